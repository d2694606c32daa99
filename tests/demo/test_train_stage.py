"""The demo's train stage for real: workers/trainer.py trains a tiny
megatron-core MoE on CPU from reader batches of a demo store, replaying the
stored routes, and the stage prints its table."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

import trajstore
from trajstore.demo._simulate import DEMO_CONFIG, trajectory_events
from trajstore.demo._train_stage import STEPS, demo_train, worker_path

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow


@pytest.fixture
def demo_store(tmp_path):
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    store = trajstore.connect(url, payload=str(tmp_path / "payload"))
    for i in range(48):  # model versions 0..4 as in the demo: some groups stale, most not
        store.append(trajectory_events(DEMO_CONFIG, i, version=i * 5 // 48))
    store.materialize()
    store.close()
    return url, str(tmp_path / "payload")


def test_train_stage_replays_the_stored_routes(demo_store):
    from rich.console import Console

    assert worker_path() is not None, "run from a source checkout: workers/trainer.py is the stage's worker"
    url, payload = demo_store
    out = io.StringIO()
    console = Console(file=out, width=200, force_terminal=False)
    demo_train(console, url, SimpleNamespace(payload=payload))
    text = out.getvalue()
    assert "train stage failed" not in text, text
    rows = [line for line in text.splitlines() if line.strip().startswith("│") and "%" in line]
    assert len(rows) == STEPS, text
    for row in rows:
        cells = [c.strip() for c in row.strip().strip("│").split("│")]
        router_equals_recorded = cells[5]
        assert router_equals_recorded == "100.0%", row
        assert int(cells[4]) > 0, row  # replayed tokens
