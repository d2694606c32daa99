"""Admission: validate commands against trajectory history and normalize them
into the facts the log stores.

A harness sends *commands* (a generation with its full prompt and every route
row the engine returned). The log stores *facts* normalized against the
trajectory's tail state at append time:

* the prompt as ``prefix_len`` tokens reused from the trajectory's current
  sequence plus the new tail, so a 30-turn episode does not store its prompt
  30 times;
* only the route rows the fold can use: on a merge, rows for positions not
  recorded yet (a recorded route is never overwritten, SPEC R3).

The merge decision needs only the length and a hash of the current sequence
(``seq_len``, ``seq_hash``), so admission reads no payload except in one rare
case: a prefix mismatch with ``routed_experts_start > 0``, which must check
that the new prompt agrees with the previous sequence on the skipped rows.

Pure: state in, state and facts out; the caller supplies ``load_sequence``.
"""

from __future__ import annotations

import hashlib
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

__all__ = ["TrajectoryState", "StoredGeneration", "Admitted", "admit", "admit_batch", "sequence_hash", "EMPTY_HASH"]


def sequence_hash(tokens: np.ndarray) -> bytes:
    """128-bit digest of a token sequence (int32 little-endian bytes)."""
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype="<i4").tobytes(), digest_size=16).digest()


EMPTY_HASH = sequence_hash(np.zeros(0, dtype=np.int32))


@dataclass(frozen=True, slots=True)
class TrajectoryState:
    """Tail state of one trajectory (a ``trajectories`` row)."""

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


@dataclass(frozen=True, slots=True, eq=False)
class StoredGeneration:
    """A generation as the log stores it (the fact)."""

    command: Generation  # as sent; scalars are taken from here
    prefix_len: int  # tokens of the previous sequence the prompt starts with (0 or seq_len)
    routes: np.ndarray | None  # rows kept, [rows, layers, topk]
    routes_start: int  # absolute position of routes[0]

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
    reward_mode = _reward_mode(g, state.reward_mode)
    layers, topk = _check_routes(g, state)
    merged = g.seq > 0 and _starts_with_sequence(g.prompt_ids, state)
    if merged:
        routes, routes_start, route_len = _merge_routes(g, state.route_len)
    else:
        _check_skipped_rows(g, state, load_sequence)
        routes, routes_start = g.routed_experts, g.routed_experts_start
        route_len = g.routed_experts_start + len(routes) if routes is not None else 0
    full = np.concatenate([g.prompt_ids, g.output_ids])
    new_state = replace(
        state,
        revision=state.revision + 1,
        last_seq=g.seq,
        reward_mode=reward_mode,
        route_layers=layers,
        route_topk=topk,
        seq_len=len(full),
        seq_hash=sequence_hash(full),
        route_len=route_len,
    )
    stored = StoredGeneration(g, state.seq_len if merged else 0, routes, routes_start)
    return Admitted(g, stored, new_state)


def _reward_mode(g: Generation, mode: str | None) -> str | None:
    this = "token" if g.token_rewards is not None else "scalar" if g.reward is not None else None
    if this is not None and mode is not None and this != mode:
        raise ValidationError(
            f"{this} rewards in a trajectory that already uses {mode} rewards", rule="reward_mode"
        )
    return mode or this


def _check_routes(g: Generation, state: TrajectoryState) -> tuple[int | None, int | None]:
    r = g.routed_experts
    if r is None:
        return state.route_layers, state.route_topk
    layers, topk = int(r.shape[1]), int(r.shape[2])
    if state.route_layers is not None and (layers, topk) != (state.route_layers, state.route_topk):
        raise ValidationError(
            f"routed_experts [layers, topk] = [{layers}, {topk}] but the trajectory uses "
            f"[{state.route_layers}, {state.route_topk}]",
            rule="routes_shape",
        )
    if state.num_experts is not None and r.size:
        hi = int(r.max())
        if hi >= state.num_experts:
            raise ValidationError(
                f"routed_experts holds expert id {hi} but num_experts is {state.num_experts}",
                rule="expert_id_range",
            )
    return layers, topk


def _starts_with_sequence(prompt: np.ndarray, state: TrajectoryState) -> bool:
    return len(prompt) >= state.seq_len and sequence_hash(prompt[: state.seq_len]) == state.seq_hash


def _merge_routes(g: Generation, route_len: int) -> tuple[np.ndarray | None, int, int]:
    """Keep only rows for positions not recorded yet (never overwrite)."""
    r, start = g.routed_experts, g.routed_experts_start
    if r is None:
        return None, route_len, route_len
    skip = max(0, route_len - start)
    kept = r[skip:]
    return kept, start + skip, max(route_len, start + len(r))


def _check_skipped_rows(
    g: Generation, state: TrajectoryState, load_sequence: Callable[[str], np.ndarray]
) -> None:
    """On a mismatch, rows below routed_experts_start must come from the previous sample."""
    start = g.routed_experts_start
    if g.routed_experts is None or start == 0:
        return
    if g.seq == 0 or start > state.route_len or start > len(g.prompt_ids):
        raise ValidationError(
            f"routed_experts_start {start} skips route rows that were never recorded "
            f"(the previous sample has {state.route_len if g.seq else 0})",
            rule="missing_route_rows",
        )
    previous = load_sequence(g.trajectory_id)
    if not np.array_equal(previous[:start], g.prompt_ids[:start]):
        raise ValidationError(
            f"routed_experts_start {start} skips rows, but the prompt differs from the recorded "
            "sequence on those positions",
            rule="missing_route_rows",
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
