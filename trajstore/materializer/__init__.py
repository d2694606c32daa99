"""The materializer: tails the log and folds finished trajectories, exactly once.

One step:
  1. read the next ``max_trajectories`` ``trajectory_finished`` events after this
     shard's checkpoint (positions are gap-free, see ``trajstore.log._dialect``);
  2. keep the trajectories of this shard (crc32 of the id mod ``num_shards``),
     rebuild their generation commands from the log and fold them (pure);
  3. write the samples to one payload segment whose name is a function of
     (shard, positions), atomically renamed into place;
  4. in ONE transaction: insert the sample rows, record the trajectories it
     could not fold (``unfoldable_trajectories``), re-point every folded
     generation event's payload locator to the sample row it was folded into
     (one copy of every token: the event's payload is a set of slices of that
     row, see ``_facts._sample_slices``), retire the log segments no event
     names any more (``trajstore gc`` deletes them after its grace), and move
     the checkpoint to the last finished event read, guarded by the
     checkpoint it started from.

A trajectory with a generation whose ``weight_versions`` labels were not in
the label map when it was appended is folded only once every such label is
mapped: at its ``trajectory_finished`` if they were all mapped before it,
else at the ``trajectory_released`` event the log adds when the last one is
(``trajstore.log._events._write_labels``). Until then it is *held back*: counted
(``num_held_back``), logged with the label, and visible in SQL and ``trajstore
info``; the checkpoint moves on (docs/materializer.md, "Held back on a
version label").

A trajectory that cannot be folded (its payload is unreadable, its index
rows contradict each other, the fold refuses it, a value does not fit the
sample columns) is recorded with the reason and skipped; it never stops the
trajectories after it (docs/materializer.md, "Unfoldable trajectories").
An exception in the fold that is no data rule (a ``TypeError``, a
``KeyError``, ...) is a bug, not the trajectory's fault: it is recorded and
counted apart (``kind = 'internal_error'``, ``num_internal_errors``), logged
with its traceback, and folded again by the next run (and by
``refold_quarantined``) until it folds (docs/materializer.md, "Internal
errors"). Infrastructure errors (``StoreUnavailable``, ``OSError``,
``MemoryError``) still propagate: they are retried by running again, never
recorded.

A payload file that is missing never consumes a trajectory. If the payload
location holds no file at all (an unmounted disk, an empty bucket: the
location, not a file, is wrong) the step fails with ``StoreUnavailable`` and
nothing is recorded. Otherwise the trajectories needing the file are
quarantined (recorded with ``PayloadMissingError``) and the checkpoint moves
on; ``refold_quarantined`` (``trajstore materialize --refold-quarantined``)
folds them once the file is back (docs/materializer.md, "Quarantine").

A crash before 4 leaves at most an unreferenced segment that the re-run
rewrites with the same bytes (and every event still in the log); a crash
after 4 has nothing to redo. Two
materializers of one shard race on the guard and one of them wins. Memory is
bounded by one batch: the log is streamed, never loaded whole.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from trajstore._util.deprecated import renamed
from trajstore._upkeep.gc import GC_INTERVAL_S, GC_MARGIN_S, compact_run_aggregates
from trajstore._append import facts
from trajstore.errors import (ConflictError, CorruptStoreError, PayloadMissingError, StoreUnavailable, TrajstoreError,
                              ValidationError, first_line)
from trajstore.events import decimal_label
from trajstore.fold import DEFAULT_POLICY, FoldMetrics, FoldPolicy, FoldResult, fold
from trajstore.log.base import DATA_ERROR, INTERNAL_ERROR, SAMPLES_KIND, Repoint, Shard, StaleState, shard_index_of
from trajstore.payload import SegmentRows
from trajstore.payload._format import SegmentKind, rows_per_batch
from trajstore.sample import Sample
from trajstore.sample._codec import SAMPLE_BATCH_BYTES, RoutesPlan, sample_table
from trajstore.log._aggregate_counts import sample_counts
from trajstore.log._aggregates import sample_every

__all__ = ["Materializer", "MaterializeStats", "shard_of"]

log = logging.getLogger(__name__)

# Errors that mean "this trajectory's data cannot be folded": the rules the fold and the
# readers of the index raise on purpose, and a stored value that does not fit the sample's
# int32 columns (an old SQLite store may hold one). Any other exception from the fold is a
# bug (INTERNAL_ERROR, retried), and "the store cannot be reached right now"
# (_INFRASTRUCTURE_ERRORS) propagates so the run is retried.
_DATA_ERRORS = (ValidationError, CorruptStoreError, OverflowError)
_INFRASTRUCTURE_ERRORS = (StoreUnavailable, OSError, MemoryError)
_MAX_MESSAGE = 1000  # characters of the reason kept in unfoldable_trajectories.message
_INTERNAL_RETRY_S = 300.0  # a long-running materializer retries its internal errors this often
_SETTING_TTL_S = 10.0  # a long-running materializer reads the expert-load sampling stride this often


def shard_of(trajectory_id: str, num_shards: int) -> int:
    return shard_index_of(trajectory_id, num_shards)


@dataclass
class MaterializeStats:
    """docs/reference.md metrics of one materialization, plus what it covered."""

    metrics: FoldMetrics = field(default_factory=FoldMetrics)
    num_trajectories: int = 0  # trajectories folded into samples
    position: int = 0  # checkpoint after the run
    num_unfoldable: int = 0  # trajectories recorded in unfoldable_trajectories for their data, and skipped
    num_held_back: int = 0  # finished trajectories passed while a version label they use is unmapped
    num_internal_errors: int = 0  # trajectories the fold failed on with a bug (recorded apart, retried)

    @property
    def num_steps_before(self) -> int:
        return self.metrics.num_steps_before

    @property
    def num_samples_after(self) -> int:
        return self.metrics.num_samples_after

    @property
    def merge_ratio(self) -> float:
        return self.metrics.merge_ratio

    @property
    def prefix_mismatch_count(self) -> int:
        return self.metrics.prefix_mismatch_count

    def to_dict(self) -> dict[str, Any]:
        return {**self.metrics.to_dict(), "num_trajectories": self.num_trajectories,
                "num_unfoldable": self.num_unfoldable, "num_held_back": self.num_held_back,
                "num_internal_errors": self.num_internal_errors, "position": self.position}

    def __add__(self, later: "MaterializeStats") -> "MaterializeStats":
        """This run followed by ``later`` (position: the later checkpoint)."""
        if not isinstance(later, MaterializeStats):
            return NotImplemented
        return MaterializeStats(self.metrics + later.metrics, self.num_trajectories + later.num_trajectories,
                                later.position, self.num_unfoldable + later.num_unfoldable,
                                self.num_held_back + later.num_held_back,
                                self.num_internal_errors + later.num_internal_errors)


class Materializer:
    def __init__(
        self,
        store,
        *,
        shard_index: int = 0,
        num_shards: int = 1,
        max_trajectories: int = 256,
        max_batch_tokens: int = 262_144,
        progress: Callable[[int], None] | None = None,
        batch_size: int | None = None,
        projection: str | None = None,
    ) -> None:
        """``max_trajectories``: finished trajectories folded per step (one
        transaction), cut earlier at ``max_batch_tokens`` tokens.
        ``batch_size`` is its old name (deprecated). ``projection``: fold into
        that named projection (its policy, samples and checkpoints) instead of
        the default samples (docs/projections.md). ``shard_index`` of
        ``num_shards`` (``Shard``): a ``ValidationError`` unless
        ``0 <= shard_index < num_shards``."""
        max_trajectories = renamed("batch_size", "max_trajectories", batch_size, max_trajectories, 256)
        self.shard = Shard(shard_index, num_shards)  # validates them (ValidationError, rule "shard")
        self.store = store
        self.shard_index = shard_index
        self._num_experts: dict[str, int | None] = {}  # the last folded batch's trajectories' num_experts
        self._calls_of: dict[str, list[dict[str, Any]]] = {}  # and their generation event rows (the commit's counts)
        self.num_shards = num_shards
        self.max_trajectories = max_trajectories
        self.max_batch_tokens = max_batch_tokens
        self.progress = progress
        self.projection = projection
        self._internal_retry_at = 0.0  # time.monotonic() when run() next retries internal errors
        self._every: tuple[float, int] | None = None  # (time.monotonic() read, the expert-load sampling stride)
        if projection is None:
            self.index = store.materialized
            self.policy = DEFAULT_POLICY
            self._segment_prefix = SegmentKind.SAMPLES.prefix
        else:
            self.index = store.materialized.projection(projection)
            row = self.index.row
            self.policy = FoldPolicy(row["merge"], row["observation"], row["routes"])
            self._segment_prefix = f"{SegmentKind.SAMPLES.prefix}{row['token']}-"

    def pending(self, *, all_shards: bool = False) -> int:
        """Finished trajectories of this shard after its checkpoint: its backlog,
        what per-shard scaling looks at. ``all_shards``: every shard's finished
        trajectories after this shard's checkpoint (the count before sharding
        was taken into account)."""
        after = self._checkpoint()[0]
        if all_shards or self.num_shards == 1:
            return self.store.log.count_events(after_position=after, types=["trajectory_finished", "trajectory_released"])
        return sum(1 for tid in self.store.log.finished_ids_after(after) if self.shard.owns(tid))

    def run(self, *, max_steps: int | None = None, compact: bool = True) -> MaterializeStats:
        """Fold until nothing finished is pending (or ``max_steps`` batches).

        The checkpoint is read once and then carried from step to step (each
        commit is guarded by it: a stale one costs a re-read, never a wrong
        commit); a step that found fewer finished trajectories than it could
        take ends the run without asking again. ``compact``: a run that folded
        something then folds the run aggregates' delta rows into their totals
        (``trajstore._upkeep.gc.compact_run_aggregates``, its own transactions, after
        the commits; ``follow`` leaves it to its GC worker)."""
        position, cumulative = self._checkpoint()
        stats = MaterializeStats(position=position)
        if self.projection is None and time.monotonic() >= self._internal_retry_at:
            # trajectories a bug kept from folding: once the code is fixed they fold here
            self._internal_retry_at = time.monotonic() + _INTERNAL_RETRY_S
            stats = stats + self._refold(None, INTERNAL_ERROR, position)
        steps = 0
        while max_steps is None or steps < max_steps:
            outcome = self._step(position, cumulative)
            if outcome is None:
                break
            done, after = outcome
            stats = stats + done
            steps += 1
            if self.progress:
                # trajectories this step took
                self.progress(done.num_trajectories + done.num_unfoldable + done.num_held_back + done.num_internal_errors)
            if after is None:  # lost the race for this batch: read the checkpoint again
                position, cumulative = self._checkpoint()
            elif after[0]:
                position, cumulative = done.position, after[1]
            else:
                break
        if compact and self.projection is None and (stats.num_trajectories or stats.num_internal_errors):
            self._compact(stats)
        return stats

    def _compact(self, stats: MaterializeStats) -> None:
        """Compact the run aggregates after commits that landed: a failure is logged, not raised (the fold
        and its counts stand, the delta rows are summed at read time, and the next compaction folds them)."""
        try:
            compact_run_aggregates(self.store)
        except TrajstoreError as e:
            log.warning("materializer %s: folded %d trajectories; compacting the run aggregates failed, left to the "
                        "next compaction: %s", self.shard, stats.num_trajectories, first_line(e))

    def step(self) -> MaterializeStats | None:
        """Fold one batch; None when nothing is pending."""
        outcome = self._step(*self._checkpoint())
        return None if outcome is None else outcome[0]

    def _step(self, position: int, cumulative: FoldMetrics
              ) -> tuple[MaterializeStats, tuple[bool, FoldMetrics] | None] | None:
        """Fold the batch after checkpoint ``(position, cumulative)``. None when
        nothing finished is pending; else its stats and, once committed, whether
        more may be pending and the checkpoint's metrics (None: another
        materializer committed this batch first)."""
        finished = self.store.log.finished_after(position, self.max_trajectories)
        if not finished:
            return None
        more = len(finished) >= self.max_trajectories
        kept, mine = self._within_budget(finished)
        more = more or len(kept) < len(finished)
        finished = kept
        folded, unfoldable, gen_rows, held = self._fold(mine)
        last = finished[-1]["position"]
        seg_name = (f"{self._segment_prefix}{self.shard_index}of{self.num_shards}-{position + 1:012d}-{last:012d}"
                    f"{SegmentKind.SAMPLES.suffix}")
        samples = [s for r in folded.values() for s in r.samples]
        calls = [c for r in folded.values() for c in r.calls_per_sample]
        metrics = sum((r.metrics for r in folded.values()), FoldMetrics())
        finished_at = {e["trajectory_id"]: e["position"] for e in mine}
        seg_row, sample_rows = self._write(seg_name, samples, calls, finished_at)
        # a projection's samples are a second view: the default samples keep the one copy
        repoints = _repoints(seg_name, folded, gen_rows) if self.projection is None else []
        # the run view's counts of the default samples (the expert load of one decode route in
        # ``every``, from the routes just written, still in memory), in the commit that stores them
        aggregates = self._counts(samples) if self.projection is None else None
        now = time.time()
        unfoldable_rows = [_unfoldable_row(tid, finished_at[tid], self.shard, err, now)
                           for tid, err in unfoldable.items()]
        checkpoint = {"position": last, **(cumulative + metrics).to_dict()}
        checkpoint.pop("merge_ratio")
        try:
            self.index.commit_samples(self.shard, sample_rows, seg_row, checkpoint, position,
                                      unfoldable_rows=unfoldable_rows, repoints=repoints, aggregates=aggregates,
                                      trajectories=[e["trajectory_id"] for e in mine], calls_of=self._calls_of)
        except StaleState:
            # another materializer did this batch
            return MaterializeStats(position=self._checkpoint()[0]), None
        _log_unfoldable(self.shard, unfoldable_rows, unfoldable)
        for tid, label in held.items():
            log.info("materializer %s: trajectory %r held back until version label %r is mapped "
                     "(a version_label event)", self.shard, tid, label)
        internal = sum(1 for r in unfoldable_rows if r["kind"] == INTERNAL_ERROR)
        return (MaterializeStats(metrics, len(folded), last, len(unfoldable) - internal, len(held), internal),
                (more, cumulative + metrics))

    def abandon_idle(self, idle_s: float, *, limit: int = 1000) -> list[str]:
        """Finish this shard's running trajectories idle for more than ``idle_s`` seconds
        (no event appended since) with status ``"abandoned"``; return their ids.

        A harness that died, or lost a conflict to a second writer, leaves its
        trajectory running forever: nothing folds it. Each is finished with an
        ordinary ``trajectory_finished`` event (status ``abandoned``), so it folds
        like any other and SQL, ``trajstore info`` and the report show it. One
        its harness finished meanwhile is left as its harness finished it; a
        call that arrives for an abandoned trajectory is refused (finished
        trajectory), never dropped. The idle time is measured against the
        appending processes' clocks: keep ``idle_s`` well above the longest
        pause of a live episode (a tool call, a human turn)."""
        if not (math.isfinite(idle_s) and idle_s > 0):
            raise ValidationError(f"the idle time before abandoning must be a finite number > 0, not {idle_s}",
                                  rule="abandon_after_s")
        if self.projection is not None:
            raise ValidationError("abandoning idle trajectories writes the log; run it without a projection",
                                  rule="abandon_after_s")
        out = []
        for tid in self.store.log.idle_running(time.time() - idle_s, limit):
            if not self.shard.owns(tid):
                continue
            try:
                self.store.append([{"type": "trajectory_finished", "trajectory_id": tid, "status": "abandoned"}])
            except (ConflictError, ValidationError) as e:  # its harness finished it meanwhile
                log.info("materializer %s: trajectory %r was not abandoned: %s", self.shard, tid, e)
                continue
            log.warning("materializer %s: trajectory %r had no event for over %gs: finished as abandoned",
                        self.shard, tid, idle_s)
            out.append(tid)
        return out

    def follow(self, stop: threading.Event, *, poll_s: float = 1.0, gc_grace_s: float | None = GC_MARGIN_S,
               gc_interval_s: float = GC_INTERVAL_S, on_step: Callable[[MaterializeStats], None] | None = None,
               abandon_after_s: float | None = None, unavailable_timeout_s: float | None = None) -> None:
        """Fold as trajectories finish until ``stop`` is set (a step is one
        transaction: stopping between steps loses nothing), and collect garbage.

        Garbage is collected by a ``trajstore._upkeep.gc.GcWorker`` in its own thread,
        started here and stopped on return: never inside this fold loop (a slow
        or stalled object store does not stop folding). Every ``gc_interval_s``
        it deletes the segments the index lists as retired before the GC
        horizon: ``gc_grace_s`` (the margin) before now, or before the oldest
        live reader lease (docs/materializer.md, "Garbage collection"), so one
        copy of every folded token is the state at rest without an operator.
        ``gc_grace_s`` None: no collection (another process does it). Only shard
        0 collects unless told otherwise (several collectors are safe, one is
        enough). ``on_step``: called with the stats of each step that folded or
        recorded something. ``abandon_after_s``: finish running trajectories
        idle that long as ``abandoned`` (:meth:`abandon_idle`), checked every
        tenth of it (1 to 60 s); None (the default): never. An unreachable store
        (a database restart) is waited out, one log line per wait, for up to
        ``unavailable_timeout_s`` per outage (None: as long as it takes;
        ``trajstore.materializer._follow``)."""
        from trajstore.materializer._follow import follow

        follow(self, stop, poll_s=poll_s, gc_grace_s=gc_grace_s, gc_interval_s=gc_interval_s, on_step=on_step,
               abandon_after_s=abandon_after_s, unavailable_timeout_s=unavailable_timeout_s)

    def refold_quarantined(self) -> MaterializeStats:
        """Fold this shard's quarantined trajectories (recorded with
        ``PayloadMissingError``) whose payload is back, and the ones a bug kept
        from folding (``kind = 'internal_error'``) that fold now; the ones still
        missing (or still failing with a bug) stay recorded, the ones that now
        fail otherwise are recorded with that reason. Their samples keep the
        trajectories' finished positions, which are behind the checkpoint: a
        ``SampleReader`` whose cursor passed them does not see them, a new one
        does. Returns what was folded (``position``: this shard's checkpoint,
        unchanged). The run aggregates are compacted after (as ``run`` does)."""
        stats = self._refold(PayloadMissingError.__name__, DATA_ERROR) + self._refold(None, INTERNAL_ERROR)
        if stats.num_trajectories:
            self._compact(stats)
        return stats

    def _refold(self, error: str | None, kind: str, position: int | None = None) -> MaterializeStats:
        """Fold again this shard's trajectories recorded with ``kind`` and ``error``
        (None: any); see ``refold_quarantined``. The default samples only.
        ``position``: this shard's checkpoint, when the caller has just read it."""
        rows = [r for r in self.store.materialized.quarantined(error, kind=kind) if self.shard.owns(r["trajectory_id"])]
        stats = MaterializeStats(position=self._checkpoint()[0] if position is None else position)
        for k in range(0, len(rows), self.max_trajectories):
            part = rows[k:k + self.max_trajectories]
            status = self.store.log.finished_status([r["trajectory_id"] for r in part])
            finished = [{"position": int(r["finished_position"]), "trajectory_id": r["trajectory_id"],
                         "status": status.get(r["trajectory_id"])} for r in part]
            folded, unfoldable, gen_rows, held = self._fold(finished)
            # still failing the same way, or waiting on a version label: both stay recorded for the next refold
            if kind == INTERNAL_ERROR:
                still = {tid for tid, e in unfoldable.items() if _kind_of(e) == INTERNAL_ERROR}
            else:
                still = {tid for tid, e in unfoldable.items() if isinstance(e, PayloadMissingError)}
            still |= set(held)
            again = [_unfoldable_row(tid, 0, self.shard, e, 0.0) for tid, e in unfoldable.items()
                     if tid in still and _kind_of(e) == INTERNAL_ERROR]
            _log_unfoldable(self.shard, again, unfoldable, retried=True)
            stats = stats + MaterializeStats(position=stats.position, num_internal_errors=len(again))
            attempted = [f["trajectory_id"] for f in finished if f["trajectory_id"] not in still]
            if not attempted:
                continue
            first, last = finished[0]["position"], finished[-1]["position"]
            seg_name = (f"{SegmentKind.SAMPLES.prefix}{self.shard_index}of{self.num_shards}-refold-{first:012d}-"
                        f"{last:012d}-{uuid.uuid4().hex[:12]}{SegmentKind.SAMPLES.suffix}")
            samples = [s for r in folded.values() for s in r.samples]
            calls = [c for r in folded.values() for c in r.calls_per_sample]
            finished_at = {f["trajectory_id"]: f["position"] for f in finished}
            seg_row, sample_rows = self._write(seg_name, samples, calls, finished_at)
            now = time.time()
            failed = [_unfoldable_row(tid, finished_at[tid], self.shard, err, now)
                      for tid, err in unfoldable.items() if tid not in still]
            try:
                self.store.materialized.commit_refold(error, attempted, sample_rows, seg_row, failed,
                                                      _repoints(seg_name, folded, gen_rows), kind=kind,
                                                      aggregates=self._counts(samples))
            except StaleState:
                if seg_row is not None:
                    self.store.payload.delete(seg_name)  # another refold took them: nothing names this file
                continue
            _log_unfoldable(self.shard, failed, unfoldable)
            internal = sum(1 for r in failed if r["kind"] == INTERNAL_ERROR)
            metrics = sum((r.metrics for r in folded.values()), FoldMetrics())
            stats = stats + MaterializeStats(metrics, len(folded), stats.position, len(failed) - internal,
                                             num_internal_errors=internal)
            log.info("materializer %s: re-folded %d trajectories recorded as %s (%d still recorded)",
                     self.shard, len(folded), error or kind, len(still))
        return stats

    def _counts(self, samples: list[Sample]) -> dict[str, Any]:
        """The run view's counts of ``samples`` (their trajectories: the last ``_fold``'s): the
        logprob histogram and the expert load of one decode route in the store's sampling
        stride, counted from the routes as written (no read back)."""
        now = time.monotonic()
        if self._every is None or now - self._every[0] > _SETTING_TTL_S:
            with self.store.log.db.reading("reading the expert-load sampling") as conn:
                self._every = (now, sample_every(conn))
        return sample_counts(samples, self._num_experts, every=self._every[1])

    def _checkpoint(self) -> tuple[int, FoldMetrics]:
        cp = self.index.load_checkpoint(self.shard)
        if cp is None:
            return 0, FoldMetrics()
        return int(cp["position"]), FoldMetrics(
            int(cp["num_steps_before"]), int(cp["num_samples_after"]), int(cp["prefix_mismatch_count"])
        )

    def _within_budget(self, finished: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Cut the batch after the trajectory that reaches ``max_batch_tokens``
        (memory is bounded by the batch, not by the log); return it and this
        shard's part of it."""
        tokens, keep = 0, len(finished)
        for k, e in enumerate(finished):
            if e["seq_len"] is not None and self.shard.owns(e["trajectory_id"]):
                tokens += int(e["seq_len"])
                if tokens >= self.max_batch_tokens:
                    keep = k + 1
                    break
        finished = finished[:keep]
        return finished, [e for e in finished if self.shard.owns(e["trajectory_id"])]

    def _fold(self, finished: list[dict[str, Any]]
              ) -> tuple[dict[str, FoldResult], dict[str, BaseException], dict[str, list[dict[str, Any]]],
                         dict[str, str]]:
        """Fold each trajectory; the ones that cannot be folded are returned
        apart with their error, and the others are unaffected. Also returns
        each folded trajectory's generation rows (seq order), and the ones
        held back with the version label they wait for."""
        folded: dict[str, FoldResult] = {}
        unfoldable: dict[str, BaseException] = {}
        gen_rows_of: dict[str, list[dict[str, Any]]] = {}
        self._calls_of = {}
        ids = [e["trajectory_id"] for e in finished]
        if not ids:
            return folded, unfoldable, gen_rows_of, {}
        held: dict[str, str] = {}
        label_maps: dict[str, dict[str, int]] = {}
        foldable = []
        waiting = self.store.log.pending_labels(ids)
        for fin in finished:
            tid = fin["trajectory_id"]
            labels = waiting.get(tid, {})
            # Every label mapped before this event's position, else the trajectory folds at a
            # later one (its trajectory_released): positions decide, so a re-run decides the same.
            late = sorted(label for label, m in labels.items() if m is None or m[1] >= fin["position"])
            if late:
                held[tid] = late[0]
            else:
                label_maps[tid] = {label: m[0] for label, m in labels.items() if m is not None}
                foldable.append(fin)
        held = {tid: label for tid, label in held.items() if tid not in label_maps}  # released in this batch
        finished = foldable
        ids = [e["trajectory_id"] for e in finished]
        if not ids:
            return folded, unfoldable, gen_rows_of, held
        held_calls = self.store.log.held_generations([t for t in ids if waiting.get(t)]) if waiting else {}
        trajs, events = self.store.log.fold_inputs(ids)
        self._num_experts = {tid: t["num_experts"] for tid, t in trajs.items()}  # for the run view's counts
        if held_calls:
            # A held call resolves whole: the labels it waited for and the ones mapped before it
            # (never re-mapped, so reading them now decides the same as any re-run).
            named = {label for tid, positions in held_calls.items() for r in events.get(tid, ())
                     if r["position"] in positions for label in _labels_named(r.get("weight_versions"))}
            mapped = self.store.log.load_labels(named)
            for tid in held_calls:
                label_maps[tid] = {**mapped, **label_maps[tid]}
        tables, bad_segments = self._read_segments([r for rows in events.values() for r in rows])
        if bad_segments:
            # A compaction may have moved these events, and a GC with a short grace deleted
            # the old file, between resolving the locators and opening it: resolve once more.
            trajs, events = self.store.log.fold_inputs(ids)
            tables, bad_segments = self._read_segments([r for rows in events.values() for r in rows])
        # each trajectory's generation rows, as read last (their locators): the fold's, and the commit's counts'
        self._calls_of = {tid: [r for r in rows if r["type"] == "generation"] for tid, rows in events.items()}
        if any(isinstance(e, PayloadMissingError) for e in bad_segments.values()) \
                and not self.store.payload.holds_any():
            raise StoreUnavailable(f"payload location {self.store.payload.location!r} holds no file (not mounted, "
                                   f"or the wrong place?): {len(bad_segments)} segment(s) missing; nothing folded "
                                   "or recorded")
        plan = RoutesPlan()  # routes built only as the sample segment is written
        for fin in finished:
            tid = fin["trajectory_id"]
            traj, rows = trajs.get(tid), events[tid]
            try:
                if traj is None:
                    raise CorruptStoreError(f"trajectory {tid!r} is finished in the log but has no row")
                gen_rows = self._calls_of[tid]
                for r in gen_rows:
                    if r["segment"] in bad_segments:
                        raise bad_segments[r["segment"]]
                gens = facts.generations_from_log(
                    gen_rows, tables,
                    (traj["route_layers"], traj["route_topk"]) if traj["route_layers"] else None,
                    label_maps[tid], held_calls.get(tid, ()),
                )
                if self.policy.routes == "last":
                    _check_last_routes_stored(tid, gen_rows)
                rewards = [r["reward"] for r in rows if r["type"] == "reward"]
                folded[tid] = fold(gens, trajectory_id=tid, group_id=traj["group_id"], status=fin["status"],
                                   final_reward=rewards[-1] if rewards else None, num_experts=traj["num_experts"],
                                   routes_alloc=plan, policy=self.policy)
                gen_rows_of[tid] = gen_rows
            except _INFRASTRUCTURE_ERRORS:
                raise
            except Exception as e:  # noqa: BLE001 - a data rule or a bug: told apart by _kind_of
                unfoldable[tid] = e
        return folded, unfoldable, gen_rows_of, held

    def _read_segments(self, rows: list[dict[str, Any]]
                       ) -> tuple[dict[str, SegmentRows], dict[str, BaseException]]:
        """The payload rows ``rows`` point at, one read per segment; a segment
        that is missing or unreadable is returned apart with its error."""
        wanted: dict[str, list[int]] = {}
        for r in rows:
            if r["segment"] is not None:
                wanted.setdefault(r["segment"], []).append(int(r["segment_row"]))
        return self.store.payload.read_many(wanted)

    def _write(self, name: str, samples: list[Sample], calls: list[int], finished_at: dict[str, int]):
        if not samples:
            return None, []
        deferred: list = []
        table = sample_table(samples, deferred=deferred)
        # Record batches of ~16 MB: an uncompressed Arrow segment is read through a
        # memory map, so a reader pays nothing for the rows of a batch it does not
        # use, and fewer batches mean less per-batch work on both sides (a remote
        # store reads whole batches: 16 MB bounds what one sample costs there).
        size = self.store.payload.write_samples(name, table, rows_per_batch(table, SAMPLE_BATCH_BYTES),
                                                deferred=deferred)
        now = time.time()
        seg_row = {"name": name, "kind": "samples", "num_rows": len(samples), "num_bytes": size, "created_at": now}
        return seg_row, [_sample_row(s, i, name, finished_at[s.trajectory_id], c, now)
                         for i, (s, c) in enumerate(zip(samples, calls))]


def _labels_named(weight_versions: Any) -> set[str]:
    """The labels of a generation row's spans that only the label map resolves."""
    spans = facts.weight_versions_from_json(weight_versions) or ()
    return {label for label, _, _ in spans
            if isinstance(label, str) and label != "default" and decimal_label(label) is None}


def _check_last_routes_stored(trajectory_id: str, gen_rows: list[dict[str, Any]]) -> None:
    """``routes="last"`` needs the rows a call re-sent for recorded positions, which
    admission does not store (only their count, ``route_rows_resent``, and how many
    differed from the recorded ones, ``route_rows_drifted``). They are known exactly
    when none differed: then they equal the recorded rows. Otherwise the samples
    would be made of rows that are not there, so the trajectory is refused."""
    for r in gen_rows:
        resent = r.get("route_rows_resent")
        if resent is None and r.get("num_route_rows_sent") is not None and r.get("num_route_rows") is not None:
            resent = int(r["num_route_rows_sent"]) - int(r["num_route_rows"])
        if resent and r.get("route_rows_drifted") != 0:
            drifted = r.get("route_rows_drifted")
            raise ValidationError(
                f"generation seq {r['seq']} re-sent {resent} route rows that the store did not keep and "
                + (f"{drifted} of them differed from the recorded ones" if drifted is not None
                   else "were appended before drift was measured")
                + ": routes='last' cannot be folded from the stored facts",
                trajectory_id=trajectory_id, rule="routes_not_stored")


def _repoints(segment: str, folded: dict[str, FoldResult], gen_rows: dict[str, list[dict[str, Any]]]
              ) -> list[Repoint]:
    """Every folded generation event -> the sample row it was folded into.

    Samples are written in ``folded`` order; sample k of a trajectory merged
    the next ``calls_per_sample[k]`` generation events (seq order). Events
    already pointing at a sample row (a re-fold) are left alone."""
    out: list[Repoint] = []
    row = 0
    for tid, result in folded.items():
        events = iter(gen_rows[tid])
        for calls in result.calls_per_sample:
            for _ in range(calls):
                e = next(events)
                if e["segment"] is not None and e.get("segment_kind") is None:
                    out.append(Repoint(int(e["position"]), segment, row, SAMPLES_KIND,
                                       e["segment"], int(e["segment_row"])))
            row += 1
    return out


def _kind_of(error: BaseException) -> str:
    """``DATA_ERROR`` for a data rule the fold (or a reader of the index) raised on
    purpose, ``INTERNAL_ERROR`` for anything else: a bug in trajstore."""
    return DATA_ERROR if isinstance(error, _DATA_ERRORS) else INTERNAL_ERROR


def _log_unfoldable(shard: Shard, rows: list[dict[str, Any]], errors: dict[str, BaseException], *,
                    retried: bool = False) -> None:
    """A warning per trajectory recorded for its data; an error with the traceback per
    internal error (a bug: the traceback is what fixing it needs)."""
    for row in rows:
        tid = row["trajectory_id"]
        if row["kind"] == INTERNAL_ERROR:
            err = errors[tid]
            log.error("materializer %s: internal error folding trajectory %r (a bug, not its data)%s: %s: %s; "
                      "recorded as internal_error, folded again by the next run", shard, tid,
                      " again" if retried else "", row["error"], row["message"],
                      exc_info=(type(err), err, err.__traceback__))
        else:
            log.warning("materializer %s: trajectory %r cannot be folded, recorded and skipped: %s: %s",
                        shard, tid, row["error"], row["message"])


def _unfoldable_row(trajectory_id: str, finished_position: int, shard: Shard, error: BaseException,
                    now: float) -> dict[str, Any]:
    message = " ".join(str(error).split()) or type(error).__name__
    return {
        "kind": _kind_of(error),
        "trajectory_id": trajectory_id,
        "finished_position": finished_position,
        "shard": str(shard),
        "error": type(error).__name__,
        "rule": getattr(error, "rule", None),
        "message": message[:_MAX_MESSAGE],
        "created_at": now,
    }


def _sample_row(s: Sample, row: int, segment: str, finished_position: int, num_calls: int,
                now: float) -> dict[str, Any]:
    mask = s.routed_experts_mask
    return {
        "trajectory_id": s.trajectory_id,
        "sample_index": s.sample_index,
        "finished_position": finished_position,
        "group_id": s.group_id,
        "status": s.status,
        "is_last_step": s.is_last_step,
        "prompt_len": len(s.prompt_ids),
        "response_len": len(s.response_ids),
        "num_loss_tokens": int(s.loss_mask.sum()),
        "num_merged_calls": num_calls,
        "reward": s.reward,
        "finish_reason": s.finish_reason,
        "min_model_version": s.min_model_version,
        "max_model_version": s.max_model_version,
        "num_route_rows": None if mask is None else int(len(mask) - mask.sum()),
        "segment": segment,
        "segment_row": row,
        "created_at": now,
    }
