"""``EventLog`` on SQLAlchemy: the log index of SQLite and PostgreSQL.

The append is one driver transaction (``Database.transaction(raw=True)``):
the segment row, positions (``SqlDialect.positions``; why the tail is bounded
on PostgreSQL: ``_dialect``'s module doc), the trajectory rows guarded by
their revision, the events, and the version-label rows and release events.
Reads and the rarer transactions are SQLAlchemy Core; the materializer's
reads are the dialect's driver statements. Every error leaves through the one
boundary (``_errors``), see ``_transaction``.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Collection, Mapping, Sequence

from sqlalchemy import Connection, Engine, delete, func, insert, or_, select, text, update

from trajstore.log._aggregates import write_event_aggregates
from trajstore.log._lineage import (annotation_rows, lineage_state, pipelined, recorded_keys, send_lineage_state,
                                    standing_attempt, step_samples, write_lineage, write_unread_steps)
from trajstore.log._ledger import load_ledger, run_groups, run_members, write_ledger
from trajstore.log._dialect import FOLD_EVENT_COLUMNS, FOLD_TRAJECTORY_COLUMNS, SERVER_MARK, SqlDialect, chunks
from trajstore.log._segments import named, named_clause, repoint, retire_emptied
from trajstore.log._transaction import Database, Later
from trajstore.log.base import RELEASED, EventLog, Repoint, StaleState, TrajectoryWrite
from trajstore.schema import events, segments, trajectories, unresolved_labels, version_labels

__all__ = ["RELEASED", "SAFE_WAIT_S", "SqlEventLog"]

SAFE_WAIT_S = 0.25  # how long safe_position waits for appends in flight before using its last bound


class SqlEventLog(EventLog):
    """The log index over a write engine and a read engine (they may be the same)."""

    def __init__(self, write_engine: Engine, read_engine: Engine, db: Database | None = None) -> None:
        self.db = db or Database(write_engine, read_engine)
        self.write_engine = write_engine
        self.read_engine = read_engine
        self._safe = 0  # the highest tail bound found so far (safe_position)

    # -- appending ---------------------------------------------------------
    def load_trajectories(self, trajectory_ids: Collection[str]) -> dict[str, dict[str, Any]]:
        return self.db.reading_cursor("loading trajectories", lambda cur, d: d.load_trajectories(cur, trajectory_ids))

    def lookup_identities(self, identities: Collection[str]) -> dict[str, bytes]:
        return self.db.reading_cursor("looking up event identities", lambda cur, d: d.lookup_identities(cur, identities))

    def load_labels(self, labels: Collection[str]) -> dict[str, int]:
        if not labels:
            return {}
        return self.db.reading_cursor("reading the version label map", lambda cur, d: d.load_labels(cur, labels))

    def pending_labels(self, trajectory_ids: Collection[str]) -> dict[str, dict[str, tuple[int, int] | None]]:
        ids = sorted(set(trajectory_ids))
        out: dict[str, dict[str, tuple[int, int] | None]] = {}
        u, v = unresolved_labels, version_labels
        with self.db.reading("reading unresolved version labels") as conn:
            for part in chunks(ids):
                q = (select(u.c.trajectory_id, u.c.label, v.c.model_version, v.c.position)
                     .select_from(u.outerjoin(v, v.c.label == u.c.label)).where(u.c.trajectory_id.in_(part)))
                for tid, label, mv, pos in conn.execute(q):
                    out.setdefault(tid, {})[label] = None if pos is None else (int(mv), int(pos))
        return out

    def held_generations(self, trajectory_ids: Collection[str]) -> dict[str, set[int]]:
        ids = sorted(set(trajectory_ids))
        out: dict[str, set[int]] = {}
        u = unresolved_labels
        with self.db.reading("reading held generations") as conn:
            for part in chunks(ids):
                q = select(u.c.trajectory_id, u.c.event_position).where(u.c.trajectory_id.in_(part))
                for tid, pos in conn.execute(q):
                    out.setdefault(tid, set()).add(int(pos))
        return out
    def lineage_keys(self, keys: Collection[tuple]) -> dict[tuple, str]:
        if not keys:
            return {}
        with self.db.reading("reading recorded lineage keys") as conn:
            return recorded_keys(conn, keys)

    def lineage_state(self, keys: Collection[tuple], wanted: Mapping[str | None, Collection[tuple[str, int]]]
                      ) -> tuple[dict[tuple, str], dict[str | None, dict[tuple[str, int], dict[str, Any]]]]:
        return self.db.reading_cursor("reading the lineage a step names",
                                      lambda cur, d: lineage_state(cur, d, keys, wanted))

    def standing_attempt(self, run: str, step: int, rank: int) -> int | None:
        with self.db.reading("reading a step's attempts") as conn:
            return standing_attempt(conn, run, step, rank)

    def step_samples(self, *, run: str, step: int) -> list[dict[str, Any]]:
        with self.db.reading("reading a step's samples") as conn:
            return step_samples(conn, run, step)

    def annotation_rows(self, *, run: str, step: int | None = None,
                        trajectory_id: str | None = None) -> list[dict[str, Any]]:
        with self.db.reading("reading sample annotations") as conn:
            return annotation_rows(conn, run, step, trajectory_id)

    def load_ledger(self, group_ids: Collection[str], prompts: Collection[tuple[str, str, int]],
                    check_plain: Collection[str] = ()
                    ) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str, int], str], set[str]]:
        with self.db.reading("reading the rollout ledger") as conn:
            return load_ledger(conn, group_ids, prompts, check_plain)

    def rollout_rows(self, run: str) -> tuple[list[tuple], list[tuple[str, str, str, int]]]:
        with self.db.reading("reading the rollout ledger") as conn:  # one read transaction: one snapshot
            return run_groups(conn, run), run_members(conn, run)

    def load_append_state(self, identities: Collection[str], trajectory_ids: Collection[str], *,
                          lineage: Any = None) -> tuple[dict[str, bytes], dict[str, dict[str, Any]]]:
        # one connection checkout (with the lineage the batch names, if any); on PostgreSQL
        # one statement, outside a transaction (``SqlDialect.load_append_state``)
        def body(cur: Any, d: SqlDialect) -> tuple[dict[str, bytes], dict[str, dict[str, Any]]]:
            if lineage is None:
                return d.load_append_state(cur, identities, trajectory_ids)
            with pipelined(cur, d):  # PostgreSQL: the lineage statements go out with the identities'
                collect = send_lineage_state(cur, d, lineage.keys, lineage.wanted)
                stored = d.lookup_identities(cur, identities)
            lineage.result = collect()
            # lineage events are store-wide (trajectory id ""), which no trajectory row has
            return stored, d.load_trajectories(cur, [tid for tid in trajectory_ids if tid])

        return self.db.reading_cursor("loading the append state", body)

    def commit_append(
        self,
        event_rows: Sequence[dict[str, Any]],
        trajectory_writes: Sequence[TrajectoryWrite],
        segment_row: Mapping[str, Any] | None,
        *,
        before_commit: Callable[[], None] | None = None,
        more_segments: Sequence[Mapping[str, Any]] = (),
    ) -> list[int]:
        n = len(event_rows)
        if n == 0:
            if before_commit is not None:
                before_commit()
            return []

        def in_one_round_trip(conn: Any, d: SqlDialect) -> list[dict[str, Any]]:
            # PostgreSQL, a batch of plain calls (no label rows, no lineage): the positions
            # are taken by the events' INSERT itself and read back once every write is sent
            # (one round trip); the trajectories' started/finished positions are read by
            # the server from the rows just inserted.
            if segment_row is not None:
                d.insert_rows(conn, segments, [segment_row, *more_segments])
            if before_commit is not None:
                before_commit()
            d.order_label_appends(conn, event_rows)
            taking = d.insert_events_taking_positions(conn, event_rows)
            _write_trajectories(conn, d, trajectory_writes, event_rows, server_marks=True)
            write_ledger(conn, d, event_rows, time.time())  # trajectories finished in ledger groups (no positions)
            write_event_aggregates(conn, d, event_rows)  # the run view's counts (no positions needed)
            return Later(lambda: _positions_taken([dict(r, position=p) for r, p in zip(event_rows, taking())]))

        def body(conn: Any, d: SqlDialect) -> list[dict[str, Any]]:  # conn: a driver cursor
            if d.pipelined_writes and not any(r.get("lineage") is not None or r.get("version_label") is not None
                                              or r.get("unresolved_labels") or _ledger_reads_positions(r)
                                              for r in event_rows):
                return in_one_round_trip(conn, d)
            # ``before_commit`` (the append's payload fsync, running meanwhile) is waited
            # for where it holds no lock other appenders need: SQLite's write lock is
            # taken at BEGIN IMMEDIATE whatever follows, so there it overlaps every
            # statement; on PostgreSQL it comes before the log_head row lock (held to
            # COMMIT, it orders every appender), overlapping only what precedes it.
            if segment_row is not None:
                d.insert_rows(conn, segments, [segment_row, *more_segments])
            if before_commit is not None and not d.single_writer:
                before_commit()
            d.order_label_appends(conn, event_rows)
            taken = d.positions(conn, n)
            rows = _positions_taken([dict(r, position=p) for r, p in zip(event_rows, taken)])
            _write_trajectories(conn, d, trajectory_writes, rows)
            d.insert_rows(conn, events, rows)
            write_lineage(conn, d, rows)
            write_ledger(conn, d, rows, time.time())  # the rollout ledger's groups
            write_event_aggregates(conn, d, rows)  # the run view's counts, in the same transaction
            rows += _write_labels(conn, d, rows)
            if before_commit is not None and d.single_writer:
                before_commit()
            return rows

        rows = self.db.transaction("appending events", body, landed=_events_landed, raw=True)
        return [r["position"] for r in rows]

    checks_steps = True

    def commit_unread_steps(self, event_rows: Sequence[dict[str, Any]]) -> list[int]:
        # BEGIN, the events (positions taken by their INSERT on PostgreSQL), each step's two
        # checked statements (``write_unread_steps``) and COMMIT: on PostgreSQL one pipeline,
        # one round trip; on SQLite one write transaction, no read before it
        def body(cur: Any, d: SqlDialect) -> Any:
            if d.pipelined_writes:
                taking = d.insert_events_taking_positions(cur, event_rows)
                write_unread_steps(cur, d, event_rows)
                return Later(taking)
            rows = [dict(r, position=p) for r, p in zip(event_rows, d.positions(cur, len(event_rows)))]
            d.insert_rows(cur, events, rows)
            write_unread_steps(cur, d, rows)
            return [r["position"] for r in rows]

        return self.db.checked("appending events", body, lambda conn: _identities_landed(conn, event_rows))

    # -- reading -----------------------------------------------------------
    def head_position(self) -> int:
        with self.db.reading("reading the log head") as conn:
            return self.db.dialect.head(conn)

    def safe_position(self, wait_s: float = SAFE_WAIT_S) -> int | None:
        """The highest position below which no append can still commit (None:
        no bound, the backend commits in position order). See ``_dialect``'s module doc."""
        d = self.db.dialect
        if d.single_writer:
            return None
        with self.db.reading("bounding the log's tail") as conn:
            h = d.settled_head(conn, wait_s)
        if h is None:
            return self._safe  # an earlier bound, still safe
        self._safe = max(self._safe, h)
        return h

    def read_events(self, *, after_position: int, limit: int, types: Collection[str] | None = None) -> list[dict[str, Any]]:
        q = select(events).where(events.c.position > after_position)
        if types:
            q = q.where(events.c.type.in_(list(types)))
        q = q.order_by(events.c.position).limit(limit)
        with self.db.reading("reading events") as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    def count_events(self, *, after_position: int, types: Collection[str] | None = None) -> int:
        q = select(func.count()).select_from(events).where(events.c.position > after_position)
        if types:
            q = q.where(events.c.type.in_(list(types)))
        with self.db.reading("counting events") as conn:
            return int(conn.execute(q).scalar_one())

    def trajectory_events(self, trajectory_ids: Collection[str]) -> dict[str, list[dict[str, Any]]]:
        ids = sorted(set(trajectory_ids))
        out: dict[str, list[dict[str, Any]]] = {t: [] for t in ids}
        with self.db.reading("reading trajectory events") as conn:
            for part in chunks(ids):
                q = select(events).where(events.c.trajectory_id.in_(part)).order_by(events.c.position)
                for r in conn.execute(q):
                    out[r.trajectory_id].append(dict(r._mapping))
        return out

    def counts(self) -> dict[str, Any]:
        with self.db.reading("counting the log") as conn:
            by_status = dict(conn.execute(select(trajectories.c.status, func.count()).group_by(trajectories.c.status)).all())
            by_type = dict(conn.execute(select(events.c.type, func.count()).group_by(events.c.type)).all())
            by_version = conn.execute(
                select(events.c.model_version, func.count(), func.sum(events.c.output_len))
                .where(events.c.type == "generation").group_by(events.c.model_version)
                .order_by(events.c.model_version)
            ).all()
            head = self.db.dialect.head(conn)
            resent, drifted = conn.execute(select(func.sum(events.c.route_rows_resent),
                                                  func.sum(events.c.route_rows_drifted))).one()
            u, v, t = unresolved_labels, version_labels, trajectories
            waiting = conn.execute(
                select(u.c.label, func.count(func.distinct(u.c.trajectory_id)),
                       func.count(func.distinct(t.c.trajectory_id)).filter(t.c.status != "running"))
                .select_from(u.join(t, t.c.trajectory_id == u.c.trajectory_id)
                             .outerjoin(v, v.c.label == u.c.label))
                .where(v.c.label.is_(None)).group_by(u.c.label).order_by(u.c.label)
            ).all()
        return {
            "head_position": int(head),
            "trajectories_by_status": {k: int(v) for k, v in by_status.items()},
            "events_by_type": {k: int(v) for k, v in by_type.items()},
            "generations_by_model_version": [
                {"model_version": v, "generations": int(c), "output_tokens": int(t or 0)} for v, c, t in by_version
            ],
            "route_drift": {"route_rows_resent": int(resent or 0), "route_rows_drifted": int(drifted or 0)},
            # finished trajectories wait here (held back from materialization) until the label is mapped
            "unresolved_version_labels": [
                {"label": label, "trajectories": int(n), "held_back_trajectories": int(h)} for label, n, h in waiting
            ],
        }

    def referenced_segments(self) -> set[str]:
        with self.db.reading("listing segments") as conn:
            return named(conn) | set(conn.execute(select(segments.c.name).where(segments.c.retired_at.is_(None)))
                                     .scalars())

    def retire_unreferenced(self, now: float) -> list[str]:
        def body(conn: Connection, d: SqlDialect) -> list[str]:
            live = conn.execute(select(segments.c.name).where(segments.c.retired_at.is_(None))).scalars().all()
            gone = sorted(set(live) - named(conn))
            for part in chunks(gone):
                conn.execute(update(segments).where(segments.c.name.in_(part), segments.c.retired_at.is_(None),
                                                    ~named_clause())
                             .values(retired_at=text(d.now_sql)))
            return gone

        return self.db.transaction("retiring unreferenced segments", body)

    def database_time(self) -> float:
        """The database's clock (seconds since the epoch): what retirement times are stamped with."""
        with self.db.reading("reading the database's clock") as conn:
            return float(conn.exec_driver_sql(f"SELECT {self.db.dialect.now_sql}").scalar_one())

    def segments_in_use(self, retired_before: float) -> set[str]:
        with self.db.reading("listing segments in use") as conn:
            recent = conn.execute(select(segments.c.name).where(
                or_(segments.c.retired_at.is_(None), segments.c.retired_at > retired_before))).scalars()
            return named(conn) | set(recent)

    def forget_segments(self, names: Collection[str]) -> int:
        names = sorted(set(names))

        def body(conn: Connection, d: SqlDialect) -> int:
            n = 0
            for part in chunks(names):
                n += conn.execute(delete(segments).where(segments.c.name.in_(part), segments.c.retired_at.is_not(None),
                                                         ~named_clause())).rowcount
            return n

        return self.db.transaction("forgetting deleted segments", body) if names else 0

    def shrink_journal(self) -> None:
        self.db.dialect.shrink_journal(self.write_engine)  # type: ignore[attr-defined]

    def compaction_candidates(self, *, max_bytes: int, limit_bytes: int) -> list[dict[str, Any]]:
        q = (select(segments).where(segments.c.kind == "events", segments.c.retired_at.is_(None),
                                    segments.c.num_bytes < max_bytes)
             .order_by(segments.c.created_at, segments.c.name))
        out, total = [], 0
        with self.db.reading("listing segments to compact") as conn:
            for r in conn.execute(q):
                out.append(dict(r._mapping))
                total += int(r.num_bytes)
                if total >= limit_bytes:
                    break
        return out

    def live_locators(self, segment_names: Collection[str]) -> list[dict[str, Any]]:
        e = events.c
        out: list[dict[str, Any]] = []
        with self.db.reading("reading event locators") as conn:
            for part in chunks(sorted(set(segment_names))):
                q = select(e.position, e.trajectory_id, e.segment, e.segment_row).where(
                    e.segment.in_(part), e.segment_kind.is_(None))
                out.extend(dict(r._mapping) for r in conn.execute(q))
        return sorted(out, key=lambda r: r["position"])

    def commit_compaction(self, segment_row: Mapping[str, Any], moves: Sequence[Repoint]) -> None:
        def body(conn: Connection, d: SqlDialect) -> None:
            conn.execute(insert(segments), [dict(segment_row)])
            repoint(conn, d, moves, guarded=True)
            retire_emptied(conn, d, {m.old_segment for m in moves if m.old_segment})

        def landed(conn: Connection, _: None) -> bool:
            return conn.execute(select(segments.c.name).where(segments.c.name == segment_row["name"])).first() is not None

        self.db.transaction(f"compacting {len(moves)} events into {segment_row['name']}", body, landed=landed)

    # -- the materializer's reads: driver SQL, only the columns it uses ------
    def finished_after(self, after_position: int, limit: int) -> list[dict[str, Any]]:
        safe = self.safe_position()  # before the read: what it allows has committed by then
        if safe is not None and safe <= after_position:
            return []
        with self.db.reading("reading finished trajectories") as conn:
            rows = self.db.dialect.finished_after(conn, after_position, limit, safe)
        return [{"position": p, "trajectory_id": tid, "status": st, "seq_len": n} for p, tid, st, n in rows]

    def finished_ids_after(self, after_position: int) -> list[str]:
        with self.db.reading("reading finished trajectories") as conn:
            q = select(events.c.trajectory_id).where(events.c.type.in_(["trajectory_finished", RELEASED])) \
                .where(events.c.position > int(after_position)).order_by(events.c.position)
            return list(conn.execute(q).scalars())

    def finished_status(self, trajectory_ids: Collection[str]) -> dict[str, str]:
        """The status of each trajectory's ``trajectory_finished`` event (absent: not finished)."""
        out: dict[str, str] = {}
        with self.db.reading("reading finished trajectories") as conn:
            for part in chunks(sorted(set(trajectory_ids))):
                q = select(events.c.trajectory_id, events.c.status).where(events.c.type == "trajectory_finished") \
                    .where(events.c.trajectory_id.in_(list(part)))
                out.update({tid: st for tid, st in conn.execute(q)})
        return out

    def idle_running(self, idle_since: float, limit: int) -> list[str]:
        with self.db.reading("reading idle running trajectories") as conn:
            q = select(trajectories.c.trajectory_id).where(trajectories.c.status == "running") \
                .where(trajectories.c.updated_at < float(idle_since)) \
                .order_by(trajectories.c.updated_at, trajectories.c.trajectory_id).limit(int(limit))
            return list(conn.execute(q).scalars())

    def fold_inputs(self, trajectory_ids: Collection[str]
                    ) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]]:
        ids = sorted(set(trajectory_ids))
        trajs: dict[str, dict[str, Any]] = {}
        out: dict[str, list[dict[str, Any]]] = {t: [] for t in ids}
        with self.db.reading("reading the trajectories to fold") as conn:
            for part in chunks(ids):
                traj_rows, event_rows = self.db.dialect.fold_inputs(conn, part)
                for row in traj_rows:
                    trajs[row[0]] = dict(zip(FOLD_TRAJECTORY_COLUMNS, row))
                for row in event_rows:
                    out[row[1]].append(dict(zip(FOLD_EVENT_COLUMNS, row)))
        return trajs, out

    def close(self) -> None:
        self.db.close()


