"""The SQLite backend: the embedded, serverless default (``SQLite``).

Engines:

* WAL journal so readers never block the writer; ``synchronous=FULL`` so a
  committed append survives power loss (acknowledged = durable).
* The write engine opens transactions with ``BEGIN IMMEDIATE``: the write
  lock is taken at the start, so two processes never both read-then-write and
  deadlock on lock upgrade; ``busy_timeout`` makes the loser wait.
* The read engine keeps plain deferred transactions.

Positions: one writer at a time, so an append takes consecutive positions from
the ``log_head`` counter row and commits before the next one starts; commits
become visible in position order and the tail needs no bound.

Read-only queries (``trajstore sql``, ``SQLite.read_only``) are kept read-only
by SQLite itself, not by looking at the query text: the file is opened with
``file:...?mode=ro`` (SQLite's pager refuses every write to it), ``PRAGMA
query_only=ON`` is set, and an authorizer, which SQLite consults while
compiling each statement, refuses the statements that would have effects
outside the database file or on the connection: ATTACH (and ``VACUUM INTO``,
which attaches), DETACH, transaction control, ``load_extension``, and every
PRAGMA except a list of introspection ones (so ``PRAGMA query_only=OFF`` is
refused).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import tempfile
import time
import urllib.request
import weakref
from typing import Any, Iterator, Sequence

from sqlalchemy import Connection, Engine, create_engine, event, select
from sqlalchemy.engine import make_url
from sqlalchemy.pool import QueuePool, StaticPool

from trajstore.errors import StoreUnavailable, ValidationError
from trajstore.log._backend import Backend, ReadQuery, safe_url
from trajstore.log._errors import driver_errors
from trajstore.schema import log_head

__all__ = ["SQLite", "default_payload_dir", "make_engines"]

_BUSY_TIMEOUT_MS = 60_000


def make_engines(url: str) -> tuple[Engine, Engine]:
    path = make_url(url).database
    if not path or path == ":memory:":
        # one private in-memory database: a single shared connection
        engine = _engine(url, immediate=True, pool=StaticPool)
        return engine, engine
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        # a mistyped path starts a new, empty store elsewhere: say so, once, where it goes
        logging.getLogger(__name__).warning("trajstore: created directory %s for a new SQLite store", directory)
    os.makedirs(directory, exist_ok=True)
    return _engine(url, immediate=True), _engine(url, immediate=False)


def _engine(url: str, *, immediate: bool, pool: type = QueuePool) -> Engine:
    # Pooled: opening a connection and setting its pragmas costs about a
    # millisecond, a third of a small append. A forked child drops the
    # inherited pool (see _forget_pools_in_forked_children).
    engine = create_engine(url, poolclass=pool, connect_args={"timeout": _BUSY_TIMEOUT_MS / 1000,
                                                               "check_same_thread": False})
    _ENGINES.add(engine)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()


_INHERITED: list = []


def _forget_pools_in_forked_children() -> None:
    # A SQLite connection must not be used across fork, nor closed in the child: closing
    # an inherited connection there (as the child's garbage collector did, at any moment,
    # with the pools dropped) disturbs the parent's use of the same files, and the
    # parent lost acknowledged rows. The child starts with fresh pools and keeps the
    # inherited ones referenced, never closed (a multiprocessing child ends with
    # os._exit, without closing them either).
    for engine in list(_ENGINES):
        _INHERITED.append(engine.pool)
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_pools_in_forked_children)


def default_payload_dir(url: str) -> str:
    """Payload beside the database file: ``<db>.payload/`` (a temporary
    directory for an in-memory database, which lives no longer either)."""
    path = make_url(url).database
    if not path or path == ":memory:":
        return tempfile.mkdtemp(prefix="trajstore-memory-payload-")
    return os.path.abspath(path) + ".payload"


class SQLite(Backend):
    """The embedded default: one writer at a time (``BEGIN IMMEDIATE``), positions
    from the ``log_head`` counter row, consecutive and committed in order; a store
    is one file, its payload beside it (module doc)."""

    name = "sqlite"
    driver = "sqlite3"
    single_writer = True
    begin_read = "BEGIN"  # one snapshot (the connection is in autocommit mode)
    begin_write = "BEGIN IMMEDIATE"  # as the write engine's "begin" hook does
    now_sql = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self, dialect: Any) -> None:
        super().__init__(dialect)
        h = log_head.c
        self.take_positions = (f"UPDATE {self.table(log_head)} SET {self.col(h.position)} = "
                               f"{self.col(h.position)} + {self.p} WHERE {self.col(h.id)} = 1 RETURNING "
                               f"{self.col(h.position)}")

    def positions(self, cur: Any, n: int) -> Sequence[int]:
        """``n`` consecutive positions from the counter row."""
        cur.execute(self.take_positions, (n,))
        (last,) = cur.fetchone()
        return range(last - n + 1, last + 1)

    def head(self, conn: Connection) -> int:
        return int(conn.execute(select(log_head.c.position).where(log_head.c.id == 1)).scalar_one())

    @classmethod
    def shrink_journal(cls, engine: Engine) -> None:
        """Copy the WAL into the database file and truncate it to zero bytes
        (``wal_checkpoint(TRUNCATE)``). Between checkpoints the WAL holds up to
        ~1,000 pages (4 MB) that SQLite reuses rather than truncates; right after a
        garbage collection that was most of the index's bytes on disk. Never
        waits: with ``busy_timeout`` 0 a reader or writer in the way makes it a
        partial checkpoint that leaves the file as it is (the next one does it)."""
        try:
            conn = engine.raw_connection()
        except Exception as e:  # noqa: BLE001 - best effort: the collection itself is done
            logging.getLogger(__name__).debug("trajstore: no WAL checkpoint: %s", e)
            return
        try:
            cur = conn.cursor()
            cur.execute("PRAGMA busy_timeout=0")
            try:
                busy, _, _ = cur.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                if busy:
                    logging.getLogger(__name__).debug("trajstore: WAL not truncated: a reader or writer is in the way")
            finally:
                cur.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
                cur.close()
        except Exception as e:  # noqa: BLE001 - best effort, as above
            logging.getLogger(__name__).debug("trajstore: WAL checkpoint failed: %s", e)
        finally:
            conn.close()

    # -- the URL's level ----------------------------------------------------------
    @classmethod
    def check_url(cls, url: str) -> None:
        host = make_url(url).host
        if host:  # sqlite://run/x.db: SQLAlchemy takes "run" for a host and SQLite opens ./x.db
            path = make_url(url).database or ""
            raise ValidationError(f"{safe_url(url)}: a SQLite URL has no host, and {host!r} would be dropped (the "
                                  f"store would be {path!r}); write sqlite:///{host}/{path} for a relative path or "
                                  f"sqlite:////abs/{path} for an absolute one", rule="url")

    @classmethod
    def make_engines(cls, url: str) -> tuple[Engine, Engine]:
        return make_engines(url)

    @classmethod
    def require_database(cls, url: str, *, missing_ok: bool = False) -> None:
        """The store's file must be a SQLite database; it must exist unless ``missing_ok``."""
        path = make_url(url).database
        if not path or path == ":memory:":
            if missing_ok:
                return
            raise StoreUnavailable("no store at an in-memory database (it starts empty)")
        if os.path.isdir(path):
            raise StoreUnavailable(f"not a trajstore store: {path} is a directory, not a SQLite database file")
        if not os.path.isfile(path):
            if missing_ok:
                return
            raise StoreUnavailable(f"no store at {path} (trajstore init, ingest or demo makes one)")
        with open(path, "rb") as f:
            header = f.read(16)
        if header and header != b"SQLite format 3\x00":
            raise StoreUnavailable(f"not a trajstore store: {path} is not a SQLite database")

    @classmethod
    def default_payload_dir(cls, url: str) -> str:
        return default_payload_dir(url)

    @classmethod
    def payload_base_dir(cls, url: str) -> str | None:
        """The database file's directory (an in-memory database has none)."""
        path = make_url(url).database
        if not path or path == ":memory:":
            return None
        return os.path.dirname(os.path.abspath(path))

    @classmethod
    @contextlib.contextmanager
    def read_only(cls, url: str, timeout_s: float | None, role: str) -> Iterator[ReadQuery]:
        """The file opened read-only, ``query_only`` on, the authorizer installed (module doc);
        one snapshot (WAL) for every query. SQLite has no roles: ``role`` is unused."""
        path = os.path.abspath(make_url(url).database)
        uri = f"file:{urllib.request.pathname2url(path)}?mode=ro"
        with driver_errors(f"cannot open {path} read-only", mode="opening"):
            conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=60.0)
        try:
            conn.execute("PRAGMA query_only=ON")
            conn.execute("BEGIN")  # one snapshot for every query (WAL)
            conn.set_authorizer(_authorizer)
            yield lambda sql: _execute(conn, sql, timeout_s)
        finally:
            conn.set_authorizer(None)
            conn.close()

    # -- what sqlite3's errors mean: it has no SQLSTATE; a busy or locked database,
    # a full disk, a read-only file are OperationalError (SQLAlchemy: unavailable) --
    @classmethod
    def constraint(cls, e: BaseException) -> str | None:
        msg = str(e)  # "UNIQUE constraint failed: table.column[, table.column]"
        if msg.startswith("UNIQUE constraint failed: "):
            return msg.split(": ", 1)[1].split(",")[0].strip()
        return None

    @classmethod
    def query_reason(cls, e: BaseException, timeout_s: float | None) -> str:
        reason = super().query_reason(e, timeout_s)
        if reason == "interrupted" and timeout_s:  # the progress handler stopped it (read_only)
            return f"query exceeded the {timeout_s:g} s timeout"
        if reason == "not authorized":  # the authorizer refused it (read_only)
            return "not authorized (trajstore sql is read-only)"
        return reason

    # -- the inspection views' fragments --------------------------------------------
    @classmethod
    def join_sorted(cls, column: str) -> str:
        # SQLite before 3.44 has no ORDER BY inside an aggregate; group_concat
        # follows the order of its input, which the views sort in a subquery.
        return f"group_concat({column}, ',')"

    @classmethod
    def version_spans(cls) -> str:
        return "generation_events g, json_each(g.version_spans) j"

    @classmethod
    def span_int(cls, key: str) -> str:
        return f"CAST(json_extract(j.value, '$.{key}') AS INTEGER)"


