"""The length-safe policy (`max_tokens_policy: "close"`, the sql default) on names no single token
spells: the closing-path planner spells them with tokens of partial UTF-8 (the check found every
request on such a schema refused with "the closing-path planner found no way to complete it ...
after 'SELECT \\"'"). Model-free: the default model's tokenizer and the grammar backend."""

from __future__ import annotations

import pytest

from agentrt.sql import schema_from_json, sql_grammar

NAMES = ["🙂", "\u202eabc", "a\u200bb", "\ufeffa", "größe_名字", "🙂🙂🙂🙂🙂🙂🙂🙂"]


@pytest.mark.parametrize("where", ["column", "table"])
@pytest.mark.parametrize("name", NAMES, ids=["emoji", "rlo", "zwsp", "bom", "mixed", "emoji8"])
def test_closing_path_spells_names_of_partial_utf8_tokens(sql_backend, tokenizer, name, where):
    schema = schema_from_json({"t": {name: "INTEGER"}} if where == "column" else {name: {"a": "INTEGER"}})
    compiled = sql_backend.compile(sql_grammar(schema).spec())
    matcher = sql_backend.new_matcher(compiled, [tokenizer.eos_token_id])
    planner = sql_backend.planner
    path = planner.closing_path(matcher)
    assert path is not None, planner.failure
    # the tokens spell a query of the grammar that names the table or column itself
    text = tokenizer.decode(path.token_ids)
    assert f'"{name}"' in text, text
    for tid in path.token_ids:
        assert matcher.accept_token(tid)
    assert matcher.is_completed()
    matcher.rollback(len(path.token_ids))
    # from inside the name too (after `SELECT "` and its first bytes), as ClosingGuard re-plans
    prefix = tokenizer.encode(f'SELECT "{name}' if where == "column" else f'SELECT * FROM "{name}')
    for tid in prefix[: len(prefix) - 1]:
        assert matcher.accept_token(tid)
    again = planner.closing_path(matcher)
    assert again is not None, planner.failure
    for tid in again.token_ids:
        assert matcher.accept_token(tid)
    assert matcher.is_completed()


# The Spider run's output that ended by max_tokens under the policy (cre_Doc_Template_Mgt, 128
# tokens): after `EXCEPT SELECT Template_` the greedy closing path grows from 4 to 71 tokens (the
# column's table must be joined in), so a guard that skipped its check on that token had no path
# that fit any more.
SPIDER_OUTPUT = (
    "SELECT AVG(SUBSTR(Templates.Template_Type_Code, 10, 1)) || 10.100000 || 10.100000 FROM Templates "
    "EXCEPT SELECT Template_Type_Code * 0 * 0 FROM Documents AS T1 INNER JOIN Paragraphs AS T2 ON "
    "T1.key = T1.key AND T1.key = T1.key"
)


def _check_invariant(matcher, guard, left: int) -> None:
    """After a kept token: the path being followed fits, or the verified path fits and the grammar
    accepts it from here, or more tokens are left than any path needs."""
    if guard.plan:
        assert len(guard.plan) <= left
    elif guard.path is not None:
        assert len(guard.path) + 1 <= left
        for i, t in enumerate(guard.path):
            assert matcher.accept_token(t), f"verified path token {i} rejected"
        assert matcher.is_completed()
        if guard.path:
            matcher.rollback(len(guard.path))
    else:
        assert left > guard.bound


@pytest.mark.parametrize("max_tokens", [60, 90, 104, 109, 128])  # 90-109: ran out before
def test_closing_guard_keeps_a_fitting_path_through_a_jump_in_path_length(
    spider_compiled, sql_backend, tokenizer, max_tokens
):
    """Replay the output token by token (a token the guard or the grammar refuses is replaced by
    the closing path's, as the engine does), with jump-forward as the engine runs it: after every
    token a closing path fits what is left, and the output ends by the grammar within max_tokens."""
    from agentrt.grammars.length_policy import ClosingGuard
    from agentrt.runtime.constraint_state import ConstraintState

    _, _, compiled, _ = spider_compiled("cre_Doc_Template_Mgt")
    stop = tokenizer.eos_token_id
    matcher = sql_backend.new_matcher(compiled, [stop])
    state = ConstraintState(matcher, ClosingGuard(sql_backend.planner, stop), sql_backend.jump_finder)
    assert state.closing.start(matcher) <= max_tokens
    want = tokenizer.encode(SPIDER_OUTPUT)
    out: list[int] = []
    while not matcher.is_terminated():
        assert len(out) < max_tokens, f"budget spent: {tokenizer.decode(out)!r}"
        tok = want[len(out)] if len(out) < len(want) else None
        if tok is None or not matcher.accept_token(tok):
            path = sql_backend.planner.closing_path(matcher)
            tok = path.token_ids[0] if path.token_ids else stop
        else:
            matcher.rollback(1)
        accepted = state.accept(tok, max_tokens - len(out) - 1)
        assert accepted is not None
        out.append(accepted.token_id)
        if matcher.is_terminated():
            break
        left = max_tokens - len(out)
        _check_invariant(matcher, state.closing, left)
        out += state.jump_forward(tokenizer, out[-1], left)
        _check_invariant(matcher, state.closing, max_tokens - len(out))
    assert out[-1] == stop and len(out) <= max_tokens


def test_forced_text_is_taken_only_when_a_closing_path_fits_after_it(spider_compiled, sql_backend, tokenizer):
    """A repair's forced text (ConstraintState.force with a budget) under the length-safe policy:
    refused, the matcher and the verified path unchanged, when no closing path fits after it."""
    from agentrt.grammars.length_policy import ClosingGuard
    from agentrt.runtime.constraint_state import ConstraintState

    _, _, compiled, _ = spider_compiled("cre_Doc_Template_Mgt")
    stop = tokenizer.eos_token_id
    matcher = sql_backend.new_matcher(compiled, [stop])
    state = ConstraintState(matcher, ClosingGuard(sql_backend.planner, stop))
    for t in tokenizer.encode("SELECT"):
        assert matcher.accept_token(t)
    state.closing.start(matcher)
    verified = list(state.closing.path)
    forced = tokenizer.encode(" Template_Details")  # then `FROM Templates` is still needed
    assert not state.force(forced, len(forced) + 1)
    assert state.closing.path == verified
    for t in verified:  # the matcher is where it was: the verified path still closes it
        assert matcher.accept_token(t)
    assert matcher.is_completed()
    matcher.rollback(len(verified))
    assert state.force(forced, 128)  # the greedy path after it is long (~70 tokens)
    _check_invariant(matcher, state.closing, 128 - len(forced))
