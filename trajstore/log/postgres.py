"""The PostgreSQL backend: the production database (psycopg 3), ``PostgreSQL``.

Transactions run at READ COMMITTED; appends take positions from the sequence
``log_positions`` and never wait for each other (below, "Positions").

Timeouts (docs/log.md, "Timeouts"): a server that accepts TCP and never
answers must not hang a command. Two URL query parameters, both named as
PostgreSQL names them, have defaults here:

* ``connect_timeout`` — seconds to wait for a connection (libpq's own
  parameter); default ``DEFAULT_CONNECT_TIMEOUT_S``; ``0`` waits forever;
* ``statement_timeout`` — the server setting, sent as
  ``options=-c statement_timeout=...``: milliseconds, or a number with a
  unit (``ms``, ``s``, ``min``, ``h``, ``d``); default
  ``DEFAULT_STATEMENT_TIMEOUT``; ``0`` disables it. It also bounds lock waits.

A connect that times out surfaces as ``StoreUnavailable`` (one line); so does
a statement cancelled by the timeout.

A pooled connection is checked at every checkout without a round trip
(``_check_out``): its socket is polled, and a connection whose server spoke
while it sat in the pool is pinged (``SELECT 1``) and replaced when the ping
fails. An idle connection has nothing to read; a server that stopped (a
restart, fast or immediate, a crash, a terminated backend) sent its
"terminating connection" notice and closed the socket, and both reach the
client before the server can accept connections again. So a caller's first
command after a restart gets a working connection however soon after its
last one the server went down, with every pooled connection broken alike.
A connection that sat in the pool ``PING_IDLE_S`` or more is pinged as well
(a peer gone without closing the socket: a network fault, a host reset),
except for a write that is sent again on a new connection when its own turns
out lost (``_dialect.RESENT_IF_LOST``: a trainer's step record, whose keys the
database makes unique, so the first send and the second cannot both land).
Under load an append reuses a connection within milliseconds, and a ping
there would be a round trip of its three: the poll costs a system call.
What the checks cannot see (the connection breaks after checkout, or a dead
peer never closed the socket) fails that command once: a lost connection
(``StoreUnavailable``; the append's read is retried on a new connection,
``_transaction.Database.reading_cursor``) and the connection is dropped.

Returning a connection to the pool rolls it back (``_reset``); when that fails
because the connection broke meanwhile (a server restart, a terminated
backend), the connection is invalidated quietly (the pool opens a new one when
it needs one), not logged as SQLAlchemy's "Exception during reset or similar"
traceback: nothing failed that the caller had not already been told about.

Positions, and why the materializer's tail is bounded. A counter row (as
SQLite's) would serialize every append on its row lock,
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
   assignment to its end) of this database's backends whose login may append
   (INSERT on ``events`` or USAGE/UPDATE on the sequence, itself or through a
   role it is a member of). An append holding a position <= H took it before
   H was read, so it had its id before then: it has ended, or it is in that
   list;
3. once none of the listed ids is running any more, no position <= H can
   commit any more, and reading up to H cannot skip one. Until then the
   previous such bound is used (``SqlEventLog.safe_position`` waits a little
   for the new one: appends take milliseconds).

   (Not ``pg_snapshot_xmax`` of a snapshot: it is one past the latest
   *completed* id, and a transaction with a higher id may already be
   running; a test with eight writers caught exactly that.)

The invariant this keeps: a transaction held open while later ones commit
is never skipped by the tail (tests/log/test_positions_pg.py holds one open
on a real second connection). The cost: any transaction with an id of a login
that may append (a long migration, a writer's session idle in a write
transaction) holds the tail back until it ends, never past it; a reader
login's (``trajstore init --reader-login``, an analyst's idle BI session
holding ``txid_current()``) does not, whatever it holds. (Revoking a login's
write rights while its append is in flight is the one way around the rule:
revoke them with its sessions ended.) Positions are unique and increasing per append, not
consecutive (a rolled-back append leaves a hole); ``head`` is the highest
stored one.

Read-only queries (``trajstore sql``, ``PostgreSQL.read_only``) are kept
read-only by the server: it refuses to run as a login holding more than the
reader's rights (a superuser, the owner, a writer: a query could switch back
to the login's own rights with ``set_config('role', 'none', false)``);
``trajstore init --reader-login NAME`` makes such a login. The query runs
inside ``BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY`` after ``SET LOCAL
ROLE trajstore_reader`` (made by migration 0002 with SELECT on the tables and
views, nothing else) and after a first statement has taken the transaction's
snapshot, so it can no longer be switched back to read-write. The query is
sent as one prepared statement (extended protocol), so ``...; DELETE ...`` is
refused by the server, and the transaction is always rolled back, never
committed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select as io_select
import time
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

from sqlalchemy import Connection, Engine, String, create_engine, event, func, select
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool, PoolResetState

from trajstore._util.backoff import Backoff
from trajstore.errors import IndexInvariantError, TrajstoreError, ValidationError, first_line
from trajstore.log._backend import Backend, ReadQuery
from trajstore.log._dialect import CHUNK, RESENT_IF_LOST, SERVER_MARK, chunks, execute
from trajstore.log._errors import driver_errors
from trajstore.log import _pg_arrays
from trajstore.log.base import Repoint
from trajstore.schema import events, trajectories, unresolved_labels

__all__ = ["DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_STATEMENT_TIMEOUT", "PostgreSQL", "default_payload_dir",
           "engine_options", "make_engines"]

DEFAULT_CONNECT_TIMEOUT_S = 10
DEFAULT_STATEMENT_TIMEOUT = "120s"
_READER_LOGIN_TIMEOUTS = {"idle_in_transaction_session_timeout": "60s", "statement_timeout": "300s"}
"""Set on a reader login by ``trajstore init --reader-login``: a session of it idle inside a
transaction for 60 s is ended, a statement running 5 min is cancelled (defaults of the
login; its transactions never hold the log's tail anyway, ``_MAY_APPEND_SQL``)."""

_DURATION = re.compile(r"^[0-9]+(ms|s|min|h|d)?$")


class _DropSecondReport(logging.Filter):
    """psycopg logs ``error ignored terminating <psycopg.Pipeline [BAD]>: ...`` when a pipeline
    (or COPY) it closes after an error fails again, as it does when the server goes away
    mid-append. The first error is already raised and reported as a trajstore error; this
    second line only repeats it in psycopg's words."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("error ignored terminating"))


def make_engines(url: str) -> tuple[Engine, Engine]:
    psycopg_log = logging.getLogger("psycopg")
    if not any(isinstance(f, _DropSecondReport) for f in psycopg_log.filters):
        psycopg_log.addFilter(_DropSecondReport())
    url, connect_args = engine_options(url)
    # reset_on_return=None: the "reset" listener below is the pool's reset (a rollback);
    # no pool_pre_ping: _check_out pings only connections that sat idle or whose server spoke
    engine = create_engine(url, pool_size=4, max_overflow=8, connect_args=connect_args,
                           pool_reset_on_return=None)
    event.listen(engine, "reset", _reset)
    event.listen(engine, "checkin", _checked_in)
    event.listen(engine, "checkout", _check_out)
    return engine, engine


PING_IDLE_S = 1.0
"""A pooled connection idle this long is pinged at checkout (module doc)."""
_IDLE_SINCE = "trajstore_idle_since"


def _checked_in(dbapi_connection: Any, record: Any) -> None:
    if record is not None:
        record.info[_IDLE_SINCE] = time.monotonic()


def _server_spoke(dbapi_connection: Any) -> bool:
    """Is there anything to read on an idle connection's socket (a notice, the end of the
    stream)? Nothing is read: one ``poll`` with no wait. A connection closed or broken on
    the client's side counts as one whose server spoke."""
    if dbapi_connection.closed or dbapi_connection.broken:
        return True
    try:
        fd = dbapi_connection.fileno()
        if hasattr(io_select, "poll"):
            poller = io_select.poll()
            poller.register(fd, io_select.POLLIN | io_select.POLLPRI)
            return bool(poller.poll(0))
        return bool(io_select.select([fd], [], [fd], 0)[0])  # (no poll: Windows)
    except Exception:  # noqa: BLE001 - no socket to poll: the connection is unusable
        return True


