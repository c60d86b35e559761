"""`agentrt check`'s third layer (runtime/models/check.py): KV bytes per token at the run dtype
(sliding-window layers counted with their window), a hybrid model's recurrent-state bytes per
sequence, and how many --max-model-len sequences the KV budget holds, as the engine's pools are built
(the state pool's share first: recurrent_state.plan_state_slots; kv_window.plan_window_pool for
windowed models)."""

from __future__ import annotations

from agentrt.runtime.models.check_report import ERROR, OK, WARNING, Capacity, CheckReport, KVEstimate
from agentrt.runtime.models.config import default_max_model_len


def kv_estimate(arch, dtype) -> KVEstimate:
    """KV bytes of `arch` (a ModelArch) at torch dtype `dtype`, windowed layers grouped by window."""
    from agentrt.runtime.kv_cache import KVPool

    specs, caches = arch.kv_layout()
    window_of = {}  # cache -> the window of the first layer that writes it
    for i, c in enumerate(caches):
        if c is not None:
            window_of.setdefault(c, arch.layer_windows[i])
    windows: dict[int, int] = {}
    for c, w in window_of.items():
        if w is not None:
            windows[int(w)] = windows.get(int(w), 0) + 1
    full = [c for c, w in window_of.items() if w is None]
    windowed = [c for c, w in window_of.items() if w is not None]
    layer = KVPool.bytes_per_token_of([specs[windowed[0] if windowed else (full or [0])[0]]], dtype)
    full_bytes = KVPool.bytes_per_token_of([specs[c] for c in full], dtype)
    name = str(dtype).removeprefix("torch.")
    return KVEstimate(
        name,
        len(window_of),
        layer,
        len(full),
        tuple(sorted(windows.items())),
        None if full_bytes == len(full) * layer else full_bytes,
    )


