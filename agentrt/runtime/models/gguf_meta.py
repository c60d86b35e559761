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
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

# GGUF architectures whose config transformers' loader builds with more than key renames (or with
# its newer reader): `gguf_hf_config` hands them to `AutoConfig.from_pretrained`, exact but slower.
SPECIAL_GGUF_ARCHS = ("t5", "stablelm", "lfm2", "gpt-oss", "gpt_oss", "minimax-m2", "gemma4", "qwen35")


class StringArray(int):
    """A GGUF string array (a vocabulary, merges) read as its length only."""


@dataclass(frozen=True)
class GgufTensor:
    """One tensor info: `shape` in torch order (rows first), `type_name` the ggml type (Q4_K, F32,
    ...), `nbytes` its bytes in the file (None for a type the gguf package does not know)."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    nbytes: int | None


@dataclass(frozen=True)
class GgufInfo:
    """A GGUF file's metadata (string arrays as StringArray counts) and tensor infos."""

    path: Path
    metadata: dict
    tensors: tuple[GgufTensor, ...]


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_string(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    if pos + 8 + n > len(buf):
        raise ValueError(f"a string of {n} bytes runs past the end of the file")
    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n


def _gguf_value(buf, pos: int, vtype: int):
    if vtype in _SCALARS:
        fmt = "<" + _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == 8:
        return _gguf_string(buf, pos)
    if vtype != 9:
        raise ValueError(f"unknown metadata value type {vtype}")
    etype, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if etype in _SCALARS:
        fmt = f"<{count}{_SCALARS[etype]}"
        return list(struct.unpack_from(fmt, buf, pos)), pos + struct.calcsize(fmt)
    if etype == 8:  # walked, not decoded: a 262k-token vocabulary costs ~0.1 s this way
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        return StringArray(count), pos
    values = []
    for _ in range(count):
        value, pos = _gguf_value(buf, pos, etype)
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
    Raises ValueError naming the file when it is not a GGUF v2/v3 file or is cut short."""
    path = Path(path)
    if path.stat().st_size < 24:
        raise ValueError(f"{path} is not a GGUF file (shorter than a GGUF header)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        try:
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (agentrt reads 2 and 3)")
            pos, metadata = 24, {}
            for _ in range(n_kv):
                key, pos = _gguf_string(buf, pos)
                metadata[key], pos = _gguf_value(buf, pos + 4, struct.unpack_from("<I", buf, pos)[0])
            tensors = []
            for _ in range(n_tensors):
                name, pos = _gguf_string(buf, pos)
                (ndim,) = struct.unpack_from("<I", buf, pos)
                dims = struct.unpack_from(f"<{ndim}Q", buf, pos + 4)
                type_id = struct.unpack_from("<I", buf, pos + 4 + 8 * ndim)[0]
                pos += 4 + 8 * ndim + 12
                type_name, block = _ggml_type(type_id)
                nbytes = prod(dims) // block[0] * block[1] if block else None
                tensors.append(GgufTensor(name, tuple(reversed(dims)), type_name, nbytes))
        except (struct.error, ValueError, OverflowError) as e:
            raise ValueError(f"{path} is not a readable GGUF file: {e}") from None
    return GgufInfo(path, metadata, tuple(tensors))


def gguf_model_type(metadata: dict) -> str:
    """The transformers model_type of a GGUF's `general.architecture` (transformers' GGUF loader's
    renames: a Llama file named "mistral" is Mistral, qwen2moe / qwen3moe / gpt-oss get their
    underscores, gemma3 files hold the text model)."""
    arch = str(metadata.get("general.architecture", ""))
    if "llama" in arch and metadata.get("general.name") == "mistral":
        return "mistral"
    renames = {
        "qwen2moe": "qwen2_moe",
        "qwen3moe": "qwen3_moe",
        "gpt-oss": "gpt_oss",
        "minimax-m2": "minimax_m2",
    }
    model_type = next((new for old, new in renames.items() if old in arch), arch)
    return "gemma3_text" if model_type == "gemma3" else model_type


def gguf_hf_config(info: GgufInfo):
    """The transformers config serve's conversion would write for this GGUF, from its metadata.
    Raises ValueError naming the architecture when transformers cannot read it (then the file
    cannot be converted either)."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    md, arch = info.metadata, str(info.metadata.get("general.architecture", ""))
    if any(s in arch for s in SPECIAL_GGUF_ARCHS):
        return AutoConfig.from_pretrained(str(info.path.parent), gguf_file=info.path.name)
    model_type = gguf_model_type(md)
    updated = model_type.removesuffix("_text")  # the key prefix transformers' mapping uses
    if arch not in GGUF_CONFIG_MAPPING and updated not in GGUF_CONFIG_MAPPING:
        raise ValueError(
            f"GGUF architecture '{arch}' is not one transformers can read (it reads "
            f"{', '.join(k for k in GGUF_CONFIG_MAPPING if k not in ('general', 'tokenizer'))}), so "
            "agentrt cannot convert it"
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
    return AutoConfig.for_model(**config)


def require_supported_gguf(path: Path) -> None:
    """Raises the ValueError `registry.arch_from_hf_config` raises for the config serve would convert
    this GGUF into, from its metadata alone (0.1 s for Gemma 3 270M; 81 s through its conversion);
    ValueError too for a file that is not GGUF or an architecture transformers cannot read. An
    architecture in SPECIAL_GGUF_ARCHS is checked by its family only (its config needs transformers'
    slow reader; the full check runs after the conversion)."""
    from agentrt.runtime.models.registry import MODEL_TYPES, arch_from_hf_config, model_class

    info = read_gguf(path)
    if any(s in str(info.metadata.get("general.architecture", "")) for s in SPECIAL_GGUF_ARCHS):
        model_type = gguf_model_type(info.metadata)
        model_class(MODEL_TYPES.get(model_type, model_type))
        return
    arch_from_hf_config(gguf_hf_config(info))
