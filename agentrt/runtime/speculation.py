"""Speculative decoding in the engine: propose drafts, fit them to the grammar, verify, account.

One step of a speculating request (Engine.step):

1. `Speculator.propose` gives each decoding request that opted in a draft (speculative/tree.py):
   n-gram prompt lookup, the draft model's k sampled/greedy tokens, or the Medusa heads' top-k tree
   computed from the previous step's hidden state.
2. For a constrained request the draft runs through the request's own matcher (accept, then
   rollback: a fork that leaves the real state untouched): the first token the grammar rejects cuts
   its subtree, and the bitmask of every remaining position is filled (`r.spec.draft_bitmask`, row 0 =
   after the last known token, row i + 1 = after node i). The draft model is masked while it
   drafts, so its proposal probabilities q are those of a grammar-respecting proposer.
3. The scheduler gives the request 1 + len(draft) KV slots: one forward computes the last token
   and every draft node (tree attention), with logits at each (`Speculator.verify_chunk`; the
   draft's masks join the step's bitmask: `Speculator.add_draft_bitmasks`).
4. `Speculator.process_verified`: `verify` decides the accepted path and the bonus token on the
   masked logits (speculative/verify.py); those tokens then go one at a time through the engine's
   normal token processing (matcher, stop conditions, length policy, jump-forward), stopping at the
   first one that ends the request or is changed by the length policy / followed by jump-forward
   text. Only the accepted path's KV slots stay with the request; the rest go back to the pool.

Requests with presence / frequency / repetition penalties do not speculate (the penalties depend
on the very tokens being verified); logit_bias applies to every row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from agentrt.errors import InternalError
from agentrt.runtime.backends import run_chunks
from agentrt.runtime.batch import BatchPlan
from agentrt.runtime.config import CacheConfig, ModelConfig, SpecConfig
from agentrt.runtime.forward import SeqChunk
from agentrt.runtime.kv_cache import KVPool
from agentrt.runtime.logprobs import logprob_tensors, read_host, rows_of, token_logprob
from agentrt.runtime.metrics import EngineStats
from agentrt.runtime.model_runner import ModelRunner
from agentrt.runtime.recurrent_state import settle_verify
from agentrt.runtime.request import Request, RequestOutput, RequestStatus, TokenLogprob
from agentrt.runtime.sampler import apply_bitmask, sample, target_probs
from agentrt.speculative.medusa import MedusaHeads
from agentrt.speculative.ngram import NgramProposer
from agentrt.speculative.tree import DEFAULT_MEDUSA_TREE, DraftTree, tree_from_topk
from agentrt.speculative.verify import rejection_sample, typical_accept, verify_tree

logger = logging.getLogger(__name__)

SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "speculative" / "heads"


def default_medusa_heads(model_name: str) -> Path | None:
    """The heads directory shipped for a registered model name (None when there is none)."""
    d = SHIPPED_HEADS / Path(model_name).name.lower()
    return d if (d / "config.json").exists() else None


class _SelfDraft:
    """The target's first `num_layers` layers + its final norm and LM head (early exit), sharing
    the target's weights; its KV lives in the draft pool."""

    def __init__(self, model, num_layers: int):
        self.model, self.num_layers = model, num_layers

    def __call__(self, ids, positions, k_caches, v_caches, meta):
        return self.model(ids, positions, k_caches, v_caches, meta, num_layers=self.num_layers)

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


