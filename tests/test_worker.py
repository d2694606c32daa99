"""The processes a user runs beside a run, as real processes: ``trajstore materialize
--follow`` (a log line per step, SIGTERM finishes the step and exits 0, a PostgreSQL
restart and killed backends waited out with one line per wait) and ``trajstore worker``
(fold, collect, push to a tracker, serve the page; each part switchable)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trajstore
from tests.helpers import free_port, reader_url_for
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.log.base import Shard

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "trajstore.cli"]
CFG = RolloutConfig(turns=2, prompt_tokens=8, output_tokens=4, observation_tokens=2, layers=2, topk=2)
ENV = {**{k: v for k, v in os.environ.items() if k != "TRAJSTORE_TOKEN"}, "PYTHONPATH": str(REPO)}


def _wait_for(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def _caught_up(store) -> bool:
    checkpoint = store.materialized.load_checkpoint(Shard(0, 1))
    return checkpoint is not None and checkpoint["position"] == store.log.head_position()


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=60)
    finally:
        proc.kill()


def _step_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "materializer shard 0/1: folded " in line]


def test_materialize_follow_logs_a_line_per_step_and_stops_on_sigterm(store_url, tmp_path):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    for i in range(5):
        store.append(trajectory_events(CFG, i))
    proc = subprocess.Popen([*CLI, "--store", store_url, "--payload", payload, "materialize", "--follow",
                             "--poll-s", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert _wait_for(lambda: _caught_up(store))
        for i in range(5, 8):
            store.append(trajectory_events(CFG, i))  # arrives while it follows
        assert _wait_for(lambda: _caught_up(store) and store.info()["samples"] >= 8)
    finally:
        out, err = _stop(proc)
    assert proc.returncode == 0, err
    steps = [json.loads(line) for line in out.splitlines()]
    assert sum(s["num_trajectories"] for s in steps) == 8
    lines = _step_lines(err)
    assert len(lines) == len(steps), err  # one log line per step that folded something
    assert lines[0].endswith(f"checkpoint {steps[0]['position']}, 0 pending") or "pending" in lines[0]
    assert "5 finished trajectories pending" in err  # the backlog when it started
    assert "SIGTERM received; stopping after the step in progress" in err and err.rstrip().endswith("stopped")
    assert len({s.trajectory_id for s in store.samples()}) == 8
    store.close()


def test_materialize_follow_refuses_refold_quarantined_in_one_line(tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    trajstore.connect(url, payload=str(tmp_path / "payload")).close()
    proc = subprocess.run([*CLI, "--store", url, "materialize", "--follow", "--refold-quarantined"],
                          capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "error: --follow folds as trajectories finish; run --refold-quarantined on its own [cli]"], proc.stderr


def _append_retrying(store, events, timeout_s: float = 60.0) -> None:
    """The test's own writer across the restart: an append the outage refused is sent again."""
    from trajstore.errors import StoreUnavailable

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.append(events)
            return
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.mark.timeout(240)
def test_a_following_materializer_rides_out_a_postgres_restart_and_killed_backends(fault_cluster, tmp_path):
    """It exited 1 at every restart and backend kill: now it waits, one WARNING line per
    wait and one INFO when the store is back, keeps folding after, and exits 0 on SIGTERM."""
    from pg_cluster import crash_cluster, start_cluster_again

    url = fault_cluster.create_database()
    payload = str(tmp_path / "payload")
    store = trajstore.connect(url, payload=payload)
    for i in range(4):
        store.append(trajectory_events(CFG, i))
    proc = subprocess.Popen([*CLI, "--store", url, "--payload", payload, "materialize", "--follow", "--poll-s", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert _wait_for(lambda: _caught_up(store))
        crash_cluster(fault_cluster)  # pg_ctl stop -m immediate: every backend killed, no checkpoint
        time.sleep(3.0)
        assert proc.poll() is None  # still waiting, not exited
        start_cluster_again(fault_cluster)
        for i in range(4, 8):
            _append_retrying(store, trajectory_events(CFG, i))
        assert _wait_for(lambda: _caught_up(store) and store.info()["samples"] >= 8), proc.poll()
        # then every backend of the database killed under it, and more work
        for backend in fault_cluster.backends(url.rsplit("/", 1)[1]):
            fault_cluster.kill_backend(backend["pid"])
        for i in range(8, 11):
            _append_retrying(store, trajectory_events(CFG, i))
        assert _wait_for(lambda: _caught_up(store) and store.info()["samples"] >= 11), proc.poll()
        assert proc.poll() is None
    finally:
        out, err = _stop(proc)
    assert proc.returncode == 0, err
    assert sum(json.loads(line)["num_trajectories"] for line in out.splitlines()) == 11
    waits = [line for line in err.splitlines() if "store unavailable while folding" in line]
    back = [line for line in err.splitlines() if "materializer shard 0/1: store available again after" in line]
    assert 1 <= len(waits) <= 2 and len(back) == len(waits), err  # one line per wait, not one per attempt
    gc_waits = [line for line in err.splitlines() if "gc pass failed" in line]
    assert len(gc_waits) <= 2, err  # the GC thread too: one line per outage, not one per 0.5-s pass
    assert "Traceback" not in err
    assert sorted({s.trajectory_id for s in store.samples()}) == \
        sorted(trajectory_events(CFG, i)[0]["trajectory_id"] for i in range(11))
    store.close()


def test_worker_folds_pushes_and_serves_the_page_until_sigterm(store_url, tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("tensorboard")
    from tests.inspect.test_trackers import _tensorboard_scalars

    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    for i in range(6):
        store.append(trajectory_events(CFG, i))
    port = free_port()
    proc = subprocess.Popen([*CLI, "--store", store_url, "--payload", payload, "worker", "--poll-s", "0.1",
                             "--tensorboard", str(tmp_path / "tb"), "--track-interval-s", "0.5",
                             "--serve-report", "--report-port", str(port), "--reader-store", reader_url_for(store_url)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "TRAJSTORE_TOKEN": "s3cret"})
    try:
        assert _wait_for(lambda: _caught_up(store) and store.info()["samples"] >= 6), _stop(proc)

        def pushed_samples() -> float:
            if not (tmp_path / "tb").is_dir():
                return -1
            return max([v for _, v in _tensorboard_scalars(str(tmp_path / "tb")).get("trajstore/samples", [])],
                       default=-1)

        assert _wait_for(lambda: pushed_samples() == store.info()["samples"]), _stop(proc)
        locked = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
        assert locked.status_code == 401 and "needs its token" in locked.text
        opened = httpx.get(f"http://127.0.0.1:{port}/?token=s3cret", timeout=30, follow_redirects=True)
        assert opened.status_code == 200 and "plotly" in opened.text
    finally:
        out, err = _stop(proc)
    assert proc.returncode == 0, err
    assert sum(json.loads(line)["num_trajectories"] for line in out.splitlines()) == 6
    assert _step_lines(err) and "trackers: pushed" in err
    assert f"open the page: http://127.0.0.1:{port}/?token=s3cret" in err
    assert "trajstore worker: stopped" in err
    store.close()


def test_worker_parts_are_switchable(store_url, tmp_path):
    """--no-fold with a tracker pushes and folds nothing; nothing switched on is one error line."""
    pytest.importorskip("tensorboard")
    from tests.inspect.test_trackers import _tensorboard_scalars

    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    for i in range(3):
        store.append(trajectory_events(CFG, i))
    proc = subprocess.Popen([*CLI, "--store", store_url, "--payload", payload, "worker",
                             "--reader-store", reader_url_for(store_url), "--no-fold",
                             "--no-gc", "--tensorboard", str(tmp_path / "tb"), "--track-interval-s", "0.3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert _wait_for(lambda: (tmp_path / "tb").is_dir()
                         and "trajstore/trajectories" in _tensorboard_scalars(str(tmp_path / "tb")))
    finally:
        out, err = _stop(proc)
    assert proc.returncode == 0, err
    assert out == "" and store.info()["samples"] == 0  # folding was switched off
    assert _tensorboard_scalars(str(tmp_path / "tb"))["trajstore/trajectories"][-1][1] == 3
    none = subprocess.run([*CLI, "--store", store_url, "worker", "--no-fold"], capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert none.returncode == 1
    assert none.stderr.splitlines() == ["error: worker: nothing to do (--no-fold, no tracker, no --serve-report)"]
    store.close()
