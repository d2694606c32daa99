"""The run view's refresh costs what the run's time axis costs, not what the store holds:
the panels moved onto aggregates and indexed queries read no inspection view (the
statements a refresh runs, on both backends, and SQLite's query plans), and draw exactly
what the views give on a small store (docs/report.md, "Aggregates")."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy import text

import trajstore
from tests.helpers import reader_url_for
from tests.inspect.test_report import RUNNING, fill, run_events
from trajstore.log._aggregate_counts import TASK_KEYS
from trajstore.inspect._figures import CLOCK_SQL, _clock
from trajstore.inspect._panels import PANELS, SUMMARY_SQL, collect
from trajstore.inspect._rebuild import rebuild_aggregates
from trajstore.inspect.sql import read_only

VIEWS = ("generation_events", "trajectory_summary", "sample_summary", "model_version_stats")
BOUNDED = ("ingest_rate", "finish_reasons", "response_length", "response_length_over_time", "logprobs",
           "expert_load", "stuck", "route_drift", "running", "problems", "prefix_mismatches", "route_coverage",
           "reward_curve", "group_reward_variance", "staleness", "staleness_over_time", "merge_ratio", "versions",
           "reward_by_version", "per_task")
"""Panels whose every query reads an aggregate or an index."""
PARTLY = {"trajectories_to_look_at": (0, 2), "training_steps": (1,)}
"""Panels whose queries at these indexes read aggregates or indexes (the others read training lineage)."""


@pytest.fixture
def store(store_url, tmp_path):
    s = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    fill(s)
    yield s
    s.close()


def _spread(store) -> None:
    """The events over ten minutes or so (their times rewritten, the aggregates recounted), so the
    page has many buckets; running trajectories idle for a while."""
    with store.log.write_engine.begin() as conn:
        # in log order, as appends stamp them (a trajectory starts with its first event, ends with its last)
        start = conn.execute(text("SELECT min(created_at) FROM events")).scalar_one()
        conn.execute(text(f"UPDATE events SET created_at = {float(start) - 1000!r} + position * 2.5"))
    rebuild_aggregates(store)


def test_the_bounded_panels_run_no_view(store):
    ran: list[str] = []
    with read_only(reader_url_for(store.url)) as query:
        def logged(sql):
            ran.append(sql)
            return query(sql)

        data = collect(logged, stuck_after_s=0.0, payload=store.payload.location)
    panels = {p["name"]: p for p in data["panels"]}
    assert set(BOUNDED) <= set(panels)
    for name in (*BOUNDED, *PARTLY):
        sql = panels[name]["sql"] if name in BOUNDED else [panels[name]["sql"][i] for i in PARTLY[name]]
        assert sql and all(q in ran for q in sql)  # the statements that ran
        assert not [q for q in sql for v in VIEWS if v in q], name
        assert panels[name]["figure"], name
    assert not [q for q in CLOCK_SQL for v in VIEWS if v in q]
    assert not [q for q in SUMMARY_SQL for v in VIEWS if v in q]
    assert all(q in ran for q in SUMMARY_SQL)


def test_sqlite_plans_the_bounded_queries_on_aggregates_and_indexes(store_url, store):
    if not store_url.startswith("sqlite"):
        pytest.skip("query plans: SQLite's EXPLAIN QUERY PLAN")
    with read_only(store.url) as query:
        clock = _clock(query, 0.0, store.payload.location)
    queries = [*CLOCK_SQL, *SUMMARY_SQL]
    for p in PANELS:
        if p.name in BOUNDED:
            queries += list(p.queries(clock))
        elif p.name in PARTLY:
            queries += [list(p.queries(clock))[i] for i in PARTLY[p.name]]
    db = sqlite3.connect(store_url.removeprefix("sqlite:///"))
    try:
        for q in queries:
            plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + q)]
            # no full pass over the log's tables: they are searched through an index, or (the first
            # and the newest event, ORDER BY position LIMIT 1; trajectories counted by status) read
            # through one, never scanned row by row
            for step in plan:
                if any(f"SCAN {t}" in step for t in ("events", "trajectories", "samples", "e ", "t ")) \
                        or step in ("SCAN e", "SCAN t"):
                    assert "USING" in step and "INDEX" in step, (q, plan)
            assert not any(v in " ".join(plan) for v in VIEWS), (q, plan)
            if "FROM trajectories t JOIN events e" in q:
                assert any("ix_trajectories_status" in s for s in plan), plan
                assert any("ix_events_trajectory_seq" in s for s in plan), plan
            if "FROM agg_trajectory_stats" in q:  # the worst few through an ordered index, no sort of them all
                assert any("ix_agg_trajectory_stats_" in s for s in plan) and not any("TEMP B-TREE" in s for s in plan), plan
            if "waiting_to_fold" in q:  # the backlog past the lowest checkpoint only
                assert any("ix_trajectories_finished_position" in s for s in plan), plan
    finally:
        db.close()


def _rows(query, sql):
    return [tuple(round(float(v), 9) if isinstance(v, float) or type(v).__name__ == "Decimal" else v for v in row)
            for row in query(sql).rows]


def test_the_aggregate_panels_equal_the_views(store):
    """Every moved query against what the views give, over many buckets."""
    _spread(store)
    with read_only(reader_url_for(store.url)) as query:
        c = _clock(query, 30.0, store.payload.location)
        assert c.num_buckets > 10
        panels = {p.name: list(p.queries(c)) for p in PANELS}
        # the run's totals and time span
        n, calls, gen, obs, mism, vmin, vmax, first, last = query(
            "SELECT count(*), sum(num_generations), sum(num_generated_tokens), sum(num_observed_tokens), "
            "sum(num_prefix_mismatches), min(min_model_version), max(max_model_version), min(first_event_at), "
            "max(last_event_at) FROM trajectory_summary").rows[0]
        assert c.num_trajectories == n
        assert (c.first_s, c.last_s) == (pytest.approx(float(first)), pytest.approx(float(last)))
        totals = query(CLOCK_SQL[1]).rows[0]
        assert [int(x) for x in totals[:4]] == [int(calls), int(gen), int(obs), int(mism)]
        assert (totals[4], totals[5]) == (int(vmin), int(vmax))
        # engine calls over time
        assert _rows(query, panels["ingest_rate"][0]) == _rows(query, (
            f"SELECT {c.bucket('created_at')} AS bucket, count(*), sum(output_len), sum(num_observed_tokens) "
            "FROM generation_events GROUP BY 1 ORDER BY 1"))
        assert _rows(query, panels["finish_reasons"][0]) == _rows(query, (
            f"SELECT {c.bucket('created_at')} AS bucket, COALESCE(finish_reason, '(none)'), count(*) "
            "FROM generation_events GROUP BY 1, 2 ORDER BY 1, 2"))
        assert _rows(query, panels["response_length_over_time"][0]) == _rows(query, (
            f"SELECT {c.bucket('created_at')} AS bucket, count(*), avg(output_len), max(output_len), "
            "count(*) FILTER (WHERE finish_reason = 'length') FROM generation_events GROUP BY 1 ORDER BY 1"))
        per_version = _rows(query, (
            "SELECT model_version, count(*), count(*) FILTER (WHERE finish_reason = 'length'), "
            "count(*) FILTER (WHERE is_prefix_mismatch), count(*) FILTER (WHERE has_routes) "
            "FROM generation_events GROUP BY model_version ORDER BY model_version"))
        assert len(per_version) > 1 and any(r[2] for r in per_version) and any(r[3] for r in per_version)
        for name in ("finish_reasons", "prefix_mismatches", "route_coverage"):
            assert _rows(query, panels[name][1]) == per_version, name
        # trajectories started, finished, running; finished by status
        assert _rows(query, panels["running"][0]) == _rows(query, (
            "SELECT bucket, sum(started), sum(finished), sum(sum(started) - sum(finished)) OVER (ORDER BY bucket) "
            f"FROM (SELECT {c.bucket('first_event_at')} AS bucket, 1 AS started, 0 AS finished "
            f"FROM trajectory_summary UNION ALL SELECT {c.bucket('last_event_at')}, 0, 1 FROM trajectory_summary "
            "WHERE status <> 'running') x GROUP BY bucket ORDER BY bucket"))
        assert _rows(query, panels["problems"][0]) == _rows(query, (
            f"SELECT {c.bucket('last_event_at')} AS bucket, count(*) FILTER (WHERE status = 'failed'), "
            "count(*) FILTER (WHERE status = 'aborted'), count(*) FILTER (WHERE status = 'truncated'), count(*) "
            "FROM trajectory_summary WHERE status <> 'running' GROUP BY 1 ORDER BY 1"))
        # route drift per version (the versions with re-sent rows)
        drift = [r for r in _rows(query, panels["route_drift"][1]) if r[1]]
        assert drift and drift == _rows(query, (
            "SELECT model_version, route_rows_resent, route_rows_drifted, route_drift_share FROM model_version_stats "
            "WHERE route_rows_resent > 0 ORDER BY model_version"))
        # the running trajectories, idle longest first
        newest = repr(c.last_s)
        assert _rows(query, panels["stuck"][0]) == _rows(query, (
            f"SELECT count(*), count(*) FILTER (WHERE {newest} - last_event_at > 30.0) FROM trajectory_summary "
            "WHERE status = 'running'"))
        stuck = _rows(query, panels["stuck"][1])
        assert stuck == _rows(query, (
            f"SELECT trajectory_id, group_id, num_generations, max_model_version, {newest} - last_event_at "
            "FROM trajectory_summary WHERE status = 'running' ORDER BY last_event_at, trajectory_id LIMIT 25"))
        assert sorted(r[0] for r in stuck) == sorted(f"traj-0-{i:06d}" for i in RUNNING)


def test_the_page_is_the_same_after_a_rebuild(store):
    """The aggregates counted at append draw what a recount draws (figures, not SQL)."""
    url = reader_url_for(store.url)

    def figures():
        with read_only(url) as query:
            data = collect(query, stuck_after_s=0.0, payload=store.payload.location)
        return data["summary"], {p["name"]: (p["figure"], p["note"]) for p in data["panels"] if p["name"] in BOUNDED}

    before = figures()
    with store.log.write_engine.begin() as conn:
        conn.execute(text("DELETE FROM agg_calls"))
    emptied = figures()
    assert emptied[1]["ingest_rate"][1] == "no engine calls yet"
    rebuild_aggregates(store)
    assert figures() == before


def _same(got, want, what):
    assert len(got) == len(want), (what, got, want)
    for a, b in zip(got, want):
        assert len(a) == len(b), (what, a, b)
        for x, y in zip(a, b):
            if isinstance(x, float) or isinstance(y, float):
                assert x == pytest.approx(y, rel=1e-9, abs=1e-9), (what, a, b)
            else:
                assert x == y, (what, a, b)


FINISHED = "status <> 'running'"


def _moved_panels_equal_the_views(query, c, *, finished_only: bool) -> None:
    """Each moved query against the view query the panel ran before. The materializer counts
    finished trajectories: where a view panel also counted running ones, the view is asked for
    the finished ones (``finished_only``: some are still running)."""
    panels = {p.name: list(p.queries(c)) for p in PANELS}
    fin = f" AND {FINISHED}" if finished_only else ""

    def same(sql, want, what):
        _same(_rows(query, sql), _rows(query, want), what)

    same(panels["reward_curve"][0],
         f"SELECT {c.bucket('last_event_at')} AS bucket, count(reward), avg(reward), min(reward), max(reward) "
         "FROM trajectory_summary WHERE status <> 'running' AND reward IS NOT NULL GROUP BY 1 ORDER BY 1", "reward")
    groups = ("SELECT group_id, count(reward) AS rewarded, max(reward) = min(reward) AS zero_variance, "
              "avg(reward * reward) - avg(reward) * avg(reward) AS reward_variance, max(last_event_at) AS finished_at "
              "FROM trajectory_summary WHERE group_id IS NOT NULL GROUP BY group_id "
              "HAVING count(*) FILTER (WHERE status = 'running') = 0 AND count(reward) > 1")
    same(panels["group_reward_variance"][0],
         f"SELECT {c.bucket('finished_at')} AS bucket, count(*), count(*) FILTER (WHERE zero_variance), "
         f"avg(reward_variance) FROM ({groups}) g GROUP BY 1 ORDER BY 1", "groups")
    assert _rows(query, panels["group_reward_variance"][0])
    same(panels["problems"][1],
         "SELECT count(*) FILTER (WHERE t.status <> 'running' AND t.num_generations > 0 AND NOT t.is_held_back "
         "AND NOT EXISTS (SELECT 1 FROM samples s WHERE s.trajectory_id = t.trajectory_id) "
         "AND NOT EXISTS (SELECT 1 FROM unfoldable_trajectories u WHERE u.trajectory_id = t.trajectory_id)), "
         "count(*) FILTER (WHERE t.is_held_back), (SELECT count(*) FROM unfoldable_trajectories), "
         f"sum(t.num_placeholder_logprobs) FILTER (WHERE t.{FINISHED}) FROM trajectory_summary t", "problems now")
    same(panels["staleness"][0], "SELECT staleness, count(*) FROM sample_summary GROUP BY staleness "
         "ORDER BY staleness", "staleness")
    same(panels["staleness"][1], "SELECT model_version_span, count(*) FROM sample_summary "
         "GROUP BY model_version_span ORDER BY model_version_span", "versions mixed")
    same(panels["staleness_over_time"][0],
         f"SELECT {c.bucket('t.last_event_at')} AS bucket, count(*), avg(s.staleness), max(s.staleness), "
         "max(s.latest_model_version) FROM sample_summary s JOIN trajectory_summary t "
         "ON t.trajectory_id = s.trajectory_id GROUP BY 1 ORDER BY 1", "staleness over time")
    assert len(_rows(query, panels["staleness_over_time"][0])) > 1 or c.num_buckets < 10
    same(panels["merge_ratio"][0], "SELECT num_generations, num_samples, count(*) FROM trajectory_summary "
         "WHERE status <> 'running' AND num_generations > 0 GROUP BY num_generations, num_samples "
         "ORDER BY num_generations, num_samples", "merge ratio")
    same(panels["merge_ratio"][1], "SELECT num_merged_calls, count(*) FROM sample_summary "
         "GROUP BY num_merged_calls ORDER BY num_merged_calls", "calls folded")
    same(panels["prefix_mismatches"][0], "SELECT num_prefix_mismatches, count(*) FROM trajectory_summary "
         f"WHERE num_generations > 0{fin} GROUP BY num_prefix_mismatches ORDER BY num_prefix_mismatches",
         "mismatches")
    same(panels["route_coverage"][0], "SELECT num_tokens - num_route_rows, count(*), sum(num_tokens), "
         "sum(num_route_rows) FROM sample_summary WHERE num_route_rows IS NOT NULL "
         "GROUP BY num_tokens - num_route_rows ORDER BY 1", "route coverage")
    same(SUMMARY_SQL[3], "SELECT count(*), sum(num_merged_calls), avg(staleness), max(staleness), "
         "sum(num_route_rows), sum(CASE WHEN num_route_rows IS NULL THEN 0 ELSE num_tokens END) "
         "FROM sample_summary", "summary")
    same(panels["training_steps"][1],
         "SELECT count(*), count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM sample_consumption c "
         "WHERE c.trajectory_id = s.trajectory_id AND c.sample_index = s.sample_index)) FROM sample_summary s",
         "never trained")
    task = "COALESCE(" + ", ".join(f"metadata ->> '{k}'" for k in TASK_KEYS) + ")"
    same(panels["per_task"][0],
         "SELECT m.task, count(*), count(t.reward), avg(t.reward), sum(t.num_generated_tokens), "
         "sum(t.num_generations), count(*) FILTER (WHERE t.status IN ('failed', 'aborted')) "
         f"FROM trajectory_summary t JOIN (SELECT trajectory_id, {task} AS task FROM trajectories) m "
         f"ON m.trajectory_id = t.trajectory_id WHERE m.task IS NOT NULL{' AND t.' + FINISHED if finished_only else ''} "
         "GROUP BY m.task ORDER BY count(*) DESC, m.task LIMIT 24", "per task")
    worst = panels["trajectories_to_look_at"]
    same(worst[0], "SELECT trajectory_id, route_drift_share, route_rows_drifted FROM trajectory_summary "
         f"WHERE route_drift_share > 0{fin} ORDER BY route_drift_share DESC, trajectory_id LIMIT 10", "most drift")
    same(worst[2], "SELECT trajectory_id, num_generated_tokens, num_generations, status FROM trajectory_summary "
         f"WHERE num_generations > 0{fin} ORDER BY num_generated_tokens DESC, trajectory_id LIMIT 10", "longest")
    assert _rows(query, worst[0]) and _rows(query, worst[2])
    if not finished_only:  # model_version_stats counts running trajectories too
        same(panels["versions"][0],
             "SELECT model_version, num_generated_tokens, num_trajectories, num_multi_version, mean_reward, "
             "num_rewarded, num_failed, num_aborted FROM model_version_stats ORDER BY model_version", "per version")
        assert len(_rows(query, panels["versions"][0])) > 1


def _finish_the_running(store) -> None:
    """The running trajectories get their reward and finish, and are materialized."""
    from tests.inspect.test_report import NUM_TRAJECTORIES

    full = run_events(0, NUM_TRAJECTORIES)
    for i in sorted(RUNNING):
        from dataclasses import replace

        from trajstore.demo._run import DEMO_CONFIG
        from trajstore.demo._simulate import trajectory_events

        cfg = replace(DEMO_CONFIG, prompt_tokens=24, output_tokens=16, observation_tokens=8)
        done = [e for e in trajectory_events(cfg, i, version=i * 4 // NUM_TRAJECTORIES)
                if e["type"] in ("reward", "trajectory_finished")]
        assert done and full[i]
        store.append(done)
    store.materialize()


def test_the_moved_panels_equal_the_views_as_the_materializer_counts(store):
    """Counted by the materializer's commits (no recount): the moved panels give what the views
    give; then the running trajectories finish (groups complete, versions gain trajectories) and
    they still do, every view unfiltered."""
    url = reader_url_for(store.url)
    with read_only(url) as query:
        c = _clock(query, 30.0, store.payload.location)
        _moved_panels_equal_the_views(query, c, finished_only=True)
    _finish_the_running(store)
    with read_only(url) as query:
        c = _clock(query, 30.0, store.payload.location)
        _moved_panels_equal_the_views(query, c, finished_only=False)


def test_the_moved_panels_equal_the_views_after_a_recount(store):
    """Over many buckets, recounted by ``--rebuild-aggregates``; then once more after the running
    trajectories finish (counted by the commit on top of the recount)."""
    _spread(store)
    url = reader_url_for(store.url)
    with read_only(url) as query:
        c = _clock(query, 30.0, store.payload.location)
        assert c.num_buckets > 10
        _moved_panels_equal_the_views(query, c, finished_only=True)
    _finish_the_running(store)
    with read_only(url) as query:
        c = _clock(query, 30.0, store.payload.location)
        _moved_panels_equal_the_views(query, c, finished_only=False)


def test_sqlite_plans_the_commit_s_counting_on_the_trajectories_index(store_url, store):
    """The materializer's commit reads its trajectories' events through their index, not every
    call of the log (a type condition made SQLite search ix_events_type_position)."""
    if not store_url.startswith("sqlite"):
        pytest.skip("query plans: SQLite's EXPLAIN QUERY PLAN")
    from trajstore.log._aggregates import events_of_sql

    db = sqlite3.connect(store_url.removeprefix("sqlite:///"))
    try:
        plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + events_of_sql(store.log.db.dialect, 2),
                                             ("traj-0-000001", "traj-0-000002"))]
    finally:
        db.close()
    assert any("ix_events_trajectory_seq" in step for step in plan) and not any("type" in step for step in plan), plan
