"""The weights on 2 MiB pages (runtime/hugepages.py): values, tensor identities, ties and views are
kept, the mapping is one the kernel may back with huge pages, and a run without them is unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from agentrt.runtime import hugepages
from agentrt.runtime.config import CacheConfig, ModelConfig
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.hugepages import HUGE_PAGE, hugepage_buffer, move_to_hugepages, thp_mode
from agentrt.runtime.model_runner import ModelRunner
from tests.support.models import make_tiny_model

needs_thp = pytest.mark.skipif(thp_mode() == "never", reason="the kernel gives no transparent huge pages")


def _vma_fields(ptr: int) -> dict[str, str]:
    """/proc/self/smaps fields of the mapping that holds address ptr."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= ptr < hi
            elif inside:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    return fields


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 64), nn.Linear(64, 300, bias=False))
    m[2].weight = m[0].weight  # a tied LM head
    m.register_buffer("table", m[1].weight[5:9, 3:40], persistent=False)  # a view of another weight
    m.register_buffer("empty", torch.empty(0))
    return m


@needs_thp
def test_weights_move_to_one_advised_mapping_unchanged():
    m = _model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    table = m.table.clone()
    params = list(m.parameters())
    x = torch.randint(0, 300, (7,))
    want = m(x)
    moved = move_to_hugepages(m)
    assert moved >= sum(p.numel() * 4 for p in params)
    assert list(m.parameters()) == params  # the same tensor objects
    assert m[2].weight is m[0].weight and torch.equal(m(x), want)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    # the view still views the weight it came from, at the same place
    assert m.table.untyped_storage().data_ptr() == m[1].weight.untyped_storage().data_ptr()
    assert m.table.data_ptr() - m[1].weight.data_ptr() == (5 * 64 + 3) * 4 and torch.equal(m.table, table)
    ptrs = [p.data_ptr() for p in params]
    assert max(ptrs) - min(ptrs) < moved and all(p % hugepages.ALIGN == 0 for p in ptrs)
    vma = _vma_fields(ptrs[0])
    assert vma.get("THPeligible") == "1", vma  # the kernel may back it with 2 MiB pages
    assert "hg" in vma.get("VmFlags", "").split()  # MADV_HUGEPAGE


@needs_thp
def test_a_buffer_starts_on_a_huge_page():
    buf = hugepage_buffer(3 * HUGE_PAGE + 5)
    assert buf is not None and buf.numel() == 3 * HUGE_PAGE + 5 and buf.data_ptr() % HUGE_PAGE == 0
    assert int(buf.sum()) == 0


def test_switched_off_leaves_the_weights(monkeypatch):
    monkeypatch.setenv("AGENTRT_HUGEPAGES", "0")
    m = _model()
    ptrs = [p.data_ptr() for p in m.parameters()]
    assert move_to_hugepages(m) == 0 and [p.data_ptr() for p in m.parameters()] == ptrs
    assert hugepage_buffer(100) is None
    for word in ("false", "OFF", "no"):
        monkeypatch.setenv("AGENTRT_HUGEPAGES", word)
        assert hugepage_buffer(100) is None


def test_no_transparent_huge_pages_leaves_the_weights(monkeypatch, tmp_path):
    (tmp_path / "enabled").write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "_THP_ENABLED", tmp_path / "enabled")
    assert thp_mode() == "never"
    m = _model()
    assert move_to_hugepages(m) == 0
    monkeypatch.setattr(hugepages, "_THP_ENABLED", tmp_path / "absent")
    assert thp_mode() == "never"
    (tmp_path / "odd").write_text("always [] never\n")
    monkeypatch.setattr(hugepages, "_THP_ENABLED", tmp_path / "odd")
    assert thp_mode() == "never"


@needs_thp
def test_a_loaded_model_runs_from_the_mapping_with_the_same_logits(default_model_dir, tmp_path, monkeypatch):
    """model_runner's load moves the packed weights (after every repacking) into the mapping; the
    logits are bit for bit those of the same weights on ordinary pages."""
    model = make_tiny_model(tmp_path / "m", default_model_dir, "llama", hidden_size=128)

    def logits() -> tuple[torch.Tensor, ModelRunner]:
        cfg = ModelConfig(model=str(model), device="cpu", dtype="float32", quantization="int4")
        runner = ModelRunner(cfg, CacheConfig(kv_cache_bytes=1 << 20))
        ids = list(range(100, 110))
        slots = runner.kv.allocate(len(ids))
        out = torch.cat(
            [runner.execute([SeqChunk(ids[: i + 1], 0, slots[: i + 1])]) for i in range(len(ids))]
        )
        return out, runner

    on, runner = logits()
    qweight = runner.model.layers[0].mlp.down_proj.qweight
    assert "hg" in _vma_fields(qweight.data_ptr()).get("VmFlags", "").split()
    monkeypatch.setenv("AGENTRT_HUGEPAGES", "0")
    off, runner = logits()
    assert "hg" not in _vma_fields(runner.model.layers[0].mlp.down_proj.qweight.data_ptr()).get("VmFlags", "")
    assert torch.equal(on, off)
