"""The CPU decode-attention kernel (runtime/kernels/cpu_kernels.py) against the torch path
(gather + SDPA), the backend choice, and the KV pool's slot order the kernel relies on for speed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentrt.runtime.attention import gather_slots
from agentrt.runtime.config import CacheConfig, ModelConfig, default_cache_dir
from agentrt.runtime.kernels import cpu_kernels
from agentrt.runtime.kv_cache import KVPool
from agentrt.runtime.model_runner import ModelRunner, SeqChunk, choose_attention_backend
from tests.helpers import make_tiny_model

FAILURE = cpu_kernels.load(default_cache_dir())
needs_kernel = pytest.mark.skipif(FAILURE is not None, reason=f"the C++ kernel is unavailable: {FAILURE}")


def reference(q, k_cache, v_cache, slots, lens):
    """The torch path's decode attention (attention.AttentionMetadata._decode without the kernel)."""
    mask = (torch.arange(slots.shape[1])[None, :] < lens[:, None])[:, None, None, :]
    kd = gather_slots(k_cache, slots).transpose(1, 2)
    vd = gather_slots(v_cache, slots).transpose(1, 2)
    gqa = q.shape[1] != k_cache.shape[1]
    return F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, enable_gqa=gqa).squeeze(2)


@needs_kernel
@pytest.mark.parametrize(
    "batch,heads,kv_heads,head_dim,max_len",
    [(1, 9, 3, 64, 37), (5, 8, 8, 32, 100), (16, 12, 3, 64, 257), (3, 4, 1, 16, 1), (2, 9, 3, 64, 2049)],
)
def test_kernel_matches_gather_and_sdpa(batch, heads, kv_heads, head_dim, max_len):
    gen = torch.Generator().manual_seed(batch * 1000 + max_len)
    num_slots = batch * max_len + 7
    k_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, kv_heads, head_dim, generator=gen)
    # each sequence's slots a random subset in random order (the pool after frees), padded with 0
    perm = torch.randperm(num_slots, generator=gen)
    slots = perm[: batch * max_len].view(batch, max_len).clone()
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    lens[0] = max_len
    for b in range(batch):
        slots[b, lens[b] :] = 0
    q = torch.randn(batch, heads, head_dim, generator=gen) * 3  # peaked softmax rows too
    got = cpu_kernels.decode_attention(q, k_cache, v_cache, slots, lens)
    assert got.shape == (batch, heads, head_dim) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, slots, lens), atol=2e-5, rtol=1e-5)


@needs_kernel
def test_loading_the_kernel_keeps_subnormal_floats():
    """A library linked with -ffast-math sets flush-to-zero for the whole process when it loads
    (crtfastmath.o); the kernel must not (the process has loaded it at import of this module)."""
    tiny = 2.2250738585072014e-308  # the smallest normal double
    assert tiny / 3 > 0
    assert (torch.tensor([1e-40], dtype=torch.float32) * 1.0).item() > 0


