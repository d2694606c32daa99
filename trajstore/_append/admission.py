"""Admission: validate commands against trajectory history and normalize them
into the facts the log stores.

A harness sends *commands* (a generation with its full prompt and every route
row the engine returned). The log stores *facts*: for each generation, the
outcome of the fold's step (``trajstore.fold.fold_step``) applied to the
trajectory's tail state at append time:

* the prompt as ``prefix_len`` tokens reused from the trajectory's current
  sequence plus the new tail, so a 30-turn episode does not store its prompt
  30 times;
* only the route rows the fold keeps: on a merge, rows for positions not
  recorded yet (a recorded route is never overwritten, docs/reference.md R3);
* the sample the call folds into (``sample_index``) and whether it merged;
* per-token versions from the engine's ``weight_versions`` spans when every
  label resolves (docs/reference.md "Versions", ``resolve_weight_versions``); otherwise
  the labels that did not, and the event is stored as sent (the materializer
  resolves it once the labels are mapped, and holds its trajectory back until
  then).

Where each rule lives: every rule of merging, routes (watermark, layout,
skipped rows) and reward modes is the fold's (``fold_step``); this module
keeps only what is admission's own: the trajectory lifecycle (started,
finished, rewards, the identical-retry rule), seq order, and expert ids
below the ``num_experts`` that trajectory_started declared.

The fold step decides a merge from the length and a hash of the current
sequence (``seq_len``, ``seq_hash`` of the tail, kept in the ``trajectories``
row), so admission reads no payload except in one rare case: a prefix
mismatch with ``routed_experts_start > 0``, which must check that the new
prompt agrees with the previous sequence on the skipped rows.

Pure: state in, state and facts out; the caller supplies ``load_sequence``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from trajstore.errors import ConflictError, ValidationError
from trajstore.events import (
    Event,
    Generation,
    Reward,
    TrajectoryFinished,
    TrajectoryStarted,
    VersionLabel,
    decimal_label,
)
from trajstore.events import GroupDropped, SampleAnnotation, TrainStep
from trajstore.fold import EMPTY_HASH, FoldStep, FoldTail, fold_step, sequence_hash

__all__ = ["TrajectoryState", "StoredGeneration", "Admitted", "admit", "admit_batch", "sequence_hash", "EMPTY_HASH",
           "resolve_weight_versions", "check_version_forms", "map_labels", "RecordedRoutes"]


@dataclass(frozen=True, slots=True)
class TrajectoryState:
    """Tail state of one trajectory (a ``trajectories`` row): admission's own
    fields, then the fold's tail (``tail``)."""

    trajectory_id: str
    group_id: str | None
    num_experts: int | None
    status: str = "running"
    revision: int = 0
    last_seq: int = -1
    reward_mode: str | None = None
    route_layers: int | None = None
    route_topk: int | None = None
    seq_len: int = 0  # length of the current sequence S_prev (prompt + output of the last call)
    seq_hash: bytes = EMPTY_HASH
    route_len: int = 0  # positions of the current sample covered by recorded (or skipped) rows
    reward: float | None = None
    num_samples: int = 0  # samples the generations so far fold into

    @property
    def tail(self) -> FoldTail:
        return FoldTail(num_samples=self.num_samples, seq_len=self.seq_len, seq_hash=self.seq_hash,
                        route_len=self.route_len, reward_mode=self.reward_mode, route_layers=self.route_layers,
                        route_topk=self.route_topk)

    def with_tail(self, tail: FoldTail, revision: int, last_seq: int) -> TrajectoryState:
        """This state after a call: the fold's ``tail``, ``revision`` and ``last_seq``, in one
        construction (``dataclasses.replace`` costs several times the constructor)."""
        assert tail.seq_hash is not None
        return TrajectoryState(self.trajectory_id, self.group_id, self.num_experts, self.status, revision, last_seq,
                               tail.reward_mode, tail.route_layers, tail.route_topk, tail.seq_len, tail.seq_hash,
                               tail.route_len, self.reward, tail.num_samples)

    def moved(self, *, status: str | None = None, reward: float | None = None) -> TrajectoryState:
        """This state one revision on, with a new ``status`` or ``reward`` (either, when given)."""
        return TrajectoryState(self.trajectory_id, self.group_id, self.num_experts,
                               self.status if status is None else status, self.revision + 1, self.last_seq,
                               self.reward_mode, self.route_layers, self.route_topk, self.seq_len, self.seq_hash,
                               self.route_len, self.reward if reward is None else reward, self.num_samples)


