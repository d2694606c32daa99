"""The lineage tables of the log index (docs/reference.md "Training lineage"): written in the
append's transaction from the facts admission made (``trajstore.lineage._admission``),
and the reads admission and the lineage readers need."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

from sqlalchemy import Connection, String, func, select

from trajstore.errors import ValidationError
from trajstore.log._dialect import SqlDialect, execute
from trajstore.log.base import ChecksFailed
from trajstore.schema import (events, lineage_annotation_versions, lineage_annotations, lineage_step_samples, lineage_steps,
                              projection_samples, projections, samples)

__all__ = ["write_lineage", "write_unread_steps", "STEP_ROW_COLUMNS", "recorded_keys", "standing_attempt", "annotation_rows", "step_samples", "lineage_state",
           "send_lineage_state", "pipelined", "SAMPLE_FACTS", "STEP_SAMPLE_COLUMNS"]

SAMPLE_FACTS = ("trajectory_id", "sample_index", "prompt_len", "response_len", "min_model_version",
                "max_model_version", "segment", "segment_row")
"""The sample columns admission checks a lineage event against."""

STEP_SAMPLE_COLUMNS = ("run", "step", "rank", "attempt", "trajectory_id", "sample_index", "ordinal",
                       "response_len", "min_model_version", "max_model_version")
"""The columns of a step's consumption rows (``_lineage.LineageFact.sample_rows`` tuples), in order."""


def write_lineage(conn: Any, d: SqlDialect, rows: Sequence[dict[str, Any]]) -> None:
    """The lineage rows of an append's ``train_step`` and ``sample_annotation``
    events (their ``lineage`` fact), at the events' positions. The keyed tables
    first: a key another writer took meanwhile fails there (a lost race)."""
    steps, samples, notes, versions = [], [], [], []
    for r in rows:
        fact = r.get("lineage")
        if fact is None:
            continue
        if fact.step_row is not None:
            steps.append(dict(fact.step_row, position=r["position"]))
            samples.extend(fact.sample_rows)
        if fact.annotation_row is not None:
            notes.append(dict(fact.annotation_row, position=r["position"], segment=r["segment"],
                              segment_row=r["segment_row"]))
            versions.extend(fact.version_rows)
    for table, part in ((lineage_steps, steps), (lineage_annotations, notes), (lineage_annotation_versions, versions)):
        if part:
            d.insert_rows(conn, table, part)
    stamp_projection_tokens(conn, d, [(r["run"], r["step"], r["rank"], r["attempt"]) for r in steps
                                      if r["projection"] is not None])
    if samples:
        # one executemany of ready tuples (ints and strings: no bind processing), in the
        # keyed tables' wake: a step's hundreds of rows cost one statement
        t = lineage_step_samples
        sql = d._cached(("insert lineage samples",), lambda: (
            f"INSERT INTO {d.table(t)} ({', '.join(d.col(t.c[n]) for n in STEP_SAMPLE_COLUMNS)}) "
            f"VALUES ({d.marks(len(STEP_SAMPLE_COLUMNS))})"))
        execute(conn, sql, samples)


STEP_ROW_COLUMNS = ("run", "step", "rank", "attempt", "world_size", "policy_version", "projection", "metrics",
                    "identity", "created_at")
"""The ``lineage_steps`` columns an unread step's row gives (``_lineage.unread_step_facts``);
the counts and the position are the database's."""


def write_unread_steps(cur: Any, d: SqlDialect, rows: Sequence[dict[str, Any]]) -> None:
    """The lineage rows of ``train_step`` events admitted without reading the store
    (``_lineage.unread_step_facts``), with the checks admission would have read
    for made by the statements themselves, two per step whatever its size:

    1. its consumption rows, ``INSERT ... SELECT`` of the step's sample keys (one
       array parameter) joined to the sample index of its projection: a sample
       that does not exist adds no row; the sample facts (response length,
       version range) are the rows' own;
    2. its ``lineage_steps`` row, ``INSERT ... SELECT`` from the consumption rows
       just written (their count and response tokens) and the event's position
       (by its identity), guarded: when fewer rows than the step's samples were
       found, PostgreSQL fails the statement (a division by zero, raised by the
       server: the transaction and the pipeline abort) and on SQLite it inserts
       nothing, which raises ``ChecksFailed`` here.

    A lineage key or identity already recorded fails on its primary or unique key.
    Whatever fails, the caller rolls the append back (``Database.checked``)."""
    pg = d.name == "postgresql"
    for r in rows:
        fact = r.get("lineage")
        if fact is None or fact.step_row is None:
            continue
        ev, row = fact.event, fact.step_row
        named = ev.projection is not None
        key = (ev.run, ev.step, ev.rank, ev.attempt)
        execute(cur, d._cached(("unread step samples", named), lambda: _unread_samples_sql(d, named)),
                (*key, *(([t for t, _ in ev.samples], [i for _, i in ev.samples]) if pg
                         else (json.dumps(ev.samples, separators=(",", ":")),)),
                 *((ev.projection,) if named else ())))
        execute(cur, d._cached(("unread step",), lambda: _unread_step_sql(d)),
                (*(row[c] for c in STEP_ROW_COLUMNS), row["identity"], *key, len(ev.samples)))
        if not pg and cur.rowcount != 1:
            raise ChecksFailed(f"train_step {key}: {len(ev.samples)} samples named, not all found")
        if named:
            stamp_projection_tokens(cur, d, [key])


