"""GGUF architectures transformers' GGUF readers cannot read, whose llama.cpp layout agentrt undoes
itself because it is a renaming: SmolLM3 (`smollm3`), GLM-4.5-4.7 (`glm4moe`) and gpt-oss (`gpt-oss`).

transformers 5.25 has no reader for `smollm3` and `glm4moe`, and its reader of `gpt-oss` fails on
every file llama.cpp writes (it converts the YaRN keys' raw field parts with `float()`: "only
0-dimensional arrays can be converted to Python scalars"). What llama.cpp's converter does to these
families is a renaming plus a fixed reshaping, undone here tensor by tensor:

- names: the gguf package's own HF -> GGUF map (`gguf.get_tensor_name_map`, llama.cpp's), inverted
  over the names of the transformers model the config builds;
- SmolLM3 (`SmolLM3Model(LlamaModel)`): Q and K rows permuted to interleaved rotary pairs, undone;
  the NoPE layers are llama.cpp's fixed every 4th (`n_no_rope_layer_step`), transformers' default
  `no_rope_layer_interval`;
- GLM-4 MoE (`Glm4MoeModel`): experts stacked per projection (gate and up fused back), the correction
  bias as `exp_probs_b.bias`; the multi-token-prediction block that follows the layers
  (`nextn_predict_layers`) is not read, as transformers reads none;
- gpt-oss (`GptOssModel`): the experts' interleaved gate/up columns split into two stacks stored
  out-features-major (MXFP4 blocks, de-quantized by the gguf package), the biases split alike; the
  sinks as `attn_sinks.weight`. The file has no key for YaRN's `truncate`: every gpt-oss checkpoint
  sets it false, and so does the config built here.

Each tensor of the file is read once and de-quantized by the gguf package (`gguf.quants.dequantize`,
K-quants and MXFP4 included) into float32. A tensor the model has no place for, or a weight the file
does not hold, raises ValueError naming it: nothing is guessed or left at random.
"""

from __future__ import annotations

from math import prod

import numpy as np

RENAMED_GGUF_ARCHS = ("smollm3", "glm4moe", "gpt-oss")
_MODEL_TYPES = {"smollm3": "smollm3", "glm4moe": "glm4_moe", "gpt-oss": "gpt_oss"}


def is_renamed(metadata: dict) -> bool:
    """Whether the GGUF's architecture is one this module converts."""
    return str(metadata.get("general.architecture", "")) in RENAMED_GGUF_ARCHS


class _Metadata:
    """A GGUF's `<arch>.*` keys (a one-element array read as its element) and tensor names."""

    def __init__(self, info) -> None:
        self.md, self.arch = info.metadata, str(info.metadata["general.architecture"])
        self.names = {t.name for t in info.tensors}

    def get(self, name: str, default=None):
        value = self.md.get(f"{self.arch}.{name}", default)
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    def need(self, name: str):
        """The key's value; ValueError naming it when the file has none."""
        value = self.get(name)
        if value is None:
            raise ValueError(f"GGUF architecture '{self.arch}': the metadata has no '{self.arch}.{name}'")
        return value


