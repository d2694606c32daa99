"""The panels of the run over time, per trajectory and per model version: SQL over the
inspection views (docs/sql.md)."""

from __future__ import annotations

from typing import Any

from trajstore.inspect._figures import (_gapped, HEIGHT, MAX_STUCK_ROWS, _VERSION_STATS_SQL, Clock, _filled, _layout, _num, 
                                        _plotly, _right_axis, _share, _sql_number, _time_axis, _two_bars,
                                        _version_axis, _wide_left, _with_right_axis)
from trajstore.inspect import _agg_sql as agg
from trajstore.inspect.sql import QueryResult

__all__: list[str] = []

_CALLS_PER_VERSION_SQL = (
    "SELECT model_version, CAST(sum(calls) AS BIGINT) AS calls, "
    "COALESCE(CAST(sum(calls) FILTER (WHERE finish_reason = 'length') AS BIGINT), 0) AS length_calls, "
    "CAST(sum(prefix_mismatches) AS BIGINT) AS mismatches, CAST(sum(calls_with_routes) AS BIGINT) AS calls_with_routes "
    f"FROM {agg.calls(agg.CALL_WIDTHS_S[-1])} GROUP BY model_version ORDER BY model_version")
"""Engine calls per model version (``agg_calls``): the finish reason, mismatch and route coverage panels share it."""


def _ingest_sql(c: Clock) -> list[str]:
    return [f"SELECT {c.bucket_of_start('bucket_start')} AS bucket, CAST(sum(calls) AS BIGINT) AS calls, "
            "CAST(sum(output_tokens) AS BIGINT) AS generated_tokens, "
            f"CAST(sum(observed_tokens) AS BIGINT) AS observed_tokens FROM {agg.calls(c.base_width)} "
            "GROUP BY 1 ORDER BY 1"]


def _ingest_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    if not r[0].rows:
        return "no engine calls yet"
    xs, (calls, gen, obs) = _filled(c, r[0].rows, 3)
    fig = _with_right_axis(make_subplots)
    fig.add_trace(go.Bar(x=xs, y=[v / c.width_s for v in calls], name="engine calls / s", opacity=0.6), secondary_y=False)
    fig.add_trace(go.Scatter(x=xs, y=[v / c.width_s for v in gen], name="generated tokens / s", mode="lines"),
                  secondary_y=True)
    fig.add_trace(go.Scatter(x=xs, y=[v / c.width_s for v in obs], name="observed tokens / s", mode="lines",
                             line=dict(dash="dot")), secondary_y=True)
    _time_axis(fig, c)
    fig.update_yaxes(title_text="calls / s", secondary_y=False, rangemode="tozero")
    _right_axis(fig, "tokens / s")
    return _layout(fig)


def _staleness_time_sql(c: Clock) -> list[str]:
    return [f"SELECT {c.bucket_of_start('bucket_start')} AS bucket, CAST(sum(samples) AS BIGINT) AS samples, "
            "CAST(sum(staleness_sum) AS DOUBLE PRECISION) / NULLIF(sum(staled), 0) AS mean_staleness, "
            "NULLIF(max(staleness_max), -1) AS max_staleness, NULLIF(max(policy_version_max), -1) AS policy_version "
            f"FROM {agg.staleness(c.base_width)} GROUP BY 1 ORDER BY 1"]


