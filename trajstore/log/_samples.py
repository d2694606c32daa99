"""``SampleIndex`` on SQLAlchemy: the default samples and every named projection's, one implementation.

``_SqlSamples`` reads and commits a sample index over three tables — sample
rows, checkpoints, unfoldable trajectories — scoped by ``projection``: the
default's ``samples``, ``materializer_checkpoints`` and
``unfoldable_trajectories``, or a projection's rows of ``projection_samples``,
``projection_checkpoints`` and ``projection_unfoldable``
(docs/projections.md). ``SqlSampleIndex`` (the default) adds the quarantine
and the projections' rows; its commits re-point the folded events to their
sample rows (the one copy of the log's tokens). ``SqlProjectionIndex`` never
re-points, never touches the default's tables, and its commits lose to a drop
of the projection.
"""

from __future__ import annotations

import time
from typing import Any, Collection, Iterator, Mapping, Sequence

from sqlalchemy import Connection, Engine, Table, and_, delete, func, insert, or_, select, text, update

from trajstore.errors import IndexInvariantError, ProjectionChangedError, ValidationError
from trajstore.log._aggregates import count_commit, count_sample_rows, insert_fold_deltas
from trajstore.log._dialect import CHUNK, SqlDialect, chunks
from trajstore.log._segments import repoint, retire_emptied
from trajstore.log._transaction import Database
from trajstore.log.base import DATA_ERROR, Repoint, SampleIndex, Shard, StaleState
from trajstore.schema import (materializer_checkpoints, projection_checkpoints, projection_samples,
                              projection_unfoldable, projections, samples, segments, unfoldable_trajectories)

__all__ = ["SqlProjectionIndex", "SqlSampleIndex"]