def renamed_hf_config(info):
    """The transformers config of a GGUF (gguf_meta.GgufInfo) in RENAMED_GGUF_ARCHS, from its
    metadata and tensor names (a bias or a q/k norm is there or not). Raises ValueError naming a
    missing key, or a value transformers' model cannot take (GLM-4 MoE's gating other than sigmoid;
    a SmolLM3 key length other than hidden / heads)."""
    from transformers import AutoConfig

    m = _Metadata(info)
    tokens = m.md.get("tokenizer.ggml.tokens")  # gguf_meta.StringArray: the vocabulary's length
    config = {
        "vocab_size": int(m.get("vocab_size") or (int(tokens) if isinstance(tokens, int) else 0)),
        "max_position_embeddings": int(m.need("context_length")),
        "hidden_size": int(m.need("embedding_length")),
        "num_hidden_layers": int(m.need("block_count")),
        "num_attention_heads": int(m.need("attention.head_count")),
        "num_key_value_heads": int(m.get("attention.head_count_kv") or m.need("attention.head_count")),
        "rms_norm_eps": float(m.need("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in m.names,
        "bos_token_id": m.md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": m.md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": m.md.get("tokenizer.ggml.padding_token_id"),
        "rope_parameters": _rope(m),
    }
    if m.get("feed_forward_length") is not None:
        config["intermediate_size"] = int(m.get("feed_forward_length"))
    head_dim = int(m.get("attention.key_length") or config["hidden_size"] // config["num_attention_heads"])
    family = {"smollm3": _smollm3, "glm4moe": _glm4moe, "gpt-oss": _gpt_oss}[m.arch]
    return AutoConfig.for_model(_MODEL_TYPES[m.arch], **family(m, config, head_dim))


def _rope(m: _Metadata) -> dict:
    """rope_parameters from rope.freq_base and a linear / YaRN rope.scaling.*."""
    rope = {"rope_type": "default", "rope_theta": float(m.get("rope.freq_base", 10000.0))}
    scaling = m.get("rope.scaling.type")
    if scaling in ("linear", "yarn") and m.get("rope.scaling.factor"):
        rope |= {"rope_type": scaling, "factor": float(m.get("rope.scaling.factor"))}
        if m.get("rope.scaling.original_context_length"):
            rope["original_max_position_embeddings"] = int(m.get("rope.scaling.original_context_length"))
        for name in ("beta_fast", "beta_slow"):
            if m.get(f"rope.scaling.yarn_{name}") is not None:
                rope[name] = float(m.get(f"rope.scaling.yarn_{name}"))
    return rope


def _smollm3(m: _Metadata, config: dict, head_dim: int) -> dict:
    if head_dim * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError(
            f"GGUF architecture 'smollm3': key length {head_dim} x {config['num_attention_heads']} heads "
            f"is not the hidden size {config['hidden_size']} (SmolLM3's head size is hidden / heads)"
        )
    return config | {
        "attention_bias": "blk.0.attn_q.bias" in m.names,
        "mlp_bias": "blk.0.ffn_up.bias" in m.names,
        "no_rope_layer_interval": 4,  # llama.cpp's n_no_rope_layer_step for smollm3
    }


def _glm4moe(m: _Metadata, config: dict, head_dim: int) -> dict:
    gating = m.get("expert_gating_func", 2)
    if gating != 2:  # gguf.ExpertGatingFuncType.SIGMOID
        raise ValueError(
            f"GGUF architecture 'glm4moe': expert_gating_func {gating}, GLM-4 MoE's is 2 (sigmoid)"
        )
    nextn = int(m.get("nextn_predict_layers", 0))
    rotary = int(m.get("rope.dimension_count", head_dim // 2)) / head_dim
    return config | {
        "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": rotary},
        "num_hidden_layers": config["num_hidden_layers"] - nextn,  # the MTP block counts as blocks
        "num_nextn_predict_layers": nextn,
        "head_dim": head_dim,
        "n_routed_experts": int(m.need("expert_count")),
        "num_experts_per_tok": int(m.need("expert_used_count")),
        "moe_intermediate_size": int(m.need("expert_feed_forward_length")),
        "n_shared_experts": int(m.get("expert_shared_count", 0)),
        "first_k_dense_replace": int(m.get("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(m.get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
        "n_group": int(m.get("expert_group_count", 1)),
        "topk_group": int(m.get("expert_group_used_count", 1)),
        "attention_bias": "blk.0.attn_q.bias" in m.names,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in m.names,
    }


def _gpt_oss(m: _Metadata, config: dict, head_dim: int) -> dict:
    """llama.cpp's fixed swa pattern 2 (layer 0 windowed); YaRN without truncation."""
    rope = config["rope_parameters"]
    n = config["num_hidden_layers"]
    return config | {
        "rope_parameters": rope | ({"truncate": False} if rope["rope_type"] == "yarn" else {}),
        "head_dim": head_dim,
        "num_local_experts": int(m.need("expert_count")),
        "num_experts_per_tok": int(m.need("expert_used_count")),
        "sliding_window": int(m.need("attention.sliding_window")),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
    }


def _dequantize(info, t) -> np.ndarray:
    """Tensor `t` (gguf_meta.GgufTensor) of the file as float32 in torch order (rows first)."""
    import gguf

    if t.nbytes is None:
        raise ValueError(
            f"{info.path.name}: tensor '{t.name}' is of {t.type_name}, which the gguf package cannot read"
        )
    raw = np.memmap(info.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.nbytes,))
    rows = prod(t.shape[:-1])
    data = gguf.quants.dequantize(raw.reshape(rows, t.nbytes // rows), gguf.GGMLQuantizationType[t.type_name])
    return np.asarray(data, dtype=np.float32).reshape(t.shape)


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of llama.cpp's `LlamaModel.permute` (interleaved rotary pairs -> halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def renamed_state_dict(info, config) -> dict:
    """The weights of a GGUF (gguf_meta.GgufInfo) in RENAMED_GGUF_ARCHS as the transformers model of
    `config` names them (float32 torch tensors), llama.cpp's reshaping undone. Raises ValueError
    naming the weights the file does not hold, the file's tensors the model has no place for, or a
    shape that differs."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    arch = str(info.metadata["general.architecture"])
    with torch.device("meta"):
        expected = {
            k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()
        }
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    # the name map spans the multi-token-prediction block too, so that its tensors are recognised
    layers = config.num_hidden_layers + getattr(config, "num_nextn_predict_layers", 0)
    name_map = gguf.get_tensor_name_map(arch_id, layers)
    tensors = {t.name: t for t in info.tensors}
    used: set[str] = set()

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise KeyError(name)
        used.add(name)
        return _dequantize(info, tensors[name])

    state, missing = {}, []
    for hf_name, shape in expected.items():
        try:
            data = _hf_tensor(arch, config, hf_name, get, name_map)
        except KeyError:
            missing.append(hf_name)
            continue
        if tuple(data.shape) != shape:
            raise ValueError(
                f"{info.path.name}: {hf_name} is {list(data.shape)} in the file, the model's is {list(shape)}"
            )
        state[hf_name] = torch.from_numpy(np.array(data, dtype=np.float32, order="C"))  # off the file's map
    if missing:
        shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise ValueError(f"{info.path.name}: the file holds no tensor for {len(missing)} weights ({shown})")
    nextn = {f"blk.{i}." for i in range(config.num_hidden_layers, layers)}
    unused = sorted(n for n in tensors if n not in used and not n.startswith(tuple(nextn)))
    if unused:
        shown = ", ".join(unused[:4]) + (", ..." if len(unused) > 4 else "")
        raise ValueError(f"{info.path.name}: {len(unused)} tensors have no place in the model ({shown})")
    return state


def _hf_tensor(arch: str, cfg, hf_name: str, get, name_map) -> np.ndarray:
    """The weight `hf_name` from the file's tensors (`get(gguf_name)`, KeyError when absent)."""
    layer, _, leaf = hf_name.partition(".mlp.experts.")
    if leaf:  # stacked experts: [E, 2I, H] / [E, H, I] (GLM), gpt-oss [E, H, 2I] / [E, I, H] + biases
        bid = layer.rsplit(".", 1)[1]
        exps = f"blk.{bid}.ffn_{{}}_exps.{{}}"
        suffix = "bias" if leaf.endswith("_bias") else "weight"
        if leaf.startswith("gate_up_proj"):
            gate, up = get(exps.format("gate", suffix)), get(exps.format("up", suffix))
            if arch != "gpt-oss":
                return np.concatenate([gate, up], axis=1)
            out = np.empty(
                (*gate.shape[:-1], 2 * gate.shape[-1])
                if suffix == "bias"
                else (gate.shape[0], gate.shape[2], 2 * gate.shape[1]),
                dtype=np.float32,
            )
            if suffix == "weight":
                gate, up = gate.swapaxes(1, 2), up.swapaxes(1, 2)
            out[..., ::2], out[..., 1::2] = gate, up
            return out
        down = get(exps.format("down", suffix))
        return down.swapaxes(1, 2) if arch == "gpt-oss" and suffix == "weight" else down
    if hf_name.endswith("e_score_correction_bias"):
        return get(f"blk.{hf_name.split('.')[2]}.exp_probs_b.bias")
    if hf_name.endswith(".sinks"):
        return get(f"{name_map.get_name(hf_name)}.weight")
    gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
        raise KeyError(hf_name)
    data = get(gguf_name)
    if arch == "smollm3" and ".self_attn.q_proj." in hf_name:
        data = _unpermute_qk(data, cfg.num_attention_heads)
    elif arch == "smollm3" and ".self_attn.k_proj." in hf_name:
        data = _unpermute_qk(data, cfg.num_key_value_heads)
    return data
