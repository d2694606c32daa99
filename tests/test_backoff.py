"""``trajstore._util.backoff.Backoff``: the pauses double up to a cap, and a loop stops before its budget."""

from __future__ import annotations

from trajstore._util.backoff import Backoff


def test_pauses_double_up_to_the_cap_and_take_at_least_that_long():
    backoff = Backoff(first_s=0.01, max_s=0.04)
    delays = []
    for _ in range(5):
        delays.append(backoff.delay)
        backoff.pause()
    assert delays == [0.01, 0.02, 0.04, 0.04, 0.04]
    assert backoff.elapsed() >= sum(delays)


def test_exhausted_when_the_next_pause_would_end_past_the_budget():
    backoff = Backoff(first_s=0.5)
    assert backoff.exhausted(0.1)  # the first pause alone ends past it
    assert not backoff.exhausted(60.0)
    backoff.delay = 100.0
    assert backoff.exhausted(60.0)
