"""Readers' leases and the retired-segment list: what the payload GC reads from
the index (``trajstore._upkeep.gc``; docs/log.md, "One copy").

A lease (``reader_leases`` row) says: the reader may still open any segment
retired after ``held_since`` (the database time before its oldest index read
whose locators it still uses). It lapses at ``expires_at`` unless renewed, so a
reader that died stops holding anything back. Every time here is the
database's clock, as ``segments.retired_at`` is.

A lease protects for at most ``max_age_s`` (``LEASE_MAX_AGE_S`` by default):
the GC's horizon is never earlier than that long before now, whatever a lease's
``held_since`` says, so a reader that renews without ever moving forward (a
read token renewing with ``since=0``) cannot hold back the GC forever. Each
lease that loses its protection so is logged once by the GC that passes it.

A lease whose name starts with ``SAMPLES_ONLY`` (a sample reader's: it opens
sample segments only) holds back sample segments only: log segments the
materializer retires meanwhile are collected as if it were not there."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Connection, and_, delete, func, insert, or_, select, update

from trajstore.log._dialect import SqlDialect
from trajstore.log._segments import named_clause
from trajstore.log._transaction import Database
from trajstore.schema import reader_leases, segments

__all__ = ["SAMPLES_ONLY", "LEASE_MAX_AGE_S", "take_lease", "renew_lease", "hold_lease", "release_lease", "gc_horizon",
           "gc_horizons", "retired_segments"]

SAMPLES_ONLY = "samples:"  # the name prefix of a lease over sample segments only
LEASE_MAX_AGE_S = 6 * 3600.0  # a lease holds back nothing retired longer ago than this
_log = logging.getLogger("trajstore.gc")
_told: set[tuple[str, float]] = set()  # leases already logged as past their maximum age (name, held_since)


def _now(conn: Connection, d: SqlDialect) -> float:
    return float(conn.exec_driver_sql(f"SELECT {d.now_sql}").scalar_one())


def _writing(conn: Connection, d: SqlDialect) -> float:
    """Start a lease's write transaction (``lease_write``: the first statement); the database's now."""
    if d.lease_write:
        conn.exec_driver_sql(d.lease_write)
    return _now(conn, d)


def take_lease(db: Database, name: str, holder: str, ttl_s: float) -> float:
    """Record lease ``name`` held since now; return its ``held_since``."""

    def body(conn: Connection, d: SqlDialect) -> float:
        now = _writing(conn, d)
        conn.execute(delete(reader_leases).where(reader_leases.c.name == name))
        conn.execute(insert(reader_leases).values(name=name, holder=holder[:255], held_since=now, renewed_at=now,
                                                  expires_at=now + ttl_s))
        return now

    return db.transaction("taking a reader lease", body)


def renew_lease(db: Database, name: str, ttl_s: float, *, advance: bool) -> float | None:
    """Extend lease ``name`` by ``ttl_s`` from now; ``advance``: it holds since now
    (the reader dropped every locator it read before). Returns its ``held_since``
    (None: the lease had expired and was removed; the caller takes a new one)."""

    def body(conn: Connection, d: SqlDialect) -> float | None:
        now = _writing(conn, d)
        values: dict[str, Any] = {"renewed_at": now, "expires_at": now + ttl_s}
        if advance:
            values["held_since"] = now
        done = conn.execute(update(reader_leases).where(reader_leases.c.name == name,
                                                        reader_leases.c.expires_at > now).values(**values)).rowcount
        if not done:
            return None
        return float(conn.execute(select(reader_leases.c.held_since)
                                  .where(reader_leases.c.name == name)).scalar_one())

    return db.transaction("renewing a reader lease", body)


def hold_lease(db: Database, name: str, holder: str, ttl_s: float, since: float | None) -> tuple[float, bool]:
    """Lease ``name`` holds since ``since`` (a database time it was told before;
    None: now) until ``ttl_s`` from now: one write transaction. ``held_since``
    only moves forward (clamped between its value and now), so a holder can
    never hold back more than it held. A lease that is absent or lapsed is
    taken anew, held since now. Returns ``(now, taken anew)``."""

    def body(conn: Connection, d: SqlDialect) -> tuple[float, bool]:
        now = _writing(conn, d)
        held = conn.execute(select(reader_leases.c.held_since)
                            .where(reader_leases.c.name == name, reader_leases.c.expires_at > now)).scalar()
        if held is None:
            conn.execute(delete(reader_leases).where(reader_leases.c.name == name))
            conn.execute(insert(reader_leases).values(name=name, holder=holder[:255], held_since=now, renewed_at=now,
                                                      expires_at=now + ttl_s))
            return now, True
        held_since = now if since is None else min(max(float(since), float(held)), now)
        conn.execute(update(reader_leases).where(reader_leases.c.name == name)
                     .values(held_since=held_since, renewed_at=now, expires_at=now + ttl_s))
        return now, False

    return db.transaction("holding a reader lease", body)


def release_lease(db: Database, name: str) -> None:
    def body(conn: Connection, d: SqlDialect) -> None:
        _writing(conn, d)
        conn.execute(delete(reader_leases).where(reader_leases.c.name == name))

    db.transaction("releasing a reader lease", body)


def gc_horizon(db: Database, margin_s: float, max_age_s: float = LEASE_MAX_AGE_S) -> tuple[float, int]:
    """``(horizon, live leases)``: segments retired before ``horizon`` may be
    deleted. It is ``now - margin_s``, or earlier: the oldest ``held_since`` of
    an unexpired lease (but not before ``now - max_age_s``), minus ``margin_s``.
    One read; expired leases are removed (a write) only when there are some."""
    samples_before, _, n = _horizons(db, margin_s, max_age_s)
    return samples_before, n


def gc_horizons(db: Database, margin_s: float, max_age_s: float = LEASE_MAX_AGE_S) -> tuple[float, float]:
    """``(samples_before, events_before)``: as ``gc_horizon``, for sample segments
    (every lease) and for log segments (leases not ``SAMPLES_ONLY``)."""
    samples_before, events_before, _ = _horizons(db, margin_s, max_age_s)
    return samples_before, events_before


def _past_max_age(db: Database, floor: float, max_age_s: float) -> None:
    """Log (once each) the live leases held since before ``floor``: they protect no more."""
    with db.reading("reading the readers' leases") as conn:
        rows = conn.execute(select(reader_leases.c.name, reader_leases.c.holder, reader_leases.c.held_since)
                            .where(reader_leases.c.held_since < floor, reader_leases.c.expires_at > floor)).all()
    for name, holder, since in rows:
        if (name, float(since)) not in _told:
            _told.add((name, float(since)))
            _log.warning("gc: reader lease %s (%s) has held since %.0f s ago, past the maximum lease age (%g s): "
                         "segments retired before then are collected, that reader loses their protection",
                         name, holder, floor + max_age_s - float(since), max_age_s)


def _horizons(db: Database, margin_s: float, max_age_s: float = LEASE_MAX_AGE_S) -> tuple[float, float, int]:
    with db.reading("reading the readers' leases") as conn:
        now = _now(conn, db.dialect)
        live = reader_leases.c.expires_at > now
        oldest, oldest_all, n, expired = conn.execute(select(
            func.min(reader_leases.c.held_since).filter(live),
            func.min(reader_leases.c.held_since).filter(live, ~reader_leases.c.name.startswith(SAMPLES_ONLY)),
            func.count().filter(live),
            func.count().filter(reader_leases.c.expires_at <= now)).select_from(reader_leases)).one()
    if expired:
        db.transaction("removing lapsed reader leases",
                       lambda conn, d: conn.execute(delete(reader_leases).where(reader_leases.c.expires_at <= now)))
    floor = now - max_age_s
    if oldest is not None and float(oldest) < floor:
        _past_max_age(db, floor, max_age_s)
    samples = now if oldest is None else min(now, max(float(oldest), floor))
    events = now if oldest_all is None else min(now, max(float(oldest_all), floor))
    return samples - margin_s, events - margin_s, int(n)


def retired_segments(db: Database, before: float, limit: int, *, events_before: float | None = None) -> list[str]:
    """Up to ``limit`` segments retired before ``before`` (log segments: before
    ``events_before``, default the same) that no index row names, oldest
    retirement first (one range scan of ``ix_segments_retired``)."""
    if events_before is None or events_before <= before:
        when = segments.c.retired_at < before
    else:
        when = and_(segments.c.retired_at < events_before,
                    or_(segments.c.kind == "events", segments.c.retired_at < before))
    q = (select(segments.c.name)
         .where(segments.c.retired_at.is_not(None), when, ~named_clause())
         .order_by(segments.c.retired_at).limit(limit))
    with db.reading("listing retired segments") as conn:
        return list(conn.execute(q).scalars())
