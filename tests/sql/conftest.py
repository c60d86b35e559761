"""Fixtures of the SQL tests: the grammar backend on the default model's tokenizer and the Spider
databases (../shared/testdata/sql/databases, schema only) with their compiled grammars. Plain
helpers are in tests/support/sql/ (the awkward-identifier database, grammar samples, token walks)."""

from __future__ import annotations

import pytest

from agentrt.grammars.spec import GrammarConfig
from tests.support.paths import shared_path


@pytest.fixture(scope="session")
def sql_backend(tokenizer):
    """The grammar backend as the server builds it, with a 120 s compile limit: a Spider database's
    bounded grammar compiles in ~8 s on an idle 2-core box (dog_kennels; 2 s before its repetitions
    were bounded), past the server's default 30 s when the suite runs beside other work."""
    from agentrt.grammars.xgrammar_backend import GrammarBackend

    backend = GrammarBackend(tokenizer, 49152, (2,), GrammarConfig(compile_timeout_s=120))
    yield backend
    backend.shutdown()


@pytest.fixture(scope="session")
def spider_dir():
    return shared_path("sql", "databases")


@pytest.fixture(scope="session")
def spider_compiled(sql_backend, spider_dir):
    """db_id -> (schema, grammar, compiled grammar, read-only engine), built on first use."""
    from agentrt.sql import introspect, open_database, sql_grammar

    cache: dict = {}

    def get(db_id: str):
        if db_id not in cache:
            url = f"sqlite:///{spider_dir / (db_id + '.sqlite')}"
            schema = introspect(url)
            grammar = sql_grammar(schema)
            cache[db_id] = (schema, grammar, sql_backend.compile(grammar.spec()), open_database(url))
        return cache[db_id]

    yield get
    for *_, engine in cache.values():
        engine.dispose()
