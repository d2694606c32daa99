"""``trajstore sql "QUERY"``: read-only SQL against a store, printed as a table, CSV or JSON.

Read-only is enforced by the database, not by looking at the query text:

* **SQLite**: the file is opened with ``file:...?mode=ro`` (SQLite's pager
  refuses every write to it), ``PRAGMA query_only=ON`` is set, and an
  authorizer, which SQLite consults while compiling each statement, refuses
  the statements that would have effects outside the database file or on the
  connection: ATTACH (and ``VACUUM INTO``, which attaches), DETACH,
  transaction control, ``load_extension``, and every PRAGMA except a list
  of introspection ones (so ``PRAGMA query_only=OFF`` is refused).
* **PostgreSQL**: it refuses to run as a login holding more than the
  reader's rights (a superuser, the owner, a writer: a query could switch
  back to the login's own rights with ``set_config('role', 'none', false)``);
  ``trajstore init --reader-login NAME`` makes such a login. The query
  runs inside ``BEGIN ISOLATION LEVEL REPEATABLE
  READ READ ONLY`` after ``SET LOCAL ROLE trajstore_reader`` (made by
  migration 0002 with SELECT on the tables and views, nothing else) and
  after a first statement has taken the transaction's snapshot, so it can
  no longer be switched back to read-write. The query is sent as one
  prepared statement (extended protocol), so ``...; DELETE ...`` is refused
  by the server, and the transaction is always rolled back, never committed.

Either way a refused query raises TrajstoreError with the database's reason
in one line (``trajstore.log._errors.driver_errors`` in its ``"user_query"``
mode, the boundary that maps every driver error), and the store is left
exactly as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shlex
import sqlite3
import sys
import time
import urllib.request
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable, Iterator, TextIO

from sqlalchemy.engine import make_url

from trajstore.errors import StoreUnavailable, TrajstoreError
from trajstore.inspect.views import READER_ROLE
from trajstore.log._errors import driver_errors

__all__ = ["QueryResult", "read_only", "run_query", "print_result", "with_iso_times", "create_reader_login",
           "add_cli_arguments", "run_from_args"]

FORMATS = ("table", "csv", "json")
MAX_TABLE_ROWS = 1000  # a rich table of a million rows helps nobody; csv/json print everything


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[tuple[Any, ...]]

    def dicts(self) -> list[dict[str, Any]]:
        return [dict(zip(self.columns, row)) for row in self.rows]


Query = Callable[[str], QueryResult]


@contextlib.contextmanager
def read_only(url: str | None, *, timeout_s: float | None = None) -> Iterator[Query]:
    """Yield ``query(sql) -> QueryResult`` on a read-only connection to the store.

    All queries see one snapshot. The schema is brought up to date first
    (as every command does), so the views exist on a store made by an
    older trajstore."""
    from trajstore.log import _sqlite
    from trajstore.store import dialect_of, resolve_url

    url = resolve_url(url)
    dialect = dialect_of(url)
    _upgrade(url, dialect)
    opener = _sqlite_reader if dialect is _sqlite else _postgres_reader
    with opener(url, timeout_s) as query:
        yield query


def run_query(url: str | None, sql: str, *, timeout_s: float | None = None) -> QueryResult:
    with read_only(url, timeout_s=timeout_s) as query:
        return query(sql)


def _upgrade(url: str, dialect: Any) -> None:
    if make_url(url).get_backend_name() == "sqlite":
        path = make_url(url).database
        if not path or path == ":memory:" or not os.path.exists(path):
            raise StoreUnavailable(f"no store at {path} (trajstore init, ingest or demo makes one)")
    write_engine, read_engine = dialect.make_engines(url)
    try:
        # unreachable, or a reader login that cannot migrate
        with driver_errors("cannot open store", mode="opening"):
            if not _has_schema(read_engine):
                raise StoreUnavailable(f"no store at {make_url(url).render_as_string(hide_password=True)} "
                                       "(trajstore init, ingest or demo makes one)")
            if not _at_head(read_engine):
                from trajstore._migrate import upgrade

                upgrade(write_engine)
    finally:
        write_engine.dispose()
        read_engine.dispose()


def _has_schema(engine: Any) -> bool:
    from sqlalchemy import inspect as sa_inspect

    with engine.connect() as conn:
        return sa_inspect(conn).has_table("alembic_version")


def _at_head(engine: Any) -> bool:
    """Checked on a plain read connection: on SQLite the write engine's
    BEGIN IMMEDIATE would wait behind a busy writer for nothing."""
    from alembic.runtime.migration import MigrationContext

    from trajstore._migrate import head_revision

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision() == head_revision()


# -- SQLite ------------------------------------------------------------------

# PRAGMAs that only report. Anything else (query_only=OFF, journal_mode=...,
# user_version=5, wal_checkpoint, optimize) is refused by the authorizer.
_SQLITE_PRAGMAS_ON_TABLE = frozenset({
    "table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo", "foreign_key_list",
})
_SQLITE_PRAGMAS_QUERY = frozenset({
    "database_list", "collation_list", "function_list", "pragma_list", "compile_options", "user_version",
    "schema_version", "page_count", "page_size", "freelist_count", "journal_mode", "query_only", "encoding",
})
_SQLITE_DENIED = {
    sqlite3.SQLITE_ATTACH: "ATTACH",
    sqlite3.SQLITE_DETACH: "DETACH",
    sqlite3.SQLITE_TRANSACTION: "transaction control",
    sqlite3.SQLITE_SAVEPOINT: "SAVEPOINT",
}


def _sqlite_authorizer(action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None) -> int:
    if action in _SQLITE_DENIED:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_PRAGMA:
        name = (arg1 or "").lower()
        reads = name in _SQLITE_PRAGMAS_ON_TABLE or (name in _SQLITE_PRAGMAS_QUERY and arg2 is None)
        if not reads:
            return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() == "load_extension":
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


@contextlib.contextmanager
def _sqlite_reader(url: str, timeout_s: float | None) -> Iterator[Query]:
    path = os.path.abspath(make_url(url).database)
    uri = f"file:{urllib.request.pathname2url(path)}?mode=ro"
    with driver_errors(f"cannot open {path} read-only", mode="opening"):
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=60.0)
    try:
        conn.execute("PRAGMA query_only=ON")
        conn.execute("BEGIN")  # one snapshot for every query (WAL)
        conn.set_authorizer(_sqlite_authorizer)
        yield lambda sql: _sqlite_execute(conn, sql, timeout_s)
    finally:
        conn.set_authorizer(None)
        conn.close()


def _sqlite_execute(conn: sqlite3.Connection, sql: str, timeout_s: float | None) -> QueryResult:
    if timeout_s:
        deadline = time.monotonic() + timeout_s
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    try:
        with driver_errors("SQL error", mode="user_query", timeout_s=timeout_s):
            cur = conn.execute(sql)
            columns = [d[0] for d in cur.description or ()]
            rows = cur.fetchall()
    finally:
        conn.set_progress_handler(None, 0)
    return QueryResult(columns, rows)


# -- PostgreSQL ----------------------------------------------------------------

@contextlib.contextmanager
def _postgres_reader(url: str, timeout_s: float | None) -> Iterator[Query]:
    import psycopg
    from sqlalchemy import create_engine
    from sqlalchemy.pool import NullPool

    from trajstore.log.postgres import engine_options

    # The store's timeouts (connect_timeout, statement_timeout; --timeout-s
    # overrides the latter). NullPool: the connection is closed afterwards,
    # never reused with our role.
    url, connect_args = engine_options(url)
    engine = create_engine(url, poolclass=NullPool, connect_args=connect_args)
    with driver_errors("cannot open store", mode="opening"):
        fairy = engine.raw_connection()
    conn: psycopg.Connection = fairy.driver_connection
    try:
        conn.rollback()
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        _enter_reader_role(conn, timeout_s)
        yield lambda sql: _postgres_execute(conn, sql)
    finally:
        with contextlib.suppress(Exception):
            conn.rollback()
        fairy.invalidate()  # closes it: the session's role and settings die with it
        engine.dispose()


# Rights a login must not hold to run inspection queries: with any of them a
# query could leave the read-only role (set_config('role', 'none', false)
# returns to the login) and act as the login itself.
_LOGIN_RIGHTS_SQL = """
SELECT r.rolsuper,
       r.rolcreaterole OR r.rolcreatedb OR r.rolbypassrls OR r.rolreplication AS admin,
       c.oid IS NOT NULL AND pg_has_role(session_user, c.relowner, 'MEMBER') AS owner,
       c.oid IS NOT NULL AND (has_table_privilege(session_user, c.oid, 'INSERT')
           OR has_table_privilege(session_user, c.oid, 'UPDATE')
           OR has_table_privilege(session_user, c.oid, 'DELETE')
           OR has_table_privilege(session_user, c.oid, 'TRUNCATE')) AS writer,
       (SELECT string_agg(p.rolname, ', ' ORDER BY p.rolname) FROM pg_roles p
         WHERE p.rolname IN ('pg_signal_backend', 'pg_read_server_files', 'pg_write_server_files',
                             'pg_execute_server_program', 'pg_write_all_data', 'pg_monitor',
                             'pg_checkpoint', 'pg_database_owner')
           AND pg_has_role(session_user, p.oid, 'MEMBER')) AS powers
