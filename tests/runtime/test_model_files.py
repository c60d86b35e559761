"""Model files: weights come from safetensors or GGUF only (a pickle checkpoint is refused, naming
the file, and never unpickled), and no code path asks transformers to run a model's remote code."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch

from agentrt.runtime.models.loader import resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_unpickling(monkeypatch):
    """Fail the test if anything unpickles (torch.load, pickle.load/loads)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was unpickled")

    for obj, name in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(obj, name, refuse)


def _model_dir(tmp_path: Path, *files: str) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for name in files:
        (d / name).write_bytes(pickle.dumps({"w": [1.0]}))
    return d


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth", "last.ckpt"])
def test_a_directory_with_a_pickle_checkpoint_is_refused(tmp_path, no_unpickling, name):
    d = _model_dir(tmp_path, name)
    with pytest.raises(ValueError, match=re.escape(f"{d / name} is a pickle checkpoint")) as e:
        resolve_model_dir(str(d), tmp_path / "cache")
    assert "safetensors" in str(e.value) and "gguf" in str(e.value)


def test_a_pickle_file_given_as_the_model_is_refused(tmp_path, no_unpickling):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(pickle.dumps({"w": [1.0]}))
    with pytest.raises(ValueError, match=re.escape(f"{path} is a pickle checkpoint")):
        resolve_model_dir(str(path), tmp_path / "cache")


def test_pickle_files_beside_safetensors_are_ignored(tmp_path, no_unpickling):
    d = _model_dir(tmp_path, "pytorch_model.bin")
    (d / "model.safetensors").write_bytes(b"")
    assert resolve_model_dir(str(d), tmp_path / "cache") == d


def test_a_directory_without_weights_is_refused(tmp_path):
    d = _model_dir(tmp_path)
    with pytest.raises(ValueError, match="has no .safetensors weights"):
        resolve_model_dir(str(d), tmp_path / "cache")


def test_no_code_asks_for_remote_code():
    offenders = [
        str(p.relative_to(ROOT))
        for folder in ("agentrt", "bench")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if re.search(r"trust_remote_code\s*=\s*(?!False)", p.read_text())
    ]
    assert offenders == []
