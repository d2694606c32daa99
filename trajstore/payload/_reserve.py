"""The reserve of empty log segment files (``Reserve``), made ahead of the appends that fill them."""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref

from trajstore._util.pools import LazyPool
from trajstore.payload._durable import fdatasync, fsync_path, unlink_quietly
from trajstore.payload._filesystem import join
from trajstore.payload._format import SegmentKind

log = logging.getLogger(__name__)

__all__ = ["Reserve"]

# The reserve of empty log segment files (``Reserve``): refilled to _RESERVE_HIGH
# when fewer than _RESERVE_LOW are left; a file is handed out only this young.
_RESERVE_LOW, _RESERVE_HIGH = 2, 8
_RESERVE_MAX_AGE_S = 30.0
_RESERVE_CLOSE_WAIT_S = 10.0  # a refill makes a few empty files and fsyncs their directory

# One thread per process for the reserves' refills.
_REFILL_POOL = LazyPool(1, "trajstore-reserve")


class Reserve:
    """Empty log segment files, made ahead of the appends that will fill them.

    An append writes its events into a segment of its own and makes it durable
    before its index transaction commits. For a new file that is an fsync that
    also journals a new inode and directory entry, then an fsync of the
    directory: here ~0.5 ms more than the ~0.6 ms of an ``fdatasync`` of the
    same megabyte written into a file that already exists (docs/benchmarks.md,
    "Append: where the time goes"). So files are created in the background, a batch
    at a time with one fsync of the directory, and an append takes one whose
    directory entry is already durable: its ``make_durable`` is one
    ``fdatasync`` (the file's new size is part of what it syncs).

    Safety:
    * ``take`` opens the file (without creating it) and keeps it open until
      ``sync_taken``: the inode it syncs cannot be freed and reused meanwhile,
      and ``sync_taken`` compares it with the inode the name now points to. If
      the write re-created the file (someone removed it), the file and the
      directory are fsynced as for a new file; if it is gone, the append fails
      (StoreUnavailable) before anything references it.
    * A file is handed out only while younger than ``_RESERVE_MAX_AGE_S``;
      older ones are deleted. ``collect_garbage`` removes only files nothing
      references and older than its grace (an hour by default; a grace shorter
      than an append takes between its write and its commit was never safe).
    * The reserve belongs to the process that made it: a forked child neither
      takes nor deletes its parent's files.
    * ``held`` names are not listed as segment files by their own store
      (``PayloadStore.list_names``): its GC never takes them. A crashed
      writer's leftovers are empty unreferenced files, removed by any GC after
      the grace; ``close`` deletes the ones left.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._ready: collections.deque[tuple[str, float]] = collections.deque()  # (name, made at, monotonic)
        self._pending: set[str] = set()  # being created by a refill
        self._taken: dict[str, int] = {}  # name -> descriptor held open until it is synced
        self._refilling = False
        self._refilled = threading.Condition(self._lock)  # notified when a refill ends
        self._closed = False
        self._pid = os.getpid()
        # a store nobody closed leaves no empty files behind at exit (or when collected)
        weakref.finalize(self, _delete_ready, root, self._ready, self._lock, self._pid)

    def _path(self, name: str) -> str:
        return join(self.root, name)

    def take(self) -> str | None:
        """A reserved file's name (now this caller's to write), or None (write a new file)."""
        if os.getpid() != self._pid:
            return None
        stale: list[str] = []
        name = None
        while name is None:
            with self._lock:
                if not self._ready:
                    break
                candidate, made = self._ready.popleft()
            if time.monotonic() - made >= _RESERVE_MAX_AGE_S:
                stale.append(candidate)
                continue
            try:
                fd = os.open(self._path(candidate), os.O_WRONLY)
            except OSError:  # control flow: removed meanwhile (a GC with a short grace), not a reserved file any more
                continue
            with self._lock:
                self._taken[candidate] = fd
            name = candidate
        for old in stale:
            unlink_quietly(self._path(old))
        # a writer slow enough to find stale files gets new ones made only when it asks again
        self._maybe_refill(allowed=not stale)
        return name

    def _maybe_refill(self, *, allowed: bool) -> None:
        with self._lock:
            if not allowed or self._closed or self._refilling or len(self._ready) >= _RESERVE_LOW:
                return
            self._refilling = True
        try:
            _REFILL_POOL.get().submit(self._refill)
        except RuntimeError:  # the interpreter is shutting down
            with self._lock:
                self._refilling = False

    def _refill(self) -> None:
        made: list[str] = []
        try:
            with self._lock:
                names = [SegmentKind.EVENTS.new_name() for _ in range(_RESERVE_HIGH - len(self._ready))]
                self._pending.update(names)
            born = time.monotonic()
            try:
                for name in names:
                    os.close(os.open(self._path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                    made.append(name)
                fsync_path(self.root)
            except OSError as e:  # control flow: no reserve, appends create their own files (and meet the error)
                log.info("cannot reserve log segment files in %s (%s); appends create their own", self.root, e)
                for name in made:
                    unlink_quietly(self._path(name))
                made = []
            with self._lock:
                self._pending.difference_update(names)
                if not self._closed:
                    self._ready.extend((name, born) for name in made)
                    made = []
            for name in made:  # closed meanwhile
                unlink_quietly(self._path(name))
        except Exception:  # never let a background refill fail silently
            log.exception("refilling the log segment reserve in %s failed", self.root)
        finally:
            with self._lock:
                self._refilling = False
                self._refilled.notify_all()

    def sync_taken(self, name: str) -> bool:
        """Make a taken file durable (``fdatasync``); False if ``name`` was not
        taken from the reserve, or the write re-created it (the caller then
        syncs it as a new file). Raises OSError, e.g. when it is gone."""
        with self._lock:
            fd = self._taken.pop(name, None)
        if fd is None:
            return False
        try:
            if os.stat(self._path(name)).st_ino != os.fstat(fd).st_ino:
                return False
            fdatasync(fd)
            return True
        finally:
            os.close(fd)

    def forget(self, name: str) -> None:
        """A taken file is being deleted (its append failed)."""
        with self._lock:
            fd = self._taken.pop(name, None)
        if fd is not None:
            os.close(fd)

    def held(self) -> frozenset[str]:
        """The names this reserve holds (not yet taken)."""
        if os.getpid() != self._pid:
            return frozenset()
        with self._lock:
            return frozenset([n for n, _ in self._ready] + list(self._pending))

    def close(self) -> None:
        """Delete the unused files; a refill in flight is waited for (it deletes
        what it made once it sees the reserve closed), so none is left behind."""
        with self._lock:
            self._closed = True
            if os.getpid() == self._pid:  # a forked child's copy has no refill thread
                self._refilled.wait_for(lambda: not self._refilling, timeout=_RESERVE_CLOSE_WAIT_S)
        _delete_ready(self.root, self._ready, self._lock, self._pid)


def _delete_ready(root: str, ready: collections.deque, lock: threading.Lock, pid: int) -> None:
    """Delete a reserve's files not taken (only in the process that made them)."""
    if os.getpid() != pid:
        return
    with lock:
        names = [n for n, _ in ready]
        ready.clear()
    for name in names:
        unlink_quietly(join(root, name))
