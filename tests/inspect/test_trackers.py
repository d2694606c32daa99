"""``trajstore track``: the store's figures pushed to TensorBoard, MLflow and W&B with
their own libraries, each read back from what the library wrote locally."""

from __future__ import annotations

import glob
import json
import math

import numpy as np
import pytest

import trajstore
from tests.helpers import reader_url_for
from tests.inspect.test_report import LENGTH_CUT, fill
from trajstore.cli import main
from trajstore.inspect.sql import read_only
from trajstore.inspect.trackers import (MLflowSink, TensorBoardSink, TrackerPusher, WandbSink,
                                        expert_load_violation, store_metrics)

# conftest: these fixtures connect store_url first thing, so it starts as a migrated copy
STORE_URL_CONNECTED_BY = ("run_store",)


@pytest.fixture
def run_store(store_url, tmp_path):
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    fill(store)
    yield store
    store.close()


def _tensorboard_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _wandb_records(path: str) -> list[bytes]:
    """The records of a W&B run file: the LevelDB log format W&B writes (a 7-byte file
    header, then 32 KiB blocks of records, each with a 7-byte header: CRC, length, kind;
    a record split across blocks comes as FIRST, MIDDLE..., LAST)."""
    import struct

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", "not a W&B run file"
    block, at, out, parts = 32768, 7, [], []
    while at + 7 <= len(data):
        if block - at % block < 7:  # a block's tail too short for a header is padding
            at += block - at % block
            continue
        _, length, kind = struct.unpack_from("<IHB", data, at)
        if kind == 0:
            break
        parts.append(data[at + 7:at + 7 + length])
        at += 7 + length
        if kind in (1, 4):  # FULL or LAST
            out.append(b"".join(parts))
            parts = []
    return out


