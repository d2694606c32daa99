"""The training panels: what the trainer recorded per step (training lineage, docs/sql.md)."""

from __future__ import annotations

from typing import Any

from trajstore.inspect._figures import (Clock, _fmt, _layout, _num, _plotly, _share, _version_axis, _wide_left)
from trajstore.inspect.sql import QueryResult

__all__: list[str] = []


# -- training lineage: what the trainer did with the samples, per step ------------------------

RUN_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")
"""One colour per run (or projection) where a panel draws several side by side."""
MAX_STEPS = 2000
"""The step panels show the newest this many training steps."""
NO_STEPS = ("no training step recorded yet: a trainer records each step with SampleReader.record_step "
            "(docs/reader.md)")


def _steps_sql(c: Clock) -> list[str]:
    return [f"SELECT run, step, count(*) AS samples, avg(staleness) AS staleness, max(staleness) AS max_staleness, "
            f"max(policy_version) AS policy_version FROM sample_consumption GROUP BY run, step "
            f"ORDER BY step DESC, run LIMIT {MAX_STEPS}",
            # the samples (agg_samples), less the distinct ones a step consumed that are samples of the store: one
            # primary-key probe of samples per consumed sample (linear in what was consumed, not in the store)
            "SELECT n AS samples, n - (SELECT count(*) FROM (SELECT DISTINCT trajectory_id, sample_index "
            "FROM sample_consumption) c WHERE EXISTS (SELECT 1 FROM samples s WHERE s.trajectory_id = c.trajectory_id "
            "AND s.sample_index = c.sample_index)) AS never_trained FROM (SELECT COALESCE(CAST(sum(samples) "
            "AS BIGINT), 0) AS n FROM agg_samples WHERE kind = 'merged_calls') a"]


def _steps_draw(c: Clock, r: list[QueryResult]) -> Any:
    """What each step consumed and how stale it was. The trainer's own metrics are the "Trainer
    metrics per step" panel's (one plot each, each on its own axis), not drawn again here."""
    go, make_subplots = _plotly()
    rows = sorted(r[0].rows, key=lambda row: (row[1], row[0]))
    if not rows:
        return NO_STEPS
    total, never = r[1].rows[0]
    fig = make_subplots(specs=[[{"secondary_y": True}]], subplot_titles=(
        f"samples consumed per step, and their staleness (never trained on: {_fmt(_share(never, total), '.1%')} "
        f"of {total} samples)",))
    runs = sorted({row[0] for row in rows})
    for k, run in enumerate(runs):  # several runs (or projections) of one store: each its own traces, one colour
        mine = [row for row in rows if row[0] == run]
        label = f" ({run})" if len(runs) > 1 else ""
        color = RUN_COLORS[k % len(RUN_COLORS)]
        steps = [int(row[1]) for row in mine]
        fig.add_trace(go.Bar(x=steps, y=[int(row[2]) for row in mine], name=f"samples consumed{label}", opacity=0.6,
                             marker_color=color, legendgroup=run, customdata=[row[0] for row in mine],
                             hovertemplate="run %{customdata}, step %{x}: %{y} samples<extra></extra>"),
                      secondary_y=False)
        fig.add_trace(go.Scatter(x=steps, y=[_num(row[3]) for row in mine], mode="lines+markers",
                                 name=f"mean staleness (policy - oldest token){label}", legendgroup=run,
                                 line=dict(color=color), hovertemplate="step %{x}: %{y} versions<extra></extra>"),
                      secondary_y=True)
        fig.add_trace(go.Scatter(x=steps, y=[_num(row[4]) for row in mine], mode="lines", legendgroup=run,
                                 line=dict(dash="dot", color=color), name=f"max staleness{label}"), secondary_y=True)
    fig.update_xaxes(title_text="training step")
    fig.update_yaxes(title_text="samples", secondary_y=False, rangemode="tozero")
    fig.update_yaxes(title_text="versions behind", secondary_y=True, rangemode="tozero", showgrid=False)
    return _layout(fig)


def _train_mismatch_sql(c: Clock) -> list[str]:
    return ["SELECT run, model_version, tokens_compared, k3_mean, abs_log_ratio_mean "
            "FROM train_rollout_mismatch_by_version ORDER BY model_version, run",
            "SELECT run, step, sum(k3_mean * tokens_compared) / sum(tokens_compared) AS k3_mean, "
            "sum(tokens_compared) AS tokens FROM train_rollout_mismatch WHERE tokens_compared > 0 "
            f"GROUP BY run, step ORDER BY step DESC, run LIMIT {MAX_STEPS}"]


def _train_mismatch_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    by_version, by_step = r[0].rows, sorted(r[1].rows, key=lambda row: (row[1], row[0]))
    if not by_version and not by_step:
        return ("no trainer logprobs recorded yet: a trainer sends them as sample annotations with "
                "SampleReader.record_step(..., annotations=...) (docs/reader.md)")
    fig = _wide_left(make_subplots, ("k3 between trainer and rollout logprobs per training step",
                                     "k3 per model version of the tokens"))
    runs = sorted({row[0] for row in by_step} | {row[0] for row in by_version})
    for k, run in enumerate(runs):  # each run (or projection) its own line and bars, one colour
        label = f" ({run})" if len(runs) > 1 else ""
        color = RUN_COLORS[k % len(RUN_COLORS)]
        steps = [row for row in by_step if row[0] == run]
        versions = [row for row in by_version if row[0] == run]
        fig.add_trace(go.Scatter(x=[int(row[1]) for row in steps], y=[_num(row[2]) for row in steps],
                                 mode="lines+markers", name=f"k3 mean{label}", legendgroup=run, line=dict(color=color),
                                 customdata=[int(row[3]) for row in steps],
                                 hovertemplate="step %{x}: %{y:.3g} over %{customdata} tokens<extra></extra>"), 1, 1)
        fig.add_trace(go.Bar(x=[str(row[1]) for row in versions], y=[_num(row[3]) for row in versions],
                             name=f"k3 mean per version{label}", legendgroup=run, marker_color=color,
                             customdata=[int(row[2]) for row in versions],
                             hovertemplate="version %{x}: %{y:.3g} over %{customdata} tokens<extra></extra>"), 1, 2)
    fig.update_xaxes(title_text="training step", row=1, col=1)
    fig.update_yaxes(title_text="k3 = exp(r) - 1 - r", row=1, col=1)
    _version_axis(fig, row=1, col=2)
    return _layout(fig)


