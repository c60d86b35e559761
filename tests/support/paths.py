"""The repository root and the shared test data beside it (../shared/testdata)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared" / "testdata"


def shared_path(*parts: str) -> Path:
    """A path under ../shared/testdata, or skip the test when the shared data is absent."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present (the shared test data sits beside the repo in CI)")
    return path


def load_case(case_id: str) -> dict:
    """One case of ../shared/testdata/cases/cases.jsonl by id (KeyError when absent)."""
    for line in shared_path("cases", "cases.jsonl").read_text().splitlines():
        case = json.loads(line)
        if case["id"] == case_id:
            return case
    raise KeyError(case_id)
