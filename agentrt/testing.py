"""Public testing utilities: a fake model runner (no weights) and one launcher for `agentrt serve`.

`FakeModelRunner` stands in for `agentrt.runtime.model_runner.ModelRunner` behind a real `Engine`
(`Engine(config, runner=FakeModelRunner())`): the scheduler, the real `KVPool`, the prefix cache,
grammar masking, sampling, stop handling and speculation run their own code, and a step takes
milliseconds. Its logits are a fixed function of the token sequence, so greedy output is a fixed
function of the prompt whatever the batch, the chunking, preemption or the prefix cache did: the
engine's invariants become exact equalities a test can check.

The fake also checks the engine's KV bookkeeping. Each KV slot holds what the fake wrote there
(token id, position, a hash of the whole prefix up to that token); every forward reads back the
context of each sequence from the slots the engine hands it and raises `KVCorruptionError` when a
slot is free, out of range, repeated, or holds another sequence's token (wrong position or a broken
prefix-hash chain). A double free raises too. With `window=None` (default) the logits depend on the
whole prefix as read from the KV pool, so a prefix-cache hit mapped to the wrong slots changes the
output.

`agentrt_server` / `launch_server` start a server subprocess on a free port, wait for GET /health
and stop it on exit (tests and bench scripts share them). `serve_in_thread` serves an app (e.g.
`create_app` over an AsyncEngine on the fake runner) with uvicorn in this process, so a test talks
HTTP to it and still reads the engine behind it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np
import torch

from agentrt.runtime.kv_cache import KVPool
from agentrt.runtime.model_runner import SeqChunk

__all__ = [
    "EOS_TOKEN",
    "FakeArch",
    "FakeModelRunner",
    "KVCorruptionError",
    "ServerProcess",
    "ServerStartError",
    "agentrt_server",
    "byte_tokenizer",
    "fake_engine",
    "free_port",
    "launch_server",
    "serve_in_thread",
]

MAX_CACHED_ROW_BYTES = 16 << 20
"""Bytes of logits rows a FakeModelRunner keeps (oldest dropped first; a row is recomputed when
needed again), so that a long run (bench/soak.py) does not grow."""

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>", "<|pad|>")
"""Special tokens of `byte_tokenizer`, ids 256.. in this order (EOS is 256)."""

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# prefix hash: h_i = (h_{i-1} * M + token_i + 1) mod P, h_{-1} = 0. P < 2^31 and M < 2^21, so the
# products fit int64 and the chain is checked with one vectorised tensor expression.
_HASH_P = 2_147_483_647
_HASH_M = 1_000_003


def _mix(h: int, token: int) -> int:
    return (h * _HASH_M + token + 1) % _HASH_P


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of byte-level BPE)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer():
    """A byte-level BPE tokenizer built in memory (no files): token id b < 256 is the byte b, then
    SPECIAL_TOKENS (EOS `<|endoftext|>` = 256); no merges, so every text encodes to its UTF-8
    bytes. A `transformers.PreTrainedTokenizerFast` with eos/pad tokens and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token="<|pad|>", bos_token=None, unk_token=None
    )
    fast.chat_template = _CHAT_TEMPLATE
    # Without merges a BPE word cache saves nothing, and it kept up to 10,000 words of ~1.7 KB (a
    # unique chat message is one word here): a served fake runner grew ~17 MiB over the first ~10
    # minutes of bench/soak.py. (Set here: PreTrainedTokenizerFast rebuilds the model, cache size lost.)
    fast.backend_tokenizer.model = models.BPE(vocab=vocab, merges=[], cache_capacity=0)
    return fast


class KVCorruptionError(RuntimeError):
    """The engine handed the fake runner KV slots that do not hold the sequence's context (a free,
    repeated or out-of-range slot, another sequence's token), or freed a slot twice."""


class _CheckedKVPool(KVPool):
    """The real KVPool (same allocate / free) that also refuses double frees and can say whether a
    slot is allocated. K[0][slot] holds (token id, position, prefix hash) as int64."""

    def __init__(self, num_slots: int, device: torch.device):
        super().__init__(
            1, 1, 3, torch.int64, device, num_slots * self.bytes_per_token_of(1, 1, 3, torch.int64)
        )
        self._free_set = set(self._free)

    def allocate(self, n: int) -> list[int] | None:
        slots = super().allocate(n)
        if slots is not None:
            self._free_set.difference_update(slots)
        return slots

    def free(self, slots: list[int]) -> None:
        slots = list(slots)
        bad = [s for s in slots if s in self._free_set or not 0 <= s < self.num_slots]
        if bad or len(set(slots)) != len(slots):
            raise KVCorruptionError(f"freeing KV slots that are not allocated (double free?): {bad or slots}")
        self._free_set.update(slots)
        super().free(slots)

    def is_free(self, slot: int) -> bool:
        return slot in self._free_set


