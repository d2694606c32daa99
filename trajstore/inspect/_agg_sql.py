"""How the run view reads each aggregate table (docs/report.md, "Aggregates"): one small
function per table giving the relation a panel's SQL selects from, so how a table is
written is known here only. Each is the table as ONE ROW PER KEY
(``trajstore.log._aggregate_counts.totals_sql``): the append's tables hold a total row per key and
the delta rows not folded into it yet (docs/log.md, "Run aggregates"), summed here
(``agg_calls.max_output_len``: their max), so a read is exact before and after a fold.

Each returns SQL text usable after ``FROM`` (a subquery named as the table) with the
table's key and value columns; the page shows it as it ran (``trajstore sql`` re-runs it
as is)."""

from __future__ import annotations

__all__ = ["output_lengths", "route_drift", "expert_load", "logprobs", "calls", "trajectories", "base_width",
           "CALL_WIDTHS_S", "rewards", "group_variance", "staleness", "bucketed"]

from trajstore.log._aggregate_counts import DRIFT_WIDTHS_S, expert_load_sql, totals_sql

CALL_WIDTHS_S = DRIFT_WIDTHS_S
"""The bucket widths ``agg_calls``, ``agg_trajectories`` and ``agg_route_drift`` are kept at."""


def _totals(table: str, where: str = "") -> str:
    return f"({totals_sql(table, where=where, order=False)}) {table}"


def _width(table: str, width_s: int) -> str:
    if width_s not in CALL_WIDTHS_S:
        raise ValueError(f"{table} is kept at {CALL_WIDTHS_S} s buckets, not {width_s!r}")
    return f"width_s = {int(width_s)}"


def output_lengths() -> str:
    """Engine calls by (model_version, output_len): ``calls``."""
    return _totals("agg_output_lengths")


def route_drift(width_s: int) -> str:
    """Calls that re-sent route rows in buckets of ``width_s`` seconds (one of ``CALL_WIDTHS_S``) by
    (width_s, bucket_start): ``rows_resent``, ``rows_compared``, ``rows_drifted``."""
    return _totals("agg_route_drift", _width("agg_route_drift", width_s))


def expert_load() -> str:
    """Decode routes per model version as counts arrays: ``model_version``, ``layers``,
    ``experts``, ``counts`` (int64 bytes of [layers, experts]), the compacted total and the
    commits' arrays not compacted yet, several rows per version
    (``trajstore.log._aggregate_counts.expert_arrays`` sums them with numpy)."""
    return f"({expert_load_sql()}) agg_expert_load"


def logprobs() -> str:
    """Generated loss tokens' rollout logprobs by (model_version, bin): ``tokens``, ``logprob_sum``."""
    return _totals("agg_logprobs")


def calls(width_s: int) -> str:
    """Engine calls in buckets of ``width_s`` seconds (one of ``CALL_WIDTHS_S``) by (bucket_start,
    model_version, finish_reason; NULL where the calls had none): ``calls``, ``output_tokens``,
    ``observed_tokens``, ``prefix_mismatches``, ``calls_with_routes``, ``max_output_len``,
    ``route_rows_resent``, ``route_rows_compared``, ``route_rows_drifted``."""
    return ("(SELECT bucket_start, NULLIF(model_version, -1) AS model_version, "
            "NULLIF(finish_reason, '') AS finish_reason, calls, output_tokens, observed_tokens, prefix_mismatches, "
            "calls_with_routes, max_output_len, route_rows_resent, route_rows_compared, route_rows_drifted "
            f"FROM {_totals('agg_calls', _width('agg_calls', width_s))}) agg_calls")


def trajectories(width_s: int) -> str:
    """Trajectories in buckets of ``width_s`` seconds by (bucket_start, status): ``started`` (their
    ``trajectory_started``, under status ``running``), ``finished`` (their ``trajectory_finished``)."""
    return ("(SELECT bucket_start, status, started, finished "
            f"FROM {_totals('agg_trajectories', _width('agg_trajectories', width_s))}) agg_trajectories")


def base_width(width_s: int) -> int:
    """The widest kept bucket width that ``width_s`` (a page's) is a multiple of."""
    return max(w for w in CALL_WIDTHS_S if width_s % w == 0)


def bucketed(table: str, width_s: int) -> str:
    """A materializer-counted table kept in time buckets (``agg_rewards``, ``agg_group_variance``,
    ``agg_staleness``: one row per key) at ``width_s`` (one of ``CALL_WIDTHS_S``)."""
    return _totals(table, _width(table, width_s))


def rewards(width_s: int) -> str:
    """Finished trajectories' rewards by finish time: ``rewarded``, ``reward_sum``, ``reward_min``, ``reward_max``."""
    return bucketed("agg_rewards", width_s)


def group_variance(width_s: int) -> str:
    """Finished groups by the finish time of their last trajectory: ``groups``, ``zero_variance_groups``,
    ``variance_sum``."""
    return bucketed("agg_group_variance", width_s)


def staleness(width_s: int) -> str:
    """Default samples by their trajectory's finish time: ``samples``, ``staled`` (with a staleness),
    ``staleness_sum``, ``staleness_max`` and ``policy_version_max`` (-1: none)."""
    return bucketed("agg_staleness", width_s)
