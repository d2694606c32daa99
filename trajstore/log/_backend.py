"""What a backend is: the one class each database's module subclasses.

Everything trajstore does differently on one database lives in one class, in
that database's module (``_sqlite.py``: ``SQLite``; ``postgres.py``:
``PostgreSQL``), and ``_registry.BACKENDS`` is the one table from a store URL's
database name to it (``backend_of(url)``). No module outside ``log/`` names a
database; ``tests/test_layout.py`` checks that.

A backend has two levels:

* the URL's (class methods: no engine yet): its engines (``make_engines``), the
  URL's own checks (``check_url``), what must exist before a store is opened
  without creating one (``require_database``, ``require_schema``), where a new
  store's payload goes (``default_payload_dir``, ``payload_base_dir``,
  ``payload_dir_from_env``), the read-only connection ``trajstore sql`` runs
  queries on (``read_only``), whether it has reader logins
  (``reader_logins``, ``make_reader_login``), how concurrent first migrations are serialized
  (``serialize_migrations``), and the fragments in which the inspection views'
  SQL differs (``join_sorted``, ``version_spans``, ``span_int``);
* what its driver's errors mean (class methods of ``_errors.DriverErrorRules``,
  asked by the one driver-error boundary ``_errors.py`` for an error whose
  driver exception is one of ``driver_errors()``, the ``driver`` module's): a
  lost race (``lost_race``), a value the database cannot hold
  (``unstorable``), the server having answered (``answered``, ``refused``),
  the unique key a write hit (``constraint``), a server restarting
  (``recovering``) or not reached (``unreached``), and a user query's reason
  (``query_reason``); the defaults say nothing, so SQLAlchemy's classes alone
  decide (a lost connection is ``OperationalError``/``InterfaceError``);
* the engine's (an instance per SQLAlchemy dialect, ``_registry.sql_dialect``):
  the driver statements of the index's hot paths (``_dialect.SqlDialect``) and
  what differs in them: how a transaction begins, how an append takes
  positions, the head, the tail's bound, the clock, the label appends' order.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from trajstore.errors import StoreUnavailable
from trajstore.log._dialect import SqlDialect
from trajstore.log._errors import DriverErrorRules, driver_errors

__all__ = ["Backend", "ReadQuery", "safe_url"]

ReadQuery = Callable[[str], tuple[list[str], list[tuple[Any, ...]]]]
"""A read-only connection's query: SQL text -> (column names, rows)."""


def safe_url(url: str) -> str:
    """``url`` with its password masked, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


class Backend(SqlDialect, DriverErrorRules):
    """One database backend (module doc). The class methods are its URL-level
    operations; an instance is its driver statements for one engine's dialect."""

    payload_dir_from_env = False
    """Does ``$TRAJSTORE_PAYLOAD_DIR`` name a new store's payload (as if given)?"""
    reader_logins = False
    """Can ``trajstore init --reader-login`` make a read-only login on it?"""

    # -- opening ----------------------------------------------------------------
    @classmethod
    def check_url(cls, url: str) -> None:
        """Refuse (ValidationError, rule ``url``) a URL this backend would misread."""

    @classmethod
    def make_engines(cls, url: str) -> tuple[Engine, Engine]:
        """The write engine and the read engine of ``url`` (may be one engine)."""
        raise NotImplementedError

    @classmethod
    def require_database(cls, url: str, *, missing_ok: bool = False) -> None:
        """Refuse (StoreUnavailable) what is certainly no store before connecting;
        a missing database is refused unless ``missing_ok`` (a store may be created)."""

    @classmethod
    def require_schema(cls, url: str, engine: Engine) -> None:
        """For an open without creating: the database must hold trajstore's schema
        (Alembic's table), else StoreUnavailable ("no store at ..."), ``engine`` disposed."""
        from sqlalchemy import inspect as sa_inspect

        try:
            with driver_errors(f"cannot open store {safe_url(url)}", mode="opening"), engine.connect() as conn:
                present = sa_inspect(conn).has_table("alembic_version")
        except StoreUnavailable:
            engine.dispose()
            raise
        if not present:
            engine.dispose()
            raise StoreUnavailable(f"no store at {safe_url(url)} (trajstore init, ingest or demo makes one)")

    @classmethod
    def serialize_migrations(cls, conn: Any) -> None:
        """Inside the migrating transaction on ``conn``: make a concurrent first
        connect wait until this one has migrated (nothing: the transaction already does)."""

    # -- the payload --------------------------------------------------------------
    @classmethod
    def default_payload_dir(cls, url: str) -> str:
        """Where a new store's payload goes when nothing names it."""
        raise NotImplementedError

    @classmethod
    def payload_base_dir(cls, url: str) -> str | None:
        """The directory a recorded relative payload path is relative to (None: none is)."""
        return None

    # -- reading ------------------------------------------------------------------
    @classmethod
    def read_only(cls, url: str, timeout_s: float | None, role: str) -> contextlib.AbstractContextManager[ReadQuery]:
        """A connection the database itself keeps read-only, every query in one
        snapshot (``role``: the read-only role, where the backend has one);
        ``timeout_s`` cancels a query that runs longer."""
        raise NotImplementedError

    @classmethod
    def make_reader_login(cls, engine: Engine, login: str, password: str | None, role: str) -> None:
        """Make (or update) ``login``, a login holding only ``role`` and reading only
        (asked only where ``reader_logins``; the caller checked the name)."""
        raise NotImplementedError

    @classmethod
    def partition_events(cls, engine: Engine, *, rows: int, ahead: int, drop_empty: bool = False) -> dict[str, Any]:
        """Partition the event index by position (``trajstore partition``; docs/deploy.md,
        "Partitioning"): where the database has declarative partitioning."""
        from trajstore.errors import ValidationError

        raise ValidationError(f"the {cls.__name__} backend does not partition the event index "
                              "(PostgreSQL does: docs/deploy.md, \"Partitioning\")", rule="partition")

    # -- the inspection views' fragments (trajstore.inspect.views) -----------------
    @classmethod
    def join_sorted(cls, column: str) -> str:
        """Aggregate: the distinct values of ``column`` sorted and joined with ','."""
        raise NotImplementedError

    @classmethod
    def version_spans(cls) -> str:
        """FROM-clause rows of generation_events ``g`` joined to its version spans ``j``
        (``j.value`` is one span object)."""
        raise NotImplementedError

    @classmethod
    def span_int(cls, key: str) -> str:
        """Field ``key`` of span ``j.value`` as an INTEGER."""
        raise NotImplementedError

    @classmethod
    def shrink_journal(cls, engine: Engine) -> None:
        """Give back the disk space the database's journal holds beyond its data,
        without waiting for any reader or writer (after a garbage collection). A
        backend whose journal is the server's own (PostgreSQL's WAL): nothing."""
