"""More panels of ``trajstore report``: per training step, per task, response length over
time, and the trajectories worth opening in the trace view.

Each is a ``Panel`` (``trajstore.inspect._figures``: SQL over the views of
docs/sql.md, a plotly figure from the rows); ``extend(panels)`` places them
among the report's panels (``trajstore.inspect._panels`` registers them).

Traces whose points are trajectories carry their ids in ``meta.trajectory_ids``
(``_trace.link_trajectories``): the page links them to the trace view.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from trajstore.log._aggregate_counts import TASK_KEYS  # a trajectory's task: the first of these its metadata has
from trajstore.inspect._figures import (HEIGHT, Clock, Panel, _gapped, _layout, _num, _plotly, _right_axis, _share,
                                        _time_axis, _with_right_axis)
from trajstore.inspect._panels_lineage import MAX_STEPS, NO_STEPS
from trajstore.inspect import _agg_sql as agg
from trajstore.inspect.sql import QueryResult

__all__ = ["extend", "TASK_KEYS"]

MAX_TASKS = 24
MAX_METRICS = 12
"""The trainer-metrics panel draws at most this many of ``train_step.metrics``' keys (those most steps carry)."""
WORST = 10
"""Trajectories listed per criterion in the "trajectories to look at" panel."""


# -- never trained on, per step -----------------------------------------------------------------

def _never_trained_sql(c: Clock) -> list[str]:
    n = MAX_STEPS
    return [
        # samples finished before each step was recorded: per step, the samples that finished between the step
        # before it (of those shown) and it, counted on ix_samples_order (finished_position, sample_index): every
        # sample at most once, from the index alone, no sort of the samples; the draw sums them up
        "SELECT run, step, position, (SELECT count(*) FROM samples s WHERE s.finished_position < w.position "
        "AND s.finished_position > w.previous) AS added FROM (SELECT run, step, position, "
        "COALESCE(lag(position) OVER (ORDER BY position), -1) AS previous FROM ("
        "SELECT run, step, min(position) AS position FROM train_steps GROUP BY run, step "
        f"ORDER BY step DESC, run LIMIT {n}) st) w ORDER BY position",
        "SELECT run, first_step, count(*) AS samples FROM (SELECT run, trajectory_id, sample_index, min(step) AS "
        "first_step FROM sample_consumption GROUP BY run, trajectory_id, sample_index) f "
        "GROUP BY run, first_step ORDER BY run, first_step",
        f"SELECT run, step, count(*) AS samples FROM sample_consumption GROUP BY run, step "
        f"ORDER BY step DESC, run LIMIT {n}",
    ]


def _never_trained_draw(c: Clock, r: list[QueryResult]) -> Any:
    import numpy as np

    go, make_subplots = _plotly()
    if not r[0].rows:
        return NO_STEPS
    # in log order: each step's samples available = those finished before it, a running sum
    available_at = dict(zip(((row[0], row[1]) for row in r[0].rows), np.cumsum([int(row[3]) for row in r[0].rows])))
    steps = sorted(((run, step, position, available_at[run, step]) for run, step, position, _ in r[0].rows),
                   key=lambda row: (row[0], row[1]))
    first: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for run in {row[0] for row in r[1].rows}:
        pts = [(int(s), int(n)) for rr, s, n in r[1].rows if rr == run]
        first[run] = (np.array([s for s, _ in pts]), np.cumsum([n for _, n in pts]))
    consumed = {(row[0], int(row[1])): int(row[2]) for row in r[2].rows}
    fig = _with_right_axis(make_subplots)
    for run in sorted({row[0] for row in steps}):
        rows = [row for row in steps if row[0] == run]
        xs = np.array([int(row[1]) for row in rows])
        available = np.array([int(row[3] or 0) for row in rows], np.float64)
        fs, cum = first.get(run, (np.zeros(0, int), np.zeros(0, int)))
        # distinct samples this run trained on at steps <= x: the cumulative count at the last first_step <= x
        at = np.searchsorted(fs, xs, side="right") - 1
        trained = np.where(at >= 0, cum[np.maximum(at, 0)] if len(cum) else 0, 0)
        share = np.where(available > 0, 1.0 - trained / np.maximum(available, 1), np.nan)
        label = f" ({run})" if len({row[0] for row in steps}) > 1 else ""
        fig.add_trace(go.Bar(x=xs.tolist(), y=[consumed.get((run, int(x)), 0) for x in xs], opacity=0.5,
                             name=f"samples consumed{label}"), secondary_y=False)
        fig.add_trace(go.Scatter(x=xs.tolist(), y=[None if np.isnan(v) else float(v) for v in share],
                                 mode="lines+markers", name=f"never trained on, as of the step{label}",
                                 customdata=np.stack([trained, available]).T.tolist(),
                                 hovertemplate="step %{x}: %{y:.1%} (%{customdata[0]} of %{customdata[1]} "
                                               "samples trained on)<extra></extra>"), secondary_y=True)
    fig.update_xaxes(title_text="training step")
    fig.update_yaxes(title_text="samples consumed", secondary_y=False, rangemode="tozero")
    _right_axis(fig, "share never trained on", tickformat=".0%", range=[0, 1])
    return _layout(fig)


