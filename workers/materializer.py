"""Long-running materializer: keeps folding finished trajectories as they arrive.

    python workers/materializer.py --store URL [--shard 0 --num-shards 1] [--poll-s 1.0]

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

from trajstore.errors import TrajstoreError
from trajstore.materializer import Materializer
from trajstore.store import connect


def run(store_url: str | None, *, shard: int, num_shards: int, poll_s: float, stop: threading.Event,
        payload: str | None = None, max_trajectories: int = 256) -> None:
    store = connect(store_url, payload=payload)
    m = Materializer(store, shard_index=shard, num_shards=num_shards, max_trajectories=max_trajectories)
    try:
        while not stop.is_set():
            stats = m.run(max_steps=1)
            if stats.num_trajectories or stats.num_unfoldable:
                print(json.dumps(stats.to_dict()), flush=True)
            elif m.pending() == 0:
                stop.wait(poll_s)  # nothing to do: sleep, but wake at once on SIGTERM
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
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        run(args.store, shard=args.shard, num_shards=args.num_shards, poll_s=args.poll_s, stop=stop,
            payload=args.payload, max_trajectories=args.max_trajectories)
    except TrajstoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
