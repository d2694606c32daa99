"""The reader's seam: the five reads ``SampleReader`` makes of a store, declared.

A store the reader reads is any object with three parts, each with only the
reads listed here (docs/reference.md, "The store's parts"):

* ``materialized.iter_sample_rows``, ``materialized.watermark`` and
  ``materialized.projection`` (the sample index; a projection's index has the
  same reads);
* ``log.count_events`` (to say why a read yielded nothing);
* ``payload.read_rows`` (the sample segments' rows).

Two implementations: a ``Store`` (``trajstore.log.base.SampleIndex``,
``EventLog`` and ``trajstore.payload.PayloadStore``, over the database and the
payload files) and ``trajstore.replay.ReplayStore`` (the same reads over Arrow
Flight). ``tests/test_reader.py`` runs the reader's tests on both, and checks
that each implementation's methods take the parameters declared here.
Re-exported by ``trajstore.reader``.
"""

from __future__ import annotations

from typing import Any, Collection, Iterable, Iterator, Mapping, Protocol, runtime_checkable

__all__ = ["ReaderEventLog", "ReaderPayload", "ReaderSampleIndex", "ReaderStore"]


@runtime_checkable
class ReaderSampleIndex(Protocol):
    """The sample index reads: rows in ``(finished_position, sample_index)`` order, the watermark."""

    def iter_sample_rows(self, *, where: Mapping[str, Any], after: tuple[int, int] | None,
                         page_rows: int) -> Iterator[list[dict[str, Any]]]:
        """Pages of sample rows matching ``where`` (``max_finished_position``, ``status``, ``group_id``, ...)
        after the key ``after``."""
        ...

    def watermark(self, num_shards: int | None = None) -> int:
        """Position up to which every materializer shard has committed its samples."""
        ...

    def projection(self, name: str) -> "ReaderSampleIndex":
        """The sample index of the named projection (``ValidationError`` when there is none)."""
        ...


@runtime_checkable
class ReaderEventLog(Protocol):
    def count_events(self, *, after_position: int, types: Collection[str] | None = None) -> int:
        """Committed events after ``after_position`` (of these types)."""
        ...


@runtime_checkable
class ReaderPayload(Protocol):
    def read_rows(self, name: str, rows: Iterable[int]) -> Any:
        """The given rows of a sample segment, as a ``trajstore.payload.SegmentRows``."""
        ...


@runtime_checkable
class ReaderStore(Protocol):
    """What ``SampleReader`` reads: a ``Store``, a ``ReplayStore``, or any object with these parts."""

    materialized: ReaderSampleIndex
    log: ReaderEventLog
    payload: ReaderPayload
