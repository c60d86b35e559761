"""GGUF metadata and tensor infos without reading tensor data, and the transformers config serve's
conversion would write for the file.

`read_gguf` memory-maps the file and walks its header with `struct`: string arrays (a vocabulary,
merges) are walked, not decoded. The `gguf` package's GGUFReader builds numpy views per vocabulary
entry: 17.7 s on Gemma 3 270M's 262,144 tokens (2 busy cores), and transformers'
`AutoConfig.from_pretrained(dir, gguf_file=)` parses through it for most architectures (18.9-32 s
measured); `read_gguf` + `gguf_hf_config` take 0.05-0.1 s and give the same config (compared on
SmolLM2 and Gemma 3: equal but for `_name_or_path`). `gguf_hf_config` applies transformers' own GGUF
key renames (`integrations.ggml.GGUF_CONFIG_MAPPING`) as its loader does, and leaves the
architectures whose loader does more than renames (SPECIAL_GGUF_ARCHS) to transformers itself.

transformers' map drops keys llama.cpp writes (a head_dim, an expert width, Phi-3's partial rotary
and window, rope scaling) and reads no rope scaling stored as tensors (Llama 3's `rope_freqs`,
Phi-3's LongRoPE factors): `gguf_hf_config` restores the keys and `rope_from_tensors` the tensors,
and serve's conversion (loader.convert_gguf) builds the model from that config, not from
transformers' own. Tested file by file against the models the GGUFs were written from
(tests/runtime/test_gguf_families.py).
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

# GGUF architectures whose config transformers' loader builds with more than key renames (or with
# its newer reader): `gguf_hf_config` hands them to `AutoConfig.from_pretrained`, exact but slower.
SPECIAL_GGUF_ARCHS = ("t5", "stablelm", "lfm2", "minimax-m2", "gemma4", "qwen35")
# (gpt-oss, smollm3, glm4moe: gguf_renamed.py, which transformers' readers cannot read)

REFUSED_GGUF_ARCHS: dict[str, tuple[str, str]] = {
    "deepseek2": (
        "deepseek_v3: DeepSeek V3, Kimi K2",
        (
            "transformers has no GGUF reader for it, and llama.cpp stores the latent attention in its own "
            "absorbed layout (each layer's kv_b_proj split into a transposed attn_k_b and an attn_v_b, one "
            "KV head of kv_lora_rank + the RoPE width, YaRN's mscale as a log multiplier)"
        ),
    ),
    "qwen3next": (
        "qwen3_next: Qwen3-Next",
        (
            "transformers has no GGUF reader for it (its reader covers Qwen3.5's qwen35 / qwen35moe), and "
            "llama.cpp rewrites the Gated DeltaNet weights (in_proj_qkvz regrouped into attn_qkv and "
            "attn_gate, ssm_a = -exp(A_log), every 1 + w norm stored with the 1 added)"
        ),
    ),
    "gemma4": (
        "gemma4: Gemma 4",
        (
            "transformers' GGUF reader maps only Gemma 4's plain sizes, not the per-layer head sizes and KV "
            "heads, the sliding pattern, KV sharing, the per-layer input embeddings, the MoE block or the "
            "logit softcap llama.cpp writes, so the model it builds is not the file's"
        ),
    ),
    **{
        arch: (
            "nemotron_h: Nemotron-H, NVIDIA Nemotron Nano v2"
            + (" (MoE blocks)" if arch.endswith("moe") else ""),
            (
                "transformers has no GGUF reader for it, and llama.cpp rewrites the Mamba-2 weights "
                "(ssm_a = -exp(A_log), the conv kernel squeezed, the gated norm grouped)"
            ),
        )
        for arch in ("nemotron_h", "nemotron_h_moe")
    },
    "granitehybrid": (
        "granite4: Granite 4.0-H",
        (
            "transformers has no GGUF reader for it, and llama.cpp rewrites the Mamba-2 weights "
            "(ssm_a = -exp(A_log), the conv kernel squeezed, the gated norm grouped) and keeps Granite's "
            "multipliers as keys of its own"
        ),
    ),
}
"""GGUF `general.architecture` -> (agentrt family: the models, why agentrt does not read the file):
the architectures llama.cpp writes for families agentrt runs from safetensors only
(`refuse_unreadable_gguf`)."""


def refuse_unreadable_gguf(metadata: dict) -> None:
    """Raises ValueError for a GGUF whose `general.architecture` is in REFUSED_GGUF_ARCHS, naming
    the architecture, the family, why, and the way out: "GGUF architecture 'qwen3next' (family
    qwen3_next: Qwen3-Next) is not supported: ..., use the safetensors checkpoint". Reads metadata only."""
    arch = str(metadata.get("general.architecture", ""))
    if arch in REFUSED_GGUF_ARCHS:
        family, why = REFUSED_GGUF_ARCHS[arch]
        raise ValueError(
            f"GGUF architecture '{arch}' (family {family}) is not supported: {why}, use the safetensors checkpoint"
        )


