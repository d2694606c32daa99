"""How the run view reads each aggregate table (docs/report.md, "Aggregates"): one small
function per table giving the relation a panel's SQL selects from, so how a table is
written (one row per key, added to in place) is known here only.

Each returns SQL text usable after ``FROM`` with the table's key and value columns; the
page shows it as it ran (``trajstore sql`` re-runs it as is)."""

from __future__ import annotations

__all__ = ["output_lengths", "route_drift", "expert_load", "logprobs", "calls", "trajectories", "base_width",
           "CALL_WIDTHS_S"]

from trajstore._aggregates import DRIFT_WIDTHS_S

CALL_WIDTHS_S = DRIFT_WIDTHS_S
"""The bucket widths ``agg_calls`` is kept at (as the route drift)."""


def output_lengths() -> str:
    """Engine calls by (model_version, output_len): ``calls``."""
    return "agg_output_lengths"


def route_drift() -> str:
    """Calls that re-sent route rows by (width_s, bucket_start): ``rows_resent``, ``rows_compared``, ``rows_drifted``."""
    return "agg_route_drift"


def expert_load() -> str:
    """Decode routes by (model_version, layer, expert): ``routed``."""
    return "agg_expert_load"


def logprobs() -> str:
    """Generated loss tokens' rollout logprobs by (model_version, bin): ``tokens``, ``logprob_sum``."""
    return "agg_logprobs"


def calls(width_s: int) -> str:
    """Engine calls in buckets of ``width_s`` seconds (one of ``CALL_WIDTHS_S``) by (bucket_start,
    model_version, finish_reason; NULL where the calls had none): ``calls``, ``output_tokens``,
    ``observed_tokens``, ``prefix_mismatches``, ``calls_with_routes``, ``max_output_len``,
    ``route_rows_resent``, ``route_rows_compared``, ``route_rows_drifted``."""
    if width_s not in CALL_WIDTHS_S:
        raise ValueError(f"agg_calls is kept at {CALL_WIDTHS_S} s buckets, not {width_s!r}")
    return ("(SELECT bucket_start, NULLIF(model_version, -1) AS model_version, "
            "NULLIF(finish_reason, '') AS finish_reason, calls, output_tokens, observed_tokens, prefix_mismatches, "
            "calls_with_routes, max_output_len, route_rows_resent, route_rows_compared, route_rows_drifted "
            f"FROM agg_calls WHERE width_s = {int(width_s)}) agg_calls")


def trajectories(width_s: int) -> str:
    """Trajectories in buckets of ``width_s`` seconds by (bucket_start, status): ``started`` (their
    ``trajectory_started``, under status ``running``), ``finished`` (their ``trajectory_finished``)."""
    if width_s not in CALL_WIDTHS_S:
        raise ValueError(f"agg_trajectories is kept at {CALL_WIDTHS_S} s buckets, not {width_s!r}")
    return ("(SELECT bucket_start, status, started, finished FROM agg_trajectories "
            f"WHERE width_s = {int(width_s)}) agg_trajectories")


def base_width(width_s: int) -> int:
    """The widest kept bucket width that ``width_s`` (a page's) is a multiple of."""
    return max(w for w in CALL_WIDTHS_S if width_s % w == 0)
