"""SQLite engines: the embedded, serverless default.

* WAL journal so readers never block the writer; ``synchronous=FULL`` so a
  committed append survives power loss (acknowledged = durable).
* The write engine opens transactions with ``BEGIN IMMEDIATE``: the write
  lock is taken at the start, so two processes never both read-then-write and
  deadlock on lock upgrade; ``busy_timeout`` makes the loser wait.
* The read engine keeps plain deferred transactions.
"""

from __future__ import annotations

import logging
import os
import tempfile
import weakref

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.pool import QueuePool, StaticPool

__all__ = ["default_payload_dir", "make_engines"]

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


def _forget_pools_in_forked_children() -> None:
    # A SQLite connection must not be used across fork; the child starts with
    # fresh pools and leaves the parent's connections alone (close=False).
    for engine in list(_ENGINES):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_pools_in_forked_children)


def default_payload_dir(url: str) -> str:
    """Payload beside the database file: ``<db>.payload/`` (a temporary
    directory for an in-memory database, which lives no longer either)."""
    path = make_url(url).database
    if not path or path == ":memory:":
        return tempfile.mkdtemp(prefix="trajstore-memory-payload-")
    return os.path.abspath(path) + ".payload"