FROM pg_roles r LEFT JOIN pg_class c ON c.oid = to_regclass('events')
WHERE r.rolname = session_user
"""


def _check_login(conn: Any) -> None:
    """Refuse a login that holds more than the reader's rights (superuser, owner, writer)."""
    with conn.cursor() as cur:
        cur.execute(_LOGIN_RIGHTS_SQL)
        row = cur.fetchone()
        cur.execute("SELECT session_user")
        (login,) = cur.fetchone()
    if row is None:
        return
    superuser, admin, owner, writer, powers = row
    why = ("a superuser" if superuser else "the store's owner (or a member of it)" if owner
           else "allowed to write the store" if writer else "allowed to create roles or databases" if admin
           else f"a member of {powers}" if powers else None)
    if why:
        raise TrajstoreError(
            f"trajstore sql will not run as {login!r}, {why}: connect as a login that holds only "
            f"the {READER_ROLE} role (trajstore init --reader-login NAME; see 'Read-only access' in docs/sql.md)")


def _enter_reader_role(conn: Any, timeout_s: float | None) -> None:
    with driver_errors(f"cannot switch to the read-only role {READER_ROLE} ({{reason}}); "
                       "see 'Read-only access' in docs/sql.md", mode="user_query"):
        _check_login(conn)
        with conn.cursor() as cur:
            cur.execute(f"SET LOCAL ROLE {READER_ROLE}")
    with conn.cursor() as cur:
        if timeout_s:
            cur.execute(f"SET LOCAL statement_timeout = {int(timeout_s * 1000)}")
        # Takes the snapshot: from here the transaction cannot become read-write.
        cur.execute("SELECT 1")


