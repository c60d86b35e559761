"""PostgreSQL: a real server (Debian's postgresql binaries, initdb + pg_ctl in a temporary
directory, run as the `postgres` user when the tests run as root) gives the same table/column
model as SQLite and DuckDB, its grammar's queries plan (EXPLAIN), and execution is read-only
with a statement timeout. Slow (a server start); skipped where the binaries are absent."""

from __future__ import annotations

import glob
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from agentrt.sql import (
    QueryError,
    QueryTimeoutError,
    execute,
    introspect,
    open_database,
    sql_grammar,
    validate,
)
from agentrt.testing import free_port
from tests.support.sql.awkward import ENDLESS, expected_model, make_awkward, model, statements
from tests.support.sql.sampling import sample
from tests.support.sql.walks import token_walks

pytestmark = pytest.mark.slow


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None
    )
    if found is None and Path(f"/usr/local/bin/{name}").exists():
        found = f"/usr/local/bin/{name}"
    return found


@pytest.fixture(scope="module")
def pg_url():
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found: install Debian's `postgresql`")
    as_user: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="agentrt-pg-"))
    if os.geteuid() == 0:  # initdb refuses root: run the server as the postgres user
        import pwd

        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(base)
            pytest.skip("running as root and there is no `postgres` user to run the server as")
        os.chown(base, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = base / "data", free_port()

    def run(*cmd):
        return subprocess.run([*as_user, *cmd], check=False, capture_output=True, text=True, timeout=120)

    r = run(initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--locale=C")
    assert r.returncode == 0, r.stderr
    opts = f"-p {port} -k {base} -c listen_addresses='' -c fsync=off"
    r = run(pg_ctl, "-D", str(data), "-o", opts, "-l", str(base / "log"), "-w", "-t", "60", "start")
    assert r.returncode == 0, r.stderr + (base / "log").read_text()
    try:
        yield f"postgresql+psycopg://postgres@/postgres?host={base}&port={port}"
    finally:
        run(pg_ctl, "-D", str(data), "-m", "immediate", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def pg_awkward(pg_url):
    import sqlalchemy as sa

    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        for statement in statements("postgres"):
            conn.exec_driver_sql(statement)
        conn.exec_driver_sql("INSERT INTO \"Clients\" (id, \"Name\") VALUES (1, 'Ada'), (2, 'Bo')")
    yield engine
    engine.dispose()


def test_postgres_gives_the_same_model(pg_awkward, tmp_path):
    schema = introspect(pg_awkward)
    assert schema.dialect == "postgres"
    assert model(schema, keys=False) == expected_model()
    assert [t.primary_key for t in schema.tables] == [("id",)] * 3
    sqlite = introspect(make_awkward("sqlite", tmp_path))
    assert model(schema) == model(sqlite)
    duck = introspect(make_awkward("duckdb", tmp_path))
    assert model(schema, keys=False) == model(duck, keys=False)


def test_postgres_grammar_queries_plan(pg_awkward, sql_backend):
    """Typed, strictly grouped PostgreSQL: token walks and sampled sentences all plan."""
    schema = introspect(pg_awkward)
    grammar = sql_grammar(schema)
    compiled = sql_backend.compile(grammar.spec())
    rng = random.Random(9)
    queries = token_walks(sql_backend, compiled, seed=4, n=60) + [sample(grammar, rng) for _ in range(300)]
    for q in queries:
        result = validate(q, schema, engine=pg_awkward)
        assert result.ok and result.checked_database, (result, q)


def test_postgres_execution_is_read_only_with_a_timeout(pg_url, pg_awkward):
    engine = open_database(pg_url.replace("postgresql+psycopg", "postgresql"))
    schema = introspect(engine)
    res = execute('SELECT "Name" FROM "Clients" ORDER BY id', engine, schema, max_rows=1)
    assert res.rows == [("Ada",)] and res.truncated
    with pytest.raises(QueryTimeoutError):
        execute(ENDLESS, engine, schema, timeout_s=0.5)
    from agentrt.sql.validate import _run

    with pytest.raises(QueryError, match="read-only"):
        _run(engine, 'DELETE FROM "Clients"', timeout_s=5, max_rows=0)
    with engine.connect() as conn:
        import sqlalchemy as sa

        with pytest.raises(sa.exc.InternalError, match="read-only"):
            conn.exec_driver_sql('DELETE FROM "Clients"')
    assert execute('SELECT COUNT(*) FROM "Clients"', engine, schema).rows == [(2,)]
    engine.dispose()
    # a caller's own engine in autocommit mode: the guard opens its own READ ONLY transaction
    import sqlalchemy as sa

    autocommit = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with pytest.raises(QueryError, match="read-only"):
        _run(autocommit, 'DELETE FROM "Clients"', timeout_s=5, max_rows=0)
    with pytest.raises(QueryTimeoutError):
        execute(ENDLESS, autocommit, schema, timeout_s=0.5)
    assert execute('SELECT COUNT(*) FROM "Clients"', autocommit, schema).rows == [(2,)]
    autocommit.dispose()


@pytest.fixture(scope="module")
def pg_db(pg_url):
    """A second, empty database on the server (the awkward one's model stays as it is): its URL."""
    import sqlalchemy as sa

    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql("CREATE DATABASE second")
    admin.dispose()
    return pg_url.replace("/postgres?", "/second?")


def test_postgres_ddl_names_are_the_databases_own(pg_db):
    """Unquoted names in CREATE TABLE text fold to lower case as PostgreSQL folds them, so the
    grammar's names are the ones the database has (the check found `"Users"` generated for
    `CREATE TABLE Users`, which then failed on the database)."""
    import sqlalchemy as sa

    from agentrt.sql import schema_from_ddl

    ddl = (
        'CREATE TABLE Users (Id int PRIMARY KEY, Name text, "Mixed" int);\n'
        "CREATE TABLE Orders (Id int PRIMARY KEY, Uid int REFERENCES USERS (ID), Total numeric);"
    )
    engine = sa.create_engine(pg_db)
    with engine.begin() as conn:
        for statement in ddl.split(";\n"):
            conn.exec_driver_sql(statement)
    live = introspect(engine)
    parsed = schema_from_ddl(ddl, "postgres")
    assert model(parsed) == model(live)
    grammar = sql_grammar(parsed)
    rng = random.Random(3)
    for q in [sample(grammar, rng) for _ in range(100)]:
        result = validate(q, parsed, engine=engine)
        assert result.ok and result.checked_database, (result, q)
    engine.dispose()


def test_postgres_outage_is_no_verdict_on_the_query(pg_db):
    """A connection the server closes while the query runs (here: pg_terminate_backend) and a
    server that does not answer are stage "connection", never the database's verdict."""
    import threading
    import time

    import sqlalchemy as sa

    from agentrt.sql.validate import DatabaseConnectionError, _run

    engine = open_database(pg_db)
    admin = sa.create_engine(pg_db, isolation_level="AUTOCOMMIT")

    def terminate():
        time.sleep(1.0)
        with admin.connect() as conn:
            conn.exec_driver_sql(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE starts_with(query, 'SELECT pg_sleep') AND pid <> pg_backend_pid()"
            )

    killer = threading.Thread(target=terminate)
    killer.start()
    with pytest.raises(DatabaseConnectionError, match="lost the connection") as e:
        _run(engine, "SELECT pg_sleep(20)", timeout_s=30, max_rows=1)
    killer.join()
    assert e.value.stage == "connection"
    # the pool recovers: the next query gets a new connection
    assert _run(engine, "SELECT 1", timeout_s=5, max_rows=1).rows == [(1,)]
    engine.dispose()
    admin.dispose()
    schema = introspect(pg_db)
    down = open_database(pg_db.split("?")[0] + f"?host=127.0.0.1&port={free_port()}")
    result = validate("SELECT id FROM users", schema, engine=down)
    assert not result.ok and result.stage == "connection" and not result.checked_database, result
