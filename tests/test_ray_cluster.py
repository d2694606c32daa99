"""Long-running, restartable materializer shards on a real two-node Ray cluster:
a head and a worker started here with `ray start` (each with one CPU, so the two
shards run on different nodes), stopped by the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import trajstore
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.log.base import Shard
from tests.helpers import free_port

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CFG = RolloutConfig(turns=2, prompt_tokens=8, output_tokens=4, observation_tokens=2, layers=2, topk=2)


def _wait_for(predicate, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return False


@pytest.fixture(scope="module")
def two_node_ray():
    exe = str(Path(sys.executable).parent / "ray")
    port = free_port()
    head_dir = tempfile.mkdtemp(prefix="rh")  # short: Ray's socket paths live under it
    # token authentication: tests/conftest.py gives the suite's clusters one token of their own
    # No drain on SIGTERM: a node drains for up to 30 s (Ray's default) before it stops, and
    # its drain request waits that long for a GCS the same SIGTERM of the group has stopped.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    common = ["--block", "--num-cpus=1", "--disable-usage-stats"]
    head_out = Path(head_dir) / "ray-start.out"
    with open(head_out, "wb") as out:
        head = subprocess.Popen([exe, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                                 "--include-dashboard=false", f"--temp-dir={head_dir}", *common],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    procs = [head]
    try:
        address = f"127.0.0.1:{port}"
        # `ray start` says so once its node runs (polling `ray status` cost a Python start a try)
        assert _wait_for(lambda: b"Ray runtime started" in head_out.read_bytes() or head.poll() is not None), \
            "ray head did not start"
        assert head.poll() is None, f"ray head exited: {head_out.read_text()[-2000:]}"
        worker = subprocess.Popen([exe, "start", f"--address={address}", "--node-ip-address=127.0.0.1", *common],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        procs.append(worker)
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        assert _wait_for(lambda: sum(n["Alive"] for n in ray.nodes()) == 2), "the worker node did not join"
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for p in reversed(procs):  # `ray start --block` stops its node's processes when terminated
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def test_long_running_shards_on_two_nodes_survive_a_restart(two_node_ray, fresh_pg_url, tmp_path):
    from trajstore.scale.ray_actors import start_shards

    store = trajstore.connect(fresh_pg_url, payload=str(tmp_path / "payload"))
    name = f"t{uuid.uuid4().hex[:8]}"
    shards = start_shards(fresh_pg_url, 2, name=name, num_cpus_per_shard=1, poll_s=0.2, gc_grace_s=None,
                          max_trajectories=3, actor_options={"scheduling_strategy": "SPREAD"})
    try:
        assert len({ray.get(s.node_id.remote(), timeout=120) for s in shards}) == 2  # one per node
        assert [ray.get(s.status.remote(), timeout=60)["max_trajectories"] for s in shards] == [3, 3]
        for i in range(12):
            store.append(trajectory_events(CFG, i))

        def caught_up() -> bool:
            head = store.log.head_position()
            cps = [store.materialized.load_checkpoint(Shard(k, 2)) for k in range(2)]
            return all(cp is not None and cp["position"] == head for cp in cps)

        assert _wait_for(caught_up)
        # a step's counts are added when it returns, after its commit (and its compaction): they
        # may trail the checkpoints by the step in progress
        counted: list = []

        def all_counted() -> bool:
            counted[:] = ray.get([s.status.remote() for s in shards], timeout=60)
            return sum(st["num_trajectories"] for st in counted) == 12

        assert _wait_for(all_counted, timeout_s=60), counted
        assert [st["pending"] for st in counted] == [0, 0] and all(st["following"] for st in counted)
        assert sum(st["num_trajectories"] for st in counted) == 12
        # kill shard 0's actor: Ray restarts it, it resumes from its checkpoint
        ray.kill(shards[0], no_restart=False)
        for i in range(12, 20):
            store.append(trajectory_events(CFG, i))
        assert _wait_for(caught_up)
        status = ray.get([s.status.remote() for s in shards], timeout=120)
        assert all(st["following"] and st["pending"] == 0 for st in status)
        samples = list(store.samples())
        keys = [(s.trajectory_id, s.sample_index) for s in samples]
        assert len(keys) == len(set(keys))  # nothing folded twice
        assert {s.trajectory_id for s in samples} == {trajectory_events(CFG, i)[0]["trajectory_id"]
                                                      for i in range(20)}
    finally:
        for s in shards:
            try:
                ray.get(s.stop.remote(), timeout=60)
            finally:
                ray.kill(s, no_restart=True)
        store.close()
