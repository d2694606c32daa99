"""What every panel of ``trajstore report`` is drawn with: the run's clock (time
buckets, sizes), the ``Panel`` record, and the figure helpers the panels share
(figures are plain dicts in plotly's figure API: ``_plot``).

The panels themselves are in ``_panels_run`` (over time, per trajectory and
per version, from the inspection views), ``_panels_tokens`` (lengths, logprobs,
expert load and route drift, from the run aggregates) and ``_panels_lineage``
(training steps); ``_panels`` lists them and collects the page's data.

Over-time panels bucket unix-second columns with integer arithmetic
(``(CAST(t * 1000 AS BIGINT) - t0_ms) / width_ms``) so one SQL text gives the
same buckets on SQLite and PostgreSQL; the width is picked from a fixed ladder
so a run has at most ``MAX_BUCKETS`` of them, each wider than the usual gap
between appends (``trajstore.inspect._timeaxis``). Every width of the ladder is
a multiple of one the route drift aggregate is kept at, so that panel sums the
stored buckets into the page's.
"""

from __future__ import annotations

import datetime as _dt
from contextlib import contextmanager
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from trajstore.errors import TrajstoreError
from trajstore.inspect import _agg_sql as agg
from trajstore.inspect._timeaxis import BUCKET_WIDTHS_S, MAX_BUCKETS, bucket_width  # noqa: F401
from trajstore.inspect.sql import Query, QueryResult

__all__: list[str] = []  # the page's names are trajstore.inspect._panels'

DEFAULT_STUCK_AFTER_S = 300.0
MAX_STUCK_ROWS = 25
RECENT_VERSIONS = 6
"""Distributions show the newest this many model versions."""


def _plotly() -> Any:
    """What the panels draw with: ``trajstore.inspect._plot`` (figures as plain dicts, in plotly's
    figure API) and its ``make_subplots``."""
    from trajstore.inspect import _plot

    return _plot, _plot.make_subplots


