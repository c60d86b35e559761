"""The C++ CPU kernels for tests: built (or loaded from AGENTRT_CACHE) once per process, and a skip
marker naming why when they cannot be (no compiler, say)."""

from __future__ import annotations

import pytest

from agentrt.runtime.config import default_cache_dir
from agentrt.runtime.kernels import cpu_kernels

KERNEL_FAILURE = cpu_kernels.load(default_cache_dir())
needs_kernel = pytest.mark.skipif(
    KERNEL_FAILURE is not None, reason=f"the C++ kernel is unavailable: {KERNEL_FAILURE}"
)
