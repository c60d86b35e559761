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