def plotly_js() -> str:
    """The plotly.js bundle shipped inside the plotly package (no CDN: pages work offline)."""
    try:
        import plotly.graph_objects  # noqa: F401 - the package whole, as pip installs it
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise TrajstoreError("trajstore report needs plotly: pip install -e '.[report]' in the trajstore checkout") from None
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
        """SQL: the bucket index of unix-seconds ``column``: floored to the millisecond as the
        aggregates floor it (a bare CAST rounds on PostgreSQL)."""
        return f"(CAST(floor({column} * 1000) AS BIGINT) - {self.t0_ms}) / {self.width_s * 1000}"

    def time_of(self, bucket: int) -> str:
        """The bucket's start as an ISO UTC time (plotly's date axis)."""
        ms = self.t0_ms + int(bucket) * self.width_s * 1000
        return _dt.datetime.fromtimestamp(ms / 1000, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")

    def bucket_of_start(self, column: str) -> str:
        """SQL: the bucket index of an aggregate's ``bucket_start`` ``column`` (unix seconds at one of
        its kept widths, ``base_width``: the page's width is a multiple of it)."""
        return f"({column} * 1000 - {self.t0_ms}) / {self.width_s * 1000}"

    @property
    def base_width(self) -> int:
        """The widest width an aggregate is kept at that this clock's width is a multiple of."""
        return agg.base_width(self.width_s)

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


CLOCK_SQL = ("SELECT status, count(*) FROM trajectories GROUP BY status ORDER BY status",
             "SELECT CAST(sum(calls) AS BIGINT), CAST(sum(output_tokens) AS BIGINT), "
             "CAST(sum(observed_tokens) AS BIGINT), CAST(sum(prefix_mismatches) AS BIGINT), min(model_version), "
             f"max(model_version) FROM {agg.calls(agg.CALL_WIDTHS_S[-1])}",
             "SELECT (SELECT created_at FROM events ORDER BY position LIMIT 1) AS first_event_at, "
             "(SELECT created_at FROM events ORDER BY position DESC LIMIT 1) AS last_event_at, "
             f"(SELECT min(bucket_start) FROM {agg.trajectories(1)}) AS first_counted_at",
             f"SELECT max(output_len) FROM {agg.output_lengths()}")
"""The run's trajectories by status, its engine calls' totals (from ``agg_calls``), its first and
newest event (by position, through the log's key; the first second ``agg_trajectories`` counted,
if earlier: the time axis keeps the archived part the aggregates still hold) and its longest
response: each one small query, whatever the store's size (the summary shows the first three
too). Seconds are whole widths, so the first second gives the first event's bucket."""


def _clock(query: Query, stuck_after_s: float, payload: str | None) -> Clock:
    n = sum(int(row[1]) for row in query(CLOCK_SQL[0]).rows)
    calls = query(CLOCK_SQL[1]).rows[0][0]
    first, last, counted = query(CLOCK_SQL[2]).rows[0]
    if counted is not None and (first is None or float(counted) < float(first)):
        first = counted  # archived trajectories' events are gone from the log, not from the aggregates
    (max_len,) = query(CLOCK_SQL[3]).rows[0]
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


TEMPLATE = "plotly_white"
"""Every figure's template; ``figure_json`` writes it into the figure's JSON."""


def _layout(fig: Any, **kw: Any) -> Any:
    # The legend at the right, where it cannot cover subplot titles or headlines.
    fig.update_layout(**{"height": HEIGHT, "margin": dict(l=60, r=20, t=40, b=50), **kw})
    return fig


_TEMPLATE_JSON: dict[str, Any] = {}


@contextmanager
def drawing() -> Iterator[None]:
    """Where figures are drawn (``collect``): figures are plain dicts (``_plot``), built without
    plotly's template or validators; ``figure_json`` adds the page's template to the JSON."""
    yield


def _template() -> dict[str, Any]:
    """``TEMPLATE`` as plotly defines it, read once (the page's look stays plotly's)."""
    try:
        import plotly.io as pio
    except ImportError:
        raise TrajstoreError("trajstore report needs plotly: pip install -e '.[report]' in the trajstore checkout") from None
    return pio.templates[TEMPLATE].to_plotly_json()


def figure_json(fig: Any) -> dict[str, Any]:
    """The figure as JSON-ready data, with the page's template (``TEMPLATE``)."""
    if not _TEMPLATE_JSON:
        _TEMPLATE_JSON.update(_template())
    out = fig.to_plotly_json()
    for trace in out.get("data", ()):
        if trace.get("type", "scatter") in _ROUNDED_TYPES:
            for key in ("x", "y", "z", "customdata"):
                if key in trace:
                    trace[key] = rounded(trace[key])
    out.setdefault("layout", {})["template"] = _TEMPLATE_JSON
    return out


SIGNIFICANT = 3
"""Fractional numbers on the page (hovers, tables of figures) keep this many significant digits, and never
fewer than their integer digits (12.345 -> 12.3, 0.012345 -> 0.0123, 1234.5 -> 1234 or 1235)."""
_ROUNDED_TYPES = frozenset({"scatter", "scattergl", "bar", "heatmap"})
"""Traces whose values are drawn as given (a histogram's or a box's raw values are binned by plotly: kept)."""


def rounded(values: Any) -> Any:
    """``values`` (a number, a list or tuple of them, nested, or a numpy array) with every fractional
    float rounded to ``SIGNIFICANT`` significant digits (its integer digits kept); integers, strings,
    None and non-finite floats are unchanged."""
    import numpy as np

    if isinstance(values, float):
        if not math.isfinite(values) or values == int(values):
            return values
        return round(values, max(0, SIGNIFICANT - 1 - math.floor(math.log10(abs(values)))))
    if isinstance(values, np.ndarray):
        if values.dtype.kind == "O":
            return [rounded(v) for v in values.tolist()]
        if values.dtype.kind != "f":
            return values
        a = np.asarray(values, np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            mag = np.floor(np.log10(np.abs(a)))
            decimals = np.where(np.isfinite(mag), np.maximum(0, SIGNIFICANT - 1 - mag), 0)
            scale = 10.0 ** decimals
            out = np.where(np.isfinite(a) & (a != 0), np.round(a * scale) / scale, a)
        return out
    if isinstance(values, (list, tuple)):
        return [rounded(v) for v in values]
    return values


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


def _gapped(rows: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
    """Rows keyed by bucket (first column), with a row of None for every bucket between the
    first and the last that has no data: a line breaks there instead of drawing across a gap
    (a pause in the run has no mean reward, not the mean of its neighbours)."""
    by_bucket = {int(r[0]): r for r in rows if r[0] is not None}
    if not by_bucket:
        return []
    width = len(next(iter(by_bucket.values())))
    return [by_bucket.get(b, (b, *[None] * (width - 1))) for b in range(min(by_bucket), max(by_bucket) + 1)]


def _time_axis(fig: Any, clock: Clock, **kw: Any) -> None:
    # the run's buckets as the range: a run of one or two buckets is not zoomed to milliseconds
    # around a point (ticks like 04:01:59.9996), and it is drawn where the run was
    fig.update_xaxes(title_text=f"time (UTC; {clock.width_s} s buckets)", type="date",
                     range=[clock.time_of(0), clock.time_of(max(clock.num_buckets, 1))], **kw)


MANY_VERSIONS = 40
"""Past this many model versions a per-version axis is a scale (bars would be hairlines)."""


def _version_axis(fig: Any, **kw: Any) -> None:
    """An x axis of model versions: one category each (versions are labels, not a scale) while
    they are few; past ``MANY_VERSIONS`` a linear axis on which the subplot's bars become
    lines (stacked bars stacked areas, markers lines): the run-long trend stays readable at
    hundreds of versions instead of hairline bars and merged markers."""
    row, col = kw.get("row"), kw.get("col")
    if row is None:  # every x axis of the figure
        axes = sorted({t.get("xaxis") or "x" for t in fig.data})
    else:
        axes = [fig.axes_of(row, col)[0]]
    for axis in axes:
        name = "xaxis" + axis[1:]
        kind = "linear" if _as_scale(fig, axis) else "category"
        fig.layout.setdefault(name, {}).update(title={"text": "model version"}, type=kind)


def _as_scale(fig: Any, axis: str) -> bool:
    """``_version_axis``'s many versions: the bars and markers on x axis ``axis`` made lines."""
    from trajstore.inspect._plot import Scatter

    mine = [t for t in fig.data if (t.get("xaxis") or "x") == axis and t["type"] in ("bar", "scatter")]
    versions = {str(x) for t in mine for x in (t.get("x") or ())}
    if len(versions) <= MANY_VERSIONS or not all(v.lstrip("-").isdigit() for v in versions):
        return False
    stacked = fig.layout.get("barmode") in ("stack", "relative")
    lines = []
    for t in mine:
        line: dict[str, Any] = {"width": 1.5}
        color = (t.get("marker") or {}).get("color")
        if isinstance(color, str):
            line["color"] = color
        elif t["type"] == "scatter" and (t.get("line") or {}).get("color") is not None:
            line["color"] = t["line"]["color"]
        keep = {k: t[k] for k in ("name", "showlegend", "legendgroup", "customdata", "hovertemplate",
                                  "xaxis", "yaxis") if t.get(k) is not None}
        lines.append(Scatter(x=[int(x) for x in t["x"]], y=t.get("y"), mode="lines", line=line,
                             stackgroup=f"stack-{axis}" if stacked and t["type"] == "bar" else None, **keep))
    fig.data[:] = [t for t in fig.data if all(t is not m for m in mine)] + lines
    return True


def _with_right_axis(make_subplots: Any) -> Any:
    """A figure with a second y axis on the right (``secondary_y=True`` traces)."""
    return make_subplots(specs=[[{"secondary_y": True}]])


def _right_axis(fig: Any, title: str, **kw: Any) -> None:
    """The right y axis: from zero, its own ticks, and no grid of its own (the left axis's grid stays readable)."""
    fig.update_yaxes(title_text=title, secondary_y=True, rangemode="tozero", showgrid=False, tickmode="auto", **kw)


def _wide_left(make_subplots: Any, titles: Sequence[str], **kw: Any) -> Any:
    """Two panels side by side, the left one (over time or a distribution) wider than the right (per version)."""
    return make_subplots(rows=1, cols=2, column_widths=[0.62, 0.38], subplot_titles=tuple(titles), **kw)


def _two_bars(titles: Sequence[str], left: dict[str, Any], right: dict[str, Any], *,
              categories: bool = True) -> Any:
    """Two bar charts side by side (a distribution and a per-version share, say): ``left`` and
    ``right`` are the ``go.Bar`` arguments of each (no legend: the subplot titles name them);
    ``categories``: both x axes are categories. The caller names the axes."""
    go, make_subplots = _plotly()
    fig = make_subplots(rows=1, cols=2, subplot_titles=tuple(titles))
    fig.add_trace(go.Bar(showlegend=False, **left), 1, 1)
    fig.add_trace(go.Bar(showlegend=False, **right), 1, 2)
    if categories:
        fig.update_xaxes(type="category")
    return fig


def _sql_number(x: float) -> str:
    """A number written into a panel's SQL (the page shows SQL a reader can run as is):
    only a finite float's own literal, never text from a flag."""
    x = float(x)
    if not math.isfinite(x):
        raise TrajstoreError(f"{x!r} is not a finite number")
    return repr(x)


def _fmt(x: Any, spec: str = "") -> str:
    return "-" if x is None else format(x, spec)


_VERSION_STATS_SQL = ("SELECT NULLIF(model_version, -1) AS model_version, generated_tokens AS num_generated_tokens, "
                      "trajectories AS num_trajectories, multi_version AS num_multi_version, "
                      "reward_sum / NULLIF(CAST(rewarded AS DOUBLE PRECISION), 0) AS mean_reward, "
                      "rewarded AS num_rewarded, failed AS num_failed, aborted AS num_aborted "
                      "FROM agg_versions ORDER BY model_version")
