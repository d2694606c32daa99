"""The EventLog on SQLAlchemy Core, shared by SQLite and PostgreSQL.

Dialect differences (engine set-up, locking for migrations) live in
``sqlite.py`` and ``postgres.py``; this module speaks only portable SQL.

Why positions come from a counter row: an event store on PostgreSQL that
takes positions from a sequence can commit position 11 before position 10;
a reader that has seen 11 and moved its checkpoint past it then never sees
10. Here every append takes its positions with ``UPDATE log_head SET
position = position + n RETURNING position`` inside its transaction. The
row lock that UPDATE takes is held until commit, so the next appender gets
its positions only after this one is committed and visible: visibility
follows position order, and tailing ``position > checkpoint`` is gap-free.
The lock is held only for the index transaction; payload files are written
and fsynced before it starts, so the serialized section is a few small
INSERTs. SQLite has a single writer anyway (``BEGIN IMMEDIATE``).
"""

from __future__ import annotations

import time
from typing import Any, Collection, Iterator, Mapping, Sequence

from sqlalchemy import Engine, and_, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError, OperationalError

from trajstore.errors import StoreUnavailable
from trajstore.log.base import EventLog, StaleState, TrajectoryWrite
from trajstore.schema import events, log_head, materializer_checkpoints, samples, segments, trajectories

_CHUNK = 500  # ids per IN (...) list


def _chunks(items: Sequence[Any], n: int = _CHUNK) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


class SqlEventLog(EventLog):
    """EventLog over a write engine and a read engine (they may be the same)."""

    def __init__(self, write_engine: Engine, read_engine: Engine) -> None:
        self.write_engine = write_engine
        self.read_engine = read_engine

    # -- appending ---------------------------------------------------------
    def load_trajectories(self, trajectory_ids: Collection[str]) -> dict[str, dict[str, Any]]:
        with self._read() as conn:
            return _load_trajectories(conn, trajectory_ids)

    def lookup_identities(self, identities: Collection[str]) -> dict[str, bytes]:
        with self._read() as conn:
            return _lookup_identities(conn, identities)

    def load_append_state(self, identities: Collection[str], trajectory_ids: Collection[str]
                          ) -> tuple[dict[str, bytes], dict[str, dict[str, Any]]]:
        with self._read() as conn:  # one transaction, one connection checkout
            return _lookup_identities(conn, identities), _load_trajectories(conn, trajectory_ids)

    def commit_append(
        self,
        event_rows: Sequence[dict[str, Any]],
        trajectory_writes: Sequence[TrajectoryWrite],
        segment_row: Mapping[str, Any] | None,
    ) -> list[int]:
        n = len(event_rows)
        if n == 0:
            return []
        try:
            with self._write() as conn:
                last = conn.execute(
                    update(log_head).where(log_head.c.id == 1)
                    .values(position=log_head.c.position + n).returning(log_head.c.position)
                ).scalar_one()
                positions = list(range(last - n + 1, last + 1))
                rows = [dict(r, position=p) for r, p in zip(event_rows, positions)]
                self._write_trajectories(conn, trajectory_writes, rows)
                if segment_row is not None:
                    conn.execute(insert(segments), [dict(segment_row)])
                conn.execute(insert(events), rows)
        except IntegrityError as e:
            raise StaleState(str(e.orig)) from None
        return positions

    def _write_trajectories(self, conn, writes: Sequence[TrajectoryWrite], rows: list[dict[str, Any]]) -> None:
        marks: dict[str, dict[str, int]] = {}
        for r in rows:
            if r["type"] == "trajectory_started":
                marks.setdefault(r["trajectory_id"], {})["started_position"] = r["position"]
            elif r["type"] == "trajectory_finished":
                marks.setdefault(r["trajectory_id"], {})["finished_position"] = r["position"]
        for w in writes:
            row = dict(w.row, **marks.get(w.row["trajectory_id"], {}))
            if w.expected_version is None:
                conn.execute(insert(trajectories), [row])
                continue
            res = conn.execute(
                update(trajectories)
                .where(trajectories.c.trajectory_id == row["trajectory_id"])
                .where(trajectories.c.version == w.expected_version)
                .values(**{k: v for k, v in row.items() if k != "trajectory_id"})
            )
            if res.rowcount != 1:
                raise StaleState(f"trajectory {row['trajectory_id']!r} changed concurrently")

    # -- reading -----------------------------------------------------------
    def head_position(self) -> int:
        with self._read() as conn:
            return int(conn.execute(select(log_head.c.position).where(log_head.c.id == 1)).scalar_one())

    def read_events(self, *, after_position: int, limit: int, types: Collection[str] | None = None) -> list[dict[str, Any]]:
        q = select(events).where(events.c.position > after_position)
        if types:
            q = q.where(events.c.type.in_(list(types)))
        q = q.order_by(events.c.position).limit(limit)
        with self._read() as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    def count_events(self, *, after_position: int, types: Collection[str] | None = None) -> int:
        q = select(func.count()).select_from(events).where(events.c.position > after_position)
        if types:
            q = q.where(events.c.type.in_(list(types)))
        with self._read() as conn:
            return int(conn.execute(q).scalar_one())

    def trajectory_events(self, trajectory_ids: Collection[str]) -> dict[str, list[dict[str, Any]]]:
        ids = sorted(set(trajectory_ids))
        out: dict[str, list[dict[str, Any]]] = {t: [] for t in ids}
        with self._read() as conn:
            for part in _chunks(ids):
                q = select(events).where(events.c.trajectory_id.in_(part)).order_by(events.c.position)
                for r in conn.execute(q):
                    out[r.trajectory_id].append(dict(r._mapping))
        return out

    def counts(self) -> dict[str, Any]:
        with self._read() as conn:
            by_status = dict(conn.execute(select(trajectories.c.status, func.count()).group_by(trajectories.c.status)).all())
            by_type = dict(conn.execute(select(events.c.type, func.count()).group_by(events.c.type)).all())
            by_version = conn.execute(
                select(events.c.model_version, func.count(), func.sum(events.c.output_len))
                .where(events.c.type == "generation").group_by(events.c.model_version)
                .order_by(events.c.model_version)
            ).all()
            n_samples = conn.execute(select(func.count()).select_from(samples)).scalar_one()
            head = conn.execute(select(log_head.c.position)).scalar_one()
        return {
            "head_position": int(head),
            "trajectories_by_status": {k: int(v) for k, v in by_status.items()},
            "events_by_type": {k: int(v) for k, v in by_type.items()},
            "generations_by_model_version": [
                {"model_version": v, "generations": int(c), "output_tokens": int(t or 0)} for v, c, t in by_version
            ],
            "samples": int(n_samples),
        }

    def referenced_segments(self) -> set[str]:
        with self._read() as conn:
            return set(conn.execute(select(segments.c.name)).scalars())

    # -- samples -----------------------------------------------------------
    def load_checkpoint(self, shard: str) -> dict[str, Any] | None:
        with self._read() as conn:
            row = conn.execute(select(materializer_checkpoints).where(materializer_checkpoints.c.shard == shard)).first()
        return dict(row._mapping) if row else None

    def commit_samples(
        self,
        shard: str,
        sample_rows: Sequence[dict[str, Any]],
        segment_row: Mapping[str, Any] | None,
        checkpoint: Mapping[str, Any],
        expected_position: int,
    ) -> None:
        cp = dict(checkpoint, shard=shard, updated_at=time.time())
        try:
            with self._write() as conn:
                current = conn.execute(
                    select(materializer_checkpoints.c.position).where(materializer_checkpoints.c.shard == shard)
                ).scalar_one_or_none()
                if (current or 0) != expected_position:
                    raise StaleState(f"shard {shard!r} checkpoint moved to {current}")
                if current is None:
                    conn.execute(insert(materializer_checkpoints), [cp])
                else:
                    conn.execute(update(materializer_checkpoints)
                                 .where(materializer_checkpoints.c.shard == shard).values(**cp))
                if segment_row is not None:
                    conn.execute(insert(segments), [dict(segment_row)])
                if sample_rows:
                    conn.execute(insert(samples), list(sample_rows))
        except IntegrityError as e:
            raise StaleState(str(e.orig)) from None

    def iter_sample_rows(self, *, where: Mapping[str, Any], after: tuple[int, int] | None,
                         batch_size: int) -> Iterator[list[dict[str, Any]]]:
        conds = _sample_filters(where)
        cursor = after
        while True:
            q = select(samples).where(*conds)
            if cursor is not None:
                fp, si = cursor
                q = q.where(or_(samples.c.finished_position > fp,
                                and_(samples.c.finished_position == fp, samples.c.sample_index > si)))
            q = q.order_by(samples.c.finished_position, samples.c.sample_index).limit(batch_size)
            with self._read() as conn:
                rows = [dict(r._mapping) for r in conn.execute(q)]
            if not rows:
                return
            yield rows
            cursor = (rows[-1]["finished_position"], rows[-1]["sample_index"])

    def close(self) -> None:
        self.write_engine.dispose()
        if self.read_engine is not self.write_engine:
            self.read_engine.dispose()

    # -- connections -------------------------------------------------------
    def _read(self):
        return _translated(self.read_engine)

    def _write(self):
        return _translated(self.write_engine)


def _load_trajectories(conn, trajectory_ids: Collection[str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for part in _chunks(sorted(set(trajectory_ids))):
        for row in conn.execute(select(trajectories).where(trajectories.c.trajectory_id.in_(part))):
            out[row.trajectory_id] = dict(row._mapping)
    return out


def _lookup_identities(conn, identities: Collection[str]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for part in _chunks(sorted(set(identities))):
        q = select(events.c.identity, events.c.content_hash).where(events.c.identity.in_(part))
        out.update({r.identity: bytes(r.content_hash) for r in conn.execute(q)})
    return out


def _sample_filters(where: Mapping[str, Any]) -> list[Any]:
    c = samples.c
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


class _translated:
    """engine.begin() that turns 'cannot reach the database' into StoreUnavailable."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ctx = None

    def __enter__(self):
        try:
            self.ctx = self.engine.begin()
            return self.ctx.__enter__()
        except OperationalError as e:
            raise StoreUnavailable(f"cannot reach the database: {_one_line(e)}") from None

    def __exit__(self, *exc):
        try:
            return self.ctx.__exit__(*exc)
        except OperationalError as e:
            raise StoreUnavailable(f"database error at commit: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    msg = str(getattr(e, "orig", e)).strip().splitlines()
    return msg[0] if msg else type(e).__name__


__all__ = ["SqlEventLog"]
