"""Request state and sampling parameters.

The per-request checkers a `Request` holds (ConstraintState, RepetitionGuard, ReasoningTracker and
its ReasoningParams, importable from here too) live in modules below this one that never import it
(tests/test_import_graph.py counts type-only imports too); what acts on a whole Request sits above
(runtime/constraint_steps.py)."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from agentrt.errors import AgentrtError, InvalidRequestError
from agentrt.grammars.spec import ConstraintSpec
from agentrt.runtime.reasoning_budget import ReasoningParams, ReasoningTracker

if TYPE_CHECKING:
    import torch

    from agentrt.prefix_cache.radix_tree import TreeNode
    from agentrt.runtime.constraint_state import ConstraintState
    from agentrt.runtime.detokenizer import IncrementalDetokenizer
    from agentrt.runtime.kv_tiers import TierLoad
    from agentrt.runtime.repetition import RepetitionGuard
    from agentrt.speculative.tree import DraftTree


GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy decoding (argmax): 0, or a value too small for fp32 division."""

MAX_STOP_CHARS = 1024
"""The longest stop string accepted (characters): each is searched at every token."""

MAX_LOGPROBS = 20
"""The most alternatives (`SamplingParams.logprobs`) a request may ask for: OpenAI's top_logprobs limit."""


class TokenLogprob(NamedTuple):
    """The log-probability (natural log) of one output token, and of the most likely tokens at its step.

    Definition: log-softmax over the vocabulary of the logits after logit_bias and penalties and
    after the grammar's bitmask (masked tokens are -inf), before temperature / top-k / top-p /
    min-p. For a constrained request this is the model's distribution renormalised over the tokens
    the grammar allowed. `top`: up to `SamplingParams.logprobs` (token_id, logprob) pairs, most
    likely first, never a masked token (so fewer when fewer are allowed); empty when logprobs=0.
    Tokens nobody sampled (jump-forward text, a closing-path token of max_tokens_policy "close")
    have logprob 0.0 and top = that token alone; a step where the grammar allows one token gets
    0.0 by the definition itself."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]

    @classmethod
    def forced(cls, token_id: int, num_top: int) -> TokenLogprob:
        """A token the runtime forced (not sampled): logprob 0.0, top = that token alone (none when
        num_top is 0)."""
        return cls(token_id, 0.0, ((token_id, 0.0),) if num_top > 0 else ())


@dataclass
class SamplingParams:
    """Per-request decoding parameters (OpenAI semantics where OpenAI defines one).

    max_tokens: completion tokens at most; None = up to the context limit.
    temperature: 0 (or below GREEDY_TEMPERATURE) = greedy. top_k: <= 0 disables. top_p in (0, 1]. min_p in [0, 1].
    presence_penalty / frequency_penalty in [-2, 2] on generated tokens (OpenAI);
    repetition_penalty in [0.01, 10] on prompt and generated tokens (CTRL, Keskar et al. 2019).
    logit_bias: token id -> bias in [-100, 100] added to the logit.
    stop: strings that end the output (not included in it); stop_token_ids: extra stop ids.
    stop_until: stop strings are looked for only in the text before the first occurrence of one of
    these strings (the texts that open a tool call: a format's trigger, Llama 3's <|python_tag|>
    too), so a stop string never cuts a constrained call.
    max_tokens_policy: "length" (default, OpenAI: stop at max_tokens, finish_reason "length") or
    "close": with a constraint, keep enough budget to finish it and close it validly
    (grammars/length_policy.py); no effect without a constraint.
    speculative: use the engine's speculative decoding for this request (when the engine has it;
    requests with presence/frequency/repetition penalties never speculate: those depend on the
    tokens being verified).
    logprobs: None = none; 0 = each output token's logprob; k in 1..MAX_LOGPROBS = also the k most
    likely tokens at each step (`RequestOutput.logprobs`, TokenLogprob has the definition).
    repetition_repair: with a JSON constraint (json_schema / json_object), end a string value that
    degenerates into repeating itself by forcing the string closed under the grammar (forced tokens,
    TokenLogprob.forced); the values closed are listed in `RequestOutput.repaired`
    (runtime/repetition.py). No effect with other constraints or none.
    Raises InvalidRequestError (a ValueError) with `param` naming the field on an invalid value
    (see `validate`).
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_until: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    max_tokens_policy: str = "length"
    speculative: bool = True
    logprobs: int | None = None
    repetition_repair: bool = False
    reasoning: ReasoningParams | None = None

    @property
    def is_greedy(self) -> bool:
        """Greedy decoding (argmax): temperature below GREEDY_TEMPERATURE."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name} {why}", param=name)

        if self.max_tokens is not None and not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.max_tokens_policy not in ("length", "close"):
            raise bad("max_tokens_policy", f"must be 'length' or 'close', got {self.max_tokens_policy!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be an integer >= -1 (-1 or 0 disable it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.01 <= self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in [0.01, 10], got {self.repetition_penalty}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise bad("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        if len(self.stop) > 16:
            raise bad("stop", f"must be at most 16 strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise bad("stop", f"strings must be non-empty; stop[{i}] is {s!r}")
            try:
                s.encode()
            except UnicodeEncodeError:  # a lone surrogate: never produced as text, so never matched
                raise bad("stop", f"stop[{i}] is not valid Unicode (a lone surrogate)") from None
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):  # scanned at every token: bounded work
            raise bad("stop", f"strings must be at most {MAX_STOP_CHARS} characters each")
        for tid, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= int(tid) < vocab_size:
                raise bad("logit_bias", f"has token id {tid} outside the vocabulary [0, {vocab_size})")
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"values must be in [-100, 100], got {bias} for token {tid}")
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int)
            and not isinstance(self.logprobs, bool)
            and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not isinstance(self.repetition_repair, bool):
            raise bad("repetition_repair", f"must be a boolean, got {self.repetition_repair!r}")
        for tid in self.stop_token_ids:
            if vocab_size is not None and not 0 <= tid < vocab_size:
                raise bad("stop_token_ids", f"has token id {tid} outside the vocabulary [0, {vocab_size})")
        if self.reasoning is not None:
            budget = self.reasoning.budget
            if budget is not None and not (
                isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0
            ):
                raise bad("thinking_token_budget", f"must be an integer >= 0, got {budget!r}")
            if self.reasoning.mode not in ("open", "optional"):
                raise bad("reasoning", f"mode must be 'open' or 'optional', got {self.reasoning.mode!r}")
            if not self.reasoning.start or not self.reasoning.end:
                raise bad("reasoning", "needs non-empty start and end markers")


class RequestStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What the engine reports for a request after a step.

    text: the whole completion so far (stop strings cut off); delta_text: the part new since the
    last report. finish_reason: None while running, else "stop" | "length" | "abort" | "error".
    error: with finish_reason "error", what went wrong as a typed error (agentrt.errors): an
    InvalidRequestError / ConstraintError when the request is at fault (e.g. a grammar that failed
    to compile), ServiceUnavailableError at shutdown, InternalError for a fault while serving it.
    logprobs: with SamplingParams.logprobs set, one TokenLogprob per entry of `token_ids` (the whole
    output so far, aligned 1:1, the final stop token included as in token_ids); else None.
    repaired: with SamplingParams.repetition_repair, the JSON pointers (RFC 6901) of the string
    values that were closed because they repeated themselves, in order (empty: none).
    num_reasoning_tokens: output tokens of the model's reasoning (SamplingParams.reasoning), its
    markers included.
    closed_by_budget: with max_tokens_policy "close", True when the budget ran short and the output
    was steered onto the planner's closing path (its end is the shortest valid completion, not the
    model's own; finish_reason stays "stop" here: the API reports "length" when what the budget
    ended was free text beside tool calls, cut rather than closed, api/tools/parsing.py)."""

    request_id: str
    text: str
    delta_text: str
    token_ids: list[int]
    num_prompt_tokens: int
    finished: bool
    finish_reason: str | None = None
    error: AgentrtError | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    repaired: list[str] = field(default_factory=list)
    closed_by_budget: bool = False
    num_reasoning_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # of num_cached_tokens: host / disk


