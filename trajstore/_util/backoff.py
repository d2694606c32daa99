"""Exponential backoff under a time budget: the one retry policy of the library's loops.

A pause starts at ``first_s`` and doubles after each one, up to ``max_s``; a
loop gives up instead of pausing past its budget. ::

    backoff = Backoff(first_s=0.05)
    while True:
        try:
            return attempt()
        except Retriable:
            if backoff.exhausted(budget_s):
                raise
        backoff.pause()
"""

from __future__ import annotations

import time

__all__ = ["Backoff"]


class Backoff:
    """The pauses of one retry loop, timed from its creation."""

    def __init__(self, first_s: float, max_s: float = 2.0) -> None:
        self.start = time.monotonic()
        self.delay = first_s
        self.max_s = max_s

    def elapsed(self) -> float:
        """Seconds since the loop started."""
        return time.monotonic() - self.start

    def exhausted(self, budget_s: float) -> bool:
        """Whether the next pause would end more than ``budget_s`` after the start."""
        return time.monotonic() + self.delay > self.start + budget_s

    def pause(self) -> None:
        """Sleep the current delay, then double it (up to ``max_s``)."""
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, self.max_s)
