"""``EventLog`` and ``SampleIndex`` on SQLAlchemy Core, shared by SQLite and PostgreSQL.

Dialect differences (engine set-up, locking for migrations) live in
``sqlite.py`` and ``postgres.py``; this module speaks only portable SQL.

Positions, and why the materializer's tail is bounded. SQLite has a single
writer (``BEGIN IMMEDIATE``): every append takes its positions from the
``log_head`` row and commits before the next one starts, so commits become
visible in position order and tailing ``position > checkpoint`` is gap-free.

On PostgreSQL a counter row would serialize every append on its row lock,
held to COMMIT (with 8 writers the lock was held 95% of the time; see
docs/log.md, "Positions"). Appends take their positions from the sequence
``log_positions`` instead, and never wait for each other. Then a transaction
may commit position 11 while one holding 10 is still open (or rolls back,
leaving a hole). A tailer that saw 11 and moved its checkpoint past it would
never see 10. So the tail is bounded (``safe_position``):

1. an append gets its transaction id (``pg_current_xact_id()``) *before* its
   first ``nextval`` (the statement that takes positions assigns it first);
2. a tailer reads the sequence's last value H, then (a later statement) the
   transaction ids running now in this database: the ``transactionid`` locks
   in ``pg_locks`` (every transaction holds one on its own id from its
   assignment to its end) of this database's backends. An append holding a position <= H took it before H was read, so it
   had its id before then: it has ended, or it is in that list;
3. once none of the listed ids is running any more, no position <= H can
   commit any more, and reading up to H cannot skip one. Until then the
   previous such bound is used (``safe_position`` waits a little for the new
   one: appends take milliseconds).

   (Not ``pg_snapshot_xmax`` of a snapshot: it is one past the latest
   *completed* id, and a transaction with a higher id may already be
   running; a test with eight writers caught exactly that.)

The invariant this keeps: a transaction held open while later ones commit
is never skipped by the tail (tests/log/test_positions_pg.py holds one open
on a real second connection). The cost: any transaction with an id (a long
migration, a session idle in a write transaction) holds the tail back until
it ends, never past it. Positions are unique and increasing per append, not
consecutive (a rolled-back append leaves a hole); ``head_position`` is the
highest stored one.

The error boundary. Every transaction runs through ``_Db.transaction`` (and
every read through ``_Db.reading``), which translates whatever the driver
raises, from connect to COMMIT, in one place (``translate``): lost races
become ``StaleState``, an unreachable database ``StoreUnavailable``, a value
the database cannot hold ``ValidationError``, anything else
``IndexInvariantError``. A connection lost *during* COMMIT is different: the
commit may have landed. Then the transaction's ``landed`` check runs on a
fresh connection (retrying while the server recovers); if the batch is there
the call succeeds, otherwise ``CommitUnknownError`` tells the caller to keep
the payload and retry.
"""

from __future__ import annotations

import logging
import time
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence, TypeVar

from sqlalchemy import Connection, Engine, and_, delete, exists, func, insert, or_, select, text, update
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, InterfaceError, OperationalError, StatementError

from trajstore.errors import (CommitUnknownError, IndexInvariantError, StoreUnavailable, TrajstoreError, ValidationError,
                              first_line)
from trajstore.log.base import EventLog, Repoint, SampleIndex, Shard, StaleState, TrajectoryWrite
from trajstore.schema import (events, log_head, materializer_checkpoints, projection_checkpoints,
                              projection_samples, projection_unfoldable, projections, samples, segments,
                              trajectories, unfoldable_trajectories, unresolved_labels, version_labels)

__all__ = ["SqlEventLog", "SqlSampleIndex", "SqlProjectionIndex", "first_line", "open_sql", "translate", "RELEASED"]

log = logging.getLogger(__name__)

_CHUNK = 500  # ids per IN (...) list
_RESOLVE_S = 30.0  # how long to try to find out whether a commit whose connection broke landed
T = TypeVar("T")

# Unique keys whose violation means "another writer got there first" (-> StaleState);
# PostgreSQL reports the constraint name, SQLite "table.column".
_RACE_KEYS = {
    "events_identity_key": "events.identity",
    "trajectories_pkey": "trajectories.trajectory_id",
    "materializer_checkpoints_pkey": "materializer_checkpoints.shard",
    "version_labels_pkey": "version_labels.label",
    "projection_checkpoints_pkey": "projection_checkpoints.projection",
    "projections_pkey": "projections.name",
}

RELEASED = "trajectory_released"
"""``events.type`` of the row the log adds when a version_label completes the
labels of a finished trajectory that was held back: the materializer folds
the trajectory there (docs/materializer.md, "Held back on a version label")."""


def _chunks(items: Sequence[Any], n: int = _CHUNK) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def translate(e: BaseException, what: str) -> Exception:
    """The trajstore error (or ``StaleState``) for an error raised while ``what`` ran."""
    if isinstance(e, (TrajstoreError, StaleState)):
        return e
    line = first_line(e)
    if isinstance(e, DBAPIError):
        sqlstate = str(getattr(e.orig, "sqlstate", None) or "")
        if isinstance(e, IntegrityError):
            key = _constraint(e)
            if key in _RACE_KEYS.values():
                return StaleState(f"{key} taken concurrently ({line})")
            return IndexInvariantError(f"{what}: the index refused the write, a trajstore bug ({line})")
        if sqlstate.startswith("40"):  # serialization failure, deadlock: lost a race
            return StaleState(f"{what}: {line}")
        if isinstance(e, DataError) or sqlstate[:2] in ("22", "54"):
            return ValidationError(f"{what}: the database cannot store a value ({line})", rule="storable_value")
        if isinstance(e, (OperationalError, InterfaceError)) or e.connection_invalidated:
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
        return _RACE_KEYS.get(name, name)
    msg = str(e.orig)
    if msg.startswith("UNIQUE constraint failed: "):
        return msg.split(": ", 1)[1].split(",")[0].strip()
    return None


def _lost_connection(e: BaseException) -> bool:
    """Did the COMMIT fail because the connection broke (outcome unknown), rather
    than because the server answered with an error (rolled back)?"""
    if not isinstance(e, DBAPIError):
        return False
    sqlstate = str(getattr(e.orig, "sqlstate", None) or "")
    if sqlstate[:2] in ("22", "23", "40", "54"):
        return False
    return e.connection_invalidated or isinstance(e, (OperationalError, InterfaceError))


