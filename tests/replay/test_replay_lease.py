"""Trainers reading through a replay server hold GC leases too: the server writes
each trainer's lease row for it (the ``lease`` action; trainers hold no
database login). A ``ReplayReader`` that read a page of rows keeps loading them
through the server although their segments were retired and the GC ran; once
it closes, or was killed with SIGKILL and its lease lapsed, the GC deletes them.
Real ``trajstore replay`` processes on loopback, on every backend."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from trajstore._upkeep.gc import collect_retired
from trajstore.replay import ReplayReader

from replay_procs import READ_TOKEN, ROOT
from test_reader_lease import _leases, _projected, _same


def test_a_replay_reader_keeps_reading_segments_retired_and_collected_after_it_read_their_rows(store,
                                                                                             replay_servers):
    segs = _projected(store)
    want = list(store.samples(projection="p"))
    server = replay_servers(store)
    reader = ReplayReader(server.location, token=READ_TOKEN, projection="p", batch_size=2, prefetch=False)
    try:
        got = list(next(reader))  # one page of every row; the server mapped the first step's segment only
        store.drop_projection("p")
        time.sleep(0.05)
        assert not set(collect_retired(store, margin_s=0)) & segs, "the GC kept what the trainer's lease holds"
        assert _leases(store) == 1
        while len(got) < len(want):
            got.extend(next(reader))
        _same(got, want)
    finally:
        reader.close()
    assert _leases(store) == 0, "close() released the lease through the server"
    assert set(collect_retired(store, margin_s=0)) == segs


_KILLED_TRAINER = r"""
import sys
try:
    import trajstore.reader._lease as rl
    rl.LEASE_TTL_S, rl.RENEW_S = 3.0, 0.5
except ImportError:
    pass
import time
from trajstore.replay import ReplayReader
reader = ReplayReader(sys.argv[1], token=sys.argv[2], projection="p", batch_size=1, prefetch=False)
print(next(reader)[0].trajectory_id, flush=True)
time.sleep(600)
"""


def test_a_killed_trainers_lease_lapses_and_the_gc_deletes_then(store, replay_servers):
    segs = _projected(store)
    server = replay_servers(store)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_TRAINER, server.location, READ_TOKEN],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "t0"
        store.drop_projection("p")
        time.sleep(4)  # past its ttl: its heartbeat, through the server, keeps the lease
        assert not set(collect_retired(store, margin_s=0)) & segs
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30
        removed: set[str] = set()
        while removed != segs and time.monotonic() < deadline:
            time.sleep(0.5)
            removed |= set(collect_retired(store, margin_s=0))
        assert removed == segs, "the killed trainer's lease lapsed after its ttl"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_server_that_cannot_write_leases_still_serves_and_the_trainer_says_so_once(store, replay_servers,
                                                                                    caplog):
    _projected(store)
    with store.log.write_engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE reader_leases")  # as a store before its lease table
    want = list(store.samples(projection="p"))
    server = replay_servers(store)
    with caplog.at_level("WARNING", logger="trajstore.reader._lease"):
        with ReplayReader(server.location, token=READ_TOKEN, projection="p", batch_size=1, page_rows=2) as reader:
            got = [s for _ in range(len(want)) for s in next(reader)]
    _same(got, want)
    said = [r for r in caplog.records if "without a GC lease" in r.getMessage()]
    assert len(said) == 1, caplog.text


def test_a_client_holds_back_no_more_than_it_read(store, replay_servers):
    """The server bounds a trainer's lease: a sample reader's name, a ttl of at most
    600 s, and ``held_since`` that only moves forward (never back to the epoch)."""
    import pytest
    from sqlalchemy import select

    from trajstore.errors import ValidationError
    from trajstore.replay import ReplayStore
    from trajstore.replay import _protocol as proto
    from trajstore.schema import reader_leases

    server = replay_servers(store)
    name = "samples:" + "a" * 32
    with ReplayStore(server.location, token=READ_TOKEN) as rs:
        with pytest.raises(ValidationError, match="lease name"):
            rs._conn.action("holding a lease", proto.LEASE, name="0" * 32, holder="h", ttl_s=5)
        with pytest.raises(ValidationError, match="ttl_s"):
            rs._leases.hold(name, "h", 10_000, None)
        now, taken = rs._leases.hold(name, "h", 5, None)
        assert taken
        later, taken = rs._leases.hold(name, "h", 5, 0.0)  # asks to hold since the epoch
        assert not taken and later >= now
        with store.log.read_engine.connect() as conn:
            row = conn.execute(select(reader_leases).where(reader_leases.c.name == name)).one()
        assert row.held_since == now and row.holder == "replay client h"
        rs._leases.release(name)
    assert _leases(store) == 0


def test_a_lease_renewed_since_the_epoch_protects_for_its_maximum_age_only(store, replay_servers, caplog):
    """A read token renewing its lease with ``since=0`` for ever keeps its ``held_since``
    where it was taken: the GC keeps what was retired since, but only for the maximum
    lease age; then it collects, and says once which lease lost its protection."""
    import logging

    from trajstore.replay import ReplayStore

    segs = _projected(store)
    server = replay_servers(store)
    name = "samples:" + "b" * 32
    with ReplayStore(server.location, token=READ_TOKEN) as rs:
        rs._leases.hold(name, "squatter", 600, None)
        time.sleep(0.05)
        store.drop_projection("p")  # retired after the lease's held_since: protected
        time.sleep(0.05)
        rs._leases.hold(name, "squatter", 600, 0.0)
        assert not set(collect_retired(store, margin_s=0)) & segs, "a lease younger than the maximum age protects"
        time.sleep(1.2)
        rs._leases.hold(name, "squatter", 600, 0.0)  # renewed, never moved forward
        assert not set(collect_retired(store, margin_s=0)) & segs  # the default maximum age (6 h) is not reached
        with caplog.at_level(logging.WARNING, logger="trajstore.gc"):
            assert set(collect_retired(store, margin_s=0, lease_max_age_s=1.0)) == segs
            collect_retired(store, margin_s=0, lease_max_age_s=1.0)
        said = [r.getMessage() for r in caplog.records if "maximum lease age" in r.getMessage()]
        assert len(said) == 1 and name in said[0] and "replay client squatter" in said[0], said
        assert _leases(store) == 1  # the lease itself stands (it lapses when no longer renewed)
