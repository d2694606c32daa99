"""The one driver-error translation boundary: what a database driver raised, as a trajstore error.

Every SQL transaction of the index runs inside ``trajstore.log._transaction``,
which hands whatever the driver raised, from connect to COMMIT, to
``translate``. Every other piece of code that talks to the database directly
(opening a store in ``store.py``, the payload location in ``payload/_home.py``,
``trajstore sql`` in ``inspect/sql.py``) runs it inside ``driver_errors``, the
context manager that maps what the driver raised (SQLAlchemy's wrapped errors or
the raw DB-API ones of sqlite3 and psycopg) to trajstore errors, in one of three
modes; the writer's store sink (``ingest/sinks.py``) and the CLI's last-resort
error line ask this module too. Nothing else classifies or catches driver
exceptions (``tests/test_layout.py`` checks that no module outside ``log/``
imports them), and callers only ever see trajstore errors (``trajstore.errors``)
or ``StaleState``, which ``Store`` and the materializer handle.

What a driver's error *means* is its backend's to say: each backend class
(``_backend.Backend``, a ``DriverErrorRules``: ``lost_race``, ``unstorable``,
``answered``, ``refused``, ``constraint``, ``recovering``, ``unreached``,
``query_reason``), in its own module, classifies the exceptions of its
driver (``driver_errors()``: sqlite3's for ``SQLite``, psycopg's for
``PostgreSQL``). This module asks the backend of the registry
(``_registry.BACKENDS``, which hands itself over with ``classify_by``: the
registry imports the backends, which import this module) whose driver raised
it, so a new backend is its module and its registry entry, nothing here.

``driver_errors(what)`` (mode ``"index"``) is ``translate``:

* a lost race (a unique key another writer took first, SQLSTATE 40:
  serialization failure, deadlock) -> ``StaleState``;
* the database cannot be reached, the connection broke -> ``StoreUnavailable``;
* a value the database cannot hold -> ``ValidationError`` (rule ``storable_value``);
* anything else the driver refused -> ``IndexInvariantError`` (a trajstore bug).

A connection lost *during* COMMIT (``lost_connection``) is the one case the
transaction resolves itself (it looks whether the commit landed).

``driver_errors(what, mode="opening")``: the database cannot be used as asked
(unreachable, timed out, no such table, a login that may not migrate):
``StoreUnavailable("<what>: <the driver's first line>")``, except, with
``races=True``, a unique key another process took first (``StaleState``: the
caller reads what it wrote), and a server starting up, in recovery or shutting
down (``ServerRecovering``, a ``StoreUnavailable`` the caller may wait out), and a
server no connection reached (``ServerUnreachable``, the same; ``transient_opening``).

``driver_errors(what, mode="user_query")``: a query a user wrote (``trajstore
sql``) that the database refused: ``TrajstoreError("<what>: <the database's
reason>")`` in one line (``{reason}`` in ``what`` places it there instead).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Iterable, Iterator, Literal

from sqlalchemy import Engine
from sqlalchemy.exc import (DataError, DBAPIError, IntegrityError, InterfaceError, OperationalError, SQLAlchemyError,
                            StatementError)

from trajstore.errors import IndexInvariantError, StoreUnavailable, TrajstoreError, ValidationError, first_line
from trajstore.log.base import StaleState

__all__ = ["DriverErrorRules", "RACE_KEYS", "ServerRecovering", "ServerUnreachable", "backend_of_error",
           "classify_by", "database_error_line", "driver_errors", "lost_connection", "refused", "retriable_error",
           "transient_opening", "translate", "unreachable", "wrapped"]

# Unique keys whose violation means "another writer got there first" (-> StaleState);
# PostgreSQL reports the constraint name, SQLite "table.column".
RACE_KEYS = {
    "events_identity_key": "events.identity",
    "trajectories_pkey": "trajectories.trajectory_id",
    "materializer_checkpoints_pkey": "materializer_checkpoints.shard",
    "version_labels_pkey": "version_labels.label",
    "projection_checkpoints_pkey": "projection_checkpoints.projection",
    "projections_pkey": "projections.name",
    "lineage_steps_pkey": "lineage_steps.run",
    "lineage_annotations_pkey": "lineage_annotations.run",
    "run_owners_pkey": "run_owners.run",
    "ledger_groups_pkey": "ledger_groups.group_id",
    "ux_ledger_groups_prompt": "ledger_groups.run",  # (run, prompt_id, epoch) another group took
}


def _driver_error(e: BaseException) -> BaseException:
    """The driver's own exception of ``e`` (SQLAlchemy wraps it as ``.orig``)."""
    return getattr(e, "orig", None) or e


