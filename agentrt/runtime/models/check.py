"""What serving a model would run into, found before any weight is read: the library of
`agentrt check MODEL`, whose command (agentrt/commands/check.py) composes these pieces with the
chat template's check as the API renders requests (this module never imports agentrt.api).

Three layers, each a list of findings (ok / warning / error):

1. architecture: the family `registry.arch_from_hf_config` picks, or its ValueError naming what is
   missing;
2. weights, tokenizer and chat template: every weight's name and shape as serve's load checks them
   (a Hugging Face directory's headers through `DecoderModel.load_hf_state_dict` on the meta device:
   the same code, no data), the tokenizer loads, its largest id fits the embedding rows, the
   embedding / LM head shapes agree with the config (tied or not), the call format and reasoning
   format the template implies, the template rendered on sample conversations within its budget
   as serve renders requests (agentrt/commands/check.py over api/template_check.py: serve refuses
   to start on its errors), BOS / EOS and every stop id;
3. weights and memory: bytes per storage format, KV bytes per token at the run dtype (sliding-window
   layers counted with their window) and how many --max-model-len sequences the KV budget holds.

Only config.json / GGUF metadata, tokenizer files and safetensors headers / GGUF tensor infos are
read, never tensor data, and a GGUF is never converted (its metadata through gguf_meta.py, its
tokenizer built from the metadata as serve's conversion builds it: 8 s for all of Gemma 3 270M).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

from agentrt.runtime.models.check_memory import capacity, kv_estimate
from agentrt.runtime.models.check_report import (
    ERROR,
    OK,
    WARNING,
    Capacity,
    CheckReport,
    Finding,
    KVEstimate,
)
from agentrt.runtime.models.checkpoint_quant import checkpoint_tensors, loaded_elements
from agentrt.runtime.models.config import check_config_counts
from agentrt.runtime.models.gguf_meta import StringArray, gguf_four_bit_layers, gguf_hf_config, read_gguf

__all__ = [
    "Capacity",
    "CheckReport",
    "Finding",
    "KVEstimate",
    "ModelFiles",
    "capacity",
    "check_special_tokens",
    "check_tokenizer",
    "kv_estimate",
    "read_model",
    "reasoning_format",
    "safetensors_headers",
    "template_text",
]

REASONING_FORMATS = (  # (text in the chat template, the reasoning format it implies), first match wins
    ("<|channel|>", "harmony (gpt-oss)"),
    ("<|channel>", "gemma4 thought channel (<|channel>thought...<channel|>)"),
    ("[THINK]", "[THINK] (Magistral)"),
    ("<think>", "think tags (<think>...</think>)"),
)

SAFETENSORS_DTYPES = {  # a safetensors header's dtype -> torch's name; others are read as float32
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U8": "uint8",
    "I8": "int8",
    "I32": "int32",
    "I64": "int64",
}

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "vocab.txt")


# ---- pure pieces --------------------------------------------------------------------------------


EMBEDDING_NAMES = ("embed_tokens.weight", "backbone.embeddings.weight")
"""How safetensors checkpoints name the token embedding (the latter: Nemotron-H's `backbone.`)."""


def reasoning_format(template: str | None) -> str:
    """The reasoning format a chat template implies (REASONING_FORMATS), or "none"."""
    return next((name for marker, name in REASONING_FORMATS if marker in (template or "")), "none")


def safetensors_headers(model_dir: Path) -> tuple[dict[str, dict], list[str]]:
    """({tensor name: {"dtype", "shape", "nbytes", "file"}}, problems) from the headers of the
    *.safetensors files of `model_dir` (8-byte length + JSON; no tensor data is read). A problem
    names the file: not a safetensors file, or shorter than its header says (cut short)."""
    tensors: dict[str, dict] = {}
    problems = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= min(size - 8, 100 << 20):
                problems.append(f"{path.name} is not a safetensors file (no valid header length)")
                continue
            try:
                header = json.loads(f.read(n))
            except (ValueError, UnicodeDecodeError):
                problems.append(f"{path.name} has a header that is not JSON")
                continue
        header.pop("__metadata__", None)
        end = 0
        for name, t in header.items():
            start, stop = t["data_offsets"]
            end = max(end, stop)
            tensors[name] = {
                "dtype": t["dtype"],
                "shape": tuple(t["shape"]),
                "nbytes": stop - start,
                "file": path.name,
            }
        if 8 + n + end > size:
            problems.append(f"{path.name} is cut short: {size} bytes, its header describes {8 + n + end}")
    return tensors, problems


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def _formats(bytes_by_format: dict[str, int]) -> str:
    return ", ".join(f"{k} {_mb(v)}" for k, v in sorted(bytes_by_format.items(), key=lambda kv: -kv[1]))


def template_text(template) -> str | None:
    """A tokenizer's chat_template as one text: itself, None, or the JSON of several named ones."""
    if template is None or isinstance(template, str):
        return template
    return json.dumps(template)  # several named templates


# ---- the check ----------------------------------------------------------------------------------


@dataclass
class ModelFiles:
    """What `read_model` read: the config, the tokenizer, the weight headers, and the family
    (`arch`, a ModelArch, None when it could not be told) with the config's vocab size. `path`: the
    Hugging Face directory or the GGUF file; `four_bit`: a GGUF's first-layer projections are Q4_1
    (gguf_meta.gguf_four_bit_layers: what `--quantization auto` asks), None for a directory (the run
    plan reads its first layer as serve does)."""

    config: object = None
    tokenizer: object = None
    stop_dir: Path | None = None
    tensors: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)  # name -> (shape, elements)
    embed: str | None = None
    head: str | None = None
    arch: object = None
    vocab: int | None = None
    path: Path | None = None
    four_bit: bool | None = None
    dtypes: dict[str, str] = field(default_factory=dict)  # name -> safetensors dtype (a directory's)


