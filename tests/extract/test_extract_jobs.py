"""`agentrt extract` and `LLM.extract_batch` on the default model: the extraction workload, bad rows,
resume after SIGKILL, confidence of forced values, and --server against `agentrt serve`."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import jsonschema
import pytest

from agentrt.commands.extract import run_extract
from agentrt.errors import ConstraintError
from agentrt.extract import ExtractInput
from agentrt.runtime.request import SamplingParams
from tests.support.paths import ROOT, shared_path

PERSON = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["person"]},
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["kind", "name", "age"],
    "additionalProperties": False,
}
UNENFORCEABLE = {  # a valid schema whose keyword the grammar cannot enforce
    "type": "object",
    "properties": {"a": {"type": "array", "items": {"type": "number"}, "uniqueItems": True}},
}
PEOPLE = [
    ("Tran Van Bao", 31),
    ("Anna Schmidt", 44),
    ("Kenji Watanabe", 27),
    ("Maria Garcia", 52),
    ("Li Wei", 38),
    ("Olu Ade", 61),
    ("Sara Cohen", 29),
    ("Ivan Petrov", 47),
]


def people_docs(n: int) -> list[dict]:
    return [
        {
            "id": f"p{i}",
            "text": f"{name} is {age} years old.",
            "gold": {"kind": "person", "name": name, "age": age},
        }
        for i, (name, age) in enumerate(PEOPLE[:n])
    ]


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    from agentrt import LLM

    return LLM(
        str(default_model_dir), device="cpu", dtype="float32", max_model_len=1024, kv_cache_bytes=64 << 20
    )


@pytest.fixture
def person_schema(tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(PERSON))
    return str(path)


def test_extract_batch_yields_every_input_and_forced_values_are_certain(llm):
    inputs = [ExtractInput(d["text"], d["id"]) for d in people_docs(3)]
    inputs.append(ExtractInput("word " * 1200, "too-long"))
    params = SamplingParams(temperature=0, max_tokens=40)
    results = list(
        llm.extract_batch(inputs, PERSON, sampling_params=params, max_in_flight=2, min_confidence=0.5)
    )
    assert sorted(r.index for r in results) == [0, 1, 2, 3]
    by_id = {r.id: r for r in results}
    assert by_id["too-long"].failure == "context_length" and "context limit" in by_id["too-long"].error
    checker = jsonschema.FormatChecker()
    for d in people_docs(3):
        r = by_id[d["id"]]
        assert r.valid, r.error
        jsonschema.validate(r.output, PERSON, format_checker=checker)
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
        if r.confidence is not None:  # the engine reports token logprobs
            assert set(r.confidence) == {"/kind", "/name", "/age"}
            assert r.confidence["/kind"] == 1.0  # a one-option enum is forced by the grammar
            assert all(0.0 < p <= 1.0 for p in r.confidence.values())
            assert r.needs_review == any(p < 0.5 for p in r.confidence.values())
    assert not llm.engine.has_work()


def test_extract_batch_raises_before_running_and_aborts_on_close(llm):
    with pytest.raises(ConstraintError, match="'uniqueItems' at /properties/a/uniqueItems"):
        llm.extract_batch(["x"], UNENFORCEABLE)
    it = llm.extract_batch([d["text"] for d in people_docs(4)], PERSON, max_in_flight=4)
    first = next(it)
    assert first.valid
    it.close()  # the other three are aborted: their KV and grammar state freed
    assert not llm.engine.has_work()


def test_bad_rows_are_error_rows_and_the_rest_valid(llm, tmp_path, person_schema, capsys):
    rows = [
        *people_docs(2),
        "{not json",
        {"id": "no-text", "body": "x"},
        {"id": "long", "text": "word " * 1200},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    args = [
        "--input",
        src,
        "--output",
        str(out),
        "--schema",
        person_schema,
        "--max-tokens",
        "40",
        "--no-progress",
    ]
    assert run_extract(args, llm=llm) == 1
    got = {r["id"]: r for r in read_rows(out)}
    assert set(got) == {"p0", "p1", "#3", "no-text", "long"}
    assert got["p0"]["valid"] and got["p1"]["valid"]
    assert "row 3 is not JSON" in got["#3"]["error"] and got["#3"]["output"] is None
    assert got["no-text"]["error"] == "row 4 has no text field 'text'"
    assert "does not fit the context" in got["long"]["error"] and not got["long"]["valid"]
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["failed_by_reason"] == {"context_length": 1, "input": 2}
    # rerun: nothing left to do, the earlier failures still count; --allow-failures makes it 0
    assert run_extract(args, llm=llm) == 1
    assert run_extract([*args, "--allow-failures"], llm=llm) == 0
    assert len(read_rows(out)) == 5


def test_short_budget_rows_are_closed_validly_and_say_so(llm, tmp_path, person_schema):
    """The job's default length-safe policy: with too few tokens for the model's own output the rows
    are closed on the shortest valid completion, valid, and marked closed_by_budget (counted in the
    summary); `--max-tokens-policy length` cuts them instead (invalid rows, reason length)."""
    src = write_jsonl(tmp_path / "in.jsonl", people_docs(2))
    base = ["--input", src, "--schema", person_schema, "--max-tokens", "18", "--no-progress"]
    base += ["--min-confidence", "0.01"]  # a closed row needs review whatever its confidence
    base += ["--allow-failures"]  # closing from the start needs 17 tokens; the model writes ~20
    closed, cut = tmp_path / "closed.jsonl", tmp_path / "cut.jsonl"
    assert run_extract([*base, "--output", str(closed)], llm=llm) == 0
    rows = read_rows(closed)
    assert all(r["valid"] and r["closed_by_budget"] and r["finish_reason"] == "stop" for r in rows), rows
    assert all(r["needs_review"] for r in rows)
    for r in rows:
        jsonschema.validate(r["output"], PERSON)
    summary = json.loads((tmp_path / "closed.jsonl.summary.json").read_text())
    assert summary["closed_by_budget_rows"] == 2
    assert run_extract([*base, "--output", str(cut), "--max-tokens-policy", "length"], llm=llm) == 0
    rows = read_rows(cut)
    assert all(not r["valid"] and r["finish_reason"] == "length" and not r["closed_by_budget"] for r in rows)


def test_schema_the_closer_cannot_close_runs_under_the_length_policy(llm, tmp_path, caplog):
    """A long minLength makes the closing-path planner give up in free text: under the job's
    default close policy its rows run as with `--max-tokens-policy length` (one warning) instead of
    every row failing with the policy's error."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 200}}, "required": ["s"]}
    path = tmp_path / "long.json"
    path.write_text(json.dumps(schema))
    src = write_jsonl(tmp_path / "in.jsonl", people_docs(2))
    out = tmp_path / "out.jsonl"
    args = ["--input", src, "--output", str(out), "--schema", str(path), "--max-tokens", "40"]
    with caplog.at_level("WARNING", logger="agentrt.extract.batch"):
        run_extract([*args, "--no-progress", "--allow-failures"], llm=llm)
    rows = read_rows(out)
    assert len(rows) == 2
    assert all("max_tokens_policy" not in (r["error"] or "") for r in rows), rows
    assert all(r["finish_reason"] == "length" and not r["closed_by_budget"] for r in rows)  # 40 < 200 chars
    assert sum("cannot close this schema" in m for m in caplog.messages) == 1


