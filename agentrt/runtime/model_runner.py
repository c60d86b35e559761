"""Model runner: loads weights and the KV pool, turns a scheduled batch into one forward pass."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from agentrt.runtime.attention import AttentionMetadata, PrefillSpan
from agentrt.runtime.config import CacheConfig, ModelConfig
from agentrt.runtime.kv_cache import KVPool
from agentrt.runtime.models.llama import LlamaArch, LlamaForCausalLM
from agentrt.runtime.models.loader import load_tokenizer, resolve_device_dtype, resolve_model_dir

logger = logging.getLogger(__name__)


@dataclass
class SeqChunk:
    """One sequence's part of a forward: `token_ids` new tokens at positions
    [context_len, context_len + len(token_ids)); `slots` are the KV slots of the whole context
    including the new tokens (len == context_len + len(token_ids)). `need_logits`: return the
    logits of the last `num_logits` new tokens (False for a prefill chunk that does not end the
    prompt; num_logits > 1 for a speculative verify chunk). `positions`: explicit positions of the
    new tokens (a draft tree: context_len + depth), with `tree_mask` [n, n] bool saying which new
    tokens each attends to; None = consecutive positions, causal."""

    token_ids: list[int]
    context_len: int
    slots: list[int]
    need_logits: bool = True
    num_logits: int = 1
    positions: list[int] | None = None
    tree_mask: torch.Tensor | None = None


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir} has no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


class ModelRunner:
    """Holds the model, tokenizer and KV pool on one device.

    execute(chunks) runs one forward over all chunks and returns logits [N, vocab] fp32 for the
    last new token of each chunk with need_logits (N of them, in order).
    """

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig):
        from transformers import AutoConfig

        self.model_dir = resolve_model_dir(model_config.model, model_config.cache_dir)
        hf_config = AutoConfig.from_pretrained(str(self.model_dir))
        self.arch = LlamaArch.from_hf_config(hf_config)
        self.device, self.dtype = resolve_device_dtype(model_config.device, model_config.dtype)
        limit = self.arch.max_position_embeddings
        window = getattr(hf_config, "sliding_window", None)
        if window and getattr(hf_config, "use_sliding_window", True):
            limit = min(limit, window)  # full attention is exact only inside the window
        self.max_model_len = model_config.max_model_len or limit
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's limit of {limit} tokens")
        loaded = load_tokenizer(self.model_dir, hf_config, self.arch.vocab_size)
        self.tokenizer, self.stop_ids = loaded.tokenizer, loaded.stop_ids
        with torch.device("meta"):
            model = LlamaForCausalLM(self.arch, self.max_model_len)
        model = model.to_empty(device=self.device)
        model.load_hf_state_dict(load_weights(self.model_dir))
        for p in model.parameters():
            p.data = p.data.to(self.dtype)
        model.init_rope()
        self.model = model.eval()
        self.weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        a = self.arch
        self.kv = KVPool(a.num_layers, a.num_kv_heads, a.head_dim, self.dtype, self.device,
                         cache_config.kv_cache_bytes)
        logger.info(
            "model %s on %s/%s: weights %.1f MB, KV %d bytes/token, %d KV tokens, context %d",
            self.model_dir, self.device, self.dtype, self.weights_bytes / 1e6,
            self.kv.bytes_per_token, self.kv.num_slots, self.max_model_len,
        )

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk], return_hidden: bool = False):
        """Logits [N, vocab] fp32 (N = sum of num_logits over chunks with need_logits, in order);
        with return_hidden, (logits, hidden [N, hidden_size] after the final norm)."""
        return run_chunks(self.model, self.kv.k, self.kv.v, chunks, self.device, return_hidden)


@torch.inference_mode()
def run_chunks(model, k_caches, v_caches, chunks: list[SeqChunk], dev: torch.device, return_hidden: bool = False):
    """One forward of `model` (forward(ids, positions, k_caches, v_caches, meta) -> hidden,
    compute_logits(hidden) -> logits) over a flat batch of chunks; see ModelRunner.execute."""
    ids, positions, new_slots, logit_idx = [], [], [], []
    decode_rows, prefills = [], []
    for chunk in chunks:
        n = len(chunk.token_ids)
        start = len(ids)
        ids.extend(chunk.token_ids)
        positions.extend(chunk.positions if chunk.positions is not None
                         else range(chunk.context_len, chunk.context_len + n))
        new_slots.extend(chunk.slots[chunk.context_len :])
        if chunk.need_logits:
            logit_idx.extend(range(start + n - chunk.num_logits, start + n))
        if n == 1 and chunk.context_len > 0:
            decode_rows.append((start, chunk.slots))
        else:
            kv_slots = None
            if chunk.context_len > 0:
                kv_slots = torch.tensor(chunk.slots, dtype=torch.int64, device=dev)
            tree_mask = chunk.tree_mask.to(dev) if chunk.tree_mask is not None else None
            prefills.append(PrefillSpan(start, start + n, chunk.context_len, kv_slots, tree_mask))
    decode_idx = decode_slots = decode_mask = None
    if decode_rows:
        max_len = max(len(s) for _, s in decode_rows)
        padded = [s + [0] * (max_len - len(s)) for _, s in decode_rows]
        decode_idx = torch.tensor([i for i, _ in decode_rows], dtype=torch.int64, device=dev)
        decode_slots = torch.tensor(padded, dtype=torch.int64, device=dev)
        lens = torch.tensor([len(s) for _, s in decode_rows], device=dev)
        decode_mask = (torch.arange(max_len, device=dev)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(new_slots, dtype=torch.int64, device=dev),
        decode_idx=decode_idx, decode_slots=decode_slots, decode_mask=decode_mask, prefills=prefills,
    )
    hidden = model(
        torch.tensor(ids, dtype=torch.int64, device=dev),
        torch.tensor(positions, dtype=torch.int64, device=dev),
        k_caches, v_caches, meta,
    )
    rows = hidden[torch.tensor(logit_idx, dtype=torch.int64, device=dev)]
    logits = model.compute_logits(rows)
    return (logits, rows) if return_hidden else logits