@dataclass(frozen=True)
class FakeArch:
    """The model shape the engine reads (`arch.vocab_size` etc.); KV is 1 layer x 1 head x 3."""

    vocab_size: int
    hidden_size: int = 8
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 3
    max_position_embeddings: int = 512


@dataclass
class ForwardRecord:
    """One `execute` call: per chunk (context_len, num_new_tokens, num_logits or 0 when it wants none)."""

    chunks: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """New tokens computed in this forward (prefill + decode + verify)."""
        return sum(n for _, n, _ in self.chunks)


class FakeModelRunner:
    """A model runner with deterministic logits and no weights (see the module docstring).

    tokenizer: `byte_tokenizer()` unless given (a Hugging Face tokenizer). vocab_size: logits width,
    at least the tokenizer's size (default: exactly it; extra ids are never preferred).
    max_model_len: context limit (tokens). num_kv_slots: size of the KV pool (tokens); a small pool
    makes the scheduler evict and preempt. window: the logits of a position depend on the last
    `window` tokens of the sequence (None: on the whole prefix, via the prefix hash read from KV).
    seed: picks the logits table.

    Logits of a position: a row of standard normal noise drawn from a generator seeded with
    (seed, key of the context), plus 4.0 on the printable ASCII bytes (0x20-0x7e) and -4.0 on every
    other id, so greedy decoding writes printable ASCII and never picks EOS unless a constraint or
    logit_bias leaves nothing better. `execute` records every forward in `forwards` unless
    `record_forwards` is False (a long-running server: the records grow by ~5 KB per forward of a
    64-sequence batch; `num_forwards` and `num_computed_tokens` count either way).
    """

    def __init__(
        self,
        tokenizer=None,
        *,
        vocab_size: int | None = None,
        max_model_len: int = 512,
        num_kv_slots: int = 4096,
        window: int | None = None,
        seed: int = 0,
        record_forwards: bool = True,
    ):
        self.tokenizer = tokenizer if tokenizer is not None else byte_tokenizer()
        n = len(self.tokenizer)
        vocab_size = vocab_size or n
        if vocab_size < n:
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {n} tokens")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        eos = self.tokenizer.eos_token_id
        self.stop_ids: tuple[int, ...] = (eos,) if eos is not None else ()
        self.arch = FakeArch(vocab_size, max_position_embeddings=max_model_len)
        self.max_model_len = max_model_len
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.kv = _CheckedKVPool(num_kv_slots, self.device)
        self.attention_backend = "fake"
        self.graphs = None
        self.memory_plan = None
        self.window, self.seed = window, seed
        self.forwards: list[ForwardRecord] = []
        self.record_forwards = record_forwards
        self.num_forwards = 0
        self.num_computed_tokens = 0  # new tokens computed over every forward so far
        bias = np.full(vocab_size, -4.0, dtype=np.float32)
        bias[0x20:0x7F] = 4.0
        self._bias = bias
        self._rows: dict[int, np.ndarray] = {}
        self._max_rows = max(64, MAX_CACHED_ROW_BYTES // (4 * vocab_size))

    # ---- the forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk], return_hidden: bool = False):
        """Logits [N, vocab_size] float32 (N = sum of num_logits over chunks with need_logits, in
        chunk order: the last num_logits new tokens of each); with return_hidden, (logits, hidden
        [N, hidden_size] float32 zeros). Writes each new token's (id, position, prefix hash) into its
        KV slot. Raises KVCorruptionError when a chunk's slots do not hold its context."""
        record = ForwardRecord()
        rows: list[np.ndarray] = []
        for c in chunks:
            n = len(c.token_ids)
            if len(c.slots) != c.context_len + n:
                raise KVCorruptionError(f"chunk has {len(c.slots)} slots for {c.context_len} + {n} tokens")
            self._check_context(c.slots[: c.context_len])
            keys = self._write(c)
            k = c.num_logits if c.need_logits else 0
            record.chunks.append((c.context_len, n, k))
            rows.extend(self._row(key) for key in keys[n - k :] if k)
        if self.record_forwards:
            self.forwards.append(record)
        self.num_forwards += 1
        self.num_computed_tokens += record.num_tokens
        logits = torch.from_numpy(np.stack(rows)) if rows else torch.empty(0, self.arch.vocab_size)
        if return_hidden:
            return logits, torch.zeros(logits.shape[0], self.arch.hidden_size)
        return logits

    def _read(self, slots: list[int]) -> torch.Tensor:
        """[len(slots), 3] int64: (token id, position, prefix hash) of each slot."""
        if not slots:
            return torch.empty(0, 3, dtype=torch.int64)
        return self.kv.k[0][torch.tensor(slots, dtype=torch.int64), 0]

    def _check_context(self, slots: list[int]) -> None:
        """The slots hold one sequence's tokens at positions 0..len-1 with an unbroken hash chain."""
        if not slots:
            return
        bad = [s for s in slots if not 0 <= s < self.kv.num_slots or self.kv.is_free(s)]
        if bad:
            raise KVCorruptionError(f"context uses KV slots that are free or out of range: {bad[:8]}")
        if len(set(slots)) != len(slots):
            raise KVCorruptionError("context uses a KV slot twice")
        kv = self._read(slots)
        tok, pos, h = kv[:, 0], kv[:, 1], kv[:, 2]
        if not torch.equal(pos, torch.arange(len(slots))):
            first = int((pos != torch.arange(len(slots))).nonzero()[0])
            raise KVCorruptionError(
                f"KV slot {slots[first]} at context position {first} holds position "
                f"{int(pos[first])}: another sequence's token"
            )
        prev = torch.cat([torch.zeros(1, dtype=torch.int64), h[:-1]])
        expect = (prev * _HASH_M + tok + 1) % _HASH_P
        if not torch.equal(expect, h):
            first = int((expect != h).nonzero()[0])
            raise KVCorruptionError(
                f"KV slot {slots[first]} at context position {first} does not continue the "
                "sequence before it: another sequence's token"
            )

    def _write(self, c: SeqChunk) -> list[int]:
        """Write the chunk's new tokens into their slots; returns each new token's logits key."""
        ctx = c.slots[: c.context_len]
        base = self._read(ctx)
        base_tokens = base[:, 0].tolist()
        base_h = int(base[-1, 2]) if len(ctx) else 0
        new = c.slots[c.context_len :]
        bad = [s for s in new if not 0 <= s < self.kv.num_slots or self.kv.is_free(s)]
        if bad or len(set(new)) != len(new) or set(new) & set(ctx):
            raise KVCorruptionError(
                f"chunk writes to KV slots that are free, repeated or in its context: {new}"
            )
        n = len(c.token_ids)
        mask = c.tree_mask.tolist() if c.tree_mask is not None else None
        positions = c.positions or [c.context_len + i for i in range(n)]
        hashes: list[int] = []
        keys: list[int] = []
        values = []
        for i, t in enumerate(c.token_ids):
            # the token's ancestors among the new tokens: all earlier ones (causal) or the tree's
            parents = [j for j in range(i) if mask is None or mask[i][j]]
            if positions[i] != c.context_len + len(parents):
                raise KVCorruptionError(
                    f"new token {i} at position {positions[i]} has {len(parents)} ancestors "
                    f"after a context of {c.context_len}"
                )
            h = _mix(hashes[parents[-1]] if parents else base_h, t)
            hashes.append(h)
            values.append((t, positions[i], h))
            if self.window is None:
                keys.append(h)
            else:
                seq = base_tokens + [c.token_ids[j] for j in parents] + [t]
                key = 0
                for x in seq[-self.window :]:
                    key = _mix(key, x)
                keys.append(key)
        if new:
            self.kv.k[0][torch.tensor(new, dtype=torch.int64), 0] = torch.tensor(values, dtype=torch.int64)
        return keys

    def _row(self, key: int) -> np.ndarray:
        row = self._rows.get(key)
        if row is None:
            noise = np.random.default_rng([self.seed, key]).standard_normal(
                self.arch.vocab_size, dtype=np.float32
            )
            if len(self._rows) >= self._max_rows:
                del self._rows[next(iter(self._rows))]
            row = self._rows[key] = noise + self._bias
        return row

    # ---- what tests read ---------------------------------------------------------------------------
    def greedy_next(self, token_ids: Sequence[int]) -> int:
        """The token greedy decoding picks after `token_ids` (unconstrained, no logit_bias): the
        reference the engine's output is checked against."""
        return int(np.argmax(self._row(self._key(token_ids))))

    def greedy_continuation(self, token_ids: Sequence[int], n: int) -> list[int]:
        """n tokens of greedy decoding after `token_ids` (no stop condition): what the engine must
        produce with temperature 0, ignore_eos and max_tokens n."""
        seq, out = list(token_ids), []
        for _ in range(n):
            t = self.greedy_next(seq)
            seq.append(t)
            out.append(t)
        return out

    def _key(self, token_ids: Sequence[int]) -> int:
        ids = list(token_ids) if self.window is None else list(token_ids)[-self.window :]
        key = 0
        for t in ids:
            key = _mix(key, t)
        return key


def fake_engine(config=None, **runner_kwargs):
    """`Engine(config, runner=FakeModelRunner(**runner_kwargs))`: a real engine (scheduler, KV pool,
    prefix cache, grammars, sampler, speculation) over the fake runner. `config.cache.kv_cache_bytes`
    and `config.model` are not used: the pool has `num_kv_slots` slots."""
    from agentrt.runtime.engine import Engine

    return Engine(config, runner=FakeModelRunner(**runner_kwargs))


# ---- one server launcher ----------------------------------------------------------------------------
class ServerStartError(RuntimeError):
    """The server exited or did not answer GET /health in time (the message has its log's tail)."""


@dataclass
class ServerProcess:
    """A running server: `url` (http://127.0.0.1:PORT), the `proc`, its `log_path` (None when its
    output is discarded) and, after the launcher's exit, `returncode`."""

    url: str
    proc: subprocess.Popen
    log_path: Path | None = None
    returncode: int | None = None

    def log_tail(self, n: int = 2000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-n:]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch_server(
    cmd: Sequence[str],
    port: int,
    *,
    timeout_s: float = 180.0,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    stop_timeout_s: float = 30.0,
) -> Iterator[ServerProcess]:
    """Start `cmd` (which must listen on 127.0.0.1:`port`), wait until GET /health answers 200 and
    yield a ServerProcess; on exit SIGTERM it, wait up to `stop_timeout_s` (then kill) and set
    `returncode`. Output goes to `log_path` (None: discarded). Raises ServerStartError when the
    process exits or is not healthy within `timeout_s` seconds."""
    import httpx

    log: IO | int = subprocess.DEVNULL
    if log_path is not None:
        log = Path(log_path).open("w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        list(cmd), stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy() if env is None else env
    )
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, Path(log_path) if log_path is not None else None)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise ServerStartError(f"{cmd[0]} exited with {proc.returncode}: {server.log_tail()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{' '.join(cmd)} did not become healthy in {timeout_s:g} s: {server.log_tail()}"
                )
            time.sleep(0.5)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: a clean exit, promptly
            try:
                proc.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        server.returncode = proc.returncode
        if not isinstance(log, int):
            log.close()


