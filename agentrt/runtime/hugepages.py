"""CPU memory on 2 MiB pages (transparent huge pages) for what a decode step streams: the weights.

A batch-1 decode step reads every weight once, in layer order. On 4 KiB pages the hardware
prefetchers stop at each page boundary and every page costs a TLB miss, so a few threads read below
the machine's bandwidth (docs/benchmarks.md has the measured difference). Linux
backs an anonymous mapping with 2 MiB pages when it is advised to (`madvise(MADV_HUGEPAGE)`, the
kernel's `transparent_hugepage/enabled` set to `madvise` or `always`), which torch's allocator does
only for single allocations of 2 MiB and more, and only with `THP_MEM_ALLOC_ENABLE=1`. A model's
weights are hundreds of tensors of 0.1-2 MB, so `move_to_hugepages` copies them into one advised
mapping instead, in module order (the order a step reads them), and points each tensor at its part
(`Tensor.set_`: every holder of the tensor sees the new storage).

Source of the technique: the Linux kernel's Documentation/admin-guide/mm/transhuge.rst;
torch's c10/core/impl/alloc_cpu.cpp (`THP_MEM_ALLOC_ENABLE`).
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor starts on a cache line
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent huge page mode, `always`, `madvise` or `never` (`never` where the
    file is absent: not Linux, or a kernel without THP)."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return "never"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1] or "never"
    return "never"


def hugepage_buffer(nbytes: int) -> torch.Tensor | None:
    """A zeroed uint8 tensor [nbytes] whose memory is an anonymous mapping advised for 2 MiB pages
    and starting on a 2 MiB boundary; None when the kernel gives no huge pages to an advised mapping
    (THP `never`, not Linux) or `AGENTRT_HUGEPAGES=0` (or false/no/off). The tensor keeps the mapping
    alive."""
    off = os.environ.get("AGENTRT_HUGEPAGES", "1").strip().lower() in ("0", "false", "no", "off")
    if nbytes <= 0 or off or thp_mode() == "never":
        return None
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # whole 2 MiB pages from a 2 MiB boundary
    try:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, OverflowError, ValueError):  # no address space: the caller's allocator says why
        return None
    whole = torch.frombuffer(m, dtype=torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE
    return whole[skip : skip + nbytes]


def zeros_on_hugepages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A zero CPU tensor of `shape` and `dtype` in a mapping advised for 2 MiB pages (a KV pool
    layer: decode attention streams it like the weights), None where huge pages are not available
    (hugepage_buffer) or when it is smaller than one (nothing to gain, and a whole 2 MiB page would
    back it). Its memory is taken as it is first written, not at allocation."""
    n = dtype.itemsize
    for d in shape:
        n *= d
    buf = hugepage_buffer(n) if n >= HUGE_PAGE else None
    return None if buf is None else buf.view(dtype).view(shape)


def _storages(model: nn.Module) -> dict[int, list[torch.Tensor]]:
    """The model's dense CPU parameters and buffers grouped by the storage they view (a tied weight
    once, views of one storage together), in module order; mkldnn tensors (oneDNN's packed
    weights) and empty ones have no storage to move."""
    groups: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for mod in model.modules():
        for t in [*mod.parameters(recurse=False), *mod.buffers(recurse=False)]:
            if t is None or id(t) in seen or t.device.type != "cpu" or t.layout != torch.strided:
                continue
            if t.is_mkldnn or t.untyped_storage().nbytes() == 0:
                continue
            seen.add(id(t))
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    return groups


def move_to_hugepages(model: nn.Module) -> int:
    """Copy the storages of the model's CPU parameters and buffers into one mapping on 2 MiB pages
    (hugepage_buffer), in module order, and point every tensor at its copy (same shape, strides,
    offset and dtype: values and tensor identities are unchanged, tied weights stay tied). Returns
    the bytes moved: 0 where huge pages are not available (the weights left as they are)."""
    groups = _storages(model)
    spans, total = [], 0
    for tensors in groups.values():
        spans.append((tensors, total))
        total += -(-tensors[0].untyped_storage().nbytes() // ALIGN) * ALIGN
    arena = hugepage_buffer(total)
    if arena is None:
        return 0
    storage, base = arena.untyped_storage(), arena.storage_offset()
    with torch.no_grad():
        for tensors, start in spans:
            old = tensors[0].untyped_storage()
            src = torch.empty(0, dtype=torch.uint8).set_(old, 0, (old.nbytes(),), (1,))
            arena[start : start + old.nbytes()].copy_(src)
            for t in tensors:
                at = (base + start) // t.element_size() + t.storage_offset()
                t.set_(storage, at, t.shape, t.stride())
    logger.debug("%d weight storages (%.1f MB) on 2 MiB pages", len(spans), total / 1e6)
    return total
