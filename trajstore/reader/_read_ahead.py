"""The reader's read-ahead: steps planned in order on a background thread and
their batches loaded ahead of the step in use (one step locally; as many as
the payload asks for on a replay store, so that its round trips overlap)."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator, TypeVar

from trajstore.reader._plan import Step
from trajstore.sample import Sample

T = TypeVar("T")


def read_ahead(payload: Any) -> int:
    """Steps a reader plans and loads ahead of the one in use: the payload's ``read_ahead``
    (a replay store's, to overlap round trips), else one."""
    depth = getattr(payload, "read_ahead", 1)
    return depth if isinstance(depth, int) and depth >= 1 else 1


class ReadAhead:
    """Steps planned in order on one background thread, up to ``depth()`` ahead of the
    one the trainer uses, each step's batch loaded as soon as it is planned (up
    to ``depth`` loads at once). ``get()`` hands them over in order: ``(step,
    batch or None)``, None at the end, or raises what planning or loading raised.
    With ``depth`` 1 this is the prefetch of one step: the next step is planned
    and loaded while this one is used."""

    def __init__(self, steps: Iterator[Step], load: Callable[[Step], list[Sample]], mine: Callable[[Step], bool],
                 depth: Callable[[], int]) -> None:
        self._steps, self._load, self._mine = steps, load, mine
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._slots = threading.Semaphore(1)  # taken by each step planned, given back as it is handed over
        self._stop = threading.Event()
        self._depth_of = depth  # asked in the background (a replay store may ask its server)
        self._depth = 1
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (future, step) for the loaders; None: no more
        self.threads = [threading.Thread(target=self._plan, daemon=True, name="trajstore-reader-prefetch")]
        self.threads[0].start()

    def _plan(self) -> None:
        loaders = 0
        try:
            self._depth = self._depth_of()
            for _ in range(self._depth - 1):
                self._slots.release()
            if self._depth > 1:  # that many loads at once, each on a thread of its own kept for the iteration
                loaders = self._depth
                for _ in range(loaders):
                    thread = threading.Thread(target=self._loader, daemon=True, name="trajstore-reader-load")
                    self.threads.append(thread)
                    thread.start()
            while True:
                self._slots.acquire()
                if self._stop.is_set():
                    return
                step = next(self._steps, None)
                if step is None:
                    self._ready.put(None)
                    return
                if not self._mine(step):
                    self._ready.put((step, None))
                elif self._depth == 1:  # one at a time: loaded here, as planned
                    self._ready.put((step, _run(self._load, step)))
                else:
                    future: Future = Future()
                    self._jobs.put((future, step))
                    self._ready.put((step, future))
        except BaseException as e:  # re-raised in the consumer by get()
            self._ready.put(e)
        finally:
            for _ in range(loaders):  # nothing more to load: each loader ends once the queue is done
                self._jobs.put(None)

    def _loader(self) -> None:
        """Loads the steps planned, in order, until the planner is done (a thread per
        load cost a thread start and a cold stack per batch)."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, step = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._load(step))
                except BaseException as e:  # re-raised in the consumer by future.result()
                    future.set_exception(e)

    def get(self) -> tuple[Step, list[Sample] | None] | None:
        item = self._ready.get()
        if item is None or isinstance(item, BaseException):
            if item is not None:
                raise item
            return None
        step, loading = item
        batch = None if loading is None else loading.result()
        self._slots.release()
        return step, batch

    def close(self) -> None:
        """Stop planning (a step being planned or loaded finishes in its thread)."""
        self._stop.set()
        self._slots.release()  # wakes the planner waiting for a slot: it sees the stop

    def join(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for the planning and the loads under way to end."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self.threads):
            thread.join(max(0.0, deadline - time.monotonic()))


def _run(fn: Callable[[Step], T], arg: Step) -> Future:
    """The future of ``fn(arg)``, run now."""
    future: Future = Future()
    try:
        future.set_result(fn(arg))
    except BaseException as e:  # re-raised in the consumer by future.result()
        future.set_exception(e)
    return future

