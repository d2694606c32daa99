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
  model version (one [layer, expert] counts array each) and rollout-logprob
  histograms per model version (``agg_expert_load``, ``agg_logprobs``).

``Counts`` maps each table to ``{key: [values]}`` (``agg_expert_load``: ``{(version,):
counts array}``); ``trajstore.log._aggregates`` adds them to the tables.

Reading: a key's count is the SUM of its rows (the MAX for ``MAX_VALUES``). The tables
the append counts (``agg_output_lengths``, ``agg_route_drift``, ``agg_calls``,
``agg_trajectories``) hold, besides one total row per key, the delta rows appends
inserted and the materializer has not folded yet (docs/log.md, "Run aggregates");
``totals_sql(table)`` is the table as one row per key, for a read or a subquery (the
run view reads every table through it: ``trajstore.inspect._agg_sql``).
"""

from __future__ import annotations

import json
import math
import zlib
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from trajstore.errors import ValidationError

__all__ = ["Counts", "LOGPROB_RANGE", "LOGPROB_BINS", "DRIFT_WIDTHS_S", "KEYS", "VALUES", "MAX_VALUES", "MIN_VALUES",
           "DELTA_ROWS", "FOLD_DELTAS", "NONE", "TRAJECTORY_TABLES", "SUMMED_REWARD_BOUND", "TASK_KEYS", "task_sql", "trajectory_record", "event_counts", "trajectory_counts", "sample_summary_counts",
           "group_contribution",
           "sample_counts", "summed_values_sql", "totals_sql", "expert_load_sql", "expert_arrays", "expert_array_rows", "logprob_bin_edges", "decode_routes", "count_routes",
           "EXPERT_SAMPLE_EVERY", "EXPERT_SAMPLE_SETTING", "expert_sample_every_sql", "expert_sample_error"]

LOGPROB_RANGE = (-12.0, 0.0)
LOGPROB_BINS = 48
"""The stored logprob histogram: 48 equal bins over [-12, 0], values clipped into it
(a change of either needs ``trajstore report --rebuild-aggregates``)."""
DRIFT_WIDTHS_S = (1, 60, 3600)
"""Bucket widths the route drift is kept at: every width of the page's ladder is a multiple of one."""

EXPERT_SAMPLE_EVERY = 32
"""The expert load counts one decode route in this many (every 32nd generated token of a
sample, from a phase of its own), each counted this many times: an estimate of the exact
count with no bias. Counting every route costs about as much CPU as the fold itself
(numpy's ``bincount`` over [tokens, layers, top-k] keys, ~0.8 us a token at 48x8); one in
8 cost a quarter of the fold's step, one in 32 costs a sixteenth (docs/benchmarks.md, the
fold's section). The error is stated on the page (``expert_sample_error``: ±2.9 % for a
(layer, expert) load of a version of 2.4 M generated tokens at 48x8 over 128 experts, ±0.4 %
for an expert over all layers). A store's ``store_settings`` row ``EXPERT_SAMPLE_SETTING``
overrides it (``1``: every route, exact); a change applies to what is counted after it
(``trajstore report --rebuild-aggregates`` recounts all)."""
EXPERT_SAMPLE_SETTING = "expert_load_sample_every"


def expert_sample_every_sql() -> str:
    """The store's ``EXPERT_SAMPLE_SETTING`` row (none: ``EXPERT_SAMPLE_EVERY``)."""
    return f"SELECT value FROM store_settings WHERE name = '{EXPERT_SAMPLE_SETTING}'"


def expert_sample_every(value: Any) -> int:
    """The sampling stride of a ``store_settings`` value (None: the default)."""
    if value is None:
        return EXPERT_SAMPLE_EVERY
    try:
        every = int(str(value).strip())
    except ValueError:
        every = 0
    if every < 1:
        raise ValidationError(f"store_settings {EXPERT_SAMPLE_SETTING} = {value!r}: expected a whole number >= 1",
                              rule="store_settings")
    return every


def expert_sample_error(counts: np.ndarray, every: int) -> float:
    """The relative error (two standard errors) of a per-expert load estimated from one decode
    route in ``every``, at the mean per-expert count of ``counts[..., expert]`` (estimates,
    each sampled route counted ``every`` times): ``2 sqrt((every - 1) / mean)``, the
    binomial error of a count of ``mean / every`` sampled routes scaled by ``every``. 0
    when every route is counted."""
    if every <= 1:
        return 0.0
    mean = float(np.asarray(counts, np.float64).mean()) if np.size(counts) else 0.0
    return math.inf if mean <= 0 else 2.0 * math.sqrt((every - 1) / mean)


