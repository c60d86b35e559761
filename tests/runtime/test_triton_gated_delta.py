"""The gated-delta-rule decode kernel (kernels/gated_delta_decode.py) vs its torch reference (CPU:
TRITON_INTERPRET=1, set in conftest; on a GPU the compiled kernel), and the reference vs the layer's
recurrence (layers.gated_delta.gated_delta_step) on the same normalised inputs, so a slip shared by
the kernel and its reference cannot pass. Grouped heads (Hv = 2 Hk), a head dim that is not a power
of two, several value blocks per head, slots scattered in a larger pool whose other rows must stay
untouched."""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime.kernels import triton_usable
from agentrt.runtime.layers.gated_delta import gated_delta_step, l2norm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_usable(DEVICE), reason="triton is not installed")


def inputs(batch: int, hk: int, hv: int, dk: int, dv: int, dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(batch, hv, dv, generator=gen)
    g = -torch.rand(batch, hv, generator=gen) * 2
    beta = torch.rand(batch, hv, generator=gen)
    pool = torch.randn(batch * 2 + 1, hv, dk, dv, generator=gen)
    slots = torch.randperm(pool.shape[0], generator=gen)[:batch].to(torch.int32)
    moved = [t.to(dtype).to(DEVICE) for t in (q, k, v)] + [t.to(DEVICE) for t in (g, beta, pool, slots)]
    return moved


@pytest.mark.parametrize(
    "batch,hk,hv,dk,dv,dtype",
    [
        (3, 2, 4, 32, 16, torch.float32),
        (2, 1, 2, 24, 40, torch.float32),
        (2, 2, 2, 128, 128, torch.float32),
        (2, 2, 4, 32, 16, torch.bfloat16),
    ],
)
def test_decode_kernel_matches_reference(batch, hk, hv, dk, dv, dtype):
    from agentrt.runtime.kernels.gated_delta_decode import gated_delta_decode, gated_delta_decode_ref

    q, k, v, g, beta, pool, slots = inputs(batch, hk, hv, dk, dv, dtype, seed=dk + dv)
    pool_ref, pool_kernel = pool.clone(), pool.clone()
    want = gated_delta_decode_ref(q, k, v, g, beta, pool_ref, slots)
    got = gated_delta_decode(q, k, v, g, beta, pool_kernel, slots)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(pool_kernel, pool_ref, atol=1e-5, rtol=1e-5)
    untouched = torch.ones(pool.shape[0], dtype=torch.bool)
    untouched[slots.long().cpu()] = False
    assert torch.equal(pool_kernel[untouched.to(DEVICE)], pool[untouched.to(DEVICE)])
    assert not torch.equal(pool_kernel[slots.long()], pool[slots.long()])


def test_reference_matches_layer_recurrence():
    from agentrt.runtime.kernels.gated_delta_decode import gated_delta_decode_ref

    q, k, v, g, beta, pool, slots = (t.cpu() for t in inputs(3, 2, 4, 32, 16, torch.float32, seed=5))
    pool_ref = pool.clone()
    want = gated_delta_decode_ref(q, k, v, g, beta, pool_ref, slots)
    state = pool[slots.long()].clone()
    qn = (l2norm(q) * 32**-0.5).repeat_interleave(2, dim=1)
    kn = l2norm(k).repeat_interleave(2, dim=1)
    got = gated_delta_step(qn, kn, v, g, beta, state)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool_ref[slots.long()], state, atol=1e-6, rtol=1e-6)


