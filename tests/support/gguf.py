"""Writing a transformers model as a GGUF file, as llama.cpp's convert_hf_to_gguf.py writes it.

`write_gguf` takes a float32 transformers model (Llama / Mistral / Mixtral, Qwen3, Qwen3-MoE,
Phi-3), renames its tensors with the gguf package's own HF -> GGUF name map, applies llama.cpp's
layout changes (Llama's Q/K row permutation for its interleaved rotary, fused MoE experts split
into ffn_gate_exps / ffn_up_exps / ffn_down_exps), quantizes the weight matrices to a ggml type the
gguf package can write (F32, F16, Q8_0, Q4_0, Q5_0, ...; the K-quants it only de-quantizes) and
writes what llama.cpp writes: the hyperparameters under `<arch>.` (rope scaling linear / YaRN as
keys; llama3 as the `rope_freqs` tensor, Phi-3's LongRoPE as `rope_factors_short` / `_long`), the
vocabulary as tokenizer.ggml.* keys and the chat template. `tiny_vocab` cuts a small but real
byte-level BPE out of the default model's tokenizer (its specials, byte tokens and the first
merges), so a file stays small and fast to parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# transformers model_type -> GGUF general.architecture (llama.cpp writes Mistral as "llama")
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
}
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3


@dataclass(frozen=True)
class TinyVocab:
    """A byte-level BPE vocabulary as a GGUF stores it."""

    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    bos_id: int
    eos_id: int
    chat_template: str | None


def tiny_vocab(tokenizer_dir: Path, size: int) -> TinyVocab:
    """The first `size` tokens of the byte-level BPE tokenizer in `tokenizer_dir` (its special tokens,
    its byte tokens, then merged tokens) and the merges that build them: a smaller tokenizer that
    splits text by the same rules. Raises ValueError when the merges do not build the tokens in order."""
    data = json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id[i] for i in range(size)]
    specials = {a["id"] for a in data["added_tokens"] if a["special"]}
    pairs = [m if isinstance(m, list) else m.split(" ") for m in data["model"]["merges"]]
    first_merged = vocab["".join(pairs[0])]  # the specials and the byte tokens come before it
    merges = []
    for i, (left, right) in enumerate(pairs[: size - first_merged]):
        if left + right != tokens[first_merged + i]:
            raise ValueError(f"merge {i} ({left!r} {right!r}) does not build token {first_merged + i}")
        merges.append(f"{left} {right}")
    config = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if template is None and (Path(tokenizer_dir) / "chat_template.jinja").is_file():
        template = (Path(tokenizer_dir) / "chat_template.jinja").read_text()
    return TinyVocab(
        tokens=tokens,
        merges=merges,
        token_types=[TOKEN_CONTROL if i in specials else TOKEN_NORMAL for i in range(size)],
        bos_id=vocab[config.get("bos_token") or tokens[1]],
        eos_id=vocab[config.get("eos_token") or tokens[2]],
        chat_template=template,
    )


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rows from the halves layout (rotate_half) to
    interleaved pairs, the layout of ggml's normal rotary. transformers' GGUF loader undoes it."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _rope(cfg) -> dict:
    return dict(getattr(cfg, "rope_parameters", None) or {})


def _rope_theta(cfg) -> float:
    return float(_rope(cfg).get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def llama3_rope_freqs(cfg) -> np.ndarray:
    """llama.cpp's `rope_freqs` for a llama3 rope scaling: the divisor of each rotary frequency
    (`LlamaModel.generate_extra_tensors`)."""
    rope = _rope(cfg)
    dim = _head_dim(cfg)
    freqs = 1.0 / (_rope_theta(cfg) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    original = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _add_metadata(w, cfg, arch: str) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(_rope_theta(cfg))
    head_dim = _head_dim(cfg)
    rope = _rope(cfg)
    rope_type = rope.get("rope_type", "default")
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(head_dim)
    elif arch == "phi3":  # Phi3MiniModel.set_gguf_parameters
        rotary = int(rope.get("partial_rotary_factor", 1.0) * head_dim)
        w.add_rope_dimension_count(rotary)
        w.add_sliding_window(cfg.sliding_window or 0)
        original = rope.get("original_max_position_embeddings") or cfg.max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(original)
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0
        )
    if getattr(cfg, "head_dim", None) is not None and arch != "phi3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if rope_type in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf_rope_type(rope_type))
        w.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def gguf_rope_type(name: str):
    import gguf

    return {"linear": gguf.RopeScalingType.LINEAR, "yarn": gguf.RopeScalingType.YARN}[name]


def _rope_tensors(cfg, arch: str) -> dict[str, np.ndarray]:
    """The rope scaling llama.cpp stores as tensors: Llama's `rope_freqs` (llama3), Phi-3's
    `rope_factors_short` / `_long` (LongRoPE)."""
    rope = _rope(cfg)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        return {"rope_freqs.weight": llama3_rope_freqs(cfg)}
    if arch == "phi3" and rope.get("rope_type") in ("longrope", "su"):
        return {
            "rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32),
        }
    return {}


def _add_vocab(w, vocab: TinyVocab) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.bos_id)
    w.add_eos_token_id(vocab.eos_id)
    w.add_add_bos_token(False)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


def _add_pad(w, cfg) -> None:
    if getattr(cfg, "pad_token_id", None) is not None:
        w.add_pad_token_id(cfg.pad_token_id)


def gguf_tensors(model, arch: str, permute: bool = True) -> dict[str, np.ndarray]:
    """The model's tensors under their GGUF names, in llama.cpp's layout (float32 numpy).
    `permute` False leaves out Llama's Q/K permutation (a broken file, for the tests that must fail)."""
    import gguf

    cfg = model.config
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, tensor in model.state_dict().items():
        data = tensor.detach().float().numpy()
        if hf_name.endswith("mlp.experts.gate_up_proj"):  # [experts, 2 x moe_ffn, hidden]
            bid = hf_name.split(".")[2]
            gate, up = np.split(data, 2, axis=1)
            out[f"blk.{bid}.ffn_gate_exps.weight"] = gate
            out[f"blk.{bid}.ffn_up_exps.weight"] = up
            continue
        if hf_name.endswith("mlp.experts.down_proj"):  # [experts, hidden, moe_ffn]
            out[f"blk.{hf_name.split('.')[2]}.ffn_down_exps.weight"] = data
            continue
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base)
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name} in the gguf package's {arch} map")
        if permute and arch == "llama" and name.endswith(".attn_q"):
            data = permute_qk(data, cfg.num_attention_heads)
        elif permute and arch == "llama" and name.endswith(".attn_k"):
            data = permute_qk(data, cfg.num_key_value_heads)
        out[f"{name}.{suffix}"] = data
    if getattr(cfg, "tie_word_embeddings", False):
        out.pop("output.weight", None)
    return {**_rope_tensors(cfg, arch), **out}


