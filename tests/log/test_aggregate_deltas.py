"""The append's run aggregates are delta rows (trajstore.log._aggregates): concurrent writers
count exactly, an append never waits for another counting the same key, and the
materializer's commit folds the deltas into one total row per key without changing a sum."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
from alembic import command
from sqlalchemy import create_engine, text

import trajstore
import trajstore.log._events as logsql
from tests.helpers import finished, gen, started
from tests.log.procs import aggregate_writer
from trajstore.log._aggregate_counts import KEYS, totals_sql
from trajstore.log._migrate import alembic_config
from trajstore.inspect._rebuild import rebuild_aggregates
from trajstore.log._aggregates import compact_event_aggregates
from trajstore.materializer import Materializer

WRITERS, PER_WRITER = 4, 12
EVENT_TABLES = ("agg_output_lengths", "agg_route_drift", "agg_calls", "agg_trajectories")


def totals(store) -> dict[str, dict[tuple, tuple]]:
    with store.log.read_engine.connect() as conn:
        return {name: {tuple(r[:len(KEYS[name])]): tuple(int(v) for v in r[len(KEYS[name]):])
                       for r in conn.execute(text(totals_sql(name)))} for name in EVENT_TABLES}


def hourly(counted: dict, name: str) -> dict[tuple, tuple]:
    """``name``'s totals at the 3600 s width, summed over the buckets (the run may cross an hour)."""
    out: dict[tuple, list] = {}
    for key, values in counted[name].items():
        if key[0] == 3600:
            have = out.setdefault(key[2:], [0] * len(values))
            for i, v in enumerate(values):
                have[i] = max(have[i], v) if name == "agg_calls" and i == 5 else have[i] + v
    return {k: tuple(v) for k, v in out.items()}


def rows(store, name: str, *, delta: bool) -> int:
    with store.log.read_engine.connect() as conn:
        return conn.execute(text(f"SELECT count(*) FROM {name} WHERE {'' if delta else 'NOT '}delta")).scalar_one()


def test_concurrent_writer_processes_count_exactly(store_url, tmp_path):
    """Writer processes append run trajectories one event a transaction (one output-length
    and time-bucket key shared by many of them) while this process materializes (each
    commit folds deltas): the totals equal a recount from the log, every delta ends up
    folded, and a fold changes no sum."""
    payload = str(tmp_path / "payload")
    trajstore.connect(store_url, payload=payload).close()  # migrated once, before the writers start
    # Spawned, not forked: a test worker holds the threads of the tests it ran before (readers'
    # prefetch and lease threads, pools), and a child forked from it can hang on a lock one of
    # them held at the fork (seen once: pytest-timeout after 300 s, the writers still alive).
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=aggregate_writer, args=(store_url, payload, w * PER_WRITER, PER_WRITER))
             for w in range(WRITERS)]
    for p in procs:
        p.start()
    store = trajstore.connect(store_url, payload=payload)
    try:
        while any(p.is_alive() for p in procs):
            store.materialize()  # folds, concurrently with the appends
            time.sleep(0.05)
        for p in procs:
            p.join(timeout=600)
            assert p.exitcode == 0
        counted = totals(store)
        with store.log.read_engine.connect() as conn:
            calls = conn.execute(text("SELECT model_version, output_len, count(*) FROM events WHERE type = "
                                      "'generation' GROUP BY 1, 2")).all()
            resent = conn.execute(text("SELECT sum(route_rows_resent) FROM events")).scalar_one()
            per_version = conn.execute(text(
                "SELECT COALESCE(model_version, -1), COALESCE(finish_reason, ''), count(*), sum(output_len), max(output_len) "
                "FROM events WHERE type = 'generation' GROUP BY 1, 2")).all()
            by_status = conn.execute(text(
                "SELECT CASE WHEN type = 'trajectory_started' THEN 'running' ELSE status END, "
                "count(*) FILTER (WHERE type = 'trajectory_started'), "
                "count(*) FILTER (WHERE type = 'trajectory_finished') FROM events "
                "WHERE type IN ('trajectory_started', 'trajectory_finished') GROUP BY 1")).all()
        assert counted["agg_output_lengths"] == {(v, n): (c,) for v, n, c in calls}
        assert resent and sum(v[0] for k, v in counted["agg_route_drift"].items() if k[0] == 1) == resent
        assert {k: (v[0], v[1], v[5]) for k, v in hourly(counted, "agg_calls").items()} == {
            (v, r): (c, o, m) for v, r, c, o, m in per_version}
        assert hourly(counted, "agg_trajectories") == {(s,): (a, b) for s, a, b in by_status}
        store.materialize()
        assert all(rows(store, name, delta=True) == 0 for name in EVENT_TABLES)
        assert totals(store) == counted  # folding moved counts, changed no sum (nor max)
        assert rows(store, "agg_output_lengths", delta=False) == len(calls)  # one total row per key
        assert rows(store, "agg_calls", delta=False) == len(counted["agg_calls"])
        rebuild_aggregates(store)
        assert totals(store) == counted  # a recount from the log agrees
    finally:
        store.close()


