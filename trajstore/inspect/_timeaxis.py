"""The report's time buckets: how wide, given the run's span and how often it appends.

A width is taken from a fixed ladder (so bucket edges fall on round times):
the smallest one that gives at most ``MAX_BUCKETS`` buckets over the span,
is at least ``MIN_BUCKET_S``, and holds on average at least
``CALLS_PER_BUCKET`` engine calls. Buckets narrower than the interval between
appends draw comb plots (a writer appending every 2 s in 1 s buckets: every
other bucket empty); the last two bounds keep a bucket wider than the usual
gap between appends.

A short run (under ``2 * MIN_BUCKET_S``, with at least ``2 * SHORT_RUN_BUCKETS``
calls: the demo's 5-second run) would fit in one bucket, where a line is a
single invisible point and an axis zooms to milliseconds; it gets the widest
ladder width that still gives ``SHORT_RUN_BUCKETS`` buckets (down to 1 s).
"""

from __future__ import annotations

__all__ = ["BUCKET_WIDTHS_S", "MAX_BUCKETS", "MIN_BUCKET_S", "CALLS_PER_BUCKET", "SHORT_RUN_BUCKETS", "bucket_width"]

MAX_BUCKETS = 100
MIN_BUCKET_S = 10
CALLS_PER_BUCKET = 4
SHORT_RUN_BUCKETS = 5
BUCKET_WIDTHS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400, 7 * 86400)


def bucket_width(span_s: float, num_calls: int) -> int:
    """Seconds per bucket for a run spanning ``span_s`` seconds with ``num_calls`` engine calls."""
    gap = span_s / num_calls if num_calls > 0 else 0.0  # the mean interval between appends
    if span_s < 2 * MIN_BUCKET_S and num_calls >= 2 * SHORT_RUN_BUCKETS:
        short = [w for w in BUCKET_WIDTHS_S if w < MIN_BUCKET_S and span_s / w >= SHORT_RUN_BUCKETS]
        if short:
            return short[-1]
    floor = max(MIN_BUCKET_S, CALLS_PER_BUCKET * gap)
    return next((w for w in BUCKET_WIDTHS_S if w >= floor and span_s / w <= MAX_BUCKETS), BUCKET_WIDTHS_S[-1])