def _locate(model: str, report: CheckReport) -> tuple[str, Path] | None:
    """("gguf" | "hf", path) of `model`, or None after adding the error that says why not."""
    from agentrt.runtime.models.loader import (
        PICKLE_SUFFIXES,
        REGISTERED_MODELS,
        find_registered_gguf,
        require_config_json,
    )

    try:
        if model in REGISTERED_MODELS:
            return "gguf", find_registered_gguf(model)
        path = Path(model).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return "gguf", path
        if path.is_dir():
            require_config_json(path, model)
            return "hf", path
        if path.is_file() and path.suffix in PICKLE_SUFFIXES:
            raise ValueError(
                f"{path} is a pickle checkpoint: agentrt loads only .safetensors or .gguf weights"
            )
        if path.exists():
            raise ValueError(f"model '{model}' is neither a Hugging Face directory nor a .gguf file")
        from agentrt.runtime.models.loader import resolve_model_dir

        return "hf", resolve_model_dir(model, Path("/nonexistent"))  # a hub id: never converted
    except ValueError as e:
        report.add(ERROR, "model", str(e))
        return None


def _read_gguf_model(path: Path, report: CheckReport, m: ModelFiles) -> None:
    from transformers import PreTrainedTokenizerFast

    info = read_gguf(path)
    total = sum(t.nbytes or 0 for t in info.tensors)
    by_type: dict[str, int] = {}
    for t in info.tensors:
        by_type[t.type_name] = by_type.get(t.type_name, 0) + (t.nbytes or 0)
    report.weight_bytes = by_type
    params = sum(prod(t.shape) for t in info.tensors)
    unknown = sorted({t.type_name for t in info.tensors if t.nbytes is None})
    level = ERROR if unknown else OK
    extra = f"; unknown tensor types {', '.join(unknown)}" if unknown else ""
    report.add(
        level,
        "weights",
        f"GGUF {_mb(total)}: {_formats(by_type)} ({len(info.tensors)} tensors, {params:,} parameters){extra}",
    )
    m.tensors = {t.name: (t.shape, prod(t.shape)) for t in info.tensors}
    m.four_bit = gguf_four_bit_layers(info)
    m.embed = "token_embd.weight" if "token_embd.weight" in m.tensors else None
    m.head = "output.weight" if "output.weight" in m.tensors else None
    try:
        m.config = gguf_hf_config(info)
    except ValueError as e:
        report.add(ERROR, "architecture", str(e))
    if not isinstance(info.metadata.get("tokenizer.ggml.tokens"), StringArray):
        report.add(
            ERROR, "tokenizer", f"{path.name} holds no tokenizer (no tokenizer.ggml.tokens in its metadata)"
        )
        return
    try:
        m.tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - any failure here is the finding
        report.add(ERROR, "tokenizer", f"the tokenizer of {path.name} does not load: {type(e).__name__}: {e}")


