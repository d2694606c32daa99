"""The token-level panels (lengths, logprobs, expert load, route drift and coverage)."""

from __future__ import annotations

from typing import Any, Sequence

from trajstore.log._aggregate_counts import (LOGPROB_BINS, LOGPROB_RANGE, expert_arrays, expert_sample_error,
                                          expert_sample_every, expert_sample_every_sql, logprob_bin_edges)
from trajstore.inspect._figures import (_gapped, RECENT_VERSIONS, Clock, _layout, _num, _plotly, 
                                        _right_axis, _share, _time_axis, _two_bars, _version_axis, _wide_left)
from trajstore.inspect import _agg_sql as agg
from trajstore.inspect._panels_run import _CALLS_PER_VERSION_SQL
from trajstore.inspect.sql import QueryResult

__all__: list[str] = []


def _length_sql(c: Clock) -> list[str]:
    w = c.length_bin
    return [f"SELECT model_version, output_len / {w} * {w} AS length_bin, sum(calls) AS calls "
            f"FROM {agg.output_lengths()} WHERE model_version >= (SELECT max(model_version) FROM "
            f"{agg.output_lengths()}) - {RECENT_VERSIONS - 1} GROUP BY 1, 2 ORDER BY 1, 2",
            "SELECT model_version, sum(output_len * calls) * 1.0 / sum(calls) AS mean_output_len, "
            f"max(output_len) AS max_output_len FROM {agg.output_lengths()} GROUP BY model_version ORDER BY model_version"]


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
    fig.update_xaxes(title_text="output tokens", row=1, col=1, rangemode="tozero")
    _version_axis(fig, row=1, col=2)
    fig.update_yaxes(tickformat=".0%", row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=2)
    return _layout(fig, barmode="overlay")



def _drift_sql(c: Clock) -> list[str]:
    return [f"SELECT {c.bucket_of_start('bucket_start')} AS bucket, "
            "sum(rows_compared) AS rows_compared, sum(rows_drifted) AS rows_drifted, sum(rows_resent) AS rows_resent "
            f"FROM {agg.route_drift(c.base_width)} GROUP BY 1 ORDER BY 1",
            "SELECT model_version, CAST(sum(route_rows_resent) AS BIGINT) AS route_rows_resent, "
            "CAST(sum(route_rows_drifted) AS BIGINT) AS route_rows_drifted, "
            "CAST(sum(route_rows_drifted) AS DOUBLE PRECISION) / NULLIF(sum(route_rows_compared), 0) "
            f"AS route_drift_share FROM {agg.calls(agg.CALL_WIDTHS_S[-1])} GROUP BY model_version "
            "ORDER BY model_version"]


def _drift_draw(c: Clock, r: list[QueryResult]) -> Any:
    go, make_subplots = _plotly()
    per_time = [row for row in r[0].rows if row[1]]
    per_version = [row for row in r[1].rows if row[1]]  # (version, resent, drifted, share)
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
    per_time = [row for row in _gapped(per_time) if row[1] is None or row[1]]
    xs = [c.time_of(row[0]) for row in per_time]
    fig.add_trace(go.Bar(x=xs, y=[None if row[1] is None else row[2] or 0 for row in per_time], name="rows drifted",
                         opacity=0.45,
                         marker_color="#8c564b"), 1, 1, secondary_y=True)
    fig.add_trace(go.Scatter(x=xs, y=[None if row[1] is None else _share(row[2] or 0, row[1]) for row in per_time],
                             name="drift share", mode="lines+markers", line=dict(color="#d62728"),
                             customdata=[[row[2] or 0, row[1]] for row in per_time],
                             hovertemplate="%{y:.2%}: %{customdata[0]} of %{customdata[1]} rows"), 1, 1)
    fig.add_trace(go.Bar(x=[str(row[0]) for row in per_version], y=[_num(row[3]) for row in per_version],
                         name="share", showlegend=False, marker_color="#d62728",
                         customdata=[[row[2] or 0, row[1]] for row in per_version],
                         hovertemplate="%{y:.2%}: %{customdata[0]} of %{customdata[1]} re-sent rows"), 1, 2)
    _time_axis(fig, c, row=1, col=1)
    _version_axis(fig, row=1, col=2)
    fig.update_yaxes(tickformat=".1%", rangemode="tozero", row=1, col=1, secondary_y=False)
    _right_axis(fig, "rows drifted", row=1, col=1)
    fig.update_yaxes(tickformat=".1%", rangemode="tozero", row=1, col=2)
    return _layout(fig)


_MISSING_BUCKETS = ((0, 0, "0"), (1, 1, "1"), (2, 9, "2-9"), (10, 99, "10-99"), (100, None, "100+"))


def _routes_sql(c: Clock) -> list[str]:
    return ["SELECT value AS tokens_without_route, samples, tokens, route_rows FROM agg_samples "
            "WHERE kind = 'no_route' ORDER BY value",
            _CALLS_PER_VERSION_SQL]