def create_reader_login(store: Any, login: str, password: str | None = None) -> str:
    """Make ``login`` a PostgreSQL LOGIN role holding only ``trajstore_reader``; return a line saying so.

    The password is ``password``, else ``$TRAJSTORE_READER_PASSWORD``, else
    none (then only trust/peer/certificate authentication can log it in).
    Needs CREATEROLE (or a superuser) on the store URL's login."""
    import re

    from sqlalchemy import text

    if store.log.write_engine.dialect.name != "postgresql":
        raise TrajstoreError("--reader-login is for PostgreSQL stores (SQLite stores are opened read-only)")
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", login):
        raise TrajstoreError(f"reader login {login!r}: use lowercase letters, digits and _ (at most 63)")
    password = password if password is not None else os.environ.get("TRAJSTORE_READER_PASSWORD")
    with driver_errors(f"cannot make reader login {login!r}", mode="opening"):
        with store.log.write_engine.begin() as conn:
            exists = conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :n"), {"n": login}).first()
            attrs = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS INHERIT"
            conn.exec_driver_sql(f"{'ALTER' if exists else 'CREATE'} ROLE {login} {attrs}")
            if password:
                quoted = conn.exec_driver_sql("SELECT quote_literal(%(p)s)", {"p": password}).scalar()
                conn.exec_driver_sql(f"ALTER ROLE {login} PASSWORD {quoted}")
            conn.exec_driver_sql(f"GRANT {READER_ROLE} TO {login}")
            conn.exec_driver_sql(f"ALTER ROLE {login} SET default_transaction_read_only = on")
    # The URL carries no password (a masked one would be sent as the password itself): libpq
    # takes it from $PGPASSWORD, set here from the variable it was read from, so the line
    # works as pasted into the shell that ran init and never prints the secret.
    url = shlex.quote(make_url(store.url).set(username=login, password=None).render_as_string(hide_password=False))
    query = shlex.quote("SELECT count(*) FROM samples")
    if not password:
        return (f"reader login {login!r} ready (only {READER_ROLE}'s rights; no password set: it logs in "
                f"only where the server trusts it): trajstore --store {url} sql {query}")
    source = ("PGPASSWORD=\"$TRAJSTORE_READER_PASSWORD\" " if "TRAJSTORE_READER_PASSWORD" in os.environ
              and os.environ["TRAJSTORE_READER_PASSWORD"] == password else "PGPASSWORD=<its password> ")
    return (f"reader login {login!r} ready (only {READER_ROLE}'s rights; the password is not printed, "
            f"pass it in $PGPASSWORD): {source}trajstore --store {url} sql {query}")


