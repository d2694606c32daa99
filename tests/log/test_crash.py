"""kill -9 of a writer in the middle of its appends: every acknowledged event is
there after restart, nothing partial is visible, retries do not duplicate, and
the payload files left behind are collected."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

import trajstore
from trajstore.demo._simulate import trajectory_events
from tests.log.procs import HEAVY

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _acked(path: str) -> list[int]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(line) for line in f.read().split("\n") if line.strip()]


def _start(url: str, payload: str, ack: str, start: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen([sys.executable, "-m", "tests.log.procs", url, payload, ack, str(start)], cwd=ROOT, env=env)


@pytest.mark.slow
def test_kill_9_mid_append_loses_nothing_acknowledged(store_url, tmp_path):
    payload, ack = str(tmp_path / "payload"), str(tmp_path / "acked.txt")
    trajstore.connect(store_url, payload=payload).close()  # migrations done before the first kill
    rng = random.Random(1234)
    for _ in range(4):
        acked = _acked(ack)
        proc = _start(store_url, payload, ack, (acked[-1] + 1) if acked else 0)
        deadline = time.time() + 60
        while len(_acked(ack)) < len(acked) + 2 and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    store = trajstore.connect(store_url, payload=payload)
    acked = _acked(ack)
    assert len(acked) >= 8
    expected = {i: trajectory_events(HEAVY, i) for i in range(acked[-1] + 2)}
    by_tid = {evs[0]["trajectory_id"]: (i, len(evs)) for i, evs in expected.items()}
    stored = store.log.trajectory_events(list(by_tid))
    for tid, (i, n) in by_tid.items():
        got = len(stored[tid])
        if i in acked:
            assert got == n, f"acknowledged trajectory {i} has {got} of {n} events"
        else:
            assert got in (0, n), f"trajectory {i} is partially visible ({got} of {n} events)"
    # every referenced payload is readable: materialize everything that is there
    stats = store.materialize()
    assert stats.num_trajectories == sum(1 for t in stored.values() if t)
    assert sum(1 for _ in store.samples()) == stats.num_samples_after
    # garbage from killed appends is collected, and nothing referenced is touched
    referenced = store.log.referenced_segments()
    store.collect_garbage(grace_s=0)
    assert {n for n, _ in store.payload.list_names()} == referenced
    # the writer retries from its last acknowledgement: no duplicates
    before = store.info()["head_position"]
    res = store.append([e for i in acked[-2:] for e in trajectory_events(HEAVY, i)])
    assert res.num_appended == 0 and store.info()["head_position"] == before
    store.close()
