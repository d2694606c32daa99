"""The payload GC: copies at rest in a steady append + materialize run, and
objects deleted per second on S3, before (listing, HEAD + DELETE per object)
and after (the index's retired list, one DeleteObjects per 1,000 keys).

    python bench/bench_gc.py [--seconds 120] [--rate 20] [--objects 3000] [--skip-steady] [--skip-s3]

Steady run: a SQLite store on a local payload directory; one thread appends
``--rate`` trajectories/s (two calls each, 256 + 64 and 64 more tokens, 48x8
routes), ``Materializer.follow`` folds them with its default GC settings (the
GC worker thread, 1 s margin, 0.5 s interval). Every 10 s: payload bytes at rest,
bytes of the sample segments (one copy of every folded token), copies at rest
(their ratio) and bytes per token (at rest / tokens appended). ``--grace 3600``
reruns it as the old default (one hour before any delete).

S3: ``moto_server`` on loopback; ``--objects`` retired log segments (small
objects, their ``segments`` rows retired); deleted by ``Store.collect_garbage``
(the full sweep: listing, then HEAD + DELETE per object, 32 in flight) and by
``trajstore._upkeep.gc.collect_retired``; requests counted from the server's log by S3 operation
(bench/_moto.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trajstore  # noqa: E402
from trajstore._upkeep.gc import collect_retired  # noqa: E402
from trajstore.materializer import Materializer  # noqa: E402
from trajstore.schema import segments  # noqa: E402
from _moto import MotoS3, s3_requests  # noqa: E402  (bench/ is on sys.path when run as a script)


def _trajectory(tid: str, rng: np.random.Generator) -> tuple[list[dict], list[dict], int]:
    prompt, out1 = rng.integers(0, 150_000, 256), rng.integers(0, 150_000, 64)
    obs, out2 = rng.integers(0, 150_000, 32), rng.integers(0, 150_000, 64)
    first = [{"type": "trajectory_started", "trajectory_id": tid, "num_experts": 128},
             {"type": "generation", "trajectory_id": tid, "seq": 0, "prompt_ids": prompt, "output_ids": out1,
              "model_version": 0, "routed_experts": rng.integers(0, 128, (319, 48, 8), dtype=np.uint8)}]
    p2 = np.concatenate([prompt, out1, obs])
    second = [{"type": "generation", "trajectory_id": tid, "seq": 1, "prompt_ids": p2, "output_ids": out2,
               "model_version": 0, "routed_experts": rng.integers(0, 128, (len(p2) + 63, 48, 8), dtype=np.uint8)},
              {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}]
    return first, second, len(p2) + len(out2)


def _bytes(root: str) -> tuple[int, int]:
    total = samples = 0
    for e in os.scandir(root):
        try:
            n = e.stat().st_size if e.is_file() else 0
        except FileNotFoundError:  # a temporary file renamed meanwhile
            continue
        if n:
            total += n
            samples += n if e.name.startswith("samples-") else 0
    return total, samples


def steady(seconds: float, rate: float, grace: float | None) -> None:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        payload = f"{d}/payload"
        store = trajstore.connect(f"sqlite:///{d}/s.db", payload=payload)
        stop = threading.Event()
        m = Materializer(store)
        kw = {} if grace is None else {"gc_grace_s": grace}
        folder = threading.Thread(target=m.follow, args=(stop,), kwargs={"poll_s": 0.2, **kw})
        folder.start()
        tokens = [0]

        def append() -> None:
            i = 0
            t0 = time.monotonic()
            while not stop.is_set():
                a, b, n = _trajectory(f"t{i}", rng)
                store.append(a)
                store.append(b)
                tokens[0] += n
                i += 1
                wait = t0 + i / rate - time.monotonic()
                if wait > 0:
                    stop.wait(wait)

        appender = threading.Thread(target=append)
        appender.start()
        label = "default settings" if grace is None else f"gc_grace_s={grace:g}"
        print(f"steady run, {label}: {rate:g} trajectories/s (2 calls, 416 tokens, 48x8 routes)")
        print(f"{'t (s)':>6} {'tokens':>9} {'at rest MB':>10} {'samples MB':>10} {'copies':>7} {'B/token':>8}")
        t0 = time.monotonic()
        worst_after_60 = 0.0
        try:
            while time.monotonic() - t0 < seconds:
                time.sleep(10)
                total, samples = _bytes(payload)
                bpt = total / max(tokens[0], 1)
                if time.monotonic() - t0 > 60:
                    worst_after_60 = max(worst_after_60, bpt)
                print(f"{time.monotonic() - t0:6.0f} {tokens[0]:9d} {total / 1e6:10.1f} {samples / 1e6:10.1f} "
                      f"{total / max(samples, 1):7.3f} {bpt:8.1f}", flush=True)
        finally:
            stop.set()
            appender.join()
            folder.join(60)
        print(f"worst bytes/token after the first minute: {worst_after_60:.1f}")
        store.close()


def s3(objects: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        moto = MotoS3(d)  # bucket "bench"
        log_path = moto.log_path
        try:
            endpoint = moto.endpoint
            print(f"GC on S3 (moto_server, loopback): {objects} retired log segments of 1 KB")
            print(f"{'path':<58} {'s':>6} {'objects/s':>9}  requests")
            for name in ("before", "after"):
                store = trajstore.connect(f"sqlite:///{d}/{name}.db",
                                          payload=f"s3://bench/{name}?endpoint_override={endpoint}&scheme=http")
                fs = store.payload.fs
                names = [f"events-retired-{i:06d}.arrow" for i in range(objects)]
                for n in names:
                    with fs.open_output_stream(store.payload.path(n)) as out:
                        out.write(b"x" * 1024)
                with store.log.write_engine.begin() as conn:
                    conn.execute(segments.insert(), [dict(name=n, kind="events", num_rows=0, num_bytes=1024,
                                                          created_at=0.0, retired_at=1.0) for n in names])
                time.sleep(1)
                start = moto.log_offset()
                t0 = time.perf_counter()
                if name == "before":
                    removed = store.collect_garbage(grace_s=0)
                    what = "before: LIST + HEAD + DELETE per object (32 in flight)"
                else:
                    removed = collect_retired(store, margin_s=0)
                    what = "after: retired list, DeleteObjects per 1,000 keys"
                took = time.perf_counter() - t0
                time.sleep(0.5)
                reqs = s3_requests(log_path, start)[0]
                store.close()
                assert len(removed) >= objects, (name, len(removed))
                print(f"{what:<58} {took:6.2f} {objects / took:9.0f}  "
                      + ", ".join(f"{k} {v}" for k, v in sorted(reqs.items())))
        finally:
            moto.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=120)
    p.add_argument("--rate", type=float, default=20, help="trajectories appended per second")
    p.add_argument("--grace", type=float, default=None, help="gc_grace_s of the fold loop (default: its default)")
    p.add_argument("--objects", type=int, default=3000)
    p.add_argument("--skip-steady", action="store_true")
    p.add_argument("--skip-s3", action="store_true")
    args = p.parse_args()
    if not args.skip_s3:
        s3(args.objects)
    if not args.skip_steady:
        steady(args.seconds, args.rate, args.grace)


if __name__ == "__main__":
    main()
