"""Compaction of the log's payload: many small log segments rewritten into few (``trajstore gc --compact``).

The live rows (events not re-pointed yet: trajectories the materializer has not
folded) of the oldest log segments smaller than half the target go into one new
segment, re-pointed in one transaction guarded by every moved event's current
locator; the old segments are retired and the GC deletes them after its grace.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import pyarrow as pa

from trajstore.log.base import EventLog, Repoint, StaleState
from trajstore.payload import PayloadStore
from trajstore.payload._format import SegmentKind


class _Parts(Protocol):
    """What this module uses of a ``Store``."""

    log: EventLog
    payload: PayloadStore

__all__ = ["compact"]

log = logging.getLogger(__name__)


def compact(store: _Parts, *, target_bytes: int = 64 << 20, max_rounds: int | None = None) -> dict[str, int]:
    """Rewrite many small log segments into few: the live rows (events not
    re-pointed yet, i.e. of trajectories the materializer has not folded)
    of the oldest log segments smaller than ``target_bytes / 2`` go into one
    new segment of about ``target_bytes``, re-pointed in one transaction
    guarded by every moved event's current locator; the old segments are
    retired (``collect_garbage`` deletes them after its grace). A crash
    before that commit leaves only an unreferenced new file. Memory is
    bounded by one round (``target_bytes`` of payload).

    Returns ``{"rounds", "segments_retired", "events_moved", "segments_written"}``."""
    stats = {"rounds": 0, "segments_retired": 0, "events_moved": 0, "segments_written": 0}
    while max_rounds is None or stats["rounds"] < max_rounds:
        done = _round(store, target_bytes)
        if done is None:
            break
        stats["rounds"] += 1
        stats["segments_retired"] += done[0]
        stats["events_moved"] += done[1]
        stats["segments_written"] += 1 if done[1] else 0
    return stats


def _round(store: _Parts, target_bytes: int) -> tuple[int, int] | None:
    """One compaction; (segments emptied, events moved), None when nothing is worth it."""
    cands = store.log.compaction_candidates(max_bytes=max(1, target_bytes // 2), limit_bytes=target_bytes)
    if len(cands) < 2:
        return None
    names = [c["name"] for c in cands]
    live = store.log.live_locators(names)
    holding = {r["segment"] for r in live}
    # Candidates without live rows (emptied by re-pointings that raced each other's
    # retiring) are retired here; left alone they would be picked again every round.
    retired = len(store.log.retire_unreferenced(time.time())) if len(holding) < len(names) else 0
    if len(holding) < 2:
        # Rewriting one segment's rows into another gains nothing (and would go on
        # forever: the copy is small enough to be a candidate again).
        return (retired, 0) if retired else None
    names = sorted(holding)
    tables = store.payload.read_locators(live)
    parts = [tables[r["segment"]].row(int(r["segment_row"])) for r in live]
    table = pa.concat_tables(parts, promote_options="default").combine_chunks()
    name = SegmentKind.EVENTS.new_name()
    size = store.payload.write(name, table, rows_per_batch=1)
    seg_row = {"name": name, "kind": "events", "num_rows": len(live), "num_bytes": size,
               "created_at": time.time()}
    moves = [Repoint(int(r["position"]), name, k, None, r["segment"], int(r["segment_row"]))
             for k, r in enumerate(live)]
    try:
        store.log.commit_compaction(seg_row, moves)
    except StaleState:
        # the materializer re-pointed some of them meanwhile and nothing was stored:
        # the new file is garbage no row names; the next round starts from fresh locators
        store.payload.delete(name)
        log.info("compaction of %d segments lost a race with the materializer; retrying", len(names))
        return 0, 0
    return len(names) + retired, len(moves)