class _SqlSamples(SampleIndex):
    """A sample index's reads and commits, scoped by ``projection`` (None: the default samples)."""

    samples: Table = samples
    checkpoint_table: Table = materializer_checkpoints
    unfoldable: Table = unfoldable_trajectories
    projection_name: str | None = None

    def __init__(self, db: Database) -> None:
        self.db = db

    # -- the scope --------------------------------------------------------------
    def _scope(self) -> dict[str, str]:
        """The key columns of this index's rows (``{"projection": name}`` for a projection)."""
        return {} if self.projection_name is None else {"projection": self.projection_name}

    def _conds(self, table: Table) -> list[Any]:
        return [table.c[k] == v for k, v in self._scope().items()]

    def _whose(self) -> str:
        """How messages name this index's rows."""
        return "" if self.projection_name is None else f"projection {self.projection_name!r} "

    def _check_current(self, conn: Connection) -> None:
        """In a commit's transaction, before anything is written: this index still exists."""

    def _check_read(self, conn: Connection) -> None:
        """In a read's transaction: the rows read belong to this index (a projection
        dropped or re-created since this object was made raises)."""

    # -- SampleIndex ------------------------------------------------------------
    def load_checkpoint(self, shard: Shard) -> dict[str, Any] | None:
        where = {**self._scope(), "shard": str(Shard.parse(str(shard)))}
        names = [c.name for c in self.checkpoint_table.columns if c.name not in self._scope()]
        with self.db.reading(f"reading a {self._whose()}checkpoint") as conn:
            # driver SQL, like the materializer's other statements (a new engine would compile a select)
            row = self.db.dialect.select_where(conn, self.checkpoint_table, names, where).first()
        return dict(zip(names, row)) if row else None

    def checkpoints(self) -> dict[Shard, dict[str, Any]]:
        t = self.checkpoint_table
        with self.db.reading(f"reading {self._whose()}checkpoints") as conn:
            self._check_read(conn)
            rows = [dict(r._mapping) for r in conn.execute(select(t).where(*self._conds(t)))]
        return {Shard.parse(r["shard"]): r for r in rows}

    def commit_samples(
        self,
        shard: Shard,
        sample_rows: Sequence[dict[str, Any]],
        segment_row: Mapping[str, Any] | None,
        checkpoint: Mapping[str, Any],
        expected_position: int,
        *,
        unfoldable_rows: Sequence[dict[str, Any]] = (),
        repoints: Sequence[Repoint] = (),
        aggregates: Mapping[str, Any] | None = None,
        trajectories: Sequence[str] = (),
        calls_of: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    ) -> None:
        if repoints and self.projection_name is not None:
            raise IndexInvariantError("a projection never re-points events (the default samples hold them)")
        key = str(Shard.parse(str(shard)))
        scope = self._scope()
        where = {**scope, "shard": key}
        cp = dict(checkpoint, **where, updated_at=time.time())
        t = self.checkpoint_table

        def body(conn: Connection, d: SqlDialect) -> None:
            # Driver SQL throughout (a new store's engine would compile every statement).
            # The guarded UPDATE is the position check: a concurrent materializer of
            # this shard that moved the checkpoint leaves it matching no row.
            self._check_current(conn)
            if expected_position == 0 and d.select_where(conn, t, ["shard"], where).first() is None:
                d.insert_rows(conn, t, [cp])  # a concurrent first commit: primary key race -> StaleState
            else:
                moved = d.update_where(conn, t, {k: v for k, v in cp.items() if k not in where},
                                       {**where, "position": expected_position})
                if moved != 1:
                    raise StaleState(f"{self._whose()}shard {key!r} checkpoint is no longer at {expected_position}")
            if segment_row is not None:
                d.insert_rows(conn, segments, [segment_row])
            if sample_rows:
                d.insert_rows(conn, self.samples, [dict(r, **scope) for r in sample_rows] if scope else sample_rows)
            if unfoldable_rows:
                d.insert_rows(conn, self.unfoldable,
                              [dict(r, **scope) for r in unfoldable_rows] if scope else unfoldable_rows)
            if repoints:
                repoint(conn, d, repoints, guarded=False)
                retire_emptied(conn, d, {m.old_segment for m in repoints if m.old_segment})
            if self.projection_name is None:
                # the run view's counts of the default samples and of the finished trajectories it
                # takes (from their index rows): rows of this commit's own, compacted in the background
                count_commit(conn, d, trajectories, sample_rows, expected_position, int(checkpoint["position"]),
                             calls_of, aggregates)

        def landed(conn: Connection, _: None) -> bool:
            pos = conn.execute(select(t.c.position).where(*self._conds(t), t.c.shard == key)).scalar_one_or_none()
            return pos is not None and pos >= int(checkpoint["position"])

        self.db.transaction(f"committing samples of {self._whose()}shard {key}", body, landed=landed)

    def iter_sample_rows(self, *, where: Mapping[str, Any], after: tuple[int, int] | None,
                         page_rows: int) -> Iterator[list[dict[str, Any]]]:
        s = self.samples
        conds = [*self._conds(s), *_sample_filters(where, s)]
        columns = [c for c in s.columns if c.name not in self._scope()]
        cursor = after
        while True:
            q = select(*columns).where(*conds)
            if cursor is not None:
                fp, si = cursor
                q = q.where(or_(s.c.finished_position > fp,
                                and_(s.c.finished_position == fp, s.c.sample_index > si)))
            q = q.order_by(s.c.finished_position, s.c.sample_index).limit(page_rows)
            with self.db.reading(f"reading {self._whose()}sample rows") as conn:
                self._check_read(conn)
                rows = [dict(r._mapping) for r in conn.execute(q)]
            if not rows:
                return
            yield rows
            cursor = (rows[-1]["finished_position"], rows[-1]["sample_index"])

    def sample_facts(self, trajectory_ids: Collection[str]) -> list[dict[str, Any]]:
        """The rows training lineage checks a step against (docs/reference.md, "Training
        lineage"): ``trajectory_id``, ``sample_index``, ``prompt_len``, ``response_len``,
        ``min_model_version``, ``max_model_version``, ``segment``, ``segment_row`` of every
        sample of ``trajectory_ids``; one query per chunk of ids, no order."""
        s = self.samples
        names = ("trajectory_id", "sample_index", "prompt_len", "response_len", "min_model_version",
                 "max_model_version", "segment", "segment_row")
        out: list[dict[str, Any]] = []
        with self.db.reading(f"reading {self._whose()}sample rows") as conn:
            for part in chunks(sorted(set(trajectory_ids))):
                q = select(*(s.c[n] for n in names)).where(*self._conds(s), s.c.trajectory_id.in_(part))
                out.extend(dict(zip(names, r)) for r in conn.execute(q))
        return out

    def count_samples(self) -> int:
        s = self.samples
        with self.db.reading(f"counting {self._whose()}samples") as conn:
            return int(conn.execute(select(func.count()).select_from(s).where(*self._conds(s))).scalar_one())

    def unfoldable_trajectories(self, *, limit: int = 20, kind: str = DATA_ERROR) -> dict[str, Any]:
        t = self.unfoldable
        conds = (*self._conds(t), t.c.kind == kind)
        with self.db.reading(f"reading {self._whose()}unfoldable trajectories") as conn:
            by_error = dict(conn.execute(select(t.c.error, func.count()).where(*conds)
                                         .group_by(t.c.error)).all())
            recent = conn.execute(
                select(t.c.trajectory_id, t.c.finished_position, t.c.shard, t.c.error, t.c.rule, t.c.message)
                .where(*conds).order_by(t.c.finished_position.desc()).limit(limit)
            ).all()
        return {"count": sum(int(v) for v in by_error.values()),
                "by_error": {k: int(v) for k, v in sorted(by_error.items())},
                "recent": [dict(r._mapping) for r in recent]}


