"""Scaling out with Ray: materializer shards as actors.

Each shard folds the trajectories whose ``crc32(trajectory_id) % num_shards``
is its index and keeps its own checkpoint, so shards never contend and a
restarted actor resumes where its shard stopped. PostgreSQL is the shared
index and the payload location must be visible to every node (a shared
filesystem or an object-store URI).

    import ray, trajstore.scale.ray_actors as ta
    ray.init(address="auto")                      # a running cluster (`ray start`)
    stats = ta.materialize_with_ray("postgresql+psycopg://...", num_shards=8)
    stats.num_samples_after, stats.num_unfoldable  # a MaterializeStats, like Store.materialize()

    shards = ta.start_shards("postgresql+psycopg://...", num_shards=8)   # long-running, restarted by Ray
    ray.get([s.status.remote() for s in shards])   # per-shard pending counts, checkpoints

The payload location comes from the store (docs/deploy.md); ``payload``, if
given, must agree with it.

An edge module: the trajstore core never imports ray.
"""

from __future__ import annotations

from typing import Any

from trajstore._upkeep.gc import GC_INTERVAL_S, GC_MARGIN_S
from trajstore.fold import FoldMetrics
from trajstore.materializer import MaterializeStats
from trajstore.scale._config import ShardConfig

__all__ = ["MaterializerShard", "materialize_with_ray", "start_shards"]


