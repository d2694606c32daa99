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

from trajstore._aggregates import (DELTA_ROWS, KEYS, MAX_VALUES, MIN_VALUES, TRAJECTORY_TABLES, VALUES, Counts, _add,
                                   _buckets, event_counts, group_contribution, merge, sample_counts,
                                   sample_summary_counts, task_sql, trajectory_counts, trajectory_record)
from trajstore.log._dialect import SqlDialect, chunks, execute
from trajstore.schema import (agg_calls, agg_expert_load, agg_group_variance, agg_groups, agg_logprobs,
                              agg_output_lengths, agg_policy_versions, agg_rewards, agg_route_drift, agg_samples,
                              agg_staleness, agg_tasks, agg_trajectories, agg_trajectory_shapes,
                              agg_trajectory_stats, agg_versions, samples, store_settings, trajectories)

__all__ = ["TABLES", "DELTA_TABLES", "PENDING", "COMPACT_ROWS", "add_counts", "insert_deltas",
           "write_event_aggregates", "compact_event_aggregates", "rebuild_event_aggregates",
           "rebuild_sample_aggregates", "count_commit", "count_trajectories", "count_sample_rows",
           "count_policy_versions", "settle_groups", "rebuild_trajectory_aggregates", "events_of_sql"]

TABLES = {t.name: t for t in (agg_expert_load, agg_logprobs, agg_output_lengths, agg_route_drift, agg_calls,
                               agg_trajectories, agg_rewards, agg_trajectory_shapes, agg_tasks, agg_versions,
                               agg_groups, agg_group_variance, agg_samples, agg_staleness, agg_policy_versions)}
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


def count_trajectories(conn: Any, d: SqlDialect, trajectory_ids: Iterable[str], *, settle: bool = True) -> list[str]:
    """Count the finished trajectories of ``trajectory_ids`` not counted yet into
    ``agg_trajectory_stats`` and the per-trajectory aggregates, from their index rows (in the
    caller's write transaction: the materializer's commit that takes them). ``settle``: also
    update their groups' part of ``agg_group_variance``. Returns the ids counted."""
    st, tr = d.table(agg_trajectory_stats), d.table(trajectories)
    counted: list[str] = []
    groups: set[str] = set()
    for part in chunks(sorted(set(trajectory_ids))):
        marks = d.marks(len(part))
        have = {r[0] for r in execute(conn, f"SELECT trajectory_id FROM {st} WHERE trajectory_id IN ({marks})",
                                      tuple(part)).fetchall()}
        part = [t for t in part if t not in have]
        if not part:
            continue
        marks = d.marks(len(part))
        trajs = [dict(zip(_TRAJ_COLUMNS, r)) for r in execute(
            conn, f"SELECT t.trajectory_id, t.group_id, t.status, t.reward, {task_sql('t.metadata')}, "
            f"(SELECT max(x.created_at) FROM events x WHERE x.trajectory_id = t.trajectory_id) "
            f"FROM {tr} t WHERE t.trajectory_id IN ({marks}) AND t.status <> 'running'", tuple(part)).fetchall()]
        if not trajs:
            continue
        calls: dict[str, list[dict[str, Any]]] = {}
        for r in execute(conn, events_of_sql(d, len(trajs)), tuple(t["trajectory_id"] for t in trajs)).fetchall():
            if r[0] == "generation":
                calls.setdefault(r[1], []).append(dict(zip(_CALL_COLUMNS, r[1:])))
        records = [trajectory_record(t, calls.get(t["trajectory_id"], ())) for t in trajs]
        d.insert_rows(conn, agg_trajectory_stats, [{k: r[k] for k in _STATS_COLUMNS} for r in records])
        add_counts(conn, d, trajectory_counts(records))
        counted.extend(r["trajectory_id"] for r in records)
        groups.update(r["group_id"] for r in records if r["group_id"] is not None)
    if settle and groups:
        settle_groups(conn, d, groups)
    return counted