@dataclass(frozen=True, slots=True, eq=False)
class StoredGeneration:
    """A generation as the log stores it (the fact): the command and its fold step."""

    command: Generation  # as sent; scalars are taken from here
    prefix_len: int  # tokens of the previous sequence the prompt starts with (0 or seq_len)
    routes: np.ndarray | None  # rows kept, [rows, layers, topk]
    routes_start: int  # absolute position of routes[0]
    sample_index: int = 0  # the sample the call folds into
    merged: bool = False  # it continued the previous call's sequence
    unresolved: tuple[str, ...] = ()  # weight_versions labels the label map did not hold at admission
    route_rows_resent: int | None = None  # rows sent for positions the sample had recorded (None: no routes)
    route_rows_drifted: int | None = None  # of those, rows differing from the recorded ones (None: not measured)

    @classmethod
    def of(cls, command: Generation, step: FoldStep, unresolved: tuple[str, ...] = (),
           drift: tuple[int | None, int | None] = (None, None)) -> StoredGeneration:
        return cls(command, step.prefix_len, step.routes, step.routes_start, step.sample_index, step.merged,
                   unresolved, drift[0], drift[1])

    @property
    def prompt_tail(self) -> np.ndarray:
        return self.command.prompt_ids[self.prefix_len:]


@dataclass(frozen=True, slots=True, eq=False)
class Admitted:
    """One event accepted by admission."""

    event: Event
    stored: StoredGeneration | None  # generations only
    state: TrajectoryState | None  # trajectory state after this event (None for a version_label)
    noop: bool = False  # an identical retry that needs no new row


class RecordedRoutes:
    """The route rows a trajectory's current sample has recorded, for the drift
    figures (docs/reference.md "Routed experts", drift): what re-sent rows are compared with.

    Held as the kept rows of each call (``chunks``: ``(start, rows, valid)``,
    ``valid`` None when every row was captured, else a bool mask), never
    concatenated into one array: a merge adds its chunk, a new sample starts
    over (with the rows it inherits from the previous sample). Immutable once
    made (``plus`` returns a new one), so a cached one survives an append
    that fails; a chunk holds a copy of the kept rows, never a view that would
    keep a call's whole re-sent array alive."""

    __slots__ = ("sample_index", "chunks", "nbytes")

    def __init__(self, sample_index: int, chunks: list[tuple[int, np.ndarray, np.ndarray | None]] | None = None,
                 nbytes: int | None = None) -> None:
        self.sample_index = sample_index
        self.chunks = chunks or []
        self.nbytes = sum(c[1].nbytes for c in self.chunks) if nbytes is None else nbytes

    def plus(self, start: int, rows: np.ndarray) -> "RecordedRoutes":
        """These rows and ``rows`` (kept by a call, at ``start``)."""
        if not len(rows):
            return self
        return RecordedRoutes(self.sample_index, self.chunks + [(start, _own_rows(rows), None)],
                              self.nbytes + rows.nbytes)

    def compared(self, start: int, end: int) -> bool:
        """Is every position ``start <= p < end`` held by a chunk with every row captured
        (``count_drifted`` then compared each of them, none counted equal unseen)?"""
        spans = sorted((max(start, c), min(end, c + len(r))) for c, r, valid in self.chunks if valid is None)
        at = start
        for a, b in spans:
            if a > at:
                break
            at = max(at, b)
        return at >= end

    def head(self, n: int) -> list[tuple[int, np.ndarray, np.ndarray | None]]:
        """The chunks cut to positions ``< n`` (what a new sample inherits)."""
        out = []
        for start, rows, valid in self.chunks:
            if start < n:
                k = min(len(rows), n - start)
                out.append((start, rows[:k], None if valid is None else valid[:k]))
        return out

    def count_drifted(self, rows: np.ndarray, start: int) -> int:
        """How many of ``rows`` (at positions ``start, start+1, ...``) differ in any
        entry from the recorded row at their position (positions never captured count as equal)."""
        end = start + len(rows)
        drifted = 0
        for c_start, c_rows, valid in self.chunks:
            a, b = max(start, c_start), min(end, c_start + len(c_rows))
            if a >= b:
                continue
            sent = _words(rows[a - start:b - start], c_rows.dtype)
            kept = _words(c_rows[a - c_start:b - c_start], rows.dtype)
            if _same_bytes(sent, kept):  # the common case: one memcmp, no per-row reduction
                continue
            differs = _differing_rows(sent, kept)
            if valid is not None:
                differs &= valid[a - c_start:b - c_start]
            drifted += int(np.count_nonzero(differs))
        return drifted


