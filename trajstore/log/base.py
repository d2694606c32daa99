"""The narrow interface every log backend implements.

Backends see records (plain dicts shaped like the ``trajstore.schema``
tables), never domain objects: admission, the fold and payload handling live
above this layer.

Contract, shared by every backend (and checked by ``tests/log``):

* **Ordering.** ``commit_append`` gives the batch's events consecutive
  positions, and a reader that has seen position ``p`` will never later see
  a newly committed event at a position ``< p``: commits become visible in
  position order. ``read_events(after_position=...)`` therefore never skips
  an event that commits late.
* **Atomicity.** ``commit_append`` stores all of a batch (events, trajectory
  rows, segment row) or nothing.
* **Optimistic concurrency.** Each trajectory row carries ``version``; a
  batch computed from a stale version raises ``StaleState`` and stores
  nothing (the caller re-reads and re-admits). So does a race on an event
  identity.
* **Errors.** Driver errors that mean "cannot reach the database" become
  ``StoreUnavailable``; nothing else from the driver escapes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Collection, Iterator, Mapping, Sequence

__all__ = ["EventLog", "StaleState", "TrajectoryWrite"]


class StaleState(Exception):
    """A concurrent writer changed a trajectory (or took an identity) first."""


@dataclass(frozen=True)
class TrajectoryWrite:
    """A trajectory row to insert (``expected_version is None``) or update."""

    row: Mapping[str, Any]
    expected_version: int | None


class EventLog(ABC):
    """The log index: events, trajectory tail state, segments, samples."""

    # -- appending ---------------------------------------------------------
    @abstractmethod
    def load_trajectories(self, trajectory_ids: Collection[str]) -> dict[str, dict[str, Any]]:
        """Trajectory rows by id (missing ids are absent)."""

    @abstractmethod
    def lookup_identities(self, identities: Collection[str]) -> dict[str, bytes]:
        """Content hash of each stored identity (missing ones are absent)."""

    def load_append_state(self, identities: Collection[str], trajectory_ids: Collection[str]
                          ) -> tuple[dict[str, bytes], dict[str, dict[str, Any]]]:
        """``lookup_identities`` and ``load_trajectories`` together (backends may
        answer both in one round trip: an append needs both before it admits)."""
        return self.lookup_identities(identities), self.load_trajectories(trajectory_ids)

    @abstractmethod
    def commit_append(
        self,
        event_rows: Sequence[dict[str, Any]],
        trajectory_writes: Sequence[TrajectoryWrite],
        segment_row: Mapping[str, Any] | None,
    ) -> list[int]:
        """Atomically store a batch; return the events' positions (see class doc)."""

    # -- reading -----------------------------------------------------------
    @abstractmethod
    def head_position(self) -> int:
        """Position of the last committed event (0 when empty)."""

    @abstractmethod
    def read_events(self, *, after_position: int, limit: int, types: Collection[str] | None = None) -> list[dict[str, Any]]:
        """Up to ``limit`` committed events with position > ``after_position``, in order."""

    @abstractmethod
    def count_events(self, *, after_position: int, types: Collection[str] | None = None) -> int:
        """Number of committed events with position > ``after_position``."""

    @abstractmethod
    def trajectory_events(self, trajectory_ids: Collection[str]) -> dict[str, list[dict[str, Any]]]:
        """All events of the given trajectories, each list in position order."""

    @abstractmethod
    def counts(self) -> dict[str, Any]:
        """Summary counts for ``trajstore info``."""

    @abstractmethod
    def referenced_segments(self) -> set[str]:
        """Names of every segment a row points at."""

    # -- samples (materializer output) --------------------------------------
    @abstractmethod
    def load_checkpoint(self, shard: str) -> dict[str, Any] | None:
        """The materializer checkpoint row of ``shard``."""

    @abstractmethod
    def commit_samples(
        self,
        shard: str,
        sample_rows: Sequence[dict[str, Any]],
        segment_row: Mapping[str, Any] | None,
        checkpoint: Mapping[str, Any],
        expected_position: int,
    ) -> None:
        """Insert sample rows and advance ``shard``'s checkpoint in one transaction.

        Raises StaleState when the stored checkpoint is not ``expected_position``
        (another materializer of the same shard got there first)."""

    @abstractmethod
    def iter_sample_rows(self, *, where: Mapping[str, Any], after: tuple[int, int] | None,
                         batch_size: int) -> Iterator[list[dict[str, Any]]]:
        """Sample rows matching the filters, in (finished_position, sample_index) order."""

    @abstractmethod
    def close(self) -> None:
        """Release connections."""
