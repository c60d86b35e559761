"""The fake model runner (no weights): deterministic logits that are a fixed function of the token
sequence, a byte-level BPE tokenizer, and a checked KV pool. See agentrt.testing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kv_cache import CacheSpec, KVPool

MAX_CACHED_ROW_BYTES = 16 << 20
"""Bytes of logits rows a FakeModelRunner keeps (oldest dropped first; a row is recomputed when
needed again), so that a long run (bench/soak.py) does not grow."""

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>", "<|pad|>")
"""Special tokens of `byte_tokenizer`, ids 256.. in this order (EOS is 256)."""

SCRIPT_MARGIN = 12.0
"""How far (logits) a scripted token stands above the rest of its row (FakeModelRunner.script)."""

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
        layout = [CacheSpec(1, 3, 3)]
        super().__init__(
            layout, torch.int64, device, num_slots * self.bytes_per_token_of(layout, torch.int64)
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
    recurrent_layers: tuple[int, ...] = ()  # no linear-attention / SSM layers


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
        self.cuda_graph_sizes = ()
        self.decode = "decode eager (the fake model)"
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
        self._script: dict[int, int] = {}  # context key -> the token a script makes the model write

    # ---- the forward -----------------------------------------------------------------------------
    @torch.inference_mode()
    def expert_load(self) -> tuple:
        """A dense model: no MoE layer (ModelRunner.expert_load)."""
        return ()

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
            scripted = self._script.get(key)
            if scripted is not None:
                row[scripted] = row.max() + SCRIPT_MARGIN
        return row

    def script(self, prompt_ids: Sequence[int], text: str) -> list[int]:
        """Make the model write `text` after `prompt_ids`: along that exact context its most likely
        next token is the script's (by SCRIPT_MARGIN logits, so greedy decoding follows it), where a
        constraint allows it; once the output leaves the script (a token the grammar forced, or one
        sampled otherwise) the logits are the usual noise. Returns the script's token ids."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        seq = list(prompt_ids)
        for t in ids:
            key = self._key(seq)
            self._script[key] = t
            self._rows.pop(key, None)
            seq.append(t)
        return ids

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