# PRAGMAs that only report. Anything else (query_only=OFF, journal_mode=...,
# user_version=5, wal_checkpoint, optimize) is refused by the authorizer.
_PRAGMAS_ON_TABLE = frozenset({
    "table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo", "foreign_key_list",
})
_PRAGMAS_QUERY = frozenset({
    "database_list", "collation_list", "function_list", "pragma_list", "compile_options", "user_version",
    "schema_version", "page_count", "page_size", "freelist_count", "journal_mode", "query_only", "encoding",
})
_DENIED = {
    sqlite3.SQLITE_ATTACH: "ATTACH",
    sqlite3.SQLITE_DETACH: "DETACH",
    sqlite3.SQLITE_TRANSACTION: "transaction control",
    sqlite3.SQLITE_SAVEPOINT: "SAVEPOINT",
}


def _authorizer(action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None) -> int:
    if action in _DENIED:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_PRAGMA:
        name = (arg1 or "").lower()
        reads = name in _PRAGMAS_ON_TABLE or (name in _PRAGMAS_QUERY and arg2 is None)
        if not reads:
            return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() == "load_extension":
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def _execute(conn: sqlite3.Connection, sql: str, timeout_s: float | None) -> tuple[list[str], list[tuple[Any, ...]]]:
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
    return columns, rows