def test_deltas_of_the_append_until_a_materializer_commit_folds_them(store):
    """Each append inserts rows of its own (its key's total row is not touched); the totals
    read the same before and after the fold (agg_calls' max_output_len: the max of the rows),
    and a retried append adds no row."""
    batch = [started("a"), gen("a", 0, [1, 2], [3, 4, 5], version=1), finished("a")]
    store.append(batch)
    store.append([started("b"), gen("b", 0, [1, 2], [6, 7, 8, 9, 9], version=1, finish_reason="length"),
                  finished("b", status="truncated")])
    assert rows(store, "agg_output_lengths", delta=True) == 2
    assert rows(store, "agg_calls", delta=True) == 6  # one per append and width
    assert rows(store, "agg_trajectories", delta=True) == 12  # started and finished, per append and width
    assert all(rows(store, name, delta=False) == 0 for name in EVENT_TABLES)
    before = totals(store)
    assert before["agg_output_lengths"] == {(1, 3): (1,), (1, 5): (1,)}
    assert {k: (v[0], v[1], v[5]) for k, v in hourly(before, "agg_calls").items()} == {
        (1, ""): (1, 3, 3), (1, "length"): (1, 5, 5)}
    assert hourly(before, "agg_trajectories") == {("running",): (2, 0), ("completed",): (0, 1),
                                                  ("truncated",): (0, 1)}
    store.materialize()
    assert all(rows(store, name, delta=True) == 0 for name in EVENT_TABLES)
    assert totals(store) == before
    store.append(batch)  # a retry: nothing new
    store.append([started("c"), gen("c", 0, [1, 2], [9, 9, 9], version=1), finished("c")])
    store.append([started("d"), gen("d", 0, [1, 2], [9] * 7, version=1), finished("d")])
    assert rows(store, "agg_output_lengths", delta=True) == 2
    assert rows(store, "agg_calls", delta=True) == 6
    got = totals(store)
    assert got["agg_output_lengths"] == {(1, 3): (2,), (1, 5): (1,), (1, 7): (1,)}
    hour = hourly(got, "agg_calls")
    assert (hour[(1, "")][0], hour[(1, "")][1], hour[(1, "")][5]) == (3, 13, 7)  # deltas and the total: max 7
    assert hourly(got, "agg_trajectories")[("running",)] == (4, 0)
    store.materialize()
    assert totals(store) == got  # the fold kept the sums and the max


