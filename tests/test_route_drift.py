"""Route drift (SPEC "Routed experts", R3 health) on both backends: per call,
``route_rows_resent`` and ``route_rows_drifted`` against hand-computed cases,
from the appending process's cache and from the log (another process)."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import text

import trajstore
from helpers import finished, gen, started


def rows(values, layers=1, topk=1):
    """One row per value, every entry of the row = that value."""
    return np.repeat(np.asarray(values, np.uint8), layers * topk).reshape(len(values), layers, topk)


def drift(store):
    with store.log.read_engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(
            "SELECT seq, route_rows_resent, route_rows_drifted FROM generation_events ORDER BY trajectory_id, seq"))]


def r1(tid="t"):
    """SPEC R1: row value = 100 * call + position; call 1 recomputes positions 0..3 differently."""
    return [gen(tid, 0, [10, 20, 30, 40, 50], [], routed_experts=rows([0, 1, 2, 3])),
            gen(tid, 1, [10, 20, 30, 40, 50, 60, 70, 80, 90], [], routed_experts=rows(range(100, 108)))]


def test_spec_r1_drifts_on_positions_0_to_3(store):
    a, b = r1()
    store.append([started("t"), a])
    result = store.append([b])
    assert drift(store) == [(0, 0, 0), (1, 4, 4)]
    assert (result.route_rows_resent, result.route_rows_drifted) == (4, 4)  # what a metrics counter adds
    assert store.info()["route_drift"] == {"route_rows_resent": 4, "route_rows_drifted": 4}


def test_spec_r1_in_one_batch(store):
    store.append([started("t"), *r1()])
    assert drift(store) == [(0, 0, 0), (1, 4, 4)]


def test_one_entry_differs_in_one_row(store):
    first = rows([1, 2, 3, 4], layers=2, topk=2)
    again = np.concatenate([first, rows([9, 9], layers=2, topk=2)])
    again[2, 1, 0] = 7  # position 2, layer 1, first choice moved
    store.append([started("t"), gen("t", 0, [1, 2, 3, 4, 5], [], routed_experts=first),
                  gen("t", 1, [1, 2, 3, 4, 5, 6, 7], [], routed_experts=again),
                  # no re-send: the engine skipped the recorded rows (routed_experts_start)
                  gen("t", 2, [1, 2, 3, 4, 5, 6, 7, 8], [], routed_experts=rows([5], 2, 2), routed_experts_start=6),
                  # a new sample: nothing of it was recorded
                  gen("t", 3, [9, 9], [], routed_experts=rows([1], 2, 2)),
                  gen("t", 4, [9, 9, 3], [4])])  # no routes
    assert drift(store) == [(0, 0, 0), (1, 4, 1), (2, 0, 0), (3, 0, 0), (4, None, None)]


def test_never_captured_positions_do_not_count_as_drifted(store):
    store.append([started("t"), gen("t", 0, [1, 2, 3, 4, 5], [], routed_experts=rows([1, 2, 3, 4])),
                  # positions 4, 5 skipped: never captured, masked for good
                  gen("t", 1, [1, 2, 3, 4, 5, 6, 7, 8, 9], [], routed_experts=rows([7, 8]), routed_experts_start=6)])
    store.append([gen("t", 2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [],
                      routed_experts=rows([1, 2, 3, 0, 50, 51, 7, 9, 60]))])
    # re-sent: positions 0..7 (8 rows); moved: 3 (was 4) and 7 (was 8); 4 and 5 were never captured
    assert drift(store)[-1] == (2, 8, 2)


@pytest.mark.parametrize("cache", ["other process", "stale", "disabled"])
def test_without_this_process_cache_the_log_gives_the_same_figures(store, store_url, tmp_path, cache):
    first = rows([1, 2, 3, 4], layers=3, topk=2)
    store.append([started("t"), gen("t", 0, [1, 2, 3, 4, 5], [], routed_experts=first)])
    again = np.concatenate([first, rows([5, 6], 3, 2)])
    again[[0, 3], 2, 1] = 77
    call = gen("t", 1, [1, 2, 3, 4, 5, 6, 7], [], routed_experts=again)
    if cache == "other process":
        with trajstore.connect(store_url, payload=str(tmp_path / "payload")) as other:
            other.append([call])
    elif cache == "stale":
        with trajstore.connect(store_url, payload=str(tmp_path / "payload")) as other:
            other.append([{"type": "reward", "trajectory_id": "t", "reward": 1.0}])  # moves the revision
        store.append([call])
    else:
        store._routes.max_bytes = 0  # nothing kept
        store.append([{"type": "reward", "trajectory_id": "t", "reward": 1.0}])
        store.append([call])
    assert drift(store)[-1] == (1, 4, 2)


def test_views_per_trajectory_and_model_version(store):
    a, b = r1("x")
    b["model_version"] = 1
    store.append([started("x"), a, b, finished("x"),
                  started("y"), gen("y", 0, [1, 2, 3], [], routed_experts=rows([4, 5])),
                  gen("y", 1, [1, 2, 3, 4], [], routed_experts=rows([4, 5, 6]), version=1), finished("y")])
    with store.log.read_engine.connect() as conn:
        per_traj = conn.execute(text("SELECT trajectory_id, route_rows_resent, route_rows_drifted, route_drift_share "
                                     "FROM trajectory_summary ORDER BY trajectory_id")).all()
        per_version = conn.execute(text("SELECT model_version, route_rows_resent, route_rows_drifted, "
                                        "route_drift_share FROM model_version_stats ORDER BY model_version")).all()
    assert [tuple(r) for r in per_traj] == [("x", 4, 4, 1.0), ("y", 2, 0, 0.0)]
    assert [tuple(r) for r in per_version] == [(0, 0, 0, None), (1, 6, 4, pytest.approx(4 / 6))]
    # and the samples are R1's: the recorded rows, never the re-sent ones
    store.materialize()
    x = next(s for s in store.samples() if s.trajectory_id == "x")
    assert x.routed_experts[:, 0, 0].tolist() == [0, 1, 2, 3, 104, 105, 106, 107, 0]
    assert x.routed_experts_mask.tolist() == [False] * 8 + [True]


def _oracle(generations):
    """Each call's (resent, drifted), from the fold of the calls before it: the
    watermark of the fold's tail, and a row-by-row comparison with the routes of
    the sample it merges into (positions never captured count as equal)."""
    from trajstore.fold import FoldTail, fold, fold_step

    out, tail, previous = [], FoldTail(seq_hash=None), (np.zeros(0, np.int32), np.zeros(0, np.int32))
    for k, g in enumerate(generations):
        step, new_tail = fold_step(tail, g, previous)
        rows = g.routed_experts
        if rows is None:
            out.append((None, None))
        elif not step.merged:
            out.append((0, 0))
        else:
            resent = min(len(rows), max(0, tail.route_len - g.routed_experts_start))
            drifted = 0
            if resent:
                last = fold(generations[:k], trajectory_id=g.trajectory_id).samples[-1]
                for j in range(resent):
                    p = g.routed_experts_start + j
                    if not last.routed_experts_mask[p] and not np.array_equal(rows[j], last.routed_experts[p]):
                        drifted += 1
            out.append((resent, drifted))
        tail, previous = new_tail, (g.prompt_ids, g.output_ids)
    return out


def test_drift_equals_a_row_by_row_comparison_with_the_fold():
    """On random trajectories (merges, mismatches, skipped rows, gaps): admission's
    figures, one call per append from the log's rows (the fallback) and all calls
    in one batch (the batch's own recorded rows), equal the oracle's."""
    from hypothesis import HealthCheck, given, settings

    from test_fold_step import EXPERTS, TID, trajectories
    from trajstore._append.admission import RecordedRoutes, admit_batch
    from trajstore.errors import ValidationError
    from trajstore.events import TrajectoryStarted
    from trajstore.fold import fold

    def from_log(done):
        """What the Store rebuilds on a cache miss: the fold of the calls stored so far."""
        def recorded(tid):
            if not done:
                return RecordedRoutes(0)
            last = fold(done, trajectory_id=tid).samples[-1]
            if last.routed_experts is None:
                return RecordedRoutes(last.sample_index)
            return RecordedRoutes(last.sample_index, [(0, last.routed_experts, ~last.routed_experts_mask)])
        return recorded

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(trajectories())
    def check(generations):
        [adm] = admit_batch([TrajectoryStarted(TID, None, EXPERTS)], {}, lambda tid: None)
        start_state = state = adm.state
        one_by_one = []
        for i, g in enumerate(generations):
            seq = (lambda j: lambda tid: np.concatenate([generations[j].prompt_ids, generations[j].output_ids]))(i - 1)
            try:
                [adm] = admit_batch([g], {TID: state}, seq, None, from_log(generations[:i]))
            except ValidationError:
                generations = generations[:i]
                break
            state = adm.state
            one_by_one.append((adm.stored.route_rows_resent, adm.stored.route_rows_drifted))
        want = _oracle(generations)
        assert one_by_one == want
        if generations:
            batch = admit_batch(generations, {TID: start_state}, lambda tid: np.zeros(0, np.int32), None,
                                from_log([]))
            assert [(a.stored.route_rows_resent, a.stored.route_rows_drifted) for a in batch] == want

    check()
