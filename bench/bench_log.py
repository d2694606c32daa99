"""Benchmark of the event log and the fold, measured side by side in one run.

    python bench/bench_log.py [--events 160] [--quick]

Reports (and writes docs/benchmarks.md's numbers from):
* append throughput (tokens/s, payload MB/s) through ``store.append`` on
  SQLite and on PostgreSQL, against writing the same arrays with pyarrow to
  one Parquet file (the raw rate), same process, same data;
* bytes per token on disk for 48 x 8 routes (expert ids < 128);
* peak extra memory of appending one 32k-token event vs its payload size;
* fold throughput (tokens/s, one core) on 4-turn trajectories of ~2,000-token
  events, and the materializer's peak RSS on a log and on a 4x larger log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trajstore  # noqa: E402
from trajstore.events import parse_event  # noqa: E402
from trajstore.fold import fold  # noqa: E402
from trajstore.payload._columns import binary_column, list_column  # noqa: E402
from trajstore.demo._simulate import RolloutConfig, trajectory_events  # noqa: E402
from _proc import reset_peak_rss, rss_kb  # noqa: E402  (bench/ is sys.path[0])

LAYERS, TOPK, EXPERTS = 48, 8, 128
PROMPT, OUTPUT = 1500, 500  # ~2,000 tokens per event
MATERIALIZE_BATCH_TOKENS = 65_536  # a 1x log is several batches, so streaming shows


def one_event_trajectories(n: int, seed: int = 0) -> list[list[dict]]:
    """n trajectories of one ~2,000-token generation each (nothing for merge to dedupe)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        tid = f"bench-{seed}-{i}"
        out.append([
            {"type": "trajectory_started", "trajectory_id": tid, "num_experts": EXPERTS},
            {"type": "generation", "trajectory_id": tid, "seq": 0,
             "prompt_ids": rng.integers(0, 32000, PROMPT, dtype=np.int32),
             "output_ids": rng.integers(0, 32000, OUTPUT, dtype=np.int32),
             "logprobs": -rng.random(OUTPUT, dtype=np.float32), "model_version": 1,
             "routed_experts": rng.integers(0, EXPERTS, (PROMPT + OUTPUT - 1, LAYERS, TOPK), dtype=np.uint8)},
        ])
    return out


def raw_pyarrow(trajs: list[list[dict]], path: str, batch: int) -> float:
    """Seconds to write the same arrays with pyarrow into one Parquet file (no store)."""
    gens = [t[1] for t in trajs]
    t0 = time.perf_counter()
    with pq.ParquetWriter(path, _raw_table(gens[:1]).schema) as w:
        for i in range(0, len(gens), batch):
            w.write_table(_raw_table(gens[i : i + batch]))
    return time.perf_counter() - t0


def _raw_table(gens: list[dict]) -> pa.Table:
    return pa.table({
        "prompt_ids": list_column([g["prompt_ids"] for g in gens], np.int32),
        "output_ids": list_column([g["output_ids"] for g in gens], np.int32),
        "logprobs": list_column([g["logprobs"] for g in gens], np.float32),
        "routes": binary_column([g["routed_experts"] for g in gens]),
    })


def append_rate(url: str, payload: str, trajs: list[list[dict]], batch: int,
                compression: str | None = None) -> tuple[float, int]:
    store = trajstore.connect(url, payload=payload, log_compression=compression)
    t0 = time.perf_counter()
    for i in range(0, len(trajs), batch):
        store.append([e for t in trajs[i : i + batch] for e in t])
    dt = time.perf_counter() - t0
    size = sum(os.path.getsize(store.payload.path(n)) for n, _ in store.payload.list_names())
    store.close()
    return dt, size


def payload_bytes(trajs: list[list[dict]]) -> int:
    g = [t[1] for t in trajs]
    return sum(x["prompt_ids"].nbytes + x["output_ids"].nbytes + x["logprobs"].nbytes + x["routed_experts"].nbytes for x in g)


def bench_append(args, pg_url: str | None, out: dict) -> None:
    trajs = one_event_trajectories(args.events)
    tokens = args.events * (PROMPT + OUTPUT)
    mb = payload_bytes(trajs) / 1e6
    with tempfile.TemporaryDirectory() as d:
        rows = {}
        for rep in range(args.repeats):  # interleaved repeats: the machine is noisy
            raw = raw_pyarrow(trajs, os.path.join(d, f"raw{rep}.parquet"), args.batch)
            lite, lite_size = append_rate(f"sqlite:///{d}/s{rep}.db", f"{d}/s{rep}.payload", trajs, args.batch)
            zstd, zstd_size = append_rate(f"sqlite:///{d}/z{rep}.db", f"{d}/z{rep}.payload", trajs, args.batch, "zstd")
            rows.setdefault("raw pyarrow", []).append(raw)
            rows.setdefault("sqlite", []).append(lite)
            rows.setdefault("sqlite, log_compression=zstd", []).append(zstd)
            if pg_url:
                pg, _ = append_rate(pg_url.replace("/bench", f"/bench{rep}"), f"{d}/pg{rep}.payload", trajs, args.batch)
                rows.setdefault("postgres", []).append(pg)
        raw_best = min(rows["raw pyarrow"])
        out["append"] = {
            name: {"seconds": min(ts), "tokens_per_s": tokens / min(ts), "payload_mb_per_s": mb / min(ts),
                   "ratio_to_raw": raw_best / min(ts)}
            for name, ts in rows.items()
        }
        out["append_setup"] = {"events": args.events, "tokens_per_event": PROMPT + OUTPUT, "routes": f"{LAYERS}x{TOPK} uint8 ids<{EXPERTS}",
                               "events_per_append": args.batch, "repeats": args.repeats}
        out["bytes_per_token_on_disk"] = {"default": lite_size / tokens, "log_compression=zstd": zstd_size / tokens}