def _read_hf_model(path: Path, report: CheckReport, m: ModelFiles) -> None:
    from transformers import AutoTokenizer

    from agentrt.runtime.models.loader import check_weight_files
    from agentrt.runtime.models.registry import read_hf_config

    try:
        check_weight_files(path)
    except ValueError as e:
        report.add(ERROR, "weights", str(e))
    headers, problems = safetensors_headers(path)
    by_dtype: dict[str, int] = {}
    for t in headers.values():
        by_dtype[t["dtype"]] = by_dtype.get(t["dtype"], 0) + t["nbytes"]
    report.weight_bytes = by_dtype
    for p in problems:
        report.add(ERROR, "weights", p)
    if headers:
        files = len({t["file"] for t in headers.values()})
        params = sum(prod(t["shape"]) for t in headers.values())
        report.add(
            OK,
            "weights",
            f"safetensors {_mb(sum(by_dtype.values()))}: {_formats(by_dtype)} ({len(headers)} tensors in "
            f"{files} file{'s' if files > 1 else ''}, {params:,} parameters)",
        )
    m.tensors = {k: (t["shape"], prod(t["shape"])) for k, t in headers.items()}
    m.dtypes = {k: t["dtype"] for k, t in headers.items()}
    embeds = sorted((k for k in m.tensors if k.endswith(EMBEDDING_NAMES)), key=len)
    heads = sorted((k for k in m.tensors if k.endswith("lm_head.weight")), key=len)
    m.embed, m.head = (embeds or [None])[0], (heads or [None])[0]
    m.stop_dir = path
    try:
        raw = json.loads((path / "config.json").read_text())
        check_config_counts(raw)
    except (OSError, json.JSONDecodeError):
        pass  # transformers says what is wrong (below)
    except ValueError as e:  # a count transformers would divide by (its own error says only "modulo by zero")
        report.add(ERROR, "architecture", str(e))
        return
    try:
        m.config = read_hf_config(path)
    except Exception as e:  # noqa: BLE001 - an unreadable config is the finding
        report.add(ERROR, "architecture", f"config.json cannot be read by transformers: {e}")
    present = [f for f in TOKENIZER_FILES if (path / f).is_file()]
    if not present:
        report.add(
            ERROR,
            "tokenizer",
            f"no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)}): copy the checkpoint's tokenizer files there",
        )
        return
    try:
        m.tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - any failure here is the finding
        report.add(ERROR, "tokenizer", f"the tokenizer in {path} does not load: {type(e).__name__}: {e}")


def _check_shapes(report: CheckReport, m: ModelFiles, vocab: int, hidden: int, tied: bool) -> None:
    if not m.tensors:
        return
    if m.embed is None:
        report.add(
            ERROR,
            "embedding",
            "no embedding tensor (embed_tokens.weight / backbone.embeddings.weight / token_embd.weight) "
            "in the weights",
        )
        return
    problems = []
    shape = m.tensors[m.embed][0]
    if tuple(shape) != (vocab, hidden):
        problems.append(
            f"{m.embed} is {list(shape)} but the config says vocab_size {vocab} x hidden_size {hidden}: "
            "the config does not match the weights"
        )
    if m.head is not None and tuple(m.tensors[m.head][0]) != (vocab, hidden):
        problems.append(f"{m.head} is {list(m.tensors[m.head][0])}, not [{vocab}, {hidden}]")
    if m.head is None and not tied:
        problems.append(
            "tie_word_embeddings is false but the weights hold no LM head (lm_head.weight / output.weight)"
        )
    if problems:
        for p in problems:
            report.add(ERROR, "embedding", p)
        return
    head = "tied to the embedding" if m.head is None else f"{m.head} {list(m.tensors[m.head][0])}"
    head += " (tie_word_embeddings)" if tied and m.head is not None else ""
    report.add(
        OK, "embedding", f"{m.embed} {list(shape)} = vocab {vocab:,} x hidden {hidden:,}; LM head {head}"
    )


