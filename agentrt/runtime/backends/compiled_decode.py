"""Compiled decode step on CPU: the dense parts of a decode forward compiled ahead of time by inductor's
C++ backend (AOTInductor: torch.export, then C++ built with the system compiler), attention eager.

What is compiled. A decode step's attention gathers each sequence's context from the KV pool and the
context length changes every step, so a whole-step graph would see a new shape every step. As vLLM's
piecewise CUDA graphs do, the step is cut at attention: three graphs, each exported once with the
batch dimension dynamic (1 .. max_batch_size), serve every batch size and every layer:

- `first`: embedding, the RoPE cos/sin rows of the positions, layer 0's input RMSNorm, QKV projection
  and rotary embedding -> (x, cos, sin, q, k, v);
- `mid`: one layer's tail (o_proj, residual, post-attention RMSNorm, SwiGLU MLP, residual) and the next
  layer's head (RMSNorm, QKV, rotary) -> (x, q, k, v), called once per pair of layers;
- `last`: the last layer's tail, the final norm and the LM head -> logits fp32.

The weights are inputs of the graphs, not constants (one graph serves all layers; no weight copy in
the artefacts), so a graph does not depend on the weight values. The graphs compose the layers' own
pieces (`DecoderLayer.pre_attention` / `post_attention`, `Attention.qkv`), so the Llama layer is
written once for torch; a compiled run builds the model on the torch element-wise ops
(run_plan.plan_run), which the graphs trace. Between graphs the KV write and the attention
(backends/torch_attention.py `AttentionMetadata.attend`: gather + SDPA) run eagerly.

Why AOTInductor and a dynamic batch, not torch.compile at padded sizes (measured on the 2-core
development box): calling a torch.compile'd piece cost ~0.6 ms of Dynamo guards and wrappers per call,
and a step makes one call per layer (30 on the default model), which ate the gain; a loaded
AOTInductor graph is called in ~0.05 ms. A dynamic batch dimension means 3 builds instead of 3 per
padded size (a build takes 1-3 minutes here) and no padding rows to compute.

Numerics: inductor is told to round low-precision intermediates where eager torch does
(emulate_precision_casts): int4 logits of the default model came out bit-identical to the eager
step's, dense bf16 within a few bf16 units in the last place; fp32 differs by summation order only.

Artefacts: `<cache_dir>/compiled-decode/<key>/{first,mid,last}.pt2`, key = hash of the torch
version, the CPU capability, the thread count (inductor bakes it into its OpenMP loops), the maximum
batch, the shapes and dtypes of the graphs' inputs, the layer types and the source of the modules
traced; inductor's own caches (FX graphs, precompiled headers) in `<cache_dir>/inductor`
(TORCHINDUCTOR_CACHE_DIR during the build). A later start loads the packages without tracing.

Failure: a build or load error at start, or an exception from a compiled step later, turns the
compiled path off for good with one log line; the step runs eagerly (the torch backend).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from agentrt.runtime.backends.torch_attention import TorchBackend, build_torch_metadata
from agentrt.runtime.forward import SeqChunk, is_plain_decode
from agentrt.runtime.kv_cache import store_kv
from agentrt.runtime.layers.rotary import apply_rope

logger = logging.getLogger(__name__)

PIECES = ("first", "mid", "last")
# the layout features (models/config.py ModelArch.layout_features) the traced pieces implement
# beyond the plain Llama layer
SUPPORTS = frozenset({"qkv_bias", "mlp_bias", "mlp:silu"})


def unsupported(arch) -> frozenset[str]:
    """The layout features of `arch` (ModelArch) the compiled decode graphs do not implement (empty:
    they run this model)."""
    return arch.layout_features() - SUPPORTS


def _pre_attention(layer: nn.Module, x, residual, cos: torch.Tensor, sin: torch.Tensor):
    """`layer`'s input norm and projections, then RoPE: x [B, hidden] the previous layer's output (the
    embeddings, residual None, for layer 0) -> (the stream [B, hidden], q [B, H, D], k [B, Hkv, D]
    rotated, v [B, Hkv, D])."""
    attn = layer.self_attn
    t = x.shape[0]
    residual, h = layer.pre_attention(x, residual)
    q, k, v = attn.qkv(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = apply_rope(q.reshape(t, attn.num_heads, attn.head_dim), cos, sin)
    k = apply_rope(k.reshape(t, attn.num_kv_heads, attn.head_dim), cos, sin)
    return residual, q, k, v.reshape(t, attn.num_kv_heads, attn.head_dim).contiguous()


def _post_attention(layer: nn.Module, residual: torch.Tensor, attn_out: torch.Tensor):
    """The rest of `layer` after attention: attn_out [B, H, D] -> (its output, the stream) [B, hidden]."""
    h = layer.self_attn.o_proj(attn_out.reshape(residual.shape[0], -1))
    return layer.post_attention(h, residual)


class _First(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.embed_tokens, self.layer = model.embed_tokens, model.layers[0]
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions].to(x.dtype), self.rope_sin[positions].to(x.dtype)
        residual, q, k, v = _pre_attention(self.layer, x, None, cos, sin)
        return residual, cos, sin, q, k, v


class _Mid(nn.Module):
    def __init__(self, prev: nn.Module, nxt: nn.Module):
        super().__init__()
        self.prev, self.nxt = prev, nxt

    def forward(self, residual, attn_out, cos, sin):
        x, residual = _post_attention(self.prev, residual, attn_out)
        return _pre_attention(self.nxt, x, residual, cos, sin)


class _Last(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.layer, self.norm, self.lm_head = model.layers[-1], model.norm, model.lm_head

    def forward(self, residual, attn_out):
        x, residual = _post_attention(self.layer, residual, attn_out)
        return self.lm_head(self.norm.add_forward(x, residual)[1]).float()


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters then buffers of `module`, shared tensors listed under each name (stable order)."""
    params = list(module.named_parameters(remove_duplicate=False))
    buffers = [(n, b) for n, b in module.named_buffers(remove_duplicate=False) if b is not None]
    return params + buffers


