"""The public methods say what they take: no ``**kwargs`` that hide parameters,
and a misspelled keyword is a TypeError, not a silently ignored option."""

from __future__ import annotations

import inspect

import pytest

import trajstore
from trajstore.store import Store


@pytest.mark.parametrize("method", [Store.samples, Store.materialize, Store.append, trajstore.connect])
def test_no_hidden_keywords(method):
    kinds = {p.kind for p in inspect.signature(method).parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds


def test_samples_and_materialize_name_their_parameters(tmp_path):
    assert list(inspect.signature(Store.samples).parameters) == [
        "self", "status", "min_model_version", "max_model_version", "group_id", "trajectory_ids", "page_rows",
        "batch_size", "projection"]
    assert list(inspect.signature(Store.materialize).parameters) == [
        "self", "shard_index", "num_shards", "max_trajectories", "max_batch_tokens", "max_steps", "progress",
        "projection"]
    with trajstore.connect(f"sqlite:///{tmp_path}/s.db") as store:
        with pytest.raises(TypeError, match="statuses"):
            store.samples(statuses="completed")
        with pytest.raises(TypeError, match="max_trajectory"):
            store.materialize(max_trajectory=3)
        assert store.materialize(max_steps=1).num_samples_after == 0
