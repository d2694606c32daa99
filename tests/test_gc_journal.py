"""The store's bytes right after ``collect_garbage``: the index's journal is given back.

SQLite keeps its WAL file between checkpoints (up to ~1,000 pages, 4 MB, reused
rather than truncated); right after a GC that was most of the index's bytes on
disk (54 of 62.9 bytes per unique token at 32 trajectories of bench_pipeline's
load). ``collect_garbage`` ends with a checkpoint that truncates it, never waiting
for a reader. Sizes are deterministic here (no timing is asserted)."""

from __future__ import annotations

import os
import sqlite3

import numpy as np
import pytest
from helpers import finished, gen, started

import trajstore
from trajstore.events._wire import encode_b64, encode_npy_b64
from trajstore.demo._simulate import RolloutConfig, trajectory_events

# bench/bench_pipeline.py's load: 4 turns, 2,400 unique tokens per trajectory, 48 x 8 routes of 128 experts
CFG = RolloutConfig(turns=4, prompt_tokens=100, output_tokens=500, observation_tokens=100, layers=48, topk=8,
                    num_experts=128, mismatch_prob=0.0, abort_prob=0.0, fail_prob=0.0, route_drift=0.0)
BOUND = 420.0  # bytes per unique token of the whole store right after collect_garbage


def _wire(i: int) -> list[dict]:
    """Trajectory ``i`` as vLLM sends it: every call re-sends all route rows, arrays base64."""
    events = trajectory_events(CFG, i)
    rng = np.random.default_rng([99, i])
    longest = max(len(e["routed_experts"]) for e in events if e["type"] == "generation")
    table = rng.integers(0, CFG.num_experts, (longest, CFG.layers, CFG.topk), dtype=np.uint8)  # sizes as the bench's
    out = []
    for e in events:
        if e["type"] == "generation":
            e = dict(e, prompt_ids=encode_b64(e["prompt_ids"]), output_ids=encode_b64(e["output_ids"]),
                     logprobs=encode_b64(e["logprobs"]),
                     routed_experts=encode_npy_b64(table[:len(e["routed_experts"])]))
        out.append(e)
    return out


def _bytes(db: str, payload: str) -> dict[str, int]:
    size = lambda p: os.path.getsize(p) if os.path.exists(p) else 0  # noqa: E731
    files = [f for f in os.listdir(payload) if f.startswith(("events-", "samples-"))]
    return {"db": size(db), "wal": size(db + "-wal"),
            "payload": sum(os.path.getsize(os.path.join(payload, f)) for f in files)}


def test_the_whole_store_right_after_gc_is_within_the_bound(tmp_path):
    db, payload = str(tmp_path / "s.db"), str(tmp_path / "payload")
    n = 32
    with trajstore.connect(f"sqlite:///{db}", payload=payload) as s:
        for i in range(n):
            s.append(_wire(i))
        s.materialize()
        assert os.path.getsize(db + "-wal") > 1 << 20  # what a GC used to leave on disk
        s.collect_garbage(grace_s=0)
        sizes = _bytes(db, payload)
    tokens = n * 2400
    assert sizes["wal"] == 0
    per_token = sum(sizes.values()) / tokens
    assert per_token <= BOUND, f"{per_token:.1f} bytes per unique token after gc: {sizes}"


def test_gc_never_waits_for_a_reader_and_truncates_the_journal_once_it_is_gone(tmp_path):
    db = str(tmp_path / "s.db")
    with trajstore.connect(f"sqlite:///{db}", payload=str(tmp_path / "payload")) as s:
        s.append([started("a"), gen("a", 0, range(50), range(50)), finished("a")])
        reader = sqlite3.connect(db)
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM events").fetchone()  # a snapshot that holds the WAL
        s.collect_garbage(grace_s=0)  # returns (busy_timeout 0 for the checkpoint), WAL left as it is
        assert os.path.getsize(db + "-wal") > 0
        s.append([started("b")])  # the store keeps working
        reader.rollback()
        reader.close()
        s.collect_garbage(grace_s=0)
        assert os.path.getsize(db + "-wal") == 0
        s.append([gen("b", 0, [1, 2], [3])])  # and after it
        assert [r["type"] for r in s.log.trajectory_events(["b"])["b"]] == ["trajectory_started", "generation"]


@pytest.mark.parametrize("store_url", ["postgres"], indirect=True)
def test_gc_on_postgresql_has_no_journal_to_give_back(store):
    store.append([started("a"), gen("a", 0, [1, 2], [3]), finished("a")])
    store.materialize()
    removed = store.collect_garbage(grace_s=0)  # the journal step is a no-op there
    assert len(removed) == 1 and removed[0].startswith("events-")  # the folded log segment
    store.append([started("b")])
    assert "b" in store.log.trajectory_events(["b"])
