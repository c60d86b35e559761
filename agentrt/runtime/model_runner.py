"""Model runner: loads weights and the KV pool, turns a scheduled batch into one forward pass."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agentrt.runtime.attention import build_torch_metadata
from agentrt.runtime.config import CacheConfig, ModelConfig, SpecConfig
from agentrt.runtime.kv_cache import KVPool, kv_dtype_name, resolve_kv_dtype
from agentrt.runtime.kv_window import SlidingWindowKVPool, plan_window_pool
from agentrt.runtime.models.config import check_config_counts
from agentrt.runtime.models.formats import four_bit_layers, load_model
from agentrt.runtime.models.loader import (
    collect_stop_ids,
    load_tokenizer,
    read_chat_template,
    resolve_device_dtype,
    resolve_model_dir,
)
from agentrt.runtime.models.registry import arch_from_hf_config
from agentrt.runtime.platform import (
    choose_attention_backend,
    choose_dtype,
    choose_linear_kernel,
    choose_threads,
    deterministic_problem,
)

if TYPE_CHECKING:
    from agentrt.runtime.triton_attention import SlotTable

logger = logging.getLogger(__name__)


@dataclass
class SeqChunk:
    """One sequence's part of a forward: `token_ids` new tokens at positions
    [context_len, context_len + len(token_ids)); `slots` are the KV slots of the whole context
    including the new tokens (len == context_len + len(token_ids)). `need_logits`: return the
    logits of the last `num_logits` new tokens (False for a prefill chunk that does not end the
    prompt; num_logits > 1 for a speculative verify chunk). `positions`: explicit positions of the
    new tokens (a draft tree: context_len + depth), with `tree_mask` [n, n] bool saying which new
    tokens each attends to; None = consecutive positions, causal. `seq_key`: identifies the
    sequence across steps (the Triton path keeps its slots on the device and uploads only new
    ones); None = anonymous (uploaded in full)."""

    token_ids: list[int]
    context_len: int
    slots: list[int]
    need_logits: bool = True
    num_logits: int = 1
    positions: list[int] | None = None
    tree_mask: torch.Tensor | None = None
    seq_key: object | None = None


@dataclass(frozen=True)
class MemoryPlan:
    """Where the device memory goes (bytes): weights, KV pool, per-token KV, and what the plan
    kept back (activations, CUDA graphs, the allocator). Printed at start."""

    device: str
    weights_bytes: int
    kv_bytes_per_token: int
    kv_pool_bytes: int
    max_kv_tokens: int
    reserved_bytes: int
    total_bytes: int
    weights_by_format: tuple[tuple[str, int], ...] = ()
    kv_dtype: str = ""
    kv_tokens_per_gib: tuple[tuple[str, int], ...] = ()  # (KV dtype, tokens per GiB of pool)
    window_kv: str = ""  # how the sliding-window layers' K/V are held (kv_window.py), "" without windows

    def describe(self) -> str:
        gb = 1e9
        by_format = ", ".join(f"{k} {v / gb:.3f} GB" for k, v in self.weights_by_format)
        per_gib = ", ".join(f"{k} {v}" for k, v in self.kv_tokens_per_gib)
        return (
            f"memory plan on {self.device}: weights {self.weights_bytes / gb:.2f} GB"
            + (f" ({by_format})" if by_format else "")
            + ", KV pool "
            + (f"{self.kv_dtype} " if self.kv_dtype else "")
            + f"{self.kv_pool_bytes / gb:.2f} GB = {self.max_kv_tokens} tokens x {self.kv_bytes_per_token} "
            f"bytes/token"
            + (f" (KV tokens per GiB: {per_gib})" if per_gib else "")
            + (f"; {self.window_kv}" if self.window_kv else "")
            + f", reserved {self.reserved_bytes / gb:.2f} GB"
            + (f" of {self.total_bytes / gb:.1f} GB" if self.total_bytes else "")
        )


def kv_tokens_per_gib(arch) -> tuple[tuple[str, int], ...]:
    """(KV dtype, tokens one GiB of pool holds) for float32, float16 and int8 (scales counted) of a
    model with `arch`'s layers, KV heads and head size."""
    return tuple(
        (
            kv_dtype_name(d),
            (1 << 30) // KVPool.bytes_per_token_of(arch.num_layers, arch.num_kv_heads, arch.head_dim, d),
        )
        for d in (torch.float32, torch.float16, torch.int8)
    )


