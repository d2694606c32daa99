"""The materializer's run aggregates as rows of each commit's own (migration 0022,
docs/report.md "Aggregates"): shards committing at once never wait on each other's rows,
reads sum the totals and the deltas exactly, and the background compaction folds the
deltas exactly once (a compaction whose backend is killed changes nothing; run again it
folds, and then finds nothing to do). Expert load equals a brute-force count; the fold
imports no pandas."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psycopg
import pytest
from sqlalchemy import create_engine, text

import trajstore
from tests.inspect.test_aggregates import tables
from tests.inspect.test_report import run_events
from tests.helpers import brute_force_expert_load, count_expert_load_every
from trajstore.log._aggregate_counts import EXPERT_SAMPLE_EVERY, expert_arrays, expert_load_sql, sample_counts
from trajstore._upkeep.gc import compact_run_aggregates
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.inspect._rebuild import rebuild_aggregates
from trajstore.log._aggregates import count_commit, insert_fold_deltas, pending_deltas
from trajstore.materializer import Materializer

REPO = Path(__file__).resolve().parents[2]
LAGGING = ("agg_group_variance", "agg_expert_load")
"""What the compaction writes (the groups' settled part) or folds into totals a read of the
table alone sees (the expert load's arrays: ``_expert_load_read`` reads both)."""


def _pending(store) -> int:
    return store.log.db.transaction("counting deltas", lambda conn, d: pending_deltas(conn, d))


def _brute_force_expert_load(store, every: int = EXPERT_SAMPLE_EVERY) -> dict[tuple, int]:
    """Every counted generated token's decode route (the row before it), by (version, layer, expert)."""
    return brute_force_expert_load(store.samples(), every)


def _expert_load_read(store) -> dict[tuple, int]:
    """What the run view reads: the compacted totals plus the commits' arrays not compacted yet."""
    with store.log.read_engine.connect() as conn:
        arrays = expert_arrays(conn.execute(text(expert_load_sql())).all())
    out: dict[tuple, int] = {}
    for v, c in arrays.items():
        for (l_, e), n in np.ndenumerate(c):
            out[(v, l_, e)] = out.get((v, l_, e), 0) + int(n)
    return {k: n for k, n in out.items() if n}


def _moe_events(n: int) -> list[list[dict]]:
    """Small MoE rollouts over 4 model versions (two route layouts: 4x2 and 6x3 of 16 experts)."""
    out = []
    for i in range(n):
        cfg = RolloutConfig(turns=3, prompt_tokens=12, output_tokens=10, observation_tokens=4, num_experts=16,
                            layers=4 if i % 2 else 6, topk=2 if i % 2 else 3, seed=i)
        out.append(trajectory_events(cfg, 1000 + i, version=i % 4))
    return out


def test_reads_are_exact_before_and_after_the_compaction_which_runs_once(store):
    for events in run_events(0, 16) + _moe_events(12):
        store.append(events)
    assert Materializer(store, max_trajectories=5).run(compact=False).num_trajectories > 0
    assert _pending(store) > 0
    before = tables(store)  # totals and deltas summed
    assert _expert_load_read(store) == _brute_force_expert_load(store)  # counted in the commits, read exactly
    folded = compact_run_aggregates(store)
    assert folded > 0 and _pending(store) == 0
    assert _expert_load_read(store) == _brute_force_expert_load(store)
    with store.log.read_engine.connect() as conn:  # compacted: one row per key, the arrays folded
        assert not conn.execute(text("SELECT count(*) FROM agg_expert_load_delta")).scalar_one()
    after = tables(store)
    assert {k: v for k, v in after.items() if k not in LAGGING} == \
        {k: v for k, v in before.items() if k not in LAGGING}
    assert after["agg_group_variance"]  # the groups are settled by the compaction
    assert compact_run_aggregates(store) == 0 and tables(store) == after  # idempotent
    rebuild_aggregates(store)
    assert tables(store) == after


def test_a_commit_counts_the_trajectories_from_the_events_the_fold_read_without_reading_them_again(store):
    """The commit's per-trajectory counts take the generation events the fold read (a finished
    trajectory's never change but for their locators), and its samples' counts the finish times
    it has just counted: no statement of the commit reads them again, and the counts equal a
    rebuild's, which reads them from SQL."""
    from sqlalchemy import event

    from trajstore.log._aggregates import events_of_sql

    for events in run_events(0, 12) + _moe_events(6):
        store.append(events)
    reread = events_of_sql(store.log.db.dialect, 1).split(" WHERE ")[0]
    seen: list[str] = []

    def note(conn, cursor, statement, *args) -> None:
        seen.append(statement)

    event.listen(store.log.db.write_engine, "before_cursor_execute", note)
    try:
        assert Materializer(store, max_trajectories=5).run(compact=False).num_trajectories >= 12
    finally:
        event.remove(store.log.db.write_engine, "before_cursor_execute", note)
    assert any("agg_trajectory_stats" in q for q in seen)  # the commits counted (on this engine)
    assert not [q for q in seen if q.startswith(reread)]
    # nor the finish times of the trajectories it has just counted, for its samples' counts
    assert not [q for q in seen if q.startswith("SELECT trajectory_id, finished_at FROM agg_trajectory_stats")]
    compact_run_aggregates(store)
    counted = tables(store)
    assert counted["agg_trajectory_shapes"] and counted["agg_versions"]
    rebuild_aggregates(store)
    assert tables(store) == counted


def test_a_commit_counts_its_expert_load_in_rows_of_its_own_and_the_compaction_folds_them_once(store):
    for events in _moe_events(8):
        store.append(events)
    Materializer(store, max_trajectories=4).run(compact=False)
    with store.log.read_engine.connect() as conn:
        noted = conn.execute(text("SELECT count(*) FROM agg_expert_pending")).scalar_one()
        deltas = conn.execute(text("SELECT count(*) FROM agg_expert_load_delta")).scalar_one()
        totals = conn.execute(text("SELECT count(*) FROM agg_expert_load")).scalar_one()
    # counted in the commits from the routes they wrote (no segment read back): one array per
    # (commit, version) in rows of the commit's own, nothing in the shared totals yet
    assert noted == 0 and totals == 0 and deltas >= 4
    assert _expert_load_read(store) == _brute_force_expert_load(store)  # both layouts, every version
    assert compact_run_aggregates(store) > 0
    assert _expert_load_read(store) == _brute_force_expert_load(store)
    assert _pending(store) == 0
    assert compact_run_aggregates(store) == 0 and _expert_load_read(store) == _brute_force_expert_load(store)
    with store.log.read_engine.connect() as conn:  # ONE row per model version, both layouts summed in
        rows = conn.execute(text("SELECT model_version, layers, experts FROM agg_expert_load")).all()
    versions = sorted({k[0] for k in _brute_force_expert_load(store)})
    assert sorted(int(r[0]) for r in rows) == versions and len(versions) >= 4
    assert {(r[1], r[2]) for r in rows} <= {(4, 16), (6, 16)}  # a version's layouts: their union
    counted = sample_counts(list(store.samples()))["agg_expert_load"]  # one int64 array per version
    assert len(counted) >= 4 and all(isinstance(c, np.ndarray) and c.dtype == np.int64 for c in counted.values())


@pytest.mark.postgres
def test_two_shards_commit_at_once_without_waiting_on_each_others_rows(fresh_pg_url, tmp_path):
    """A shard's commit transaction is held open after adding its aggregates (the statements the
    materializer's commit runs, on the same keys the other shard counts: the same time
    buckets, versions, tasks, experts); the other shard folds and commits meanwhile. With the
    totals upserted in the commit (before migration 0022) it waited for the held row locks.
    A compaction held open does not stop a commit either."""
    store = trajstore.connect(fresh_pg_url, payload=str(tmp_path / "payload"))
    engine = create_engine(fresh_pg_url)
    try:
        for events in run_events(0, 16):
            store.append(events)
        ids = [t for t in store.log.finished_ids_after(0)]
        mine = [t for t in ids if Materializer(store, shard_index=0, num_shards=2).shard.owns(t)]
        assert mine and len(mine) < len(ids)
        d = store.log.db.dialect
        head = max(r["position"] for r in store.log.finished_after(0, 1000))
        samples_0 = list(store.samples())  # nothing folded yet: counts of no sample
        assert not samples_0
        with engine.connect() as held:
            held.begin()
            held.exec_driver_sql("SET application_name = 'held-shard-0'")
            count_commit(held, d, mine, [], 0, head)  # shard 0's commit: its trajectories' counts
            insert_fold_deltas(held, d, {"agg_expert_load": {(0,): np.ones((8, 64), np.int64)},
                                         "agg_logprobs": {(0, b): [1, -1.0] for b in range(48)}})
            done: dict = {}

            def shard_1() -> None:
                try:
                    done["stats"] = Materializer(store, shard_index=1, num_shards=2).run(compact=False)
                except Exception as e:  # noqa: BLE001 - reported below
                    done["error"] = e

            t = threading.Thread(target=shard_1)
            t0 = time.monotonic()
            t.start()
            t.join(60)
            assert not t.is_alive(), "shard 1's commit waited on shard 0's open transaction"
            assert "error" not in done, done
            assert done["stats"].num_trajectories > 0
            assert Materializer(store, shard_index=1, num_shards=2).pending() == 0  # all of shard 1's
            assert time.monotonic() - t0 < 30
            held.rollback()
        # a compaction held open (its totals rows locked) while shard 0 commits
        with engine.connect() as held:
            held.begin()
            from trajstore.log._aggregates import compact_aggregates

            assert compact_aggregates(held, d) > 0
            t = threading.Thread(target=lambda: done.__setitem__("stats0", Materializer(
                store, shard_index=0, num_shards=2).run(compact=False)))
            t.start()
            t.join(60)
            assert not t.is_alive(), "shard 0's commit waited on an open compaction"
            assert done["stats0"].num_trajectories > 0
            held.commit()
        compact_run_aggregates(store)
        counted = tables(store)
        rebuild_aggregates(store)
        assert tables(store) == counted  # every commit counted once: equal to a recount
    finally:
        engine.dispose()
        store.close()

def test_segments_an_older_version_noted_are_counted_once_by_the_compaction(store):
    """A store upgraded with commits that noted their segment (``agg_expert_pending``) instead
    of counting it: the compaction counts each noted segment once."""
    from trajstore.log._aggregates import note_expert_pending
    from trajstore.log._dialect import execute

    for events in _moe_events(8):
        store.append(events)
    Materializer(store, max_trajectories=4).run(compact=False)

    def as_before(conn, d):  # the commits' arrays gone, their segments noted instead
        execute(conn, "DELETE FROM agg_expert_load_delta", ())
        for (segment,) in execute(conn, "SELECT DISTINCT segment FROM samples ORDER BY segment", ()).fetchall():
            note_expert_pending(conn, d, segment)

    store.log.db.transaction("noting segments", as_before)
    with store.log.read_engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM agg_expert_pending")).scalar_one() == 2
    assert _expert_load_read(store) == {}
    assert compact_run_aggregates(store) > 0 and _pending(store) == 0
    assert _expert_load_read(store) == _brute_force_expert_load(store)
    assert compact_run_aggregates(store) == 0 and _expert_load_read(store) == _brute_force_expert_load(store)



def _kill_when_waiting(url: str, like: str, timeout_s: float = 60) -> None:
    """Terminate the backend whose query holds ``like`` once it waits on a lock."""
    dsn = url.replace("postgresql+psycopg://", "postgresql://")
    deadline = time.monotonic() + timeout_s
    with psycopg.connect(dsn, autocommit=True) as admin:
        while True:
            got = admin.execute("SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                                ("%" + like + "%",)).fetchall()
            if got:
                assert admin.execute("SELECT pg_terminate_backend(%s)", (got[0][0],)).fetchone()[0]
                return
            assert time.monotonic() < deadline, "the compaction never waited"
            time.sleep(0.05)


def _run_until_killed_waiting(call, url: str, like: str) -> dict:
    """``call()`` on a thread, its backend terminated once it waits on a lock (``_kill_when_waiting``);
    ``{"result": ...}`` or ``{"error": ...}``, the outcome for the test to assert."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = call()
        except Exception as e:  # noqa: BLE001 - the outcome is asserted by the caller
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    _kill_when_waiting(url, like)
    t.join(60)
    assert not t.is_alive()
    return out


@pytest.mark.postgres
def test_a_compaction_whose_backend_is_killed_changes_nothing_and_the_next_folds_once(fresh_pg_url, tmp_path):
    store = trajstore.connect(fresh_pg_url, payload=str(tmp_path / "payload"))
    engine = create_engine(fresh_pg_url)
    try:
        for events in run_events(0, 16) + _moe_events(6):
            store.append(events)
        Materializer(store, max_trajectories=4).run(compact=False)
        before, pending = tables(store), _pending(store)
        assert pending
        with engine.connect() as holder:  # an uncommitted total row of a key the deltas add to
            holder.begin()
            width, start = holder.execute(text("SELECT width_s, bucket_start FROM agg_rewards_delta LIMIT 1")).one()
            holder.execute(text("INSERT INTO agg_rewards (width_s, bucket_start, rewarded, reward_sum, reward_min, "
                                "reward_max) VALUES (:w, :b, 0, 0, 0, 0)"), {"w": width, "b": start})
            # it has folded agg_groups, agg_logprobs and agg_policy_versions' deltas (deleted,
            # totals upserted) in its transaction and waits on agg_rewards: killed there
            out = _run_until_killed_waiting(lambda: compact_run_aggregates(store), fresh_pg_url, "INSERT INTO agg_rewards (")
            holder.rollback()
        err = out.get("error")
        assert isinstance(err, trajstore.TrajstoreError) and "\n" not in str(err), out
        assert _pending(store) == pending and tables(store) == before  # rolled back whole
        assert compact_run_aggregates(store) >= pending and _pending(store) == 0
        after = tables(store)
        assert {k: v for k, v in after.items() if k not in LAGGING} == \
            {k: v for k, v in before.items() if k not in LAGGING}
        assert compact_run_aggregates(store) == 0 and tables(store) == after
        rebuild_aggregates(store)
        assert tables(store) == after  # exactly once: equal to a recount
    finally:
        engine.dispose()
        store.close()


@pytest.mark.postgres
def test_a_run_whose_compaction_fails_after_its_commits_keeps_its_counts(fresh_pg_url, tmp_path, caplog):
    """The fold committed: a compaction that fails after it is a warning, not the run's error (the run's
    counts stand, ``trajstore materialize`` does not report landed work as failed), and the next
    compaction folds the deltas once."""
    store = trajstore.connect(fresh_pg_url, payload=str(tmp_path / "payload"))
    engine = create_engine(fresh_pg_url)
    try:
        for events in run_events(0, 8):
            store.append(events)
        m = Materializer(store, max_trajectories=16)
        with engine.connect() as holder:  # the totals locked: the commits' delta rows go in, the compaction waits
            holder.begin()
            holder.execute(text("LOCK TABLE agg_rewards IN EXCLUSIVE MODE"))
            with caplog.at_level("WARNING", logger="trajstore.materializer"):
                out = _run_until_killed_waiting(m.run, fresh_pg_url, "INSERT INTO agg_rewards (")
            holder.rollback()
        assert "error" not in out, out
        assert out["result"].num_trajectories > 0 and m.pending() == 0  # every finished one folded
        assert any("compacting the run aggregates failed" in r.getMessage() for r in caplog.records)
        assert compact_run_aggregates(store) > 0
        after = tables(store)
        rebuild_aggregates(store)
        assert tables(store) == after  # exactly once: equal to a recount
    finally:
        engine.dispose()
        store.close()


def test_the_fold_imports_no_pandas(tmp_path):
    """A fresh process that appends MoE rollouts and materializes them has not imported pandas
    (pyarrow's ``pa.array`` imports it on first use: 0.3 s at a process's first fold step)."""
    code = f"""
import sys
import trajstore
from trajstore.demo._simulate import RolloutConfig, trajectory_events
s = trajstore.connect("sqlite:///{tmp_path}/s.db", payload="{tmp_path}/p")
for i in range(4):
    cfg = RolloutConfig(turns=3, prompt_tokens=12, output_tokens=10, observation_tokens=4, num_experts=16,
                        layers=4, topk=2, seed=i)
    s.append(trajectory_events(cfg, i, version=i % 2))
assert s.materialize().num_trajectories == 4
assert "pandas" not in sys.modules, "pandas imported"
print("ok")
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr[-2000:]


@pytest.mark.postgres
def test_two_compactions_adding_to_one_version_at_once_lose_nothing(fresh_pg_url, tmp_path):
    """The expert load is one row per model version, read, summed and written back: a
    compaction adding to a version another holds (its transaction open) waits for it and then
    adds to what it wrote, for a version both create as well as for one that exists."""
    from trajstore.log._aggregates import add_expert_arrays

    store = trajstore.connect(fresh_pg_url, payload=str(tmp_path / "payload"))
    engine = create_engine(fresh_pg_url)
    d = store.log.db.dialect
    try:
        add_once = {5: np.arange(12, dtype=np.int64).reshape(3, 4)}
        with engine.begin() as conn:
            add_expert_arrays(conn, d, {4: np.ones((3, 4), np.int64)})  # an existing version
        done: dict = {}
        with engine.connect() as held:
            held.begin()
            add_expert_arrays(held, d, {4: np.ones((3, 4), np.int64), **add_once})

            def other() -> None:
                with engine.begin() as conn:
                    add_expert_arrays(conn, d, {4: np.full((2, 6), 2, np.int64), 5: np.ones((3, 4), np.int64)})
                done["ok"] = True

            t = threading.Thread(target=other)
            t.start()
            t.join(1.0)
            assert t.is_alive() and "ok" not in done  # waits for the held compaction's rows
            held.commit()
        t.join(30)
        assert done.get("ok")
        with engine.connect() as conn:
            got = expert_arrays(conn.execute(text(expert_load_sql())).all())
            assert conn.execute(text("SELECT count(*) FROM agg_expert_load")).scalar_one() == 2
        four = np.zeros((3, 6), np.int64)
        four[:, :4] += 2
        four[:2, :] += 2
        assert got[4].tolist() == four.tolist()
        assert got[5].tolist() == (add_once[5] + 1).tolist()
    finally:
        engine.dispose()
        store.close()


def test_the_expert_load_counts_one_route_in_every_within_its_stated_error(store):
    """By default one decode route in ``EXPERT_SAMPLE_EVERY`` is counted (each that many times):
    the same routes at every count (a recount gives the same arrays), an estimate of the exact
    load within the error the page states; a store set to 1 counts every route, exactly."""
    from trajstore.log._aggregate_counts import expert_sample_error

    for i in range(6):
        cfg = RolloutConfig(turns=2, prompt_tokens=8, output_tokens=400, observation_tokens=4, num_experts=8,
                            layers=2, topk=2, seed=i)
        store.append(trajectory_events(cfg, 2000 + i, version=0))
    store.materialize()
    compact_run_aggregates(store)
    sampled = _expert_load_read(store)
    assert sampled == _brute_force_expert_load(store, EXPERT_SAMPLE_EVERY) and EXPERT_SAMPLE_EVERY > 1
    exact = _brute_force_expert_load(store, 1)
    assert sampled != exact and set(sampled) <= set(exact)
    got, want = np.zeros((2, 8)), np.zeros((2, 8))
    for (v, l_, e), n in sampled.items():
        got[l_, e] += n
    for (v, l_, e), n in exact.items():
        want[l_, e] += n
    stated = expert_sample_error(got, EXPERT_SAMPLE_EVERY)  # what the page says (2 σ), at the (layer, expert) grain
    off = got / want - 1  # 16 cells: their spread is about σ, none beyond 4 σ
    assert 0 < stated < 0.5 and np.sqrt((off ** 2).mean()) <= stated * 0.75 and np.abs(off).max() <= 2 * stated
    assert abs(got.sum() / want.sum() - 1) < stated / 4  # the total: far closer
    rebuild_aggregates(store)
    assert _expert_load_read(store) == sampled  # a recount samples the same routes
    count_expert_load_every(store, 1)
    rebuild_aggregates(store)
    assert _expert_load_read(store) == exact


@pytest.mark.parametrize("value", ["0", "-3", "eight", "2.5"])
def test_a_bad_expert_load_sampling_setting_is_a_validation_error_naming_it(value):
    from trajstore.errors import ValidationError
    from trajstore.log._aggregate_counts import EXPERT_SAMPLE_SETTING, expert_sample_every

    with pytest.raises(ValidationError) as e:
        expert_sample_every(value)
    assert e.value.rule == "store_settings" and EXPERT_SAMPLE_SETTING in str(e.value) and repr(value) in str(e.value)
    assert expert_sample_every(None) == EXPERT_SAMPLE_EVERY and expert_sample_every(" 4 ") == 4


def test_logprob_bins_by_arithmetic_are_the_bins_a_search_of_the_edges_finds():
    from trajstore.log._aggregate_counts import LOGPROB_BINS, LOGPROB_RANGE, logprob_bin_edges, logprob_bins

    rng = np.random.default_rng(7)
    edges = logprob_bin_edges()
    values = np.concatenate([rng.uniform(-14, 1, 100_000).astype(np.float32), edges.astype(np.float32),
                             np.nextafter(edges.astype(np.float32), np.float32(-np.inf)),
                             np.nextafter(edges.astype(np.float32), np.float32(np.inf)),
                             np.asarray([np.nan, np.inf, -np.inf, -9999.0, 0.0, -0.0], np.float32)]).astype(np.float64)
    searched = np.clip(np.searchsorted(edges, np.clip(values, *LOGPROB_RANGE), side="right") - 1, 0, LOGPROB_BINS - 1)
    assert np.array_equal(logprob_bins(values), searched)
