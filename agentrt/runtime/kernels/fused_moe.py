"""Fused mixture-of-experts: the experts of a sparse MoE block as two grouped GEMM kernels.

The design follows vLLM's `fused_moe` Triton kernel (and SGLang's port of it): every (token,
expert) pair the router chose is sorted by expert and each expert's run is padded to a multiple of
BLOCK_M ("moe_align_block_size"), so a block of BLOCK_M sorted rows belongs to a single expert. One
grouped GEMM then runs a program per (row block, output column block): it gathers the block's token
rows of x and multiplies them by that block's expert weight tile. Padding rows carry an
out-of-range sentinel pair id and are masked out.

- kernel 1: x @ W_gate_up[e]^T with both halves (gate and up) accumulated in the same program, the
  bias and activation applied in registers: writes h [T*k, I] (x's dtype), one row per pair.
- kernel 2: h @ W_down[e]^T + bias, times the pair's routing weight: writes [T*k, H] fp32, which
  is summed over the k pairs of each token in torch (a fixed order: deterministic, unlike the
  atomic adds of the vLLM kernel).

Activations: `silu` (Mixtral, Qwen3-MoE: silu(gate) * up, gate the first I rows of W_gate_up and
up the next I) and `swiglu_clamp` (gpt-oss, transformers' GptOssExperts: gate clamped from above
and up on both sides at `swiglu_limit`, h = (up + 1) * gate * sigmoid(1.702 * gate), gate/up rows
interleaved in W_gate_up with interleaved=True). Nothing here reads data on the host once the ids
are checked (check_ids=False skips that), so `fused_moe` can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from agentrt.runtime.kernels import dot_precision, upcast_dot

ACTIVATIONS = {"silu": 0, "swiglu_clamp": 1}
SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid scale (GptOssConfig.swiglu_alpha)


def _pad_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Sorted length that holds any routing of `num_pairs` pairs: each expert that has pairs
    adds at most block_m - 1 padding rows; rounded up to whole blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """`align_by_expert` without a host read: returns (sorted_pair_ids, block_expert, num_valid
    as a 0-d int64 tensor)."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    size = _pad_bound(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount without its host read of max()
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    start = torch.cumsum(counts, 0) - counts  # first sorted (unpadded) index of each expert
    rank = torch.arange(num_pairs, device=device) - start[sorted_experts]
    dest = (padded_end - padded)[sorted_experts] + rank
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest] = order.to(torch.int32)
    block_start = torch.arange(0, size, block_m, device=device)
    # the expert whose padded run covers the block's first row; experts with no pairs have an
    # empty run (searchsorted steps over them); blocks past the last run get -1 (skipped)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert, padded_end[-1]  # num_experts >= 1 (checked)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Sort the router's (token, expert) pairs by expert, each expert's run padded to block_m.

    topk_ids: [T, k] integer expert ids in [0, num_experts). Pair t*k + j is (token t, its j-th
    expert). Returns:
    - sorted_pair_ids [P] int32: pair ids grouped by expert in expert order (stable: ascending pair
      id within an expert), each expert's run padded with the sentinel T*k to a multiple of
      block_m; an expert without pairs has no run. P is a static bound, a multiple of block_m,
      that depends on T*k, num_experts and block_m only (so shapes never depend on the routing);
      rows from num_valid on are all sentinel.
    - block_expert [P // block_m] int32: the expert of each block of block_m rows; -1 for the
      unused blocks from num_valid // block_m on.
    - num_valid: int, the number of leading rows in use (the padded runs' total).
    As vLLM's moe_align_block_size, in torch ops (argsort, cumsum, searchsorted; no loop).
    Raises ValueError for block_m < 1, num_experts < 1, a non-integer topk_ids or an id out of range.
    """
    _check_ids(topk_ids, num_experts)
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    sorted_ids, block_expert, num_valid = _align(topk_ids, num_experts, block_m)
    return sorted_ids, block_expert, int(num_valid)


def _check_ids(topk_ids: torch.Tensor, num_experts: int, check_range: bool = True) -> None:
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if check_range and topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"topk_ids must lie in [0, {num_experts}), got values in [{lo}, {hi}]")


def _check_inputs(
    x,
    w_gate_up,
    w_down,
    topk_weights,
    topk_ids,
    activation,
    gate_up_bias,
    down_bias,
    swiglu_limit,
    check_ids=True,
) -> tuple[int, int, int, int, int]:
    """Validate the `fused_moe` arguments; returns (T, H, E, I, k)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
    if swiglu_limit is not None and activation != "swiglu_clamp":
        raise ValueError("swiglu_limit applies to activation='swiglu_clamp' only")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    tokens, hidden = x.shape
    if w_gate_up.dim() != 3 or w_gate_up.shape[2] != hidden or w_gate_up.shape[1] % 2:
        raise ValueError(f"w_gate_up must be [E, 2I, H={hidden}], got shape {tuple(w_gate_up.shape)}")
    experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if w_down.shape != (experts, hidden, inter):
        raise ValueError(f"w_down must be [E, H, I] = {(experts, hidden, inter)}, got {tuple(w_down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids and topk_weights must both be [T={tokens}, k], got {tuple(topk_ids.shape)} "
            f"and {tuple(topk_weights.shape)}"
        )
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    for name, bias, shape in (
        ("gate_up_bias", gate_up_bias, (experts, 2 * inter)),
        ("down_bias", down_bias, (experts, hidden)),
    ):
        if bias is not None and tuple(bias.shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(bias.shape)}")
    if w_gate_up.dtype != x.dtype or w_down.dtype != x.dtype:
        raise ValueError(f"weights must have x's dtype {x.dtype}, got {w_gate_up.dtype} and {w_down.dtype}")
    tensors = [x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_bias, down_bias]
    if len({t.device for t in tensors if t is not None}) != 1:
        raise ValueError("all tensors must be on one device")
    _check_ids(topk_ids, experts, check_range=check_ids)
    return tokens, hidden, experts, inter, topk_ids.shape[1]


@triton.jit
def _gate_up_kernel(
    X,
    W,
    Bias,
    Out,
    SortedIds,
    BlockExpert,
    num_pairs,
    top_k,
    hidden,
    inter,
    row_step,
    up_offset,
    limit,
    stride_xt,
    stride_xh,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_ot,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    ALPHA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    if expert < 0:  # an unused block past the padded runs
        return
    pairs = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs  # padding rows hold the sentinel num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    gate_rows = offs_n * row_step  # split: row n and I + n; interleaved: rows 2n and 2n + 1
    up_rows = gate_rows + up_offset
    w_base = W + expert * stride_we
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden
        a = tl.load(
            X + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xh,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(
            w_base + gate_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0
        )
        wu = tl.load(
            w_base + up_rows[None, :] * stride_wn + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0
        )
        if UPCAST:
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_gate += tl.dot(a, wg, out_dtype=tl.float32, input_precision=PRECISION)
        acc_up += tl.dot(a, wu, out_dtype=tl.float32, input_precision=PRECISION)
    if HAS_BIAS:
        b_base = Bias + expert * stride_be
        acc_gate += tl.load(b_base + gate_rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_base + up_rows, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if ACT == 0:  # silu(gate) * up
        h = acc_gate * tl.sigmoid(acc_gate) * acc_up
    else:  # gpt-oss: (clamp(up) + 1) * clamp(gate) * sigmoid(alpha * clamp(gate))
        if HAS_LIMIT:
            acc_gate = tl.minimum(acc_gate, limit)
            acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        h = (acc_up + 1.0) * acc_gate * tl.sigmoid(acc_gate * ALPHA)
    tl.store(
        Out + pairs.to(tl.int64)[:, None] * stride_ot + offs_n[None, :],
        h.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


@triton.jit
def _down_kernel(
    H,
    W,
    Bias,
    RouteW,
    Out,
    SortedIds,
    BlockExpert,
    num_pairs,
    hidden,
    inter,
    stride_ht,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_ot,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(SortedIds + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask = pairs < num_pairs
    rows = pairs.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    w_base = W + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < inter
        a = tl.load(
            H + rows[:, None] * stride_ht + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        w = tl.load(
            w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w, out_dtype=tl.float32, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    route = tl.load(RouteW + rows, mask=m_mask, other=0.0)
    acc = acc * route[:, None]
    tl.store(Out + rows[:, None] * stride_ot + offs_n[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: about the mean pairs per expert (decode batches waste little padding),
    between 16 (the smallest tensor-core tile) and 64."""
    mean = triton.cdiv(num_pairs, num_experts)
    return max(16, min(64, triton.next_power_of_2(mean)))


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    interleaved: bool = False,
    check_ids: bool = True,
) -> torch.Tensor:
    """The routed experts' output of a sparse MoE block, as two Triton grouped GEMMs.

    x: [T, H] (bf16 / fp16 / fp32); w_gate_up: [E, 2I, H] and w_down: [E, H, I] in x's dtype (any
    strides: transposed views such as transformers' GptOssExperts weights work without a copy);
    topk_weights: [T, k] routing weights (any float dtype, used as fp32); topk_ids: [T, k] integer
    expert ids in [0, E); gate_up_bias: [E, 2I] and down_bias: [E, H] optional, any float dtype.
    Returns [T, H] in x's dtype: out[t] = sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t]) with
    expert_e(v) = W_down[e] act(W_gate_up[e] v + gate_up_bias[e]) + down_bias[e].
    activation: "silu" (silu(gate) * up) or "swiglu_clamp" (gpt-oss; swiglu_limit clamps gate from
    above and up on both sides, None = no clamp). interleaved: gate/up are rows 2i / 2i + 1 of
    W_gate_up (gpt-oss) instead of rows i / I + i. The intermediate activation is rounded to x's
    dtype between the kernels (as the GPU GEMMs take it). check_ids=False skips the range check of
    topk_ids, the only host read (needed to capture a CUDA graph); out-of-range ids are then
    undefined behaviour.
    Raises ValueError on mismatched shapes, dtypes or devices, topk ids out of [0, E), an unknown
    activation, or swiglu_limit with activation="silu".
    Algorithm: vLLM's fused_moe (sort pairs by expert, pad to BLOCK_M, grouped GEMM), see module doc.
    """
    tokens, hidden, experts, _inter, top_k = _check_inputs(
        x,
        w_gate_up,
        w_down,
        topk_weights,
        topk_ids,
        activation,
        gate_up_bias,
        down_bias,
        swiglu_limit,
        check_ids,
    )
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    # biases are indexed with a unit stride along their last dimension (they are small)
    gate_up_bias = gate_up_bias.contiguous() if gate_up_bias is not None else None
    down_bias = down_bias.contiguous() if down_bias is not None else None
    block_m = _block_m(num_pairs, experts)
    sorted_ids, block_expert, _ = _align(topk_ids, experts, block_m)
    h = _gate_up_pass(
        x,
        w_gate_up,
        gate_up_bias,
        sorted_ids,
        block_expert,
        top_k,
        activation,
        swiglu_limit,
        interleaved,
        block_m,
    )
    route = topk_weights.reshape(-1).to(torch.float32).contiguous()
    partial = _down_pass(h, w_down, down_bias, route, sorted_ids, block_expert, block_m)
    return partial.view(tokens, top_k, hidden).sum(1).to(x.dtype)


def _gate_up_pass(
    x,
    w_gate_up,
    gate_up_bias,
    sorted_ids,
    block_expert,
    top_k,
    activation,
    swiglu_limit,
    interleaved,
    block_m,
) -> torch.Tensor:
    """Kernel 1: each sorted pair's x row @ W_gate_up[e]^T (+ bias), activated in registers.
    Returns h [T*k, I] in x's dtype, one row per (token, expert) pair."""
    num_pairs, hidden, inter = x.shape[0] * top_k, x.shape[1], w_gate_up.shape[1] // 2
    num_blocks = block_expert.numel()
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    upcast, precision = upcast_dot(x.dtype), dot_precision(x.dtype)
    block_n1 = min(64, max(16, triton.next_power_of_2(inter)))
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n1))](
        x,
        w_gate_up,
        gate_up_bias if gate_up_bias is not None else w_gate_up,
        h,
        sorted_ids,
        block_expert,
        num_pairs,
        top_k,
        hidden,
        inter,
        2 if interleaved else 1,
        1 if interleaved else inter,
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
        x.stride(0),
        x.stride(1),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        w_gate_up.stride(2),
        gate_up_bias.stride(0) if gate_up_bias is not None else 0,
        h.stride(0),
        ACT=ACTIVATIONS[activation],
        HAS_BIAS=gate_up_bias is not None,
        HAS_LIMIT=swiglu_limit is not None,
        ALPHA=SWIGLU_ALPHA,
        BLOCK_M=block_m,
        BLOCK_N=block_n1,
        BLOCK_K=32,
        UPCAST=upcast,
        PRECISION=precision,
    )
    return h


def _down_pass(h, w_down, down_bias, route, sorted_ids, block_expert, block_m) -> torch.Tensor:
    """Kernel 2: each pair's h row @ W_down[e]^T (+ bias) times its routing weight (route: [T*k]
    fp32). Returns partial [T*k, H] fp32, summed over each token's k pairs by the caller."""
    num_pairs, inter = h.shape
    hidden = w_down.shape[1]
    num_blocks = block_expert.numel()
    partial = torch.empty(num_pairs, hidden, dtype=torch.float32, device=h.device)
    upcast, precision = upcast_dot(h.dtype), dot_precision(h.dtype)
    block_n2 = min(64, max(16, triton.next_power_of_2(hidden)))
    _down_kernel[(num_blocks, triton.cdiv(hidden, block_n2))](
        h,
        w_down,
        down_bias if down_bias is not None else w_down,
        route,
        partial,
        sorted_ids,
        block_expert,
        num_pairs,
        hidden,
        inter,
        h.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        w_down.stride(2),
        down_bias.stride(0) if down_bias is not None else 0,
        partial.stride(0),
        HAS_BIAS=down_bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n2,
        BLOCK_K=32,
        UPCAST=upcast,
        PRECISION=precision,
    )
    return partial


def _activate(gate_up: torch.Tensor, activation: str, swiglu_limit, interleaved: bool) -> torch.Tensor:
    """[N, 2I] fp32 gate/up projections -> [N, I] activation (the reference's)."""
    if interleaved:
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return (up + 1) * gate * torch.sigmoid(gate * SWIGLU_ALPHA)


def fused_moe_ref(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    interleaved: bool = False,
) -> torch.Tensor:
    """Torch reference of `fused_moe`: same arguments, shapes and errors (ValueError), fp32 math
    with no rounding of the intermediate, a loop over the experts that were chosen (index_select
    of their tokens, two matmuls, index_add of the weighted result), as transformers' eager
    experts modules do. Returns [T, H] in x's dtype."""
    _check_inputs(
        x, w_gate_up, w_down, topk_weights, topk_ids, activation, gate_up_bias, down_bias, swiglu_limit
    )
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    route = topk_weights.reshape(-1).float()
    xf = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(flat).tolist():
        pairs = torch.nonzero(flat == e).squeeze(1)
        tokens = pairs // top_k
        gate_up = xf.index_select(0, tokens) @ w_gate_up[e].float().T
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[e].float()
        y = _activate(gate_up, activation, swiglu_limit, interleaved) @ w_down[e].float().T
        if down_bias is not None:
            y = y + down_bias[e].float()
        out.index_add_(0, tokens, y * route.index_select(0, pairs)[:, None])
    return out.to(x.dtype)
