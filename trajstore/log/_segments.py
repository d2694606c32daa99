"""Which payload segments the index names, re-pointing events to other segment rows,
and retiring the log segments left empty (docs/log.md, "One copy")."""

from __future__ import annotations

from typing import Any, Collection, Sequence

from sqlalchemy import Connection, and_, exists, or_, select

from trajstore.errors import IndexInvariantError
from trajstore.log._dialect import SqlDialect, chunks
from trajstore.log.base import Repoint, StaleState
from trajstore.schema import events, projection_samples, samples, segments

__all__ = ["named", "named_clause", "repoint", "retire_emptied"]


def named(conn: Connection) -> set[str]:
    """Segments an ``events``, ``samples`` or ``projection_samples`` row names."""
    found = set(conn.execute(select(events.c.segment).where(events.c.segment.is_not(None)).distinct()).scalars())
    found |= set(conn.execute(select(projection_samples.c.segment).distinct()).scalars())
    return found | set(conn.execute(select(samples.c.segment).distinct()).scalars())


def named_clause() -> Any:
    """SQL: this ``segments`` row is not a log segment, or some event names it
    (one probe of ``ix_events_segment``; sample segments are retired only when their
    projection is dropped, and then no row names them)."""
    return or_(and_(segments.c.kind != "events", segments.c.retired_at.is_(None)),
               exists().where(events.c.segment == segments.c.name))


def repoint(conn: Any, d: SqlDialect, moves: Sequence[Repoint], *, guarded: bool) -> None:
    """Re-point events' payload locators. Guarded (compaction): each event
    must still be where the move was computed from, else ``StaleState``.
    Unguarded (the materializer, under its checkpoint guard): the sample row
    holds the same bytes whatever log row the event pointed at.

    One executemany of ready tuples through the driver (both drivers sum its
    rowcount: SQLAlchemy's ``supports_sane_multi_rowcount``), in position
    order: materializer and compaction take the row locks in the same order."""
    if not moves:
        return
    n = d.repoint(conn, moves, guarded=guarded)
    if n != len(moves):
        if guarded:
            raise StaleState(f"{len(moves) - n} of {len(moves)} events moved concurrently")
        raise IndexInvariantError(f"re-pointing {len(moves)} events found {n}: the log lost events, a trajstore bug")


def retire_emptied(conn: Any, d: SqlDialect, names: Collection[str]) -> None:
    """Retire these log segments if no index row names them any more, at the
    database's time (driver SQL: ``named_clause`` spelled out)."""
    for part in chunks(sorted(names)):
        d.retire_emptied(conn, part)