def plan_kv_budget(
    cache_config: CacheConfig,
    device: torch.device,
    bytes_per_token: int,
    max_model_len: int,
    max_num_seqs: int,
    vocab_size: int,
    hidden_size: int,
) -> tuple[int, int, int]:
    """(KV budget bytes, reserved bytes, device total bytes). An explicit kv_cache_bytes wins. On
    CUDA the budget is gpu_memory_utilization x total - memory in use now (weights) - a reserve
    for activations and logits (max_num_seqs x (vocab + 8 x hidden) x 4 bytes x 4, at least 1 GiB);
    raises ValueError when that leaves less than one full-context sequence. CPU: 1 GiB."""
    if cache_config.kv_cache_bytes is not None:
        return cache_config.kv_cache_bytes, 0, 0
    if device.type != "cuda":
        return 1 << 30, 0, 0
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    reserve = max(1 << 30, 16 * max_num_seqs * (vocab_size + 8 * hidden_size))
    budget = int(cache_config.gpu_memory_utilization * total) - used - reserve
    if budget < bytes_per_token * max_model_len:
        raise ValueError(
            f"not enough device memory for the KV cache: {budget / 1e9:.2f} GB left after the weights "
            f"({used / 1e9:.2f} GB in use) and a {reserve / 1e9:.2f} GB activation reserve, below one "
            f"{max_model_len}-token sequence ({bytes_per_token * max_model_len / 1e9:.2f} GB): lower "
            "max_model_len, raise gpu_memory_utilization or set kv_cache_bytes"
        )
    return budget, reserve, total


