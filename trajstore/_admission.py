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
  recorded yet (a recorded route is never overwritten, SPEC R3);
* the sample the call folds into (``sample_index``) and whether it merged.

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

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from trajstore.errors import ValidationError
from trajstore.events import (
    Event,
    Generation,
    Reward,
    TrajectoryFinished,
    TrajectoryStarted,
)
from trajstore.fold import EMPTY_HASH, FoldStep, FoldTail, fold_step, sequence_hash

__all__ = ["TrajectoryState", "StoredGeneration", "Admitted", "admit", "admit_batch", "sequence_hash", "EMPTY_HASH"]


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

    def with_tail(self, tail: FoldTail) -> TrajectoryState:
        assert tail.seq_hash is not None
        return replace(self, num_samples=tail.num_samples, seq_len=tail.seq_len, seq_hash=tail.seq_hash,
                       route_len=tail.route_len, reward_mode=tail.reward_mode, route_layers=tail.route_layers,
                       route_topk=tail.route_topk)


@dataclass(frozen=True, slots=True, eq=False)
class StoredGeneration:
    """A generation as the log stores it (the fact): the command and its fold step."""

    command: Generation  # as sent; scalars are taken from here
    prefix_len: int  # tokens of the previous sequence the prompt starts with (0 or seq_len)
    routes: np.ndarray | None  # rows kept, [rows, layers, topk]
    routes_start: int  # absolute position of routes[0]
    sample_index: int = 0  # the sample the call folds into
    merged: bool = False  # it continued the previous call's sequence

    @classmethod
    def of(cls, command: Generation, step: FoldStep) -> StoredGeneration:
        return cls(command, step.prefix_len, step.routes, step.routes_start, step.sample_index, step.merged)

    @property
    def prompt_tail(self) -> np.ndarray:
        return self.command.prompt_ids[self.prefix_len:]


@dataclass(frozen=True, slots=True, eq=False)
class Admitted:
    """One event accepted by admission."""

    event: Event
    stored: StoredGeneration | None  # generations only
    state: TrajectoryState  # trajectory state after this event
    noop: bool = False  # an identical retry that needs no new row


def admit(
    event: Event,
    state: TrajectoryState | None,
    load_sequence: Callable[[str], np.ndarray],
) -> Admitted:
    """Check ``event`` against its trajectory's ``state``; return the fact and the new state.

    ``load_sequence(trajectory_id)`` returns the trajectory's current token
    sequence; it is called only for a prefix mismatch that skips route rows.
    """
    if isinstance(event, TrajectoryStarted):
        if state is not None:
            raise ValidationError("trajectory already started", rule="already_started")
        new = TrajectoryState(event.trajectory_id, event.group_id, event.num_experts)
        return Admitted(event, None, replace(new, revision=1))
    if state is None:
        raise ValidationError("unknown trajectory (no trajectory_started event)", rule="unknown_trajectory")
    if isinstance(event, Reward) and event.event_id is None and state.status != "running" and event.reward == state.reward:
        # A reward without event_id has no identity; re-sent after the finish with the
        # value already in force, it is the retry of an acknowledged append.
        return Admitted(event, None, state, noop=True)
    if state.status != "running":
        raise ValidationError(f"trajectory already finished ({state.status})", rule="finished_trajectory")
    if isinstance(event, TrajectoryFinished):
        return Admitted(event, None, replace(state, status=event.status, revision=state.revision + 1))
    if isinstance(event, Reward):
        return Admitted(event, None, replace(state, reward=event.reward, revision=state.revision + 1))
    return _admit_generation(event, state, load_sequence)


def _admit_generation(
    g: Generation, state: TrajectoryState, load_sequence: Callable[[str], np.ndarray]
) -> Admitted:
    if g.seq != state.last_seq + 1:
        rule = "seq_taken" if g.seq <= state.last_seq else "seq_gap"
        raise ValidationError(f"seq {g.seq} but the next seq is {state.last_seq + 1}", rule=rule)
    step, tail = fold_step(state.tail, g, lambda: load_sequence(g.trajectory_id))
    _check_expert_ids(g, state.num_experts)
    new_state = replace(state.with_tail(tail), revision=state.revision + 1, last_seq=g.seq)
    return Admitted(g, StoredGeneration.of(g, step), new_state)


def _check_expert_ids(g: Generation, num_experts: int | None) -> None:
    """Every expert id sent is below the num_experts trajectory_started declared."""
    r = g.routed_experts
    # a dtype that cannot hold num_experts needs no scan (uint8 rows against 256+ experts)
    if num_experts is None or r is None or not r.size or np.iinfo(r.dtype).max < num_experts:
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
) -> list[Admitted]:
    """Admit events in order, threading each trajectory's state through the batch.

    Raises ValidationError located at the offending event's index.
    """
    states = dict(states)
    last_sequences: dict[str, np.ndarray] = {}

    def sequence(tid: str) -> np.ndarray:
        return last_sequences[tid] if tid in last_sequences else load_sequence(tid)

    out: list[Admitted] = []
    for i, ev in enumerate(events):
        try:
            adm = admit(ev, states.get(ev.trajectory_id), sequence)
        except ValidationError as e:
            raise e.at(i, ev.trajectory_id) from None
        states[ev.trajectory_id] = adm.state
        if isinstance(ev, Generation):
            last_sequences[ev.trajectory_id] = np.concatenate([ev.prompt_ids, ev.output_ids])
        out.append(adm)
    return out
