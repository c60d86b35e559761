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


def test_sql_bad_input_leaves_the_server_serving(sql_client):
    """A schema with more tables than the grammar's scope budget (6,000 columns), one with
    thousands of columns that the grammar can hold, and a question over the context: each is a
    clear answer (400, or a query) for that request only; the next request is served."""
    too_many = {f"t{i}": {f"c{j}": "INTEGER" for j in range(60)} for i in range(100)}
    resp = _chat(sql_client, {"schema": too_many})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "sql.schema" and "Schema.subset" in err["message"], err

    wide = {f"t{i}": {f"t{i}_id": "INTEGER"} | {f"c{i}_{j}": "TEXT" for j in range(150)} for i in range(20)}
    resp = _chat(sql_client, {"schema": wide}, max_tokens=64)
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:  # over the compile limit: said so, naming the constraint
        assert "compile" in resp.json()["error"]["message"], resp.text

    resp = _chat(sql_client, {"database": "music"}, question="singers " * 20000)
    assert resp.status_code == 400, resp.text
    assert "context" in resp.json()["error"]["message"] or "tokens" in resp.json()["error"]["message"]

    resp = _chat(sql_client, {"database": "music"})
    assert resp.status_code == 200 and isinstance(resp.json()["choices"][0]["sql_check"]["valid"], bool)


# ---- over the fake model runner (agentrt.testing): the HTTP behaviour, not the model's queries ----


@pytest.fixture(scope="module")
def fake_sql_client(tokenizer, tmp_path_factory):
    """The API over the fake runner with three named databases: `music`, `big` (70 tables, over the
    grammar's limit) and `flaky` (its file is removed by a test). Yields (client, databases, dir)."""
    from fastapi.testclient import TestClient

    from agentrt.api.app import create_app
    from agentrt.runtime.async_engine import AsyncEngine
    from agentrt.sql.service import SQLDatabases
    from agentrt.testing import fake_engine

    d = tmp_path_factory.mktemp("sqlfake")
    with sqlite3.connect(d / "music.db") as db:
        db.executescript(DDL)
    with sqlite3.connect(d / "big.db") as db:
        db.execute("CREATE TABLE t0 (id INTEGER PRIMARY KEY, name TEXT)")
        for i in range(1, 70):
            db.execute(
                f"CREATE TABLE t{i} (id INTEGER PRIMARY KEY, t0_id INTEGER REFERENCES t0 (id), v{i} REAL)"
            )
    with sqlite3.connect(d / "flaky.db") as db:
        db.executescript(DDL)
    databases = SQLDatabases({n: f"sqlite:///{d / (n + '.db')}" for n in ("music", "big", "flaky")})
    databases.load()
    front = AsyncEngine(engine=fake_engine(tokenizer=tokenizer, max_model_len=8192, num_kv_slots=16384))
    with TestClient(create_app(front, MODEL, databases=databases)) as c:
        yield c, databases, d
    front.shutdown()


def _tables_named(query: str) -> set[str]:
    import sqlglot
    from sqlglot import exp

    tree = sqlglot.parse_one(query, read="sqlite")
    ctes = {c.alias_or_name for c in tree.find_all(exp.CTE)}
    return {t.name for t in tree.find_all(exp.Table)} - ctes


def test_tables_field_chooses_the_tables_of_a_database_over_the_limit(fake_sql_client):
    client, databases, _ = fake_sql_client
    from agentrt.sql.service import table_limit_warning

    warning = table_limit_warning(databases.get("big"))  # printed by `agentrt serve` at start
    assert "70 tables" in warning and '"tables"' in warning and "limit of 64" in warning
    assert table_limit_warning(databases.get("music")) is None
    resp = _chat(client, {"database": "big"})
    assert resp.status_code == 400 and '"tables"' in resp.json()["error"]["message"], resp.text
    resp = _chat(client, {"database": "big", "tables": ["t0", "T5"]}, max_tokens=64)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["sql_check"]["valid"], choice
    assert _tables_named(choice["message"]["content"]) <= {"t0", "t5"}, choice
    # a schema the request carries takes it too
    resp = _chat(client, {"schema": DDL, "tables": ["concert"]}, max_tokens=64)
    assert resp.status_code == 200 and _tables_named(resp.json()["choices"][0]["message"]["content"]) == {
        "concert"
    }