def test_decode_kernel_refuses_bad_inputs():
    from agentrt.runtime.kernels.gated_delta_decode import gated_delta_decode

    q, k, v, g, beta, pool, slots = inputs(2, 2, 4, 32, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        gated_delta_decode(q, k, v, g[:, :2], beta, pool, slots)
    with pytest.raises(ValueError, match="float32"):
        gated_delta_decode(q, k, v, g, beta, pool.double(), slots)


# The chunked prefill kernel (kernels/gated_delta_chunk.py). Tolerance: 1e-5 absolute and relative on
# outputs and states of magnitude ~0.3 (measured 2.8e-7 / 8e-7 in float32; the bf16 cases cast the
# same bf16 values to float32 in both, so the same bound holds).
def chunk_inputs(lengths, hk, hv, dk, dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    q, k = (torch.randn(t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 2
    beta = torch.rand(t, hv, generator=gen)
    pool = torch.randn(3 * len(lengths) + 2, hv, dk, dv, generator=gen)
    return [x.to(dtype).to(DEVICE) for x in (q, k, v)] + [x.to(DEVICE) for x in (g, beta, pool)]


def seq_states(lengths, snapshots, fresh):
    """SeqStates over consecutive rows: sequence i in working slot 3i + 1, its snapshots (token counts
    `snapshots[i]`) in the slots after it."""
    from agentrt.runtime.recurrent_state import SeqState

    seqs, start = [], 0
    for i, n in enumerate(lengths):
        snaps = [(m, 3 * i + 2 + j) for j, m in enumerate(snapshots[i])]
        seqs.append(SeqState(start, start + n, 3 * i + 1, fresh[i], snaps))
        start += n
    return seqs


@pytest.mark.parametrize(
    "lengths,snapshots,fresh,hk,hv,dk,dv,dtype",
    [
        # a full chunk + a remainder from a stored state, a short fresh one with a snapshot of the
        # empty prefix (zeros), exactly one chunk; grouped value heads, head dims not powers of two
        ([81, 5, 64], [[30, 81], [0], []], [False, True, False], 2, 4, 24, 40, torch.float32),
        ([70], [[]], [False], 1, 1, 128, 128, torch.float32),  # Qwen3-Next's head dims
        ([65, 1, 3], [[64], [], [1, 2]], [True, False, False], 2, 4, 32, 16, torch.bfloat16),
    ],
)
def test_chunk_kernel_matches_reference(lengths, snapshots, fresh, hk, hv, dk, dv, dtype):
    from agentrt.runtime.kernels.gated_delta_chunk import gated_delta_chunk, gated_delta_chunk_ref

    q, k, v, g, beta, pool = chunk_inputs(lengths, hk, hv, dk, dv, dtype, seed=sum(lengths))
    seqs = seq_states(lengths, snapshots, fresh)
    for s in seqs:
        if s.fresh:
            pool[s.slot] = float("nan")  # a fresh sequence's slot is never read
    pool_ref, pool_kernel = pool.clone(), pool.clone()
    want = gated_delta_chunk_ref(q, k, v, g, beta, pool_ref, seqs)
    got = gated_delta_chunk(q, k, v, g, beta, pool_kernel, seqs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_kernel, pool_ref, atol=1e-5, rtol=1e-5, equal_nan=True)
    written = {s.slot for s in seqs} | {slot for s in seqs for _, slot in s.snapshots}
    untouched = [i for i in range(pool.shape[0]) if i not in written]
    assert torch.equal(pool_kernel[untouched], pool[untouched])
    if [0] in snapshots:  # the empty prefix's snapshot of a fresh sequence is zeros
        i = snapshots.index([0])
        assert not pool_kernel[seqs[i].snapshots[0][1]].any()


def test_chunk_reference_matches_layer_recurrence():
    """The reference (the layer's chunked form, segment by segment) against the token-by-token
    recurrence on the same normalised inputs."""
    from agentrt.runtime.kernels.gated_delta_chunk import gated_delta_chunk_ref
    from agentrt.runtime.layers.gated_delta import gated_delta_recurrent

    lengths = [100]
    q, k, v, g, beta, pool = (x.cpu() for x in chunk_inputs(lengths, 2, 4, 32, 16, torch.float32, seed=7))
    seqs = seq_states(lengths, [[37]], [False])
    pool_ref = pool.clone()
    want = gated_delta_chunk_ref(q, k, v, g, beta, pool_ref, seqs)
    state = pool[1].clone()
    qn = (l2norm(q) * 32**-0.5).repeat_interleave(2, dim=1)
    kn = l2norm(k).repeat_interleave(2, dim=1)
    first = gated_delta_recurrent(qn[:37], kn[:37], v[:37], g[:37], beta[:37], state)
    torch.testing.assert_close(pool_ref[2], state, atol=1e-5, rtol=1e-5)  # the snapshot after 37
    rest = gated_delta_recurrent(qn[37:], kn[37:], v[37:], g[37:], beta[37:], state)
    torch.testing.assert_close(want, torch.cat([first, rest]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_ref[1], state, atol=1e-5, rtol=1e-5)


def test_chunk_kernel_refuses_bad_inputs():
    from agentrt.runtime.kernels.gated_delta_chunk import gated_delta_chunk

    q, k, v, g, beta, pool = chunk_inputs([10], 2, 4, 32, 16, torch.float32, seed=1)
    seqs = seq_states([10], [[]], [False])
    with pytest.raises(ValueError, match="do not fit"):
        gated_delta_chunk(q, k, v, g[:, :2], beta, pool, seqs)
    with pytest.raises(ValueError, match="float32"):
        gated_delta_chunk(q, k, v, g, beta, pool.double(), seqs)