class DraftModelProposer:
    """A smaller model with the target's vocabulary (or a self-draft) and its own KV pool.

    Per request it keeps KV for a prefix of the sequence (`r.spec.draft_slots`); `propose` catches up
    on the tokens it has not seen (the prompt the first time, the accepted tokens afterwards) and
    then drafts k tokens one forward at a time, batched across requests."""

    def __init__(self, model, kv: KVPool, device: torch.device):
        self.model, self.kv, self.device = model, kv, device

    def propose(
        self, reqs: list[Request], ks: dict[Request, int], grammar, failed: dict | None = None
    ) -> dict[Request, tuple[DraftTree, object]]:
        """Drafts (chains, with q_probs when sampling) and, for constrained requests, the bitmask
        rows [len + 1, words] filled along the way. Requests whose KV does not fit get none.
        Faults stay where they arise: a request whose own part raises (its matcher, sampling) gets
        no draft and goes into `failed` (request -> InternalError: its matcher's state is unknown,
        so it must fail; raised when `failed` is None); a draft forward that raises ends drafting
        for this step (logged; matchers rolled back, drafts finished so far kept)."""
        active, chunks = [], []
        for r in reqs:
            seq = r.token_ids
            have = len(r.spec.draft_slots)
            slots = self.kv.allocate(len(seq) - have + ks[r] - 1)
            if slots is None:
                continue
            need = len(seq) - have
            r.spec.draft_slots.extend(slots[:need])
            state = {"r": r, "spare": slots[need:], "tokens": [], "q": [], "bitmask": None}
            if r.grammar is not None:
                state["bitmask"] = grammar.allocate_bitmask(ks[r] + 1)
            active.append(state)
            chunks.append(SeqChunk(seq[have:], have, list(r.spec.draft_slots)))
        out: dict[Request, tuple[DraftTree, object]] = {}
        step = 0
        while active:
            try:
                logits = run_chunks(self.model, self.kv.k, self.kv.v, chunks, self.device)
            except Exception:  # drafts are an optimisation: this step goes on without the rest
                logger.exception("the draft model's forward failed; no drafts for %d requests", len(active))
                for st in active:
                    st["tokens"], st["q"] = self._abandon(st), []
                return out
            nxt_active, nxt_chunks = [], []
            for i, st in enumerate(active):
                try:
                    done = self._draft_token(st, logits[i : i + 1], step, ks, grammar)
                except Exception as e:
                    if failed is None:
                        raise
                    r = st["r"]
                    logger.exception("drafting for %s failed", r.request_id)
                    failed[r] = InternalError(
                        f"internal error in speculative drafting: {type(e).__name__}: {e}"
                    )
                    self.kv.free(st["spare"])
                    st["spare"] = []
                    continue
                if not done:
                    nxt_active.append(st)
                    r = st["r"]
                    nxt_chunks.append(
                        SeqChunk([st["tokens"][-1]], len(r.spec.draft_slots) - 1, list(r.spec.draft_slots))
                    )
                else:
                    self._finish_draft(st, out)
            active, chunks = nxt_active, nxt_chunks
            step += 1
        return out

    def _draft_token(self, st: dict, row: torch.Tensor, step: int, ks: dict, grammar) -> bool:
        """Sample one draft token for st's request from its logits row [1, V] (masked by its
        grammar), feed it to the matcher; True when its draft is done."""
        r = st["r"]
        if st["bitmask"] is not None:
            r.grammar.matcher.fill_next_token_bitmask(st["bitmask"], step)
            apply_bitmask(row, st["bitmask"][step : step + 1], [0], grammar)
        if r.params.is_greedy:
            tok = sample(row, [r])[0]
            q = None
        else:
            q = target_probs(row, r.params)[0]
            tok = int(torch.multinomial(q, 1, generator=r.generator).item()) if float(q.sum()) > 0 else -1
        ok = tok >= 0 and (r.grammar is None or r.grammar.matcher.accept_token(tok))
        if ok:
            st["tokens"].append(tok)
            if q is not None:
                st["q"].append(q)
        done = (
            not ok
            or len(st["tokens"]) >= ks[r]
            or tok in (r.params.stop_token_ids or ())
            or (r.grammar is not None and r.grammar.matcher.is_terminated())
        )
        if not done:
            slot = st["spare"].pop(0)
            r.spec.draft_slots.append(slot)
            r.spec.draft_fed.append(tok)
        return done

    def _abandon(self, st: dict) -> list:
        """Give back what st's draft holds (spare slots; its matcher's draft tokens rolled back)."""
        self.kv.free(st["spare"])
        st["spare"] = []
        if st["bitmask"] is not None and st["tokens"]:
            st["r"].grammar.matcher.rollback(len(st["tokens"]))
        return []

    def _finish_draft(self, st: dict, out: dict) -> None:
        r, tokens = st["r"], st["tokens"]
        self.kv.free(st["spare"])
        st["spare"] = []
        if st["bitmask"] is not None:
            if tokens and not r.grammar.matcher.is_terminated():
                r.grammar.matcher.fill_next_token_bitmask(st["bitmask"], len(tokens))
            if tokens:
                r.grammar.matcher.rollback(len(tokens))
            st["bitmask"] = st["bitmask"][: len(tokens) + 1]
        if not tokens:
            return
        q = torch.stack(st["q"]) if st["q"] else None
        out[r] = (DraftTree.chain(tokens, q), st["bitmask"])

    def settle(self, r: Request, base_len: int) -> None:
        """After the step: keep draft KV only for the prefix of the sequence it was computed for
        (the fed draft tokens that were accepted), minus the last token (fed next time)."""
        seq_len = r.num_tokens
        seq = r.token_ids
        m = 0
        while (
            m < len(r.spec.draft_fed) and base_len + m < seq_len and seq[base_len + m] == r.spec.draft_fed[m]
        ):
            m += 1
        valid = min(base_len + m, seq_len - 1, len(r.spec.draft_slots))
        self.kv.free(r.spec.draft_slots[valid:])
        del r.spec.draft_slots[valid:]
        r.spec.draft_fed = []

    def release(self, r: Request) -> None:
        self.kv.free(r.spec.draft_slots)
        r.spec.draft_slots = []
        r.spec.draft_fed = []