class _WeightsAsInputs(nn.Module):
    """forward(*inputs, *tensors) = piece(*inputs) with the piece's parameters and buffers replaced by
    `tensors` (torch.func.functional_call), so the exported graph holds no weights."""

    def __init__(self, piece: nn.Module, num_inputs: int):
        super().__init__()
        self._piece = (piece,)  # not a submodule: its weights must not become constants
        self.names = [n for n, _ in _named_tensors(piece)]
        self.num_inputs = num_inputs

    def forward(self, *args):
        n = self.num_inputs
        return torch.func.functional_call(self._piece[0], dict(zip(self.names, args[n:])), args[:n])


@functools.cache
def _source_hash() -> str:
    """Hash of the source of the modules the graphs trace, read once per process (the code running)."""
    from agentrt.runtime import forward
    from agentrt.runtime.backends import torch_attention as torch_backend
    from agentrt.runtime.layers import attention as attention_layer
    from agentrt.runtime.layers import mlp, norm, rotary
    from agentrt.runtime.models import base, quant

    h = hashlib.sha256()
    for mod in (forward, torch_backend, attention_layer, mlp, norm, rotary, base, quant):
        h.update(inspect.getsource(mod).encode())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


def cache_key(pieces: dict[str, nn.Module], arch, max_batch_size: int, threads: int) -> str:
    """Hex digest naming a build: torch version, CPU capability, threads, max batch, the model's
    ModelArch (norm epsilon and the like are constants of the graphs), the source of the traced
    modules and each piece's module types and tensor names, shapes and dtypes."""
    h = hashlib.sha256()
    h.update(
        f"{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}|{threads}|{max_batch_size}|{arch!r}".encode()
    )
    h.update(_source_hash().encode())
    for name, piece in pieces.items():
        h.update(name.encode())
        for mod_name, mod in piece.named_modules():
            h.update(f"{mod_name}:{type(mod).__qualname__}:{mod.extra_repr()}".encode())
        for t_name, t in _named_tensors(piece):
            h.update(f"{t_name}:{tuple(t.shape)}:{t.dtype}".encode())
    return h.hexdigest()[:20]


