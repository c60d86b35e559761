"""--deterministic on the Triton path (CPU: the Triton interpreter; GPU: compiled kernels): the
linear layers and norms on the batch-invariant Triton kernels, and a sequence's logits bitwise the
same alone, in a batch (CUDA-graph buffers padded or eager), and prefilled in one chunk or two.
And what --deterministic refuses."""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from agentrt.runtime.engine import Engine
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kernels import triton_usable

pytestmark = pytest.mark.skipif(
    not triton_usable(torch.device("cpu")) and not torch.cuda.is_available(),
    reason="needs triton (TRITON_INTERPRET=1 on CPU)",
)


def engine(path, **model) -> Engine:
    return Engine(
        EngineConfig(
            model=ModelConfig(model=str(path), device="cpu", cuda_graph_batch_sizes=(1, 2, 4), **model),
            cache=CacheConfig(kv_cache_bytes=8 << 20),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        )
    )


@pytest.mark.slow  # ~2 minutes under the interpreter: 7 forwards through the 49152-row LM head's tiles
def test_deterministic_triton_rows_do_not_depend_on_the_batch_or_the_chunks(tiny_gqa_llama_dir):
    eng = engine(tiny_gqa_llama_dir, dtype="float32", attention_backend="triton", deterministic=True)
    runner = eng.runner
    assert runner.weight_format.linear_kernel == "triton"
    assert "TritonLinear" in repr(runner.model.lm_head)
    gen = torch.Generator().manual_seed(0)
    lens = [40, 5, 17]
    seqs = []
    for i, n in enumerate(lens):
        ids = torch.randint(0, 1000, (n + 1,), generator=gen).tolist()
        seqs.append((ids, runner.kv.allocate(n + 1), ("seq", i)))

    def prefill(parts):  # parts: (seq index, start, end) -> last-token logits per part
        chunks = [SeqChunk(seqs[i][0][a:b], a, seqs[i][1][:b], seq_key=seqs[i][2]) for i, a, b in parts]
        return runner.backend.eager.run(chunks)

    def decode(idx):
        chunks = [SeqChunk(seqs[i][0][-1:], lens[i], seqs[i][1], seq_key=seqs[i][2]) for i in idx]
        return runner.execute(chunks)  # the CUDA-graph runner's static buffers, padded to 1, 2 or 4

    alone = prefill([(0, 0, 40)])[0]
    batched = prefill([(1, 0, 5), (0, 0, 40), (2, 0, 17)])
    two_chunks = prefill([(0, 0, 23)]), prefill([(0, 23, 40)])[0]
    assert torch.equal(batched[1], alone)
    assert torch.equal(two_chunks[1], alone)
    one = decode([0])[0]
    three = decode([2, 0, 1])  # padded to 4
    assert torch.equal(three[1], one)
    assert torch.equal(decode([1, 0])[1], one)
    assert runner.backend.graphs.num_runs >= 3
    eng.grammar.shutdown()


@pytest.mark.parametrize(
    "model, match",
    [
        ({"dtype": "bfloat16"}, "only float32"),
        ({"dtype": "float32", "attention_backend": "torch"}, "attention backend torch"),
        ({"dtype": "float32", "linear_kernel": "aten"}, "aten is not batch-invariant"),
    ],
)
def test_deterministic_refuses_what_is_not_invariant(tiny_gqa_llama_dir, model, match):
    with pytest.raises(ValueError, match=match):
        engine(tiny_gqa_llama_dir, deterministic=True, **model)