def stamp_projection_tokens(conn: Any, d: SqlDialect, keys: Sequence[tuple]) -> None:
    """Give the steps ``keys`` (run, step, rank, attempt), just written from a named
    projection's samples, that projection's identity (``projections.token``) in the
    same transaction: what was trained is then named beyond the projection's name."""
    if not keys:
        return
    t, p = lineage_steps, projections
    sql = d._cached(("lineage projection token",), lambda: (
        f"UPDATE {d.table(t)} SET {d.col(t.c.projection_token)} = (SELECT {d.col(p.c.token)} FROM {d.table(p)} "
        f"WHERE {d.col(p.c.name)} = {d.table(t)}.{d.col(t.c.projection)}) "
        f"WHERE run = {d.p} AND step = {d.p} AND rank = {d.p} AND attempt = {d.p}"))
    execute(conn, sql, list(keys))


def _typed(d: SqlDialect, column: Any) -> str:
    """A parameter in a SELECT list feeding ``column``: on PostgreSQL cast to its type
    (a string to TEXT: a cast to VARCHAR(n) would cut a longer value that the INSERT's
    own assignment refuses)."""
    if d.name != "postgresql":
        return d.p
    kind = "TEXT" if isinstance(column.type, String) else column.type.compile(d.dialect)
    return f"CAST({d.p} AS {kind})"


def _unread_samples_sql(d: SqlDialect, named: bool) -> str:
    t, s = lineage_step_samples, (projection_samples if named else samples)
    cols = ", ".join(d.col(t.c[n]) for n in STEP_SAMPLE_COLUMNS)
    on_projection = f"s.projection = {d.p} AND " if named else ""
    if d.name == "postgresql":
        keys = "unnest(CAST(%s AS TEXT[]), CAST(%s AS INTEGER[])) WITH ORDINALITY AS k(tid, idx, ord)"
        tid, idx, ordinal = "k.tid", "k.idx", "k.ord - 1"
    else:  # one JSON array of [trajectory_id, sample_index] pairs (json_extract: any SQLite with JSON1)
        keys, ordinal = "json_each(?) AS k", "k.key"
        tid, idx = "json_extract(k.value, '$[0]')", "json_extract(k.value, '$[1]')"
    key = ", ".join(_typed(d, t.c[n]) for n in ("run", "step", "rank", "attempt"))
    return (f"INSERT INTO {d.table(t)} ({cols}) "
            f"SELECT {key}, s.trajectory_id, s.sample_index, {ordinal}, "
            f"s.response_len, s.min_model_version, s.max_model_version "
            f"FROM {keys} CROSS JOIN {d.table(s)} AS s "  # SQLite: the keys outside, a key lookup each
            f"WHERE {on_projection}s.trajectory_id = {tid} AND s.sample_index = {idx}")


def _unread_step_sql(d: SqlDialect) -> str:
    t, x = lineage_steps, lineage_step_samples
    given = ", ".join(_typed(d, t.c[n]) for n in STEP_ROW_COLUMNS)
    # PostgreSQL raises on 1 / 0 (the check fails the transaction); SQLite's 1 / 0 is NULL: no row
    return (f"INSERT INTO {d.table(t)} ({', '.join(d.col(t.c[n]) for n in STEP_ROW_COLUMNS)}, "
            f"{d.col(t.c.position)}, {d.col(t.c.num_samples)}, {d.col(t.c.num_response_tokens)}) "
            f"SELECT {given}, (SELECT {d.col(events.c.position)} FROM {d.table(events)} "
            f"WHERE {d.col(events.c.identity)} = {d.p}), c.n, c.tokens "
            f"FROM (SELECT COUNT(*) AS n, COALESCE(SUM(response_len), 0) AS tokens FROM {d.table(x)} "
            f"WHERE run = {d.p} AND step = {d.p} AND rank = {d.p} AND attempt = {d.p}) AS c "
            f"WHERE 1 / (CASE WHEN c.n = {d.p} THEN 1 ELSE 0 END) = 1")


