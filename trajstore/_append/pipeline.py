"""One ``Store.append``, down the layers: parse, duplicates, admission, payload, index.

``append(store, events)`` is the whole write path of an append, in one pass:

1. parse the wire dicts (``trajstore.events``), each event's identity named;
2. the duplicate rule (``retries``): identical retries dropped, conflicting ones
   refused, against the identities the index holds (read with the trajectories'
   tail rows in one query; not read at all for a batch that starts every
   trajectory it touches: the unique keys check that at commit);
3. admission (``admission.admit_batch``) against each trajectory's tail, then the
   rollout ledger's rules (``trajstore.rollout._ledger``) and lineage's
   (``trajstore.lineage._admission``);
4. one payload segment of the stored calls' arrays (``facts.segment_table``), made
   durable on a pooled thread while the index rows are built;
5. one index transaction (``EventLog.commit_append``), which waits for that fsync
   before COMMIT.

A lost optimistic-concurrency race (``StaleState``: another writer moved one of
the batch's trajectories first) re-reads and re-admits, up to ``MAX_ATTEMPTS``
times (then ``ContentionError``). A trainer's batch of ``train_step`` events is
first tried without any read (``commit_unread_steps``: its statements check it).

The route rows a call re-sends for recorded positions are compared with the
recorded ones (docs/log.md, "Route drift"); rebuilding those from the log is a
payload read, so a store keeps what its own appends recorded (``RoutesCache``),
per trajectory, at the revision it recorded them at, up to ``ROUTES_CACHE_BYTES``.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol, Sequence

import numpy as np

from trajstore._append import facts
from trajstore._append.admission import Admitted, RecordedRoutes, TrajectoryState, admit_batch
from trajstore._append.digests import DIGEST_POOL as _DIGEST_POOL, Digests as _Digests
from trajstore._append.retries import split_retries as _split_retries
from trajstore.errors import CommitUnknownError, ContentionError, TrajstoreError, ValidationError, first_line
from trajstore.events import (Event, Generation, TrajectoryStarted, VersionLabel, content_hash, decimal_label,
                              identity_of, parse_event, parse_events)
from trajstore.lineage import _admission as _lineage
from trajstore.log.base import ChecksFailed, EventLog, SampleIndex, StaleState, TrajectoryWrite
from trajstore.payload import PayloadStore
from trajstore.rollout import _ledger

__all__ = ["AppendResult", "AppendTarget", "MAX_ATTEMPTS", "ROUTES_CACHE_BYTES", "RoutesCache", "append", "current_sequence", "labels_named", "parse_all",
           "sample_source"]

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 20  # re-admissions after losing an optimistic-concurrency race


ROUTES_CACHE_BYTES = 256 << 20
"""Recorded route rows of running trajectories kept per Store for the drift
figures (docs/log.md, "Route drift"); past it the least recently used go."""


class RoutesCache:
    """trajectory_id -> (revision, RecordedRoutes) of running trajectories this
    process appended to, least recently used first out past ``max_bytes``. An
    entry is valid only for the trajectory revision it was made at: an append
    by another process moves the revision, and the next comparison rebuilds it."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, tuple[int, RecordedRoutes]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, trajectory_id: str, revision: int) -> RecordedRoutes | None:
        with self._lock:
            hit = self._entries.get(trajectory_id)
            if hit is None or hit[0] != revision:
                return None
            self._entries.move_to_end(trajectory_id)
            return hit[1]

    def after_append(self, admitted: Sequence[Admitted], before: Mapping[str, TrajectoryState],
                     routes_after: Mapping[str, RecordedRoutes | None]) -> None:
        """Keep what a committed append's trajectories recorded, at their new revisions."""
        final: dict[str, TrajectoryState] = {}
        for a in admitted:
            if a.state is not None:
                final[a.event.trajectory_id] = a.state
        with self._lock:
            for tid, state in final.items():
                if tid in routes_after:
                    value = routes_after[tid]
                else:  # the batch did not change its recorded rows: an entry at the old revision still holds
                    old = self._entries.get(tid)
                    prev = before.get(tid)
                    value = old[1] if old is not None and prev is not None and old[0] == prev.revision else None
                self._drop(tid)
                if value is not None and state.status == "running":
                    self._entries[tid] = (state.revision, value)
                    self.nbytes += value.nbytes
            while self.nbytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))

    def _drop(self, trajectory_id: str) -> None:
        old = self._entries.pop(trajectory_id, None)
        if old is not None:
            self.nbytes -= old[1].nbytes


