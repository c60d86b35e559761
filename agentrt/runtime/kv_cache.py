"""KV pool: preallocated K and V tensors per layer, addressed by token slot (page size 1), stored at
the model's dtype, another float dtype, or quantized to int8 with one scale per token and KV head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from agentrt.runtime.hugepages import zeros_on_hugepages

KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8_e4m3")
# amax below this stores zeros with scale 0 (127 / amax would overflow float32 near 3.7e-37)
QUANT_MIN_AMAX = 1e-30


class QuantizedKV(NamedTuple):
    """One layer's int8 K (or V) pool: data [S, Hkv, D] int8 and scale [S, Hkv] float32, both
    contiguous, slot-major. Row (s, h) holds x ~= data[s, h, :] * scale[s, h] (see `quantize_kv`).
    `dtype` (torch.int8), `shape` (data's) and `device` read like a tensor's, so shape checks written
    for a float pool hold for it."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (q [..., D] int8, scale [...] float32): symmetric absmax per row, computed
    in float32: amax = max |x|; scale = amax / 127; q = round_half_even(x * (127 / amax)) clamped to
    [-127, 127]; a row with amax < QUANT_MIN_AMAX (zeros) gets q = 0 and scale = 0. Every store path
    (this reference, the C++ rope_store, the Triton rope_and_store) computes exactly these float32
    operations, so they write the same bytes for the same float32 input row. A row with a NaN gets a
    NaN scale (its dequantized values are NaN)."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    ok = amax >= QUANT_MIN_AMAX
    inv = torch.where(ok, 127.0 / torch.where(ok, amax, 1.0), 0.0)
    q = torch.round(x * inv[..., None]).clamp_(-127, 127).nan_to_num_(0.0).to(torch.int8)
    scale = torch.where(ok | amax.isnan(), amax / 127.0, 0.0)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., D] int8, scale [...] float32 -> q * scale [..., D] float32 (one rounding per element)."""
    return q.float() * scale[..., None]


def store_kv(cache: torch.Tensor | QuantizedKV, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write x [T, Hkv, D] to the pool rows `slots` [T] int64 of one layer's K or V cache: cast to a
    float pool's dtype, quantized (`quantize_kv`) into an int8 pool."""
    if isinstance(cache, QuantizedKV):
        q, scale = quantize_kv(x)
        cache.data[slots] = q
        cache.scale[slots] = scale
    else:
        cache[slots] = x.to(cache.dtype)


def gather_kv(cache: torch.Tensor | QuantizedKV, slots: torch.Tensor) -> torch.Tensor:
    """cache [S, Hkv, D], slots [...] int64 -> [..., Hkv, D]: the rows of those slots (index_select on
    the [S, Hkv * D] view: whole rows, 1.4x faster than advanced indexing), an int8 pool's
    de-quantized to float32 (only the gathered rows: the pool itself is never copied)."""
    flat = slots.reshape(-1)
    if isinstance(cache, QuantizedKV):
        s, h, d = cache.data.shape
        q = cache.data.reshape(s, h * d).index_select(0, flat).view(*slots.shape, h, d)
        return dequantize_kv(q, cache.scale.index_select(0, flat).view(*slots.shape, h))
    rows = cache.reshape(cache.shape[0], -1).index_select(0, flat)
    return rows.view(*slots.shape, *cache.shape[1:])


def resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool dtype of `--kv-cache-dtype name`: auto = the model's dtype; float32; float16 (the CPU
    attention kernel reads it in place, each value widened exactly); bfloat16; int8
    (quantized: QuantizedKV). Raises ValueError naming the problem for an unknown name, and for
    fp8_e4m3: it needs a CUDA device, and no kernel stores or reads fp8 yet (int8 is the quantized
    KV cache on every device)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name == "fp8_e4m3":
        if device.type != "cuda":
            raise ValueError(f"kv_cache_dtype fp8_e4m3 needs a CUDA device (here {device}): use int8")
        raise ValueError("kv_cache_dtype fp8_e4m3 is not implemented yet (no fp8 KV kernels): use int8")
    dtypes = {
        "float32": torch.float32,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "int8": torch.int8,
    }
    return model_dtype if name == "auto" else dtypes[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """float32 / bfloat16 / int8 ... (torch's name without the prefix)."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CacheSpec:
    """The shape of one KV cache (one per attention layer, or shared by the layers that read it):
    K rows [num_kv_heads, k_dim] and V rows [num_kv_heads, v_dim] per slot; v_dim 0 = no V cache
    (multi-head latent attention keeps its compressed latent in K)."""

    num_kv_heads: int
    k_dim: int
    v_dim: int

    def row_bytes(self, dtype: torch.dtype) -> int:
        """K + V bytes of one token in this cache at `dtype` (an int8 cache's float32 scale per row
        included)."""
        size = torch.empty((), dtype=dtype).element_size()
        scale = 4 if dtype == torch.int8 else 0
        k = self.k_dim * size + scale
        v = self.v_dim * size + scale if self.v_dim else 0
        return self.num_kv_heads * (k + v)


def uniform_layout(num_layers: int, num_kv_heads: int, head_dim: int) -> list[CacheSpec]:
    """One CacheSpec(num_kv_heads, head_dim, head_dim) per layer: the Llama layout."""
    return [CacheSpec(num_kv_heads, head_dim, head_dim)] * num_layers


class KVPool:
    """One K and one V cache per CacheSpec of `layout`, K [num_slots, Hkv, k_dim] and V
    [num_slots, Hkv, v_dim], addressed by slot.

    dtype: a float dtype (the caches are plain tensors of it), or torch.int8: each cache is then a
    QuantizedKV, data [num_slots, Hkv, D] int8 plus scale [num_slots, Hkv] float32, one symmetric
    absmax scale per token and KV head (x ~= data * scale; `quantize_kv` gives the exact rounding),
    written by every store path and read by every attention backend straight from these tensors.
    Other dtypes (the fake runner's int64) are plain tensors too.

    Sized from a byte budget: bytes_per_token = the sum over the caches of CacheSpec.row_bytes
    (2 x kv_heads x (head_dim x dtype bytes, + 4 for the float32 scale when int8) for a Llama layer). `allocate` pops slots from a free list (no partial
    allocation: it returns None when fewer than asked are free); `free` returns them. The free list
    is a stack kept so that slots come out in ascending runs (a fresh pool gives 0, 1, 2, ...; freed
    slots come back in the order they were freed): attention reads a sequence's K/V rows in slot
    order, and rows read in descending address order took twice as long (CPU decode kernel).
    Slots are token-granular, so no memory is lost to partially filled pages. Raises ValueError when
    the budget holds no token or cannot be allocated on the device.
    """

    def __init__(
        self,
        layout: list[CacheSpec],
        dtype: torch.dtype,
        device: torch.device,
        budget_bytes: int,
        num_slots: int | None = None,
        layer_rows: list[int] | None = None,
    ):
        self.dtype = dtype
        self.quantized = dtype == torch.int8
        self.layout = list(layout)
        self.bytes_per_token = self.bytes_per_token_of(self.layout, dtype)
        self.num_slots = int(budget_bytes // self.bytes_per_token) if num_slots is None else num_slots
        if self.num_slots < 1:
            raise ValueError(
                f"kv_cache_bytes={budget_bytes} holds no token ({self.bytes_per_token} bytes each)"
            )
        rows = layer_rows or [self.num_slots] * len(self.layout)

        def cache(n: int, heads: int, dim: int):
            shape = (n, heads, dim)
            data = zeros_on_hugepages(shape, dtype) if torch.device(device).type == "cpu" else None
            if data is None:
                data = torch.zeros(shape, dtype=dtype, device=device)
            if not self.quantized:
                return data
            return QuantizedKV(data, torch.zeros(shape[:2], dtype=torch.float32, device=device))

        try:
            self.k = [cache(n, c.num_kv_heads, c.k_dim) for n, c in zip(rows, self.layout)]
            self.v = [cache(n, c.num_kv_heads, c.v_dim) for n, c in zip(rows, self.layout)]
        except RuntimeError as e:  # includes torch.OutOfMemoryError
            self.k = self.v = []
            raise ValueError(
                f"cannot allocate a KV pool of {budget_bytes / 1e9:.2f} GB on {device} "
                f"({type(e).__name__}): lower kv_cache_bytes"
            ) from None
        self._free = list(range(self.num_slots - 1, -1, -1))

    @staticmethod
    def bytes_per_token_of(layout: list[CacheSpec], dtype: torch.dtype) -> int:
        """K + V bytes of one token over every cache of `layout` (an int8 pool's float32 scales
        included)."""
        return sum(c.row_bytes(dtype) for c in layout)

    def state_tensors(self) -> list[torch.Tensor]:
        """Every per-slot tensor of the pool, each with the slot as its first dimension: what a lower
        cache tier copies out of and back into the pool for a run of slots (`tensor[slots]`),
        whatever the KV dtype. A float pool: each layer's K, then each layer's V ([S, Hkv, D]). An
        int8 pool: each layer's K data, each layer's V data ([S, Hkv, D] int8), then each layer's K
        scales, each layer's V scales ([S, Hkv] float32)."""
        if not self.quantized:
            return [*self.k, *self.v]
        return [
            *(c.data for c in self.k),
            *(c.data for c in self.v),
            *(c.scale for c in self.k),
            *(c.scale for c in self.v),
        ]

    @property
    def pool_bytes(self) -> int:
        """Bytes of K/V (and int8 scales) the pool holds."""
        return self.num_slots * self.bytes_per_token

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take n free slots, or return None (and take nothing) when fewer than n are free."""
        if n > len(self._free):
            return None
        taken = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        taken.reverse()
        return taken

    def free(self, slots: list[int]) -> None:
        self._free.extend(reversed(slots))

    # A plain pool keeps every layer's K/V for every slot: the sliding-window pool's calls
    # (kv_window.SlidingWindowKVPool) are no-ops here, so the scheduler calls them on any pool.
    window = 0  # the largest window whose layers hold fewer rows than slots (0: none)
    states = None  # the recurrent layers' recurrent_state.StatePool beside the KV, or None
    swa_map = None  # slot -> window row [num_slots] int64, or None

    @property
    def num_free_window(self) -> int:
        return len(self._free)

    def reclaim(self, n: int, live: set[int]) -> int:
        return 0

    def touch(self, slots) -> None:
        pass

    def sync_map(self) -> None:
        pass

    def demote(self, slots) -> None:
        pass

    def usable_prefix(self, slots: list[int]) -> int:
        return len(slots)

    def adopt(self, mine: list[int], theirs: list[int]) -> None:
        """Free the request's slots `mine` that differ from the tree's `theirs` (duplicates)."""
        self.free([m for m, t in zip(mine, theirs) if m != t])
