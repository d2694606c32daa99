"""The materializer through the store, on SQLite and PostgreSQL: SPEC worked
examples end to end, exactly-once, incremental, crash-safe, sharded; a shard's
backlog; trajectories it cannot fold recorded and skipped; the long-running
worker (``workers/materializer.py``)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from sqlalchemy import select, update

import trajstore
from trajstore.cli import main
from trajstore.events import parse_event
from trajstore.fold import fold
from trajstore.log.base import EventLog, Shard
from trajstore.materializer import Materializer, shard_of
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.schema import events, samples, trajectories, unfoldable_trajectories
from trajstore.schema import events as events_table, samples as samples_table
from tests.helpers import finished, gen, reader_url_for, reward, routes, snapshot, started

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The tests whose first step connects store_url (a store's first connect migrates it): theirs is a
# copy of the migrated template (tests/conftest.py).
STORE_URL_CONNECTED_BY = (
    "test_kill_9_materializer_then_restart_equals_clean_run",
    "test_cli_materialize_and_info_show_unfoldable",
    "test_worker_follows_the_log_and_stops_on_sigterm",
    "test_worker_collects_retired_segments_after_the_grace",
)


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


@pytest.mark.parametrize("shard_index, num_shards", [(2, 2), (-1, 1), (0, 0)])
def test_a_shard_outside_its_count_is_a_validation_error(tmp_path, shard_index, num_shards):
    from trajstore.errors import ValidationError
    from trajstore.materializer import Materializer

    with trajstore.connect(f"sqlite:///{tmp_path}/s.db") as store:
        with pytest.raises(ValidationError) as e:
            Materializer(store, shard_index=shard_index, num_shards=num_shards)
    assert isinstance(e.value, ValueError) and e.value.rule == "shard"


# ----------------------------------------------------------------------------
# Materializer.pending() is this shard's backlog (what per-shard scaling reads).


def test_pending_counts_this_shards_backlog(store):
    ids = [f"t{i}" for i in range(12)]
    for tid in ids:
        store.append([started(tid), gen(tid, 0, [1, 2], [3]), finished(tid)])
    shards = [Materializer(store, shard_index=k, num_shards=3) for k in range(3)]
    mine = [sum(shard_of(t, 3) == k for t in ids) for k in range(3)]
    assert [m.pending() for m in shards] == mine and sum(mine) == 12
    assert all(m.pending(all_shards=True) == 12 for m in shards)
    assert shards[0].run().num_trajectories == mine[0]
    assert [m.pending() for m in shards] == [0, mine[1], mine[2]]
    assert Materializer(store).pending() == 12  # one shard: every finished trajectory


# ----------------------------------------------------------------------------
# A trajectory the materializer cannot fold is recorded with its reason and
# skipped; it never stops the trajectories after it, on SQLite and
# PostgreSQL. Every bad trajectory here is made the way it happens in the
# field: a payload file lost, an index row that contradicts the payload, a
# trajectory row the fold refuses, a value that does not fit the sample columns.


def good(store, tid: str) -> None:
    store.append([started(tid), gen(tid, 0, [1, 2], [3, 4], version=1), gen(tid, 1, [1, 2, 3, 4, 5], [6], version=2),
                  finished(tid)])


def _segment_of(store, tid: str) -> str:
    with store.log.read_engine.connect() as conn:
        (seg,) = set(conn.execute(select(events.c.segment).where(events.c.trajectory_id == tid)
                                  .where(events.c.segment.is_not(None))).scalars())
    return seg


def _sql(store, statement) -> None:
    with store.log.write_engine.begin() as conn:
        conn.execute(statement)


def make_missing_payload(store, tid: str) -> None:
    good(store, tid)  # its own append call: its own segment
    os.remove(store.payload.path(_segment_of(store, tid)))


def make_bad_prefix(store, tid: str) -> None:
    good(store, tid)
    _sql(store, update(events).where(events.c.trajectory_id == tid).where(events.c.seq == 1).values(prefix_len=999))


def make_expert_overflow(store, tid: str) -> None:
    # uint16 routes stored under num_experts=512, then a row saying 8 experts: the fold refuses ids > 255
    store.append([started(tid, num_experts=512),
                  gen(tid, 0, [1, 2], [3], routed_experts=routes(2, value=300, dtype=np.uint16).tolist()),
                  finished(tid)])
    _sql(store, update(trajectories).where(trajectories.c.trajectory_id == tid).values(num_experts=8))


def make_huge_model_version(store, tid: str) -> None:
    # The reported reproduction: 2**31 stored on SQLite (whatever admission
    # accepts today, an old store may hold it), then OverflowError in the fold.
    good(store, tid)
    _sql(store, update(events).where(events.c.trajectory_id == tid).values(model_version=2**31))


BAD = {
    "missing_payload": (make_missing_payload, "PayloadMissingError"),  # quarantined: see test_payload_location
    "bad_prefix": (make_bad_prefix, "CorruptStoreError"),
    "expert_overflow": (make_expert_overflow, "ValidationError"),
    "huge_model_version": (make_huge_model_version, "OverflowError"),
}


def bad_kinds(store) -> list[str]:
    # PostgreSQL's INTEGER column cannot hold 2**31: that fault exists only on SQLite.
    return [k for k in BAD if k != "huge_model_version" or store.url.startswith("sqlite")]


def unfoldable_rows(store) -> list[dict]:
    with store.log.read_engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(
            select(unfoldable_trajectories).order_by(unfoldable_trajectories.c.finished_position))]


def sample_keys(store) -> list[tuple[str, int]]:
    with store.log.read_engine.connect() as conn:
        return [tuple(r) for r in conn.execute(
            select(samples.c.trajectory_id, samples.c.sample_index).order_by(samples.c.finished_position))]


def test_huge_model_version_wedged_the_materializer_now_recorded(store):
    """The reported reproduction: every run raised OverflowError, nothing after it was folded."""
    make_huge_model_version(store, "bad") if store.url.startswith("sqlite") else make_bad_prefix(store, "bad")
    good(store, "later")
    stats = store.materialize()
    assert (stats.num_trajectories, stats.num_unfoldable) == (1, 1)
    assert [s.trajectory_id for s in store.samples()] == ["later"]
    (row,) = unfoldable_rows(store)
    assert row["trajectory_id"] == "bad" and row["shard"] == "0/1"
    assert row["error"] == ("OverflowError" if store.url.startswith("sqlite") else "CorruptStoreError")


@pytest.mark.parametrize("max_trajectories", [1, 3, 256])
def test_bad_trajectories_are_recorded_and_the_others_materialize(store, max_trajectories):
    kinds = bad_kinds(store)
    good(store, "first")
    for k in kinds:
        BAD[k][0](store, f"bad-{k}")
        good(store, f"after-{k}")
    stats = Materializer(store, max_trajectories=max_trajectories).run()
    goods = ["first"] + [f"after-{k}" for k in kinds]
    assert (stats.num_trajectories, stats.num_unfoldable) == (len(goods), len(kinds))
    assert stats.num_steps_before == 2 * len(goods)  # metrics count folded trajectories only
    assert [s.trajectory_id for s in store.samples()] == goods
    rows = unfoldable_rows(store)
    assert [(r["trajectory_id"], r["error"]) for r in rows] == [(f"bad-{k}", BAD[k][1]) for k in kinds]
    fin = {r["trajectory_id"]: r["position"] for r in store.log.read_events(
        after_position=0, limit=1000, types=["trajectory_finished"])}
    for r in rows:
        assert r["finished_position"] == fin[r["trajectory_id"]] and r["shard"] == "0/1"
        assert r["message"] and "\n" not in r["message"]
    by = {r["trajectory_id"]: r for r in rows}
    assert by["bad-expert_overflow"]["rule"] is not None and "num_experts" in by["bad-expert_overflow"]["message"]
    assert "missing" in by["bad-missing_payload"]["message"]
    assert "prefix_len" in by["bad-bad_prefix"]["message"]

    # exactly once: re-running records nothing again and folds nothing again
    again = store.materialize()
    assert (again.num_trajectories, again.num_unfoldable, again.num_samples_after) == (0, 0, 0)
    assert unfoldable_rows(store) == rows
    keys = sample_keys(store)
    assert len(keys) == len(set(keys)) == len(goods)
    # and the materializer keeps going with what arrives later
    good(store, "latest")
    later = store.materialize()
    assert (later.num_trajectories, later.num_unfoldable) == (1, 0)
    assert [s.trajectory_id for s in store.samples()][-1] == "latest"
    assert len(unfoldable_rows(store)) == len(kinds)


def test_a_whole_batch_of_bad_trajectories_still_moves_the_checkpoint(store):
    make_missing_payload(store, "a")
    make_bad_prefix(store, "b")
    stats = store.materialize()
    assert (stats.num_trajectories, stats.num_unfoldable, stats.num_samples_after) == (0, 2, 0)
    assert stats.position == store.log.head_position() == store.materialized.load_checkpoint("0/1")["position"]
    assert store.materialize().num_unfoldable == 0


def test_shards_record_their_own_unfoldable_trajectories(store):
    for i in range(12):
        (make_bad_prefix if i % 3 == 0 else good)(store, f"t{i}")
    totals = [Materializer(store, shard_index=k, num_shards=3, max_trajectories=2).run() for k in range(3)]
    assert sum(t.num_unfoldable for t in totals) == 4 and sum(t.num_trajectories for t in totals) == 8
    rows = unfoldable_rows(store)
    assert sorted(r["trajectory_id"] for r in rows) == ["t0", "t3", "t6", "t9"]
    from trajstore.materializer import shard_of

    assert all(r["shard"] == f"{shard_of(r['trajectory_id'], 3)}/3" for r in rows)


def test_stats_to_dict_and_sum(store):
    make_bad_prefix(store, "bad")
    good(store, "ok")
    stats = store.materialize()
    d = stats.to_dict()
    assert (d["num_trajectories"], d["num_unfoldable"], d["position"]) == (1, 1, store.log.head_position())
    assert not hasattr(stats, "__getitem__")


def test_cli_materialize_and_info_show_unfoldable(store_url, tmp_path, capsys):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    make_bad_prefix(store, "bad")
    make_missing_payload(store, "gone")
    good(store, "ok")
    # a quarantined trajectory (its payload file is missing) is not success: exit 1, the fix named
    assert main(["--store", store_url, "--payload", payload, "materialize"]) == 1
    captured = capsys.readouterr()
    assert "1 trajectory quarantined" in captured.err and "--refold-quarantined" in captured.err
    out = captured.out
    metrics = json.loads(out[out.index("{"):])
    assert (metrics["num_trajectories"], metrics["num_unfoldable"]) == (1, 2)
    assert main(["--store", store_url, "--payload", payload, "info"]) == 0
    info = json.loads(capsys.readouterr().out)["unfoldable_trajectories"]
    assert info["count"] == 2 and info["by_error"] == {"CorruptStoreError": 1, "PayloadMissingError": 1}
    assert [r["trajectory_id"] for r in info["recent"]] == ["gone", "bad"]
    # and in SQL, through the read-only inspection command
    assert main(["--store", reader_url_for(store_url), "sql", "--format", "json",
                 "SELECT trajectory_id, error FROM unfoldable_trajectories ORDER BY finished_position"]) == 0
    out = capsys.readouterr().out
    assert out.index('"bad"') < out.index('"gone"') and "CorruptStoreError" in out
    store.close()


def test_store_unavailable_is_not_recorded(store):
    """A payload location that cannot be reached (here: a plain file where the
    mount should be) fails the run with StoreUnavailable and records nothing:
    the next run retries it."""
    good(store, "a")
    from trajstore.errors import StoreUnavailable

    location = store.payload.location
    os.rename(location, location + ".away")
    with open(location, "w"):
        pass
    with pytest.raises(StoreUnavailable):
        store.materialize()
    os.remove(location)
    os.rename(location + ".away", location)
    assert unfoldable_rows(store) == [] and store.materialized.load_checkpoint("0/1") is None
    assert store.materialize().num_trajectories == 1


def test_migrations_create_exactly_the_schema(store):
    """The migrations and trajstore.schema agree (as every migration must); an index the
    schema makes for one dialect only (``ddl_if``: alembic's comparison does not read it)
    is compared on that dialect only, and is absent on the others."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlalchemy import inspect

    from trajstore.schema import metadata

    with store.log.write_engine.connect() as conn:
        name = conn.dialect.name
        elsewhere = {ix.name: ix.table.name for t in metadata.tables.values() for ix in t.indexes
                     if getattr(ix, "_ddl_if", None) is not None and ix._ddl_if.dialect not in (None, name)}
        ctx = MigrationContext.configure(conn, opts={"include_object": lambda obj, n, kind, *_: n not in elsewhere})
        assert compare_metadata(ctx, metadata) == []
        for index, table in elsewhere.items():
            assert index not in {ix["name"] for ix in inspect(conn).get_indexes(table)}
    if name == "sqlite":
        assert elsewhere == {"ix_lineage_step_samples_sample": "lineage_step_samples"}


# ----------------------------------------------------------------------------
# The long-running materializer worker folds as events arrive and stops cleanly on SIGTERM.


CFG = RolloutConfig(turns=2, prompt_tokens=8, output_tokens=4, observation_tokens=2, layers=2, topk=2)


def _wait_for(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_worker_follows_the_log_and_stops_on_sigterm(store_url, tmp_path):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "workers", "materializer.py"), "--store", store_url,
         "--payload", payload, "--poll-s", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        for i in range(5):
            store.append(trajectory_events(CFG, i))
        assert _wait_for(lambda: store.info()["samples"] >= 5 and store.materialized.load_checkpoint(Shard(0, 1))["position"]
                         == store.log.head_position())
        for i in range(5, 8):
            store.append(trajectory_events(CFG, i))  # arrives after the first fold
        assert _wait_for(lambda: store.materialized.load_checkpoint(Shard(0, 1))["position"] == store.log.head_position())
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    # the documented path still works, and says where the command moved
    assert "DeprecationWarning: workers/materializer.py is deprecated; run `trajstore materialize --follow`" in err
    folded = sum(json.loads(line)["num_trajectories"] for line in out.splitlines())
    assert folded == 8
    assert sorted({s.trajectory_id for s in store.samples()}) == sorted(trajectory_events(CFG, i)[0]["trajectory_id"] for i in range(8))


def _log_files(payload: str) -> list[str]:
    """Non-empty log segment files (the reserve's empty files aside). The worker's GC
    may delete a file between the listing and its size: a file gone is not counted."""
    out = []
    for n in os.listdir(payload):
        if n.startswith("events-") and n.endswith(".arrow"):
            try:
                if os.path.getsize(os.path.join(payload, n)):
                    out.append(n)
            except FileNotFoundError:
                continue
    return sorted(out)


def test_worker_collects_retired_segments_after_the_grace(store_url, tmp_path):
    """One copy at rest without an operator: the long-running materializer deletes the
    log segments its folds retired once their grace is over (here 1 s), and keeps the
    segment of a trajectory still running."""
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    for i in range(4):
        store.append(trajectory_events(CFG, i))
    running = trajectory_events(CFG, 99)[:-1]  # not finished: its segment stays
    store.append(running)
    assert len(_log_files(payload)) == 5
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "workers", "materializer.py"), "--store", store_url,
         "--poll-s", "0.1", "--gc-grace-s", "1", "--gc-interval-s", "0.2"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert _wait_for(lambda: store.info()["samples"] >= 4)
        assert _wait_for(lambda: len(_log_files(payload)) == 1, timeout_s=30)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    assert proc.returncode == 0
    (left,) = _log_files(payload)
    assert left in store.log.referenced_segments()
    assert len({s.trajectory_id for s in store.samples()}) == 4  # folded tokens read from the sample segments
    samples = list(store.samples())
    assert all(len(s.prompt_ids) + len(s.response_ids) > 0 for s in samples)
    store.close()


