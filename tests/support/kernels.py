"""The C++ CPU kernels for tests: built (or loaded from AGENTRT_CACHE) once per process, a skip
marker naming why when they cannot be (no compiler, say), and a fresh process to run a script in
(a loaded op stays loaded: another build, another environment or an emulated CPU needs its own)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agentrt.runtime.config import default_cache_dir
from agentrt.runtime.kernels import cpu_kernels

KERNEL_FAILURE = cpu_kernels.load(default_cache_dir())
needs_kernel = pytest.mark.skipif(
    KERNEL_FAILURE is not None, reason=f"the C++ kernel is unavailable: {KERNEL_FAILURE}"
)


def run_fresh(script: str, tmp_path, *, runner: tuple[str, ...] = (), timeout: int = 600, **env) -> str:
    """stdout of `script` in a fresh Python process, argv[1] = tmp_path, env added to this one's;
    runner: a command the interpreter runs under (an emulator). Fails the test on a non-zero exit."""
    proc = subprocess.run(
        [*runner, sys.executable, "-c", script, str(tmp_path)],
        check=False,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout
