"""Long-running materializer: keeps folding finished trajectories as they arrive.

    python workers/materializer.py --store URL [--shard 0 --num-shards 1] [--poll-s 1.0] [--gc-grace-s 1] [--abandon-after-s S]

Shard 0 also runs the payload GC in a thread of its own: every ``--gc-interval-s``
(default 0.5) it deletes the segments the index lists as retired more than
``--gc-grace-s`` (the margin, default 1) ago, or before the oldest live reader
lease: one copy of every folded token is the state at rest.

SIGTERM / SIGINT stop it after the step in progress commits (a step is one
transaction, so stopping between steps loses nothing). Prints one JSON line
per step that folded (or recorded as unfoldable) something.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from trajstore._gc import GC_INTERVAL_S, GC_MARGIN_S
from trajstore.errors import TrajstoreError
from trajstore.materializer import Materializer
from trajstore.store import connect


def run(store_url: str | None, *, shard: int, num_shards: int, poll_s: float, stop: threading.Event,
        payload: str | None = None, max_trajectories: int = 256, gc_grace_s: float | None = GC_MARGIN_S,
        gc_interval_s: float = GC_INTERVAL_S, abandon_after_s: float | None = None) -> None:
    """``gc_grace_s``: collect retired payload after this grace (None: never; by default
    only shard 0 collects)."""
    store = connect(store_url, payload=payload)
    m = Materializer(store, shard_index=shard, num_shards=num_shards, max_trajectories=max_trajectories)
    try:
        m.follow(stop, poll_s=poll_s, gc_grace_s=gc_grace_s if shard == 0 else None, gc_interval_s=gc_interval_s,
                 abandon_after_s=abandon_after_s,
                 on_step=lambda stats: print(json.dumps(stats.to_dict()), flush=True))
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default=None)
    p.add_argument("--payload", default=None)
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument("--poll-s", type=float, default=1.0)
    p.add_argument("--max-trajectories", "--batch-size", type=int, default=256, dest="max_trajectories",
                   help="finished trajectories folded per step (--batch-size: its old name)")
    p.add_argument("--gc-grace-s", type=float, default=GC_MARGIN_S,
                   help="delete retired payload files this long after retirement, or after the oldest live "
                        f"reader lease (default {GC_MARGIN_S:g}; negative: never)")
    p.add_argument("--gc-interval-s", type=float, default=GC_INTERVAL_S,
                   help=f"how often the GC worker looks at the retired list (default {GC_INTERVAL_S:g})")
    p.add_argument("--abandon-after-s", type=float, default=None,
                   help="finish running trajectories with no event for this long as 'abandoned' (default: never)")
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        run(args.store, shard=args.shard, num_shards=args.num_shards, poll_s=args.poll_s, stop=stop,
            payload=args.payload, max_trajectories=args.max_trajectories,
            gc_grace_s=None if args.gc_grace_s < 0 else args.gc_grace_s, gc_interval_s=args.gc_interval_s,
            abandon_after_s=args.abandon_after_s)
    except TrajstoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
