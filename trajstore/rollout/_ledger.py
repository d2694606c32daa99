"""The rollout ledger (docs/reference.md "Rollout ledger"): its admission rules and
the resume plan a driver reads.

Admission (``ledger_changes``): a batch's ``trajectory_started`` events that name
a group, its ``trajectory_finished`` events of grouped trajectories and its
``group_dropped`` events, checked against the groups the store holds
(``EventLog.load_ledger``) and the batch's own earlier events:

* every trajectory of a ledger group carries the group's ``run``, ``prompt_id``,
  ``epoch`` and ``group_size`` (``group_mismatch``; a trajectory started
  without them in a ledger group too, and a ledger group whose id trajectories
  outside the ledger already use);
* a ``(run, prompt_id, epoch)`` is answered by one group (``prompt_redispatched``,
  naming the first);
* a dropped group takes no new trajectory (``group_dropped``), and is dropped
  once; a ``group_dropped`` names a ledger group of its run (``unknown_group``,
  ``group_mismatch``).

Each accepted event gets its ``LedgerChange``, which ``log._ledger.write_ledger``
applies to ``ledger_groups`` in the append's transaction.

The plan (``rollout_plan``): a run's groups and their trajectories, read in one
transaction (``EventLog.rollout_rows``), and the tail of each running
trajectory of an open group, rebuilt from its last recorded call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from trajstore.errors import ValidationError
from trajstore.events import WHOLE_STATUSES, Event, Generation, GroupDropped, TrajectoryFinished, TrajectoryStarted

__all__ = ["Group", "LedgerChange", "RolloutPlan", "Tail", "ledger_changes", "ledger_reads", "rollout_plan"]


@dataclass(frozen=True, slots=True)
class LedgerChange:
    """What one accepted event changes in ``ledger_groups``."""

    kind: str  # "start" | "finish" | "drop" | "plain" (a start without the ledger's fields: guarded)
    group_id: str
    fields: tuple[str, str, int, int] | None = None  # a start's (run, prompt_id, epoch, group_size)
    whole: bool = False  # a finish: completed/truncated (counts toward group_size)
    reason: str | None = None  # a drop's reason


@dataclass(frozen=True, slots=True, eq=False)
class Tail:
    """A running trajectory as a restarted driver continues it: its next call has
    ``seq = next_seq`` and a prompt that starts with ``tokens`` (int32: the prompt and
    output of its last recorded call; empty when it has none). ``last_version`` and
    ``last_finish_reason`` are that call's (None: none recorded, or not known yet)."""

    trajectory_id: str
    next_seq: int
    tokens: np.ndarray
    last_version: int | None
    last_finish_reason: str | None


@dataclass(frozen=True, slots=True)
class Group:
    """One group of the ledger: ``finished`` (completed/truncated) and ``failed``
    (aborted/failed/abandoned) trajectory ids and the ``running`` trajectories'
    tails, each in the order they started. ``missing`` episodes still to start for
    the group to be whole. ``dropped`` (with ``reason``): a ``group_dropped`` was
    appended for it."""

    group_id: str
    prompt_id: str
    epoch: int
    group_size: int
    finished: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()
    running: tuple[Tail, ...] = ()
    dropped: bool = False
    reason: str | None = None

    @property
    def missing(self) -> int:
        return max(0, self.group_size - len(self.finished) - len(self.running))

    @property
    def whole(self) -> bool:
        return not self.dropped and len(self.finished) >= self.group_size


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """A run's resume plan (docs/reference.md "Rollout ledger").

    ``dispatched``: every ``(prompt_id, epoch)`` that has a group (whole, open or
    dropped): never dispatch it again. ``whole``: groups with nothing left to do.
    ``open``: neither whole nor dropped, oldest first (by their first
    trajectory_started). ``dropped``: dropped groups; their ``running``
    trajectories are the driver's to finish (``aborted``). An unknown run has an
    empty plan."""

    run: str
    dispatched: frozenset[tuple[str, int]] = frozenset()
    whole: tuple[Group, ...] = ()
    open: tuple[Group, ...] = ()
    dropped: tuple[Group, ...] = field(default_factory=tuple)