Counts = dict[str, dict[tuple, list[float]]]
MAX_VALUES = {"agg_calls": (5,), "agg_rewards": (3,), "agg_groups": (5, 6), "agg_staleness": (3, 4)}
"""Per table, the counted columns (indexes into ``VALUES[table]``) kept as a maximum, not a sum:
a key's value is the max over its rows (``agg_calls.max_output_len``)."""
MIN_VALUES = {"agg_rewards": (2,), "agg_groups": (4,), "agg_policy_versions": (0,)}
"""Per table, the counted columns kept as a minimum."""
NONE = -1
"""The key (or kept maximum) standing for SQL NULL where a key column cannot be NULL: a call or
sample without a model version, a sample without a staleness (read back with ``NULLIF(x, -1)``)."""
CALL_NO_VERSION, CALL_NO_REASON = -1, ""
"""``agg_calls``' key for a call without a model version, without a finish reason."""

KEYS = {"agg_logprobs": ("model_version", "bin"),
        "agg_output_lengths": ("model_version", "output_len"), "agg_route_drift": ("width_s", "bucket_start"),
        "agg_calls": ("width_s", "bucket_start", "model_version", "finish_reason"),
        "agg_trajectories": ("width_s", "bucket_start", "status"),
        "agg_rewards": ("width_s", "bucket_start"),
        "agg_trajectory_shapes": ("num_generations", "num_samples", "num_prefix_mismatches"),
        "agg_tasks": ("task",), "agg_versions": ("model_version",), "agg_groups": ("group_id",),
        "agg_group_variance": ("width_s", "bucket_start"), "agg_samples": ("kind", "value"),
        "agg_staleness": ("width_s", "bucket_start"), "agg_policy_versions": ("model_version",)}
"""Each aggregate table's key columns (``agg_expert_load``, one counts array per model
version, is not keyed by columns: ``expert_load_sql``)."""
VALUES = {"agg_logprobs": ("tokens", "logprob_sum"),
          "agg_output_lengths": ("calls",), "agg_route_drift": ("rows_resent", "rows_compared", "rows_drifted"),
          "agg_calls": ("calls", "output_tokens", "observed_tokens", "prefix_mismatches", "calls_with_routes",
                        "max_output_len", "route_rows_resent", "route_rows_compared", "route_rows_drifted"),
          "agg_trajectories": ("started", "finished"),
          "agg_rewards": ("rewarded", "reward_sum", "reward_min", "reward_max"),
          "agg_trajectory_shapes": ("trajectories", "placeholder_logprobs"),
          "agg_tasks": ("trajectories", "rewarded", "reward_sum", "generated_tokens", "calls", "failed"),
          "agg_versions": ("trajectories", "generated_tokens", "rewarded", "reward_sum", "failed", "aborted",
                           "multi_version"),
          "agg_groups": ("trajectories", "rewarded", "reward_sum", "reward_sumsq", "reward_min", "reward_max",
                         "finished_at"),
          "agg_group_variance": ("groups", "zero_variance_groups", "variance_sum"),
          "agg_samples": ("samples", "tokens", "route_rows"),
          "agg_staleness": ("samples", "staled", "staleness_sum", "staleness_max", "policy_version_max"),
          "agg_policy_versions": ("first_position",)}
"""Each aggregate table's counted columns (a key's count: their sums over its rows; the max for
those in ``MAX_VALUES``)."""
DELTA_ROWS = ("agg_output_lengths", "agg_route_drift", "agg_calls", "agg_trajectories")
FOLD_DELTAS = ("agg_logprobs", "agg_rewards", "agg_trajectory_shapes", "agg_tasks", "agg_versions", "agg_groups",
               "agg_samples", "agg_staleness", "agg_policy_versions")
"""The tables the materializer's commit counts into: it inserts rows of its own into
``<table>_delta`` beside each (no row another shard may hold is updated); the compaction
moves them into the totals (schema.py, migration 0022)."""
"""The tables the append counts: a total row per key plus the appends' delta rows not folded
yet. The others (the materializer's) are one row per key (their key is the primary key)."""


