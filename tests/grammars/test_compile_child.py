"""Grammar compiles in killable child processes (grammars/compile_child.py): a compile past its time
limit is killed, so it holds no thread and no core, and the next constraint compiles at once (the
adversarial run found two such compiles locking every new constraint out for minutes). The whole
pipeline runs there (the schema's conversion and the finite check too, not only xgrammar's compile),
and what it refuses arrives as the same ConstraintError as when compiling in process."""

from __future__ import annotations

import json
import time

import psutil
import pytest

from agentrt.errors import ConstraintError
from agentrt.grammars.compile_child import CompileChildError
from agentrt.grammars.conformance import accepts
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.xgrammar_backend import GrammarBackend

# cheap to convert and check, seconds of xgrammar compile
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


def test_the_helper_stays_single_threaded_after_loading_the_pipeline(backend):
    # it forks a child per compile: a fork of a multi-threaded process can inherit a held lock
    assert psutil.Process(backend._zygote._proc.pid).num_threads() == 1


def _wide_object(num_properties: int) -> ConstraintSpec:
    """An object with `num_properties` required string properties, built without the meta-schema
    check (seconds here for this size: the server runs it before compiling)."""
    props = {f"p{i}": {"type": "string"} for i in range(num_properties)}
    schema = {"type": "object", "properties": props, "required": list(props)}
    return ConstraintSpec("json_schema", json.dumps(schema, separators=(",", ":")))


@pytest.fixture(scope="module")
def fast_limit_backend(tokenizer):
    b = GrammarBackend(
        tokenizer,
        49152,
        (2,),
        GrammarConfig(compile_in_child=True, compile_timeout_s=0.5, compile_nice=0, compile_threads=2),
    )
    b._zygote.wait_ready()
    yield b
    b.shutdown()


def test_a_conversion_past_the_limit_is_killed_and_a_small_constraint_compiles_meanwhile(fast_limit_backend):
    """28,000 required properties (~1 MB, under the 1 MiB limit): normalizing, converting and
    checking it takes many times the 0.5 s limit before xgrammar's compile would even start. That
    work used to run on the server's compile thread, past any limit; now the child doing it is
    killed at the deadline."""
    b = fast_limit_backend
    big = _wide_object(28_000)
    assert len(big.value) < b.config.max_constraint_bytes
    t0 = time.monotonic()
    slow = b.submit(big)
    small = b.submit(ConstraintSpec.regex("[a-z]{2}-[0-9]"))  # meanwhile, on the other thread
    assert accepts(b, small.result(60), "ab-1")
    with pytest.raises(ConstraintError, match="did not compile within 0.5 s"):
        slow.result(60)
    assert time.monotonic() - t0 < 10 * 0.5  # killed at the deadline, not at the end of the work
    assert _children(b) == [] and b._queue._num_stuck() == 0


def _refused(backend: GrammarBackend, spec: ConstraintSpec) -> ConstraintError:
    with pytest.raises(ConstraintError) as e:
        backend.compile(spec)
    return e.value


def _fields(e: ConstraintError) -> tuple:
    return (type(e), e.message, e.param, e.keyword, e.pointer, e.tool_index)


@pytest.fixture(scope="module")
def in_process(tokenizer):
    b = GrammarBackend(tokenizer, 49152, (2,), GrammarConfig(compile_in_child=False))
    yield b
    b.shutdown()


def _tools(second_parameters: dict) -> ConstraintSpec:
    plan = {
        "format": "hermes",
        "mode": "required",
        "parallel": False,
        "tools": [
            {
                "name": "ok",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
                "strict": None,
            },
            {"name": "bad", "parameters": second_parameters, "strict": None},
        ],
    }
    return ConstraintSpec.tool_calls(json.dumps(plan))


REFUSED = {
    "remote-ref": (
        ConstraintSpec("json_schema", '{"$ref":"https://example.com/s.json"}'),
        "$ref",
        "/$ref",
        None,
    ),
    "lookahead-pattern": (
        ConstraintSpec(
            "json_schema", '{"type":"object","properties":{"p":{"type":"string","pattern":"^(?=a)b$"}}}'
        ),
        "pattern",
        "/properties/p/pattern",
        None,
    ),
    "tool-parameters": (
        _tools({"type": "object", "properties": {"x": {"type": "string", "pattern": "^(?=a)b$"}}}),
        "pattern",
        "/properties/x/pattern",
        1,
    ),
    "no-finite-output": (ConstraintSpec.grammar('root ::= "a" root'), None, None, None),
    "bad-regex": (ConstraintSpec.regex("a(b"), None, None, None),
    "bad-lark": (ConstraintSpec.lark("start: )"), None, None, None),
    "unknown-kind": (ConstraintSpec("nonsense", "x"), None, None, None),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refusal_in_the_child_is_the_same_constraint_error_as_in_process(backend, in_process, name):
    spec, keyword, pointer, tool_index = REFUSED[name]
    there, here = _refused(backend, spec), _refused(in_process, spec)
    assert _fields(there) == _fields(here)
    assert (there.keyword, there.pointer, there.tool_index) == (keyword, pointer, tool_index)
    assert there.message.startswith(f"{spec.kind} constraint cannot be compiled: ")


def test_what_the_child_returns_besides_the_grammar_is_what_compiling_here_gives(backend, in_process):
    # best effort (strict False): a keyword it cannot enforce is dropped and reported
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "uniqueItems": True}},
        "required": ["a"],
    }
    spec = ConstraintSpec.json_schema(schema, strict=False)
    there, here = backend.compile(spec), in_process.compile(spec)
    assert there.not_enforced == here.not_enforced
    assert there.forced_bound == here.forced_bound and there.forced_bound is not None
    recursive = ConstraintSpec.grammar('root ::= "(" root ")" | "x"')
    assert backend.compile(recursive).forced_bound == in_process.compile(recursive).forced_bound


