"""The panels of ``trajstore report``: SQL over the inspection views, drawn with plotly.

Every panel is a few read-only queries over the views of docs/sql.md and a
function that turns their rows into a plotly figure; the page shows each
panel's SQL exactly as it ran, so every number on it can be re-derived with
``trajstore sql``. ``collect(query)`` runs them all in the caller's read-only
snapshot and returns the page's data as one JSON-ready dict, which the live
page (``trajstore report --serve``) polls and the static page embeds.

Over-time panels bucket unix-second columns with integer arithmetic
(``(CAST(t * 1000 AS BIGINT) - t0_ms) / width_ms``) so one SQL text gives the
same buckets on SQLite and PostgreSQL; the width is picked from a fixed ladder
so a run has at most ``MAX_BUCKETS`` of them, each wider than the usual gap between
appends (``trajstore.inspect._timeaxis``).
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from trajstore.errors import TrajstoreError
from trajstore.inspect._timeaxis import BUCKET_WIDTHS_S, MAX_BUCKETS, bucket_width  # noqa: F401
from trajstore.inspect.sql import Query, QueryResult

__all__ = ["Clock", "Panel", "PANELS", "DEFAULT_STUCK_AFTER_S", "collect", "plotly_js"]

DEFAULT_STUCK_AFTER_S = 300.0
MAX_STUCK_ROWS = 25
RECENT_VERSIONS = 6
"""Distributions show the newest this many model versions."""


def _plotly() -> Any:
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        raise TrajstoreError("trajstore report needs plotly: pip install -e '.[report]' in the trajstore checkout") from None
    return go, make_subplots


def plotly_js() -> str:
    """The plotly.js bundle shipped inside the plotly package (no CDN: pages work offline)."""
    _plotly()
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


@dataclass(frozen=True)
class Clock:
    """The run's time axis and the few sizes the panels' SQL is written for."""

    num_trajectories: int
    first_s: float
    last_s: float
    width_s: int
    max_output_len: int
    stuck_after_s: float
    payload: str | None = None
    """Where the sample segments are (the token-level panels read them); None: those panels say so."""
    cache: dict = field(default_factory=dict, compare=False, repr=False)
    """What panels of one ``collect`` share (the newest samples' token columns)."""

    @property
    def t0_ms(self) -> int:
        return int(self.first_s // self.width_s) * self.width_s * 1000

    def bucket(self, column: str) -> str:
        """SQL: the bucket index of unix-seconds ``column``."""
        return f"(CAST({column} * 1000 AS BIGINT) - {self.t0_ms}) / {self.width_s * 1000}"

    def time_of(self, bucket: int) -> str:
        """The bucket's start as an ISO UTC time (plotly's date axis)."""
        ms = self.t0_ms + int(bucket) * self.width_s * 1000
        return _dt.datetime.fromtimestamp(ms / 1000, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")

    @property
    def num_buckets(self) -> int:
        return int((self.last_s * 1000 - self.t0_ms) // (self.width_s * 1000)) + 1

    @property
    def length_bin(self) -> int:
        """Width of the response-length histogram's bins, in tokens (about 40 bins)."""
        for w in (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 50, 64, 100, 128, 200, 256, 500, 512, 1000, 1024, 2048, 4096):
            if self.max_output_len / w <= 40:
                return w
        return 8192


CLOCK_SQL = ("SELECT count(*), sum(num_generations), sum(num_generated_tokens), sum(num_observed_tokens), "
             "sum(num_prefix_mismatches), min(min_model_version), max(max_model_version), min(first_event_at), "
             "max(last_event_at) FROM trajectory_summary",
             "SELECT max(output_len) FROM generation_events")
"""The run's totals and time span (also the summary's totals), and the longest response."""


def _clock(query: Query, stuck_after_s: float, payload: str | None) -> Clock:
    n, calls, *_, first, last = query(CLOCK_SQL[0]).rows[0]
    (max_len,) = query(CLOCK_SQL[1]).rows[0]
    first = float(first) if first is not None else time.time()
    last = float(last) if last is not None else first
    span = max(last - first, 0.0)
    width = bucket_width(span, int(calls or 0))
    return Clock(int(n), first, last, width, int(max_len or 0), stuck_after_s, payload)


@dataclass(frozen=True)
class Panel:
    name: str
    title: str
    caption: str
    queries: Callable[[Clock], Sequence[str]]
    """The panel's SQL for this clock (over-time panels write the bucket width into it)."""
    draw: Callable[[Clock, list[QueryResult]], Any]
    """A plotly Figure from the results, or a string saying why there is nothing to draw."""


# -- figure helpers ----------------------------------------------------------------

HEIGHT = 330


def _layout(fig: Any, **kw: Any) -> Any:
    # The legend at the right, where it cannot cover subplot titles or headlines.
    fig.update_layout(**{"template": "plotly_white", "height": HEIGHT, "margin": dict(l=60, r=20, t=40, b=50), **kw})
    return fig


def _share(part: Any, whole: Any) -> float | None:
    return float(part) / float(whole) if whole else None


def _num(x: Any) -> float | None:
    return None if x is None else float(x)


def _filled(clock: Clock, rows: Sequence[Sequence[Any]], columns: int) -> tuple[list[str], list[list[float]]]:
    """Every bucket from the first to the last, with zeros where the query returned no row."""
    by_bucket = {int(r[0]): r[1:] for r in rows if r[0] is not None}
    buckets = range(0, max([clock.num_buckets - 1, *by_bucket]) + 1) if by_bucket else range(0)
    xs = [clock.time_of(b) for b in buckets]
    cols = [[float(by_bucket[b][i] or 0) if b in by_bucket else 0.0 for b in buckets] for i in range(columns)]
    return xs, cols


def _time_axis(fig: Any, clock: Clock, **kw: Any) -> None:
    fig.update_xaxes(title_text=f"time (UTC; {clock.width_s} s buckets)", **kw)


def _version_axis(fig: Any, **kw: Any) -> None:
    """An x axis of model versions: one category each (versions are labels, not a scale)."""
    fig.update_xaxes(title_text="model version", type="category", **kw)


def _with_right_axis(make_subplots: Any) -> Any:
    """A figure with a second y axis on the right (``secondary_y=True`` traces)."""
    return make_subplots(specs=[[{"secondary_y": True}]])


def _right_axis(fig: Any, title: str, **kw: Any) -> None:
    """The right y axis: from zero, its own ticks, and no grid of its own (the left axis's grid stays readable)."""
    fig.update_yaxes(title_text=title, secondary_y=True, rangemode="tozero", showgrid=False, tickmode="auto", **kw)


def _wide_left(make_subplots: Any, titles: Sequence[str], **kw: Any) -> Any:
    """Two panels side by side, the left one (over time or a distribution) wider than the right (per version)."""
    return make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38], subplot_titles=tuple(titles), **kw)


# -- the panels ---------------------------------------------------------------------

def _ingest_sql(c: Clock) -> list[str]:
    return [f"SELECT {c.bucket('created_at')} AS bucket, count(*) AS calls, "
            "sum(output_len) AS generated_tokens, sum(num_observed_tokens) AS observed_tokens "
            "FROM generation_events GROUP BY 1 ORDER BY 1"]


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
    return [f"SELECT {c.bucket('t.last_event_at')} AS bucket, count(*) AS samples, "
            "avg(s.staleness) AS mean_staleness, max(s.staleness) AS max_staleness, "
            "max(s.latest_model_version) AS policy_version "
            "FROM sample_summary s JOIN trajectory_summary t ON t.trajectory_id = s.trajectory_id "
            "GROUP BY 1 ORDER BY 1"]


def _staleness_time_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    rows = r[0].rows
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
    return [f"SELECT {c.bucket('last_event_at')} AS bucket, count(reward) AS rewarded, avg(reward) AS mean_reward, "
            "min(reward) AS min_reward, max(reward) AS max_reward "
            "FROM trajectory_summary WHERE status <> 'running' AND reward IS NOT NULL GROUP BY 1 ORDER BY 1"]


def _reward_time_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, _ = _plotly()
    rows = r[0].rows
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
        "SELECT bucket, sum(started) AS started, sum(finished) AS finished, "
        "sum(sum(started) - sum(finished)) OVER (ORDER BY bucket) AS running FROM ("
        f"SELECT {c.bucket('first_event_at')} AS bucket, 1 AS started, 0 AS finished FROM trajectory_summary "
        f"UNION ALL SELECT {c.bucket('last_event_at')}, 0, 1 FROM trajectory_summary WHERE status <> 'running'"
        ") x GROUP BY bucket ORDER BY bucket"]


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


def _sql_number(x: float) -> str:
    """A number written into a panel's SQL (the page shows SQL a reader can run as is):
    only a finite float's own literal, never text from a flag."""
    x = float(x)
    if not math.isfinite(x):
        raise TrajstoreError(f"{x!r} is not a finite number")
    return repr(x)


def _stuck_sql(c: Clock) -> list[str]:
    newest = _sql_number(c.last_s)  # the newest event in the store (the clock's max(last_event_at))
    return [
        f"SELECT count(*) AS running, count(*) FILTER (WHERE {newest} - last_event_at > {_sql_number(c.stuck_after_s)}) AS stuck "
        "FROM trajectory_summary WHERE status = 'running'",
        f"SELECT trajectory_id, group_id, num_generations, max_model_version, {newest} - last_event_at AS idle_s "
        f"FROM trajectory_summary WHERE status = 'running' ORDER BY last_event_at, trajectory_id LIMIT {MAX_STUCK_ROWS}"]


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


_VERSION_STATS_SQL = ("SELECT model_version, num_generated_tokens, num_trajectories, num_multi_version, mean_reward, "
                      "num_rewarded, num_failed, num_aborted, route_rows_resent, route_rows_drifted, route_drift_share "
                      "FROM model_version_stats ORDER BY model_version")


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
    _version_axis(fig)
    return _layout(fig, barmode="stack")


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
    _version_axis(fig)
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    return _layout(fig, barmode="stack")


def _finish_sql(c: Clock) -> list[str]:
    return [
        f"SELECT {c.bucket('created_at')} AS bucket, COALESCE(finish_reason, '(none)') AS finish_reason, "
        "count(*) AS calls FROM generation_events GROUP BY 1, 2 ORDER BY 1, 2",
        "SELECT model_version, count(*) AS calls, count(*) FILTER (WHERE finish_reason = 'length') AS length_calls "
        "FROM generation_events GROUP BY model_version ORDER BY model_version"]


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
                                 stackgroup="reasons", mode="lines"), 1, 1)
    fig.add_trace(go.Bar(x=[str(row[0]) for row in per_version], y=[_share(row[2], row[1]) for row in per_version],
                         name="length", marker_color="#d62728", showlegend=False,
                         customdata=[[row[2], row[1]] for row in per_version],
                         hovertemplate="%{customdata[0]} of %{customdata[1]} calls"), 1, 2)
    _time_axis(fig, c, row=1, col=1)
    _version_axis(fig, row=1, col=2)
    fig.update_yaxes(tickformat=".0%", rangemode="tozero")
    return _layout(fig)