def resolve_weight_versions(g: Generation, labels: Mapping[str, int]) -> tuple[Generation, tuple[str, ...]]:
    """docs/reference.md "Versions": the call with ``token_model_versions`` and ``model_version``
    derived from its ``weight_versions`` spans, and the labels that did not resolve.

    A decimal label (``"8"``, ``8``) is that version, ``"default"`` the event's
    own ``model_version``, any other label ``labels[label]``. When a label is
    missing the call is returned unchanged with the missing labels (sorted);
    nothing is guessed. Explicit ``token_model_versions`` win over the spans.
    Raises ValidationError (rule ``weight_versions``) when the resolved versions
    go back."""
    spans = g.weight_versions
    if spans is None or g.token_model_versions is not None:
        return g, ()
    values = []
    missing = set()
    for label, start, end in spans:
        v = _resolved(label, g.model_version, labels)
        if v is None:
            missing.add(label)
        values.append(v)
    if missing:
        return g, tuple(sorted(missing))  # type: ignore[arg-type]
    if not spans:
        return g, ()
    lengths = np.fromiter((end - start for _, start, end in spans), np.int64, len(spans))
    versions = np.repeat(np.asarray(values, dtype=np.int32), lengths)
    back = np.flatnonzero(np.diff(versions) < 0)
    if back.size:
        i = int(back[0])
        raise ValidationError(f"weight_versions resolve to versions that go back from {int(versions[i])} to "
                              f"{int(versions[i + 1])} at output token {i + 1} (versions never decrease)",
                              rule="weight_versions")
    return replace(g, token_model_versions=versions, model_version=int(versions[-1])), ()