class _Db:
    """The engines and the one error boundary around every transaction."""

    def __init__(self, write_engine: Engine, read_engine: Engine) -> None:
        self.write_engine = write_engine
        self.read_engine = read_engine

    @contextmanager
    def reading(self, what: str) -> Iterator[Connection]:
        try:
            with self.read_engine.connect() as conn:
                yield conn
        except Exception as e:
            raise translate(e, what) from None

    def reading_cursor(self, what: str, body: Callable[[Any, "_DriverSql"], T]) -> T:
        """``body(cursor, driver_sql)`` in one read transaction on a pooled driver
        connection: the append's reads (a few small SELECTs) without SQLAlchemy's
        per-statement execution context, which cost ~0.1 ms a statement, more
        than SQLite took to run them (docs/benchmarks.md, "Append: where the
        time goes"). Driver errors are wrapped as SQLAlchemy would wrap them (a
        lost connection is invalidated) and go through ``translate``."""
        engine = self.read_engine
        raw = _checkout(engine, what)
        try:
            cur = raw.cursor()
            try:
                if engine.dialect.name == "sqlite":
                    cur.execute("BEGIN")  # one snapshot (the connection is in autocommit mode)
                return body(cur, _driver_sql_of(engine.dialect))
            finally:
                _quietly(cur.close)
        except Exception as e:
            raise translate(_wrapped(e, raw, engine, what), what) from None
        finally:
            _quietly(raw.close)  # back to the pool, whose reset rolls the read transaction back

    def transaction_cursor(self, what: str, body: Callable[[Any, "_DriverSql"], T],
                           landed: Callable[[Connection, T], bool] | None = None) -> T:
        """``transaction`` on a pooled driver connection: ``body(cursor, driver_sql)``
        runs the driver SQL straight on the cursor (the append's transaction: its
        five statements cost more in SQLAlchemy's execution than in SQLite). The
        same error boundary: every driver error wrapped as SQLAlchemy would and
        translated, a connection lost during COMMIT resolved by ``landed``."""
        engine = self.write_engine
        raw = _checkout(engine, what)
        try:
            cur = raw.cursor()
            try:
                try:
                    if engine.dialect.name == "sqlite":
                        cur.execute("BEGIN IMMEDIATE")  # as the write engine's "begin" hook does
                    result = body(cur, _driver_sql_of(engine.dialect))
                except Exception as e:
                    _quietly(raw.rollback)
                    raise translate(_wrapped(e, raw, engine, what), what) from None
                try:
                    raw.commit()
                except Exception as e:
                    return self._after_failed_commit(what, _wrapped(e, raw, engine, what), landed, result)
                return result
            finally:
                _quietly(cur.close)
        finally:
            _quietly(raw.close)

    def _after_failed_commit(self, what: str, e: BaseException, landed: Callable[[Connection, T], bool] | None,
                             result: T) -> T:
        """A COMMIT raised ``e``: the result if it landed after all, else the error to raise."""
        if not _lost_connection(e):
            raise translate(e, what) from None  # the server refused the commit: rolled back
        log.warning("%s: connection lost during COMMIT (%s); finding out whether it landed", what, first_line(e))
        outcome = None if landed is None else self._find_out(what, lambda c: landed(c, result))
        if outcome:
            log.warning("%s: the commit had landed", what)
            return result
        state = "it is not visible" if outcome is False else "it could not be checked"
        raise CommitUnknownError(f"{what}: connection lost during COMMIT ({first_line(e)}) and {state}; "
                                 "retry (appends are idempotent)") from None

    def transaction(self, what: str, body: Callable[[Connection], T],
                    landed: Callable[[Connection, T], bool] | None = None) -> T:
        """Run ``body`` in one write transaction and commit it; translate every error.

        ``landed(conn, result)`` tells, on a fresh connection, whether the
        transaction committed; it is asked when the connection breaks during
        COMMIT."""
        try:
            conn = self.write_engine.connect()
        except Exception as e:
            raise translate(e, what) from None
        try:
            try:
                tx = conn.begin()
                result = body(conn)
            except Exception as e:
                _quietly(conn.rollback)
                raise translate(e, what) from None
            try:
                tx.commit()
            except Exception as e:
                return self._after_failed_commit(what, e, landed, result)
            return result
        finally:
            _quietly(conn.close)

    def _find_out(self, what: str, check: Callable[[Connection], bool]) -> bool | None:
        deadline = time.monotonic() + _RESOLVE_S
        pause = 0.1
        while True:
            try:
                with self.read_engine.connect() as conn:
                    return bool(check(conn))
            except Exception as e:
                if time.monotonic() + pause > deadline:
                    log.warning("%s: could not find out whether the commit landed: %s", what, first_line(e))
                    return None
            time.sleep(pause)
            pause = min(pause * 2, 2.0)

    def close(self) -> None:
        self.write_engine.dispose()
        if self.read_engine is not self.write_engine:
            self.read_engine.dispose()


def _checkout(engine: Engine, what: str) -> Any:
    """A pooled driver connection of ``engine`` (pre-pinged where the engine pings);
    errors translated (the pool does not wrap the driver's)."""
    try:
        return engine.raw_connection()
    except Exception as e:
        raise translate(_wrapped(e, None, engine, what), what) from None


def _wrapped(e: BaseException, raw: Any, engine: Engine, what: str) -> BaseException:
    """A driver error as SQLAlchemy wraps it (``DBAPIError`` subclass by the driver's
    class, ``connection_invalidated`` when it lost the connection, which is then
    invalidated: the pool drops it); anything else as it is."""
    dialect = engine.dialect
    driver_error = dialect.loaded_dbapi.Error
    if not isinstance(e, driver_error):
        return e
    lost = raw is None or bool(dialect.is_disconnect(e, raw.dbapi_connection, None))
    if lost and raw is not None:
        _quietly(lambda: raw.invalidate(e))
    return DBAPIError.instance(what, None, e, driver_error, connection_invalidated=lost, dialect=dialect)


def _execute(target: Any, sql: str, params: Any) -> Any:
    """Driver SQL on a SQLAlchemy ``Connection`` or straight on a driver cursor
    (a list of parameter tuples: executemany). What it returns has ``rowcount``."""
    if isinstance(target, Connection):
        return target.exec_driver_sql(sql, params)
    if isinstance(params, list):
        target.executemany(sql, params)
    else:
        target.execute(sql, params)
    return target


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:  # the connection is already broken: nothing more to learn from it
        pass


_SAFE_WAIT_S = 0.25  # how long safe_position waits for appends in flight before using its last bound
_SEQUENCE_LAST = "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM log_positions"
# (this database's backends only: a long transaction elsewhere on the server does not hold the tail)
_RUNNING_XIDS = ("SELECT l.transactionid::text FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                 "WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted "
                 "AND l.transactionid IS NOT NULL AND a.datname = current_database()")
_STILL_RUNNING = ("SELECT 1 FROM pg_locks WHERE locktype = 'transactionid' AND mode = 'ExclusiveLock' "
                  "AND granted AND transactionid::text = ANY(%s) LIMIT 1")