@dataclass
class SpecState:
    """A request's speculative-decoding state (runtime/speculation.py).

    draft: the DraftTree to verify this step (its target KV slots follow Request.slots);
    draft_bitmask: [len(draft) + 1, ceil(vocab / 32)] int32 grammar masks of the verify rows;
    medusa_topk: Medusa heads' top-k token ids [heads][k] at the last sampled position;
    draft_slots: the draft model's KV slots (its own pool); draft_fed: draft tokens whose
    draft-model KV is computed."""

    draft: DraftTree | None = None
    draft_bitmask: torch.Tensor | None = None
    medusa_topk: list[list[int]] | None = None
    draft_slots: list[int] = field(default_factory=list)
    draft_fed: list[int] = field(default_factory=list)


@dataclass
class CacheState:
    """A request's prefix-cache and KV-tier state (runtime/scheduler.py, runtime/kv_tiers.py), as
    mini-sglang's `Req.cache_handle`. Counts are tokens (one KV slot each, `Request.slots`).

    node: the radix-tree node locked (lock_ref) for the shared prefix, `slots[:num_shared]` being
    the tree's; window_demoted: leading slots out of every attention window, demoted in the KV
    pool's LRU; hit_node: the node where the first admission's cache hit ended; num_cached_tokens:
    prompt tokens served from the cache at the first admission (None: not admitted yet), of which
    `tier_hits` came from each lower tier ("host" / "disk"). tier_load: lower-tier blocks loading
    before admission (kv_tiers.TierLoad); tier_checked: the lower tiers were looked up for this
    admission; tier_relooked: looked up again once (the pool's part of the prefix was evicted
    meanwhile); tier_node: the node locked for blocks loaded from a lower tier until admission;
    prefilled_since_insert: computed prefill KV not yet inserted into the radix tree. For a model
    with recurrent layers (recurrent_state.py): state_slot the working state slot (None while not
    running); snapshots: (depth, slot) state snapshots taken by forwards, not yet in the tree;
    verify_states: scratch slots holding the state after 1, 2, ... tokens of a speculative verify
    chunk, of which verify_kept tokens were kept (recurrent_state.settle_verify); tier_credit:
    (depth, tokens per tier) that a snapshot loaded from a lower tier made resumable, counted into
    tier_hits at admission if r resumes at or past that depth (the snapshot may be dropped before)."""

    node: TreeNode | None = None
    num_shared: int = 0
    window_demoted: int = 0
    hit_node: TreeNode | None = None
    num_cached_tokens: int | None = None
    tier_load: TierLoad | None = None
    tier_checked: bool = False
    tier_relooked: bool = False
    tier_node: TreeNode | None = None
    tier_hits: dict[str, int] = field(default_factory=dict)
    tier_credit: tuple[int, dict[str, int]] | None = None
    prefilled_since_insert: bool = False
    state_slot: int | None = None
    snapshots: list[tuple[int, int]] = field(default_factory=list)
    verify_states: list[int] = field(default_factory=list)
    verify_kept: int = 0


