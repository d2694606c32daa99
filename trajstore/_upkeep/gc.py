"""The payload GC that keeps up without an operator (docs/materializer.md, "Garbage
collection"; docs/log.md, "One copy").

Steady path (``collect_retired``, run by ``GcWorker`` in its own thread): the
segments the index lists as retired (``segments.retired_at`` set, no row naming
them) before the GC horizon are deleted in batches (S3: one ``DeleteObjects``
per 1,000 keys; a local disk: unlinks) and their rows forgotten. No listing of
the payload. The horizon is the database's ``now``, or the oldest ``held_since``
of a live reader lease if earlier, minus a short safety margin (``GC_MARGIN_S``:
a retirement stamped before its transaction commits, a reader between taking
its lease and reading). A lease lapses ``ttl_s`` after its last renewal: a dead
reader stops holding anything back; and a live one holds back nothing retired
more than ``lease_max_age_s`` ago (``LEASE_MAX_AGE_S``, 6 h, by default; logged
once per lease when it loses its protection), so disk use stays bounded
whatever a reader does. ``SampleReader`` and the replay server's
trainers hold leases of their own (``trajstore.reader._lease``) over sample
segments only: a log segment's horizon ignores them.

Crash leftovers (files no ``segments`` row knows) are found only by listing:
``Store.collect_garbage`` / ``trajstore gc``, and the worker's rare full sweep
(``sweep_interval_s``), with their own grace for files not yet committed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from trajstore.errors import StoreUnavailable, TrajstoreError, first_line
from trajstore.log._aggregates import COMPACT_ROWS, EXPERT_SEGMENTS, compact_aggregates, count_pending_experts
from trajstore.log.base import EventLog
from trajstore.payload import PayloadStore
from trajstore.log._leases import (LEASE_MAX_AGE_S, gc_horizon, gc_horizons, release_lease, renew_lease,
                                   retired_segments, take_lease)


class _Parts(Protocol):
    """What this module uses of a ``Store``."""

    log: EventLog
    payload: PayloadStore

log = logging.getLogger(__name__)

__all__ = ["GC_MARGIN_S", "GC_INTERVAL_S", "LEASE_MAX_AGE_S", "LEASE_TTL_S", "SWEEP_GRACE_S", "GcStats", "GcWorker",
           "ReaderLease", "collect_retired", "lease_horizon", "sweep"]

GC_MARGIN_S = 1.0  # deleted this long after retirement (or after the oldest live lease's held_since)
GC_INTERVAL_S = 0.5  # one pass of the steady path every so often: one indexed query when nothing is retired
LEASE_TTL_S = 60.0  # a reader lease not renewed this long has lapsed
SWEEP_GRACE_S = 3600.0  # a file no row knows is a crash leftover once this old (a writer may not have committed)
SWEEP_INTERVAL_S = 6 * 3600.0  # the worker's full sweep (one listing of the payload)
_BATCH = 1000


@dataclass
class GcStats:
    passes: int = 0
    deleted: int = 0
    sweeps: int = 0
    failures: int = 0
    last_pass_s: float = 0.0
    compacted: int = 0  # run-aggregate delta rows folded into their totals


def lease_horizon(store: Any, margin_s: float, lease_max_age_s: float = LEASE_MAX_AGE_S) -> float:
    """Segments retired before this (database time) may be deleted (module doc)."""
    return gc_horizon(store.log.db, margin_s, lease_max_age_s)[0]


def compact_run_aggregates(store: Any, *, max_rounds: int | None = None) -> int:
    """Fold the run aggregates' delta rows (the appends' and the materializer commits') into
    their totals (``trajstore.log._aggregates.compact_aggregates``), one transaction per round
    of up to ``COMPACT_ROWS`` rows per table, until a round finds fewer (or ``max_rounds``);
    then count the expert load of the committed sample segments noted for it
    (``count_pending_experts``, up to ``EXPERT_SEGMENTS`` a transaction). Returns the rows
    folded and segments counted. Exactly once: a round that fails rolls back whole."""
    db = store.log.db
    n, rounds = 0, 0
    while max_rounds is None or rounds < max_rounds:
        got = db.transaction("compacting the run aggregates", lambda conn, d: compact_aggregates(conn, d))
        n, rounds = n + got, rounds + 1
        if got < COMPACT_ROWS:
            break
    from trajstore.sample._codec import load_samples

    rounds = 0
    while max_rounds is None or rounds < max_rounds:  # the expert load of committed segments
        got = db.transaction("counting the expert load of committed samples", lambda conn, d: count_pending_experts(
            conn, d, lambda rows: load_samples(store, rows)))
        n, rounds = n + got, rounds + 1
        if got < EXPERT_SEGMENTS:
            break
    return n


def collect_retired(store: Any, *, margin_s: float = GC_MARGIN_S, max_batches: int | None = None,
                    lease_max_age_s: float = LEASE_MAX_AGE_S) -> list[str]:
    """Delete the retired segments before the GC horizon, in batches of 1,000
    from the index's list; forget their rows; return their names."""
    # a sample reader's lease keeps no log segment
    samples_before, events_before = gc_horizons(store.log.db, margin_s, lease_max_age_s)
    removed: list[str] = []
    batches = 0
    while max_batches is None or batches < max_batches:
        names = retired_segments(store.log.db, samples_before, _BATCH, events_before=events_before)
        if not names:
            break
        gone = store.payload.delete_many(names)
        store.log.forget_segments(gone)
        removed.extend(gone)
        batches += 1
        if len(names) < _BATCH or len(gone) < len(names):
            break  # the rest next pass (a delete refused now is retried then)
    return removed


