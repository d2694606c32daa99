"""The run aggregates the report's panels read (docs/report.md "Aggregates"), on both backends:
counted in the transaction that stores what they count, so a retried append or a lost
materializer race never counts twice; equal to a recount from the log and the samples; an
upgraded store gets the log's part from the migration and the samples' part from
``trajstore report --rebuild-aggregates``."""

from __future__ import annotations

import math

import numpy as np
import pytest
from alembic import command
from sqlalchemy import create_engine, text

import trajstore
from tests.helpers import brute_force_expert_load, reader_url_for
from tests.inspect.test_report import fill, run_events
from trajstore.log._aggregate_counts import EXPERT_SAMPLE_EVERY, KEYS, TRAJECTORY_TABLES, expert_arrays, expert_load_sql, totals_sql
from trajstore.log._migrate import alembic_config
from trajstore.cli import main
from trajstore.inspect._panels import collect
from trajstore.inspect._rebuild import rebuild_aggregates
from trajstore.inspect.sql import read_only
from trajstore.log.base import StaleState

TABLES = ("agg_expert_load", "agg_logprobs", "agg_output_lengths", "agg_route_drift", "agg_calls", "agg_trajectories",
          *TRAJECTORY_TABLES)


APPENDED = ("agg_output_lengths", "agg_route_drift", "agg_calls", "agg_trajectories")


def tables(store) -> dict[str, dict[tuple, tuple]]:
    """Every aggregate key: key -> values, summed over its rows (floats rounded: sums may add
    in another order), the expert load's arrays as (version, layer, expert) -> routed, and
    every row of ``agg_trajectory_stats``."""
    out = {}
    with store.log.read_engine.connect() as conn:
        for name in TABLES:
            if name == "agg_expert_load":  # one counts array per version (and commits' arrays)
                arrays = expert_arrays(conn.execute(text(expert_load_sql())).all())
                out[name] = {(v, int(l_), int(e)): (float(n),) for v, c in arrays.items()
                             for (l_, e), n in np.ndenumerate(c)}
                continue
            rows = conn.execute(text(totals_sql(name))).all()
            keys = len(KEYS[name])
            out[name] = {tuple(r[:keys]): tuple(None if v is None else round(float(v), 6) + 0.0 for v in r[keys:])
                         for r in rows}
            if name == "agg_group_variance":  # a group counted, then taken back: its rows hold 0
                out[name] = {k: v for k, v in out[name].items() if v[0]}
        out["agg_trajectory_stats"] = {r[0]: tuple(r[1:]) for r in conn.execute(text(
            "SELECT * FROM agg_trajectory_stats ORDER BY trajectory_id")).all()}
    return out


@pytest.fixture
def store(store_url, tmp_path):
    s = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    yield s
    s.close()


def test_the_aggregates_equal_a_recount_of_the_store(store):
    fill(store)
    counted = tables(store)
    assert all(counted[name] for name in TABLES)
    # the log's part, straight from the view
    with store.log.read_engine.connect() as conn:
        lengths = conn.execute(text("SELECT model_version, output_len, count(*) FROM generation_events "
                                    "GROUP BY model_version, output_len")).all()
    assert counted["agg_output_lengths"] == {(v, n): (float(c),) for v, n, c in lengths}
    # the samples' part: the counted generated tokens' decode routes (the row before each), by version
    expected = brute_force_expert_load(store.samples(), EXPERT_SAMPLE_EVERY)
    assert {k: v[0] for k, v in counted["agg_expert_load"].items() if v[0]} == expected
    assert rebuild_aggregates(store)["samples"] == store.materialized.count_samples()
    assert tables(store) == counted


def test_a_retried_append_counts_once(store):
    batches = run_events(0, 6)
    for events in batches:
        store.append(events)
    once = tables(store)
    for events in batches:  # acknowledged, sent again: duplicates, stored once
        assert store.append(events).num_duplicates == len(events)
    assert tables(store) == once
    store.append(batches[0] + run_events(6, 1)[0])  # a retry with one new trajectory: only it is counted
    after = tables(store)["agg_output_lengths"]
    new_calls = sum(1 for e in run_events(6, 1)[0] if e["type"] == "generation")
    assert sum(v[0] for v in after.values()) == sum(v[0] for v in once["agg_output_lengths"].values()) + new_calls