def lineage_state(cur: Any, d: SqlDialect, keys: Collection[tuple],
                  wanted: Mapping[str | None, Collection[tuple[str, int]]]
                  ) -> tuple[dict[tuple, str], dict[str | None, dict[tuple[str, int], dict[str, Any]]]]:
    """What admitting an append's lineage events reads, in one read transaction on
    the driver cursor ``cur``: the identity recording each of ``keys`` (as
    ``recorded_keys``), and per projection (None: the default samples) the
    ``SAMPLE_FACTS`` rows of the ``wanted`` sample keys that exist. One statement
    per step (and annotation attempt) and one per projection, whatever the number
    of samples: the trajectory ids go as one array parameter (PostgreSQL ``= ANY``,
    SQLite ``json_each``), not as a list of markers. A named projection that does
    not exist raises ValidationError (``projection``)."""
    return send_lineage_state(cur, d, keys, wanted)()


def send_lineage_state(cur: Any, d: SqlDialect, keys: Collection[tuple],
                       wanted: Mapping[str | None, Collection[tuple[str, int]]]
                       ) -> Callable[[], tuple[dict[tuple, str], dict[str | None, dict[tuple[str, int], dict[str, Any]]]]]:
    """``lineage_state`` in two halves: every statement is sent now (each on a
    cursor of its own, fetching nothing), and the returned function reads the
    results. Inside a PostgreSQL pipeline (``pipelined``) the statements then go
    out with whatever the transaction sends next, in one round trip."""
    wanted_keys = set(keys)
    conn = cur.connection
    sent: list[tuple[str, tuple, Any]] = []  # (what, its key, its cursor)

    def send(what: str, key: tuple, sql: str, params: tuple) -> None:
        c = conn.cursor()
        c.execute(sql, params)
        sent.append((what, key, c))

    for run, step in sorted({k[1:3] for k in wanted_keys if k[0] == "train_step"}):
        send("steps", (run, step), d._cached(("lineage steps",), lambda: (
            f"SELECT rank, attempt, identity FROM {d.table(lineage_steps)} WHERE run = {d.p} AND step = {d.p}")),
            (run, step))
    for run, step, attempt in sorted({k[1:4] for k in wanted_keys if k[0] == "sample_annotation"}):
        send("annotations", (run, step, attempt), d._cached(("lineage annotations",), lambda: (
            f"SELECT trajectory_id, sample_index, identity FROM {d.table(lineage_annotations)} "
            f"WHERE run = {d.p} AND step = {d.p} AND attempt = {d.p}")), (run, step, attempt))
    wants: dict[str | None, set[tuple[str, int]]] = {}
    for projection, sample_keys in wanted.items():
        want = wants[projection] = set(sample_keys)
        ids = sorted({tid for tid, _ in want})
        if not ids:
            continue
        if projection is not None:
            send("projection", (projection,), d._cached(("projection exists",), lambda: (
                f"SELECT 1 FROM {d.table(projections)} WHERE name = {d.p}")), (projection,))
        table = samples if projection is None else projection_samples
        ids_param: Any = ids if d.name == "postgresql" else json.dumps(ids)
        sql = d._cached(("lineage sample facts", projection is None), lambda: (
            f"SELECT {', '.join(SAMPLE_FACTS)} FROM {d.table(table)} WHERE "
            + ("" if projection is None else f"projection = {d.p} AND ")
            + ("trajectory_id = ANY(%s)" if d.name == "postgresql"
               else "trajectory_id IN (SELECT value FROM json_each(?))")))
        send("samples", (projection,), sql, (ids_param,) if projection is None else (projection, ids_param))

    def collect() -> tuple[dict[tuple, str], dict[str | None, dict[tuple[str, int], dict[str, Any]]]]:
        recorded: dict[tuple, str] = {}
        found: dict[str | None, dict[tuple[str, int], dict[str, Any]]] = {p: {} for p in wants}
        try:
            for what, key, c in sent:
                rows = c.fetchall()
                if what == "steps":
                    for rank, attempt, identity in rows:
                        k = ("train_step", *key, int(rank), int(attempt))
                        if k in wanted_keys:
                            recorded[k] = identity
                elif what == "annotations":
                    for tid, index, identity in rows:
                        k = ("sample_annotation", *key, tid, int(index))
                        if k in wanted_keys:
                            recorded[k] = identity
                elif what == "projection":
                    if not rows:
                        raise ValidationError(f"no projection {key[0]!r} (trajstore projection list)",
                                              rule="projection")
                else:
                    want, out = wants[key[0]], found[key[0]]
                    for r in rows:
                        k2 = (r[0], int(r[1]))
                        if k2 in want:
                            out[k2] = dict(zip(SAMPLE_FACTS, r))
        finally:
            for _, _, c in sent:
                c.close()
        return recorded, found

    return collect