# -- admission -------------------------------------------------------------------------

def ledger_reads(events: Sequence[Event], plain: bool = True
                 ) -> tuple[set[str], set[tuple[str, str, int]], set[str]] | None:
    """What admitting ``events`` reads (``EventLog.load_ledger``): the group ids they
    name, the ``(run, prompt_id, epoch)`` keys their ledger starts answer, and the
    group ids of those starts (checked for trajectories outside the ledger). None: the
    batch has no ledger event (and, with ``plain``, no grouped trajectory_started).

    ``plain=False``: the groups of trajectory_started events without the ledger's
    fields are not read; the append's transaction guards them instead (a ledger
    group of that id fails it: ``LedgerChange("plain")``), and the retry reads them."""
    ids: set[str] = set()
    prompts: set[tuple[str, str, int]] = set()
    ledger_ids: set[str] = set()
    for ev in events:
        if isinstance(ev, TrajectoryStarted) and ev.group_id is not None:
            if ev.run is not None:
                ids.add(ev.group_id)
                prompts.add((ev.run, ev.prompt_id, ev.epoch))  # type: ignore[arg-type]
                ledger_ids.add(ev.group_id)
            elif plain:
                ids.add(ev.group_id)
        elif isinstance(ev, GroupDropped):
            ids.add(ev.group_id)
    return (ids, prompts, ledger_ids) if ids else None


def _describe(fields: Sequence[Any]) -> str:
    run, prompt_id, epoch, size = fields
    return f"run {run!r}, prompt_id {prompt_id!r}, epoch {epoch}, group_size {size}"


def ledger_changes(
    events: Sequence[tuple[int, Event, str | None]],
    loaded: tuple[Mapping[str, Mapping[str, Any]], Mapping[tuple[str, str, int], str], set[str]],
) -> dict[int, LedgerChange]:
    """The ledger change of each of ``events`` (``(index, event, group_id of its
    trajectory)``, in batch order) that has one, by index. ``loaded``: what
    ``EventLog.load_ledger`` read for them. Raises ValidationError located at the
    first event refused."""
    stored_groups, stored_prompts, plain_stored = loaded
    groups: dict[str, list[Any]] = {  # group id -> [fields, dropped]
        gid: [(r["run"], r["prompt_id"], int(r["epoch"]), int(r["group_size"])), r["dropped_position"] is not None]
        for gid, r in stored_groups.items()}
    prompts = dict(stored_prompts)
    plain = set(plain_stored)
    out: dict[int, LedgerChange] = {}
    for i, ev, group_id in events:
        try:
            change = _change(ev, group_id, groups, prompts, plain)
        except ValidationError as e:
            raise e.at(i, ev.trajectory_id or None) from None
        if change is not None:
            out[i] = change
    return out