def bench_fold(out: dict, n: int) -> None:
    cfg = RolloutConfig(turns=4, prompt_tokens=1400, output_tokens=150, observation_tokens=50,
                        layers=LAYERS, topk=TOPK, num_experts=EXPERTS, mismatch_prob=0.0, abort_prob=0.0)
    trajs = []
    for i in range(n):
        evs = trajectory_events(cfg, i)
        trajs.append([parse_event(e) for e in evs if e["type"] == "generation"])
    event_tokens = sum(g.num_tokens for t in trajs for g in t)
    t0 = time.process_time()
    sample_tokens = 0
    for i, gens in enumerate(trajs):
        for s in fold(gens, trajectory_id=gens[0].trajectory_id, num_experts=EXPERTS).samples:
            sample_tokens += s.num_tokens
    cpu = time.process_time() - t0
    out["fold"] = {"trajectories": n, "tokens_per_event": event_tokens / (4 * n),
                   "sample_tokens_per_cpu_s": sample_tokens / cpu, "event_tokens_per_cpu_s": event_tokens / cpu}


def _child(kind: str, arg: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, arg], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_big_event(d: str) -> dict:
    rng = np.random.default_rng(1)
    n = 32768
    ev = {"type": "generation", "trajectory_id": "big", "seq": 0,
          "prompt_ids": rng.integers(0, 32000, n - 1024, dtype=np.int32),
          "output_ids": rng.integers(0, 32000, 1024, dtype=np.int32),
          "logprobs": -rng.random(1024, dtype=np.float32), "model_version": 1,
          "routed_experts": rng.integers(0, EXPERTS, (n - 1, LAYERS, TOPK), dtype=np.uint8)}
    size = ev["prompt_ids"].nbytes + ev["output_ids"].nbytes + ev["logprobs"].nbytes + ev["routed_experts"].nbytes
    store = trajstore.connect(f"sqlite:///{d}/big.db")
    store.append([{"type": "trajectory_started", "trajectory_id": "warm"}])  # imports and connections warmed up
    reset_peak_rss()
    rss0, _ = rss_kb()
    store.append([{"type": "trajectory_started", "trajectory_id": "big", "num_experts": EXPERTS}, ev])
    _, peak = rss_kb()
    return {"payload_bytes": size, "peak_extra_bytes": (peak - rss0) * 1024}


def child_materialize(url: str) -> dict:
    store = trajstore.connect(url)
    reset_peak_rss()
    rss0, _ = rss_kb()
    stats = store.materialize(max_batch_tokens=MATERIALIZE_BATCH_TOKENS)
    _, peak = rss_kb()
    return {"trajectories": stats.num_trajectories, "peak_rss_kb": peak, "rss_before_kb": rss0}


def bench_materializer_memory(out: dict, base: int) -> None:
    cfg = RolloutConfig(turns=4, prompt_tokens=500, output_tokens=200, observation_tokens=50,
                        layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
    res = {}
    with tempfile.TemporaryDirectory() as d:
        for mult in (1, 4):
            url = f"sqlite:///{d}/m{mult}.db"
            store = trajstore.connect(url)
            for i in range(base * mult):
                store.append(trajectory_events(cfg, i))
            store.close()
            res[f"{mult}x"] = _child("materialize", url)
    res["growth"] = res["4x"]["peak_rss_kb"] / res["1x"]["peak_rss_kb"]
    out["materializer_memory"] = res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=160)
    p.add_argument("--batch", type=int, default=16, help="events per append call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-postgres", action="store_true")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, arg = args.child
        print(json.dumps(child_big_event(arg) if kind == "big" else child_materialize(arg)))
        return
    out: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    cluster = None
    pg_url = None
    if not args.no_postgres:
        from tests.pg_cluster import PgCluster

        cluster = PgCluster()
        cluster.start()
        for rep in range(args.repeats):
            cluster.create_database(f"bench{rep}")
        pg_url = cluster.url("bench")
    try:
        bench_append(args, pg_url, out)
    finally:
        if cluster:
            cluster.stop()
    bench_fold(out, 40)
    with tempfile.TemporaryDirectory() as d:
        big = _child("big", d)
    big["ratio"] = big["peak_extra_bytes"] / big["payload_bytes"]
    out["append_32k_event_memory"] = big
    bench_materializer_memory(out, 60)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
