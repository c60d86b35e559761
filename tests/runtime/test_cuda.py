"""CUDA path vs the CPU reference on the default model (runs only where a GPU is present; on CPU
the same Triton code is covered by test_kernels.py and test_triton_backend.py). Also the GPU
benchmark script's code paths, smoke-run on CPU under the Triton interpreter (slow)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.request import SamplingParams
from tests.support.models import chat_ids
from tests.support.paths import ROOT

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (a GPU machine)")
QUESTIONS = [
    "Name a city in France.",
    "What is 12 times 7?",
    "Write a haiku about rain.",
    'Return JSON with keys "name" and "age" for Ana, 31.',
]


@needs_cuda
def test_cuda_bf16_greedy_matches_cpu_fp32(default_model_dir, tokenizer):
    """First 16 greedy tokens identical (bf16 may diverge later); prompt logits within bf16
    tolerance; decode ran through captured CUDA graphs and the Triton kernels."""
    prompts = [chat_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engines = {
        "cpu": Engine(
            EngineConfig(
                model=ModelConfig(model=str(default_model_dir), device="cpu", dtype="float32"),
                cache=CacheConfig(kv_cache_bytes=256 << 20),
            )
        ),
        "cuda": Engine(
            EngineConfig(model=ModelConfig(model=str(default_model_dir), device="cuda", dtype="bfloat16"))
        ),
    }
    outs, logits = {}, {}
    for name, eng in engines.items():
        outs[name] = [o.token_ids for o in eng.generate([(p, params, None) for p in prompts])]
        runner = eng.runner
        rows = []
        for p in prompts:
            slots = runner.kv.allocate(len(p))
            rows.append(runner.execute([SeqChunk(p, 0, slots)]).float().cpu())
            runner.kv.free(slots)
        logits[name] = torch.cat(rows)
    gpu = engines["cuda"].runner
    assert gpu.attention_backend == "triton" and gpu.backend.graphs.graphs and gpu.backend.graphs.num_runs > 0
    assert outs["cuda"] == outs["cpu"]
    ref, got = logits["cpu"], logits["cuda"]
    assert torch.equal(ref.argmax(-1), got.argmax(-1))
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max() < 0.03, rel  # bf16 weights + activations over 30 layers
    for eng in engines.values():
        eng.grammar.shutdown()


@pytest.mark.slow
def test_gpu_benchmark_script_smoke_on_cpu(tmp_path):
    """bench/gpu.py end to end on a tiny shape (interpreter): every measurement produces a number."""
    import json

    out = tmp_path / "gpu.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu.py"),
            "--device",
            "cpu",
            "--models",
            "tiny",
            "--context",
            "40",
            "--steps",
            "2",
            "--batches",
            "1,8",
            "--out",
            str(out),
        ],
        check=True,
        env=env,
        timeout=900,
        capture_output=True,
    )
    result = json.loads(out.read_text())["results"][0]
    assert [d["batch"] for d in result["decode"]] == [1, 8]
    assert all(d["tokens_s"] > 0 and d["bound_tokens_s"] > 0 for d in result["decode"])
    assert result["prefill_long_tokens_s"] > 0 and result["ttft_cold_s"] > 0 and result["ttft_warm_s"] > 0
    assert [c["batch"] for c in result["constrained"]] == [1, 8]