class AppendTarget(Protocol):
    """What an append uses of a ``Store``: its three parts, the route cache the drift
    figures compare with (``_route_drift`` False: not measured), and the log's
    generations of one trajectory (the rare paths)."""

    log: EventLog
    materialized: SampleIndex
    payload: PayloadStore
    _routes: RoutesCache
    _route_drift: bool

    def load_generations(self, trajectory_id: str) -> list[Generation]: ...


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


def append(store: AppendTarget, events: Iterable[Mapping[str, Any] | Event]) -> AppendResult:
    parsed, digests = _parse_digesting(events)
    # A batch that starts every trajectory it touches expects none of them, nor
    # any of its identities, in the log: it is admitted without reading the index
    # first. The unique keys it inserts (trajectory ids, identities) check that
    # expectation at commit; a violation is a lost race (StaleState), and every
    # later attempt reads first (an identical retry is then found a duplicate).
    read_first = not _starts_every_trajectory(parsed)
    if store.log.checks_steps and _lineage.checkable_in_sql([ev for ev, _ in parsed]):
        # A batch of train_steps (a trainer's record) is admitted without reading the
        # store: the statements that write it check its samples and keys
        # (``EventLog.commit_unread_steps``). When a check fails nothing is stored and
        # the batch is read and admitted as any other, which finds the precise error,
        # no-op or conflict.
        try:
            return _once(store, parsed, digests, unread=True)
        except (ChecksFailed, StaleState):
            pass
    last = ""
    for _ in range(MAX_ATTEMPTS):
        try:
            return _once(store, parsed, digests, read_first=read_first)
        except StaleState as e:
            last = first_line(e)
            read_first = True
            continue  # another writer moved a trajectory first: re-read, re-admit
    raise ContentionError(f"gave up after {MAX_ATTEMPTS} concurrent-write conflicts (last: {last}); retry later")


