"""A materializer commit on PostgreSQL sends its rows as arrays (trajstore/log/_pg_arrays.py):
its statements do not grow with the rows it writes (an executemany sent one per row: a
32-trajectory step's commit was ~230), and the values stored are the ones given."""

from __future__ import annotations

from helpers import finished, gen, reward, routes, started
from pg_roundtrips import RoundTrips
from sqlalchemy import Column, Float, Integer, String, select, text

import trajstore
from trajstore.log._pg_arrays import columns_of
from trajstore.materializer import Materializer
from trajstore.schema import agg_rewards_delta, agg_trajectory_shapes_delta, events, samples


def _trajectories(prefix: str, n: int) -> list[dict]:
    out = []
    for i in range(n):
        t = f"{prefix}{i}"
        prompt, prev = [1, 2, 3], []
        out.append(started(t, group_id=f"g{i // 2}", num_experts=8))
        for turn in range(3):
            out_ids = [10 + turn] * 4
            out.append(gen(t, turn, prompt, out_ids, version=turn % 2, logprobs=[-0.5] * 4,
                           routed_experts=routes(len(prompt) + 4 - 1, 2, 2)))
            prev = prompt + out_ids
            prompt = prev + [7, 8]
        out.append(reward(t, 1 if i % 2 else 0.25))  # an int reward among floats
        out.append(finished(t))
    return out


def _commit_statements(store, trips: RoundTrips, m: Materializer) -> int:
    trips.reset()
    stats = m.run(max_steps=1, compact=False)
    assert stats.num_trajectories > 0
    return trips.counts()["statements"]


def test_a_commit_sends_as_many_statements_for_4_trajectories_as_for_24(fresh_pg_url, tmp_path):
    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as store:
        m = Materializer(store, max_trajectories=64)
        store.append(_trajectories("w", 2))
        m.run(compact=False)  # statements prepared, the checkpoint row there
        trips = RoundTrips(store.log.db.write_engine)
        try:
            store.append(_trajectories("a", 4))
            few = _commit_statements(store, trips, m)
            store.append(_trajectories("b", 24))
            many = _commit_statements(store, trips, m)
        finally:
            trips.close()
        with store.log.db.reading("test") as conn:
            moved = conn.execute(select(events.c.segment_kind).where(events.c.type == "generation")).scalars().all()
            rows = conn.execute(select(samples.c.trajectory_id)).scalars().all()
    assert len(rows) == 30 and set(moved) == {"samples"}  # every call re-pointed at its sample row
    # one statement per kind of row (the re-pointing, the samples, the counts...), not one per row
    assert many - few <= 2, (few, many)  # one statement per row made it 66 and 177
    assert many < 72, many  # fewer than the 72 events re-pointed alone


def test_counts_given_as_ints_and_floats_are_stored_as_given(fresh_pg_url, tmp_path):
    rewards = [(1, 10, 1, 1, 1, 1), (1, 11, 2, 0.75, 0.25, 0.5), (60, 0, 3, 2, -1, 1.5)]
    shapes = [(1, 1, 0, 1, 0), (2, 1, 1, 1, 0)]
    r, sh = agg_rewards_delta.c, agg_trajectory_shapes_delta.c
    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as store:
        store.log.db.transaction("inserting counts", lambda conn, d: d.insert_tuples(conn, [
            (agg_rewards_delta, ("width_s", "bucket_start", "rewarded", "reward_sum", "reward_min", "reward_max"),
             rewards),
            (agg_trajectory_shapes_delta, ("num_generations", "num_samples", "num_prefix_mismatches", "trajectories",
                                           "placeholder_logprobs"), shapes)]))
        with store.log.db.reading("test") as conn:
            got = conn.execute(select(r.width_s, r.bucket_start, r.rewarded, r.reward_sum, r.reward_min, r.reward_max)
                               .order_by(r.width_s, r.bucket_start)).all()
            got_shapes = conn.execute(select(sh.num_generations, sh.trajectories).order_by(sh.num_generations)).all()
    assert [tuple(x) for x in got] == [(1, 10, 1, 1.0, 1.0, 1.0), (1, 11, 2, 0.75, 0.25, 0.5),
                                       (60, 0, 3, 2.0, -1.0, 1.5)]
    assert [tuple(x) for x in got_shapes] == [(1, 1), (2, 1)]


def test_a_column_of_mixed_python_types():
    f, i, s = Column("f", Float), Column("i", Integer), Column("s", String)
    assert columns_of([(1, 1, "a"), (2.5, 2, None), (None, None, "b")], [f, i, s]) == [
        [1.0, 2.5, None], [1, 2, None], ["a", None, "b"]]
    assert columns_of([(None,), (None,)], [i]) == [[None, None]]
    assert columns_of([(1,), (True,)], [i]) is None  # psycopg would refuse the array: rows one by one
    assert columns_of([("a",), (1,)], [s]) is None
    assert columns_of([(1.5,), (True,)], [f]) is None


def test_a_compaction_sends_as_many_statements_for_4_trajectories_as_for_24(fresh_pg_url, tmp_path):
    """Its upserts into the totals go one statement of arrays per table (``add_counts``), not one per key."""
    from trajstore._upkeep.gc import compact_run_aggregates

    with trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p")) as store:
        m = Materializer(store, max_trajectories=64)
        store.append(_trajectories("w", 2))
        m.run(compact=False)
        compact_run_aggregates(store)  # statements prepared, the totals' first rows there
        trips = RoundTrips(store.log.db.write_engine)
        counted = []
        try:
            for prefix, n in (("a", 4), ("b", 24)):
                store.append(_trajectories(prefix, n))
                m.run(compact=False)
                trips.reset()
                compact_run_aggregates(store)
                counted.append(trips.counts()["statements"])
        finally:
            trips.close()
        with store.log.db.reading("test") as conn:
            groups = conn.execute(text("SELECT count(*) FROM agg_groups")).scalar_one()
    assert groups == 12  # g0..g11: every group's total row
    # which tables have rows to fold moves the count by a statement or two; one statement per
    # key (group, bucket) made it 65 and 88
    assert counted[1] - counted[0] <= 3, counted
