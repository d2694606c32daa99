"""Deprecated: the long-running materializer is ``trajstore materialize --follow``
(installed with the package; docs/materializer.md, "One worker beside the run").

    python workers/materializer.py --store URL [--shard 0 --num-shards 1] [--poll-s 1.0] [--gc-grace-s 1] [--abandon-after-s S]

still works, with the same flags and output (one JSON line per step on
stdout), and warns once: it runs ``trajstore materialize --follow``.
SIGTERM / SIGINT stop it after the step in progress commits; exit 0.
"""

from __future__ import annotations

import sys
import threading
import warnings

from trajstore._upkeep.gc import GC_INTERVAL_S, GC_MARGIN_S
from trajstore.cli import main as trajstore_main

MOVED = "workers/materializer.py is deprecated; run `trajstore materialize --follow` (same flags)"


def run(store_url: str | None, *, shard: int, num_shards: int, poll_s: float, stop: threading.Event,
        payload: str | None = None, max_trajectories: int = 256, gc_grace_s: float | None = GC_MARGIN_S,
        gc_interval_s: float = GC_INTERVAL_S, abandon_after_s: float | None = None) -> None:
    """Fold until ``stop`` is set (``Materializer.follow``); ``gc_grace_s`` None: no collection
    (only shard 0 collects)."""
    from trajstore.materializer import Materializer
    from trajstore.store import connect

    warnings.warn(MOVED, DeprecationWarning, stacklevel=2)
    store = connect(store_url, payload=payload)
    m = Materializer(store, shard_index=shard, num_shards=num_shards, max_trajectories=max_trajectories)
    try:
        m.follow(stop, poll_s=poll_s, gc_grace_s=gc_grace_s if shard == 0 else None, gc_interval_s=gc_interval_s,
                 abandon_after_s=abandon_after_s)
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    warnings.warn(MOVED, DeprecationWarning, stacklevel=2)
    argv = ["--max-trajectories" if a == "--batch-size" else a for a in argv]  # its old name here
    return trajstore_main(["materialize", "--follow", *argv])


if __name__ == "__main__":
    warnings.simplefilter("default", DeprecationWarning)  # shown once, on stderr
    sys.exit(main())
