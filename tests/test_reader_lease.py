"""A reader's GC lease: a ``SampleReader`` that read a page of sample rows keeps
loading them although their segments were retired (a dropped projection) and
the payload GC ran; once it closes (or was killed with SIGKILL and its lease
lapsed) the GC deletes them. On every backend, and with the payload on a real
S3-compatible server (moto_server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select

import trajstore
from trajstore._upkeep.gc import collect_retired
from trajstore.reader import SampleReader
from trajstore.schema import projection_samples, reader_leases
from tests.helpers import finished, gen, started
from tests.test_gc import BUCKET, s3_logged  # noqa: F401 - the moto_server fixture

ROOT = Path(__file__).resolve().parents[1]


def _projected(store, n: int = 6) -> set[str]:
    """``n`` finished trajectories folded into projection ``p`` (one sample segment per
    trajectory): the names of its sample segments."""
    for i in range(n):
        tid = f"t{i}"
        store.append([started(tid), gen(tid, 0, [1, 2, 3], [4 + i, 5]),
                      gen(tid, 1, [1, 2, 3, 4 + i, 5, 6], [7, 8 + i]), finished(tid)])
    store.materialize()
    store.create_projection("p", merge="none")
    for _ in range(n):
        store.materialize(projection="p", max_trajectories=1)
    with store.log.read_engine.connect() as conn:
        return set(conn.execute(select(projection_samples.c.segment).distinct()).scalars())


def _leases(store) -> int:
    with store.log.read_engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(reader_leases)).scalar_one()


def _same(got, want) -> None:
    assert [(s.trajectory_id, s.sample_index) for s in got] == [(s.trajectory_id, s.sample_index) for s in want]
    for a, b in zip(got, want):
        assert np.array_equal(a.prompt_ids, b.prompt_ids) and np.array_equal(a.response_ids, b.response_ids)
        assert np.array_equal(a.loss_mask, b.loss_mask)


def _reads_through_a_gc(store) -> None:
    segs = _projected(store)
    assert len(segs) >= 3
    want = list(store.samples(projection="p"))
    reader = SampleReader(store, projection="p", batch_size=2, prefetch=False)
    try:
        got = list(next(reader))  # the reader read the page of every row, and loaded the first step
        store.drop_projection("p")  # retires every sample segment of the projection
        time.sleep(0.05)
        removed = set(collect_retired(store, margin_s=0))
        assert not removed & segs, "the GC kept what the reader's lease holds"
        assert _leases(store) == 1
        while len(got) < len(want):  # loads the segments the dropped projection retired
            got.extend(next(reader))
        _same(got, want)
    finally:
        reader.close()
    assert _leases(store) == 0, "close() released the lease"
    assert set(collect_retired(store, margin_s=0)) == segs, "and the GC deletes them then"
    assert not segs & {n for n, _ in store.payload.list_names()}


def test_a_reader_keeps_reading_segments_retired_and_collected_after_it_read_their_rows(store):
    _reads_through_a_gc(store)


def test_a_reader_with_read_ahead_holds_what_it_planned(store):
    segs = _projected(store)
    want = list(store.samples(projection="p"))
    with SampleReader(store, projection="p", batch_size=1) as reader:
        _read_the_rest_across_a_gc(store, reader, segs, want)
    assert set(collect_retired(store, margin_s=0)) == segs


def _read_the_rest_across_a_gc(store, reader, segs: set, want: list) -> None:
    """After the reader's first batch, the projection is dropped and the GC runs: it keeps the
    segments the reader's lease holds, and the reader reads the rest of them correctly."""
    got = list(next(reader))
    assert reader._lease.held
    store.drop_projection("p")
    time.sleep(0.05)
    assert not set(collect_retired(store, margin_s=0)) & segs
    while len(got) < len(want):
        got.extend(next(reader))
    _same(got, want)


def test_an_idle_reader_holds_nothing_back(store):
    """Once it handed over everything it read, a live reader's lease advances with
    its renewals (to the previous renewal's time): segments retired before that
    are collected although it is alive."""
    segs = _projected(store)
    reader = SampleReader(store, projection="p", batch_size=100, prefetch=False)
    try:
        assert len(next(reader)) == 12
        store.drop_projection("p")
        time.sleep(0.05)
        assert not segs & set(collect_retired(store, margin_s=0))  # held since before the drop
        reader._lease.renew()
        reader._lease.renew()  # held since the previous renewal: after the drop
        assert segs <= set(collect_retired(store, margin_s=0))
        assert _leases(store) == 1
    finally:
        reader.close()


