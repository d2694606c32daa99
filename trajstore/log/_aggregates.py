"""The run view's aggregate tables (``trajstore._aggregates``): added to in the
transaction that stores what they count, and rebuilt from the log and the samples.

``add_counts`` is one ``INSERT ... ON CONFLICT DO UPDATE`` executemany per
table (SQLite and PostgreSQL spell it alike), keys sorted so two transactions
adding to the same keys take their row locks in one order (no deadlock between
materializer shards)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from trajstore._aggregates import MAX_VALUES, WRITER_KEYED, Counts, event_counts, merge, sample_counts
from trajstore.log._dialect import SqlDialect, execute
from trajstore.schema import (agg_calls, agg_expert_load, agg_logprobs, agg_output_lengths, agg_route_drift,
                              agg_trajectories, samples, store_settings, trajectories)

__all__ = ["TABLES", "PENDING", "add_counts", "write_event_aggregates", "rebuild_event_aggregates",
           "rebuild_sample_aggregates"]

TABLES = {t.name: t for t in (agg_expert_load, agg_logprobs, agg_output_lengths, agg_route_drift, agg_calls,
                               agg_trajectories)}
EVENT_TABLES = (agg_output_lengths, agg_route_drift, agg_calls, agg_trajectories)
"""The tables counted from the log's events (the append's transaction)."""
PENDING = "aggregates_pending"
"""The ``store_settings`` row an upgraded store with samples gets until their aggregates are counted."""


def _split(table: Any) -> tuple[list[str], list[str]]:
    keys = [c.name for c in table.primary_key.columns]
    return keys, [c.name for c in table.columns if c.name not in keys]


def add_counts(conn: Any, d: SqlDialect, counts: Counts) -> None:
    """Add ``counts`` to the aggregate tables (``conn``: a Connection or a driver cursor)."""
    for name in sorted(counts):
        part = counts[name]
        if not part:
            continue
        table = TABLES[name]
        keys, values = _split(table)
        t = d.table(table)

        def build() -> str:
            # the writer key is the database's (not a parameter): this backend, 0 on SQLite
            writer = ["writer"] if name in WRITER_KEYED else []
            given = [k for k in keys if k not in writer]
            cols = [*given, *writer, *values]
            marks = d.marks(len(given) + len(values)).split(", ")
            marks[len(given):len(given)] = ["0" if d.single_writer else "pg_backend_pid()"] * len(writer)
            maxima = {values[i] for i in MAX_VALUES.get(name, ())}

            def update(v: str) -> str:
                c = d.col(table.c[v])
                if v in maxima:  # the larger one, spelled alike on both backends
                    return f"{c} = CASE WHEN excluded.{c} > {t}.{c} THEN excluded.{c} ELSE {t}.{c} END"
                return f"{c} = {t}.{c} + excluded.{c}"

            updates = ", ".join(update(v) for v in values)
            return (f"INSERT INTO {t} ({', '.join(d.col(table.c[c]) for c in cols)}) VALUES ({', '.join(marks)}) "
                    f"ON CONFLICT ({', '.join(d.col(table.c[k]) for k in keys)}) DO UPDATE SET {updates}")

        sql = d._cached(("add_counts", name), build)
        execute(conn, sql, [(*k, *v) for k, v in sorted(part.items())])


def write_event_aggregates(conn: Any, d: SqlDialect, rows: Sequence[Mapping[str, Any]]) -> None:
    """The append's hook: add its generation events' aggregates."""
    counts = event_counts(rows)
    if counts:
        add_counts(conn, d, counts)


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
    from every generation, start and finish event, in the caller's write transaction. Returns the
    number of events read."""
    _lock(conn, d, EVENT_TABLES)
    _delete_all(conn, d, EVENT_TABLES)
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