class StringArray(int):
    """A GGUF string array (a vocabulary, merges) read as its length only."""


@dataclass(frozen=True)
class GgufTensor:
    """One tensor info: `shape` in torch order (rows first), `type_name` the ggml type (Q4_K, F32,
    ...), `nbytes` its bytes in the file (None for a type the gguf package does not know), `offset`
    where its data starts in the file."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    nbytes: int | None
    offset: int = 0


@dataclass(frozen=True)
class GgufInfo:
    """A GGUF file's metadata (string arrays as StringArray counts) and tensor infos."""

    path: Path
    metadata: dict
    tensors: tuple[GgufTensor, ...]


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32"}
_TYPE_NAMES |= {7: "bool", 8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
# the fewest bytes a value of each type takes in the file: a string is its 8-byte length at least, an
# array its 4-byte element type and 8-byte length
_MIN_BYTES = {**{t: struct.calcsize("<" + f) for t, f in _SCALARS.items()}, 8: 8, 9: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, n_dimensions (0 dims), type, offset


def _check_count(buf, pos: int, count: int, each: int, field: str) -> None:
    """Raises ValueError naming `field` when `count` items of at least `each` bytes (each 1: a
    length in bytes) cannot fit in what is left of the file after byte `pos`: a hostile or corrupt
    count, refused before it is walked or handed to `struct` (whose error names only a buffer size)."""
    left = max(len(buf) - pos, 0)
    if count * each <= left:
        return
    room = f"{left:,} bytes left after byte {pos:,} of its {len(buf):,}"
    if each == 1:
        raise ValueError(f"{field} is {count:,} bytes, but the file has only {room}")
    raise ValueError(
        f"{field} is {count:,}, but the file has only {room}: room for at most {left // each:,} "
        f"(at least {each} bytes each)"
    )


def _unpack(fmt: str, buf, pos: int, field: str) -> tuple:
    """struct.unpack_from, with a ValueError naming `field` when it runs past the end of the file."""
    if pos + struct.calcsize(fmt) > len(buf):
        raise ValueError(f"{field} at byte {pos:,} runs past the end of the file ({len(buf):,} bytes)")
    return struct.unpack_from(fmt, buf, pos)


def _gguf_string(buf, pos: int, field: str) -> tuple[str, int]:
    (n,) = _unpack("<Q", buf, pos, f"the length of {field}")
    _check_count(buf, pos + 8, n, 1, f"the length of {field}")
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n


_MAX_ARRAY_NESTING = 8  # arrays of arrays: gguf-py writes them, llama.cpp reads none


def _gguf_value(buf, pos: int, vtype: int, field: str, depth: int = 0):
    """(value, position after it) of a metadata value of type `vtype` at `pos`; `field` names it in
    errors ("metadata key 'llama.block_count'")."""
    if vtype in _SCALARS:
        fmt = "<" + _SCALARS[vtype]
        return _unpack(fmt, buf, pos, field)[0], pos + struct.calcsize(fmt)
    if vtype == 8:
        return _gguf_string(buf, pos, field)
    if vtype != 9:
        raise ValueError(f"{field} has unknown value type {vtype}")
    etype, count = _unpack("<IQ", buf, pos, f"the array header of {field}")
    pos += 12
    if etype not in _MIN_BYTES:
        raise ValueError(f"{field} is an array of unknown value type {etype}")
    _check_count(buf, pos, count, _MIN_BYTES[etype], f"the array length of {field} ({_TYPE_NAMES[etype]})")
    if etype in _SCALARS:
        fmt = f"<{count}{_SCALARS[etype]}"
        return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
    if etype == 8:  # walked, not decoded: a 262k-token vocabulary costs ~0.1 s this way
        try:
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        except struct.error:
            pos = len(buf) + 1
        if pos > len(buf):
            raise ValueError(
                f"the strings of {field} ({count:,}) run past the end of the file ({len(buf):,} bytes)"
            )
        return StringArray(count), pos
    if depth >= _MAX_ARRAY_NESTING:
        raise ValueError(f"{field} nests arrays more than {_MAX_ARRAY_NESTING} deep")
    values = []
    for i in range(count):
        value, pos = _gguf_value(buf, pos, etype, f"{field}[{i}]", depth + 1)
        values.append(value)
    return values, pos


def _ggml_type(type_id: int) -> tuple[str, tuple[int, int] | None]:
    """(name, (block elements, block bytes)) of a ggml tensor type, from the gguf package."""
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        return f"ggml type {type_id}", None
    return qtype.name, gguf.GGML_QUANT_SIZES.get(qtype)


def read_gguf(path: Path) -> GgufInfo:
    """Metadata and tensor infos of a GGUF file (memory-mapped; tensor data is never touched).

    Raises ValueError naming the file when it is not a GGUF v2/v3 file, and naming the field when a
    count, length or offset of the header does not fit in the file (a corrupt or hostile file): the
    header's tensor_count or metadata_kv_count, a string's or an array's length, a tensor's
    n_dimensions, or a tensor whose data runs past the end, with the file size (bytes) it had to fit."""
    path = Path(path)
    if path.stat().st_size < 24:
        raise ValueError(f"{path} is not a GGUF file (shorter than a GGUF header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        try:
            metadata, tensors = _read_header(buf)
        except (struct.error, ValueError, OverflowError) as e:
            raise ValueError(f"{path} is not a readable GGUF file: {e}") from None
    return GgufInfo(path, metadata, tensors)


# The first layer's projection weights, which the conversion names *.layers.0.*proj.weight (the
# tensors formats.four_bit_layers reads): attention q/k/v/qkv/output, MLP gate/up/down (experts' and shared experts' too).
_FIRST_LAYER_PROJECTIONS = re.compile(
    r"blk\.0\.(attn_(q|k|v|qkv|output)|ffn_(gate|up|down)(_exps|_shexp)?)\.weight"
)


def gguf_four_bit_layers(info: GgufInfo) -> bool:
    """formats.four_bit_layers' answer for the directory serve's conversion would write from this
    GGUF, from the tensor types alone (no tensor data read, nothing converted): True when the first
    layer has projection weights and every one is Q4_1. A Q4_1 block (32 values, a float16 scale and
    minimum, 16 levels) de-quantizes to values int4_levels gives back exactly; Q4_0 (a scale and the
    fixed offset -8) and the K-quants do not, since their blocks seldom span all 16 levels (measured:
    random weights through gguf's Q4_0 come back with a max error of 0.21 against four_bit_layers'
    tolerance of 4e-5; Gemma 3 270M's Q4_K attn_output 0.028 against 5e-6), so they plan as not 4-bit,
    as serve plans them after converting."""
    types = [t.type_name for t in info.tensors if _FIRST_LAYER_PROJECTIONS.fullmatch(t.name)]
    return bool(types) and all(t == "Q4_1" for t in types)


def _read_header(buf) -> tuple[dict, tuple[GgufTensor, ...]]:
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (agentrt reads 2 and 3)")
    _check_count(buf, 24, n_kv, _MIN_KV_BYTES, "the header's metadata_kv_count")
    _check_count(buf, 24, n_tensors, _MIN_TENSOR_INFO_BYTES, "the header's tensor_count")
    pos, metadata = 24, {}
    for i in range(n_kv):
        key, pos = _gguf_string(buf, pos, f"the key of metadata entry {i}")
        (vtype,) = _unpack("<I", buf, pos, f"the value type of metadata key '{key}'")
        metadata[key], pos = _gguf_value(buf, pos + 4, vtype, f"metadata key '{key}'")
    _check_count(buf, pos, n_tensors, _MIN_TENSOR_INFO_BYTES, "the header's tensor_count")
    infos = []
    for i in range(n_tensors):
        name, pos = _gguf_string(buf, pos, f"the name of tensor {i}")
        (ndim,) = _unpack("<I", buf, pos, f"n_dimensions of tensor '{name}'")
        _check_count(buf, pos + 4, ndim, 8, f"n_dimensions of tensor '{name}'")
        dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
        type_id, offset = _unpack("<IQ", buf, pos + 4 + 8 * ndim, f"the type and offset of tensor '{name}'")
        pos += 4 + 8 * ndim + 12
        infos.append((name, dims, type_id, offset))
    align = metadata.get("general.alignment", 32)
    if type(align) is not int or align < 1:
        raise ValueError(f"metadata key 'general.alignment' is {align!r}, not a positive number of bytes")
    data_start = -(-pos // align) * align
    tensors = []
    for name, dims, type_id, offset in infos:
        type_name, block = _ggml_type(type_id)
        nbytes = prod(dims) // block[0] * block[1] if block else None
        if data_start + offset + (nbytes or 0) > len(buf):
            raise ValueError(
                f"the data of tensor '{name}' ({type_name} {list(reversed(dims))}: {nbytes or 0:,} bytes at "
                f"byte {data_start + offset:,}) runs past the end of the file ({len(buf):,} bytes)"
            )
        tensors.append(GgufTensor(name, tuple(reversed(dims)), type_name, nbytes, data_start + offset))
    return metadata, tuple(tensors)


def gguf_model_type(metadata: dict) -> str:
    """The transformers model_type of a GGUF's `general.architecture` (transformers' GGUF loader's
    renames: qwen2moe / qwen3moe / gpt-oss get their underscores, gemma3 files hold the text model;
    its newer reader's: qwen35 / qwen35moe are Qwen3.5's text models).

    llama.cpp writes Mistral models as `llama` and runs them as Llama, with no sliding window (it has
    no key for one). transformers' loader makes a Llama file whose general.name is exactly
    "mistral" a Mistral config, then cannot map its tensors (gguf-py has no "mistral"
    architecture: NotImplementedError after the config is built, transformers 5.x), and its
    MistralConfig would add a default 4096-token window. Such a file is converted as the Llama it
    is."""
    arch = str(metadata.get("general.architecture", ""))
    renames = {
        "qwen2moe": "qwen2_moe",
        "qwen3moe": "qwen3_moe",
        "qwen35moe": "qwen3_5_moe_text",  # before qwen35, which it contains
        "qwen35": "qwen3_5_text",
        "gpt-oss": "gpt_oss",
        "minimax-m2": "minimax_m2",
    }
    model_type = next((new for old, new in renames.items() if old in arch), arch)
    return "gemma3_text" if model_type == "gemma3" else model_type


def gguf_hf_config(info: GgufInfo):
    """The transformers config serve's conversion would write for this GGUF, from its metadata (for
    the architectures of gguf_renamed.py, agentrt's own). Raises ValueError naming the architecture
    when it is refused (REFUSED_GGUF_ARCHS, saying why) or neither transformers nor agentrt can read
    it (then the file cannot be converted either)."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    from agentrt.runtime.models.gguf_renamed import RENAMED_GGUF_ARCHS, is_renamed, renamed_hf_config

    md, arch = info.metadata, str(info.metadata.get("general.architecture", ""))
    refuse_unreadable_gguf(md)
    if is_renamed(md):
        return renamed_hf_config(info)
    if any(s in arch for s in SPECIAL_GGUF_ARCHS):
        return AutoConfig.from_pretrained(str(info.path.parent), gguf_file=info.path.name)
    model_type = gguf_model_type(md)
    updated = model_type.removesuffix("_text")  # the key prefix transformers' mapping uses
    if arch not in GGUF_CONFIG_MAPPING and updated not in GGUF_CONFIG_MAPPING:
        raise ValueError(
            f"GGUF architecture '{arch}' is not one transformers can read (it reads "
            f"{', '.join(k for k in GGUF_CONFIG_MAPPING if k not in ('general', 'tokenizer'))}, qwen35, "
            f"qwen35moe; agentrt itself reads {', '.join(RENAMED_GGUF_ARCHS)}), so agentrt cannot convert it"
        )
    experts = md.get(f"{arch}.expert_count")
    if arch == "llama" and experts:
        raise ValueError(
            f"GGUF architecture 'llama' with {experts} experts (Mixtral): transformers' GGUF loader maps "
            "no expert tensors for it (it would build a dense Llama with random MLPs), so agentrt cannot "
            "convert it; serve the Hugging Face safetensors checkpoint instead"
        )
    names = {t.name for t in info.tensors}
    config = {"tie_word_embeddings": "output.weight" not in names or arch in ("falcon", "bloom")}
    config.update(GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}))
    for key, value in md.items():
        prefix, _, rest = key.replace(arch, updated).partition(".")
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if target in (None, -1) or isinstance(value, StringArray):
            continue
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        config[target] = value.replace(arch, updated) if isinstance(value, str) else value
    config["model_type"] = model_type
    if "vocab_size" not in config and isinstance(md.get("tokenizer.ggml.tokens"), StringArray):
        config["vocab_size"] = int(md["tokenizer.ggml.tokens"])
    _restore_dropped_keys(md, arch, model_type, config)
    return AutoConfig.for_model(**config)


def _restore_dropped_keys(md: dict, arch: str, model_type: str, config: dict) -> None:
    """Hyperparameters llama.cpp's converter writes but transformers' GGUF key map (5.x) drops, so
    that the config class's default stands in for them: a Qwen3 head_dim other than the default 128
    or a Qwen3-MoE expert width other than 768 fails to load (shape mismatch); a Phi-3 partial
    rotary dimension or sliding window, or a linear / YaRN rope scaling, would be silently lost.
    Only what the file states is set, and nothing transformers already read is changed."""

    def key(name: str):
        return md.get(f"{arch}.{name}")

    if "head_dim" not in config and key("attention.key_length"):
        config["head_dim"] = int(key("attention.key_length"))
    if model_type == "qwen3_moe" and key("expert_feed_forward_length"):
        config["moe_intermediate_size"] = int(key("expert_feed_forward_length"))
    if model_type == "phi3":
        if key("rope.dimension_count"):  # Phi-4-mini rotates 3/4 of each head
            head_dim = config["hidden_size"] // config["num_attention_heads"]
            config["partial_rotary_factor"] = int(key("rope.dimension_count")) / head_dim
        if key("attention.sliding_window"):  # 0: none (Phi-4)
            config["sliding_window"] = int(key("attention.sliding_window"))
    scaling = key("rope.scaling.type")
    if scaling in ("linear", "yarn") and key("rope.scaling.factor"):
        rope = {"rope_type": scaling, "factor": float(key("rope.scaling.factor"))}
        if key("rope.scaling.original_context_length"):
            rope["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
        for name in ("beta_fast", "beta_slow"):
            if key(f"rope.scaling.yarn_{name}"):
                rope[name] = float(key(f"rope.scaling.yarn_{name}"))
        config["rope_scaling"] = rope


def _f32_tensor(info: GgufInfo, name: str):
    """The F32 tensor `name` of the file as a float64 numpy vector, or None when absent. Raises
    ValueError when it is stored in another type."""
    import numpy as np

    t = next((t for t in info.tensors if t.name == name), None)
    if t is None:
        return None
    if t.type_name != "F32":
        raise ValueError(f"{info.path.name}: {name} is {t.type_name}, not F32")
    count = prod(t.shape)
    return np.fromfile(info.path, dtype="<f4", count=count, offset=t.offset).astype(np.float64)


def rope_from_tensors(info: GgufInfo, config) -> None:
    """Set on `config` (the file's transformers config) the rope scaling llama.cpp stores as tensors,
    which transformers' GGUF loader skips (it maps no tensor to them): a Llama 3.x `rope_freqs`
    (llama3 scaling: the per-frequency divisors) and Phi-3's `rope_factors_short` / `_long`
    (LongRoPE). Reads those vectors' data only (a few hundred bytes). Raises ValueError when the
    `rope_freqs` of a Llama file is not one llama3 scaling reproduces."""
    if config.model_type == "phi3":
        short = _f32_tensor(info, "rope_factors_short.weight")
        long = _f32_tensor(info, "rope_factors_long.weight")
        if short is not None and long is not None:
            original = info.metadata.get("phi3.rope.scaling.original_context_length")
            config.rope_parameters = {
                **config.rope_parameters,
                "rope_type": "longrope",
                "short_factor": short.tolist(),
                "long_factor": long.tolist(),
                **({"original_max_position_embeddings": int(original)} if original else {}),
            }
            if original:
                config.original_max_position_embeddings = int(original)
        return
    freqs = _f32_tensor(info, "rope_freqs.weight") if config.model_type == "llama" else None
    if freqs is not None and freqs.max() > 1 + 1e-6:
        original = info.metadata.get("llama.rope.scaling.original_context_length")
        if not original:  # Llama 3's, or half the context of a smaller model
            original = min(8192, config.max_position_embeddings // 2)
        try:
            rope = _llama3_rope(config, freqs, int(original))
        except ValueError as e:
            raise ValueError(f"{info.path.name}: {e}") from None
        config.rope_parameters = {**config.rope_parameters, **rope}


def _llama3_rope(config, divisors, original: int) -> dict:
    """The llama3 rope parameters whose frequency divisors are `divisors` (llama.cpp's
    `rope_freqs`: 1 for high frequencies, `factor` for low ones, a smooth ramp between). The ramp
    `s = (L / wavelength - low) / (high - low)` fixes only L / (high - low) and low / (high - low),
    so L is `original` and low / high are solved from the ramp (any L gives the same frequencies).
    Checked against transformers' own llama3 frequencies."""
    import numpy as np
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta = float(config.rope_parameters.get("rope_theta", getattr(config, "default_theta", 10000.0)))
    dim = 2 * len(divisors)
    wavelength = 2 * np.pi * theta ** (np.arange(0, dim, 2) / dim)
    factor = float(divisors.max())
    ramp = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if ramp.sum() < 2:
        raise ValueError(
            f"rope_freqs has {int(ramp.sum())} frequencies between 1 and its factor {factor:g}: "
            "agentrt recovers llama3 rope scaling from at least 2"
        )
    smooth = (1 / divisors[ramp] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(1 / wavelength[ramp], smooth, 1)  # slope = L/(high-low)
    low = -intercept * original / slope
    rope = {
        "rope_type": "llama3",
        "factor": round(factor, 6),
        "low_freq_factor": round(low, 6),
        "high_freq_factor": round(low + original / slope, 6),
        "original_max_position_embeddings": original,
    }
    check = type(config).from_dict({**config.to_dict(), "rope_parameters": {"rope_theta": theta, **rope}})
    ours = ROPE_INIT_FUNCTIONS["llama3"](check, torch.device("cpu"))[0].double().numpy()
    expected = (1 / theta ** (np.arange(0, dim, 2) / dim)) / divisors
    if not np.allclose(ours, expected, rtol=1e-4):
        raise ValueError("rope_freqs is not a llama3 rope scaling agentrt can reproduce")
    return rope


def require_supported_gguf(path: Path):
    """The config serve's conversion builds the model from (gguf_hf_config; None for an architecture
    in SPECIAL_GGUF_ARCHS, whose config transformers builds). Raises the ValueError
    `registry.arch_from_hf_config` raises for that config, from the metadata alone (0.1 s for Gemma 3
    270M; 81 s through its conversion); ValueError too for a file that is not GGUF or an
    architecture transformers cannot read. An architecture in SPECIAL_GGUF_ARCHS is checked by its
    family only (its config needs transformers' slow reader; the full check runs after the
    conversion)."""
    from agentrt.runtime.models.registry import MODEL_TYPES, arch_from_hf_config, model_class

    info = read_gguf(path)
    refuse_unreadable_gguf(info.metadata)
    if any(s in str(info.metadata.get("general.architecture", "")) for s in SPECIAL_GGUF_ARCHS):
        model_type = gguf_model_type(info.metadata)
        model_class(MODEL_TYPES.get(model_type, model_type))
        return None
    config = gguf_hf_config(info)
    arch_from_hf_config(config)
    return config