def _wandb_history(wandb_dir: str) -> list[dict]:
    """The history rows of the one offline run under ``wandb_dir``, parsed with W&B's own protobufs."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(f"{wandb_dir}/wandb/offline-run-*/run-*.wandb")
    rows = []
    for data in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_every_tracker_gets_the_store_figures(run_store, tmp_path):
    store = run_store
    url = reader_url_for(store.url)
    samples = list(store.samples())
    sinks = [TensorBoardSink(str(tmp_path / "tb")),
             MLflowSink(f"sqlite:///{tmp_path}/mlflow.db", experiment="rl-run"),
             WandbSink("rl-run", mode="offline", dir=str(tmp_path))]
    pusher = TrackerPusher(url, sinks, payload=store.payload.location)
    first = pusher.push()
    fill(store, 100, 8, version_base=10)  # more rollouts between the two pushes
    second = pusher.push()
    pusher.close()

    # What was pushed agrees with the samples read independently.
    assert first["trajstore/samples"] == len(samples)
    length = sum(s.finish_reason == "length" for s in samples) / len(samples)
    assert math.isclose(first["trajstore/length_finish_share"], length) and length > 0
    assert first["trajstore/trajectories_finished"] == len({s.trajectory_id for s in samples})
    assert first["trajstore/moe/max_vio/max"] > 0  # the demo's routes are random: never perfectly even
    assert "trajstore/ingest/calls_per_s" not in first and second["trajstore/ingest/calls_per_s"] > 0
    assert second["trajstore/samples"] > first["trajstore/samples"]
    step = 101  # the newest training step: fill(store, 100, ...) records steps 100 and 101 (lineage)

    scalars = _tensorboard_scalars(str(tmp_path / "tb"))
    assert [v for _, v in scalars["trajstore/samples"]] == [first["trajstore/samples"], second["trajstore/samples"]]
    assert scalars["trajstore/samples"][-1][0] == step
    assert math.isclose(scalars["trajstore/length_finish_share"][0][1], length, rel_tol=1e-6)

    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    history = client.get_metric_history(sinks[1].run_id, "trajstore/samples")
    assert [(m.step, m.value) for m in history][-1] == (step, second["trajstore/samples"])
    assert client.get_run(sinks[1].run_id).info.status == "FINISHED"

    rows = _wandb_history(str(tmp_path))
    assert [r["trajstore/samples"] for r in rows] == [first["trajstore/samples"], second["trajstore/samples"]]
    assert rows[-1]["trajstore/step"] == step


def test_store_metrics_on_an_empty_store(store_url, tmp_path):
    trajstore.connect(store_url, payload=str(tmp_path / "payload")).close()
    with read_only(reader_url_for(store_url)) as query:
        got = store_metrics(query, payload=str(tmp_path / "payload"))
    assert got.step == 0 and got.values["samples"] == 0 and "staleness/mean" not in got.values


def test_expert_load_violation_is_verls_max_vio():
    """The same figure verl 0.9.1 reports for a rollout's routes, computed by verl's own function."""
    import torch
    from verl.trainer.ppo.metric_utils import _compute_rollout_moe_load_balance_metrics_from_counts

    rng = np.random.default_rng(3)
    num_experts = 16
    skew = np.array([8.0] + [1.0] * (num_experts - 1))
    routes = [rng.choice(num_experts, size=(n, 4, 2), p=skew / skew.sum()).astype(np.uint8) for n in (50, 70, 9)]
    dense = [np.concatenate([r, np.zeros((len(r), 1, 2), np.uint8)], axis=1) for r in routes]  # + a dense layer
    ours = expert_load_violation(dense, num_experts)
    counts = np.stack([np.bincount(np.concatenate([r[:, layer].ravel() for r in routes]), minlength=num_experts)
                       for layer in range(4)])
    verl = _compute_rollout_moe_load_balance_metrics_from_counts(torch.from_numpy(counts))
    assert math.isclose(ours["moe/max_vio/max"], verl["rollout/moe/max_vio/max"], rel_tol=1e-6)
    assert math.isclose(ours["moe/max_vio/avg"], verl["rollout/moe/max_vio/avg"], rel_tol=1e-6)
    assert expert_load_violation([np.zeros((5, 2, 2), np.uint8)], num_experts) == {}  # dense only: no figure


def test_track_command_once(run_store, tmp_path, capsys):
    url = reader_url_for(run_store.url)
    assert main(["--store", url, "--payload", run_store.payload.location, "track",
                 "--tensorboard", str(tmp_path / "tb"), "--once"]) == 0
    assert _tensorboard_scalars(str(tmp_path / "tb"))["trajstore/samples"][0][1] > 0
    with pytest.raises(SystemExit):  # argparse: one line naming the flag (tests/test_cli_numbers.py)
        main(["--store", url, "track", "--tensorboard", str(tmp_path / "tb2"), "--interval-s", "nan"])
    assert "argument --interval-s: 'nan' is not a finite number" in capsys.readouterr().err
    assert main(["--store", url, "track", "--once"]) == 1
    assert "name at least one tracker" in capsys.readouterr().err


def test_worker_pushes_until_sigterm(run_store, tmp_path):
    """workers/trackers.py as a real process: pushes on its interval when the store moved,
    never the same reading again, and closes its runs on SIGTERM (exit 0)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, os.path.join(root, "workers", "trackers.py"),
                             "--store", reader_url_for(run_store.url), "--payload", run_store.payload.location,
                             "--tensorboard", str(tmp_path / "tb"), "--interval-s", "0.3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def pushes(n: int) -> int:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = len(_tensorboard_scalars(str(tmp_path / "tb")).get("trajstore/samples", [])) \
                if (tmp_path / "tb").is_dir() else 0
            if got >= n:
                return got
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        return got

    try:
        assert pushes(1) == 1
        time.sleep(1.5)  # five intervals with nothing new
        assert pushes(1) == 1
        fill(run_store, 100, 8, version_base=10)
        assert pushes(2) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.communicate()
    finally:
        proc.kill()
    assert len(_tensorboard_scalars(str(tmp_path / "tb"))["trajstore/samples"]) == 2


def test_pushes_are_keyed_by_the_training_step_with_the_trainers_metrics(run_store, tmp_path):
    """With lineage, each push is keyed by the newest training step, carries that step's
    trainer metrics (mean over ranks) and the k3 mismatch of its annotated tokens."""
    store = run_store
    readers = [trajstore.SampleReader(store, rank=r, world_size=2, batch_size=4) for r in range(2)]
    batches = [next(iter(reader)) for reader in readers]
    for r, (reader, batch) in enumerate(zip(readers, batches)):
        s = batch[0]
        logprobs = np.asarray(s.rollout_logprobs, np.float32) + 0.1  # r = 0.1 on every compared token
        reader.record_step(7, run="grpo", policy_version=9, metrics={"loss": 1.0 + r, "kl": 0.5},
                           annotations={(s.trajectory_id, s.sample_index): {"trainer_logprobs": logprobs}})
    pusher = TrackerPusher(reader_url_for(store.url), [TensorBoardSink(str(tmp_path / "tb"))],
                           payload=store.payload.location)
    pushed = pusher.push()
    pusher.close()
    assert pushed["trajstore/train/loss"] == 1.5 and pushed["trajstore/train/kl"] == 0.5
    k3 = math.exp(0.1) - 1 - 0.1
    assert math.isclose(pushed["trajstore/mismatch/k3_mean"], k3, rel_tol=1e-3)
    assert _tensorboard_scalars(str(tmp_path / "tb"))["trajstore/train/loss"] == [(7, 1.5)]