class DriverErrorRules:
    """What a driver's errors mean: the class methods each backend (``_backend.Backend``
    subclasses this) overrides in its own module for its driver's exceptions
    (``e``: the driver's own exception, SQLAlchemy's ``.orig`` or a raw one).
    These defaults say nothing: SQLAlchemy's classes alone decide (a lost
    connection is ``OperationalError``/``InterfaceError``)."""

    driver = ""
    """The DB-API module of its driver (``sqlite3``, ``psycopg``): its errors are this backend's to classify."""

    @classmethod
    def driver_errors(cls) -> tuple[type[BaseException], ...]:
        """The DB-API base classes of its driver (``Error``, ``Warning``); () where it is not installed."""
        if not cls.driver:
            return ()
        try:
            module = importlib.import_module(cls.driver)
        except ImportError:  # an install without this backend's driver
            return ()
        return (module.Error, module.Warning)

    @classmethod
    def lost_race(cls, e: BaseException) -> bool:
        """Did the transaction lose a race to another (serialization failure, deadlock)?"""
        return False

    @classmethod
    def unstorable(cls, e: BaseException) -> bool:
        """Was a value refused that the database cannot hold (out of range, too long)?"""
        return False

    @classmethod
    def answered(cls, e: BaseException) -> bool:
        """Did the server answer with an error (the transaction rolled back, the connection fine)?"""
        return False

    @classmethod
    def refused(cls, e: BaseException) -> bool:
        """Did the database refuse a statement (a value, a check, a key), the connection fine?"""
        return False

    @classmethod
    def constraint(cls, e: BaseException) -> str | None:
        """The unique key a write violated, as ``table.column`` (``_errors.RACE_KEYS``' values), if it says."""
        return None

    @classmethod
    def recovering(cls, e: BaseException) -> bool:
        """Is the server starting up, in recovery or shutting down (a restart to wait out)?"""
        return False

    @classmethod
    def unreached(cls, e: BaseException) -> bool:
        """Did no server answer the connection (refused, timed out, no slot free), as
        opposed to a refused login or a missing database?"""
        return False

    @classmethod
    def query_reason(cls, e: BaseException, timeout_s: float | None) -> str:
        """Why the database refused a query a user wrote, in one line."""
        return first_line(str(e))


class _Registry:
    """Where the boundary finds the backends: ``classify_by`` sets it (once, ``_registry``)."""

    backends: Callable[[], Iterable[type[DriverErrorRules]]] = staticmethod(lambda: ())


def classify_by(backends: Callable[[], Iterable[type[DriverErrorRules]]]) -> None:
    """Let the boundary ask ``backends()`` (the registry's backend classes, read at
    each call) what a driver's error means."""
    _Registry.backends = staticmethod(backends)


def backend_of_error(e: BaseException) -> type[DriverErrorRules]:
    """The backend class whose driver raised ``e`` (SQLAlchemy's wrapped error or
    the driver's own); ``DriverErrorRules``, which says nothing, for any other."""
    raw = _driver_error(e)
    for backend in _Registry.backends():
        classes = backend.driver_errors()
        if classes and isinstance(raw, classes):
            return backend
    return DriverErrorRules


def unreachable(e: BaseException) -> bool:
    """Is ``e`` a driver error saying the database could not be reached or the
    connection failed (worth retrying: the pool reconnects)?"""
    return isinstance(e, DBAPIError) and (isinstance(e, (OperationalError, InterfaceError))
                                          or bool(e.connection_invalidated))


def translate(e: BaseException, what: str) -> BaseException:
    """The trajstore error (or ``StaleState``) for an error raised while ``what`` ran;
    anything that is not a driver error is returned as it is."""
    if isinstance(e, (TrajstoreError, StaleState)):
        return e
    line = first_line(e)
    if isinstance(e, DBAPIError):
        backend, raw = backend_of_error(e), _driver_error(e)
        if isinstance(e, IntegrityError):
            key = backend.constraint(raw)
            if key in RACE_KEYS.values():
                return StaleState(f"{key} taken concurrently ({line})")
            return IndexInvariantError(f"{what}: the index refused the write, a trajstore bug ({line})")
        if backend.lost_race(raw):  # serialization failure, deadlock
            return StaleState(f"{what}: {line}")
        if isinstance(e, DataError) or backend.unstorable(raw):
            return ValidationError(f"{what}: the database cannot store a value ({line})", rule="storable_value")
        if unreachable(e):
            return StoreUnavailable(f"{what}: database unavailable ({line})")
        return IndexInvariantError(f"{what}: unexpected database error, a trajstore bug ({line})")
    if isinstance(e, (StatementError, OverflowError, UnicodeError)):
        # a parameter the driver could not bind (an int beyond 64 bits, a lone surrogate, ...)
        return ValidationError(f"{what}: the database cannot store a value ({line})", rule="storable_value")
    return e


def lost_connection(e: BaseException) -> bool:
    """Did the COMMIT fail because the connection broke (outcome unknown), rather
    than because the server answered with an error (rolled back)?"""
    if not isinstance(e, DBAPIError) or backend_of_error(e).answered(_driver_error(e)):
        return False
    return unreachable(e)