def _write_labels(conn: Any, d: SqlDialect, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The label rows of an append (after its events, under the log_head lock):
    ``unresolved_labels`` of its generations, ``version_labels`` of its
    version_label events, and a ``trajectory_released`` event for each finished
    trajectory whose last missing label this append maps. Returns those events.

    The materializer decides from positions alone: a trajectory finished at
    ``F`` folds there iff every label it waits for was mapped before ``F``;
    else it is held, and the version_label that maps its last missing label
    (after ``F``, so this append saw it finished) adds the release event it
    folds at. Exactly one of the two happens."""
    pending = [{"event_position": r["position"], "label": label, "trajectory_id": r["trajectory_id"]}
               for r in rows for label in (r.get("unresolved_labels") or ())]
    if pending:
        d.insert_rows(conn, unresolved_labels, pending)
    now = time.time()
    mapped = [{"label": r["version_label"], "model_version": r["model_version"], "position": r["position"],
               "created_at": now} for r in rows if r.get("version_label") is not None]
    if not mapped:
        return []
    d.insert_rows(conn, version_labels, mapped)
    first = min(m["position"] for m in mapped)
    waiting: dict[str, list[Any]] = {}
    for tid, pos, finished_at, status in d.labels_of_waiting(conn, [m["label"] for m in mapped]):
        waiting.setdefault(tid, [finished_at, status, []])[2].append(pos)
    released = sorted(tid for tid, (finished_at, _, positions) in waiting.items()
                      if finished_at is not None and None not in positions
                      and max(positions) > finished_at and max(positions) >= first)
    if not released:
        return []
    out = []
    for tid, position in zip(released, d.positions(conn, len(released))):
        row: dict[str, Any] = dict.fromkeys(c.name for c in events.columns)
        row.update(position=position, trajectory_id=tid, type=RELEASED, status=waiting[tid][1],
                   content_hash=b"\x00", created_at=now)
        out.append(row)
    d.insert_rows(conn, events, out)
    return out


def _ledger_reads_positions(row: Mapping[str, Any]) -> bool:
    """Does the row's ledger change need its position (a group started or dropped; a finish or a
    guard does not)?"""
    change = row.get("ledger")
    return change is not None and change.kind not in ("finish", "plain")


def _positions_taken(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The append's event rows once their positions are taken, its transaction still open
    (the seam tests hold an append at, to commit others past it)."""
    return rows


