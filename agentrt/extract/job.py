"""The job loop of `agentrt extract`: input rows -> a driver (in-process engine or a server) -> the
output file, with resume, a progress bar, Ctrl-C handling, the summary and the exit status.

Ctrl-C: the first one stops the job at once (no new documents, the ones in flight aborted), unless a
row is being written: then right after that row, so no half row is ever written. The summary is
still written (with "interrupted": true) and the exit status is 130. Rows already written stay;
rerunning the command resumes after them.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from agentrt.extract.reader import InputReader
from agentrt.extract.types import ExtractInput
from agentrt.extract.writer import OutputWriter

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass
class JobPlan:
    """What a job runs: the input reader, the opened output, the schemas (by name for
    `schema_field`, or one under the name None), whether failures still exit 0, whether to show a
    progress bar, and the confidence threshold (for the summary's needs_review count)."""

    reader: InputReader
    writer: OutputWriter
    schemas: dict[str | None, dict]
    allow_failures: bool = False
    progress: bool = True
    min_confidence: float | None = None


def job_inputs(plan: JobPlan, skipped: list[int]) -> Iterator[ExtractInput]:
    """The reader's rows not yet in the output, as ExtractInputs (a schema name not in the job's
    schemas is an error row). `skipped[0]` counts the rows skipped as already done."""
    one = plan.schemas.get(None)
    for row in plan.reader:
        if plan.writer.is_done(row.id):
            skipped[0] += 1
            continue
        inp = ExtractInput(row.text, row.id, error=row.error, gold=row.gold, schema_name=row.schema_name)
        if inp.error is None:
            if plan.reader.schema_field:
                inp.schema = plan.schemas.get(row.schema_name)
                if inp.schema is None:
                    known = ", ".join(sorted(k for k in plan.schemas if k)) or "none"
                    inp.error = f"row {row.number}: unknown schema {row.schema_name!r} (known: {known})"
            else:
                inp.schema = one
        yield inp


class _Interrupt:
    """SIGINT while a row is written is held until the row is complete."""

    def __init__(self) -> None:
        self.writing = False
        self.pending = False

    def handler(self, signum, frame) -> None:
        if self.writing:
            self.pending = True
            return
        raise KeyboardInterrupt

    def after_write(self) -> None:
        if self.pending:
            raise KeyboardInterrupt


def run_job(plan: JobPlan, results_of, summary_path: Path) -> int:
    """Run the job: `results_of(inputs)` is the driver (an iterator of ExtractResult in completion
    order). Writes each result as a row, then the summary (printed and written to `summary_path`).
    Returns the exit status (module docstring; EXIT_FAILED when some row of the output is not valid,
    this run's or an earlier one's, unless allow_failures)."""
    from tqdm import tqdm

    from agentrt.extract.summary import JobSummary

    summary = JobSummary()
    skipped = [0]
    total = plan.reader.count()
    bar = tqdm(
        total=total,
        initial=min(plan.writer.num_existing, total),
        unit="doc",
        file=sys.stderr,
        disable=not plan.progress,
        dynamic_ncols=True,
        mininterval=0.5,
    )
    stop = _Interrupt()
    previous = signal.signal(signal.SIGINT, stop.handler)
    interrupted = False
    t0 = time.perf_counter()
    results = results_of(job_inputs(plan, skipped))
    try:
        for r in results:
            row = r.row()
            stop.writing = True
            try:
                plan.writer.write(row)
            finally:
                stop.writing = False
            stop.after_write()
            summary.add(r)
            bar.update(1)
            bar.set_postfix(valid=f"{summary.valid / summary.rows:.0%}", refresh=False)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        try:
            if hasattr(results, "close"):
                results.close()  # aborts the documents in flight
        except KeyboardInterrupt:
            interrupted = True
        signal.signal(signal.SIGINT, previous)
        bar.close()
        plan.writer.close()
    wall = time.perf_counter() - t0
    d = summary.as_dict(
        wall,
        output=str(plan.writer.path),
        skipped_already_done=skipped[0],
        duplicate_ids=plan.reader.num_duplicates,
        earlier_rows=plan.writer.num_existing,
        earlier_invalid=plan.writer.num_existing_invalid,
        torn_bytes_repaired=plan.writer.num_repaired_bytes,
        interrupted=interrupted,
    )
    if plan.min_confidence is not None:
        d["needs_review"] = summary.needs_review
    summary_path.write_text(json.dumps(d, indent=2) + "\n")
    for line in summary.lines(d):
        print(f"agentrt: {line}")
    if skipped[0]:
        print(f"agentrt: {skipped[0]} rows were already in {plan.writer.path} (resumed)")
    print(f"agentrt: summary written to {summary_path}")
    if interrupted:
        print("agentrt: interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    failed = summary.rows - summary.valid + plan.writer.num_existing_invalid
    return EXIT_FAILED if failed and not plan.allow_failures else EXIT_OK