def refused(e: BaseException) -> bool:
    """Did the database refuse a statement (a value, a check, a key), the
    transaction rolled back and the connection fine?"""
    return isinstance(e, (IntegrityError, DataError)) or (
        isinstance(e, DBAPIError) and backend_of_error(e).refused(_driver_error(e)))


def retriable_error(e: BaseException, what: str) -> StoreUnavailable | None:
    """``StoreUnavailable`` when ``e`` is a driver error meaning "lost the
    connection" (a writer retries it), else None. ``Store`` translates these
    itself; a sink asks here so that a driver error that got past it still never
    fails trajectories on a database restart."""
    if unreachable(e):
        return StoreUnavailable(f"{what}: database connection failed: {first_line(e)}")
    return None


def wrapped(e: BaseException, raw: Any, engine: Engine, what: str) -> BaseException:
    """A driver error raised on a pooled driver connection ``raw`` (None: while
    checking one out) as SQLAlchemy wraps it (``DBAPIError`` subclass by the
    driver's class, ``connection_invalidated`` when it lost the connection, which
    is then invalidated: the pool drops it); anything else as it is."""
    dialect = engine.dialect
    driver_error = dialect.loaded_dbapi.Error
    if not isinstance(e, driver_error):
        return e
    lost = raw is None or bool(dialect.is_disconnect(e, raw.dbapi_connection, None))
    if lost and raw is not None:
        try:
            raw.invalidate(e)
        except Exception:  # the connection is already broken: nothing more to learn from it
            pass
    return DBAPIError.instance(what, None, e, driver_error, connection_invalidated=lost, dialect=dialect)


class ServerRecovering(StoreUnavailable):
    """The server answered "starting up / in recovery / shutting down" (SQLSTATE
    class 57P) or dropped the connection while terminating it: a restart, which
    a caller may wait out as an append's commit outcome is."""


def _recovering(e: BaseException) -> bool:
    return backend_of_error(e).recovering(_driver_error(e))


class ServerUnreachable(StoreUnavailable):
    """Opening a store: no server answered (connection refused or timed out, the
    connection dropped, no connection slot free), which a caller may wait out; a
    refused login or a missing database is not this."""


def _unreachable_server(e: BaseException) -> bool:
    return unreachable(e) and backend_of_error(e).unreached(_driver_error(e))


def transient_opening(e: BaseException) -> bool:
    """Is ``e``, raised opening a store, a server down or restarting (worth waiting
    for), rather than a store that is not there or a login it refused?"""
    return isinstance(e, (ServerRecovering, ServerUnreachable))


def _raw_driver_errors() -> tuple[type[BaseException], ...]:
    """The DB-API base classes of every backend's driver (installed), for a connection
    opened on the driver itself (``trajstore sql``), which SQLAlchemy does not wrap."""
    return tuple(c for backend in _Registry.backends() for c in backend.driver_errors())


def _is_driver_error(e: BaseException) -> bool:
    return isinstance(e, SQLAlchemyError) or isinstance(e, _raw_driver_errors())


def _user_query_error(e: BaseException, what: str, timeout_s: float | None) -> TrajstoreError:
    reason = backend_of_error(e).query_reason(_driver_error(e), timeout_s)  # in one line
    if "{reason}" in what:
        return TrajstoreError(what.replace("{reason}", reason))
    return TrajstoreError(f"{what}: {reason}")


def _opening_error(e: BaseException, what: str, races: bool) -> BaseException:
    if races and isinstance(e, IntegrityError):
        return StaleState(f"{what}: another process wrote it first ({first_line(e)})")
    if _recovering(e):
        return ServerRecovering(f"{what}: {first_line(e)}")
    if _unreachable_server(e):
        return ServerUnreachable(f"{what}: {first_line(e)}")
    return StoreUnavailable(f"{what}: {first_line(e)}")


Mode = Literal["index", "opening", "user_query"]


@contextlib.contextmanager
def driver_errors(what: str, *, mode: Mode = "index", races: bool = False,
                  timeout_s: float | None = None) -> Iterator[None]:
    """Run the body with whatever a database driver raises in it mapped to a
    trajstore error (or ``StaleState``), named by ``what``; see the module
    docstring for the three modes. ``races`` (mode ``"opening"``): a unique key
    another process took first is ``StaleState``. ``timeout_s``: the user query's timeout,
    named when the database stopped it. Anything that is not a driver error
    passes through as it is."""
    try:
        yield
    except (TrajstoreError, StaleState):
        raise
    except Exception as e:
        if mode == "index":
            error = translate(e, what)
        elif not _is_driver_error(e):
            raise
        elif mode == "opening":
            error = _opening_error(e, what, races)
        else:
            error = _user_query_error(e, what, timeout_s)
        if error is e:
            raise
        raise error from None


def database_error_line(e: BaseException) -> str | None:
    """For an error report of last resort (the CLI's): a driver error that got
    past every boundary (a trajstore bug) as ``database error: <the driver's
    message>``; None for anything else."""
    if isinstance(e, DBAPIError) and e.orig is not None:
        return f"database error: {e.orig}"
    return None
