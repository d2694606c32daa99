"""Stores of one backend in a process share the driver statements they build
(``trajstore.log._dialect.SqlDialect``): a new store's first append compiles nothing."""

from __future__ import annotations

from pathlib import Path

import trajstore
from trajstore.demo._simulate import RolloutConfig, trajectory_events

CFG = RolloutConfig(turns=2, prompt_tokens=8, output_tokens=8, observation_tokens=4, layers=2, topk=2,
                    num_experts=8, mismatch_prob=0.0, abort_prob=0.0, fail_prob=0.0)


def test_a_new_store_reuses_the_statements_another_built(store: trajstore.Store, store_url: str, tmp_path: Path):
    store.append(trajectory_events(CFG, 0))
    built = store.log.db.dialect._statements
    keys = set(built)
    assert keys  # the append built its statements
    other = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    try:
        assert other.log.db.dialect is not store.log.db.dialect
        assert other.log.db.dialect._statements is built
        events = trajectory_events(CFG, 1)
        assert other.append(events).num_appended == len(events)
        assert set(built) == keys  # the same append on the new store built nothing
    finally:
        other.close()