class SqlSampleIndex(_SqlSamples):
    """The default sample index over the same engines as the log; the quarantine
    and the named projections' rows."""

    def __init__(self, write_engine: Engine, read_engine: Engine, db: Database | None = None) -> None:
        super().__init__(db or Database(write_engine, read_engine))

    def quarantined(self, error: str | None, *, kind: str = DATA_ERROR) -> list[dict[str, Any]]:
        t = unfoldable_trajectories
        with self.db.reading("reading quarantined trajectories") as conn:
            rows = conn.execute(select(t.c.trajectory_id, t.c.finished_position, t.c.shard)
                                .where(*_recorded_as(error, kind)).order_by(t.c.finished_position)).all()
        return [dict(r._mapping) for r in rows]

    def commit_refold(self, error: str | None, trajectory_ids: Sequence[str], sample_rows: Sequence[dict[str, Any]],
                      segment_row: Mapping[str, Any] | None, unfoldable_rows: Sequence[dict[str, Any]],
                      repoints: Sequence[Repoint], *, kind: str = DATA_ERROR,
                      aggregates: Mapping[str, Any] | None = None) -> None:
        t = unfoldable_trajectories

        def body(conn: Connection, d: SqlDialect) -> None:
            # the guard: every one of them is still recorded with ``kind``/``error`` (no other refold took it)
            gone = 0
            for part in chunks(sorted(trajectory_ids)):
                gone += conn.execute(t.delete().where(t.c.trajectory_id.in_(list(part)))
                                     .where(*_recorded_as(error, kind))).rowcount
            if gone != len(set(trajectory_ids)):
                raise StaleState(f"{len(set(trajectory_ids)) - gone} quarantined trajectories were re-folded "
                                 "concurrently")
            if segment_row is not None:
                d.insert_rows(conn, segments, [segment_row])
            if sample_rows:
                d.insert_rows(conn, samples, sample_rows)
            if unfoldable_rows:
                d.insert_rows(conn, unfoldable_trajectories, unfoldable_rows)
            if repoints:
                repoint(conn, d, repoints, guarded=False)
                retire_emptied(conn, d, {m.old_segment for m in repoints if m.old_segment})
            if aggregates:
                insert_fold_deltas(conn, d, aggregates)
            count_sample_rows(conn, d, sample_rows)  # their trajectories were counted when recorded

        def landed(conn: Connection, _: None) -> bool:
            ids = sorted(set(trajectory_ids))[:CHUNK]
            return not conn.execute(select(t.c.trajectory_id).where(t.c.trajectory_id.in_(ids))
                                    .where(*_recorded_as(error, kind)).limit(1)).first()

        self.db.transaction("re-folding quarantined trajectories", body, landed=landed)

    # -- named projections (docs/projections.md) ------------------------------
    def create_projection(self, row: Mapping[str, Any]) -> None:
        """Insert a ``projections`` row; ``ValidationError`` (rule ``projection``) when the name is taken."""
        def body(conn: Connection, d: SqlDialect) -> None:
            if conn.execute(select(projections.c.name).where(projections.c.name == row["name"])).first():
                raise ValidationError(f"projection {row['name']!r} exists (drop it first to change its policy)",
                                      rule="projection")
            conn.execute(insert(projections).values(**row))

        try:
            self.db.transaction(f"creating projection {row['name']!r}", body)
        except StaleState:  # created concurrently
            raise ValidationError(f"projection {row['name']!r} exists", rule="projection") from None

    def projections(self) -> list[dict[str, Any]]:
        """Every projection's row, with ``num_samples`` and ``num_unfoldable``, by name."""
        with self.db.reading("listing projections") as conn:
            rows = [dict(r._mapping) for r in conn.execute(select(projections).order_by(projections.c.name))]
            n = dict(conn.execute(select(projection_samples.c.projection, func.count())
                                  .group_by(projection_samples.c.projection)).all())
            bad = dict(conn.execute(select(projection_unfoldable.c.projection, func.count())
                                    .group_by(projection_unfoldable.c.projection)).all())
        for r in rows:
            r["num_samples"], r["num_unfoldable"] = int(n.get(r["name"], 0)), int(bad.get(r["name"], 0))
        return rows

    def projection(self, name: str) -> "SqlProjectionIndex":
        """The sample index of projection ``name`` (``ValidationError`` when there is none)."""
        with self.db.reading("reading a projection") as conn:
            row = conn.execute(select(projections).where(projections.c.name == name)).first()
        if row is None:
            raise ValidationError(f"no projection {name!r} (trajstore projection list)", rule="projection")
        return SqlProjectionIndex(self.db, dict(row._mapping))

    def projection_as(self, name: str, token: str) -> "SqlProjectionIndex":
        """Projection ``name`` as it was created with identity ``token`` (a reader's, told
        before): ``ProjectionChangedError`` now and at each later read once the projection
        of that name is another one (dropped, or dropped and created again)."""
        index = SqlProjectionIndex(self.db, {"name": name, "token": token})
        with self.db.reading("reading a projection") as conn:
            index._check_read(conn)  # noqa: SLF001 - its own class's check
        return index

    def drop_projection(self, name: str) -> dict[str, int]:
        """In one transaction: delete projection ``name``'s samples, checkpoints,
        unfoldable rows and row, and retire its sample segments (``trajstore gc``
        deletes the files after its grace). The log, the default samples and other
        projections are untouched. Returns ``{"samples", "segments"}`` removed."""
        def body(conn: Connection, d: SqlDialect) -> dict[str, int]:
            if conn.execute(select(projections.c.name).where(projections.c.name == name)).first() is None:
                raise ValidationError(f"no projection {name!r} (trajstore projection list)", rule="projection")
            ps = projection_samples
            names = sorted(conn.execute(select(ps.c.segment).where(ps.c.projection == name).distinct()).scalars())
            n = conn.execute(delete(ps).where(ps.c.projection == name)).rowcount
            for t in (projection_checkpoints, projection_unfoldable):
                conn.execute(delete(t).where(t.c.projection == name))
            conn.execute(delete(projections).where(projections.c.name == name))
            for part in chunks(names):  # stamped with the database's clock, as the GC compares them
                conn.execute(update(segments).where(segments.c.name.in_(part), segments.c.kind == "samples",
                                                    segments.c.retired_at.is_(None)).values(retired_at=text(d.now_sql)))
            return {"samples": int(n), "segments": len(names)}

        return self.db.transaction(f"dropping projection {name!r}", body)