class Speculator:
    """Owns the proposer of one engine; counts its passes in the engine's EngineStats."""

    def __init__(self, config: SpecConfig, runner: ModelRunner, model_name: str, grammar, stats: EngineStats):
        self.config, self.runner, self.grammar, self.stats = config, runner, grammar, stats
        self.method = config.method
        self.k = config.num_speculative_tokens
        self.ngram = self.draft = self.heads = None
        if runner.arch.recurrent_layers and (
            self.method == "medusa" or (self.method == "draft" and config.draft_model is None)
        ):
            what = "medusa (a draft tree)" if self.method == "medusa" else "a self-draft (draft_layers)"
            raise ValueError(
                f"speculative decoding with {what} is not supported with recurrent (linear-attention / "
                "SSM) layers: use ngram or a draft model"
            )
        if self.method == "ngram":
            self.ngram = NgramProposer(self.k, config.ngram_min, config.ngram_max)
        elif self.method == "draft":
            self.draft = self._load_draft(config, runner)
        elif self.method == "medusa":
            path = config.medusa_heads or default_medusa_heads(model_name)
            if path is None:
                raise ValueError(
                    f"no Medusa heads are shipped for model '{model_name}': pass --medusa-heads DIR "
                    "(train them with `agentrt train-medusa`)"
                )
            arch = runner.arch
            self.heads = (
                MedusaHeads.load(path, arch.hidden_size, arch.vocab_size)
                .to(runner.device, runner.dtype)
                .eval()
            )
            self.tree_choices = tuple(config.medusa_tree or DEFAULT_MEDUSA_TREE)
            self.topk = 1 + max(max(c) for c in self.tree_choices)
            logger.info(
                "Medusa: %d heads from %s, tree of %d nodes",
                self.heads.num_heads,
                path,
                len(self.tree_choices),
            )

    @staticmethod
    def _load_draft(config: SpecConfig, runner: ModelRunner) -> DraftModelProposer:
        target = runner.arch
        if config.draft_model is None:
            n = config.draft_layers
            if not 1 <= n < target.num_layers:
                raise ValueError(
                    f"draft_layers must be in [1, {target.num_layers - 1}] for this model, got {n}"
                )
            specs, caches = target.kv_layout()
            layout = [specs[c] for c in sorted({c for c in caches[:n] if c is not None})]
            if [c for c in caches[:n] if c is not None] != list(range(len(layout))):
                raise ValueError("a self-draft needs the first layers to own the first KV caches")
            kv = KVPool(
                layout,
                runner.dtype,
                runner.device,
                runner.kv.num_slots * KVPool.bytes_per_token_of(layout, runner.dtype),
            )
            logger.info("self-draft: the first %d of %d layers", n, target.num_layers)
            return DraftModelProposer(_SelfDraft(runner.model, n), kv, runner.device)
        draft = ModelRunner(
            ModelConfig(
                model=config.draft_model,
                device=str(runner.device),
                dtype=str(runner.dtype).removeprefix("torch."),
                attention_backend="torch",
                enforce_eager=True,
            ),
            CacheConfig(kv_cache_bytes=1 << 20),
            max_num_seqs=1,
        )  # a small pool, replaced below
        if draft.arch.recurrent_layers:
            raise ValueError("a draft model with recurrent (linear-attention / SSM) layers is not supported")
        if draft.arch.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model vocabulary ({draft.arch.vocab_size}) differs from the target's "
                f"({target.vocab_size})"
            )
        probe = 'Draft models must share the tokenizer: {"a": 1}'
        if draft.tokenizer.encode(probe, add_special_tokens=False) != runner.tokenizer.encode(
            probe, add_special_tokens=False
        ):
            raise ValueError("draft model tokenizer differs from the target's")
        a = draft.arch
        layout = a.kv_layout()[0]
        kv = KVPool(
            layout,
            draft.dtype,
            draft.device,
            runner.kv.num_slots * KVPool.bytes_per_token_of(layout, draft.dtype),
        )
        return DraftModelProposer(draft.model, kv, draft.device)

    # ---- 1-2: drafts ---------------------------------------------------------------------------
    def _budget(self, r: Request, max_model_len: int) -> int:
        """Draft tokens worth proposing for r now (0: none)."""
        p = r.params
        if (
            not p.speculative
            or p.presence_penalty
            or p.frequency_penalty
            or p.repetition_penalty != 1.0
            or r.num_tokens - len(r.slots) != 1
            or not r.output_ids
        ):
            return 0
        return max(0, min(self.k, r.max_tokens - len(r.output_ids) - 1, max_model_len - r.num_tokens - 1))

    def propose(
        self, running: list[Request], max_model_len: int, failed: dict | None = None
    ) -> list[Request]:
        """Set r.spec.draft (and r.spec.draft_bitmask) on running requests that speculate this step; returns
        the requests proposed to (each needs `settle` after the step). With n-gram or Medusa drafts,
        a request whose drafting raises (its matcher, while the draft is fitted to its grammar) gets
        no draft and goes into `failed` (request -> InternalError; its matcher's state is unknown,
        so it must fail); the others draft as usual. The same holds for a draft model, whose forward
        failing leaves the step without drafts (DraftModelProposer.propose)."""
        ks = {r: k for r in running if (k := self._budget(r, max_model_len)) > 0}
        if not ks:
            return []
        if self.draft is not None:
            for r, (tree, bitmask) in self.draft.propose(list(ks), ks, self.grammar, failed).items():
                r.spec.draft, r.spec.draft_bitmask = tree, bitmask
            return list(ks)
        for r, k in ks.items():
            try:
                self._propose_one(r, k)
            except Exception as e:
                if failed is None:
                    raise
                logger.exception("drafting for %s failed", r.request_id)
                failed[r] = InternalError(f"internal error in speculative drafting: {type(e).__name__}: {e}")
        return list(ks)

    def _propose_one(self, r: Request, k: int) -> None:
        """An n-gram or Medusa draft of up to k tokens for r, fitted to its grammar."""
        if self.ngram is not None:
            tree = DraftTree.chain(self.ngram.propose(r.token_ids, k))
        else:
            topk, r.spec.medusa_topk = r.spec.medusa_topk, None
            if topk is None:
                return
            tree = tree_from_topk(topk[:k], self.tree_choices)
        if len(tree) == 0:
            return
        bitmask = None
        if r.grammar is not None:
            tree, bitmask = self._fit_to_grammar(r, tree)
        if len(tree):
            r.spec.draft, r.spec.draft_bitmask = tree, bitmask

    def _fit_to_grammar(self, r: Request, tree: DraftTree) -> tuple[DraftTree, torch.Tensor]:
        """Walk the tree depth-first with the request's matcher (accept, recurse, rollback): cut
        every node the grammar rejects (and its subtree); fill the bitmask row of each kept node."""
        m = r.grammar.matcher
        n = len(tree)
        bitmask = self.grammar.allocate_bitmask(n + 1)
        m.fill_next_token_bitmask(bitmask, 0)
        keep = [False] * n
        children = [[] for _ in range(n + 1)]
        for i, p in enumerate(tree.parents):
            children[p + 1].append(i)

        def visit(node: int) -> None:
            for c in children[node + 1]:
                if m.is_terminated() or not m.accept_token(tree.token_ids[c]):
                    continue
                keep[c] = True
                if not m.is_terminated():
                    m.fill_next_token_bitmask(bitmask, c + 1)
                visit(c)
                m.rollback(1)

        visit(-1)
        rows = [0] + [i + 1 for i in range(n) if keep[i]]
        self.stats.num_draft_tokens_cut_by_grammar += n - sum(keep)
        return tree.prune(keep), bitmask[rows]

    # ---- 3: the verify chunk and its masks ----------------------------------------------------------
    @staticmethod
    def verify_chunk(r: Request, context_len: int, slots: list[int]) -> SeqChunk:
        """r's verify chunk: its last token at `context_len` plus every node of r.spec.draft at
        context_len + depth, with a tree mask unless the draft is a chain, logits at every position;
        `slots`: the KV slots of the whole context including them."""
        tree = r.spec.draft
        ids = [r.last_token_id, *tree.token_ids]
        positions = [context_len, *(context_len + d for d in tree.depths)]
        mask = None if tree.is_chain else tree.attention_mask()
        states = r.cache.verify_states  # recurrent layers: the state after each draft token
        snapshots = tuple((i + 1, s) for i, s in enumerate(states))
        return SeqChunk(
            ids, context_len, slots, True, len(ids), positions, mask, id(r), r.cache.state_slot, snapshots
        )

    def add_draft_bitmasks(
        self, plan: BatchPlan, bitmask: torch.Tensor | None, constrained: list[int]
    ) -> torch.Tensor | None:
        """Copy the masks filled while drafting (`r.spec.draft_bitmask`) into the step's bitmask
        [plan.num_rows, words] int32 at each verify row (allocated when None and needed) and append
        those rows to `constrained`; returns the bitmask."""
        for s in plan.rows:
            draft_bitmask = s.request.spec.draft_bitmask
            if s.verify and draft_bitmask is not None:
                if bitmask is None:
                    bitmask = self.grammar.allocate_bitmask(plan.num_rows)
                bitmask[s.row : s.row + s.num_rows] = draft_bitmask
                constrained.extend(range(s.row, s.row + s.num_rows))
        return bitmask

    # ---- 4: verification -----------------------------------------------------------------------
    def verify(self, r: Request, logits: torch.Tensor, greedy_ids: list[int]) -> tuple[list[int], int]:
        """logits [len(draft) + 1, V] fp32 for r's verify rows (penalties and masks applied);
        greedy_ids: their argmax (-1 where all masked). Returns (accepted node indices, bonus)."""
        tree = r.spec.draft
        p = r.params
        if p.is_greedy:
            return verify_tree(tree, lambda row: greedy_ids[row])

        def draw(row: int) -> int:
            return sample(logits[row : row + 1], [r])[0]

        if tree.q_probs is not None:
            probs = target_probs(logits, p)
            if float(probs[0].sum()) <= 0.0:
                return [], -1
            n, bonus = rejection_sample(probs, tree, r.generator)
            return list(range(n)), bonus
        if self.config.acceptance == "typical":
            return typical_accept(
                tree,
                lambda row: target_probs(logits[row : row + 1], p)[0],
                draw,
                self.config.typical_epsilon,
                self.config.typical_delta,
            )
        return verify_tree(tree, draw)

    def account(self, tree: DraftTree, accepted: list[int]) -> None:
        """Count one verify pass: draft tokens, accepted tokens, acceptance per depth."""
        self.stats.count_verify(len(tree), len(accepted), list(tree.depths))

    def process_verified(
        self,
        r: Request,
        logits: torch.Tensor,
        row: int,
        process_token: Callable[[Request, int, TokenLogprob | None], RequestOutput | None],
    ) -> tuple[list, int | None]:
        """Verify r's draft on its rows' logits [len(draft) + 1, V] and feed the accepted tokens +
        the bonus token through `process_token` (the engine's per-token processing) one at a time,
        stopping at the first that ends the request or that the length policy / jump-forward changes
        (later tokens were verified for a different sequence). Only the KV slots of the path actually
        taken stay with r. Returns (outputs, the logits row of the last token when every token went
        in unchanged, else None)."""
        tree = r.spec.draft
        flags = torch.stack([torch.argmax(logits, dim=-1), torch.isneginf(logits).all(dim=-1).long()])
        want = r.params.logprobs
        if want is None:
            argmax, masked = flags.tolist()
        else:  # each node's token at its parent's row, every row's top: in the same host read
            lt = logprob_tensors(logits, [p + 1 for p in tree.parents], tree.token_ids, want)
            host, node_lp, top_values, top_ids, best = read_host(
                flags, lt.chosen, lt.top_values, lt.top_ids, lt.best
            )
            argmax, masked = ([int(x) for x in row] for row in rows_of(host, 2))
        greedy = [-1 if m else g for g, m in zip(argmax, masked)]  # one host sync for the rows
        accepted, bonus = self.verify(r, logits, greedy)
        self.account(tree, accepted)
        ctx = len(r.slots) - 1 - len(tree)
        base, node_slots = r.slots[:ctx], r.slots[ctx:]
        path = [0, *(1 + a for a in accepted)]
        seq = [*(tree.token_ids[a] for a in accepted), bonus]
        lps: list[TokenLogprob | None] = [None] * len(seq)
        if want is not None:  # the target's logprob of each token at the row it was drawn from
            top_values, top_ids = rows_of(top_values, len(tree) + 1), rows_of(top_ids, len(tree) + 1)
            for i, tok in enumerate(seq):
                at = path[i]  # not `row`: that is the chunk's first logits row, returned below
                if i < len(accepted):
                    lp = node_lp[accepted[i]]
                elif r.params.is_greedy or tok < 0:  # the bonus is the row's argmax
                    lp = best[at]
                else:  # a sampled bonus (this path already reads the host per draw)
                    lp = float(torch.log_softmax(logits[at].float(), dim=-1)[tok])
                lps[i] = token_logprob(tok, lp, top_values[at], top_ids[at], want)
        r.spec.draft = None
        outs, used, complete = [], 0, False
        try:
            for i, tok in enumerate(seq):
                r.slots = base + [node_slots[j] for j in path[: i + 1]]
                used = r.cache.verify_kept = i + 1
                before = r.num_tokens
                outs.append(process_token(r, tok, lps[i]))
                if r.status is RequestStatus.FINISHED or r.token_ids[before:] != [tok]:
                    break
            else:
                complete = True
        finally:
            if self.runner.kv.states is not None:  # recurrent layers: the state of the tokens kept
                settle_verify(self.runner.kv.states, r.cache)
            keep = set(path[:used])
            self.runner.kv.free([s for j, s in enumerate(node_slots) if j not in keep])
        return outs, (row + path[-1] if complete else None)

    # ---- Medusa: the next step's candidates -------------------------------------------------------
    @torch.inference_mode()
    def medusa_candidates(self, reqs: list[Request], hidden: torch.Tensor) -> None:
        """hidden [len(reqs), hidden_size]: the state at each request's last sampled token; sets
        r.spec.medusa_topk = top-k token ids per head ([heads][topk])."""
        logits = self.heads(hidden, self.runner.model.lm_head)  # [K, B, V] (a quantized head too)
        top = torch.topk(logits, self.topk, dim=-1).indices.permute(1, 0, 2).tolist()  # [B, K, topk]
        for r, ids in zip(reqs, top):
            r.spec.medusa_topk = ids

    def settle(self, r: Request, base_len: int) -> None:
        r.spec.draft, r.spec.draft_bitmask = None, None
        if self.draft is not None:
            self.draft.settle(r, base_len)

    def release(self, r: Request) -> None:
        r.spec.draft, r.spec.draft_bitmask, r.spec.medusa_topk = None, None, None
        if self.draft is not None:
            self.draft.release(r)