def capacity(
    kv: KVEstimate, max_model_len: int, budget: int | None, device: str, source: str, window_pool=None
) -> Capacity:
    """Sequences of `max_model_len` tokens that `budget` KV bytes hold (0 when budget is None).
    window_pool: (token slots, window rows) of the sliding-window pool the engine builds here
    (kv_window.plan_window_pool), or None for the plain pool (every layer per token)."""
    if budget is None:
        return Capacity(device, None, source, max_model_len)
    if window_pool is None:
        pool = budget // (kv.pool_bytes_per_token * max_model_len)
    else:
        slots, rows = window_pool
        window = max(w for w, _ in kv.windows)
        pool = min(slots // max_model_len, rows // min(max_model_len, window))
    return Capacity(device, budget, source, max_model_len, pool, budget // kv.sequence_bytes(max_model_len))


def check_memory(report: CheckReport, arch, tensors: dict, options: dict) -> None:
    """The third layer: the KV dtype and bytes per token of `arch`, and how many sequences of
    --max-model-len tokens the KV budget holds (the runner's rule on CUDA, the weights estimated from
    `tensors`: name -> (shape, elements)); `options`: max_model_len, max_num_seqs, device, dtype,
    kv_cache_bytes (and state_slots, None by default). Adds its findings to `report`."""
    device = options["device"]
    try:
        dev, dtype, why = _device_and_dtype(device, options["dtype"])
    except (RuntimeError, ValueError) as e:
        report.add(
            ERROR,
            "kv cache",
            str(e) if isinstance(e, ValueError) else f"device '{device}' is not cpu / cuda / cuda:N",
        )
        return
    limit = arch.max_position_embeddings
    n = options["max_model_len"] or default_max_model_len(limit)
    if not 1 <= n <= limit:
        report.add(ERROR, "capacity", f"max_model_len={n} is outside the model's limit of 1..{limit} tokens")
        return
    kv = _report_kv(report, arch, dtype, why, n)
    state_bytes = _report_state(report, arch)
    found = _kv_budget(report, dev, dtype, arch, kv, tensors, options)
    if found is None:
        return
    budget, source = found
    if state_bytes and budget is not None:  # the state pool's share comes first, as the runner takes it
        from agentrt.runtime.recurrent_state import plan_state_slots

        try:
            slots = plan_state_slots(budget, state_bytes, options["max_num_seqs"], options.get("state_slots"))
        except ValueError as e:
            report.add(ERROR, "capacity", str(e))
            return
        budget -= slots * state_bytes
        source += (
            f", less the recurrent-state pool's {slots * state_bytes:,} bytes ({slots:,} slots: "
            f"{options['max_num_seqs'] + 1} working, the rest prefix snapshots)"
        )
    window_pool = _window_pool(arch, kv, budget, options["max_num_seqs"], n)
    _report_capacity(report, kv, n, dev, budget, source, window_pool, options)


def _device_and_dtype(device: str, dtype: str):
    """(torch.device, run torch dtype, the reason for it) of --device and --dtype, as the runner picks
    them. Raises RuntimeError for a device that is not cpu / cuda / cuda:N, ValueError (choose_dtype's)
    for a dtype the device cannot run."""
    import torch

    from agentrt.runtime.platform import choose_dtype

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    if dev.type not in ("cpu", "cuda"):
        raise RuntimeError
    run_dtype, why = choose_dtype(dev, dtype)
    return dev, run_dtype, why


def _report_kv(report: CheckReport, arch, dtype, why: str, n: int) -> KVEstimate:
    """Sets report.kv and adds the finding of its bytes per token (and of one n-token sequence)."""
    kv = report.kv = kv_estimate(arch, dtype)
    parts = [f"full-attention layers ({kv.full_layers}): {kv.full_bytes_per_token:,} bytes/token"]
    parts += [
        f"windowed layers ({c}): {c * kv.layer_bytes:,} bytes/token up to {w:,} tokens" for w, c in kv.windows
    ]
    if arch.mla is not None:  # the pool holds the latent: say what full K/V would take
        parts[0] += f" ({arch.mla.describe_kv(arch.num_layers, arch.num_heads, dtype)})"
    report.add(
        OK,
        "kv cache",
        f"{kv.dtype} ({why}); {'; '.join(parts)}; one {n:,}-token sequence {kv.sequence_bytes(n):,} bytes",
    )
    return kv


def state_shapes(arch) -> list[dict]:
    """Per recurrent layer of `arch`, its mixer's `state_shapes()` ({name: (shape, dtype)}), read
    from mixers built on the meta device (no memory). Raises what the mixer's from_hf_config raises
    for a config it cannot read."""
    import torch

    from agentrt.runtime.models.base import RECURRENT_MIXERS

    by_kind: dict[str, dict] = {}
    with torch.device("meta"):
        for i in arch.recurrent_layers:
            kind = arch.layer_mixers[i]
            if kind not in by_kind:
                by_kind[kind] = RECURRENT_MIXERS[kind].from_hf_config(arch.mixer_config).state_shapes()
    return [by_kind[arch.layer_mixers[i]] for i in arch.recurrent_layers]


def _report_state(report: CheckReport, arch) -> int:
    """Sets report.state_bytes and adds its finding for a model with recurrent layers: one
    sequence's state (bytes; the engine's StatePool slot); 0 without recurrent layers (or after an
    ERROR when the mixers cannot be built from the config)."""
    if not arch.recurrent_layers:
        return 0
    from agentrt.runtime.recurrent_state import StatePool

    try:
        shapes = state_shapes(arch)
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        report.add(ERROR, "recurrent state", f"the mixers cannot be built from the config: {e}")
        return 0
    total = report.state_bytes = StatePool.bytes_per_slot_of(shapes)
    kinds = {arch.layer_mixers[i]: shape for i, shape in zip(arch.recurrent_layers, shapes)}
    per_layer = "; ".join(
        kind
        + " "
        + " + ".join(f"{name} {list(sh)} {str(dt).removeprefix('torch.')}" for name, (sh, dt) in d.items())
        for kind, d in kinds.items()
    )
    report.add(
        OK,
        "recurrent state",
        f"{len(arch.recurrent_layers)} of {arch.num_layers} layers: {total:,} bytes per sequence, held for "
        f"each running sequence and each prefix snapshot beside the KV (per layer: {per_layer})",
    )
    return total


def _kv_budget(report: CheckReport, dev, dtype, arch, kv: KVEstimate, tensors: dict, options: dict):
    """(KV budget in bytes or None when not measurable here, where it comes from), as the engine sizes
    its pool: --kv-cache-bytes, 1 GiB on a CPU, else the runner's CUDA rule with the weights estimated
    from `tensors`. None (after a WARNING) when the CUDA device's memory cannot be read."""
    import torch

    from agentrt.runtime.config import CacheConfig

    budget, source = options["kv_cache_bytes"], "--kv-cache-bytes"
    if budget is None and dev.type == "cpu":
        budget, source = 1 << 30, "the CPU default, 1 GiB"
    elif budget is None and not torch.cuda.is_available():
        budget, source = None, "not measurable here: CUDA is not available (give --kv-cache-bytes)"
    elif budget is None:  # the runner's rule, with the weights estimated from the headers
        try:
            free, total = torch.cuda.mem_get_info(dev)
        except (RuntimeError, AssertionError, ValueError) as e:
            report.add(WARNING, "capacity", f"{dev}: not measurable: {e}")
            return None
        weights = sum(e for _, e in tensors.values()) * dtype.itemsize
        reserve = max(1 << 30, 16 * options["max_num_seqs"] * (arch.vocab_size + 8 * arch.hidden_size))
        budget = int(CacheConfig.gpu_memory_utilization * total) - (total - free) - weights - reserve
        source = (
            f"{CacheConfig.gpu_memory_utilization} x {total / 2**30:.1f} GiB - {(total - free) / 2**30:.1f} GiB in use "
            f"- {weights / 2**30:.2f} GiB weights ({kv.dtype}, estimated) - {reserve / 2**30:.2f} GiB reserve"
        )
    return budget, source


def _window_pool(arch, kv: KVEstimate, budget: int | None, max_num_seqs: int, n: int):
    """(token slots, window rows) of the sliding-window pool the engine would build from `budget`
    bytes (kv_window.plan_window_pool with the default chunk), or None for the plain pool."""
    from agentrt.runtime.config import SchedulerConfig
    from agentrt.runtime.kv_window import plan_window_pool

    if not (kv.windows and budget is not None and budget > 0 and arch.uniform_kv):
        return None  # the engine builds the plain pool (model_runner._make_pool)
    plan = plan_window_pool(
        arch.layer_windows,
        kv.layer_bytes,
        budget,
        max_num_seqs,
        SchedulerConfig.max_num_batched_tokens,  # the engine's pool with the default chunk
        n,
    )
    return None if isinstance(plan, str) else plan


def _report_capacity(
    report: CheckReport, kv: KVEstimate, n: int, dev, budget, source: str, window_pool, options
) -> None:
    """Sets report.capacity and adds its finding: an ERROR when the pool cannot hold one n-token
    sequence (or, estimated on CUDA, not one at full length), a WARNING when requests are limited."""
    cap = report.capacity = capacity(kv, n, budget, str(dev), source, window_pool)
    if budget is None:
        report.add(WARNING, "capacity", f"{dev}: {source}")
        return
    slots = (
        (budget // kv.pool_bytes_per_token if window_pool is None else window_pool[0]) if budget > 0 else 0
    )
    text = f"{dev} KV budget {budget:,} bytes ({source}): {cap.pool_sequences} sequences of {n:,} tokens"
    if kv.windows:
        how = (
            "every layer per token"
            if window_pool is None
            else f"{window_pool[1]:,} windowed-layer rows, shared by the running sequences' windows"
        )
        text += f" with the pool as built ({how}; {cap.window_sequences} if each kept exactly its window)"
    estimated = dev.type == "cuda" and options["kv_cache_bytes"] is None  # the runner refuses it then
    if slots < 1 or (estimated and cap.pool_sequences < 1):
        report.add(
            ERROR,
            "capacity",
            f"{text}: the pool cannot hold one sequence; lower --max-model-len or give more memory",
        )
    elif cap.pool_sequences < 1:
        report.add(
            WARNING, "capacity", f"{text}: the pool holds {slots:,} tokens, so requests are limited to that"
        )
    else:
        fewer = options["max_num_seqs"] > cap.pool_sequences
        extra = f"; fewer than --max-num-seqs {options['max_num_seqs']} at full context" if fewer else ""
        report.add(OK, "capacity", text + extra)
