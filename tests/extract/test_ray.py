"""`agentrt extract --ray` on a local Ray cluster started by the test (2 CPUs, 2 engine actors, the
default model): the same rows as the in-process job at temperature 0, one row per id, and resume
(deleted rows and a torn last line) runs only the missing ids. GPU actors (num_gpus=1) are not
tested here: this machine has no GPU."""

from __future__ import annotations

import json
import sys

import pytest

from agentrt.commands.extract import run_extract
from agentrt.extract.ray_job import RAY_INSTALL_HINT, blocks, decode_result, encode_result
from agentrt.extract.types import ExtractResult, Usage
from tests.extract.test_extract_jobs import PERSON, people_docs, read_rows, write_jsonl
from tests.support.ray_cluster import start_local_ray


@pytest.fixture(scope="module")
def ray_cluster():
    ray = start_local_ray("ray.data")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def llm(default_model_dir):
    from agentrt import LLM

    return LLM(
        str(default_model_dir), device="cpu", dtype="float32", max_model_len=1024, kv_cache_bytes=64 << 20
    )


def same_row(got: dict, want: dict) -> None:
    """Token-identical outputs (greedy); confidence to float32 rounding, since logprobs of one token
    differ in the last bits with the batch it ran in (the prefix cache and batch composition)."""
    keys = ("id", "output", "valid", "error", "finish_reason", "needs_review")
    assert {k: got.get(k) for k in keys} == {k: want.get(k) for k in keys}, (got, want)
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
    assert got["confidence"] == pytest.approx(want["confidence"], rel=1e-4, abs=1e-6)


def engine_flags(model_dir) -> list[str]:
    """The engine of the `llm` fixture, as flags (each actor builds its own)."""
    return [str(model_dir), "--device", "cpu", "--dtype", "float32", "--max-model-len", "1024",
            "--kv-cache-bytes", str(64 << 20)]  # fmt: skip


def test_without_ray_the_flag_exits_2_saying_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    src = write_jsonl(tmp_path / "in.jsonl", people_docs(1))
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(PERSON))
    out = tmp_path / "out.jsonl"
    argv = ["--input", src, "--output", str(out), "--schema", str(schema), "--ray", "--num-workers", "2"]
    assert run_extract(argv) == 2
    assert RAY_INSTALL_HINT in capsys.readouterr().err
    assert not out.exists()


def test_ray_flags_need_ray(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", people_docs(1))
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(PERSON))
    argv = [
        "--input",
        src,
        "--output",
        str(tmp_path / "o.jsonl"),
        "--schema",
        str(schema),
        "--num-workers",
        "2",
    ]
    assert run_extract(argv) == 2
    assert "need --ray" in capsys.readouterr().err


def test_blocks_stream_full_blocks_and_split_a_small_job_over_the_workers():
    assert [len(b) for b in blocks(map(str, range(5)), 8, 2)] == [3, 2]
    assert [len(b) for b in blocks(map(str, range(20)), 4, 2)] == [4, 4, 4, 4, 4]
    assert [len(b) for b in blocks(map(str, range(9)), 4, 2)] == [4, 4, 1]
    assert list(blocks([], 4, 2)) == []
    got = [i for b in blocks(map(str, range(9)), 4, 2) for i, _ in b]
    assert got == list(range(9))  # every row once, with its position in the job
    with pytest.raises(ValueError, match="must be >= 1"):
        list(blocks(["a"], 0, 1))


def test_results_cross_the_pipeline_unchanged():
    r = ExtractResult(
        3, 5.0, {"a": [1, "x"]}, True, finish_reason="stop", usage=Usage(10, 4, 2),
        confidence={"/a/0": 0.25}, needs_review=False, text='{"a": [1, "x"]}', gold={"a": [1]},
    )  # fmt: skip
    assert decode_result(encode_result(r)) == r


@pytest.mark.slow  # ~210 s on 2 busy cores: Ray start, 2 x 2 actors loading the model, the in-process job
def test_two_actors_match_in_process_and_resume_runs_only_missing_ids(
    ray_cluster, llm, default_model_dir, tmp_path
):
    docs = people_docs(4)
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    common = ["--input", src, "--schema", str(schema), "--max-tokens", "40", "--no-progress"]
    assert run_extract([*common, "--output", str(tmp_path / "local.jsonl")], llm=llm) == 0
    out = tmp_path / "ray.jsonl"
    ray_argv = [
        *common,
        "--output",
        str(out),
        *engine_flags(default_model_dir),
        "--ray",
        "--num-workers",
        "2",
    ]
    assert run_extract(ray_argv) == 0
    local = {r["id"]: r for r in read_rows(tmp_path / "local.jsonl")}
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == sorted(d["id"] for d in docs)  # one row per id
    for r in rows:
        same_row(r, local[r["id"]])
    summary = json.loads((tmp_path / "ray.jsonl.summary.json").read_text())
    assert summary["rows"] == 4 and summary["valid"] == 4

    # resume: two rows deleted and a torn last line; only those ids run again
    kept = out.read_text().splitlines(keepends=True)[:2]
    out.write_text("".join(kept) + '{"id": "p9", "output": {"kind": "per')
    assert run_extract(ray_argv) == 0
    rows = read_rows(out)
    assert sorted(r["id"] for r in rows) == sorted(d["id"] for d in docs)
    assert rows[:2] == [json.loads(line) for line in kept]  # the kept rows untouched
    summary = json.loads((tmp_path / "ray.jsonl.summary.json").read_text())
    assert summary["rows"] == 2 and summary["skipped_already_done"] == 2
    assert summary["torn_bytes_repaired"] > 0
    for r in rows[2:]:
        same_row(r, local[r["id"]])
