"""`LLM.sql` and `agentrt sql` on the default model over a real SQLite database (issue 15): the
query comes back checked (sqlglot, the schema, EXPLAIN), with rows when asked, and a failure is
reported as one, never as good SQL."""

from __future__ import annotations

import sqlite3
import subprocess
import sys

import pytest

pytest.importorskip("sqlglot", reason="the sql extra (sqlglot, sqlalchemy) is not installed")
pytest.importorskip("sqlalchemy", reason="the sql extra (sqlglot, sqlalchemy) is not installed")

DDL = (
    "CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER);\n"
    "CREATE TABLE concert (concert_id INTEGER PRIMARY KEY, singer_id INTEGER REFERENCES singer (singer_id), "
    "year INTEGER);"
)
QUESTION = "List the names of singers older than 40."


@pytest.fixture(scope="module")
def music_db(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sql") / "music.db"
    with sqlite3.connect(path) as db:
        db.executescript(DDL)
        db.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", [(1, "Ana", "PT", 31), (2, "Bo", "SE", 45)])
    return f"sqlite:///{path}"


def test_llm_sql_returns_a_checked_query_and_its_rows(engine, music_db):
    from agentrt.sdk import LLM

    llm = LLM.from_engine(engine)
    result = llm.sql(QUESTION, music_db, execute=True, max_tokens=64)
    assert result.query.startswith("SELECT"), result
    if result.valid:  # it parsed, names only real columns, EXPLAIN accepted it, and it ran
        assert result.checked_database and result.rows is not None
        assert result.rows.columns and len(result.rows.rows) <= 2
    else:  # the reason is given; the tiny model may run out of tokens
        assert result.error and result.stage in ("length", "parse", "schema", "database"), result
    schema_only = llm.sql(QUESTION, DDL, max_tokens=64)  # no connection: sqlglot and the schema only
    assert schema_only.query == result.query and not schema_only.checked_database
    with pytest.raises(ValueError, match="needs a database"):
        llm.sql(QUESTION, DDL, execute=True)


def test_llm_sql_reports_a_query_cut_by_max_tokens_as_invalid(engine, music_db):
    from agentrt.errors import InvalidRequestError
    from agentrt.runtime.request import SamplingParams
    from agentrt.sdk import LLM

    llm = LLM.from_engine(engine)
    cut = SamplingParams(temperature=0.0, max_tokens=3)  # max_tokens_policy "length": the query is cut
    result = llm.sql(QUESTION, music_db, sampling_params=cut)
    assert (result.valid, result.stage) == (False, "length"), result
    assert "did not end within 3 tokens" in result.error
    # the default policy, "close", refuses a budget too small to end any query, naming it
    with pytest.raises(InvalidRequestError, match="max_tokens 3 is below"):
        llm.sql(QUESTION, music_db, max_tokens=3)


def test_llm_sql_bad_database_is_a_clear_error(engine, tmp_path):
    from agentrt.sdk import LLM
    from agentrt.sql.errors import SchemaError

    with pytest.raises(SchemaError, match="unsupported database"):
        LLM.from_engine(engine).sql(QUESTION, "mysql://x/y")
    with pytest.raises(SchemaError):
        LLM.from_engine(engine).sql(QUESTION, f"sqlite:///{tmp_path / 'missing' / 'x.db'}")


@pytest.mark.slow  # a CLI process loading the model, ~21 s; LLM.sql below is the same path in-process
def test_agentrt_sql_cli_prints_the_query_and_rows(music_db):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrt.cli",
            "sql",
            "--database",
            music_db,
            "--execute",
            "--max-tokens",
            "64",
            QUESTION,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = proc.stdout.splitlines()
    assert lines and lines[0].startswith("SELECT"), (proc.stdout, proc.stderr[-2000:])
    if proc.returncode == 0:
        assert len(lines) >= 2  # the header of the rows, then the rows
    else:
        assert proc.returncode == 1 and "failed its check" in proc.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "agentrt.cli", "sql", "--database", "mysql://x/y", QUESTION],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and "unsupported database" in bad.stderr
