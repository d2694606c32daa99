"""The panels of ``trajstore report``: SQL over the inspection views and the run
aggregates, drawn as plotly figures (plain dicts: ``_plot``).

Every panel is a few read-only queries and a function that turns their rows
into a plotly figure (``_panels_run``, ``_panels_tokens``, ``_panels_lineage``;
what they share is ``_figures``; the per-step and per-task panels, response length
over time and the trajectories to look at are ``_step_panels``); the page shows each panel's SQL exactly as
it ran, so every number on it can be re-derived with ``trajstore sql``.
``collect(query)`` runs them all in the caller's read-only snapshot and returns
the page's data as one JSON-ready dict, which the live page (``trajstore report
--serve``) polls and the static page embeds. Over-time panels share the run's
time buckets (``_figures.Clock``), as wide as ``trajstore.inspect._timeaxis``
says.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from typing import Any, Callable, Sequence

from trajstore.errors import TrajstoreError
from trajstore.inspect._figures import (BUCKET_WIDTHS_S, CLOCK_SQL, DEFAULT_STUCK_AFTER_S, MAX_BUCKETS,  # noqa: F401
                                        RECENT_VERSIONS, Clock, Panel, _clock, _fmt, _share, drawing, figure_json,
                                        plotly_js)
from trajstore.inspect._panels_lineage import (_steps_draw, _steps_sql, _train_mismatch_draw,
                                               _train_mismatch_sql)
from trajstore.inspect._panels_run import (_finish_draw, _finish_sql, _groups_draw, _groups_sql, _ingest_draw,
                                           _ingest_sql, _merge_draw, _merge_sql, _mismatch_draw, _mismatch_sql,
                                           _problems_draw, _problems_sql, _reward_time_draw, _reward_time_sql,
                                           _reward_version_draw, _reward_version_sql, _running_draw, _running_sql,
                                           _staleness_draw, _staleness_sql, _staleness_time_draw,
                                           _staleness_time_sql, _stuck_draw, _stuck_sql, _versions_draw,
                                           _versions_sql)
from trajstore.inspect._panels_tokens import (_drift_draw, _drift_sql, _experts_draw, _experts_sql, _length_draw,
                                              _length_sql, _logprob_draw, _logprob_sql, _read_samples,  # noqa: F401
                                              _routes_draw, _routes_sql)
from trajstore.inspect._panels_trends import TRENDS
from trajstore.inspect._sources import kinds_of
from trajstore.inspect._step_panels import extend as _extend_panels
from trajstore.inspect.sql import Query, QueryResult

__all__ = ["Clock", "Panel", "PANELS", "DEFAULT_STUCK_AFTER_S", "collect", "plotly_js"]


PANELS: tuple[Panel, ...] = (
    Panel("ingest_rate", "Ingest rate",
          "Engine calls appended per second, and the tokens they generated and read (observed), by time of append.",
          _ingest_sql, _ingest_draw),
    Panel("staleness_over_time", "Staleness as the run goes",
          "For the samples of trajectories finishing in each bucket: how many versions their oldest generated token "
          "lags the newest policy version in the log at that moment (mean and max), and that policy version.",
          _staleness_time_sql, _staleness_time_draw),
    Panel("reward_curve", "Reward curve",
          "Mean (and range of) the reward of the trajectories finishing in each bucket.",
          _reward_time_sql, _reward_time_draw),
    Panel("running", "Running trajectories",
          "Trajectories started and finished per bucket, and how many are running (started, not finished) "
          "at the end of each.",
          _running_sql, _running_draw),
    Panel("stuck", "Stuck trajectories",
          "Running trajectories by how long they have been idle while the log went on (seconds between their last "
          "event and the newest event in the store); red ones passed the stuck threshold (--stuck-after-s).",
          _stuck_sql, _stuck_draw),
    Panel("group_reward_variance", "Groups without reward variance",
          "Finished groups (every trajectory finished, two or more rewarded) by finish time: a group whose "
          "trajectories all got the same reward has zero advantage everywhere and teaches a group-relative "
          "method nothing.",
          _groups_sql, _groups_draw),
    Panel("problems", "Trajectories that need attention",
          "Trajectories that ended failed, aborted or truncated, over time; and, now, the finished ones without "
          "samples: waiting for the materializer, held back until a version label is mapped, or refused by the "
          "materializer (trajstore info lists them).",
          _problems_sql, _problems_draw),
    Panel("finish_reasons", "Finish reasons",
          "The share of engine calls by finish_reason over time, and per model version the share cut by the "
          "length limit (finish_reason = 'length').",
          _finish_sql, _finish_draw),
    Panel("response_length", "Response lengths",
          "Distribution of the tokens generated per engine call for the newest model versions, and the mean and "
          "max per version (from agg_output_lengths, counted as the calls are appended).",
          _length_sql, _length_draw),
    Panel("logprobs", "Rollout logprobs",
          "Distribution of the engine's logprob of each generated loss token, per model version, over every "
          "materialized sample; and its mean per version. Token columns are not in SQL: the materializer counts "
          "them into agg_logprobs (fixed bins) as it writes the samples.",
          _logprob_sql, _logprob_draw),
    Panel("expert_load", "Expert load balance (MoE routes)",
          "How often each expert was routed to when generating, relative to an even split, per model version (the "
          "MoE layers and top-k slots of every materialized sample's recorded decode routes, counted into "
          "agg_expert_load as the materializer writes them, one decode route in 32 by default with its error stated; "
          "the newest versions) and per layer for the newest "
          "version, and the busiest expert's load over the mean (verl's max_vio + 1): the router's balance as the "
          "policy moves. Layers whose every entry is 0 (vLLM's dense layers) are left out.",
          _experts_sql, _experts_draw),
    Panel("versions", "Tokens and trajectories per model version",
          "Tokens generated by each policy version, and the trajectories it took part in (a trajectory resumed "
          "under a newer version counts under each).",
          _versions_sql, _versions_draw),
    Panel("reward_by_version", "Reward by model version",
          "Mean trajectory reward over the trajectories each version generated in, and the share of them that "
          "failed or were aborted.",
          _reward_version_sql, _reward_version_draw),
    Panel("staleness", "Staleness of samples",
          "Samples by how many versions their oldest token lags the newest version in the log when their "
          "trajectory finished, and by how many versions one sample mixes.",
          _staleness_sql, _staleness_draw),
    Panel("merge_ratio", "Merge ratio",
          "Samples per engine call for each finished trajectory (docs/reference.md merge_ratio; lower is more merging), and "
          "how many calls each sample folds.",
          _merge_sql, _merge_draw),
    Panel("prefix_mismatches", "Prefix mismatches",
          "Calls whose prompt did not continue the trajectory's sequence, so a new sample started.",
          _mismatch_sql, _mismatch_draw),
    Panel("route_drift", "Route drift (R3 health)",
          "Route rows the engine re-sent for positions a sample had already recorded, and the share of them whose "
          "experts differ from the recording (any layer or slot), over time and per model version of the calls. "
          "R3 replays the first recording; a rising share means the engine's routing is not reproducible.",
          _drift_sql, _drift_draw),
    Panel("training_steps", "Training steps",
          "What the trainer recorded for each step (training lineage, docs/sql.md): the samples it consumed, how "
          "many versions their oldest generated token lagged the step's policy, the share of the store's samples "
          "no step consumed, and the trainer's own metrics (loss, KL, entropy, grad norm...) per step.",
          _steps_sql, _steps_draw),
    Panel("train_rollout_mismatch", "Trainer vs rollout logprobs",
          "k3 (exp(r) - 1 - r, r = trainer logprob - rollout logprob) over the tokens the trainer annotated, per "
          "step and per model version of the tokens: how far the trainer's recomputation moved from what the "
          "engine sampled.",
          _train_mismatch_sql, _train_mismatch_draw),
    Panel("route_coverage", "Route coverage (R3)",
          "Tokens of each sample without a captured router route (the final token never has one, so 1 is "
          "complete capture), and the share of engine calls that returned routes at all.",
          _routes_sql, _routes_draw),
)
# per step, per task, length over time, and the links to the trace view, placed among the panels above
PANELS = _extend_panels(PANELS)
# the whole run by bucket of versions and of steps, after the per-version panels (the newest few versions)
PANELS = tuple(q for p in PANELS for q in ((p, TRENDS) if p.name == "staleness" else (p,)))


# -- the summary ---------------------------------------------------------------------

SUMMARY_SQL = (
    *CLOCK_SQL[:3],  # the clock's: trajectories by status, the calls' totals, the first and newest event
    # the default samples (agg_samples: one row per figure and value)
    "SELECT COALESCE(CAST(sum(samples) FILTER (WHERE kind = 'merged_calls') AS BIGINT), 0), "
    "CAST(sum(value * samples) FILTER (WHERE kind = 'merged_calls') AS BIGINT), "
    "CAST(sum(value * samples) FILTER (WHERE kind = 'staleness' AND value >= 0) AS DOUBLE PRECISION) "
    "/ NULLIF(sum(samples) FILTER (WHERE kind = 'staleness' AND value >= 0), 0), "
    "max(value) FILTER (WHERE kind = 'staleness' AND value >= 0), "
    "CAST(sum(route_rows) FILTER (WHERE kind = 'no_route') AS BIGINT), "
    "CAST(sum(tokens) FILTER (WHERE kind = 'no_route') AS BIGINT) FROM agg_samples",
)



def _summary(query: Query) -> list[list[str]]:
    by_status = query(SUMMARY_SQL[0]).rows
    n = sum(int(row[1]) for row in by_status)
    calls, generated, observed, mismatches, vmin, vmax = query(SUMMARY_SQL[1]).rows[0]
    _, last, _ = query(SUMMARY_SQL[2]).rows[0]
    samples, folded, mean_stale, max_stale, routed, routable = query(SUMMARY_SQL[3]).rows[0]
    last_at = "-" if last is None else _dt.datetime.fromtimestamp(float(last), _dt.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")
    return [
        ["trajectories", f"{n} ({', '.join(f'{s} {c}' for s, c in by_status) or 'none'})"],
        ["engine calls (generation events)", _fmt(calls or 0)],
        ["tokens generated / observed", f"{_fmt(generated or 0)} / {_fmt(observed or 0)}"],
        ["model versions (newest = the policy now)", "-" if vmin is None else f"{vmin} .. {vmax}"],
        ["newest event", last_at],
        ["samples", _fmt(samples)],
        ["merge ratio (samples / folded calls)", _fmt(_share(samples, folded), ".3f")],
        ["prefix mismatches", _fmt(mismatches or 0)],
        ["staleness of samples: mean / max", f"{_fmt(mean_stale, '.2f')} / {_fmt(max_stale)}"],
        ["tokens with captured routes", _fmt(_share(routed, routable), ".2%")],
    ]


# -- the page's data -------------------------------------------------------------------

def collect(query: Query, *, stuck_after_s: float = DEFAULT_STUCK_AFTER_S, payload: str | None = None,
            panels: Sequence[Panel] = PANELS, progress: Callable[[int], None] | None = None,
            memo: dict[str, Any] | None = None, moved: set[str] | None = None) -> dict[str, Any]:
    """Run every panel's SQL through ``query`` (one read-only snapshot) and draw it.

    Returns ``{"empty", "summary", "summary_sql", "panels": [{"name", "title",
    "caption", "sql", "figure", "note"}], "generated_at"}``: ``figure`` is the
    plotly figure as JSON-ready data, or None with ``note`` saying why (the
    panel has nothing to draw yet). ``payload``: where the store's payload is
    (the token-level panels read the newest samples' segments there).
    ``progress(1)`` is called after each panel. An empty store (no trajectory) has no
    panels at all: the page shows one "no data yet" state instead. ``memo``: a dict kept
    between calls (the live page's): a panel whose SQL and rows are those of the previous call
    is not drawn again, its previous entry (the same object) is returned. ``moved``: the kinds of
    write since the previous call (``_sources``; None: any): a panel whose SQL reads no table such
    a write changes keeps its previous rows without running its SQL."""
    ran: dict[str, QueryResult] = {}
    run = query

    def once(sql: str) -> QueryResult:  # panels sharing a query (and the summary) run it once
        if sql not in ran:
            ran[sql] = run(sql)
        return ran[sql]

    query = once
    if not isinstance(stuck_after_s, (int, float)) or isinstance(stuck_after_s, bool) \
            or not math.isfinite(stuck_after_s) or stuck_after_s < 0:
        raise TrajstoreError(f"stuck_after_s must be a finite number of seconds >= 0, got {stuck_after_s!r}")
    clock = _clock(query, float(stuck_after_s), payload)
    data: dict[str, Any] = {"generated_at": time.time(), "empty": clock.num_trajectories == 0,
                            "summary_sql": list(SUMMARY_SQL), "summary": [], "panels": []}
    if data["empty"]:
        return data
    data["summary"] = _summary(query)
    with drawing():
        for panel in panels:
            sql = list(panel.queries(clock))
            before = memo.get(panel.name) if memo is not None else None
            if before is not None and moved is not None and before[0] == sql and not kinds_of(sql) & moved:
                results = before[3]  # nothing its tables hold has moved
            else:
                results = [query(q) for q in sql]
            # what a drawing reads besides its rows: a time panel's axis spans the clock's buckets (their
            # width and start are in its SQL, as the length bins and the stuck threshold are in theirs)
            rows = [clock.num_buckets if any("bucket" in q for q in sql) else None, [r.rows for r in results]]
            if before is not None and before[0] == sql and before[1] == rows:
                data["panels"].append(before[2])  # the same rows draw the same figure
            else:
                drawn = panel.draw(clock, results)
                figure, note = (None, drawn) if isinstance(drawn, str) else (figure_json(drawn), None)
                data["panels"].append({"name": panel.name, "title": panel.title, "caption": panel.caption,
                                       "sql": sql, "figure": figure, "note": note})
            if memo is not None:
                memo[panel.name] = (sql, rows, data["panels"][-1], results)
            if progress:
                progress(1)  # one panel drawn
    return data
