"""CUDA graphs for the decode forward (as vLLM and SGLang capture them): one graph per batch size in
a fixed set, over static input buffers; a batch is padded up to the next captured size.

A step then costs one graph launch instead of hundreds of kernel launches, which is what keeps
small-batch decode near the memory-bandwidth bound. Padding rows write no KV (slot -1) and attend
to nothing (context length 0). Without capture (CPU, or enforce_eager) the same static-buffer path
runs eagerly, which is how the padding logic is tested without a GPU.
"""

from __future__ import annotations

import logging

import torch

from agentrt.runtime.backends.triton import SlotTable, TritonAttentionMetadata, TritonBackend
from agentrt.runtime.forward import SeqChunk, is_plain_decode
from agentrt.runtime.kernels.decode_attention import decode_splits

logger = logging.getLogger(__name__)


class DecodeGraphRunner:
    """Decode forwards at padded batch sizes over static buffers.

    model: forward(ids [B], positions [B], k_caches, v_caches, meta) -> hidden [B, hidden];
    compute_logits(hidden) -> [B, vocab] fp32. `capture`: record CUDA graphs (device must be CUDA);
    otherwise run the static-buffer forward eagerly.
    """

    def __init__(
        self,
        model,
        k_caches,
        v_caches,
        table: SlotTable,
        batch_sizes,
        device: torch.device,
        capture: bool,
        swa_map: torch.Tensor | None = None,
    ):
        self.model, self.k_caches, self.v_caches, self.table = model, k_caches, v_caches, table
        self.batch_sizes = sorted(set(batch_sizes))
        self.device = device
        n = self.batch_sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.page_rows = torch.zeros(n, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.metas = {
            bs: TritonAttentionMetadata(
                slot_mapping=self.slot_mapping[:bs],
                positions=self.positions[:bs],
                page_table=table.table,
                page_rows=self.page_rows[:bs],
                is_decode=True,
                seq_lens=self.seq_lens[:bs],
                num_splits=decode_splits(table.max_len),
                swa_map=swa_map,  # a sliding-window pool's map: updated in place, read by the graph
            )
            for bs in self.batch_sizes
        }
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_runs = 0  # decode steps served (replayed, or eager on static buffers)
        if capture:
            self._capture_all()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def accepts(self, chunks) -> bool:
        """A plain-decode batch no larger than the largest captured size."""
        return len(chunks) <= self.max_batch_size and is_plain_decode(chunks)

    def padded_size(self, batch: int) -> int | None:
        return next((bs for bs in self.batch_sizes if bs >= batch), None)

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(
            self.input_ids[:bs], self.positions[:bs], self.k_caches, self.v_caches, self.metas[bs]
        )
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):  # largest first: later graphs reuse its memory
                for _ in range(2):  # warm up: Triton compiles, allocator settles
                    self._forward(bs)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self._forward(bs)
                self.graphs[bs] = (graph, out)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    @torch.inference_mode()
    def run(self, chunks) -> torch.Tensor:
        """Logits [len(chunks), vocab] fp32 of a plain-decode batch (see is_plain_decode) of at
        most max_batch_size sequences. Host-to-device traffic: one [5, bs] int64 copy plus the
        slot-table update of the new tokens."""
        batch = len(chunks)
        bs = self.padded_size(batch)
        self.num_runs += 1
        rows = self.table.sync(
            [(c.seq_key if c.seq_key is not None else ("anon", i), c.slots) for i, c in enumerate(chunks)]
        )
        host = torch.zeros(5, bs, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        host[2].fill_(-1)
        host[:, :batch] = torch.tensor(
            [
                [c.token_ids[0] for c in chunks],
                [c.context_len for c in chunks],
                [c.slots[c.context_len] for c in chunks],
                rows,
                [c.context_len + 1 for c in chunks],
            ]
        )
        dev = host.to(self.device, non_blocking=True)
        self.input_ids[:bs].copy_(dev[0])
        self.positions[:bs].copy_(dev[1])
        self.slot_mapping[:bs].copy_(dev[2])
        self.page_rows[:bs].copy_(dev[3])
        self.seq_lens[:bs].copy_(dev[4])
        if bs in self.graphs:
            graph, out = self.graphs[bs]
            graph.replay()
            return out[:batch]
        return self._forward(bs)[:batch]


class CudaGraphBackend:
    """The Triton backend with plain-decode batches (forward.is_plain_decode) of up to the largest of
    `batch_sizes` sequences through a DecodeGraphRunner (captured CUDA graphs with `capture`, else
    the same static buffers eagerly); every other batch runs the Triton backend eagerly."""

    name = "triton"

    def __init__(self, eager: TritonBackend, batch_sizes, capture: bool):
        self.eager, self.reason = eager, eager.reason
        self.graphs = DecodeGraphRunner(
            eager.model,
            eager.kv.k,
            eager.kv.v,
            eager.slot_table,
            batch_sizes,
            eager.device,
            capture,
            eager.kv.swa_map,
        )
        # the batch sizes replayed from captured graphs (() when they run eagerly)
        self.captured_sizes = tuple(self.graphs.batch_sizes) if self.graphs.graphs else ()

    def prepare(self, chunks: list[SeqChunk]):
        return self.eager.prepare(chunks)

    def run(self, chunks: list[SeqChunk], return_hidden: bool = False):
        """Logits [N, vocab] fp32 (with return_hidden, and the hidden rows; never from a graph)."""
        if not return_hidden and self.graphs.accepts(chunks):
            return self.graphs.run(chunks)
        return self.eager.run(chunks, return_hidden)

    def describe(self) -> str:
        sizes = self.graphs.batch_sizes
        return (
            f"decode from CUDA graphs (batch {sizes[0]}-{sizes[-1]})"
            if self.graphs.graphs
            else "decode eager"
        )
