"""The SQL a backend speaks: one typed dialect object per database, obtained once per engine.

``SqlDialect`` holds the driver statements of the index's hot paths (the
append's reads and writes, the materializer's reads and commits, re-pointing,
retiring), built once per dialect; ``SQLite`` and ``PostgreSQL`` add what
differs between the two backends: how a driver transaction begins, how an
append takes its positions, the log head, the database clock, how appends that
map version labels are ordered, and the log tail's bound. Everything else is
portable SQLAlchemy Core in ``_events.py`` and ``_samples.py``.

Why driver statements. SQLAlchemy Core spent about 4 ms per append
compiling, caching and coercing half a dozen small statements (and a new
store's engine compiles every statement of a materializer commit); these go
straight to the driver, through ``exec_driver_sql`` on a SQLAlchemy
connection or straight on a driver cursor, so driver errors still reach the
one error boundary (``_errors``). SQLAlchemy's own bind and result processors
of each column are applied to the values (JSON, booleans, floats bind exactly
as Core binds them). Executemany of ready tuples: both drivers sum an
executemany's rowcount (``supports_sane_multi_rowcount``).

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
never see 10. So the tail is bounded (``PostgreSQL.settled_head``):

1. an append gets its transaction id (``pg_current_xact_id()``) *before* its
   first ``nextval`` (the statement that takes positions assigns it first);
2. a tailer reads the sequence's last value H, then (a later statement) the
   transaction ids running now in this database: the ``transactionid`` locks
   in ``pg_locks`` (every transaction holds one on its own id from its
   assignment to its end) of this database's backends. An append holding a position <= H took it before H was read, so it
   had its id before then: it has ended, or it is in that list;
3. once none of the listed ids is running any more, no position <= H can
   commit any more, and reading up to H cannot skip one. Until then the
   previous such bound is used (``SqlEventLog.safe_position`` waits a little
   for the new one: appends take milliseconds).

   (Not ``pg_snapshot_xmax`` of a snapshot: it is one past the latest
   *completed* id, and a transaction with a higher id may already be
   running; a test with eight writers caught exactly that.)

The invariant this keeps: a transaction held open while later ones commit
is never skipped by the tail (tests/log/test_positions_pg.py holds one open
on a real second connection). The cost: any transaction with an id (a long
migration, a session idle in a write transaction) holds the tail back until
it ends, never past it. Positions are unique and increasing per append, not
consecutive (a rolled-back append leaves a hole); ``head`` is the highest
stored one.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

from sqlalchemy import Connection, Engine, String, func, select

from trajstore._backoff import Backoff
from trajstore.errors import IndexInvariantError
from trajstore.log.base import RELEASED, Repoint
from trajstore.schema import events, log_head, segments, trajectories, unresolved_labels, version_labels

__all__ = ["CHUNK", "SERVER_MARK", "PostgreSQL", "SQLite", "SqlDialect", "chunks", "sql_dialect", "execute"]

CHUNK = 500  # ids per IN (...) list
SERVER_MARK: Any = type("ServerMark", (), {"__repr__": lambda self: "SERVER_MARK"})()
"""A trajectory row's ``started_position``/``finished_position`` the server reads from the
event of that type just inserted in the same transaction (``PostgreSQL.insert_events_taking_positions``)."""
_MARK_TYPES = {"started_position": "trajectory_started", "finished_position": "trajectory_finished"}


def chunks(items: Sequence[Any], n: int = CHUNK) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def execute(target: Any, sql: str, params: Any) -> Any:
    """Driver SQL on a SQLAlchemy ``Connection`` or straight on a driver cursor
    (a list of parameter tuples: executemany). What it returns has ``rowcount``."""
    if isinstance(target, Connection):
        return target.exec_driver_sql(sql, params)
    if isinstance(params, list):
        target.executemany(sql, params)
    else:
        target.execute(sql, params)
    return target


Procs = list[Callable[[Any], Any] | None]

FOLD_TRAJECTORY_COLUMNS = ("trajectory_id", "group_id", "num_experts", "route_layers", "route_topk", "seq_len")
FOLD_EVENT_COLUMNS = ("position", "trajectory_id", "type", "seq", "event_id", "model_version", "prompt_len",
                      "prefix_len", "output_len", "routes_start", "num_route_rows", "routes_dtype", "reward",
                      "has_token_rewards", "finish_reason", "segment", "segment_row", "segment_kind",
                      "version_spans", "sample_index", "is_merged", "weight_versions",
                      # what a projection with routes="last" needs to know was dropped (projections.md)
                      "num_route_rows_sent", "route_rows_resent", "route_rows_drifted")


class SqlDialect:
    """The driver statements of one SQLAlchemy dialect, built on first use and
    kept; the subclasses add what differs between the backends."""

    name = ""
    single_writer = False
    """One write lock per database, taken at BEGIN: appends commit in position order."""
    begin_read: str | None = None
    """What a read on a driver connection starts with (None: the driver begins by itself)."""
    begin_write: str | None = None
    """What a write transaction on a driver connection starts with."""
    now_sql = ""
    """The database's clock, seconds since the epoch, as SQL. Retirement times are
    stamped and compared with it (``segments.retired_at``), so the GC grace does not
    depend on the clocks of the machines that retire and collect agreeing."""
    take_positions = ""
    autocommit_reads = False
    """Reads on a driver cursor run outside a transaction (``Database.reading_cursor``)."""
    pipelined_writes = False
    """A driver transaction's statements and COMMIT go out in the driver's pipeline mode
    (``Database.transaction``): statements whose results are not read must not be asked for a
    ``rowcount`` (guards raise on the server instead: ``update_trajectories``); the COMMIT goes alone."""

    def __init__(self, dialect: Any) -> None:
        if not dialect.supports_sane_multi_rowcount:  # pragma: no cover - both supported drivers have it
            raise IndexInvariantError(f"driver {dialect.driver!r} does not report an executemany's rowcount")
        self.dialect = dialect
        self.p = "?" if dialect.paramstyle == "qmark" else "%s"
        self.q = dialect.identifier_preparer
        self._statements: dict[tuple, Any] = {}
        self._binds: dict[Any, Callable[[Any], Any] | None] = {}
        self._results: dict[Any, Callable[[Any], Any] | None] = {}
        self._traj_cols = [c.name for c in trajectories.columns]

    # -- building ------------------------------------------------------------
    def marks(self, n: int) -> str:
        """``n`` parameter markers, comma-separated."""
        return ", ".join([self.p] * n)

    def table(self, table: Any) -> str:
        return self.q.format_table(table)

    def col(self, column: Any) -> str:
        return self.q.format_column(column)

    def _cached(self, key: tuple, build: Callable[[], Any]) -> Any:
        found = self._statements.get(key)
        if found is None:
            found = self._statements[key] = build()
        return found

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

    @staticmethod
    def _params(rows: Sequence[Mapping[str, Any]], names: Sequence[str], procs: Procs) -> list[tuple]:
        convert = [(i, f) for i, f in enumerate(procs) if f is not None]
        out = []
        for r in rows:
            values = list(map(r.get, names))
            for i, f in convert:
                values[i] = f(values[i])
            out.append(tuple(values))
        return out

    # -- generic statements ----------------------------------------------------
    def insert_rows(self, conn: Any, table: Any, rows: Sequence[Mapping[str, Any]]) -> None:
        """One executemany; the columns are the union of the rows' keys (missing ones NULL)."""
        keys = set().union(*rows)
        names = tuple(c.name for c in table.columns if c.name in keys)
        sql, procs = self._cached(("insert", table.name, names), lambda: (
            f"INSERT INTO {self.table(table)} ({', '.join(self.col(table.c[n]) for n in names)}) "
            f"VALUES ({self.marks(len(names))})", [self._bind(table.c[n]) for n in names]))
        execute(conn, sql, self._params(rows, names, procs))

    def select_where(self, conn: Any, table: Any, columns: Sequence[str], where: Mapping[str, Any]) -> Any:
        """``SELECT columns FROM table WHERE k = v AND ...`` (``where`` in the columns' order)."""
        keys = tuple(where)
        sql = self._cached(("select", table.name, tuple(columns), keys), lambda: (
            f"SELECT {', '.join(self.col(table.c[n]) for n in columns)} FROM {self.table(table)} "
            f"WHERE {' AND '.join(f'{self.col(table.c[k])} = {self.p}' for k in keys)}"))
        return execute(conn, sql, tuple(where[k] for k in keys))

    def update_where(self, conn: Any, table: Any, values: Mapping[str, Any], where: Mapping[str, Any]) -> int:
        """``UPDATE table SET values WHERE k = v AND ...``; the number of rows updated."""
        names, keys = tuple(values), tuple(where)
        sql, procs = self._cached(("update", table.name, names, keys), lambda: (
            f"UPDATE {self.table(table)} SET {', '.join(f'{self.col(table.c[n])} = {self.p}' for n in names)} "
            f"WHERE {' AND '.join(f'{self.col(table.c[k])} = {self.p}' for k in keys)}",
            [self._bind(table.c[n]) for n in names]))
        (params,) = self._params([values], names, procs)
        return execute(conn, sql, params + tuple(where[k] for k in keys)).rowcount

    # -- the append ------------------------------------------------------------
    def update_trajectories(self, conn: Any, updates: Sequence[tuple[dict[str, Any], int]]) -> int:
        """Guarded updates (``revision`` must still be the expected one); the number of rows updated."""
        n = 0
        groups: dict[tuple[str, ...], list[tuple[dict[str, Any], int]]] = {}
        for row, rev in updates:
            groups.setdefault(tuple(k for k in self._traj_cols if k in row and k != "trajectory_id"),
                              []).append((row, rev))
        t = trajectories
        for names, group in groups.items():
            sql, procs = self._cached(("update trajectories", names), lambda: (
                f"UPDATE {self.table(t)} SET {', '.join(f'{self.col(t.c[n])} = {self.p}' for n in names)} "
                f"WHERE {self.col(t.c.trajectory_id)} = {self.p} AND {self.col(t.c.revision)} = {self.p}",
                [self._bind(t.c[n]) for n in names]))
            params = [values + (row["trajectory_id"], rev)
                      for values, (row, rev) in zip(self._params([r for r, _ in group], names, procs), group)]
            n += execute(conn, sql, params).rowcount
        return n

    def load_append_state(self, cur: Any, identities: Collection[str], trajectory_ids: Collection[str]
                          ) -> tuple[dict[str, bytes], dict[str, dict[str, Any]]]:
        """``lookup_identities`` and ``load_trajectories`` with driver cursor ``cur``."""
        return self.lookup_identities(cur, identities), self.load_trajectories(cur, trajectory_ids)

    def lookup_identities(self, cur: Any, identities: Collection[str]) -> dict[str, bytes]:
        """Stored content digests of ``identities``, read with driver cursor ``cur``."""
        prefix = self._cached(("identities",), lambda: (
            f"SELECT {self.col(events.c.identity)}, {self.col(events.c.content_hash)} "
            f"FROM {self.table(events)} WHERE {self.col(events.c.identity)} IN "))
        out: dict[str, bytes] = {}
        for part in chunks(sorted(set(identities))):
            cur.execute(f"{prefix}({self.marks(len(part))})", tuple(part))
            out.update({ident: bytes(digest) for ident, digest in cur.fetchall()})
        return out

    def load_trajectories(self, cur: Any, trajectory_ids: Collection[str]) -> dict[str, dict[str, Any]]:
        """Trajectory rows by id, read with driver cursor ``cur`` (values through
        the columns' result processors, as a SQLAlchemy result gives them)."""
        prefix = self._cached(("trajectories",), lambda: (
            f"SELECT {', '.join(self.col(c) for c in trajectories.columns)} "
            f"FROM {self.table(trajectories)} WHERE {self.col(trajectories.c.trajectory_id)} IN "))
        out: dict[str, dict[str, Any]] = {}
        names = self._traj_cols
        for part in chunks(sorted(set(trajectory_ids))):
            cur.execute(f"{prefix}({self.marks(len(part))})", tuple(part))
            procs = [self._result(c, d[1]) for c, d in zip(trajectories.columns, cur.description)]
            for values in cur.fetchall():
                row = {n: v if f is None else f(v) for n, v, f in zip(names, values, procs)}
                out[row["trajectory_id"]] = row
        return out

    def load_labels(self, cur: Any, labels: Collection[str]) -> dict[str, int]:
        """The label map's entries for ``labels`` (missing ones are absent)."""
        v = version_labels
        out: dict[str, int] = {}
        for part in chunks(sorted(set(labels))):
            cur.execute(f"SELECT {self.col(v.c.label)}, {self.col(v.c.model_version)} FROM "
                        f"{self.table(v)} WHERE {self.col(v.c.label)} IN ({self.marks(len(part))})", tuple(part))
            out.update({label: int(mv) for label, mv in cur.fetchall()})
        return out

    def positions(self, cur: Any, n: int) -> Sequence[int]:
        """Take ``n`` log positions in this transaction (module doc)."""
        raise NotImplementedError

    def order_label_appends(self, cur: Any, event_rows: Sequence[Mapping[str, Any]]) -> None:
        """Before an append takes its positions: make the appends that map a version
        label, or finish a trajectory waiting on one, take positions and commit one
        after another (``_events._write_labels`` decides from positions alone)."""

    def labels_of_waiting(self, cur: Any, labels: Sequence[str]) -> list[tuple[str, int | None, int | None, str]]:
        """For every trajectory waiting on one of ``labels``: each label it waits on as
        ``(trajectory_id, position the label was mapped at or None, finished_position, status)``."""
        u, v, t = "u", "v", "t"
        out: list[tuple[str, int | None, int | None, str]] = []
        for part in chunks(sorted(set(labels))):
            cur.execute(
                f"SELECT {u}.trajectory_id, {v}.position, {t}.finished_position, {t}.status "
                f"FROM {self.table(unresolved_labels)} {u} "
                f"JOIN {self.table(trajectories)} {t} ON {t}.trajectory_id = {u}.trajectory_id "
                f"LEFT JOIN {self.table(version_labels)} {v} ON {v}.label = {u}.label "
                f"WHERE {u}.trajectory_id IN (SELECT w.trajectory_id FROM {self.table(unresolved_labels)} w "
                f"WHERE w.label IN ({self.marks(len(part))}))", tuple(part))
            out.extend(cur.fetchall())
        return out

    # -- the log's head and tail -------------------------------------------------
    def head(self, conn: Connection) -> int:
        """The highest stored position (0: none)."""
        raise NotImplementedError

    def settled_head(self, conn: Connection, wait_s: float) -> int | None:
        """The highest position below which no append can still commit, waiting up
        to ``wait_s`` for the appends in flight (None: they had not ended). Asked
        only when appends may commit out of position order (not ``single_writer``)."""
        raise NotImplementedError

    # -- the materializer's reads and writes --------------------------------------
    def finished_after(self, conn: Connection, after_position: int, limit: int, bound: int | None) -> list[tuple]:
        """``(position, trajectory_id, status, seq_len)`` of the next ``limit``
        trajectory_finished / released events after ``after_position``, up to ``bound``."""
        def build() -> str:
            e, t = events.c, trajectories.c
            return (f"SELECT e.{self.col(e.position)}, e.{self.col(e.trajectory_id)}, e.{self.col(e.status)}, "
                    f"t.{self.col(t.seq_len)} FROM {self.table(events)} e LEFT JOIN {self.table(trajectories)} t "
                    f"ON t.{self.col(t.trajectory_id)} = e.{self.col(e.trajectory_id)} "
                    f"WHERE e.{self.col(e.type)} IN ('trajectory_finished', '{RELEASED}') "
                    f"AND e.{self.col(e.position)} > {self.p} "
                    + ("" if bound is None else f"AND e.{self.col(e.position)} <= {self.p} ")
                    + f"ORDER BY e.{self.col(e.position)} LIMIT {self.p}")

        sql = self._cached(("finished after", bound is None), build)
        params = (int(after_position),) + (() if bound is None else (int(bound),)) + (int(limit),)
        return conn.exec_driver_sql(sql, params).fetchall()

    def fold_inputs(self, conn: Connection, part: Sequence[str]) -> tuple[list[tuple], list[tuple]]:
        """The ``FOLD_TRAJECTORY_COLUMNS`` of trajectories ``part`` and the
        ``FOLD_EVENT_COLUMNS`` of their generation and reward events (position order)."""
        e, t = events.c, trajectories.c
        traj_prefix, event_prefix = self._cached(("fold inputs",), lambda: (
            f"SELECT {', '.join(self.col(t[c]) for c in FOLD_TRAJECTORY_COLUMNS)} FROM {self.table(trajectories)} "
            f"WHERE {self.col(t.trajectory_id)} IN ",
            f"SELECT {', '.join(self.col(e[c]) for c in FOLD_EVENT_COLUMNS)} FROM {self.table(events)} "
            f"WHERE {self.col(e.trajectory_id)} IN "))
        marks = self.marks(len(part))
        trajs = conn.exec_driver_sql(f"{traj_prefix}({marks})", tuple(part)).fetchall()
        evs = conn.exec_driver_sql(f"{event_prefix}({marks}) AND {self.col(e.type)} IN ('generation', 'reward') "
                                   f"ORDER BY {self.col(e.position)}", tuple(part)).fetchall()
        return trajs, evs

    def repoint(self, conn: Any, moves: Sequence[Repoint], *, guarded: bool) -> int:
        """One executemany re-pointing ``moves`` (position order); guarded, each
        event must still be at its old (log) locator. The number of rows updated."""
        def build() -> str:
            c = events.c
            sql = (f"UPDATE {self.table(events)} SET {self.col(c.segment)} = {self.p}, "
                   f"{self.col(c.segment_row)} = {self.p}, {self.col(c.segment_kind)} = {self.p} "
                   f"WHERE {self.col(c.position)} = {self.p}")
            if guarded:
                sql += (f" AND {self.col(c.segment)} = {self.p} AND {self.col(c.segment_row)} = {self.p}"
                        f" AND {self.col(c.segment_kind)} IS NULL")
            return sql

        params = sorted(((m.segment, m.segment_row, m.segment_kind, m.position)
                         + ((m.old_segment, m.old_segment_row) if guarded else ()) for m in moves),
                        key=lambda t: t[3])
        return execute(conn, self._cached(("repoint", guarded), build), params).rowcount

    def retire_emptied(self, conn: Any, part: Sequence[str]) -> None:
        """Retire these log segments, at the database's time, if no event names
        them any more (one probe of ``ix_events_segment`` each)."""
        g = segments
        prefix = self._cached(("retire emptied",), lambda: (
            f"UPDATE {self.table(g)} SET {self.col(g.c.retired_at)} = {self.now_sql} WHERE {self.col(g.c.name)} IN "))
        suffix = (f" AND {self.col(g.c.retired_at)} IS NULL AND {self.col(g.c.kind)} = 'events' "
                  f"AND NOT EXISTS (SELECT 1 FROM {self.table(events)} WHERE {self.table(events)}."
                  f"{self.col(events.c.segment)} = {self.table(g)}.{self.col(g.c.name)})")
        execute(conn, f"{prefix}({self.marks(len(part))}){suffix}", tuple(part))


