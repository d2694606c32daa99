"""The run view's aggregates (docs/report.md, "Aggregates"): counts the page reads
with one small query each, instead of scanning the store on every refresh.

They are counted where the data is already in hand, and added in the
transaction that stores it, so a retried or duplicate append (dropped before
its transaction) and a re-run materializer batch (its commit is guarded by the
checkpoint) never count twice:

* ``event_counts(rows)``: an append's generation event rows (their index
  columns): calls per (model version, output length), the route drift of
  the calls that re-sent rows, per time bucket, and the calls' totals per
  (time bucket, model version, finish reason), and (with the trajectories'
  start and finish events) trajectories started and finished per (time bucket,
  status) (``agg_output_lengths``, ``agg_route_drift``, ``agg_calls``,
  ``agg_trajectories``);
* ``sample_counts(samples)``: a materializer commit's default samples (their
  token columns, decoded for the sample segment): decode-route expert load per
  (model version, layer, expert) and rollout-logprob histograms per model
  version (``agg_expert_load``, ``agg_logprobs``).

``Counts`` maps each table to ``{key: [values]}``; ``trajstore.log._aggregates``
adds them to the tables.

Reading: a key's count is the SUM of its rows (the MAX for ``MAX_VALUES``). The tables
the append counts (``agg_output_lengths``, ``agg_route_drift``, ``agg_calls``,
``agg_trajectories``) hold, besides one total row per key, the delta rows appends
inserted and the materializer has not folded yet (docs/log.md, "Run aggregates");
``totals_sql(table)`` is the table as one row per key, for a read or a subquery (the
run view reads every table through it: ``trajstore.inspect._agg_sql``).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = ["Counts", "LOGPROB_RANGE", "LOGPROB_BINS", "DRIFT_WIDTHS_S", "KEYS", "VALUES", "MAX_VALUES", "DELTA_ROWS",
           "event_counts",
           "sample_counts", "totals_sql", "logprob_bin_edges", "decode_routes", "count_routes"]

LOGPROB_RANGE = (-12.0, 0.0)
LOGPROB_BINS = 48
"""The stored logprob histogram: 48 equal bins over [-12, 0], values clipped into it
(a change of either needs ``trajstore report --rebuild-aggregates``)."""
DRIFT_WIDTHS_S = (1, 60, 3600)
"""Bucket widths the route drift is kept at: every width of the page's ladder is a multiple of one."""

Counts = dict[str, dict[tuple, list[float]]]
MAX_VALUES = {"agg_calls": (5,)}
"""Per table, the counted columns (indexes into ``VALUES[table]``) kept as a maximum, not a sum:
a key's value is the max over its rows (``agg_calls.max_output_len``)."""
CALL_NO_VERSION, CALL_NO_REASON = -1, ""
"""``agg_calls``' key for a call without a model version, without a finish reason."""

KEYS = {"agg_expert_load": ("model_version", "layer", "expert"), "agg_logprobs": ("model_version", "bin"),
        "agg_output_lengths": ("model_version", "output_len"), "agg_route_drift": ("width_s", "bucket_start"),
        "agg_calls": ("width_s", "bucket_start", "model_version", "finish_reason"),
        "agg_trajectories": ("width_s", "bucket_start", "status")}
"""Each aggregate table's key columns."""
VALUES = {"agg_expert_load": ("routed",), "agg_logprobs": ("tokens", "logprob_sum"),
          "agg_output_lengths": ("calls",), "agg_route_drift": ("rows_resent", "rows_compared", "rows_drifted"),
          "agg_calls": ("calls", "output_tokens", "observed_tokens", "prefix_mismatches", "calls_with_routes",
                        "max_output_len", "route_rows_resent", "route_rows_compared", "route_rows_drifted"),
          "agg_trajectories": ("started", "finished")}
"""Each aggregate table's counted columns (a key's count: their sums over its rows; the max for
those in ``MAX_VALUES``)."""
DELTA_ROWS = ("agg_output_lengths", "agg_route_drift", "agg_calls", "agg_trajectories")
"""The tables the append counts: a total row per key plus the appends' delta rows not folded
yet. The others (the materializer's) are one row per key (their key is the primary key)."""


def totals_sql(table: str, *, where: str = "", order: bool = True) -> str:
    """``SELECT`` of aggregate table ``table`` as one row per key: its key columns, then its
    counted columns summed over the key's rows (the max for ``MAX_VALUES``; named as the
    columns), in key order (``order``). ``where``: a condition on the table's rows (its key
    columns), applied before the sums. Use it as is or as a subquery, ``FROM (...) t``; a
    read that groups by the key and sums (maxes) is the same. A table of one row per key
    (not in ``DELTA_ROWS``) is selected as it is, no grouping (its primary key serves the read)."""
    keys, values = ", ".join(KEYS[table]), VALUES[table]
    cut, ordered = f" WHERE {where}" if where else "", f" ORDER BY {keys}" if order else ""
    if table not in DELTA_ROWS:
        return f"SELECT {keys}, {', '.join(values)} FROM {table}{cut}{ordered}"
    maxima = MAX_VALUES.get(table, ())
    sums = ", ".join(f"{'max' if i in maxima else 'sum'}({v}) AS {v}" for i, v in enumerate(values))
    return f"SELECT {keys}, {sums} FROM {table}{cut} GROUP BY {keys}{ordered}"