def check_version_forms(g: Generation, labels: Mapping[str, int]) -> None:
    """docs/reference.md "Versions": a call that sends its versions in more than one form is
    consistent. Every ``weight_versions`` span whose label resolves now (decimal,
    ``"default"`` = the event's ``model_version``, or in ``labels``) agrees with
    ``token_model_versions`` over its tokens; without per-token versions, a
    ``model_version`` sent with spans equals the last token's version when the
    last span's label resolves now. A ``"default"`` span takes ``model_version``
    as its version, so a call with one states nothing else with it. Raises
    ValidationError (rule ``version_conflict``) naming the span; labels that do
    not resolve yet are not judged (the call is held until they are mapped).
    (``model_version`` against ``token_model_versions`` is checked at parsing,
    same rule.)"""
    spans = g.weight_versions
    if not spans:
        return
    tv = g.token_model_versions
    if tv is None:
        if g.model_version is None or any(label == "default" for label, _, _ in spans):
            return
        i = max(k for k, (_, start, end) in enumerate(spans) if end > start) if len(g.output_ids) else None
        if i is None:
            return
        label, start, end = spans[i]
        v = _resolved(label, g.model_version, labels)
        if v is not None and v != g.model_version:
            raise ValidationError(f"model_version {g.model_version} but the last output token's span, "
                                  f"weight_versions[{i}] {label!r} [{start}, {end}), is version {v}",
                                  rule="version_conflict")
        return
    for i, (label, start, end) in enumerate(spans):
        if end <= start:
            continue
        v = _resolved(label, g.model_version, labels)
        if v is None:
            continue
        differs = np.flatnonzero(tv[start:end] != v)
        if differs.size:
            k = start + int(differs[0])
            raise ValidationError(f"weight_versions[{i}] {label!r} [{start}, {end}) is version {v} but "
                                  f"token_model_versions has {int(tv[k])} at output token {k}",
                                  rule="version_conflict")


def _resolved(label: str | int, model_version: int | None, labels: Mapping[str, int]) -> int | None:
    """A span label's version now (docs/reference.md "Versions"); None while it is not mapped."""
    v = decimal_label(label)
    if v is not None:
        return v
    return model_version if label == "default" else labels.get(label)  # type: ignore[arg-type]


def map_labels(events: Sequence[Event], labels: Mapping[str, int]) -> dict[str, int]:
    """``labels`` extended by the batch's ``version_label`` events (a batch's labels
    resolve its generations wherever they stand in it). A label mapped to two
    versions raises ConflictError located at the event that remapped it."""
    out = dict(labels)
    for i, ev in enumerate(events):
        if isinstance(ev, VersionLabel):
            known = out.get(ev.label)
            if known is not None and known != ev.model_version:
                raise ConflictError(f"version label {ev.label!r} is already mapped to model_version {known}, "
                                    f"not {ev.model_version}", index=i)
            out[ev.label] = ev.model_version
    return out


def _own_rows(rows: np.ndarray) -> np.ndarray:
    """``rows`` held without keeping more memory alive than they use, and safe from the
    caller: the array itself when it is a read-only view of an immutable ``bytes`` of
    about its size (a call's routes decoded from base64 with no re-sent rows before
    them: its first call, or a call that starts a sample), else a copy (a view of a
    re-sent table would keep the whole table alive; a caller's array may be changed)."""
    base = rows
    while isinstance(base, np.ndarray) and base.base is not None:
        if base.flags.writeable:
            return np.array(rows)
        base = base.base
    if isinstance(base, bytes) and not rows.flags.writeable and len(base) <= rows.nbytes + _OWN_SLACK:
        return rows
    return np.array(rows)


_OWN_SLACK = 4096  # bytes beyond the rows a kept view may hold alive (a .npy header)


