"""The trainer's reader: a resumable cursor over materialized samples.

This module holds ``SampleReader``: reading sample rows and payload, steps,
the resume state. Around it: ``_reader_config.py`` (``ReaderConfig``,
``ReaderStats``, re-exported here), ``_reader_state.py`` (the state's format
and validation), ``_batch_plan.py`` (the pure planning: units, steps,
``plan_step``, importable from here too) and ``_policies.py`` (the sampling
policies, re-exported here).

Order. Samples have a stable order, ``(finished_position, sample_index)``.
The reader turns it into a global sequence of *units* (one sample, or with
``keep_groups`` one whole GRPO group) whose key is the order key of its last
row, so the unit sequence only grows at the end as the store grows: it is
prefix-stable.

Steps. Every rank computes the same global steps from the same unit
sequence: with the default ``fifo`` policy step i takes the next prefix of
units that packs into ``world_size`` batches (``plan_step``) and gives rank r
batch r; another policy picks each step's units from a pool of the next
units (``_policies``). A rank reads all rows' metadata (small SQL rows) but
loads payload only for its own batch.

State. The global cursor (key of the last consumed unit, or the last one a
policy's pool took in), for groups where to rescan to rebuild groups still
open at the cursor, and a policy's pool. Because a fifo step always consumes
a prefix of the unit sequence, its state taken after any step resumes with
any world size or batch size without losing or repeating a unit. Every
rank's ``state_dict()`` is the same; save any one. See docs/reader.md for
the reasoning and its limits.

Watermark. Only rows at ``finished_position <= min(checkpoint of every
materializer shard)`` are read: below it nothing can appear later, so what
the reader has seen is a prefix of what it will ever see.

An unavailable store. Every read of the store (``_retrying``) is retried
with backoff while it raises ``StoreUnavailable`` (a database restarting, a
replay server's database down), for up to ``unavailable_timeout_s``, with
one log line when the wait starts and one when it ends; only then does the
error reach the trainer. An iteration that raised resumes, at the next
``next()``, after the last batch it handed out: it never ends as if the data
were exhausted. Opening a store by URL and ``record_step`` wait the same way
(``_reader_patience``).
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from trajstore.reader import _state as _reader_state
from trajstore.reader._plan import Key, Step, Unit, UnitBuilder, plan_step, row_key
from trajstore._util.deprecated import renamed
from trajstore.reader._patience import Patient
from trajstore.rollout._ledger import reader_lookup
from trajstore.reader._lease import ReadLease, holder as _lease_holder
from trajstore.reader._read_ahead import ReadAhead as _ReadAhead, read_ahead as _read_ahead
from trajstore.reader._policies import (IDLE, FifoPolicy, FreshnessPolicy, ReadyFirstPolicy, ReusePolicy, SamplingPolicy,
                                 pooled_steps)
from trajstore.reader._config import ReaderConfig, ReaderStats, _settings
from trajstore.reader._seam import ReaderEventLog, ReaderPayload, ReaderSampleIndex, ReaderStore
from trajstore.reader._state import STATE_FORMAT, STATE_FORMAT_VERSION
from trajstore.sample._codec import read_segment_samples
from trajstore.errors import ProjectionChangedError, TrajstoreError, ValidationError
from trajstore.sample import Sample

__all__ = ["FifoPolicy", "FreshnessPolicy", "ReadyFirstPolicy", "ReaderConfig", "ReaderEventLog", "ReaderPayload",
           "ReaderSampleIndex", "ReaderStats", "ReaderStore", "ReusePolicy", "SampleReader", "SamplingPolicy"]

_log = logging.getLogger("trajstore.reader")

_CLOSE_WAIT_S = 120.0  # longest close() waits for reads under way (they give up once it is closing)


class SampleReader(Patient):
    """Batches (lists of ``Sample``) for one data-parallel rank, in the global step order.

    ``store`` is a ``Store``, a store URL, or any ``ReaderStore`` (the five reads
    the reader makes; ``ReplayStore`` is one). Settings are the fields of
    ``ReaderConfig`` as keywords (``reader.config`` holds them)::

        reader = SampleReader(store, rank=r, world_size=w, batch_size=8, keep_groups=True, group_size=4)
        for batch in reader:                 # list[Sample]
            ...
            reader.current_model_version = step    # staleness is judged against this
            save(reader.state_dict())        # small JSON; the same on every rank

    ``current_model_version`` is the trainer's policy version; with
    ``max_staleness`` a unit is skipped when its oldest token is older than
    ``current_model_version - max_staleness`` (counted in ``stats``). Set it
    between batches. ``current_version`` is its old, deprecated name.

    ``policy`` chooses which ready units each step takes: ``"fifo"`` (the
    default), ``"ready_first"``, ``"freshness"``, ``"reuse"``, or a policy
    object (``ReusePolicy(max_uses=2)``, ...); docs/reader.md, "Sampling policies".

    A ``ReaderConfig`` as the second argument (its fields overridden by the
    keywords) still works but is deprecated: one way to say the settings, the
    one the README shows. Code holding a ``ReaderConfig`` passes
    ``**dataclasses.asdict(config)``.
    """

    def __init__(self, store: ReaderStore | str, config: ReaderConfig | None = None, *, rank: int = 0,
                 world_size: int = 1,
                 current_model_version: int | None = None, payload: str | None = None,
                 current_version: int | None = None, **fields: Any) -> None:
        if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValidationError(f"rank {rank!r} not in [0, world_size={world_size!r})", rule="reader_config")
        self.config = ReaderConfig(**_settings(type(self).__name__, config, fields))
        self.rank, self.world_size = rank, world_size
        self.stats = ReaderStats()
        self._patience_init()
        self._owns_store = isinstance(store, str)
        if self._owns_store:
            from trajstore.log._errors import transient_opening
            from trajstore.store import connect

            url = store  # opening waits out a server down or restarting, as reading does
            store = self._retrying("opening the store", lambda: connect(url, payload=payload, migrate=False,
                                                                        create=False), transient_opening)
        self.store: ReaderStore = store
        # the sample index read: the default samples, or a named projection's
        name = self.config.projection
        self._index: ReaderSampleIndex = (store.materialized if name is None else
                       self._retrying("opening the projection", lambda: store.materialized.projection(name)))
        self.current_model_version = renamed("current_version", "current_model_version", current_version,
                                             current_model_version, None)
        self._cursor: Key | None = None
        self._scan_from: Key | None = None
        self._snapshot: int | None = None
        self._steps_gen: Iterator[Step] | None = None
        self._batches: Iterator[tuple[int, list[Sample]]] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pipelines: set[_ReadAhead] = set()  # the read-ahead of iterations under way
        self._explained = False  # the reason for yielding nothing is logged once
        self._open_groups: dict[str, list[Any]] = {}
        self._policy_pool: dict[Key, int] = {}  # a pooled policy's units at the committed state: key -> uses
        # the GC lease over the sample segments of the pages read and not yet handed over (taken at the first page)
        self._lease = ReadLease(store, _lease_holder(rank, world_size))

    @property
    def current_version(self) -> int | None:
        """Deprecated name of ``current_model_version``."""
        warnings.warn("current_version is deprecated; use current_model_version (same meaning)",
                      DeprecationWarning, stacklevel=2)
        return self.current_model_version

    @current_version.setter
    def current_version(self, value: int | None) -> None:
        warnings.warn("current_version is deprecated; use current_model_version (same meaning)",
                      DeprecationWarning, stacklevel=2)
        self.current_model_version = value

    # -- iteration ---------------------------------------------------------
    def __iter__(self) -> "SampleReader":
        return self

    def __next__(self) -> list[Sample]:
        if self._batches is None:
            self._batches = self.iter_steps()
        try:
            return next(self._batches)[1]
        except StopIteration:
            raise
        except BaseException:
            # The iteration that raised is over; the next call starts a new one
            # after the last batch handed out (never a StopIteration that would
            # look like the end of the data).
            self._batches = None
            raise

    def iter_steps(self, offset: int = 0, stride: int = 1) -> Iterator[tuple[int, list[Sample]]]:
        """``(global step, batch)`` for steps ``offset, offset + stride, ...``.

        The state advances over every step, loaded or not: DataLoader worker
        ``offset`` of ``stride`` loads its share and its states stay exact.

        When it raises (or is closed early), the steps planned ahead are
        dropped: the next iteration starts after the last batch yielded."""
        if self._steps_gen is None:
            self._steps_gen = self._steps()
        steps = self._steps_gen
        try:
            yield from self._iter_steps(steps, offset, stride)
        except BaseException:
            if self._steps_gen is steps:
                self._steps_gen = None
                self._lease.restart()  # what it planned ahead is planned again, from pages read again
            raise

    def _iter_steps(self, steps: Iterator[Step], offset: int, stride: int) -> Iterator[tuple[int, list[Sample]]]:

        def produce() -> tuple[Step, list[Sample] | None] | None:
            step = next(steps, None)
            if step is None:
                return None
            mine = step.bins is not None and step.index % stride == offset
            return step, self._load(step.bins[self.rank]) if mine else None

        # The next step is planned ahead only when that cannot change it: with
        # max_staleness it depends on current_model_version, set after this batch.
        ahead = self.config.prefetch and self.config.max_staleness is None and not self.config.policy.uses_version
        # How many steps are planned and loaded ahead of the one being used: one,
        # or what the payload asks for (a replay server's round trips overlap).
        pipeline = _ReadAhead(steps, lambda step: self._load(step.bins[self.rank]),
                              lambda step: step.bins is not None and step.index % stride == offset,
                              lambda: _read_ahead(self.store.payload)) if ahead else None
        before = {name: getattr(self.stats, name) for name in ReaderStats._SAVED}
        any_batch = False
        next_item = pipeline.get if pipeline is not None else produce
        if pipeline is not None:
            self._pipelines.add(pipeline)
        try:
            while True:
                item = next_item()
                if item is None:
                    self._lease.restart()  # every step was handed over: rows left (groups never complete) are not loaded
                    if not any_batch and offset == 0:  # one DataLoader worker speaks for all
                        self._explain_empty(before)
                    return
                step, batch = item
                self._commit(step.state)
                any_batch = any_batch or step.bins is not None
                if batch is not None:
                    batch = self._by_finish_reason(batch)
                    self.stats.batches += 1
                    self.stats.samples += len(batch)
                    self.stats.tokens += sum(s.num_tokens for s in batch)
                    self._lineage_recorder().handed_out(batch)
                    yield step.index, batch
        finally:
            if pipeline is not None:
                pipeline.close()  # steps planned ahead are dropped: the next iteration plans them again
                self._pipelines.discard(pipeline)

    def _by_finish_reason(self, batch: list[Sample]) -> list[Sample]:
        """``drop_finish_reasons`` and ``mask_finish_reasons`` applied to a loaded batch."""
        drop, mask = self.config.drop_finish_reasons, self.config.mask_finish_reasons
        if not drop and not mask:
            return batch
        out = []
        for sample in batch:
            reason = sample.finish_reason
            if drop and reason in drop:
                self.stats.dropped_samples += 1
                continue
            if mask and reason in mask:
                sample = replace(sample, loss_mask=np.zeros_like(sample.loss_mask))
                self.stats.masked_samples += 1
            out.append(sample)
        return out

    def _explain_empty(self, before: dict[str, int]) -> None:
        """Say once, through logging, why an iteration yielded no batch at all."""
        if self._explained:
            return
        self._explained = True
        reasons = []
        cfg, stats = self.config, self.stats
        if stats.open_groups:
            largest = max((g[0] for g in self._open_groups.values()), default=0)
            reasons.append(f"{stats.open_groups} groups are still open: fewer than group_size={cfg.group_size} of "
                           f"their trajectories are materialized (the fullest has {largest}); "
                           f"is group_size the number of trajectories per group?")
        stale = stats.stale_units - before["stale_units"]
        if stale:
            reasons.append(f"all {stale} units ({stats.stale_samples - before['stale_samples']} samples) were staler "
                           f"than max_staleness={cfg.max_staleness} at current_model_version={self.current_model_version}")
        filtered = stats.filtered_samples - before["filtered_samples"]
        if filtered:
            reasons.append(f"the status filter {list(cfg.status or ())} removed {filtered} samples")
        try:
            pending = self._unmaterialized()
        except TrajstoreError:  # explaining must not fail the read
            pending = 0
        if pending:
            reasons.append(f"{pending} finished trajectories are not materialized yet (run `trajstore materialize`"
                           f"{'' if cfg.num_shards == 1 else ', on every shard'}; num_shards={cfg.num_shards})")
        if not reasons:
            reasons.append("no samples after the resumed state's position" if self._cursor is not None
                           else "the store has no materialized samples and no finished trajectory")
        _log.warning("trajstore reader (rank %d of %d) yields no batch: %s", self.rank, self.world_size,
                     "; ".join(reasons))

    def _unmaterialized(self) -> int:
        """Finished trajectories above the watermark (not materialized by every shard);
        asked once (explaining does not wait for an unavailable store)."""
        return self.store.log.count_events(after_position=self._watermark(retry=False),
                                           types=["trajectory_finished"])

    def _load(self, units: Sequence[Unit]) -> list[Sample]:
        """The samples of some units, in order.

        An Arrow segment (uncompressed, memory-mapped) is read in one go: its
        samples are views, nothing is decoded. The rows of a Parquet segment
        (written before sample segments became Arrow) are read in up to
        ``read_threads`` contiguous parts in parallel: one Parquet read
        decompresses its row groups on one core."""
        rows = [r for u in units for r in u.kept]
        by_segment: dict[str, list[int]] = {}
        for i, r in enumerate(rows):
            by_segment.setdefault(r["segment"], []).append(i)
        n = self.config.read_threads
        jobs = [(name, part) for name, idx in by_segment.items()
                for part in (_split(idx, n) if name.endswith(".parquet") else [idx])]
        if len(jobs) > 1:
            if self._pool is None:
                size = n * _read_ahead(self.store.payload)  # batches may load concurrently (read-ahead)
                with self._outage_lock:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(size, thread_name_prefix="trajstore-reader")
            parts = list(self._pool.map(lambda job: self._read(rows, *job), jobs))
        else:
            parts = [self._read(rows, *job) for job in jobs]
        out: list[Any] = [None] * len(rows)
        for part in parts:
            for i, sample in part:
                out[i] = sample
        return out

    def _read(self, rows: list[dict[str, Any]], segment: str, idx: list[int]) -> list[tuple[int, Sample]]:
        """(index in ``rows``, sample) for some rows of one segment."""
        wanted = [rows[i]["segment_row"] for i in idx]
        samples = self._retrying(f"reading samples of {segment}",
                                 lambda: read_segment_samples(self.store.payload, segment, wanted))
        return list(zip(idx, samples))

    # -- resume state --------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where the next batch starts: a small JSON-able dict, identical on every rank."""
        return {
            "format": STATE_FORMAT,
            "format_version": STATE_FORMAT_VERSION,
            "fingerprint": self.config.fingerprint(),
            "cursor": None if self._cursor is None else list(self._cursor),
            "scan_from": None if self._scan_from is None else list(self._scan_from),
            "snapshot_position": self._snapshot,
            "current_model_version": self.current_model_version,
            "stats": {name: getattr(self.stats, name) for name in ReaderStats._SAVED},
            **self._projection_identity(),
            **({"pool": [[*k, uses] for k, uses in sorted(self._policy_pool.items())]}
               if self.config.policy.pooled else {}),
        }

    def _projection_identity(self) -> dict[str, str]:
        """The read projection's identity beyond its name (absent for the default samples)."""
        token = getattr(self._index, "token", None) if self.config.projection is not None else None
        return {} if token is None else {"projection_token": token}

    def load_state_dict(self, state: Any) -> None:
        """Continue after the batch the state was taken at (any rank, any world size).

        Raises ResumeStateError naming the mismatch when the state is malformed,
        from another format version, or was saved with a different unit
        sequence (``keep_groups``, ``group_size``, ``status``). States saved
        before the keys were renamed (``version``, ``current_version``) load."""
        _reader_state.validate(state, self.config)
        mine = self._projection_identity().get("projection_token")
        saved = state.get("projection_token")
        if mine is not None and saved is not None and saved != mine:
            raise ProjectionChangedError(f"the state was saved reading projection {self.config.projection!r} as it "
                                         "was before it was dropped and created again: its samples are another "
                                         "sequence; start a new reader (and a new epoch) on it")
        self._cursor = _reader_state.key_or_none(state["cursor"])
        self._scan_from = _reader_state.key_or_none(state["scan_from"])
        self._snapshot = None if self.config.follow else state["snapshot_position"]
        self._policy_pool = _reader_state.pool_of(state, self.config)
        self.current_model_version = _reader_state.get(state, "current_model_version")
        for name in ReaderStats._SAVED:
            setattr(self.stats, name, state["stats"][name])
        self._steps_gen = self._batches = None
        self._lineage_recorder().forget()  # what was handed out before the restore is not this step's

    # -- training lineage (trajstore.lineage) ------------------------------------
    def record_step(self, step: int, *, run: str, policy_version: int | None = None,
                    metrics: dict[str, float] | None = None, annotations: Any = None,
                    attempt: int | None = None) -> Any:
        """Record, when training step ``step`` of ``run`` ends, the samples this rank
        consumed in it: the ones this reader handed out since the last call. One
        ``train_step`` event with ``metrics`` and one ``sample_annotation`` per entry
        of ``annotations`` (``{(trajectory_id, sample_index): {"trainer_logprobs":
        array, "advantages": array or number, "entropy": array, "metrics": {...}}}``),
        appended atomically. ``policy_version`` defaults to ``current_model_version``.
        A replayed step with the same content is a no-op; one redone differently
        takes the next attempt (``trajstore.lineage``). Returns a ``RecordedStep``."""
        version = self.current_model_version if policy_version is None else policy_version
        if annotations is not None and not isinstance(annotations, (Mapping, Sequence)):
            annotations = list(annotations)  # an iterator: read once, the same for every try
        recorder = self._lineage_recorder()
        # waits out an unavailable store as reading does: a try that failed stored nothing or
        # this same content, which the next finds stored (a no-op, by identity)
        return self._retrying(f"recording step {step} of run {run!r}", lambda: recorder.record(
            step, run=run, policy_version=version, metrics=metrics,  # type: ignore[arg-type]
            annotations=annotations, attempt=attempt))

    def _lineage_recorder(self) -> Any:
        recorder = self.__dict__.get("_lineage")
        if recorder is None:
            from trajstore.lineage import store_recorder

            recorder = self._lineage = store_recorder(self.store, rank=self.rank, world_size=self.world_size,
                                                      projection=self.config.projection)
        return recorder

    def _commit(self, state: dict[str, Any]) -> None:
        self._cursor = _reader_state.key_or_none(state["cursor"])
        self._scan_from = _reader_state.key_or_none(state["scan_from"])
        self._snapshot = state["snapshot_position"]
        self._policy_pool = {(k[0], k[1]): k[2] for k in state.get("pool", ())}
        for name in ReaderStats._SAVED:
            setattr(self.stats, name, state["stats"][name])
        self._lease.handed_over(self._cursor, self._scan_from)

    def close(self) -> None:
        self._closing.set()  # a wait for an unavailable store or a follow poll gives up
        for pipeline in list(self._pipelines):  # no read of the store outlives close()
            pipeline.close()
            pipeline.join(_CLOSE_WAIT_S)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._lease.close()
        if self._owns_store:
            self.store.close()

    def __enter__(self) -> "SampleReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- planning ------------------------------------------------------------
    def _steps(self) -> Iterator[Step]:
        """Global steps from the committed state on; each carries the state after it."""
        self._lease.restart()  # pages an earlier plan read are read again
        snapshot = None
        if not self.config.follow:
            snapshot = self._snapshot if self._snapshot is not None else self._watermark()
        else:
            self._watermark()
        builder = UnitBuilder(keep_groups=self.config.keep_groups, group_size=self.config.group_size,
                              status=self.config.status, ledger=reader_lookup(self.store.log))
        self._learn = builder.learn  # each page's ledger groups (whole as the ledger counts, dropped never read)
        self._open_groups = builder.groups
        if self.config.policy.pooled:
            yield from self._pooled_steps(builder, snapshot)
            return
        units = self._units(builder, self._cursor, self._scan_from, snapshot)
        ahead: deque[Unit] = deque()
        counts = {name: getattr(self.stats, name) for name in ReaderStats._SAVED}
        cursor = self._cursor
        while True:
            taken, ended = self._gather(ahead, units)
            kept = [u for u, skip in taken if not skip]
            cost = sum(self._cost(u) for u in kept)
            if not taken or (ended and self.config.drop_last and cost < self.world_size * self.config.capacity):
                return
            n, bins = plan_step([self._cost(u) for u in kept], self.world_size, self.config.capacity)
            if n < len(kept):
                cut = next(i for i, (u, _) in enumerate(taken) if u is kept[n])
                ahead.extendleft(u for u, _ in reversed(taken[cut:]))
                taken, kept = taken[:cut], kept[:n]
            self._count(taken, counts)
            cursor = taken[-1][0].key
            if kept:
                counts["steps"] += 1
            yield Step(counts["steps"] - 1, [[kept[i] for i in b] for b in bins] if kept else None,
                        self._state_after(cursor, builder, ahead, snapshot, counts))
            self.stats.open_groups = len(builder.groups)
            if ended and not ahead:
                return

    def _pooled_steps(self, builder: UnitBuilder, snapshot: int | None) -> Iterator[Step]:
        """The steps of a pooled sampling policy (``_policies.pooled_steps``)."""
        restored = dict(self._policy_pool)
        units = self._units(builder, self._cursor, self._scan_from, snapshot, keep=restored, idle=True)
        counts = {name: getattr(self.stats, name) for name in ReaderStats._SAVED}

        def state_after(cursor: Key | None, pool: list[Unit], uses: list[int]) -> dict[str, Any]:
            firsts = [u.first for u in pool] + [k for k in [builder.first_pending()] if k is not None]
            self.stats.open_groups = len(builder.groups)
            return {"cursor": None if cursor is None else list(cursor),
                    "scan_from": list(min(firsts)) if firsts and cursor is not None else None,
                    "snapshot_position": snapshot, "stats": dict(counts),
                    "pool": [[*u.key, n] for u, n in zip(pool, uses)]}

        yield from pooled_steps(self.config.policy, units, cursor=self._cursor, restored=restored,
                                world_size=self.world_size, capacity=self.config.capacity, cost=self._cost,
                                stale=lambda u: self._skip(u) and bool(u.kept),
                                current=lambda: self.current_model_version, counts=counts,
                                drop_last=self.config.drop_last, state_after=state_after)

    def _gather(self, ahead: deque, units: Iterator[Unit]) -> tuple[list[tuple[Unit, bool]], bool]:
        """The next units up to one step's budget, each with whether it is skipped; and
        whether the unit sequence ended."""
        taken: list[tuple[Unit, bool]] = []
        cost, budget = 0, self.world_size * self.config.capacity
        while True:
            if not ahead:
                unit = next(units, None)
                if unit is None:
                    return taken, True
                ahead.append(unit)
            skip = self._skip(ahead[0])
            if not skip:
                if cost and cost + self._cost(ahead[0]) > budget:
                    return taken, False
                cost += self._cost(ahead[0])
            taken.append((ahead.popleft(), skip))
            if cost >= budget:  # full: hand it over now, without waiting for the next unit
                return taken, False

    def _skip(self, unit: Unit) -> bool:
        if not unit.kept:
            return True  # every sample filtered out by status
        current, staleness = self.current_model_version, self.config.max_staleness
        return staleness is not None and current is not None and unit.oldest_version < current - staleness

    def _cost(self, unit: Unit) -> int:
        return unit.num_tokens if self.config.max_tokens_per_batch else len(unit.kept)

    @staticmethod
    def _count(taken: list[tuple[Unit, bool]], counts: dict[str, int]) -> None:
        for unit, skip in taken:
            counts["filtered_samples"] += len(unit.rows) - len(unit.kept)
            if skip and unit.kept:
                counts["stale_units"] += 1
                counts["stale_samples"] += len(unit.kept)

    def _state_after(self, cursor: Key, builder: UnitBuilder, ahead: deque, snapshot: int | None,
                     counts: dict[str, int]) -> dict[str, Any]:
        scan_from = None
        if self.config.keep_groups:
            firsts = [u.first for u in ahead] + [k for k in [builder.first_pending()] if k is not None]
            scan_from = min(firsts, default=None)
        return {"cursor": list(cursor), "scan_from": None if scan_from is None else list(scan_from),
                "snapshot_position": snapshot, "stats": dict(counts)}

    # -- rows ------------------------------------------------------------------
    def _units(self, builder: UnitBuilder, cursor: Key | None, scan_from: Key | None, snapshot: int | None, *,
               keep: dict[Key, int] | None = None, idle: bool = False) -> Iterator[Unit]:
        """Units completing after ``cursor`` (and the ones at or before it ``keep``
        names: a policy's pool), in order; with ``idle``, ``IDLE`` where a follow
        poll found nothing new."""
        for row in self._rows(builder, cursor, scan_from, snapshot):
            if row is IDLE:
                if idle:
                    yield IDLE
                continue
            unit = builder.add(row)
            if unit is not None and (cursor is None or unit.key > cursor or (keep and unit.key in keep)):
                yield unit
        self.stats.open_groups = len(builder.groups)

    def _rows(self, builder: UnitBuilder, cursor: Key | None, scan_from: Key | None,
              snapshot: int | None) -> Iterator[dict[str, Any]]:
        if cursor is not None and scan_from is not None and scan_from <= cursor:
            # Rebuild the groups that were open at the cursor. A group whose
            # earlier trajectories lie before the rescan already completed (its
            # unit is at or before the cursor): its count starts where it was.
            seen: set[str] = set()

            def seed(group_id: str) -> int:
                if group_id in seen:
                    return 0
                seen.add(group_id)
                return self._trajectories_before(group_id, scan_from[0]) % self.config.group_size

            builder.seed = seed
            for row in self._scan((scan_from[0], scan_from[1] - 1), cursor[0], follow=False):
                if row_key(row) > cursor:
                    break  # the cursor's trajectory's later samples: the scan after the cursor reads them
                yield row
            builder.seed = None
        yield from self._scan(cursor, snapshot, follow=self.config.follow)

    def _scan(self, after: Key | None, until: int | None, *, follow: bool) -> Iterator[dict[str, Any]]:
        """Sample rows after ``after`` up to ``until`` (follow: up to the moving watermark)."""
        idle_since = time.monotonic()
        while True:
            found = False
            where = {"max_finished_position": self._watermark() if follow else until}
            for page in self._pages(where, after):
                found, after = True, row_key(page[-1])
                self._learn(page)
                yield from page
            if not follow:
                return
            if found:
                idle_since = time.monotonic()
                continue
            if time.monotonic() - idle_since >= self.config.timeout_s:
                return
            yield IDLE  # nothing new now: a policy's pool may plan a step with what it holds
            self.stats.polls += 1
            if self._closing.wait(self.config.poll_interval_s):
                return

    def _pages(self, where: dict[str, Any], after: Key | None, *, leased: bool = True
               ) -> Iterator[list[dict[str, Any]]]:
        """Pages of sample rows after ``after``; a page that failed on an unavailable
        store is asked for again, after the last row received. ``leased``: the
        page's segments are held by the reader's GC lease until its rows are
        handed over (the reader will load them)."""
        pages: Iterator[list[dict[str, Any]]] | None = None

        def next_page() -> list[dict[str, Any]] | None:
            nonlocal pages
            token = self._lease.reading() if leased else None
            page = None
            try:
                if pages is None:
                    pages = iter(self._index.iter_sample_rows(where=where, after=after,
                                                              page_rows=self.config.page_rows))
                try:
                    page = next(pages, None)
                except BaseException:
                    pages = None  # a generator that raised is finished: the retry starts a new query
                    raise
                return page
            finally:
                self._lease.read(token, row_key(page[-1]) if page else None)

        while True:
            page = self._retrying("reading sample rows", next_page)
            if not page:
                return
            yield page
            after = row_key(page[-1])

    def _trajectories_before(self, group_id: str, position: int) -> int:
        where = {"group_id": group_id, "max_finished_position": position - 1}
        seen = set()
        for page in self._pages(where, None, leased=False):  # counted, never loaded
            seen.update(r["finished_position"] for r in page)
        return len(seen)

    def _watermark(self, *, retry: bool = True) -> int:
        """Position up to which every materializer shard has committed its samples."""
        read = lambda: self._index.watermark(self.config.num_shards)  # noqa: E731
        return self._retrying("reading the watermark", read) if retry else read()


def _split(items: list[int], n: int) -> list[list[int]]:
    """``items`` in at most ``n`` contiguous, non-empty parts of near-equal size."""
    n = min(n, len(items))
    return [items[k * len(items) // n: (k + 1) * len(items) // n] for k in range(n)]