def _add(into: dict[tuple, list[float]], key: tuple, values: Sequence[float], maxima: Sequence[int] = ()) -> None:
    have = into.get(key)
    if have is None:
        into[key] = list(values)
    else:
        for i, v in enumerate(values):
            have[i] = max(have[i], v) if i in maxima else have[i] + v


def merge(a: Counts, b: Mapping[str, Mapping[tuple, Sequence[float]]]) -> Counts:
    """``a`` plus ``b`` (into ``a``)."""
    for table, part in b.items():
        into = a.setdefault(table, {})
        maxima = MAX_VALUES.get(table, ())
        for key, values in part.items():
            _add(into, key, values, maxima)
    return a


def event_counts(rows: Iterable[Mapping[str, Any]]) -> Counts:
    """The aggregates of event rows (``events`` columns): generation events, and trajectory
    start and finish events (``agg_trajectories``); other types are skipped."""
    lengths: dict[tuple, list[float]] = {}
    drift: dict[tuple, list[float]] = {}
    calls: dict[tuple, list[float]] = {}
    maxima = MAX_VALUES["agg_calls"]
    trajs: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("type") in ("trajectory_started", "trajectory_finished"):
            started = r["type"] == "trajectory_started"
            for w in DRIFT_WIDTHS_S:
                _add(trajs, (w, math.floor(float(r["created_at"]) / w) * w, "running" if started else str(r["status"])),
                     (int(started), int(not started)))
            continue
        if r.get("type") != "generation":
            continue
        version, reason, out_len = r.get("model_version"), r.get("finish_reason"), int(r.get("output_len") or 0)
        key = (CALL_NO_VERSION if version is None else int(version), CALL_NO_REASON if reason is None else str(reason))
        resent, drifted = int(r.get("route_rows_resent") or 0), r.get("route_rows_drifted")
        values = (1, out_len, int(r.get("prompt_len") or 0) - int(r.get("prefix_len") or 0),
                  int(bool(r.get("seq")) and r.get("is_merged") is not None and not r.get("is_merged")),
                  int((r.get("num_route_rows_sent") or 0) > 0), out_len,
                  resent, resent if drifted is not None else 0, int(drifted or 0))
        for w in DRIFT_WIDTHS_S:
            _add(calls, (w, math.floor(float(r["created_at"]) / w) * w, *key), values, maxima)
        if r.get("model_version") is not None and r.get("output_len") is not None:
            _add(lengths, (int(r["model_version"]), int(r["output_len"])), (1,))
        resent = r.get("route_rows_resent")
        if resent:
            drifted = r.get("route_rows_drifted")
            values = (int(resent), int(resent) if drifted is not None else 0, int(drifted or 0))
            for w in DRIFT_WIDTHS_S:
                _add(drift, (w, math.floor(float(r["created_at"]) / w) * w), values)
    out: Counts = {}
    if lengths:
        out["agg_output_lengths"] = lengths
    if drift:
        out["agg_route_drift"] = drift
    if calls:
        out["agg_calls"] = calls
    if trajs:
        out["agg_trajectories"] = trajs
    return out


def logprob_bin_edges() -> np.ndarray:
    return np.linspace(*LOGPROB_RANGE, LOGPROB_BINS + 1)


