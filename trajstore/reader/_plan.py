"""The reader's step planning, with no I/O: units, steps and the partitioning.

Units. ``UnitBuilder`` turns sample rows, in their stable order
``(finished_position, sample_index)``, into *units*: one sample each, or
with ``keep_groups`` one whole GRPO group (``group_size`` trajectories with
the same ``group_id``), placed where its last trajectory finished. A unit's
*key* is the order key of its last row, so the unit sequence is prefix-stable.

Steps. ``plan_step`` decides how many of the next units one global step
takes and which rank gets each. It is a pure function of the units' costs,
the world size and the capacity, so every rank computes the same plan and it
is tested on its own (``tests/test_reader.py``). ``SampleReader``
(``reader.py``) reads the rows and the payload and carries the resume state.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from trajstore.errors import CorruptStoreError
from trajstore.events import WHOLE_STATUSES

__all__ = ["Key", "Step", "Unit", "UnitBuilder", "plan_step", "row_key"]

Key = tuple[int, int]  # (finished_position, sample_index)


def row_key(row: dict[str, Any]) -> Key:
    """A sample row's place in the stable order."""
    return int(row["finished_position"]), int(row["sample_index"])


@dataclass(eq=False)
class Unit:
    """What the reader schedules: one sample, or one whole group."""

    rows: list[dict[str, Any]]
    kept: list[dict[str, Any]] = field(default_factory=list)  # rows passing the status filter
    num_tokens: int = 0
    oldest_version: int = 0

    @property
    def key(self) -> Key:
        return row_key(self.rows[-1])

    @property
    def first(self) -> Key:
        return row_key(self.rows[0])


@dataclass
class Step:
    """One global step: the units of each rank, and the reader state after it."""

    index: int
    bins: list[list[Unit]] | None  # per rank; None when every unit of the step was skipped
    state: dict[str, Any]


def plan_step(costs: Sequence[int], world_size: int, capacity: int) -> tuple[int, list[list[int]]]:
    """How many of the next units (with these costs) one global step takes, and
    which of them go to each rank.

    The step takes the longest prefix whose total fits ``world_size *
    capacity`` and that packs into ``world_size`` bins of ``capacity``
    (longest first onto the least-loaded rank, which balances the ranks); a
    unit bigger than ``capacity`` fits only an empty bin. Always at least one
    unit. Each bin lists its units in sequence order. Pure, so every rank
    computes the same plan.
    """
    total, n = 0, 0
    for c in costs:
        if n and total + c > world_size * capacity:
            break
        total, n = total + c, n + 1
    while n > 1:
        bins = _pack(costs[:n], world_size, capacity)
        if bins is not None:
            return n, bins
        n -= 1
    return n, [[0] if n and r == 0 else [] for r in range(world_size)]


def _pack(costs: Sequence[int], world_size: int, capacity: int) -> list[list[int]] | None:
    loads = [(0, r) for r in range(world_size)]  # a heap of (load, rank): ties go to the lower rank
    bins: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(loads)
        if load and load + costs[i] > capacity:
            return None
        bins[r].append(i)
        heapq.heappush(loads, (load + costs[i], r))
    return [sorted(b) for b in bins]


class UnitBuilder:
    """Turns sample rows (in order) into units, holding trajectories and groups until complete.

    ``keep_groups``, ``group_size`` and ``status`` mean what they mean in
    ``ReaderConfig``. On resume the reader sets ``seed(group_id)``: how many of
    a group's trajectories were already counted before the rescan.

    Groups of the rollout ledger (docs/reference.md "Rollout ledger") count as the
    ledger does: ``ledger(group_ids)`` gives ``{group_id: (group_size, dropped)}``
    of the ledger groups among them, asked once per page of rows (``learn``). A
    ledger group is whole when its own ``group_size`` trajectories finished
    completed or truncated (aborted and failed ones ride along, never counted);
    a trajectory finishing after that is not part of it; a dropped group's
    samples are never handed out, with or without ``keep_groups``."""

    def __init__(self, *, keep_groups: bool, group_size: int | None, status: tuple[str, ...] | None,
                 ledger: Callable[[set[str]], dict[str, tuple[int, bool]]] | None = None) -> None:
        self.keep_groups, self.group_size, self.status = keep_groups, group_size, status
        self.trajectory: list[dict[str, Any]] = []
        self.groups: dict[str, list[Any]] = {}  # group_id -> [trajectories seen, rows]
        self.seed: Callable[[str], int] | None = None
        self.ledger, self.ledger_groups = ledger, {}  # group_id -> (group_size, dropped), or None
        self.whole: set[str] = set()  # ledger groups handed out whole

    def learn(self, rows: Sequence[dict[str, Any]]) -> None:
        """The ledger state of the groups of a page of rows, before its rows are added."""
        if self.ledger is None:
            return
        ids = {r["group_id"] for r in rows if r["group_id"] is not None}
        if ids:
            self.ledger_groups.update(dict.fromkeys(ids))
            self.ledger_groups.update(self.ledger(ids))

    def add(self, row: dict[str, Any]) -> Unit | None:
        ledger = self.ledger_groups.get(row["group_id"]) if row["group_id"] is not None else None
        if not self.keep_groups:
            return None if ledger is not None and ledger[1] else self._unit([row])
        if self.trajectory and row["finished_position"] != self.trajectory[0]["finished_position"]:
            raise _corrupt(self.trajectory[0])
        self.trajectory.append(row)
        if not row["is_last_step"]:
            return None
        rows, self.trajectory = self.trajectory, []
        group_id = rows[0]["group_id"]
        if group_id is None:
            return self._unit(rows)
        if ledger is not None:
            return self._add_to_ledger_group(group_id, rows, *ledger)
        if group_id not in self.groups:
            self.groups[group_id] = [self.seed(group_id) if self.seed else 0, []]
        group = self.groups[group_id]
        group[0] += 1
        group[1].extend(rows)
        if group[0] < self.group_size:
            return None
        del self.groups[group_id]
        return self._unit(group[1])

    def _add_to_ledger_group(self, group_id: str, rows: list[dict[str, Any]], size: int, dropped: bool
                             ) -> Unit | None:
        if dropped or group_id in self.whole:
            self.groups.pop(group_id, None)  # a dropped group's rows go, held ones too
            return None
        group = self.groups.setdefault(group_id, [0, []])
        group[0] += rows[0]["status"] in WHOLE_STATUSES
        group[1].extend(rows)
        if group[0] < size:
            return None
        del self.groups[group_id]
        self.whole.add(group_id)
        return self._unit(group[1])

    def first_pending(self) -> Key | None:
        """Key of the earliest row held in an incomplete trajectory or group."""
        firsts = [row_key(g[1][0]) for g in self.groups.values() if g[1]]
        if self.trajectory:
            firsts.append(row_key(self.trajectory[0]))
        return min(firsts, default=None)

    def _unit(self, rows: list[dict[str, Any]]) -> Unit:
        status = self.status
        kept = rows if status is None else [r for r in rows if r["status"] in status]
        return Unit(rows, kept, sum(int(r["prompt_len"]) + int(r["response_len"]) for r in kept),
                    min((int(r["min_model_version"]) for r in kept), default=0))


def _corrupt(row: dict[str, Any]) -> CorruptStoreError:
    return CorruptStoreError(f"trajectory {row['trajectory_id']!r} has no sample marked is_last_step")
