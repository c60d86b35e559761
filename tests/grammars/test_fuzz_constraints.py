"""Constraint fuzzing, model-free: hypothesis-generated JSON Schemas, regexes, EBNF and Lark texts and
choice lists go through the compile path the engine uses (`ConstraintSpec.<kind>` as the API builds
it, then `GrammarBackend.submit`), and a bounded subset through a short generation on the fake runner.

Each input gets a compiled constraint or a typed 400 (an InvalidRequestError: ConstraintError,
ContextLengthError) within the compile timeout: never another exception (a 500), never a hang.
A generation over a compiled constraint finishes without an internal error, and an output that
finished with "stop" satisfies its regex / JSON Schema.

The whole module runs under `memory_cap` (a runaway allocation fails the test instead of the
machine), every case under a wall-clock guard, and the hypothesis budgets are fixed and derandomized.
Known failures are strict xfails whose reason gives the reproducer: they flip when fixed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import threading
import time

import jsonschema
import pytest
import regex as re_mod
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrt.errors import InvalidRequestError, ServiceUnavailableError
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.grammars.xgrammar_backend import CompiledConstraint
from agentrt.runtime.config import EngineConfig
from agentrt.runtime.request import SamplingParams
from agentrt.testing import fake_engine
from tests.support.fuzz import (
    choices,
    deep_schema,
    ebnf_grammars,
    json_schemas,
    lark_grammars,
    memory_cap,
    regexes,
)

COMPILE_TIMEOUT_S = 5.0
"""The fuzz engine's compile limit (seconds): a compile past it must come back as a 400."""
GUARD_S = 5 * COMPILE_TIMEOUT_S + 15.0 + 25.0
"""Wall-clock guard of one case (compile, or compile + a short generation), its 503 retries included
(STARVED_RETRIES below: 5 compiles and 15 s of waiting at most): past it, a hang."""
MAX_TOKENS = 12
PROMPT = list(b"Answer:")