# -- the trainer's metrics, one small plot each -----------------------------------------------

def _metrics_sql(c: Clock) -> list[str]:
    n = MAX_STEPS
    return [f"SELECT run, step, rank, metrics FROM train_steps ORDER BY step DESC, run, rank LIMIT {n * 8}"]


def _metrics_draw(c: Clock, r: list[QueryResult]) -> Any:
    import math

    go, make_subplots = _plotly()
    if not r[0].rows:
        return NO_STEPS
    values: dict[str, dict[tuple[str, int], list[float]]] = {}
    for run, step, _, metrics in r[0].rows:
        got = json.loads(metrics) if isinstance(metrics, str) else (metrics or {})
        for name, v in got.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                values.setdefault(name, {}).setdefault((run, int(step)), []).append(float(v))
    if not values:
        return "the training steps carry no numeric metrics (record_step(..., metrics={'loss': ...}))"
    names = sorted(values, key=lambda k: (-len(values[k]), k))[:MAX_METRICS]
    cols = min(3, len(names))
    rows = (len(names) + cols - 1) // cols
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=tuple(names), vertical_spacing=0.35 / rows,
                        horizontal_spacing=0.08)
    runs = sorted({run for per in values.values() for run, _ in per})
    for i, name in enumerate(names):
        row, col = i // cols + 1, i % cols + 1
        for k, run in enumerate(runs):
            pts = sorted((s, v) for (rr, s), v in values[name].items() if rr == run)
            if not pts:
                continue
            xs = [s for s, _ in pts]
            mean = [sum(v) / len(v) for _, v in pts]
            if any(len(v) > 1 for _, v in pts):  # several ranks: their range
                fig.add_trace(go.Scatter(x=xs, y=[min(v) for _, v in pts], mode="lines", line=dict(width=0),
                                         showlegend=False, hoverinfo="skip"), row, col)
                fig.add_trace(go.Scatter(x=xs, y=[max(v) for _, v in pts], mode="lines", line=dict(width=0),
                                         fill="tonexty", fillcolor="rgba(99,110,250,0.15)", showlegend=False,
                                         name="ranks min .. max"), row, col)
            fig.add_trace(go.Scatter(x=xs, y=mean, mode="lines+markers", name=run, legendgroup=run,
                                     showlegend=i == 0, marker=dict(size=4),
                                     line=dict(color=P_COLORS[k % len(P_COLORS)]),
                                     hovertemplate=f"{name.replace('%', '%%')} at step %{{x}}: %{{y:.4g}}"
                                                   "<extra>%{fullData.name}</extra>"), row, col)
    fig.update_xaxes(title_text="training step", row=rows)
    return _layout(fig, height=max(HEIGHT, 230 * rows))


P_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


# -- per task -----------------------------------------------------------------------------------

def _task_sql(c: Clock) -> list[str]:
    return [
        "SELECT task, trajectories, rewarded, reward_sum / NULLIF(CAST(rewarded AS DOUBLE PRECISION), 0) AS mean_reward, "
        f"generated_tokens, calls, failed FROM agg_tasks ORDER BY trajectories DESC, task LIMIT {MAX_TASKS}"]


