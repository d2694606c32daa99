"""The run-long trends: the per-version panels show the newest few versions, these the whole run
in at most ``TREND_BUCKETS`` buckets of model versions (response length quantiles, reward) and of
training steps (staleness of what each step consumed).

Every statement reads what is already bounded: the output-length aggregate grouped by version
bucket and length, ``agg_versions`` (one row per version, the query the per-version panels run,
so it runs once a refresh), and the consumption per step.
"""

from __future__ import annotations

from typing import Any

from trajstore.inspect import _agg_sql as agg
from trajstore.inspect._figures import _VERSION_STATS_SQL, Clock, Panel, _layout, _num, _plotly
from trajstore.inspect.sql import QueryResult

__all__: list[str] = []

TREND_BUCKETS = 40
"""The run is cut into at most this many buckets of model versions, and of training steps."""
QUANTILES = (0.1, 0.5, 0.9)


def _bucket(column: str, low: str, high: str) -> str:
    """SQL: ``column``'s bucket of ``TREND_BUCKETS`` equal ranges from ``low`` to ``high`` (integers)."""
    return f"(({column} - {low}) * {TREND_BUCKETS}) / ({high} - {low} + 1)"


def _trends_sql(c: Clock) -> list[str]:
    lengths = agg.output_lengths()
    # the run's versions: the table's rows as written (totals and deltas alike: the same versions), one pass
    versions = ("(SELECT min(model_version) AS lo, max(model_version) AS hi FROM agg_output_lengths "
                "WHERE model_version >= 0) r")
    return [
        # calls by (version bucket, output length): TREND_BUCKETS x the longest output at most
        f"SELECT {_bucket('model_version', 'r.lo', 'r.hi')} AS bucket, min(model_version) AS first_version, "
        f"max(model_version) AS last_version, output_len, CAST(sum(calls) AS BIGINT) AS calls FROM {lengths} "
        f"CROSS JOIN {versions} WHERE model_version >= 0 GROUP BY 1, output_len ORDER BY 1, output_len",
        _VERSION_STATS_SQL,
        # what each step consumed, by bucket of steps over the whole run
        f"SELECT {_bucket('step', 'r.lo', 'r.hi')} AS bucket, min(step) AS first_step, max(step) AS last_step, "
        "count(*) AS samples, avg(staleness) AS staleness, max(staleness) AS max_staleness FROM sample_consumption "
        "CROSS JOIN (SELECT min(step) AS lo, max(step) AS hi FROM lineage_steps) r GROUP BY 1 ORDER BY 1",
    ]


def _quantiles(lengths: list[int], calls: list[int]) -> list[float]:
    import numpy as np

    cum = np.cumsum(calls)
    return [float(lengths[int(np.searchsorted(cum, q * cum[-1], side="left"))]) for q in QUANTILES]


def _span(first: Any, last: Any, what: str) -> str:
    return f"{what} {first}" if first == last else f"{what}s {first}-{last}"