def _staleness_time_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    rows = _gapped(r[0].rows)
    if not rows:
        return "no materialized samples yet (trajstore materialize folds finished trajectories)"
    xs = [c.time_of(row[0]) for row in rows]
    fig = _with_right_axis(make_subplots)
    fig.add_trace(go.Scatter(x=xs, y=[_num(row[2]) for row in rows], name="mean staleness", mode="lines+markers",
                             customdata=[row[1] for row in rows],
                             hovertemplate="%{y:.2f} versions behind<br>%{customdata} samples"), secondary_y=False)
    fig.add_trace(go.Scatter(x=xs, y=[_num(row[3]) for row in rows], name="max staleness", mode="lines",
                             line=dict(dash="dash")), secondary_y=False)
    fig.add_trace(go.Scatter(x=xs, y=[_num(row[4]) for row in rows], name="policy version", mode="lines",
                             line=dict(shape="hv", color="grey")), secondary_y=True)
    _time_axis(fig, c)
    fig.update_yaxes(title_text="versions behind", secondary_y=False, rangemode="tozero")
    _right_axis(fig, "policy version")
    return _layout(fig)


def _reward_time_sql(c: Clock) -> list[str]:
    return [f"SELECT {c.bucket_of_start('bucket_start')} AS bucket, CAST(sum(rewarded) AS BIGINT) AS rewarded, "
            "sum(reward_sum) / CAST(sum(rewarded) AS DOUBLE PRECISION) AS mean_reward, min(reward_min) AS min_reward, "
            f"max(reward_max) AS max_reward FROM {agg.rewards(c.base_width)} GROUP BY 1 ORDER BY 1"]


def _reward_time_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, _ = _plotly()
    rows = _gapped(r[0].rows)
    if not rows:
        return "no finished trajectory has a reward yet"
    xs = [c.time_of(row[0]) for row in rows]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=xs, y=[_num(row[3]) for row in rows], mode="lines", line=dict(width=0),
                             showlegend=False, hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=xs, y=[_num(row[4]) for row in rows], mode="lines", line=dict(width=0),
                             fill="tonexty", fillcolor="rgba(99,110,250,0.15)", name="min .. max"))
    fig.add_trace(go.Scatter(x=xs, y=[_num(row[2]) for row in rows], mode="lines+markers", name="mean reward",
                             customdata=[row[1] for row in rows], hovertemplate="%{y:.3f} (n=%{customdata})"))
    _time_axis(fig, c)
    fig.update_yaxes(title_text="reward of finished trajectories")
    return _layout(fig)


def _running_sql(c: Clock) -> list[str]:
    return [
        f"SELECT {c.bucket_of_start('bucket_start')} AS bucket, CAST(sum(started) AS BIGINT) AS started, "
        "CAST(sum(finished) AS BIGINT) AS finished, "
        "CAST(sum(sum(started) - sum(finished)) OVER (ORDER BY "
        f"{c.bucket_of_start('bucket_start')}) AS BIGINT) AS running FROM {agg.trajectories(c.base_width)} "
        "GROUP BY 1 ORDER BY 1"]


def _running_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    rows = r[0].rows
    if not rows:
        return "no trajectories yet"
    xs = [c.time_of(row[0]) for row in rows]
    fig = _with_right_axis(make_subplots)
    fig.add_trace(go.Scatter(x=xs, y=[row[3] for row in rows], name="running at the bucket's end", mode="lines",
                             line=dict(shape="hv", width=3, color="#2ca02c")), secondary_y=False)
    fig.add_trace(go.Bar(x=xs, y=[row[1] for row in rows], name="started", opacity=0.45, marker_color="#1f77b4"),
                  secondary_y=True)
    fig.add_trace(go.Bar(x=xs, y=[row[2] for row in rows], name="finished", opacity=0.45, marker_color="#ff7f0e"),
                  secondary_y=True)
    _time_axis(fig, c)
    fig.update_yaxes(title_text="running trajectories", secondary_y=False, rangemode="tozero")
    _right_axis(fig, "started / finished per bucket")
    return _layout(fig, barmode="group")