def _task_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    rows = r[0].rows
    if not rows:
        return ("no trajectory names a task: trajectory_started's metadata carries one of the keys "
                + ", ".join(TASK_KEYS))
    tasks = [str(row[0]) for row in rows]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("mean reward per task", "tokens generated per call",
                                                        "failed or aborted"))
    fig.add_trace(go.Bar(x=tasks, y=[_num(row[3]) for row in rows], name="mean reward", showlegend=False,
                         customdata=[[row[2], row[1]] for row in rows],
                         hovertemplate="%{x}: %{y:.3f} (%{customdata[0]} rewarded of %{customdata[1]})"
                                       "<extra></extra>"), 1, 1)
    fig.add_trace(go.Bar(x=tasks, y=[_share(row[4], row[5]) for row in rows], name="tokens per call",
                         showlegend=False, marker_color="#ff7f0e"), 1, 2)
    fig.add_trace(go.Bar(x=tasks, y=[_share(row[6], row[1]) for row in rows], name="failed or aborted",
                         showlegend=False, marker_color="#d62728", customdata=[row[1] for row in rows],
                         hovertemplate="%{x}: %{y:.1%} of %{customdata}<extra></extra>"), 1, 3)
    fig.update_xaxes(type="category", title_text="task")
    fig.update_yaxes(tickformat=".0%", row=1, col=3)
    return _layout(fig)


# -- response length as the run goes --------------------------------------------------------------

def _length_time_sql(c: Clock) -> list[str]:
    return [f"SELECT {c.bucket_of_start('bucket_start')} AS bucket, CAST(sum(calls) AS BIGINT) AS calls, "
            "CAST(sum(output_tokens) AS DOUBLE PRECISION) / sum(calls) AS mean_output_len, "
            "max(max_output_len) AS max_output_len, "
            "COALESCE(CAST(sum(calls) FILTER (WHERE finish_reason = 'length') AS BIGINT), 0) AS length_calls "
            f"FROM {agg.calls(c.base_width)} GROUP BY 1 ORDER BY 1"]


def _length_time_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    rows = _gapped(r[0].rows)
    if not rows:
        return "no engine calls yet"
    xs = [c.time_of(row[0]) for row in rows]
    fig = _with_right_axis(make_subplots)
    fig.add_trace(go.Scatter(x=xs, y=[_num(row[2]) for row in rows], mode="lines+markers", name="mean",
                             customdata=[row[1] for row in rows], hovertemplate="%{y:.1f} tokens (%{customdata} calls)"),
                  secondary_y=False)
    fig.add_trace(go.Scatter(x=xs, y=[row[3] for row in rows], mode="lines", name="max", line=dict(dash="dash")),
                  secondary_y=False)
    fig.add_trace(go.Bar(x=xs, y=[_share(row[4], row[1]) for row in rows], name="cut by the length limit",
                         opacity=0.35, marker_color="#d62728"), secondary_y=True)
    _time_axis(fig, c)
    fig.update_yaxes(title_text="tokens generated per call", secondary_y=False, rangemode="tozero")
    _right_axis(fig, "share with finish_reason = 'length'", tickformat=".0%")
    return _layout(fig)


# -- trajectories to look at (links to the trace view) -------------------------------------------

def _worst_sql(c: Clock) -> list[str]:
    return [
        # finished trajectories (agg_trajectory_stats), the worst first through its ordered indexes
        "SELECT trajectory_id, route_drift_share, route_rows_drifted FROM agg_trajectory_stats "
        f"WHERE route_drift_share > 0 ORDER BY route_drift_share DESC, trajectory_id LIMIT {WORST}",
        "SELECT trajectory_id, max(k3_mean) AS k3_mean, sum(tokens_compared) AS tokens FROM train_rollout_mismatch "
        f"WHERE tokens_compared > 0 GROUP BY trajectory_id ORDER BY max(k3_mean) DESC, trajectory_id LIMIT {WORST}",
        "SELECT trajectory_id, num_generated_tokens, num_generations, status FROM agg_trajectory_stats "
        f"WHERE num_generations > 0 ORDER BY num_generated_tokens DESC, trajectory_id LIMIT {WORST}",
    ]


