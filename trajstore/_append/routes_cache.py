"""The recorded route rows of running trajectories, kept per ``Store`` for the drift figures.

Admission compares the route rows a call re-sends for recorded positions with
the recorded ones (docs/log.md, "Route drift"); rebuilding them from the log
is a payload read, so a store keeps what its own appends recorded, per
trajectory, at the revision it recorded them at, up to ``ROUTES_CACHE_BYTES``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Mapping, Sequence

from trajstore._append.admission import Admitted, RecordedRoutes, TrajectoryState

__all__ = ["ROUTES_CACHE_BYTES", "RoutesCache"]

ROUTES_CACHE_BYTES = 256 << 20
"""Recorded route rows of running trajectories kept per Store for the drift
figures (docs/log.md, "Route drift"); past it the least recently used go."""


class RoutesCache:
    """trajectory_id -> (revision, RecordedRoutes) of running trajectories this
    process appended to, least recently used first out past ``max_bytes``. An
    entry is valid only for the trajectory revision it was made at: an append
    by another process moves the revision, and the next comparison rebuilds it."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[str, tuple[int, RecordedRoutes]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, trajectory_id: str, revision: int) -> RecordedRoutes | None:
        with self._lock:
            hit = self._entries.get(trajectory_id)
            if hit is None or hit[0] != revision:
                return None
            self._entries.move_to_end(trajectory_id)
            return hit[1]

    def after_append(self, admitted: Sequence[Admitted], before: Mapping[str, TrajectoryState],
                     routes_after: Mapping[str, RecordedRoutes | None]) -> None:
        """Keep what a committed append's trajectories recorded, at their new revisions."""
        final: dict[str, TrajectoryState] = {}
        for a in admitted:
            if a.state is not None:
                final[a.event.trajectory_id] = a.state
        with self._lock:
            for tid, state in final.items():
                if tid in routes_after:
                    value = routes_after[tid]
                else:  # the batch did not change its recorded rows: an entry at the old revision still holds
                    old = self._entries.get(tid)
                    prev = before.get(tid)
                    value = old[1] if old is not None and prev is not None and old[0] == prev.revision else None
                self._drop(tid)
                if value is not None and state.status == "running":
                    self._entries[tid] = (state.revision, value)
                    self.nbytes += value.nbytes
            while self.nbytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))

    def _drop(self, trajectory_id: str) -> None:
        old = self._entries.pop(trajectory_id, None)
        if old is not None:
            self.nbytes -= old[1].nbytes
