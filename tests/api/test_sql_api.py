"""The `sql` constraint over HTTP (issue 15): a schema the request carries or a database the server
was started with, the grammar compiled through the ordinary path, every finished query checked
(`sql_check`), and the errors, each naming the field."""

from __future__ import annotations

import sqlite3

import pytest

pytest.importorskip("sqlglot", reason="the sql extra (sqlglot, sqlalchemy) is not installed")
pytest.importorskip("sqlalchemy", reason="the sql extra (sqlglot, sqlalchemy) is not installed")

MODEL = "smollm2-135m-instruct"
DDL = (
    "CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER);\n"
    "CREATE TABLE concert (concert_id INTEGER PRIMARY KEY, singer_id INTEGER REFERENCES singer (singer_id), "
    "year INTEGER);"
)


@pytest.fixture(scope="module")
def sql_client(engine, tmp_path_factory):
    """The API in-process on the default model with one named database `music` (SQLite)."""
    from fastapi.testclient import TestClient

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.sql.service import SQLDatabases

    path = tmp_path_factory.mktemp("sql") / "music.db"
    with sqlite3.connect(path) as db:
        db.executescript(DDL)
        db.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", [(1, "Ana", "PT", 31), (2, "Bo", "SE", 45)])
    databases = SQLDatabases({"music": f"sqlite:///{path}"})
    databases.load()
    front = AsyncEngine(engine=engine)
    with TestClient(create_app(front, MODEL, databases=databases)) as c:
        yield c
    front.shutdown()


def _chat(client, sql, question="How many singers are there?", **kw):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Write a SQL query. {question}"}],
        "temperature": 0,
        "max_tokens": 48,
        "sql": sql,
    }
    return client.post("/v1/chat/completions", json={**body, **kw})


@pytest.mark.parametrize(
    "sql",
    [{"database": "music"}, {"schema": DDL}, {"schema": {"singer": {"name": "TEXT", "age": "INTEGER"}}}],
    ids=["database", "ddl", "json"],
)
def test_sql_constraint_output_is_checked_and_finished_queries_pass(sql_client, sql):
    questions = ("List the names of singers older than 40.", "How many singers are there?")
    choices = []
    for question in questions:
        resp = _chat(sql_client, sql, question)
        assert resp.status_code == 200, resp.text
        choices += resp.json()["choices"]
    # greedy: at least one question ends its query (stop); one cut by max_tokens is reported as such
    assert any(c["finish_reason"] == "stop" for c in choices), choices
    for choice in choices:
        query, check = choice["message"]["content"], choice["sql_check"]
        assert query.startswith(("SELECT", "WITH")), query
        if choice["finish_reason"] == "stop":  # a finished sentence of the grammar: it passes every check
            assert check["valid"] and check["error"] is None, (query, check)
            assert check["checked_database"] is ("database" in sql)  # EXPLAIN on the named database
        else:  # cut by max_tokens: reported as failing, never as good SQL
            assert not check["valid"] and check["stage"] == "length", (query, check)


def test_sql_constraint_on_text_completions(sql_client):
    resp = sql_client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "-- all singers\n",
            "max_tokens": 40,
            "temperature": 0,
            "sql": {"schema": DDL},
        },
    )
    assert resp.status_code == 200, resp.text
    assert "sql_check" in resp.json()["choices"][0]


@pytest.mark.parametrize(
    "sql,extra,param,pattern",
    [
        ({"database": "music", "schema": DDL}, {}, "sql", "exactly one of schema and database"),
        ({}, {}, "sql", "exactly one of schema and database"),
        ({"database": "shop"}, {}, "sql.database", "unknown database 'shop'; this server has: music"),
        ({"database": "music", "dialect": "postgres"}, {}, "sql.database", "is sqlite, not postgres"),
        ({"schema": "sqlite:////etc/passwd.db"}, {}, "sql.schema", "cannot carry a database URL"),
        ({"schema": ""}, {}, "sql.schema", "empty"),
        ({"schema": "CREATE TABLE (("}, {}, "sql.schema", "."),
        ({"schema": {}}, {}, "sql.schema", "."),
        ({"schema": DDL, "url": "x"}, {}, "sql.url", "Extra inputs"),
        ({"schema": DDL}, {"regex": "a+"}, "sql", "regex, sql"),
    ],
)
def test_sql_errors_name_the_field(sql_client, sql, extra, param, pattern):
    resp = _chat(sql_client, sql, **extra)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and pattern in err["message"], err
