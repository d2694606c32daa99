"""The retention command's index side (docs/deploy.md, "Index growth").

Which trajectories may leave the index (folded by every shard of the default
fold and by every named projection), and the one transaction that drops
their ``events`` rows once their archive file is durable: it marks the
``trajectories`` rows ``archived_at`` (guarded: a row another run archived
first makes it store nothing), deletes exactly the archived positions, checks
no other event of those trajectories is left, deletes their
``agg_trajectory_stats`` rows (the run view's per-trajectory rows: the
aggregate totals keep their counts) and the aggregate rows only retired data
needs (``trim_aggregates``: settled groups none of whose trajectories is left,
1-second buckets older than the newest hour), and retires the log segments
left without a row. SQLAlchemy Core: the same statements on every backend.
"""

from __future__ import annotations

from typing import Collection, Mapping, Sequence

from sqlalchemy import Connection, and_, delete, exists, func, select, update

from trajstore.log._dialect import SqlDialect, chunks
from trajstore.log._segments import retire_emptied
from trajstore.log._transaction import Database
from trajstore.log.base import RELEASED, Shard, StaleState
from trajstore.schema import (agg_calls, agg_group_variance, agg_groups, agg_groups_delta, agg_rewards,
                              agg_route_drift, agg_staleness, agg_trajectories, agg_trajectory_stats, events,
                              materializer_checkpoints, projection_checkpoints, projection_unfoldable, projections,
                              trajectories, unfoldable_trajectories, unresolved_labels, version_labels)

__all__ = ["ARCHIVED_TYPES", "FINE_BUCKETS_KEPT_S", "SqlRetention", "trim_aggregates"]

FINE_BUCKETS_KEPT_S = 3600
"""The run view's 1-second buckets kept behind each table's newest one: the page draws them only for
a run shorter than ``MAX_BUCKETS`` (100) buckets of 30 s (``trajstore.inspect._timeaxis``); a longer
one reads the 60-second and 1-hour buckets, which retention keeps."""
BUCKETED = (agg_calls, agg_group_variance, agg_rewards, agg_route_drift, agg_staleness, agg_trajectories)


def trim_aggregates(conn: Connection) -> dict[str, int]:
    """Delete the run aggregates' rows that only retired data needs, in the caller's write
    transaction (the archive's): ``agg_groups`` rows of groups none of whose trajectories is
    left unarchived, settled (no delta of theirs pending: their part of ``agg_group_variance``
    stays), and every bucketed table's 1-second rows more than ``FINE_BUCKETS_KEPT_S`` behind its
    newest (the first second ``agg_trajectories`` counted stays: the page's time axis starts
    there). Returns the rows deleted per table. Every figure the page shows is unchanged: no
    total, 60-second or 1-hour row is touched, and no page reads a trimmed row (a run whose 1-second
    rows reach back further than the kept hour is drawn in buckets of a minute or more)."""
    out: dict[str, int] = {}
    g, t = agg_groups, trajectories
    out["agg_groups"] = conn.execute(delete(g).where(
        ~exists().where(and_(t.c.group_id == g.c.group_id, t.c.archived_at.is_(None))),
        ~exists().where(agg_groups_delta.c.group_id == g.c.group_id))).rowcount
    for table in BUCKETED:
        fine = table.c.width_s == 1
        newest = conn.execute(select(func.max(table.c.bucket_start)).where(fine)).scalar_one_or_none()
        if newest is None:
            continue
        conds = [fine, table.c.bucket_start < int(newest) - FINE_BUCKETS_KEPT_S]
        if table is agg_trajectories:
            first = select(func.min(table.c.bucket_start)).where(fine).scalar_subquery()
            conds.append(table.c.bucket_start > first)
        out[table.name] = conn.execute(delete(table).where(*conds)).rowcount
    return out

# The events of a trajectory that the archive holds (the wire events) and drops;
# ``trajectory_released`` is the store's own, dropped with them.
ARCHIVED_TYPES = ("trajectory_started", "generation", "reward", "trajectory_finished", RELEASED)


def _folded_to(checkpoints: Sequence[tuple[str, int]]) -> int:
    """The position every shard of a fold has committed: 0 when some shard of the
    count its keys name (or of any count they name) has no checkpoint."""
    if not checkpoints:
        return 0
    at = {Shard.parse(str(key)): int(position) for key, position in checkpoints}
    if any(shard not in at for count in {s.count for s in at} for shard in Shard.all(count)):
        return 0
    return min(at.values())


