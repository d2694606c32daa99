"""What moves each panel: the live page reruns only the SQL of panels whose tables may have changed.

The change query (``SIGNALS_SQL``) answers, in one short read-only statement of index probes and
tiny counts, one token per kind of write:

* ``rollout``: the newest log position of each rollout event type (an append of trajectories,
  calls, rewards, version labels, dropped groups; the aggregates counted at append move with it);
* ``lineage``: the newest position of each training-lineage type (``train_step``,
  ``sample_annotation``);
* ``fold``: the materializers' and projections' checkpoints (a fold writes samples and the
  aggregates counted at its commit);
* ``compaction``: what the background compaction has left to count (``agg_expert_pending``,
  ``agg_groups_delta``: counting them changes the expert load and the settled groups);
* ``log``: the newest position of all (an event of a type not listed above moves everything).

A panel's SQL names its tables; ``SOURCES`` maps each table (or view) to the kinds of write
that change what it reads. A table not listed is taken to change with every kind.
``tests/inspect/test_report_sources.py`` checks the map on both backends: after each kind of
write alone, every panel that does not name it reads exactly what it read before.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Sequence

from trajstore.events._types import LINEAGE_TYPES
from trajstore.log._aggregate_counts import DELTA_ROWS, FOLD_DELTAS

__all__: list[str] = []

ROLLOUT_TYPES = ("trajectory_started", "generation", "reward", "trajectory_finished", "version_label",
                 "group_dropped")
KINDS = ("rollout", "lineage", "fold", "compaction")

_KIND_SQL: dict[str, tuple[str, ...]] = {
    "log": ("(SELECT max(position) FROM events)",),
    "rollout": tuple(f"(SELECT max(position) FROM events WHERE type = '{t}')" for t in ROLLOUT_TYPES),
    "lineage": tuple(f"(SELECT max(position) FROM events WHERE type = '{t}')" for t in LINEAGE_TYPES),
    "fold": ("(SELECT max(updated_at) FROM materializer_checkpoints)", "(SELECT sum(position) FROM materializer_checkpoints)",
             "(SELECT count(*) FROM materializer_checkpoints)", "(SELECT max(updated_at) FROM projection_checkpoints)"),
    "compaction": ("(SELECT count(*) FROM agg_expert_pending)", "(SELECT count(*) FROM agg_groups_delta)"),
}
SIGNALS_SQL = "SELECT " + ", ".join(q for qs in _KIND_SQL.values() for q in qs)
"""Every kind's token in one row (index probes on ``ix_events_type_position`` and primary keys)."""

_R, _L, _F, _C = ({"rollout"}, {"lineage"}, {"fold"}, {"compaction"})
SOURCES: dict[str, set[str]] = {
    # the log's own rows, and the aggregates an append counts (``DELTA_ROWS``)
    **{t: _R for t in ("events", "trajectories", "version_labels", "unresolved_labels", "ledger_groups", *DELTA_ROWS)},
    # what a fold writes: samples, and the aggregates its commit counts (``FOLD_DELTAS``); the compaction
    # settles the groups (and their variance) and counts the expert load of pending segments
    **{t: _F for t in ("samples", "agg_trajectory_stats", "unfoldable_trajectories", "materializer_checkpoints",
                       "projection_samples", "projection_checkpoints", "projection_unfoldable", *FOLD_DELTAS)},
    "agg_groups": _F | _C, "agg_group_variance": _F | _C, "agg_expert_load": _F | _C, "agg_expert_pending": _F | _C,
    # the trainer's lineage (and the views over it)
    **{t: _L for t in ("lineage_steps", "lineage_step_samples", "lineage_annotations", "lineage_annotation_versions",
                       "sample_consumption", "train_steps", "train_rollout_mismatch",
                       "train_rollout_mismatch_by_version")},
    # settings: the aggregates' state after an upgrade or a recount (neither moves a token: the live page
    # recomputes everything at least every MAX_AGE_S anyway)
    "store_settings": _F,
}


def tokens(row: Sequence[Any]) -> dict[str, tuple]:
    """``SIGNALS_SQL``'s row as ``{kind: token}``."""
    out, at = {}, 0
    for kind, qs in _KIND_SQL.items():
        out[kind] = tuple(row[at:at + len(qs)])
        at += len(qs)
    return out


def moved(before: dict[str, tuple] | None, now: dict[str, tuple]) -> set[str] | None:
    """The kinds of write between two tokens; None: anything may have changed (no earlier token, or
    a log position no listed type accounts for)."""
    if before is None:
        return None
    kinds = {k for k in KINDS if before.get(k) != now.get(k)}
    if before.get("log") != now.get("log") and not kinds & {"rollout", "lineage"}:
        return None
    return kinds


_TABLE = re.compile(r"\b(?:FROM|JOIN)\s+([A-Za-z_][A-Za-z0-9_]*)", re.IGNORECASE)


@lru_cache(maxsize=4096)
def _kinds_of(sql: str) -> frozenset[str]:
    kinds: set[str] = set()
    for table in _TABLE.findall(sql):
        name = table.lower()
        name = name[:-len("_delta")] if name.endswith("_delta") and name[:-len("_delta")] in SOURCES else name
        kinds |= SOURCES.get(name, set(KINDS))
    return frozenset(kinds)


def kinds_of(sql: Sequence[str]) -> frozenset[str]:
    """The kinds of write that may change what the statements ``sql`` read."""
    out: frozenset[str] = frozenset()
    for q in sql:
        out |= _kinds_of(q)
    return out
