"""What the route drift figures cost the append, drift on vs off, side by side in one run.

    python bench/bench_drift.py [--trajectories 8] [--turns 8] [--repeats 5] [--postgres URL]

Workload: vLLM's pattern, one engine call per ``store.append`` (what the proxy
does): each of ``--trajectories`` multi-turn trajectories makes ``--turns``
calls; every call's prompt is the previous sequence plus 200 observation
tokens, it generates 200 tokens, and it returns route rows for the whole
sequence (48 layers x top-8, uint8), i.e. re-sends every recorded row, 1 in
50 of them recomputed differently. Calls of the trajectories interleave
(turn by turn), as concurrent rollouts do.

Variants, each in a fresh SQLite store, interleaved ``--repeats`` times (best
of each kept):
* ``drift off``: the figures not measured (``Store._route_drift = False``);
* ``drift on``: the default (this process's cache of recorded rows);
* ``drift on, no cache``: the cache holds nothing, so every comparison
  rebuilds the recorded rows from the log (the fallback when another
  process appended the trajectory's previous call).

Prints one JSON object: wall seconds per variant, per append, and the ratio
to ``drift off``; the same for the process's CPU time (less noisy on a
shared machine: the fsync waits are not in it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trajstore  # noqa: E402

LAYERS, TOPK, EXPERTS = 48, 8, 128
FIRST_PROMPT, OBSERVATION, OUTPUT = 600, 200, 200


def workload(n: int, turns: int, seed: int = 0) -> list[list[dict]]:
    """Appends (each a list of events) in the order they are made: turn by turn."""
    rng = np.random.default_rng(seed)
    per_traj: list[list[list[dict]]] = []
    for i in range(n):
        tid = f"drift-{i}"
        seq = rng.integers(0, 32000, FIRST_PROMPT, dtype=np.int32)
        routes = np.zeros((0, LAYERS, TOPK), np.uint8)
        calls: list[list[dict]] = []
        for t in range(turns):
            if t:
                seq = np.concatenate([seq, rng.integers(0, 32000, OBSERVATION, dtype=np.int32)])
            out = rng.integers(0, 32000, OUTPUT, dtype=np.int32)
            n_rows = len(seq) + OUTPUT - 1
            new = rng.integers(0, EXPERTS, (n_rows - len(routes), LAYERS, TOPK), dtype=np.uint8)
            resent = routes.copy()
            moved = rng.random(len(resent)) < 0.02
            resent[moved, 0, 0] = (resent[moved, 0, 0] + 1) % EXPERTS
            routes = np.concatenate([routes, new])
            event = {"type": "generation", "trajectory_id": tid, "seq": t, "prompt_ids": seq, "output_ids": out,
                     "logprobs": -rng.random(OUTPUT, dtype=np.float32), "model_version": 1,
                     "routed_experts": np.concatenate([resent, new])}
            calls.append(([{"type": "trajectory_started", "trajectory_id": tid, "num_experts": EXPERTS}]
                          if t == 0 else []) + [event])
            seq = np.concatenate([seq, out])
        per_traj.append(calls)
    return [per_traj[i][t] for t in range(turns) for i in range(n)]


def run(url: str, payload: str, appends: list[list[dict]], variant: str) -> tuple[float, float]:
    store = trajstore.connect(url, payload=payload)
    store._route_drift = variant != "drift off"
    if variant == "drift on, no cache":
        store._routes.max_bytes = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for batch in appends:
        store.append(batch)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if variant != "drift off":  # the figures were measured
        with store.log.read_engine.connect() as conn:
            from sqlalchemy import text
            missing = conn.execute(text("SELECT COUNT(*) FROM events WHERE route_rows_resent > 0 "
                                        "AND route_rows_drifted IS NULL")).scalar_one()
        assert missing == 0, missing
    store.close()
    return dt, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--postgres", help="also run on this PostgreSQL URL (a database per run is not made: "
                                      "pass an empty one per invocation)")
    args = p.parse_args()
    appends = workload(args.trajectories, args.turns)
    variants = ("drift off", "drift on", "drift on, no cache")
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpus: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as d:
        run(f"sqlite:///{d}/warm.db", f"{d}/warm.payload", appends, "drift on")  # imports, first-use costs
        for rep in range(args.repeats):
            for k, v in enumerate(variants):
                wall, cpu = run(f"sqlite:///{d}/s{rep}-{k}.db", f"{d}/s{rep}-{k}.payload", appends, v)
                times[v].append(wall)
                cpus[v].append(cpu)
    base = min(times["drift off"])
    cpu_base = min(cpus["drift off"])
    rows_sent = sum(len(e["routed_experts"]) for b in appends for e in b if e["type"] == "generation")
    print(json.dumps({
        "setup": {"trajectories": args.trajectories, "turns": args.turns, "appends": len(appends),
                  "routes": f"{LAYERS}x{TOPK} uint8", "route_rows_sent": rows_sent, "repeats": args.repeats},
        "seconds": {v: min(ts) for v, ts in times.items()},
        "ms_per_append": {v: 1e3 * min(ts) / len(appends) for v, ts in times.items()},
        "ratio_to_drift_off": {v: min(ts) / base for v, ts in times.items()},
        "cpu_ms_per_append": {v: 1e3 * min(ts) / len(appends) for v, ts in cpus.items()},
        "cpu_ratio_to_drift_off": {v: min(ts) / cpu_base for v, ts in cpus.items()},
        "all_runs": times,
    }, indent=2))


if __name__ == "__main__":
    main()