def _length_sql(c: Clock) -> list[str]:
    w = c.length_bin
    return [f"SELECT model_version, output_len / {w} * {w} AS length_bin, count(*) AS calls "
            f"FROM generation_events WHERE model_version >= (SELECT max(model_version) FROM generation_events) - "
            f"{RECENT_VERSIONS - 1} GROUP BY 1, 2 ORDER BY 1, 2",
            "SELECT model_version, avg(output_len) AS mean_output_len, max(output_len) AS max_output_len "
            "FROM generation_events GROUP BY model_version ORDER BY model_version"]


def _length_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    bins, means = r[0].rows, r[1].rows
    if not bins:
        return "no engine calls yet"
    fig = _wide_left(make_subplots, (f"tokens generated per call (bins of {c.length_bin}; newest versions)",
                                     "mean / max per version"))
    totals: dict[int, int] = {}
    for v, _, n in bins:
        totals[v] = totals.get(v, 0) + n
    for v in sorted(totals):
        pts = [(b, n) for vv, b, n in bins if vv == v]
        fig.add_trace(go.Bar(x=[b + c.length_bin / 2 for b, _ in pts], y=[n / totals[v] for _, n in pts],
                             width=c.length_bin, opacity=0.5, name=f"version {v}"), 1, 1)
    fig.add_trace(go.Bar(x=[str(row[0]) for row in means], y=[_num(row[1]) for row in means], name="mean",
                         showlegend=False), 1, 2)
    fig.add_trace(go.Scatter(x=[str(row[0]) for row in means], y=[row[2] for row in means], name="max",
                             mode="markers", showlegend=False, marker=dict(symbol="diamond", size=9,
                                                                            color="black")), 1, 2)
    fig.update_xaxes(title_text="output tokens", row=1, col=1)
    _version_axis(fig, row=1, col=2)
    fig.update_yaxes(tickformat=".0%", row=1, col=1)
    return _layout(fig, barmode="overlay")