@contextlib.contextmanager
def agentrt_server(
    model: str = "smollm2-135m-instruct", *args: str, port: int | None = None, **kwargs
) -> Iterator[ServerProcess]:
    """`agentrt serve MODEL ARGS... --port PORT` (this Python, a free port unless given) via
    `launch_server` (keyword arguments go to it)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "agentrt.cli", "serve", model, *args, "--port", str(port)]
    with launch_server(cmd, port, **kwargs) as server:
        yield server


@contextlib.contextmanager
def serve_in_thread(app, *, timeout_s: float = 30.0, log_level: str = "warning") -> Iterator[str]:
    """Serve the ASGI `app` with uvicorn on a free 127.0.0.1 port from a background thread of this
    process; yields the base URL (http://127.0.0.1:PORT) once it accepts connections, and stops the
    server on exit. Raises ServerStartError when it has not started within `timeout_s` seconds."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise ServerStartError(f"uvicorn did not start on port {port} within {timeout_s:g} s")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# ---- fault injection (issue 17: fault isolation) ---------------------------------------------------
FAULT_KINDS = ("matcher", "accept", "jump_forward", "forward", "nan", "penalties", "detokenizer")
"""What `FaultInjector` can make raise for one request: its bitmask fill ("matcher"), its grammar
accept, its jump-forward search, the model forward of a batch holding its chunk, NaN in its
logits row (a broken sampler input), its logit penalties, its detokenizer / stop-string update."""


class InjectedFault(RuntimeError):
    """The exception a `FaultInjector` raises."""


class FaultInjector:
    """Makes one request's work raise inside a real `Engine` (fake or real runner), from its
    `after_tokens`-th output token on; a context manager that undoes every patch on exit.

    engine: the Engine; request_id: the victim; kind: one of FAULT_KINDS. Other requests are
    untouched, so a test can check they finish exactly as they would alone."""

    def __init__(self, engine, request_id: str, kind: str, after_tokens: int = 1):
        if kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {FAULT_KINDS}, got {kind!r}")
        self.engine, self.request_id, self.kind, self.after = engine, request_id, kind, after_tokens
        self.num_raised = 0
        self._undo: list = []

    def _victim(self):
        e = self.engine
        for r in [*e.grammar_wait, *e.scheduler.waiting, *e.scheduler.running]:
            if r.request_id == self.request_id:
                return r
        return None

    def _due(self, r) -> bool:
        return r is not None and r.request_id == self.request_id and r.num_output_tokens >= self.after

    def _raise(self, what: str):
        self.num_raised += 1
        raise InjectedFault(f"injected {what} fault")

    def _patch(self, owner, name: str, make) -> None:
        import types

        real, had = getattr(owner, name), name in vars(owner)
        setattr(owner, name, make(real))
        self._undo.append((owner, name, real, had or isinstance(owner, (type, types.ModuleType))))

    def __enter__(self):  # -> FaultInjector
        import concurrent.futures

        from agentrt.runtime import sampler
        from agentrt.runtime.constraint_state import ConstraintState

        e, kind = self.engine, self.kind
        if kind == "matcher":

            def batch_fill(real):
                def fill(matchers, rows, batch):
                    v = self._victim()
                    if (
                        self._due(v)
                        and v.grammar is not None
                        and any(m is v.grammar.matcher for m in matchers)
                    ):
                        fut = concurrent.futures.Future()
                        fut.set_exception(InjectedFault("injected batched bitmask fault"))
                        return fut
                    return real(matchers, rows, batch)

                return fill

            def row_fill(real):
                def fill(matcher, bitmask, row):
                    v = self._victim()
                    if self._due(v) and v.grammar is not None and matcher is v.grammar.matcher:
                        self._raise("matcher")
                    return real(matcher, bitmask, row)

                return fill

            self._patch(e.grammar, "fill_bitmasks_async", batch_fill)
            self._patch(e.grammar, "fill_bitmask", row_fill)
        elif kind in ("accept", "jump_forward"):

            def method(real):
                def call(state, *args, **kwargs):
                    v = self._victim()
                    if self._due(v) and v.grammar is state:
                        self._raise(kind)
                    return real(state, *args, **kwargs)

                return call

            self._patch(ConstraintState, kind, method)
        elif kind == "forward":

            def execute(real):
                def run(chunks, *args, **kwargs):
                    v = self._victim()
                    if self._due(v) and any(c.seq_key == id(v) for c in chunks):
                        self._raise("forward")
                    return real(chunks, *args, **kwargs)

                return run

            self._patch(e.runner, "execute", execute)
        elif kind == "nan":

            def forward(real):
                def run(plan):
                    out = real(plan)
                    for s in plan.rows:
                        if self._due(s.request):
                            self.num_raised += 1
                            out.logits[s.row : s.row + s.num_rows] = float("nan")
                    return out

                return run

            self._patch(e, "_forward", forward)
        elif kind == "penalties":

            def penalize(real):
                def run(logits, i, r):
                    if self._due(r):
                        self._raise("penalties")
                    return real(logits, i, r)

                return run

            self._patch(sampler, "_penalize", penalize)
        else:  # detokenizer

            def update(real):
                def run(r, reason):
                    if self._due(r):
                        self._raise("detokenizer")
                    return real(r, reason)

                return run

            self._patch(e.output, "update", update)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, real, restore in reversed(self._undo):
            if restore:
                setattr(owner, name, real)
            else:
                delattr(owner, name)  # an instance attribute we added: the class's method shows again
        self._undo.clear()