# ----------------------------------------------------------------------------
# The materializer's own SQL reads (EventLog.finished_after / fold_inputs as
# the SQL index implements them) give what the generic ones give, on SQLite and
# PostgreSQL.

READS_CFG = RolloutConfig(turns=3, prompt_tokens=30, output_tokens=12, observation_tokens=5, layers=3, topk=2,
                          num_experts=64, mismatch_prob=0.3, seed=5)


def test_materializer_reads_equal_the_generic_ones(store):
    for i in range(5):
        evs = trajectory_events(READS_CFG, i)
        store.append(evs if i != 3 else evs[:-1])  # one unfinished
    unfinished = trajectory_events(READS_CFG, 3)[0]["trajectory_id"]
    store.append([{"type": "reward", "trajectory_id": unfinished, "reward": 0.5}])
    log = store.log
    for after, limit in ((0, 100), (0, 2), (5, 3)):
        assert log.finished_after(after, limit) == EventLog.finished_after(log, after, limit)
    ids = [r["trajectory_id"] for r in log.finished_after(0, 100)] + [unfinished, "none"]
    trajs, events = log.fold_inputs(ids)
    assert any(r["type"] == "reward" for r in events[unfinished])
    g_trajs, g_events = EventLog.fold_inputs(log, ids)
    assert set(trajs) == set(g_trajs) and set(events) == set(g_events) == set(ids)
    for tid in trajs:
        assert trajs[tid] == {k: g_trajs[tid][k] for k in trajs[tid]}
    for tid in events:
        assert [r["position"] for r in events[tid]] == [r["position"] for r in g_events[tid]]
        for got, want in zip(events[tid], g_events[tid]):
            for k, v in got.items():
                assert (bool(v) if isinstance(want[k], bool) else v) == want[k], (tid, k)
    stats = store.materialize()
    assert stats.num_trajectories == 4
    assert store.materialize().num_trajectories == 0