@pytest.mark.parametrize(
    "tables,pattern",
    [(["t0", "nope"], "no table 'nope' in the schema"), (["t1", "T1"], "named twice"), ([], "at least 1")],
)
def test_tables_field_errors_name_it(fake_sql_client, tables, pattern):
    client, *_ = fake_sql_client
    resp = _chat(client, {"database": "big", "tables": tables})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "sql.tables" and pattern in err["message"], err


def test_refresh_of_an_unreachable_database_is_a_503(fake_sql_client):
    client, _, d = fake_sql_client
    assert _chat(client, {"database": "flaky", "refresh": True}).status_code == 200
    (d / "flaky.db").rename(d / "flaky.moved")
    try:
        resp = _chat(client, {"database": "flaky", "refresh": True})
        assert resp.status_code == 503, resp.text
        err = resp.json()["error"]
        assert err["type"] == "server_error" and "no SQLite database file" in err["message"], err
    finally:
        (d / "flaky.moved").rename(d / "flaky.db")
    assert _chat(client, {"database": "flaky", "refresh": True}).status_code == 200


def test_names_no_token_spells_close_under_the_default_policy(fake_sql_client):
    """max_tokens_policy "close" (the sql default) on names of partial-UTF-8 tokens: a query, not
    a 400 from the closing-path planner."""
    client, *_ = fake_sql_client
    for name in ("🙂", "\u202eabc", "a\u200bb", "\ufeffa"):
        resp = _chat(client, {"schema": {"t": {name: "INTEGER"}, name: {"b": "TEXT"}}}, max_tokens=96)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["sql_check"]["valid"], choice


def test_ddl_over_the_cap_is_a_400_naming_the_limit(fake_sql_client):
    from agentrt.sql.schema import MAX_DDL_BYTES

    client, *_ = fake_sql_client
    ddl = "CREATE TABLE t (a int DEFAULT (" + "1+" * (MAX_DDL_BYTES // 2) + "1))"
    resp = _chat(client, {"schema": ddl})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "sql.schema" and f"over the limit of {MAX_DDL_BYTES} bytes" in err["message"], err


def test_responses_refuses_the_sql_field(fake_sql_client):
    client, *_ = fake_sql_client
    for sql in ({"database": "music"}, {"database": "nope"}):
        resp = client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "List singers.", "max_output_tokens": 16, "sql": sql},
        )
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "sql" and "/v1/chat/completions" in err["message"], err


def test_sql_databases_route_gives_the_prompts_schema(fake_sql_client):
    from agentrt.sql.service import sql_messages

    client, databases, d = fake_sql_client
    resp = client.get("/v1/sql/databases")
    assert resp.status_code == 200, resp.text
    listing = {x["name"]: x for x in resp.json()["data"]}
    assert set(listing) == {"music", "big", "flaky"}
    music = databases.get("music")
    assert listing["music"]["dialect"] == "sqlite" and listing["music"]["num_tables"] == 2
    assert (
        sorted(listing["music"]["tables"]) == ["concert", "singer"] and listing["music"]["max_tables"] == 64
    )
    assert listing["music"]["ddl"] == music.schema.to_ddl("sqlite")
    assert listing["music"]["system_prompt"] == sql_messages("q", music.schema)[0]["content"]
    assert listing["big"]["num_tables"] == 70
    assert str(d) not in resp.text and "sqlite:" not in resp.text  # never the URL


@pytest.mark.parametrize(
    "field,value",
    [
        ("regex", "[a-z]+"),
        ("grammar", 'root ::= "a"'),
        ("lark", 'start: "a"'),
        ("choice", ["a", "b"]),
        ("guided_json", {"type": "object"}),
        ("guided_regex", "[a-z]+"),
        ("guided_choice", ["a"]),
        ("structured_outputs", {"regex": "[a-z]+"}),
        ("response_format", {"type": "json_object"}),
    ],
)
def test_responses_refuses_every_chat_constraint_field(fake_sql_client, field, value):
    """/v1/responses enforces text.format only: a chat/completions constraint field sent there is a
    400 naming it (it was silently ignored, so the output was unconstrained)."""
    client, *_ = fake_sql_client
    resp = client.post(
        "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4, field: value}
    )
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == field and "text.format" in err["message"], err