class MaterializerShard:
    """One materializer shard; wrap with ``ray.remote`` (done by ``materialize_with_ray``
    and ``start_shards``).

    ``follow=True``: the actor folds as trajectories finish, in a thread of its own,
    from its construction until ``stop()`` (``Materializer.follow``; shard 0 also
    collects retired payload in its GC worker thread, ``gc_grace_s`` after
    retirement or the oldest live reader lease). Its state is its shard's
    checkpoint in the store: an actor restarted by Ray (``max_restarts``) is
    constructed again and resumes where the shard's last commit left it; nothing
    is folded twice (each commit is guarded by the checkpoint it started from)."""

    def __init__(self, store_url: str, shard_index: int, num_shards: int, payload: str | None = None,
                 max_trajectories: int = 256, batch_size: int | None = None, *, follow: bool = False,
                 poll_s: float = 1.0, gc_grace_s: float | None = GC_MARGIN_S, gc_interval_s: float = GC_INTERVAL_S,
                 abandon_after_s: float | None = None, unavailable_timeout_s: float | None = None) -> None:
        import threading

        from trajstore._util.deprecated import renamed
        from trajstore.materializer import Materializer
        from trajstore.store import connect

        max_trajectories = renamed("batch_size", "max_trajectories", batch_size, max_trajectories, 256)
        # the options of `trajstore worker` (one ShardConfig): the same fold, loop and GC either way
        self.config = ShardConfig(shard=shard_index, num_shards=num_shards, max_trajectories=max_trajectories,
                                  abandon_after_s=abandon_after_s, poll_s=poll_s, gc_grace_s=gc_grace_s,
                                  gc_interval_s=gc_interval_s, unavailable_timeout_s=unavailable_timeout_s)
        self.store = connect(store_url, payload=payload)
        self.materializer = Materializer(self.store, shard_index=shard_index, num_shards=num_shards,
                                         max_trajectories=max_trajectories)
        self._stop = threading.Event()
        self._folded = {"num_trajectories": 0, "num_unfoldable": 0, "num_internal_errors": 0}
        self._error: str | None = None
        self._thread = None
        if follow:
            self._thread = threading.Thread(target=self._follow, daemon=True)
            self._thread.start()

    def _follow(self) -> None:
        def count(stats) -> None:
            self._folded["num_trajectories"] += stats.num_trajectories
            self._folded["num_unfoldable"] += stats.num_unfoldable
            self._folded["num_internal_errors"] += stats.num_internal_errors

        while not self._stop.is_set():
            try:
                self.materializer.follow(self._stop, on_step=count, **self.config.follow_kwargs())
            except Exception as e:  # the store unreachable for a while: say so, retry
                self._error = f"{type(e).__name__}: {e}"
                self._stop.wait(self.config.poll_s)

    def run(self) -> dict[str, Any]:
        """Fold everything pending for this shard; return ``MaterializeStats.to_dict()``."""
        return self.materializer.run().to_dict()

    def pending(self) -> int:
        """This shard's backlog: its finished trajectories after its checkpoint."""
        return self.materializer.pending()

    def status(self) -> dict[str, Any]:
        """``shard``, ``pending`` (this shard's backlog), ``position`` (its checkpoint),
        ``max_trajectories`` (its fold batch), what this incarnation folded, ``following``,
        the last error (None). A step's counts are added when the step returns (after its
        commit and, without a GC worker, its compaction), so they may trail ``position``
        by the step in progress."""
        return {"shard": str(self.materializer.shard), "pending": self.materializer.pending(),
                "position": self.materializer._checkpoint()[0],
                "max_trajectories": self.materializer.max_trajectories, **self._folded,
                "following": self._thread is not None and self._thread.is_alive(), "error": self._error}

    def node_id(self) -> str | None:
        """The Ray node this actor runs on (None outside Ray)."""
        try:
            import ray

            return ray.get_runtime_context().get_node_id()
        except Exception:
            return None

    def stop(self) -> None:
        """Stop following after the step in progress commits."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def start_shards(store_url: str, num_shards: int, *, payload: str | None = None, name: str = "trajstore",
                 namespace: str = "trajstore", num_cpus_per_shard: float = 1.0, poll_s: float = 1.0,
                 gc_grace_s: float | None = GC_MARGIN_S, max_restarts: int = -1, max_trajectories: int = 256,
                 actor_options: dict[str, Any] | None = None, gc_interval_s: float = GC_INTERVAL_S,
                 abandon_after_s: float | None = None, unavailable_timeout_s: float | None = None) -> list[Any]:
    """Start (or find, by name) ``num_shards`` long-running shard actors that follow
    the log: detached named actors ``{name}-{k}of{num_shards}`` in ``namespace``,
    restarted by Ray when they die (``max_restarts``; -1: always). Call after
    ``ray.init(address=...)``; returns the actor handles (``status``, ``pending``,
    ``stop``). ``max_trajectories``: trajectories folded per commit
    (``Materializer``); it, ``poll_s``, ``gc_grace_s``, ``gc_interval_s``,
    ``abandon_after_s`` and ``unavailable_timeout_s`` are ``trajstore worker``'s
    options of the same names (``--poll-s`` ...). ``actor_options``: more Ray actor options (``resources``,
    ``scheduling_strategy``, ...), for placement. Each shard holds
    ``num_cpus_per_shard`` while it lives, and a restarted one is placed only
    where that much is free: leave spare capacity (docs/deploy.md,
    "Materializer shards on a Ray cluster")."""
    import ray

    actor = ray.remote(MaterializerShard)
    return [actor.options(name=f"{name}-{k}of{num_shards}", namespace=namespace, get_if_exists=True,
                          num_cpus=num_cpus_per_shard, max_restarts=max_restarts, max_task_retries=-1,
                          lifetime="detached", **(actor_options or {})).remote(
        store_url, k, num_shards, payload, max_trajectories, follow=True, poll_s=poll_s, gc_grace_s=gc_grace_s,
        gc_interval_s=gc_interval_s, abandon_after_s=abandon_after_s, unavailable_timeout_s=unavailable_timeout_s)
        for k in range(num_shards)]


def materialize_with_ray(store_url: str, num_shards: int, *, payload: str | None = None,
                         num_cpus_per_shard: float = 1.0, max_trajectories: int = 256,
                         actor_options: dict[str, Any] | None = None) -> MaterializeStats:
    """Run ``num_shards`` materializer actors once; return their summed stats,
    what ``Store.materialize()`` returns (``position``: the lowest shard
    checkpoint, up to which every shard has folded). ``max_trajectories`` and
    ``actor_options`` as for ``start_shards``."""
    import ray

    actor = ray.remote(MaterializerShard).options(num_cpus=num_cpus_per_shard, **(actor_options or {}))
    shards = [actor.remote(store_url, k, num_shards, payload, max_trajectories) for k in range(num_shards)]
    results = ray.get([s.run.remote() for s in shards])
    for s in shards:
        ray.kill(s)
    total = MaterializeStats(position=min((r["position"] for r in results), default=0))
    for r in results:
        total = total + MaterializeStats(
            FoldMetrics(r["num_steps_before"], r["num_samples_after"], r["prefix_mismatch_count"]),
            r["num_trajectories"], total.position, r["num_unfoldable"],
            num_internal_errors=r.get("num_internal_errors", 0))
    return total
