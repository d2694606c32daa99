"""Concurrent writers and a tailing reader: nothing lost, nothing duplicated,
positions seen in order, no event skipped because it committed late."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

import pytest
from sqlalchemy import insert, update

import trajstore
from trajstore.schema import events, log_head
from tests.helpers import gen, started
from tests.log.procs import concurrent_writer

WRITERS, TRAJECTORIES = 8, 100  # 8 x 100 x 10 = 8,000 events


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/store.db"


def _tail(store, stop: threading.Event, seen: list[int]) -> None:
    position = 0
    while True:
        done = stop.is_set()  # read the flag BEFORE the last poll: the final poll sees every commit
        bound = store.log.safe_position()  # the tail's bound: no position at or below it commits later
        rows = store.log.read_events(after_position=position, limit=1000)
        if bound is not None:
            rows = [r for r in rows if r["position"] <= bound]
        seen.extend(r["position"] for r in rows)
        if rows:
            position = rows[-1]["position"]
        elif done:
            return
        else:
            time.sleep(0.01)


@pytest.mark.slow
def test_eight_processes_append_concurrently_to_postgres(fresh_pg_url, tmp_path):
    payload = str(tmp_path / "payload")
    trajstore.connect(fresh_pg_url, payload=payload).close()  # migrated once, before the writers
    # Forked (spawned, each writer spent ~2.5 s CPU importing trajstore and, at
    # its first append, pyarrow's pandas): forked before this process holds a
    # connection or starts a thread, each a real process with its own connections.
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=concurrent_writer, args=(fresh_pg_url, payload, w, TRAJECTORIES)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    store = trajstore.connect(fresh_pg_url, payload=payload)
    seen: list[int] = []
    stop = threading.Event()
    tailer = threading.Thread(target=_tail, args=(store, stop, seen))
    tailer.start()
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0
    stop.set()
    tailer.join(timeout=60)

    total = WRITERS * TRAJECTORIES * 10
    assert seen == sorted(seen), "the tailing reader saw positions out of order"
    assert len(seen) == len(set(seen)), "the tailing reader saw an event twice"
    rows = store.log.read_events(after_position=0, limit=total + 10)
    assert seen == [r["position"] for r in rows], "the tailing reader missed events"
    assert len(rows) == total
    keys = {(r["trajectory_id"], r["type"], r["seq"]) for r in rows}
    assert len(keys) == total, "an event was stored twice"
    per_writer = {}
    for r in rows:
        w = r["trajectory_id"].split("-")[0]
        per_writer[w] = per_writer.get(w, 0) + 1
    assert per_writer == {f"w{w}": TRAJECTORIES * 10 for w in range(WRITERS)}
    info = store.info()
    assert info["trajectories_by_status"] == {"completed": WRITERS * TRAJECTORIES}
    store.close()


def test_a_late_commit_is_not_skipped(sqlite_url, tmp_path):
    """SQLite: hold one appender's transaction open after it took its position; later
    appends must wait, and a tailer must see the held event before any later one.
    (PostgreSQL, where later appends do not wait: tests/log/test_positions_pg.py.)"""
    store_url = sqlite_url
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    store.append([started("held")])
    held = store.log.write_engine.connect()
    tx = held.begin()
    p = held.execute(update(log_head).values(position=log_head.c.position + 1).returning(log_head.c.position)).scalar_one()
    held.execute(insert(events), [{"position": p, "trajectory_id": "held", "type": "reward", "reward": 1.0,
                                   "content_hash": b"\0" * 16, "created_at": 0.0}])
    later_done = threading.Event()

    def later() -> None:
        s2 = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
        s2.append([started("later"), gen("later", 0, [1], [2])])
        s2.close()
        later_done.set()

    t = threading.Thread(target=later)
    t.start()
    time.sleep(1.0)
    visible = [r["position"] for r in store.log.read_events(after_position=1, limit=10)]
    assert visible == [], f"events after an uncommitted position became visible: {visible}"
    assert not later_done.is_set(), "a later append committed while an earlier position was open"
    tx.commit()
    held.close()
    t.join(timeout=60)
    assert later_done.is_set()
    rows = store.log.read_events(after_position=1, limit=10)
    assert [(r["position"], r["trajectory_id"]) for r in rows] == [(2, "held"), (3, "later"), (4, "later")]
    store.close()