class GcWorker:
    """Runs the GC in its own daemon thread: ``collect_retired`` every
    ``interval_s``, the retirement of segments two concurrent re-pointings each
    left to the other every ``retire_check_s``, and a full sweep (listing the
    payload for crash leftovers) every ``sweep_interval_s`` (None: never).
    Errors are logged and retried at the next pass; nothing it does blocks its
    caller. ``stop()`` ends it (waits for the pass running)."""

    def __init__(self, store: Any, *, margin_s: float = GC_MARGIN_S, interval_s: float = GC_INTERVAL_S,
                 retire_check_s: float = 60.0, sweep_interval_s: float | None = SWEEP_INTERVAL_S,
                 sweep_grace_s: float = SWEEP_GRACE_S, name: str = "trajstore-gc",
                 lease_max_age_s: float = LEASE_MAX_AGE_S) -> None:
        self.store, self.margin_s, self.interval_s = store, margin_s, interval_s
        self.lease_max_age_s = lease_max_age_s
        self.retire_check_s, self.sweep_interval_s, self.sweep_grace_s = retire_check_s, sweep_interval_s, sweep_grace_s
        self.stats = GcStats()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "GcWorker":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> "GcWorker":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _run(self) -> None:
        last_retire = last_sweep = time.monotonic()
        failing_since: float | None = None  # the store has been unavailable since (monotonic)
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                if t0 - last_retire >= self.retire_check_s:
                    last_retire = t0
                    self.store.log.retire_unreferenced(time.time())
                if self.sweep_interval_s is not None and t0 - last_sweep >= self.sweep_interval_s:
                    last_sweep = t0
                    self.stats.sweeps += 1
                    self.stats.deleted += len(self.store.collect_garbage(
                        grace_s=self.sweep_grace_s, margin_s=self.margin_s, lease_max_age_s=self.lease_max_age_s))
                self.stats.compacted += compact_run_aggregates(self.store, max_rounds=4)
                removed = collect_retired(self.store, margin_s=self.margin_s, lease_max_age_s=self.lease_max_age_s)
                self.stats.deleted += len(removed)
                if removed:
                    log.info("gc: deleted %d retired payload segment(s)", len(removed))
                if failing_since is not None:
                    log.info("gc: store available again after %.1f s", time.monotonic() - failing_since)
                    failing_since = None
            except StoreUnavailable as e:  # one line per outage, not one per pass
                self.stats.failures += 1
                if failing_since is None:
                    failing_since = t0
                    log.warning("gc pass failed, retried every %gs until the store answers: %s", self.interval_s,
                                first_line(e))
            except TrajstoreError as e:
                self.stats.failures += 1
                log.warning("gc pass failed, retried in %gs: %s", self.interval_s, first_line(e))
            except Exception:  # noqa: BLE001 - a GC bug must not end the thread silently
                self.stats.failures += 1
                log.exception("gc pass failed, retried in %gs", self.interval_s)
            self.stats.passes += 1
            self.stats.last_pass_s = time.monotonic() - t0
            self._stop.wait(self.interval_s)


