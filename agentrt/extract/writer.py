"""The job's output: append-only JSON Lines, one row per input id, durable per row, resumable.

Each row is one `os.write` of its whole line (JSON + "\\n") on a file opened for appending, then
`fsync` (every `fsync_every` rows; 1 by default). A SIGKILL can therefore leave at most one torn
row: the last line, without its newline. `OutputWriter.open` repairs that before appending:
it reads the existing file line by line (never all of it at once), collects the ids of complete
rows, and truncates a last line that has no trailing newline or is not JSON. A line before the
last that is not a JSON row means the file is not this job's output: ValueError, nothing changed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from agentrt.extract.reader import _id_key


def scan_output(path: Path) -> tuple[set, int, int, int | None]:
    """(id keys of the complete rows, number of those rows, how many of them are not valid, byte
    offset to truncate at or None). Raises ValueError for a non-JSON line that is not the last one."""
    done: set = set()
    num_rows, num_invalid, offset, torn = 0, 0, 0, None
    with path.open("rb") as f:
        pending_error = None
        for raw in f:
            if pending_error is not None:  # a bad line followed by more lines: not a torn tail
                raise ValueError(pending_error)
            start, offset = offset, offset + len(raw)
            if not raw.endswith(b"\n"):
                torn = start
                break
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
                if not isinstance(row, dict) or "id" not in row:
                    raise ValueError("not a row object with an id")
            except ValueError as e:
                pending_error = (
                    f"{path}: line at byte {start} is not an output row ({e}); not this job's output?"
                )
                torn = start
                continue
            done.add(_id_key(row["id"]))
            num_rows += 1
            num_invalid += row.get("valid") is not True
    return done, num_rows, num_invalid, torn


class OutputWriter:
    """Appends rows to `path`. Construct with `OutputWriter.open`."""

    def __init__(
        self, path: Path, fd: int, done: set, existing: tuple[int, int], fsync_every: int, repaired: int
    ):
        self.path, self.fd, self.done = path, fd, done
        self.num_existing, self.num_existing_invalid = existing  # complete rows found at open, not valid
        self.num_repaired_bytes = repaired  # bytes of a torn last line cut away at open
        self.fsync_every = fsync_every
        self.num_written = 0

    @classmethod
    def open(cls, path: str | Path, *, resume: bool = True, fsync_every: int = 1) -> OutputWriter:
        """Open `path` for appending (created if absent). With `resume` (default), an existing file
        is scanned (`done`: the id keys already written) and a torn last line truncated; without it
        an existing file is emptied. Raises OSError at once when it cannot be written, ValueError
        when it holds lines that are not output rows (see the module docstring)."""
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            done, num, num_invalid, repaired = set(), 0, 0, 0
            if not resume:
                os.ftruncate(fd, 0)
            elif os.fstat(fd).st_size:
                done, num, num_invalid, torn = scan_output(path)
                if torn is not None:
                    repaired = os.fstat(fd).st_size - torn
                    os.ftruncate(fd, torn)
                    os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, done, (num, num_invalid), max(1, fsync_every), repaired)

    def is_done(self, rid: Any) -> bool:
        """Whether a row with this id is already in the output."""
        return _id_key(rid) in self.done

    def write(self, row: dict[str, Any]) -> None:
        """Append one row (a dict with "id") as one line; durable once `fsync_every` rows are written.
        Raises OSError (disk full, ...): the row may then be torn, and is repaired on the next open."""
        data = (json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n").encode()
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.done.add(_id_key(row["id"]))
        self.num_written += 1
        if self.num_written % self.fsync_every == 0:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