class SqlEventLog(EventLog):
    """The log index over a write engine and a read engine (they may be the same)."""

    def __init__(self, write_engine: Engine, read_engine: Engine, db: _Db | None = None) -> None:
        self.db = db or _Db(write_engine, read_engine)
        self.write_engine = write_engine
        self.read_engine = read_engine
        self._safe = 0  # the highest tail bound found so far (safe_position)

    # -- appending ---------------------------------------------------------
    def load_trajectories(self, trajectory_ids: Collection[str]) -> dict[str, dict[str, Any]]:
        return self.db.reading_cursor("loading trajectories",
                                      lambda cur, sql: sql.load_trajectories(cur, trajectory_ids))

    def lookup_identities(self, identities: Collection[str]) -> dict[str, bytes]:
        return self.db.reading_cursor("looking up event identities",
                                      lambda cur, sql: sql.lookup_identities(cur, identities))

    def load_labels(self, labels: Collection[str]) -> dict[str, int]:
        if not labels:
            return {}
        return self.db.reading_cursor("reading the version label map", lambda cur, sql: sql.load_labels(cur, labels))

    def pending_labels(self, trajectory_ids: Collection[str]) -> dict[str, dict[str, tuple[int, int] | None]]:
        ids = sorted(set(trajectory_ids))
        out: dict[str, dict[str, tuple[int, int] | None]] = {}
        u, v = unresolved_labels, version_labels
        with self.db.reading("reading unresolved version labels") as conn:
            for part in _chunks(ids):
                q = (select(u.c.trajectory_id, u.c.label, v.c.model_version, v.c.position)
                     .select_from(u.outerjoin(v, v.c.label == u.c.label)).where(u.c.trajectory_id.in_(part)))
                for tid, label, mv, pos in conn.execute(q):
                    out.setdefault(tid, {})[label] = None if pos is None else (int(mv), int(pos))
        return out

    def load_append_state(self, identities: Collection[str], trajectory_ids: Collection[str]
                          ) -> tuple[dict[str, bytes], dict[str, dict[str, Any]]]:
        # one transaction, one connection checkout
        return self.db.reading_cursor("loading the append state", lambda cur, sql: (
            sql.lookup_identities(cur, identities), sql.load_trajectories(cur, trajectory_ids)))

    def commit_append(
        self,
        event_rows: Sequence[dict[str, Any]],
        trajectory_writes: Sequence[TrajectoryWrite],
        segment_row: Mapping[str, Any] | None,
        *,
        before_commit: Callable[[], None] | None = None,
    ) -> list[int]:
        n = len(event_rows)
        if n == 0:
            if before_commit is not None:
                before_commit()
            return []

        def body(conn: Any, sql: _DriverSql) -> list[dict[str, Any]]:  # conn: a driver cursor
            # ``before_commit`` (the append's payload fsync, running meanwhile) is waited
            # for where it holds no lock other appenders need: SQLite's write lock is
            # taken at BEGIN IMMEDIATE whatever follows, so there it overlaps every
            # statement; on PostgreSQL it comes before the log_head row lock (held to
            # COMMIT, it orders every appender), overlapping only what precedes it.
            if segment_row is not None:
                sql.insert_rows(conn, segments, [segment_row])
            if before_commit is not None and not sql.single_writer:
                before_commit()
            if not sql.single_writer and sql.touches_labels(conn, event_rows):
                sql.lock_labels(conn)
            taken = sql.positions(conn, n)
            rows = [dict(r, position=p) for r, p in zip(event_rows, taken)]
            _write_trajectories(conn, sql, trajectory_writes, rows)
            sql.insert_rows(conn, events, rows)
            rows += _write_labels(conn, sql, rows)
            if before_commit is not None and sql.single_writer:
                before_commit()
            return rows

        rows = self.db.transaction_cursor("appending events", body, landed=_events_landed)
        return [r["position"] for r in rows]

    # -- reading -----------------------------------------------------------
    def head_position(self) -> int:
        with self.db.reading("reading the log head") as conn:
            return _head(conn)

    def safe_position(self, wait_s: float = _SAFE_WAIT_S) -> int | None:
        """The highest position below which no append can still commit (None:
        no bound, the backend commits in position order). See the module doc."""
        if self.write_engine.dialect.name != "postgresql":
            return None
        with self.db.reading("bounding the log's tail") as conn:
            h = int(conn.exec_driver_sql(_SEQUENCE_LAST).scalar_one())
            running = [x for (x,) in conn.exec_driver_sql(_RUNNING_XIDS)]
            deadline = time.monotonic() + wait_s
            delay = 0.0005
            while True:
                if not running or conn.exec_driver_sql(_STILL_RUNNING, (running,)).first() is None:
                    self._safe = max(self._safe, h)
                    return h
                if time.monotonic() >= deadline:
                    return self._safe  # an earlier bound, still safe
                time.sleep(delay)
                delay = min(0.01, delay * 2)

    def read_events(self, *, after_position: int, limit: int, types: Collection[str] | None = None) -> list[dict[str, Any]]:
        q = select(events).where(events.c.position > after_position)
        if types:
            q = q.where(events.c.type.in_(list(types)))
        q = q.order_by(events.c.position).limit(limit)
        with self.db.reading("reading events") as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    def count_events(self, *, after_position: int, types: Collection[str] | None = None) -> int:
        q = select(func.count()).select_from(events).where(events.c.position > after_position)
        if types:
            q = q.where(events.c.type.in_(list(types)))
        with self.db.reading("counting events") as conn:
            return int(conn.execute(q).scalar_one())

    def trajectory_events(self, trajectory_ids: Collection[str]) -> dict[str, list[dict[str, Any]]]:
        ids = sorted(set(trajectory_ids))
        out: dict[str, list[dict[str, Any]]] = {t: [] for t in ids}
        with self.db.reading("reading trajectory events") as conn:
            for part in _chunks(ids):
                q = select(events).where(events.c.trajectory_id.in_(part)).order_by(events.c.position)
                for r in conn.execute(q):
                    out[r.trajectory_id].append(dict(r._mapping))
        return out

    def counts(self) -> dict[str, Any]:
        with self.db.reading("counting the log") as conn:
            by_status = dict(conn.execute(select(trajectories.c.status, func.count()).group_by(trajectories.c.status)).all())
            by_type = dict(conn.execute(select(events.c.type, func.count()).group_by(events.c.type)).all())
            by_version = conn.execute(
                select(events.c.model_version, func.count(), func.sum(events.c.output_len))
                .where(events.c.type == "generation").group_by(events.c.model_version)
                .order_by(events.c.model_version)
            ).all()
            head = _head(conn)
            resent, drifted = conn.execute(select(func.sum(events.c.route_rows_resent),
                                                  func.sum(events.c.route_rows_drifted))).one()
            u, v, t = unresolved_labels, version_labels, trajectories
            waiting = conn.execute(
                select(u.c.label, func.count(func.distinct(u.c.trajectory_id)),
                       func.count(func.distinct(t.c.trajectory_id)).filter(t.c.status != "running"))
                .select_from(u.join(t, t.c.trajectory_id == u.c.trajectory_id)
                             .outerjoin(v, v.c.label == u.c.label))
                .where(v.c.label.is_(None)).group_by(u.c.label).order_by(u.c.label)
            ).all()
        return {
            "head_position": int(head),
            "trajectories_by_status": {k: int(v) for k, v in by_status.items()},
            "events_by_type": {k: int(v) for k, v in by_type.items()},
            "generations_by_model_version": [
                {"model_version": v, "generations": int(c), "output_tokens": int(t or 0)} for v, c, t in by_version
            ],
            "route_drift": {"route_rows_resent": int(resent or 0), "route_rows_drifted": int(drifted or 0)},
            # finished trajectories wait here (held back from materialization) until the label is mapped
            "unresolved_version_labels": [
                {"label": label, "trajectories": int(n), "held_back_trajectories": int(h)} for label, n, h in waiting
            ],
        }

    def referenced_segments(self) -> set[str]:
        with self.db.reading("listing segments") as conn:
            return _named(conn) | set(conn.execute(select(segments.c.name).where(segments.c.retired_at.is_(None)))
                                      .scalars())

    def retire_unreferenced(self, now: float) -> list[str]:
        def body(conn: Connection) -> list[str]:
            named = _named(conn)
            live = conn.execute(select(segments.c.name).where(segments.c.retired_at.is_(None))).scalars().all()
            gone = sorted(set(live) - named)
            for part in _chunks(gone):
                conn.execute(update(segments).where(segments.c.name.in_(part), segments.c.retired_at.is_(None),
                                                    ~_named_clause())
                             .values(retired_at=text(_db_now_sql(conn.dialect))))
            return gone

        return self.db.transaction("retiring unreferenced segments", body)

    def database_time(self) -> float:
        """The database's clock (seconds since the epoch): what retirement times are stamped with."""
        with self.db.reading("reading the database's clock") as conn:
            return float(conn.exec_driver_sql(f"SELECT {_db_now_sql(conn.dialect)}").scalar_one())

    def segments_in_use(self, retired_before: float) -> set[str]:
        with self.db.reading("listing segments in use") as conn:
            recent = conn.execute(select(segments.c.name).where(
                or_(segments.c.retired_at.is_(None), segments.c.retired_at > retired_before))).scalars()
            return _named(conn) | set(recent)

    def forget_segments(self, names: Collection[str]) -> int:
        names = sorted(set(names))

        def body(conn: Connection) -> int:
            n = 0
            for part in _chunks(names):
                n += conn.execute(delete(segments).where(segments.c.name.in_(part), segments.c.retired_at.is_not(None),
                                                         ~_named_clause())).rowcount
            return n

        return self.db.transaction("forgetting deleted segments", body) if names else 0

    def compaction_candidates(self, *, max_bytes: int, limit_bytes: int) -> list[dict[str, Any]]:
        q = (select(segments).where(segments.c.kind == "events", segments.c.retired_at.is_(None),
                                    segments.c.num_bytes < max_bytes)
             .order_by(segments.c.created_at, segments.c.name))
        out, total = [], 0
        with self.db.reading("listing segments to compact") as conn:
            for r in conn.execute(q):
                out.append(dict(r._mapping))
                total += int(r.num_bytes)
                if total >= limit_bytes:
                    break
        return out

    def live_locators(self, segment_names: Collection[str]) -> list[dict[str, Any]]:
        e = events.c
        out: list[dict[str, Any]] = []
        with self.db.reading("reading event locators") as conn:
            for part in _chunks(sorted(set(segment_names))):
                q = select(e.position, e.trajectory_id, e.segment, e.segment_row).where(
                    e.segment.in_(part), e.segment_kind.is_(None))
                out.extend(dict(r._mapping) for r in conn.execute(q))
        return sorted(out, key=lambda r: r["position"])

    def commit_compaction(self, segment_row: Mapping[str, Any], moves: Sequence[Repoint]) -> None:
        def body(conn: Connection) -> None:
            conn.execute(insert(segments), [dict(segment_row)])
            _repoint(conn, moves, guarded=True)
            _retire_emptied(conn, {m.old_segment for m in moves if m.old_segment}, time.time())

        def landed(conn: Connection, _: None) -> bool:
            return conn.execute(select(segments.c.name).where(segments.c.name == segment_row["name"])).first() is not None

        self.db.transaction(f"compacting {len(moves)} events into {segment_row['name']}", body, landed=landed)

    # -- the materializer's reads: driver SQL, only the columns it uses ------
    def finished_after(self, after_position: int, limit: int) -> list[dict[str, Any]]:
        safe = self.safe_position()  # before the read: what it allows has committed by then
        if safe is not None and safe <= after_position:
            return []
        with self.db.reading("reading finished trajectories") as conn:
            e, t = _quoted(conn, events), _quoted(conn, trajectories)
            bound = "" if safe is None else f"AND e.{e.position} <= {int(safe)} "
            sql = (f"SELECT e.{e.position}, e.{e.trajectory_id}, e.{e.status}, t.{t.seq_len} "
                   f"FROM {e.table} e LEFT JOIN {t.table} t ON t.{t.trajectory_id} = e.{e.trajectory_id} "
                   f"WHERE e.{e.type} IN ('trajectory_finished', '{RELEASED}') AND e.{e.position} > {e.p} {bound}"
                   f"ORDER BY e.{e.position} LIMIT {e.p}")
            rows = conn.exec_driver_sql(sql, (int(after_position), int(limit))).fetchall()
        return [{"position": p, "trajectory_id": tid, "status": st, "seq_len": n} for p, tid, st, n in rows]

    def finished_ids_after(self, after_position: int) -> list[str]:
        with self.db.reading("reading finished trajectories") as conn:
            q = select(events.c.trajectory_id).where(events.c.type.in_(["trajectory_finished", RELEASED])) \
                .where(events.c.position > int(after_position)).order_by(events.c.position)
            return list(conn.execute(q).scalars())

    def finished_status(self, trajectory_ids: Collection[str]) -> dict[str, str]:
        """The status of each trajectory's ``trajectory_finished`` event (absent: not finished)."""
        out: dict[str, str] = {}
        with self.db.reading("reading finished trajectories") as conn:
            for part in _chunks(sorted(set(trajectory_ids))):
                q = select(events.c.trajectory_id, events.c.status).where(events.c.type == "trajectory_finished") \
                    .where(events.c.trajectory_id.in_(list(part)))
                out.update({tid: st for tid, st in conn.execute(q)})
        return out

    def fold_inputs(self, trajectory_ids: Collection[str]
                    ) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]]:
        ids = sorted(set(trajectory_ids))
        trajs: dict[str, dict[str, Any]] = {}
        out: dict[str, list[dict[str, Any]]] = {t: [] for t in ids}
        with self.db.reading("reading the trajectories to fold") as conn:
            e, t = _quoted(conn, events), _quoted(conn, trajectories)
            for part in _chunks(ids):
                marks = ", ".join([e.p] * len(part))
                q = (f"SELECT {', '.join(getattr(t, c) for c in _FOLD_TRAJECTORY_COLUMNS)} FROM {t.table} "
                     f"WHERE {t.trajectory_id} IN ({marks})")
                for row in conn.exec_driver_sql(q, tuple(part)):
                    trajs[row[0]] = dict(zip(_FOLD_TRAJECTORY_COLUMNS, row))
                q = (f"SELECT {', '.join(getattr(e, c) for c in _FOLD_EVENT_COLUMNS)} FROM {e.table} "
                     f"WHERE {e.trajectory_id} IN ({marks}) AND {e.type} IN ('generation', 'reward') "
                     f"ORDER BY {e.position}")
                for row in conn.exec_driver_sql(q, tuple(part)):
                    out[row[1]].append(dict(zip(_FOLD_EVENT_COLUMNS, row)))
        return trajs, out

    def close(self) -> None:
        self.db.close()