def summed_values_sql(table: str) -> str:
    """Aggregate table ``table``'s counted columns summed over the rows of a key, as a
    ``SELECT`` list: ``sum`` of each, ``max`` of ``MAX_VALUES``, ``min`` of ``MIN_VALUES``
    (named as the columns). What a read sums (``totals_sql``) and what the compaction adds
    to a key's total row on PostgreSQL (``trajstore.log._aggregates._fold_on_server``)."""
    maxima, minima = MAX_VALUES.get(table, ()), MIN_VALUES.get(table, ())
    return ", ".join(f"{'max' if i in maxima else 'min' if i in minima else 'sum'}({v}) AS {v}"
                     for i, v in enumerate(VALUES[table]))


def totals_sql(table: str, *, where: str = "", order: bool = True) -> str:
    """``SELECT`` of aggregate table ``table`` as one row per key: its key columns, then its
    counted columns summed over the key's rows (the max for ``MAX_VALUES``, the min for
    ``MIN_VALUES``; named as the columns), in key order (``order``). ``where``: a condition
    on the table's rows (its key columns), applied before the sums. Use it as is or as a
    subquery, ``FROM (...) t``; a read that groups by the key and sums (maxes) is the same.
    The rows summed: the append's tables' (``DELTA_ROWS``) total and delta rows; the
    materializer's (``FOLD_DELTAS``) total rows and those of its ``<table>_delta`` beside it;
    a table of one row per key (``agg_group_variance``, written by the compaction only) is
    selected as it is, no grouping (its primary key serves the read). ``agg_expert_load``
    holds arrays, not keyed counts: ``expert_load_sql`` reads it."""
    keys, values = ", ".join(KEYS[table]), VALUES[table]
    cut, ordered = f" WHERE {where}" if where else "", f" ORDER BY {keys}" if order else ""
    if table not in DELTA_ROWS and table not in FOLD_DELTAS:
        return f"SELECT {keys}, {', '.join(values)} FROM {table}{cut}{ordered}"
    source = table
    if table in FOLD_DELTAS:
        cols = f"{keys}, {', '.join(values)}"
        source = f"(SELECT {cols} FROM {table}{cut} UNION ALL SELECT {cols} FROM {table}_delta{cut}) {table}"
        cut = ""
    return f"SELECT {keys}, {summed_values_sql(table)} FROM {source}{cut} GROUP BY {keys}{ordered}"


def expert_load_sql(where: str = "") -> str:
    """The expert-load arrays: each model version's compacted total (``agg_expert_load``, one
    row per version) and the commits' arrays not compacted yet (``agg_expert_load_delta``),
    as ``model_version, layers, experts, counts`` rows (int64 bytes of [layers, experts]);
    a version's load is the sum of its rows (``expert_arrays``). ``where``: a condition on
    ``model_version``, applied to both tables."""
    cut = f" WHERE {where}" if where else ""
    return (f"SELECT model_version, layers, experts, counts FROM agg_expert_load{cut} UNION ALL "
            f"SELECT model_version, layers, experts, counts FROM agg_expert_load_delta{cut}")


def expert_arrays(rows: Iterable[Sequence[Any]]) -> dict[int, np.ndarray]:
    """``{model_version: counts[layer, expert]}``, summed, of ``agg_expert_load`` or
    ``agg_expert_load_delta`` rows (``model_version, layers, experts, counts``); layouts of
    one version are summed into the union of their shapes."""
    out: dict[int, np.ndarray] = {}
    for version, layers, experts, counts in rows:
        _add_array(out, int(version), np.frombuffer(bytes(counts), "<i8").reshape(int(layers), int(experts)))
    return out


def _add_array(into: dict[int, np.ndarray], version: int, c: np.ndarray) -> None:
    have = into.get(version)
    if have is None:
        into[version] = c.astype(np.int64, copy=True)
        return
    if have.shape != c.shape and not (have.shape[0] >= c.shape[0] and have.shape[1] >= c.shape[1]):
        grown = np.zeros(np.maximum(have.shape, c.shape), np.int64)
        grown[:have.shape[0], :have.shape[1]] += have
        have = into[version] = grown
    have[:c.shape[0], :c.shape[1]] += c


def expert_array_rows(arrays: Mapping[int, np.ndarray]) -> list[tuple[int, int, int, bytes]]:
    """``(model_version, layers, experts, counts)`` rows of counts arrays (``{version:
    counts[layer, expert]}``), in version order: the columns of ``agg_expert_load`` and
    ``agg_expert_load_delta``."""
    rows = []
    for version, c in sorted(arrays.items()):
        c = np.ascontiguousarray(c, "<i8")
        rows.append((int(version), int(c.shape[0]), int(c.shape[1]), c.tobytes()))
    return rows