def _stuck_sql(c: Clock) -> list[str]:
    newest = _sql_number(c.last_s)  # the newest event in the store (the clock's)
    # the running trajectories only (ix_trajectories_status), each one's events through its index
    running = ("SELECT t.trajectory_id, t.group_id, count(*) FILTER (WHERE e.type = 'generation') AS num_generations, "
               "max(CASE WHEN e.type = 'generation' THEN e.model_version END) AS max_model_version, "
               "max(e.created_at) AS last_event_at FROM trajectories t JOIN events e ON e.trajectory_id = t.trajectory_id "
               "WHERE t.status = 'running' GROUP BY t.trajectory_id, t.group_id")
    return [
        f"SELECT count(*) AS running, count(*) FILTER (WHERE {newest} - last_event_at > {_sql_number(c.stuck_after_s)}) "
        f"AS stuck FROM ({running}) r",
        f"SELECT trajectory_id, group_id, num_generations, max_model_version, {newest} - last_event_at AS idle_s "
        f"FROM ({running}) r ORDER BY last_event_at, trajectory_id LIMIT {MAX_STUCK_ROWS}"]


def _stuck_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, _ = _plotly()
    running, stuck = r[0].rows[0]
    rows = r[1].rows
    if not rows:
        return "no running trajectories: nothing can be stuck"
    rows = list(reversed(rows))  # the longest idle on top
    idle = [float(row[4] or 0) for row in rows]
    fig = go.Figure(go.Bar(
        y=[row[0] for row in rows], x=idle, orientation="h",
        marker_color=["#d62728" if s > c.stuck_after_s else "#1f77b4" for s in idle],
        customdata=[[row[1], row[2], row[3]] for row in rows],
        hovertemplate="%{y}: idle %{x:.1f} s<br>group %{customdata[0]}, %{customdata[1]} calls, "
                      "version %{customdata[2]}<extra></extra>"))
    fig.add_vline(x=c.stuck_after_s, line_dash="dash", line_color="#d62728",
                  annotation_text=f"stuck after {c.stuck_after_s:g} s")
    fig.update_xaxes(title_text="idle: seconds since its last event, behind the log's newest event",
                     rangemode="tozero")
    _layout(fig, title=dict(text=f"{running} running, {stuck} idle over {c.stuck_after_s:g} s"
                                 f"{f' (the {len(rows)} longest idle shown)' if running > len(rows) else ''}",
                            font=dict(size=13)))
    fig.update_layout(height=max(HEIGHT, 60 + 18 * len(rows)), margin=dict(l=160))
    return fig



def _versions_sql(c: Clock) -> list[str]:
    return [_VERSION_STATS_SQL]


def _versions_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    rows = r[0].rows
    if not rows:
        return "no engine calls yet"
    v = [str(row[0]) for row in rows]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("generated tokens", "trajectories"))
    fig.add_trace(go.Bar(x=v, y=[row[1] for row in rows], name="generated tokens", showlegend=False), 1, 1)
    fig.add_trace(go.Bar(x=v, y=[row[2] - row[3] for row in rows], name="this version only"), 1, 2)
    fig.add_trace(go.Bar(x=v, y=[row[3] for row in rows], name="also other versions"), 1, 2)
    _layout(fig, barmode="stack")
    _version_axis(fig)
    return fig


def _reward_version_sql(c: Clock) -> list[str]:
    return [_VERSION_STATS_SQL]


def _reward_version_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    rows = r[0].rows
    if not rows:
        return "no engine calls yet"
    v = [str(row[0]) for row in rows]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("mean reward", "failed / aborted trajectories"))
    fig.add_trace(go.Bar(x=v, y=[_num(row[4]) for row in rows], name="mean reward", showlegend=False,
                         text=[f"n={row[5]}" for row in rows], textposition="outside"), 1, 1)
    fig.add_trace(go.Bar(x=v, y=[_share(row[6], row[2]) for row in rows], name="failed"), 1, 2)
    fig.add_trace(go.Bar(x=v, y=[_share(row[7], row[2]) for row in rows], name="aborted"), 1, 2)
    _layout(fig, barmode="stack")
    _version_axis(fig)
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    return fig