def test_concurrent_appends_add_rows_of_their_own(store_url, store):
    """Every append of one bucket counts the same agg_calls/agg_trajectories keys: each inserts
    delta rows of its own (no shared row updated), which add up to what a recount gives; the
    recount leaves one total row per key."""
    import threading

    other = trajstore.connect(store_url)
    try:
        batches = run_events(0, 4)
        threads = [threading.Thread(target=s.append, args=(b,)) for s, b in zip((store, other), batches[:2])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        other.append(batches[2])
        with store.log.read_engine.connect() as conn:
            deltas = conn.execute(text("SELECT count(*) FROM agg_trajectories WHERE delta AND width_s = 3600 "
                                       "AND status = 'running'")).scalar_one()
        assert deltas == 3  # one per append (each starts one trajectory), none updated
        counted = tables(store)
        rebuild_aggregates(store)  # total rows now: the same sums (of the append's tables; the
        # recount also counts the finished trajectories no materializer has taken yet)
        assert {k: v for k, v in tables(store).items() if k in APPENDED} == \
            {k: v for k, v in counted.items() if k in APPENDED}
        with store.log.read_engine.connect() as conn:
            for name in ("agg_calls", "agg_trajectories"):
                assert not conn.execute(text(f"SELECT count(*) FROM {name} WHERE delta")).scalar_one()
    finally:
        other.close()


def test_a_materializer_commit_that_loses_its_race_counts_nothing(store):
    fill(store)
    before = tables(store)
    (shard, cp), = store.materialized.checkpoints().items()
    extra = {"agg_expert_load": {(0,): np.full((2, 4), 5, np.int64)}, "agg_logprobs": {(0, 0): [1, -13.0]}}
    with pytest.raises(StaleState):  # a second materializer of the batch: its checkpoint moved on
        store.materialized.commit_samples(shard, [], None, {k: cp[k] for k in
                                          ("position", "num_steps_before", "num_samples_after",
                                           "prefix_mismatch_count")}, int(cp["position"]) - 1, aggregates=extra)
    assert tables(store) == before
    assert store.materialize().num_trajectories == 0  # nothing left: a re-run folds nothing, counts nothing
    assert tables(store) == before


def test_an_upgraded_store_is_backfilled(store_url, store, tmp_path, capsys):
    fill(store)
    fresh = tables(store)
    engine = create_engine(store_url)
    try:
        for target, down in (("0014", True), ("head", False)):  # a store made before the aggregates, upgraded
            with engine.begin() as conn:
                cfg = alembic_config()
                cfg.attributes["connection"] = conn
                (command.downgrade if down else command.upgrade)(cfg, target)
    finally:
        engine.dispose()
    upgraded = tables(store)
    assert upgraded["agg_output_lengths"] == fresh["agg_output_lengths"]  # the migration counted the log's part
    assert upgraded["agg_route_drift"] == fresh["agg_route_drift"]
    assert upgraded["agg_calls"] == fresh["agg_calls"]  # 0019 counted them from the log (total rows)
    assert upgraded["agg_trajectories"] == fresh["agg_trajectories"]
    for name in (*TRAJECTORY_TABLES, "agg_trajectory_stats"):  # 0020 counted them from the store
        assert upgraded[name] == fresh[name] and fresh[name], name
    assert not upgraded["agg_expert_load"] and not upgraded["agg_logprobs"]  # the payload's: pending
    url = reader_url_for(store_url)
    with read_only(url) as query:
        notes = {p["name"]: p["note"] for p in collect(query)["panels"]}
    assert "--rebuild-aggregates" in notes["expert_load"] and "--rebuild-aggregates" in notes["logprobs"]
    assert main(["report", "--store", store_url, "--rebuild-aggregates"]) == 0
    assert "samples" in capsys.readouterr().out
    assert tables(store) == fresh
    with read_only(url) as query:
        panels = {p["name"]: p for p in collect(query)["panels"]}
    assert panels["expert_load"]["figure"] and panels["logprobs"]["figure"]


@pytest.mark.parametrize("how", ["materialize", "refold_quarantined"])
def test_a_trajectory_folded_again_counts_once(store, monkeypatch, how):
    """A trajectory a bug kept from folding counts nothing while it is quarantined, and once
    (in the commit that takes it out of quarantine) when it folds: equal to a recount."""
    import trajstore.materializer as materializer_module
    from trajstore.materializer import Materializer

    real_fold = materializer_module.fold
    broken = "traj-0-000003"

    def fold(gens, *, trajectory_id, **kw):
        if trajectory_id == broken:
            raise TypeError("a bug")
        return real_fold(gens, trajectory_id=trajectory_id, **kw)

    for events in run_events(0, 8):
        store.append(events)
    monkeypatch.setattr(materializer_module, "fold", fold)
    assert store.materialize().num_internal_errors == 1
    without = tables(store)
    assert store.materialize().num_internal_errors == 1  # retried, still failing: counts nothing
    assert tables(store) == without
    monkeypatch.setattr(materializer_module, "fold", real_fold)  # the fix
    if how == "materialize":
        assert store.materialize().num_trajectories == 1
    else:
        assert Materializer(store).refold_quarantined().num_trajectories == 1
    folded = tables(store)
    assert folded["agg_expert_load"] != without["agg_expert_load"]
    assert (store.materialize().num_trajectories, Materializer(store).refold_quarantined().num_trajectories) == (0, 0)
    assert tables(store) == folded
    rebuild_aggregates(store)
    assert tables(store) == folded


def test_a_rebuild_without_the_payload_is_one_error_and_changes_nothing(store, tmp_path, capsys):
    from pathlib import Path

    from trajstore.payload._format import SegmentKind

    fill(store)
    before = tables(store)
    for name, _ in store.payload.list_names():  # the sample segments are gone (a wrong mount, say)
        if SegmentKind.of(name) in (SegmentKind.SAMPLES, SegmentKind.SAMPLES_PARQUET):
            (Path(store.payload.location) / name).unlink()
    assert main(["report", "--store", store.url, "--rebuild-aggregates"]) != 0
    err = capsys.readouterr().err
    assert "cannot read the sample segments" in err and "Traceback" not in err
    assert tables(store) == before


def test_rewards_near_the_float_limit_are_counted_and_the_page_draws(store_url, store):
    """Any finite reward is accepted; the aggregates' sums take it clamped to
    ``SUMMED_REWARD_BOUND`` (1e308 squared raised in Python and two of them summed
    overflowed PostgreSQL's upsert: the materializer's commit failed, and with it
    every other trajectory of the step). Minimums and maximums keep the values."""
    from tests.helpers import finished, gen, reward, started
    from trajstore.log._aggregate_counts import SUMMED_REWARD_BOUND

    values = {"big": 1.7e308, "bigger": 1.7e308, "low": -1.7e308, "plain": 0.5}
    for tid, r in values.items():
        store.append([started(tid, group_id="g"), gen(tid, 0, [1, 2], [3]), reward(tid, r), finished(tid)])
    assert store.materialize().num_trajectories == 4
    counted = tables(store)
    # the 1-second buckets (the four may finish in two seconds), summed
    seconds = [v for k, v in counted["agg_rewards"].items() if k[0] == 1]
    count, low, high = sum(v[0] for v in seconds), min(v[2] for v in seconds), max(v[3] for v in seconds)
    assert (count, low, high) == (4.0, -1.7e308, 1.7e308)
    assert all(abs(v[1]) <= 2 * SUMMED_REWARD_BOUND for v in seconds)
    assert math.isclose(sum(v[1] for v in seconds), SUMMED_REWARD_BOUND + 0.5, rel_tol=1e-12)
    assert counted["agg_group_variance"]  # the group's variance: finite, two or more rewarded
    assert all(np.isfinite(v).all() for v in counted["agg_group_variance"].values())
    with read_only(reader_url_for(store_url)) as query:
        panels = {p["name"]: p for p in collect(query)["panels"]}
    for name in ("reward_curve", "group_reward_variance", "reward_by_version"):
        assert panels[name]["figure"], (name, panels[name]["note"])