def _trends_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    length_rows, version_rows, step_rows = r[0].rows, r[1].rows, r[2].rows
    if not length_rows and not step_rows:
        return "no engine calls and no training steps yet"
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.09, subplot_titles=(
        "tokens generated per call: p10 / p50 / p90", "mean reward and failed share",
        "staleness of what the steps consumed"))
    # response length quantiles per version bucket
    by_bucket: dict[int, list[Any]] = {}
    for bucket, first, last, length, calls in length_rows:
        if bucket is None or not calls:
            continue
        got = by_bucket.setdefault(int(bucket), [int(first), int(last), [], []])
        got[0], got[1] = min(got[0], int(first)), max(got[1], int(last))
        got[2].append(int(length))
        got[3].append(int(calls))
    buckets = sorted(by_bucket)
    xs = [(by_bucket[b][0] + by_bucket[b][1]) / 2 for b in buckets]
    spans = [_span(by_bucket[b][0], by_bucket[b][1], "version") for b in buckets]
    quantiles = [_quantiles(by_bucket[b][2], by_bucket[b][3]) for b in buckets]
    for i, (q, dash) in enumerate(zip(QUANTILES, ("dot", "solid", "dot"))):
        fig.add_trace(go.Scatter(x=xs, y=[row[i] for row in quantiles], mode="lines+markers", name=f"p{int(q * 100)}",
                                 line=dict(dash=dash, color="#1f77b4"), marker=dict(size=4), customdata=spans,
                                 hovertemplate=f"%{{customdata}}: p{int(q * 100)} %{{y}} tokens<extra></extra>",
                                 legendgroup="length"), 1, 1)
    # reward and failures per version bucket (agg_versions, one row per version, bucketed here)
    versions = [row for row in version_rows if row[0] is not None]
    if versions:
        lo, hi = min(int(row[0]) for row in versions), max(int(row[0]) for row in versions)
        acc: dict[int, list[Any]] = {}
        for v, _, n, _, mean, rewarded, failed, aborted in versions:
            b = (int(v) - lo) * TREND_BUCKETS // (hi - lo + 1)
            a = acc.setdefault(b, [int(v), int(v), 0.0, 0, 0, 0])
            a[0], a[1] = min(a[0], int(v)), max(a[1], int(v))
            a[2] += (_num(mean) or 0.0) * int(rewarded or 0)
            a[3] += int(rewarded or 0)
            a[4] += int(failed or 0) + int(aborted or 0)
            a[5] += int(n or 0)
        rows = [acc[b] for b in sorted(acc)]
        vx = [(a[0] + a[1]) / 2 for a in rows]
        vspans = [_span(a[0], a[1], "version") for a in rows]
        fig.add_trace(go.Scatter(x=vx, y=[a[2] / a[3] if a[3] else None for a in rows], mode="lines+markers",
                                 name="mean reward", marker=dict(size=4), line=dict(color="#2ca02c"),
                                 customdata=[[s, a[3]] for s, a in zip(vspans, rows)],
                                 hovertemplate="%{customdata[0]}: %{y} (%{customdata[1]} rewarded)<extra></extra>"),
                      1, 2)
        fig.add_trace(go.Scatter(x=vx, y=[a[4] / a[5] if a[5] else None for a in rows], mode="lines",
                                 name="failed or aborted", line=dict(color="#d62728", dash="dash"),
                                 customdata=vspans, hovertemplate="%{customdata}: %{y:.1%} failed or aborted"
                                                                  "<extra></extra>"), 1, 2)
    # staleness per bucket of training steps
    sx = [(int(row[1]) + int(row[2])) / 2 for row in step_rows]
    sspans = [[_span(row[1], row[2], "step"), int(row[3])] for row in step_rows]
    fig.add_trace(go.Scatter(x=sx, y=[_num(row[4]) for row in step_rows], mode="lines+markers", name="mean staleness",
                             marker=dict(size=4), line=dict(color="#9467bd"), customdata=sspans,
                             hovertemplate="%{customdata[0]}: %{y} versions behind (%{customdata[1]} samples)"
                                           "<extra></extra>"), 1, 3)
    fig.add_trace(go.Scatter(x=sx, y=[_num(row[5]) for row in step_rows], mode="lines", name="max staleness",
                             line=dict(color="#9467bd", dash="dot"), customdata=sspans,
                             hovertemplate="%{customdata[0]}: max %{y}<extra></extra>"), 1, 3)
    fig.update_xaxes(title_text="model version", row=1, col=1)
    fig.update_xaxes(title_text="model version", row=1, col=2)
    fig.update_xaxes(title_text="training step", row=1, col=3)
    fig.update_yaxes(rangemode="tozero", row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=3)
    return _layout(fig)


TRENDS = Panel(
    "run_trends", "The whole run, by bucket",
    f"The per-version panels show the newest versions; these the whole run in at most {TREND_BUCKETS} buckets of "
    "model versions (tokens generated per engine call: 10th, 50th and 90th percentile; mean reward and the share "
    "failed or aborted) and of training steps (how many versions the consumed samples' oldest token lagged the "
    "step's policy: mean and max).", _trends_sql, _trends_draw)
