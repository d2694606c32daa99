"""The one driver-error translation boundary: what a database driver raised, as a trajstore error.

Every SQL transaction of the index runs inside ``trajstore.log._transaction``,
which hands whatever the driver raised, from connect to COMMIT, to
``translate``; opening a store (``store.py``) and the writer's store sink
(``ingest/sinks.py``) ask this module too. Nothing else classifies driver
exceptions, and callers only ever see trajstore errors (``trajstore.errors``)
or ``StaleState``, which ``Store`` and the materializer handle:

* a lost race (a unique key another writer took first, SQLSTATE 40:
  serialization failure, deadlock) -> ``StaleState``;
* the database cannot be reached, the connection broke -> ``StoreUnavailable``;
* a value the database cannot hold -> ``ValidationError`` (rule ``storable_value``);
* anything else the driver refused -> ``IndexInvariantError`` (a trajstore bug).

A connection lost *during* COMMIT (``lost_connection``) is the one case the
transaction resolves itself (it looks whether the commit landed).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, InterfaceError, OperationalError, StatementError

from trajstore.errors import IndexInvariantError, StoreUnavailable, TrajstoreError, ValidationError, first_line
from trajstore.log.base import StaleState

__all__ = ["RACE_KEYS", "lost_connection", "opening_error", "retriable_error", "translate", "unreachable",
           "wrapped"]

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


def opening_error(e: BaseException, what: str) -> BaseException:
    """For an error while opening a store (connecting, checking its schema,
    migrating it): a driver error means the database cannot be used as asked
    (unreachable, timed out, a login that may not migrate):
    ``StoreUnavailable("<what>: <its first line>")``. Anything else as it is."""
    if isinstance(e, DBAPIError):
        return StoreUnavailable(f"{what}: {first_line(e)}")
    return e


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