_FOLD_TRAJECTORY_COLUMNS = ("trajectory_id", "group_id", "num_experts", "route_layers", "route_topk", "seq_len")
_FOLD_EVENT_COLUMNS = ("position", "trajectory_id", "type", "seq", "event_id", "model_version", "prompt_len",
                       "prefix_len", "output_len", "routes_start", "num_route_rows", "routes_dtype", "reward",
                       "has_token_rewards", "finish_reason", "segment", "segment_row", "segment_kind",
                       "version_spans", "sample_index", "is_merged", "weight_versions",
                       # what a projection with routes="last" needs to know was dropped (projections.md)
                       "num_route_rows_sent", "route_rows_resent", "route_rows_drifted")


class _Quoted:
    """A table's name and column names quoted for a dialect, and its parameter marker ``p``."""

    def __init__(self, conn: Connection, table: Any) -> None:
        q = conn.dialect.identifier_preparer
        self.table = q.format_table(table)
        self.p = "?" if conn.dialect.paramstyle == "qmark" else "%s"
        for c in table.columns:
            setattr(self, c.name, q.quote(c.name))


_QUOTED: dict[tuple[str, str, str], _Quoted] = {}


def _quoted(conn: Connection, table: Any) -> _Quoted:
    key = (conn.dialect.name, conn.dialect.paramstyle, table.name)
    if key not in _QUOTED:
        _QUOTED[key] = _Quoted(conn, table)
    return _QUOTED[key]


def _named(conn: Connection) -> set[str]:
    """Segments an ``events``, ``samples`` or ``projection_samples`` row names."""
    named = set(conn.execute(select(events.c.segment).where(events.c.segment.is_not(None)).distinct()).scalars())
    named |= set(conn.execute(select(projection_samples.c.segment).distinct()).scalars())
    return named | set(conn.execute(select(samples.c.segment).distinct()).scalars())


def _named_clause():
    """SQL: this ``segments`` row is not a log segment, or some event names it
    (one probe of ``ix_events_segment``; sample segments are retired only when their
    projection is dropped, and then no row names them)."""
    return or_(and_(segments.c.kind != "events", segments.c.retired_at.is_(None)),
               exists().where(events.c.segment == segments.c.name))


def _repoint(conn: Connection, moves: Sequence[Repoint], *, guarded: bool) -> None:
    """Re-point events' payload locators. Guarded (compaction): each event
    must still be where the move was computed from, else ``StaleState``.
    Unguarded (the materializer, under its checkpoint guard): the sample row
    holds the same bytes whatever log row the event pointed at.

    One executemany of ready tuples through the driver (both drivers sum its
    rowcount: SQLAlchemy's ``supports_sane_multi_rowcount``), in position
    order: materializer and compaction take the row locks in the same order."""
    if not moves:
        return
    params = sorted(((m.segment, m.segment_row, m.segment_kind, m.position)
                     + ((m.old_segment, m.old_segment_row) if guarded else ()) for m in moves),
                    key=lambda t: t[3])
    n = conn.exec_driver_sql(_repoint_sql(conn, guarded), params).rowcount
    if n != len(moves):
        if guarded:
            raise StaleState(f"{len(moves) - n} of {len(moves)} events moved concurrently")
        raise IndexInvariantError(f"re-pointing {len(moves)} events found {n}: the log lost events, a trajstore bug")


def _repoint_sql(conn: Connection, guarded: bool) -> str:
    """The re-pointing UPDATE in the driver's own parameter style; guarded, it
    also requires the event's current (log) locator."""
    d = conn.dialect
    if not d.supports_sane_multi_rowcount:  # pragma: no cover - both supported drivers have it
        raise IndexInvariantError(f"driver {d.driver!r} does not report an executemany's rowcount")
    p = "?" if d.paramstyle == "qmark" else "%s"
    q = d.identifier_preparer
    c = events.c
    sql = (f"UPDATE {q.format_table(events)} SET {q.format_column(c.segment)} = {p}, "
           f"{q.format_column(c.segment_row)} = {p}, {q.format_column(c.segment_kind)} = {p} "
           f"WHERE {q.format_column(c.position)} = {p}")
    if guarded:
        sql += (f" AND {q.format_column(c.segment)} = {p} AND {q.format_column(c.segment_row)} = {p}"
                f" AND {q.format_column(c.segment_kind)} IS NULL")
    return sql


def _db_now_sql(dialect: Any) -> str:
    """The database's clock, seconds since the epoch, as SQL. Retirement times are
    stamped and compared with it (``segments.retired_at``), so the GC grace does not
    depend on the clocks of the machines that retire and collect agreeing."""
    if dialect.name == "postgresql":
        return "EXTRACT(EPOCH FROM clock_timestamp())::float8"
    return "((julianday('now') - 2440587.5) * 86400.0)"


