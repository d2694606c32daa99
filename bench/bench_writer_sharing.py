"""Writers of one store URL in one process: engine calls per payload object.

    PYTHONPATH=<tree> python bench/bench_writer_sharing.py [--writers 8] [--rate 800] [--seconds 6]
        [--backend sqlite|postgres]

``--writers`` threads, each with its own ``trajstore.Writer(url)`` made from
the same store URL (as a process running several rollout workers does),
together offer ``--rate`` engine calls per second for ``--seconds`` (each
call a generation continuing its trajectory, 16 new prompt and 16 output
tokens with logprobs; every writer has its own trajectories). Writers that
share the URL's one store share its group committer, so their batches can go
into one payload object and one index transaction; writers with a store each
cannot. Reported: calls achieved per second, calls per payload object
(generation events / distinct segments they point at, read from the index),
and the process CPU per call. Run it with each tree's ``PYTHONPATH`` to
compare.
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


def _call(tid: str, turn: int) -> dict:
    prompt = np.arange(16 + 32 * turn, dtype=np.int32) % 1000
    return {"type": "generation", "trajectory_id": tid, "seq": turn, "prompt_ids": prompt,
            "output_ids": (np.arange(16, dtype=np.int32) + 16 + 32 * turn) % 1000,
            "logprobs": np.full(16, -0.5, dtype=np.float32), "model_version": 1}


def run(url: str, payload: str, writers: int, rate: float, seconds: float, trajectories: int = 16) -> dict:
    import trajstore
    from trajstore.ingest.client import Writer

    trajstore.connect(url, payload=payload).close()  # the payload location is recorded once
    ws = [Writer(url) for _ in range(writers)]
    stores = {id(w._sink.store) for w in ws}
    go = threading.Barrier(writers + 1)
    counts = [0] * writers

    def produce(k: int) -> None:
        w = ws[k]
        tids = [f"w{k}-t{i}" for i in range(trajectories)]
        for t in tids:
            w.put({"type": "trajectory_started", "trajectory_id": t})
        w.flush()
        go.wait()
        period = writers / rate
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < seconds:
            turn, i = divmod(n, trajectories)
            w.put(_call(tids[i], turn))
            n += 1
            pause = t0 + n * period - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        w.flush()
        counts[k] = n

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(writers)]
    for t in threads:
        t.start()
    go.wait()
    c0, t0 = time.process_time(), time.monotonic()
    for t in threads:
        t.join()
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    for w in ws:
        w.close()
    from sqlalchemy import text

    with trajstore.connect(url) as s, s.log.read_engine.connect() as conn:
        gens, segs = conn.execute(text(
            "SELECT count(*), count(DISTINCT segment) FROM events WHERE type = 'generation'")).one()
    calls = sum(counts)
    return {"stores": len(stores), "calls": calls, "calls_per_s": calls / wall, "calls_per_object": gens / max(1, segs),
            "cpu_ms_per_call": cpu / calls * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--rate", type=float, default=800.0)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        if args.backend == "postgres":
            from pg_cluster import PgCluster

            with PgCluster() as pg:
                res = run(pg.create_database("bench"), f"{d}/payload", args.writers, args.rate, args.seconds)
        else:
            res = run(f"sqlite:///{d}/s.db", f"{d}/payload", args.writers, args.rate, args.seconds)
    import trajstore

    print(f"{trajstore.__file__}: {args.writers} writers of one URL ({res['stores']} store(s)), offered "
          f"{args.rate:g} calls/s for {args.seconds:g} s, {args.backend}: achieved {res['calls_per_s']:.0f} calls/s, "
          f"{res['calls_per_object']:.1f} calls per object, {res['cpu_ms_per_call']:.3f} ms CPU per call")


if __name__ == "__main__":
    main()
