"""A reader's patience with an unavailable store: every read (``SampleReader._retrying``),
opening the store (``SampleReader(url)``) and recording a step (``record_step``) is
retried with backoff while it raises ``StoreUnavailable``, for up to
``unavailable_timeout_s`` from the first failed attempt's start, with one log line
when the wait starts and one when it ends; only then does the error reach the trainer.

Opening waits only for a server that cannot be reached or is restarting
(``trajstore.log.transient_opening``): a store that is not there, a refused login,
fail at once as before.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, TypeVar

from trajstore._util.backoff import Backoff
from trajstore.errors import StoreUnavailable, first_line

__all__ = ["Patient"]

_log = logging.getLogger("trajstore.reader")

T = TypeVar("T")


class Patient:
    """The waits of ``SampleReader`` (a mixin): needs ``config.unavailable_timeout_s``,
    ``rank``, ``world_size``, ``stats`` and ``_patience_init()`` called first."""

    config: Any
    stats: Any
    rank: int
    world_size: int

    def _patience_init(self) -> None:
        self._closing = threading.Event()  # set by close(): a wait for the store gives up
        self._outage_lock = threading.Lock()
        self._outage_since: float | None = None  # when the current wait for an unavailable store began

    def _retrying(self, what: str, read: Callable[[], T],
                  transient: Callable[[StoreUnavailable], bool] | None = None) -> T:
        """``read()``, retried with backoff while it raises ``StoreUnavailable`` (and
        ``transient(error)``, when given, says it may pass), for up to
        ``unavailable_timeout_s`` from the first failed attempt's start.
        One WARNING when the reader starts waiting and one INFO when the store is
        back, however many reads (prefetch, parallel payload reads) wait meanwhile;
        ``stats.unavailable_waits`` / ``unavailable_s`` count the waits."""
        backoff: Backoff | None = None
        while True:
            started = time.monotonic()
            try:
                result = read()
            except StoreUnavailable as e:
                if transient is not None and not transient(e):
                    raise
                if self._closing.is_set():  # closed: the read ends here, it is no outage
                    raise StoreUnavailable(f"{what}: the reader was closed ({first_line(e)})") from None
                if backoff is None:
                    backoff = Backoff(first_s=0.1, max_s=2.0)
                    backoff.start = started
                    self._outage_began(started, what, e)
                budget = self.config.unavailable_timeout_s
                if backoff.exhausted(budget):
                    _log.error("trajstore reader (rank %d of %d): gave up %s after %g s: %s",
                               self.rank, self.world_size, what, budget, first_line(e))
                    raise StoreUnavailable(f"{what}: the store stayed unavailable for {budget:g} s "
                                           f"(unavailable_timeout_s={budget:g}): {first_line(e)}") from None
                if self._closing.wait(backoff.delay):
                    raise StoreUnavailable(f"{what}: the reader was closed while the store was unavailable "
                                           f"({first_line(e)})") from None
                backoff.delay = min(backoff.delay * 2, backoff.max_s)
                continue
            if self._outage_since is not None:
                self._outage_ended()
            return result

    def _outage_began(self, at: float, what: str, e: BaseException) -> None:
        with self._outage_lock:
            if self._outage_since is not None:
                return  # another read of this reader is waiting already and said so
            self._outage_since = at
            self.stats.unavailable_waits += 1
        _log.warning("trajstore reader (rank %d of %d): store unavailable while %s (%s); retrying for up to %g s",
                     self.rank, self.world_size, what, first_line(e), self.config.unavailable_timeout_s)

    def _outage_ended(self) -> None:
        with self._outage_lock:
            since, self._outage_since = self._outage_since, None
            if since is None:
                return
            waited = time.monotonic() - since
            self.stats.unavailable_s += waited
        _log.info("trajstore reader (rank %d of %d): store available again after %.1f s",
                  self.rank, self.world_size, waited)
