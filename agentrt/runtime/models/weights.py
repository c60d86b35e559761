"""Weight files on disk: reading a checkpoint directory's safetensors tensors onto a device
(`load_weights`) and writing a cache entry atomically (`atomic_cache_dir`, used by the quantized
weights cache of formats.py and the GGUF conversion of loader.py). Nothing here knows the model or
the runner: the models package builds on it, never the other way round."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import torch


def load_weights(model_dir: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the directory's .safetensors files, loaded straight onto `device`."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir} has no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f), device=str(device)))
    return tensors


@contextlib.contextmanager
def atomic_cache_dir(target: Path):
    """A temporary directory beside `target` to write a cache entry into, renamed to `target` when
    the block ends without an exception (a concurrent writer that renamed first wins; its
    `model.safetensors` must then be there, else OSError), removed in every case."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        yield tmp
        try:
            os.replace(tmp, target)
        except OSError:  # another process wrote it first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
