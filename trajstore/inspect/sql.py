"""``trajstore sql "QUERY"``: read-only SQL against a store, printed as a table, CSV or JSON.

Read-only is enforced by the database, not by looking at the query text: the
store's backend opens the connection (``read_only`` of ``trajstore.log._sqlite.SQLite``
and ``trajstore.log.postgres.PostgreSQL``, whose module docstrings say how).
In short, SQLite opens the file read-only with ``query_only`` on and an
authorizer refusing ATTACH, transaction control, ``load_extension`` and
non-introspection PRAGMAs; PostgreSQL refuses a login holding more than the
reader's rights, runs every query as one prepared statement under ``SET LOCAL
ROLE trajstore_reader`` in a READ ONLY REPEATABLE READ transaction, and rolls
it back. ``trajstore init --reader-login NAME`` (``create_reader_login``) makes
such a login where the backend has them (``reader_logins``).

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
import sys
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Callable, Iterator, TextIO

from sqlalchemy.engine import make_url

from trajstore._util.config import add_flags, config_from_args, option
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
    from trajstore.log._registry import backend_of
    from trajstore.store import resolve_url

    url = resolve_url(url)
    backend = backend_of(url)
    _upgrade(url, backend)
    with backend.read_only(url, timeout_s, READER_ROLE) as query:
        yield lambda sql: QueryResult(*query(sql))


def run_query(url: str | None, sql: str, *, timeout_s: float | None = None) -> QueryResult:
    with read_only(url, timeout_s=timeout_s) as query:
        return query(sql)


def _upgrade(url: str, backend: Any) -> None:
    backend.require_database(url)
    write_engine, read_engine = backend.make_engines(url)
    try:
        # unreachable, or a reader login that cannot migrate
        with driver_errors("cannot open store", mode="opening"):
            if not _has_schema(read_engine):
                raise StoreUnavailable(f"no store at {make_url(url).render_as_string(hide_password=True)} "
                                       "(trajstore init, ingest or demo makes one)")
            if not _at_head(read_engine):
                from trajstore.log._migrate import upgrade

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

    from trajstore.log._migrate import head_revision

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision() == head_revision()


# -- PostgreSQL reader logins --------------------------------------------------

def _reader_url(store_url: str, login: str) -> Any:
    """The store URL as ``login`` connects: over TCP to 127.0.0.1 when the store's URL goes through
    a local socket (no host, or a socket directory), where the usual ``peer`` authentication takes
    only the OS user's own name and would refuse the reader login; on TCP its password applies."""
    url = make_url(store_url).set(username=login, password=None)
    socket_host = url.query.get("host")
    if isinstance(socket_host, tuple):
        socket_host = socket_host[0] if socket_host else None
    if url.host is None and (socket_host is None or str(socket_host).startswith("/")):
        port = url.port or url.query.get("port") or 5432
        url = url.difference_update_query(["host", "port"]).set(host="127.0.0.1", port=int(str(port)))
    return url


def create_reader_login(store: Any, login: str, password: str | None = None) -> str:
    """Make ``login`` a PostgreSQL LOGIN role holding only ``trajstore_reader``; return a line saying so.

    The password is ``password``, else ``$TRAJSTORE_READER_PASSWORD``, else
    none (then only trust/peer/certificate authentication can log it in).
    Needs CREATEROLE (or a superuser) on the store URL's login."""
    import re

    from trajstore.log._registry import backend_of

    if not backend_of(store.url).reader_logins:
        raise TrajstoreError("--reader-login is for PostgreSQL stores (SQLite stores are opened read-only)")
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", login):
        raise TrajstoreError(f"reader login {login!r}: use lowercase letters, digits and _ (at most 63)")
    password = password if password is not None else os.environ.get("TRAJSTORE_READER_PASSWORD")
    with driver_errors(f"cannot make reader login {login!r}", mode="opening"):
        backend_of(store.url).make_reader_login(store.log.write_engine, login, password, READER_ROLE)
    # The URL carries no password (a masked one would be sent as the password itself): libpq
    # takes it from $PGPASSWORD, set here from the variable it was read from, so the line
    # works as pasted into the shell that ran init and never prints the secret.
    url = shlex.quote(_reader_url(store.url, login).render_as_string(hide_password=False))
    query = shlex.quote("SELECT count(*) FROM samples")
    if not password:
        return (f"reader login {login!r} ready (only {READER_ROLE}'s rights; no password set: it logs in "
                f"only where the server trusts it): trajstore --store {url} sql {query}")
    source = ("PGPASSWORD=\"$TRAJSTORE_READER_PASSWORD\" " if "TRAJSTORE_READER_PASSWORD" in os.environ
              and os.environ["TRAJSTORE_READER_PASSWORD"] == password else "PGPASSWORD=<its password> ")
    return (f"reader login {login!r} ready (only {READER_ROLE}'s rights; the password is not printed, "
            f"pass it in $PGPASSWORD): {source}trajstore --store {url} sql {query}")


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

@dataclass(frozen=True)
class _SqlOptions:
    """``trajstore sql``'s settings: each field is also its flag."""

    query: str = option(flag="query", help="one SQL statement, e.g. \"SELECT * FROM trajectory_summary LIMIT 5\" "
                                           "(views: see docs/sql.md)")
    store_url: str | None = option(None, flag=None, dest="store", help="store URL (the CLI's global --store)")
    format: str = option("table", choices=FORMATS, help="output format (default: table)")
    timeout_s: float | None = option(None, min=0, min_exclusive=True, help="cancel the query after this many seconds")
    unix_times: bool = option(False, help="print time columns (*_at) as the unix seconds the views hold "
                                          "(default: ISO 8601 UTC, e.g. 2026-01-02T03:04:05.678+00:00)")


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``trajstore sql``: one per field of its settings."""
    add_flags(parser, _SqlOptions)


def run_from_args(args: argparse.Namespace) -> int:
    options = config_from_args(_SqlOptions, args)
    result = run_query(options.store_url, options.query, timeout_s=options.timeout_s)
    print_result(result, options.format, iso_times=not options.unix_times)
    return 0
