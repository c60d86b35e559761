"""The Triton backend's recurrent layers (backends/triton_recurrent.py) on the CPU interpreter
(TRITON_INTERPRET=1, set in conftest; on a GPU the compiled kernels):

- the decode kernels over the state pool's slots (kernels/conv_step.py, kernels/ssd_decode.py) against
  their torch references, slots scattered in a larger pool whose other rows must stay untouched;
- a Gated DeltaNet and a Mamba-2 mixer through recurrent_state.run_recurrent with the Triton scans
  against the torch scans on one mixed batch (decoding sequences, a fresh prefill with snapshots
  including the empty prefix, a chunk from a stored state ending at a snapshot, a fresh single
  token): outputs and every slot of the pool (working and snapshot) within 1e-5 (measured 1.2e-6 /
  3e-7 on outputs up to 3.4 / 2.5, states 5e-7 / 1.2e-7; Gated DeltaNet / Mamba-2); a decoding row
  scans to the same bits alone and batched;
- the backend and the run plan: a hybrid model on --attention-backend triton decodes without CUDA
  graphs and the plan names how its recurrent layers run.
"""

from __future__ import annotations

import pytest
import torch

from agentrt.runtime.kernels import triton_usable
from agentrt.runtime.layers.gated_delta import GatedDeltaNet
from agentrt.runtime.layers.mamba2 import Mamba2Mixer
from agentrt.runtime.recurrent_state import TORCH_SCANS, RecurrentBatch, SeqState, StatePool, run_recurrent

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not triton_usable(DEVICE), reason="triton is not installed")
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _scattered(batch: int, rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return gen, torch.randperm(rows, generator=gen)[:batch].to(DEVICE)


def _untouched(after, before, slots):
    keep = torch.ones(before.shape[0], dtype=torch.bool, device=before.device)
    keep[slots.long()] = False
    return torch.equal(after[keep], before[keep])


@pytest.mark.parametrize(
    "channels,width,bias,dtype",
    [(40, 4, True, torch.float32), (300, 4, False, torch.float32), (24, 2, True, torch.bfloat16)],
)
def test_conv_step_matches_reference(channels, width, bias, dtype):
    from agentrt.runtime.kernels.conv_step import conv_step, conv_step_ref

    gen, slots = _scattered(3, 7, seed=channels)
    x = torch.randn(3, channels, generator=gen).to(dtype).to(DEVICE)
    pool = torch.randn(7, channels, width - 1, generator=gen).to(DEVICE)
    weight = torch.randn(channels, width, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(channels, generator=gen).to(dtype).to(DEVICE) if bias else None
    ref_pool, kernel_pool = pool.clone(), pool.clone()
    want = conv_step_ref(x, ref_pool, slots, weight, b)
    got = conv_step(x, kernel_pool, slots, weight, b)
    tol = TOL if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}  # torch sums in bf16
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(kernel_pool, ref_pool, **TOL)
    assert _untouched(kernel_pool, pool, slots)


@pytest.mark.parametrize("heads,groups,p,n", [(4, 2, 8, 16), (3, 1, 24, 10)])
def test_ssd_decode_matches_reference(heads, groups, p, n):
    from agentrt.runtime.kernels.ssd_decode import ssd_decode, ssd_decode_ref

    gen, slots = _scattered(3, 8, seed=p + n)
    x = torch.randn(3, heads, p, generator=gen)
    dt = torch.rand(3, heads, generator=gen)
    a, d = -torch.rand(heads, generator=gen) * 3, torch.randn(heads, generator=gen)
    b, c = (torch.randn(3, groups, n, generator=gen) for _ in range(2))
    pool = torch.randn(8, heads, p, n, generator=gen)
    x, dt, a, d, b, c, pool = (t.to(DEVICE) for t in (x, dt, a, d, b, c, pool))
    ref_pool, kernel_pool = pool.clone(), pool.clone()
    want = ssd_decode_ref(x, dt, a, b, c, d, ref_pool, slots)
    got = ssd_decode(x, dt, a, b, c, d, kernel_pool, slots)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(kernel_pool, ref_pool, **TOL)
    assert _untouched(kernel_pool, pool, slots)


def _mixer(kind: str):
    torch.manual_seed(5)
    if kind == "gated_delta":
        mixer = GatedDeltaNet(32, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)
    else:
        mixer = Mamba2Mixer(
            32, num_heads=4, head_dim=8, state_size=16, n_groups=2, time_step_limit=(0.0, 1.0)
        )
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return mixer.to(DEVICE).eval()


# (rows, fresh, snapshots) per sequence, working slots 0, 1, ... and snapshot slots from 8 up
MIXED_BATCH = [
    (1, False, []),
    (70, True, [(0, 8), (33, 9), (64, 10)]),
    (1, False, []),
    (9, False, [(9, 11)]),
    (1, True, []),
]


def _batch(pool, layout):
    seqs, start, slot = [], 0, 0
    for rows, fresh, snaps in layout:
        seqs.append(SeqState(start, start + rows, slot, fresh, list(snaps)))
        start, slot = start + rows, slot + 1
    return RecurrentBatch(pool, seqs), start


@pytest.mark.parametrize("kind", ["gated_delta", "mamba2"])
@torch.no_grad()
def test_triton_scans_match_the_torch_scans(kind):
    from agentrt.runtime.backends.triton_recurrent import triton_scans

    mixer = _mixer(kind)
    pools = [StatePool([mixer.state_shapes()], 12, DEVICE) for _ in range(2)]
    gen = torch.Generator().manual_seed(1)
    for name, t in pools[0].tensors[0].items():
        t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
        pools[1].tensors[0][name].copy_(t)
    outs = []
    for pool, scans in zip(pools, (TORCH_SCANS, triton_scans(mixer))):
        batch, rows = _batch(pool, MIXED_BATCH)
        x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        outs.append(run_recurrent(mixer, 0, x, batch, scans))
    assert triton_scans(mixer) is not TORCH_SCANS
    torch.testing.assert_close(outs[1], outs[0], **TOL)
    for name in ("conv", "recurrent"):
        torch.testing.assert_close(pools[1].tensors[0][name], pools[0].tensors[0][name], **TOL)
    assert not pools[1].tensors[0]["recurrent"][8].any()  # the empty prefix's snapshot: zeros


@pytest.mark.parametrize("kind", ["gated_delta", "mamba2"])
@torch.no_grad()
def test_a_decoding_row_scans_to_the_same_bits_alone_and_batched(kind):
    """The decode kernels' result for a sequence does not depend on the others in the batch (the
    projections around the scan are the linear layers' business)."""
    from agentrt.runtime.backends.triton_recurrent import triton_scans

    mixer = _mixer(kind)
    rows = mixer.project(torch.randn(3, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE))
    outs = []
    for batch in (3, 1):
        pool = StatePool([mixer.state_shapes()], 4, DEVICE)
        for t in pool.tensors[0].values():
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(4)))
        slots = torch.arange(batch, device=DEVICE)
        core = triton_scans(mixer).decode(mixer, tuple(r[:batch] for r in rows), pool.tensors[0], slots)
        outs.append((core[:1], {name: t[:1] for name, t in pool.tensors[0].items()}))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(outs[0][1][name], outs[1][1][name]) for name in ("conv", "recurrent"))


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory, default_model_dir):
    from tests.support.families import save_family

    return save_family("qwen3_next", tmp_path_factory.mktemp("qwen3_next"), default_model_dir)


