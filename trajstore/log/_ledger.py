"""The rollout ledger's table (docs/reference.md "Rollout ledger"): written in the
append's transaction from the changes admission made (``trajstore.rollout._ledger``),
and the reads admission and a driver's resume plan need.

``ledger_groups`` holds one row per group with its counts; the writes change
them relative to what is stored (``num_started + k``), so two appends to one
group never lose each other's counts. A new group's row is an upsert guarded
by the fields it was admitted against: a group another writer opened with
other fields, or dropped meanwhile, fails the guard's primary key, a lost race
(``StaleState``: the append is re-read and re-admitted, which refuses it); a
``(run, prompt_id, epoch)`` another group took meanwhile fails on its unique
index, the same race.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence

from sqlalchemy import Connection, select, tuple_

from trajstore.log._dialect import SqlDialect, execute
from trajstore.schema import ledger_groups, trajectories

__all__ = ["GROUP_COLUMNS", "load_ledger", "run_groups", "run_members", "write_ledger"]

GROUP_COLUMNS = ("group_id", "run", "prompt_id", "epoch", "group_size", "num_started", "num_finished", "num_failed",
                 "started_position", "started_at", "dropped_position", "dropped_reason", "dropped_at")

_CHUNK = 500  # ids per IN list


def _chunks(items: Sequence[Any]) -> list[Sequence[Any]]:
    return [items[i:i + _CHUNK] for i in range(0, len(items), _CHUNK)]


def load_ledger(conn: Connection, group_ids: Collection[str], prompts: Collection[tuple[str, str, int]],
                check_plain: Collection[str] = ()
                ) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, str, int], str], set[str]]:
    """What admitting a batch's ledger events reads, in one read transaction: the rows of
    ``group_ids`` that are ledger groups, the group holding each of ``prompts``
    (``(run, prompt_id, epoch)``), and which of ``check_plain`` that are not ledger
    groups name trajectories outside the ledger (started without its fields)."""
    t = ledger_groups
    cols = [t.c[n] for n in GROUP_COLUMNS]
    groups: dict[str, dict[str, Any]] = {}
    held: dict[tuple[str, str, int], str] = {}
    plain: set[str] = set()
    ids = sorted(group_ids)
    for part in _chunks(ids):
        groups.update({r.group_id: dict(r._mapping) for r in conn.execute(select(*cols).where(t.c.group_id.in_(part)))})
    for part in _chunks(sorted(prompts)):
        q = select(t.c.run, t.c.prompt_id, t.c.epoch, t.c.group_id).where(
            tuple_(t.c.run, t.c.prompt_id, t.c.epoch).in_(list(part)))
        held.update({(r.run, r.prompt_id, int(r.epoch)): r.group_id for r in conn.execute(q)})
    new = sorted(g for g in check_plain if g not in groups)
    for part in _chunks(new):
        q = select(trajectories.c.group_id).where(trajectories.c.group_id.in_(part)).distinct()
        plain.update(r.group_id for r in conn.execute(q))
    return groups, held, plain


def write_ledger(conn: Any, d: SqlDialect, rows: Sequence[Mapping[str, Any]], now: float) -> None:
    """The ``ledger_groups`` changes of an append's events (their ``ledger`` change,
    ``trajstore.rollout._ledger.LedgerChange``), at the events' positions, in group id order:
    groups started, the guard of starts outside the ledger, trajectories finished,
    then groups dropped. Finishes and guards need no position (the pipelined append)."""
    starts: dict[str, list[Any]] = {}
    finishes: dict[str, list[int]] = {}
    drops: dict[str, tuple[int, str | None]] = {}
    plain: set[str] = set()
    for r in rows:
        change = r.get("ledger")
        if change is None:
            continue
        if change.kind == "plain":
            plain.add(change.group_id)
        elif change.kind == "start":
            got = starts.get(change.group_id)
            if got is None:
                starts[change.group_id] = [change, r["position"], 1]
            else:
                got[2] += 1
        elif change.kind == "finish":
            counts = finishes.setdefault(change.group_id, [0, 0])
            counts[0 if change.whole else 1] += 1
        else:
            drops[change.group_id] = (r["position"], change.reason)
    t = ledger_groups
    table = d.table(t)
    if starts:
        names = ("group_id", "run", "prompt_id", "epoch", "group_size", "num_started", "num_finished", "num_failed",
                 "started_position", "started_at")
        upsert = d._cached(("ledger upsert",), lambda: (
            f"INSERT INTO {table} ({', '.join(d.col(t.c[n]) for n in names)}) VALUES ({d.marks(len(names))}) "
            f"ON CONFLICT ({d.col(t.c.group_id)}) DO UPDATE SET "
            f"{d.col(t.c.num_started)} = {table}.{d.col(t.c.num_started)} + excluded.{d.col(t.c.num_started)}"))
        # the guard: a group found with other fields, or dropped, gets a copy of its row
        # inserted, which its primary key refuses (a lost race: ``StaleState``)
        guard = d._cached(("ledger guard",), lambda: (
            f"INSERT INTO {table} SELECT * FROM {table} WHERE {d.col(t.c.group_id)} = {d.p} AND NOT ("
            + " AND ".join(f"{d.col(t.c[n])} = {d.p}" for n in ("run", "prompt_id", "epoch", "group_size"))
            + f" AND {d.col(t.c.dropped_position)} IS NULL)"))
        ordered = sorted(starts)
        execute(conn, upsert, [(gid, *starts[gid][0].fields, starts[gid][2], 0, 0, starts[gid][1], now)
                               for gid in ordered])
        execute(conn, guard, [(gid, *starts[gid][0].fields) for gid in ordered])
    if plain:
        # trajectories started without the ledger's fields, admitted without reading the
        # ledger: a ledger group of their group id fails this guard (the retry reads it)
        guard = d._cached(("ledger plain guard",), lambda: (
            f"INSERT INTO {table} SELECT * FROM {table} WHERE {d.col(t.c.group_id)} = {d.p}"))
        execute(conn, guard, [(gid,) for gid in sorted(plain)])
    if finishes:
        sql = d._cached(("ledger finish",), lambda: (
            f"UPDATE {table} SET {d.col(t.c.num_finished)} = {d.col(t.c.num_finished)} + {d.p}, "
            f"{d.col(t.c.num_failed)} = {d.col(t.c.num_failed)} + {d.p} WHERE {d.col(t.c.group_id)} = {d.p}"))
        execute(conn, sql, [(ok, failed, gid) for gid, (ok, failed) in sorted(finishes.items())])
    if drops:
        drop = d._cached(("ledger drop",), lambda: (
            f"UPDATE {table} SET {d.col(t.c.dropped_position)} = {d.p}, {d.col(t.c.dropped_reason)} = {d.p}, "
            f"{d.col(t.c.dropped_at)} = {d.p} WHERE {d.col(t.c.group_id)} = {d.p} "
            f"AND {d.col(t.c.dropped_position)} IS NULL"))
        # dropped by another append meanwhile: the same guard
        guard = d._cached(("ledger drop guard",), lambda: (
            f"INSERT INTO {table} SELECT * FROM {table} WHERE {d.col(t.c.group_id)} = {d.p} "
            f"AND {d.col(t.c.dropped_position)} <> {d.p}"))
        ordered = sorted(drops)
        execute(conn, drop, [(drops[gid][0], drops[gid][1], now, gid) for gid in ordered])
        execute(conn, guard, [(gid, drops[gid][0]) for gid in ordered])


def run_groups(conn: Connection, run: str) -> list[tuple]:
    """``run``'s ledger groups, oldest first (by their first trajectory_started): tuples of
    ``GROUP_COLUMNS`` (plain tuples: a run of 100,000 groups reads them in one pass)."""
    t = ledger_groups
    q = select(*[t.c[n] for n in GROUP_COLUMNS]).where(t.c.run == run).order_by(t.c.started_position)
    return [tuple(r) for r in conn.execute(q)]


def run_members(conn: Connection, run: str) -> list[tuple[str, str, str, int]]:
    """``(group_id, trajectory_id, status, last_seq)`` of every trajectory of ``run``'s
    ledger groups, in the order they started."""
    t, g = trajectories, ledger_groups
    q = (select(t.c.group_id, t.c.trajectory_id, t.c.status, t.c.last_seq)
         .select_from(g.join(t, t.c.group_id == g.c.group_id))
         .where(g.c.run == run).order_by(t.c.started_position))
    return [tuple(r) for r in conn.execute(q)]
