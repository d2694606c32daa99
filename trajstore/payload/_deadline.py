"""One deadline for the object-store requests of an append, whatever their number.

pyarrow's S3 timeouts bound one attempt of one request; an append may make
several requests (its log segment, its annotation segment, a delete after a
failure), each with several attempts, and a hung server (SIGSTOP) made an
append wait their sum (57.6 s seen). ``Remote.call`` runs a request on a
worker thread and waits for it at most until the deadline of the append under
way (``deadline()``, opened by ``Store.append``; outside an append a request
runs as it is, bounded by pyarrow's timeouts alone): past it the append fails with ``StoreUnavailable``
at once, and the request is left to finish on its thread, bounded by pyarrow's
own timeouts. A write finished after its caller gave up deletes what it wrote
(``undo``): nothing names it. ``settle()`` waits for such requests (the GC
does before it lists the objects).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout, wait
from typing import Callable, Iterator, TypeVar

from trajstore._util.pools import LazyPool
from trajstore.errors import StoreUnavailable

__all__ = ["DEFAULT_DEADLINE_S", "Remote", "deadline"]

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 25.0
"""The longest an append waits for an object store (``deadline`` in an ``s3://`` location's query)."""

T = TypeVar("T")
_local = threading.local()
_POOL = LazyPool(64, "trajstore-object-store")


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Every ``Remote.call`` of this thread inside the block ends by ``seconds`` from
    now (an enclosing block's deadline stands; None: no deadline opened here)."""
    if seconds is None or getattr(_local, "until", None) is not None:
        yield
        return
    _local.until = time.monotonic() + seconds
    try:
        yield
    finally:
        _local.until = None


class Remote:
    """The requests of one object-store location, each bounded by the deadline under way."""

    def __init__(self, seconds: float, where: str) -> None:
        self.seconds, self.where = seconds, where
        self._pending: set[Future] = set()
        self._lock = threading.Lock()

    def call(self, what: str, request: Callable[[], T], *, undo: Callable[[], object] | None = None) -> T:
        """``request()`` (what it raises, it raises), or StoreUnavailable once the deadline
        of this thread's append passed; ``undo()`` then runs on the request's thread if it succeeds after all."""
        until = getattr(_local, "until", None)
        if until is None:  # no append under way: pyarrow's timeouts alone (a long transfer that moves is never cut)
            return request()
        if until - time.monotonic() <= 0:
            raise StoreUnavailable(self._late(what))
        lock, state = threading.Lock(), {"given_up": False, "done": False}

        def run() -> T:
            result = request()
            with lock:
                state["done"] = True
                late = state["given_up"]
            if late and undo is not None:
                try:
                    undo()
                except Exception as e:  # noqa: BLE001 - best effort: an unnamed object is the GC's
                    log.info("%s: finished after the deadline, left for gc: %s", what, e)
            return result

        future = _POOL.get().submit(run)
        try:
            # measured after the hand-off: a submit that had to start a thread (under the
            # executors' process-wide lock) never adds its wait to the deadline
            return future.result(timeout=max(0.0, until - time.monotonic()))
        except FutureTimeout:
            with lock:
                if state["done"]:
                    return future.result()
                state["given_up"] = True
            with self._lock:
                self._pending.add(future)
            future.add_done_callback(self._forget)
            raise StoreUnavailable(self._late(what)) from None

    def _late(self, what: str) -> str:
        return (f"{what}: the object store at {self.where!r} did not answer within the {self.seconds:g} s "
                "deadline (deadline= in the payload location)")

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def settle(self, timeout_s: float = 120.0) -> None:
        """Wait (up to ``timeout_s``) for the requests whose callers gave up."""
        with self._lock:
            pending = list(self._pending)
        if pending:
            wait(pending, timeout=timeout_s)
