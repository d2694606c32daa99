"""The SQL a backend speaks: the driver statements every backend shares.

``SqlDialect`` holds the driver statements of the index's hot paths (the
append's reads and writes, the materializer's reads and commits, re-pointing,
retiring), built once per SQLAlchemy dialect; each backend's class
(``trajstore.log._sqlite.SQLite``, ``trajstore.log.postgres.PostgreSQL``,
through ``trajstore.log._backend.Backend``) adds what differs: how a driver
transaction begins, how an append takes its positions, the log head, the
database clock, how appends that map version labels are ordered, and the log
tail's bound. Everything else is portable SQLAlchemy Core in ``_events.py``
and ``_samples.py``.

Why driver statements. SQLAlchemy Core spent about 4 ms per append
compiling, caching and coercing half a dozen small statements (and a new
store's engine compiles every statement of a materializer commit); these go
straight to the driver, through ``exec_driver_sql`` on a SQLAlchemy
connection or straight on a driver cursor, so driver errors still reach the
one error boundary (``_errors``). SQLAlchemy's own bind and result processors
of each column are applied to the values (JSON, booleans, floats bind exactly
as Core binds them). Executemany of ready tuples: both drivers sum an
executemany's rowcount (``supports_sane_multi_rowcount``).

Positions, and why the materializer's tail is bounded. Tailing ``position >
checkpoint`` must never skip a row that commits late. SQLite has a single
writer (``BEGIN IMMEDIATE``): every append takes its positions from the
``log_head`` row and commits before the next one starts, so commits become
visible in position order (``single_writer``) and the tail needs no bound.
PostgreSQL appends take their positions from the sequence ``log_positions``
and never wait for each other, so a position may commit after a higher one:
the tail is bounded by ``PostgreSQL.settled_head``, and ``trajstore.log.postgres``
explains the bound and the invariant it keeps.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

from sqlalchemy import Connection

from trajstore.errors import IndexInvariantError
from trajstore.log.base import RELEASED, Repoint
from trajstore.schema import events, segments, trajectories, unresolved_labels, version_labels

__all__ = ["CHUNK", "SERVER_MARK", "SqlDialect", "chunks", "execute", "RESENT_IF_LOST"]

CHUNK = 500  # ids per IN (...) list
SERVER_MARK: Any = type("ServerMark", (), {"__repr__": lambda self: "SERVER_MARK"})()
"""A trajectory row's ``started_position``/``finished_position`` the server reads from the
event of that type just inserted in the same transaction (``PostgreSQL.insert_events_taking_positions``)."""


RESENT_IF_LOST: ContextVar[bool] = ContextVar("trajstore_resent_if_lost", default=False)
"""True while a write that is sent again when its connection turns out lost checks its
connection out (``_transaction.Database.checked``): a backend's checkout may then skip a
ping it makes only to find a dead connection before anything is sent
(``postgres._check_out``)."""


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

_BUILT: dict[tuple, tuple[dict, dict, dict]] = {}
"""(backend class, dialect, driver, paramstyle) -> the statements, bind and result
processors its stores built (``SqlDialect.__init__``)."""

FOLD_TRAJECTORY_COLUMNS = ("trajectory_id", "group_id", "num_experts", "route_layers", "route_topk", "seq_len")
FOLD_EVENT_COLUMNS = ("position", "trajectory_id", "type", "seq", "event_id", "model_version", "prompt_len",
                      "prefix_len", "output_len", "routes_start", "num_route_rows", "routes_dtype", "reward",
                      "has_token_rewards", "finish_reason", "segment", "segment_row", "segment_kind",
                      "version_spans", "sample_index", "is_merged", "weight_versions",
                      # what a projection with routes="last" needs to know was dropped (projections.md)
                      "num_route_rows_sent", "route_rows_resent", "route_rows_drifted",
                      # what the commit's run-view counts need besides (trajstore.log._aggregates._CALL_COLUMNS)
                      "min_model_version", "num_placeholder_logprobs")
_TYPE = FOLD_EVENT_COLUMNS.index("type")


class SqlDialect:
    """The driver statements of one SQLAlchemy dialect, built on first use and
    kept; each backend's class adds what differs (module doc)."""

    name = ""
    single_writer = False
    """One write lock per database, taken at BEGIN: appends commit in position order."""
    begin_read: str | None = None
    """What a read on a driver connection starts with (None: the driver begins by itself)."""
    begin_write: str | None = None
    """What a write transaction on a driver connection starts with."""
    lease_write: str | None = None
    """What a reader's lease transaction starts with: a reader login whose sessions
    are read-only by default (PostgreSQL's ``default_transaction_read_only``) may
    still write its own lease row (the only table its role may write)."""
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
        # Built statements and the columns' processors depend on the backend's class and the
        # driver only (no per-store or per-server SQL): every store of one kind in a process
        # shares them, so a new store's first append and materializer commit compile nothing
        # (about 5 % of the CPU of a new store's first appends of 64 calls went to building them).
        self._statements: dict[tuple, Any]
        self._binds: dict[Any, Callable[[Any], Any] | None]
        self._results: dict[Any, Callable[[Any], Any] | None]
        self._statements, self._binds, self._results = _BUILT.setdefault(
            (type(self), dialect.name, dialect.driver, dialect.paramstyle), ({}, {}, {}))
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
    def names_of(self, table: Any, rows: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
        """The columns of ``table`` any of ``rows`` has, in the table's order."""
        keys = set().union(*rows)
        # the table's column names kept (iterating a Table's columns builds a list each time)
        columns = self._cached(("columns", table.name), lambda: tuple(c.name for c in table.columns))
        return tuple(n for n in columns if n in keys)

    def insert_rows(self, conn: Any, table: Any, rows: Sequence[Mapping[str, Any]]) -> None:
        """One executemany; the columns are the union of the rows' keys (missing ones NULL)."""
        names = self.names_of(table, rows)
        sql, procs = self._cached(("insert", table.name, names), lambda: (
            f"INSERT INTO {self.table(table)} ({', '.join(self.col(table.c[n]) for n in names)}) "
            f"VALUES ({self.marks(len(names))})", [self._bind(table.c[n]) for n in names]))
        execute(conn, sql, self._params(rows, names, procs))

    def as_arrays(self, table: Any, names: Sequence[str], rows: Sequence[tuple]) -> tuple[str, tuple] | None:
        """Rows (tuples in ``names``' order) as one source of rows and its parameters (``SELECT
        * FROM unnest(...)`` and one list per column, on PostgreSQL), for an ``INSERT ... SELECT``;
        None where rows go one by one (SQLite; a single row; values that cannot go as arrays)."""
        return None

    def update_rows(self, conn: Any, table: Any, names: Sequence[str], key: str, rows: Sequence[tuple]) -> None:
        """``UPDATE table SET names WHERE key = ...`` for each row (the values of ``names``, then
        the key's): one executemany (on PostgreSQL, one statement of arrays)."""
        sql = self._cached(("update rows", table.name, tuple(names), key), lambda: (
            f"UPDATE {self.table(table)} SET {', '.join(f'{self.col(table.c[n])} = {self.p}' for n in names)} "
            f"WHERE {self.col(table.c[key])} = {self.p}"))
        execute(conn, sql, list(rows))

    def insert_tuples(self, conn: Any, parts: Sequence[tuple[Any, Sequence[str], list[tuple]]]) -> None:
        """Rows of several tables, each ``(table, names, rows)`` with the rows' values in
        ``names``' order: one executemany per table (on PostgreSQL, one statement for all)."""
        for table, names, rows in parts:
            if rows:
                sql = self._cached(("insert tuples", table.name, tuple(names)), lambda: (
                    f"INSERT INTO {self.table(table)} ({', '.join(self.col(table.c[n]) for n in names)}) "
                    f"VALUES ({self.marks(len(names))})"))
                execute(conn, sql, rows)

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

    def insert_events_taking_positions(self, cur: Any, rows: Sequence[Mapping[str, Any]]) -> Callable[[], list[int]]:
        """Insert ``rows`` (no ``position``), their positions taken by the INSERT itself; the
        returned function reads the positions (asked only where ``pipelined_writes``)."""
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
        # Every event of the trajectories, the types kept here: with a type condition in
        # the SQL, SQLite (no statistics) searched ix_events_type_position, i.e. every
        # generation and reward event of the log, instead of each trajectory's own.
        evs = conn.exec_driver_sql(f"{event_prefix}({marks}) ORDER BY {self.col(e.position)}", tuple(part)).fetchall()
        return trajs, [r for r in evs if r[_TYPE] in ("generation", "reward")]

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
