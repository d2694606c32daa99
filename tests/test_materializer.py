"""The materializer through the store, on SQLite and PostgreSQL: SPEC worked
examples end to end, exactly-once, incremental, crash-safe, sharded."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from sqlalchemy import select

import trajstore
from trajstore.events import parse_event
from trajstore.fold import fold
from trajstore.log.base import Shard
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.schema import events as events_table, samples as samples_table
from tests.helpers import finished, gen, reward, snapshot, started

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(store, calls, tid="t1", **started_kw):
    store.append([started(tid, **started_kw)] + [gen(tid, i, p, o, **kw) for i, (p, o, kw) in enumerate(calls)]
                 + [finished(tid)])
    stats = store.materialize()
    return stats, [s for s in store.samples(trajectory_ids=[tid])]


def arr(x, dtype):
    return np.asarray(x, dtype=dtype)


def test_M1(store):
    stats, (s,) = run(store, [([10, 20, 30], [40, 50], dict(logprobs=[-.1, -.2])),
                              ([10, 20, 30, 40, 50, 60, 70], [80, 90], dict(logprobs=[-.3, -.4]))])
    np.testing.assert_array_equal(s.prompt_ids, arr([10, 20, 30], np.int32))
    np.testing.assert_array_equal(s.response_ids, arr([40, 50, 60, 70, 80, 90], np.int32))
    np.testing.assert_array_equal(s.loss_mask, arr([1, 1, 0, 0, 1, 1], np.uint8))
    np.testing.assert_allclose(s.rollout_logprobs, arr([-.1, -.2, 0, 0, -.3, -.4], np.float32))
    assert (s.prompt_ids.dtype, s.loss_mask.dtype, s.rollout_logprobs.dtype) == (np.int32, np.uint8, np.float32)
    assert (stats.num_steps_before, stats.num_samples_after, stats.merge_ratio, stats.prefix_mismatch_count) == (2, 1, 0.5, 0)


def test_M2(store):
    stats, samples = run(store, [([10, 20, 30], [40, 50], {}), ([99, 88, 77], [11, 22], {})])
    assert [s.is_last_step for s in samples] == [False, True]
    assert (stats.prefix_mismatch_count, stats.merge_ratio) == (1, 1.0)
    np.testing.assert_array_equal(samples[1].prompt_ids, [99, 88, 77])


def test_M3(store):
    stats, (a, b) = run(store, [([1, 2, 3], [4, 5], {}), ([1, 2, 3, 4, 5, 6, 7], [8, 9], {}), ([100, 200], [11, 22], {})])
    np.testing.assert_array_equal(a.prompt_ids, [1, 2, 3])
    np.testing.assert_array_equal(a.response_ids, [4, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(a.loss_mask, [1, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(b.prompt_ids, [100, 200])
    np.testing.assert_array_equal(b.response_ids, [11, 22])
    assert stats.prefix_mismatch_count == 1 and stats.merge_ratio == pytest.approx(2 / 3)


def test_M4(store):
    _, (s,) = run(store, [([1], [2], dict(logprobs=[-1])), ([1, 2, 3], [4], dict(logprobs=[-2])),
                          ([1, 2, 3, 4, 5], [6], dict(logprobs=[-3]))])
    np.testing.assert_array_equal(s.prompt_ids, [1])
    np.testing.assert_array_equal(s.response_ids, [2, 3, 4, 5, 6])
    np.testing.assert_array_equal(s.loss_mask, [1, 0, 1, 0, 1])
    np.testing.assert_array_equal(s.rollout_logprobs, arr([-1, 0, -2, 0, -3], np.float32))


def test_M5(store):
    stats, samples = run(store, [([10], [20, 30], {}), ([10, 20], [30, 40], {})])
    assert len(samples) == 2 and stats.prefix_mismatch_count == 1


def test_R1(store):
    seq0, seq1 = [10, 20, 30, 40, 50], [10, 20, 30, 40, 50, 60, 70, 80, 90]
    r0 = np.array([0 * 100 + p for p in range(4)]).reshape(4, 1, 1)
    r1 = np.array([100 + p for p in range(8)]).reshape(8, 1, 1)
    _, (s,) = run(store, [(seq0[:3], seq0[3:], dict(routed_experts=r0.tolist())),
                          (seq1[:7], seq1[7:], dict(routed_experts=r1.tolist()))], num_experts=256)
    assert s.routed_experts.shape == (9, 1, 1) and s.routed_experts.dtype == np.uint8
    np.testing.assert_array_equal(s.routed_experts[:4, 0, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(s.routed_experts[4:8, 0, 0], [104, 105, 106, 107])
    np.testing.assert_array_equal(s.routed_experts_mask, [0, 0, 0, 0, 0, 0, 0, 0, 1])
    assert s.routed_experts[8, 0, 0] == 0  # masked rows hold 0..topk-1


def test_A1(store):
    _, (s,) = run(store, [([1, 2, 3], [4, 5], dict(version=5)), ([1, 2, 3, 4, 5], [6, 7, 8], dict(version=6))])
    np.testing.assert_array_equal(s.response_ids, [4, 5, 6, 7, 8])
    np.testing.assert_array_equal(s.loss_mask, [1, 1, 1, 1, 1])
    np.testing.assert_array_equal(s.token_model_versions, arr([5, 5, 6, 6, 6], np.int32))
    assert (s.min_model_version, s.max_model_version) == (5, 6)


def test_A2(store):
    _, (s,) = run(store, [
        ([1, 2], [3, 4, 5, 6], dict(version=8, token_model_versions=[7, 7, 8, 8], logprobs=[-.1, -.2, -.3, -.4],
                                   finish_reason="length")),
        ([1, 2, 3, 4, 5, 6, 9], [10], dict(version=8, finish_reason="stop")),
    ])
    np.testing.assert_array_equal(s.response_ids, [3, 4, 5, 6, 9, 10])
    np.testing.assert_array_equal(s.token_model_versions, arr([7, 7, 8, 8, -1, 8], np.int32))
    assert s.logprobs_mask.dtype == np.bool_
    np.testing.assert_array_equal(s.logprobs_mask, [1, 1, 1, 1, 0, 0])
    assert (s.min_model_version, s.max_model_version, s.finish_reason) == (7, 8, "stop")
    with store.log.read_engine.connect() as conn:
        row = conn.execute(select(samples_table.c.finish_reason, samples_table.c.min_model_version)).one()
        spans = conn.execute(select(events_table.c.version_spans, events_table.c.min_model_version,
                                    events_table.c.model_version).where(events_table.c.seq == 0)).one()
    assert tuple(row) == ("stop", 7)
    assert spans.version_spans == [{"model_version": 7, "num_tokens": 2, "num_loss_tokens": 2},
                                   {"model_version": 8, "num_tokens": 2, "num_loss_tokens": 2}]
    assert (spans.min_model_version, spans.model_version) == (7, 8)


def test_A2_backwards_versions_refused_and_nothing_stored(store):
    store.append([started("t0"), gen("t0", 0, [1], [2])])
    before = snapshot(store)
    bad = [started("t1"), {k: v for k, v in gen("t1", 0, [1, 2], [3, 4, 5, 6]).items() if k != "model_version"}
           | {"token_model_versions": [8, 7, 8, 8]}]
    with pytest.raises(trajstore.ValidationError) as e:
        store.append(bad)
    assert e.value.rule == "token_model_versions" and e.value.index == 1
    assert snapshot(store) == before


def test_generation_metadata_is_stored_and_queryable(store):
    store.append([started("t1"), gen("t1", 0, [1], [2], metadata={"tool": "search", "latency_ms": 12.5}),
                  gen("t1", 1, [1, 2], [3])])
    with store.log.read_engine.connect() as conn:
        rows = conn.execute(select(events_table.c.seq, events_table.c.metadata)
                            .where(events_table.c.type == "generation").order_by(events_table.c.seq)).all()
    assert [tuple(r) for r in rows] == [(0, {"tool": "search", "latency_ms": 12.5}), (1, None)]


def test_trajectory_reward_status_and_group_travel(store):
    store.append([started("t1", group_id="g"), gen("t1", 0, [1], [2], reward=0.25), reward("t1", 0.5),
                  reward("t1", 1.0), finished("t1", "truncated")])
    store.materialize()
    (s,) = store.samples()
    assert (s.reward, s.status, s.group_id, s.is_last_step) == (1.0, "truncated", "g", True)


def test_only_finished_trajectories_and_incremental(store):
    store.append([started("a"), gen("a", 0, [1], [2]), started("b"), gen("b", 0, [1], [2])])
    assert store.materialize().num_samples_after == 0
    store.append([finished("a")])
    first = store.materialize()
    assert (first.num_trajectories, first.num_samples_after) == (1, 1)
    again = store.materialize()
    assert (again.num_trajectories, again.num_steps_before, again.num_samples_after) == (0, 0, 0)
    store.append([gen("b", 1, [1, 2, 3], [4]), finished("b")])
    later = store.materialize()
    assert (later.num_trajectories, later.num_steps_before, later.num_samples_after) == (1, 2, 1)
    assert [s.trajectory_id for s in store.samples()] == ["a", "b"]
    assert store.info()["samples"] == 2


def test_samples_filters(store):
    for i, (status, v) in enumerate([("completed", 1), ("failed", 2), ("completed", 3)]):
        store.append([started(f"t{i}", group_id=f"g{i % 2}"), gen(f"t{i}", 0, [1], [2], version=v), finished(f"t{i}", status)])
    store.materialize()
    ids = lambda **kw: [s.trajectory_id for s in store.samples(**kw)]  # noqa: E731
    assert ids() == ["t0", "t1", "t2"]
    assert ids(status="completed") == ["t0", "t2"]
    assert ids(min_model_version=2) == ["t1", "t2"]
    assert ids(max_model_version=2) == ["t0", "t1"]
    assert ids(group_id="g0") == ["t0", "t2"]
    assert ids(trajectory_ids=["t1"]) == ["t1"]


def _random_trajectory(rng: random.Random, tid: str) -> list[dict]:
    """Commands with merges, mismatches, observation deltas, skipped prompt rows, route-less calls."""
    L, K = 2, 2
    evs = [started(tid, num_experts=300 if rng.random() < 0.2 else 64)]
    seq_tokens: list[int] = []
    for seq in range(rng.randint(1, 6)):
        kind = rng.random()
        if seq == 0 or kind < 0.25:
            prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 6))]
            if seq and rng.random() < 0.5:
                prompt = seq_tokens[: rng.randint(0, len(seq_tokens))] + prompt
        else:
            prompt = seq_tokens + [rng.randrange(1000) for _ in range(rng.randint(0, 3))]
        out = [rng.randrange(1000) for _ in range(rng.randint(1, 5))]
        n = len(prompt) + len(out)
        kw: dict = {"logprobs": [-rng.random() for _ in out], "version": seq // 2}
        if rng.random() < 0.3:
            kw.pop("logprobs")
        if rng.random() < 0.4:  # an in-flight weight update inside the call
            step = rng.randint(0, len(out))
            kw["token_model_versions"] = [seq // 2] * step + [seq // 2 + 1] * (len(out) - step)
            if rng.random() < 0.5:
                kw["version"] = kw["token_model_versions"][-1]
            else:
                kw["model_version"] = None  # derived from the last token
        if rng.random() < 0.7:
            kw["finish_reason"] = rng.choice(["stop", "length", "abort"])
        if rng.random() < 0.85:
            start = 0
            if seq and prompt[: len(seq_tokens)] == seq_tokens and rng.random() < 0.5:
                start = rng.randint(0, len(seq_tokens))
            hi = 299 if evs[0]["num_experts"] == 300 else 63
            kw["routed_experts"] = np.array([[[rng.randint(0, hi) for _ in range(K)] for _ in range(L)]
                                             for _ in range(n - 1 - start)])
            kw["routed_experts_start"] = start
        e = gen(tid, seq, prompt, out, **kw)
        evs.append({k: v for k, v in e.items() if v is not None})
        seq_tokens = prompt + out
    return evs + [finished(tid)]


def test_store_round_trip_equals_folding_the_commands(store):
    """Admission stores facts (prompt tails, unseen route rows only); folding them must
    give exactly the samples of folding the commands as sent."""
    rng = random.Random(42)
    expected = {}
    for i in range(120):
        evs = _random_trajectory(rng, f"t{i}")
        try:
            store.append(evs)
        except trajstore.ValidationError as e:
            assert e.rule == "missing_route_rows", str(e)  # only the rare skipped-rows refusal is expected
            continue
        gens = [parse_event(e) for e in evs if e["type"] == "generation"]
        expected[f"t{i}"] = fold(gens, trajectory_id=f"t{i}", num_experts=evs[0]["num_experts"]).samples
    store.materialize()
    got: dict[str, list] = {}
    for s in store.samples():
        got.setdefault(s.trajectory_id, []).append(s)
    assert len(expected) > 80
    assert got.keys() == expected.keys()
    for tid, samples in expected.items():
        assert len(got[tid]) == len(samples)
        for a, b in zip(got[tid], samples):
            assert a.equals(b), f"{tid} sample {a.sample_index} differs"


def test_sharded_materializers_fold_everything_once(store):
    cfg = RolloutConfig(turns=2, prompt_tokens=8, output_tokens=4, observation_tokens=2, layers=2, topk=2)
    for i in range(40):
        store.append(trajectory_events(cfg, i))
    from trajstore.materializer import Materializer

    total = sum(Materializer(store, shard_index=k, num_shards=3, max_trajectories=7).run().num_trajectories for k in range(3))
    assert total == 40
    tids = [s.trajectory_id for s in store.samples() if s.sample_index == 0]
    assert sorted(tids) == sorted(set(tids)) and len(tids) == 40


CRASH_CFG = RolloutConfig(turns=3, prompt_tokens=64, output_tokens=32, observation_tokens=8, layers=4, topk=2, seed=3)


def _materialize_main(url: str, payload: str) -> None:
    store = trajstore.connect(url, payload=payload)
    from trajstore.materializer import Materializer

    Materializer(store, max_trajectories=2).run()


@pytest.mark.slow
def test_kill_9_materializer_then_restart_equals_clean_run(store_url, tmp_path):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    for i in range(300):
        store.append(trajectory_events(CRASH_CFG, i))
    env = dict(os.environ, PYTHONPATH=ROOT)
    code = f"from tests.test_materializer import _materialize_main as m; m({store_url!r}, {payload!r})"
    rng = random.Random(5)
    at_kill = []
    for _ in range(5):
        before = store.materialized.load_checkpoint(Shard(0, 1))
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)
        deadline = time.time() + 60
        while store.materialized.load_checkpoint(Shard(0, 1)) == before and time.time() < deadline and proc.poll() is None:
            time.sleep(0.01)  # kill only once this run has committed something: mid-run
        time.sleep(rng.uniform(0.0, 0.15))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        cp = store.materialized.load_checkpoint(Shard(0, 1))
        at_kill.append(cp["num_samples_after"] if cp else 0)
    stats = store.materialize()  # the restart finishes the job
    cp = store.materialized.load_checkpoint(Shard(0, 1))
    got = list(store.samples())

    clean_dir = tmp_path / "clean"
    clean = trajstore.connect(f"sqlite:///{clean_dir}/clean.db", payload=str(clean_dir / "payload"))
    for i in range(300):
        clean.append(trajectory_events(CRASH_CFG, i))
    clean_stats = clean.materialize()
    want = list(clean.samples())
    assert any(0 < n < clean_stats.num_samples_after for n in at_kill), f"no kill landed mid-run: {at_kill}"
    assert len(got) == len(want) == clean_stats.num_samples_after
    assert [(s.trajectory_id, s.sample_index) for s in got] == [(s.trajectory_id, s.sample_index) for s in want]
    assert all(a.equals(b) for a, b in zip(got, want)), "samples differ from a clean run"
    assert cp["num_samples_after"] == clean_stats.num_samples_after
    assert cp["num_steps_before"] == clean_stats.num_steps_before
    assert stats.num_samples_after <= clean_stats.num_samples_after
    store.close()
    clean.close()


def test_sample_rows_index_the_merge(store):
    from sqlalchemy import select

    from trajstore.schema import samples as samples_table

    store.append([started("t1"), gen("t1", 0, [1], [2]), gen("t1", 1, [1, 2, 3], [4]), gen("t1", 2, [9], [8]),
                  finished("t1")])
    store.materialize()
    with store.log.read_engine.connect() as conn:
        rows = conn.execute(select(samples_table.c.sample_index, samples_table.c.num_merged_calls,
                                   samples_table.c.prompt_len, samples_table.c.response_len)
                            .order_by(samples_table.c.sample_index)).all()
    assert [tuple(r) for r in rows] == [(0, 2, 1, 3), (1, 1, 1, 1)]
