"""Process-wide thread pools, made on first use and made again in a forked child
(a child has none of its parent's threads)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["LazyPool"]


class LazyPool:
    """One ``ThreadPoolExecutor`` per process, created by the first ``get()``."""

    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        self._max_workers = max_workers
        self._prefix = thread_name_prefix
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix=self._prefix)
            return self._pool

    def _forget(self) -> None:
        # the child starts its own pool; the parent's threads and lock state are not its own
        self._pool, self._lock = None, threading.Lock()
