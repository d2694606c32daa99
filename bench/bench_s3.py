"""Appends with the payload on an S3-compatible server beside a local disk, and GC throughput.

    python bench/bench_s3.py [--appends 200] [--files 400]

Starts ``moto_server`` (the ``dev`` extra) on a loopback port. Appends one
trajectory's generation (256 + 64 tokens, 48x8 routes: ~120 KB of payload) per
call to a SQLite store whose payload is on S3, then on a local directory:
latency p50/p99 and appends/s. Then GC: ``--files`` retired log segments are
deleted from S3 by ``Store.collect_garbage`` (parallel HEAD + DELETE): files/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trajstore  # noqa: E402
from _moto import MotoS3  # noqa: E402  (bench/ is on sys.path when run as a script)


def _calls(n: int, rng: np.random.Generator) -> list[list[dict]]:
    out = []
    for i in range(n):
        tid = f"t{i}"
        out.append([{"type": "trajectory_started", "trajectory_id": tid, "num_experts": 128},
                    {"type": "generation", "trajectory_id": tid, "seq": 0,
                     "prompt_ids": rng.integers(0, 150_000, 256), "output_ids": rng.integers(0, 150_000, 64),
                     "model_version": 0, "routed_experts": rng.integers(0, 128, (319, 48, 8), dtype=np.uint8)},
                    {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}])
    return out


def appends(url: str, payload: str, calls: list[list[dict]]) -> dict:
    store = trajstore.connect(url, payload=payload)
    store.append([{"type": "trajectory_started", "trajectory_id": "warm"}])
    lat = []
    t0 = time.perf_counter()
    for c in calls:
        t = time.perf_counter()
        store.append(c)
        lat.append(time.perf_counter() - t)
    wall = time.perf_counter() - t0
    store.close()
    ms = np.array(lat) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "appends_per_s": len(calls) / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--appends", type=int, default=200)
    p.add_argument("--files", type=int, default=400)
    args = p.parse_args()
    log_dir = tempfile.TemporaryDirectory()
    moto = MotoS3(log_dir.name)  # bucket "bench"
    try:
        endpoint = moto.endpoint
        s3 = moto.uri("run")
        rng = np.random.default_rng(0)
        calls = _calls(args.appends, rng)
        with tempfile.TemporaryDirectory() as d:
            r_s3 = appends(f"sqlite:///{d}/s3.db", s3, calls)
            r_local = appends(f"sqlite:///{d}/local.db", f"{d}/payload", calls)
            print(f"append to S3 (moto, loopback): p50 {r_s3['p50_ms']:.1f} ms, p99 {r_s3['p99_ms']:.1f} ms, "
                  f"{r_s3['appends_per_s']:.0f} appends/s")
            print(f"append to local disk:          p50 {r_local['p50_ms']:.1f} ms, p99 {r_local['p99_ms']:.1f} ms, "
                  f"{r_local['appends_per_s']:.0f} appends/s")
            # GC: files nothing references, written before the grace (0 s); one request at a
            # time (as before), then the parallel collection
            import trajstore.payload._store as payload_mod
            from trajstore._util.pools import LazyPool

            for threads in (1, payload_mod._GC_THREADS):
                payload_mod._GC_POOL = LazyPool(threads, "bench-gc")
                store = trajstore.connect(f"sqlite:///{d}/gc{threads}.db",
                                          payload=f"s3://bench/gc{threads}?endpoint_override={endpoint}&scheme=http")
                fs, root = store.payload.fs, store.payload.root
                for i in range(args.files):
                    with fs.open_output_stream(f"{root}/events-garbage-{i:06d}.arrow") as out:
                        out.write(b"x" * 1024)
                t0 = time.perf_counter()
                removed = store.collect_garbage(grace_s=0)
                gc_s = time.perf_counter() - t0
                store.close()
                print(f"gc on S3, {threads:>2} request(s) in flight: {len(removed)} files in {gc_s:.2f} s = "
                      f"{len(removed) / gc_s:.0f} files/s")
    finally:
        moto.close()
        log_dir.cleanup()


if __name__ == "__main__":
    main()
