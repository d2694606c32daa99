"""Compaction of small log segments and the GC of retired ones:
events keep reading the same bytes, the file count stays bounded, a race
with the materializer leaves nothing half-done, and a reader in flight keeps
reading a file the GC unlinks."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.ipc as ipc
import pytest

import trajstore
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.log.base import Repoint, StaleState
from tests.helpers import finished, gen, started

CFG = RolloutConfig(turns=4, prompt_tokens=40, output_tokens=30, observation_tokens=10, layers=3, topk=2,
                    num_experts=64, mismatch_prob=0.2, abort_prob=0.0, fail_prob=0.0, seed=11)


def _split(evs: list[dict]) -> tuple[list[dict], dict]:
    """A trajectory's events without its finish, and the finish."""
    return evs[:-1], evs[-1]


def _append_running(store, ids) -> dict[str, dict]:
    """Every trajectory's events but its finish, two per append (many small segments)."""
    fins = {}
    for i in ids:
        evs, fin = _split(trajectory_events(CFG, i))
        for k in range(0, len(evs), 2):
            store.append(evs[k : k + 2])
        fins[fin["trajectory_id"]] = fin
    return fins


def _log_files(store) -> set[str]:
    return {n for n, _ in store.payload.list_names() if n.startswith("events-")}


def _same(gens_a, gens_b) -> bool:
    def eq(x, y):
        if x is None or y is None:
            return x is None and y is None
        if isinstance(x, np.ndarray):
            return x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
        return x == y
    fields = ("seq", "prompt_ids", "output_ids", "logprobs", "loss_mask", "routed_experts", "routed_experts_start",
              "token_rewards", "token_model_versions", "reward", "finish_reason", "model_version")
    return len(gens_a) == len(gens_b) and all(eq(getattr(a, f), getattr(b, f)) for a, b in zip(gens_a, gens_b)
                                              for f in fields)


def test_compaction_moves_running_events_into_few_segments_with_the_same_bytes(store):
    fins = _append_running(store, range(12))
    before = {t: store.load_generations(t) for t in fins}
    n_before = len(_log_files(store))
    done = store.compact(target_bytes=1 << 20)
    assert done["events_moved"] == sum(len(g) for g in before.values()) and done["segments_retired"] == n_before
    assert store.collect_garbage(grace_s=3600) == []  # retired, but inside the grace
    store.collect_garbage(grace_s=0)
    files = _log_files(store)
    assert len(files) == done["segments_written"] < n_before / 4
    assert files == store.log.referenced_segments()
    assert all(_same(before[t], store.load_generations(t)) for t in fins)
    # folding the compacted log gives the samples of a store that never compacted
    store.append(list(fins.values()))
    store.materialize()
    got = list(store.samples())
    clean = trajstore.connect(f"sqlite:///{os.path.dirname(store.payload.root)}/clean.db",
                              payload=store.payload.root + "-clean")
    _append_running(clean, range(12))
    clean.append(list(fins.values()))
    clean.materialize()
    want = list(clean.samples())
    clean.close()
    assert len(got) == len(want) and all(a.equals(b) for a, b in zip(got, want))


def test_file_count_stays_bounded_as_the_log_grows(store):
    counts = []
    for round_ in range(4):
        _append_running(store, range(round_ * 6, round_ * 6 + 6))
        store.compact(target_bytes=256 << 10)
        store.collect_garbage(grace_s=0)
        counts.append(len(_log_files(store)))
    live = sum(os.path.getsize(store.payload.path(n)) for n in _log_files(store))
    assert counts[-1] <= live // (128 << 10) + 2, counts
    assert counts[-1] < 6 * 5  # vs one file per two events without compaction


def test_compaction_that_loses_to_the_materializer_changes_nothing(store):
    fins = _append_running(store, range(3))
    segs = [c["name"] for c in store.log.compaction_candidates(max_bytes=1 << 30, limit_bytes=1 << 30)]
    live = store.log.live_locators(segs)
    store.append(list(fins.values()))
    store.materialize()  # re-points every one of them while the compaction "runs"
    seg_row = {"name": "events-compacted-late.arrow", "kind": "events", "num_rows": len(live), "num_bytes": 1,
               "created_at": 0.0}
    moves = [Repoint(r["position"], seg_row["name"], k, None, r["segment"], r["segment_row"])
             for k, r in enumerate(live)]
    before = {t: store.load_generations(t) for t in fins}
    with pytest.raises(StaleState):
        store.log.commit_compaction(seg_row, moves)
    assert seg_row["name"] not in store.log.segments_in_use(retired_before=float("-inf"))
    assert all(_same(before[t], store.load_generations(t)) for t in fins)
    # and through Store.compact: nothing small and live is left to do
    assert store.compact(target_bytes=1 << 20)["events_moved"] == 0