def _change(ev: Event, group_id: str | None, groups: dict[str, list[Any]],
            prompts: dict[tuple[str, str, int], str], plain: set[str]) -> LedgerChange | None:
    if isinstance(ev, TrajectoryStarted):
        if ev.group_id is None:
            return None
        gid = ev.group_id
        known = groups.get(gid)
        fields = ev.ledger
        if fields is None:
            if known is not None:
                raise ValidationError(f"group {gid!r} is a rollout ledger group ({_describe(known[0])}): each of its "
                                      f"trajectories carries run, prompt_id, epoch and group_size", rule="group_mismatch")
            plain.add(gid)
            return LedgerChange("plain", gid)
        if known is not None:
            if tuple(known[0]) != fields:
                raise ValidationError(f"group {gid!r} is {_describe(known[0])}, not {_describe(fields)}",
                                      rule="group_mismatch")
            if known[1]:
                raise ValidationError(f"group {gid!r} is dropped: it takes no new trajectory", rule="group_dropped")
            return LedgerChange("start", gid, fields)
        if gid in plain:
            raise ValidationError(f"group {gid!r} already has trajectories started without run, prompt_id, epoch "
                                  f"and group_size", rule="group_mismatch")
        key = fields[:3]
        first = prompts.get(key)  # type: ignore[arg-type]
        if first is not None and first != gid:
            raise ValidationError(f"prompt {fields[1]!r} of epoch {fields[2]} in run {fields[0]!r} is already "
                                  f"answered by group {first!r} (answer it again in another epoch)",
                                  rule="prompt_redispatched")
        groups[gid] = [fields, False]
        prompts[key] = gid  # type: ignore[index]
        return LedgerChange("start", gid, fields)
    if isinstance(ev, TrajectoryFinished):
        # every grouped trajectory: a group outside the ledger has no row, and the update changes nothing
        return None if group_id is None else LedgerChange("finish", group_id, whole=ev.status in WHOLE_STATUSES)
    if isinstance(ev, GroupDropped):
        known = groups.get(ev.group_id)
        if known is None:
            raise ValidationError(f"group_dropped names group {ev.group_id!r}, which no trajectory_started with "
                                  f"run, prompt_id, epoch and group_size opened", rule="unknown_group")
        if known[0][0] != ev.run:
            raise ValidationError(f"group {ev.group_id!r} belongs to run {known[0][0]!r}, not {ev.run!r}",
                                  rule="group_mismatch")
        if known[1]:
            raise ValidationError(f"group {ev.group_id!r} is already dropped", rule="group_dropped")
        known[1] = True
        return LedgerChange("drop", ev.group_id, reason=ev.reason)
    return None


# -- the resume plan -------------------------------------------------------------------

def rollout_plan(run: str, groups: Sequence[tuple], members: Sequence[tuple[str, str, str, int]],
                 tails: Callable[[Sequence[tuple[str, int]]], Mapping[str, tuple[np.ndarray, Generation | None]]]
                 ) -> RolloutPlan:
    """The plan from ``EventLog.rollout_rows(run)`` (group rows as tuples of
    ``log._ledger.GROUP_COLUMNS``). ``tails(running)`` rebuilds the last call of each
    running ``(trajectory_id, last_seq)``: ``trajectory_id -> (tokens, last call or None)``."""
    by_group: dict[str, list[tuple[str, str, str, int]]] = {}
    for m in members:
        by_group.setdefault(m[0], []).append(m)
    rebuilt = tails([(m[1], int(m[3])) for m in members if m[2] == "running"]) if members else {}
    whole, open_, dropped = [], [], []
    dispatched = set()
    for gid, _run, prompt_id, epoch, size, *_, dropped_position, reason, _at in groups:
        finished, failed, running = [], [], []
        for _, tid, status, last_seq in by_group.get(gid, ()):
            if status == "running":
                running.append(_tail(tid, int(last_seq), rebuilt.get(tid)))
            elif status in WHOLE_STATUSES:
                finished.append(tid)
            else:
                failed.append(tid)
        is_dropped = dropped_position is not None
        group = Group(gid, prompt_id, int(epoch), int(size), tuple(finished), tuple(failed), tuple(running),
                      is_dropped, reason)
        (dropped if is_dropped else whole if len(finished) >= size else open_).append(group)
        dispatched.add((prompt_id, int(epoch)))
    return RolloutPlan(run, frozenset(dispatched), tuple(whole), tuple(open_), tuple(dropped))


_NO_TOKENS = np.zeros(0, dtype=np.int32)
_NO_TOKENS.setflags(write=False)


def _tail(tid: str, last_seq: int, rebuilt: tuple[np.ndarray, Generation | None] | None) -> Tail:
    tokens, last = rebuilt if rebuilt is not None else (_NO_TOKENS, None)
    return Tail(tid, last_seq + 1, tokens, None if last is None else last.model_version,
                None if last is None else last.finish_reason)