def _check_layout(report: CheckReport, arch, m: ModelFiles) -> None:
    """The weights of a Hugging Face directory as serve's load checks them: the model built on the
    meta device, the headers' shapes loaded by `load_hf_state_dict` (renames, q/k/v and gate/up
    packing, experts, missing and unexpected weights, every shape); no tensor data is read."""
    import torch

    from agentrt.runtime.models.registry import build_model

    if not m.tensors:
        return
    try:
        with torch.device("meta"):
            model = build_model(arch, 1)
            shapes = {  # the headers' dtypes: quantized tensors are told by theirs (checkpoint_quant.py)
                name: torch.empty(
                    shape, dtype=getattr(torch, SAFETENSORS_DTYPES.get(m.dtypes.get(name), "float32"))
                )
                for name, (shape, _) in m.tensors.items()
            }
            model.load_hf_state_dict(checkpoint_tensors(shapes, arch.checkpoint_quant, torch.float32))
    except (ValueError, RuntimeError) as e:
        report.add(ERROR, "weights", f"serve would refuse them at load: {e}")
        return
    report.add(OK, "weights", f"all {len(m.tensors)} tensors have the names and shapes the model loads")


def check_tokenizer(report: CheckReport, m: ModelFiles) -> None:
    """The tokenizer's finding: it loads, and its largest id fits the embedding's m.vocab rows
    (an error finding when not). m.tokenizer must be loaded."""
    tok = m.tokenizer
    max_id = max(tok.get_vocab().values())
    if m.vocab is not None and max_id >= m.vocab:
        report.add(
            ERROR,
            "tokenizer",
            f"token id {max_id} but the embedding has only {m.vocab} rows: tokenizer and model do not match",
        )
    else:
        rows = f" < {m.vocab:,} embedding rows" if m.vocab is not None else ""
        report.add(
            OK, "tokenizer", f"loads ({type(tok).__name__}, {len(tok):,} tokens, largest id {max_id:,}{rows})"
        )


def check_special_tokens(report: CheckReport, m: ModelFiles) -> None:
    """BOS, EOS and every stop id as serve collects them (loader.collect_stop_ids); a warning when
    there is no stop id. m.tokenizer must be loaded."""
    from agentrt.runtime.models.loader import collect_stop_ids, out_of_vocab_stop_ids

    tok = m.tokenizer
    stop_dir = m.stop_dir or Path("/nonexistent")  # a GGUF's conversion reads no generation_config.json
    report.stop_ids = collect_stop_ids(tok, stop_dir, m.config) if m.config is not None else ()
    outside = out_of_vocab_stop_ids(tok, stop_dir, m.config) if m.config is not None else ()
    if outside:
        report.add(
            WARNING,
            "special tokens",
            f"eos ids {list(outside)} of the config / generation_config.json are outside the vocabulary: "
            "not used as stop ids",
        )
    report.bos_id, report.eos_id = tok.bos_token_id, tok.eos_token_id

    def name(i):
        return "none" if i is None else f"{i} {tok.convert_ids_to_tokens(i)!r}"

    stops = ", ".join(name(i) for i in report.stop_ids)
    level = OK if report.stop_ids else WARNING
    why = "" if report.stop_ids else " (generation stops only at max_tokens or a stop string)"
    report.add(
        level,
        "special tokens",
        f"BOS {name(report.bos_id)}, EOS {name(report.eos_id)}; stop ids [{stops}]{why}",
    )


