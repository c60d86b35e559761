"""Writing the 2026 families' tiny transformers models as GGUF files, as llama.cpp's converter writes
them (its `conversion/*.py`: Qwen3_5TextModel / Qwen3_5MoeTextModel, MiniMaxM2Model, GptOssModel,
SmolLM3Model, Glm4MoeModel), and GGUF files that hold a header only.

`write_family_gguf` follows the converter of the model's family step by step: the hyperparameters
`TextModel.set_gguf_parameters` and the family's own `set_gguf_parameters` write, the changes its
`modify_tensors` makes to each tensor (Qwen3.5: value heads from grouped to tiled order, `1 + w`
norms stored with the one added, `ssm_a = -exp(A_log)`, the conv kernel squeezed; SmolLM3: Llama's
Q/K row permutation; gpt-oss: MXFP4 expert blocks; MoE experts split into ffn_*_exps stacks), then
the gguf package's own HF -> GGUF tensor names. The vocabulary is tests/support/gguf.py's
`TinyVocab`. `header_gguf` writes a file whose metadata names an architecture and nothing else a
loader could use (for the refusals, which must come before any tensor is read).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.support.gguf import TinyVocab, _add_vocab, _rope_theta, permute_qk

# transformers model_type -> GGUF general.architecture
FAMILY_ARCH = {
    "qwen3_5_text": "qwen35",
    "qwen3_5_moe_text": "qwen35moe",
    "minimax_m2": "minimax-m2",
    "gpt_oss": "gpt-oss",
    "smollm3": "smollm3",
    "glm4_moe": "glm4moe",
}
# tensors llama.cpp's converter keeps in F32 whatever the file type (ModelBase.prepare_tensors:
# besides 1-D tensors and biases, the routers, the conv kernels, the sinks)
_F32_TENSORS = (".ffn_gate_inp.", ".ssm_conv1d.", ".attn_sinks.")


def _reorder_v_heads(t: np.ndarray, axis: int, num_k: int, per_k: int, head_dim: int) -> np.ndarray:
    """llama.cpp `_LinearAttentionVReorderBase._reorder_v_heads`: value heads grouped by key head
    [G0_v0.., G1_v0..] to tiled order [G0_v0, G1_v0, ..., G0_v1, ...] along `axis`."""
    shape = list(t.shape)
    axis %= len(shape)
    t = t.reshape(*shape[:axis], num_k, per_k, head_dim, *shape[axis + 1 :])
    return np.swapaxes(t, axis, axis + 1).reshape(shape)


def _qwen35_tensor(cfg, name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Qwen3_5TextModel.modify_tensors: _LinearAttentionVReorderBase, then Qwen3NextModel, then
    Qwen2MoeModel's expert split."""
    num_k, num_v = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, per_k = cfg.linear_key_head_dim, cfg.linear_value_head_dim, num_v // num_k
    if num_k != num_v and "linear_attn." in name:
        if ".in_proj_qkv." in name:
            qk = 2 * dk * num_k
            data = np.concatenate([data[:qk], _reorder_v_heads(data[qk:], 0, num_k, per_k, dv)])
        elif ".in_proj_z." in name:
            data = _reorder_v_heads(data, 0, num_k, per_k, dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name:
            data = _reorder_v_heads(data, 0, num_k, per_k, 1)
        elif ".A_log" in name or ".dt_bias" in name:
            data = _reorder_v_heads(data[:, None], 0, num_k, per_k, 1)[:, 0]
        elif ".conv1d" in name:
            data, qk = data.squeeze(), 2 * dk * num_k
            data = np.concatenate([data[:qk], _reorder_v_heads(data[qk:], 0, num_k, per_k, dv)])
        elif ".out_proj." in name:
            data = _reorder_v_heads(data, 1, num_k, per_k, dv)
    if name.endswith(".A_log"):
        data = -np.exp(data)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        data = data.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        data = data + 1
    return _split_experts(name, data)


def _split_experts(name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Qwen2MoeModel / the converters' MoE handling: a fused gate_up stack [E, 2I, H] becomes the
    gate and up stacks, down_proj [E, H, I] stays, both as `*.weight`."""
    if name.endswith("experts.gate_up_proj"):
        gate, up = np.split(data, 2, axis=1)
        base = name.removesuffix(".gate_up_proj")
        return [(f"{base}.gate_proj.weight", gate), (f"{base}.up_proj.weight", up)]
    if name.endswith("experts.down_proj"):
        return [(f"{name}.weight", data)]
    return [(name, data)]


def _qwen35_metadata(w, cfg) -> None:
    """Qwen3_5TextModel.set_gguf_parameters: TextModel's keys, Qwen2MoeModel's expert widths,
    Qwen3NextModel's ssm / interval / rotary keys, the mrope sections."""
    _text_model_metadata(w, cfg)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(cfg.full_attention_interval)
    factor = cfg.rope_parameters.get("partial_rotary_factor", 0.25)
    w.add_rope_dimension_count(int(cfg.head_dim * factor))
    sections = list(cfg.rope_parameters.get("mrope_section") or [11, 11, 10])
    w.add_rope_dimension_sections((sections + [0] * 4)[:4])


def _text_model_metadata(w, cfg, blocks: int | None = None) -> None:
    """TextModel.set_gguf_parameters for the keys these tiny configs have (`blocks`: the block count
    a converter sets instead of num_hidden_layers)."""
    w.add_block_count(blocks or cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if getattr(cfg, "intermediate_size", None):
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    scoring = getattr(cfg, "scoring_func", None)
    if scoring is not None:
        import gguf

        w.add_expert_gating_func(
            {"sigmoid": gguf.ExpertGatingFuncType.SIGMOID, "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[
                scoring
            ]
        )
    if getattr(cfg, "head_dim", None) is not None:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)


def _minimax_m2_metadata(w, cfg) -> None:
    """MiniMaxM2Model.set_gguf_parameters: TextModel's keys (the sigmoid gating from scoring_func),
    the expert width (its intermediate_size) and the rotary width (rotary_dim)."""
    _text_model_metadata(w, cfg)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.rotary_dim)


def _moe_tensor(cfg, name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """MiniMaxM2Model / Glm4MoeModel.modify_tensors on a transformers 5 state dict: the correction
    bias renamed as the converters' filter_tensors renames it, the experts split into stacks."""
    return _split_experts(name.replace("e_score_correction_bias", "e_score_correction.bias"), data)


def _gpt_oss_metadata(w, cfg) -> None:
    """GptOssModel.set_gguf_parameters: TextModel's keys (YaRN as rope.scaling.*), the window, the
    expert width and counts."""
    import gguf

    _text_model_metadata(w, cfg)
    rope = cfg.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_expert_feed_forward_length(cfg.intermediate_size)


def _gpt_oss_tensor(cfg, name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """GptOssModel: sinks as `attn_sinks.weight`; the experts' interleaved gate/up columns split
    (even columns gate, odd up) and stored out-features-major, as the checkpoint's MXFP4 blocks are
    repacked (transformers 5 keeps [E, H, 2I] / [E, I, H], the checkpoint and the GGUF [E, 2I, H] /
    [E, H, I]); the biases split the same way."""
    if name.endswith("sinks"):
        return [(f"{name}.weight", data)]
    base = name.rsplit(".", 1)[0]
    if name.endswith("experts.gate_up_proj"):
        t = np.swapaxes(data, 1, 2)
        return [(f"{base}.gate_proj.weight", t[:, ::2]), (f"{base}.up_proj.weight", t[:, 1::2])]
    if name.endswith("experts.gate_up_proj_bias"):
        return [(f"{base}.gate_proj.bias", data[:, ::2]), (f"{base}.up_proj.bias", data[:, 1::2])]
    if name.endswith("experts.down_proj"):
        return [(f"{base}.down_proj.weight", np.swapaxes(data, 1, 2))]
    if name.endswith("experts.down_proj_bias"):
        return [(f"{base}.down_proj.bias", data)]
    return [(name, data)]


def _smollm3_metadata(w, cfg) -> None:
    """SmolLM3Model (LlamaModel).set_gguf_parameters: TextModel's keys, the vocabulary size and the
    rotary width; no key for the NoPE layers (llama.cpp fixes every 4th layer)."""
    _text_model_metadata(w, cfg)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(
        cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    )


def _smollm3_tensor(cfg, name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """LlamaModel.modify_tensors: Q and K rows (weights and biases) permuted to interleaved pairs."""
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        data = permute_qk(data, cfg.num_attention_heads)
    elif name.endswith(("k_proj.weight", "k_proj.bias")):
        data = permute_qk(data, cfg.num_key_value_heads)
    return [(name, data)]


def _glm4_moe_metadata(w, cfg) -> None:
    """Glm4MoeModel.set_gguf_parameters: TextModel's keys with the multi-token-prediction layers
    counted as blocks, the rotary width, the expert counts and widths, the leading dense layers, the
    sigmoid gating, the routed scale and renormalisation, the MTP layer count."""
    import gguf

    nextn = cfg.num_nextn_predict_layers
    _text_model_metadata(w, cfg, cfg.num_hidden_layers + nextn)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(int(head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.5)))
    w.add_expert_count(cfg.n_routed_experts)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    w.add_leading_dense_block_count(cfg.first_k_dense_replace)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg.routed_scaling_factor)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    w.add_expert_group_count(cfg.n_group)
    w.add_expert_group_used_count(cfg.topk_group)
    w.add_nextn_predict_layers(nextn)


def _glm4_moe_nextn(model, out: dict[str, np.ndarray]) -> None:
    """The multi-token-prediction block released GLM-4.5 checkpoints hold after their layers
    (`model.layers.{L}.*`), which llama.cpp writes as blk.{L}: here the last layer's tensors again
    and the nextn projections, random (transformers' model has no such block)."""
    cfg = model.config
    last, mtp = f"blk.{cfg.num_hidden_layers - 1}.", f"blk.{cfg.num_hidden_layers}."
    for name in [n for n in out if n.startswith(last)]:
        out[mtp + name.removeprefix(last)] = out[name].copy()
    rng = np.random.default_rng(0)
    h = cfg.hidden_size
    out[f"{mtp}nextn.eh_proj.weight"] = rng.normal(0, 0.1, (h, 2 * h)).astype(np.float32)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        out[f"{mtp}nextn.{norm}.weight"] = np.ones(h, dtype=np.float32)


FAMILIES = {  # model_type -> (metadata writer, tensor changes)
    "qwen3_5_text": (_qwen35_metadata, _qwen35_tensor),
    "qwen3_5_moe_text": (_qwen35_metadata, _qwen35_tensor),
    "minimax_m2": (_minimax_m2_metadata, _moe_tensor),
    "gpt_oss": (_gpt_oss_metadata, _gpt_oss_tensor),
    "smollm3": (_smollm3_metadata, _smollm3_tensor),
    "glm4_moe": (_glm4_moe_metadata, _moe_tensor),
}
EXTRA_TENSORS = {"glm4_moe": _glm4_moe_nextn}  # model_type -> adds tensors the model has not
# the expert stacks llama.cpp writes as MXFP4 whatever the file type (gpt-oss: repacked from the
# checkpoint's own MXFP4 blocks)
MXFP4_TENSORS = {"gpt_oss": ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")}


def _gguf_tensors(model, arch: str, modify) -> dict[str, np.ndarray]:
    import gguf

    cfg = model.config
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for hf_name, tensor in model.state_dict().items():
        for name, data in modify(cfg, hf_name, tensor.detach().float().numpy()):
            new = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if new is None:
                raise ValueError(f"no GGUF name for {name} in the gguf package's {arch} map")
            out[new] = data
    if getattr(cfg, "tie_word_embeddings", False):
        out.pop("output.weight", None)
    if cfg.model_type in EXTRA_TENSORS:
        EXTRA_TENSORS[cfg.model_type](model, out)
    return out


def write_family_gguf(
    model,
    path: Path,
    vocab: TinyVocab,
    qtype: str = "F32",
    drop: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write `model` (a float32 transformers causal LM of a family in FAMILIES) to `path` as llama.cpp's
    converter would, its weight matrices stored as `qtype` (F32, F16, Q8_0, ...; 1-D tensors, biases,
    routers and conv kernels stay F32, as the converter keeps them). The tensors named in `drop` are
    left out and `extra` ones (GGUF name -> float32 array) added: broken files."""
    import gguf

    cfg = model.config
    arch = FAMILY_ARCH[cfg.model_type]
    metadata, modify = FAMILIES[cfg.model_type]
    if cfg.vocab_size != len(vocab.tokens):
        raise ValueError(f"model vocab {cfg.vocab_size} != {len(vocab.tokens)} tokens")
    ggml_type = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[ggml_type][0]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(cfg.model_type)
    metadata(w, cfg)
    _add_vocab(w, vocab)
    mxfp4 = MXFP4_TENSORS.get(cfg.model_type, ())
    tensors = {**_gguf_tensors(model, arch, modify), **(extra or {})}
    for name, data in ((n, d) for n, d in tensors.items() if n not in drop):
        keep = (
            data.ndim < 2
            or not name.endswith(".weight")  # biases (ModelBase.prepare_tensors keeps them F32)
            or any(s in f".{name}" for s in _F32_TENSORS)
            or data.shape[-1] % block
        )
        if name.endswith(mxfp4):
            mx = gguf.GGMLQuantizationType.MXFP4
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data), mx), raw_dtype=mx)
        elif qtype == "F32" or keep:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, ggml_type), raw_dtype=ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def header_gguf(path: Path, arch: str, vocab: TinyVocab, layers: int = 2) -> Path:
    """A GGUF whose metadata names `arch` with a few Llama-like hyperparameters and the vocabulary,
    and whose one tensor (the embedding) is all zeros: enough for a loader to name the architecture,
    nothing to convert."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_head_count(4)
    _add_vocab(w, vocab)
    w.add_tensor("token_embd.weight", np.zeros((len(vocab.tokens), 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


__all__ = ["FAMILY_ARCH", "header_gguf", "permute_qk", "write_family_gguf"]
