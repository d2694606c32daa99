"""Sampling policies through `trajstore replay` servers as real processes: the server's
samples-per-insert pacing holds each policy's reader and lets it go on once rollouts insert
more, without changing what the policy chooses. (Apart from test_replay_policies.py, whose
tests share one filled store: each test here appends to a store of its own, and the file
alone is as long as the rest, so the two balance across workers.)"""

from __future__ import annotations

import threading
import time

import pytest

from trajstore.materializer import Materializer
from trajstore.reader import SampleReader
from trajstore.replay import ReplayReader
from trajstore.demo._simulate import trajectory_events

from replay_procs import READ_TOKEN
from test_reader import CFG, fill, keys, shuffled
from test_replay_policies import POLICIES


@pytest.fixture
def filled_own(store):
    """A store of the test's own, filled as test_replay_policies.py's shared ``filled``: each test here appends."""
    fill(store, shuffled())
    return store


@pytest.mark.parametrize("policy", list(POLICIES))
def test_samples_per_insert_paces_every_policy_without_changing_its_choice(filled_own, replay_servers, policy):
    store = filled_own  # it appends: a store of its own
    uses = POLICIES[policy]["max_uses"] if policy == "reuse" else 1
    n = store.materialized.count_samples()
    # the limiter lets half of the epoch's serves through, then holds until as many samples again are inserted
    server = replay_servers(store, "--samples-per-insert", str(uses / 2), "--hold-s", "0.5", metrics=True)
    config = {"batch_size": 4, "policy": POLICIES[policy], "current_model_version": 6}
    expected = [keys(b) for b in SampleReader(store, **config)]
    assert sum(map(len, expected)) == uses * n
    got: list = []
    reader = ReplayReader(server.location, token=READ_TOKEN, **config)
    t = threading.Thread(target=lambda: got.extend(keys(b) for b in reader), daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while 'trajstore_replay_wait_seconds_total{reason="samples_per_insert"}' not in server.metrics():
        assert time.monotonic() < deadline, "the policy's reader was never held"
        time.sleep(0.1)
    time.sleep(1.0)
    assert t.is_alive() and sum(map(len, got)) <= uses * n / 2 + 4, "the limiter let the epoch through"
    m = Materializer(store)
    for i in range(100, 100 + 48):
        store.append(trajectory_events(CFG, i, version=i // 8))
    m.run()
    assert store.materialized.count_samples() >= 2 * n
    t.join(timeout=120)
    assert not t.is_alive(), "the reader stayed held after the rollouts inserted more"
    assert got == expected, "pacing changed what the policy chose"
    reader.close()
