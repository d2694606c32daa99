"""The run view's aggregate tables (``trajstore.log._aggregate_counts``): added to in the
transaction that stores what they count, and rebuilt from the log and the samples.

Two ways of adding, by who adds:

* the compaction and a rebuild (the totals): ``add_counts``, one ``INSERT ... ON
  CONFLICT DO UPDATE`` executemany per table (SQLite and PostgreSQL spell it alike),
  keys sorted so two transactions adding to the same keys take their row locks in one
  order; on PostgreSQL the compaction takes, sums and adds a table's deltas in one
  statement, no delta row sent to the client (``_fold_on_server``); the expert load,
  one counts array per model version, by ``add_expert_arrays`` (the version's row
  read, summed by numpy, written back: one row per version, not one per (layer,
  expert)). The materializer's commit inserts rows of its own
  (``insert_fold_deltas``);
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

import numpy as np

from trajstore.log._aggregate_counts import (
    DELTA_ROWS, FOLD_DELTAS, KEYS, MAX_VALUES, MIN_VALUES, TRAJECTORY_TABLES, VALUES, Counts, _add, _add_array, _buckets,
    event_counts, expert_array_rows, expert_arrays, expert_sample_every, expert_sample_every_sql, group_contribution,
    merge, sample_counts, sample_summary_counts, summed_values_sql, task_sql, totals_sql, trajectory_counts,
    trajectory_record)
from trajstore.log._dialect import SqlDialect, chunks, execute
from trajstore.schema import (agg_calls, agg_expert_load, agg_expert_load_delta, agg_expert_pending, agg_group_variance, agg_groups,
                              agg_groups_delta, agg_logprobs, agg_logprobs_delta, agg_output_lengths,
                              agg_policy_versions, agg_policy_versions_delta, agg_rewards, agg_rewards_delta,
                              agg_route_drift, agg_samples, agg_samples_delta, agg_staleness, agg_staleness_delta,
                              agg_tasks, agg_tasks_delta, agg_trajectories, agg_trajectory_shapes,
                              agg_trajectory_shapes_delta, agg_trajectory_stats, agg_versions, agg_versions_delta,
                              samples, store_settings, trajectories)

__all__ = ["TABLES", "DELTA_TABLES", "FOLD_DELTA_TABLES", "PENDING", "COMPACT_ROWS", "add_counts", "insert_deltas",
           "insert_fold_deltas", "add_expert_arrays", "compact_aggregates", "pending_deltas", "note_expert_pending",
           "count_pending_experts", "sample_every", "EXPERT_SEGMENTS",
           "write_event_aggregates", "compact_event_aggregates", "rebuild_event_aggregates",
           "rebuild_sample_aggregates", "count_commit", "count_trajectories", "count_sample_rows",
           "count_policy_versions", "settle_groups", "rebuild_trajectory_aggregates", "events_of_sql"]

TABLES = {t.name: t for t in (agg_logprobs, agg_output_lengths, agg_route_drift, agg_calls,
                               agg_trajectories, agg_rewards, agg_trajectory_shapes, agg_tasks, agg_versions,
                               agg_groups, agg_group_variance, agg_samples, agg_staleness, agg_policy_versions)}
DELTA_TABLES = {name: TABLES[name] for name in DELTA_ROWS}
FOLD_DELTA_TABLES = {t.name[:-len("_delta")]: t for t in (
    agg_logprobs_delta, agg_rewards_delta, agg_trajectory_shapes_delta, agg_tasks_delta, agg_versions_delta,
    agg_groups_delta, agg_samples_delta, agg_staleness_delta, agg_policy_versions_delta)}
"""The materializer's commit's rows of its own, beside each table it counts into (migration 0022)."""
assert set(FOLD_DELTA_TABLES) == set(FOLD_DELTAS)
"""The tables counted from the log's events, which appends insert delta rows into (a key's
count: the sum of its rows, the max for ``MAX_VALUES``)."""
PENDING = "aggregates_pending"
"""The ``store_settings`` row an upgraded store with samples gets until their aggregates are counted."""
COMPACT_ROWS = 20_000
"""Deltas one compaction takes at most per table."""


def _split(table: Any) -> tuple[list[str], list[str]]:
    return list(KEYS[table.name]), list(VALUES[table.name])


def _upsert_sql(d: SqlDialect, name: str, source: str) -> str:
    """``INSERT`` of table ``name``'s rows (its key columns, then its counted columns) from
    ``source`` (a ``SELECT``; empty: one row of parameters) added to the rows of their keys:
    sums, the larger (smaller) of ``MAX_VALUES`` (``MIN_VALUES``), NULL standing for none.
    The append's tables (``DELTA_TABLES``) add to the key's total row, the one not ``delta``."""
    table = TABLES[name]
    keys, values = _split(table)
    t = d.table(table)
    cols = [*keys, *values]
    maxima = {values[i] for i in MAX_VALUES.get(name, ())}
    minima = {values[i] for i in MIN_VALUES.get(name, ())}

    def update(v: str) -> str:
        c = d.col(table.c[v])
        if v in maxima or v in minima:  # the larger (smaller) one, spelled alike on both backends; NULL: none
            op = ">" if v in maxima else "<"
            return (f"{c} = CASE WHEN {t}.{c} IS NULL OR excluded.{c} {op} {t}.{c} THEN "
                    f"COALESCE(excluded.{c}, {t}.{c}) ELSE {t}.{c} END")
        return f"{c} = {t}.{c} + excluded.{c}"

    updates = ", ".join(update(v) for v in values)
    names = ", ".join(d.col(table.c[c]) for c in cols)
    target = ", ".join(d.col(table.c[k]) for k in keys)
    if name in DELTA_TABLES:  # the key's total row: the partial unique index over the rows not delta
        rows_of = f"SELECT *, FALSE FROM ({source}) AS s" if source else f"VALUES ({d.marks(len(cols))}, FALSE)"
        return (f"INSERT INTO {t} ({names}, delta) {rows_of} "
                f"ON CONFLICT ({target}) WHERE NOT delta DO UPDATE SET {updates}")
    rows_of = source or f"VALUES ({d.marks(len(cols))})"
    return f"INSERT INTO {t} ({names}) {rows_of} ON CONFLICT ({target}) DO UPDATE SET {updates}"


def add_counts(conn: Any, d: SqlDialect, counts: Counts) -> None:
    """Add ``counts`` to the aggregate tables' rows of their keys (the totals of the delta
    tables): one upsert per table (``conn``: a Connection or a driver cursor)."""
    for name in sorted(counts):
        part = counts[name]
        if not part:
            continue
        table = TABLES[name]
        keys, values = _split(table)
        rows = [(*k, *v) for k, v in sorted(part.items())]
        arrays = d.as_arrays(table, [*keys, *values], rows)
        if arrays is not None:  # the rows as one statement of arrays (PostgreSQL)
            execute(conn, d._cached(("add_counts arrays", name), lambda: _upsert_sql(d, name, arrays[0])), arrays[1])
        else:
            execute(conn, d._cached(("add_counts", name), lambda: _upsert_sql(d, name, "")), rows)


def _fold_on_server(conn: Any, d: SqlDialect, name: str, deltas: Any, *, limit: int) -> tuple[int, list]:
    """PostgreSQL: fold up to ``limit`` delta rows of table ``name`` (rows of ``deltas``; of the
    append's tables, those ``delta`` in the table itself) into their keys' totals in one
    statement, none of them sent to the client: the rows no other transaction holds are
    deleted (``FOR UPDATE SKIP LOCKED``), summed per key in key order as a read sums them
    (``summed_values_sql``) and upserted (``_upsert_sql``). Returns the rows folded and, for
    a table of one key column, the keys added to (else none)."""
    keys, values = KEYS[name], VALUES[name]

    def build() -> str:
        t = d.table(deltas)
        own = " WHERE delta" if deltas is TABLES.get(name) else ""
        ks = ", ".join(keys)
        summed = f"SELECT {ks}, {summed_values_sql(name)} FROM taken GROUP BY {ks} ORDER BY {ks}"
        added = f"ARRAY(SELECT {keys[0]} FROM added)" if len(keys) == 1 else "NULL"
        return (f"WITH taken AS (DELETE FROM {t} WHERE id IN (SELECT id FROM {t}{own} ORDER BY id LIMIT {d.p} "
                f"FOR UPDATE SKIP LOCKED) RETURNING {ks}, {', '.join(values)}), "
                f"added AS ({_upsert_sql(d, name, summed)} RETURNING {ks}) "
                f"SELECT (SELECT count(*) FROM taken), {added}")

    n, added = execute(conn, d._cached(("fold on server", name), build), (int(limit),)).fetchone()
    return int(n), list(added or ())


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


def insert_fold_deltas(conn: Any, d: SqlDialect, counts: Mapping[str, Mapping[tuple, Any]]) -> None:
    """A materializer commit's counts, as rows of its own: ``counts`` of ``FOLD_DELTAS`` tables
    inserted into their ``<table>_delta``, and ``agg_expert_load`` (``{(version,): counts
    array}``) as one ``agg_expert_load_delta`` row per version (the array's int64 bytes).
    Plain INSERTs (``SqlDialect.insert_tuples``: one statement on PostgreSQL): no row another
    transaction may hold is updated or locked."""
    parts = []
    for name in sorted(counts):
        part = counts[name]
        if not part:
            continue
        if name == "agg_expert_load":
            arrays = {}
            for (version, *rest), c in part.items():
                if rest:  # a (version, layer, expert) row: not how a commit counts
                    raise ValueError("agg_expert_load counts of a commit are one array per model version")
                _add_array(arrays, int(version), np.asarray(c, np.int64))
            parts.append((agg_expert_load_delta, ("model_version", "layers", "experts", "counts"),
                          expert_array_rows(arrays)))
            continue
        parts.append((FOLD_DELTA_TABLES[name], (*KEYS[name], *VALUES[name]),
                      [(*k, *v) for k, v in sorted(part.items())]))
    d.insert_tuples(conn, parts)


def add_expert_arrays(conn: Any, d: SqlDialect, arrays: Mapping[int, np.ndarray]) -> None:
    """Add expert-load arrays (``{model_version: counts[layer, expert]}``) to their versions'
    ``agg_expert_load`` rows, in the caller's write transaction: one row per version is
    read, summed by numpy (layouts of one version summed into the union of their shapes)
    and written back. On PostgreSQL a missing row is first inserted empty (``ON CONFLICT DO
    NOTHING``: two compactions adding a new version at once both find it) and the rows are
    locked in version order (``FOR UPDATE``) before the read, so two compactions adding to
    one version take turns and neither loses the other's counts."""
    if not arrays:
        return
    t = d.table(agg_expert_load)
    versions = sorted(int(v) for v in arrays)
    execute(conn, d._cached(("expert_load_seed",), lambda: (
        f"INSERT INTO {t} (model_version, layers, experts, counts) VALUES ({d.marks(4)}) "
        "ON CONFLICT (model_version) DO NOTHING")), [(v, 0, 0, b"") for v in versions])
    summed: dict[int, np.ndarray] = {}
    lock = "" if d.single_writer else " FOR UPDATE"
    for part in chunks(versions):
        have = execute(conn, f"SELECT model_version, layers, experts, counts FROM {t} WHERE model_version IN "
                             f"({d.marks(len(part))}) ORDER BY model_version{lock}", tuple(part)).fetchall()
        summed.update(expert_arrays(r for r in have if int(r[1]) and int(r[2])))
    for v in versions:
        _add_array(summed, v, np.asarray(arrays[v], np.int64))
    execute(conn, d._cached(("expert_load_set",), lambda: (
        f"UPDATE {t} SET layers = {d.p}, experts = {d.p}, counts = {d.p} WHERE model_version = {d.p}")),
        [(layers, experts, counts, v) for v, layers, experts, counts in expert_array_rows(summed)])


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
        if d.name == "postgresql":  # summed on the server, no row sent
            n += _fold_on_server(conn, d, name, table, limit=limit)[0]
            continue
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


def _take(conn: Any, d: SqlDialect, table: Any, cols: Sequence[str], limit: int) -> list[tuple]:
    """Delete up to ``limit`` rows of delta table ``table`` (oldest first) and return their
    ``cols``; on PostgreSQL only rows no other transaction holds (``SKIP LOCKED``)."""
    t = d.table(table)

    def build() -> str:
        skip = "" if d.single_writer else " FOR UPDATE SKIP LOCKED"
        return (f"DELETE FROM {t} WHERE id IN (SELECT id FROM {t} ORDER BY id LIMIT {d.p}{skip}) "
                f"RETURNING {', '.join(d.col(table.c[c]) for c in cols)}")

    return execute(conn, d._cached(("take", table.name), build), (int(limit),)).fetchall()


def compact_aggregates(conn: Any, d: SqlDialect, *, limit: int = COMPACT_ROWS) -> int:
    """The background compaction, in the caller's write transaction (exactly once: the deltas
    it deletes and the totals it adds commit together or not at all; run again, it finds
    nothing to do): the appends' deltas (``compact_event_aggregates``), the materializer
    commits' ``<table>_delta`` rows and expert-load arrays folded into their totals, up to
    ``limit`` rows per table, and the groups whose counts moved settled (their part of
    ``agg_group_variance``). Every key's sum, min and max is unchanged by it (a read of one
    statement sees the rows before or after it). On PostgreSQL two compactions take
    different deltas (``SKIP LOCKED``) and queue only on the totals rows both add to; no
    materializer commit waits for one. Returns the number of delta rows folded."""
    n = compact_event_aggregates(conn, d, limit=limit)
    groups: set[str] = set()
    for name, table in sorted(FOLD_DELTA_TABLES.items()):
        if d.name == "postgresql":  # summed on the server, no row sent
            got_n, added = _fold_on_server(conn, d, name, table, limit=limit)
            if name == "agg_groups":
                groups.update(added)
            n += got_n
            continue
        keys = KEYS[name]
        got = _take(conn, d, table, (*keys, *VALUES[name]), limit)
        if not got:
            continue
        into: dict[tuple, list[float]] = {}
        k, maxima, minima = len(keys), MAX_VALUES.get(name, ()), MIN_VALUES.get(name, ())
        for r in got:
            _add(into, tuple(r[:k]), list(r[k:]), maxima, minima)
        if name == "agg_groups":
            groups.update(key[0] for key in into)
        add_counts(conn, d, {name: into})
        n += len(got)
    got = _take(conn, d, agg_expert_load_delta, ("model_version", "layers", "experts", "counts"), limit)
    if got:
        add_expert_arrays(conn, d, expert_arrays(got))
        n += len(got)
    if groups:
        settle_groups(conn, d, groups)
    return n


def pending_deltas(conn: Any, d: SqlDialect) -> int:
    """Delta rows of the materializer's tables not compacted yet (every table's), and
    commits whose expert load is not counted yet."""
    parts = [f"SELECT count(*) FROM {d.table(t)}"
             for t in (*FOLD_DELTA_TABLES.values(), agg_expert_load_delta, agg_expert_pending)]
    return int(execute(conn, "SELECT " + " + ".join(f"({p})" for p in parts), ()).fetchone()[0])


EXPERT_SEGMENTS = 16
"""Commits' sample segments one expert-load count takes at most (one transaction)."""


def note_expert_pending(conn: Any, d: SqlDialect, segment: str) -> None:
    """Note that sample segment ``segment``'s expert load is to be counted (a row of its own in
    ``agg_expert_pending``; ``count_pending_experts`` counts it): how commits before the
    in-commit count left it, and how a test builds such a store."""
    execute(conn, d._cached(("note_expert_pending",), lambda: (
        f"INSERT INTO {d.table(agg_expert_pending)} (segment) VALUES ({d.p})")), (segment,))


def sample_every(conn: Any) -> int:
    """The store's expert-load sampling stride (``trajstore.log._aggregate_counts.EXPERT_SAMPLE_EVERY``,
    or its ``store_settings`` row); a bad row is a one-line ``ValueError`` naming it."""
    got = execute(conn, expert_sample_every_sql(), ()).fetchone()
    return expert_sample_every(None if got is None else got[0])


def count_pending_experts(conn: Any, d: SqlDialect, load: Callable[[list[dict[str, Any]]], list[Any]], *,
                          limit: int = EXPERT_SEGMENTS) -> int:
    """Count the decode-route expert load of up to ``limit`` committed sample segments noted in
    ``agg_expert_pending`` into ``agg_expert_load``, in the caller's write transaction: the
    rows are deleted (on PostgreSQL only rows no other transaction holds: ``SKIP LOCKED``)
    and the counts added together, so a segment counts exactly once. ``load(rows)``: the
    samples of ``samples`` rows (``segment``, ``segment_row``), from the payload. Counted
    here, off the fold's critical path: numpy's ``bincount`` over every decode route costs
    about as much as the fold (docs/report.md, "Aggregates"). A materializer commit counts its
    own samples' routes now (``agg_expert_load_delta``); this counts the segments an older
    version noted. Returns the segments counted."""
    got = _take(conn, d, agg_expert_pending, ("segment",), limit)
    if not got:
        return 0
    s, t = d.table(samples), d.table(trajectories)
    arrays: dict[int, np.ndarray] = {}
    every = sample_every(conn)
    for (segment,) in got:
        rows = [dict(zip(("trajectory_id", "segment", "segment_row", "num_experts"), r)) for r in execute(
            conn, f"SELECT s.trajectory_id, s.segment, s.segment_row, tr.num_experts FROM {s} s "
                  f"JOIN {t} tr ON tr.trajectory_id = s.trajectory_id WHERE s.segment = {d.p} "
                  "ORDER BY s.segment_row", (segment,)).fetchall()]
        if not rows:
            continue
        counted = sample_counts(load(rows), {r["trajectory_id"]: r["num_experts"] for r in rows}, every=every,
                                logprobs=False)
        for (version,), c in counted.get("agg_expert_load", {}).items():
            _add_array(arrays, int(version), c)  # type: ignore[arg-type]
    add_expert_arrays(conn, d, arrays)
    return len(got)


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
    tables = (agg_expert_load, agg_logprobs, agg_expert_load_delta, agg_logprobs_delta, agg_expert_pending)
    _lock(conn, d, tables)
    _delete_all(conn, d, tables)
    s, t = d.table(samples), d.table(trajectories)
    after: tuple = ("", -1)
    n = 0
    every = sample_every(conn)
    while True:
        got = execute(conn, f"SELECT s.trajectory_id, s.sample_index, s.segment, s.segment_row, tr.num_experts "
                      f"FROM {s} s JOIN {t} tr ON tr.trajectory_id = s.trajectory_id "
                      f"WHERE s.trajectory_id > {d.p} OR (s.trajectory_id = {d.p} AND s.sample_index > {d.p}) "
                      f"ORDER BY s.trajectory_id, s.sample_index LIMIT {int(page_rows)}",
                      (after[0], after[0], after[1])).fetchall()
        if not got:
            break
        counts = sample_counts(read([tuple(r[:4]) for r in got]), {r[0]: r[4] for r in got}, every=every)
        arrays = counts.pop("agg_expert_load", {})
        add_expert_arrays(conn, d, {k[0]: c for k, c in arrays.items()})  # type: ignore[misc]
        add_counts(conn, d, counts)
        n += len(got)
        after = (got[-1][0], got[-1][1])
    execute(conn, f"DELETE FROM {d.table(store_settings)} WHERE name = {d.p}", (PENDING,))
    return n


# -- the materializer's per-trajectory and per-sample counts -------------------------------------

_TRAJ_COLUMNS = ("trajectory_id", "group_id", "status", "reward", "task", "finished_at")
_CALL_COLUMNS = ("trajectory_id", "seq", "sample_index", "is_merged", "output_len", "model_version",
                 "min_model_version", "version_spans", "route_rows_resent", "route_rows_drifted",
                 "num_placeholder_logprobs", "reward")
_SAMPLE_COLUMNS = ("trajectory_id", "finished_position", "prompt_len", "response_len", "num_merged_calls",
                   "min_model_version", "max_model_version", "num_route_rows")
_STATS_COLUMNS = tuple(c.name for c in agg_trajectory_stats.columns)


def events_of_sql(d: SqlDialect, n: int) -> str:
    """The events of ``n`` trajectories (``type`` and the generation columns): every event of theirs
    through ``ix_events_trajectory_seq``, the calls kept by the caller. With a condition on the type
    SQLite (no ``ANALYZE`` statistics) searched ``ix_events_type_position``: every call of the log."""
    return f"SELECT type, {', '.join(_CALL_COLUMNS)} FROM events WHERE trajectory_id IN ({d.marks(n)})"


def count_trajectories(conn: Any, d: SqlDialect, trajectory_ids: Iterable[str], *,
                       add: Callable[[Any, SqlDialect, Counts], None] = insert_fold_deltas,
                       calls_of: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
                       finished_at: dict[str, float] | None = None) -> list[str]:
    """Count the finished trajectories of ``trajectory_ids`` not counted yet into
    ``agg_trajectory_stats`` (a row of each trajectory's own) and the per-trajectory
    aggregates, from their index rows (in the caller's write transaction: the materializer's
    commit that takes them). ``add``: how the counts are added (a commit's rows of its own by
    default; a rebuild adds to the totals). ``calls_of``: trajectories whose generation event
    rows (``_CALL_COLUMNS`` at least) the caller read already (the fold's inputs: a finished
    trajectory's generation events never change but for their payload locators), not read
    again; the others' are. ``finished_at``: filled with the finish time of each trajectory
    counted (its ``agg_trajectory_stats`` row's). Their groups' part of ``agg_group_variance`` is
    settled by the compaction (``settle_groups``). Returns the ids counted."""
    st, tr = d.table(agg_trajectory_stats), d.table(trajectories)
    counted: list[str] = []
    for part in chunks(sorted(set(trajectory_ids))):
        marks = d.marks(len(part))
        # the ones not counted yet (no row of theirs in agg_trajectory_stats), in the same statement
        trajs = [dict(zip(_TRAJ_COLUMNS, r)) for r in execute(
            conn, f"SELECT t.trajectory_id, t.group_id, t.status, t.reward, {task_sql('t.metadata')}, "
            f"(SELECT max(x.created_at) FROM events x WHERE x.trajectory_id = t.trajectory_id) "
            f"FROM {tr} t WHERE t.trajectory_id IN ({marks}) AND t.status <> 'running' "
            f"AND NOT EXISTS (SELECT 1 FROM {st} c WHERE c.trajectory_id = t.trajectory_id)", tuple(part)).fetchall()]
        if not trajs:
            continue
        read = calls_of or {}
        calls: dict[str, Sequence[Mapping[str, Any]]] = {t["trajectory_id"]: read[t["trajectory_id"]]
                                                         for t in trajs if t["trajectory_id"] in read}
        unread = [t["trajectory_id"] for t in trajs if t["trajectory_id"] not in read]
        if unread:
            for r in execute(conn, events_of_sql(d, len(unread)), tuple(unread)).fetchall():
                if r[0] == "generation":
                    calls.setdefault(r[1], []).append(dict(zip(_CALL_COLUMNS, r[1:])))  # type: ignore[union-attr]
        records = [trajectory_record(t, calls.get(t["trajectory_id"], ())) for t in trajs]
        d.insert_rows(conn, agg_trajectory_stats, [{k: r[k] for k in _STATS_COLUMNS} for r in records])
        add(conn, d, trajectory_counts(records))
        counted.extend(r["trajectory_id"] for r in records)
        if finished_at is not None:
            finished_at.update((r["trajectory_id"], r["finished_at"]) for r in records)
    return counted


def settle_groups(conn: Any, d: SqlDialect, group_ids: Iterable[str]) -> None:
    """Move each group's part of ``agg_group_variance`` to what its ``agg_groups`` row and its
    running trajectories say now (a group counts once none of its trajectories runs and two or
    more are rewarded; its earlier part, if any, is taken back)."""
    g, tr = d.table(agg_groups), d.table(trajectories)
    names = VALUES["agg_groups"]
    for part in chunks(sorted(set(group_ids))):
        marks = d.marks(len(part))
        # the group's counts: its total row and the deltas not compacted yet; its part as last settled
        summed = totals_sql("agg_groups", where=f"group_id IN ({marks})", order=False)
        rows = execute(conn, f"SELECT s.group_id, {', '.join(f's.{n}' for n in names)}, g.counted_at, "
                             f"g.counted_zero, g.counted_variance FROM ({summed}) s "
                             f"LEFT JOIN {g} g ON g.group_id = s.group_id", tuple(part) * 2).fetchall()
        running = dict(execute(conn, f"SELECT group_id, count(*) FROM {tr} WHERE group_id IN ({marks}) "
                                     "AND status = 'running' GROUP BY group_id", tuple(part)).fetchall())
        delta: dict[tuple, list[float]] = {}
        updates = []
        for r in rows:
            gid, values, old = r[0], r[1:1 + len(names)], r[1 + len(names):]
            new = group_contribution(values, int(running.get(gid, 0)))
            was = None if old[0] is None else (float(old[0]), int(old[1]), float(old[2]))
            if was == new:
                continue
            for sign, got in ((-1, was), (1, new)):
                if got is not None:
                    for key in _buckets(got[0]):
                        _add(delta, key, (sign, sign * got[1], sign * got[2]))
            updates.append((*(new or (None, None, None)), gid))
        if updates:  # (in the groups' order: two compactions settling the same groups take turns)
            d.update_rows(conn, agg_groups, ("counted_at", "counted_zero", "counted_variance"), "group_id",
                          sorted(updates, key=lambda u: u[-1]))
        if delta:
            add_counts(conn, d, {"agg_group_variance": delta})


def count_policy_versions(conn: Any, d: SqlDialect, after: int, upto: int | None = None, *,
                          add: Callable[[Any, SqlDialect, Counts], None] = insert_fold_deltas) -> None:
    """Note the first position of each model version generated at after ``after`` (to ``upto``)
    in ``agg_policy_versions`` (the newest version at a position, for a sample's staleness)."""
    cut = "" if upto is None else f" AND position <= {d.p}"
    got = execute(conn, f"SELECT model_version, min(position) FROM events WHERE type = 'generation' "
                        f"AND position > {d.p}{cut} AND model_version IS NOT NULL GROUP BY model_version",
                  (int(after),) if upto is None else (int(after), int(upto))).fetchall()
    if got:
        add(conn, d, {"agg_policy_versions": {(int(v),): [int(p)] for v, p in got}})


def count_sample_rows(conn: Any, d: SqlDialect, rows: Sequence[Mapping[str, Any]], *,
                      add: Callable[[Any, SqlDialect, Counts], None] = insert_fold_deltas,
                      known: Mapping[str, float] | None = None) -> None:
    """Count default sample rows (``samples`` columns) into ``agg_samples`` and ``agg_staleness``
    (their trajectories counted already: ``agg_trajectory_stats`` gives the finish time, read
    for those not in ``known``: the finish times the caller has just counted)."""
    if not rows:
        return
    st = d.table(agg_trajectory_stats)
    finished_at: dict[str, float] = dict(known or {})
    for part in chunks(sorted({r["trajectory_id"] for r in rows} - set(finished_at))):
        finished_at.update(execute(conn, f"SELECT trajectory_id, finished_at FROM {st} WHERE trajectory_id IN "
                                         f"({d.marks(len(part))})", tuple(part)).fetchall())
    policy = sorted((int(p), int(v)) for v, p in execute(conn, totals_sql("agg_policy_versions", order=False),
                                                          ()).fetchall())
    add(conn, d, sample_summary_counts(rows, finished_at, policy))


def count_commit(conn: Any, d: SqlDialect, trajectory_ids: Sequence[str], sample_rows: Sequence[Mapping[str, Any]],
                 after: int, upto: int, calls_of: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
                 aggregates: Mapping[str, Mapping[tuple, Any]] | None = None) -> None:
    """The materializer commit's counts of the run view, as rows of its own: the trajectories
    it takes (finished after ``after`` up to ``upto`` in the log; ``calls_of``: the generation
    event rows of those the fold read, ``count_trajectories``), the model versions first
    seen in that stretch of the log, and its default samples (their groups are settled by
    the compaction), with ``aggregates`` (its samples' counts, ``insert_fold_deltas``). The
    model versions are inserted first (the samples' staleness reads them); the other
    counts all at once, at the end."""
    count_policy_versions(conn, d, after, upto)
    pending: Counts = {}

    def collect(_conn: Any, _d: SqlDialect, counts: Counts) -> None:
        merge(pending, counts)

    finished_at: dict[str, float] = {}
    count_trajectories(conn, d, trajectory_ids, add=collect, calls_of=calls_of, finished_at=finished_at)
    count_sample_rows(conn, d, sample_rows, add=collect, known=finished_at)
    overlap = set(pending) & set(aggregates or {})
    if overlap:  # pragma: no cover - a commit's sample counts and its trajectories' count other tables
        raise ValueError(f"counted twice in one commit: {sorted(overlap)}")
    insert_fold_deltas(conn, d, {**(aggregates or {}), **pending})


def rebuild_trajectory_aggregates(conn: Any, d: SqlDialect, *, page_rows: int = 2000) -> int:
    """Recount ``agg_trajectory_stats`` and the per-trajectory and per-sample aggregates
    (``TRAJECTORY_TABLES``) from every finished trajectory and default sample, in the caller's
    write transaction. Returns the number of trajectories counted."""
    tables = (agg_trajectory_stats, *(TABLES[n] for n in TRAJECTORY_TABLES),
              *(FOLD_DELTA_TABLES[n] for n in TRAJECTORY_TABLES if n in FOLD_DELTA_TABLES))
    _lock(conn, d, tables)
    _delete_all(conn, d, tables)
    count_policy_versions(conn, d, -1, add=add_counts)
    tr, s, n, after = d.table(trajectories), d.table(samples), 0, ""
    while True:
        ids = [r[0] for r in execute(conn, f"SELECT trajectory_id FROM {tr} WHERE status <> 'running' AND "
                                           f"trajectory_id > {d.p} ORDER BY trajectory_id LIMIT {int(page_rows)}",
                                     (after,)).fetchall()]
        if not ids:
            break
        n += len(count_trajectories(conn, d, ids, add=add_counts))
        after = ids[-1]
    after = ""
    while True:
        groups = [r[0] for r in execute(conn, f"SELECT group_id FROM {d.table(agg_groups)} WHERE group_id > {d.p} "
                                              f"ORDER BY group_id LIMIT {int(page_rows)}", (after,)).fetchall()]
        if not groups:
            break
        settle_groups(conn, d, groups)
        after = groups[-1]
    cursor: tuple = ("", -1)
    while True:
        got = execute(conn, f"SELECT {', '.join(_SAMPLE_COLUMNS)}, sample_index FROM {s} WHERE trajectory_id > {d.p} "
                            f"OR (trajectory_id = {d.p} AND sample_index > {d.p}) ORDER BY trajectory_id, sample_index "
                            f"LIMIT {int(page_rows)}", (cursor[0], cursor[0], cursor[1])).fetchall()
        if not got:
            break
        count_sample_rows(conn, d, [dict(zip(_SAMPLE_COLUMNS, r)) for r in got], add=add_counts)
        cursor = (got[-1][0], got[-1][-1])
    return n