def _check_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """At checkout: a connection whose server spoke while it sat in the pool, or idle
    ``PING_IDLE_S`` or more, answers ``SELECT 1`` or is replaced (``DisconnectionError``
    makes the pool open a new one); any other is handed out without a round trip. An
    idle one is not pinged for a write that is sent again on a new connection when its
    own is lost (``RESENT_IF_LOST``, a trainer's step record): it finds out itself."""
    since = record.info.get(_IDLE_SINCE)
    if since is None:
        return  # just opened
    if (time.monotonic() - since < PING_IDLE_S or RESENT_IF_LOST.get()) and not _server_spoke(dbapi_connection):
        return  # (a write re-sent on a new connection if this one is lost needs no idle ping)
    try:
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        try:
            dbapi_connection.execute("SELECT 1", prepare=False)
        finally:
            dbapi_connection.autocommit = autocommit
    except Exception as e:  # noqa: BLE001 - any failure: the connection is unusable
        raise DisconnectionError(f"pooled connection failed its ping: {first_line(e)}") from None


_log = logging.getLogger("trajstore.log")


def _reset(dbapi_connection: Any, record: Any, state: PoolResetState) -> None:
    """A connection returned to the pool: roll back what it left open; a connection
    that broke meanwhile is invalidated (closed and dropped from the pool) quietly."""
    if state.transaction_was_reset or not state.asyncio_safe:
        return  # already rolled back by its SQLAlchemy Connection, or not ours to touch
    try:
        dbapi_connection.rollback()
    except Exception as e:  # noqa: BLE001 - any failure here means the connection is unusable
        _log.debug("a pooled connection failed its rollback on return (%s); dropping it",
                   str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        if record is not None:
            record.invalidate(e)


def engine_options(url: str) -> tuple[str, dict[str, str | int]]:
    """The URL psycopg gets and the connect arguments carrying the timeouts.

    ``statement_timeout`` is not a libpq parameter, so it leaves the URL and
    joins ``options``; ``connect_timeout`` stays in the URL when given."""
    u = make_url(url)
    query = dict(u.query)
    connect_args: dict[str, str | int] = {}
    given = query.get("connect_timeout")
    if given is None:
        connect_args["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT_S
    elif not (isinstance(given, str) and given.isdigit()):
        raise ValidationError(f"connect_timeout={given!r} in the store URL is not a whole number of seconds",
                              rule="url")
    statement = query.pop("statement_timeout", None)
    if statement is not None and not (isinstance(statement, str) and _DURATION.match(statement)):
        raise ValidationError(f"statement_timeout={statement!r} in the store URL is not a duration "
                              "(milliseconds, or a number with ms, s, min, h or d)", rule="url")
    options = query.pop("options", "")
    if isinstance(options, tuple):
        options = " ".join(options)
    if statement is None and "statement_timeout" in options:
        statement = ""  # given the libpq way (options=-c statement_timeout=...): keep it
    elif statement is None:
        statement = DEFAULT_STATEMENT_TIMEOUT
    if statement:
        options = f"{options} -c statement_timeout={statement}"
    connect_args["options"] = options.strip()
    return u.set(query=query).render_as_string(hide_password=False), connect_args


def default_payload_dir(url: str) -> str:
    """``$TRAJSTORE_PAYLOAD_DIR``, else ``./trajstore-payload/<database>``."""
    env = os.environ.get("TRAJSTORE_PAYLOAD_DIR")
    if env:
        return env
    return os.path.abspath(os.path.join("trajstore-payload", make_url(url).database or "trajstore"))


_SEQUENCE_LAST = "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM log_positions"
# Whether backend ``a``'s login may take log positions: it (or a role it may become) can
# insert events or advance the sequence. A login that cannot (a reader login, the
# ``trajstore_reader`` role's) holds no position, so its transactions never hold the tail.
_MAY_APPEND_SQL = ("EXISTS (SELECT 1 FROM pg_roles r WHERE pg_has_role(a.usesysid, r.oid, 'MEMBER') "
                  "AND (has_table_privilege(r.oid, to_regclass('events'), 'INSERT') "
                  "OR has_sequence_privilege(r.oid, to_regclass('log_positions'), 'USAGE, UPDATE')))")
# (this database's backends only: a long transaction elsewhere on the server does not hold the tail;
# and only a login's that may append, above)
_RUNNING_XIDS = ("SELECT l.transactionid::text FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                 "WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted "
                 f"AND l.transactionid IS NOT NULL AND a.datname = current_database() AND {_MAY_APPEND_SQL}")
_STILL_RUNNING = ("SELECT 1 FROM pg_locks WHERE locktype = 'transactionid' AND mode = 'ExclusiveLock' "
                  "AND granted AND transactionid::text = ANY(%s) LIMIT 1")


_MARK_TYPES = {"started_position": "trajectory_started", "finished_position": "trajectory_finished"}
"""The event type whose position a trajectory row's ``SERVER_MARK`` column takes."""


class PostgreSQL(Backend):
    """The production backend: positions from the sequence ``log_positions``
    (appends never wait for each other), so the tail is bounded; read-only
    queries under a role the server enforces (module doc)."""

    name = "postgresql"
    driver = "psycopg"
    autocommit_reads = True
    pipelined_writes = True
    payload_dir_from_env = True
    reader_logins = True
    lease_write = "SET TRANSACTION READ WRITE"
    MIGRATION_LOCK_KEY = 0x7472616A  # "traj": concurrent first connects migrate one after another
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
        """Rows as one statement of arrays (``_pg_arrays``); trajectories taking their
        positions in the INSERT one by one."""
        if table is not trajectories or not any(v is SERVER_MARK for r in rows for v in r.values()):
            if not _pg_arrays.insert_rows(self, conn, table, rows):
                super().insert_rows(conn, table, rows)
            return
        for row in rows:  # new trajectories of a batch taking its positions in its INSERT: few
            marked = tuple(k for k in _MARK_TYPES if row.get(k) is SERVER_MARK)
            names = tuple(c.name for c in table.columns if c.name in row and c.name not in marked)
            sql, procs = self._cached(("insert marked", names, marked), lambda: (
                f"INSERT INTO {self.table(table)} ({', '.join(self.col(table.c[n]) for n in names + marked)}) "
                f"VALUES ({', '.join([self.p] * len(names) + [self._mark(m) for m in marked])})",
                [self._bind(table.c[n]) for n in names]))
            (values,) = self._params([row], names, procs)
            execute(conn, sql, values + (row["trajectory_id"],) * len(marked))

    def as_arrays(self, table: Any, names: Sequence[str], rows: Sequence[tuple]) -> tuple[str, tuple] | None:
        arrays = _pg_arrays.arrays_of(table, names, rows)
        if arrays is None:
            return None
        return self._cached(("array source", table.name, tuple(names)),
                            lambda: _pg_arrays.array_source(self, table, names)), tuple(arrays)

    def update_rows(self, conn: Any, table: Any, names: Sequence[str], key: str, rows: Sequence[tuple]) -> None:
        if not _pg_arrays.update_rows(self, conn, table, names, key, rows):
            super().update_rows(conn, table, names, key, rows)

    def insert_tuples(self, conn: Any, parts: Sequence[tuple[Any, Sequence[str], list[tuple]]]) -> None:
        if not _pg_arrays.insert_tuples(self, conn, parts):
            super().insert_tuples(conn, parts)

    def repoint(self, conn: Any, moves: Sequence[Repoint], *, guarded: bool) -> int:
        return _pg_arrays.repoint(self, conn, moves, guarded=guarded)

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

    # -- the URL's level ----------------------------------------------------------
    @classmethod
    def make_engines(cls, url: str) -> tuple[Engine, Engine]:
        return make_engines(url)

    @classmethod
    def serialize_migrations(cls, conn: Any) -> None:
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({cls.MIGRATION_LOCK_KEY})")

    @classmethod
    def default_payload_dir(cls, url: str) -> str:
        return default_payload_dir(url)

    @classmethod
    @contextlib.contextmanager
    def read_only(cls, url: str, timeout_s: float | None, role: str) -> Iterator[ReadQuery]:
        """One connection in a read-only REPEATABLE READ transaction under ``role``
        (module doc), with the store URL's timeouts (``timeout_s`` overrides the
        statement timeout); closed afterwards, never reused with the role."""
        import psycopg

        url, connect_args = engine_options(url)
        engine = create_engine(url, poolclass=NullPool, connect_args=connect_args)
        with driver_errors("cannot open store", mode="opening"):
            fairy = engine.raw_connection()
        conn: psycopg.Connection = fairy.driver_connection
        try:
            conn.rollback()
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            conn.read_only = True
            _enter_reader_role(conn, timeout_s, role)
            yield lambda sql: _execute(conn, sql, role)
        finally:
            with contextlib.suppress(Exception):
                conn.rollback()
            fairy.invalidate()  # closes it: the session's role and settings die with it
            engine.dispose()

    @classmethod
    def partition_events(cls, engine: Engine, *, rows: int, ahead: int, drop_empty: bool = False) -> dict[str, Any]:
        from trajstore.log._pg_partition import partition_events

        with driver_errors("partitioning the event index"):
            return partition_events(engine, rows=rows, ahead=ahead, drop_empty=drop_empty)

    @classmethod
    def make_reader_login(cls, engine: Engine, login: str, password: str | None, role: str) -> None:
        from sqlalchemy import text

        with engine.begin() as conn:
            exists = conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :n"), {"n": login}).first()
            attrs = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS INHERIT"
            conn.exec_driver_sql(f"{'ALTER' if exists else 'CREATE'} ROLE {login} {attrs}")
            if password:
                quoted = conn.exec_driver_sql("SELECT quote_literal(%(p)s)", {"p": password}).scalar()
                conn.exec_driver_sql(f"ALTER ROLE {login} PASSWORD {quoted}")
            conn.exec_driver_sql(f"GRANT {role} TO {login}")
            conn.exec_driver_sql(f"ALTER ROLE {login} SET default_transaction_read_only = on")
            # what one of its sessions may hold (an idle BI session, a runaway query): defaults of the login's
            for name, value in _READER_LOGIN_TIMEOUTS.items():
                conn.exec_driver_sql(f"ALTER ROLE {login} SET {name} = '{value}'")

    # -- what psycopg's errors mean: by SQLSTATE, and the server's words where it has none --
    @classmethod
    def lost_race(cls, e: BaseException) -> bool:
        return _sqlstate(e).startswith("40")  # serialization failure, deadlock

    @classmethod
    def unstorable(cls, e: BaseException) -> bool:
        return _sqlstate(e)[:2] in ("22", "54")  # data exception, program limit exceeded

    @classmethod
    def answered(cls, e: BaseException) -> bool:
        return _sqlstate(e)[:2] in _ANSWERED

    @classmethod
    def refused(cls, e: BaseException) -> bool:
        return _sqlstate(e)[:2] in ("22", "23")  # a value, a check, a key

    @classmethod
    def constraint(cls, e: BaseException) -> str | None:
        from trajstore.log._errors import RACE_KEYS

        name = getattr(getattr(e, "diag", None), "constraint_name", None)
        return RACE_KEYS.get(name, name) if name else None

    @classmethod
    def recovering(cls, e: BaseException) -> bool:
        return _sqlstate(e).startswith("57P") or any(t in str(e) for t in _RECOVERING_TEXT)

    @classmethod
    def unreached(cls, e: BaseException) -> bool:
        text = str(e).lower()
        return any(t in text for t in _UNREACHED_TEXT)

    @classmethod
    def query_reason(cls, e: BaseException, timeout_s: float | None) -> str:
        diag = getattr(e, "diag", None)  # the server's primary message and the character it points at
        position = getattr(diag, "statement_position", None)
        return first_line(getattr(diag, "message_primary", None) or str(e)) + (
            f" (at character {position})" if position else "")

    # -- the inspection views' fragments --------------------------------------------
    @classmethod
    def join_sorted(cls, column: str) -> str:
        return f"string_agg({column}, ',' ORDER BY {column})"

    @classmethod
    def version_spans(cls) -> str:
        return "generation_events g CROSS JOIN LATERAL json_array_elements(g.version_spans) AS j(value)"

    @classmethod
    def span_int(cls, key: str) -> str:
        return f"CAST(j.value ->> '{key}' AS INTEGER)"


def _sqlstate(e: BaseException) -> str:
    return str(getattr(e, "sqlstate", None) or "")


# SQLSTATE classes the server answers with (the transaction is rolled back, the connection fine):
# 22 data exception, 23 integrity constraint, 40 transaction rollback, 54 program limit exceeded
_ANSWERED = ("22", "23", "40", "54")
# a restart: starting up, in recovery, shutting down (SQLSTATE class 57P, or only the words
# when the server dropped the connection while terminating it)
_RECOVERING_TEXT = ("in recovery mode", "starting up", "shutting down", "terminating connection")
# no server answered: refused, timed out, dropped, no connection slot free (a Unix socket not there)
_UNREACHED_TEXT = ("connection refused", "could not connect", "timeout expired", "timed out",
                   "server closed the connection", "connection reset", "no route to host",
                   "not yet accepting connections", "too many clients", "no such file or directory")


# Rights a login must not hold to run inspection queries: with any of them a
# query could leave the read-only role (set_config('role', 'none', false)
# returns to the login) and act as the login itself.
_LOGIN_RIGHTS_SQL = """
SELECT r.rolsuper,
       r.rolcreaterole OR r.rolcreatedb OR r.rolbypassrls OR r.rolreplication AS admin,
       c.oid IS NOT NULL AND pg_has_role(session_user, c.relowner, 'MEMBER') AS owner,
       c.oid IS NOT NULL AND (has_table_privilege(session_user, c.oid, 'INSERT')
           OR has_table_privilege(session_user, c.oid, 'UPDATE')
           OR has_table_privilege(session_user, c.oid, 'DELETE')
           OR has_table_privilege(session_user, c.oid, 'TRUNCATE')) AS writer,
       (SELECT string_agg(p.rolname, ', ' ORDER BY p.rolname) FROM pg_roles p
         WHERE p.rolname IN ('pg_signal_backend', 'pg_read_server_files', 'pg_write_server_files',
                             'pg_execute_server_program', 'pg_write_all_data', 'pg_monitor',
                             'pg_checkpoint', 'pg_database_owner')
           AND pg_has_role(session_user, p.oid, 'MEMBER')) AS powers
FROM pg_roles r LEFT JOIN pg_class c ON c.oid = to_regclass('events')
WHERE r.rolname = session_user
"""


def _check_login(conn: Any, role: str) -> None:
    """Refuse a login that holds more than the reader's rights (superuser, owner, writer)."""
    with conn.cursor() as cur:
        cur.execute(_LOGIN_RIGHTS_SQL)
        row = cur.fetchone()
        cur.execute("SELECT session_user")
        (login,) = cur.fetchone()
    if row is None:
        return
    superuser, admin, owner, writer, powers = row
    why = ("a superuser" if superuser else "the store's owner (or a member of it)" if owner
           else "allowed to write the store" if writer else "allowed to create roles or databases" if admin
           else f"a member of {powers}" if powers else None)
    if why:
        raise TrajstoreError(
            f"trajstore sql will not run as {login!r}, {why}: connect as a login that holds only "
            f"the {role} role (trajstore init --reader-login NAME; see 'Read-only access' in docs/sql.md)")


def _enter_reader_role(conn: Any, timeout_s: float | None, role: str) -> None:
    with driver_errors(f"cannot switch to the read-only role {role} ({{reason}}); "
                       "see 'Read-only access' in docs/sql.md", mode="user_query"):
        _check_login(conn, role)
        with conn.cursor() as cur:
            cur.execute(f"SET LOCAL ROLE {role}")
    with conn.cursor() as cur:
        if timeout_s:
            cur.execute(f"SET LOCAL statement_timeout = {int(timeout_s * 1000)}")
        # Takes the snapshot: from here the transaction cannot become read-write.
        cur.execute("SELECT 1")


def _execute(conn: Any, sql: str, role: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    with driver_errors("SQL error", mode="user_query"), conn.cursor() as cur:
        # Again before every query: an earlier one may have run set_config('role', ...).
        cur.execute(f"SET LOCAL ROLE {role}")
        # prepare=True: one Parse message, so the server refuses a second statement.
        cur.execute(sql, prepare=True)
        columns = [d.name for d in cur.description or ()]
        rows = cur.fetchall() if cur.description else []
    return columns, rows