@contextlib.contextmanager
def _inductor_env(inductor_dir: Path):
    """TORCHINDUCTOR_CACHE_DIR = inductor_dir while building (restored after), eager-like rounding of
    low-precision intermediates."""
    import torch._inductor.config as inductor_config

    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    try:
        with inductor_config.patch(emulate_precision_casts=True):
            yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def build_package(piece: nn.Module, inputs: Sequence[torch.Tensor], max_batch_size: int, path: Path) -> None:
    """Export `piece` (weights as inputs, dim 0 of every input in `inputs` dynamic up to
    max_batch_size) and build it with AOTInductor into the package `path` (.pt2), written atomically.
    Raises whatever torch.export or inductor raise."""
    from torch.export import Dim

    wrapper = _WeightsAsInputs(piece, len(inputs))
    weights = [t for _, t in _named_tensors(piece)]
    batch = Dim("batch", min=1, max=max_batch_size)
    dynamic = tuple([{0: batch}] * len(inputs) + [None] * len(weights))
    with torch.inference_mode(False), torch.no_grad():
        args = tuple(t.clone() for t in inputs) + tuple(w.detach().clone() for w in weights)
        ep = torch.export.export(wrapper, args, dynamic_shapes=(dynamic,), strict=False)
        tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
        try:
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def _load(path: Path) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """The package's flat call: list of input tensors -> list of outputs (no pytree work per call)."""
    return torch._inductor.aoti_load_package(str(path), run_single_threaded=True).loader.run


