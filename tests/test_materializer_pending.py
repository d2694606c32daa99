"""Materializer.pending() is this shard's backlog (what per-shard scaling reads)."""

from __future__ import annotations

from trajstore.materializer import Materializer, shard_of
from tests.helpers import finished, gen, started


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