def settle_groups(conn: Any, d: SqlDialect, group_ids: Iterable[str]) -> None:
    """Move each group's part of ``agg_group_variance`` to what its ``agg_groups`` row and its
    running trajectories say now (a group counts once none of its trajectories runs and two or
    more are rewarded; its earlier part, if any, is taken back)."""
    g, tr = d.table(agg_groups), d.table(trajectories)
    names = VALUES["agg_groups"]
    for part in chunks(sorted(set(group_ids))):
        marks = d.marks(len(part))
        rows = execute(conn, f"SELECT group_id, {', '.join(names)}, counted_at, counted_zero, counted_variance "
                             f"FROM {g} WHERE group_id IN ({marks})", tuple(part)).fetchall()
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
        if updates:
            execute(conn, f"UPDATE {g} SET counted_at = {d.p}, counted_zero = {d.p}, counted_variance = {d.p} "
                          f"WHERE group_id = {d.p}", updates)
        if delta:
            add_counts(conn, d, {"agg_group_variance": delta})


def count_policy_versions(conn: Any, d: SqlDialect, after: int, upto: int | None = None) -> None:
    """Note the first position of each model version generated at after ``after`` (to ``upto``)
    in ``agg_policy_versions`` (the newest version at a position, for a sample's staleness)."""
    cut = "" if upto is None else f" AND position <= {d.p}"
    got = execute(conn, f"SELECT model_version, min(position) FROM events WHERE type = 'generation' "
                        f"AND position > {d.p}{cut} AND model_version IS NOT NULL GROUP BY model_version",
                  (int(after),) if upto is None else (int(after), int(upto))).fetchall()
    if got:
        add_counts(conn, d, {"agg_policy_versions": {(int(v),): [int(p)] for v, p in got}})


def count_sample_rows(conn: Any, d: SqlDialect, rows: Sequence[Mapping[str, Any]]) -> None:
    """Count default sample rows (``samples`` columns) into ``agg_samples`` and ``agg_staleness``
    (their trajectories counted already: ``agg_trajectory_stats`` gives the finish time)."""
    if not rows:
        return
    st = d.table(agg_trajectory_stats)
    finished_at: dict[str, float] = {}
    for part in chunks(sorted({r["trajectory_id"] for r in rows})):
        finished_at.update(execute(conn, f"SELECT trajectory_id, finished_at FROM {st} WHERE trajectory_id IN "
                                         f"({d.marks(len(part))})", tuple(part)).fetchall())
    policy = [(int(p), int(v)) for p, v in execute(
        conn, f"SELECT first_position, model_version FROM {d.table(agg_policy_versions)} ORDER BY first_position",
        ()).fetchall()]
    add_counts(conn, d, sample_summary_counts(rows, finished_at, policy))


def count_commit(conn: Any, d: SqlDialect, trajectory_ids: Sequence[str], sample_rows: Sequence[Mapping[str, Any]],
                 after: int, upto: int) -> None:
    """The materializer commit's counts of the run view: the trajectories it takes (finished
    after ``after`` up to ``upto`` in the log), their groups, the model versions first seen in
    that stretch of the log, and its default samples."""
    count_policy_versions(conn, d, after, upto)
    count_trajectories(conn, d, trajectory_ids)
    count_sample_rows(conn, d, sample_rows)


def rebuild_trajectory_aggregates(conn: Any, d: SqlDialect, *, page_rows: int = 2000) -> int:
    """Recount ``agg_trajectory_stats`` and the per-trajectory and per-sample aggregates
    (``TRAJECTORY_TABLES``) from every finished trajectory and default sample, in the caller's
    write transaction. Returns the number of trajectories counted."""
    tables = (agg_trajectory_stats, *(TABLES[n] for n in TRAJECTORY_TABLES))
    _lock(conn, d, tables)
    _delete_all(conn, d, tables)
    count_policy_versions(conn, d, -1)
    tr, s, n, after = d.table(trajectories), d.table(samples), 0, ""
    while True:
        ids = [r[0] for r in execute(conn, f"SELECT trajectory_id FROM {tr} WHERE status <> 'running' AND "
                                           f"trajectory_id > {d.p} ORDER BY trajectory_id LIMIT {int(page_rows)}",
                                     (after,)).fetchall()]
        if not ids:
            break
        n += len(count_trajectories(conn, d, ids, settle=False))
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
        count_sample_rows(conn, d, [dict(zip(_SAMPLE_COLUMNS, r)) for r in got])
        cursor = (got[-1][0], got[-1][-1])
    return n