def _once(store: AppendTarget, parsed: list[tuple[Event, str | None]], digests: "_Digests", *,
                 read_first: bool = True, unread: bool = False) -> AppendResult:
    # identities and trajectory rows in one read (rows of duplicates are unused);
    # not read_first: expected absent, checked by the unique keys at commit
    stored: Mapping[str, bytes] = {}
    loaded: Mapping[str, Any] = {}
    # the lineage admission reads, read with the state: no read of its own (unread: none at all)
    plan = None if unread else _lineage.LineagePlan.of([ev for ev, _ in parsed])
    if read_first and not unread:
        stored, loaded = store.log.load_append_state({ident for _, ident in parsed if ident},
                                                    {ev.trajectory_id for ev, _ in parsed}, lineage=plan)
    fresh = _drop_duplicates(store, parsed, digests, stored)
    rows = {tid: loaded[tid] for tid in {parsed[i][0].trajectory_id for i in fresh} if tid in loaded}
    states = {tid: facts.state_from_row(r) for tid, r in rows.items()}
    labels = store.log.load_labels(labels_named([parsed[i][0] for i in fresh]))
    routes_after: dict[str, RecordedRoutes | None] = {}
    recorded = (lambda tid: _recorded_routes(store, tid, states.get(tid))) if store._route_drift else None
    try:
        admitted = admit_batch([parsed[i][0] for i in fresh], states, functools.partial(current_sequence, store), labels,
                               recorded, routes_after)
    except ValidationError as e:
        raise e.at(fresh[e.index] if e.index is not None else 0) from None
    kept = [(i, a) for i, a in zip(fresh, admitted) if not a.noop]
    if not kept:
        return AppendResult(0, len(parsed), None, tuple(range(len(parsed))))
    ledger = _ledger.changes_of(store.log, kept, plain=read_first)
    named = [(i, a.event, parsed[i][1]) for i, a in kept if _lineage.is_lineage(a.event)]
    lineage = ({i: f for (i, _, _), f in zip(named, _lineage.unread_step_facts(named))}  # type: ignore[arg-type]
               if unread else _admit_lineage(store, named, plan))
    # the stored events' content digests not taken at the parse (events passed as objects)
    # are hashed on the pool while this thread writes the payload segment (its write
    # releases the GIL); they are needed only at commit
    digesting = digests.start([i for i, _ in kept])
    segment, seg_row, gen_rows = _write_segment(store, [a for _, a in kept])
    written = [segment] if segment is not None else []
    try:
        notes, note_seg_row, note_rows = _write_annotations(store, lineage)
    except BaseException:
        if segment is not None:
            store.payload.delete(segment)
        raise
    if notes is not None:
        written.append(notes)
    # The segments' fsync runs on the pool while this thread builds the rows and
    # runs the index statements; the transaction waits for it before COMMIT, so the
    # payload is durable before any committed row references it.
    synced = None if not written else _DIGEST_POOL.get().submit(
        lambda: [store.payload.make_durable(name) for name in written])
    try:
        digest = digesting.result()
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
            positions = store.log.commit_unread_steps(event_rows)
        else:
            positions = store.log.commit_append(event_rows, _trajectory_writes([a for _, a in kept], rows),
                                               seg_rows[0] if seg_rows else None, more_segments=seg_rows[1:],
                                               before_commit=None if synced is None else synced.result)
    except CommitUnknownError:
        raise  # the commit may have landed: the segments stay (GC removes them if unreferenced)
    except BaseException as e:
        if synced is not None:
            wait([synced])  # its fsync must not outlive the file
        for name in written:
            store.payload.discard(name, after=e)  # certainly not committed (never masks ``e``)
        raise
    store._routes.after_append(admitted, states, routes_after)
    stored_now = {i for i, _ in kept}
    stored_gens = [a.stored for _, a in kept if a.stored is not None]
    return AppendResult(len(kept), len(parsed) - len(kept), positions[-1],
                        tuple(i for i in range(len(parsed)) if i not in stored_now),
                        sum(g.route_rows_resent or 0 for g in stored_gens),
                        sum(g.route_rows_drifted or 0 for g in stored_gens))


def _drop_duplicates(store: AppendTarget, parsed: list[tuple[Event, str | None]], digests: "_Digests",
                     stored: Mapping[str, bytes]) -> list[int]:
    """Indices of events not stored yet; identical retries dropped, conflicting ones refused.
    ``stored``: content hash of each of the batch's identities already in the log."""
    return _split_retries(parsed, stored, digests.get, lambda label: store.log.load_labels([label]).get(label))[0]


def _write_segment(store: AppendTarget, admitted: list[Admitted]) -> tuple[str | None, dict | None, dict[int, int]]:
    gens = [a for a in admitted if a.stored is not None]
    if not gens:
        return None, None, {}
    stored = [a.stored for a in gens if a.stored is not None]
    table = facts.segment_table(stored)
    name = store.payload.new_log_segment()
    # one event per record batch; not synced yet (the caller's make_durable)
    try:
        # the routes are written whole: the file holds at least their bytes (allocated ahead)
        size = store.payload.write(name, table, rows_per_batch=1, durable=False,
                                   at_least=sum(s.routes.nbytes for s in stored if s.routes is not None))
    except BaseException as e:
        store.payload.discard(name, after=e)  # nothing references it: a partial file is garbage
        raise
    seg_row = {"name": name, "kind": "events", "num_rows": len(gens), "num_bytes": size, "created_at": time.time()}
    return name, seg_row, {id(a): i for i, a in enumerate(gens)}