def test_a_readers_lease_holds_back_sample_segments_only(store):
    """A reader opens sample segments only: the log segments the materializer
    retires while the reader holds rows pending are collected a margin later."""
    segs = _projected(store)
    collect_retired(store, margin_s=0)  # what folding the projection left
    with SampleReader(store, projection="p", batch_size=1, prefetch=False) as reader:
        next(reader)  # rows pending: the lease holds since before the page
        for i in range(3):
            tid = f"late{i}"
            store.append([started(tid), gen(tid, 0, [1, 2], [3])])
            store.append([finished(tid)])
        store.materialize()  # re-points the late trajectories' events: retires their log segments
        store.drop_projection("p")
        time.sleep(0.05)
        removed = set(collect_retired(store, margin_s=0))
        assert len([n for n in removed if n.startswith("events-")]) == 3 and not removed & segs
    assert segs <= set(collect_retired(store, margin_s=0))


_KILLED_READER = r"""
import sys, time
try:
    import trajstore.reader._lease as rl
    rl.LEASE_TTL_S, rl.RENEW_S = float(sys.argv[2]), 0.5
except ImportError:
    pass
from trajstore.reader import SampleReader
reader = SampleReader(sys.argv[1], projection="p", batch_size=1, prefetch=False, payload=sys.argv[3])
batch = next(reader)
print(batch[0].trajectory_id, flush=True)
time.sleep(600)
"""


def test_a_killed_readers_lease_lapses_and_the_gc_deletes_then(store, store_url, tmp_path):
    segs = _projected(store)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_READER, store_url, "3", str(tmp_path / "payload")],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "t0"  # it read the page and handed over its first batch
        store.drop_projection("p")
        time.sleep(4)  # longer than its ttl: its heartbeat keeps the lease alive
        assert not set(collect_retired(store, margin_s=0)) & segs
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30
        removed: set[str] = set()
        while removed != segs and time.monotonic() < deadline:
            time.sleep(0.5)
            removed |= set(collect_retired(store, margin_s=0))
        assert removed == segs, "the killed reader's lease lapsed after its ttl"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_reader_login_takes_its_lease(store, store_url, tmp_path):
    """Under a login with only the reader's rights (PostgreSQL's read-only role
    may write its own lease row) the reader is protected the same way."""
    from tests.helpers import reader_url_for

    segs = _projected(store)
    want = list(store.samples(projection="p"))
    with SampleReader(reader_url_for(store_url), projection="p", batch_size=2, prefetch=False,
                      payload=str(tmp_path / "payload")) as reader:
        _read_the_rest_across_a_gc(store, reader, segs, want)
    assert set(collect_retired(store, margin_s=0)) == segs


def test_a_reader_that_cannot_write_its_lease_reads_on_and_says_so_once(store, caplog, monkeypatch):
    """A store whose database refuses the lease write (here: a lease table that is
    gone, as before migration 0017) still reads; the reader logs it once."""
    _projected(store)
    with store.log.write_engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE reader_leases")
    want = list(store.samples(projection="p"))
    with caplog.at_level("WARNING", logger="trajstore.reader._lease"):
        with SampleReader(store, projection="p", batch_size=1, page_rows=2, prefetch=False) as reader:
            got = [s for batch in reader for s in batch]
    _same(got, want)
    said = [r for r in caplog.records if "without a GC lease" in r.getMessage()]
    assert len(said) == 1, caplog.text


def test_a_reader_writes_its_lease_once_not_per_page_or_sample(store):
    """The hot path writes nothing: one row taken at the first page, however many
    pages and samples follow (renewals come from its thread, every few seconds)."""
    from sqlalchemy import event

    _projected(store)
    writes = []
    engine = store.log.write_engine

    def count(conn, cursor, statement, *a):
        if "reader_leases" in statement and not statement.lstrip().upper().startswith("SELECT"):
            writes.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        with SampleReader(store, projection="p", batch_size=1, page_rows=2, prefetch=False) as reader:
            n = sum(len(b) for b in reader)
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert n == 12
    inserts = [w for w in writes if w.lstrip().upper().startswith("INSERT")]
    assert len(inserts) == 1 and len(writes) <= 4, writes  # take (delete + insert), release


def test_on_s3_a_reader_keeps_reading_what_it_read_and_the_gc_deletes_it_after(store_url, s3_logged):
    """On an object store nothing keeps a deleted object readable (no inode, no map):
    only the lease does."""
    endpoint, _ = s3_logged
    prefix = f"lease-{uuid.uuid4().hex[:8]}"
    s3 = trajstore.connect(store_url, payload=f"s3://{BUCKET}/{prefix}?endpoint_override={endpoint}&scheme=http")
    try:
        _reads_through_a_gc(s3)
    finally:
        s3.close()
