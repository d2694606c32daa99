"""Materializer shards as real Ray actors (local Ray cluster) fold every trajectory once."""

from __future__ import annotations

import pytest

import trajstore
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.log.base import Shard

ray = pytest.importorskip("ray")

CFG = RolloutConfig(turns=3, prompt_tokens=16, output_tokens=8, observation_tokens=4, layers=2, topk=2,
                    mismatch_prob=0.3, abort_prob=0.2)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def test_ray_shards_fold_everything_exactly_once(local_ray, fresh_pg_url, tmp_path):
    from trajstore.materializer import MaterializeStats
    from trajstore.scale.ray_actors import materialize_with_ray

    payload = str(tmp_path / "payload")
    store = trajstore.connect(fresh_pg_url, payload=payload)
    for i in range(30):
        store.append(trajectory_events(CFG, i))
    metrics = materialize_with_ray(fresh_pg_url, 3, payload=payload, num_cpus_per_shard=0.5)
    # what Store.materialize() returns (it returned a bare FoldMetrics before)
    assert isinstance(metrics, MaterializeStats)
    assert (metrics.num_trajectories, metrics.num_unfoldable) == (30, 0)
    assert metrics.position == store.log.head_position()
    samples = list(store.samples())
    assert len({(s.trajectory_id, s.sample_index) for s in samples}) == len(samples) == metrics.num_samples_after
    assert {s.trajectory_id for s in samples} == {trajectory_events(CFG, i)[0]["trajectory_id"] for i in range(30)}
    assert metrics.num_steps_before == sum(
        1 for i in range(30) for e in trajectory_events(CFG, i) if e["type"] == "generation")
    assert {store.materialized.load_checkpoint(Shard(k, 3))["position"] for k in range(3)} == {store.log.head_position()}
    again = materialize_with_ray(fresh_pg_url, 3, payload=payload, num_cpus_per_shard=0.5)
    assert (again.num_samples_after, again.num_trajectories) == (0, 0)


def test_shards_take_their_fold_batch_and_ray_options(local_ray, fresh_pg_url, tmp_path):
    from trajstore.scale.ray_actors import MaterializerShard, materialize_with_ray

    payload = str(tmp_path / "payload")
    store = trajstore.connect(fresh_pg_url, payload=payload)
    for i in range(10):
        store.append(trajectory_events(CFG, i))
    # in-process: the shard folds at most max_trajectories per commit
    shard = MaterializerShard(fresh_pg_url, 0, 1, payload, max_trajectories=4)
    assert shard.status()["max_trajectories"] == 4
    assert shard.materializer.step().num_trajectories == 4
    # through Ray, with extra actor options (a fractional CPU and a name-free spread placement)
    stats = materialize_with_ray(fresh_pg_url, 1, payload=payload, num_cpus_per_shard=0.25, max_trajectories=2,
                                 actor_options={"scheduling_strategy": "SPREAD"})
    assert (stats.num_trajectories, stats.num_unfoldable) == (6, 0)
    assert {s.trajectory_id for s in store.samples()} == {trajectory_events(CFG, i)[0]["trajectory_id"]
                                                          for i in range(10)}