def _write_trajectories(conn: Any, d: SqlDialect, writes: Sequence[TrajectoryWrite],
                        rows: Sequence[Mapping[str, Any]], *, server_marks: bool = False) -> None:
    """Insert new trajectory rows, update existing ones guarded by their revision
    (``StaleState`` when another writer moved one), in trajectory id order.
    ``server_marks``: the rows have no positions yet; the started and finished
    positions are read by the server from the batch's events (``SERVER_MARK``)."""
    marks: dict[str, dict[str, Any]] = {}
    for r in rows:
        value = SERVER_MARK if server_marks else r.get("position")
        if r["type"] == "trajectory_started":
            marks.setdefault(r["trajectory_id"], {})["started_position"] = value
        elif r["type"] == "trajectory_finished":
            marks.setdefault(r["trajectory_id"], {})["finished_position"] = value
    inserts: list[dict[str, Any]] = []
    updates: list[tuple[dict[str, Any], int]] = []
    for w in sorted(writes, key=lambda w: w.row["trajectory_id"]):
        row = dict(w.row, **marks.get(w.row["trajectory_id"], {}))
        if w.expected_revision is None:
            inserts.append(row)
        else:
            updates.append((row, w.expected_revision))
    if inserts:
        d.insert_rows(conn, trajectories, inserts)
    if updates:
        n = d.update_trajectories(conn, updates)
        if n != len(updates):
            raise StaleState(f"{len(updates) - n} of {len(updates)} trajectories changed concurrently "
                             f"({', '.join(repr(r['trajectory_id']) for r, _ in updates[:3])}...)")


