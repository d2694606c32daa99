"""The long-running materializer worker folds as events arrive and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import trajstore
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.log.base import Shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = RolloutConfig(turns=2, prompt_tokens=8, output_tokens=4, observation_tokens=2, layers=2, topk=2)


def _wait_for(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_worker_follows_the_log_and_stops_on_sigterm(store_url, tmp_path):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "workers", "materializer.py"), "--store", store_url,
         "--payload", payload, "--poll-s", "0.1"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        for i in range(5):
            store.append(trajectory_events(CFG, i))
        assert _wait_for(lambda: store.info()["samples"] >= 5 and store.materialized.load_checkpoint(Shard(0, 1))["position"]
                         == store.log.head_position())
        for i in range(5, 8):
            store.append(trajectory_events(CFG, i))  # arrives after the first fold
        assert _wait_for(lambda: store.materialized.load_checkpoint(Shard(0, 1))["position"] == store.log.head_position())
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    folded = sum(json.loads(line)["num_trajectories"] for line in out.splitlines())
    assert folded == 8
    assert sorted({s.trajectory_id for s in store.samples()}) == sorted(trajectory_events(CFG, i)[0]["trajectory_id"] for i in range(8))


def _log_files(payload: str) -> list[str]:
    """Non-empty log segment files (the reserve's empty files aside). The worker's GC
    may delete a file between the listing and its size: a file gone is not counted."""
    out = []
    for n in os.listdir(payload):
        if n.startswith("events-") and n.endswith(".arrow"):
            try:
                if os.path.getsize(os.path.join(payload, n)):
                    out.append(n)
            except FileNotFoundError:
                continue
    return sorted(out)


def test_worker_collects_retired_segments_after_the_grace(store_url, tmp_path):
    """One copy at rest without an operator: the long-running materializer deletes the
    log segments its folds retired once their grace is over (here 1 s), and keeps the
    segment of a trajectory still running."""
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    for i in range(4):
        store.append(trajectory_events(CFG, i))
    running = trajectory_events(CFG, 99)[:-1]  # not finished: its segment stays
    store.append(running)
    assert len(_log_files(payload)) == 5
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "workers", "materializer.py"), "--store", store_url,
         "--poll-s", "0.1", "--gc-grace-s", "1", "--gc-interval-s", "0.2"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert _wait_for(lambda: store.info()["samples"] >= 4)
        assert _wait_for(lambda: len(_log_files(payload)) == 1, timeout_s=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0
    (left,) = _log_files(payload)
    assert left in store.log.referenced_segments()
    assert len({s.trajectory_id for s in store.samples()}) == 4  # folded tokens read from the sample segments
    samples = list(store.samples())
    assert all(len(s.prompt_ids) + len(s.response_ids) > 0 for s in samples)
    store.close()