def test_compaction_stops_when_one_segment_holds_every_live_row(store):
    """Found by the three-jobs test on SQLite: log segments emptied by a re-pointing
    but left unretired (two re-pointings raced each other's retiring) were picked as
    candidates every round beside the one segment still holding live rows, which was
    then copied into a new, equally small segment, round after round, for ever."""
    from sqlalchemy import update

    from trajstore.schema import segments as segments_table

    store.append(trajectory_events(CFG, 0))  # one append each: a segment of its own
    store.append(trajectory_events(CFG, 1))
    running, _ = _split(trajectory_events(CFG, 2))
    store.append(running)
    store.materialize()  # re-points trajectories 0 and 1 and retires their segments
    with store.log.write_engine.begin() as conn:  # as if the retiring had raced
        conn.execute(update(segments_table).values(retired_at=None))
    files = _log_files(store)
    assert len(files) == 3
    before = store.load_generations(running[0]["trajectory_id"])
    stats = store.compact(target_bytes=1 << 30, max_rounds=20)
    assert stats == {"rounds": 1, "segments_retired": 2, "events_moved": 0, "segments_written": 0}
    assert _log_files(store) == files  # the live segment was not rewritten
    assert store.compact(target_bytes=1 << 30, max_rounds=20)["rounds"] == 0
    assert _same(before, store.load_generations(running[0]["trajectory_id"]))
    store.collect_garbage(grace_s=0)
    assert len(_log_files(store)) == 1


def test_a_reader_holding_an_open_segment_keeps_reading_through_a_gc(store):
    store.append([started("r"), gen("r", 0, [1, 2, 3], list(range(100, 400)), logprobs=[-0.5] * 300),
                  gen("r", 1, [1, 2, 3] + list(range(100, 400)) + [7], list(range(500, 800))), finished("r")])
    (name,) = _log_files(store)
    rows = [r for r in store.log.trajectory_events(["r"])["r"] if r["type"] == "generation"]
    with store.payload._open(name) as src:  # what read_rows does: a memory map of the file
        reader = ipc.open_file(src)
        first = reader.get_batch(0)
        store.materialize()
        assert name not in store.log.referenced_segments()
        assert store.collect_garbage(grace_s=0) == [name]
        assert not os.path.exists(store.payload.path(name))
        second = reader.get_batch(1)  # unlinked, still readable through the open map
    assert first.column("output_ids")[0].values.to_numpy().tolist() == list(range(100, 400))
    assert second.column("output_ids")[0].values.to_numpy().tolist() == list(range(500, 800))
    # a locator resolved before the re-pointing is still good while the file is retired within the grace
    store.append([started("s"), gen("s", 0, [1], [2]), finished("s")])
    (old,) = _log_files(store)
    stale = store.log.trajectory_events(["s"])["s"]
    store.materialize()
    assert store.collect_garbage(grace_s=3600) == []
    assert old in store.payload.read_locators([r for r in stale if r["segment"]])


def test_cli_gc_compact(store_url, tmp_path, capsys):
    from trajstore.cli import main

    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    fins = _append_running(store, range(6))
    before = {t: store.load_generations(t) for t in fins}
    n = len(_log_files(store))
    store.close()  # the writer is done: its reserve of empty segment files goes with it
    assert main(["--store", store_url, "--payload", payload, "gc", "--compact", "--grace-s", "0"]) == 0
    out = capsys.readouterr().out
    assert f"from {n} small log segment(s) into 1" in out and f"removed {n} payload file(s)" in out
    assert len(_log_files(store)) == 1
    assert all(_same(before[t], store.load_generations(t)) for t in fins)
    store.close()


def test_compaction_materializer_and_appends_at_once_equal_a_clean_run(store_url, tmp_path):
    """Three real jobs race on the same events: a writer appending in small pieces,
    a materializer re-pointing what finishes, a compactor moving what runs."""
    import threading
    import time

    from trajstore.materializer import Materializer

    payload = str(tmp_path / "payload")
    stores = [trajstore.connect(store_url, payload=payload) for _ in range(3)]
    n, done, errors = 12, threading.Event(), []

    def writer():
        for i in range(n):
            evs = trajectory_events(CFG, i)
            for k in range(0, len(evs), 2):
                stores[0].append(evs[k : k + 2])
        done.set()

    def guarded(job):
        def run():
            try:
                while not done.is_set():
                    job()
                    time.sleep(0.02)  # a busy loop would starve the writer on a loaded machine
            except Exception as e:  # reported below, with the job's name
                errors.append(e)
        return run

    threads = [threading.Thread(target=writer),
               threading.Thread(target=guarded(lambda: Materializer(stores[1], max_trajectories=2).run())),
               threading.Thread(target=guarded(lambda: stores[2].compact(target_bytes=32 << 10)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    store = stores[0]
    stats = store.materialize()
    assert stats.num_unfoldable == 0 and store.materialized.unfoldable_trajectories()["count"] == 0
    store.collect_garbage(grace_s=0)
    assert {n for n, _ in store.payload.list_names()} == store.log.referenced_segments()
    got = list(store.samples())
    clean = trajstore.connect(f"sqlite:///{tmp_path}/clean.db", payload=str(tmp_path / "clean-payload"))
    for i in range(n):
        clean.append(trajectory_events(CFG, i))
    clean.materialize()
    want = list(clean.samples())
    clean.close()
    assert [(s.trajectory_id, s.sample_index) for s in got] == [(s.trajectory_id, s.sample_index) for s in want]
    assert all(a.equals(b) for a, b in zip(got, want))
    for s in stores:
        s.close()
