"""The run view's aggregate tables (``trajstore._aggregates``): added to in the
transaction that stores what they count, and rebuilt from the log and the samples.

Two ways of adding, by who adds:

* the materializer's commit (``agg_expert_load``, ``agg_logprobs``): ``add_counts``,
  one ``INSERT ... ON CONFLICT DO UPDATE`` executemany per table (SQLite and
  PostgreSQL spell it alike), keys sorted so two transactions adding to the same
  keys take their row locks in one order (no deadlock between materializer shards);
* the append (``agg_output_lengths``, ``agg_route_drift``, ``agg_calls``,
  ``agg_trajectories``): ``insert_deltas``,
  plain INSERTs of the append's own rows (``delta`` true). Appends are many and
  concurrent, and a key (one output length, one time bucket) is shared by most of
  them: an upsert of its row would make each append wait, on PostgreSQL, for the
  row lock of any other append counting the same key until that one commits. A
  key's count is the sum of its rows; ``compact_event_aggregates`` (in the
  materializer's commit) folds deltas into the key's one total row, taking on
  PostgreSQL only deltas no other transaction holds (``SKIP LOCKED``), so it never
  waits for an append or another compaction.

A retried or duplicate append adds nothing twice: its deltas are in the transaction
that inserts its events, which fails on the events' identities. A fold moves counts
between rows of the same key, never changing a sum: readers (one statement) see the
sums before or after it, both exact."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from trajstore._aggregates import DELTA_ROWS, KEYS, MAX_VALUES, VALUES, Counts, _add, event_counts, merge, sample_counts
from trajstore.log._dialect import SqlDialect, execute
from trajstore.schema import (agg_calls, agg_expert_load, agg_logprobs, agg_output_lengths, agg_route_drift,
                              agg_trajectories, samples, store_settings, trajectories)

__all__ = ["TABLES", "DELTA_TABLES", "PENDING", "COMPACT_ROWS", "add_counts", "insert_deltas",
           "write_event_aggregates", "compact_event_aggregates", "rebuild_event_aggregates",
           "rebuild_sample_aggregates"]

TABLES = {t.name: t for t in (agg_expert_load, agg_logprobs, agg_output_lengths, agg_route_drift, agg_calls,
                               agg_trajectories)}
DELTA_TABLES = {name: TABLES[name] for name in DELTA_ROWS}
"""The tables counted from the log's events, which appends insert delta rows into (a key's
count: the sum of its rows, the max for ``MAX_VALUES``)."""
PENDING = "aggregates_pending"
"""The ``store_settings`` row an upgraded store with samples gets until their aggregates are counted."""
COMPACT_ROWS = 20_000
"""Deltas one fold takes at most per table (a materializer commit's share of the work)."""


def _split(table: Any) -> tuple[list[str], list[str]]:
    return list(KEYS[table.name]), list(VALUES[table.name])


def add_counts(conn: Any, d: SqlDialect, counts: Counts) -> None:
    """Add ``counts`` to the aggregate tables' rows of their keys (the totals of the delta
    tables): one upsert per table (``conn``: a Connection or a driver cursor)."""
    for name in sorted(counts):
        part = counts[name]
        if not part:
            continue
        table = TABLES[name]
        keys, values = _split(table)
        t = d.table(table)
        total = name in DELTA_TABLES

        def build() -> str:
            cols = [*keys, *values]
            maxima = {values[i] for i in MAX_VALUES.get(name, ())}

            def update(v: str) -> str:
                c = d.col(table.c[v])
                if v in maxima:  # the larger one, spelled alike on both backends
                    return f"{c} = CASE WHEN excluded.{c} > {t}.{c} THEN excluded.{c} ELSE {t}.{c} END"
                return f"{c} = {t}.{c} + excluded.{c}"

            updates = ", ".join(update(v) for v in values)
            names = ", ".join(d.col(table.c[c]) for c in cols)
            target = ", ".join(d.col(table.c[k]) for k in keys)
            if total:  # the key's total row: the partial unique index over the rows not delta
                return (f"INSERT INTO {t} ({names}, delta) VALUES ({d.marks(len(cols))}, FALSE) "
                        f"ON CONFLICT ({target}) WHERE NOT delta DO UPDATE SET {updates}")
            return (f"INSERT INTO {t} ({names}) VALUES ({d.marks(len(cols))}) "
                    f"ON CONFLICT ({target}) DO UPDATE SET {updates}")

        sql = d._cached(("add_counts", name), build)
        execute(conn, sql, [(*k, *v) for k, v in sorted(part.items())])


def insert_deltas(conn: Any, d: SqlDialect, counts: Counts) -> None:
    """Insert ``counts`` of the delta tables as rows of their own (no row of another
    transaction updated or locked)."""
    for name in sorted(counts):
        part = counts[name]
        if not part:
            continue
        table = DELTA_TABLES[name]
        keys, values = _split(table)

        def build() -> str:
            cols = [*keys, *values]
            return (f"INSERT INTO {d.table(table)} ({', '.join(d.col(table.c[c]) for c in cols)}, delta) "
                    f"VALUES ({d.marks(len(cols))}, TRUE)")

        sql = d._cached(("insert_deltas", name), build)
        execute(conn, sql, [(*k, *v) for k, v in sorted(part.items())])


def write_event_aggregates(conn: Any, d: SqlDialect, rows: Sequence[Mapping[str, Any]]) -> None:
    """The append's hook: insert its events' aggregates (generation, start and finish events)
    as delta rows."""
    counts = event_counts(rows)
    if counts:
        insert_deltas(conn, d, counts)


def compact_event_aggregates(conn: Any, d: SqlDialect, *, limit: int = COMPACT_ROWS) -> int:
    """Fold up to ``limit`` delta rows per table into their keys' total rows, in the caller's
    write transaction: the deltas are deleted and their sums (maxima for ``MAX_VALUES``)
    upserted into the totals (every key's sum and max unchanged). On PostgreSQL only deltas no other transaction holds are
    taken (``FOR UPDATE SKIP LOCKED``): the fold never waits for an append, and two folds
    take different deltas. Returns the number of deltas folded."""
    n = 0
    for name, table in sorted(DELTA_TABLES.items()):
        keys, values = _split(table)
        t = d.table(table)

        def build() -> str:
            skip = "" if d.single_writer else " FOR UPDATE SKIP LOCKED"
            cols = ", ".join(d.col(table.c[c]) for c in (*keys, *values))
            return (f"DELETE FROM {t} WHERE id IN (SELECT id FROM {t} WHERE delta ORDER BY id LIMIT {d.p}{skip}) "
                    f"RETURNING {cols}")

        sql = d._cached(("compact", name), build)
        got = execute(conn, sql, (int(limit),)).fetchall()
        if not got:
            continue
        k, into, maxima = len(keys), {}, MAX_VALUES.get(name, ())
        for r in got:
            _add(into, tuple(r[:k]), list(r[k:]), maxima)
        counts: Counts = {name: into}
        add_counts(conn, d, counts)
        n += len(got)
    return n


def _delete_all(conn: Any, d: SqlDialect, tables: Iterable[Any]) -> None:
    for table in tables:
        execute(conn, f"DELETE FROM {d.table(table)}", ())


def _lock(conn: Any, d: SqlDialect, tables: Sequence[Any]) -> None:
    """PostgreSQL: keep every writer of ``tables`` out until commit (an append or a materializer
    commit that adds to them waits); SQLite's write transaction already does."""
    if not d.single_writer:
        execute(conn, f"LOCK TABLE {', '.join(d.table(t) for t in tables)} IN EXCLUSIVE MODE", ())


def rebuild_event_aggregates(conn: Any, d: SqlDialect, *, page_rows: int = 50_000) -> int:
    """Recount ``agg_output_lengths``, ``agg_route_drift``, ``agg_calls`` and ``agg_trajectories``
    into total rows from every generation, start and finish event, in the caller's write
    transaction. Returns the number of generation events read."""
    tables = tuple(DELTA_TABLES.values())
    _lock(conn, d, tables)
    _delete_all(conn, d, tables)  # totals and deltas: recounted as totals
    after, n = -1, 0
    names = ("position", "type", "model_version", "output_len", "route_rows_resent", "route_rows_drifted",
             "created_at", "finish_reason", "prompt_len", "prefix_len", "seq", "is_merged", "num_route_rows_sent", "status")
    while True:
        got = execute(conn, f"SELECT {', '.join(names)} FROM events WHERE type IN ('generation', 'trajectory_started', "
                      f"'trajectory_finished') AND position > {d.p} "
                      f"ORDER BY position LIMIT {int(page_rows)}", (after,)).fetchall()
        if not got:
            return n
        add_counts(conn, d, event_counts(dict(zip(names, r)) for r in got))
        n += sum(1 for r in got if r[1] == "generation")
        after = got[-1][0]


def rebuild_sample_aggregates(conn: Any, d: SqlDialect, read: Callable[[list[tuple]], list[Any]], *,
                              page_rows: int = 256) -> int:
    """Recount ``agg_expert_load`` and ``agg_logprobs`` from every default sample, in the
    caller's write transaction (materializer commits wait for it on PostgreSQL; SQLite's
    writers do anyway), and drop the ``aggregates_pending`` row. ``read(rows)``: the
    samples of ``(trajectory_id, sample_index, segment, segment_row)`` rows, from the
    payload. Returns the number of samples read."""
    _lock(conn, d, (agg_expert_load, agg_logprobs))
    _delete_all(conn, d, (agg_expert_load, agg_logprobs))
    s, t = d.table(samples), d.table(trajectories)
    after: tuple = ("", -1)
    n = 0
    while True:
        got = execute(conn, f"SELECT s.trajectory_id, s.sample_index, s.segment, s.segment_row, tr.num_experts "
                      f"FROM {s} s JOIN {t} tr ON tr.trajectory_id = s.trajectory_id "
                      f"WHERE s.trajectory_id > {d.p} OR (s.trajectory_id = {d.p} AND s.sample_index > {d.p}) "
                      f"ORDER BY s.trajectory_id, s.sample_index LIMIT {int(page_rows)}",
                      (after[0], after[0], after[1])).fetchall()
        if not got:
            break
        counts: Counts = {}
        merge(counts, sample_counts(read([tuple(r[:4]) for r in got]), {r[0]: r[4] for r in got}))
        add_counts(conn, d, counts)
        n += len(got)
        after = (got[-1][0], got[-1][1])
    execute(conn, f"DELETE FROM {d.table(store_settings)} WHERE name = {d.p}", (PENDING,))
    return n
