"""`agentrt check` prints the run plan `serve` would take (issue 52 item 4): check takes serve's
flags that decide the plan, with serve's names and defaults; its plan is the one the engine's
ModelRunner builds from serve's flags (runtime/run_plan.py); what plan_run refuses is an error
finding and exit 1 in check, and stops serve before the load. A GGUF's `--quantization auto` answer
comes from its tensor types (gguf_meta.gguf_four_bit_layers): it must be what serve reads from the
converted weights (formats.four_bit_layers)."""

from __future__ import annotations

import argparse

import pytest

from agentrt.commands.check import add_check_parser, check_args, checked_before_load
from agentrt.engine_args import (
    add_engine_args,
    cache_config,
    engine_config,
    model_config,
    with_engine_defaults,
)

MODEL = "smollm2-135m-instruct"  # the registered default: check reads its GGUF, serve its conversion
PLAN_FLAGS = [  # every flag plan_run reads, each away from its default
    ["--device", "cpu"],
    ["--dtype", "float32"],
    ["--quantization", "auto"],
    ["--quant-group-size", "64"],
    ["--quantize-lm-head"],
    ["--threads", "1"],
    ["--max-model-len", "512"],
    ["--kv-cache-dtype", "float16"],
    ["--state-slots", "96"],
    ["--state-snapshot-interval", "64"],
    ["--attention-backend", "torch"],
    ["--enforce-eager"],
    ["--compile"],
    ["--linear-kernel", "aten"],
    ["--deterministic"],
]


def _check_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentrt")
    add_check_parser(p.add_subparsers(dest="command"))
    return p


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentrt serve")
    add_engine_args(p)
    return p


def _check(*argv: str) -> argparse.Namespace:
    return _check_parser().parse_args(["check", *argv])


def test_check_takes_the_plan_flags_as_serve_takes_them():
    flags = [f for pair in PLAN_FLAGS for f in pair]
    check, serve = with_engine_defaults(_check(MODEL, *flags)), _serve_parser().parse_args([MODEL, *flags])
    assert model_config(check) == model_config(serve) and cache_config(check) == cache_config(serve)
    check, serve = with_engine_defaults(_check()), _serve_parser().parse_args([])
    assert model_config(check) == model_config(serve) and cache_config(check) == cache_config(serve)
    assert check.kv_cache_bytes is None and check.max_num_seqs == serve.max_num_seqs  # check's own flags
    assert "the run plan serve would take" in _check_parser().format_help()


@pytest.mark.parametrize(
    "flags",
    [[], ["--attention-backend", "torch"], ["--quantization", "auto"]],
    ids=["default", "torch", "auto"],
)
def test_check_prints_the_plan_the_runner_takes(default_model_dir, flags):
    """The runner built from serve's flags (engine_config, as serve builds it) plans what check printed."""
    from agentrt.runtime.model_runner import ModelRunner

    argv = [MODEL, "--device", "cpu", "--kv-cache-bytes", str(4 << 20), *flags]
    report = check_args(_check(*argv))
    assert report.exit_status == 0, report.describe()
    printed = [f.message for f in report.of("run plan")]
    config = engine_config(_serve_parser().parse_args(argv))
    runner = ModelRunner(config.model, config.cache)
    assert printed == [line.strip() for line in runner.plan.describe().splitlines()]
    assert len(printed) == 8 and all(f.level == "ok" for f in report.of("run plan"))
    if flags == ["--quantization", "auto"]:  # a 4-bit GGUF: told from its tensor types, not converted
        assert runner.plan.quantization == "int4"


def test_the_plan_of_a_directory_reads_its_four_bit_layers(default_model_dir):
    report = check_args(_check(str(default_model_dir), "--device", "cpu", "--quantization", "auto"))
    [weights] = [f.message for f in report.of("run plan") if f.message.startswith("weights:")]
    assert weights.startswith("weights: int4, groups of 32, LM head too (auto: the layers' weights are 4-bit")


REFUSED = {
    "deterministic compiled": (
        ["--deterministic", "--compile"],
        "--deterministic: the compiled decode step (--compile) runs aten matmuls",
    ),
    "cpu attention at bf16": (
        ["--attention-backend", "cpu", "--dtype", "bfloat16"],
        "attention_backend 'cpu' needs the CPU at float32",
    ),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_plan_serve_would_refuse_is_an_error_in_check_and_stops_serve(default_model_dir, capsys, name):
    from agentrt.cli import main

    flags, message = REFUSED[name]
    assert main(["check", MODEL, "--device", "cpu", *flags]) == 1
    out = capsys.readouterr().out
    assert f"[error] run plan: these options cannot run here: {message}" in out, out
    assert "[ok] run plan" not in out
    assert not checked_before_load(_serve_parser().parse_args([MODEL, "--device", "cpu", *flags]))
    assert f"agentrt: error: run plan: these options cannot run here: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_0", "Q8_0"])
def test_the_gguf_four_bit_rule_is_what_serve_reads_after_converting(tmp_path, qtype):
    """gguf_four_bit_layers of a first layer of `qtype` == four_bit_layers of its de-quantized weights
    (what the conversion writes): Q4_1 is 4-bit, Q4_0 (fixed offset) and Q8_0 are not."""
    import gguf
    import numpy as np
    import torch
    from gguf.quants import dequantize, quantize
    from safetensors.torch import save_file

    from agentrt.runtime.models.formats import four_bit_layers
    from agentrt.runtime.models.gguf_meta import GgufInfo, GgufTensor, gguf_four_bit_layers

    kind = gguf.GGMLQuantizationType[qtype]
    names = {"attn_q": "self_attn.q_proj", "ffn_down": "mlp.down_proj"}
    weights = {}
    for i, hf in enumerate(names.values()):
        w = np.random.default_rng(i).standard_normal((48, 64)).astype(np.float32)
        weights[f"model.layers.0.{hf}.weight"] = torch.from_numpy(dequantize(quantize(w, kind), kind).copy())
    save_file(weights, str(tmp_path / "model.safetensors"))
    tensors = [GgufTensor(f"blk.0.{g}.weight", (48, 64), qtype, None) for g in names]
    tensors += [
        GgufTensor("blk.0.attn_norm.weight", (64,), "F32", None),
        GgufTensor("output.weight", (9, 64), "Q8_0", None),
    ]
    info = GgufInfo(tmp_path / "m.gguf", {}, tuple(tensors))
    assert gguf_four_bit_layers(info) == four_bit_layers(tmp_path) == (qtype == "Q4_1")
    assert not gguf_four_bit_layers(GgufInfo(tmp_path / "m.gguf", {}, tuple(tensors[2:])))  # no projections