class CompiledDecode:
    """Plain-decode batches (forward.is_plain_decode) of at most `max_batch_size` sequences through
    the three AOTInductor graphs of the module docstring, eager attention over the KV pool between.

    model: a models/base.DecoderModel whose layout `unsupported` accepts, on the CPU (dense, Int8Linear or Int4Linear layers);
    k_caches / v_caches: the KVPool's per-layer [slots, Hkv, D] tensors; cache_dir: the AGENTRT_CACHE
    root; threads: torch intra-op threads (part of the cache key). Call `start` once before `run`;
    `failure` is None while the compiled path is on, else why it is off.
    """

    def __init__(
        self,
        model: nn.Module,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        max_batch_size: int,
        cache_dir: Path,
        threads: int,
    ):
        self.model, self.k_caches, self.v_caches = model, k_caches, v_caches
        self.max_batch_size = max(1, max_batch_size)
        layers = model.layers
        self._pieces = {
            "first": _First(model),
            "mid": _Mid(layers[0], layers[1 % len(layers)]),
            "last": _Last(model),
        }
        self.key = cache_key(self._pieces, model.arch, self.max_batch_size, threads)
        self.package_dir = Path(cache_dir) / "compiled-decode" / self.key
        self.inductor_dir = Path(cache_dir) / "inductor"
        self.failure: str | None = None
        self.start_s: float | None = None
        self.from_cache = False
        self.num_runs = 0  # decode steps served compiled
        self._run_fns: dict[str, Callable] = {}
        # the weights each call passes, in the graphs' order
        self._first_w = [t for _, t in _named_tensors(self._pieces["first"])]
        self._mid_w = [
            [t for _, t in _named_tensors(_Mid(layers[i], layers[i + 1]))] for i in range(len(layers) - 1)
        ]
        self._last_w = [t for _, t in _named_tensors(self._pieces["last"])]

    @property
    def active(self) -> bool:
        return self.failure is None and len(self._run_fns) == len(PIECES)

    def accepts(self, chunks) -> bool:
        """True when the compiled path is on and `chunks` is a plain-decode batch it holds."""
        return self.active and 0 < len(chunks) <= self.max_batch_size and is_plain_decode(chunks)

    def describe(self) -> str:
        """One phrase for the start line: the build or load time, or why the step runs eagerly."""
        if self.failure is not None:
            return f"decode eager (compile failed: {self.failure})"
        if self.start_s is None:
            return "decode not compiled yet"
        how = "loaded from cache" if self.from_cache else "built"
        return (
            f"decode compiled (AOTInductor, batch 1-{self.max_batch_size}, {how} in {self.start_s:.1f} s, "
            f"{self.package_dir})"
        )

    def _fail(self, error: BaseException, when: str) -> None:
        text = str(error).strip().splitlines()
        self.failure = f"{type(error).__name__}: {text[0][:300] if text else ''}".rstrip(": ")
        self._run_fns = {}
        logger.warning("compiled decode off (%s failed: %s); decode runs eagerly", when, self.failure)

    def _example_inputs(self) -> dict[str, list[torch.Tensor]]:
        a, dtype = self.model.arch, self.model.embed_tokens.weight.dtype
        b = min(2, self.max_batch_size)
        i64 = torch.zeros(b, dtype=torch.int64)
        x = torch.zeros(b, a.hidden_size, dtype=dtype)
        attn = torch.zeros(b, a.num_heads, a.head_dim, dtype=dtype)
        rope = torch.zeros(b, a.head_dim // 2, dtype=dtype)
        return {
            "first": [i64, i64.clone()],
            "mid": [x, attn, rope, rope.clone()],
            "last": [x.clone(), attn.clone()],
        }

    def start(self) -> float:
        """Load the three packages from the cache, building the missing ones first; returns the
        seconds it took. On any error the compiled path is off (`failure` says why)."""
        t0 = time.perf_counter()
        try:
            paths = {name: self.package_dir / f"{name}.pt2" for name in PIECES}
            self.from_cache = all(p.is_file() for p in paths.values())
            if not self.from_cache:
                logger.info(
                    "building the compiled decode step into %s (first start with this model, format and "
                    "thread count: minutes; later starts load it)",
                    self.package_dir,
                )
                self.package_dir.mkdir(parents=True, exist_ok=True)
                examples = self._example_inputs()
                with _inductor_env(self.inductor_dir):
                    for name in PIECES:
                        if not paths[name].is_file():
                            build_package(
                                self._pieces[name], examples[name], self.max_batch_size, paths[name]
                            )
            self._run_fns = {name: _load(paths[name]) for name in PIECES}
        except Exception as e:  # noqa: BLE001 - any build error means: serve eagerly
            self._fail(e, "build" if not self.from_cache else "load")
        self.start_s = time.perf_counter() - t0
        if self.failure is None:
            logger.info(
                "compiled decode %s in %.1f s (%s)",
                "loaded" if self.from_cache else "built",
                self.start_s,
                self.package_dir,
            )
        return self.start_s

    @torch.inference_mode()
    def run(self, chunks) -> torch.Tensor | None:
        """Logits [len(chunks), vocab] fp32 of a batch `accepts` took, or None when the compiled step
        failed (logged once; the compiled path is then off and the caller runs the step eagerly: the
        KV slots it wrote get the same values again)."""
        try:
            logits = self._run(chunks)
        except Exception as e:  # noqa: BLE001 - fall back to eager, keep serving
            self._fail(e, "decode step")
            return None
        self.num_runs += 1
        return logits

    def _run(self, chunks) -> torch.Tensor:
        first, mid, last = (self._run_fns[name] for name in PIECES)
        inputs = build_torch_metadata(chunks, torch.device("cpu"))
        meta = inputs.meta
        residual, cos, sin, q, k, v = first([inputs.input_ids, inputs.positions, *self._first_w])
        num_layers = len(self.k_caches)
        for i in range(num_layers):
            k_cache, v_cache = self.k_caches[i], self.v_caches[i]
            store_kv(k_cache, meta.slot_mapping, k)  # cast or quantized as the pool stores them
            store_kv(v_cache, meta.slot_mapping, v)
            attn_out = meta.attend(q, k, v, k_cache, v_cache).contiguous()  # the default scale
            if i + 1 < num_layers:
                residual, q, k, v = mid([residual, attn_out, cos, sin, *self._mid_w[i]])
        return last([residual, attn_out, *self._last_w])[0]


class CompiledDecodeBackend:
    """The torch backend with plain-decode batches (forward.is_plain_decode) of up to `max_batch_size`
    sequences through a CompiledDecode (built or loaded at construction); every other batch, and every
    batch once the compiled step has failed, runs the torch backend eagerly."""

    captured_sizes: tuple[int, ...] = ()

    def __init__(self, eager: TorchBackend, max_batch_size: int, cache_dir: Path, threads: int):
        self.eager, self.name, self.reason = eager, eager.name, eager.reason
        self.compiled = CompiledDecode(
            eager.model, eager.kv.k, eager.kv.v, max_batch_size, cache_dir, threads
        )
        self.compiled.start()

    def prepare(self, chunks: list[SeqChunk]):
        return self.eager.prepare(chunks)

    def run(self, chunks: list[SeqChunk], return_hidden: bool = False):
        """Logits [N, vocab] fp32 (with return_hidden, and the hidden rows: never compiled)."""
        if not return_hidden and self.compiled.accepts(chunks):
            logits = self.compiled.run(chunks)
            if logits is not None:  # None: the compiled step failed and is off now; run it eagerly
                return logits
        return self.eager.run(chunks, return_hidden)

    def describe(self) -> str:
        return self.compiled.describe()
