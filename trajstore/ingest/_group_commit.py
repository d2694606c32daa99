"""Group commit: requests (engine calls, HTTP bodies, writer batches) coalesced into one ``store.append``.

The one coalescer of the write path: the ingest service, the recording
proxies and the in-process ``Writer`` sink all submit here. Pure threading
over any object with ``append(events)`` (a ``Store``): no FastAPI, no event
loop. Many requests (of many trajectories) become one payload segment and one
index transaction, bounded like a Kafka producer's batch:

* ``linger_s`` (``linger.ms``): a group is committed once its oldest request
  has waited that long, or earlier when it is full; 0 commits as soon as a
  committer is free (requests that queued meanwhile still go together);
* ``max_group_bytes`` (``batch.size``), ``max_group_events`` and
  ``max_group_tokens``: a group is full at any of them (one larger request
  goes alone).

Each request's future resolves only after its group's append returned (the
payload fsynced before the index commit): acknowledged means durable, and a
failed group acknowledges nothing. ``store.append`` is atomic, so when a
coalesced append is refused nothing is stored and the requests are
re-appended without the culprit: a bad event fails only its own request.
Coalescing never reorders a request's events.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from trajstore.errors import StoreUnavailable, ValidationError

__all__ = ["DEFAULT_COMMITTERS", "DEFAULT_GROUP_WAIT_S", "DEFAULT_LINGER_S", "DEFAULT_MAX_GROUP_BYTES",
           "GroupCommitter", "release_shared", "request_bytes", "shared_committer"]

# How long a group about to be committed waits for requests still being read or parsed.
DEFAULT_GROUP_WAIT_S = 0.005
# The service's and the proxies' linger (``GroupCommitter(linger_s=)``): at 3,300 calls/s into one
# coalescer, 20 ms makes groups of about 66 calls; an engine call takes seconds, 20 ms more is noise.
DEFAULT_LINGER_S = 0.02
# A group's bound in bytes (``GroupCommitter(max_group_bytes=)``): 64 calls of 512 KiB (600 new tokens
# with 48x8 routes are about 240 KB), a quarter of the service's default bytes in flight.
DEFAULT_MAX_GROUP_BYTES = 32 << 20
# Groups appended at once (GroupCommitter ``committers``): one builds and writes while another waits for its fsyncs.
DEFAULT_COMMITTERS = 1


@dataclass
class _Request:
    events: list
    num_tokens: int
    trajectories: frozenset
    nbytes: int = 0
    arrived: float = 0.0  # time.monotonic() at submit
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class GroupCommitter:
    """Committer threads that append queued requests, coalescing those that wait.

    ``submit(events)`` returns a future of ``(group_size, AppendResult)``.
    A group is capped at ``max_group_events`` events, ``max_group_tokens``
    tokens and ``max_group_bytes`` bytes (one request alone may exceed them).
    ``linger_s``: how long the oldest queued request waits for others before
    its group is committed (unless the group is full first); 0: no wait.

    ``committers``: groups appended at once. An append spends much of its
    time waiting for its fsyncs (the payload segment, the SQL commit); a
    second committer builds and writes the next group meanwhile. Groups in
    flight never share a trajectory, and groups start in arrival order: a
    request that touches a trajectory of a group being appended waits, and
    so does every request queued after it.
    """

    def __init__(self, store: Any, *, max_group_events: int = 8192, max_group_tokens: int = 1 << 21,
                 metrics: Any = None, max_wait_s: float = DEFAULT_GROUP_WAIT_S,
                 committers: int = 1, linger_s: float = 0.0,
                 max_group_bytes: int = DEFAULT_MAX_GROUP_BYTES) -> None:
        if not linger_s >= 0:
            raise ValueError(f"linger_s must be 0 or more, got {linger_s!r}")
        if not max_group_bytes >= 1:
            raise ValueError(f"max_group_bytes must be at least 1, got {max_group_bytes!r}")
        self._store = store
        self.max_group_events, self.max_group_tokens = max_group_events, max_group_tokens
        self.max_group_bytes = max_group_bytes
        self.max_wait_s = max_wait_s
        self.linger_s = linger_s
        self.num_groups = self.num_requests = 0  # appends made, requests they held (calls per object)
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

    def submit(self, events: list, num_tokens: int = 0, *, expected: bool = False,
               nbytes: int | None = None) -> concurrent.futures.Future:
        """Queue one request; its future resolves once its group is stored (durable) or refused.
        ``nbytes``: its size (an HTTP body's length); None: estimated (``request_bytes``)."""
        req = _Request(events, num_tokens, _trajectories_of(events),
                       request_bytes(events) if nbytes is None else nbytes, time.monotonic())
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
                if self.linger_s > 0 and not self._closed and not self._group_full():
                    # linger: the oldest request waits for others (Kafka's linger.ms), unless the group fills
                    deadline = self._queue[0].arrived + self.linger_s
                    self._cond.wait_for(lambda: self._closed or self._group_full()
                                        or time.monotonic() >= deadline, max(0.0, deadline - time.monotonic()))
                    if not self._startable():
                        continue
                if self._expected and not self._closed and self.max_wait_s > 0:
                    # Requests whose bodies are being read or parsed join this group rather
                    # than the next: an append's fixed cost (fsyncs, one transaction) is paid
                    # once for all of them.
                    self._cond.wait_for(lambda: not self._expected or self._closed or self._group_full(),
                                        self.max_wait_s)
                    if not self._startable():
                        continue  # another committer took the queue's head meanwhile
                group: list[_Request] = []
                n_events = n_tokens = n_bytes = 0
                while self._startable():  # in flight: other committers' groups (this one's join below)
                    req = self._queue[0]
                    if group and (n_events + len(req.events) > self.max_group_events
                                  or n_tokens + req.num_tokens > self.max_group_tokens
                                  or n_bytes + req.nbytes > self.max_group_bytes):
                        break
                    group.append(self._queue.popleft())
                    n_events += len(req.events)
                    n_tokens += req.num_tokens
                    n_bytes += req.nbytes
                for req in group:
                    self._in_flight |= req.trajectories
                return group

    def _group_full(self) -> bool:
        return (sum(len(r.events) for r in self._queue) >= self.max_group_events
                or sum(r.num_tokens for r in self._queue) >= self.max_group_tokens
                or sum(r.nbytes for r in self._queue) >= self.max_group_bytes)

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

    def _append(self, events: list, requests: int = 1) -> Any:
        result = self._store.append(events)
        with self._cond:
            self.num_groups += 1
            self.num_requests += requests
        if self._metrics is not None:
            self._metrics.count_commit(requests)
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
                result = self._append([ev for req in pending for ev in req.events], len(pending))
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


_SHARED: dict[int, tuple[Any, GroupCommitter, int]] = {}  # id(store) -> (store, committer, users)
_SHARED_LOCK = threading.Lock()


def shared_committer(store: Any) -> GroupCommitter:
    """The one ``GroupCommitter`` of ``store`` in this process (no linger: a caller that batches, the
    ``Writer``, has its own), made on first use: concurrent in-process writers of one store share
    payload objects and index transactions. Every call is paired with ``release_shared(store)``."""
    with _SHARED_LOCK:
        found = _SHARED.get(id(store))
        if found is None or found[0] is not store:
            found = (store, GroupCommitter(store, max_wait_s=0.0), 0)
        _SHARED[id(store)] = (store, found[1], found[2] + 1)
        return found[1]


def release_shared(store: Any) -> None:
    """One user of ``shared_committer(store)`` is done; the last one closes it (what is queued is committed)."""
    with _SHARED_LOCK:
        found = _SHARED.get(id(store))
        if found is None or found[0] is not store:
            return
        if found[2] > 1:
            _SHARED[id(store)] = (store, found[1], found[2] - 1)
            return
        del _SHARED[id(store)]
    found[1].close()


def request_bytes(events: list) -> int:
    """About how many bytes ``events`` hold (arrays' buffers, strings; 64 per event besides): what
    ``max_group_bytes`` counts for a request submitted without its size."""
    total = 0
    for ev in events:
        total += 64
        values = ev.values() if isinstance(ev, dict) else ()
        for value in values:
            nbytes = getattr(value, "nbytes", None)
            if nbytes is not None:
                total += int(nbytes)
            elif isinstance(value, (str, bytes, bytearray)):
                total += len(value)
            elif isinstance(value, (list, tuple)):
                total += 8 * len(value)
            elif isinstance(value, dict):  # {b64, dtype, shape} arrays
                total += len(value.get("b64") or "") if isinstance(value.get("b64"), str) else 0
    return total


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

