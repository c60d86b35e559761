"""Extraction job plumbing without a model: input rows, the resumable output, prompts, the summary,
and the CLI's argument errors (exit 2 before anything runs)."""

from __future__ import annotations

import json
import os

import pytest

from agentrt.commands.extract import run_extract
from agentrt.extract.prompt import PromptTemplate, extraction_messages
from agentrt.extract.reader import InputReader
from agentrt.extract.summary import JobSummary, gold_leaves
from agentrt.extract.types import ExtractResult
from agentrt.extract.writer import OutputWriter

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_rows_errors_missing_and_duplicate_ids(tmp_path, capsys):
    src = write_lines(
        tmp_path / "in.jsonl",
        [
            json.dumps({"id": "a", "text": "A", "gold": {"name": "A"}}),
            "not json",
            json.dumps({"text": "no id"}),
            json.dumps({"id": "c", "body": "no text"}),
            json.dumps({"id": "a", "text": "again"}),
            "",
            json.dumps([1, 2]),
            json.dumps({"id": {"x": 1}, "text": "bad id"}),
            json.dumps({"id": 7, "text": 5}),
        ],
    )
    reader = InputReader(src, gold_field="gold")
    rows = list(reader)
    assert reader.count() == 8
    by_id = {r.id: r for r in rows}
    assert by_id["a"].text == "A" and by_id["a"].gold == {"name": "A"} and by_id["a"].error is None
    assert "row 2 is not JSON" in by_id["#2"].error
    assert by_id["#3"].text == "no id" and by_id["#3"].error is None  # no id: its row number
    assert by_id["c"].error == "row 4 has no text field 'text'"
    assert "not an object" in by_id["#6"].error
    assert "must be a string or a number" in by_id["#7"].error
    assert "text field 'text' must be a string" in by_id[7].error
    assert reader.num_duplicates == 1 and [r.id for r in rows].count("a") == 1
    assert "id 'a' was already seen" in capsys.readouterr().err


def test_csv_rows_and_parquet_message(tmp_path):
    src = tmp_path / "in.csv"
    src.write_text('doc_id,body,gold\n1,"Line one\nline two","{""name"": ""X""}"\n2,second,\n')
    reader = InputReader(src, id_field="doc_id", text_field="body", gold_field="gold")
    rows = list(reader)
    assert reader.count() == 2
    assert [(r.id, r.text) for r in rows] == [("1", "Line one\nline two"), ("2", "second")]
    assert rows[0].gold == {"name": "X"}
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        with pytest.raises(ValueError, match="pip install pyarrow"):
            InputReader(tmp_path / "in.parquet")
    else:  # (pyarrow comes with the ray extra)
        pq.write_table(pa.table({"doc_id": ["a", "b"], "body": ["first", "second"]}), tmp_path / "in.parquet")
        reader = InputReader(tmp_path / "in.parquet", id_field="doc_id", text_field="body")
        assert [(r.id, r.text) for r in reader] == [("a", "first"), ("b", "second")]
    with pytest.raises(ValueError, match="cannot tell the format"):
        InputReader(tmp_path / "in.txt")


def row(rid, valid=True):
    return ExtractResult(0, rid, output={"name": "x"}, valid=valid, finish_reason="stop").row()


def test_output_resume_repairs_a_torn_last_line(tmp_path):
    out = tmp_path / "out.jsonl"
    w = OutputWriter.open(out)
    for rid in ("a", "b", 3):
        w.write(row(rid, valid=rid != "b"))
    w.close()
    whole = out.read_bytes()
    out.write_bytes(whole + json.dumps(row("d"))[:25].encode())  # half a row, as a SIGKILL leaves it
    w = OutputWriter.open(out)
    assert w.num_existing == 3 and w.num_existing_invalid == 1 and w.num_repaired_bytes == 25
    assert w.is_done("a") and w.is_done(3) and w.is_done(3.0) and not w.is_done("3") and not w.is_done("d")
    w.write(row("d"))
    w.close()
    lines = out.read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["a", "b", 3, "d"]
    # a complete last line that is not JSON is torn too; a bad line before the end is not ours
    out.write_bytes(out.read_bytes() + b"{garbage\n")
    w = OutputWriter.open(out)
    assert w.num_existing == 4 and w.num_repaired_bytes == len(b"{garbage\n")
    w.close()
    out.write_bytes(b"{garbage\n" + out.read_bytes())
    with pytest.raises(ValueError, match="not an output row"):
        OutputWriter.open(out)