def test_unenforceable_schema_stops_before_start(llm, tmp_path, capsys):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(UNENFORCEABLE))
    out = tmp_path / "out.jsonl"
    src = write_jsonl(tmp_path / "in.jsonl", people_docs(1))
    assert run_extract(["--input", src, "--output", str(out), "--schema", str(schema)], llm=llm) == 2
    assert "'uniqueItems' at /properties/a/uniqueItems" in capsys.readouterr().err
    assert out.read_text() == ""


@pytest.mark.slow  # ~100 s on 2 busy CPU cores
def test_extraction_workload_subset(llm, tmp_path):
    data = shared_path("extraction")
    docs = [json.loads(line) for line in (data / "docs.jsonl").read_text().splitlines()]
    subset = [d for d in docs if d["schema_name"] != "invoice"][:4] + [
        d for d in docs if d["schema_name"] == "invoice"
    ][:1]
    src = write_jsonl(tmp_path / "docs.jsonl", subset)
    out = tmp_path / "out.jsonl"
    rc = run_extract(
        [
            "--input", src, "--output", str(out), "--schema-field", "schema_name", "--schemas",
            str(data / "schemas"), "--gold-field", "gold", "--max-tokens", "160", "--no-progress",
        ],
        llm=llm,
    )  # fmt: skip
    rows = read_rows(out)
    assert rc == (0 if all(r["valid"] for r in rows) else 1)
    assert sorted(r["id"] for r in rows) == sorted(d["id"] for d in subset)
    schemas = {p.stem: json.loads(p.read_text()) for p in (data / "schemas").glob("*.json")}
    name = {d["id"]: d["schema_name"] for d in subset}
    checker = jsonschema.FormatChecker()
    valid = [r for r in rows if r["valid"]]
    assert valid, rows
    for r in valid:
        jsonschema.validate(r["output"], schemas[name[r["id"]]], format_checker=checker)
    for r in rows:
        if not r["valid"]:
            assert r["error"] and r["finish_reason"] == "length", r
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["rows"] == len(subset) and summary["valid"] == len(valid)
    assert (
        0.0 <= summary["field_accuracy"]["overall"] <= 1.0
        and "/customer" in summary["field_accuracy"]["per_field"]
    )
    assert summary["prefix_cache_hit_share"] > 0  # documents of a schema share its system prompt


