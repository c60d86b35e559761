"""Model runner: loads weights and the KV pool, turns a scheduled batch into one forward pass."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass

import torch

from agentrt.runtime.backends import make_backend
from agentrt.runtime.config import CacheConfig, ModelConfig, SpecConfig
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kv_cache import KVPool, kv_dtype_name
from agentrt.runtime.kv_window import SlidingWindowKVPool, plan_window_pool
from agentrt.runtime.models.config import check_config_counts
from agentrt.runtime.models.formats import load_model
from agentrt.runtime.models.loader import (
    collect_stop_ids,
    load_tokenizer,
    read_chat_template,
    resolve_model_dir,
)
from agentrt.runtime.models.registry import arch_from_hf_config, read_hf_config
from agentrt.runtime.recurrent_state import StatePool, plan_state_slots
from agentrt.runtime.run_plan import plan_run

logger = logging.getLogger(__name__)


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
    kv_note: str = ""  # what a token's KV is when not K and V per layer (latent attention), or ""
    state: str = ""  # the recurrent layers' state pool (recurrent_state.py), "" without recurrent layers

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
            + (f" ({self.kv_note})" if self.kv_note else "")
            + (f" (KV tokens per GiB: {per_gib})" if per_gib else "")
            + (f"; {self.window_kv}" if self.window_kv else "")
            + (f"; {self.state}" if self.state else "")
            + f", reserved {self.reserved_bytes / gb:.2f} GB"
            + (f" of {self.total_bytes / gb:.1f} GB" if self.total_bytes else "")
        )


def kv_tokens_per_gib(arch) -> tuple[tuple[str, int], ...]:
    """(KV dtype, tokens one GiB of pool holds) for float32, float16 and int8 (scales counted) of a
    model with `arch`'s layers, KV heads and head size."""
    return tuple(
        (
            kv_dtype_name(d),
            (1 << 30) // KVPool.bytes_per_token_of(arch.kv_layout()[0], d),
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

    At start: the run's plan (run_plan.plan_run: dtype, threads, attention backend, compiled decode,
    quantization, linear kernel, element-wise ops, KV dtype, each with its reason), the model built
    with the plan's ops (models/formats.load_model), the KV pool, then one Backend
    (backends.make_backend: Triton kernels on CUDA with decode batches replayed from CUDA graphs; on
    the CPU the C++ attention and element-wise kernels at float32, else torch's gather + SDPA, decode
    batches through the C++ whole-stack op or the compiled graphs where the plan takes them; see
    docs/architecture.md, "The forward"). Weights load straight to the device in the run dtype (bf16
    on CUDA, fp32 on CPU by default); dense fp32 linear layers on the CPU run oneDNN's packed matmul
    (models/cpu_linear.py).

    execute(chunks) runs one forward over all chunks (`backend.run`) and returns logits [N, vocab]
    fp32 for the last `num_logits` new tokens of each chunk with need_logits (in order).
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
        self.model_dir = resolve_model_dir(model_config.model, model_config.cache_dir)
        check_config_counts(json.loads((self.model_dir / "config.json").read_text()))
        hf_config = read_hf_config(self.model_dir)
        self.arch = arch_from_hf_config(hf_config)
        self.plan = plan = plan_run(model_config, cache_config, self.arch, self.model_dir)
        self.device, self.dtype, self.num_threads = plan.device, plan.dtype, plan.threads
        self.max_model_len, self.kv_dtype, self.attention_backend = (
            plan.max_model_len,
            plan.kv_dtype,
            plan.backend,
        )
        if self.device.type == "cpu":
            torch.set_num_threads(self.num_threads)
        self._load_tokenizer(model_config, hf_config)
        self.model, self.weight_format = load_model(
            self.arch, self.max_model_len, self.model_dir, self.device, self.dtype, plan.dtype_reason,
            plan.quantization, plan.group_size, plan.quantize_lm_head, model_config.cache_dir,
            (plan.linear_kernel, plan.linear_reason), cpu_kernels=plan.cpu_kernels, ops=plan.ops,
        )  # fmt: skip
        if model_config.quantization == "auto":
            self.weight_format = dataclasses.replace(self.weight_format, quant_reason=plan.quant_reason)
        self.weights_bytes = sum(n for _, n in self.weight_format.bytes)
        self._make_pool_and_plan(cache_config, max_num_seqs, max_num_batched_tokens, spec_config)
        self.backend = make_backend(
            plan.backend, self.model, self.kv, self.device, reason=plan.backend_reason, compiled=plan.compiled,
            max_num_seqs=max_num_seqs, max_len=self.max_model_len,
            graph_batch_sizes=model_config.cuda_graph_batch_sizes,
            capture_graphs=self.device.type == "cuda" and not model_config.enforce_eager,
            cache_dir=model_config.cache_dir, threads=self.num_threads,
        )  # fmt: skip
        # the decode batch sizes replayed from captured CUDA graphs (() without them)
        self.cuda_graph_sizes: tuple[int, ...] = self.backend.captured_sizes
        decode = self.backend.describe()  # how decode steps run, for the start line
        if model_config.compile_decode and not plan.compiled:
            decode = f"decode eager ({plan.decode_reason})"
        self.decode = decode
        logger.info(
            "model %s on %s, weights %s, %d threads (%s), attention %s (%s), context %d, %s; %s",
            self.model_dir, self.device, self.weight_format.describe(), self.num_threads, plan.threads_reason,
            plan.backend, plan.backend_reason, self.max_model_len, decode, self.memory_plan.describe(),
        )  # fmt: skip

    def _load_tokenizer(self, model_config: ModelConfig, hf_config) -> None:
        """The tokenizer and stop ids (a --chat-template file replaces the model's template)."""
        loaded = load_tokenizer(self.model_dir, hf_config, self.arch.vocab_size)
        self.tokenizer, self.stop_ids = loaded.tokenizer, loaded.stop_ids
        if model_config.chat_template is not None:
            self.tokenizer.chat_template = read_chat_template(model_config.chat_template)
            self.stop_ids = collect_stop_ids(self.tokenizer, self.model_dir, hf_config)

    def _make_pool_and_plan(self, cache_config, max_num_seqs, max_num_batched_tokens, spec_config) -> None:
        """The KV pool (`kv`) in the budget plan_kv_budget leaves (shared with a draft model's pool),
        and the MemoryPlan that says where the memory went."""
        a = self.arch
        bytes_per_token = KVPool.bytes_per_token_of(a.kv_layout()[0], self.kv_dtype)
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
        states, state_note = self._make_states(cache_config, budget, max_num_seqs)
        if states is not None:
            budget -= states.pool_bytes
        self.kv, window_kv = self._make_pool(
            cache_config, budget, max_num_seqs, max_num_batched_tokens, spec_config
        )
        self.kv.states = states
        mla = self.arch.mla
        kv_note = mla.describe_kv(a.num_layers, a.num_heads, self.kv_dtype) if mla is not None else ""
        self.memory_plan = MemoryPlan(
            str(self.device), self.weights_bytes, self.kv.bytes_per_token, self.kv.pool_bytes, self.kv.num_slots,
            reserved, total, self.weight_format.bytes, kv_dtype_name(self.kv_dtype),
            () if self.kv.window else kv_tokens_per_gib(a),  # (a plain pool's)
            window_kv,
            kv_note=kv_note,
            state=state_note,
        )  # fmt: skip

    def _make_states(self, cache_config, budget: int, max_num_seqs: int):
        """(the recurrent layers' StatePool, what the memory plan says of it), (None, "") for a model
        without recurrent layers: a working slot per running sequence (+1) and snapshot slots for
        the prefix cache (recurrent_state.plan_state_slots: `state_slots` in all, else a quarter of
        the KV budget, at least as many as working slots). With the KV tiers, the snapshot interval
        is rounded up to a multiple of their block (a snapshot goes down beside the block ending at
        its depth). Raises ValueError when the budget cannot hold the working slots."""
        layers = self.arch.recurrent_layers
        if not layers:
            return None, ""
        shapes = [self.model.layers[i].linear_attn.state_shapes() for i in layers]
        per_slot = StatePool.bytes_per_slot_of(shapes)
        working = max_num_seqs + 1
        slots = plan_state_slots(budget, per_slot, max_num_seqs, cache_config.state_slots)
        pool = StatePool(shapes, slots, self.device)
        pool.snapshot_interval = every = cache_config.state_snapshot_interval
        if cache_config.kv_host_bytes or cache_config.kv_disk_dir:  # a block end each (kv_tiers keys them)
            block = cache_config.kv_tier_block_tokens
            pool.snapshot_interval = -(-every // block) * block
        return pool, (
            f"recurrent state ({len(layers)} of {self.arch.num_layers} layers): {slots} slots x "
            f"{per_slot:,} bytes = {pool.pool_bytes / 1e9:.3f} GB ({working} working, the rest prefix "
            f"snapshots every {pool.snapshot_interval} tokens)"
        )

    def expert_load(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(layer index, tokens routed to each expert since start) of every MoE layer (its first module
        counting `expert_tokens`: the MLP, or Gemma 4's MoE beside it); () for a dense model. Plain
        reads (the HTTP thread calls it at scrape time)."""
        load = []
        for i, layer in enumerate(getattr(self.model, "layers", ())):
            moe = next((m for m in layer.modules() if hasattr(m, "expert_tokens")), None)
            if moe is not None:
                load.append((i, tuple(moe.expert_tokens.tolist())))
        return tuple(load)

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk], return_hidden: bool = False):
        """Logits [N, vocab] fp32 (N = sum of num_logits over chunks with need_logits, in order);
        with return_hidden, (logits, hidden [N, hidden_size] after the final norm)."""
        self.kv.sync_map()  # a GPU sliding-window pool: the slot -> row changes since the last step
        return self.backend.run(chunks, return_hidden)

    def _make_pool(self, cache_config, budget, max_num_seqs, max_num_batched_tokens, spec_config):
        """(the KV pool, what the memory plan says of the windowed layers): a SlidingWindowKVPool when
        the model has sliding-window layers and nothing here needs every layer per token, else a
        KVPool (the reason in the second item, "" for a model without windows)."""
        a = self.arch

        def plain():
            return KVPool(a.kv_layout()[0], self.kv_dtype, self.device, budget)

        if not a.windowed:
            return plain(), ""
        off = None
        if not a.uniform_kv:
            off = "the model's KV caches differ in shape or are shared between layers"
        elif cache_config.disable_hybrid_swa_memory:
            off = "disable_hybrid_swa_memory"
        elif cache_config.kv_host_bytes or cache_config.kv_disk_dir:
            off = "the KV host/disk tiers copy every layer per token"
        elif spec_config is not None and spec_config.method == "draft":
            off = "a draft model's pool is sized from this one's tokens"
        if off is None:
            layer_bytes = KVPool.bytes_per_token_of(a.kv_layout()[0][:1], self.kv_dtype)
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