def _add(into: dict[tuple, list[float]], key: tuple, values: Sequence[float], maxima: Sequence[int] = (),
         minima: Sequence[int] = ()) -> None:
    have = into.get(key)
    if have is None:
        into[key] = list(values)
    else:
        for i, v in enumerate(values):
            if i in maxima or i in minima:  # None (SQL NULL): no bound
                have[i] = v if have[i] is None else have[i] if v is None else \
                    max(have[i], v) if i in maxima else min(have[i], v)
            else:
                have[i] = have[i] + v


def merge(a: Counts, b: Mapping[str, Mapping[tuple, Sequence[float]]]) -> Counts:
    """``a`` plus ``b`` (into ``a``)."""
    for table, part in b.items():
        into = a.setdefault(table, {})
        maxima, minima = MAX_VALUES.get(table, ()), MIN_VALUES.get(table, ())
        for key, values in part.items():
            _add(into, key, values, maxima, minima)
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


TRAJECTORY_TABLES = ("agg_rewards", "agg_trajectory_shapes", "agg_tasks", "agg_versions", "agg_groups",
                     "agg_group_variance", "agg_samples", "agg_staleness", "agg_policy_versions")
"""The tables the materializer's commit counts each finished trajectory and its samples into
(one row per key), besides ``agg_trajectory_stats`` (one row per trajectory)."""
FAILED = ("failed", "aborted")
TASK_KEYS = ("task", "env", "environment", "env_class", "data_source", "dataset", "task_name")
"""A trajectory's task is the first of these keys its ``trajectory_started`` metadata has."""


def task_sql(metadata: str = "metadata") -> str:
    """SQL: a trajectory's task from its ``metadata`` column (the first of ``TASK_KEYS`` it has, as text)."""
    return "COALESCE(" + ", ".join(f"{metadata} ->> '{k}'" for k in TASK_KEYS) + ")"


def _spans(raw: Any) -> list[Mapping[str, Any]] | None:
    if raw is None:
        return None
    return json.loads(raw) if isinstance(raw, (str, bytes)) else list(raw)