def _retire_emptied(conn: Connection, names: Collection[str], now: float | None = None) -> None:
    """Retire these segments if no index row names them any more (driver SQL:
    ``_named_clause`` spelled out, one probe of ``ix_events_segment`` each), at
    the database's time (``now`` is ignored: kept for callers)."""
    g, e = _quoted(conn, segments), _quoted(conn, events)
    for part in _chunks(sorted(names)):
        conn.exec_driver_sql(
            f"UPDATE {g.table} SET {g.retired_at} = {_db_now_sql(conn.dialect)} "
            f"WHERE {g.name} IN ({', '.join([g.p] * len(part))}) "
            f"AND {g.retired_at} IS NULL AND {g.kind} = 'events' "
            f"AND NOT EXISTS (SELECT 1 FROM {e.table} WHERE {e.table}.{e.segment} = {g.table}.{g.name})",
            tuple(part))


def _insert(conn: Connection, table: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """One executemany of ``rows`` through the driver (``_DriverSql.insert_rows``)."""
    _driver_sql(conn).insert_rows(conn, table, rows)


def _write_labels(conn: Any, sql: "_DriverSql", rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The label rows of an append (after its events, under the log_head lock):
    ``unresolved_labels`` of its generations, ``version_labels`` of its
    version_label events, and a ``trajectory_released`` event for each finished
    trajectory whose last missing label this append maps. Returns those events.

    The materializer decides from positions alone: a trajectory finished at
    ``F`` folds there iff every label it waits for was mapped before ``F``;
    else it is held, and the version_label that maps its last missing label
    (after ``F``, so this append saw it finished) adds the release event it
    folds at. Exactly one of the two happens."""
    pending = [{"event_position": r["position"], "label": label, "trajectory_id": r["trajectory_id"]}
               for r in rows for label in (r.get("unresolved_labels") or ())]
    if pending:
        sql.insert_rows(conn, unresolved_labels, pending)
    now = time.time()
    mapped = [{"label": r["version_label"], "model_version": r["model_version"], "position": r["position"],
               "created_at": now} for r in rows if r.get("version_label") is not None]
    if not mapped:
        return []
    sql.insert_rows(conn, version_labels, mapped)
    first = min(m["position"] for m in mapped)
    waiting: dict[str, list[Any]] = {}
    for tid, pos, finished_at, status in sql.labels_of_waiting(conn, [m["label"] for m in mapped]):
        waiting.setdefault(tid, [finished_at, status, []])[2].append(pos)
    released = sorted(tid for tid, (finished_at, _, positions) in waiting.items()
                      if finished_at is not None and None not in positions
                      and max(positions) > finished_at and max(positions) >= first)
    if not released:
        return []
    out = []
    for tid, position in zip(released, sql.positions(conn, len(released))):
        row: dict[str, Any] = dict.fromkeys(c.name for c in events.columns)
        row.update(position=position, trajectory_id=tid, type=RELEASED, status=waiting[tid][1],
                   content_hash=b"\x00", created_at=now)
        out.append(row)
    sql.insert_rows(conn, events, out)
    return out


def _write_trajectories(conn: Any, sql: "_DriverSql", writes: Sequence[TrajectoryWrite],
                        rows: list[dict[str, Any]]) -> None:
    """Insert new trajectory rows, update existing ones guarded by their revision
    (``StaleState`` when another writer moved one), in trajectory id order."""
    marks: dict[str, dict[str, int]] = {}
    for r in rows:
        if r["type"] == "trajectory_started":
            marks.setdefault(r["trajectory_id"], {})["started_position"] = r["position"]
        elif r["type"] == "trajectory_finished":
            marks.setdefault(r["trajectory_id"], {})["finished_position"] = r["position"]
    inserts: list[dict[str, Any]] = []
    updates: list[tuple[dict[str, Any], int]] = []
    for w in sorted(writes, key=lambda w: w.row["trajectory_id"]):
        row = dict(w.row, **marks.get(w.row["trajectory_id"], {}))
        if w.expected_revision is None:
            inserts.append(row)
        else:
            updates.append((row, w.expected_revision))
    if inserts:
        sql.insert_rows(conn, trajectories, inserts)
    if updates:
        n = sql.update_trajectories(conn, updates)
        if n != len(updates):
            raise StaleState(f"{len(updates) - n} of {len(updates)} trajectories changed concurrently "
                             f"({', '.join(repr(r['trajectory_id']) for r, _ in updates[:3])}...)")


class _DriverSql:
    """The append path's statements (and the materializer's inserts) as driver
    SQL, built once per dialect.

    SQLAlchemy Core spent about 4 ms per append compiling, caching and
    coercing half a dozen small statements; these go straight to the driver
    through ``exec_driver_sql`` (so driver errors are still wrapped and
    ``translate``d) with SQLAlchemy's own bind and result processors of each
    column applied to the values (JSON, booleans, floats bind exactly as Core
    binds them). Executemany of ready tuples: both drivers sum an
    executemany's rowcount (``supports_sane_multi_rowcount``)."""

    def __init__(self, dialect: Any) -> None:
        if not dialect.supports_sane_multi_rowcount:  # pragma: no cover - both supported drivers have it
            raise IndexInvariantError(f"driver {dialect.driver!r} does not report an executemany's rowcount")
        self.dialect = dialect
        self.single_writer = dialect.name == "sqlite"  # one write lock per database, taken at BEGIN
        self.p = "?" if dialect.paramstyle == "qmark" else "%s"
        self.q = dialect.identifier_preparer
        q = self.q
        if dialect.name == "postgresql":
            # the transaction id first (the WHERE runs before the first nextval), then the
            # positions: the order the tail's bound relies on (module doc)
            self.take_positions = ("SELECT nextval('log_positions') FROM generate_series(1, %s) "
                                   "WHERE pg_current_xact_id() IS NOT NULL")
        else:
            self.take_positions = (f"UPDATE {q.format_table(log_head)} SET {q.format_column(log_head.c.position)} = "
                                   f"{q.format_column(log_head.c.position)} + {self.p} WHERE "
                                   f"{q.format_column(log_head.c.id)} = 1 RETURNING "
                                   f"{q.format_column(log_head.c.position)}")
        self._statements: dict[tuple, tuple[str, list[Callable[[Any], Any] | None]]] = {}
        self._binds: dict[Any, Callable[[Any], Any] | None] = {}
        self._results: dict[Any, Callable[[Any], Any] | None] = {}
        self._traj_cols = [c.name for c in trajectories.columns]
        self._traj_select = (f"SELECT {', '.join(q.format_column(c) for c in trajectories.columns)} "
                             f"FROM {q.format_table(trajectories)} WHERE "
                             f"{q.format_column(trajectories.c.trajectory_id)} IN ")
        self._ident_select = (f"SELECT {q.format_column(events.c.identity)}, {q.format_column(events.c.content_hash)} "
                              f"FROM {q.format_table(events)} WHERE {q.format_column(events.c.identity)} IN ")

    def _bind(self, column: Any) -> Callable[[Any], Any] | None:
        if column not in self._binds:
            self._binds[column] = column.type.dialect_impl(self.dialect).bind_processor(self.dialect)
        return self._binds[column]

    def _result(self, column: Any, coltype: Any) -> Callable[[Any], Any] | None:
        """The column's result processor for the driver's type code ``coltype``."""
        key = (column, coltype)
        if key not in self._results:
            self._results[key] = column.type.dialect_impl(self.dialect).result_processor(self.dialect, coltype)
        return self._results[key]

    def _params(self, rows: Sequence[Mapping[str, Any]], names: Sequence[str],
                procs: Sequence[Callable[[Any], Any] | None]) -> list[tuple]:
        convert = [(i, f) for i, f in enumerate(procs) if f is not None]
        out = []
        for r in rows:
            values = list(map(r.get, names))
            for i, f in convert:
                values[i] = f(values[i])
            out.append(tuple(values))
        return out

    def insert_rows(self, conn: Any, table: Any, rows: Sequence[Mapping[str, Any]]) -> None:
        """One executemany; the columns are the union of the rows' keys (missing ones NULL)."""
        keys = set().union(*rows)
        names = tuple(c.name for c in table.columns if c.name in keys)
        key = ("insert", table.name, names)
        if key not in self._statements:
            q = self.q
            sql = (f"INSERT INTO {q.format_table(table)} ({', '.join(q.format_column(table.c[n]) for n in names)}) "
                   f"VALUES ({', '.join([self.p] * len(names))})")
            self._statements[key] = (sql, [self._bind(table.c[n]) for n in names])
        sql, procs = self._statements[key]
        _execute(conn, sql, self._params(rows, names, procs))

    def update_trajectories(self, conn: Any, updates: Sequence[tuple[dict[str, Any], int]]) -> int:
        """Guarded updates (``revision`` must still be the expected one); the number of rows updated."""
        n = 0
        groups: dict[tuple[str, ...], list[tuple[dict[str, Any], int]]] = {}
        for row, rev in updates:
            groups.setdefault(tuple(k for k in self._traj_cols if k in row and k != "trajectory_id"),
                              []).append((row, rev))
        for names, group in groups.items():
            key = ("update", names)
            if key not in self._statements:
                q, p, t = self.q, self.p, trajectories
                sets = ", ".join(f"{q.format_column(t.c[n])} = {p}" for n in names)
                sql = (f"UPDATE {q.format_table(t)} SET {sets} WHERE {q.format_column(t.c.trajectory_id)} = {p} "
                       f"AND {q.format_column(t.c.revision)} = {p}")
                self._statements[key] = (sql, [self._bind(t.c[n]) for n in names])
            sql, procs = self._statements[key]
            params = [values + (row["trajectory_id"], rev)
                      for values, (row, rev) in zip(self._params([r for r, _ in group], names, procs), group)]
            n += _execute(conn, sql, params).rowcount
        return n

    def lookup_identities(self, cur: Any, identities: Collection[str]) -> dict[str, bytes]:
        """Stored content digests of ``identities``, read with driver cursor ``cur``."""
        out: dict[str, bytes] = {}
        for part in _chunks(sorted(set(identities))):
            cur.execute(self._ident_select + "(" + ", ".join([self.p] * len(part)) + ")", tuple(part))
            out.update({ident: bytes(digest) for ident, digest in cur.fetchall()})
        return out

    def load_labels(self, cur: Any, labels: Collection[str]) -> dict[str, int]:
        """The label map's entries for ``labels`` (missing ones are absent)."""
        q, v = self.q, version_labels
        out: dict[str, int] = {}
        for part in _chunks(sorted(set(labels))):
            cur.execute(f"SELECT {q.format_column(v.c.label)}, {q.format_column(v.c.model_version)} FROM "
                        f"{q.format_table(v)} WHERE {q.format_column(v.c.label)} IN "
                        f"({', '.join([self.p] * len(part))})", tuple(part))
            out.update({label: int(mv) for label, mv in cur.fetchall()})
        return out

    def positions(self, cur: Any, n: int) -> Sequence[int]:
        """Take ``n`` log positions in this transaction: consecutive from the
        counter row on SQLite; increasing, not necessarily consecutive, from the
        sequence on PostgreSQL (module doc)."""
        cur.execute(self.take_positions, (n,))
        if self.single_writer:
            (last,) = cur.fetchone()
            return range(last - n + 1, last + 1)
        return sorted(p for (p,) in cur.fetchall())

    # The held-back rule (``_write_labels``) decides from positions alone: a
    # trajectory folds at its finish iff every label it waits on was mapped at a
    # lower position, else the version_label append that maps the last one adds
    # its release. That needs the two kinds of append to see each other in
    # position order. SQLite has one writer at a time. On PostgreSQL positions
    # come from a sequence, so a version_label append (position 12) could run its
    # release query before a concurrent finish (position 11) commits: neither
    # would release, and the trajectory would wait forever. So an append that maps
    # a label, or that finishes a trajectory with unresolved labels, first takes
    # one transaction-level advisory lock: those appends take their positions and
    # commit one after another, each seeing the ones before. Every other append
    # (generations, the finishes of trajectories that never waited on a label)
    # takes no lock.
    LABELS_LOCK_KEY = 0x7472616A_6C61  # "trajla": any fixed bigint no other code uses

    def touches_labels(self, cur: Any, event_rows: Sequence[Mapping[str, Any]]) -> bool:
        if any(r.get("version_label") is not None for r in event_rows):
            return True
        finishing = {r["trajectory_id"] for r in event_rows if r["type"] == "trajectory_finished"}
        if not finishing:
            return False
        if any(r.get("unresolved_labels") for r in event_rows if r["trajectory_id"] in finishing):
            return True
        # an earlier call of a finishing trajectory left an unresolved label (those rows
        # are committed: the trajectory row's revision guard orders appends to it)
        for part in _chunks(sorted(finishing)):
            cur.execute(f"SELECT 1 FROM {self.q.format_table(unresolved_labels)} "
                        f"WHERE trajectory_id IN ({', '.join([self.p] * len(part))}) LIMIT 1", list(part))
            if cur.fetchone() is not None:
                return True
        return False

    def lock_labels(self, cur: Any) -> None:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (self.LABELS_LOCK_KEY,))
        cur.fetchall()

    def labels_of_waiting(self, cur: Any, labels: Sequence[str]) -> list[tuple[str, int | None, int | None, str]]:
        """For every trajectory waiting on one of ``labels``: each label it waits on as
        ``(trajectory_id, position the label was mapped at or None, finished_position, status)``."""
        q, p = self.q, self.p
        u, v, t = "u", "v", "t"
        out: list[tuple[str, int | None, int | None, str]] = []
        for part in _chunks(sorted(set(labels))):
            cur.execute(
                f"SELECT {u}.trajectory_id, {v}.position, {t}.finished_position, {t}.status "
                f"FROM {q.format_table(unresolved_labels)} {u} "
                f"JOIN {q.format_table(trajectories)} {t} ON {t}.trajectory_id = {u}.trajectory_id "
                f"LEFT JOIN {q.format_table(version_labels)} {v} ON {v}.label = {u}.label "
                f"WHERE {u}.trajectory_id IN (SELECT w.trajectory_id FROM {q.format_table(unresolved_labels)} w "
                f"WHERE w.label IN ({', '.join([p] * len(part))}))", tuple(part))
            out.extend(cur.fetchall())
        return out

    def load_trajectories(self, cur: Any, trajectory_ids: Collection[str]) -> dict[str, dict[str, Any]]:
        """Trajectory rows by id, read with driver cursor ``cur`` (values through
        the columns' result processors, as a SQLAlchemy result gives them)."""
        out: dict[str, dict[str, Any]] = {}
        names = self._traj_cols
        for part in _chunks(sorted(set(trajectory_ids))):
            cur.execute(self._traj_select + "(" + ", ".join([self.p] * len(part)) + ")", tuple(part))
            procs = [self._result(c, d[1]) for c, d in zip(trajectories.columns, cur.description)]
            for values in cur.fetchall():
                row = {n: v if f is None else f(v) for n, v, f in zip(names, values, procs)}
                out[row["trajectory_id"]] = row
        return out