@contextmanager
def pipelined(cur: Any, d: SqlDialect) -> Iterator[None]:
    """On PostgreSQL, psycopg's pipeline mode on ``cur``'s connection: statements
    are sent without waiting, and the first fetch sends them as one batch (with
    the BEGIN the driver adds, unless the connection reads in autocommit, as the
    append's state read does: ``autocommit_reads``). Elsewhere nothing."""
    if d.name != "postgresql":
        yield
        return
    with cur.connection.pipeline():
        yield


def recorded_keys(conn: Connection, keys: Collection[tuple]) -> dict[tuple, str]:
    """The identity of the event that recorded each of ``keys`` (``_lineage.lineage_key``:
    type first), for those recorded. One query per step (and attempt, for annotations):
    a step's keys share them, and its rows are few."""
    wanted = set(keys)
    out: dict[tuple, str] = {}
    s, a = lineage_steps.c, lineage_annotations.c
    for run, step in sorted({k[1:3] for k in wanted if k[0] == "train_step"}):
        q = select(s.rank, s.attempt, s.identity).where(s.run == run, s.step == step)
        for rank, attempt, identity in conn.execute(q):
            key = ("train_step", run, step, rank, attempt)
            if key in wanted:
                out[key] = identity
    for run, step, attempt in sorted({k[1:4] for k in wanted if k[0] == "sample_annotation"}):
        q = select(a.trajectory_id, a.sample_index, a.identity).where(a.run == run, a.step == step,
                                                                       a.attempt == attempt)
        for tid, index, identity in conn.execute(q):
            key = ("sample_annotation", run, step, attempt, tid, index)
            if key in wanted:
                out[key] = identity
    return out


def standing_attempt(conn: Connection, run: str, step: int, rank: int) -> int | None:
    """The highest attempt recorded for ``(run, step, rank)`` (None: none)."""
    s = lineage_steps.c
    q = select(func.max(s.attempt)).where(s.run == run, s.step == step, s.rank == rank)
    found = conn.execute(q).scalar_one()
    return None if found is None else int(found)


def step_samples(conn: Connection, run: str, step: int) -> list[dict[str, Any]]:
    """The samples of step ``step`` of ``run``, every rank at its standing attempt, in
    (rank, ordinal) order: ``rank``, ``attempt``, ``trajectory_id``, ``sample_index``, ``projection``,
    ``projection_token`` (the projection's identity when the step was written; None: the
    default samples or a step written before it was kept)."""
    s, x = lineage_steps.c, lineage_step_samples.c
    top = (select(s.rank, func.max(s.attempt).label("attempt")).where(s.run == run, s.step == step)
           .group_by(s.rank).subquery())
    q = (select(x.rank, x.attempt, x.trajectory_id, x.sample_index, s.projection, s.projection_token)
         .select_from(lineage_step_samples.join(top, (top.c.rank == x.rank) & (top.c.attempt == x.attempt))
                      .join(lineage_steps, (s.run == x.run) & (s.step == x.step) & (s.rank == x.rank)
                            & (s.attempt == x.attempt)))
         .where(x.run == run, x.step == step).order_by(x.rank, x.ordinal))
    return [dict(r._mapping) for r in conn.execute(q)]


def annotation_rows(conn: Connection, run: str, step: int | None, trajectory_id: str | None) -> list[dict[str, Any]]:
    """``lineage_annotations`` rows of ``run`` (of one step, of one trajectory's
    samples), in (step, trajectory_id, sample_index, attempt) order."""
    a = lineage_annotations.c
    q = select(lineage_annotations).where(a.run == run)
    if step is not None:
        q = q.where(a.step == step)
    if trajectory_id is not None:
        q = q.where(a.trajectory_id == trajectory_id)
    q = q.order_by(a.step, a.trajectory_id, a.sample_index, a.attempt)
    return [dict(r._mapping) for r in conn.execute(q)]