# -- the plan as JSON (the ingest service's GET /v1/rollout_state) --------------------

def plan_to_json(plan: RolloutPlan) -> dict[str, Any]:
    """The plan as a JSON object; each tail's tokens as ``{b64, dtype, shape}`` (``_wire``)."""
    from trajstore.events._wire import encode_b64

    def group(g: Group) -> dict[str, Any]:
        return {"group_id": g.group_id, "prompt_id": g.prompt_id, "epoch": g.epoch, "group_size": g.group_size,
                "finished": list(g.finished), "failed": list(g.failed), "dropped": g.dropped, "reason": g.reason,
                "running": [{"trajectory_id": t.trajectory_id, "next_seq": t.next_seq, "tokens": encode_b64(t.tokens),
                             "last_version": t.last_version, "last_finish_reason": t.last_finish_reason}
                            for t in g.running]}

    return {"run": plan.run, "dispatched": sorted([p, e] for p, e in plan.dispatched),
            "whole": [group(g) for g in plan.whole], "open": [group(g) for g in plan.open],
            "dropped": [group(g) for g in plan.dropped]}


def plan_from_json(obj: Mapping[str, Any]) -> RolloutPlan:
    """``plan_to_json``'s inverse."""
    from trajstore.events._wire import decode_array

    def group(g: Mapping[str, Any]) -> Group:
        return Group(g["group_id"], g["prompt_id"], int(g["epoch"]), int(g["group_size"]), tuple(g["finished"]),
                     tuple(g["failed"]),
                     tuple(Tail(t["trajectory_id"], int(t["next_seq"]),
                                np.ascontiguousarray(decode_array(t["tokens"], field="tokens").reshape(-1),
                                                     dtype=np.int32),
                                t["last_version"], t["last_finish_reason"]) for t in g["running"]),
                     bool(g["dropped"]), g["reason"])

    return RolloutPlan(obj["run"], frozenset((p, int(e)) for p, e in obj["dispatched"]),
                       tuple(group(g) for g in obj["whole"]), tuple(group(g) for g in obj["open"]),
                       tuple(group(g) for g in obj["dropped"]))


def reader_lookup(log: Any) -> Callable[[set[str]], dict[str, tuple[int, bool]]] | None:
    """What a reader asks of the ledger (``_batch_plan.UnitBuilder``): ``{group_id:
    (group_size, dropped)}`` of the ledger groups among some group ids, one read. None
    when ``log`` keeps no ledger (a reader over a replay service)."""
    load = getattr(log, "load_ledger", None)
    if load is None:
        return None

    def lookup(group_ids: set[str]) -> dict[str, tuple[int, bool]]:
        try:
            rows = load(group_ids, ())[0]
        except NotImplementedError:
            return {}
        return {gid: (int(r["group_size"]), r["dropped_position"] is not None) for gid, r in rows.items()}

    return lookup


def changes_of(log: Any, kept: Sequence[tuple[int, Any]], before: list | None = None, *,
               plain: bool = True) -> dict[int, "LedgerChange"]:
    """The rollout ledger's changes of an append's stored events by index (``trajstore.rollout._ledger``).
    ``before``: the ledger events of earlier checked batches, admitted first (index -1), then extended.
    ``plain``: read the groups of starts without the ledger's fields (else the commit guards them)."""
    events = [(i, a.event, a.state.group_id if a.state is not None else None) for i, a in kept]
    prior = before if before is not None else []
    reads = ledger_reads([ev for _, ev, _ in prior + events], plain)
    changes = ledger_changes(prior + events, ({}, {}, set()) if reads is None else log.load_ledger(*reads))
    changes.pop(-1, None)
    if before is not None:
        before.extend((-1, ev, gid) for _, ev, gid in events if isinstance(ev, (TrajectoryStarted, GroupDropped)))
    return changes