def test_output_fails_at_once_when_unwritable(tmp_path):
    with pytest.raises(OSError):
        OutputWriter.open(tmp_path / "missing-dir" / "out.jsonl")
    if os.geteuid() != 0:
        locked = tmp_path / "locked.jsonl"
        locked.write_text("")
        locked.chmod(0o444)
        with pytest.raises(PermissionError):
            OutputWriter.open(locked)


def test_prompt_templates():
    assert extraction_messages("doc", SCHEMA)[1] == {"role": "user", "content": "doc"}
    t = PromptTemplate.parse('Schema: {schema}\nExample: {"a": 1}\n---\nDocument:\n{text}\n')
    msgs = t.messages("The {schema} doc", SCHEMA)
    assert msgs[0] == {"role": "system", "content": f'Schema: {json.dumps(SCHEMA)}\nExample: {{"a": 1}}'}
    assert msgs[1] == {"role": "user", "content": "Document:\nThe {schema} doc"}
    assert PromptTemplate.parse("Extract from {text}").messages("x", SCHEMA) == [
        {"role": "user", "content": "Extract from x"}
    ]
    with pytest.raises(ValueError, match="no {text} placeholder"):
        PromptTemplate.parse("{schema} only")


def test_summary_field_accuracy_and_failures():
    s = JobSummary()
    gold = {"name": "A", "tags": ["x", "y"], "n": 1, "ok": True, "none": None}
    assert set(gold_leaves(gold)) == {"/name", "/tags/0", "/tags/1", "/n", "/ok", "/none"}
    good = {"name": "A", "tags": ["x", "z"], "n": 1.0, "ok": 1, "none": None}
    s.add(ExtractResult(0, "a", output=good, valid=True, gold=gold, repaired=["/tags"]))
    s.add(ExtractResult(1, "b", failure="length", gold=gold))
    s.add(ExtractResult(2, "c", failure="input"))
    d = s.as_dict(2.0)
    assert (d["rows"], d["valid"], d["failed_by_reason"]) == (3, 1, {"input": 1, "length": 1})
    assert d["repaired_rows"] == 1 and "repaired 1" in s.lines(d)[0]
    acc = d["field_accuracy"]["per_field"]
    assert acc == {"/n": 0.5, "/name": 0.5, "/none": 0.5, "/ok": 0.0, "/tags/0": 0.5, "/tags/1": 0.0}


def test_cli_argument_errors_exit_2(tmp_path, capsys):
    src = write_lines(tmp_path / "in.jsonl", [json.dumps({"id": 1, "text": "x"})])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"type": 5}}}))
    out = tmp_path / "out.jsonl"
    assert run_extract(["--input", str(src), "--output", str(out), "--schema", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not a valid JSON Schema: at /properties/a/type" in err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(SCHEMA))
    args = ["--input", str(src), "--schema", str(good)]
    assert run_extract([*args, "--output", str(tmp_path / "no" / "out.jsonl")]) == 2
    assert "cannot write the output" in capsys.readouterr().err
    assert run_extract(["--input", str(src), "--output", str(out), "--schemas", str(tmp_path)]) == 2
    assert "--schemas needs --schema-field" in capsys.readouterr().err
    assert run_extract([*args, "--output", str(out), "--min-confidence", "2"]) == 2
    assert (
        run_extract(["--input", str(tmp_path / "nope.jsonl"), "--output", str(out), "--schema", str(good)])
        == 2
    )
    assert "nope.jsonl" in capsys.readouterr().err
    assert not out.exists() or out.read_text() == ""
