"""Output processing: after a token is accepted, decide whether the request stops, turn its
tokens into text, and build the RequestOutput the caller sees (stop checks, detokenization and
emission in one place)."""

from __future__ import annotations

from agentrt.runtime.detokenizer import IncrementalDetokenizer
from agentrt.runtime.reasoning_budget import ReasoningTracker
from agentrt.runtime.request import Request, RequestOutput


class OutputProcessor:
    """Stop conditions, detokenization and emission for one engine.

    tokenizer: the model's Hugging Face tokenizer; stop_ids: the model's end-of-sequence ids;
    max_model_len: the context limit in tokens."""

    def __init__(self, tokenizer, stop_ids: list[int], max_model_len: int):
        self.tokenizer, self.stop_ids, self.max_model_len = tokenizer, stop_ids, max_model_len

    def update(self, r: Request, reason: str | None) -> str | None:
        """After r's last output token was appended (and its grammar advanced): check the stop
        conditions not yet decided, update `r.text`, and return the finish reason ("stop",
        "length") or None. `reason`: "stop" when the grammar terminated on that token.

        Unconstrained requests stop on the model's EOS ids (unless ignore_eos) and on
        stop_token_ids; a stop token is not part of the text. Stop strings (OpenAI `stop`) cut the
        text before the first match (ending before `stop_until`, when set); with a reasoning model
        they are looked for in the answer only (`answer_start`): never in the reasoning, its end
        marker (sampled or forced by the thinking budget) or what separates the answer from it. The budget
        (`r.max_tokens`) and the context limit end with "length". Text is decoded incrementally (runtime/detokenizer.py: O(window) per token);
        the final text is one full decode, exactly as the tokenizer says."""
        p = r.params
        tok = r.last_token_id
        if r.grammar is None and ((tok in self.stop_ids and not p.ignore_eos) or tok in p.stop_token_ids):
            reason = "stop"
        output_ids = r.output_ids
        text_ids = output_ids[:-1] if reason == "stop" else output_ids
        cut = -1
        if reason is None:  # a window of new tokens, not the whole output
            if r.detokenizer is None:
                r.detokenizer = IncrementalDetokenizer(p.skip_special_tokens)
            text = r.detokenizer.update(self.tokenizer, text_ids)
            if p.stop and r.stop_end is None:
                if r.answer_start is None:  # stop strings apply to the answer, not the reasoning
                    r.answer_start = answer_start(r.reasoning, text, r.stop_scanned)
                    if r.answer_start is not None:
                        r.stop_scanned = r.answer_start
                    elif r.reasoning.state != "answer":  # the end marker is not in text[:len(text)]
                        r.stop_scanned = len(text)
                if r.answer_start is not None:
                    cut = self._find_stop(r, text)
                    if cut >= 0:
                        text, reason = text[:cut], "stop"
            if reason is None and (len(output_ids) >= r.max_tokens or r.num_tokens >= self.max_model_len):
                reason = "length"
        if reason is not None and cut < 0:
            text = self.tokenizer.decode(text_ids, skip_special_tokens=p.skip_special_tokens)
        r.text = text
        return reason

    @staticmethod
    def _find_stop(r: Request, text: str) -> int:
        """Where the first stop string starts in `text` (-1: none yet). Only the text after the
        previous scan is searched (a match may begin up to len(stop) - 1 characters before it).
        With `stop_until`, matches must end before its first occurrence (`r.stop_end`, then no
        more scans), and a possible start of it at the end of the text is not scanned yet."""
        p = r.params
        end = len(text)
        lo = r.answer_start or 0
        if p.stop_until:
            found = [text.find(u, max(lo, r.stop_scanned - len(u) + 1)) for u in p.stop_until]
            if any(k >= 0 for k in found):
                r.stop_end = end = min(k for k in found if k >= 0)
            else:
                end -= max(_partial_match(text, end, u) for u in p.stop_until)
        starts = [text.find(s, max(lo, r.stop_scanned - len(s) + 1), end) for s in p.stop]
        r.stop_scanned = end
        return min((i for i in starts if i >= 0), default=-1)

    @staticmethod
    def emit(r: Request, final: bool) -> RequestOutput | None:
        """The output to report for r now: the new text since the last report (None when there is
        none and r is not final). While running, an incomplete UTF-8 sequence, text not yet scanned
        for stop strings and a possible start of a stop string before it are held back. Token ids
        and logprobs are the whole output so far (held-back text's tokens included)."""
        text = r.text
        upto = len(text)
        if not final:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                upto = len(text.rstrip("\ufffd"))
            if r.params.stop and r.stop_end is None:  # text not yet scanned for stop strings waits,
                upto = min(upto, r.stop_scanned)  # and so does a possible start of one before it
                upto -= max(_partial_match(text, upto, s) for s in r.params.stop)
        delta = text[r.sent_len : upto] if upto > r.sent_len else ""
        if not delta and not final:
            return None
        r.sent_len = max(r.sent_len, upto)
        return RequestOutput(
            r.request_id,
            text[:upto],
            delta,
            r.output_ids,
            r.num_prompt_tokens,
            final,
            r.finish_reason,
            r.error,
            r.cache.num_cached_tokens or 0,
            list(r.logprobs) if r.logprobs is not None else None,
            list(r.repetition.repaired) if r.repetition is not None else [],
            r.closed_by_budget,
            r.reasoning.num_tokens if r.reasoning is not None else 0,
            dict(r.cache.tier_hits),
        )


