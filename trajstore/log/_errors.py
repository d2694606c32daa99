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
down (``ServerRecovering``, a ``StoreUnavailable`` the caller may wait out).

``driver_errors(what, mode="user_query")``: a query a user wrote (``trajstore
sql``) that the database refused: ``TrajstoreError("<what>: <the database's
reason>")`` in one line (``{reason}`` in ``what`` places it there instead).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Literal

from sqlalchemy import Engine
from sqlalchemy.exc import (DataError, DBAPIError, IntegrityError, InterfaceError, OperationalError, SQLAlchemyError,
                            StatementError)

from trajstore.errors import IndexInvariantError, StoreUnavailable, TrajstoreError, ValidationError, first_line
from trajstore.log.base import StaleState

__all__ = ["RACE_KEYS", "ServerRecovering", "database_error_line", "driver_errors", "lost_connection",
           "retriable_error", "translate", "unreachable", "wrapped"]

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
    "ledger_groups_pkey": "ledger_groups.group_id",
    "ux_ledger_groups_prompt": "ledger_groups.run",  # (run, prompt_id, epoch) another group took
}

# SQLSTATE classes the server answers with (the transaction is rolled back, the connection fine):
# 22 data exception, 23 integrity constraint, 40 transaction rollback, 54 program limit exceeded
_ANSWERED = ("22", "23", "40", "54")


def _sqlstate(e: DBAPIError) -> str:
    return str(getattr(e.orig, "sqlstate", None) or "")


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
        sqlstate = _sqlstate(e)
        if isinstance(e, IntegrityError):
            key = _constraint(e)
            if key in RACE_KEYS.values():
                return StaleState(f"{key} taken concurrently ({line})")
            return IndexInvariantError(f"{what}: the index refused the write, a trajstore bug ({line})")
        if sqlstate.startswith("40"):  # serialization failure, deadlock: lost a race
            return StaleState(f"{what}: {line}")
        if isinstance(e, DataError) or sqlstate[:2] in ("22", "54"):
            return ValidationError(f"{what}: the database cannot store a value ({line})", rule="storable_value")
        if unreachable(e):
            return StoreUnavailable(f"{what}: database unavailable ({line})")
        return IndexInvariantError(f"{what}: unexpected database error, a trajstore bug ({line})")
    if isinstance(e, (StatementError, OverflowError, UnicodeError)):
        # a parameter the driver could not bind (an int beyond 64 bits, a lone surrogate, ...)
        return ValidationError(f"{what}: the database cannot store a value ({line})", rule="storable_value")
    return e


def _constraint(e: IntegrityError) -> str | None:
    diag = getattr(e.orig, "diag", None)
    name = getattr(diag, "constraint_name", None)
    if name:
        return RACE_KEYS.get(name, name)
    msg = str(e.orig)
    if msg.startswith("UNIQUE constraint failed: "):
        return msg.split(": ", 1)[1].split(",")[0].strip()
    return None


def lost_connection(e: BaseException) -> bool:
    """Did the COMMIT fail because the connection broke (outcome unknown), rather
    than because the server answered with an error (rolled back)?"""
    if not isinstance(e, DBAPIError) or _sqlstate(e)[:2] in _ANSWERED:
        return False
    return unreachable(e)


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


_RECOVERING_TEXT = ("in recovery mode", "starting up", "shutting down", "terminating connection")


def _recovering(e: BaseException) -> bool:
    orig = getattr(e, "orig", None)
    state = str(getattr(orig, "sqlstate", None) or getattr(e, "sqlstate", None) or "")
    text = str(orig or e)
    return state.startswith("57P") or any(t in text for t in _RECOVERING_TEXT)


def _raw_driver_errors() -> tuple[type[BaseException], ...]:
    """The DB-API base classes of the drivers trajstore uses, for a connection
    opened on the driver itself (``trajstore sql``), which SQLAlchemy does not wrap."""
    import sqlite3

    classes: list[type[BaseException]] = [sqlite3.Error, sqlite3.Warning]
    try:
        import psycopg
    except ImportError:  # a SQLite-only install
        pass
    else:
        classes += [psycopg.Error, psycopg.Warning]
    return tuple(classes)


def _is_driver_error(e: BaseException) -> bool:
    return isinstance(e, SQLAlchemyError) or isinstance(e, _raw_driver_errors())


def _reason(e: BaseException) -> str:
    """The database's reason for refusing a statement, in one line (PostgreSQL's
    primary message and the character it points at)."""
    orig = getattr(e, "orig", None) or e
    diag = getattr(orig, "diag", None)
    primary = getattr(diag, "message_primary", None) or str(orig)
    position = getattr(diag, "statement_position", None)
    return first_line(primary) + (f" (at character {position})" if position else "")


def _user_query_error(e: BaseException, what: str, timeout_s: float | None) -> TrajstoreError:
    reason = _reason(e)
    if reason == "interrupted" and timeout_s:  # SQLite's progress handler stopped it
        reason = f"query exceeded the {timeout_s:g} s timeout"
    elif reason == "not authorized":  # SQLite's authorizer refused it
        reason = "not authorized (trajstore sql is read-only)"
    if "{reason}" in what:
        return TrajstoreError(what.replace("{reason}", reason))
    return TrajstoreError(f"{what}: {reason}")


def _opening_error(e: BaseException, what: str, races: bool) -> BaseException:
    if races and isinstance(e, IntegrityError):
        return StaleState(f"{what}: another process wrote it first ({first_line(e)})")
    if _recovering(e):
        return ServerRecovering(f"{what}: {first_line(e)}")
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