def _cache_layout(arch) -> str:
    """How the KV caches differ from one per layer of the heads above, or "": caches of other shapes
    (Gemma 4's full-attention layers) and layers that read an earlier layer's cache (KV sharing)."""
    specs, caches = arch.kv_layout()
    shared = sum(1 for i, c in enumerate(caches) if c is not None and caches.index(c) != i)
    if arch.mla is not None or (len(set(specs)) < 2 and not shared):
        return ""
    shapes: dict[str, int] = {}
    for s in specs:
        shape = f"{s.num_kv_heads} x {s.k_dim}" + ("" if s.v_dim in (0, s.k_dim) else f" / {s.v_dim}")
        shapes[shape] = shapes.get(shape, 0) + 1
    text = f"; {len(specs)} KV caches ({', '.join(f'{n} of {k}' for k, n in shapes.items())})"
    return text + (f", {shared} layers reading an earlier layer's" if shared else "")


def read_model(model: str, chat_template: str | None = None) -> tuple[CheckReport, ModelFiles]:
    """The first layers of the check of `model` (registered name, HF directory, .gguf file or
    cached hub id), no weight data read: where it is, its weights' headers and formats, its
    architecture and shapes (and, for a directory, every weight's name and shape as the load
    checks them), its tokenizer loaded, `chat_template` (a file or text, serve's --chat-template)
    set on it. Never raises for a broken model: every problem is an error finding of the report.
    Returns (the report so far, what was read); the tokenizer, template and memory findings follow
    (agentrt/commands/check.py `check_model`)."""
    from agentrt.runtime.models.registry import ARCHITECTURES, arch_from_hf_config

    report = CheckReport(model)
    m = ModelFiles()
    located = _locate(model, report)
    if located is None:
        return report, m
    kind, path = located
    m.path = path
    report.source = (
        f"GGUF file {path} (metadata only, not converted)"
        if kind == "gguf"
        else f"Hugging Face directory {path}"
    )
    try:
        (_read_gguf_model if kind == "gguf" else _read_hf_model)(path, report, m)
    except ValueError as e:
        report.add(ERROR, "model", str(e))
    if m.config is not None:
        try:
            m.arch = arch_from_hf_config(m.config)
        except ValueError as e:
            report.add(ERROR, "architecture", str(e))
    text = getattr(m.config, "text_config", None) or m.config
    m.vocab = getattr(text, "vocab_size", None)
    arch = m.arch
    if arch is not None:
        report.architecture, report.family = arch.architecture, ARCHITECTURES[arch.architecture][0]
        moe = f", {arch.num_experts} experts (top {arch.num_experts_per_tok})" if arch.num_experts else ""
        kv_heads = f"{arch.num_kv_heads} KV head{'s' if arch.num_kv_heads > 1 else ''}"
        heads = f"{arch.num_heads} heads / {kv_heads} x {arch.head_dim}"
        if arch.mla is not None:  # latent attention: one cached row per token, not K/V heads
            heads = (
                f"{arch.num_heads} heads x {arch.head_dim} over one latent KV row (kv_lora_rank "
                f"{arch.mla.kv_lora_rank} + RoPE key {arch.mla.qk_rope_head_dim})"
            )
        heads += _cache_layout(arch)
        shape = (
            f"{arch.num_layers} layers, hidden {arch.hidden_size}, {heads}{moe}, vocab "
            f"{arch.vocab_size:,}, context {arch.max_position_embeddings:,}"
        )
        report.findings.insert(
            0, Finding(OK, "architecture", f"{arch.architecture} (family {report.family}): {shape}")
        )
        quant = arch.checkpoint_quant
        if quant is not None and kind == "hf":  # the weights as the load makes them (checkpoint_quant.py)
            report.add(OK, "weights", f"{quant.describe()} to the run dtype")
            m.tensors = {k: (dims, loaded_elements(k, dims, quant)) for k, (dims, _) in m.tensors.items()}
        num_errors = len(report.errors)
        _check_shapes(report, m, arch.vocab_size, arch.hidden_size, arch.tie_word_embeddings)
        if kind == "hf" and len(report.errors) == num_errors:  # else the embedding said it already
            _check_layout(report, arch, m)
    if m.tokenizer is not None and chat_template is not None:
        from agentrt.runtime.models.loader import read_chat_template

        try:
            m.tokenizer.chat_template = read_chat_template(chat_template)
        except (ValueError, OSError) as e:
            report.add(ERROR, "chat template", str(e))
    return report, m