class SqlProjectionIndex(_SqlSamples):
    """The sample index of one named projection (``row``: its policy). Its
    commits never re-point events (the default samples hold the one copy of the
    log's tokens) and never touch the default's tables."""

    samples = projection_samples
    checkpoint_table = projection_checkpoints
    unfoldable = projection_unfoldable

    def __init__(self, db: Database, row: Mapping[str, Any]) -> None:
        super().__init__(db)
        self.name = self.projection_name = str(row["name"])
        self.row = dict(row)

    def _check_current(self, conn: Connection) -> None:
        # the projection must still exist: a drop between the fold and this commit wins
        token = conn.execute(select(projections.c.token).where(projections.c.name == self.name)).scalar()
        if token != self.row["token"]:
            raise StaleState(f"projection {self.name!r} was dropped")

    @property
    def token(self) -> str:
        """The identity the projection was created with (a re-created one has another)."""
        return str(self.row["token"])

    def _check_read(self, conn: Connection) -> None:
        token = conn.execute(select(projections.c.token).where(projections.c.name == self.name)).scalar()
        if token != self.row["token"]:
            raise ProjectionChangedError(
                f"projection {self.name!r} was " + ("dropped" if token is None else "dropped and created again")
                + " since this reader began: its samples are another sequence; start a new reader "
                  "(and a new epoch) on it")


def _sample_filters(where: Mapping[str, Any], table: Table) -> list[Any]:
    c = table.c
    conds: list[Any] = []
    if where.get("status") is not None:
        st = where["status"]
        conds.append(c.status.in_([st] if isinstance(st, str) else list(st)))
    if where.get("min_model_version") is not None:
        conds.append(c.min_model_version >= where["min_model_version"])
    if where.get("max_model_version") is not None:
        conds.append(c.max_model_version <= where["max_model_version"])
    if where.get("group_id") is not None:
        conds.append(c.group_id == where["group_id"])
    if where.get("trajectory_ids") is not None:
        conds.append(c.trajectory_id.in_(list(where["trajectory_ids"])))
    if where.get("max_finished_position") is not None:
        conds.append(c.finished_position <= where["max_finished_position"])
    return conds


def _recorded_as(error: str | None, kind: str) -> list[Any]:
    """The conditions on ``unfoldable_trajectories`` rows recorded with ``kind`` and ``error`` (None: any)."""
    t = unfoldable_trajectories
    return [t.c.kind == kind] + ([] if error is None else [t.c.error == error])