@needs_kernel
def test_kernel_refuses_bad_slots_and_lengths():
    k = torch.zeros(10, 1, 8)
    q = torch.zeros(1, 2, 8)
    with pytest.raises(RuntimeError, match="slot out of the pool"):
        cpu_kernels.decode_attention(q, k, k, torch.tensor([[3, 10]]), torch.tensor([2]))
    with pytest.raises(RuntimeError, match=r"lens must be in \[1, L\]"):
        cpu_kernels.decode_attention(q, k, k, torch.tensor([[3, 4]]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match="query heads must be a multiple of KV heads"):
        cpu_kernels.decode_attention(torch.zeros(1, 3, 8), torch.zeros(10, 2, 8), torch.zeros(10, 2, 8),
                                       torch.tensor([[1]]), torch.tensor([1]))  # fmt: skip


def test_backend_choice_names_why(tmp_path):
    cpu = torch.device("cpu")
    assert choose_attention_backend("auto", cpu, torch.bfloat16, tmp_path) == ("torch", "auto")
    assert choose_attention_backend("torch", cpu, torch.float32, tmp_path) == ("torch", "requested")
    with pytest.raises(
        ValueError, match=r"attention_backend 'cpu' needs the CPU at float32 \(here cpu, torch.bfloat16\)"
    ):
        choose_attention_backend("cpu", cpu, torch.bfloat16, tmp_path)
    with pytest.raises(ValueError, match="attention_backend must be auto, torch, cpu or triton"):
        ModelConfig(attention_backend="flash")
    if FAILURE is None:
        assert choose_attention_backend("auto", cpu, torch.float32, default_cache_dir())[0] == "cpu"


@needs_kernel
def test_model_logits_and_tokens_match_the_torch_path(default_model_dir, tmp_path):
    tiny = make_tiny_model(tmp_path / "m", default_model_dir, "llama", hidden_size=128)

    def runner(backend: str) -> ModelRunner:
        cfg = ModelConfig(model=str(tiny), device="cpu", dtype="float32", attention_backend=backend)
        return ModelRunner(cfg, CacheConfig(kv_cache_bytes=4 << 20))

    torch_runner, kernel_runner = runner("torch"), runner("auto")
    assert kernel_runner.attention_backend == "cpu"
    prompts = [list(range(100, 100 + n)) for n in (3, 17, 40)]
    outs = {}
    for name, r in (("torch", torch_runner), ("cpu", kernel_runner)):
        slots = [r.kv.allocate(len(p) + 8) for p in prompts]
        ids = [list(p) for p in prompts]
        logits_seen = []
        for step in range(8):  # prefill, then 7 batched greedy decode steps over 3 lengths
            chunks = [
                SeqChunk(ids[i] if step == 0 else ids[i][-1:], 0 if step == 0 else len(ids[i]) - 1,
                         slots[i][: len(ids[i])])
                for i in range(len(prompts))
            ]  # fmt: skip
            logits = r.execute(chunks)
            logits_seen.append(logits)
            for i, row in enumerate(logits):
                ids[i].append(int(row.argmax()))
        outs[name] = (ids, torch.stack(logits_seen))
    assert outs["torch"][0] == outs["cpu"][0]
    torch.testing.assert_close(outs["cpu"][1], outs["torch"][1], atol=1e-4, rtol=0)


def test_pool_gives_ascending_runs():
    pool = KVPool(1, 1, 4, torch.float32, torch.device("cpu"), 1 << 12)  # 128 slots
    a = pool.allocate(5)
    assert a == [0, 1, 2, 3, 4]
    assert [pool.allocate(1)[0] for _ in range(3)] == [5, 6, 7]
    pool.free(a)
    assert pool.allocate(5) == a  # a freed run comes back in its order
    pool.free([9, 3, 7])
    assert pool.allocate(3) == [9, 3, 7]


SCRIPT = """
import sys, torch
from pathlib import Path
from agentrt.runtime.kernels import cpu_kernels as c
from agentrt.runtime.model_runner import choose_attention_backend
cache = Path(sys.argv[1])
print("nocompiler", c.load(cache / "none"))
print("auto", choose_attention_backend("auto", torch.device("cpu"), torch.float32, cache / "none"))
try:
    choose_attention_backend("cpu", torch.device("cpu"), torch.float32, cache / "none")
except ValueError as e:
    print("explicit", e)
c._loaded.clear()
import os
os.environ.pop("CXX")
target = c.library_path(cache / "bad")
target.parent.mkdir(parents=True)
target.write_bytes(b"not a shared library")
print("damaged", c.load(cache / "bad"), target.stat().st_size > 1000)
"""


@needs_kernel
def test_no_compiler_falls_back_and_a_damaged_cache_entry_is_rebuilt(tmp_path):
    """In a fresh process (a loaded op stays loaded): with no compiler the kernel is unavailable,
    auto takes torch and says why, an explicit `cpu` is refused; a damaged cached library is
    rebuilt."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler")}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "nocompiler FileNotFoundError" in out or "nocompiler RuntimeError" in out, out
    assert "auto ('torch', " in out and "auto: the C++ kernels are unavailable: " in out
    assert "explicit attention_backend 'cpu': the C++ kernels are unavailable" in out
    assert "damaged None True" in out, out + proc.stderr
