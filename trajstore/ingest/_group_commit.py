"""Group commit: requests queued while an append runs are coalesced into the next ``store.append``.

Pure threading over any object with ``append(events)`` (a ``Store``): no
FastAPI, no event loop. N concurrent clients cost about one transaction (and
one payload file) per round instead of N. ``store.append`` is atomic, so when
a coalesced append is refused nothing is stored and the requests are
re-appended without the culprit: a bad event fails only its own request.
Coalescing never reorders a request's events.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from trajstore.errors import StoreUnavailable, ValidationError

__all__ = ["DEFAULT_COMMITTERS", "DEFAULT_GROUP_WAIT_S", "GroupCommitter"]

# How long a group about to be committed waits for requests still being read or parsed.
DEFAULT_GROUP_WAIT_S = 0.005
# Groups appended at once (GroupCommitter ``committers``): one builds and writes while another waits for its fsyncs.
DEFAULT_COMMITTERS = 1


@dataclass
class _Request:
    events: list
    num_tokens: int
    trajectories: frozenset
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class GroupCommitter:
    """Committer threads that append queued requests, coalescing those that wait.

    ``submit(events)`` returns a future of ``(group_size, AppendResult)``.
    A group is capped at ``max_group_events`` events and ``max_group_tokens``
    tokens (one request alone may exceed them).

    ``committers``: groups appended at once. An append spends much of its
    time waiting for its fsyncs (the payload segment, the SQL commit); a
    second committer builds and writes the next group meanwhile. Groups in
    flight never share a trajectory, and groups start in arrival order: a
    request that touches a trajectory of a group being appended waits, and
    so does every request queued after it.
    """

    def __init__(self, store: Any, *, max_group_events: int = 8192, max_group_tokens: int = 1 << 21,
                 metrics: Any = None, max_wait_s: float = DEFAULT_GROUP_WAIT_S,
                 committers: int = 1) -> None:
        self._store = store
        self.max_group_events, self.max_group_tokens = max_group_events, max_group_tokens
        self.max_wait_s = max_wait_s
        self._metrics = metrics
        self._cond = threading.Condition()
        self._queue: deque[_Request] = deque()
        self._expected = 0  # requests announced (body being read or parsed), not submitted yet
        self._in_flight: set = set()  # trajectories of the groups being appended
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"trajstore-group-commit-{i}", daemon=True)
                         for i in range(max(1, committers))]
        for thread in self._threads:
            thread.start()

    def expect(self) -> None:
        """A request is on its way (its body is being read or parsed): a group
        about to be committed waits for it, up to ``max_wait_s``. Every
        ``expect()`` is followed by ``submit(..., expected=True)`` or ``forget()``."""
        with self._cond:
            self._expected += 1

    def forget(self) -> None:
        """An expected request will not be submitted (it failed before)."""
        with self._cond:
            self._expected -= 1
            self._cond.notify_all()

    def submit(self, events: list, num_tokens: int = 0, *, expected: bool = False) -> concurrent.futures.Future:
        req = _Request(events, num_tokens, _trajectories_of(events))
        with self._cond:
            if expected:
                self._expected -= 1
            if self._closed:
                raise StoreUnavailable("the ingest service is shutting down")
            self._queue.append(req)
            self._cond.notify_all()
        return req.future

    def close(self) -> None:
        """Commit what is queued, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def _startable(self) -> bool:
        """The request at the head of the queue may start a group now."""
        return bool(self._queue) and self._in_flight.isdisjoint(self._queue[0].trajectories)

    def _take(self) -> list[_Request]:
        """The next group (its trajectories marked in flight); [] when closed and drained."""
        with self._cond:
            while True:
                self._cond.wait_for(lambda: self._startable() or (self._closed and not self._queue))
                if not self._queue:
                    return []
                if self._expected and not self._closed and self.max_wait_s > 0:
                    # Requests whose bodies are being read or parsed join this group rather
                    # than the next: an append's fixed cost (fsyncs, one transaction) is paid
                    # once for all of them.
                    self._cond.wait_for(lambda: not self._expected or self._closed or self._group_full(),
                                        self.max_wait_s)
                    if not self._startable():
                        continue  # another committer took the queue's head meanwhile
                group: list[_Request] = []
                n_events = n_tokens = 0
                while self._startable():  # in flight: other committers' groups (this one's join below)
                    req = self._queue[0]
                    if group and (n_events + len(req.events) > self.max_group_events
                                  or n_tokens + req.num_tokens > self.max_group_tokens):
                        break
                    group.append(self._queue.popleft())
                    n_events += len(req.events)
                    n_tokens += req.num_tokens
                for req in group:
                    self._in_flight |= req.trajectories
                return group

    def _group_full(self) -> bool:
        return (sum(len(r.events) for r in self._queue) >= self.max_group_events
                or sum(r.num_tokens for r in self._queue) >= self.max_group_tokens)

    def _run(self) -> None:
        while group := self._take():
            try:
                if len(group) == 1:
                    self._commit_alone(group[0])
                else:
                    self._commit_group(group)
            finally:
                with self._cond:
                    for req in group:
                        self._in_flight -= req.trajectories
                    self._cond.notify_all()

    def _append(self, events: list) -> Any:
        result = self._store.append(events)
        if self._metrics is not None:
            self._metrics.count_commit()
        return result

    def _commit_group(self, group: list[_Request]) -> None:
        """Append the group as one; a refused request is dropped and the rest re-tried together.

        Only the refused request fails: a ValidationError names the event
        index in the coalesced append, which maps to exactly one request
        (append is atomic, so nothing was stored). Any other failure (the
        store is unreachable, or a bug an event provoked) re-appends each
        request on its own, so it reaches only the request(s) that hit it."""
        pending = list(group)
        while len(pending) > 1:
            try:
                result = self._append([ev for req in pending for ev in req.events])
            except ValidationError as e:
                culprit = _request_of(pending, e.index)
                if culprit is None:
                    break
                req, offset = culprit
                req.future.set_exception(e.at(e.index - offset))
                pending.remove(req)
                continue
            except Exception:  # noqa: BLE001 - isolated below, request by request
                break
            offset = 0
            for req in pending:
                req.future.set_result((len(pending), _share_of(result, offset, len(req.events))))
                offset += len(req.events)
            return
        for req in pending:
            self._commit_alone(req)

    def _commit_alone(self, req: _Request) -> None:
        try:
            req.future.set_result((1, self._append(req.events)))
        except BaseException as e:
            req.future.set_exception(e)


def _trajectories_of(events: list) -> frozenset:
    """The trajectory ids ``events`` touch (parsed events or wire dicts; anything else counts as None)."""
    tids = set()
    for ev in events:
        tid = ev.get("trajectory_id") if isinstance(ev, dict) else getattr(ev, "trajectory_id", None)
        tids.add(tid if isinstance(tid, str) else None)
    return frozenset(tids)


def _share_of(result: Any, offset: int, n: int) -> Any:
    """One request's own counts out of a coalesced append's result."""
    from trajstore.store import AppendResult

    dups = tuple(i - offset for i in result.duplicate_indices if offset <= i < offset + n)
    return AppendResult(n - len(dups), len(dups), result.last_position, dups)


def _request_of(pending: list[_Request], index: int | None) -> tuple[_Request, int] | None:
    """The request holding event ``index`` of the coalesced append, and its first event's index."""
    if index is None:
        return None
    offset = 0
    for req in pending:
        if index < offset + len(req.events):
            return req, offset
        offset += len(req.events)
    return None