def sample_counts(samples: Iterable[Any], num_experts: Mapping[str, int | None] | None = None) -> Counts:
    """The aggregates of samples' token columns: expert load of their decode routes (every
    expert below ``num_experts[trajectory_id]`` and the highest id routed to gets a row) and
    their generated loss tokens' rollout logprobs."""
    experts: dict[tuple, list[float]] = {}
    logprobs: dict[tuple, list[float]] = {}
    per_version: dict[int, np.ndarray] = {}  # [layer, expert] counts
    lps: list[np.ndarray] = []  # generated loss tokens' logprobs and versions, per sample
    lvs: list[np.ndarray] = []
    routed: dict[tuple, tuple[list, list, list]] = {}  # layout -> decode rows, their versions, num_experts
    edges = logprob_bin_edges()
    for s in samples:
        v = np.asarray(s.token_model_versions)
        keep = (v >= 0) & np.asarray(s.logprobs_mask, bool) & np.asarray(s.loss_mask, bool)
        if keep.any():
            lps.append(np.asarray(s.rollout_logprobs, np.float64)[keep])
            lvs.append(v[keep])
        got = decode_routes(s)
        if got is None or not len(got[0]):
            continue
        declared = int((num_experts or {}).get(s.trajectory_id) or 0)
        layout = got[0].shape[1:]
        have = routed.setdefault(layout, ([], [], [0]))
        have[0].append(got[0])
        have[1].append(got[1])
        have[2][0] = max(have[2][0], declared)
    if lps:  # one histogram per call, not per sample
        lp, lv = np.concatenate(lps), np.concatenate(lvs)
        bins = np.clip(np.searchsorted(edges, np.clip(lp, *LOGPROB_RANGE), side="right") - 1, 0, LOGPROB_BINS - 1)
        versions, vi = np.unique(lv, return_inverse=True)
        key = vi * LOGPROB_BINS + bins
        n = np.bincount(key, minlength=len(versions) * LOGPROB_BINS)
        total = np.bincount(key, weights=lp, minlength=len(versions) * LOGPROB_BINS)
        for k in np.flatnonzero(n):
            _add(logprobs, (int(versions[k // LOGPROB_BINS]), int(k % LOGPROB_BINS)), (int(n[k]), float(total[k])))
    for rows_of, versions_of, (declared,) in routed.values():  # one count per layout, not per sample
        rows = np.concatenate(rows_of)
        versions, vi = np.unique(np.concatenate(versions_of), return_inverse=True)
        counts = count_routes(rows, max(declared, int(rows.max()) + 1), vi, len(versions))
        for i, version in enumerate(versions.tolist()):
            have_v = per_version.get(version)
            if have_v is not None and have_v.shape != counts[i].shape:  # another layout: the union of both
                grown = np.zeros(np.maximum(have_v.shape, counts[i].shape), np.int64)
                grown[:have_v.shape[0], :have_v.shape[1]] += have_v
                have_v = per_version[version] = grown
            if have_v is None:
                per_version[version] = counts[i].astype(np.int64)
            else:
                have_v[:counts.shape[1], :counts.shape[2]] += counts[i]
    for version, c in per_version.items():  # one row per (layer, expert): once per call, not per sample
        layers, experts_ = np.indices(c.shape)
        experts.update(((version, int(l_), int(e)), [int(n)])
                       for l_, e, n in zip(layers.ravel(), experts_.ravel(), c.ravel()))
    out: Counts = {}
    if experts:
        out["agg_expert_load"] = experts
    if logprobs:
        out["agg_logprobs"] = logprobs
    return out


def decode_routes(sample: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """``(rows [n, layers, topk], versions [n])``: the routes that generated the sample's
    tokens and those tokens' model versions; None when the sample has no routes."""
    if sample.routed_experts is None:
        return None
    versions = np.asarray(sample.token_model_versions)
    gen = np.flatnonzero(versions >= 0)
    rows = len(sample.prompt_ids) + gen - 1
    ok = (rows >= 0) & (rows < len(sample.routed_experts))
    if sample.routed_experts_mask is not None:
        ok[ok] &= ~np.asarray(sample.routed_experts_mask, bool)[rows[ok]]
    routes = sample.routed_experts
    routes = routes.array() if hasattr(routes, "place") else np.asarray(routes)  # planned routes: as written
    return routes[rows[ok]], versions[gen[ok]]


def count_routes(rows: np.ndarray, num_experts: int, group: np.ndarray | None = None,
                 num_groups: int = 1) -> np.ndarray:
    """``counts[group, layer, expert]`` of route rows ``[n, layers, topk]`` (``group[i]``:
    row i's group, all 0 by default). ``bincount`` over keys built a few hundred rows at a
    time in one reused buffer of machine ints (the conversion ``bincount`` would make of
    narrower keys costs more than the count; a chunk stays in cache)."""
    n, layers, topk = rows.shape
    per_group = layers * num_experts
    size = num_groups * per_group
    counts = np.zeros(size, np.int64)
    if not n:
        return counts.reshape(num_groups, layers, num_experts)
    chunk = max(256, -(-size // max(layers * topk, 1)))  # a chunk's keys outnumber the bins
    layer_offset = (np.arange(layers, dtype=np.intp) * num_experts)[None, :, None]
    buf = np.empty((min(chunk, n), layers, topk), np.intp)
    g = None if group is None else np.asarray(group, np.intp) * per_group
    for start in range(0, n, chunk):
        part = rows[start:start + chunk]
        key = buf[:len(part)]
        np.add(part, layer_offset, out=key, casting="unsafe")
        if g is not None:
            key += g[start:start + chunk, None, None]
        counts += np.bincount(key.ravel(), minlength=size)
    return counts.reshape(num_groups, layers, num_experts)