def test_server_mode_matches_in_process(llm, server, tmp_path, person_schema):
    src = write_jsonl(tmp_path / "in.jsonl", people_docs(3))
    common = ["--input", src, "--schema", person_schema, "--max-tokens", "40", "--no-progress"]
    assert run_extract([*common, "--output", str(tmp_path / "local.jsonl")], llm=llm) == 0
    remote = tmp_path / "remote.jsonl"
    assert run_extract([*common, "--output", str(remote), "--server", server, "--max-in-flight", "2"]) == 0
    local = {r["id"]: r for r in read_rows(tmp_path / "local.jsonl")}
    remote_rows = {r["id"]: r for r in read_rows(remote)}
    assert set(local) == set(remote_rows) == {"p0", "p1", "p2"}
    for rid, r in local.items():
        s = remote_rows[rid]
        assert (s["output"], s["valid"], s["finish_reason"]) == (r["output"], r["valid"], r["finish_reason"])
        assert s["usage"]["completion_tokens"] == r["usage"]["completion_tokens"]


def wait_rows(path, k: int, proc, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= k:
            return
        if proc.poll() is not None:
            return
        time.sleep(0.05)
    raise AssertionError(f"{k} rows did not appear in {timeout_s} s")


@pytest.mark.slow  # ~70 s: four CLI processes against the shared server
def test_sigkill_at_random_rows_then_rerun_gives_one_row_per_id(server, tmp_path, person_schema):
    docs = people_docs(8)
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "agentrt.cli", "extract", "--input", src, "--output", str(out),
           "--schema", person_schema, "--max-tokens", "40", "--server", server, "--max-in-flight", "2",
           "--no-progress"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    done = 0
    for ks in range(3):  # kill after k more rows, three times (k random, each run resumes the last)
        k = done + rng.randint(1, 2)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_rows(out, k, proc)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        done = len(read_rows_lenient(out))
    with out.open("ab") as f:  # a torn last line, as a kill during a write leaves it
        f.write(b'{"id": "p7", "output": {"kind": "per')
    res = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (seed, res.stdout, res.stderr)
    ids = [r["id"] for r in read_rows(out)]
    assert sorted(ids) == sorted(d["id"] for d in docs), (seed, ids)
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["torn_bytes_repaired"] > 0


def read_rows_lenient(path) -> list[dict]:
    """Complete rows of a file a SIGKILL may have left torn."""
    rows = []
    for line in path.read_bytes().split(b"\n")[:-1] if path.exists() else []:
        rows.append(json.loads(line))
    return rows
