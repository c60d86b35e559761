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