class ModelRunner:
    """Holds the model, tokenizer and KV pool on one device.

    execute(chunks) runs one forward over all chunks and returns logits [N, vocab] fp32 for the
    last new token of each chunk with need_logits (N of them, in order). Weights load straight to
    the device in the run dtype (bf16 on CUDA, fp32 on CPU by default). Attention runs the Triton
    kernels on CUDA (decode batches replayed from CUDA graphs); on the CPU decode attention runs the
    C++ kernel of kernels/cpu_kernels.py at float32 (else torch SDPA) and prefill torch SDPA
    (decode batches through the compiled graphs of compiled_decode.py with compile_decode). Dense
    fp32 linear layers on the CPU run oneDNN's packed matmul (models/cpu_linear.py).
    `max_num_seqs` sizes the slot table and the memory plan's activation reserve. With a draft
    model (`spec_config`), an automatic KV budget is shared: a self-draft of n of L layers leaves
    this pool L / (L + n) of it (the draft pool, sized in proportion, takes the rest); a separate
    draft model leaves it 80% (for the draft's weights and pool).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        max_num_seqs: int = 16,
        spec_config: SpecConfig | None = None,
        max_num_batched_tokens: int = 512,
    ):
        from transformers import AutoConfig

        self.model_dir = resolve_model_dir(model_config.model, model_config.cache_dir)
        check_config_counts(json.loads((self.model_dir / "config.json").read_text()))
        hf_config = AutoConfig.from_pretrained(str(self.model_dir))
        self.arch = arch_from_hf_config(hf_config)
        self.device, self.dtype = resolve_device_dtype(model_config.device, model_config.dtype)
        dtype_reason = choose_dtype(self.device, model_config.dtype)[1]
        self.num_threads, threads_reason = choose_threads(model_config.threads)
        if self.device.type == "cpu":
            torch.set_num_threads(self.num_threads)
        limit = self.arch.max_position_embeddings
        self.max_model_len = model_config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's limit of {limit} tokens"
            )
        backend, backend_reason = choose_attention_backend(
            model_config.attention_backend, self.device, self.dtype, model_config.cache_dir
        )
        compiled = (
            model_config.compile_decode
            and not model_config.enforce_eager
            and backend in ("torch", "cpu")
            and self.arch.llama_layout()
        )
        loaded = load_tokenizer(self.model_dir, hf_config, self.arch.vocab_size)
        self.tokenizer, self.stop_ids = loaded.tokenizer, loaded.stop_ids
        if model_config.chat_template is not None:
            self.tokenizer.chat_template = read_chat_template(model_config.chat_template)
            self.stop_ids = collect_stop_ids(self.tokenizer, self.model_dir, hf_config)
        quantization, quantize_lm_head = model_config.quantization, model_config.quantize_lm_head
        group_size = model_config.quant_group_size
        four_bit = False
        if quantization == "auto":  # the CPU kernels' formats where they run, else exact weights:
            kernel = backend == "cpu" and not compiled  # int4 when the weights are 4-bit already
            four_bit = kernel and four_bit_layers(self.model_dir)
            if four_bit:
                quantization, quantize_lm_head, group_size = "int4", True, 32
            else:
                quantization, quantize_lm_head = ("int8", True) if kernel else ("none", quantize_lm_head)
        if model_config.deterministic:
            problem = deterministic_problem(self.device, self.dtype, backend, compiled, quantization)
            if problem is not None:
                raise ValueError(f"--deterministic: {problem}")
        model, self.weight_format = load_model(
            self.arch,
            self.max_model_len,
            self.model_dir,
            self.device,
            self.dtype,
            dtype_reason,
            quantization,
            group_size,
            quantize_lm_head,
            model_config.cache_dir,
            choose_linear_kernel(
                model_config.linear_kernel,
                self.device,
                self.dtype,
                compiled,
                model_config.deterministic,
                backend,
            ),
            cpu_kernels=backend == "cpu" and not compiled,
        )
        if model_config.quantization == "auto":
            why = (
                "the layers' weights are 4-bit already (Q4_1 blocks of 32 give them back): the CPU int4 "
                "kernel, the LM head int8"
                if four_bit
                else "the CPU int8 kernel (the weights are not 4-bit)"
                if quantization == "int8"
                else "the CPU int8 and int4 kernels need the CPU at float32 with attention backend cpu, "
                f"decode not compiled (here {self.device}, {str(self.dtype).removeprefix('torch.')}, "
                f"attention {backend}{', compiled' if compiled else ''})"
            )
            self.weight_format = dataclasses.replace(self.weight_format, quant_reason=f"auto: {why}")
        self.model = model
        self.weights_bytes = sum(n for _, n in self.weight_format.bytes)
        a = self.arch
        self.kv_dtype = resolve_kv_dtype(cache_config.kv_cache_dtype, self.dtype, self.device)
        if (
            model_config.deterministic
            and backend == "cpu"
            and self.kv_dtype not in (torch.float32, torch.float16, torch.int8)
        ):
            raise ValueError(
                f"--deterministic: the CPU attention kernel reads float32, float16 or int8 KV, not "
                f"{kv_dtype_name(self.kv_dtype)} (--kv-cache-dtype)"
            )
        bytes_per_token = KVPool.bytes_per_token_of(a.num_layers, a.num_kv_heads, a.head_dim, self.kv_dtype)
        budget, reserved, total = plan_kv_budget(
            cache_config,
            self.device,
            bytes_per_token,
            self.max_model_len,
            max_num_seqs,
            a.vocab_size,
            a.hidden_size,
        )
        if cache_config.kv_cache_bytes is None and spec_config is not None and spec_config.method == "draft":
            n = spec_config.draft_layers or 0
            if spec_config.draft_model is not None:
                budget = int(budget * 0.8)
            elif 1 <= n < a.num_layers:  # other values are refused by the speculator, clearly
                budget = int(budget * a.num_layers / (a.num_layers + n))
        self.kv, window_kv = self._make_pool(
            cache_config, backend, budget, max_num_seqs, max_num_batched_tokens, spec_config
        )
        self.memory_plan = MemoryPlan(
            str(self.device),
            self.weights_bytes,
            self.kv.bytes_per_token,
            self.kv.pool_bytes,
            self.kv.num_slots,
            reserved,
            total,
            self.weight_format.bytes,
            kv_dtype_name(self.kv_dtype),
            () if self.kv.window else kv_tokens_per_gib(a),  # (a plain pool's)
            window_kv,
        )
        self.attention_backend = backend
        self.slot_table = self.graphs = None
        if backend == "triton":
            from agentrt.runtime.cuda_graph import DecodeGraphRunner
            from agentrt.runtime.triton_attention import SlotTable

            # a verify chunk may hold up to 65 tokens past the context (1 + 64 draft nodes, SpecConfig)
            self.slot_table = SlotTable(2 * max_num_seqs + 8, self.max_model_len + 128, self.device)
            sizes = [b for b in model_config.cuda_graph_batch_sizes if b <= max(max_num_seqs, 1)] or [1]
            capture = self.device.type == "cuda" and not model_config.enforce_eager
            self.graphs = DecodeGraphRunner(
                model, self.kv.k, self.kv.v, self.slot_table, sizes, self.device, capture, self.kv.swa_map
            )
        self.compiled = None  # CompiledDecode on CPU with compile_decode (see compiled_decode.py)
        decode = "decode eager"
        if model_config.compile_decode and backend in ("torch", "cpu") and self.device.type == "cpu":
            if model_config.enforce_eager:
                decode = "decode eager (enforce_eager)"
            elif not self.arch.llama_layout():
                decode = f"decode eager (the compiled decode knows the Llama layout only, not {self.arch.architecture})"
            else:
                from agentrt.runtime.compiled_decode import CompiledDecode

                self.compiled = CompiledDecode(
                    model, self.kv.k, self.kv.v, max_num_seqs, model_config.cache_dir, self.num_threads
                )
                self.compiled.start()
                decode = self.compiled.describe()
        logger.info(
            "model %s on %s, weights %s, %d threads (%s), attention %s (%s), context %d, %s; %s",
            self.model_dir,
            self.device,
            self.weight_format.describe(),
            self.num_threads,
            threads_reason,
            backend,
            backend_reason,
            self.max_model_len,
            decode,
            self.memory_plan.describe(),
        )

    def expert_load(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(layer index, tokens routed to each expert since start) of every MoE layer; () for a dense
        model. Plain reads (the HTTP thread calls it at scrape time)."""
        return tuple(
            (i, tuple(layer.mlp.expert_tokens.tolist()))
            for i, layer in enumerate(getattr(self.model, "layers", ()))
            if hasattr(layer.mlp, "expert_tokens")
        )

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk], return_hidden: bool = False):
        """Logits [N, vocab] fp32 (N = sum of num_logits over chunks with need_logits, in order);
        with return_hidden, (logits, hidden [N, hidden_size] after the final norm)."""
        self.kv.sync_map()  # a GPU sliding-window pool: the slot -> row changes since the last step
        if self.graphs is not None and not return_hidden and self.graphs.accepts(chunks):
            return self.graphs.run(chunks)
        if self.compiled is not None and not return_hidden and self.compiled.accepts(chunks):
            logits = self.compiled.run(chunks)
            if logits is not None:  # None: the compiled step failed and is off now; run it eagerly
                return logits
        return run_chunks(
            self.model,
            self.kv.k,
            self.kv.v,
            chunks,
            self.device,
            return_hidden,
            self.slot_table,
            self.attention_backend == "cpu",
            self.kv.swa_map,
        )

    def _make_pool(self, cache_config, backend, budget, max_num_seqs, max_num_batched_tokens, spec_config):
        """(the KV pool, what the memory plan says of the windowed layers): a SlidingWindowKVPool when
        the model has sliding-window layers and nothing here needs every layer per token, else a
        KVPool (the reason in the second item, "" for a model without windows)."""
        a = self.arch

        def plain():
            return KVPool(a.num_layers, a.num_kv_heads, a.head_dim, self.kv_dtype, self.device, budget)

        if not a.windowed:
            return plain(), ""
        off = None
        if cache_config.disable_hybrid_swa_memory:
            off = "disable_hybrid_swa_memory"
        elif cache_config.kv_host_bytes or cache_config.kv_disk_dir:
            off = "the KV host/disk tiers copy every layer per token"
        elif spec_config is not None and spec_config.method == "draft":
            off = "a draft model's pool is sized from this one's tokens"
        if off is None:
            layer_bytes = KVPool.bytes_per_token_of(1, a.num_kv_heads, a.head_dim, self.kv_dtype)
            plan = plan_window_pool(
                a.layer_windows,
                layer_bytes,
                budget,
                max_num_seqs,
                max_num_batched_tokens,
                self.max_model_len,
                cache_config.swa_full_tokens_ratio,
            )
            if isinstance(plan, str):
                off = plan
        if off is not None:
            return plain(), f"plain pool: the windowed layers keep every token too ({off})"
        kv = SlidingWindowKVPool(
            a.layer_windows, a.num_kv_heads, a.head_dim, self.kv_dtype, self.device, *plan
        )
        return kv, (
            f"sliding-window pool (the model has {kv.num_window_layers} sliding-window layers, window "
            f"{kv.window}): the tokens above hold the {kv.num_full_layers} full-attention layers' K/V, "
            f"{kv.num_window_slots} rows x "
            f"{kv.window_bytes_per_token} bytes/row the windowed layers' for the tokens still attended"
        )


