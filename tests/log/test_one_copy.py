"""One copy of every token: the materializer re-points folded
events to the sample rows they were folded into, in its checkpoint
transaction; the log segments they leave are retired and collected, and
re-folding the re-pointed log gives byte-identical samples."""

from __future__ import annotations

import numpy as np
from sqlalchemy import select

from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.fold import fold
from trajstore.schema import events as events_table, segments as segments_table
from tests.helpers import finished, gen, routes, started

LOAD = RolloutConfig(turns=4, prompt_tokens=40, output_tokens=30, observation_tokens=10, layers=3, topk=2,
                     num_experts=64, mismatch_prob=0.3, abort_prob=0.2, fail_prob=0.1, seed=3)


def _odd_trajectories() -> list[list[dict]]:
    """Calls that exercise every way an event's payload differs from its sample's defaults."""
    seq0 = list(range(1, 10))
    out = []
    # no logprobs on one call, logprobs on the other; loss masks; per-token versions
    out.append([started("nolp"), gen("nolp", 0, seq0[:3], seq0[3:5], loss_mask=[1, 0]),
                gen("nolp", 1, seq0[:7], seq0[7:], version=2, logprobs=[-.5, -.25],
                    token_model_versions=[1, 2]), finished("nolp")])
    # token rewards on one call only (the other call's are the fold's zeros)
    out.append([started("tokrw"), gen("tokrw", 0, [1, 2], [3, 4], token_rewards=[0.5, 1.0]),
                gen("tokrw", 1, [1, 2, 3, 4, 5], [6]), finished("tokrw")])
    # routes sent as uint16 that fit uint8 in the sample, re-sent rows, a skipped start, a mismatch
    r = routes(12, 2, 2, dtype=np.uint16) + 100
    out.append([started("routes", num_experts=200),
                gen("routes", 0, [1, 2, 3], [4, 5], routed_experts=r[:4].tolist()),
                gen("routes", 1, [1, 2, 3, 4, 5, 6], [7, 8], routed_experts=r[:7].tolist()),
                gen("routes", 2, [1, 2, 3, 4, 5, 6, 7, 8, 9], [10], routed_experts=r[7:9].tolist(),
                    routed_experts_start=7),
                gen("routes", 3, [1, 2, 3, 4, 99], [11, 12], routed_experts=r[4:6].tolist(),
                    routed_experts_start=4),
                finished("routes")])
    # wide expert ids: uint16 in the sample too
    w = routes(5, 1, 2, dtype=np.uint16) + 300
    out.append([started("wide", num_experts=512), gen("wide", 0, [1, 2], [3, 4], routed_experts=w[:3].tolist()),
                gen("wide", 1, [1, 2, 3, 4, 5], [6], routed_experts=w[3:5].tolist(), routed_experts_start=3),
                finished("wide")])
    # an empty output, a scalar reward, a mismatch at seq 1
    out.append([started("empty"), gen("empty", 0, [1, 2], [], reward=0.5), gen("empty", 1, [7, 8], [9]),
                finished("empty", status="truncated")])
    return out


def _fill(store, n: int = 24) -> list[str]:
    tids = []
    for evs in _odd_trajectories():
        store.append(evs)
        tids.append(evs[0]["trajectory_id"])
    for i in range(n):
        evs = trajectory_events(LOAD, i)
        for k in range(0, len(evs), 2):  # many small log segments
            store.append(evs[k : k + 2])
        tids.append(evs[0]["trajectory_id"])
    return tids


