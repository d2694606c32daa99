"""The reader's read-ahead: steps planned in order on a background thread and
their batches loaded ahead of the step in use (one step locally; as many as
the payload asks for on a replay store, so that its round trips overlap)."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator, TypeVar

from trajstore._batch_plan import Step
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
        self.threads = [threading.Thread(target=self._plan, daemon=True, name="trajstore-reader-prefetch")]
        self.threads[0].start()

    def _plan(self) -> None:
        try:
            self._depth = self._depth_of()
            for _ in range(self._depth - 1):
                self._slots.release()
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
                    self._ready.put((step, _run(self._load, step, background=self.threads)))
        except BaseException as e:  # re-raised in the consumer by get()
            self._ready.put(e)

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


def _run(fn: Callable[[Step], T], arg: Step, *, background: list[threading.Thread] | None = None) -> Future:
    """The future of ``fn(arg)``: run now, or in a daemon thread added to ``background``
    (a daemon never holds up interpreter exit, e.g. while a server is retried)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(arg))
        except BaseException as e:  # re-raised in the consumer by future.result()
            future.set_exception(e)

    if background is not None:
        thread = threading.Thread(target=run, daemon=True, name="trajstore-reader-load")
        background[:] = [t for t in background if t.is_alive()] + [thread]
        thread.start()
    else:
        run()
    return future

