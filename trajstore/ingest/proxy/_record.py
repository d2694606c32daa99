"""What the proxy records: a call's ``Tag`` (which trajectory, which policy version) and the
``Recorder`` that numbers each trajectory's calls and appends them."""

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from trajstore._append.admission import sequence_hash
from trajstore.errors import ValidationError
from trajstore.ingest._event_dicts import trajectory_started

__all__ = ["Recorder", "Tag", "tag_of"]


@dataclass
class Tag:
    """What the harness said about a call: which trajectory, which policy version, and
    (a rollout driver's trajectory) its rollout ledger fields, all or none."""

    trajectory_id: str
    model_version: int
    group_id: str | None = None
    num_experts: int | None = None
    run: str | None = None
    prompt_id: str | None = None
    epoch: int | None = None
    group_size: int | None = None


class Recorder:
    """Numbers each trajectory's calls and appends them, one call at a time per trajectory.

    With a ``committer`` (the ingest service's ``GroupCommitter``), records of
    different trajectories that are ready at once are appended together in
    one store append (one payload segment, one transaction): calls from many
    rollouts share the append's fixed cost. A record refused in a group
    fails only its own call.
    """

    def __init__(self, store: Any, committer: Any = None) -> None:
        self.store = store
        self.committer = committer
        self._next_seq: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._mutex = threading.Lock()

    def _lock(self, trajectory_id: str) -> asyncio.Lock:
        with self._mutex:
            return self._locks.setdefault(trajectory_id, asyncio.Lock())

    def _tail(self, trajectory_id: str) -> tuple[bool, int]:
        """(is the trajectory stored?, its next seq) as the store knows it."""
        state = self.store.trajectory_state(trajectory_id)
        return (False, 0) if state is None else (True, state.last_seq + 1)

    async def route_start(self, trajectory_id: str, prompt_ids: list) -> int:
        """Route rows the trajectory has recorded that a call with ``prompt_ids`` need not get again.

        Non-zero only when the prompt continues the recorded sequence (the
        call will merge), so the rows below it are the recorded ones.
        """
        from starlette.concurrency import run_in_threadpool

        state = await run_in_threadpool(self.store.trajectory_state, trajectory_id)
        if state is None or state.status != "running" or state.route_len <= 0:
            return 0
        try:
            prompt = np.asarray(prompt_ids, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            return 0
        if prompt.ndim != 1 or len(prompt) < state.seq_len or (prompt.size and (prompt.min() < 0 or prompt.max() > np.iinfo(np.int32).max)):
            return 0
        if sequence_hash(prompt[: state.seq_len].astype(np.int32)) != state.seq_hash:
            return 0
        return min(state.route_len, len(prompt) - 1)

    async def _append(self, events: list[dict]) -> None:
        from starlette.concurrency import run_in_threadpool

        if self.committer is None:
            await run_in_threadpool(self.store.append, events)
        else:
            await asyncio.wrap_future(self.committer.submit(events))

    async def record(self, tag: Tag, make_events: Callable[[int], list[dict]]) -> int:
        """Append ``make_events(seq)`` (the call's generation) as ``tag``'s next; return its seq."""
        from starlette.concurrency import run_in_threadpool

        async with self._lock(tag.trajectory_id):
            for attempt in (0, 1):
                known = tag.trajectory_id in self._next_seq
                stored, seq = (True, self._next_seq[tag.trajectory_id]) if known else await run_in_threadpool(self._tail, tag.trajectory_id)
                events = make_events(seq)
                if not stored:
                    events.insert(0, trajectory_started(
                        tag.trajectory_id, group_id=tag.group_id, num_experts=tag.num_experts, run=tag.run,
                        prompt_id=tag.prompt_id, epoch=tag.epoch, group_size=tag.group_size))
                try:
                    await self._append(events)
                except ValidationError as e:
                    # another proxy (or a restart) moved the trajectory: re-read once
                    self._next_seq.pop(tag.trajectory_id, None)
                    if attempt or e.rule not in ("seq_taken", "seq_gap", "conflict", "unknown_trajectory"):
                        raise
                    continue
                self._next_seq[tag.trajectory_id] = seq + len(events) - (0 if stored else 1)
                return seq
        raise AssertionError("unreachable")

    async def finish(self, trajectory_id: str, status: str, reward: float | None) -> None:
        events: list[dict] = []
        if reward is not None:
            events.append({"type": "reward", "trajectory_id": trajectory_id, "reward": reward})
        events.append({"type": "trajectory_finished", "trajectory_id": trajectory_id, "status": status})
        async with self._lock(trajectory_id):
            await self._append(events)
            self._next_seq.pop(trajectory_id, None)
        with self._mutex:
            self._locks.pop(trajectory_id, None)


def _int_or_none(value: Any, what: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValidationError(f"{what} must be an integer, got {value!r}", rule=what) from None


def tag_of(headers: Any, body: dict, default_model_version: int, default_num_experts: int | None) -> Tag | None:
    """The call's Tag from headers or the ``trajstore`` body field (popped), None when unnamed."""
    extra = body.pop("trajstore", None) or {}
    if not isinstance(extra, dict):
        raise ValidationError("the trajstore body field must be an object", rule="trajstore_field")
    tid = headers.get("x-trajstore-trajectory") or extra.get("trajectory_id")
    if not tid:
        return None
    version = headers.get("x-trajstore-model-version", extra.get("model_version"))
    num_experts = headers.get("x-trajstore-num-experts", extra.get("num_experts"))
    run = headers.get("x-trajstore-run", extra.get("run"))
    prompt_id = headers.get("x-trajstore-prompt", extra.get("prompt_id"))
    return Tag(
        trajectory_id=str(tid),
        model_version=default_model_version if version is None else _int_or_none(version, "model_version"),
        group_id=headers.get("x-trajstore-group", extra.get("group_id")),
        num_experts=default_num_experts if num_experts is None else _int_or_none(num_experts, "num_experts"),
        # the rollout ledger's fields (docs/reference.md "Rollout ledger"): checked with the trajectory_started
        run=None if run is None else str(run),
        prompt_id=None if prompt_id is None else str(prompt_id),
        epoch=_int_or_none(headers.get("x-trajstore-epoch", extra.get("epoch")), "epoch"),
        group_size=_int_or_none(headers.get("x-trajstore-group-size", extra.get("group_size")), "group_size"),
    )
