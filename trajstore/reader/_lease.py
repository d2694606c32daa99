"""A sample reader's GC lease: what keeps the payload GC (``trajstore._upkeep.gc``) from
deleting a sample segment between the reader resolving its locators (a page of
sample index rows) and loading its rows (docs/reader.md, "The payload GC").

One ``reader_leases`` row per reader, written at most once per ``RENEW_S``
by a daemon thread (never per page, never per sample): the page reads only
note, in memory, which lease time they started after. The lease holds since
the oldest such time of a page whose rows the reader may still load, i.e.
rows not yet handed over (``handed_over``: the committed state's cursor
and ``scan_from`` say which); a reader with nothing pending holds since its
previous renewal. A local reader writes its row in the store's database; a
replay reader asks its server to write it (the ``lease`` action), since its
trainers hold no database login. The row lapses ``LEASE_TTL_S`` after its
last renewal: a reader killed with SIGKILL holds nothing back after that.

Loaded samples need no lease: an Arrow segment's rows are views of a memory
map (an unlinked file's inode lives as long as the map), other segments'
rows are read into memory.

A reader that cannot write its lease (a login without the grant, a store
before migration 0017, a replay server that does not know the action) logs
it once and reads on, protected by the GC's margin only (``GC_MARGIN_S``).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import uuid
import weakref
from typing import Any

from trajstore.errors import TrajstoreError, first_line
from trajstore.log._leases import SAMPLES_ONLY

__all__ = ["LEASE_TTL_S", "RENEW_S", "ReadLease"]

_log = logging.getLogger(__name__)

LEASE_TTL_S = 30.0  # a reader's lease not renewed this long has lapsed (the reader died)
RENEW_S = 5.0  # one lease write per reader this often, at most
RELEASE_WAIT_S = 5.0  # close() waits this long at most for the release

Key = tuple[int, int]


class _DatabaseLeases:
    """Leases written in the store's own database (``trajstore.log._leases``)."""

    def __init__(self, db: Any) -> None:
        self.db = db

    def hold(self, name: str, holder: str, ttl_s: float, since: float | None) -> tuple[float, bool]:
        from trajstore.log._leases import hold_lease

        return hold_lease(self.db, name, holder, ttl_s, since)

    def release(self, name: str) -> None:
        from trajstore.log._leases import release_lease

        release_lease(self.db, name)


def _backend(store: Any) -> Any:
    """Where ``store``'s readers write their lease: its database, its replay
    server (``ReplayStore._leases``), or nowhere (None: another ``ReaderStore``)."""
    db = getattr(getattr(store, "log", None), "db", None)
    if db is not None and hasattr(db, "transaction"):
        return _DatabaseLeases(db)
    return getattr(store, "_leases", None)