class SqlRetention:
    """The index side of ``trajstore archive`` over one store's ``Database``."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def horizons(self) -> tuple[int, dict[str, int]]:
        """How far the default fold and each named projection have folded the log: the
        lowest checkpoint of its shards, where a shard without a checkpoint row yet
        counts as position 0 (as the readers' watermark counts it): the shard set is
        the one the checkpoint keys name (``index/count``), so one shard of two that
        has not committed keeps every trajectory (0 without any checkpoint)."""
        pc = projection_checkpoints
        with self.db.reading("reading the fold checkpoints") as conn:
            default = conn.execute(select(materializer_checkpoints.c.shard, materializer_checkpoints.c.position)).all()
            names = conn.execute(select(projections.c.name)).scalars().all()
            rows = conn.execute(select(pc.c.projection, pc.c.shard, pc.c.position)).all()
        per: dict[str, list[tuple[str, int]]] = {}
        for name, shard, position in rows:
            per.setdefault(name, []).append((shard, position))
        return _folded_to(default), {n: _folded_to(per.get(n, [])) for n in names}

    def candidates(self, *, horizon: int, before_position: int | None, updated_before: float | None,
                   limit: int) -> list[tuple[str, int]]:
        """Up to ``limit`` finished, not archived trajectories whose every event is at or
        below ``horizon`` (and below ``before_position``), last updated before
        ``updated_before``, that no fold recorded as unfoldable and none waits on an
        unmapped version label: ``(trajectory_id, last position)`` by last position."""
        t, e = trajectories, events
        last = func.max(e.c.position)
        conds = [t.c.archived_at.is_(None), t.c.status != "running", t.c.finished_position.is_not(None),
                 t.c.finished_position <= horizon,
                 ~exists().where(unfoldable_trajectories.c.trajectory_id == t.c.trajectory_id),
                 ~exists().where(projection_unfoldable.c.trajectory_id == t.c.trajectory_id),
                 ~exists().where(and_(unresolved_labels.c.trajectory_id == t.c.trajectory_id,
                                      ~exists().where(version_labels.c.label == unresolved_labels.c.label)))]
        if updated_before is not None:
            conds.append(t.c.updated_at < updated_before)
        having = [last <= horizon]
        if before_position is not None:
            conds.append(t.c.finished_position < before_position)
            having.append(last < before_position)
        q = (select(t.c.trajectory_id, last).select_from(
            t.join(e, and_(e.c.trajectory_id == t.c.trajectory_id, e.c.type.in_(ARCHIVED_TYPES))))
             .where(*conds).group_by(t.c.trajectory_id).having(and_(*having)).order_by(last, t.c.trajectory_id)
             .limit(limit))
        with self.db.reading("finding trajectories to archive") as conn:
            return [(r[0], int(r[1])) for r in conn.execute(q)]

    def archived_count(self) -> int:
        with self.db.reading("counting archived trajectories") as conn:
            return int(conn.execute(select(func.count()).where(trajectories.c.archived_at.is_not(None))).scalar_one())

    def drop_archived(self, trajectory_ids: Sequence[str], positions: Collection[int],
                      segment_names: Collection[str], now: float) -> int:
        """Mark the trajectories archived and delete exactly ``positions`` (their
        archived events), in one transaction; retire the log segments left without
        a row. Stores nothing (``StaleState``) when a trajectory was archived
        meanwhile or holds an event the archive does not. Returns the rows deleted."""
        ids, pos = sorted(set(trajectory_ids)), sorted(set(positions))

        def body(conn: Connection, d: SqlDialect) -> int:
            marked = 0
            for part in chunks(ids):
                marked += conn.execute(update(trajectories).where(trajectories.c.trajectory_id.in_(part),
                                                                 trajectories.c.archived_at.is_(None))
                                       .values(archived_at=now)).rowcount
            if marked != len(ids):
                raise StaleState(f"{len(ids) - marked} of {len(ids)} trajectories were archived by another run")
            deleted = 0
            for part in chunks(pos):
                deleted += conn.execute(delete(events).where(events.c.position.in_(part))).rowcount
            if deleted != len(pos):
                raise StaleState(f"{len(pos) - deleted} archived events were no longer in the index")
            for part in chunks(ids):
                left = conn.execute(select(func.count()).where(events.c.trajectory_id.in_(part),
                                                               events.c.type.in_(ARCHIVED_TYPES))).scalar_one()
                if left:
                    raise StaleState(f"{left} events of these trajectories arrived after their archive was written")
            for part in chunks(ids):  # their row of the run view's "trajectories to look at" (the run's
                # totals keep counting them): agg_trajectory_stats grows with the live index only
                conn.execute(delete(agg_trajectory_stats).where(agg_trajectory_stats.c.trajectory_id.in_(part)))
            trim_aggregates(conn)  # the run view's rows only retired data needs
            if segment_names:
                retire_emptied(conn, d, segment_names)
            return deleted

        return self.db.transaction("dropping archived events", body)

    def lagging(self, projection_horizons: Mapping[str, int], last_position: int) -> dict[str, int]:
        """The projections whose checkpoint is below ``last_position``."""
        return {n: h for n, h in sorted(projection_horizons.items()) if h < last_position}