def write_gguf(
    model,
    path: Path,
    vocab: TinyVocab,
    qtype: str = "F32",
    name: str | None = None,
    permute: bool = True,
    drop: tuple[str, ...] = (),
) -> Path:
    """Write `model` (a float32 transformers causal LM) to `path` as a GGUF of `qtype`: every weight
    matrix (2-D or 3-D expert stacks) whose rows fill whole blocks stored as `qtype`, norms and
    other vectors as F32, as llama.cpp's converter does. `name` is general.name ("mistral" makes a
    Llama file a Mistral one for transformers' loader); `permute` as in `gguf_tensors`; the tensors
    named in `drop` are left out (a broken file)."""
    import gguf

    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    if cfg.vocab_size != len(vocab.tokens):
        raise ValueError(f"model vocab {cfg.vocab_size} != {len(vocab.tokens)} tokens")
    ggml_type = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[ggml_type][0]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name or cfg.model_type)
    w.add_file_type(
        {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16}.get(
            qtype, getattr(gguf.LlamaFileType, f"MOSTLY_{qtype}", gguf.LlamaFileType.GUESSED)
        )
    )
    _add_metadata(w, cfg, arch)
    _add_vocab(w, vocab)
    _add_pad(w, cfg)
    for tensor_name, data in gguf_tensors(model, arch, permute).items():
        if tensor_name in drop:
            continue
        if data.ndim >= 2 and data.shape[-1] % block == 0 and qtype != "F32":
            w.add_tensor(tensor_name, gguf.quants.quantize(data, ggml_type), raw_dtype=ggml_type)
        else:
            w.add_tensor(tensor_name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
