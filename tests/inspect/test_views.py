"""The inspection views on both backends, checked against values computed
here, straight from the wire-format events that were appended (SPEC rules
applied to the dicts; nothing is read back from the store to build them).

The store mixes what the views must get right: merges, prefix mismatches,
aborts resumed under a newer version, calls without routes, trajectories
without any routes, per-call scalar rewards, token rewards, a running
trajectory, an aborted one, one without generations, missing finish reasons,
and events of many trajectories interleaved in the log.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from tests.helpers import reader_url_for
from sqlalchemy import text

import trajstore
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.inspect.views import VIEW_NAMES

# conftest: these fixtures connect store_url first thing, so it starts as a migrated copy
STORE_URL_CONNECTED_BY = ("built",)

CFG = RolloutConfig(turns=4, prompt_tokens=6, output_tokens=5, observation_tokens=3, layers=2, topk=1,
                    num_experts=8, mismatch_prob=0.3, abort_prob=0.3, fail_prob=0.1, seed=7)
NUM_TRAJECTORIES = 30


# -- the events ----------------------------------------------------------------

def _vary(i: int, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Trajectory ``i`` of the simulation, bent into one of the cases above."""
    gens = [e for e in events if e["type"] == "generation"]
    if i % 5 == 1:
        for g in gens[1::2]:
            g.pop("routed_experts")  # calls without routes inside a routed trajectory
    if i % 5 == 4:
        for g in gens:
            g.pop("routed_experts")
    if i % 5 == 2:
        events = [e for e in events if e["type"] != "reward"]
        gens[0]["reward"] = 0.25  # only the first call: the last sample may have none
        if len(gens) > 2:
            gens[2]["reward"] = 0.75
    if i % 5 == 3:
        events = [e for e in events if e["type"] != "reward"]
        for g in gens:
            g["token_rewards"] = np.full(len(g["output_ids"]), 0.1, np.float32)
    if i % 4 == 3:
        gens[-1].pop("finish_reason")
    if i % 6 == 0:
        gens[-1]["finish_reason"] = "length"
    if i % 7 == 4:
        events = [e for e in events if e["type"] != "trajectory_finished"]  # still running
    if i % 7 == 5:
        events[-1]["status"] = "aborted"
    if i % 8 == 7:  # weights swapped inside the first call (SPEC "Versions")
        g = gens[0]
        n, v = len(g["output_ids"]), g["model_version"]
        g["token_model_versions"] = [v] * (n // 2) + [v + 1] * (n - n // 2)
        g["model_version"] = v + 1
        if i == 15:
            del g["model_version"]  # derived from the last token
        if i == 23:
            g["loss_mask"] = ([1, 0, 1, 1, 0] * n)[:n]
    if i % 3 == 0:
        gens[0]["metadata"] = {"tool": "search" if i % 2 else "python", "latency_ms": 10.5 + 10 * i}
    return events


def all_events() -> list[list[dict[str, Any]]]:
    per_trajectory = [_vary(i, trajectory_events(CFG, i, version=i // 6)) for i in range(NUM_TRAJECTORIES)]
    per_trajectory.append([
        {"type": "trajectory_started", "trajectory_id": "no-calls", "group_id": "solo"},
        {"type": "reward", "trajectory_id": "no-calls", "reward": 0.5},
        {"type": "trajectory_finished", "trajectory_id": "no-calls", "status": "failed"},
    ])
    return per_trajectory


def interleaved(per_trajectory: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Round-robin over trajectories, each one's events in order: a busy log."""
    out, queues = [], [list(evs) for evs in per_trajectory]
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


# -- expectations, from the dicts ------------------------------------------------

@dataclass
class Expected:
    generations: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    trajectories: dict[str, dict[str, Any]] = field(default_factory=dict)
    samples: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    versions: dict[int, dict[str, Any]] = field(default_factory=dict)


def _call_facts(g: dict[str, Any], previous: np.ndarray | None, route_len: int) -> tuple[dict[str, Any], int]:
    """What one call contributes, by SPEC fold rules 1-2 and the R3 route rules."""
    prompt, output = np.asarray(g["prompt_ids"]), np.asarray(g["output_ids"])
    merged = previous is not None and len(prompt) >= len(previous) and np.array_equal(prompt[: len(previous)], previous)
    prefix = len(previous) if merged else 0
    routes, start = g.get("routed_experts"), g.get("routed_experts_start", 0)
    sent = None if routes is None or len(routes) == 0 else len(routes)
    if sent is None:
        stored, new_route_len = None, route_len if merged else 0
    elif merged:  # rows for recorded positions are dropped, never overwrite
        stored, new_route_len = max(0, sent - max(0, route_len - start)), max(route_len, start + sent)
    else:
        stored, new_route_len = sent, start + sent
    loss = g.get("loss_mask")
    loss = np.ones(len(output), np.int64) if loss is None else np.asarray(loss)
    tv = np.asarray(g["token_model_versions"]) if "token_model_versions" in g else None
    last = int(tv[-1]) if tv is not None and len(tv) else g["model_version"]
    first = int(tv[0]) if tv is not None and len(tv) else last
    versions = np.full(len(output), last) if tv is None else tv
    # version -> [generated tokens, loss tokens] of this call
    per_version = {int(v): [int(np.sum(versions == v)), int(np.sum(loss[versions == v]))]
                   for v in np.unique(versions)} or {last: [0, 0]}
    return {
        "group_id": None, "is_merged": merged, "is_prefix_mismatch": previous is not None and not merged,
        "prompt_len": len(prompt), "prefix_len": prefix, "num_observed_tokens": len(prompt) - prefix,
        "output_len": len(output), "num_loss_tokens": int(np.sum(loss)),
        "model_version": last, "min_model_version": first, "finish_reason": g.get("finish_reason"),
        "metadata": g.get("metadata"), "_per_version": per_version,
        "has_routes": sent is not None, "num_route_rows_sent": sent, "num_route_rows_stored": stored,
        "reward": g.get("reward"), "has_token_rewards": g.get("token_rewards") is not None,
    }, new_route_len


def _expect_trajectory(exp: Expected, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fill ``exp.generations`` for one trajectory; return its samples (no final reward yet)."""
    start = events[0]
    tid, group = start["trajectory_id"], start.get("group_id")
    samples: list[dict[str, Any]] = []
    previous, route_len, any_routes = None, 0, False
    for g in (e for e in events if e["type"] == "generation"):
        facts, route_len = _call_facts(g, previous, route_len)
        any_routes |= facts["has_routes"]
        if not facts["is_merged"]:
            samples.append({"calls": [], "prompt_len": facts["prompt_len"], "route_len": 0})
        sample = samples[-1]
        sample["calls"].append(facts)
        sample["route_len"] = route_len
        facts.update(group_id=group, sample_index=len(samples) - 1)
        exp.generations[(tid, g["seq"])] = facts
        previous = np.concatenate([np.asarray(g["prompt_ids"]), np.asarray(g["output_ids"])])
    for s in samples:
        s["any_routes"] = any_routes
    return samples


def _sample_row(group: str | None, s: dict[str, Any], last: bool, status: str, reward: float | None,
                latest: int) -> dict[str, Any]:
    calls = s["calls"]
    num_tokens = s["prompt_len"] + sum(c["output_len"] for c in calls) + sum(
        c["num_observed_tokens"] for c in calls[1:])
    versions = [v for c in calls if c["output_len"] for v in (c["min_model_version"], c["model_version"])]
    rows = min(s["route_len"], num_tokens) if s["any_routes"] else None
    return {
        "finish_reason": calls[-1]["finish_reason"],
        "finish_reasons": ",".join(sorted({c["finish_reason"] for c in calls} - {None})) or None,
        "group_id": group, "status": status, "is_last_step": last, "prompt_len": s["prompt_len"],
        "response_len": num_tokens - s["prompt_len"], "num_tokens": num_tokens,
        "num_loss_tokens": sum(c["num_loss_tokens"] for c in calls), "num_merged_calls": len(calls),
        "num_generated_tokens": sum(c["output_len"] for c in calls),
        "num_observed_tokens": sum(c["num_observed_tokens"] for c in calls[1:]),
        "reward": reward, "min_model_version": min(versions), "max_model_version": max(versions),
        "model_version_span": max(versions) - min(versions), "latest_model_version": latest,
        "staleness": latest - min(versions), "num_calls_with_routes": sum(c["has_routes"] for c in calls),
        "num_route_rows": rows, "route_coverage": None if rows is None else rows / num_tokens,
    }


def _last_reward(calls: list[dict[str, Any]]) -> float | None:
    rewards = [c["reward"] for c in calls if c["reward"] is not None]
    return rewards[-1] if rewards else None


def expected(per_trajectory: list[list[dict[str, Any]]], log_order: list[dict[str, Any]]) -> Expected:
    exp = Expected()
    latest_at_finish: dict[str, int] = {}
    latest = None
    for e in log_order:
        if e["type"] == "generation":
            v = e["model_version"] if "model_version" in e else int(e["token_model_versions"][-1])
            latest = v if latest is None else max(latest, v)
        elif e["type"] == "trajectory_finished":
            latest_at_finish[e["trajectory_id"]] = latest
    for events in per_trajectory:
        tid, group = events[0]["trajectory_id"], events[0].get("group_id")
        samples = _expect_trajectory(exp, events)
        finished = [e for e in events if e["type"] == "trajectory_finished"]
        status = finished[0]["status"] if finished else "running"
        reward_events = [e["reward"] for e in events if e["type"] == "reward"]
        final_reward = reward_events[-1] if reward_events else (_last_reward(samples[-1]["calls"]) if samples else None)
        calls = [c for s in samples for c in s["calls"]]
        exp.trajectories[tid] = _trajectory_row(group, status, samples, calls, final_reward)
        if not finished:
            continue  # not materialized
        for k, s in enumerate(samples):
            last = k == len(samples) - 1
            reward = final_reward if last else _last_reward(s["calls"])
            exp.samples[(tid, k)] = _sample_row(group, s, last, status, reward, latest_at_finish[tid])
    exp.versions = _version_rows(exp)
    return exp


def _trajectory_row(group, status, samples, calls, reward) -> dict[str, Any]:
    versions = [v for c in calls for v in (c["min_model_version"], c["model_version"])]
    reasons = sorted({c["finish_reason"] for c in calls if c["finish_reason"] is not None})
    return {
        "group_id": group, "status": status, "num_generations": len(calls),
        "num_generated_tokens": sum(c["output_len"] for c in calls),
        "num_observed_tokens": sum(c["num_observed_tokens"] for c in calls),
        "num_loss_tokens": sum(c["num_loss_tokens"] for c in calls), "num_samples": len(samples),
        "num_prefix_mismatches": sum(c["is_prefix_mismatch"] for c in calls),
        "num_generations_with_routes": sum(c["has_routes"] for c in calls), "reward": reward,
        "min_model_version": min(versions, default=None), "max_model_version": max(versions, default=None),
        "model_version_span": max(versions) - min(versions) if versions else None,
        "finish_reasons": ",".join(reasons) or None,
        "last_finish_reason": calls[-1]["finish_reason"] if calls else None,
    }


def _version_rows(exp: Expected) -> dict[int, dict[str, Any]]:
    # a call counts under every version it generated tokens at, with exactly those tokens
    by_version: dict[int, dict[str, list]] = {}
    for (tid, _), c in exp.generations.items():
        for v, counts in c["_per_version"].items():
            by_version.setdefault(v, {}).setdefault(tid, []).append((c, counts))
    out = {}
    for v, trajs in by_version.items():
        t_rows = [exp.trajectories[tid] for tid in trajs]
        calls = [c for cs in trajs.values() for c, _ in cs]
        counts = [n for cs in trajs.values() for _, n in cs]
        rewards = [t["reward"] for t in t_rows if t["reward"] is not None]
        out[v] = {
            "num_trajectories": len(trajs), "num_generations": len(calls),
            "num_generated_tokens": sum(n[0] for n in counts),
            "num_loss_tokens": sum(n[1] for n in counts),
            "num_aborted_calls": sum(c["finish_reason"] == "abort" for c in calls),
            "num_rewarded": len(rewards), "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "num_completed": sum(t["status"] == "completed" for t in t_rows),
            "num_aborted": sum(t["status"] == "aborted" for t in t_rows),
            "num_failed": sum(t["status"] == "failed" for t in t_rows),
            "num_multi_version": sum(t["model_version_span"] > 0 for t in t_rows),
        }
    return out


# -- the store -------------------------------------------------------------------

@dataclass
class Built:
    store: Any
    exp: Expected
    metrics: Any
    appended_between: tuple[float, float]


@pytest.fixture
def built(store_url, tmp_path):
    per_trajectory = all_events()
    order = interleaved(per_trajectory)
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    t0 = time.time()
    for i in range(0, len(order), 16):
        store.append(order[i : i + 16])
    t1 = time.time()
    metrics = store.materialize()
    yield Built(store, expected(per_trajectory, order), metrics, (t0, t1))
    store.close()


def view_rows(store, view: str, key: tuple[str, ...]) -> dict[Any, dict[str, Any]]:
    with store.log.read_engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(text(f"SELECT * FROM {view}"))]
    out = {tuple(r[k] for k in key) if len(key) > 1 else r[key[0]]: r for r in rows}
    assert len(out) == len(rows), f"{view}: duplicate keys {key}"
    return out


def assert_rows_match(view: str, got: dict[Any, dict[str, Any]], want: dict[Any, dict[str, Any]]) -> None:
    assert set(got) == set(want), f"{view}: rows differ: missing {set(want) - set(got)}, extra {set(got) - set(want)}"
    for k, w in want.items():
        for col, value in w.items():
            if col.startswith("_"):
                continue  # a helper fact, not a column
            actual = got[k][col]
            if col == "metadata" and isinstance(actual, str):
                actual = json.loads(actual)  # SQLite gives JSON text
            if isinstance(value, bool):
                actual = bool(actual)  # SQLite gives 0/1
            if isinstance(value, float):
                assert actual == pytest.approx(value), f"{view} {k} {col}: {actual} != {value}"
            else:
                assert actual == value, f"{view} {k} {col}: {actual!r} != {value!r}"


# -- the tests -------------------------------------------------------------------

def test_generation_events(built):
    got = view_rows(built.store, "generation_events", ("trajectory_id", "seq"))
    assert_rows_match("generation_events", got, built.exp.generations)
    positions = [r["position"] for r in got.values()]
    assert len(set(positions)) == len(positions)


def test_trajectory_summary(built):
    got = view_rows(built.store, "trajectory_summary", ("trajectory_id",))
    assert_rows_match("trajectory_summary", got, built.exp.trajectories)
    t0, t1 = built.appended_between
    for row in got.values():
        assert t0 <= row["first_event_at"] <= row["last_event_at"] <= t1
        assert row["duration_s"] == pytest.approx(row["last_event_at"] - row["first_event_at"])


def test_trajectory_summary_agrees_with_the_materializer_metrics(built):
    got = view_rows(built.store, "trajectory_summary", ("trajectory_id",))
    folded = [r for r in got.values() if r["status"] != "running"]
    assert sum(r["num_generations"] for r in folded) == built.metrics.num_steps_before
    assert sum(r["num_samples"] for r in folded) == built.metrics.num_samples_after
    assert sum(r["num_prefix_mismatches"] for r in folded) == built.metrics.prefix_mismatch_count


def test_sample_summary(built):
    got = view_rows(built.store, "sample_summary", ("trajectory_id", "sample_index"))
    assert_rows_match("sample_summary", got, built.exp.samples)


def test_sample_summary_against_the_samples_themselves(built):
    """The merge result in SQL is the one the fold produced (token arrays)."""
    got = view_rows(built.store, "sample_summary", ("trajectory_id", "sample_index"))
    samples = list(built.store.samples())
    assert len(samples) == len(got)
    recorded = view_rows(built.store, "samples", ("trajectory_id", "sample_index"))
    assert {k: r["num_merged_calls"] for k, r in got.items()} == \
        {k: r["num_merged_calls"] for k, r in recorded.items()}, "the view and the materializer disagree"
    for s in samples:
        row = got[(s.trajectory_id, s.sample_index)]
        assert row["num_tokens"] == s.num_tokens
        assert row["num_loss_tokens"] == int(s.loss_mask.sum())
        assert row["num_observed_tokens"] == int(np.sum(s.token_model_versions == -1))
        if s.routed_experts_mask is None:
            assert row["route_coverage"] is None
        else:
            assert row["route_coverage"] == pytest.approx(1 - s.routed_experts_mask.mean())


def test_model_version_stats(built):
    got = view_rows(built.store, "model_version_stats", ("model_version",))
    assert_rows_match("model_version_stats", got, built.exp.versions)
    assert len(got) >= 4, "the store should span several model versions"


def test_the_store_covers_the_cases(built):
    """Guard against the generator drifting into a store that tests nothing."""
    g = built.exp.generations.values()
    t = built.exp.trajectories.values()
    assert any(c["is_merged"] for c in g) and any(c["is_prefix_mismatch"] for c in g)
    assert any(c["finish_reason"] == "abort" for c in g) and any(c["finish_reason"] is None for c in g)
    assert any(not c["has_routes"] for c in g) and any(c["has_token_rewards"] for c in g)
    assert {"running", "completed", "aborted", "failed"} <= {r["status"] for r in t}
    assert any(r["reward"] is None for r in t) and any(r["num_generations"] == 0 for r in t)
    assert any(s["num_route_rows"] is None for s in built.exp.samples.values())
    assert any(0 < (s["route_coverage"] or 0) < 1 for s in built.exp.samples.values())
    assert any(c["min_model_version"] < c["model_version"] for c in g), "no call spans versions"
    assert any(c["metadata"] for c in g) and any(s["finish_reason"] is None for s in built.exp.samples.values())


def test_views_go_away_on_downgrade_and_come_back(store_url, tmp_path):
    from alembic import command

    from trajstore.log._migrate import alembic_config

    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    engine = store.log.write_engine
    for target in ("0001", "head"):
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            (command.downgrade if target == "0001" else command.upgrade)(cfg, target)
        with engine.connect() as conn:
            names = set(conn.dialect.get_view_names(conn))
        assert (set(VIEW_NAMES) & names) == (set() if target == "0001" else set(VIEW_NAMES))
    store.close()


def test_tokens_per_version_are_exact_for_calls_that_span_versions(built):
    """A call with tokens at versions v and v+1 splits its tokens between them."""
    spanning = [c for c in built.exp.generations.values() if c["min_model_version"] < c["model_version"]]
    got = view_rows(built.store, "model_version_stats", ("model_version",))
    total = sum(c["output_len"] for c in built.exp.generations.values())
    assert sum(r["num_generated_tokens"] for r in got.values()) == total
    for c in spanning:
        assert set(c["_per_version"]) <= set(got)


def test_sample_finish_reasons_agree_with_the_samples(built):
    got = view_rows(built.store, "sample_summary", ("trajectory_id", "sample_index"))
    for s in built.store.samples():
        assert got[(s.trajectory_id, s.sample_index)]["finish_reason"] == s.finish_reason


@pytest.mark.parametrize("query", [
    "SELECT trajectory_id, seq FROM generation_events WHERE metadata ->> 'tool' = 'search'",
    "SELECT trajectory_id, seq FROM generation_events WHERE {extract} = 'search'",
])
def test_event_metadata_is_queryable(built, query):
    """docs/sql.md: ``->>`` on both backends, or each one's own JSON function."""
    dialect = built.store.log.read_engine.dialect.name
    extract = "json_extract(metadata, '$.tool')" if dialect == "sqlite" else "json_extract_path_text(metadata, 'tool')"
    with built.store.log.read_engine.connect() as conn:
        got = {tuple(r) for r in conn.execute(text(query.format(extract=extract)))}
        latency = conn.execute(text(
            "SELECT max(CAST(metadata ->> 'latency_ms' AS DOUBLE PRECISION)) FROM generation_events")).scalar_one()
    want = {k for k, c in built.exp.generations.items() if (c["metadata"] or {}).get("tool") == "search"}
    assert got == want and want
    assert latency == max(c["metadata"]["latency_ms"] for c in built.exp.generations.values() if c["metadata"])


DOC_METADATA_QUERIES = {  # docs/sql.md "Event metadata (JSON)", run as written through `trajstore sql`
    "both": """SELECT tool, count(*) AS calls, avg(latency_ms) AS mean_latency_ms
FROM (
    SELECT metadata ->> 'tool' AS tool,
           CAST(metadata ->> 'latency_ms' AS DOUBLE PRECISION) AS latency_ms
    FROM generation_events
    WHERE metadata IS NOT NULL
) m
GROUP BY tool""",
    "sqlite": """SELECT trajectory_id, seq FROM generation_events
WHERE json_extract(metadata, '$.tool') = 'search' AND json_extract(metadata, '$.latency_ms') > 100""",
    "postgresql": """SELECT trajectory_id, seq FROM generation_events
WHERE metadata ->> 'tool' = 'search' AND (metadata ->> 'latency_ms')::float > 100""",
}


def test_documented_metadata_queries_run_read_only(built, store_url):
    from trajstore.inspect.sql import run_query

    dialect = built.store.log.read_engine.dialect.name
    meta = [(k, c["metadata"]) for k, c in built.exp.generations.items() if c["metadata"]]
    by_tool = {}
    for _, m in meta:
        by_tool.setdefault(m["tool"], []).append(m["latency_ms"])
    got = {r[0]: (r[1], r[2]) for r in run_query(reader_url_for(store_url), DOC_METADATA_QUERIES["both"]).rows}
    assert got.keys() == by_tool.keys()
    for tool, latencies in by_tool.items():
        assert got[tool][0] == len(latencies) and got[tool][1] == pytest.approx(sum(latencies) / len(latencies))
    rows = {tuple(r) for r in run_query(reader_url_for(store_url), DOC_METADATA_QUERIES[dialect]).rows}
    assert rows == {k for k, m in meta if m["tool"] == "search" and m["latency_ms"] > 100} and rows


# -- plans: every per-trajectory join is an index lookup ---------------------------

@pytest.mark.parametrize("view", ["trajectory_summary", "model_version_stats"])
def test_sqlite_views_join_by_index_not_by_scan(tmp_path, view):
    """A LEFT JOIN that SQLite answers by scanning its right side once per
    trajectory makes the view quadratic in the number of trajectories (2,000
    trajectories took seconds); each must be a SEARCH (an index, automatic or
    not). The plan, not a timing, is what the test reads."""
    import sqlite3

    url = f"sqlite:///{tmp_path}/s.db"
    with trajstore.connect(url) as store:
        for i in range(20):
            store.append(trajectory_events(CFG, i))
    conn = sqlite3.connect(f"{tmp_path}/s.db")
    plan = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN SELECT * FROM {view}")]
    joins = [step for step in plan if "LEFT-JOIN" in step]
    assert joins, plan
    assert [s for s in joins if not s.startswith("SEARCH")] == [], "\n".join(plan)