def _admit_lineage(store: AppendTarget, events: Sequence[tuple[int, Event, str | None]],
                   plan: "_lineage.LineagePlan | None" = None) -> dict[int, "_lineage.LineageFact"]:
    """The facts of an append's lineage events (``trajstore.lineage._admission``) by their index."""
    if not events:
        return {}
    made = _lineage.admit_lineage(events, sample_source(store, plan))  # type: ignore[arg-type]
    return {i: fact for (i, _, _), fact in zip(events, made)}


def sample_source(store: AppendTarget, plan: "_lineage.LineagePlan | None" = None) -> "_lineage.SampleSource":
    """The log and the sample index as lineage admission reads them (one read, or
    none when ``plan`` was read with the append's state)."""
    from trajstore.sample._codec import load_samples

    return _lineage.SampleSource(store.log.lineage_state, lambda sample_rows: load_samples(store, sample_rows),
                                 plan=plan)


def _write_annotations(store: AppendTarget, lineage: Mapping[int, "_lineage.LineageFact"]
                       ) -> tuple[str | None, dict | None, dict[int, int]]:
    """The payload segment of an append's annotation arrays (not synced yet)."""
    with_arrays = [(i, f) for i, f in sorted(lineage.items()) if f.has_arrays]
    if not with_arrays:
        return None, None, {}
    table = _lineage.annotation_table([f for _, f in with_arrays])
    name = store.payload.new_name("lineage")
    try:
        size = store.payload.write(name, table, rows_per_batch=len(with_arrays), durable=False)
    except BaseException:
        store.payload.delete(name)
        raise
    seg_row = {"name": name, "kind": "lineage", "num_rows": len(with_arrays), "num_bytes": size,
               "created_at": time.time()}
    return name, seg_row, {i: k for k, (i, _) in enumerate(with_arrays)}


def _recorded_routes(store: AppendTarget, trajectory_id: str, state: TrajectoryState | None) -> RecordedRoutes | None:
    """The current sample's recorded route rows (the drift figures compare re-sent
    rows with them): this process's cache when it saw the trajectory's last
    append, else rebuilt from the log (a payload read; docs/log.md, "Route drift")."""
    if state is None:
        return None
    hit = store._routes.get(trajectory_id, state.revision)
    if hit is not None:
        return hit
    try:
        gens = store.load_generations(trajectory_id)
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


def current_sequence(store: AppendTarget, trajectory_id: str) -> np.ndarray:
    """The trajectory's current token sequence, rebuilt from the log (rare path)."""
    gens = store.load_generations(trajectory_id)
    if not gens:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate([gens[-1].prompt_ids, gens[-1].output_ids])


def parse_all(events: Iterable[Mapping[str, Any] | Event]) -> list[tuple[Event, str | None]]:
    return [(ev, identity_of(ev)) for ev in parse_events(events)]


def _parse_digesting(events: Iterable[Mapping[str, Any] | Event]) -> tuple[list[tuple[Event, str | None]], _Digests]:
    """``parse_all``, each generation decoded from the wire digested right after its parse:
    its arrays (a call's route table re-sent each turn: ~1 MB) are then still in the
    CPU's cache, where hashing the batch's afterwards read them from memory again."""
    parsed: list[tuple[Event, str | None]] = []
    hashed: dict[int, bytes] = {}
    for i, obj in enumerate(events):
        try:
            ev = parse_event(obj)
        except ValidationError as e:
            raise e.at(i) from None
        parsed.append((ev, identity_of(ev)))
        if isinstance(ev, Generation) and ev is not obj:
            hashed[i] = content_hash(ev)
    digests = _Digests([ev for ev, _ in parsed])
    digests.cache.update(hashed)
    return parsed, digests


def labels_named(events: Sequence[Event]) -> set[str]:
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