class ReadLease:
    """A reader's lease over the sample segments it may still load (module doc).

    ``reading()`` before a page of index rows is read, ``read(token, last_key)``
    after it (``last_key`` None: nothing to hold, e.g. an empty page or a failed
    read); ``handed_over(cursor, scan_from)`` after each committed step;
    ``restart()`` when the reader drops what it planned (a new iteration);
    ``close()`` releases the row. Nothing here raises to the reader."""

    def __init__(self, store: Any, holder: str) -> None:
        self._backend = _backend(store)
        self.holder = holder
        self.name = ""
        self.ttl_s, self.renew_s = LEASE_TTL_S, RENEW_S
        self._lock = threading.Lock()
        self._writing = threading.Lock()  # a renewal and the release never cross
        self._ids = itertools.count()
        self._pending: dict[int, tuple[float, Key | None, int]] = {}  # token -> (lease time, last key, generation)
        self._generation = 0
        self._stamp: float | None = None  # the database time of the last write of the row
        self._pid: int | None = None
        self._failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._stamp is not None and self._pid == os.getpid()

    # -- the reader's hot path: memory only, after the first page -----------------
    def reading(self) -> int | None:
        """A token for a page read about to start (None: no lease)."""
        if not self._ensure():
            return None
        with self._lock:
            token = next(self._ids)
            self._pending[token] = (self._stamp, None, self._generation)  # type: ignore[assignment]
            return token

    def read(self, token: int | None, last_key: Key | None) -> None:
        if token is None:
            return
        with self._lock:
            entry = self._pending.pop(token, None)
            if entry is not None and last_key is not None and entry[2] == self._generation:
                self._pending[token] = (entry[0], last_key, entry[2])

    def handed_over(self, cursor: Key | None, scan_from: Key | None) -> None:
        """Pages whose rows all lie at or before ``cursor`` (and before ``scan_from``) are done."""
        if cursor is None or not self._pending:
            return
        with self._lock:
            for token, (_, last, _gen) in list(self._pending.items()):
                if last is not None and last <= cursor and (scan_from is None or last < scan_from):
                    del self._pending[token]

    def restart(self) -> None:
        """The pages read so far will not be loaded (reads under way are dropped when they end)."""
        with self._lock:
            self._generation += 1
            for token, (_, last, _gen) in list(self._pending.items()):
                if last is not None:
                    del self._pending[token]

    # -- the row --------------------------------------------------------------------
    def _ensure(self) -> bool:
        """Take the lease on the first page read (in this process: a forked copy takes its own)."""
        if self._backend is None or self._failed:
            return False
        if self._pid == os.getpid():
            return True
        with self._lock:
            if self._pid == os.getpid():
                return True
            self._pending.clear()
            self._stop = threading.Event()
            self.name = SAMPLES_ONLY + uuid.uuid4().hex  # it opens sample segments only: log segments are not held
            try:
                self._stamp, _ = self._backend.hold(self.name, self.holder, self.ttl_s, None)
            except TrajstoreError as e:
                self._failed = True
                _log.warning("trajstore reader %s reads without a GC lease (its pages are protected by the GC "
                             "margin only): %s", self.holder, first_line(e))
                return False
            self._pid = os.getpid()
            self._thread = threading.Thread(target=_beat, args=(weakref.ref(self), self._stop, self.renew_s),
                                            daemon=True, name="trajstore-reader-lease")
            self._thread.start()
            return True

    def renew(self) -> None:
        """One write: held since the oldest pending page's lease time, else the last renewal's."""
        if not self.held:
            return
        with self._lock:
            since = min((t for t, _, _ in self._pending.values()), default=self._stamp)
        with self._writing:
            if self._stop.is_set():
                return
            now, anew = self._backend.hold(self.name, self.holder, self.ttl_s, since)
        with self._lock:
            self._stamp = now
        if anew:
            _log.warning("trajstore reader %s: its GC lease had lapsed (not renewed for %g s); segments retired "
                         "meanwhile may be gone", self.holder, self.ttl_s)

    def close(self) -> None:
        """Release the row: one write, waited for at most ``RELEASE_WAIT_S`` (a store
        or server that does not answer does not hold up closing; the row lapses)."""
        self._stop.set()
        if not self.held:
            return
        self._stamp = None

        def release() -> None:
            try:
                with self._writing:
                    self._backend.release(self.name)
            except TrajstoreError as e:
                _log.info("trajstore reader %s: its GC lease was not released (it lapses by itself): %s",
                          self.holder, first_line(e))

        thread = threading.Thread(target=release, daemon=True, name="trajstore-reader-lease-release")
        thread.start()
        thread.join(RELEASE_WAIT_S)


def _beat(ref: "weakref.ref[ReadLease]", stop: threading.Event, every_s: float) -> None:
    """The heartbeat: renews the lease every ``every_s`` until it is closed, or
    dropped with its reader unclosed (then the row lapses by itself)."""
    failing = False
    while not stop.wait(every_s):
        lease = ref()
        if lease is None:
            return
        try:
            lease.renew()
            failing = False
        except TrajstoreError as e:
            if not failing:  # once per outage, not once per beat
                _log.warning("trajstore reader %s: renewing its GC lease failed, retried every %g s: %s",
                             lease.holder, every_s, first_line(e))
            failing = True
        except Exception:  # noqa: BLE001 - a bug must not end the heartbeat silently
            _log.exception("trajstore reader %s: renewing its GC lease failed", lease.holder)
        del lease


def holder(rank: int, world_size: int) -> str:
    """Who holds a reader's lease, as ``reader_leases.holder`` shows it."""
    return f"reader {rank}/{world_size} {socket.gethostname()}:{os.getpid()}"
