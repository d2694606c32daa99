"""The Store: the public entry point (``trajstore.connect``).

It wires the layers together and owns no rule of its own:
wire dicts → ``events.parse_events`` → identities / idempotency
(``_retries.split_retries``) → ``_admission.admit_batch`` (the drift figures'
recorded routes cached by ``_routes_cache``) → one payload segment
(``payload``) → one index transaction (``log``). Which database a URL opens,
and what must exist before it is opened, is the backend's
(``log._registry.backend_of``). Folding is ``materializer``'s, reading
``reader``'s.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections import ChainMap
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from trajstore._append import facts
from trajstore.payload import _home as _payload_home
from trajstore._append.digests import DIGEST_POOL as _DIGEST_POOL, Digests as _Digests
from trajstore._append.admission import Admitted, RecordedRoutes, TrajectoryState, admit_batch
from trajstore._append.retries import split_retries as _split_retries
from trajstore._append.routes_cache import ROUTES_CACHE_BYTES, RoutesCache as _RoutesCache
from trajstore.rollout import _ledger
from trajstore.lineage import _admission as _lineage
from trajstore.errors import CommitUnknownError, ContentionError, TrajstoreError, ValidationError, first_line
from trajstore.events import (Event, Generation, TrajectoryFinished, TrajectoryStarted, VersionLabel,
                              decimal_label, identity_of, parse_events)
from trajstore.log.base import ChecksFailed, EventLog, Repoint, SampleIndex, StaleState, TrajectoryWrite
from trajstore.log._backend import safe_url as _safe
from trajstore.log._errors import driver_errors
from trajstore.log._registry import backend_of
from trajstore.log._open import open_sql
from trajstore.payload import PayloadStore, SegmentRows
from trajstore.payload._format import SegmentKind
from trajstore.sample import Sample

__all__ = ["Store", "AppendCheck", "AppendResult", "connect", "DEFAULT_URL", "resolve_url"]

log = logging.getLogger(__name__)

DEFAULT_URL = "sqlite:///trajstore-data/trajstore.db"
_MAX_ATTEMPTS = 20  # re-admissions after losing an optimistic-concurrency race


@dataclass(frozen=True)
class AppendResult:
    num_appended: int
    num_duplicates: int
    last_position: int | None
    duplicate_indices: tuple[int, ...] = ()
    """Indices (in the append call) of the events that were already stored
    (identical retries): a caller that coalesced several requests into one
    append can tell each its own counts."""
    route_rows_resent: int = 0
    """Route drift of the stored calls (docs/reference.md R3 health): rows re-sent for recorded positions..."""
    route_rows_drifted: int = 0
    """...and how many of those differed from the recorded rows (what a metrics counter adds up)."""


def resolve_url(url: str | None) -> str:
    """``url``, else ``$TRAJSTORE_URL``, else the embedded default."""
    return url or os.environ.get("TRAJSTORE_URL") or DEFAULT_URL


def connect(url: str | None = None, *, payload: str | None = None, log_compression: str | None = None,
            migrate: bool = True, create: bool = True) -> "Store":
    """Open (and on first use create) a store.

    ``url``: ``sqlite:///path.db`` (embedded) or ``postgresql+psycopg://...``;
    None means ``$TRAJSTORE_URL``, else ``sqlite:///trajstore-data/trajstore.db``.
    ``payload``: where the payload files live (the log's Arrow IPC segments,
    uncompressed unless ``log_compression``, and the sample segments): a
    local path or any pyarrow filesystem URI. The store records it when it is
    created and every later process finds it there: None means the recorded
    location; a location that disagrees with it raises PayloadLocationError
    before anything is read or written (docs/deploy.md). A new store without
    one gets ``<db file>.payload/`` for SQLite, ``$TRAJSTORE_PAYLOAD_DIR`` (else
    ``./trajstore-payload/<database>``, made absolute) for PostgreSQL.
    ``log_compression``: codec of the log's payload files (None, "lz4",
    "zstd"); see ``trajstore.payload.PayloadStore``. Readers need not agree.
    ``create=False``: only open an existing store; a missing SQLite file or a
    PostgreSQL database without trajstore's schema raises StoreUnavailable
    ("no store at ...") and nothing is created (what read-only tools use).
    """
    return Store(resolve_url(url), payload=payload, log_compression=log_compression, migrate=migrate,
                 create=create)


class Store:
    """The store: ``log`` (the log index), ``materialized`` (the sample index)
    and ``payload`` (the token columns' files) are the seams the materializer,
    the reader and the inspection tools use."""

    url: str
    log: EventLog
    materialized: SampleIndex
    payload: PayloadStore

    def __init__(self, url: str, *, payload: str | None = None, log_compression: str | None = None,
                 migrate: bool = True, create: bool = True) -> None:
        self.url = url
        backend = backend_of(url)
        backend.require_database(url, missing_ok=create)
        write_engine, read_engine = backend.make_engines(url)
        if not create:
            backend.require_schema(url, read_engine)
        if migrate:
            from trajstore.log._migrate import upgrade

            with driver_errors(f"cannot open store {_safe(url)}", mode="opening"):  # first contact: one line
                upgrade(write_engine)
        # the payload location the store recorded (refusing a disagreeing one) before any payload I/O
        location = _payload_home.resolve(url, write_engine, read_engine, payload,
                                         lambda: backend.default_payload_dir(url), record=migrate)
        self.log, self.materialized = open_sql(write_engine, read_engine)
        # its root was made with its marker when the location was recorded, never by a later open
        self.payload = PayloadStore(location, log_compression, create=_payload_home.ephemeral(location))
        self._routes = _RoutesCache(ROUTES_CACHE_BYTES)
        self._route_drift = True  # off only to measure what the drift figures cost (bench/)

    # -- appending ---------------------------------------------------------
    def append(self, events: Iterable[Mapping[str, Any] | Event]) -> AppendResult:
        """Append wire-format events atomically and idempotently (docs/reference.md "Event wire format").

        Raises ValidationError (naming the event index, trajectory and rule) and
        stores nothing when any event is refused; StoreUnavailable (retriable:
        ContentionError when other writers kept winning the race for the same
        trajectories, CommitUnknownError when the commit's outcome is unknown)
        when the append may not have been stored. Retrying an append is safe. Its
        object-store requests share one deadline (``payload/_deadline.py``)."""
        with self.payload.deadline():
            return self._append(events)

    def _append(self, events: Iterable[Mapping[str, Any] | Event]) -> AppendResult:
        parsed = _parse_all(events)
        digests = _Digests([ev for ev, _ in parsed])
        # A batch that starts every trajectory it touches expects none of them, nor
        # any of its identities, in the log: it is admitted without reading the index
        # first. The unique keys it inserts (trajectory ids, identities) check that
        # expectation at commit; a violation is a lost race (StaleState), and every
        # later attempt reads first (an identical retry is then found a duplicate).
        read_first = not _starts_every_trajectory(parsed)
        if self.log.checks_steps and _lineage.checkable_in_sql([ev for ev, _ in parsed]):
            # A batch of train_steps (a trainer's record) is admitted without reading the
            # store: the statements that write it check its samples and keys
            # (``EventLog.commit_unread_steps``). When a check fails nothing is stored and
            # the batch is read and admitted as any other, which finds the precise error,
            # no-op or conflict.
            try:
                return self._append_once(parsed, digests, unread=True)
            except (ChecksFailed, StaleState):
                pass
        last = ""
        for _ in range(_MAX_ATTEMPTS):
            try:
                return self._append_once(parsed, digests, read_first=read_first)
            except StaleState as e:
                last = first_line(e)
                read_first = True
                continue  # another writer moved a trajectory first: re-read, re-admit
        raise ContentionError(f"gave up after {_MAX_ATTEMPTS} concurrent-write conflicts (last: {last}); retry later")

    def check(self, events: Iterable[Mapping[str, Any] | Event]) -> AppendResult:
        """What ``append(events)`` would do now, without writing anything.

        Raises what ``append`` would (ValidationError naming the event index,
        trajectory and rule; ConflictError); otherwise returns the counts the
        append would report (``last_position`` None). Several batches checked
        as if appended one after the other: ``checker()``."""
        return self.checker().check(events)

    def checker(self) -> "AppendCheck":
        """A dry run over successive batches (see ``AppendCheck``)."""
        return AppendCheck(self)

    def _append_once(self, parsed: list[tuple[Event, str | None]], digests: "_Digests", *,
                     read_first: bool = True, unread: bool = False) -> AppendResult:
        # identities and trajectory rows in one read (rows of duplicates are unused);
        # not read_first: expected absent, checked by the unique keys at commit
        stored: Mapping[str, bytes] = {}
        loaded: Mapping[str, Any] = {}
        # the lineage admission reads, read with the state: no read of its own (unread: none at all)
        plan = None if unread else _lineage.LineagePlan.of([ev for ev, _ in parsed])
        if read_first and not unread:
            stored, loaded = self.log.load_append_state({ident for _, ident in parsed if ident},
                                                        {ev.trajectory_id for ev, _ in parsed}, lineage=plan)
        fresh = self._drop_duplicates(parsed, digests, stored)
        rows = {tid: loaded[tid] for tid in {parsed[i][0].trajectory_id for i in fresh} if tid in loaded}
        states = {tid: facts.state_from_row(r) for tid, r in rows.items()}
        labels = self.log.load_labels(_labels_named([parsed[i][0] for i in fresh]))
        routes_after: dict[str, RecordedRoutes | None] = {}
        recorded = (lambda tid: self._recorded_routes(tid, states.get(tid))) if self._route_drift else None
        try:
            admitted = admit_batch([parsed[i][0] for i in fresh], states, self._current_sequence, labels,
                                   recorded, routes_after)
        except ValidationError as e:
            raise e.at(fresh[e.index] if e.index is not None else 0) from None
        kept = [(i, a) for i, a in zip(fresh, admitted) if not a.noop]
        if not kept:
            return AppendResult(0, len(parsed), None, tuple(range(len(parsed))))
        ledger = _ledger.changes_of(self.log, kept, plain=read_first)
        named = [(i, a.event, parsed[i][1]) for i, a in kept if _lineage.is_lineage(a.event)]
        lineage = ({i: f for (i, _, _), f in zip(named, _lineage.unread_step_facts(named))}  # type: ignore[arg-type]
                   if unread else self._admit_lineage(named, plan))
        segment, seg_row, gen_rows = self._write_segment([a for _, a in kept])
        written = [segment] if segment is not None else []
        try:
            notes, note_seg_row, note_rows = self._write_annotations(lineage)
        except BaseException:
            if segment is not None:
                self.payload.delete(segment)
            raise
        if notes is not None:
            written.append(notes)
        # The segments' fsync runs on the pool while this thread hashes the content
        # digests (needed only at commit), builds the rows and runs the index
        # statements; the transaction waits for it before COMMIT, so the payload is
        # durable before any committed row references it.
        synced = None if not written else _DIGEST_POOL.get().submit(
            lambda: [self.payload.make_durable(name) for name in written])
        try:
            digest = digests.start([i for i, _ in kept]).result()
            event_rows = []
            for i, adm in kept:
                row = facts.event_row(adm, parsed[i][1], digest[i], gen_rows.get(id(adm)))
                row["segment"] = segment if id(adm) in gen_rows else None
                if i in ledger:
                    row["ledger"] = ledger[i]  # not a column: the log changes its ledger_groups row
                if i in lineage:
                    row.update(_lineage.event_columns(lineage[i]))
                    if i in note_rows:
                        row.update(segment=notes, segment_row=note_rows[i])
                event_rows.append(row)
            seg_rows = [r for r in (seg_row, note_seg_row) if r is not None]
            if unread:  # checked by the statements that write it (ChecksFailed: nothing stored)
                positions = self.log.commit_unread_steps(event_rows)
            else:
                positions = self.log.commit_append(event_rows, _trajectory_writes([a for _, a in kept], rows),
                                                   seg_rows[0] if seg_rows else None, more_segments=seg_rows[1:],
                                                   before_commit=None if synced is None else synced.result)
        except CommitUnknownError:
            raise  # the commit may have landed: the segments stay (GC removes them if unreferenced)
        except BaseException as e:
            if synced is not None:
                wait([synced])  # its fsync must not outlive the file
            for name in written:
                self.payload.discard(name, after=e)  # certainly not committed (never masks ``e``)
            raise
        self._routes.after_append(admitted, states, routes_after)
        stored_now = {i for i, _ in kept}
        stored_gens = [a.stored for _, a in kept if a.stored is not None]
        return AppendResult(len(kept), len(parsed) - len(kept), positions[-1],
                            tuple(i for i in range(len(parsed)) if i not in stored_now),
                            sum(g.route_rows_resent or 0 for g in stored_gens),
                            sum(g.route_rows_drifted or 0 for g in stored_gens))

    def _drop_duplicates(self, parsed: list[tuple[Event, str | None]], digests: "_Digests",
                         stored: Mapping[str, bytes]) -> list[int]:
        """Indices of events not stored yet; identical retries dropped, conflicting ones refused.
        ``stored``: content hash of each of the batch's identities already in the log."""
        return _split_retries(parsed, stored, digests.get, lambda label: self.log.load_labels([label]).get(label))[0]

    def _write_segment(self, admitted: list[Admitted]) -> tuple[str | None, dict | None, dict[int, int]]:
        gens = [a for a in admitted if a.stored is not None]
        if not gens:
            return None, None, {}
        table = facts.segment_table([a.stored for a in gens])
        name = self.payload.new_log_segment()
        # one event per record batch; not synced yet (the caller's make_durable)
        try:
            size = self.payload.write(name, table, rows_per_batch=1, durable=False)
        except BaseException as e:
            self.payload.discard(name, after=e)  # nothing references it: a partial file is garbage
            raise
        seg_row = {"name": name, "kind": "events", "num_rows": len(gens), "num_bytes": size, "created_at": time.time()}
        return name, seg_row, {id(a): i for i, a in enumerate(gens)}

    def _admit_lineage(self, events: Sequence[tuple[int, Event, str | None]],
                       plan: "_lineage.LineagePlan | None" = None) -> dict[int, "_lineage.LineageFact"]:
        """The facts of an append's lineage events (``trajstore.lineage._admission``) by their index."""
        if not events:
            return {}
        made = _lineage.admit_lineage(events, self._sample_source(plan))  # type: ignore[arg-type]
        return {i: fact for (i, _, _), fact in zip(events, made)}

    def _sample_source(self, plan: "_lineage.LineagePlan | None" = None) -> "_lineage.SampleSource":
        """The log and the sample index as lineage admission reads them (one read, or
        none when ``plan`` was read with the append's state)."""
        from trajstore.sample._codec import load_samples

        return _lineage.SampleSource(self.log.lineage_state, lambda sample_rows: load_samples(self, sample_rows),
                                     plan=plan)

    def _write_annotations(self, lineage: Mapping[int, "_lineage.LineageFact"]
                           ) -> tuple[str | None, dict | None, dict[int, int]]:
        """The payload segment of an append's annotation arrays (not synced yet)."""
        with_arrays = [(i, f) for i, f in sorted(lineage.items()) if f.has_arrays]
        if not with_arrays:
            return None, None, {}
        table = _lineage.annotation_table([f for _, f in with_arrays])
        name = self.payload.new_name("lineage")
        try:
            size = self.payload.write(name, table, rows_per_batch=len(with_arrays), durable=False)
        except BaseException:
            self.payload.delete(name)
            raise
        seg_row = {"name": name, "kind": "lineage", "num_rows": len(with_arrays), "num_bytes": size,
                   "created_at": time.time()}
        return name, seg_row, {i: k for k, (i, _) in enumerate(with_arrays)}

    def _recorded_routes(self, trajectory_id: str, state: TrajectoryState | None) -> RecordedRoutes | None:
        """The current sample's recorded route rows (the drift figures compare re-sent
        rows with them): this process's cache when it saw the trajectory's last
        append, else rebuilt from the log (a payload read; docs/log.md, "Route drift")."""
        if state is None:
            return None
        hit = self._routes.get(trajectory_id, state.revision)
        if hit is not None:
            return hit
        try:
            gens = self.load_generations(trajectory_id)
            if not gens:
                return RecordedRoutes(0)
            from trajstore.fold import fold

            last = fold(gens, trajectory_id=trajectory_id, num_experts=state.num_experts).samples[-1]
        except (TrajstoreError, ArithmeticError, ValueError, TypeError, IndexError, KeyError) as e:
            # e.g. a call still waiting on a version label does not fold yet: the drift is not measured
            log.debug("route drift of %r not measured: %s", trajectory_id, first_line(e))
            return None
        if last.routed_experts is None:
            return RecordedRoutes(last.sample_index)
        n = state.route_len
        return RecordedRoutes(last.sample_index, [(0, last.routed_experts[:n], ~last.routed_experts_mask[:n])])

    def _current_sequence(self, trajectory_id: str) -> np.ndarray:
        """The trajectory's current token sequence, rebuilt from the log (rare path)."""
        gens = self.load_generations(trajectory_id)
        if not gens:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate([gens[-1].prompt_ids, gens[-1].output_ids])

    # -- reading the log ---------------------------------------------------
    def load_generations(self, trajectory_id: str) -> list[Generation]:
        """One trajectory's generation commands, rebuilt from the log."""
        rows = [r for r in self.log.trajectory_events([trajectory_id])[trajectory_id] if r["type"] == "generation"]
        if not rows:
            return []
        traj = self.log.load_trajectories([trajectory_id])[trajectory_id]
        tables = self.payload.read_locators(rows)
        shape = (traj["route_layers"], traj["route_topk"]) if traj["route_layers"] else None
        return facts.generations_from_log(rows, tables, shape)

    def trajectory_state(self, trajectory_id: str) -> TrajectoryState | None:
        """A trajectory's tail state (status, ``last_seq``, ...), None if unknown.

        Writers that number generations themselves (the proxy) resume from
        ``last_seq + 1``."""
        row = self.log.load_trajectories([trajectory_id]).get(trajectory_id)
        return None if row is None else facts.state_from_row(row)

    def rollout_state(self, run: str) -> "_ledger.RolloutPlan":
        """The resume plan of rollout run ``run`` (docs/reference.md "Rollout ledger"):
        ``dispatched``, ``whole``, ``open`` (oldest first, each running trajectory's
        tail) and ``dropped``, from one read of the ledger's index (never a scan of
        the log) and the last call of each running trajectory. An unknown run: an
        empty plan."""
        return _ledger.rollout_plan(run, *self.log.rollout_rows(run), lambda running: _ledger.tails(self, running))

    def info(self) -> dict[str, Any]:
        """Counts per status, event type and model version, and the number of samples."""
        return {**self.log.counts(), "samples": self.materialized.count_samples()}

    def collect_garbage(self, *, grace_s: float = 3600.0, margin_s: float | None = None,
                        lease_max_age_s: float | None = None) -> list[str]:
        """Delete payload files nothing needs any more; return their names: the
        full sweep, which lists the payload (``trajstore gc``; the steady path,
        driven by the index's retired list without listing, is
        ``trajstore._upkeep.gc.collect_retired``, run by the materializer's GC worker).

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
        from trajstore._upkeep.gc import GC_MARGIN_S, LEASE_MAX_AGE_S, lease_horizon

        # Retirement times are the database's, and so is "now" here: the grace does not
        # depend on this machine's clock agreeing with the retiring one's.
        self.log.retire_unreferenced(time.time())  # ones two concurrent re-pointings each left to the other
        horizon = lease_horizon(self, min(grace_s, GC_MARGIN_S) if margin_s is None else margin_s,
                                LEASE_MAX_AGE_S if lease_max_age_s is None else lease_max_age_s)
        keep = self.log.segments_in_use(retired_before=min(self.log.database_time() - grace_s, horizon))
        removed = self.payload.collect_garbage(keep, grace_s=grace_s)
        self.log.forget_segments(removed)
        self.log.shrink_journal()  # SQLite: the WAL's ~4 MB between checkpoints, given back
        return removed

    def compact(self, *, target_bytes: int = 64 << 20, max_rounds: int | None = None) -> dict[str, int]:
        """Rewrite many small log segments into few: the live rows (events not
        re-pointed yet, i.e. of trajectories the materializer has not folded)
        of the oldest log segments smaller than ``target_bytes / 2`` go into one
        new segment of about ``target_bytes``, re-pointed in one transaction
        guarded by every moved event's current locator; the old segments are
        retired (``collect_garbage`` deletes them after its grace). A crash
        before that commit leaves only an unreferenced new file. Memory is
        bounded by one round (``target_bytes`` of payload).

        Returns ``{"rounds", "segments_retired", "events_moved", "segments_written"}``."""
        stats = {"rounds": 0, "segments_retired": 0, "events_moved": 0, "segments_written": 0}
        while max_rounds is None or stats["rounds"] < max_rounds:
            done = self._compact_round(target_bytes)
            if done is None:
                break
            stats["rounds"] += 1
            stats["segments_retired"] += done[0]
            stats["events_moved"] += done[1]
            stats["segments_written"] += 1 if done[1] else 0
        return stats

    def _compact_round(self, target_bytes: int) -> tuple[int, int] | None:
        """One compaction; (segments emptied, events moved), None when nothing is worth it."""
        cands = self.log.compaction_candidates(max_bytes=max(1, target_bytes // 2), limit_bytes=target_bytes)
        if len(cands) < 2:
            return None
        names = [c["name"] for c in cands]
        live = self.log.live_locators(names)
        holding = {r["segment"] for r in live}
        # Candidates without live rows (emptied by re-pointings that raced each other's
        # retiring) are retired here; left alone they would be picked again every round.
        retired = len(self.log.retire_unreferenced(time.time())) if len(holding) < len(names) else 0
        if len(holding) < 2:
            # Rewriting one segment's rows into another gains nothing (and would go on
            # forever: the copy is small enough to be a candidate again).
            return (retired, 0) if retired else None
        names = sorted(holding)
        tables = self.payload.read_locators(live)
        parts = [tables[r["segment"]].row(int(r["segment_row"])) for r in live]
        table = pa.concat_tables(parts, promote_options="default").combine_chunks()
        name = SegmentKind.EVENTS.new_name()
        size = self.payload.write(name, table, rows_per_batch=1)
        seg_row = {"name": name, "kind": "events", "num_rows": len(live), "num_bytes": size,
                   "created_at": time.time()}
        moves = [Repoint(int(r["position"]), name, k, None, r["segment"], int(r["segment_row"]))
                 for k, r in enumerate(live)]
        try:
            self.log.commit_compaction(seg_row, moves)
        except StaleState:
            # the materializer re-pointed some of them meanwhile and nothing was stored:
            # the new file is garbage no row names; the next round starts from fresh locators
            self.payload.delete(name)
            log.info("compaction of %d segments lost a race with the materializer; retrying", len(names))
            return 0, 0
        return len(names) + retired, len(moves)

    # -- materialized samples ------------------------------------------------
    def materialize(
        self,
        *,
        shard_index: int = 0,
        num_shards: int = 1,
        max_trajectories: int = 256,
        max_batch_tokens: int = 262_144,
        max_steps: int | None = None,
        progress: Callable[[int], None] | None = None,
        projection: str | None = None,
    ):
        """Fold every finished trajectory not folded yet; return the metrics
        (``MaterializeStats``: num_steps_before, num_samples_after, merge_ratio, ...).

        ``shard_index``/``num_shards``: fold only this shard's trajectories;
        ``max_trajectories``: trajectories folded per step (one transaction),
        cut earlier at ``max_batch_tokens`` tokens; ``max_steps``: stop after
        that many steps (None: until nothing is pending); ``progress``: called
        with the number of trajectories each step folded; ``projection``: fold
        into that named projection instead of the default samples
        (docs/projections.md)."""
        from trajstore.materializer import Materializer

        return Materializer(self, shard_index=shard_index, num_shards=num_shards, max_trajectories=max_trajectories,
                            max_batch_tokens=max_batch_tokens, progress=progress,
                            projection=projection).run(max_steps=max_steps)

    # -- named projections (docs/projections.md) --------------------------------
    def create_projection(self, name: str, *, merge: str = "prefix", observation: str = "prompt",
                          routes: str = "first") -> dict[str, Any]:
        """Define projection ``name``: the log re-folded under ``FoldPolicy(merge,
        observation, routes)``. Materialize it with ``materialize(projection=name)``;
        read it with ``samples(projection=name)`` or ``SampleReader(..., projection=name)``."""
        import re
        import uuid

        from trajstore.fold import FoldPolicy

        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
            raise ValidationError(f"projection name {name!r}: want 1-64 letters, digits, '_', '.', '-'",
                                  rule="projection")
        policy = FoldPolicy(merge, observation, routes)
        row = {"name": name, **policy.to_dict(), "token": uuid.uuid4().hex, "created_at": time.time()}
        self.materialized.create_projection(row)
        return row

    def projections(self) -> list[dict[str, Any]]:
        """Every named projection: its policy, ``num_samples``, ``num_unfoldable``."""
        return self.materialized.projections()

    def drop_projection(self, name: str) -> dict[str, int]:
        """Delete projection ``name`` and its samples; its sample segments are
        retired, and ``collect_garbage`` deletes them after its grace. Nothing
        else changes: the log, the default samples, other projections."""
        return self.materialized.drop_projection(name)

    def samples(
        self,
        *,
        status: str | Sequence[str] | None = None,
        min_model_version: int | None = None,
        max_model_version: int | None = None,
        group_id: str | None = None,
        trajectory_ids: Iterable[str] | None = None,
        page_rows: int = 256,
        batch_size: int | None = None,
        projection: str | None = None,
    ) -> Iterator[Sample]:
        """Materialized samples in their stable order (finished position, sample index).

        ``status``: one status or several; ``min_model_version`` keeps samples
        whose oldest token is at least that version, ``max_model_version``
        those whose newest token is at most that; ``group_id`` and
        ``trajectory_ids`` select by id; ``page_rows``: index rows per query
        (``batch_size`` is its old, deprecated name); ``projection``: the samples
        of that named projection (docs/projections.md). Memory stays bounded."""
        from trajstore._util.deprecated import renamed
        from trajstore.sample._codec import iter_samples

        page_rows = renamed("batch_size", "page_rows", batch_size, page_rows, 256)
        return iter_samples(self, status=status, min_model_version=min_model_version,
                            max_model_version=max_model_version, group_id=group_id,
                            trajectory_ids=trajectory_ids, page_rows=page_rows, projection=projection)

    def close(self) -> None:
        self.log.close()  # the sample index shares its engines
        self.payload.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({_safe(self.url)!r}, payload={self.payload.location!r})"


class AppendCheck:
    """Admission without writing, batch after batch, as if each were appended
    after the ones before (``Store.checker()``): how ``trajstore ingest``
    validates a whole file before storing any of it.

    Keeps only each touched trajectory's small tail state, the last token
    sequence of running ones, and a 16-byte digest per event identity seen;
    no token arrays of past batches. Events already stored (or seen in an
    earlier batch) with the same content count as duplicates, as ``append``
    would skip them. After an error the checker is spent (its state has
    taken the batch's events before the refused one)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._states: dict[str, TrajectoryState | None] = {}
        self._sequences: dict[str, np.ndarray] = {}  # running trajectories' last sequence (rare path only)
        self._seen: dict[str, bytes] = {}  # identity -> content digest
        self._labels: dict[str, int] = {}  # the label map, as far as the batches named it
        self._lineage: dict[tuple, str] = {}  # lineage keys the batches recorded -> identity
        self._ledger: list = []  # the batches' ledger events so far (admitted with each next batch's)

    def check(self, events: Iterable[Mapping[str, Any] | Event]) -> AppendResult:
        """The next batch; raises as ``Store.append`` would (indices within this batch)."""
        parsed = _parse_all(events)
        log = self.store.log
        named = _labels_named([ev for ev, _ in parsed])
        self._labels.update(log.load_labels(named - self._labels.keys()))
        stored = log.lookup_identities({ident for _, ident in parsed if ident and ident not in self._seen})
        unknown = {ev.trajectory_id for ev, _ in parsed if ev.trajectory_id not in self._states}
        if unknown:
            rows = log.load_trajectories(unknown)
            self._states.update({tid: facts.state_from_row(rows[tid]) if tid in rows else None for tid in unknown})
        digests = _Digests([ev for ev, _ in parsed])
        # a retry of a stored event, or a repeat: append skips it
        fresh, duplicates, first = _split_retries(parsed, ChainMap(self._seen, stored), digests.get, self._labels.get)
        self._seen.update((ident, digests.get(i)) for ident, i in first.items())
        try:
            admitted = admit_batch([parsed[i][0] for i in fresh], self._states, self._sequence, self._labels)
        except ValidationError as e:
            raise e.at(fresh[e.index] if e.index is not None else 0) from None
        _ledger.changes_of(log, [(i, adm) for i, adm in zip(fresh, admitted) if not adm.noop], self._ledger)
        lineage = [(i, adm.event, parsed[i][1]) for i, adm in zip(fresh, admitted) if _lineage.is_lineage(adm.event)]
        if lineage:
            _lineage.admit_lineage(lineage, self.store._sample_source(), self._lineage)  # type: ignore[arg-type]
            self._lineage.update((_lineage.lineage_key(ev), ident) for _, ev, ident in lineage)  # type: ignore
        for i, adm in zip(fresh, admitted):
            ev = adm.event
            if adm.noop:
                duplicates.append(i)
            if isinstance(ev, VersionLabel):
                self._labels.setdefault(ev.label, ev.model_version)
                continue
            if adm.state is None:  # a lineage event: store-wide
                continue
            self._states[ev.trajectory_id] = adm.state
            if isinstance(ev, Generation):
                self._sequences[ev.trajectory_id] = np.concatenate([ev.prompt_ids, ev.output_ids])
            elif isinstance(ev, TrajectoryFinished):
                self._sequences.pop(ev.trajectory_id, None)
        duplicates.sort()
        return AppendResult(len(parsed) - len(duplicates), len(duplicates), None, tuple(duplicates))

    def _sequence(self, trajectory_id: str) -> np.ndarray:
        if trajectory_id in self._sequences:
            return self._sequences[trajectory_id]
        return self.store._current_sequence(trajectory_id)


def _parse_all(events: Iterable[Mapping[str, Any] | Event]) -> list[tuple[Event, str | None]]:
    return [(ev, identity_of(ev)) for ev in parse_events(events)]


def _labels_named(events: Sequence[Event]) -> set[str]:
    """The labels an append must look up in the label map: its version_label events'
    and its generations' span labels that are neither decimal nor ``"default"``."""
    out: set[str] = set()
    for ev in events:
        if isinstance(ev, VersionLabel):
            out.add(ev.label)
        elif isinstance(ev, Generation) and ev.weight_versions is not None:
            out.update(label for label, _, _ in ev.weight_versions
                       if isinstance(label, str) and label != "default" and decimal_label(label) is None)
    return out


def _starts_every_trajectory(parsed: Sequence[tuple[Event, str | None]]) -> bool:
    """Is each trajectory's first event in the batch its trajectory_started?"""
    seen: set[str] = set()
    for ev, _ in parsed:
        if ev.trajectory_id not in seen:
            if not isinstance(ev, TrajectoryStarted):
                return False
            seen.add(ev.trajectory_id)
    return bool(seen)


def _trajectory_writes(admitted: Sequence[Admitted], rows: Mapping[str, Any]) -> list[TrajectoryWrite]:
    """The final state of each trajectory the batch touched."""
    last: dict[str, Admitted] = {}
    started: dict[str, TrajectoryStarted] = {}
    for a in admitted:
        if a.state is None:  # a version_label: store-wide
            continue
        last[a.event.trajectory_id] = a
        if isinstance(a.event, TrajectoryStarted):
            started[a.event.trajectory_id] = a.event
    writes = []
    for tid, a in last.items():
        existing = rows.get(tid)
        row = facts.trajectory_row(a.state, started.get(tid))
        writes.append(TrajectoryWrite(row, existing["revision"] if existing else None))
    return writes


def __getattr__(name: str):
    # ``dialect_of`` (a store URL's backend) was public here; it is the backend registry's now
    if name == "dialect_of":
        warnings.warn("trajstore.store.dialect_of is deprecated; a store URL's backend is "
                      "trajstore.log._registry.backend_of (same use: make_engines, default_payload_dir)",
                      DeprecationWarning, stacklevel=2)
        return backend_of
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