@dataclass(eq=False)
class Request:
    """A generation request and its mutable per-request state (owned by the engine thread).
    Compared by identity.

    `token_ids` is the one token list of the sequence: the prompt (the constructor's argument),
    then every output token; `prompt_ids` / `output_ids` are views of it (copies). `slots[i]` is
    the KV slot of token_ids[i]. Per-subsystem state is grouped in records: `cache` (CacheState:
    prefix cache and KV tiers), `spec` (SpecState: speculative decoding)."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    constraint: ConstraintSpec | None = None
    cache_salt: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = field(init=False)
    # state
    status: RequestStatus = RequestStatus.WAITING
    slots: list[int] = field(default_factory=list)
    max_tokens: int = 0  # resolved completion budget (tokens), set by the engine
    compile_future: Future | None = None  # of the CompiledConstraint, while WAITING_FOR_GRAMMAR
    grammar: ConstraintState | None = None  # matcher, closing guard, jump-forward (constrained requests)
    closed_by_budget: bool = False  # the closing guard steered the output closed (kept past `grammar`)
    num_jump_forward_tokens: int = 0  # tokens appended by jump-forward (not sampled)
    pending_jump_forward: int = 0  # of those, tokens whose KV is not computed yet
    generator: torch.Generator | None = None
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None  # made at the first token
    sent_len: int = 0
    stop_end: int | None = None  # where params.stop_until first occurs in text (stop strings end there)
    stop_scanned: int = 0  # text[:stop_scanned] has been searched for stop strings
    answer_start: int | None = None  # where the answer begins in text (after any reasoning), once known
    finish_reason: str | None = None
    error: AgentrtError | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    prompt_counted: bool = False  # the prompt's tokens are in the engine's stats
    cache: CacheState = field(default_factory=CacheState)
    spec: SpecState = field(default_factory=SpecState)
    repetition: RepetitionGuard | None = None  # runaway-value repair (SamplingParams.repetition_repair)
    reasoning: ReasoningTracker | None = None  # a reasoning model's state and budget (params.reasoning)
    logprobs: list[TokenLogprob] | None = field(init=False)  # one per output token, when asked for

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.logprobs = [] if self.params.logprobs is not None else None

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @output_ids.setter
    def output_ids(self, ids: list[int]) -> None:
        del self.token_ids[self.num_prompt_tokens :]
        self.token_ids.extend(ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def append_output(self, ids: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """Append generated (or forced) tokens; `logprobs`: theirs, one each, when the request asked
        for logprobs (None there: the tokens were forced, TokenLogprob.forced). Raises ValueError
        when `logprobs` does not match `ids` (the output and its logprobs stay aligned)."""
        if self.logprobs is not None:
            if logprobs is None:
                logprobs = [TokenLogprob.forced(t, self.params.logprobs) for t in ids]
            if [lp.token_id for lp in logprobs] != list(ids):
                raise ValueError(f"logprobs of {[lp.token_id for lp in logprobs]} given for tokens {ids}")
            self.logprobs.extend(logprobs)
        self.token_ids.extend(ids)

    def cached_key(self) -> list[int]:
        """Tokens whose KV may come from the cache: all known tokens but the last, which must be
        computed to get the next token's logits."""
        return self.token_ids[:-1]