class SQLite(SqlDialect):
    """The embedded default: one writer at a time (``BEGIN IMMEDIATE``), positions
    from the ``log_head`` counter row, consecutive and committed in order."""

    name = "sqlite"
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


_SEQUENCE_LAST = "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM log_positions"
# (this database's backends only: a long transaction elsewhere on the server does not hold the tail)
_RUNNING_XIDS = ("SELECT l.transactionid::text FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                 "WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted "
                 "AND l.transactionid IS NOT NULL AND a.datname = current_database()")
_STILL_RUNNING = ("SELECT 1 FROM pg_locks WHERE locktype = 'transactionid' AND mode = 'ExclusiveLock' "
                  "AND granted AND transactionid::text = ANY(%s) LIMIT 1")


class PostgreSQL(SqlDialect):
    """The production backend: positions from the sequence ``log_positions``
    (appends never wait for each other), so the tail is bounded (module doc)."""

    name = "postgresql"
    autocommit_reads = True
    pipelined_writes = True
    now_sql = "EXTRACT(EPOCH FROM clock_timestamp())::float8"
    # the transaction id first (the WHERE runs before the first nextval), then the
    # positions: the order the tail's bound relies on (module doc)
    take_positions = ("SELECT nextval('log_positions') FROM generate_series(1, %s) "
                      "WHERE pg_current_xact_id() IS NOT NULL")

    def positions(self, cur: Any, n: int) -> Sequence[int]:
        """``n`` increasing positions from the sequence, not necessarily consecutive."""
        cur.execute(self.take_positions, (n,))
        return sorted(p for (p,) in cur.fetchall())

    def insert_events_taking_positions(self, cur: Any, rows: Sequence[Mapping[str, Any]]) -> Callable[[], list[int]]:
        """Insert ``rows`` (no ``position``) taking their positions in the INSERT itself, after
        the transaction id is assigned (the tail bound's order, module doc): ``nextval`` once
        per row, numbered in increasing order and joined to the rows by their order, so the
        batch's positions increase with its rows. Nothing is read here (an executemany
        with RETURNING would wait for its answers): the returned function reads the
        positions, in the pipeline once every later write was sent."""
        keys = set().union(*rows) - {"position"}
        names = tuple(c.name for c in events.columns if c.name in keys)
        procs = self._cached(("insert events taking positions", names),
                             lambda: [self._bind(events.c[n]) for n in names])
        # (a string column's cast has no length: an explicit cast to VARCHAR(n) would cut a
        # longer value where the INSERT's own assignment refuses it)
        casts = [f"CAST({self.p} AS {'TEXT' if isinstance(events.c[n].type, String) else events.c[n].type.compile(self.dialect)})"
                 for n in names]
        cols = ", ".join(self.col(events.c[n]) for n in names)
        params = self._params(rows, names, procs)
        step = max(1, 30000 // (len(names) + 1))  # bind parameters per statement stay under 65,535
        cursors = []
        for lo in range(0, len(params), step):
            part = params[lo:lo + step]
            values = ", ".join(f"({i}, {', '.join(casts)})" for i in range(1, len(part) + 1))
            sql = (f"WITH p AS (SELECT nextval('log_positions') AS position FROM generate_series(1, {len(part)}) "
                   "WHERE pg_current_xact_id() IS NOT NULL), "
                   "o AS (SELECT position, row_number() OVER (ORDER BY position) AS ord FROM p), "
                   f"v (ord, {', '.join(f'c{k}' for k in range(len(names)))}) AS (VALUES {values}) "
                   f"INSERT INTO {self.table(events)} ({self.col(events.c.position)}, {cols}) "
                   f"SELECT o.position, {', '.join(f'v.c{k}' for k in range(len(names)))} FROM v JOIN o USING (ord) "
                   f"RETURNING {self.col(events.c.position)}")
            taking = cur.connection.cursor()
            taking.execute(sql, [value for row in part for value in row])
            cursors.append(taking)

        def positions() -> list[int]:
            out: list[int] = []
            for taking in cursors:
                out += sorted(int(p) for (p,) in taking.fetchall())
                taking.close()
            if len(out) != len(rows):  # pragma: no cover - one RETURNING row per inserted row
                raise IndexInvariantError(f"{len(out)} positions for {len(rows)} events")
            return out
        return positions

    def _mark(self, name: str) -> str:
        t = self.table(events)
        return (f"(SELECT max({self.col(events.c.position)}) FROM {t} WHERE {self.col(events.c.trajectory_id)} = "
                f"{self.p} AND {self.col(events.c.type)} = '{_MARK_TYPES[name]}')")

    def insert_rows(self, conn: Any, table: Any, rows: Sequence[Mapping[str, Any]]) -> None:
        if table is not trajectories or not any(v is SERVER_MARK for r in rows for v in r.values()):
            return super().insert_rows(conn, table, rows)
        for row in rows:  # new trajectories of a batch taking its positions in its INSERT: few
            marked = tuple(k for k in _MARK_TYPES if row.get(k) is SERVER_MARK)
            names = tuple(c.name for c in table.columns if c.name in row and c.name not in marked)
            sql, procs = self._cached(("insert marked", names, marked), lambda: (
                f"INSERT INTO {self.table(table)} ({', '.join(self.col(table.c[n]) for n in names + marked)}) "
                f"VALUES ({', '.join([self.p] * len(names) + [self._mark(m) for m in marked])})",
                [self._bind(table.c[n]) for n in names]))
            (values,) = self._params([row], names, procs)
            execute(conn, sql, values + (row["trajectory_id"],) * len(marked))

    def update_trajectories(self, conn: Any, updates: Sequence[tuple[dict[str, Any], int]]) -> int:
        """Guarded updates whose guard the server checks: each update that finds its row at
        another revision inserts a copy of the row instead, which the primary key refuses (a
        lost race, ``StaleState``: the transaction rolls back). No ``rowcount`` is
        read, so the updates go out with the append's other writes (``pipelined_writes``)."""
        groups: dict[tuple[tuple[str, ...], tuple[str, ...]], list[tuple[dict[str, Any], int]]] = {}
        for row, rev in updates:
            marked = tuple(k for k in _MARK_TYPES if row.get(k) is SERVER_MARK)
            groups.setdefault((tuple(k for k in self._traj_cols if k in row and k != "trajectory_id"
                                     and k not in marked), marked), []).append((row, rev))
        t = trajectories
        for (names, marked), group in groups.items():
            sets = [f"{self.col(t.c[n])} = {self.p}" for n in names] + [f"{self.col(t.c[m])} = {self._mark(m)}"
                                                                         for m in marked]
            sql, procs = self._cached(("guarded update trajectories", names, marked), lambda: (
                f"WITH u AS (UPDATE {self.table(t)} SET "
                f"{', '.join(sets)} "
                f"WHERE {self.col(t.c.trajectory_id)} = {self.p} AND {self.col(t.c.revision)} = {self.p} "
                f"RETURNING 1) INSERT INTO {self.table(t)} SELECT * FROM {self.table(t)} "
                f"WHERE {self.col(t.c.trajectory_id)} = {self.p} AND NOT EXISTS (SELECT 1 FROM u)",
                [self._bind(t.c[n]) for n in names]))
            params = [values + (row["trajectory_id"],) * len(marked) + (row["trajectory_id"], rev, row["trajectory_id"])
                      for values, (row, rev) in zip(self._params([r for r, _ in group], names, procs), group)]
            execute(conn, sql, params)
        return len(updates)

    def load_append_state(self, cur: Any, identities: Collection[str], trajectory_ids: Collection[str]
                          ) -> tuple[dict[str, bytes], dict[str, dict[str, Any]]]:
        """Both in one statement (one round trip): the trajectory rows, then the stored
        identities' digests in two extra columns (NULL on the trajectory rows)."""
        idents, tids = sorted(set(identities)), sorted(set(trajectory_ids))
        if len(idents) > CHUNK or len(tids) > CHUNK:
            return super().load_append_state(cur, identities, trajectory_ids)

        def build() -> str:
            t, e = trajectories, events
            cols = ", ".join(self.col(c) for c in t.columns)
            nulls = ", ".join(f"CAST(NULL AS {c.type.compile(self.dialect)})" for c in t.columns)
            return (f"SELECT NULL, CAST(NULL AS BYTEA), {cols} FROM {self.table(t)} "
                    f"WHERE {self.col(t.c.trajectory_id)} = ANY({self.p}) UNION ALL "
                    f"SELECT {self.col(e.c.identity)}, {self.col(e.c.content_hash)}, {nulls} "
                    f"FROM {self.table(e)} WHERE {self.col(e.c.identity)} = ANY({self.p})")
        cur.execute(self._cached(("append state",), build), (tids, idents))
        procs = [self._result(c, d[1]) for c, d in zip(trajectories.columns, cur.description[2:])]
        names = self._traj_cols
        stored: dict[str, bytes] = {}
        rows: dict[str, dict[str, Any]] = {}
        for values in cur.fetchall():
            if values[0] is not None:
                stored[values[0]] = bytes(values[1])
                continue
            row = {n: v if f is None else f(v) for n, v, f in zip(names, values[2:], procs)}
            rows[row["trajectory_id"]] = row
        return stored, rows

    def head(self, conn: Connection) -> int:
        # the highest event's: the sequence also counts positions of appends that rolled back
        return int(conn.execute(select(func.coalesce(func.max(events.c.position), 0))).scalar_one())

    def settled_head(self, conn: Connection, wait_s: float) -> int | None:
        h = int(conn.exec_driver_sql(_SEQUENCE_LAST).scalar_one())
        running = [x for (x,) in conn.exec_driver_sql(_RUNNING_XIDS)]
        backoff = Backoff(first_s=0.0005, max_s=0.01)
        while True:
            if not running or conn.exec_driver_sql(_STILL_RUNNING, (running,)).first() is None:
                return h
            if backoff.exhausted(wait_s):
                return None
            backoff.pause()

    # The held-back rule (``_events._write_labels``) decides from positions alone: a
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

    def order_label_appends(self, cur: Any, event_rows: Sequence[Mapping[str, Any]]) -> None:
        # No result is read here: in the pipelined append (``pipelined_writes``) the lock
        # statements go out with the positions, in the same round trip.
        if self.touches_labels(cur, event_rows):
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (self.LABELS_LOCK_KEY,))
            return
        finishing = sorted({r["trajectory_id"] for r in event_rows if r["type"] == "trajectory_finished"})
        # an earlier call of a finishing trajectory left an unresolved label (those rows
        # are committed: the trajectory row's revision guard orders appends to it): the
        # lock is taken where the server finds one
        for part in chunks(finishing):
            cur.execute(f"SELECT pg_advisory_xact_lock(%s) FROM (SELECT 1 FROM {self.table(unresolved_labels)} "
                        f"WHERE trajectory_id IN ({self.marks(len(part))}) LIMIT 1) AS waiting",
                        [self.LABELS_LOCK_KEY, *part])

    def touches_labels(self, cur: Any, event_rows: Sequence[Mapping[str, Any]]) -> bool:
        """Does the batch itself map a label, or finish a trajectory with a label its own
        calls leave unresolved? (Labels left by earlier calls: ``order_label_appends``.)"""
        if any(r.get("version_label") is not None for r in event_rows):
            return True
        finishing = {r["trajectory_id"] for r in event_rows if r["type"] == "trajectory_finished"}
        return any(r.get("unresolved_labels") for r in event_rows if r["trajectory_id"] in finishing)


_BY_NAME: dict[str, type[SqlDialect]] = {"sqlite": SQLite, "postgresql": PostgreSQL}
_OF: "weakref.WeakKeyDictionary[Any, SqlDialect]" = weakref.WeakKeyDictionary()


def sql_dialect(engine: Engine) -> SqlDialect:
    """The dialect object of ``engine`` (one per SQLAlchemy dialect, built on first use)."""
    found = _OF.get(engine.dialect)
    if found is None:
        kind = _BY_NAME.get(engine.dialect.name)
        if kind is None:  # pragma: no cover - store.sql_dialect refuses other URLs first
            raise IndexInvariantError(f"no trajstore dialect for {engine.dialect.name!r}")
        found = _OF[engine.dialect] = kind(engine.dialect)
    return found
