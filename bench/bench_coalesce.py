"""Engine calls per payload object and round trips per committed batch, at an offered rate.

    PYTHONPATH=<tree> python bench/bench_coalesce.py [--rate 3300] [--trajectories 512] [--turns 8]
        [--linger-ms 20] [--backends sqlite,postgres]

One producer thread offers ``rate`` engine calls per second (turn-major over
``trajectories`` multi-turn trajectories: each call a generation continuing
its trajectory's sequence, 16 new prompt tokens and 16 output tokens with
logprobs) to the group committer every write path shares
(``trajstore.ingest._group_commit.GroupCommitter``: the ingest service's, the
proxies', the Writer's store sink's) without waiting for acknowledgements,
as the service's and the proxies' request handlers do. A tree whose
committer has no linger runs it as it was (groups of what queued during the
previous append).

Reported per backend: the rate achieved (calls acknowledged per second of
the run), calls per payload object (generation events / distinct segments
they point at, read from the index), and on PostgreSQL the round trips per
committed batch, counted from libpq's protocol trace of every connection
(tests/pg_roundtrips.py: a round trip is one turn from client messages to
server messages, so pipelined statements count once; SQLAlchemy's
``before_cursor_execute`` does not see the append's driver cursors, the
pool's pings or the driver's implicit BEGIN).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _committer(store, linger_s: float):
    from trajstore.ingest._group_commit import GroupCommitter

    try:
        return GroupCommitter(store, max_wait_s=0.0, linger_s=linger_s), True
    except TypeError:  # a tree from before the linger
        return GroupCommitter(store, max_wait_s=0.0), False


def _call(tid: str, turn: int) -> dict:
    prompt = np.arange(16 + 32 * turn, dtype=np.int32) % 1000
    return {"type": "generation", "trajectory_id": tid, "seq": turn, "prompt_ids": prompt,
            "output_ids": (np.arange(16, dtype=np.int32) + 16 + 32 * turn) % 1000,
            "logprobs": np.full(16, -0.5, dtype=np.float32), "model_version": 1, "event_id": f"{tid}-{turn}"}


def run(url: str, payload: str, rate: float, n_traj: int, turns: int, linger_s: float,
        trace_pg: bool) -> dict:
    import trajstore
    from sqlalchemy import text

    store = trajstore.connect(url, payload=payload)
    tids = [f"t{i}" for i in range(n_traj)]
    store.append([{"type": "trajectory_started", "trajectory_id": t, "event_id": f"{t}-s"} for t in tids])
    calls = [_call(t, k) for k in range(turns) for t in tids]  # turn-major: a rollout's next call per trajectory
    trips = None
    if trace_pg:
        from pg_roundtrips import RoundTrips

        trips = RoundTrips(store.log.db.write_engine)
        store.append([_call(t, 0) for t in tids[:1]])  # a traced connection, its statements prepared
        trips.reset()
        calls = [c for c in calls if not (c["trajectory_id"] == tids[0] and c["seq"] == 0)]
    committer, lingers = _committer(store, linger_s)
    futures = []
    t0 = time.perf_counter()
    for i, call in enumerate(calls):
        due = t0 + i / rate
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        futures.append(committer.submit([call]))
    offered_s = time.perf_counter() - t0
    for f in futures:
        f.result()
    wall = time.perf_counter() - t0
    committer.close()
    with store.log.db.read_engine.connect() as conn:
        n_gen, n_seg = conn.execute(text("SELECT count(*), count(DISTINCT segment) FROM events "
                                         "WHERE type = 'generation'")).one()
    out = {"calls": len(calls), "offered_per_s": len(calls) / offered_s, "achieved_per_s": len(calls) / wall,
           "calls_per_object": n_gen / max(1, n_seg), "lingers": lingers}
    if trips is not None:
        c = trips.counts()
        out.update(round_trips=c["round_trips"], commits=c["commits"], pings=c["pings"],
                   round_trips_per_batch=c["round_trips"] / max(1, c["commits"]))
        trips.close()
    store.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=3300.0)
    ap.add_argument("--trajectories", type=int, default=512)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--linger-ms", type=float, default=20.0)
    ap.add_argument("--backends", default="sqlite,postgres")
    args = ap.parse_args()
    import trajstore

    print(f"trajstore from {os.path.dirname(trajstore.__file__)}; offered {args.rate:g} calls/s, "
          f"{args.trajectories} trajectories x {args.turns} turns, linger {args.linger_ms:g} ms")
    for backend in args.backends.split(","):
        with tempfile.TemporaryDirectory() as d:
            if backend == "sqlite":
                res = run(f"sqlite:///{d}/s.db", f"{d}/p", args.rate, args.trajectories, args.turns,
                          args.linger_ms / 1e3, False)
            else:
                from pg_cluster import PgCluster

                with PgCluster() as cluster:
                    res = run(cluster.create_database("bench"), f"{d}/p", args.rate, args.trajectories,
                              args.turns, args.linger_ms / 1e3, True)
        print(f"{backend}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in res.items()))
        sys.stdout.flush()


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    main()
