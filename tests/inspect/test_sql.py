"""``trajstore sql``: read-only enforced by the database on both backends.

Every write attempt fails with one line on stderr and leaves the store
exactly as it was (every row of every table, the schema, sequences, large
objects, files beside the store). Reads print as a table, CSV or JSON.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import uuid
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

import trajstore
from trajstore.cli import main
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.inspect.sql import read_only, run_query
from trajstore.inspect.views import READER_ROLE
from tests.helpers import reader_url_for

CFG = RolloutConfig(turns=3, prompt_tokens=6, output_tokens=5, observation_tokens=3, layers=2, topk=1,
                    num_experts=8, mismatch_prob=0.3, abort_prob=0.3, seed=3)
TABLES = ("log_head", "trajectories", "events", "segments", "samples", "materializer_checkpoints", "alembic_version")


def filled_store(url: str, payload: str) -> trajstore.Store:
    s = trajstore.connect(url, payload=payload)
    for i in range(6):
        s.append(trajectory_events(CFG, i, version=i // 2))
    s.materialize()
    if s.log.write_engine.dialect.name == "postgresql":
        with s.log.write_engine.begin() as conn:
            conn.execute(text("CREATE SEQUENCE test_seq"))
            # Readable by the reader, so nextval is refused by the read-only
            # transaction itself, not only for lack of privilege.
            conn.execute(text(f"GRANT SELECT, USAGE ON SEQUENCE test_seq TO {READER_ROLE}"))
    return s


@pytest.fixture
def store(store_url, tmp_path):
    s = filled_store(store_url, str(tmp_path / "payload"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def refusing_store(module_store_url, tmp_path_factory):
    """``store`` and its directory (the SQLite file's, the payload's) for the tests of writes
    that are refused and change nothing: built once per module and backend."""
    database = make_url(module_store_url).database
    directory = Path(database).parent if module_store_url.startswith("sqlite") else tmp_path_factory.mktemp("sql")
    s = filled_store(module_store_url, str(directory / "payload"))
    yield s, directory
    s.close()


def fingerprint(store, tmp_path) -> dict:
    """Everything a write through ``trajstore sql`` could change."""
    out = {}
    with store.log.read_engine.connect() as conn:
        for table in TABLES:
            rows = conn.execute(text(f"SELECT * FROM {table} ORDER BY 1")).all()
            out[table] = (len(rows), hashlib.sha256(repr(rows).encode()).hexdigest())
        if conn.dialect.name == "sqlite":
            out["schema"] = conn.execute(text("SELECT type, name, sql FROM sqlite_master ORDER BY name")).all()
            out["user_version"] = conn.execute(text("PRAGMA user_version")).scalar()
        else:
            out["schema"] = conn.execute(text(
                "SELECT table_name, table_type FROM information_schema.tables "
                "WHERE table_schema = current_schema() ORDER BY 1")).all()
            out["views"] = conn.execute(text(
                "SELECT viewname, definition FROM pg_views WHERE schemaname = current_schema() ORDER BY 1")).all()
            out["seq"] = conn.execute(text("SELECT last_value, is_called FROM test_seq")).one()
            out["large_objects"] = conn.execute(text("SELECT count(*) FROM pg_largeobject_metadata")).scalar()
    # SQLite makes and removes -wal/-shm as connections come and go.
    out["files"] = sorted(n for n in os.listdir(tmp_path) if not n.endswith(("-wal", "-shm")))
    return out


def sql(store, *argv: str) -> list[str]:
    return ["--store", reader_url_for(store.url), "sql", *argv]


def run_cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


WRITES_BOTH = [
    "INSERT INTO log_head (id, position) VALUES (2, 0)",
    "UPDATE trajectories SET status = 'failed'",
    "DELETE FROM events",
    "DELETE FROM samples WHERE sample_index = 0",
    "DROP VIEW trajectory_summary",
    "DROP TABLE samples",
    "CREATE TABLE scratch (a INTEGER)",
    "ALTER TABLE events ADD COLUMN scratch INTEGER",
    "CREATE INDEX ix_scratch ON events (created_at)",
    "SELECT * FROM log_head FOR UPDATE",
    "SELECT 1; DELETE FROM events",
    "WITH gone AS (DELETE FROM events RETURNING position) SELECT count(*) FROM gone",
    "INSERT INTO segments SELECT name || 'x', kind, num_rows, num_bytes, created_at FROM segments",
]
WRITES_SQLITE = [
    "PRAGMA query_only = OFF",
    "PRAGMA user_version = 7",
    "PRAGMA journal_mode = DELETE",
    "ATTACH DATABASE '{tmp}/attached.db' AS extra",
    "VACUUM INTO '{tmp}/copy.db'",
    "VACUUM",
    "REINDEX",
    "BEGIN IMMEDIATE",
    "SELECT load_extension('/nonexistent')",
]
WRITES_POSTGRES = [
    "TRUNCATE events",
    "SELECT nextval('test_seq')",
    "SELECT setval('test_seq', 42)",
    "SELECT set_config('transaction_read_only', 'off', false)",
    "SET TRANSACTION READ WRITE",
    "SELECT pg_read_file('/etc/hostname')",
    "COPY events TO PROGRAM 'touch {tmp}/pwned'",
    "LOCK TABLE events IN ACCESS EXCLUSIVE MODE",
    "GRANT INSERT ON events TO PUBLIC",
    "CREATE TEMP TABLE scratch (a INTEGER)",
    "REFRESH MATERIALIZED VIEW trajectory_summary",
]


WRITES = ([pytest.param("both", q, id=q) for q in WRITES_BOTH]
          + [pytest.param("sqlite", q, id=q) for q in WRITES_SQLITE]
          + [pytest.param("postgresql", q, id=q) for q in WRITES_POSTGRES])


@pytest.mark.parametrize("backend, query", WRITES)
def test_writes_are_refused_and_change_nothing(refusing_store, capsys, backend, query):
    store, tmp_path = refusing_store  # the module's store (a refused write changes nothing) and its directory
    if backend not in ("both", store.log.write_engine.dialect.name):
        pytest.skip(f"a {backend} statement")
    query = query.format(tmp=tmp_path)
    before = fingerprint(store, tmp_path)
    rc, out, err = run_cli(capsys, sql(store, query))
    assert rc == 1, f"{query!r} was not refused: {out}"
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert fingerprint(store, tmp_path) == before, f"{query!r} changed the store"


def test_postgres_side_effects_a_read_only_transaction_allows_do_not_last(store, tmp_path, capsys):
    """lo_create and advisory locks are not refused by a read-only transaction;
    the rollback and the closed session undo them."""
    if store.log.write_engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL functions")
    before = fingerprint(store, tmp_path)
    for query in ("SELECT lo_create(0)", "SELECT pg_advisory_lock(4242)", "NOTIFY trajstore_test"):
        rc, _, err = run_cli(capsys, sql(store, query))
        assert rc == 0, err
    assert fingerprint(store, tmp_path) == before
    with store.log.read_engine.connect() as conn:
        held = conn.execute(text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242"))
        assert held.scalar() == 0


def test_the_refusal_names_the_database_reason(store, capsys):
    rc, _, err = run_cli(capsys, sql(store, "DELETE FROM events"))
    assert rc == 1
    reason = ("attempt to write a readonly database" if store.log.write_engine.dialect.name == "sqlite"
              else "cannot execute DELETE in a read-only transaction")
    assert err == f"error: SQL error: {reason}\n"


@pytest.mark.parametrize("query, fragment", [
    ("SELEC 1", "syntax error"),
    ("SELECT * FROM no_such_view", "no_such_view"),
    ("SELECT no_such_column FROM trajectory_summary", "no_such_column"),
    ("SELECT 1 FROM trajectory_summary WHERE AND", "syntax error"),
])
def test_sql_errors_are_one_line(store, capsys, query, fragment):
    rc, out, err = run_cli(capsys, sql(store, query))
    assert rc == 1 and out == ""
    assert err.startswith("error: SQL error: ") and err.count("\n") == 1, err
    assert fragment in err


def test_postgres_cannot_escape_the_reader_role_between_queries(store):
    if store.log.write_engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL roles")
    with read_only(reader_url_for(store.url)) as query:
        assert query("SELECT current_user").rows == [(READER_ROLE,)]
        query("SELECT set_config('role', session_user, false)")
        assert query("SELECT current_user").rows == [(READER_ROLE,)]
        assert query("SHOW transaction_read_only").rows == [("on",)]


def test_table_csv_and_json_show_the_same_rows(store, capsys):
    q = "SELECT trajectory_id, status, num_generations, reward FROM trajectory_summary ORDER BY trajectory_id"
    want = run_query(reader_url_for(store.url), q)
    assert len(want.rows) == 6
    rc, out, _ = run_cli(capsys, sql(store, "--format", "csv", q))
    assert rc == 0
    parsed = list(csv.reader(io.StringIO(out)))
    assert parsed[0] == want.columns
    assert [r[0] for r in parsed[1:]] == [r[0] for r in want.rows]
    assert [int(r[2]) for r in parsed[1:]] == [r[2] for r in want.rows]
    rc, out, _ = run_cli(capsys, sql(store, "--format", "json", q))
    assert json.loads(out) == [dict(zip(want.columns, r)) for r in want.rows]
    rc, out, _ = run_cli(capsys, sql(store, q))
    lines = out.splitlines()
    assert all(c in lines[0] for c in want.columns)
    assert sum(r[0] in out for r in want.rows) == 6 and lines[-1] == "(6 rows)"


def test_all_views_are_readable(store):
    for view in ("generation_events", "trajectory_summary", "sample_summary", "model_version_stats"):
        assert run_query(reader_url_for(store.url), f"SELECT count(*) FROM {view}").rows[0][0] > 0


def test_timeout_cancels_a_long_query(store, capsys):
    slow = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 1000000000) "
            "SELECT count(*) FROM c"
            if store.log.write_engine.dialect.name == "sqlite" else "SELECT pg_sleep(5)")
    rc, _, err = run_cli(capsys, sql(store, "--timeout-s", "0.2", slow))
    assert rc == 1 and err.count("\n") == 1
    assert "timeout" in err


def test_a_missing_sqlite_store_is_not_created(tmp_path, capsys):
    path = tmp_path / "nothing.db"
    rc, _, err = run_cli(capsys, ["--store", f"sqlite:///{path}", "sql", "SELECT 1"])
    assert rc == 1 and "no store at" in err
    assert not path.exists()


# -- PostgreSQL: a store owned by an ordinary user --------------------------------------

@pytest.fixture
def owned_store(pg_cluster, tmp_path):
    """A database owned by a LOGIN role without CREATEROLE, as in production."""
    owner, db = f"owner_{uuid.uuid4().hex[:8]}", f"t_{uuid.uuid4().hex[:12]}"
    admin = psycopg.connect(make_url(pg_cluster.url()).set(drivername="postgresql").render_as_string(False),
                            autocommit=True)
    admin.execute(f"CREATE ROLE {owner} LOGIN")
    admin.execute(f"CREATE DATABASE {db} OWNER {owner}")
    url = make_url(pg_cluster.url(db)).set(username=owner).render_as_string(False)
    store = trajstore.connect(url, payload=str(tmp_path / "payload"))
    store.append(trajectory_events(CFG, 0))
    yield store, admin, owner, url
    store.close()
    pg_cluster.drop_database(db)
    admin.execute(f"DROP ROLE {owner}")
    admin.close()


def test_postgres_owner_is_refused_and_told_what_to_do(owned_store, capsys):
    """The owner's login could leave the reader role inside a query
    (set_config('role', 'none', false)); trajstore sql refuses it in one line.
    What docs/sql.md tells an administrator to do then works."""
    store, admin, owner, url = owned_store
    rc, _, err = run_cli(capsys, ["--store", url, "sql", "SELECT count(*) FROM events"])
    assert rc == 1 and err.count("\n") == 1
    assert f"will not run as '{owner}'" in err and "owner" in err and "docs/sql.md" in err
    # docs/sql.md: an administrator makes the reader role (the owner lacks CREATEROLE) ...
    admin.execute(f"DO $$ BEGIN CREATE ROLE {READER_ROLE} NOLOGIN; "
                  "EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    with psycopg.connect(make_url(url).set(drivername="postgresql", username="postgres")
                         .render_as_string(False), autocommit=True) as in_db:
        in_db.execute(f"GRANT USAGE ON SCHEMA public TO {READER_ROLE}")
        in_db.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {READER_ROLE}")
    # ... and a reader login with trajstore init --reader-login.
    analyst = f"analyst_{uuid.uuid4().hex[:8]}"
    su_url = make_url(url).set(username="postgres").render_as_string(False)
    rc, out, err = run_cli(capsys, ["--store", su_url, "init", "--reader-login", analyst])
    assert rc == 0, err
    assert f"reader login '{analyst}' ready" in out
    reader = make_url(url).set(username=analyst).render_as_string(False)
    try:
        rc, out, err = run_cli(capsys, ["--store", reader, "sql", "--format", "csv", "SELECT count(*) FROM events"])
        assert (rc, err) == (0, ""), err
        assert out.splitlines()[1] == str(len(trajectory_events(CFG, 0)))
        rc, _, err = run_cli(capsys, ["--store", reader, "sql", "DELETE FROM events"])
        assert rc == 1 and "read-only transaction" in err
    finally:
        admin.execute(f"DROP ROLE {analyst}")


ESCAPE_READ_FILE = ("SELECT set_config('role','none',false), "
                    "query_to_xml('SELECT pg_read_file(''/etc/passwd'') AS f', true, false, '')")


@pytest.mark.postgres
def test_postgres_superuser_login_is_refused(store, capsys):
    """The reader-role escape printed /etc/passwd under a superuser login."""
    if store.log.write_engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL roles")
    rc, out, err = run_cli(capsys, ["--store", store.url, "sql", ESCAPE_READ_FILE])
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert "will not run as 'postgres', a superuser" in err and "root:" not in err


def test_postgres_reader_login_cannot_escape(store, capsys):
    """Under a reader login, leaving the role lands on the login, which holds no more."""
    if store.log.write_engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL roles")
    rc, out, err = run_cli(capsys, sql(store, ESCAPE_READ_FILE))
    assert rc == 1 and "root:" not in out + err and err.count("\n") == 1
    assert "permission denied" in err
    # pg_terminate_backend inside query_to_xml, aimed at the owner's other sessions
    with store.log.write_engine.connect() as other:
        pid = other.execute(text("SELECT pg_backend_pid()")).scalar()
        kill = ("SELECT set_config('role','none',false), query_to_xml("
                f"'SELECT pg_terminate_backend({pid}) AS k', true, false, '')")
        rc, out, err = run_cli(capsys, sql(store, kill))
        assert rc == 1 and err.count("\n") == 1 and ("permission denied" in err or "must be" in err), (out, err)
        assert other.execute(text("SELECT 1")).scalar() == 1  # the owner's session lives
    # A login that can write the store is refused before any query runs.
    writer = f"writer_{uuid.uuid4().hex[:8]}"
    with store.log.write_engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {writer} LOGIN IN ROLE {READER_ROLE}"))
        conn.execute(text(f"GRANT INSERT ON events TO {writer}"))
    try:
        url = make_url(store.url).set(username=writer).render_as_string(False)
        rc, _, err = run_cli(capsys, ["--store", url, "sql", "SELECT 1"])
        assert rc == 1 and "allowed to write the store" in err
    finally:
        with store.log.write_engine.begin() as conn:
            conn.execute(text(f"REVOKE ALL ON events FROM {writer}"))
            conn.execute(text(f"DROP ROLE {writer}"))


SQLITE_ESCAPES = [
    "ATTACH DATABASE '{tmp}/other.db' AS o",
    "SELECT load_extension('libsqlite3ext')",
    "PRAGMA writable_schema = ON",
    "PRAGMA query_only = 0",
    "PRAGMA main.journal_mode = DELETE",
    "PRAGMA wal_checkpoint(TRUNCATE)",
]


@pytest.mark.parametrize("query", SQLITE_ESCAPES)
def test_sqlite_escapes_are_refused(tmp_path, capsys, query):
    store = trajstore.connect(f"sqlite:///{tmp_path}/s.db", payload=str(tmp_path / "payload"))
    store.append(trajectory_events(CFG, 0))
    before = fingerprint(store, tmp_path)
    rc, _, err = run_cli(capsys, ["--store", store.url, "sql", query.format(tmp=tmp_path)])
    assert rc == 1 and err.count("\n") == 1, err
    assert fingerprint(store, tmp_path) == before
    assert not (tmp_path / "other.db").exists()
    store.close()


def test_postgres_analyst_login_in_the_reader_role_cannot_write(store, capsys):
    """docs/sql.md: hand out a LOGIN role IN ROLE trajstore_reader."""
    if store.log.write_engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL roles")
    analyst = f"analyst_{uuid.uuid4().hex[:8]}"
    with store.log.write_engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {analyst} LOGIN IN ROLE {READER_ROLE}"))
    url = make_url(store.url).set(username=analyst)
    try:
        rc, out, err = run_cli(capsys, ["--store", url.render_as_string(False), "sql", "--format", "csv",
                                        "SELECT count(*) FROM trajectory_summary"])
        assert (rc, err, out.splitlines()[1]) == (0, "", "6")
        with psycopg.connect(url.set(drivername="postgresql").render_as_string(False)) as direct:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                direct.execute("DELETE FROM events")
    finally:
        with store.log.write_engine.begin() as conn:
            conn.execute(text(f"DROP ROLE {analyst}"))


def test_postgres_queries_have_the_stores_timeouts(store):
    """``trajstore sql`` connects with the store's engine options: a server that
    hangs cannot hang it (statement_timeout by default, --timeout-s overrides)."""
    if store.log.write_engine.dialect.name != "postgresql":
        pytest.skip("PostgreSQL settings")
    url = reader_url_for(store.url)
    assert run_query(url, "SHOW statement_timeout").rows == [("2min",)]
    assert run_query(url, "SHOW statement_timeout", timeout_s=5).rows == [("5s",)]
    given = f"{url}{'&' if '?' in url else '?'}statement_timeout=7s"
    assert run_query(given, "SHOW statement_timeout").rows == [("7s",)]
