"""PostgreSQL positions from a sequence: appends do not wait for each other, and
the materializer's tail never skips a transaction held open while later ones
commit (trajstore.log.postgres, "Positions")."""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy import select, text

import trajstore
import trajstore.log._events as logsql
from trajstore.materializer import Materializer
from trajstore.schema import events, samples
from tests.helpers import finished, gen, started

pytestmark = pytest.mark.postgres


def trajectory(tid: str) -> list[dict]:
    # an output length of the trajectory's own (ids of different lengths); appends of one
    # run-aggregate key no longer meet on a row lock (the append inserts delta rows:
    # tests/log/test_aggregate_deltas.py), so this is no longer what keeps them apart
    return [started(tid), gen(tid, 0, [1, 2], [3] * (2 + len(tid)), version=1), finished(tid)]


def test_a_transaction_held_open_is_never_skipped_by_the_tail(fresh_pg_url, tmp_path, monkeypatch):
    """Appender A takes its positions, then its transaction stays open (a real append on
    its own connection, stopped after its positions were taken). Appender B, on another
    connection, appends a whole trajectory after it and commits without waiting. The
    materializer must fold neither until A commits (B's positions are above A's), then
    both, each once, A's first."""
    payload = str(tmp_path / "payload")
    a_store = trajstore.connect(fresh_pg_url, payload=payload)
    b_store = trajstore.connect(fresh_pg_url)
    m_store = trajstore.connect(fresh_pg_url)
    a_store.append(trajectory("before"))
    assert Materializer(m_store).run().num_trajectories == 1

    holding, release = threading.Event(), threading.Event()
    real = logsql._positions_taken

    def held_write(rows):
        if threading.current_thread().name == "held-appender":
            holding.set()  # positions taken, transaction open
            assert release.wait(60)
        return real(rows)

    monkeypatch.setattr(logsql, "_positions_taken", held_write)
    out: dict = {}
    a = threading.Thread(target=lambda: out.setdefault("a", a_store.append(trajectory("held"))),
                         name="held-appender")
    a.start()
    try:
        assert holding.wait(30)
        t0 = time.monotonic()
        b = b_store.append(trajectory("later"))  # does not queue behind A
        assert time.monotonic() - t0 < 10
        with m_store.log.read_engine.connect() as conn:
            held_positions = conn.execute(text("SELECT last_value FROM log_positions")).scalar_one()
        assert b.last_position is not None and b.last_position == held_positions  # B took positions after A
        bound = m_store.log.safe_position(wait_s=0.2)
        assert bound is not None and bound < b.last_position - 2  # A's three positions are below B's
        stats = Materializer(m_store).run()
        assert stats.num_trajectories == 0  # "later" is committed but after an open position: not yet
        assert [s.trajectory_id for s in m_store.samples()] == ["before"]
    finally:
        release.set()
        a.join(60)
    assert out["a"].num_appended == 3
    stats = Materializer(m_store).run()
    assert stats.num_trajectories == 2
    with m_store.log.read_engine.connect() as conn:
        order = list(conn.execute(select(samples.c.trajectory_id).order_by(samples.c.finished_position)).scalars())
        positions = list(conn.execute(select(events.c.position).order_by(events.c.position)).scalars())
    assert order == ["before", "held", "later"]
    assert len(positions) == len(set(positions)) == 9
    assert Materializer(m_store).run().num_trajectories == 0  # exactly once
    for s in (a_store, b_store, m_store):
        s.close()


def test_a_rolled_back_append_leaves_a_hole_the_tail_steps_over(fresh_pg_url, tmp_path):
    store = trajstore.connect(fresh_pg_url, payload=str(tmp_path / "payload"))
    store.append(trajectory("a"))
    with store.log.write_engine.connect() as conn:  # positions taken, then rolled back
        conn.execute(text("SELECT nextval('log_positions') FROM generate_series(1, 5) "
                          "WHERE pg_current_xact_id() IS NOT NULL")).all()
        conn.rollback()
    store.append(trajectory("b"))
    assert store.materialize().num_trajectories == 2
    assert store.log.head_position() == 11  # 3 positions, a hole of 5, 3 more: the highest stored one
    assert sorted(s.trajectory_id for s in store.samples()) == ["a", "b"]
    store.close()


def test_a_reader_login_holding_a_transaction_id_stalls_neither_the_tail_nor_the_materializer(fresh_pg_url, tmp_path):
    """An analyst's session as the reader login (``trajstore init --reader-login``) holds a
    transaction id (``BEGIN; SELECT txid_current();``) and stays idle: before, the tail
    waited on it (``log_safe_position`` NULL, the materializer folded 0 of 3) for as long as
    it stayed. Only the transactions of logins that may append hold the tail: a writer's
    held transaction still does. The login's sessions are capped by the timeouts ``init``
    sets on it."""
    import psycopg
    from sqlalchemy.engine import make_url

    from trajstore.cli import main

    login = "stall_analyst"
    store = trajstore.connect(fresh_pg_url, payload=str(tmp_path / "payload"))
    assert main(["--store", fresh_pg_url, "init", "--reader-login", login]) == 0
    u = make_url(fresh_pg_url)
    dsn = f"host={u.host} port={u.port} dbname={u.database}"
    reader = psycopg.connect(f"{dsn} user={login}")
    owner = psycopg.connect(f"{dsn} user={u.username}", autocommit=True)
    try:
        with reader.cursor() as cur:
            cur.execute("SHOW idle_in_transaction_session_timeout")
            assert cur.fetchone()[0] == "1min"
            cur.execute("SHOW statement_timeout")
            assert cur.fetchone()[0] == "5min"
            cur.execute("SELECT txid_current()")  # psycopg opened the transaction: it holds an id now
            held = cur.fetchone()[0]
        with owner.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND transactionid::text = %s",
                        (str(held % 2**32),))
            assert cur.fetchone()[0] == 1  # the reader's transaction id is running
        for tid in ("a", "b", "c"):
            store.append(trajectory(tid))
        head = store.log.head_position()
        assert store.log.safe_position(wait_s=0.2) == head
        assert Materializer(store).run().num_trajectories == 3
        with owner.cursor() as cur:
            cur.execute("SELECT log_safe_position(0.2)")
            assert cur.fetchone()[0] == head
        with reader.cursor() as cur:  # the reader's own view, in its held transaction
            cur.execute("SELECT position FROM log_safe_position")
            assert cur.fetchone()[0] == head
        # a login that may append still holds the tail while its transaction has an id
        writer = psycopg.connect(f"{dsn} user={u.username}")
        try:
            with writer.cursor() as cur:
                cur.execute("SELECT txid_current()")
            store.append(trajectory("d"))
            assert store.log.safe_position(wait_s=0.2) == head  # the earlier bound, not past the writer
            with owner.cursor() as cur:
                cur.execute("SELECT log_safe_position(0.2)")
                assert cur.fetchone()[0] is None
        finally:
            writer.close()
        assert store.log.safe_position(wait_s=0.2) == store.log.head_position()
        assert Materializer(store).run().num_trajectories == 1
    finally:
        reader.close()
        owner.close()
        store.close()
