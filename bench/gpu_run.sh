#!/usr/bin/env bash
# One prepared call for a GPU machine (PyTorch + Triton, no internet, no model files), run from
# the repo root: the Triton kernels against their torch references on CUDA, then bench/gpu.py.
# Results go to $OUT (or ./gpu-out): kernels.log, gpu.log (the tables), gpu.json.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_kernels.py 2>&1 | tail -5 | tee "$OUT/kernels.log"
timeout 420 python3 bench/gpu.py --out "$OUT/gpu.json" 2>&1 | tee -a "$OUT/gpu.log"
