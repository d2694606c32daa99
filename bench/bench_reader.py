"""Benchmark of the trainer reader, measured side by side in one run.

    python bench/bench_reader.py [--trajectories 40] [--scale 10] [--out bench/results/bench_reader.json]

Reports (docs/reader.md quotes them):
* throughput in tokens/s of ``SampleReader`` batches collated into torch
  tensors (padded and packed; 48 x 8 routes, expert ids < 128) against
  ``pyarrow.parquet.read_table`` of the same samples' arrays written to one
  uncompressed Parquet file (the sample segments are Arrow IPC now; before,
  the baseline read the zstd Parquet segments themselves), warm page cache
  for both, best of a few rounds;
* peak RSS of a process reading every batch of a store and of a store with
  ``--scale`` times more samples (each in a fresh subprocess, from
  ``resource.getrusage``), next to the same process's RSS before reading.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trajstore  # noqa: E402
from trajstore.materializer import Materializer  # noqa: E402
from trajstore.demo._simulate import RolloutConfig, trajectory_events  # noqa: E402
from _proc import reset_peak_rss  # noqa: E402  (bench/ is on sys.path when run as a script)

CFG = RolloutConfig(turns=2, prompt_tokens=768, output_tokens=256, observation_tokens=64, layers=48, topk=8,
                    num_experts=128, mismatch_prob=0.1, abort_prob=0.1, fail_prob=0.0, route_drift=0.0)
BATCH_SIZE = 16
ROUNDS = 5


def realistic_routes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Distinct expert ids per (token, layer) with a router's entropy: a random first
    expert, then random gaps of 1..15 (8 gaps < 128, so no repeats). The simulator's
    consecutive ids compress ~8x, which would flatter every reader alike."""
    rows, layers, topk = shape
    base = rng.integers(0, CFG.num_experts, (rows, layers, 1))
    gaps = rng.integers(1, 16, (rows, layers, topk)).cumsum(-1) - 1
    return ((base + gaps) % CFG.num_experts).astype(np.uint8)


def events(i: int) -> list[dict]:
    rng = np.random.default_rng(i)
    out = trajectory_events(CFG, i)
    for ev in out:
        if ev["type"] == "generation":
            ev["routed_experts"] = realistic_routes(rng, ev["routed_experts"].shape)
    return out


def build(directory: str, num_trajectories: int) -> tuple[str, str]:
    """A SQLite store holding ``num_trajectories`` materialized trajectories; its (url, payload)."""
    url, payload = f"sqlite:///{directory}/store.db", f"{directory}/payload"
    store = trajstore.connect(url, payload=payload)
    for start in range(0, num_trajectories, 8):
        store.append([ev for i in range(start, min(start + 8, num_trajectories)) for ev in events(i)])
    Materializer(store, max_trajectories=16).run()
    store.close()
    return url, payload


def raw_file(url: str, payload: str, path: str) -> str:
    """The store's samples' arrays as one uncompressed Parquet file (the raw baseline)."""
    from trajstore.sample._codec import sample_table

    store = trajstore.connect(url, payload=payload, migrate=False)
    pq.write_table(sample_table(list(store.samples())), path, compression="none")
    store.close()
    return path


def raw_read(paths: list[str]) -> tuple[int, float]:
    """(tokens, seconds) of pyarrow.parquet.read_table over the files."""
    start, tokens = time.perf_counter(), 0
    for path in paths:
        table = pq.read_table(path)
        tokens += pc.sum(pc.list_value_length(table["prompt_ids"])).as_py()
        tokens += pc.sum(pc.list_value_length(table["response_ids"])).as_py()
    return tokens, time.perf_counter() - start


def reader_read(url: str, payload: str, layout: str) -> tuple[int, float]:
    """(tokens, seconds) of reading every batch and collating it into torch tensors."""
    from trajstore.train.collate import collate
    from trajstore.reader import SampleReader

    start, tokens = time.perf_counter(), 0
    with SampleReader(url, payload=payload, batch_size=BATCH_SIZE) as reader:
        for batch in reader:
            tensors = collate(batch, layout=layout)
            tokens += int(tensors["seq_lens"].sum())
            assert tensors["routed_experts"].shape[2:] == (CFG.layers, CFG.topk)
    return tokens, time.perf_counter() - start


def throughput(url: str, payload: str, scratch: str) -> dict[str, float]:
    paths = [raw_file(url, payload, os.path.join(scratch, "raw.parquet"))]
    raw_read(paths)  # warm the page cache for both
    runs = {"raw_pyarrow": lambda: raw_read(paths),
            "reader_padded": lambda: reader_read(url, payload, "padded"),
            "reader_packed": lambda: reader_read(url, payload, "packed")}
    best: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for _ in range(ROUNDS):  # interleaved, so drift in machine load hits all alike
        for name, run in runs.items():
            tokens[name], seconds = run()
            best[name] = max(best.get(name, 0.0), tokens[name] / seconds)
    assert len(set(tokens.values())) == 1, f"readers disagree on the token count: {tokens}"
    out = {f"{name}_tokens_per_s": round(v) for name, v in best.items()}
    out.update(tokens=tokens["raw_pyarrow"], raw_parquet_mb=round(sum(os.path.getsize(p) for p in paths) / 2**20, 1))
    for name in ("reader_padded", "reader_packed"):
        out[f"{name}_vs_raw"] = round(best[name] / best["raw_pyarrow"], 3)
    return out


def peak_rss(url: str, payload: str) -> dict[str, float]:
    """Peak RSS of a fresh process that reads and collates every batch of the store."""
    return _child("--child-rss", url, payload)


def _child(*argv: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    return json.loads(out.stdout)


def _child_rss(url: str, payload: str) -> None:
    """Prints the reading's peak RSS. ru_maxrss of a child starts at its parent's RSS
    (Linux takes the high-water mark over exec), so ``main`` starts these children
    while it is still small; the imports' own peak is reset (Linux >= 4.0) so
    the peak is the reading's."""
    import torch  # noqa: F401  (imported before the baseline, as a trainer has it)

    from trajstore.train.collate import collate  # noqa: F401

    reset_peak_rss()
    before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens, _ = reader_read(url, payload, "packed")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rss_before_read_mb": round(before_mb, 1), "peak_rss_mb": round(peak_mb, 1),
                      "read_growth_mb": round(peak_mb - before_mb, 1), "tokens": tokens}))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=40, help="trajectories in the small store")
    p.add_argument("--scale", type=int, default=10, help="the large store has this many times more")
    p.add_argument("--dir", default=None, help="where the stores go (default: a temporary directory)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "bench_reader.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t0 = time.perf_counter()
        # Built in children, so this process stays small for the RSS children it starts.
        small = _child("--child-build", os.path.join(tmp, "small"), str(args.trajectories))
        large = _child("--child-build", os.path.join(tmp, "large"), str(args.trajectories * args.scale))
        build_s = round(time.perf_counter() - t0, 1)
        rss_small, rss_large = peak_rss(*small), peak_rss(*large)
        results = {"config": {"trajectories": args.trajectories, "scale": args.scale, "batch_size": BATCH_SIZE,
                              "layers": CFG.layers, "topk": CFG.topk, "cpus": os.cpu_count()},
                   "build_s": build_s, "throughput": throughput(*large, tmp), "rss_small": rss_small, "rss_large": rss_large}
    results["rss_large_vs_small"] = round(results["rss_large"]["peak_rss_mb"] / results["rss_small"]["peak_rss_mb"], 3)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child-rss":
        _child_rss(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "--child-build":
        print(json.dumps(build(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
