"""Sampling policies through `trajstore replay` servers as real processes (the
server's samples-per-insert pacing of each policy: test_replay_pacing.py):

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
import time

import pytest

import trajstore
from trajstore.reader import SampleReader
from trajstore.replay import ReplayReader

from replay_procs import READ_TOKEN
from test_reader import GROUP_SIZE, fill, keys, shuffled

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
    read it (readers' leases aside)."""
    s = trajstore.connect(module_store_url, payload=str(tmp_path_factory.mktemp("filled") / "payload"))
    fill(s, shuffled())
    yield s
    s.close()


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