def _finish_sql(c: Clock) -> list[str]:
    return [
        f"SELECT {c.bucket_of_start('bucket_start')} AS bucket, COALESCE(finish_reason, '(none)') AS finish_reason, "
        f"CAST(sum(calls) AS BIGINT) AS calls FROM {agg.calls(c.base_width)} GROUP BY 1, 2 ORDER BY 1, 2",
        _CALLS_PER_VERSION_SQL]


def _finish_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    per_time, per_version = r[0].rows, r[1].rows
    if not per_time:
        return "no engine calls yet"
    totals: dict[int, int] = {}
    for b, _, n in per_time:
        totals[b] = totals.get(b, 0) + n
    reasons = sorted({row[1] for row in per_time}, key=lambda s: (s != "length", s))
    calls = sum(row[1] for row in per_version)
    length = sum(row[2] for row in per_version)
    fig = _wide_left(make_subplots, ("finish reasons over time (share of calls)",
                                     f"finish_reason = 'length' per version (run: {length / calls:.1%})"))
    for reason in reasons:
        pts = [(b, n) for b, rr, n in per_time if rr == reason]
        fig.add_trace(go.Scatter(x=[c.time_of(b) for b, _ in pts], y=[n / totals[b] for b, n in pts], name=reason,
                                 stackgroup="reasons", mode="lines" if len(totals) > 1 else "lines+markers"),
                      1, 1)  # one bucket: a stacked area of one point draws nothing, its marker shows
    fig.add_trace(go.Bar(x=[str(row[0]) for row in per_version], y=[_share(row[2], row[1]) for row in per_version],
                         name="length", marker_color="#d62728", showlegend=False,
                         customdata=[[row[2], row[1]] for row in per_version],
                         hovertemplate="%{customdata[0]} of %{customdata[1]} calls"), 1, 2)
    _time_axis(fig, c, row=1, col=1)
    _version_axis(fig, row=1, col=2)
    fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    return _layout(fig)



def _groups_sql(c: Clock) -> list[str]:
    return [f"SELECT {c.bucket_of_start('bucket_start')} AS bucket, CAST(sum(groups) AS BIGINT) AS groups, "
            "CAST(sum(zero_variance_groups) AS BIGINT) AS zero_variance_groups, "
            "sum(variance_sum) / CAST(sum(groups) AS DOUBLE PRECISION) AS mean_variance "
            f"FROM {agg.group_variance(c.base_width)} GROUP BY 1 HAVING sum(groups) > 0 ORDER BY 1"]


def _groups_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    rows = r[0].rows
    if not rows:
        return "no finished group with two or more rewarded trajectories yet"
    xs = [c.time_of(row[0]) for row in rows]
    groups = sum(row[1] for row in rows)
    zero = sum(row[2] for row in rows)
    fig = _with_right_axis(make_subplots)
    fig.add_trace(go.Bar(x=xs, y=[row[1] - row[2] for row in rows], name="groups with reward variance"),
                  secondary_y=False)
    fig.add_trace(go.Bar(x=xs, y=[row[2] for row in rows], name="zero-variance groups (no advantage)",
                         marker_color="#d62728"), secondary_y=False)
    fig.add_trace(go.Scatter(x=xs, y=[_num(row[3]) for row in rows], name="mean within-group variance",
                             mode="lines+markers", line=dict(color="black")), secondary_y=True)
    _time_axis(fig, c)
    fig.update_yaxes(title_text="finished groups", secondary_y=False)
    _right_axis(fig, "reward variance")
    return _layout(fig, barmode="stack", title=dict(
        text=f"{zero} of {groups} finished groups ({zero / groups:.0%}) have one reward for all their trajectories",
        font=dict(size=13)))


