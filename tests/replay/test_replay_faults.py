"""The replay service through a PostgreSQL crash and restart: a follow-mode
``ReplayReader`` (its server a real process on the store) waits the outage
out and goes on, every sample read once, in order."""

from __future__ import annotations

import logging

import pytest

import trajstore
from trajstore.replay import ReplayReader

from replay_procs import READ_TOKEN
from test_reader import FOLLOW_TIMEOUT_S, append_samples, keys
from test_reader_faults import three_steps_across_a_restart


@pytest.mark.timeout(240)
def test_a_follow_replay_reader_rides_out_a_database_restart(fault_cluster, tmp_path, replay_servers, caplog):
    caplog.set_level(logging.INFO, logger="trajstore.reader")
    caplog.set_level(logging.INFO, logger="trajstore.replay.client")
    store = trajstore.connect(fault_cluster.create_database(), payload=str(tmp_path / "payload"))
    append_samples(store, 0, 6)
    server = replay_servers(store)
    # the server answers "store unavailable" while its database is down: the reader's
    # unavailable_timeout_s (default) rides that out, not the connection's retry_timeout_s
    reader = ReplayReader(server.location, token=READ_TOKEN, batch_size=4, follow=True, timeout_s=FOLLOW_TIMEOUT_S,
                          poll_interval_s=0.05, retry_timeout_s=1.0)
    batches = three_steps_across_a_restart(fault_cluster, store, reader)  # it polls the server meanwhile
    assert [len(b) for b in batches] == [4, 4, 4]
    assert keys(s for b in batches for s in b) == [(s.trajectory_id, s.sample_index) for s in store.samples()]
    assert reader.stats.unavailable_waits >= 1
    lines = [r.getMessage() for r in caplog.records if r.name == "trajstore.reader"]
    assert any("store unavailable while" in m for m in lines) and any("available again" in m for m in lines), lines
    # the server answered "store unavailable": the reader's wait is the one said, not the client's failovers
    client = [r.getMessage() for r in caplog.records if r.name == "trajstore.replay.client"]
    assert not any("failed on" in m for m in client), client
    store.close()


@pytest.mark.timeout(120)
def test_a_server_killed_under_parallel_streams_is_said_once(tmp_path, replay_servers, caplog):
    """A server killed -9 while a batch's payload is asked for in parallel streams,
    then restarted: one warning for the outage and one line when it answers again,
    not one per stream; the batch is the local reader's."""
    import threading

    from test_reader import fill, shuffled
    from trajstore.reader import SampleReader

    caplog.set_level(logging.INFO, logger="trajstore.replay.client")
    store = trajstore.connect(f"sqlite:///{tmp_path / 'store.db'}", payload=str(tmp_path / "payload"))
    fill(store, shuffled(24))
    server = replay_servers(store)
    config = {"batch_size": 12, "page_rows": 1000, "prefetch": False}
    reader = ReplayReader(server.location, token=READ_TOKEN, streams=4, retry_timeout_s=60, **config)
    local = SampleReader(store, **config)
    assert keys(next(reader)) == keys(next(local))  # the rows of every step are read: only payload calls remain
    server.kill9()
    restart = threading.Timer(1.5, server.start)
    restart.start()
    try:
        second = next(reader)
    finally:
        restart.join()
    assert keys(second) == keys(next(local))
    # this reader's lines: a reader an earlier test of the process left open may log about its own server
    client = [m for m in (r.getMessage() for r in caplog.records if r.name == "trajstore.replay.client")
              if server.location in m]
    assert sum("failed on" in m for m in client) == 1, client
    assert sum("answers again" in m for m in client) == 1, client
    reader.close()
    local.close()
    store.close()