def _groups_sql(c: Clock) -> list[str]:
    groups = ("SELECT group_id, count(reward) AS rewarded, max(reward) = min(reward) AS zero_variance, "
              "avg(reward * reward) - avg(reward) * avg(reward) AS reward_variance, max(last_event_at) AS finished_at "
              "FROM trajectory_summary GROUP BY group_id "
              "HAVING count(*) FILTER (WHERE status = 'running') = 0 AND count(reward) > 1")
    return [f"SELECT {c.bucket('finished_at')} AS bucket, count(*) AS groups, "
            "count(*) FILTER (WHERE zero_variance) AS zero_variance_groups, avg(reward_variance) AS mean_variance "
            f"FROM ({groups}) g GROUP BY 1 ORDER BY 1"]


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
    return [f"SELECT {c.bucket('last_event_at')} AS bucket, count(*) FILTER (WHERE status = 'failed') AS failed, "
            "count(*) FILTER (WHERE status = 'aborted') AS aborted, "
            "count(*) FILTER (WHERE status = 'truncated') AS truncated, count(*) AS finished "
            "FROM trajectory_summary WHERE status <> 'running' GROUP BY 1 ORDER BY 1",
            "SELECT count(*) FILTER (WHERE t.status <> 'running' AND t.num_generations > 0 AND NOT t.is_held_back "
            "AND NOT EXISTS (SELECT 1 FROM samples s WHERE s.trajectory_id = t.trajectory_id) "
            "AND NOT EXISTS (SELECT 1 FROM unfoldable_trajectories u WHERE u.trajectory_id = t.trajectory_id)) "
            "AS waiting_to_fold, count(*) FILTER (WHERE t.is_held_back) AS held_back, "
            "(SELECT count(*) FROM unfoldable_trajectories) AS unfoldable, "
            "sum(t.num_placeholder_logprobs) AS placeholder_logprobs FROM trajectory_summary t"]


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
    return ["SELECT staleness, count(*) AS samples FROM sample_summary GROUP BY staleness ORDER BY staleness",
            "SELECT model_version_span, count(*) AS samples FROM sample_summary GROUP BY model_version_span "
            "ORDER BY model_version_span"]