@torch.inference_mode()
def run_chunks(
    model,
    k_caches,
    v_caches,
    chunks: list[SeqChunk],
    dev: torch.device,
    return_hidden: bool = False,
    slot_table: SlotTable | None = None,
    cpu_kernel: bool = False,
    swa_map: torch.Tensor | None = None,
):
    """One forward of `model` (forward(ids, positions, k_caches, v_caches, meta) -> hidden,
    compute_logits(hidden) -> logits) over a flat batch of chunks; see ModelRunner.execute.
    With a slot_table the Triton kernels run, else the torch path (decode attention through the
    C++ kernel with cpu_kernel, which must be loaded). An empty batch gives logits [0, vocab]."""
    if not chunks:
        empty = torch.empty(0, model.arch.vocab_size, device=dev)
        return (empty, torch.empty(0, model.arch.hidden_size, device=dev)) if return_hidden else empty
    if slot_table is not None:
        from agentrt.runtime.triton_attention import build_triton_metadata

        batch = build_triton_metadata(chunks, slot_table, dev)
    else:
        batch = build_torch_metadata(chunks, dev, cpu_kernel)
    batch.meta.swa_map = swa_map
    hidden = model(batch.input_ids, batch.positions, k_caches, v_caches, batch.meta)
    rows = hidden[batch.logit_idx]
    logits = model.compute_logits(rows)
    return (logits, rows) if return_hidden else logits
