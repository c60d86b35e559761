"""Grammar compiles in killable child processes (grammars/compile_child.py): a compile past its time
limit is killed, so it holds no thread and no core, and the next constraint compiles at once (the
adversarial run found two such compiles locking every new constraint out for minutes)."""

from __future__ import annotations

import time

import psutil
import pytest

from agentrt.errors import ConstraintError
from agentrt.grammars.conformance import accepts
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.xgrammar_backend import GrammarBackend

# cheap to parse and check here, seconds of xgrammar compile in the child
SLOW_EBNF = "root ::= " + " ".join(f'[a-z]{{1,{2000 + i}}} "{i}"' for i in range(12))


@pytest.fixture(scope="module")
def backend(tokenizer):
    b = GrammarBackend(
        tokenizer, 49152, (2,), GrammarConfig(compile_in_child=True, compile_timeout_s=2.0, compile_nice=0)
    )
    b._zygote.wait_ready()  # (its start-up, seconds, is not part of the 2 s limit under test)
    yield b
    b.shutdown()


def _children(b: GrammarBackend) -> list[psutil.Process]:
    """The zygote's compile children still alive after up to 5 s (an exiting one needs a moment)."""
    deadline = time.monotonic() + 5
    while (kids := psutil.Process(b._zygote._proc.pid).children()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return kids


def test_compiles_in_a_child_give_working_grammars(backend):
    compiled = backend.compile(ConstraintSpec.regex("[a-z]{3}-[0-9]{2}"))
    assert accepts(backend, compiled, "abc-12") and not accepts(backend, compiled, "abc-1x")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert accepts(backend, backend.compile(ConstraintSpec.json_schema(schema)), '{"n": 5}')
    assert _children(backend) == []  # each compile's child has exited


def test_a_compile_past_its_limit_is_killed_and_the_next_one_runs_at_once(backend):
    t0 = time.monotonic()
    with pytest.raises(ConstraintError, match="did not compile within 2 s"):
        backend.compile(ConstraintSpec.grammar(SLOW_EBNF))
    assert time.monotonic() - t0 < 10
    assert _children(backend) == []  # killed
    assert backend._queue._num_stuck() == 0  # no thread is left running it
    t0 = time.monotonic()
    assert backend.compile(ConstraintSpec.regex("[0-9]+")) is not None
    assert time.monotonic() - t0 < 5


def test_shutdown_stops_the_helper_process(tokenizer):
    b = GrammarBackend(tokenizer, 49152, (2,), GrammarConfig(compile_in_child=True))
    proc = psutil.Process(b._zygote._proc.pid)
    assert b.compile(ConstraintSpec.choice(["yes", "no"])) is not None
    b.shutdown()
    proc.wait(10)  # raises psutil.TimeoutExpired while it still runs
    assert not proc.is_running()
