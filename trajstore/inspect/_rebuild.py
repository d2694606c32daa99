"""``trajstore report --rebuild-aggregates``: count the run aggregates again from the log and
the samples (docs/report.md, "Aggregates").

What a store upgraded with samples needs once (migrations 0015 and 0019 count the
log's part themselves, not the samples' token columns, which are in the payload), and
what repairs the tables should they ever disagree with the store. Three write
transactions: the log's aggregates from every generation, start and finish
event (into total rows: the appends' deltas are replaced), then the samples'
from every default sample's segment rows, then the finished trajectories' and
their samples' (``agg_trajectory_stats`` and the tables migration 0020 made) from
the index rows; on PostgreSQL each holds
its tables' lock (appends, then materializer commits, wait for it), on SQLite
the write lock does the same."""

from __future__ import annotations

from typing import Any, Callable

from trajstore.errors import CorruptStoreError, StoreUnavailable, TrajstoreError, first_line

__all__: list[str] = []


def rebuild_aggregates(store: Any, *, progress: Callable[[int], None] | None = None) -> dict[str, int]:
    """Recount every aggregate table of ``store`` (a ``trajstore.Store``); returns
    ``{"events": generation events read, "samples": samples read}``."""
    from trajstore.inspect._panels_tokens import _read_samples
    from trajstore.log._aggregates import (rebuild_event_aggregates, rebuild_sample_aggregates,
                                           rebuild_trajectory_aggregates)

    db = store.log.db
    events = db.transaction("recounting the run aggregates of the log",
                            lambda conn, d: rebuild_event_aggregates(conn, d))
    location = store.payload.location

    def read(rows: list[tuple]) -> list[Any]:
        try:
            got = _read_samples(location, rows)
        except (StoreUnavailable, CorruptStoreError, ValueError) as e:  # nothing is recounted: it rolls back
            raise TrajstoreError(f"cannot read the sample segments under {location} to recount the aggregates: "
                                 f"{first_line(e) or type(e).__name__}") from None
        if progress:
            progress(len(rows))
        return got

    samples = db.transaction("recounting the run aggregates of the samples",
                             lambda conn, d: rebuild_sample_aggregates(conn, d, read))
    counted = db.transaction("recounting the run aggregates of the finished trajectories",
                             lambda conn, d: rebuild_trajectory_aggregates(conn, d))
    return {"events": events, "samples": samples, "trajectories": counted}