def test_a_hybrid_on_triton_decodes_without_cuda_graphs(qwen3_next_dir):
    """The graphs' static metadata has no state slots: a hybrid model's Triton backend is the eager
    one, and with capture requested the start line says why."""
    from agentrt.runtime.backends import make_backend
    from agentrt.runtime.backends.triton import TritonBackend
    from agentrt.runtime.config import CacheConfig, ModelConfig
    from agentrt.runtime.model_runner import ModelRunner

    runner = ModelRunner(
        ModelConfig(model=str(qwen3_next_dir), device="cpu", dtype="float32", attention_backend="triton"),
        CacheConfig(kv_cache_bytes=8 << 20),
    )
    assert isinstance(runner.backend, TritonBackend) and runner.cuda_graph_sizes == ()
    backend = make_backend("triton", runner.model, runner.kv, runner.device, capture_graphs=True)
    assert isinstance(backend, TritonBackend) and backend.captured_sizes == ()
    assert (
        backend.describe() == "decode eager (CUDA graphs do not capture the recurrent layers' state updates)"
    )


def test_the_plan_says_how_the_recurrent_layers_run(qwen3_next_dir, monkeypatch):
    from agentrt.runtime import run_plan
    from agentrt.runtime.config import CacheConfig, ModelConfig
    from agentrt.runtime.models.registry import arch_from_hf_config, read_hf_config

    arch = arch_from_hf_config(read_hf_config(qwen3_next_dir))
    cpu = {"model": str(qwen3_next_dir), "device": "cpu", "dtype": "float32"}
    plan = run_plan.plan_run(
        ModelConfig(attention_backend="triton", **cpu), CacheConfig(), arch, qwen3_next_dir
    )
    assert (
        "  recurrent layers: Gated DeltaNet by the Triton kernels (decode step, chunked prefill) "
        "(attention triton)" in plan.describe().splitlines()
    )
    plan = run_plan.plan_run(
        ModelConfig(attention_backend="torch", **cpu), CacheConfig(), arch, qwen3_next_dir
    )
    assert plan.recurrent == "torch scans (chunked prefill, batched decode step)"
    assert plan.recurrent_reason == "attention torch: the recurrent kernels are the Triton backend's"
    # auto on CUDA: the Triton backend (it took torch for hybrids before), decode without graphs
    monkeypatch.setattr(run_plan, "choose_attention_backend", lambda *a: ("triton", "auto: CUDA"))
    plan = run_plan.plan_run(ModelConfig(**cpu), CacheConfig(), arch, qwen3_next_dir)
    assert (plan.backend, plan.backend_reason) == ("triton", "auto: CUDA")
    how = run_plan._recurrent_plan(ModelConfig(**cpu), "triton", torch.device("cuda"), arch)
    assert (
        how[1]
        == "attention triton; decode eager: CUDA graphs do not capture the recurrent layers' state updates"
    )


