"""Scaling out with Ray: materializer shards as actors.

Each shard folds the trajectories whose ``crc32(trajectory_id) % num_shards``
is its index and keeps its own checkpoint, so shards never contend and a
restarted actor resumes where its shard stopped. PostgreSQL is the shared
index and the payload location must be visible to every node (a shared
filesystem or an object-store URI).

    import ray, trajstore.scale.ray_actors as ta
    ray.init()
    stats = ta.materialize_with_ray("postgresql+psycopg://...", num_shards=8, payload="s3://bucket/run1")
    stats.num_samples_after, stats.num_unfoldable  # a MaterializeStats, like Store.materialize()

An edge module: the trajstore core never imports ray.
"""

from __future__ import annotations

from typing import Any

from trajstore.fold import FoldMetrics
from trajstore.materializer import MaterializeStats

__all__ = ["MaterializerShard", "materialize_with_ray"]


class MaterializerShard:
    """One materializer shard; wrap with ``ray.remote`` (done by ``materialize_with_ray``)."""

    def __init__(self, store_url: str, shard_index: int, num_shards: int, payload: str | None = None,
                 max_trajectories: int = 256, batch_size: int | None = None) -> None:
        from trajstore._deprecated import renamed
        from trajstore.materializer import Materializer
        from trajstore.store import connect

        max_trajectories = renamed("batch_size", "max_trajectories", batch_size, max_trajectories, 256)
        self.store = connect(store_url, payload=payload)
        self.materializer = Materializer(self.store, shard_index=shard_index, num_shards=num_shards,
                                         max_trajectories=max_trajectories)

    def run(self) -> dict[str, Any]:
        """Fold everything pending for this shard; return ``MaterializeStats.to_dict()``."""
        return self.materializer.run().to_dict()

    def pending(self) -> int:
        return self.materializer.pending()


def materialize_with_ray(store_url: str, num_shards: int, *, payload: str | None = None,
                         num_cpus_per_shard: float = 1.0) -> MaterializeStats:
    """Run ``num_shards`` materializer actors once; return their summed stats,
    what ``Store.materialize()`` returns (``position``: the lowest shard
    checkpoint, up to which every shard has folded)."""
    import ray

    actor = ray.remote(num_cpus=num_cpus_per_shard)(MaterializerShard)
    shards = [actor.remote(store_url, k, num_shards, payload) for k in range(num_shards)]
    results = ray.get([s.run.remote() for s in shards])
    for s in shards:
        ray.kill(s)
    total = MaterializeStats(position=min((r["position"] for r in results), default=0))
    for r in results:
        total = total + MaterializeStats(
            FoldMetrics(r["num_steps_before"], r["num_samples_after"], r["prefix_mismatch_count"]),
            r["num_trajectories"], total.position, r["num_unfoldable"])
    return total
