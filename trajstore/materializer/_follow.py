"""The long-running fold loop: ``trajstore materialize --follow``, ``trajstore worker``,
``Materializer.follow`` and the Ray shards all run this one loop.

Each step is one call of the public ``Materializer.run(max_steps=1)`` (one
transaction: stopping between steps loses nothing). When the store cannot be
reached (``StoreUnavailable``: a PostgreSQL restart, a killed backend, the
payload storage gone), the loop waits it out as a ``SampleReader`` does:
backoff from 0.1 s to 2 s, one WARNING when the wait begins and one INFO when
the store answers again, however many attempts fail in between. It gives up
(re-raises) only after ``unavailable_timeout_s`` of one outage (None: never).
A step whose commit was lost in the outage is folded again by the next one:
each commit is guarded by the shard checkpoint it started from.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from trajstore._util.backoff import Backoff
from trajstore._upkeep.gc import GC_INTERVAL_S, GC_MARGIN_S, GcWorker
from trajstore.errors import StoreUnavailable, first_line

__all__ = ["follow", "step_line"]

log = logging.getLogger("trajstore.materializer")


def step_line(shard: Any, stats: Any, pending: int | None) -> str:
    """One human line for a step that folded something."""
    d = stats.to_dict()
    parts = [f"folded {d['num_trajectories']} trajector{'y' if d['num_trajectories'] == 1 else 'ies'} "
             f"into {d['num_samples_after']} sample(s)"]
    if d.get("num_unfoldable"):
        parts.append(f"{d['num_unfoldable']} unfoldable")
    if d.get("num_internal_errors"):
        parts.append(f"{d['num_internal_errors']} internal error(s)")
    parts.append(f"checkpoint {d['position']}")
    if pending is not None:
        parts.append(f"{pending} pending")
    return f"materializer shard {shard}: " + ", ".join(parts)


class _Outage:
    """One wait for the store: its backoff, logged once when it begins and once when it ends."""

    def __init__(self, shard: Any, timeout_s: float | None) -> None:
        self.shard = shard
        self.timeout_s = timeout_s
        self.backoff: Backoff | None = None
        self.waits = 0

    def failed(self, what: str, e: StoreUnavailable, stop: threading.Event) -> None:
        """Pause before the next attempt; re-raise ``e`` when the budget is spent."""
        if self.backoff is None:
            self.backoff = Backoff(first_s=0.1, max_s=2.0)
            self.waits += 1
            budget = "as long as it takes" if self.timeout_s is None else f"up to {self.timeout_s:g} s"
            log.warning("materializer shard %s: store unavailable while %s (%s); retrying for %s",
                        self.shard, what, first_line(e), budget)
        elif self.timeout_s is not None and self.backoff.exhausted(self.timeout_s):
            log.error("materializer shard %s: gave up %s after %g s: %s", self.shard, what, self.timeout_s,
                      first_line(e))
            raise e
        stop.wait(self.backoff.delay)
        self.backoff.delay = min(self.backoff.delay * 2, self.backoff.max_s)

    def ok(self) -> None:
        if self.backoff is not None:
            log.info("materializer shard %s: store available again after %.1f s", self.shard, self.backoff.elapsed())
            self.backoff = None


def follow(m: Any, stop: threading.Event, *, poll_s: float = 1.0, gc_grace_s: float | None = GC_MARGIN_S,
           gc_interval_s: float = GC_INTERVAL_S, on_step: Callable[[Any], None] | None = None,
           abandon_after_s: float | None = None, unavailable_timeout_s: float | None = None,
           pending_in_line: bool = False) -> int:
    """Fold with materializer ``m`` as trajectories finish until ``stop`` is set
    (see ``Materializer.follow`` for ``gc_grace_s``, ``gc_interval_s``,
    ``abandon_after_s`` and ``on_step``). Logs one INFO line per step that
    folded something (with this shard's backlog when ``pending_in_line``).
    Returns the number of outages waited out."""
    last_abandon = time.monotonic()
    worker = None if gc_grace_s is None else GcWorker(
        m.store, margin_s=gc_grace_s, interval_s=gc_interval_s, name=f"trajstore-gc-{m.shard}").start()
    m.gc = worker
    abandon_every = None if abandon_after_s is None else max(1.0, min(60.0, abandon_after_s / 10))
    outage = _Outage(m.shard, unavailable_timeout_s)
    try:
        while not stop.is_set():
            if abandon_every is not None and time.monotonic() - last_abandon >= abandon_every:
                last_abandon = time.monotonic()
                try:
                    m.abandon_idle(abandon_after_s)
                except StoreUnavailable as e:  # retried at the next check; folding goes on
                    log.warning("materializer %s: abandoning idle trajectories failed, retried later: %s",
                                m.shard, first_line(e))
            try:
                stats = m.run(max_steps=1, compact=worker is None)  # with a GC worker, it compacts
                idle = not (stats.num_trajectories or stats.num_unfoldable or stats.num_internal_errors)
                pending = m.pending(all_shards=idle) if (idle or pending_in_line) else None
            except StoreUnavailable as e:
                outage.failed("folding", e, stop)
                continue
            outage.ok()
            if not idle:
                if log.isEnabledFor(logging.INFO):
                    log.info("%s", step_line(m.shard, stats, pending))
                if on_step is not None:
                    on_step(stats)
            elif pending == 0:
                stop.wait(poll_s)  # nothing to do: sleep, but wake at once when stopped
    finally:
        if worker is not None:
            worker.stop(timeout=0)  # a pass stuck on the object store ends with the process (daemon)
    return outage.waits
