"""Whether numpy's matmul gives a row the same bits at every place in a tile: the Triton
interpreter's tl.dot is numpy's matmul, so the batch-invariant matmul's test (tests/runtime/
test_kernels.py) can hold rows bitwise only where it does. OpenBLAS picks its sgemm kernel by CPU;
`OPENBLAS_CORETYPE=Haswell` (or Zen, SkylakeX) chooses one by name.

    OPENBLAS_CORETYPE=Haswell .venv/bin/python bench/blas_rows.py
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="64,32,64", help="M,K,N of one tile (the kernel's: 64,32,64)")
    m, k, n = (int(v) for v in ap.parse_args().shape.split(","))
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    full, alone = np.matmul(a, b), np.zeros_like(a)
    differ = []
    for r in range(m):
        alone[0] = a[r]
        if not np.array_equal(np.matmul(alone, b)[0], full[r]):
            differ.append(r)
    core = os.environ.get("OPENBLAS_CORETYPE", "(the CPU's)")
    print(
        f"OPENBLAS_CORETYPE={core} tile {m}x{k}x{n}: rows whose bits differ from row 0's: {differ or 'none'}"
    )


if __name__ == "__main__":
    main()
