"""The engines of one database and the one transaction wrapper every index statement runs in.

Every read (``reading``, ``reading_cursor``) and every write transaction
(``transaction``) checks a connection out through ``_connected``, which hands
whatever the driver raises, from connect to COMMIT, to the error boundary
(``_errors.translate``). A transaction runs on a SQLAlchemy ``Connection`` or,
on the hot paths (``raw=True``), on a pooled driver cursor: the append's few
small statements cost more in SQLAlchemy's per-statement execution context
(~0.1 ms each) than SQLite took to run them (docs/benchmarks.md, "Append:
where the time goes"); driver errors there are wrapped as SQLAlchemy would
wrap them (a lost connection is invalidated) before they are translated.

On PostgreSQL a driver transaction runs in psycopg's pipeline mode: the
statements a body sends without reading a result go to the server together
(a body that needs their answers returns ``Later``, evaluated once the
pipeline synced), so an append's transaction costs two round trips (BEGIN
and every write, the positions taken by the events' INSERT; the COMMIT), and
a read on a driver cursor runs outside any transaction (one round trip, no
BEGIN and no ROLLBACK). The
COMMIT is sent alone, after the writes answered: queued behind them it would
reach the server even when the client lost the connection before the writes
ended (a backend waiting for a lock), and the client could no longer tell a
certain failure from an uncertain commit.

A pooled connection found lost by a read on a driver cursor (``reading_cursor``,
the append's reads) costs that read one more try on a new connection: a read
stores nothing. A write transaction is never re-sent: lost before COMMIT it
is a certain failure (``StoreUnavailable``), and the caller retries.

A transaction whose statements check what the caller did not read first
(``Database.checked``, a trainer's step) sends its COMMIT inside the
pipeline: one round trip in all. A check that fails rolls it back
(``ChecksFailed``); a connection lost anywhere in that pipeline is handled
as a connection lost during COMMIT (below), its ``landed`` check by the
events' identities, except that a write found not stored is sent once more
on a new connection (its keys are unique: at most one of the sends lands).
So its pooled connection is not pinged for having sat idle: a dead one costs
the send that finds it, never a round trip for every live one.

A connection lost *during* COMMIT is different: the commit may have landed.
Then the transaction's ``landed`` check runs on a fresh connection (retrying
with ``trajstore._util.backoff.Backoff`` while the server recovers); if the
transaction is there the call succeeds, otherwise ``CommitUnknownError``
tells the caller to keep the payload and retry.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

from sqlalchemy import Connection, Engine

from trajstore._util.backoff import Backoff
from trajstore.errors import CommitUnknownError, first_line
from trajstore.log._dialect import RESENT_IF_LOST, SqlDialect
from trajstore.log._registry import sql_dialect
from trajstore.log._errors import lost_connection, refused, translate, wrapped
from trajstore.log.base import ChecksFailed

__all__ = ["Database", "Later", "RESOLVE_S"]

log = logging.getLogger("trajstore.log")

RESOLVE_S = 30.0  # how long to try to find out whether a commit whose connection broke landed
T = TypeVar("T")


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:  # the connection is already broken: nothing more to learn from it
        pass


class _LostPooledConnection(Exception):
    """A read's pooled connection was lost after its checkout (``Database.reading_cursor``)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _NotStored(Exception):
    """A pipelined write lost its connection and is not stored (``Database.checked`` sends it again)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class Later:
    """What a pipelined transaction's body returns when its result needs the answers of the
    statements it sent (``value()`` is called once the pipeline synced, before COMMIT)."""

    def __init__(self, value: Callable[[], Any]) -> None:
        self.value = value


class Database:
    """The write and read engines (they may be the same), their dialect object,
    and the one transaction wrapper."""

    def __init__(self, write_engine: Engine, read_engine: Engine) -> None:
        self.write_engine = write_engine
        self.read_engine = read_engine
        self.dialect: SqlDialect = sql_dialect(write_engine)

    @contextmanager
    def _connected(self, what: str, engine: Engine, raw: bool, retry_lost: bool = False,
                   resent_if_lost: bool = False) -> Iterator[Any]:
        """A connection of ``engine`` (``raw``: a pooled driver connection), closed
        afterwards (the pool's reset rolls back what was left open); every error
        raised meanwhile leaves translated. With ``retry_lost`` a driver connection
        lost after its checkout (invalidated: the pool drops it) raises
        ``_LostPooledConnection`` instead, for the caller to try once more.
        ``resent_if_lost``: checked out under ``RESENT_IF_LOST`` (the caller sends its
        write again if this connection is lost: no idle ping)."""
        conn = None
        try:
            token = RESENT_IF_LOST.set(resent_if_lost)
            try:
                conn = engine.raw_connection() if raw else engine.connect()
            finally:
                RESENT_IF_LOST.reset(token)
            yield conn
        except Exception as e:
            error = wrapped(e, conn if raw else None, engine, what) if raw else e
            if retry_lost and conn is not None and getattr(error, "connection_invalidated", False):
                raise _LostPooledConnection(error) from None
            raise translate(error, what) from None
        finally:
            if conn is not None:
                _quietly(conn.close)

    @contextmanager
    def reading(self, what: str) -> Iterator[Connection]:
        """A SQLAlchemy connection of the read engine, in one read transaction."""
        with self._connected(what, self.read_engine, raw=False) as conn:
            yield conn

    def reading_cursor(self, what: str, body: Callable[[Any, SqlDialect], T]) -> T:
        """``body(cursor, dialect)`` in one read transaction on a pooled driver
        connection of the read engine (the append's reads).

        A read whose pooled connection turns out lost (the server restarted and
        the checkout's checks could not see it: ``postgres._check_out``) is run
        once more on a new connection: a read stores nothing, so it is never
        uncertain. A connect that fails, or a second loss, is raised as usual."""
        try:
            return self._read_on_cursor(what, body)
        except _LostPooledConnection as lost:
            log.info("%s: a pooled connection was lost (%s); reading on a new one", what, first_line(lost.error))
        return self._read_on_cursor(what, body, retry=False)

    def _read_on_cursor(self, what: str, body: Callable[[Any, SqlDialect], T], retry: bool = True) -> T:
        d = self.dialect
        with self._connected(what, self.read_engine, raw=True, retry_lost=retry) as raw:
            if d.autocommit_reads:
                raw.dbapi_connection.autocommit = True  # no BEGIN, no ROLLBACK: the read's one round trip
            cur = raw.cursor()
            try:
                if d.begin_read:
                    cur.execute(d.begin_read)
                return body(cur, d)
            finally:
                _quietly(cur.close)
                if d.autocommit_reads:
                    _quietly(lambda: setattr(raw.dbapi_connection, "autocommit", False))

    def transaction(self, what: str, body: Callable[[Any, SqlDialect], T],
                    landed: Callable[[Connection, T], bool] | None = None, *, raw: bool = False) -> T:
        """Run ``body(conn, dialect)`` in one write transaction and commit it;
        translate every error. ``conn`` is a SQLAlchemy ``Connection``, or with
        ``raw`` a driver cursor.

        ``landed(conn, result)`` tells, on a fresh connection, whether the
        transaction committed; it is asked when the connection breaks during
        COMMIT."""
        d, engine = self.dialect, self.write_engine
        if raw and d.pipelined_writes:
            return self._pipelined(what, body, landed)
        with self._connected(what, engine, raw) as conn:
            cur = conn.cursor() if raw else None
            try:
                try:
                    if raw:
                        if d.begin_write:
                            cur.execute(d.begin_write)
                        commit = conn.commit
                    else:
                        commit = conn.begin().commit
                    result = body(cur if raw else conn, d)
                except Exception:
                    _quietly(conn.rollback)
                    raise
                try:
                    commit()
                except Exception as e:
                    return self._after_failed_commit(what, wrapped(e, conn, engine, what) if raw else e,
                                                     landed, result)
                return result
            finally:
                if cur is not None:
                    _quietly(cur.close)

    def _pipelined(self, what: str, body: Callable[[Any, SqlDialect], T],
                   landed: Callable[[Connection, T], bool] | None) -> T:
        """``transaction(raw=True)`` in psycopg's pipeline mode (module doc): BEGIN and the body's
        statements in the pipeline, an error there rolls back; then the COMMIT alone, whose
        failure is handled as ``transaction``'s."""
        d, engine = self.dialect, self.write_engine
        with self._connected(what, engine, raw=True) as conn:
            driver = conn.dbapi_connection
            # BEGIN and COMMIT are the pipeline's own statements (the driver's implicit BEGIN
            # would wait for its answer: a round trip of its own)
            driver.autocommit = True
            cur = conn.cursor()
            try:
                try:
                    with driver.pipeline():
                        cur.execute("BEGIN")
                        result = body(cur, d)
                    if isinstance(result, Later):  # the pipeline's one sync brought every answer
                        result = result.value()
                except Exception:
                    _quietly(conn.rollback)
                    raise
                try:
                    cur.execute("COMMIT")
                except Exception as e:
                    _quietly(conn.rollback)
                    return self._after_failed_commit(what, wrapped(e, conn, engine, what), landed, result)
                return result
            finally:
                _quietly(cur.close)
                _quietly(lambda: setattr(driver, "autocommit", False))

    def checked(self, what: str, body: Callable[[Any, SqlDialect], T],
                landed: Callable[[Connection], T | None]) -> T:
        """``body(cursor, dialect)`` in one write transaction whose statements make their
        own checks (the caller read nothing first), committed; on PostgreSQL BEGIN, the
        body's statements and COMMIT are one pipeline ending in one Sync: one round
        trip in all, the pooled connection checked out without the idle ping
        (``RESENT_IF_LOST``: a dead one is found by the send, below).

        An error the database answers with (a check's, a key's: SQLSTATE classes 22
        and 23) or ``ChecksFailed`` from the body rolls the transaction back and raises
        ``ChecksFailed``: nothing is stored, the caller reads to learn why. Other
        errors are translated as ``transaction``'s.

        With the COMMIT in the pipeline, a connection lost after the pipeline was sent
        leaves the outcome unknown wherever it broke (the server may run the queued
        COMMIT after the client gave up, e.g. once a lock it waited for is released):
        then ``landed(conn)`` on a fresh connection returns the result if the
        transaction is there. When it is not, the pipeline is sent once more on a new
        connection: the body's rows are keyed by the events' identities (and the
        lineage keys), which the database makes unique, so of the two sends at most
        one lands. A first send that commits late makes the second wait for it and
        fail on a key (``ChecksFailed``: the caller reads and finds it stored).
        ``CommitUnknownError`` is raised when the outcome cannot be checked, or the
        second send's connection is lost too and its write is not found: never a
        success that was not stored, never "not stored" for a write that may land."""
        try:
            return self._checked(what, body, landed, resend=True)
        except _NotStored as lost:
            log.warning("%s: connection lost (%s) and nothing stored; sending it again on a new connection",
                        what, first_line(lost.error))
        return self._checked(what, body, landed, resend=False)

    def _checked(self, what: str, body: Callable[[Any, SqlDialect], T],
                 landed: Callable[[Connection], T | None], *, resend: bool) -> T:
        """One send of ``checked``; with ``resend`` a pipelined write whose connection
        was lost and that is not stored raises ``_NotStored``."""
        d, engine = self.dialect, self.write_engine
        found: list[T] = []

        def is_landed(conn: Connection, _: Any) -> bool:
            result = landed(conn)
            if result is None:
                return False
            found.append(result)
            return True

        pipelined = d.pipelined_writes
        with self._connected(what, engine, raw=True, resent_if_lost=pipelined and resend) as conn:
            driver = conn.dbapi_connection
            cur = conn.cursor()
            try:
                try:
                    if pipelined:
                        driver.autocommit = True  # BEGIN and COMMIT are the pipeline's own statements
                        with driver.pipeline():
                            cur.execute("BEGIN")
                            result = body(cur, d)
                            cur.execute("COMMIT")
                    else:
                        if d.begin_write:
                            cur.execute(d.begin_write)
                        result = body(cur, d)
                except ChecksFailed:
                    _quietly(conn.rollback)
                    raise
                except Exception as e:
                    error = wrapped(e, conn, engine, what)
                    if pipelined and lost_connection(error):
                        self._after_failed_commit(what, error, is_landed, None, resend=resend)
                        return found[0]
                    _quietly(conn.rollback)
                    if refused(error):
                        raise ChecksFailed(f"{what}: {first_line(error)}") from None
                    raise translate(error, what) from None
                if not pipelined:
                    try:
                        conn.commit()
                    except Exception as e:
                        self._after_failed_commit(what, wrapped(e, conn, engine, what), is_landed, None)
                        return found[0]
                return result.value() if isinstance(result, Later) else result
            finally:
                _quietly(cur.close)
                if pipelined:
                    _quietly(lambda: setattr(driver, "autocommit", False))

    def _after_failed_commit(self, what: str, e: BaseException, landed: Callable[[Connection, T], bool] | None,
                             result: T, *, resend: bool = False) -> T:
        """A COMMIT raised ``e``: the result if it landed after all, else the error to raise
        (``resend``: ``_NotStored`` when it is certainly not there, for the caller to send again)."""
        if not lost_connection(e):
            raise translate(e, what) from None  # the server refused the commit: rolled back
        log.warning("%s: connection lost during COMMIT (%s); finding out whether it landed", what, first_line(e))
        outcome = None if landed is None else self._find_out(what, lambda c: landed(c, result))
        if outcome:
            log.warning("%s: the commit had landed", what)
            return result
        if outcome is False and resend:
            raise _NotStored(e)
        state = "it is not visible" if outcome is False else "it could not be checked"
        raise CommitUnknownError(f"{what}: connection lost during COMMIT ({first_line(e)}) and {state}; "
                                 "retry (appends are idempotent)") from None

    def _find_out(self, what: str, check: Callable[[Connection], bool]) -> bool | None:
        """``check`` on a fresh connection, retried while the server recovers (None: it never answered)."""
        backoff = Backoff(first_s=0.1, max_s=2.0)
        while True:
            try:
                with self.read_engine.connect() as conn:
                    return bool(check(conn))
            except Exception as e:
                if backoff.exhausted(RESOLVE_S):
                    log.warning("%s: could not find out whether the commit landed: %s", what, first_line(e))
                    return None
            backoff.pause()

    def close(self) -> None:
        self.write_engine.dispose()
        if self.read_engine is not self.write_engine:
            self.read_engine.dispose()