def _problems_sql(c: Clock) -> list[str]:
    return [f"SELECT {c.bucket_of_start('bucket_start')} AS bucket, "
            "COALESCE(CAST(sum(finished) FILTER (WHERE status = 'failed') AS BIGINT), 0) AS failed, "
            "COALESCE(CAST(sum(finished) FILTER (WHERE status = 'aborted') AS BIGINT), 0) AS aborted, "
            "COALESCE(CAST(sum(finished) FILTER (WHERE status = 'truncated') AS BIGINT), 0) AS truncated, "
            f"CAST(sum(finished) AS BIGINT) AS finished FROM {agg.trajectories(c.base_width)} "
            "WHERE status <> 'running' GROUP BY 1 ORDER BY 1",
            _NOW_SQL]


_UNRESOLVED = ("SELECT 1 FROM unresolved_labels u WHERE u.trajectory_id = t.trajectory_id "
               "AND NOT EXISTS (SELECT 1 FROM version_labels v WHERE v.label = u.label)")
_NOW_SQL = (
    # finished after the lowest materializer checkpoint (through the index on finished_position), with a call,
    # no sample, not unfoldable, not held back: bounded by the materializer's backlog
    "SELECT (SELECT count(*) FROM trajectories t WHERE t.finished_position > "
    "COALESCE((SELECT min(position) FROM materializer_checkpoints), -1) AND t.status <> 'running' "
    "AND EXISTS (SELECT 1 FROM events e WHERE e.trajectory_id = t.trajectory_id AND e.type = 'generation') "
    "AND NOT EXISTS (SELECT 1 FROM samples s WHERE s.trajectory_id = t.trajectory_id) "
    "AND NOT EXISTS (SELECT 1 FROM unfoldable_trajectories f WHERE f.trajectory_id = t.trajectory_id) "
    f"AND NOT EXISTS ({_UNRESOLVED})) AS waiting_to_fold, "
    # the labels still unmapped: bounded by the calls that named one
    "(SELECT count(DISTINCT u.trajectory_id) FROM unresolved_labels u JOIN trajectories t "
    "ON t.trajectory_id = u.trajectory_id WHERE t.status <> 'running' "
    "AND NOT EXISTS (SELECT 1 FROM version_labels v WHERE v.label = u.label)) AS held_back, "
    "(SELECT count(*) FROM unfoldable_trajectories) AS unfoldable, "
    "(SELECT CAST(sum(placeholder_logprobs) AS BIGINT) FROM agg_trajectory_shapes) AS placeholder_logprobs")
"""The problems panel's "now": trajectories waiting for the materializer, held back, refused; the
finished trajectories' placeholder logprobs (``agg_trajectory_shapes``)."""


def _problems_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    per_time = r[0].rows
    waiting, held, unfoldable, placeholders = r[1].rows[0]
    fig = _wide_left(make_subplots, (
        "failed, aborted and truncated, by finish time", "finished, without samples, now"))
    xs = [c.time_of(row[0]) for row in per_time]
    for i, (name, color) in enumerate((("failed", "#d62728"), ("aborted", "#ff7f0e"), ("truncated", "#9467bd"))):
        fig.add_trace(go.Bar(x=xs, y=[row[1 + i] for row in per_time], name=name, marker_color=color,
                             customdata=[row[4] for row in per_time],
                             hovertemplate="%{y} of %{customdata} finished<extra>" + name + "</extra>"), 1, 1)
    labels = ["waiting to fold", "held back (label)", "unfoldable"]
    fig.add_trace(go.Bar(x=labels, y=[waiting or 0, held or 0, unfoldable or 0], showlegend=False, name="now",
                         marker_color=["#7f7f7f", "#bcbd22", "#d62728"], text=[waiting or 0, held or 0, unfoldable or 0],
                         textposition="outside"), 1, 2)
    _time_axis(fig, c, row=1, col=1)
    fig.update_xaxes(title_text=f"logprobs the engine sent as placeholders (stored as missing): {placeholders or 0}",
                     row=1, col=2)
    fig.update_yaxes(title_text="trajectories", rangemode="tozero")
    return _layout(fig, barmode="stack")