def _staleness_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    stale, span = r[0].rows, r[1].rows
    if not stale:
        return "no materialized samples yet (trajstore materialize folds finished trajectories)"
    fig = make_subplots(rows=1, cols=2, subplot_titles=("staleness at finish (versions behind)",
                                                        "versions mixed within one sample (max - min)"))
    fig.add_trace(go.Bar(x=[str(row[0]) for row in stale], y=[row[1] for row in stale], showlegend=False,
                         name="samples"), 1, 1)
    fig.add_trace(go.Bar(x=[str(row[0]) for row in span], y=[row[1] for row in span], showlegend=False,
                         name="samples", marker_color="#ff7f0e"), 1, 2)
    fig.update_xaxes(type="category")
    fig.update_yaxes(title_text="samples", row=1, col=1)
    return _layout(fig)


def _merge_sql(c: Clock) -> list[str]:
    return ["SELECT num_generations, num_samples, count(*) AS trajectories FROM trajectory_summary "
            "WHERE status <> 'running' AND num_generations > 0 GROUP BY num_generations, num_samples "
            "ORDER BY num_generations, num_samples",
            "SELECT num_merged_calls, count(*) AS samples FROM sample_summary GROUP BY num_merged_calls "
            "ORDER BY num_merged_calls"]


def _merge_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    per_traj, per_sample = r[0].rows, r[1].rows
    if not per_traj:
        return "no finished trajectory with engine calls yet"
    overall = _share(sum(row[1] * row[2] for row in per_traj), sum(row[0] * row[2] for row in per_traj))
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"samples / calls per trajectory (run: {overall:.3f})",
                                                        "engine calls folded into one sample"))
    bins = [0] * 20  # merge ratios in (0, 1], in twentieths
    for calls, samples, n in per_traj:
        bins[min(int(samples / calls * 20), 19)] += n
    fig.add_trace(go.Bar(x=[(i + 0.5) / 20 for i in range(20)], y=bins, width=0.05, showlegend=False,
                         name="trajectories"), 1, 1)
    fig.add_vline(x=overall, line_dash="dash", row=1, col=1)
    fig.add_trace(go.Bar(x=[str(row[0]) for row in per_sample], y=[row[1] for row in per_sample], showlegend=False,
                         name="samples", marker_color="#2ca02c"), 1, 2)
    fig.update_xaxes(title_text="merge ratio", range=[0, 1], row=1, col=1)
    fig.update_yaxes(title_text="trajectories", row=1, col=1)
    fig.update_xaxes(title_text="calls", type="category", row=1, col=2)
    return _layout(fig)


def _mismatch_sql(c: Clock) -> list[str]:
    return ["SELECT num_prefix_mismatches, count(*) AS trajectories FROM trajectory_summary WHERE num_generations > 0 "
            "GROUP BY num_prefix_mismatches ORDER BY num_prefix_mismatches",
            "SELECT model_version, count(*) AS calls, count(*) FILTER (WHERE is_prefix_mismatch) AS mismatches "
            "FROM generation_events GROUP BY model_version ORDER BY model_version"]


def _mismatch_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    per_traj, per_version = r[0].rows, r[1].rows
    if not per_traj:
        return "no engine calls yet"
    fig = make_subplots(rows=1, cols=2, subplot_titles=("prefix mismatches per trajectory",
                                                        "calls that start a new sample by mismatch"))
    fig.add_trace(go.Bar(x=[str(row[0]) for row in per_traj], y=[row[1] for row in per_traj], showlegend=False,
                         name="trajectories", marker_color="#d62728"), 1, 1)
    fig.add_trace(go.Bar(x=[str(row[0]) for row in per_version], y=[_share(row[2], row[1]) for row in per_version],
                         showlegend=False, name="share of calls", marker_color="#d62728"), 1, 2)
    fig.update_xaxes(type="category")
    fig.update_xaxes(title_text="mismatches", row=1, col=1)
    fig.update_xaxes(title_text="model version", row=1, col=2)
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    return _layout(fig)


def _drift_sql(c: Clock) -> list[str]:
    return [f"SELECT {c.bucket('created_at')} AS bucket, "
            "sum(route_rows_resent) FILTER (WHERE route_rows_drifted IS NOT NULL) AS rows_compared, "
            "sum(route_rows_drifted) AS rows_drifted, sum(route_rows_resent) AS rows_resent "
            "FROM generation_events WHERE route_rows_resent > 0 GROUP BY 1 ORDER BY 1",
            _VERSION_STATS_SQL]


