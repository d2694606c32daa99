"""The reference rollout driver: prompts in, whole groups out, resumable after kill -9.

A rollout driver takes prompts from a dataset, runs a group of ``group_size``
agent episodes per prompt on the engines (through the recording proxy, or
recording with a ``Writer``) and leaves whole groups in the store for
training. :class:`RolloutDriver` keeps no state of its own: every decision it
makes is recorded in the store first (SPEC "Rollout ledger"), so a driver that
is killed and started again with the same arguments reads
``rollout_state(run)`` and carries on where it was:

* prompts are taken in a fixed order per epoch (a permutation of the dataset
  drawn from ``(seed, epoch)``); a prompt in ``plan.dispatched`` is never
  dispatched again;
* dispatching a prompt is one append of its group's ``group_size``
  ``trajectory_started`` events (``run``, ``prompt_id``, ``epoch``,
  ``group_size``), before any engine call;
* an open group's running trajectories are continued from their tails (the
  episode function gets the ``Tail``; its next call has ``seq = next_seq`` and
  a prompt that starts with ``tail.tokens``), or, with
  ``resume="replace"``, finished ``aborted`` and replaced; its missing members
  are started under new trajectory ids;
* a group is dropped (``group_dropped``) when ``stale(group)`` says so at a
  resume, when its prompt left the dataset, or when ``max_failures`` of its
  episodes failed;
* a prompt the driver decides to skip for good (``skip(prompt_id, item)``
  returns a reason) is recorded as a group with one trajectory finished
  ``failed`` (metadata ``{"skipped": reason}``) and dropped with the reason
  ``skipped: <reason>``: dispatched, never whole, never handed out.

The episode function does the engine calls and returns an :class:`Outcome`;
the driver records it (``reward``, ``trajectory_finished``). An episode that
raises means the driver lost contact (a proxy or engine restarting): it stops
dispatching, lets the other episodes end, and re-reads the plan from the
store, which says exactly what was recorded. docs/rollout.md has the recipe
for verl's and SkyRL's rollout loops.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from trajstore.errors import TrajstoreError, ValidationError

__all__ = ["Episode", "Outcome", "RolloutDriver", "RolloutStats"]

log = logging.getLogger("trajstore.rollout")

_GOOD = ("completed", "truncated")
_STATUSES = ("completed", "truncated", "aborted", "failed")


@dataclass(frozen=True)
class Episode:
    """One episode for the episode function: a new one (``tail is None``) or one to continue.

    ``tail`` (the plan's ``Tail``: ``next_seq``, ``tokens``, ``last_version``,
    ``last_finish_reason``) is set when the trajectory was running when the
    driver stopped; its recorded calls stay, the episode goes on from
    ``tail.tokens`` (empty: nothing was recorded, start from the prompt).
    ``index`` is the member's number in its group (replacements continue the
    count past ``group_size - 1``)."""

    run: str
    trajectory_id: str
    group_id: str
    prompt_id: str
    epoch: int
    index: int
    item: Any
    tail: Any = None


@dataclass(frozen=True)
class Outcome:
    """How an episode ended: ``status`` one of completed, truncated, aborted, failed."""

    status: str = "completed"
    reward: float | None = None


@dataclass
class RolloutStats:
    """What a :meth:`RolloutDriver.run` did (this process only; the store holds the rest)."""

    dispatched: int = 0
    """groups dispatched"""
    continued: int = 0
    """running trajectories continued from their tails"""
    replaced: int = 0
    """trajectories started in place of failed, aborted or missing ones"""
    dropped: int = 0
    """groups dropped (stale, failed, gone from the dataset)"""
    skipped: int = 0
    """prompts skipped for good"""
    episodes: int = 0
    """episodes recorded as finished"""
    replans: int = 0
    """times the plan was read again after losing contact"""


@dataclass
class _Group:
    group_id: str
    prompt_id: str
    epoch: int
    item: Any
    size: int
    finished: int = 0
    failed: int = 0
    running: int = 0
    next_index: int = 0
    dropping: str | None = None


class RolloutDriver:
    """Run ``group_size`` episodes per prompt of ``dataset`` for ``epochs`` epochs, resumable.

    ``ledger``: where the plan is read and the driver's events are appended, a
    ``Store`` (``append``) or a ``Writer`` (``extend`` + ``flush``), both with
    ``rollout_state(run)``. ``dataset``: ``{prompt_id: item}`` or
    ``[(prompt_id, item), ...]``. ``episode(Episode) -> Outcome`` runs on up to
    ``concurrency`` threads. ``stale(group) -> bool`` is asked for each open
    group of the plan at a (re)start; ``skip(prompt_id, item) -> str | None``
    before a prompt is dispatched. ``started`` holds extra
    ``trajectory_started`` fields (``num_experts``, ``metadata``).
    ``progress(groups_done, groups_total)`` is called as groups end.
    """

    def __init__(self, ledger: Any, run: str, dataset: Mapping[str, Any] | Sequence[tuple[str, Any]], *,
                 episode: Callable[[Episode], Outcome], group_size: int, epochs: int = 1, seed: int = 0,
                 shuffle: bool = True, concurrency: int = 4, resume: str = "continue",
                 max_failures: int | None = None, stale: Callable[[Any], bool] | None = None,
                 skip: Callable[[str, Any], str | None] | None = None, started: Mapping[str, Any] | None = None,
                 progress: Callable[[int, int], None] | None = None, retry_for_s: float = 120.0) -> None:
        items = list(dataset.items()) if isinstance(dataset, Mapping) else [tuple(p) for p in dataset]
        ids = [str(p) for p, _ in items]
        if len(set(ids)) != len(ids):
            raise ValidationError("rollout dataset: prompt ids must be unique", rule="dataset")
        if resume not in ("continue", "replace"):
            raise ValidationError(f"rollout resume must be 'continue' or 'replace', got {resume!r}", rule="resume")
        if not 1 <= group_size <= 65535 or epochs < 1 or concurrency < 1:
            raise ValidationError("rollout: group_size must be 1..65535, epochs and concurrency >= 1", rule="driver")
        self.ledger, self.run_name, self.episode = ledger, run, episode
        self.prompts = ids
        self.items = {p: item for p, (_, item) in zip(ids, items)}
        self.group_size, self.epochs, self.seed, self.shuffle = group_size, epochs, seed, shuffle
        self.concurrency, self.resume = concurrency, resume
        self.max_failures = group_size if max_failures is None else max_failures
        self.stale, self.skip, self.started = stale, skip, dict(started or {})
        self.progress, self.retry_for_s = progress, retry_for_s
        self.stats = RolloutStats()
        self._done = 0
        self._last_error = ""

    # -- names: deterministic, so a restarted driver (or a second run of the same seed) agrees ---------
    def group_id(self, prompt_id: str, epoch: int) -> str:
        return f"{self.run_name}/e{epoch}/{prompt_id}"

    def trajectory_id(self, group_id: str, index: int) -> str:
        return f"{group_id}/{index}"

    def order(self, epoch: int) -> list[str]:
        """The epoch's prompt order: the dataset's, permuted by ``(seed, epoch)`` when shuffling."""
        if not self.shuffle:
            return list(self.prompts)
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
        return [self.prompts[i] for i in perm]

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> RolloutStats:
        """Until every prompt of every epoch is dispatched and no group is open; returns the stats.

        Each pass starts from the plan in the store; a pass that lost contact
        (an episode raised, an append failed) is followed by another after a
        backoff, for up to ``retry_for_s`` without progress."""
        lost_since: float | None = None
        delay = 0.2
        while True:
            try:
                plan = self.ledger.rollout_state(self.run_name)
            except TrajstoreError as e:
                plan = None
                self._lost("reading the plan", e)
            if plan is not None:
                self._done = len(plan.dispatched) - len(plan.open)
                if not plan.open and len(plan.dispatched) >= self._total():
                    log.info("rollout %s: done, %d groups whole of %d dispatched", self.run_name,
                             len(plan.whole), len(plan.dispatched))
                    return self.stats
                before = (self.stats.episodes, self.stats.dispatched, self.stats.dropped)
                whole_pass = self._pass(plan)
                if whole_pass or before != (self.stats.episodes, self.stats.dispatched, self.stats.dropped):
                    lost_since, delay = None, 0.2  # progress
                if whole_pass:
                    continue
            now = time.monotonic()
            lost_since = now if lost_since is None else lost_since
            if now - lost_since >= self.retry_for_s:
                raise TrajstoreError(f"rollout {self.run_name}: no progress for {self.retry_for_s:.0f} s; "
                                     f"giving up (last: {self._last_error})")
            self.stats.replans += 1
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _total(self) -> int:
        return self.epochs * len(self.prompts)

    def _pass(self, plan: Any) -> bool:
        """Resume the plan's open groups, then dispatch new prompts; False when contact was lost."""
        groups: dict[str, _Group] = {}
        queue: deque[Episode] = deque()
        tails = sum(1 for g in plan.open for t in g.running if len(t.tokens))
        log.info("rollout %s: %d of %d prompts dispatched, %d groups open (%d trajectories to continue)",
                 self.run_name, len(plan.dispatched), self._total(), len(plan.open), tails)
        try:
            for g in plan.open:
                self._resume_group(g, groups, queue)
            # a group dropped elsewhere (an operator, another tool) may leave running members: end them
            leftover = [t.trajectory_id for g in getattr(plan, "dropped", ()) for t in g.running]
            if leftover:
                self._append([e for tid in leftover for e in self._finish_events(tid, "aborted")])
        except TrajstoreError as e:
            self._lost("resuming the open groups", e)
            return False
        new = self._undispatched(set(plan.dispatched))
        lost = False
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="rollout") as pool:
            running: dict[Future, Episode] = {}
            while True:
                while not lost and len(running) < self.concurrency:
                    if not queue:
                        try:
                            if not self._dispatch_next(new, groups, queue):
                                break
                        except TrajstoreError as e:
                            self._lost("dispatching", e)
                            lost = True
                            break
                        continue
                    ep = queue.popleft()
                    running[pool.submit(self.episode, ep)] = ep
                if not running:
                    return not lost
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in done:
                    ep = running.pop(f)
                    try:
                        outcome = f.result()
                    except Exception as e:  # lost contact: re-read the plan, it knows what landed
                        self._lost(f"episode {ep.trajectory_id}", e)
                        lost = True
                        continue
                    if not isinstance(outcome, Outcome) or outcome.status not in _STATUSES:
                        raise ValidationError(f"rollout {self.run_name}: episode {ep.trajectory_id} returned "
                                              f"{outcome!r}; its status must be one of {', '.join(_STATUSES)}",
                                              rule="status")
                    try:
                        self._record(ep, outcome, groups[ep.group_id], queue, lost)
                    except TrajstoreError as e:
                        self._lost(f"recording {ep.trajectory_id}", e)
                        lost = True

    def _lost(self, what: str, e: BaseException) -> None:
        self._last_error = f"{what}: {' '.join(str(e).split())[:300] or type(e).__name__}"
        log.warning("rollout %s: %s", self.run_name, self._last_error)

    def _undispatched(self, dispatched: set) -> Iterator[tuple[str, int]]:
        for epoch in range(self.epochs):
            for prompt_id in self.order(epoch):
                if (prompt_id, epoch) not in dispatched:
                    yield prompt_id, epoch

    # -- appends -----------------------------------------------------------------------------------
    def _append(self, events: list[dict]) -> None:
        if hasattr(self.ledger, "append"):
            self.ledger.append(events)
        else:
            self.ledger.extend(events)
            self.ledger.flush()

    def _start(self, g: _Group) -> Episode:
        index = g.next_index
        g.next_index += 1
        tid = self.trajectory_id(g.group_id, index)
        return Episode(self.run_name, tid, g.group_id, g.prompt_id, g.epoch, index, g.item)

    def _started(self, ep: Episode, **extra: Any) -> dict:
        return {**self.started, **extra, "type": "trajectory_started", "trajectory_id": ep.trajectory_id,
                "group_id": ep.group_id, "run": self.run_name, "prompt_id": ep.prompt_id, "epoch": ep.epoch,
                "group_size": self.group_size}

    def _dispatch_next(self, new: Iterator[tuple[str, int]], groups: dict[str, _Group], queue: deque) -> bool:
        """Dispatch the next prompt (or record its skip); False when none is left."""
        for prompt_id, epoch in new:
            g = _Group(self.group_id(prompt_id, epoch), prompt_id, epoch, self.items[prompt_id], self.group_size)
            reason = self.skip(prompt_id, g.item) if self.skip is not None else None
            if reason:
                ep = self._start(g)
                self._append([self._started(ep, metadata={"skipped": str(reason)}),
                              {"type": "trajectory_finished", "trajectory_id": ep.trajectory_id, "status": "failed"},
                              {"type": "group_dropped", "run": self.run_name, "group_id": g.group_id,
                               "reason": f"skipped: {reason}"}])
                log.info("rollout %s: skipped %s (epoch %d): %s", self.run_name, prompt_id, epoch, reason)
                self.stats.skipped += 1
                self._group_done()
                continue
            eps = [self._start(g) for _ in range(self.group_size)]
            self._append([self._started(ep) for ep in eps])
            g.running = len(eps)
            groups[g.group_id] = g
            queue.extend(eps)
            self.stats.dispatched += 1
            log.debug("rollout %s: dispatched %s (epoch %d) as %s", self.run_name, prompt_id, epoch, g.group_id)
            return True
        return False

    def _finish_events(self, tid: str, status: str, reward: float | None = None) -> list[dict]:
        events = [] if reward is None else [{"type": "reward", "trajectory_id": tid, "reward": float(reward)}]
        return events + [{"type": "trajectory_finished", "trajectory_id": tid, "status": status}]

    def _drop(self, g: _Group, reason: str, running: Sequence[str] = ()) -> None:
        """Finish ``running`` as aborted and drop the group, in one append."""
        events = [e for tid in running for e in self._finish_events(tid, "aborted")]
        self._append(events + [{"type": "group_dropped", "run": self.run_name, "group_id": g.group_id,
                                "reason": reason}])
        log.info("rollout %s: dropped %s: %s", self.run_name, g.group_id, reason)
        self.stats.dropped += 1
        self._group_done()

    def _group_done(self) -> None:
        self._done += 1
        if self.progress is not None:
            self.progress(self._done, self._total())

    def _resume_group(self, plan_group: Any, groups: dict[str, _Group], queue: deque) -> None:
        """An open group of the plan: drop it, or continue its running members and start its missing ones."""
        pg = plan_group
        known = [*pg.finished, *pg.failed, *(t.trajectory_id for t in pg.running)]
        g = _Group(pg.group_id, pg.prompt_id, pg.epoch, self.items.get(pg.prompt_id), pg.group_size,
                   finished=len(pg.finished), failed=len(pg.failed), next_index=_next_index(known, pg.group_id))
        running = [t.trajectory_id for t in pg.running]
        if pg.prompt_id not in self.items:
            return self._drop(g, "prompt not in the dataset", running)
        if self.stale is not None and self.stale(pg):
            return self._drop(g, "stale", running)
        if g.failed >= self.max_failures:
            return self._drop(g, f"{g.failed} episodes failed", running)
        groups[g.group_id] = g
        replace = {t.trajectory_id for t in pg.running if self.resume == "replace" and len(t.tokens)}
        if replace:  # a harness that cannot continue from tokens: abort them, start others in their place
            self._append([e for tid in sorted(replace) for e in self._finish_events(tid, "aborted")])
            g.failed += len(replace)
        for t in pg.running:
            if t.trajectory_id in replace:
                continue
            idx = _index_of(t.trajectory_id, pg.group_id)
            queue.append(Episode(self.run_name, t.trajectory_id, g.group_id, g.prompt_id, g.epoch, idx, g.item, t))
            g.running += 1
            self.stats.continued += 1
        self._replace(g, queue, max(0, g.size - g.finished - g.running))

    def _replace(self, g: _Group, queue: deque, n: int) -> None:
        if n <= 0:
            return
        eps = [self._start(g) for _ in range(n)]
        self._append([self._started(ep) for ep in eps])
        g.running += n
        queue.extend(eps)
        self.stats.replaced += n

    def _record(self, ep: Episode, outcome: Outcome, g: _Group, queue: deque, lost: bool) -> None:
        """Record an episode's outcome; start a replacement for a failed one, or drop the group."""
        status = outcome.status
        self._append(self._finish_events(ep.trajectory_id, status, outcome.reward))
        self.stats.episodes += 1
        g.running -= 1
        if status in _GOOD:
            g.finished += 1
        else:
            g.failed += 1
            if g.failed >= self.max_failures:
                g.dropping = f"{g.failed} episodes failed"
            elif not lost and g.dropping is None and g.finished + g.running < g.size:
                self._replace(g, queue, 1)
        if g.finished >= g.size:
            log.debug("rollout %s: %s whole", self.run_name, g.group_id)
            self._group_done()
        elif g.dropping is not None and g.running == 0:
            self._drop(g, g.dropping)


def _index_of(trajectory_id: str, group_id: str) -> int:
    rest = trajectory_id[len(group_id) + 1:] if trajectory_id.startswith(group_id + "/") else ""
    return int(rest) if rest.isdigit() else -1


def _next_index(known: Sequence[str], group_id: str) -> int:
    return max([_index_of(t, group_id) for t in known] + [len(known) - 1]) + 1