def _routes_draw(c: Clock, r: list[QueryResult]) -> Any:
    missing, per_version = r[0].rows, r[1].rows
    if not per_version:
        return "no engine calls yet"
    tokens = sum(row[2] for row in missing)
    covered = _share(sum(row[3] for row in missing), tokens)
    counts = [sum(n for m, n, *_ in missing if lo <= m and (hi is None or m <= hi)) for lo, hi, _ in _MISSING_BUCKETS]
    fig = _two_bars(("samples by tokens without a route" + (f" ({covered:.2%} covered)" if covered is not None else ""),
                     "engine calls that returned routes"),
                    dict(x=[b[2] for b in _MISSING_BUCKETS], y=counts, name="samples", marker_color="#9467bd"),
                    dict(x=[str(row[0]) for row in per_version], y=[_share(row[4], row[1]) for row in per_version],
                         name="share of calls", marker_color="#9467bd"))
    fig.update_xaxes(title_text="tokens without a route (1 = the final token only)", row=1, col=1)
    _version_axis(fig, row=1, col=2)
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    return _layout(fig)



# -- token-level panels: the run aggregates of the default samples' token columns -----------------

PENDING_SQL = "SELECT value FROM store_settings WHERE name = 'aggregates_pending'"
PENDING_NOTE = ("this store was upgraded with samples whose token columns are not counted yet: run "
                "trajstore report --rebuild-aggregates once (docs/report.md)")


def _logprob_sql(c: Clock) -> list[str]:
    return [f"SELECT model_version, bin, tokens, logprob_sum FROM {agg.logprobs()} ORDER BY model_version, bin",
            PENDING_SQL]


def _experts_sql(c: Clock) -> list[str]:
    # the newest versions' arrays: each one's compacted total and the commits' arrays not
    # compacted yet (a few per commit since the last compaction), summed by numpy
    return [f"SELECT model_version, layers, experts, counts FROM {agg.expert_load()} "
            f"WHERE model_version >= (SELECT max(model_version) FROM {agg.expert_load()}) - {RECENT_VERSIONS - 1} "
            "ORDER BY model_version",
            PENDING_SQL, expert_sample_every_sql()]


def _pending(r: list[QueryResult]) -> str | None:
    return PENDING_NOTE if r[1].rows else None


def _logprob_draw(c: Clock, r: list[QueryResult]) -> Any:
    import numpy as np

    go, make_subplots = _plotly()
    rows = r[0].rows
    if not rows:
        return _pending(r) or "no materialized sample carries rollout logprobs yet"
    versions = sorted({int(row[0]) for row in rows})
    hist = np.zeros((len(versions), LOGPROB_BINS))
    sums = np.zeros(len(versions))
    at = {v: i for i, v in enumerate(versions)}
    for v, b, n, total in rows:
        hist[at[int(v)], int(b)] += int(n)
        sums[at[int(v)]] += float(total)
    tokens = hist.sum(axis=1)
    fig = _wide_left(make_subplots, (
        f"rollout logprob of generated loss tokens (every sample, {int(tokens.sum())} tokens)",
        "mean logprob per version"))
    edges = logprob_bin_edges()
    centers = (edges[:-1] + edges[1:]) / 2
    for i in range(max(0, len(versions) - RECENT_VERSIONS), len(versions)):
        fig.add_trace(go.Bar(x=centers.tolist(), y=(hist[i] / max(tokens[i], 1)).tolist(),
                             width=float(edges[1] - edges[0]), opacity=0.5, name=f"version {versions[i]}"), 1, 1)
    fig.add_trace(go.Bar(x=[str(v) for v in versions], y=(sums / np.maximum(tokens, 1)).tolist(), name="mean",
                         showlegend=False, customdata=[int(n) for n in tokens],
                         hovertemplate="%{y:.3f} over %{customdata} tokens"), 1, 2)
    fig.update_xaxes(title_text=f"logprob (clipped to {LOGPROB_RANGE[0]:g})", row=1, col=1)
    _version_axis(fig, row=1, col=2)
    fig.update_yaxes(tickformat=".0%", row=1, col=1)
    if _pending(r):
        _layout(fig, title=dict(text=PENDING_NOTE, font=dict(size=11)))
    return _layout(fig, barmode="overlay")