def _identities_landed(conn: Connection, rows: Sequence[Mapping[str, Any]]) -> list[int] | None:
    """The positions of ``rows`` when every one is stored under its identity with its
    content (None: not all are; positions are not known before the commit answers)."""
    want = {r["identity"]: bytes(r["content_hash"]) for r in rows}
    got: dict[str, tuple[int, bytes]] = {}
    for part in chunks(sorted(want)):
        q = select(events.c.identity, events.c.position, events.c.content_hash).where(events.c.identity.in_(part))
        got.update({r.identity: (int(r.position), bytes(r.content_hash)) for r in conn.execute(q)})
    if any(got.get(i, (0, None))[1] != h for i, h in want.items()):
        return None
    return [got[r["identity"]][0] for r in rows]


def _events_landed(conn: Connection, rows: list[dict[str, Any]]) -> bool:
    """Are exactly these rows stored at their positions (same trajectory, type and content)?"""
    want = {r["position"]: (r["trajectory_id"], r["type"], bytes(r["content_hash"])) for r in rows}
    got: dict[int, tuple[str, str, bytes]] = {}
    for part in chunks(sorted(want)):
        q = select(events.c.position, events.c.trajectory_id, events.c.type, events.c.content_hash) \
            .where(events.c.position.in_(part))
        got.update({r.position: (r.trajectory_id, r.type, bytes(r.content_hash)) for r in conn.execute(q)})
    return got == want