def answer_start(tracker: ReasoningTracker | None, text: str, scanned: int) -> int | None:
    """Where the answer begins in `text` (a character offset), where stop strings may match: 0
    without reasoning; for a reasoning model, after its end marker, the whitespace or separator
    after it and the answer's header (Harmony's "<|start|>assistant<|channel|>final<|message|>"),
    as the API's ReasoningParser drops them; None while the output is still reasoning or the answer
    has not begun. `scanned`: text[:scanned] is known to hold no end marker (a marker that the
    decoded text leaves out, a special token skipped, ends the reasoning there). A reasoning that a
    call marker ended (ReasoningParams.call_markers) is followed by its answer at that marker."""
    if tracker is None:
        return 0
    if tracker.state != "answer":
        return None
    p = tracker.params
    at = 0
    marker = tracker.ended_by
    if marker is not None and marker != p.end:  # a call inside the reasoning opens the answer
        k = text.find(marker, max(0, scanned - len(marker) + 1))
        at = k if k >= 0 else min(scanned, len(text))
        return at if at < len(text) else None
    if tracker.num_tokens:  # the reasoning ran: the answer starts after its end marker
        k = text.find(p.end, max(0, scanned - len(p.end) + 1))
        at = k + len(p.end) if k >= 0 else min(scanned, len(text))
    for prefix in (p.after_end.strip(), p.header):
        at = _skip_space(text, at)
        if prefix and text.startswith(prefix, at):
            at += len(prefix)
        elif prefix and prefix.startswith(text[at:]):
            return None  # the separator or header may still be written
    at = _skip_space(text, at)
    return at if at < len(text) else None


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _partial_match(text: str, upto: int, stop: str) -> int:
    """The longest k < len(stop) with text[:upto] ending in stop[:k] (0: none). Only the k where
    stop[k - 1] is text's last character are compared, without copying the text: O(len(stop)) for
    the positions plus the compares (stop strings are at most MAX_STOP_CHARS long)."""
    if upto == 0:
        return 0
    last = text[upto - 1]
    k = min(len(stop) - 1, upto)
    while k > 0:
        k = stop.rfind(last, 0, k) + 1  # the next candidate: stop[k - 1] == last
        if k > 0 and text.endswith(stop[:k], 0, upto):
            return k
        k -= 1
    return 0
