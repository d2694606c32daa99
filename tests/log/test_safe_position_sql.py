"""The log's tail bound in SQL (docs/sql.md, "Tailing the log"): a plain-SQL tailer
of ``events`` that reads ``position <= (SELECT position FROM log_safe_position)``,
the bound in its own statement first, never skips an append that commits late.

On PostgreSQL an append is held open on its own connection after it took its
positions while a later one commits: ``position > last`` alone skips the held
one for good; the bounded tail reads neither until it commits, then both, in
order. On SQLite the view is the log head: an open append holds the single write
lock, later appends wait for it, and the bound never covers uncommitted rows.
Every query runs under the read-only reader login, as docs/sql.md says.
"""

from __future__ import annotations

import sqlite3
import threading
import time

import psycopg
import pytest
from sqlalchemy.engine import make_url

import trajstore
import trajstore.log._events as logsql
from trajstore.cli import main
from tests.helpers import finished, gen, reader_url_for, started

BOUND = "SELECT position FROM log_safe_position"
TAIL = "SELECT position, trajectory_id FROM events WHERE position > {p} AND position <= {p} ORDER BY position LIMIT 1000"


def trajectory(tid: str) -> list[dict]:
    # an output length of the trajectory's own (ids of different lengths); appends of one
    # run-aggregate key no longer meet on a row lock (the append inserts delta rows:
    # tests/log/test_aggregate_deltas.py), so this is no longer what keeps them apart
    return [started(tid), gen(tid, 0, [1, 2], [3] * (2 + len(tid)), version=1), finished(tid)]


class SqlTailer:
    """The documented tailing loop, on a plain DBAPI connection as the reader login."""

    def __init__(self, store_url: str) -> None:
        reader = reader_url_for(store_url)
        if reader.startswith("sqlite"):
            self.conn = sqlite3.connect(make_url(reader).database, isolation_level=None)
            self.mark = "?"
        else:
            self.conn = psycopg.connect(make_url(reader).set(drivername="postgresql").render_as_string(False),
                                        autocommit=True)
            self.mark = "%s"
        self.last = 0
        self.seen: list[int] = []

    def bound(self, sql: str = BOUND) -> int | None:
        row = self.conn.execute(sql).fetchone()
        return None if row is None else row[0]

    def step(self) -> list[tuple[int, str]]:
        bound = self.bound()  # its own statement, before the read
        if bound is None:
            return []
        rows = self.conn.execute(TAIL.format(p=self.mark), (self.last, bound)).fetchall()
        if rows:
            self.last = rows[-1][0]
            self.seen += [p for p, _ in rows]
        return rows

    def naive_step(self) -> list[tuple[int, str]]:
        rows = self.conn.execute(f"SELECT position, trajectory_id FROM events WHERE position > {self.mark} "
                                 "ORDER BY position", (self.last,)).fetchall()
        if rows:
            self.last = rows[-1][0]
            self.seen += [p for p, _ in rows]
        return rows

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def held_append(monkeypatch):
    """Run an append in a thread that stops, transaction open, right after taking its positions."""
    holding, release = threading.Event(), threading.Event()
    real = logsql._positions_taken

    def held_write(rows):
        if threading.current_thread().name == "held-appender":
            holding.set()
            assert release.wait(60)
        return real(rows)

    monkeypatch.setattr(logsql, "_positions_taken", held_write)
    threads: list[threading.Thread] = []

    def start(store, events) -> threading.Thread:
        t = threading.Thread(target=lambda: store.append(events), name="held-appender")
        t.start()
        threads.append(t)
        assert holding.wait(30)
        return t

    yield start, release
    release.set()
    for t in threads:
        t.join(60)