def _staleness_sql(c: Clock) -> list[str]:
    return ["SELECT NULLIF(value, -1) AS staleness, samples FROM agg_samples WHERE kind = 'staleness' ORDER BY value",
            "SELECT value AS model_version_span, samples FROM agg_samples WHERE kind = 'version_span' ORDER BY value"]


def _staleness_draw(c: Clock, r: list[QueryResult]) -> Any:
    stale, span = r[0].rows, r[1].rows
    if not stale:
        return "no materialized samples yet (trajstore materialize folds finished trajectories)"
    fig = _two_bars(("staleness at finish (versions behind)", "versions mixed within one sample (max - min)"),
                    dict(x=[str(row[0]) for row in stale], y=[row[1] for row in stale], name="samples"),
                    dict(x=[str(row[0]) for row in span], y=[row[1] for row in span], name="samples",
                         marker_color="#ff7f0e"))
    fig.update_yaxes(title_text="samples", row=1, col=1)
    return _layout(fig)


def _merge_sql(c: Clock) -> list[str]:
    return ["SELECT num_generations, num_samples, CAST(sum(trajectories) AS BIGINT) AS trajectories "
            "FROM agg_trajectory_shapes WHERE num_generations > 0 GROUP BY num_generations, num_samples "
            "ORDER BY num_generations, num_samples",
            "SELECT value AS num_merged_calls, samples FROM agg_samples WHERE kind = 'merged_calls' ORDER BY value"]


def _merge_draw(c: Clock, r: list[QueryResult]) -> Any:
    per_traj, per_sample = r[0].rows, r[1].rows
    if not per_traj:
        return "no finished trajectory with engine calls yet"
    overall = _share(sum(row[1] * row[2] for row in per_traj), sum(row[0] * row[2] for row in per_traj))
    bins = [0] * 20  # merge ratios in (0, 1], in twentieths
    for calls, samples, n in per_traj:
        bins[min(int(samples / calls * 20), 19)] += n
    fig = _two_bars((f"samples / calls per trajectory (run: {overall:.3f})", "engine calls folded into one sample"),
                    dict(x=[(i + 0.5) / 20 for i in range(20)], y=bins, width=0.05, name="trajectories"),
                    dict(x=[str(row[0]) for row in per_sample], y=[row[1] for row in per_sample], name="samples",
                         marker_color="#2ca02c"), categories=False)
    fig.add_vline(x=overall, line_dash="dash", row=1, col=1)
    fig.update_xaxes(title_text="merge ratio", range=[0, 1], row=1, col=1)
    fig.update_yaxes(title_text="trajectories", row=1, col=1)
    fig.update_xaxes(title_text="calls", type="category", row=1, col=2)
    return _layout(fig)


def _mismatch_sql(c: Clock) -> list[str]:
    return ["SELECT num_prefix_mismatches, CAST(sum(trajectories) AS BIGINT) AS trajectories FROM agg_trajectory_shapes "
            "WHERE num_generations > 0 GROUP BY num_prefix_mismatches ORDER BY num_prefix_mismatches",
            _CALLS_PER_VERSION_SQL]


def _mismatch_draw(c: Clock, r: list[QueryResult]) -> Any:
    per_traj, per_version = r[0].rows, r[1].rows
    if not per_traj:
        return "no engine calls yet"
    fig = _two_bars(("prefix mismatches per trajectory", "calls that start a new sample by mismatch"),
                    dict(x=[str(row[0]) for row in per_traj], y=[row[1] for row in per_traj], name="trajectories",
                         marker_color="#d62728"),
                    dict(x=[str(row[0]) for row in per_version], y=[_share(row[3], row[1]) for row in per_version],
                         name="share of calls", marker_color="#d62728"))
    fig.update_xaxes(title_text="mismatches", row=1, col=1)
    _version_axis(fig, row=1, col=2)
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    return _layout(fig)