_DRIVER_SQL: "weakref.WeakKeyDictionary[Any, _DriverSql]" = weakref.WeakKeyDictionary()


def _driver_sql(conn: Connection) -> _DriverSql:
    """The driver statements of ``conn``'s dialect (built on first use)."""
    return _driver_sql_of(conn.dialect)


def _driver_sql_of(dialect: Any) -> _DriverSql:
    sql = _DRIVER_SQL.get(dialect)
    if sql is None:
        sql = _DRIVER_SQL[dialect] = _DriverSql(dialect)
    return sql


def _head(conn: Connection) -> int:
    """The highest stored position (0: none). On PostgreSQL the highest event's; the
    sequence also counts positions of appends that rolled back."""
    if conn.dialect.name == "postgresql":
        return int(conn.execute(select(func.coalesce(func.max(events.c.position), 0))).scalar_one())
    return int(conn.execute(select(log_head.c.position).where(log_head.c.id == 1)).scalar_one())


def _events_landed(conn: Connection, rows: list[dict[str, Any]]) -> bool:
    """Are exactly these rows stored at their positions (same trajectory, type and content)?"""
    want = {r["position"]: (r["trajectory_id"], r["type"], bytes(r["content_hash"])) for r in rows}
    got: dict[int, tuple[str, str, bytes]] = {}
    for part in _chunks(sorted(want)):
        q = select(events.c.position, events.c.trajectory_id, events.c.type, events.c.content_hash) \
            .where(events.c.position.in_(part))
        got.update({r.position: (r.trajectory_id, r.type, bytes(r.content_hash)) for r in conn.execute(q)})
    return got == want