class ReaderLease:
    """A reader's lease (``reader_leases`` row): while it lives, the GC keeps every
    segment retired after its ``held_since``. Taken on construction, held since
    then; ``advance()`` moves ``held_since`` to now (call it when every locator
    read before is dropped, e.g. between a reader's steps); a daemon thread
    renews it every ``ttl_s / 3``; ``close()`` releases it. A lease not renewed
    for ``ttl_s`` (the reader died) lapses and holds nothing back.

    If the lease cannot be written (a read-only login without the grant, a
    store before migration 0015) the reader runs without one, protected only by
    the GC's margin; that is logged once."""

    def __init__(self, store: Any, holder: str | None = None, *, ttl_s: float = LEASE_TTL_S,
                 heartbeat: bool = True) -> None:
        self.store, self.ttl_s = store, ttl_s
        self.name = uuid.uuid4().hex
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}"
        self.held_since: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        try:
            self.held_since = take_lease(store.log.db, self.name, self.holder, ttl_s)
        except TrajstoreError as e:
            log.warning("reader %s runs without a GC lease (protected by the GC margin only): %s", self.holder,
                        first_line(e))
            return
        if heartbeat:
            self._thread = threading.Thread(target=self._beat, name="trajstore-lease", daemon=True)
            self._thread.start()

    @property
    def held(self) -> bool:
        return self.held_since is not None

    def renew(self, *, advance: bool = False) -> None:
        if self.held_since is None or self._stop.is_set():
            return
        with self._lock:
            since = renew_lease(self.store.log.db, self.name, self.ttl_s, advance=advance)
            if since is None:  # lapsed (the reader stalled past its ttl): hold from now on
                log.warning("reader %s: its GC lease lapsed; segments retired meanwhile may be gone", self.holder)
                since = take_lease(self.store.log.db, self.name, self.holder, self.ttl_s)
            self.held_since = since

    def advance(self) -> None:
        self.renew(advance=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except StoreUnavailable as e:
                log.warning("reader %s: renewing its GC lease failed, retried: %s", self.holder, first_line(e))

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self.held_since is not None:
            try:
                release_lease(self.store.log.db, self.name)
            except TrajstoreError as e:
                log.info("reader %s: lease not released (it lapses by itself): %s", self.holder, first_line(e))

    def __enter__(self) -> "ReaderLease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def sweep(store: _Parts, *, grace_s: float = 3600.0, margin_s: float | None = None,
                    lease_max_age_s: float | None = None) -> list[str]:
    """Delete payload files nothing needs any more; return their names: the
    full sweep, which lists the payload (``trajstore gc``; the steady path,
    driven by the index's retired list without listing, is
    ``collect_retired``, run by the materializer's GC worker).

    Two kinds: log segments retired (every event re-pointed into a sample
    segment by the materializer, or moved by ``compact``) more than
    ``grace_s`` ago, and files no ``segments`` row knows (left by a crashed
    append, materialization or compaction) older than ``grace_s``. A file
    an ``events`` or ``samples`` row names is never deleted, nor one retired
    after the oldest live reader lease's ``held_since`` minus ``margin_s``
    (default: ``grace_s``'s smaller of it and 2 s); a lease protects nothing
    retired more than ``lease_max_age_s`` ago (default ``LEASE_MAX_AGE_S``,
    6 h). The grace protects readers that resolved a locator just before it
    was re-pointed and hold no lease (docs/log.md, "One copy")."""
    # Retirement times are the database's, and so is "now" here: the grace does not
    # depend on this machine's clock agreeing with the retiring one's.
    store.log.retire_unreferenced(time.time())  # ones two concurrent re-pointings each left to the other
    horizon = lease_horizon(store, min(grace_s, GC_MARGIN_S) if margin_s is None else margin_s,
                            LEASE_MAX_AGE_S if lease_max_age_s is None else lease_max_age_s)
    keep = store.log.segments_in_use(retired_before=min(store.log.database_time() - grace_s, horizon))
    removed = store.payload.collect_garbage(keep, grace_s=grace_s)
    store.log.forget_segments(removed)
    store.log.shrink_journal()  # SQLite: the WAL's ~4 MB between checkpoints, given back
    return removed
