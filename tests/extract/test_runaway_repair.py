"""Runaway-value repair on the default model (agentrt/runtime/repetition.py): ticket-11-001 of the
extraction workload loops in its order_id value ("2023-01-01T12:30:00Z-2023-01-01T12:30:00Z-...")
until max_tokens under greedy decoding. With repair the value is closed under the grammar and the
row is valid JSON for the schema; without it the output runs to max_tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest

from agentrt.commands.extract import run_extract
from agentrt.extract.prompt import prompt_messages
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.request import SamplingParams
from tests.support.paths import shared_path

DOC_ID = "ticket-11-001"
MAX_TOKENS = 160  # measured: the loop starts near token 60 and repair closes it at token 118


def _doc() -> tuple[dict, dict]:
    data = shared_path("extraction")
    doc = next(
        d for d in map(json.loads, (data / "docs.jsonl").read_text().splitlines()) if d["id"] == DOC_ID
    )
    return doc, json.loads((data / "schemas" / f"{doc['schema_name']}.json").read_text())


@pytest.fixture(scope="module")
def llm(engine):
    from agentrt import LLM

    return LLM.from_engine(engine)


def test_runaway_value_is_closed_with_repair_and_runs_to_length_without(llm):
    doc, schema = _doc()
    ids = llm._chat_ids(prompt_messages(doc["text"], schema))
    spec = ConstraintSpec.json_schema(schema, strict=True)
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_repair=on, logprobs=0)
        for on in (True, False)
    ]
    on, off = llm.engine.generate([(ids, p, spec) for p in params])
    assert off.finish_reason == "length" and off.repaired == []
    assert on.finish_reason == "stop", on.text
    assert on.repaired == ["/order_id"]
    obj = json.loads(on.text)
    jsonschema.validate(obj, schema, format_checker=jsonschema.FormatChecker())
    # the text before the repair is the unrepaired output's: repair only ends the value
    value_end = on.text.index(obj["order_id"]) + len(obj["order_id"])
    assert off.text.startswith(on.text[:value_end])
    assert len(obj["order_id"]) >= 3 * len("2023-01-01T12:30:00Z-")
    # the closing quote was forced, not sampled
    k = len(llm.tokenizer(on.text[: value_end + 1], add_special_tokens=False)["input_ids"]) - 1
    assert on.token_ids[k] == llm.tokenizer.encode('"', add_special_tokens=False)[0]
    assert on.logprobs[k].logprob == 0.0


@pytest.mark.slow  # ~50 s: the engine-level test above covers the repair in the default suite
def test_extract_job_repairs_by_default_and_reports_the_field(llm, tmp_path):
    doc, schema = _doc()
    (tmp_path / "docs.jsonl").write_text(json.dumps({"id": doc["id"], "text": doc["text"]}) + "\n")
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    argv = [
        "--input", str(tmp_path / "docs.jsonl"), "--schema", str(tmp_path / "schema.json"),
        "--max-tokens", str(MAX_TOKENS), "--no-progress",
    ]  # fmt: skip
    assert run_extract([*argv, "--output", str(tmp_path / "on.jsonl")], llm=llm) == 0
    row = json.loads((tmp_path / "on.jsonl").read_text())
    assert row["valid"] is True and row["finish_reason"] == "stop"
    assert row["repaired"] == ["/order_id"]
    jsonschema.validate(row["output"], schema, format_checker=jsonschema.FormatChecker())