class SqlSampleIndex(SampleIndex):
    """The sample index over the same engines as the log."""

    def __init__(self, write_engine: Engine, read_engine: Engine, db: _Db | None = None) -> None:
        self.db = db or _Db(write_engine, read_engine)

    def load_checkpoint(self, shard: Shard) -> dict[str, Any] | None:
        key = str(Shard.parse(str(shard)))
        names = [c.name for c in materializer_checkpoints.columns]
        with self.db.reading("reading a materializer checkpoint") as conn:
            # driver SQL, like the materializer's other statements (a new engine would compile a select)
            c = _quoted(conn, materializer_checkpoints)
            row = conn.exec_driver_sql(f"SELECT {', '.join(getattr(c, n) for n in names)} FROM {c.table} "
                                       f"WHERE {c.shard} = {c.p}", (key,)).first()
        return dict(zip(names, row)) if row else None

    def checkpoints(self) -> dict[Shard, dict[str, Any]]:
        with self.db.reading("reading materializer checkpoints") as conn:
            rows = [dict(r._mapping) for r in conn.execute(select(materializer_checkpoints))]
        return {Shard.parse(r["shard"]): r for r in rows}

    def commit_samples(
        self,
        shard: Shard,
        sample_rows: Sequence[dict[str, Any]],
        segment_row: Mapping[str, Any] | None,
        checkpoint: Mapping[str, Any],
        expected_position: int,
        *,
        unfoldable_rows: Sequence[dict[str, Any]] = (),
        repoints: Sequence[Repoint] = (),
    ) -> None:
        key = str(Shard.parse(str(shard)))
        cp = dict(checkpoint, shard=key, updated_at=time.time())
        cps = materializer_checkpoints

        def body(conn: Connection) -> None:
            # Driver SQL throughout (a new store's engine would compile every statement).
            # The guarded UPDATE is the position check: a concurrent materializer of
            # this shard that moved the checkpoint leaves it matching no row.
            c = _quoted(conn, cps)
            if expected_position == 0 and conn.exec_driver_sql(
                    f"SELECT {c.shard} FROM {c.table} WHERE {c.shard} = {c.p}", (key,)).first() is None:
                _insert(conn, cps, [cp])  # a concurrent first commit: primary key race -> StaleState
            else:
                names = [n for n in cp if n != "shard"]
                res = conn.exec_driver_sql(
                    f"UPDATE {c.table} SET {', '.join(f'{getattr(c, n)} = {c.p}' for n in names)} "
                    f"WHERE {c.shard} = {c.p} AND {c.position} = {c.p}",
                    tuple(cp[n] for n in names) + (key, expected_position))
                if res.rowcount != 1:
                    raise StaleState(f"shard {key!r} checkpoint is no longer at {expected_position}")
            if segment_row is not None:
                _insert(conn, segments, [segment_row])
            if sample_rows:
                _insert(conn, samples, sample_rows)
            if unfoldable_rows:
                _insert(conn, unfoldable_trajectories, unfoldable_rows)
            if repoints:
                _repoint(conn, repoints, guarded=False)
                _retire_emptied(conn, {m.old_segment for m in repoints if m.old_segment}, cp["updated_at"])

        def landed(conn: Connection, _: None) -> bool:
            pos = conn.execute(select(cps.c.position).where(cps.c.shard == key)).scalar_one_or_none()
            return pos is not None and pos >= int(checkpoint["position"])

        self.db.transaction(f"committing samples of shard {key}", body, landed=landed)

    def iter_sample_rows(self, *, where: Mapping[str, Any], after: tuple[int, int] | None,
                         page_rows: int) -> Iterator[list[dict[str, Any]]]:
        conds = _sample_filters(where)
        cursor = after
        while True:
            q = select(samples).where(*conds)
            if cursor is not None:
                fp, si = cursor
                q = q.where(or_(samples.c.finished_position > fp,
                                and_(samples.c.finished_position == fp, samples.c.sample_index > si)))
            q = q.order_by(samples.c.finished_position, samples.c.sample_index).limit(page_rows)
            with self.db.reading("reading sample rows") as conn:
                rows = [dict(r._mapping) for r in conn.execute(q)]
            if not rows:
                return
            yield rows
            cursor = (rows[-1]["finished_position"], rows[-1]["sample_index"])

    def count_samples(self) -> int:
        with self.db.reading("counting samples") as conn:
            return int(conn.execute(select(func.count()).select_from(samples)).scalar_one())

    def unfoldable_trajectories(self, *, limit: int = 20) -> dict[str, Any]:
        t = unfoldable_trajectories
        with self.db.reading("reading unfoldable trajectories") as conn:
            by_error = dict(conn.execute(select(t.c.error, func.count()).group_by(t.c.error)).all())
            recent = conn.execute(
                select(t.c.trajectory_id, t.c.finished_position, t.c.shard, t.c.error, t.c.rule, t.c.message)
                .order_by(t.c.finished_position.desc()).limit(limit)
            ).all()
        return {"count": sum(int(v) for v in by_error.values()),
                "by_error": {k: int(v) for k, v in sorted(by_error.items())},
                "recent": [dict(r._mapping) for r in recent]}


    def quarantined(self, error: str) -> list[dict[str, Any]]:
        t = unfoldable_trajectories
        with self.db.reading("reading quarantined trajectories") as conn:
            rows = conn.execute(select(t.c.trajectory_id, t.c.finished_position, t.c.shard)
                                .where(t.c.error == error).order_by(t.c.finished_position)).all()
        return [dict(r._mapping) for r in rows]

    def commit_refold(self, error: str, trajectory_ids: Sequence[str], sample_rows: Sequence[dict[str, Any]],
                      segment_row: Mapping[str, Any] | None, unfoldable_rows: Sequence[dict[str, Any]],
                      repoints: Sequence[Repoint]) -> None:
        t = unfoldable_trajectories

        def body(conn: Connection) -> None:
            # the guard: every one of them is still quarantined with ``error`` (no other refold took it)
            gone = 0
            for part in _chunks(sorted(trajectory_ids)):
                gone += conn.execute(t.delete().where(t.c.trajectory_id.in_(list(part)))
                                     .where(t.c.error == error)).rowcount
            if gone != len(set(trajectory_ids)):
                raise StaleState(f"{len(set(trajectory_ids)) - gone} quarantined trajectories were re-folded "
                                 "concurrently")
            if segment_row is not None:
                _insert(conn, segments, [segment_row])
            if sample_rows:
                _insert(conn, samples, sample_rows)
            if unfoldable_rows:
                _insert(conn, unfoldable_trajectories, unfoldable_rows)
            if repoints:
                _repoint(conn, repoints, guarded=False)
                _retire_emptied(conn, {m.old_segment for m in repoints if m.old_segment}, time.time())

        def landed(conn: Connection, _: None) -> bool:
            ids = sorted(set(trajectory_ids))[:_CHUNK]
            return not conn.execute(select(t.c.trajectory_id).where(t.c.trajectory_id.in_(ids))
                                    .where(t.c.error == error).limit(1)).first()

        self.db.transaction("re-folding quarantined trajectories", body, landed=landed)

    # -- named projections (docs/projections.md) ------------------------------
    def create_projection(self, row: Mapping[str, Any]) -> None:
        """Insert a ``projections`` row; ``ValidationError`` (rule ``projection``) when the name is taken."""
        def body(conn: Connection) -> None:
            if conn.execute(select(projections.c.name).where(projections.c.name == row["name"])).first():
                raise ValidationError(f"projection {row['name']!r} exists (drop it first to change its policy)",
                                      rule="projection")
            conn.execute(insert(projections).values(**row))

        try:
            self.db.transaction(f"creating projection {row['name']!r}", body)
        except StaleState:  # created concurrently
            raise ValidationError(f"projection {row['name']!r} exists", rule="projection") from None

    def projections(self) -> list[dict[str, Any]]:
        """Every projection's row, with ``num_samples`` and ``num_unfoldable``, by name."""
        with self.db.reading("listing projections") as conn:
            rows = [dict(r._mapping) for r in conn.execute(select(projections).order_by(projections.c.name))]
            n = dict(conn.execute(select(projection_samples.c.projection, func.count())
                                  .group_by(projection_samples.c.projection)).all())
            bad = dict(conn.execute(select(projection_unfoldable.c.projection, func.count())
                                    .group_by(projection_unfoldable.c.projection)).all())
        for r in rows:
            r["num_samples"], r["num_unfoldable"] = int(n.get(r["name"], 0)), int(bad.get(r["name"], 0))
        return rows

    def projection(self, name: str) -> "SqlProjectionIndex":
        """The sample index of projection ``name`` (``ValidationError`` when there is none)."""
        with self.db.reading("reading a projection") as conn:
            row = conn.execute(select(projections).where(projections.c.name == name)).first()
        if row is None:
            raise ValidationError(f"no projection {name!r} (trajstore projection list)", rule="projection")
        return SqlProjectionIndex(self.db, dict(row._mapping))

    def drop_projection(self, name: str) -> dict[str, int]:
        """In one transaction: delete projection ``name``'s samples, checkpoints,
        unfoldable rows and row, and retire its sample segments (``trajstore gc``
        deletes the files after its grace). The log, the default samples and other
        projections are untouched. Returns ``{"samples", "segments"}`` removed."""
        def body(conn: Connection) -> dict[str, int]:
            if conn.execute(select(projections.c.name).where(projections.c.name == name)).first() is None:
                raise ValidationError(f"no projection {name!r} (trajstore projection list)", rule="projection")
            ps = projection_samples
            names = sorted(conn.execute(select(ps.c.segment).where(ps.c.projection == name).distinct()).scalars())
            n = conn.execute(delete(ps).where(ps.c.projection == name)).rowcount
            for t in (projection_checkpoints, projection_unfoldable):
                conn.execute(delete(t).where(t.c.projection == name))
            conn.execute(delete(projections).where(projections.c.name == name))
            now = time.time()
            for part in _chunks(names):
                conn.execute(update(segments).where(segments.c.name.in_(part), segments.c.kind == "samples",
                                                    segments.c.retired_at.is_(None)).values(retired_at=now))
            return {"samples": int(n), "segments": len(names)}

        return self.db.transaction(f"dropping projection {name!r}", body)


