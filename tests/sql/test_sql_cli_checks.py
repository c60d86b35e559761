"""`LLM.sql(tables=...)` and `agentrt sql`: bad flags and a bad database fail before the model loads
(the check found `--max-rows -1` reported after a 220 s generation, and a missing database after a
96 s model load). Over the fake model runner (agentrt.testing) where a model is needed."""

from __future__ import annotations

import sqlite3

import pytest

from agentrt.sql import SchemaError


@pytest.fixture(scope="module")
def big_db(tmp_path_factory):
    """An SQLite database of 70 tables (over the grammar's limit of 64): its URL."""
    path = tmp_path_factory.mktemp("sqlcli") / "big.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t0 (id INTEGER PRIMARY KEY, name TEXT)")
        for i in range(1, 70):
            db.execute(f"CREATE TABLE t{i} (id INTEGER PRIMARY KEY, t0_id INTEGER REFERENCES t0 (id))")
    return f"sqlite:///{path}"


@pytest.fixture(scope="module")
def fake_llm(tokenizer):
    from agentrt.sdk import LLM
    from agentrt.testing import fake_engine

    return LLM.from_engine(fake_engine(tokenizer=tokenizer, max_model_len=8192, num_kv_slots=16384))


def test_llm_sql_tables_chooses_the_tables(fake_llm, big_db):
    import sqlglot
    from sqlglot import exp

    with pytest.raises(SchemaError, match="Schema.subset"):
        fake_llm.sql("How many?", big_db, max_tokens=64)
    result = fake_llm.sql("How many?", big_db, tables=["t0", "t7"], execute=True, max_tokens=64)
    assert result.valid and result.rows is not None, result
    tree = sqlglot.parse_one(result.query, read="sqlite")
    ctes = {c.alias_or_name for c in tree.find_all(exp.CTE)}
    assert {t.name for t in tree.find_all(exp.Table)} - ctes <= {"t0", "t7"}, result.query
    with pytest.raises(SchemaError, match="no table 'nope'"):
        fake_llm.sql("How many?", big_db, tables=["nope"])
    with pytest.raises(ValueError, match="max_rows must be >= 0"):
        fake_llm.sql("How many?", big_db, tables=["t0"], execute=True, max_rows=-1)


@pytest.fixture
def no_model(monkeypatch):
    """LLM.from_config fails the test: the command must stop before the model loads."""
    from agentrt.sdk import LLM

    def refuse(*_a, **_k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(LLM, "from_config", classmethod(refuse))


@pytest.mark.parametrize(
    "flags",
    [["--max-rows", "-1"], ["--max-tokens", "0"], ["--max-rows", "ten"], ["--max-tokens", "-5"]],
)
def test_cli_bad_numbers_exit_2_before_the_model(no_model, big_db, flags, capsys):
    from agentrt.cli import main

    with pytest.raises(SystemExit) as e:
        main(["sql", "--database", big_db, "--execute", *flags, "List rows"])
    assert e.value.code == 2
    assert flags[0] in capsys.readouterr().err


def test_cli_checks_the_database_before_the_model(no_model, big_db, tmp_path, capsys):
    from agentrt.cli import main

    missing = tmp_path / "missing.sqlite"
    assert main(["sql", "--database", f"sqlite:///{missing}", "List rows"]) == 2
    assert "no SQLite database file" in capsys.readouterr().err and not missing.exists()
    assert main(["sql", "--database", big_db, "--tables", "t0,nope", "List rows"]) == 2
    assert "no table 'nope'" in capsys.readouterr().err
    assert main(["sql", "--database", "mysql://u@localhost/db", "List rows"]) == 2
    assert "unsupported database" in capsys.readouterr().err


def test_cli_tables_reach_the_query(fake_llm, big_db, monkeypatch, capsys):
    import sqlglot
    from sqlglot import exp

    from agentrt.cli import main
    from agentrt.sdk import LLM

    monkeypatch.setattr(LLM, "from_config", classmethod(lambda cls, config: fake_llm))
    assert (
        main(["sql", "--database", big_db, "--tables", "t3, t0", "--execute", "--max-tokens", "64", "q"]) == 0
    )
    query = capsys.readouterr().out.splitlines()[0]
    tree = sqlglot.parse_one(query, read="sqlite")
    ctes = {c.alias_or_name for c in tree.find_all(exp.CTE)}
    assert {t.name for t in tree.find_all(exp.Table)} - ctes <= {"t0", "t3"}, query
