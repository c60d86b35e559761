"""Compiled decode step on CPU (runtime/backends/compiled_decode.py): parity with the eager step, the eager
fallback, --enforce-eager, the artefacts under the cache directory.

Building the three graphs of a tiny model takes 1-3 minutes on the 2-core development box, so the
tests that build are marked slow; one build (per weight format) is shared by a module's tests."""

from __future__ import annotations

import argparse
import logging
import os

import pytest
import torch

from agentrt.runtime.backends import compiled_decode, run_chunks
from agentrt.runtime.backends.compiled_decode import CompiledDecodeBackend
from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.request import SamplingParams
from tests.support.models import make_tiny_model

FORMATS = {
    "float32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
}


@pytest.fixture(scope="module")
def tiny(default_model_dir, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tinyc") / "m", default_model_dir, "llama")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One AGENTRT_CACHE for the module: the first compiled engine of a format builds, later ones load."""
    return tmp_path_factory.mktemp("agentrt-cache")


def make_engine(tiny, cache_dir, fmt="float32", compile_decode=True, enforce_eager=False) -> Engine:
    dtype, quant = FORMATS[fmt]
    return Engine(
        EngineConfig(
            model=ModelConfig(
                model=str(tiny),
                device="cpu",
                dtype=dtype,
                quantization=quant,
                cache_dir=cache_dir,
                compile_decode=compile_decode,
                enforce_eager=enforce_eager,
            ),
            cache=CacheConfig(kv_cache_bytes=4 << 20, enable_prefix_cache=False),
            scheduler=SchedulerConfig(max_num_seqs=4),
        )
    )


@pytest.fixture(scope="module")
def compiled_engine(tiny, cache_dir):
    engine = make_engine(tiny, cache_dir)
    assert isinstance(engine.runner.backend, CompiledDecodeBackend)
    assert engine.runner.backend.compiled.active, engine.runner.backend.compiled.failure
    return engine


@pytest.fixture(scope="module")
def eager_engine(tiny, cache_dir):
    engine = make_engine(tiny, cache_dir, compile_decode=False)
    assert not isinstance(engine.runner.backend, CompiledDecodeBackend)
    return engine


PROMPTS = [[100 + 7 * i + j for j in range(5 + 3 * i)] for i in range(6)]


def greedy(engine: Engine, max_tokens=(3, 9, 5, 12, 7, 10)) -> list[list[int]]:
    """Six greedy requests through at most 4 running sequences (max_num_seqs), of different lengths:
    the decode batch grows as requests are admitted and shrinks as they finish."""
    no_eos = {t: -100.0 for t in engine.stop_ids}
    reqs = [
        (ids, SamplingParams(temperature=0, max_tokens=n, logit_bias=no_eos), None)
        for ids, n in zip(PROMPTS, max_tokens)
    ]
    return [out.token_ids for out in engine.generate(reqs)]


def spy_batch_sizes(monkeypatch, compiled) -> list[int]:
    sizes: list[int] = []
    run = compiled.run

    def spy(chunks):
        sizes.append(len(chunks))
        return run(chunks)

    monkeypatch.setattr(compiled, "run", spy)
    return sizes


def decode_logits(runner, fn, contexts=(5, 9, 14), steps=4) -> list[torch.Tensor]:
    """Logits of `steps` decode steps of len(contexts) sequences (prompts prefilled eagerly), each
    step through fn(chunks); the batch drops its first sequence after two steps."""
    torch.manual_seed(0)
    slots = [runner.kv.allocate(n + steps) for n in contexts]
    ids = [torch.randint(0, 49152, (n + steps,)).tolist() for n in contexts]
    try:
        with torch.inference_mode():
            run_chunks(
                runner.model,
                runner.kv.k,
                runner.kv.v,
                [SeqChunk(t[:n], 0, s[:n]) for t, s, n in zip(ids, slots, contexts)],
                runner.device,
            )
            out = []
            for i in range(steps):
                first = 1 if i >= 2 else 0
                chunks = [
                    SeqChunk([t[n + i]], n + i, s[: n + i + 1])
                    for t, s, n in list(zip(ids, slots, contexts))[first:]
                ]
                out.append(fn(chunks))
            return out
    finally:
        for s in slots:
            runner.kv.free(s)


def test_enforce_eager_keeps_the_compiled_step_off(tiny, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="agentrt.runtime.model_runner"):
        engine = make_engine(tiny, tmp_path, enforce_eager=True)
    assert not isinstance(engine.runner.backend, CompiledDecodeBackend)
    assert "decode eager (enforce_eager)" in caplog.text
    assert not (tmp_path / "compiled-decode").exists()


def test_cli_flag_switches_compile_decode():
    from agentrt.engine_args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config(p.parse_args([])).model.compile_decode is False
    assert engine_config(p.parse_args(["--compile"])).model.compile_decode is True
    assert engine_config(p.parse_args(["--compile", "--no-compile"])).model.compile_decode is False
    eager = engine_config(p.parse_args(["--compile", "--enforce-eager"])).model
    assert eager.compile_decode and eager.enforce_eager


def test_build_failure_falls_back_to_eager_once_and_keeps_serving(tiny, tmp_path, monkeypatch, caplog):
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("forced compile failure")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", broken)
    with caplog.at_level(logging.INFO):
        engine = make_engine(tiny, tmp_path)
    compiled = engine.runner.backend.compiled
    assert calls == [1]  # the first build failed; nothing else was tried
    assert not compiled.active and "forced compile failure" in compiled.failure
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "compiled decode off" in r.message
    ]
    assert len(warnings) == 1 and "forced compile failure" in warnings[0].message
    assert "decode eager (compile failed: RuntimeError: forced compile failure)" in caplog.text
    assert not list((tmp_path / "compiled-decode").glob("*/*.pt2"))
    eager = make_engine(tiny, tmp_path, compile_decode=False)
    assert greedy(engine) == greedy(eager)
    assert compiled.num_runs == 0