def _same_generation(a, b) -> None:
    for name in ("trajectory_id", "seq", "model_version", "routed_experts_start", "reward", "finish_reason",
                 "event_id", "metadata"):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("prompt_ids", "output_ids", "logprobs", "routed_experts", "token_rewards", "token_model_versions"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None or y is None:
            # an empty output's logprobs: null and [] fold alike
            assert (x is None and y is None) or (name == "logprobs" and len(a.output_ids) == 0), name
            continue
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    # a call sent without loss_mask trains on every output token: the sample says so explicitly
    la = np.ones(len(a.output_ids), np.uint8) if a.loss_mask is None else a.loss_mask
    assert la.dtype == b.loss_mask.dtype and np.array_equal(la, b.loss_mask)


def _locators(store) -> dict[int, tuple]:
    e = events_table.c
    with store.log.read_engine.connect() as conn:
        return {r.position: (r.trajectory_id, r.segment, r.segment_row, r.segment_kind)
                for r in conn.execute(select(e.position, e.trajectory_id, e.segment, e.segment_row, e.segment_kind)
                                      .where(e.type == "generation"))}


def test_refold_from_the_repointed_log_is_byte_identical(store):
    tids = _fill(store)
    before = {t: store.load_generations(t) for t in tids}
    stats = store.materialize(max_trajectories=7)
    samples = {}
    for s in store.samples():
        samples.setdefault(s.trajectory_id, []).append(s)
    assert stats.num_trajectories == len(samples) == len(tids)
    assert {kind for (_, _, _, kind) in _locators(store).values()} == {"samples"}
    for tid in tids:
        gens = store.load_generations(tid)
        assert len(gens) == len(before[tid])
        for a, b in zip(before[tid], gens):
            _same_generation(a, b)
        traj = store.log.load_trajectories([tid])[tid]
        rows = store.log.trajectory_events([tid])[tid]
        rewards = [r["reward"] for r in rows if r["type"] == "reward"]
        fin = [r["status"] for r in rows if r["type"] == "trajectory_finished"][0]
        again = fold(gens, trajectory_id=tid, group_id=traj["group_id"], status=fin,
                     final_reward=rewards[-1] if rewards else None, num_experts=traj["num_experts"]).samples
        assert len(again) == len(samples[tid])
        for x, y in zip(again, samples[tid]):
            assert x.equals(y), f"{tid} sample {x.sample_index} differs after re-folding the re-pointed log"


def test_unfinished_trajectories_stay_in_the_log_and_emptied_segments_are_retired(store):
    store.append([started("done"), gen("done", 0, [1], [2]), finished("done")])
    store.append([started("running"), gen("running", 0, [1], [2])])
    shared = [started("a"), gen("a", 0, [1], [2]), started("b"), gen("b", 0, [3], [4]), finished("a")]
    store.append(shared)  # one log segment holding a finished and a running trajectory
    store.materialize()
    loc = {tid: (seg, kind) for (tid, seg, _, kind) in _locators(store).values()}
    assert loc["done"][1] == loc["a"][1] == "samples"
    assert loc["running"][1] is None and loc["b"][1] is None
    with store.log.read_engine.connect() as conn:
        rows = {r.name: r.retired_at for r in conn.execute(select(segments_table.c.name, segments_table.c.retired_at))}
    assert rows[loc["b"][0]] is None, "a segment an event still names is not retired"
    assert rows[loc["running"][0]] is None
    retired = {n for n, t in rows.items() if t is not None}
    assert len(retired) == 1 and retired.isdisjoint(store.log.referenced_segments())
    removed = store.collect_garbage(grace_s=0)
    assert set(removed) == retired
    on_disk = {n for n, _ in store.payload.list_names()}
    assert on_disk == store.log.referenced_segments()
    assert [len(store.load_generations(t)) for t in ("done", "running", "a", "b")] == [1, 1, 1, 1]
    # the running trajectories go on and fold later from both kinds of segments
    store.append([gen("b", 1, [3, 4, 5], [6]), finished("b"), finished("running")])
    store.materialize()
    assert {kind for (_, _, _, kind) in _locators(store).values()} == {"samples"}
    assert [s.response_ids.tolist() for s in store.samples(trajectory_ids=["b"])] == [[4, 5, 6]]


def test_the_grace_keeps_retired_files_and_gc_never_removes_a_named_one(store):
    _fill(store, n=6)
    store.materialize()
    named = store.log.referenced_segments()
    assert store.collect_garbage(grace_s=3600) == []  # retired just now: inside the grace
    removed = store.collect_garbage(grace_s=0)
    assert removed and not set(removed) & named
    assert {n for n, _ in store.payload.list_names()} == named
    assert all(n.startswith("samples-") for n in named), "every finished trajectory's tokens are in one copy"
    assert sum(1 for _ in store.samples()) > 0


def test_unfoldable_trajectories_stay_in_the_log(store):
    from sqlalchemy import update

    store.append([started("bad"), gen("bad", 0, [1], [2]), gen("bad", 1, [1, 2, 3], [4]), finished("bad"),
                  started("ok"), gen("ok", 0, [5], [6]), finished("ok")])
    with store.log.write_engine.begin() as conn:  # an index row contradicting its payload
        conn.execute(update(events_table).where(events_table.c.trajectory_id == "bad", events_table.c.seq == 1)
                     .values(prefix_len=999))
    stats = store.materialize()
    assert (stats.num_trajectories, stats.num_unfoldable) == (1, 1)
    kinds = {(tid, kind) for (tid, _, _, kind) in _locators(store).values()}
    assert kinds == {("bad", None), ("ok", "samples")}
    store.collect_garbage(grace_s=0)
    assert store.payload.read_locators([r for r in store.log.trajectory_events(["bad"])["bad"] if r["segment"]])