@pytest.mark.postgres
def test_an_append_does_not_wait_for_another_counting_the_same_key(fresh_pg_url, tmp_path, monkeypatch):
    """Appender A's transaction stays open after its aggregate rows were written (a real
    append on its own connection); appender B, counting the same keys whose total rows exist
    (one version and output length; one time bucket, version and finish reason of agg_calls;
    one time bucket and status of agg_trajectories), commits without waiting for it, and so
    does a materializer commit folding deltas. A's own rows lock nothing B touches."""
    payload = str(tmp_path / "payload")
    a_store = trajstore.connect(fresh_pg_url, payload=payload)
    b_store = trajstore.connect(fresh_pg_url, payload=payload)
    same = lambda tid: [started(tid), gen(tid, 0, [1, 2], [3, 4, 5], version=1), finished(tid)]  # noqa: E731
    b_store.append(same("first"))
    Materializer(b_store).run()  # the keys' total rows
    assert rows(b_store, "agg_output_lengths", delta=False) == 1
    assert rows(b_store, "agg_calls", delta=False) == 3  # one per width
    assert rows(b_store, "agg_trajectories", delta=False) == 6  # started and finished, per width
    b_store.append(same("second"))  # a committed delta for the next fold

    holding, release = threading.Event(), threading.Event()
    real = logsql._positions_taken  # in the pipelined append: after every write of it ran

    def held(r):
        if threading.current_thread().name == "held-appender":
            holding.set()
            assert release.wait(60)
        return real(r)

    monkeypatch.setattr(logsql, "_positions_taken", held)
    a = threading.Thread(target=lambda: a_store.append(same("held")), name="held-appender")
    a.start()
    done: dict = {}
    try:
        assert holding.wait(30)
        with b_store.log.read_engine.connect() as conn:  # A holds its aggregate rows' write
            held_tables = conn.execute(text(
                "SELECT DISTINCT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation WHERE c.relname "
                "LIKE 'agg%' AND l.mode = 'RowExclusiveLock' AND l.pid <> pg_backend_pid()")).scalars().all()
        assert {"agg_output_lengths", "agg_calls", "agg_trajectories"} <= set(held_tables)
        b = threading.Thread(target=lambda: done.setdefault("b", b_store.append(same("b"))))
        b.start()
        b.join(15)
        assert "b" in done, "an append waited for another holding the same aggregate key"
        assert done["b"].num_appended == 3
        t0 = time.monotonic()
        with b_store.log.write_engine.begin() as conn:  # a fold, while A holds: no wait
            # "second" and "b", not A's: 1 output length, 3 agg_calls and 6 agg_trajectories rows each
            assert compact_event_aggregates(conn, b_store.log.db.dialect) == 2 * (1 + 3 + 6)
        assert time.monotonic() - t0 < 10
    finally:
        release.set()
        a.join(60)
    got = totals(b_store)
    assert got["agg_output_lengths"] == {(1, 3): (4,)}
    assert {k: (v[0], v[1], v[5]) for k, v in hourly(got, "agg_calls").items()} == {(1, ""): (4, 12, 3)}
    assert hourly(got, "agg_trajectories") == {("running",): (4, 0), ("completed",): (0, 4)}
    Materializer(b_store).run()
    assert all(rows(b_store, name, delta=True) == 0 for name in EVENT_TABLES)
    assert totals(b_store) == got
    for s in (a_store, b_store):
        s.close()


def test_the_migration_keeps_every_sum_both_ways(store_url, tmp_path):
    """Down to 0017 (one row per key, the key the primary key again; agg_calls and
    agg_trajectories dropped) and back: the deltas are folded into the totals, every sum
    kept (the two tables 0019 makes counted again from the log, as total rows)."""
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    call = lambda tid, n: [started(tid), gen(tid, 0, [1, 2], [3] * n, version=1), finished(tid)]  # noqa: E731
    store.append(call("a", 3))
    store.materialize()
    store.append(call("b", 3))  # a delta of the key with a total row
    store.append(call("c", 4))  # a delta of a key without one
    before = totals(store)
    assert before["agg_output_lengths"] == {(1, 3): (2,), (1, 4): (1,)}
    engine = create_engine(store_url)
    try:
        for target, down in (("0017", True), ("head", False)):
            with engine.begin() as conn:
                cfg = alembic_config()
                cfg.attributes["connection"] = conn
                (command.downgrade if down else command.upgrade)(cfg, target)
            if down:
                with engine.connect() as conn:
                    got = conn.execute(text("SELECT model_version, output_len, calls FROM agg_output_lengths "
                                            "ORDER BY 1, 2")).all()
                assert [tuple(r) for r in got] == [(1, 3, 2), (1, 4, 1)]
    finally:
        engine.dispose()
    assert totals(store) == before  # agg_calls and agg_trajectories: 0019's backfill from the log
    assert all(rows(store, name, delta=True) == 0 for name in EVENT_TABLES)  # total rows only
    store.append(call("d", 4))  # appends count again, as deltas
    assert totals(store)["agg_output_lengths"] == {(1, 3): (2,), (1, 4): (2,)}
    store.close()