def _drift_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    per_time = [row for row in r[0].rows if row[1]]
    per_version = [row for row in r[1].rows if row[8]]
    if not per_time:
        if r[0].rows:
            return ("route rows were re-sent, but none was compared with the recording (calls appended by a "
                    "trajstore before route drift was measured)")
        return ("no call re-sent route rows for recorded positions yet (drift is measured when a merged call's "
                "engine returns the whole sequence's routes)")
    compared = sum(row[1] for row in per_time)
    drifted = sum(row[2] or 0 for row in per_time)
    fig = _wide_left(make_subplots, (f"re-sent route rows that moved (run: {drifted} of {compared}, "
                                     f"{drifted / compared:.2%})", "drift share per version"),
                     specs=[[{"secondary_y": True}, {}]])
    xs = [c.time_of(row[0]) for row in per_time]
    fig.add_trace(go.Bar(x=xs, y=[row[2] or 0 for row in per_time], name="rows drifted", opacity=0.45,
                         marker_color="#8c564b"), 1, 1, secondary_y=True)
    fig.add_trace(go.Scatter(x=xs, y=[_share(row[2] or 0, row[1]) for row in per_time], name="drift share",
                             mode="lines+markers", line=dict(color="#d62728"),
                             customdata=[[row[2] or 0, row[1]] for row in per_time],
                             hovertemplate="%{y:.2%}: %{customdata[0]} of %{customdata[1]} rows"), 1, 1)
    fig.add_trace(go.Bar(x=[str(row[0]) for row in per_version], y=[_num(row[10]) for row in per_version],
                         name="share", showlegend=False, marker_color="#d62728",
                         customdata=[[row[9] or 0, row[8]] for row in per_version],
                         hovertemplate="%{y:.2%}: %{customdata[0]} of %{customdata[1]} re-sent rows"), 1, 2)
    _time_axis(fig, c, row=1, col=1)
    _version_axis(fig, row=1, col=2)
    fig.update_yaxes(tickformat=".1%", rangemode="tozero", row=1, col=1, secondary_y=False)
    _right_axis(fig, "rows drifted", row=1, col=1)
    fig.update_yaxes(tickformat=".1%", rangemode="tozero", row=1, col=2)
    return _layout(fig)


_MISSING_BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 9, "2-9"), (10, 99, "10-99"), (100, None, "100+"))


def _routes_sql(c: Clock) -> list[str]:
    return ["SELECT num_tokens - num_route_rows AS tokens_without_route, count(*) AS samples, "
            "sum(num_tokens) AS tokens, sum(num_route_rows) AS route_rows "
            "FROM sample_summary WHERE num_route_rows IS NOT NULL GROUP BY num_tokens - num_route_rows",
            "SELECT model_version, count(*) AS calls, count(*) FILTER (WHERE has_routes) AS calls_with_routes "
            "FROM generation_events GROUP BY model_version ORDER BY model_version"]


def _routes_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    missing, per_version = r[0].rows, r[1].rows
    if not per_version:
        return "no engine calls yet"
    tokens = sum(row[2] for row in missing)
    covered = _share(sum(row[3] for row in missing), tokens)
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "samples by tokens without a route" + (f" ({covered:.2%} covered)" if covered is not None else ""),
        "engine calls that returned routes"))
    counts = [sum(n for m, n, *_ in missing if lo <= m and (hi is None or m <= hi)) for lo, hi, _ in _MISSING_BUCKETS]
    fig.add_trace(go.Bar(x=[b[2] for b in _MISSING_BUCKETS], y=counts, showlegend=False, name="samples",
                         marker_color="#9467bd"), 1, 1)
    fig.add_trace(go.Bar(x=[str(row[0]) for row in per_version], y=[_share(row[2], row[1]) for row in per_version],
                         showlegend=False, name="share of calls", marker_color="#9467bd"), 1, 2)
    fig.update_xaxes(type="category")
    fig.update_xaxes(title_text="tokens without a route (1 = the final token only)", row=1, col=1)
    fig.update_xaxes(title_text="model version", row=1, col=2)
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    return _layout(fig)


# -- token-level panels: the newest samples' token columns, read from the payload -------------

TOKEN_SAMPLES = 256
"""The token-level panels read the newest this many samples (their token columns are not in SQL)."""
LOGPROB_RANGE = (-12.0, 0.0)
LOGPROB_BINS = 48


def _token_sql(c: Clock) -> list[str]:
    return ["SELECT s.trajectory_id, s.sample_index, s.segment, s.segment_row, t.num_experts "
            "FROM samples s JOIN trajectories t ON t.trajectory_id = s.trajectory_id "
            f"ORDER BY s.finished_position DESC, s.sample_index DESC LIMIT {TOKEN_SAMPLES}"]