def _words(rows: np.ndarray, other: np.dtype) -> np.ndarray:
    """``rows`` [n, layers, topk] as [n, w] machine words when both sides have one dtype
    (a row of 48 x 8 uint8 ids is 48 uint64 words: the comparison reads 8x fewer
    elements), else as [n, layers * topk] ids."""
    flat = rows.reshape(len(rows), -1)
    if rows.dtype != other or not flat.flags.c_contiguous:
        return flat
    size = flat.shape[1] * flat.itemsize
    for word in (np.uint64, np.uint32, np.uint16):
        if size % np.dtype(word).itemsize == 0:
            return flat.view(word)
    return flat


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal(a, b)``, as one ``memcmp`` (``bytes.startswith`` at the view's offset)
    when the two have one dtype and shape, both C-contiguous, and one is a view of an
    immutable ``bytes`` (a table decoded from base64): no [n, w] booleans written
    and read back (a re-sent table is ~1 MB a call)."""
    if a.dtype == b.dtype and a.shape == b.shape and a.flags.c_contiguous and b.flags.c_contiguous:
        if not a.size:
            return True
        for x, y in ((a, b), (b, a)):
            base = x.base
            while isinstance(base, np.ndarray):
                base = base.base
            if isinstance(base, bytes):
                offset = x.ctypes.data - np.frombuffer(base, np.uint8).ctypes.data
                if 0 <= offset <= len(base) - x.nbytes:
                    return base.startswith(y.reshape(-1).view(np.uint8), offset)  # y's bytes, any dtype
    return bool(np.array_equal(a, b))


def _differing_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row of two [n, w] arrays: does any entry differ? The [n, w] booleans are
    reduced as machine words (half the time of ``np.any(axis=1)`` on 48x8 rows)."""
    ne = a != b
    for word in (np.uint64, np.uint32, np.uint16):
        if ne.shape[1] % np.dtype(word).itemsize == 0:
            ne = ne.view(word)
            break
    return ne.any(axis=1) if ne.shape[1] > 1 else ne[:, 0] != 0


RoutesSource = Callable[[], "RecordedRoutes | None"]
"""Returns the trajectory's current sample's recorded rows (called only when a
re-sent row must be compared); None: not available, the drift is not measured."""


def admit(
    event: Event,
    state: TrajectoryState | None,
    load_sequence: Callable[[str], np.ndarray],
    labels: Mapping[str, int] | None = None,
    stored_labels: Mapping[str, int] | None = None,
    recorded: RoutesSource | None = None,
) -> Admitted:
    """Check ``event`` against its trajectory's ``state``; return the fact and the new state.

    ``load_sequence(trajectory_id)`` returns the trajectory's current token
    sequence; it is called only for a prefix mismatch that skips route rows.
    ``labels``: the label map (docs/reference.md "Versions") the call's spans resolve with;
    ``stored_labels``: the part of it already in the log (a version_label
    mapping one of those again to the same version is a no-op).
    ``recorded()``: the current sample's recorded rows, asked for only when the
    call re-sends rows for recorded positions (their drift is counted);
    without it the drift is not measured (``route_rows_drifted`` None).
    """
    if isinstance(event, (TrainStep, SampleAnnotation)):
        return Admitted(event, None, None)  # store-wide; checked against the samples by trajstore.lineage._admission
    if isinstance(event, GroupDropped):
        return Admitted(event, None, None)  # store-wide; checked against the groups by trajstore.rollout._ledger
    if isinstance(event, VersionLabel):
        known = (stored_labels or {}).get(event.label)
        if known is not None and known != event.model_version:
            raise ConflictError(f"version label {event.label!r} is already mapped to model_version {known}, "
                                f"not {event.model_version}")
        return Admitted(event, None, None, noop=known is not None)
    if isinstance(event, TrajectoryStarted):
        if state is not None:
            raise ValidationError("trajectory already started", rule="already_started")
        return Admitted(event, None, TrajectoryState(event.trajectory_id, event.group_id, event.num_experts, revision=1))
    if state is None:
        raise ValidationError("unknown trajectory (no trajectory_started event)", rule="unknown_trajectory")
    if isinstance(event, Reward) and event.event_id is None and state.status != "running" and event.reward == state.reward:
        # A reward without event_id has no identity; re-sent after the finish with the
        # value already in force, it is the retry of an acknowledged append.
        return Admitted(event, None, state, noop=True)
    if state.status != "running":
        raise ValidationError(f"trajectory already finished ({state.status})", rule="finished_trajectory")
    if isinstance(event, TrajectoryFinished):
        return Admitted(event, None, state.moved(status=event.status))
    if isinstance(event, Reward):
        return Admitted(event, None, state.moved(reward=event.reward))
    return _admit_generation(event, state, load_sequence, labels or {}, recorded)


def _admit_generation(
    g: Generation, state: TrajectoryState, load_sequence: Callable[[str], np.ndarray], labels: Mapping[str, int],
    recorded: RoutesSource | None = None,
) -> Admitted:
    if g.seq != state.last_seq + 1:
        rule = "seq_taken" if g.seq <= state.last_seq else "seq_gap"
        raise ValidationError(f"seq {g.seq} but the next seq is {state.last_seq + 1}", rule=rule)
    step, tail = fold_step(state.tail, g, lambda: load_sequence(g.trajectory_id))
    drift, same = _drift(g, step, state, recorded)
    _check_expert_ids(g, state.num_experts, same)
    check_version_forms(g, labels)
    resolved, unresolved = resolve_weight_versions(g, labels)
    new_state = state.with_tail(tail, revision=state.revision + 1, last_seq=g.seq)
    return Admitted(resolved, StoredGeneration.of(resolved, step, unresolved, drift), new_state)


def _drift(g: Generation, step: FoldStep, state: TrajectoryState, recorded: RoutesSource | None
           ) -> tuple[tuple[int | None, int | None], int]:
    """``(route_rows_resent, route_rows_drifted)`` of a call (docs/reference.md drift): rows sent for
    positions below the sample's watermark (only a merge has any; the fold drops them),
    and how many of those differ from what was recorded; then how many leading rows of
    the call were compared with recorded rows and found equal (rows admission checked
    before, against the same ``num_experts``)."""
    rows = g.routed_experts
    if rows is None:
        return (None, None), 0
    if not step.merged:
        return (0, 0), 0
    resent = min(len(rows), max(0, state.route_len - g.routed_experts_start))
    if not resent:
        return (0, 0), 0
    have = recorded() if recorded is not None else None
    if have is None:
        return (resent, None), 0
    start = g.routed_experts_start
    drifted = have.count_drifted(rows[:resent], start)
    return (resent, drifted), resent if not drifted and have.compared(start, start + resent) else 0


def _resent_whole(have: RecordedRoutes | None, g: Generation, s: StoredGeneration) -> RecordedRoutes | None:
    """The recorded rows after a merged call that re-sent every recorded row from its
    ``routed_experts_start`` on, each compared and found equal, with its kept rows right
    after them in the same array (vLLM's calls): the call's own table, held as it was
    decoded (no copy; the chunks it equals are let go). None when that does not hold."""
    rows, resent = g.routed_experts, s.route_rows_resent or 0
    if have is None or rows is None or s.routes is None or not resent or s.route_rows_drifted != 0:
        return None
    start, n = g.routed_experts_start, resent + len(s.routes)
    if s.routes_start != start + resent or n > len(rows) or not have.compared(start, start + resent):
        return None
    whole = rows[:n]
    kept = whole[resent:]
    if (s.routes.dtype != kept.dtype or s.routes.shape != kept.shape
            or s.routes.__array_interface__["data"][0] != kept.__array_interface__["data"][0]
            or _own_rows(whole) is not whole):
        return None
    return RecordedRoutes(have.sample_index, have.head(start) + [(start, whole, None)])


def _next_recorded(have: RecordedRoutes | None, step: FoldStep) -> RecordedRoutes | None:
    """The recorded rows after a call with outcome ``step`` (None: unknown)."""
    if step.merged:
        return have.plus(step.routes_start, step.routes) if have is not None and step.routes is not None else have
    inherited = step.inherited_rows
    if inherited and have is None:
        return None
    out = RecordedRoutes(step.sample_index, have.head(inherited) if inherited and have is not None else None)
    return out.plus(step.routes_start, step.routes) if step.routes is not None else out


@functools.lru_cache(maxsize=None)
def _dtype_max(dtype: np.dtype) -> int:
    """The largest value ``dtype`` holds (``np.iinfo`` builds an object per call)."""
    return int(np.iinfo(dtype).max)


def _check_expert_ids(g: Generation, num_experts: int | None, same: int = 0) -> None:
    """Every expert id sent is below the num_experts trajectory_started declared.
    ``same``: leading rows found equal to recorded ones, checked when they were
    recorded (a re-sent table's bulk: not scanned again)."""
    r = g.routed_experts
    # a dtype that cannot hold num_experts needs no scan (uint8 rows against 256+ experts)
    if num_experts is None or r is None or not r.size or _dtype_max(r.dtype) < num_experts:
        return
    r = r[same:]
    if not r.size:
        return
    hi = int(r.max())
    if hi >= num_experts:
        raise ValidationError(
            f"routed_experts holds expert id {hi} but num_experts is {num_experts}", rule="expert_id_range"
        )


def admit_batch(
    events: Sequence[Event],
    states: dict[str, TrajectoryState | None],
    load_sequence: Callable[[str], np.ndarray],
    labels: Mapping[str, int] | None = None,
    recorded_routes: Callable[[str], RecordedRoutes | None] | None = None,
    routes_after: dict[str, RecordedRoutes | None] | None = None,
) -> list[Admitted]:
    """Admit events in order, threading each trajectory's state through the batch.

    ``labels``: the stored label map (at least the labels the batch names);
    the batch's own ``version_label`` events extend it for every event of the
    batch. Raises ValidationError (ConflictError for a remapped label) located
    at the offending event's index.

    ``recorded_routes(trajectory_id)``: the current sample's recorded rows
    before the batch (asked only when a call re-sends rows, and only when the
    batch has not changed them before); the batch's calls update them. When
    ``routes_after`` is given, it receives each touched trajectory's recorded
    rows after the batch, where known (None: unknown).
    """
    stored_labels = dict(labels or {})
    batch_labels = map_labels(events, stored_labels)
    states = dict(states)
    last_calls: dict[str, Generation] = {}  # a call's sequence is built only if asked for (rare)

    def sequence(tid: str) -> np.ndarray:
        if tid in last_calls:
            g = last_calls[tid]
            return np.concatenate([g.prompt_ids, g.output_ids])
        return load_sequence(tid)

    working: dict[str, RecordedRoutes | None] = {}  # absent: not needed yet (still as before the batch)

    def recorded(tid: str) -> RoutesSource:
        def get() -> RecordedRoutes | None:
            if tid not in working:
                working[tid] = recorded_routes(tid) if recorded_routes is not None else None
            return working[tid]
        return get

    out: list[Admitted] = []
    for i, ev in enumerate(events):
        try:
            adm = admit(ev, states.get(ev.trajectory_id), sequence, batch_labels, stored_labels,
                        recorded(ev.trajectory_id))
        except ValidationError as e:
            raise e.at(i, ev.trajectory_id or None) from None
        if isinstance(ev, VersionLabel):
            stored_labels.setdefault(ev.label, ev.model_version)  # a repeat in the batch is a no-op
            out.append(adm)
            continue
        if adm.state is None:  # a lineage or ledger event: store-wide
            out.append(adm)
            continue
        states[ev.trajectory_id] = adm.state
        if isinstance(ev, Generation):
            last_calls[ev.trajectory_id] = ev
            s = adm.stored
            assert s is not None
            step = FoldStep(s.merged, s.sample_index, s.prefix_len, s.routes, s.routes_start)
            tid = ev.trajectory_id
            if not step.merged:
                if step.inherited_rows and tid not in working:
                    recorded(tid)()  # the rows it inherits (the skipped-rows check read the log already)
                working[tid] = _next_recorded(working.get(tid), step)
            elif step.routes is not None and len(step.routes):
                # new rows: known only if loaded (a call that re-sent rows loaded it); else unknown
                # until the next comparison reloads (engines that send only new rows never compare)
                working[tid] = _resent_whole(working.get(tid), ev, s) or _next_recorded(working.get(tid), step)
        out.append(adm)
    if routes_after is not None:
        routes_after.update(working)
    return out
