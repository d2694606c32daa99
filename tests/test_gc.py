"""The payload GC that keeps up without an operator: deletes driven by the
index's retired list (no listing of the payload), batched (one DeleteObjects
per up to 1,000 keys on a real S3-compatible server), in its own worker thread
(the fold loop keeps folding while a GC pass is stuck), and readers protected
by leases (a live lease keeps what was retired after it; a killed reader's
lease lapses)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from sqlalchemy import func, select

import trajstore
from trajstore._upkeep.gc import GcWorker, ReaderLease, collect_retired
from trajstore.materializer import Materializer
from trajstore.schema import reader_leases, segments
from tests.helpers import finished, gen, moto_s3, started

ROOT = Path(__file__).resolve().parents[1]


def _trajectories(store, prefix: str, n: int) -> list[str]:
    tids = []
    for i in range(n):
        tid = f"{prefix}{i}"
        store.append([started(tid), gen(tid, 0, [1, 2, 3], [4, 5])])  # each append: one log segment
        store.append([gen(tid, 1, [1, 2, 3, 4, 5, 6], [7, 8]), finished(tid)])
        tids.append(tid)
    return tids


def _retired(store) -> set[str]:
    with store.log.read_engine.connect() as conn:
        return set(conn.execute(select(segments.c.name).where(segments.c.retired_at.is_not(None))).scalars())


def _files(store) -> set[str]:
    return {n for n, _ in store.payload.list_names()}


def _no_listing(store, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the steady GC path listed the payload")
    monkeypatch.setattr(store.payload, "list_names", refuse)


def test_the_retired_list_drives_the_deletes_without_listing(store, monkeypatch):
    _trajectories(store, "a", 6)
    store.materialize()
    retired = _retired(store)
    assert len(retired) == 12 and retired <= _files(store)
    named = store.log.referenced_segments()
    with monkeypatch.context() as m:
        _no_listing(store, m)
        removed = collect_retired(store, margin_s=0)
    assert set(removed) == retired
    assert _files(store) == named and not _retired(store)  # files deleted, rows forgotten
    assert sorted(s.trajectory_id for s in store.samples()) == [f"a{i}" for i in range(6)]
    with monkeypatch.context() as m:
        _no_listing(store, m)
        assert collect_retired(store, margin_s=0) == []  # nothing retired: one indexed query, nothing else


def test_the_margin_keeps_what_was_just_retired(store):
    _trajectories(store, "a", 3)
    store.materialize()
    assert collect_retired(store, margin_s=3600) == []
    assert len(collect_retired(store, margin_s=0)) == 6


def test_a_readers_lease_keeps_its_segments_while_the_gc_deletes_everything_else(store):
    _trajectories(store, "old", 3)
    store.materialize()
    before = _retired(store)
    _trajectories(store, "new", 3)
    lease = ReaderLease(store, "test-reader", heartbeat=False)
    assert lease.held
    held_rows = [r for tid in ("new0", "new1", "new2") for r in store.log.trajectory_events([tid])[tid]
                 if r["segment"]]  # the reader resolves locators under its lease ...
    store.materialize()  # ... the materializer re-points them and retires their log segments
    after = _retired(store) - before
    assert len(after) == 6
    assert set(collect_retired(store, margin_s=0)) == before  # only what was retired before the lease
    assert after <= _files(store)
    assert store.payload.read_locators(held_rows)  # the reader still opens what it resolved
    lease.advance()  # it dropped those locators
    assert set(collect_retired(store, margin_s=0)) == after
    lease.close()
    with store.log.read_engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(reader_leases)).scalar_one() == 0


_LEASE_HOLDER = r"""
import sys, time
import trajstore
from trajstore._upkeep.gc import ReaderLease
store = trajstore.connect(sys.argv[1])
lease = ReaderLease(store, "doomed", ttl_s=float(sys.argv[2]))
print(lease.held_since, flush=True)
time.sleep(600)
"""


def test_a_killed_readers_lease_lapses(store, store_url):
    _trajectories(store, "a", 2)
    proc = subprocess.Popen([sys.executable, "-c", _LEASE_HOLDER, store_url, "3"], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    try:
        assert float(proc.stdout.readline())  # the lease is taken
        store.materialize()
        assert collect_retired(store, margin_s=0) == []  # a live reader's lease: kept
        time.sleep(4)  # the heartbeat (every ttl/3) keeps it alive past its ttl
        assert collect_retired(store, margin_s=0) == []
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30
        removed: list[str] = []
        while not removed and time.monotonic() < deadline:
            time.sleep(0.5)
            removed = collect_retired(store, margin_s=0)
        assert len(removed) == 4, "the dead reader's lease lapsed after its ttl"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_the_fold_loop_keeps_folding_while_a_gc_pass_is_stuck(store):
    """A GC pass stuck on the object store (here: its deletes wait on an event, as
    on a stalled server) does not stop Materializer.follow."""
    _trajectories(store, "a", 2)
    store.materialize()
    stuck, release = threading.Event(), threading.Event()
    real = store.payload.delete_many

    def stalled(names):
        stuck.set()
        release.wait(60)
        return real(names)

    store.payload.delete_many = stalled
    stop = threading.Event()
    m = Materializer(store)
    t = threading.Thread(target=m.follow, args=(stop,), kwargs={"poll_s": 0.05, "gc_grace_s": 0,
                                                                  "gc_interval_s": 0.05})
    t.start()
    try:
        assert stuck.wait(30), "the GC worker ran"
        tids = _trajectories(store, "b", 4)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len({s.trajectory_id for s in store.samples()}) < 6:
            time.sleep(0.05)
        assert {s.trajectory_id for s in store.samples()} >= set(tids), "folding went on"
        assert m.gc.stats.passes == 0, "the GC pass is still stuck meanwhile"
        release.set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _retired(store):
            time.sleep(0.05)
        assert not _retired(store), "and it collects once unstuck"
    finally:
        release.set()
        stop.set()
        t.join(30)
    assert not t.is_alive()


def test_the_worker_thread_collects_and_stops(store):
    _trajectories(store, "a", 3)
    store.materialize()
    with GcWorker(store, margin_s=0, interval_s=0.05) as w:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _retired(store):
            time.sleep(0.05)
    assert not _retired(store) and w.stats.deleted == 6 and w.stats.failures == 0
    assert not w._thread.is_alive()


def test_explicit_gc_honours_live_leases(store):
    _trajectories(store, "a", 2)
    with ReaderLease(store, "r", heartbeat=False):
        store.materialize()
        assert store.collect_garbage(grace_s=0) == []  # the full sweep keeps what a lease holds
    assert len(store.collect_garbage(grace_s=0)) == 4


# ---- a real S3-compatible server (moto_server), its request log read server-side

BUCKET = "trajstore-gc"


@pytest.fixture(scope="module")
def s3_logged(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("moto") / "requests.log"
    with moto_s3(BUCKET, log_path) as endpoint:
        yield endpoint, log_path


def _requests(log_path: Path, start: int) -> list[str]:
    with open(log_path) as f:
        f.seek(start)
        return re.findall(r'"([A-Z]+ /\S*) HTTP', re.sub(r"\x1b\[[0-9;]*m", "", f.read()))


def test_on_s3_one_delete_objects_request_per_thousand_keys_and_no_listing(store_url, s3_logged, monkeypatch):
    endpoint, log_path = s3_logged
    prefix = f"p-{uuid.uuid4().hex[:8]}"
    store = trajstore.connect(store_url, payload=f"s3://{BUCKET}/{prefix}?endpoint_override={endpoint}&scheme=http")
    try:
        _trajectories(store, "a", 3)
        store.materialize()
        assert len(_retired(store)) == 6
        # more retired keys than one request takes: rows for objects written straight to the bucket
        fs = store.payload.fs
        extra = [f"events-extra-{i:05d}.arrow" for i in range(1200)]
        for name in extra[:5]:
            with fs.open_output_stream(store.payload.path(name)) as out:
                out.write(b"x")
        with store.log.write_engine.begin() as conn:
            conn.execute(segments.insert(), [dict(name=n, kind="events", num_rows=0, num_bytes=1, created_at=0.0,
                                                  retired_at=1.0) for n in extra])
        time.sleep(1)
        start = log_path.stat().st_size
        removed = collect_retired(store, margin_s=0)
        time.sleep(0.5)
        reqs = _requests(log_path, start)
        assert len(removed) == 1206 and not _retired(store)
        deletes = [r for r in reqs if r.startswith(f"POST /{BUCKET}?delete")]
        assert len(deletes) == 2, reqs  # 1,206 keys: two DeleteObjects requests
        assert not [r for r in reqs if r.startswith("DELETE ")], "no per-object DeleteObject"
        assert not [r for r in reqs if r.startswith("GET ") and "list-type" in r or r == f"GET /{BUCKET}"], \
            "no listing"
        assert not [r for r in reqs if r.startswith("HEAD ")], "no per-object HEAD"
        left = {i.base_name for i in fs.get_file_info(pafs.FileSelector(store.payload.root)) if i.size}
        assert not any(n.startswith("events-") for n in left) and store.log.referenced_segments() <= left
        assert sorted(s.trajectory_id for s in store.samples()) == ["a0", "a1", "a2"]
        # the count sees per-object deletes where there are some (pyarrow's, one request each)
        start = log_path.stat().st_size
        with fs.open_output_stream(store.payload.path("events-one.arrow")) as out:
            out.write(b"x")
        store.payload.delete("events-one.arrow")
        time.sleep(0.5)
        assert f"DELETE /{BUCKET}/{prefix}/events-one.arrow" in _requests(log_path, start)
    finally:
        store.close()


def test_a_reader_login_holds_a_lease(store, store_url):
    """The read-only role may write its own leases (migration 0015): a reader
    connected as an analyst login protects what it reads like any other."""
    from tests.helpers import reader_url_for

    _trajectories(store, "a", 2)
    reader = trajstore.connect(reader_url_for(store_url), migrate=False, create=False)
    try:
        lease = ReaderLease(reader, "analyst", heartbeat=False)
        assert lease.held
        store.materialize()
        assert collect_retired(store, margin_s=0) == []
        lease.renew()
        lease.close()
        assert len(collect_retired(store, margin_s=0)) == 4
    finally:
        reader.close()


def test_the_workers_rare_full_sweep_takes_crash_leftovers(store):
    """Files no segments row knows are found only by listing: the worker's full
    sweep (here every 0.1 s, with no grace) removes them; its steady path alone does not."""
    _trajectories(store, "a", 1)
    leftover = "events-crashed-leftover.arrow"
    with open(store.payload.path(leftover), "wb") as f:
        f.write(b"x" * 100)
    assert collect_retired(store, margin_s=0) == [] and leftover in _files(store)
    with GcWorker(store, margin_s=0, interval_s=0.05, sweep_interval_s=0.1, sweep_grace_s=0) as w:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and leftover in _files(store):
            time.sleep(0.05)
    assert leftover not in _files(store) and w.stats.sweeps >= 1
    assert store.log.referenced_segments() <= _files(store)