FUZZ = settings(
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module", autouse=True)
def capped():
    with memory_cap(3 << 30):
        yield


@pytest.fixture(scope="module")
def engine():
    e = fake_engine(
        EngineConfig(grammar=GrammarConfig(compile_timeout_s=COMPILE_TIMEOUT_S)), max_model_len=128
    )
    yield e
    e.grammar.shutdown()


@contextlib.contextmanager
def guard(seconds: float, what: str):
    """Raise TimeoutError in the test (main thread) when the block runs past `seconds`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError(f"{what} ran past {seconds:g} s: a hang?")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def build_spec(kind: str, value) -> ConstraintSpec:
    """The spec as the API builds it from a request field. Raises ConstraintError."""
    return getattr(ConstraintSpec, kind)(value)


STARVED_RETRIES = 4
"""A 503 (the compile got too little CPU within its limit, or earlier compiles past their limit still
hold the compile threads: a busy test machine) is retried after 1, 2, 4, 8 s, as the error tells a
client to ("try again later"); the 503 is not cached, so the retry compiles again."""


def compile_outcome(engine, kind: str, value) -> CompiledConstraint | InvalidRequestError:
    """The compiled constraint, or the typed 400 the request gets (a 503 is retried STARVED_RETRIES
    times, then propagates). Any other exception propagates (the test fails: the server would answer
    500); no result within GUARD_S fails as a hang."""
    try:
        spec = build_spec(kind, value)
    except InvalidRequestError as e:
        return e
    for attempt in range(STARVED_RETRIES + 1):
        fut = engine.grammar.submit(spec)
        try:
            return fut.result(timeout=GUARD_S)
        except InvalidRequestError as e:
            return e
        except ServiceUnavailableError:  # starved of CPU on a loaded machine: a client retries a 503
            if attempt == STARVED_RETRIES:
                raise
            time.sleep(2**attempt)
        except concurrent.futures.TimeoutError:
            pytest.fail(
                f"{kind} constraint got no result within {GUARD_S:g} s (limit {COMPILE_TIMEOUT_S:g} s)"
            )


def check_compile(engine, kind: str, value) -> CompiledConstraint | InvalidRequestError:
    with guard(GUARD_S, f"compiling a {kind} constraint"):
        out = compile_outcome(engine, kind, value)
    assert isinstance(out, (CompiledConstraint, InvalidRequestError)), out
    if isinstance(out, InvalidRequestError):
        msg = out.message.strip()
        assert msg and not msg.endswith(":"), f"a 400 without a reason for {kind} {value!r}: {msg!r}"
        assert "recursion depth" not in msg, msg  # Python's words, not the problem's
    return out


def check_generation(engine, kind: str, value, temperature: float = 0.0, seed: int = 0) -> None:
    """Compile, then (when it compiled) generate MAX_TOKENS tokens: no internal error; a "stop"
    output satisfies the constraint."""
    with guard(GUARD_S, f"generating under a {kind} constraint"):
        compiled = compile_outcome(engine, kind, value)
        if not isinstance(compiled, CompiledConstraint):
            return
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed)
        (out,) = engine.generate([(PROMPT, params, build_spec(kind, value))])
    assert out.finished
    if out.finish_reason == "error":
        assert isinstance(out.error, InvalidRequestError), f"{kind} {value!r}: {out.error!r}"
        return
    if out.finish_reason != "stop":
        return
    if kind == "regex":
        assert re_mod.fullmatch(value, out.text), f"output {out.text!r} does not match {value!r}"
    elif kind == "json_schema":
        jsonschema.validate(json.loads(out.text), value)
    elif kind == "choice":
        assert out.text in value


# ---- compile path: unbounded inputs -------------------------------------------------------------------
@settings(FUZZ, max_examples=100)
@given(schema=json_schemas())
def test_json_schemas_compile_or_400(engine, schema):
    check_compile(engine, "json_schema", schema)


@settings(FUZZ, max_examples=100)
@given(pattern=regexes())
def test_regexes_compile_or_400(engine, pattern):
    check_compile(engine, "regex", pattern)


@settings(FUZZ, max_examples=80)
@given(text=ebnf_grammars())
def test_ebnf_grammars_compile_or_400(engine, text):
    check_compile(engine, "grammar", text)


@settings(FUZZ, max_examples=40)
@given(text=lark_grammars())
def test_lark_grammars_compile_or_400(engine, text):
    check_compile(engine, "lark", text)


@settings(FUZZ, max_examples=20)
@given(values=choices())
def test_choices_compile_or_400(engine, values):
    check_compile(engine, "choice", values)


EDGE_CASES = {
    "ebnf-count-2e9": ("grammar", 'root ::= "a"{2000000000,2147483647}'),
    "ebnf-count-1e20": ("grammar", 'root ::= "a"{99999999999999999999}'),
    "ebnf-nest-5000": ("grammar", "root ::= " + "(" * 5000 + '"a"' + ")" * 5000),
    "ebnf-surrogate-escape": ("grammar", 'root ::= "\\ud800"'),
    "ebnf-left-recursion": ("grammar", "root ::= r1\nr1 ::= root"),
    "regex-count-1e9": ("regex", "a{1000000000}"),
    "regex-count-2e32": ("regex", "a{4294967296}"),
    "regex-nested-counts": ("regex", "(a{1000}){1000}"),
    "regex-nested-plus": ("regex", "((a+)+)+b"),
    "regex-surrogate-escape": ("regex", "\\ud800"),
    "regex-nest-3000": ("regex", "(" * 3000 + "a" + ")" * 3000),
    "regex-nest-5000": ("regex", "(" * 5000 + "a" + ")" * 5000),
    "lark-count-2e9": ("lark", 'start: "a" ~ 2000000000'),
    "lark-regex-count-1e9": ("lark", "start: /a{1000000000}/"),
    "lark-repeat-of-alternation": ("lark", 'start: ("b" ~ 5 | "c" ~ 5 | "d") ~ 6..12'),
    "lark-groups-2^40": ("lark", "start: " + '("a" | "b") ' * 40),
    "lark-optionals-2^40": ("lark", "start: " + '"a"? ' * 40),
    "schema-minItems-1e9": ("json_schema", {"type": "array", "minItems": 1000000000}),
    "schema-minLength-1e9": ("json_schema", {"type": "string", "minLength": 1000000000}),
    "schema-pattern-count-1e9": ("json_schema", {"type": "string", "pattern": "a{1000000000}"}),
    "schema-forced-1e6-items": (
        "json_schema",
        {"type": "array", "items": {"const": "a"}, "minItems": 10**6, "maxItems": 10**6},
    ),
    "schema-arrays-100-deep": ("json_schema", deep_schema(100)),
    "schema-objects-100-deep": ("json_schema", deep_schema(100, "object")),
    "schema-arrays-5000-deep": ("json_schema", deep_schema(5000)),
    "schema-enum-100k-chars": ("json_schema", {"enum": ["x" * 100_000]}),
    "schema-enum-int-1e400": ("json_schema", {"enum": [10**400]}),
    "choice-200k-chars": ("choice", ["a" * 200_000]),
}


@pytest.mark.parametrize("case", EDGE_CASES)
def test_edge_cases_compile_or_400(engine, case):
    check_compile(engine, *EDGE_CASES[case])


@pytest.mark.parametrize(
    "kind,value",
    [
        ("regex", "\ud800"),
        ("choice", ["\udfff"]),
        ("grammar", 'root ::= "\ud800"'),
        ("lark", 'start: "\ud800"'),
        ("json_schema", {"enum": ["\ud800"]}),
    ],
    ids=["regex", "choice", "grammar", "lark", "json_schema"],
)
def test_lone_surrogate_is_a_400(engine, kind, value):
    check_compile(engine, kind, value)


any_constraint = st.one_of(
    st.tuples(st.just("json_schema"), json_schemas()),
    st.tuples(st.just("regex"), regexes()),
    st.tuples(st.just("grammar"), ebnf_grammars()),
    st.tuples(st.just("lark"), lark_grammars()),
    st.tuples(st.just("choice"), choices()),
)


@pytest.mark.slow
@settings(FUZZ, max_examples=2000)
@given(kc=any_constraint)
def test_constraints_compile_or_400_large_budget(engine, kc):
    check_compile(engine, *kc)


# ---- generation over bounded constraints ---------------------------------------------------------------
bounded_constraints = st.one_of(
    st.tuples(st.just("json_schema"), json_schemas(bounded=True, max_leaves=6)),
    st.tuples(st.just("regex"), regexes(bounded=True)),
    st.tuples(st.just("grammar"), ebnf_grammars(bounded=True)),
    st.tuples(st.just("lark"), lark_grammars(bounded=True)),
    st.tuples(st.just("choice"), choices()),
)


@settings(FUZZ, max_examples=80)
@given(kc=bounded_constraints, temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 3))
def test_generation_under_fuzzed_constraints(engine, kc, temperature, seed):
    check_generation(engine, kc[0], kc[1], temperature, seed)


FORCED_RUNS = {
    "regex-1e5": ("regex", "a{100000}"),
    "regex-pairs-2e4": ("regex", "(ab){20000}c"),
    "ebnf-2e9": ("grammar", 'root ::= "a"{2000000000,2147483647}'),
    "regex-1e9": ("regex", "a{1000000000}"),
    "lark-2e9": ("lark", 'start: "a" ~ 2000000000'),
    "schema-1e6-items": (
        "json_schema",
        {"type": "array", "items": {"const": "a"}, "minItems": 10**6, "maxItems": 10**6},
    ),
}


@pytest.mark.parametrize("case", FORCED_RUNS)
def test_forced_text_is_bounded_by_max_tokens(case):
    """A constraint that forces a long run (up to 2e9 characters, issue 17: jump-forward used to
    materialise all of it: > 2 GB, the OOM killer) gives MAX_TOKENS tokens and finish_reason
    "length". Its own engine under a lower memory cap, so a regression costs ~1.5 GB for seconds."""
    kind, value = FORCED_RUNS[case]
    engine = fake_engine(EngineConfig(grammar=GrammarConfig(compile_timeout_s=COMPILE_TIMEOUT_S)))
    try:
        with memory_cap(3 << 29), guard(GUARD_S, "a long forced run"):
            compiled = compile_outcome(engine, kind, value)
            assert isinstance(compiled, CompiledConstraint), compiled
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
            (out,) = engine.generate([(PROMPT, params, build_spec(kind, value))])
    finally:
        engine.grammar.shutdown()
    assert out.error is None, repr(out.error)
    assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS


# Run in a child process that is killed at the end: each of these compiles used to hold a compile thread
# at 100% CPU for minutes after its request got its timeout 400 (lark expanded the repeat into every
# combination; grammars/lark_grammar.py now writes it as an EBNF repeat).
_LARK_BLOWUP = r"""
import json, sys
from agentrt.grammars.spec import ConstraintSpec, GrammarConfig
from agentrt.runtime.config import EngineConfig
from agentrt.testing import fake_engine
engine = fake_engine(EngineConfig(grammar=GrammarConfig(compile_timeout_s=3.0)))
texts = ['start: "a"\nitem: ("%s" ~ 5 | "c" ~ 5 | "d") ~ 6..12\n' % x for x in "bxyz"]
futs = [engine.grammar.submit(ConstraintSpec.lark(t)) for t in texts]
for f in futs:
    try:
        f.result(timeout=60)
    except Exception as e:
        print(type(e).__name__, str(e)[:200], flush=True)
try:
    engine.grammar.submit(ConstraintSpec.regex("[a-z]+")).result(timeout=60)
    print("AFTER ok", flush=True)
except Exception as e:
    print("AFTER", type(e).__name__, str(e)[:200], flush=True)
"""


def test_lark_repeat_blowup_does_not_hold_compile_threads():
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _LARK_BLOWUP], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "AFTER ok" in out, out[-2000:]
