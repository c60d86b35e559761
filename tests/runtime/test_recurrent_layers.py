"""The recurrent mixers of the hybrid families (layers/gated_delta.py, layers/mamba2.py) against
transformers' own modules on the same random weights (float32, tiny shapes built in the test).

Each layer is built from a transformers config, loaded from the transformers module's state dict
(so the parameter names are the checkpoints'), and must give transformers' output for a 150-token
sequence in one segment (chunked form: two full chunks of 64 and a remainder of 22), in segments
1 + 7 + 64 + 3 + 75 with the state carried, and one token at a time (the recurrence), with the same
final state each way. The states start as garbage and `fresh=True` must ignore them.

Measured (this CPU, float32, outputs of magnitude ~5-10): one segment within 2e-6 of transformers,
segments and single tokens within 1.5e-5, final states within 1e-5 of each other. Tolerances below
are atol 1e-4 / rtol 1e-5 (outputs) and 5e-5 (states).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.granitemoehybrid.configuration_granitemoehybrid import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextGatedDeltaNet,
    torch_recurrent_gated_delta_rule,
)

from agentrt.runtime.layers.gated_delta import (
    GatedDeltaNet,
    gated_delta_chunked,
    gated_delta_recurrent,
    l2norm,
)
from agentrt.runtime.layers.mamba2 import Mamba2Mixer, ssd_chunked, ssd_step

HIDDEN, SEQ_LEN = 64, 150
SEGMENTS = (1, 7, 64, 3, 75)
OUT_TOL = {"atol": 1e-4, "rtol": 1e-5}
STATE_TOL = {"atol": 5e-5, "rtol": 1e-5}


def _gdn_config(cls):
    return cls(
        hidden_size=HIDDEN,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _nemotron():
    cfg = NemotronHConfig(
        hidden_size=HIDDEN,
        layers_block_type=["mamba"],
        mamba_num_heads=8,
        mamba_head_dim=8,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=64,
        time_step_limit=(0.0, 1.0),  # clamps part of the softplus(dt) of these weights
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return cfg, NemotronHMamba2Mixer(cfg, layer_idx=0)


def _granite():
    cfg = GraniteMoeHybridConfig(
        hidden_size=HIDDEN,
        layer_types=["mamba"],
        num_hidden_layers=1,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return cfg, GraniteMoeHybridMambaLayer(cfg, layer_idx=0)


def _qwen3_next():
    cfg = _gdn_config(Qwen3NextConfig)
    return cfg, Qwen3NextGatedDeltaNet(cfg, 0)


def _qwen3_5():
    cfg = _gdn_config(Qwen3_5TextConfig)
    return cfg, Qwen3_5GatedDeltaNet(cfg, 0)


CASES = {
    "qwen3_next": (_qwen3_next, GatedDeltaNet),
    "qwen3_5": (_qwen3_5, GatedDeltaNet),
    "nemotron_h": (_nemotron, Mamba2Mixer),
    "granite_hybrid": (_granite, Mamba2Mixer),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    """(transformers module, ours) with the same random weights (every parameter redrawn, norm
    weights included, so a weight read in the wrong place shows)."""
    build, ours_cls = CASES[request.param]
    gen = torch.Generator().manual_seed(sum(map(ord, request.param)))
    cfg, ref = build()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    ours = ours_cls.from_hf_config(cfg)
    ours.load_state_dict(ref.state_dict())  # strict: the names and shapes are the checkpoint's
    return ref.eval(), ours.eval()


def _states(layer, fill: float):
    return {key: torch.full(shape, fill, dtype=dtype) for key, (shape, dtype) in layer.state_shapes().items()}


def _run(layer, x: torch.Tensor, lengths) -> tuple[torch.Tensor, dict]:
    """x [n, hidden] through `layer` in segments of `lengths`, from a garbage state marked fresh."""
    state = _states(layer, float("nan"))
    outs, pos = [], 0
    for i, length in enumerate(lengths):
        outs.append(layer.forward_segment(x[pos : pos + length], state["conv"], state["recurrent"], i == 0))
        pos += length
    assert pos == x.shape[0]
    return torch.cat(outs), state


@torch.no_grad()
def test_layer_matches_transformers_in_any_segmentation(pair):
    ref, ours = pair
    x = torch.randn(SEQ_LEN, HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = ref(x[None])[0]
    whole, whole_state = _run(ours, x, [SEQ_LEN])
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    for lengths in (SEGMENTS, [1] * SEQ_LEN):
        got, state = _run(ours, x, lengths)
        torch.testing.assert_close(got, expected, **OUT_TOL)
        for key in state:
            torch.testing.assert_close(state[key], whole_state[key], **STATE_TOL)


@torch.no_grad()
def test_state_shapes_and_decode_batch(pair):
    """forward_decode over B sequences at different points equals each one's forward_segment."""
    _, ours = pair
    shapes = ours.state_shapes()
    assert set(shapes) == {"conv", "recurrent"}
    assert shapes["conv"][0] == (ours.conv_dim, ours.conv_kernel - 1)
    assert all(dtype == torch.float32 for _, dtype in shapes.values())
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randn(n, HIDDEN, generator=gen) for n in (5, 70, 1)]
    states = [_run(ours, p, [len(p)])[1] for p in prompts]
    batch_conv = torch.stack([s["conv"] for s in states])
    batch_rec = torch.stack([s["recurrent"] for s in states])
    nxt = torch.randn(len(prompts), HIDDEN, generator=gen)
    got = ours.forward_decode(nxt, batch_conv, batch_rec)
    for i, s in enumerate(states):
        want = ours.forward_segment(nxt[i : i + 1], s["conv"], s["recurrent"], False)
        torch.testing.assert_close(got[i : i + 1], want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(batch_rec[i], s["recurrent"], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(batch_conv[i], s["conv"], atol=1e-6, rtol=1e-6)


def _delta_inputs(n: int, heads: int, dk: int, dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(n, heads, dk, generator=gen)) * dk**-0.5
    k = l2norm(torch.randn(n, heads, dk, generator=gen))
    v = torch.randn(n, heads, dv, generator=gen)
    g = -torch.rand(n, heads, generator=gen) * 2  # decays exp(g) in (e^-2, 1]
    beta = torch.rand(n, heads, generator=gen)
    s0 = torch.randn(heads, dk, dv, generator=gen)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("n,chunk", [(1, 64), (63, 64), (200, 64), (37, 8)])
def test_gated_delta_chunked_equals_recurrence(n, chunk):
    """The chunked form from a non-zero start state against our recurrence and transformers'."""
    q, k, v, g, beta, s0 = _delta_inputs(n, 3, 16, 8, seed=n)
    s_rec, s_chunk = s0.clone(), s0.clone()
    o_rec = gated_delta_recurrent(q, k, v, g, beta, s_rec)
    o_chunk = gated_delta_chunked(q, k, v, g, beta, s_chunk, chunk_size=chunk)
    o_hf, s_hf = torch_recurrent_gated_delta_rule(
        *(t[None] for t in (q * 16**0.5, k, v, g, beta)), initial_state=s0[None], output_final_state=True
    )
    torch.testing.assert_close(o_rec, o_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_rec, s_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o_chunk, o_rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_chunk, s_rec, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,chunk", [(1, 64), (130, 64), (37, 8)])
def test_ssd_chunked_equals_recurrence(n, chunk):
    """The SSD chunked form from a non-zero start state against step-by-step recurrence, grouped B/C."""
    gen = torch.Generator().manual_seed(n)
    heads, groups, p, nst = 4, 2, 8, 16
    x = torch.randn(n, heads, p, generator=gen)
    dt = torch.rand(n, heads, generator=gen)
    a = -torch.rand(heads, generator=gen) * 3
    b, c = (torch.randn(n, groups, nst, generator=gen) for _ in range(2))
    s0 = torch.randn(heads, p, nst, generator=gen)
    s_rec, s_chunk = s0.clone(), s0.clone()
    y_rec = torch.stack([ssd_step(x[t], dt[t], a, b[t], c[t], s_rec) for t in range(n)])
    y_chunk = ssd_chunked(x, dt, a, b, c, s_chunk, chunk_size=chunk)
    torch.testing.assert_close(y_chunk, y_rec, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_chunk, s_rec, atol=1e-5, rtol=1e-5)
    # one head written out in float64: S <- exp(dt a) S + dt x b^T, y = S c
    s = s0[1].double()
    for t in range(n):
        s = math.exp(dt[t, 1] * a[1]) * s + dt[t, 1].double() * torch.outer(
            x[t, 1].double(), b[t, 0].double()
        )
    torch.testing.assert_close(s_rec[1].double(), s, atol=1e-5, rtol=1e-5)


def test_config_errors():
    with pytest.raises(ValueError, match="not a multiple"):
        GatedDeltaNet(HIDDEN, num_k_heads=3, num_v_heads=4, head_k_dim=8, head_v_dim=8)
    with pytest.raises(ValueError, match="not supported"):
        Mamba2Mixer(HIDDEN, num_heads=4, head_dim=8, state_size=8, activation="relu")
    assert Mamba2Mixer(HIDDEN, 4, 8, 8, time_step_limit=(0.0, math.inf)).time_step_limit is None


def _float64_delta_rule(q, k, v, g, beta):
    """The gated delta rule token by token in float64 (written out here, not the module's code)."""
    s = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float64)
    out = []
    for t in range(q.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        kt = k[t].double()
        delta = (v[t].double() - (kt[:, None, :] @ s)[:, 0]) * beta[t].double()[:, None]
        s = s + kt[:, :, None] * delta[:, None, :]
        out.append((q[t].double()[:, None, :] @ s)[:, 0])
    return torch.stack(out), s


def _float64_ssd(x, dt, a, b, c):
    """The SSD recurrence token by token in float64 (written out here)."""
    rep = x.shape[1] // b.shape[1]
    s = torch.zeros(x.shape[1], x.shape[2], b.shape[2], dtype=torch.float64)
    out = []
    for t in range(x.shape[0]):
        bt, ct, d = (
            b[t].double().repeat_interleave(rep, 0),
            c[t].double().repeat_interleave(rep, 0),
            dt[t].double(),
        )
        s = (
            s * (d * a.double()).exp()[:, None, None]
            + (x[t].double() * d[:, None])[:, :, None] * bt[:, None, :]
        )
        out.append((s @ ct[:, :, None])[..., 0])
    return torch.stack(out), s


@pytest.mark.parametrize("log_decay", [0.1, 12.0])
def test_chunked_forms_precise_under_strong_decay(log_decay):
    """Per-token log decays down to -12 (Qwen3-Next's A reaches 16; Mamba's A = -exp(A_log) is -32 here)
    put the chunk's cumulative log decay near -400: the chunked forms must stay within 1e-6 (relative
    to the largest output) of a float64 recurrence. Decays taken as differences of float32 cumulative
    sums were measured at 5e-6 (gated delta) and 8e-5 (SSD) here."""
    gen = torch.Generator().manual_seed(3)
    n = 300
    q = l2norm(torch.randn(n, 4, 16, generator=gen)) * 16**-0.5
    k = l2norm(torch.randn(n, 4, 16, generator=gen))
    v, beta = torch.randn(n, 4, 8, generator=gen), torch.rand(n, 4, generator=gen)
    g = -torch.rand(n, 4, generator=gen) * log_decay
    want, want_state = _float64_delta_rule(q, k, v, g, beta)
    state = torch.zeros(4, 16, 8)
    got = gated_delta_chunked(q, k, v, g, beta, state)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()
    torch.testing.assert_close(state.double(), want_state, atol=1e-6, rtol=1e-5)

    x, b, c = (
        torch.randn(n, 8, 16, generator=gen),
        torch.randn(n, 2, 32, generator=gen),
        torch.randn(n, 2, 32, generator=gen),
    )
    dt = torch.rand(n, 8, generator=gen) * log_decay / 32
    a = -torch.linspace(1, 32, 8)
    want, want_state = _float64_ssd(x, dt, a, b, c)
    state = torch.zeros(8, 16, 32)
    got = ssd_chunked(x, dt, a, b, c, state)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()
    torch.testing.assert_close(state.double(), want_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "build,field",
    [
        (lambda: GatedDeltaNet(64, 0, 4, 8, 8), "linear_num_key_heads"),
        (lambda: GatedDeltaNet(64, 2, -4, 8, 8), "linear_num_value_heads"),
        (lambda: GatedDeltaNet(64, 2, 4, 8, 8, conv_kernel=0), "linear_conv_kernel_dim"),
        (lambda: Mamba2Mixer(64, 4, 16, 8, n_groups=0), "n_groups"),
        (lambda: Mamba2Mixer(64, 0, 16, 8), "mamba num_heads"),
    ],
)
def test_a_count_that_is_not_positive_is_a_config_error(build, field):
    """(adversary finding: 0 was a ZeroDivisionError traceback from serve and check)"""
    with pytest.raises(ValueError, match=f"config {field} must be a positive integer"):
        build()
