"""Streaming readers of extraction job inputs: JSON Lines, CSV, Parquet (with pyarrow).

Rows are read one at a time (Parquet: one record batch at a time), so an input of any size needs
memory for one row (batch), plus a set of the ids seen. Each row becomes an `InputRow`:

- id: the `id_field` value (a string or a number). A row without one gets the id "#N", N its row
  number in the file (1-based, counting data rows: JSON Lines lines, CSV records after the header,
  Parquet rows), stable across reruns of the same file, so resume works for inputs without ids.
- a row whose id was already seen in this input is a duplicate: it gets no output row (the output
  has one row per id) and is counted (`InputReader.num_duplicates`) and reported in the summary.
- a line that is not JSON (or not a JSON object), a row without the text field, a text that is not
  a string, an id that is not a string or number, or a schema name not in the job's schemas: an
  error row (`error` says which, with the row number), written to the output as such.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = ("jsonl", "csv", "parquet")


@dataclass
class InputRow:
    """One input row. number: its 1-based row number; id; text (None on error rows); schema_name:
    the `schema_field` value (None without one); gold: the `gold_field` value; error: why the row
    cannot run (None for a good row)."""

    number: int
    id: Any
    text: str | None = None
    schema_name: str | None = None
    gold: Any = None
    error: str | None = None


def input_format(path: str | Path, fmt: str | None = None) -> str:
    """`fmt`, or the format of `path` by its suffix (.jsonl/.json/.ndjson, .csv, .parquet). Raises
    ValueError for an unknown one."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown input format {fmt!r}: use one of {', '.join(FORMATS)}")
        return fmt
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".csv", ".parquet"):
        return suffix[1:]
    raise ValueError(f"cannot tell the format of {path} from its suffix: name it .jsonl, .csv or .parquet")


def _parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            "reading Parquet needs pyarrow, which is not installed: `pip install pyarrow` "
            "(or agentrt[extract]), or convert the input to JSON Lines or CSV"
        ) from None
    return pq


class InputReader:
    """Iterate `InputRow`s of a file. Opening checks the file can be read (OSError) and its format
    (ValueError: unknown suffix, Parquet without pyarrow)."""

    def __init__(
        self,
        path: str | Path,
        *,
        id_field: str = "id",
        text_field: str = "text",
        schema_field: str | None = None,
        gold_field: str | None = None,
        fmt: str | None = None,
    ):
        self.path = Path(path)
        self.fmt = input_format(self.path, fmt)
        self.id_field, self.text_field = id_field, text_field
        self.schema_field, self.gold_field = schema_field, gold_field
        self.num_duplicates = 0
        if self.fmt == "parquet":
            _parquet()
        with self.path.open("rb"):
            pass

    def count(self) -> int:
        """Data rows in the file (one streaming pass; JSON Lines: non-blank lines)."""
        if self.fmt == "parquet":
            return _parquet().ParquetFile(self.path).metadata.num_rows
        if self.fmt == "csv":
            with self.path.open(newline="", encoding="utf-8", errors="replace") as f:
                return max(0, sum(1 for _ in csv.reader(f)) - 1)
        n = 0
        with self.path.open("rb") as f:
            for line in f:
                n += bool(line.strip())
        return n

    def __iter__(self) -> Iterator[InputRow]:
        seen: set = set()
        for number, record in self._records():
            row = record if isinstance(record, InputRow) else self._row(number, record)
            key = _id_key(row.id)
            if key in seen:
                self.num_duplicates += 1
                print(
                    f"agentrt: warning: {self.path} row {number}: id {row.id!r} was already seen; skipped",
                    file=sys.stderr,
                )
                continue
            seen.add(key)
            yield row

    def _records(self) -> Iterator[tuple[int, dict | InputRow]]:
        if self.fmt == "jsonl":
            yield from self._jsonl()
        elif self.fmt == "csv":
            with self.path.open(newline="", encoding="utf-8") as f:
                for number, rec in enumerate(csv.DictReader(f), 1):
                    yield number, {k: v for k, v in rec.items() if k is not None}
        else:
            number = 0
            for batch in _parquet().ParquetFile(self.path).iter_batches(batch_size=256):
                for rec in batch.to_pylist():
                    number += 1
                    yield number, rec

    def _jsonl(self) -> Iterator[tuple[int, dict | InputRow]]:
        number = 0
        with self.path.open("rb") as f:
            for raw in f:
                if not raw.strip():
                    continue
                number += 1
                try:
                    rec = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    yield number, InputRow(number, f"#{number}", error=f"row {number} is not JSON: {e}")
                    continue
                if not isinstance(rec, dict):
                    why = f"row {number} is a JSON {type(rec).__name__}, not an object"
                    yield number, InputRow(number, f"#{number}", error=why)
                    continue
                yield number, rec

    def _row(self, number: int, rec: dict) -> InputRow:
        rid = rec.get(self.id_field)
        if rid is None or rid == "":
            rid = f"#{number}"
        elif isinstance(rid, bool) or not isinstance(rid, (str, int, float)):
            return InputRow(
                number,
                f"#{number}",
                error=f"row {number}: id field '{self.id_field}' must be a string or a number, "
                f"got {type(rid).__name__}",
            )
        gold = rec.get(self.gold_field) if self.gold_field else None
        if isinstance(gold, str) and self.fmt == "csv":  # CSV cells are text: JSON gold is allowed
            try:
                gold = json.loads(gold)
            except json.JSONDecodeError:
                pass
        schema_name = rec.get(self.schema_field) if self.schema_field else None
        row = InputRow(number, rid, gold=gold, schema_name=schema_name)
        if self.text_field not in rec or rec[self.text_field] is None:
            row.error = f"row {number} has no text field '{self.text_field}'"
        elif not isinstance(rec[self.text_field], str):
            row.error = (
                f"row {number}: text field '{self.text_field}' must be a string, "
                f"got {type(rec[self.text_field]).__name__}"
            )
        elif self.schema_field and not isinstance(schema_name, str):
            row.error = f"row {number} has no schema name in field '{self.schema_field}'"
        else:
            row.text = rec[self.text_field]
        return row


def _id_key(rid: Any) -> Any:
    """A set key for an id: 5 and 5.0 are the same id, "5" is another."""
    return (type(rid) is str, rid)
