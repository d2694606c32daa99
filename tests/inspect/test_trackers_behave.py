"""Trackers that behave beside a live trainer: TensorBoard without torch, a trainer's
MLflow run left running, names MLflow refuses renamed, ranks averaged without
overflow, no push repeated once nothing moves, distributions as histograms.
Each read back from what the tracker's own library wrote (EventAccumulator, an
MLflow file store, a W&B offline run file)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trajstore
from tests.helpers import reader_url_for
from tests.inspect.test_report import fill
from tests.inspect.test_trackers import _tensorboard_scalars, _wandb_history
from trajstore.inspect.trackers import MLflowSink, TensorBoardSink, TrackerPusher, WandbSink, mlflow_name

REPO = Path(__file__).resolve().parents[2]
REFUSED = {"acc@1": 0.25, "kl(avg)": 0.5, "reward%": 75.0}


# The store_url these fixtures connect first thing (a store's first connect migrates it): a
# copy of the migrated template (tests/conftest.py).
STORE_URL_CONNECTED_BY = ("trained",)


@pytest.fixture
def trained(store_url, tmp_path):
    """A run's store whose newest step (7) carries metrics MLflow refuses, one near the float limit."""
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    fill(store)
    readers = [trajstore.SampleReader(store, rank=r, world_size=2, batch_size=4) for r in range(2)]
    for r, reader in enumerate(readers):
        s = next(iter(reader))[0]
        logprobs = np.asarray(s.rollout_logprobs, np.float32) + 0.1 * (r + 1)
        reader.record_step(7, run="grpo", policy_version=9, metrics={**REFUSED, "grad_norm": 1.5e308},
                           annotations={(s.trajectory_id, s.sample_index): {"trainer_logprobs": logprobs}})
    yield store
    store.close()


def test_mlflow_names_are_sanitised_as_documented():
    assert mlflow_name("acc@1") == "acc_at_1"
    assert mlflow_name("kl(avg)") == "kl_avg"
    assert mlflow_name("reward%") == "reward_pct"
    assert mlflow_name("trajstore/train/a b:c-d.e_f") == "trajstore/train/a b:c-d.e_f"  # allowed: unchanged
    assert mlflow_name("x#y") == "x_y"


def test_track_tensorboard_writes_event_files_without_torch(trained, tmp_path):
    """`track --tensorboard` in a process where torch cannot be imported: scalars and histograms."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    script = ("import sys; sys.modules['torch'] = None\n"  # `import torch` raises ImportError
              "from trajstore.cli import main; sys.exit(main(sys.argv[1:]))")
    logdir = tmp_path / "tb"
    proc = subprocess.run([sys.executable, "-c", script, "--store", reader_url_for(trained.url), "--payload",
                           trained.payload.location, "track", "--tensorboard", str(logdir), "--once"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    scalars = _tensorboard_scalars(str(logdir))
    assert scalars["trajstore/train/acc@1"] == [(7, 0.25)]  # TensorBoard takes any name: kept as the trainer wrote it
    assert scalars["trajstore/train/kl(avg)"] == [(7, 0.5)]
    assert "trajstore/train/grad_norm" not in scalars  # beyond a float32 scalar: left out, never written as inf
    assert "beyond a TensorBoard scalar's float32 range" in proc.stderr
    assert all(math.isfinite(v) for points in scalars.values() for _, v in points)
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    assert {"trajstore/hist/staleness", "trajstore/hist/response_len", "trajstore/hist/k3"} <= \
        set(acc.Tags()["histograms"])
    (staleness,) = acc.Histograms("trajstore/hist/staleness")
    assert staleness.step == 7 and staleness.histogram_value.num == trained.info()["samples"]
    (k3,) = acc.Histograms("trajstore/hist/k3")
    assert k3.histogram_value.num == 2  # one annotated sample per rank
    assert k3.histogram_value.min == pytest.approx(math.exp(0.1) - 1.1, rel=1e-2)


def test_mlflow_continues_a_trainers_run_without_ending_it(trained, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()  # MLflow's file store
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("trainer")
    run_id = client.create_run(experiment).info.run_id  # the trainer's live run
    pusher = TrackerPusher(reader_url_for(trained.url), [MLflowSink(uri, run_id=run_id)],
                           payload=trained.payload.location)
    pushed = pusher.push()
    assert pusher.push() == {}  # nothing moved: not pushed again
    pusher.close()
    assert client.get_run(run_id).info.status == "RUNNING"
    got = client.get_run(run_id).data.metrics
    assert got["trajstore/train/acc_at_1"] == 0.25 and got["trajstore/train/kl_avg"] == 0.5
    assert got["trajstore/train/reward_pct"] == 75.0
    assert pushed["trajstore/train/grad_norm"] == 1.5e308  # two ranks' mean, no overflow to inf
    assert got["trajstore/train/grad_norm"] == 1.5e308
    assert all(math.isfinite(v) for v in pushed.values())
    history = client.get_metric_history(run_id, "trajstore/samples")
    assert [(m.step, m.value) for m in history] == [(7, pushed["trajstore/samples"])]  # once, however many pushes
    # a run the pusher made itself is ended when it closes
    own = MLflowSink(uri, experiment="own")
    own.close()
    assert client.get_run(own.run_id).info.status == "FINISHED"


def test_pushes_stop_repeating_once_the_run_stops_and_resume_when_it_moves(trained, tmp_path):
    pusher = TrackerPusher(reader_url_for(trained.url), [TensorBoardSink(str(tmp_path / "tb"))],
                           payload=trained.payload.location)
    first = pusher.push()
    assert [pusher.push() for _ in range(3)] == [{}, {}, {}]
    fill(trained, 100, 8, version_base=10)  # the run goes on
    second = pusher.push()
    pusher.close()
    assert second["trajstore/samples"] > first["trajstore/samples"]
    assert [v for _, v in _tensorboard_scalars(str(tmp_path / "tb"))["trajstore/samples"]] == \
        [first["trajstore/samples"], second["trajstore/samples"]]


def test_wandb_offline_gets_histograms_in_the_scalars_row(trained, tmp_path):
    pytest.importorskip("wandb")
    pusher = TrackerPusher(reader_url_for(trained.url), [WandbSink("rl", mode="offline", dir=str(tmp_path))],
                           payload=trained.payload.location)
    pushed = pusher.push()
    pusher.close()
    import time

    deadline = time.monotonic() + 30
    rows: list = []
    while not rows and time.monotonic() < deadline:  # W&B's service may land the record just after finish()
        try:
            rows = _wandb_history(str(tmp_path))
        except ValueError:  # the run file not there yet
            rows = []
        time.sleep(0.2)
    (row,) = rows
    assert row["trajstore/samples"] == pushed["trajstore/samples"] and row["trajstore/step"] == 7
    # W&B's history row flattens a histogram into its fields
    assert row["trajstore/hist/staleness/_type"] == "histogram"
    assert sum(row["trajstore/hist/response_len/values"]) == trained.info()["samples"]
    assert sum(row["trajstore/hist/k3/values"]) == 2