def test_a_bug_in_the_child_is_not_answered_as_a_refusal(backend, in_process):
    """An unexpected exception (here a tool plan without its tools: a KeyError, never a refusal)
    fails the compile with the child's traceback, as the same bug fails it in process."""
    spec = ConstraintSpec.tool_calls('{"format": "hermes"}')
    with pytest.raises(KeyError):
        in_process.compile(spec)
    with pytest.raises(CompileChildError, match="KeyError: 'tools'"):
        backend.compile(spec)


def _sql_spec() -> ConstraintSpec:
    from agentrt.sql.service import sql_constraint
    from agentrt.sql.sources import load_schema

    ddl = 'CREATE TABLE "my singer" (id INTEGER PRIMARY KEY, name TEXT, age INTEGER);'
    return sql_constraint(load_schema(ddl, "sqlite"), "sqlite")


KINDS = {
    "json_schema": (
        ConstraintSpec.json_schema(
            {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        ),
        ['{"n": 5}', '{"n": -12}'],
        ['{"n": "5"}', '{"m": 5}'],
    ),
    "regex": (ConstraintSpec.regex("[a-z]{3}-[0-9]{2}"), ["abc-12"], ["abc-1x", "ab-12"]),
    "lark": (ConstraintSpec.lark('start: "a"+ "b"'), ["ab", "aaab"], ["b", "aba"]),
    "choice": (ConstraintSpec.choice(["yes", "no"]), ["yes", "no"], ["ye", "maybe"]),
    "tool_calls": (
        _tools({"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}),
        ['<tool_call>\n{"name": "bad", "arguments": {"x": "hi"}}\n</tool_call>'],
        ['<tool_call>\n{"name": "bad", "arguments": {"x": 1}}\n</tool_call>'],
    ),
    "sql": (_sql_spec(), ['SELECT name FROM "my singer"'], ["DELETE FROM singer", "SELECT nom FROM singer"]),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_child_sends_the_grammar_as_text_that_compiles_to_the_same_grammar(backend, in_process, kind):
    """The child returns the grammar's EBNF (xgrammar's serialization of a compiled grammar can take
    GBs: compile_child's docstring); compiled again here it is the grammar compiled in process, for
    every constraint kind, tool calls' structural tags and a schema-aware SQL grammar included."""
    spec, good, bad = KINDS[kind]
    there, here = backend.compile(spec), in_process.compile(spec)
    assert str(there.grammar.grammar) == str(here.grammar.grammar)
    for text in good:
        assert accepts(backend, there, text) and accepts(in_process, here, text), text
    for text in bad:
        assert not accepts(backend, there, text) and not accepts(in_process, here, text), text


def test_a_compile_past_its_memory_limit_is_a_clear_refusal(tokenizer):
    """compile_memory_bytes bounds each compile child's address space (RLIMIT_AS): a constraint
    whose compile needs more (an enum of 20,000 strings: ~100 s and far more than 16 MiB unbounded)
    is refused naming the limit, and the next constraint compiles."""
    b = GrammarBackend(
        tokenizer,
        49152,
        (2,),
        GrammarConfig(
            compile_in_child=True, compile_timeout_s=60, compile_nice=0, compile_memory_bytes=16 << 20
        ),
    )
    try:
        b._zygote.wait_ready()
        big = {"enum": [f"value-{i:06d}-" + "abcdefghij" * 2 for i in range(20000)]}
        with pytest.raises(
            ConstraintError, match=r"more memory to compile than the compile limit \(16 MiB\)"
        ):
            b.compile(ConstraintSpec.json_schema(big))
        compiled = b.compile(ConstraintSpec.regex("[a-z]{3}"))
        assert accepts(b, compiled, "abc") and not accepts(b, compiled, "abcd")
        assert _children(b) == []
    finally:
        b.shutdown()