@pytest.mark.postgres
def test_postgres_a_held_open_append_is_skipped_by_position_gt_last_but_not_by_the_bound(
        fresh_pg_url, tmp_path, held_append):
    start, release = held_append
    payload = str(tmp_path / "payload")
    a_store, b_store = trajstore.connect(fresh_pg_url, payload=payload), trajstore.connect(fresh_pg_url)
    a_store.append(trajectory("before"))
    bounded, naive = SqlTailer(fresh_pg_url), SqlTailer(fresh_pg_url)
    try:
        assert [p for p, _ in bounded.step()] == [1, 2, 3]
        naive.naive_step()
        held = start(a_store, trajectory("held"))  # positions 4-6 taken, not committed
        b_store.append(trajectory("later"))  # positions 7-9, committed
        assert [t for _, t in naive.naive_step()] == ["later"] * 3  # and its checkpoint moves past 4-6
        assert bounded.bound("SELECT log_safe_position(0)") is None  # an append in flight: no new bound
        t0 = time.monotonic()
        assert bounded.bound() is None  # the view waits its 0.25 s for it, then gives none
        assert time.monotonic() - t0 >= 0.2
        assert bounded.step() == []
        release.set()
        held.join(60)
        assert bounded.bound() == 9
        assert [(p, t) for p, t in bounded.step()] == [(4, "held"), (5, "held"), (6, "held"),
                                                      (7, "later"), (8, "later"), (9, "later")]
        assert bounded.seen == list(range(1, 10))  # each once, in order
        assert naive.naive_step() == [] and naive.seen == [1, 2, 3, 7, 8, 9]  # 4-6 lost for good
    finally:
        bounded.close()
        naive.close()
        a_store.close()
        b_store.close()


@pytest.mark.postgres
def test_postgres_bounded_sql_tailer_sees_every_event_of_concurrent_writers(fresh_pg_url, tmp_path):
    payload = str(tmp_path / "payload")
    trajstore.connect(fresh_pg_url, payload=payload).close()
    stores = [trajstore.connect(fresh_pg_url) for _ in range(4)]
    errors: list[BaseException] = []

    def write(i: int) -> None:
        try:
            for k in range(25):
                stores[i].append(trajectory(f"w{i}-{k}"))
        except BaseException as e:  # reported below
            errors.append(e)

    tailer = SqlTailer(fresh_pg_url)
    writers = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for w in writers:
        w.start()
    try:
        while any(w.is_alive() for w in writers):
            tailer.step()
        for w in writers:
            w.join()
        assert not errors
        while tailer.step():
            pass
        with stores[0].log.read_engine.connect() as conn:
            stored = [p for (p,) in conn.exec_driver_sql("SELECT position FROM events ORDER BY position")]
        assert len(stored) == 4 * 25 * 3
        assert tailer.seen == stored  # none missing, none twice, in order
    finally:
        tailer.close()
        for s in stores:
            s.close()


def test_sqlite_the_bound_is_the_committed_head_and_later_appends_wait(tmp_path, held_append):
    start, release = held_append
    url = f"sqlite:///{tmp_path / 'store.db'}"
    a_store, b_store = trajstore.connect(url, payload=str(tmp_path / "payload")), trajstore.connect(url)
    a_store.append(trajectory("before"))
    tailer = SqlTailer(url)
    try:
        held = start(a_store, trajectory("held"))
        later = threading.Thread(target=lambda: b_store.append(trajectory("later")))
        later.start()
        later.join(0.5)
        assert later.is_alive()  # the single writer: it waits for the held append
        assert tailer.bound() == 3  # the committed head, nothing of the open append
        assert [p for p, _ in tailer.step()] == [1, 2, 3]
        release.set()
        held.join(60)
        later.join(60)
        assert tailer.bound() == 9
        assert [t for _, t in tailer.step()] == ["held"] * 3 + ["later"] * 3
        assert tailer.seen == list(range(1, 10))
    finally:
        tailer.close()
        a_store.close()
        b_store.close()


def test_trajstore_sql_reads_the_bound(store_url, tmp_path, capsys):
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    store.append(trajectory("a"))
    store.close()
    assert main(["--store", reader_url_for(store_url), "sql", "--format", "csv", BOUND]) == 0
    assert capsys.readouterr().out.splitlines() == ["position", "3"]
