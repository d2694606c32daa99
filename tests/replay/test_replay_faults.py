"""The replay service through a PostgreSQL crash and restart: a follow-mode
``ReplayReader`` (its server a real process on the store) waits the outage
out and goes on, every sample read once, in order."""

from __future__ import annotations

import logging
import time

import pytest

import trajstore
from trajstore.replay import ReplayReader

from replay_procs import READ_TOKEN
from test_reader import FOLLOW_TIMEOUT_S, _restart, append_samples, keys


@pytest.mark.timeout(240)
def test_a_follow_replay_reader_rides_out_a_database_restart(fault_cluster, tmp_path, replay_servers, caplog):
    caplog.set_level(logging.INFO, logger="trajstore.reader")
    caplog.set_level(logging.INFO, logger="trajstore.replay.client")
    store = trajstore.connect(fault_cluster.create_database(), payload=str(tmp_path / "payload"))
    append_samples(store, 0, 6)
    server = replay_servers(store)
    # retry_timeout_s=1: the connection alone gives up on the outage long before the
    # server's database is back; the reader's unavailable_timeout_s (default) rides it out
    reader = ReplayReader(server.location, token=READ_TOKEN, batch_size=4, follow=True, timeout_s=FOLLOW_TIMEOUT_S,
                          poll_interval_s=0.05, retry_timeout_s=1.0)
    batches = [next(reader)]
    time.sleep(0.3)  # the reader polls the server for the next step meanwhile
    _restart(fault_cluster)
    append_samples(store, 6, 6)
    batches += [next(reader), next(reader)]
    reader.close()
    assert [len(b) for b in batches] == [4, 4, 4]
    assert keys(s for b in batches for s in b) == [(s.trajectory_id, s.sample_index) for s in store.samples()]
    assert reader.stats.unavailable_waits >= 1
    lines = [r.getMessage() for r in caplog.records if r.name == "trajstore.reader"]
    assert any("store unavailable while" in m for m in lines) and any("available again" in m for m in lines), lines
    # the client says so once per outage too, not once per request retried (nor per parallel stream)
    client = [r.getMessage() for r in caplog.records if r.name == "trajstore.replay.client"]
    assert sum("failed on" in m for m in client) == 1, client
    assert sum("answers again" in m for m in client) == 1, client
    store.close()