def _read_samples(payload: str, rows: Sequence[Sequence[Any]]) -> list[Any]:
    """The samples at (segment, segment_row) of ``rows``, read without writing anything
    (the store's own PayloadStore makes its directory and reserve files on open)."""
    from urllib.parse import urlparse

    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    from trajstore._samples import samples_from_table
    from trajstore.payload._format import SegmentKind

    parsed = urlparse(payload)
    if parsed.scheme and len(parsed.scheme) > 1 and parsed.scheme != "file":
        fs, root = pafs.FileSystem.from_uri(payload)
    else:
        fs, root = pafs.LocalFileSystem(), (parsed.path if parsed.scheme == "file" else payload)
    by_segment: dict[str, list[int]] = {}
    for r in rows:
        by_segment.setdefault(r[2], []).append(int(r[3]))
    out = []
    for segment, wanted in by_segment.items():
        path = f"{root.rstrip('/')}/{segment}"
        if SegmentKind.of(segment) is SegmentKind.SAMPLES_PARQUET:
            with fs.open_input_file(path) as f:
                table = pq.read_table(f)
            out.extend(samples_from_table(table, wanted))
            continue
        with fs.open_input_file(path) as f:
            reader = ipc.open_file(f)
            per = int((reader.schema.metadata or {}).get(b"trajstore.rows_per_batch", 0)) or None
            if per is None:  # one batch layout unknown: read it whole
                table = reader.read_all()
                out.extend(samples_from_table(table, wanted))
                continue
            numbers = sorted({w // per for w in wanted})
            batches = [reader.get_batch(b) for b in numbers]
            starts, at = {}, 0
            for b, batch in zip(numbers, batches):
                starts[b], at = at, at + batch.num_rows
            table = pa.Table.from_batches(batches, schema=reader.schema)
            out.extend(samples_from_table(table, [starts[w // per] + w % per for w in wanted]))
    return out


def _token_samples(c: Clock, r: list[QueryResult]) -> tuple[list[Any], dict[Any, int]] | str:
    """The newest samples, read once per ``collect`` for both token-level panels."""
    key = (c.payload, tuple(tuple(row) for row in r[0].rows))
    if key not in c.cache:
        c.cache.clear()
        c.cache[key] = _token_samples_uncached(c, r)
    return c.cache[key]


def _token_samples_uncached(c: Clock, r: list[QueryResult]) -> tuple[list[Any], dict[Any, int]] | str:
    rows = r[0].rows
    if not rows:
        return "no materialized samples yet (trajstore materialize folds finished trajectories)"
    if c.payload is None:
        return "the payload location is unknown (--payload)"
    import os

    if "://" not in c.payload and not os.path.isdir(c.payload):
        return f"no payload at {c.payload} (pass --payload PATH_OR_URI)"
    try:
        samples = _read_samples(c.payload, rows)
    except (OSError, ValueError) as e:
        return f"cannot read the sample segments under {c.payload}: {str(e).splitlines()[0]}"
    experts = {(row[0], row[1]): row[4] for row in rows}
    return samples, experts


def _logprob_draw(c: Clock, r: list[QueryResult]) -> Any:
    import numpy as np

    go, make_subplots = _plotly()
    got = _token_samples(c, r)
    if isinstance(got, str):
        return got
    samples, _ = got
    versions, logprobs = [], []
    for s in samples:
        v = np.asarray(s.token_model_versions)
        keep = (v >= 0) & np.asarray(s.logprobs_mask, bool) & np.asarray(s.loss_mask, bool)
        versions.append(v[keep])
        logprobs.append(np.asarray(s.rollout_logprobs, np.float64)[keep])
    v = np.concatenate(versions) if versions else np.zeros(0, np.int32)
    lp = np.concatenate(logprobs) if logprobs else np.zeros(0)
    if not len(lp):
        return "the newest samples carry no rollout logprobs"
    fig = _wide_left(make_subplots, (
        f"rollout logprob of generated tokens (newest {len(samples)} samples, {len(lp)} tokens)",
        "mean logprob per version"))
    edges = np.linspace(*LOGPROB_RANGE, LOGPROB_BINS + 1)
    centers = (edges[:-1] + edges[1:]) / 2
    for version in np.unique(v)[-RECENT_VERSIONS:]:
        counts, _ = np.histogram(np.clip(lp[v == version], *LOGPROB_RANGE), bins=edges)
        fig.add_trace(go.Bar(x=centers.tolist(), y=(counts / max(counts.sum(), 1)).tolist(), width=float(edges[1] - edges[0]), opacity=0.5,
                             name=f"version {int(version)}"), 1, 1)
    per = np.unique(v)
    fig.add_trace(go.Bar(x=[str(int(x)) for x in per], y=[float(lp[v == x].mean()) for x in per], name="mean",
                         showlegend=False, customdata=[int((v == x).sum()) for x in per],
                         hovertemplate="%{y:.3f} over %{customdata} tokens"), 1, 2)
    fig.update_xaxes(title_text=f"logprob (clipped to {LOGPROB_RANGE[0]:g})", row=1, col=1)
    _version_axis(fig, row=1, col=2)
    fig.update_yaxes(tickformat=".0%", row=1, col=1)
    return _layout(fig, barmode="overlay")


def _experts_draw(c: Clock, r: list[QueryResult]) -> Any:
    import numpy as np

    from trajstore.inspect._routes import expert_load

    go, make_subplots = _plotly()
    got = _token_samples(c, r)
    if isinstance(got, str):
        return got
    samples, experts = got
    load = expert_load(samples, max([int(n) for n in experts.values() if n] + [0]) or None)
    if load is None or not load.layers:
        return "the newest samples carry no routes"
    counts = load.counts.astype(np.float64)  # [version, layer, expert], one bincount over every entry
    per_version = counts.sum(axis=1)
    share = per_version / np.maximum(per_version.mean(axis=1, keepdims=True), 1e-12)  # 1.0 = an even expert
    newest = counts[-1]
    layer_share = newest / np.maximum(newest.mean(axis=1, keepdims=True), 1e-12)
    vio = load.max_violation() + 1.0  # [version, layer]: busiest expert over the mean
    versions = [str(v) for v in load.versions]
    fig = make_subplots(rows=2, cols=2, column_widths=[0.68, 0.32], vertical_spacing=0.14, subplot_titles=(
        f"load per expert relative to an even split, per version (newest {len(samples)} samples, decode routes, "
        f"{len(load.layers)} MoE layers)",
        "busiest expert / mean, per version (1 = balanced)",
        f"load per expert and layer, version {versions[-1]}", f"busiest expert / mean per layer, version {versions[-1]}"))
    heat = dict(colorscale="RdBu", reversescale=True, zmid=1.0)
    fig.add_trace(go.Heatmap(z=share.tolist(), x=list(range(load.num_experts)), y=versions, **heat,
                             colorbar=dict(title="load / mean", x=1.0, len=0.45, y=0.78),
                             hovertemplate="version %{y}, expert %{x}: %{z:.2f} x even<extra></extra>"), 1, 1)
    fig.add_trace(go.Bar(x=versions, y=vio.max(axis=1).tolist(), name="worst layer", marker_color="#9467bd"), 1, 2)
    fig.add_trace(go.Bar(x=versions, y=vio.mean(axis=1).tolist(), name="mean over layers", marker_color="#c5b0d5"),
                  1, 2)
    fig.add_trace(go.Heatmap(z=layer_share.tolist(), x=list(range(load.num_experts)), y=[str(i) for i in load.layers],
                             **heat, showscale=False,
                             hovertemplate="layer %{y}, expert %{x}: %{z:.2f} x even<extra></extra>"), 2, 1)
    fig.add_trace(go.Bar(x=[str(i) for i in load.layers], y=vio[-1].tolist(), name="layer", showlegend=False,
                         marker_color="#9467bd"), 2, 2)
    fig.update_xaxes(title_text="expert id", row=1, col=1)
    fig.update_xaxes(title_text="expert id", row=2, col=1)
    fig.update_yaxes(title_text="model version", type="category", row=1, col=1)
    fig.update_yaxes(title_text="layer", type="category", row=2, col=1)
    fig.update_xaxes(title_text="layer", type="category", row=2, col=2)
    _version_axis(fig, row=1, col=2)
    return _layout(fig, height=620, barmode="group")


# -- training lineage: what the trainer did with the samples, per step ------------------------

MAX_STEPS = 2000
"""The step panels show the newest this many training steps."""
NO_STEPS = ("no training step recorded yet: a trainer records each step with SampleReader.record_step "
            "(docs/reader.md)")
TRAINER_METRICS = 6
"""The step panel draws at most this many of the trainer's metrics (the ones most steps carry)."""


def _steps_sql(c: Clock) -> list[str]:
    return [f"SELECT run, step, count(*) AS samples, avg(staleness) AS staleness, max(staleness) AS max_staleness, "
            f"max(policy_version) AS policy_version FROM sample_consumption GROUP BY run, step "
            f"ORDER BY step DESC, run LIMIT {MAX_STEPS}",
            f"SELECT run, step, rank, metrics FROM train_steps ORDER BY step DESC, run, rank LIMIT {MAX_STEPS * 8}",
            "SELECT count(*) AS samples, count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM sample_consumption c "
            "WHERE c.trajectory_id = s.trajectory_id AND c.sample_index = s.sample_index)) AS never_trained "
            "FROM sample_summary s"]


def _steps_draw(c: Clock, r: list[QueryResult]) -> Any:
    import json

    go, make_subplots = _plotly()
    rows = sorted(r[0].rows, key=lambda row: (row[1], row[0]))
    if not rows:
        return NO_STEPS
    total, never = r[2].rows[0]
    per_step: dict[int, dict[str, list[float]]] = {}
    for _, step, _, metrics in r[1].rows:
        values = json.loads(metrics) if isinstance(metrics, str) else (metrics or {})
        for name, v in values.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                per_step.setdefault(int(step), {}).setdefault(name, []).append(float(v))
    counts: dict[str, int] = {}
    for values in per_step.values():
        for name in values:
            counts[name] = counts.get(name, 0) + 1
    names = sorted(counts, key=lambda n: (-counts[n], n))[:TRAINER_METRICS]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.5, 0.5], specs=[[{"secondary_y": True}, {}]],
                        subplot_titles=(f"samples consumed and their staleness per step (never trained on: "
                                        f"{_fmt(_share(never, total), '.1%')} of {total} samples)",
                                        "the trainer's metrics per step (mean over ranks)"))
    steps = [int(row[1]) for row in rows]
    fig.add_trace(go.Bar(x=steps, y=[int(row[2]) for row in rows], name="samples consumed", opacity=0.6,
                         customdata=[row[0] for row in rows], hovertemplate="run %{customdata}, step %{x}: "
                         "%{y} samples<extra></extra>"), 1, 1, secondary_y=False)
    fig.add_trace(go.Scatter(x=steps, y=[_num(row[3]) for row in rows], mode="lines+markers",
                             name="staleness (policy - oldest token)"), 1, 1, secondary_y=True)
    fig.add_trace(go.Scatter(x=steps, y=[_num(row[4]) for row in rows], mode="lines", line=dict(dash="dot"),
                             name="max staleness"), 1, 1, secondary_y=True)
    for name in names:
        xs = sorted(s for s in per_step if name in per_step[s])
        fig.add_trace(go.Scatter(x=xs, y=[sum(per_step[s][name]) / len(per_step[s][name]) for s in xs],
                                 mode="lines+markers", name=name), 1, 2)
    fig.update_xaxes(title_text="training step")
    fig.update_yaxes(title_text="samples", row=1, col=1, secondary_y=False)
    fig.update_yaxes(title_text="versions", row=1, col=1, secondary_y=True, rangemode="tozero", showgrid=False)
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
    fig.add_trace(go.Scatter(x=[int(row[1]) for row in by_step], y=[_num(row[2]) for row in by_step],
                             mode="lines+markers", name="k3 mean", customdata=[int(row[3]) for row in by_step],
                             hovertemplate="step %{x}: %{y:.4g} over %{customdata} tokens<extra></extra>"), 1, 1)
    fig.add_trace(go.Bar(x=[str(row[1]) for row in by_version], y=[_num(row[3]) for row in by_version],
                         name="k3 mean per version", customdata=[int(row[2]) for row in by_version],
                         hovertemplate="version %{x}: %{y:.4g} over %{customdata} tokens<extra></extra>"), 1, 2)
    fig.update_xaxes(title_text="training step", row=1, col=1)
    fig.update_yaxes(title_text="k3 = exp(r) - 1 - r", row=1, col=1)
    _version_axis(fig, row=1, col=2)
    return _layout(fig)


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
          "max per version.",
          _length_sql, _length_draw),
    Panel("logprobs", "Rollout logprobs",
          "Distribution of the engine's logprob of each generated loss token, per model version, over the newest "
          "samples; and its mean per version. Token columns are not in SQL: the query picks the samples, their "
          "sample segments in the payload give the tokens.",
          _token_sql, _logprob_draw),
    Panel("expert_load", "Expert load balance (MoE routes)",
          "How often each expert was routed to when generating, relative to an even split, per model version (the "
          "MoE layers and top-k slots of the newest samples' recorded routes) and per layer for the newest version, "
          "and the busiest expert's load over the mean (verl's max_vio + 1): the router's balance as the policy "
          "moves. Layers whose every entry is 0 (vLLM's dense layers) are left out.",
          _token_sql, _experts_draw),
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

import sys as _sys  # noqa: E402

from trajstore.inspect import _step_panels  # noqa: E402

# per step, per task, length over time, links to the trace view (drawn with this module's helpers)
PANELS = _step_panels.extend(PANELS, _sys.modules[__name__])


# -- the summary ---------------------------------------------------------------------

SUMMARY_SQL = (
    "SELECT status, count(*) FROM trajectory_summary GROUP BY status ORDER BY status",
    CLOCK_SQL[0],
    "SELECT count(*), sum(num_merged_calls), avg(staleness), max(staleness), "
    "sum(num_route_rows), sum(CASE WHEN num_route_rows IS NULL THEN 0 ELSE num_tokens END) FROM sample_summary",
)


def _fmt(x: Any, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


def _summary(query: Query) -> list[list[str]]:
    by_status = query(SUMMARY_SQL[0]).rows
    n, calls, generated, observed, mismatches, vmin, vmax, _, last = query(SUMMARY_SQL[1]).rows[0]
    samples, folded, mean_stale, max_stale, routed, routable = query(SUMMARY_SQL[2]).rows[0]
    last_at = "-" if last is None else _dt.datetime.fromtimestamp(float(last), _dt.timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")
    return [
        ["trajectories", f"{n} ({', '.join(f'{s} {c}' for s, c in by_status) or 'none'})"],
        ["engine calls (generation events)", _fmt(calls)],
        ["tokens generated / observed", f"{_fmt(generated)} / {_fmt(observed)}"],
        ["model versions (newest = the policy now)", "-" if vmin is None else f"{vmin} .. {vmax}"],
        ["newest event", last_at],
        ["samples", _fmt(samples)],
        ["merge ratio (samples / folded calls)", _fmt(_share(samples, folded), ".3f")],
        ["prefix mismatches", _fmt(mismatches)],
        ["staleness of samples: mean / max", f"{_fmt(mean_stale, '.2f')} / {_fmt(max_stale)}"],
        ["tokens with captured routes", _fmt(_share(routed, routable), ".2%")],
    ]


# -- the page's data -------------------------------------------------------------------

def collect(query: Query, *, stuck_after_s: float = DEFAULT_STUCK_AFTER_S, payload: str | None = None,
            panels: Sequence[Panel] = PANELS, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run every panel's SQL through ``query`` (one read-only snapshot) and draw it.

    Returns ``{"empty", "summary", "summary_sql", "panels": [{"name", "title",
    "caption", "sql", "figure", "note"}], "generated_at"}``: ``figure`` is the
    plotly figure as JSON-ready data, or None with ``note`` saying why (the
    panel has nothing to draw yet). ``payload``: where the store's payload is
    (the token-level panels read the newest samples' segments there).
    ``progress(1)`` is called after each panel. An empty store (no trajectory) has no
    panels at all: the page shows one "no data yet" state instead."""
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
    for panel in panels:
        sql = list(panel.queries(clock))
        drawn = panel.draw(clock, [query(q) for q in sql])
        figure, note = (None, drawn) if isinstance(drawn, str) else (drawn.to_plotly_json(), None)
        data["panels"].append({"name": panel.name, "title": panel.title, "caption": panel.caption,
                               "sql": sql, "figure": figure, "note": note})
        if progress:
            progress(1)  # one panel drawn
    return data