def trajectory_record(trajectory: Mapping[str, Any], calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One finished trajectory's figures, as the ``trajectory_summary`` view gives them, from its
    ``trajectories`` row (``trajectory_id``, ``group_id``, ``status``, ``reward``, ``task``,
    ``finished_at``: its newest event's time) and its generation events (index columns): the
    row of ``agg_trajectory_stats`` plus ``versions`` (generated tokens per model version, a
    call's version spans split as ``model_version_stats`` splits them) and ``model_version_span``."""
    calls = sorted(calls, key=lambda r: int(r["seq"]))
    n = len(calls)
    num_samples = max((int(r["sample_index"]) for r in calls), default=-1) + 1
    reward = trajectory.get("reward")
    if reward is None:  # the last per-call reward, when its call is in the final sample
        rewarded = [r for r in calls if r.get("reward") is not None]
        if rewarded and int(rewarded[-1]["sample_index"]) == num_samples - 1:
            reward = rewarded[-1]["reward"]
    resent = [int(r["route_rows_resent"]) for r in calls if r.get("route_rows_resent") is not None]
    drifted = [int(r["route_rows_drifted"]) for r in calls if r.get("route_rows_drifted") is not None]
    compared = sum(int(r["route_rows_resent"] or 0) for r in calls if r.get("route_rows_drifted") is not None)
    versions: dict[int, int] = {}
    lows = [r["min_model_version"] if r.get("min_model_version") is not None else r.get("model_version")
            for r in calls]
    highs = [r.get("model_version") for r in calls]
    for r in calls:
        spans = _spans(r.get("version_spans"))
        parts = ([(r.get("model_version"), r.get("output_len"))] if spans is None
                 else [(sp.get("model_version"), sp.get("num_tokens")) for sp in spans])
        for v, tokens in parts:
            key = NONE if v is None else int(v)
            versions[key] = versions.get(key, 0) + int(tokens or 0)
    lows, highs = [v for v in lows if v is not None], [v for v in highs if v is not None]
    return {
        "trajectory_id": trajectory["trajectory_id"], "group_id": trajectory.get("group_id"),
        "status": trajectory["status"], "task": trajectory.get("task"),
        "finished_at": float(trajectory["finished_at"]), "reward": None if reward is None else float(reward),
        "num_generations": n, "num_generated_tokens": sum(int(r.get("output_len") or 0) for r in calls),
        "num_samples": max(num_samples, 0),
        "num_prefix_mismatches": sum(1 for r in calls if int(r["seq"]) > 0 and r.get("is_merged") is not None
                                     and not r["is_merged"]),
        "num_placeholder_logprobs": sum(int(r.get("num_placeholder_logprobs") or 0) for r in calls),
        "route_rows_drifted": sum(drifted) if drifted else None,
        "route_drift_share": (sum(drifted) / compared) if drifted and compared else None,
        "versions": versions if n else {},
        "model_version_span": (max(highs) - min(lows)) if highs and lows else None,
        "_resent": sum(resent) if resent else None,
    }


def _buckets(at: float) -> list[tuple[int, int]]:
    return [(w, math.floor(at / w) * w) for w in DRIFT_WIDTHS_S]


SUMMED_REWARD_BOUND = 1e100
"""A reward enters the aggregates' sums (and sums of squares) clamped to ± this: any finite
reward is accepted, and a sum of a few such as 1e308 would overflow (PostgreSQL refuses
the upsert, Python's ``**`` raises) and stop the materializer's commit. Minimums and
maximums keep the reward as sent."""


def trajectory_counts(records: Iterable[Mapping[str, Any]]) -> Counts:
    """The per-trajectory aggregates of finished trajectories' ``trajectory_record``: rewards by
    finish time, (calls, samples, prefix mismatches) shapes, per task, per model version, and
    the reward sums of each group (``agg_groups``; ``group_contribution`` turns a group's row into
    its part of ``agg_group_variance``)."""
    out: Counts = {name: {} for name in ("agg_rewards", "agg_trajectory_shapes", "agg_tasks", "agg_versions",
                                         "agg_groups")}
    for r in records:
        reward, bad = r["reward"], r["status"] in FAILED
        summed = 0.0 if reward is None else min(max(reward, -SUMMED_REWARD_BOUND), SUMMED_REWARD_BOUND)
        if reward is not None:
            for key in _buckets(r["finished_at"]):
                _add(out["agg_rewards"], key, (1, summed, reward, reward), MAX_VALUES["agg_rewards"],
                     MIN_VALUES["agg_rewards"])
        _add(out["agg_trajectory_shapes"], (r["num_generations"], r["num_samples"], r["num_prefix_mismatches"]),
             (1, r["num_placeholder_logprobs"]))
        if r["task"] is not None:
            _add(out["agg_tasks"], (str(r["task"]),),
                 (1, int(reward is not None), summed, r["num_generated_tokens"], r["num_generations"], int(bad)))
        multi = int((r["model_version_span"] or 0) > 0)
        for v, tokens in r["versions"].items():
            _add(out["agg_versions"], (v,), (1, tokens, int(reward is not None), summed,
                                             int(r["status"] == "failed"), int(r["status"] == "aborted"), multi))
        if r["group_id"] is not None:
            _add(out["agg_groups"], (r["group_id"],),
                 (1, int(reward is not None), summed, summed * summed,
                  math.inf if reward is None else reward, -math.inf if reward is None else reward, r["finished_at"]),
                 MAX_VALUES["agg_groups"], MIN_VALUES["agg_groups"])
    for key, values in out["agg_groups"].items():  # no reward: no bound (NULL)
        if not values[1]:
            values[4] = values[5] = None
    return _nonempty(out)


def _nonempty(counts: Counts) -> Counts:
    """The tables of ``counts`` that have a key to add."""
    return {name: keys for name, keys in counts.items() if keys}


def group_contribution(values: Sequence[Any], running: int) -> tuple[float, int, float] | None:
    """A group's part of ``agg_group_variance``: ``(finished_at, zero variance, variance)`` when
    no trajectory of it runs and two or more are rewarded (``values``: its ``agg_groups``
    values), else None."""
    _, rewarded, total, squares, low, high, finished_at = values
    rewarded = int(rewarded or 0)
    if running or rewarded < 2:
        return None
    mean = float(total) / rewarded
    return float(finished_at), int(low == high), float(squares) / rewarded - mean * mean


def sample_summary_counts(rows: Iterable[Mapping[str, Any]], finished_at: Mapping[str, float],
                          policy: Sequence[tuple[int, int]]) -> Counts:
    """The aggregates of default sample rows (``samples`` columns) as ``sample_summary`` gives
    them: by staleness, versions mixed, calls folded, tokens without a route (``agg_samples``),
    and staleness by the trajectory's finish time (``agg_staleness``; ``finished_at``: per
    trajectory). ``policy``: ``(first position, model version)`` of every model version, in
    position order (``agg_policy_versions``): the newest version at a position is the largest
    whose first position is at or before it."""
    firsts = np.asarray([p for p, _ in policy], np.int64)
    newest = np.maximum.accumulate(np.asarray([v for _, v in policy], np.int64)) if policy else np.zeros(0, np.int64)
    hist: dict[tuple, list[float]] = {}
    stale: dict[tuple, list[float]] = {}
    for s in rows:
        at = int(np.searchsorted(firsts, int(s["finished_position"]), side="right")) - 1
        latest = int(newest[at]) if at >= 0 else None
        staleness = None if latest is None else latest - int(s["min_model_version"])
        tokens = int(s["prompt_len"]) + int(s["response_len"])
        _add(hist, ("staleness", NONE if staleness is None else staleness), (1, 0, 0))
        _add(hist, ("version_span", int(s["max_model_version"]) - int(s["min_model_version"])), (1, 0, 0))
        _add(hist, ("merged_calls", int(s["num_merged_calls"])), (1, 0, 0))
        if s.get("num_route_rows") is not None:
            _add(hist, ("no_route", tokens - int(s["num_route_rows"])), (1, tokens, int(s["num_route_rows"])))
        when = finished_at.get(s["trajectory_id"])
        if when is not None:
            for key in _buckets(when):
                _add(stale, key, (1, int(staleness is not None), staleness or 0,
                                  NONE if staleness is None else staleness, NONE if latest is None else latest),
                     MAX_VALUES["agg_staleness"])
    return _nonempty({"agg_samples": hist, "agg_staleness": stale})


def logprob_bin_edges() -> np.ndarray:
    return np.linspace(*LOGPROB_RANGE, LOGPROB_BINS + 1)


_BIN_SCALE = LOGPROB_BINS / (LOGPROB_RANGE[1] - LOGPROB_RANGE[0])
assert _BIN_SCALE == 2.0 ** round(math.log2(_BIN_SCALE)), "the bins' width must be a power of two (exact arithmetic)"


def logprob_bins(lp: np.ndarray) -> np.ndarray:
    """The histogram bin of each logprob (float64): the ``k`` with ``edges[k] <= lp <
    edges[k + 1]`` (``logprob_bin_edges``), values clipped into the range (0 in the last bin,
    NaN too). Arithmetic, not a search: a float32 logprob plus 12 times a power of two is
    exact in float64, so the floor is the bin ``searchsorted`` finds."""
    x = np.clip(lp, *LOGPROB_RANGE)
    x -= LOGPROB_RANGE[0]
    x *= _BIN_SCALE
    return np.fmin(x, LOGPROB_BINS - 1, out=x).astype(np.intp)


def _groups(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_inverse=True)`` of small non-negative integers (model
    versions) without a sort: a value's group is its offset from the smallest."""
    values = np.asarray(values, np.int64)
    low, high = int(values.min()), int(values.max())
    if low < 0 or high - low > 1 << 20:
        return np.unique(values, return_inverse=True)
    if low == high:
        return np.asarray([low], np.int64), np.zeros(len(values), np.intp)
    offset = (values - low).astype(np.intp)
    present = np.flatnonzero(np.bincount(offset, minlength=high - low + 1))
    index = np.zeros(high - low + 1, np.intp)
    index[present] = np.arange(len(present))
    return present + low, index[offset]


def sample_counts(samples: Iterable[Any], num_experts: Mapping[str, int | None] | None = None, *,
                  experts: bool = True, every: int = 1, logprobs: bool = True) -> Counts:
    """The aggregates of samples' token columns: expert load of their decode routes and
    their generated loss tokens' rollout logprobs. ``agg_expert_load`` is
    ``{(model_version,): counts[layer, expert]}`` (an int64 array: every expert below
    ``num_experts[trajectory_id]`` and the highest id routed to), one per version.
    ``experts`` False: the logprobs only. ``every``: count one decode route in ``every``
    (``decode_routes``), each ``every`` times (the materializer's commit counts its samples'
    routes as it wrote them, in the store's stride). ``logprobs`` False: the expert load only
    (the compaction's count of a segment an older version noted in ``agg_expert_pending``).
    The samples' token columns are laid end to end and counted at once (``bincount`` over
    (version, bin) keys; the decode routes chosen for the whole batch, ``_decode_rows``), not
    sample by sample."""
    samples = list(samples)
    out: Counts = {}
    if logprobs and samples:
        histogram = _logprob_counts(samples)
        if histogram:
            out["agg_logprobs"] = histogram
    if not experts:
        return out
    by_layout: dict[tuple, list[tuple[Any, np.ndarray]]] = {}  # layout -> (sample, routes)
    for s in samples:
        routes = s.routed_experts
        if routes is not None:
            routes = routes.array() if hasattr(routes, "place") else np.asarray(routes)  # planned: as written
            by_layout.setdefault(routes.shape[1:], []).append((s, routes))
    per_version: dict[int, np.ndarray] = {}  # [layer, expert] counts
    for group in by_layout.values():  # one count per layout, not per sample
        rows, row_versions, counted = _decode_rows(group, every)
        if not len(rows):
            continue
        declared = max(int((num_experts or {}).get(s.trajectory_id) or 0)
                       for (s, _), n in zip(group, counted) if n)
        versions, vi = _groups(row_versions)
        counts = count_routes(rows, max(declared, int(rows.max()) + 1), vi if len(versions) > 1 else None,
                              len(versions))
        if every > 1:
            counts *= every
        for i, version in enumerate(versions.tolist()):
            _add_array(per_version, int(version), counts[i])
    if per_version:  # one array per version: no row per (layer, expert)
        out["agg_expert_load"] = {(v,): c for v, c in per_version.items()}  # type: ignore[dict-item]
    return out


def _logprob_counts(samples: Sequence[Any]) -> dict[tuple, list[float]]:
    """``agg_logprobs`` of samples: their generated (version >= 0) loss tokens with a reported
    logprob, per (model version, bin): the token count and the logprobs' sum (float64, summed
    in token order)."""
    def joined(name: str, dtype: Any = None) -> np.ndarray:
        parts = [getattr(s, name) for s in samples]
        if dtype is None:
            return np.concatenate(parts) if len(parts) > 1 else np.asarray(parts[0])
        return np.concatenate(parts, dtype=dtype, casting="unsafe") if len(parts) > 1 \
            else np.asarray(parts[0]).astype(dtype, casting="unsafe")

    v = joined("token_model_versions")
    keep = v >= 0
    keep &= joined("logprobs_mask", np.bool_)
    keep &= joined("loss_mask", np.bool_)
    if not keep.any():
        return {}
    lp = joined("rollout_logprobs", np.float64)[keep]
    versions, vi = _groups(v[keep])
    key = vi * LOGPROB_BINS + logprob_bins(lp)
    n = np.bincount(key, minlength=len(versions) * LOGPROB_BINS)
    total = np.bincount(key, weights=lp, minlength=len(versions) * LOGPROB_BINS)
    nz = np.flatnonzero(n)
    return {(v_, b): [c, t] for v_, b, c, t in zip(versions[nz // LOGPROB_BINS].tolist(),
                                                    (nz % LOGPROB_BINS).tolist(), n[nz].tolist(),
                                                    total[nz].tolist())}


def _decode_rows(group: Sequence[tuple[Any, np.ndarray]], every: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``decode_routes`` of several samples at once (``(sample, routes)`` of one layout): their
    chosen rows end to end ``[n, layers, topk]``, those rows' token versions, and how many
    rows each sample gave. The same rows, in the same order, as ``decode_routes`` sample by
    sample: the selection is made over the samples' token columns laid end to end, and
    only the gather of the rows is per sample."""
    num = len(group)
    lengths = np.fromiter((len(s.token_model_versions) for s, _ in group), np.intp, num)
    starts = np.zeros(num, np.intp)
    np.cumsum(lengths[:-1], out=starts[1:])
    versions = np.concatenate([s.token_model_versions for s, _ in group]) if num > 1 \
        else np.asarray(group[0][0].token_model_versions)
    if every > 1:
        firsts = [(-(zlib.crc32(f"{s.trajectory_id}/{s.sample_index}".encode()) % every)) % every for s, _ in group]
        gen = np.concatenate([np.arange(a + f, a + n, every) for a, n, f in
                              zip(starts.tolist(), lengths.tolist(), firsts)])
        which = np.repeat(np.arange(num), [len(range(f, n, every)) for n, f in zip(lengths.tolist(), firsts)])
    else:
        gen = np.arange(len(versions))
        which = np.repeat(np.arange(num), lengths)
    generated = versions[gen] >= 0
    gen, which = gen[generated], which[generated]
    prompts = np.fromiter((len(s.prompt_ids) for s, _ in group), np.intp, num)
    sizes = np.fromiter((len(r) for _, r in group), np.intp, num)
    rows = gen - starts[which] + prompts[which] - 1  # each token's route row in its sample
    ok = (rows >= 0) & (rows < sizes[which])
    if any(s.routed_experts_mask is not None for s, _ in group):
        parts = [np.zeros(n, np.bool_) if s.routed_experts_mask is None else np.asarray(s.routed_experts_mask, bool)
                 for (s, _), n in zip(group, sizes.tolist())]
        mask_starts = np.zeros(num, np.intp)
        np.cumsum(np.fromiter(map(len, parts[:-1]), np.intp, num - 1), out=mask_starts[1:])
        if (rows[ok] >= np.fromiter(map(len, parts), np.intp, num)[which[ok]]).any():
            raise IndexError("a sample's routed_experts_mask is shorter than its routes")  # as indexing it raised
        ok[ok] &= ~np.concatenate(parts)[mask_starts[which[ok]] + rows[ok]]
    rows, which, gen = rows[ok], which[ok], gen[ok]
    counted = np.bincount(which, minlength=num)
    bounds = np.zeros(num + 1, np.intp)
    np.cumsum(counted, out=bounds[1:])
    parts = [r[rows[a:b]] for (_, r), a, b in zip(group, bounds[:-1].tolist(), bounds[1:].tolist()) if b > a]
    if not parts:
        return np.zeros((0, *group[0][1].shape[1:]), group[0][1].dtype), versions[:0], counted
    return (parts[0] if len(parts) == 1 else np.concatenate(parts)), versions[gen], counted


def decode_routes(sample: Any, every: int = 1) -> tuple[np.ndarray, np.ndarray] | None:
    """``(rows [n, layers, topk], versions [n])``: the routes that generated the sample's
    tokens and those tokens' model versions; None when the sample has no routes. ``every``
    > 1: only the generated tokens at a response position ``p`` with ``(p + phase) % every
    == 0``, ``phase`` fixed by the sample's trajectory and index (the same rows at every
    count of the sample, a recount included; phases of samples spread evenly)."""
    if sample.routed_experts is None:
        return None
    versions = np.asarray(sample.token_model_versions)
    if every > 1:
        phase = zlib.crc32(f"{sample.trajectory_id}/{sample.sample_index}".encode()) % every
        gen = np.arange((-phase) % every, len(versions), every)
        gen = gen[versions[gen] >= 0]
    else:
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
    row i's group, all 0 by default). Rows of several groups are ordered by group first
    (a stable sort of a few thousand small ints) and each group counted apart, so one
    count's bins stay one group's [layers, experts] (cache-sized). ``bincount`` over keys
    built a few hundred rows at a time in one reused buffer (uint16 when the keys fit: the
    conversion ``bincount`` makes of them costs less than building machine ints; a chunk
    stays in cache)."""
    n, layers, topk = rows.shape
    per_group = layers * num_experts
    counts = np.zeros((num_groups, per_group), np.int64)
    if not n:
        return counts.reshape(num_groups, layers, num_experts)
    if group is None or num_groups == 1:
        _count_into(counts[0], rows, num_experts)
        return counts.reshape(num_groups, layers, num_experts)
    group = np.asarray(group, np.intp)
    order = np.argsort(group, kind="stable")
    ends = np.searchsorted(group[order], np.arange(1, num_groups + 1), side="left")
    start = 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            _count_into(counts[g], rows[order[start:end]], num_experts)
        start = end
    return counts.reshape(num_groups, layers, num_experts)


def _count_into(counts: np.ndarray, rows: np.ndarray, num_experts: int) -> None:
    """Add the [layer, expert] counts of route rows ``[n, layers, topk]`` to ``counts`` (flat)."""
    n, layers, topk = rows.shape
    size = layers * num_experts
    dtype = np.uint16 if size <= 1 << 16 else np.intp
    chunk = max(256, -(-size // max(layers * topk, 1)))  # a chunk's keys outnumber the bins
    layer_offset = (np.arange(layers, dtype=dtype) * num_experts)[None, :, None]
    buf = np.empty((min(chunk, n), layers, topk), dtype)
    for start in range(0, n, chunk):
        part = rows[start:start + chunk]
        key = buf[:len(part)]
        np.add(part, layer_offset, out=key, casting="unsafe")
        counts += np.bincount(key.ravel(), minlength=size)