def _postgres_execute(conn: Any, sql: str) -> QueryResult:
    with driver_errors("SQL error", mode="user_query"), conn.cursor() as cur:
        # Again before every query: an earlier one may have run set_config('role', ...).
        cur.execute(f"SET LOCAL ROLE {READER_ROLE}")
        # prepare=True: one Parse message, so the server refuses a second statement.
        cur.execute(sql, prepare=True)
        columns = [d.name for d in cur.description or ()]
        rows = cur.fetchall() if cur.description else []
    return QueryResult(columns, rows)


# -- printing ----------------------------------------------------------------

def _plain(value: Any) -> Any:
    """A value JSON and CSV can carry."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, (str, int, float, bool, list, dict)) or value is None:
        return value
    return str(value)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.1f}" if value.is_integer() and abs(value) < 1e15 else f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(_plain(value))


def _is_time_column(name: str) -> bool:
    return name.endswith("_at") or name in ("created_at", "updated_at", "time", "timestamp")


def with_iso_times(result: QueryResult) -> QueryResult:
    """Columns named ``*_at`` hold Unix seconds; show them as ISO 8601 UTC times."""
    import datetime as dt

    cols = [i for i, c in enumerate(result.columns) if _is_time_column(c)]
    if not cols:
        return result

    def iso(v: Any) -> Any:
        if isinstance(v, (int, float, Decimal)) and not isinstance(v, bool):
            try:
                return dt.datetime.fromtimestamp(float(v), dt.timezone.utc).isoformat(timespec="milliseconds")
            except (OverflowError, OSError, ValueError):
                return v
        return v

    rows = [tuple(iso(v) if i in cols else v for i, v in enumerate(row)) for row in result.rows]
    return QueryResult(result.columns, rows)


def print_result(result: QueryResult, fmt: str = "table", out: TextIO | None = None, *,
                 iso_times: bool = True) -> None:
    """``result`` in ``fmt``; time columns (``*_at``) as ISO 8601 UTC unless ``iso_times=False``
    (then the unix seconds the views hold)."""
    out = out or sys.stdout
    if iso_times:
        result = with_iso_times(result)
    if fmt == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(result.columns)
        writer.writerows([[("" if v is None else _plain(v)) for v in row] for row in result.rows])
    elif fmt == "json":
        out.write(json.dumps([{k: _plain(v) for k, v in d.items()} for d in result.dicts()], indent=2) + "\n")
    elif fmt == "table":
        _print_table(result, out)
    else:
        raise ValueError(f"unknown format {fmt!r}; formats: {', '.join(FORMATS)}")


def _print_table(result: QueryResult, out: TextIO) -> None:
    from rich.console import Console
    from rich.table import Table

    shown = result.rows[:MAX_TABLE_ROWS]
    cells = [[_cell(v) for v in row] for row in shown]
    table = Table(*result.columns, show_edge=False, header_style="bold")
    for row in cells:
        table.add_row(*row)
    # Off a terminal, size the table to its content instead of wrapping at 80 columns.
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(result.columns)]
    natural = sum(widths) + 3 * len(widths) + 1
    is_tty = getattr(out, "isatty", lambda: False)()
    console = Console(file=out, width=None if is_tty else max(natural, 40), highlight=False)
    console.print(table)
    if len(result.rows) > len(shown):
        console.print(f"({len(result.rows) - len(shown)} more rows not shown; add LIMIT or use --format csv)")
    console.print(f"({len(result.rows)} row{'s' if len(result.rows) != 1 else ''})")


# -- CLI ---------------------------------------------------------------------

def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    from trajstore._argtypes import number

    parser.add_argument("query", help="one SQL statement, e.g. \"SELECT * FROM trajectory_summary LIMIT 5\" "
                                      "(views: see docs/sql.md)")
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    parser.add_argument("--timeout-s", type=number(float, min=0, min_exclusive=True), default=None,
                        help="cancel the query after this many seconds")
    parser.add_argument("--unix-times", action="store_true",
                        help="print time columns (*_at) as the unix seconds the views hold "
                             "(default: ISO 8601 UTC, e.g. 2026-01-02T03:04:05.678+00:00)")


def run_from_args(args: argparse.Namespace) -> int:
    result = run_query(args.store, args.query, timeout_s=args.timeout_s)
    print_result(result, args.format, iso_times=not getattr(args, "unix_times", False))
    return 0