def _experts_draw(c: Clock, r: list[QueryResult]) -> Any:
    import numpy as np

    from trajstore.inspect._routes import max_violation, moe_layers

    go, make_subplots = _plotly()
    arrays = expert_arrays(r[0].rows)  # {version: counts[layer, expert]}, summed
    if not arrays:
        return _pending(r) or "no materialized sample carries routes yet"
    versions = sorted(arrays)
    shape = np.max([arrays[v].shape for v in versions], axis=0)
    counts = np.zeros((len(versions), int(shape[0]), int(shape[1])))  # [version, layer, expert]
    for i, v in enumerate(versions):
        counts[i, :arrays[v].shape[0], :arrays[v].shape[1]] = arrays[v]
    moe = moe_layers(counts)
    if not moe.any():
        return "the samples' routes name expert 0 only (dense layers): no MoE layer to show"
    layers = np.flatnonzero(moe)
    counts = counts[:, moe, :]
    num_experts = counts.shape[2]
    per_version = counts.sum(axis=1)
    share = per_version / np.maximum(per_version.mean(axis=1, keepdims=True), 1e-12)  # 1.0 = an even expert
    newest = counts[-1]
    layer_share = newest / np.maximum(newest.mean(axis=1, keepdims=True), 1e-12)
    vio = max_violation(counts) + 1.0  # [version, layer]: busiest expert over the mean
    names = [str(int(v)) for v in versions]
    every = expert_sample_every(r[2].rows[0][0] if len(r) > 2 and r[2].rows else None)
    routes = "decode routes" if every == 1 else f"1 decode route in {every}"
    fig = make_subplots(rows=2, cols=2, column_widths=[0.68, 0.32], vertical_spacing=0.14, subplot_titles=(
        f"load per expert relative to an even split, per version (every sample, {routes}, "
        f"{len(layers)} MoE layers)",
        "busiest expert / mean, per version (1 = balanced)",
        f"load per expert and layer, version {names[-1]}", f"busiest expert / mean per layer, version {names[-1]}"))
    heat = dict(colorscale="RdBu", reversescale=True, zmid=1.0)
    fig.add_trace(go.Heatmap(z=share.tolist(), x=list(range(num_experts)), y=names, **heat,
                             colorbar=dict(title="load / mean", x=1.0, len=0.45, y=0.78),
                             hovertemplate="version %{y}, expert %{x}: %{z:.2f} x even<extra></extra>"), 1, 1)
    fig.add_trace(go.Bar(x=names, y=vio.max(axis=1).tolist(), name="worst layer", marker_color="#9467bd"), 1, 2)
    fig.add_trace(go.Bar(x=names, y=vio.mean(axis=1).tolist(), name="mean over layers", marker_color="#c5b0d5"),
                  1, 2)
    fig.add_trace(go.Heatmap(z=layer_share.tolist(), x=list(range(num_experts)), y=[str(i) for i in layers],
                             **heat, showscale=False,
                             hovertemplate="layer %{y}, expert %{x}: %{z:.2f} x even<extra></extra>"), 2, 1)
    fig.add_trace(go.Bar(x=[str(i) for i in layers], y=vio[-1].tolist(), name="layer", showlegend=False,
                         marker_color="#9467bd"), 2, 2)
    fig.update_xaxes(title_text="expert id", row=1, col=1)
    fig.update_xaxes(title_text="expert id", row=2, col=1)
    fig.update_yaxes(title_text="model version", type="category", row=1, col=1)
    fig.update_yaxes(title_text="layer", type="category", row=2, col=1)
    fig.update_xaxes(title_text="layer", type="category", row=2, col=2)
    _version_axis(fig, row=1, col=2)
    notes = [PENDING_NOTE] if _pending(r) else []
    if every > 1:  # sampled counting: its error at the finest grain shown (a layer's expert, newest version)
        notes.append(f"sampled: 1 decode route in {every} counted (x{every}); a (layer, expert) load of version "
                     f"{names[-1]} within ±{100 * expert_sample_error(newest, every):.1g}% (2 σ), "
                     f"an expert's over all layers ±{100 * expert_sample_error(per_version[-1], every):.1g}%")
    if notes:
        _layout(fig, title=dict(text="<br>".join(notes), font=dict(size=11)))
    # the legend at the bottom right, below the colorbar (top right): neither covers the other
    return _layout(fig, height=620, barmode="group", legend=dict(y=0.0, yanchor="bottom", x=1.02))


# -- reading samples from the payload read-only (trajstore track reads the newest samples' routes) ---

def _read_samples(payload: str, rows: Sequence[Sequence[Any]]) -> list[Any]:
    """The samples at (segment, segment_row) of ``rows``, read without writing anything
    (the store's own PayloadStore makes its directory and reserve files on open)."""
    from urllib.parse import urlparse

    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    from trajstore.payload._errors import payload_errors
    from trajstore.payload._format import SegmentKind
    from trajstore.sample._codec import samples_from_table

    parsed = urlparse(payload)
    if parsed.scheme and len(parsed.scheme) > 1 and parsed.scheme != "file":
        with payload_errors("payload location", payload):
            fs, root = pafs.FileSystem.from_uri(payload)
    else:
        fs, root = pafs.LocalFileSystem(), (parsed.path if parsed.scheme == "file" else payload)
    by_segment: dict[str, list[int]] = {}
    for r in rows:
        by_segment.setdefault(r[2], []).append(int(r[3]))
    out = []
    for segment, wanted in by_segment.items():
        path = f"{root.rstrip('/')}/{segment}"
        with payload_errors("cannot read payload segment", path, missing="payload segment", corrupt="payload segment"):
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