@pytest.mark.slow
def test_the_engine_on_triton_gives_the_torch_backends_tokens(qwen3_next_dir, monkeypatch):
    """A hybrid model served on the Triton backend (interpreted: ~30 s): two prompts batched, one again
    from the prefix cache (resumed from its snapshot at the prompt's last token but one), then with
    16-token prefill chunks and speculation whose verify chunks keep 0, 1 or 2 draft tokens and
    reject the rest (the proposer made to draft the torch run's tokens then a wrong one, as
    test_hybrid_state does; the state rolled back through the per-token snapshots): the torch
    backend's greedy tokens and cached counts each time."""
    from agentrt.runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpecConfig
    from agentrt.runtime.engine import Engine
    from agentrt.runtime.request import SamplingParams
    from agentrt.speculative.ngram import NgramProposer

    torch.manual_seed(2)
    prompts = [torch.randint(0, 49152, (n,)).tolist() for n in (30, 33)]
    stats = []

    def run(backend, **kw):
        model = ModelConfig(
            model=str(qwen3_next_dir), device="cpu", dtype="float32", attention_backend=backend
        )
        cache = CacheConfig(kv_cache_bytes=16 << 20, state_snapshot_interval=16)
        engine = Engine(EngineConfig(model=model, cache=cache, **kw))
        params = SamplingParams(temperature=0, max_tokens=8, logit_bias={t: -100.0 for t in engine.stop_ids})
        out = [o.token_ids for o in engine.generate([(ids, params, None) for ids in prompts])]
        again = [(o.token_ids, o.num_cached_tokens) for o in engine.generate([(prompts[0], params, None)])]
        stats.append(engine.stats)
        return out, again

    want = run("torch")
    assert want[1][0][1] > 0  # the second time resumes from a snapshot
    assert run("triton") == want
    wrong = next(t for t in range(100, 200) if all(t not in out for out in want[0]))

    def propose(self, token_ids, k=None):
        i = 0 if token_ids[: len(prompts[0])] == prompts[0] else 1
        m = len(token_ids) - len(prompts[i])
        return (want[0][i][m : m + m % 3] + [wrong] * 3)[:k]

    monkeypatch.setattr(NgramProposer, "propose", propose)
    spec = SpecConfig(method="ngram", num_speculative_tokens=3)
    assert run("triton", scheduler=SchedulerConfig(max_num_batched_tokens=16), speculative=spec) == want
    assert 0 < stats[-1].num_accepted_tokens < stats[-1].num_draft_tokens