class SqlProjectionIndex(SampleIndex):
    """The sample index of one named projection: its own rows of
    ``projection_samples``, ``projection_checkpoints`` and
    ``projection_unfoldable``. Its commits never re-point events (the default
    samples hold the one copy of the log's tokens) and never touch the
    default's tables."""

    def __init__(self, db: _Db, row: Mapping[str, Any]) -> None:
        self.db = db
        self.name = str(row["name"])
        self.row = dict(row)

    def load_checkpoint(self, shard: Shard) -> dict[str, Any] | None:
        key, t = str(Shard.parse(str(shard))), projection_checkpoints
        with self.db.reading("reading a projection checkpoint") as conn:
            row = conn.execute(select(t).where(t.c.projection == self.name, t.c.shard == key)).first()
        return None if row is None else {k: v for k, v in row._mapping.items() if k != "projection"}

    def checkpoints(self) -> dict[Shard, dict[str, Any]]:
        t = projection_checkpoints
        with self.db.reading("reading projection checkpoints") as conn:
            rows = [dict(r._mapping) for r in conn.execute(select(t).where(t.c.projection == self.name))]
        return {Shard.parse(r["shard"]): r for r in rows}

    def commit_samples(self, shard: Shard, sample_rows: Sequence[dict[str, Any]],
                       segment_row: Mapping[str, Any] | None, checkpoint: Mapping[str, Any],
                       expected_position: int, *, unfoldable_rows: Sequence[dict[str, Any]] = (),
                       repoints: Sequence[Repoint] = ()) -> None:
        if repoints:
            raise IndexInvariantError("a projection never re-points events (the default samples hold them)")
        key = str(Shard.parse(str(shard)))
        cp = dict(checkpoint, projection=self.name, shard=key, updated_at=time.time())
        t = projection_checkpoints

        def body(conn: Connection) -> None:
            # the projection must still exist: a drop between the fold and this commit wins
            if conn.execute(select(projections.c.token).where(projections.c.name == self.name)).scalar() \
                    != self.row["token"]:
                raise StaleState(f"projection {self.name!r} was dropped")
            if expected_position == 0 and conn.execute(
                    select(t.c.shard).where(t.c.projection == self.name, t.c.shard == key)).first() is None:
                conn.execute(insert(t).values(**cp))  # a concurrent first commit: primary key race -> StaleState
            else:
                res = conn.execute(update(t).where(t.c.projection == self.name, t.c.shard == key,
                                                   t.c.position == expected_position)
                                   .values(**{k: v for k, v in cp.items() if k not in ("projection", "shard")}))
                if res.rowcount != 1:
                    raise StaleState(f"projection {self.name!r} shard {key!r} checkpoint is no longer at "
                                     f"{expected_position}")
            if segment_row is not None:
                _insert(conn, segments, [segment_row])
            if sample_rows:
                _insert(conn, projection_samples, [dict(r, projection=self.name) for r in sample_rows])
            if unfoldable_rows:
                _insert(conn, projection_unfoldable, [dict(r, projection=self.name) for r in unfoldable_rows])

        def landed(conn: Connection, _: None) -> bool:
            pos = conn.execute(select(t.c.position).where(t.c.projection == self.name, t.c.shard == key)
                               ).scalar_one_or_none()
            return pos is not None and pos >= int(checkpoint["position"])

        self.db.transaction(f"committing samples of projection {self.name!r} shard {key}", body, landed=landed)

    def iter_sample_rows(self, *, where: Mapping[str, Any], after: tuple[int, int] | None,
                         page_rows: int) -> Iterator[list[dict[str, Any]]]:
        ps = projection_samples
        conds = [ps.c.projection == self.name, *_sample_filters(where, ps)]
        cursor = after
        while True:
            q = select(*[c for c in ps.columns if c.name != "projection"]).where(*conds)
            if cursor is not None:
                fp, si = cursor
                q = q.where(or_(ps.c.finished_position > fp,
                                and_(ps.c.finished_position == fp, ps.c.sample_index > si)))
            q = q.order_by(ps.c.finished_position, ps.c.sample_index).limit(page_rows)
            with self.db.reading("reading projection sample rows") as conn:
                rows = [dict(r._mapping) for r in conn.execute(q)]
            if not rows:
                return
            yield rows
            cursor = (rows[-1]["finished_position"], rows[-1]["sample_index"])

    def count_samples(self) -> int:
        ps = projection_samples
        with self.db.reading("counting projection samples") as conn:
            return int(conn.execute(select(func.count()).select_from(ps).where(ps.c.projection == self.name))
                       .scalar_one())

    def unfoldable_trajectories(self, *, limit: int = 20) -> dict[str, Any]:
        t = projection_unfoldable
        with self.db.reading("reading a projection's unfoldable trajectories") as conn:
            by_error = dict(conn.execute(select(t.c.error, func.count()).where(t.c.projection == self.name)
                                         .group_by(t.c.error)).all())
            recent = conn.execute(
                select(t.c.trajectory_id, t.c.finished_position, t.c.shard, t.c.error, t.c.rule, t.c.message)
                .where(t.c.projection == self.name).order_by(t.c.finished_position.desc()).limit(limit)).all()
        return {"count": sum(int(v) for v in by_error.values()),
                "by_error": {k: int(v) for k, v in sorted(by_error.items())},
                "recent": [dict(r._mapping) for r in recent]}


def open_sql(write_engine: Engine, read_engine: Engine) -> tuple[SqlEventLog, SqlSampleIndex]:
    """The log index and the sample index of one database, sharing its engines."""
    db = _Db(write_engine, read_engine)
    return SqlEventLog(write_engine, read_engine, db), SqlSampleIndex(write_engine, read_engine, db)


def _sample_filters(where: Mapping[str, Any], table: Any = samples) -> list[Any]:
    c = table.c
    conds: list[Any] = []
    if where.get("status") is not None:
        st = where["status"]
        conds.append(c.status.in_([st] if isinstance(st, str) else list(st)))
    if where.get("min_model_version") is not None:
        conds.append(c.min_model_version >= where["min_model_version"])
    if where.get("max_model_version") is not None:
        conds.append(c.max_model_version <= where["max_model_version"])
    if where.get("group_id") is not None:
        conds.append(c.group_id == where["group_id"])
    if where.get("trajectory_ids") is not None:
        conds.append(c.trajectory_id.in_(list(where["trajectory_ids"])))
    if where.get("max_finished_position") is not None:
        conds.append(c.finished_position <= where["max_finished_position"])
    return conds