@pytest.mark.slow
def test_compiled_decode_matches_eager_logits_and_greedy_tokens(compiled_engine, eager_engine, monkeypatch):
    runner = compiled_engine.runner
    compiled = runner.backend.compiled
    got = decode_logits(runner, compiled.run)
    want = decode_logits(
        runner, lambda ch: run_chunks(runner.model, runner.kv.k, runner.kv.v, ch, runner.device)
    )
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == torch.float32
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-4), (g - w).abs().max()
    assert [g.shape[0] for g in got] == [3, 3, 2, 2]

    sizes = spy_batch_sizes(monkeypatch, compiled)
    before = compiled.num_runs
    tokens = greedy(compiled_engine)
    assert tokens == greedy(eager_engine)
    assert [len(t) for t in tokens] == [3, 9, 5, 12, 7, 10]
    assert compiled.num_runs - before == len(sizes) > 0
    assert {1, 2, 3, 4} <= set(sizes)  # the batch grew and shrank; every size ran compiled
    assert compiled.active


@pytest.mark.slow
def test_artefacts_live_under_the_cache_dir_and_load_on_a_second_start(
    compiled_engine, tiny, cache_dir, caplog
):
    compiled = compiled_engine.runner.backend.compiled
    assert compiled.package_dir.parent == cache_dir / "compiled-decode"
    assert sorted(p.name for p in compiled.package_dir.iterdir()) == ["first.pt2", "last.pt2", "mid.pt2"]
    inductor = cache_dir / "inductor"
    assert inductor.is_dir() and any(inductor.iterdir())  # inductor's own caches went there too
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(inductor)  # restored after the build
    with caplog.at_level(logging.INFO):
        second = make_engine(tiny, cache_dir)
    again = second.runner.backend.compiled
    assert again.active and again.from_cache and again.package_dir == compiled.package_dir
    assert "loaded from cache" in again.describe() and "decode compiled" in caplog.text
    runner = second.runner
    want = decode_logits(
        runner, lambda ch: run_chunks(runner.model, runner.kv.k, runner.kv.v, ch, runner.device)
    )
    for g, w in zip(decode_logits(runner, again.run), want):
        assert torch.allclose(g, w, atol=1e-5, rtol=1e-4)
    # another thread count is another build (inductor bakes it into its loops)
    other = compiled_decode.CompiledDecode(
        runner.model, runner.kv.k, runner.kv.v, 4, cache_dir, runner.num_threads + 1
    )
    assert other.package_dir != compiled.package_dir


@pytest.mark.slow
def test_failure_during_a_compiled_step_falls_back_to_eager(
    tiny, cache_dir, compiled_engine, eager_engine, caplog
):
    engine = make_engine(tiny, cache_dir)  # loads the module's build
    compiled = engine.runner.backend.compiled
    assert compiled.active
    mid = compiled._run_fns["mid"]
    calls = []

    def flaky(inputs):
        calls.append(1)
        if len(calls) == 5:  # a few steps into the requests
            raise RuntimeError("forced step failure")
        return mid(inputs)

    compiled._run_fns["mid"] = flaky
    with caplog.at_level(logging.WARNING):
        tokens = greedy(engine)
    assert tokens == greedy(eager_engine)
    assert not compiled.active and "forced step failure" in compiled.failure
    assert sum("compiled decode off" in r.message for r in caplog.records) == 1
    assert len(calls) == 5  # nothing compiled ran after the failure


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_low_precision_and_quantized_formats_compile_and_match_eager(tiny, cache_dir, fmt):
    engine = make_engine(tiny, cache_dir, fmt)
    runner = engine.runner
    compiled = runner.backend.compiled
    assert compiled.active, compiled.failure
    want = decode_logits(
        runner, lambda ch: run_chunks(runner.model, runner.kv.k, runner.kv.v, ch, runner.device)
    )
    got = decode_logits(runner, compiled.run)
    # inductor rounds bf16 intermediates where eager torch does (emulate_precision_casts), but its
    # kernels may sum in another order: a few units in the last place of bf16 (2^-8 relative) remain
    for g, w in zip(got, want):
        diff = (g - w).abs()
        assert diff.max() <= 1e-2 and diff.mean() <= 1e-3, (diff.max(), diff.mean())
    assert compiled.num_runs == len(got) and compiled.active
