"""Sampling policies through `trajstore replay` servers as real processes:

* the server's samples-per-insert pacing holds each policy's reader and lets it
  go on once rollouts insert more, without changing what the policy chooses;
* a trainer process reading with a policy, killed -9 mid-epoch, restored from
  the last state it saved: the same steps as an uninterrupted reader;
* ``ReplayDataset`` (StatefulDataLoader) takes the policy as ``SampleDataset`` does.

Run as a script, this file is the trainer process:
    python tests/replay/test_replay_policies.py trainer JOB.json
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import trajstore
from trajstore.materializer import Materializer
from trajstore.reader import SampleReader
from trajstore.replay import ReplayReader
from trajstore.demo._simulate import trajectory_events

from replay_procs import READ_TOKEN
from test_reader import CFG, GROUP_SIZE, fill, keys, shuffled

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))

POLICIES = {
    "fifo": "fifo",
    "ready_first": {"name": "ready_first", "bound": 1, "window": 16},
    "freshness": {"name": "freshness", "decay": 0.5, "window": 16, "seed": 5},
    "reuse": {"name": "reuse", "max_uses": 2, "window": 16, "seed": 2},
}


@pytest.fixture(scope="module")
def filled(module_store_url, tmp_path_factory):
    """A filled store on each backend: built once per module and shared by the tests that only
    read it (readers' leases aside). A test that appends takes ``filled_own``."""
    s = trajstore.connect(module_store_url, payload=str(tmp_path_factory.mktemp("filled") / "payload"))
    fill(s, shuffled())
    yield s
    s.close()


@pytest.fixture
def filled_own(store):
    """``filled`` for a test that appends to it: a store of the test's own."""
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


def _trainer_main(path: str) -> None:
    """Read with a policy through the servers; after each batch append a line with
    its keys and the state (flushed and fsynced: what a checkpoint would hold)."""
    with open(path) as f:
        job = json.load(f)
    reader = ReplayReader(job["location"], token=READ_TOKEN, **job["config"])
    if job.get("state") is not None:
        reader.load_state_dict(job["state"])
    with open(job["out"], "a") as out:
        while True:
            reader.current_model_version = 2 + reader.stats.steps // 2
            batch = next(reader, None)
            if batch is None:
                break
            out.write(json.dumps({"keys": keys(batch), "state": reader.state_dict()}) + "\n")
            out.flush()
            os.fsync(out.fileno())
            time.sleep(job["pause_s"])
    reader.close()


def _lines(path: str) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:  # the line being written when the process was killed
                break
    return out


@pytest.mark.parametrize("policy", ["freshness", "reuse"])
def test_a_trainer_killed_mid_epoch_resumes_its_policy_exactly(filled, replay_servers, tmp_path, policy):
    server = replay_servers(filled)
    config = {"batch_size": 3, "keep_groups": policy == "reuse", "group_size": GROUP_SIZE,
              "policy": POLICIES[policy]}
    if not config["keep_groups"]:
        del config["group_size"]
    uninterrupted = []
    reader = ReplayReader(server.location, token=READ_TOKEN, **config)
    while True:
        reader.current_model_version = 2 + reader.stats.steps // 2
        batch = next(reader, None)
        if batch is None:
            break
        uninterrupted.append(keys(batch))
    reader.close()
    assert len(uninterrupted) > 8
    out = str(tmp_path / "trainer.jsonl")
    job = {"location": server.location, "config": config, "out": out, "pause_s": 0.3}
    with open(tmp_path / "job.json", "w") as f:
        json.dump(job, f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests"),
                                                        os.path.dirname(HERE)])}
    proc = subprocess.Popen([sys.executable, HERE, "trainer", str(tmp_path / "job.json")], cwd=ROOT, env=env,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not os.path.exists(out) or len(_lines(out)) < 4:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the trainer process read nothing"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    before = _lines(out)
    assert 4 <= len(before) < len(uninterrupted), "the trainer was not killed mid-epoch"
    job.update(state=before[-1]["state"], out=str(tmp_path / "resumed.jsonl"), pause_s=0.0)
    with open(tmp_path / "job.json", "w") as f:
        json.dump(job, f)
    done = subprocess.run([sys.executable, HERE, "trainer", str(tmp_path / "job.json")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    after = _lines(job["out"])
    steps = [[tuple(k) for k in line["keys"]] for line in before + after]
    assert steps == [[tuple(k) for k in b] for b in uninterrupted], "the restored trainer took other steps"


def test_replay_dataset_takes_the_policy_under_a_stateful_dataloader(filled, replay_servers):
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")
    from trajstore.replay.dataset import ReplayDataset

    server = replay_servers(filled)
    config = {"batch_size": 4, "policy": POLICIES["reuse"]}
    expected = [keys(b) for b in SampleReader(filled, **config)]

    def run(state=None, stop=None):
        loader = torchdata.StatefulDataLoader(ReplayDataset(server.location, token=READ_TOKEN, **config),
                                              batch_size=None, num_workers=2,
                                              # a fresh interpreter: gRPC (earlier clients here) is not fork-safe
                                              multiprocessing_context="forkserver")
        if state is not None:
            loader.load_state_dict(state)
        out = []
        for batch in loader:
            out.append(list(zip(batch["trajectory_ids"], (int(i) for i in batch["sample_indices"]))))
            if stop is not None and len(out) == stop:
                break
        return out, loader.state_dict()

    head, state = run(stop=5)
    tail, _ = run(state)
    assert head + tail == expected


if __name__ == "__main__":
    if sys.argv[1] == "trainer":
        _trainer_main(sys.argv[2])