def _worst_draw(c: Clock, r: list[QueryResult]) -> Any:
    from trajstore.inspect._trace import link_trajectories

    go, make_subplots = _plotly()
    drift, k3, longest = (list(reversed(q.rows)) for q in r)  # the worst on top
    if not (drift or k3 or longest):
        return "no engine calls yet"
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.2, subplot_titles=(
        "highest route drift share", "highest trainer vs rollout k3 (a sample's mean)", "most tokens generated"))
    for col, rows, color, fmt, extra in (
            (1, drift, "#d62728", ".2%", lambda row: f"{row[2]} rows moved"),
            (2, k3, "#9467bd", ".4g", lambda row: f"over {row[2]} tokens"),
            (3, longest, "#1f77b4", "d", lambda row: f"{row[2]} calls, {row[3]}")):
        fig.add_trace(link_trajectories(go.Bar(
            y=[row[0] for row in rows], x=[_num(row[1]) for row in rows], orientation="h", showlegend=False,
            marker_color=color, customdata=[extra(row) for row in rows], name="",
            hovertemplate="%{y}: %{x:" + fmt + "}, %{customdata} (click: trace view)<extra></extra>"),
            [row[0] for row in rows]), 1, col)
    fig.update_yaxes(type="category", automargin=True)
    fig.update_xaxes(tickformat=".1%", row=1, col=1)
    return _layout(fig, height=max(HEIGHT, 60 + 24 * max(len(drift), len(k3), len(longest))))


# -- registering ---------------------------------------------------------------------------------

def _linked_stuck(panel: Any) -> Any:
    """The stuck panel with its bars linked to the trace view (its y values are trajectory ids)."""
    from dataclasses import replace

    from trajstore.inspect._trace import link_trajectories

    def draw(c: Clock, r: list[QueryResult]) -> Any:
        fig = panel.draw(c, r)
        if not isinstance(fig, str) and fig.data:
            link_trajectories(fig.data[0], list(fig.data[0].y or ()))
        return fig

    return replace(panel, draw=draw)


def extend(panels: Sequence[Panel]) -> tuple[Panel, ...]:
    """``panels`` with these placed among them (after the panel each belongs beside, else at the end)."""
    new = {
        "response_length": Panel(
            "response_length_over_time", "Response length as the run goes",
            "Tokens generated per engine call in each bucket (mean and max), and the share of calls cut by the "
            "length limit (finish_reason = 'length').", _length_time_sql, _length_time_draw),
        "reward_by_version": Panel(
            "per_task", "Per task",
            "Trajectories grouped by their task, the first of the keys " + ", ".join(TASK_KEYS) + " that "
            "trajectory_started's metadata has: mean reward, tokens generated per engine call, and the share that "
            "failed or were aborted.", _task_sql, _task_draw),
        "train_rollout_mismatch": Panel(
            "never_trained", "Never trained on, per step",
            "Per training step: the samples it consumed, and of the samples whose trajectory finished before the "
            "step was recorded, the share the run had not trained on at any step up to it (samples the trainer "
            "skipped or has not reached).", _never_trained_sql, _never_trained_draw),
    }
    metrics = Panel(
        "trainer_metrics", "Trainer metrics per step",
        "Every numeric key of train_step.metrics (loss, KL, entropy, grad norm, clip fraction, route replay "
        "mismatch, ... whatever the trainer records; the twelve most steps carry), one plot each: the mean over "
        "ranks, and their range when several ranks report.", _metrics_sql, _metrics_draw)
    worst = Panel(
        "trajectories_to_look_at", "Trajectories to look at",
        "The trajectories with the highest route drift share, the highest trainer-vs-rollout k3 of a sample, and "
        "the most generated tokens. Click a bar or a link to open the trajectory in the trace view, token by token.",
        _worst_sql, _worst_draw)
    out: list[Any] = []
    for p in panels:
        out.append(_linked_stuck(p) if p.name == "stuck" else p)
        if p.name in new:
            out.append(new.pop(p.name))
            if p.name == "train_rollout_mismatch":
                out.append(metrics)
                metrics = None
    out.extend(new.values())
    if metrics is not None:
        out.append(metrics)
    out.append(worst)
    return tuple(out)