# ----------------------------------------------------------------------------
# Old keyword names (one name per meaning) still work, with a DeprecationWarning:
# Materializer(batch_size=) and Store.samples(batch_size=).

def test_materializer_batch_size_is_max_trajectories(five_trajectories):
    with pytest.warns(DeprecationWarning, match="batch_size= is deprecated; use max_trajectories="):
        old = Materializer(five_trajectories, batch_size=2)
    assert old.max_trajectories == 2
    assert old.run(max_steps=1).num_trajectories == 2  # one step folds at most two trajectories
    with pytest.raises(TypeError, match="not both"), pytest.warns(DeprecationWarning):
        Materializer(five_trajectories, batch_size=2, max_trajectories=3)


def test_store_samples_batch_size_is_page_rows(five_trajectories):
    five_trajectories.materialize()
    new = [s.trajectory_id for s in five_trajectories.samples(page_rows=2)]
    with pytest.warns(DeprecationWarning, match="batch_size= is deprecated; use page_rows="):
        old = five_trajectories.samples(batch_size=2)
    assert [s.trajectory_id for s in old] == new and len(new) >= 5


def test_the_fold_reads_each_trajectorys_events_through_its_index_whatever_the_log_holds(tmp_path):
    """The fold's read of its trajectories' events (``fold_inputs``) searches
    ``ix_events_trajectory_seq``, one probe per trajectory: with a condition on
    the event type, SQLite (no statistics: trajstore runs no ANALYZE) searched
    ``ix_events_type_position`` instead, every generation and reward event of the
    log for every fold step (materializing 8 trajectories took 0.66 s at 100,000
    in the log). SQLite only: PostgreSQL plans from the statistics autovacuum
    keeps."""
    import sqlite3

    from sqlalchemy import Engine, event as sa_event

    store = trajstore.connect(f"sqlite:///{tmp_path}/s.db", payload=str(tmp_path / "payload"))
    cfg = RolloutConfig(turns=2, prompt_tokens=8, output_tokens=4, observation_tokens=2, layers=2, topk=2, seed=3)
    store.append([e for i in range(30) for e in trajectory_events(cfg, i)])
    seen: list[tuple[str, tuple]] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        if "FROM events WHERE trajectory_id IN" in " ".join(statement.replace('"', "").split()):
            seen.append((statement, tuple(parameters)))

    sa_event.listen(Engine, "before_cursor_execute", record)
    try:
        assert store.materialize().num_trajectories == 30
    finally:
        sa_event.remove(Engine, "before_cursor_execute", record)
    folded = {s.trajectory_id for s in store.samples() if len(s.response_ids)}
    store.close()
    assert seen, "the fold read no events by trajectory"
    db = sqlite3.connect(tmp_path / "s.db")
    for statement, params in seen:
        plan = " ".join(row[-1] for row in db.execute("EXPLAIN QUERY PLAN " + statement, params))
        assert "ix_events_trajectory_seq" in plan and "ix_events_type_position" not in plan, plan
    db.close()
    assert len(folded) == 30
