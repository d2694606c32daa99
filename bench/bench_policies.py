"""Each sampling policy's read throughput, local and through a replay server, in one run.

    python bench/bench_policies.py [--trajectories 96] [--rounds 3] [--out bench/results/bench_policies.json]

One SQLite store (24 layers x top-4 routes); for every policy a full
non-follow epoch of ``SampleReader`` (local) and of ``ReplayReader`` through a
``ReplayServer`` on loopback in this process, batches touched (every array's
first byte read), rounds interleaved (policy by policy, local then remote),
the median reported; fifo also without prefetch, the baseline of
ready_first, which plans no step ahead. tokens/s counts the tokens handed out (``reuse`` hands
each sample out ``max_uses`` times). docs/benchmarks.md quotes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trajstore  # noqa: E402
from trajstore.demo._simulate import RolloutConfig, trajectory_events  # noqa: E402
from trajstore.materializer import Materializer  # noqa: E402
from trajstore.reader import SampleReader  # noqa: E402

CFG = RolloutConfig(turns=2, prompt_tokens=512, output_tokens=256, observation_tokens=64, layers=24, topk=4,
                    num_experts=64, mismatch_prob=0.1, abort_prob=0.1, fail_prob=0.0, route_drift=0.0)
# Reader settings per variant. ready_first reads current_model_version, so it plans no
# step ahead (prefetch is off for it): fifo without prefetch is its baseline.
VARIANTS = {
    "fifo": {"policy": "fifo"},
    "fifo-noprefetch": {"policy": "fifo", "prefetch": False},
    "ready_first": {"policy": {"name": "ready_first", "bound": 1}},
    "freshness": {"policy": {"name": "freshness", "decay": 0.5}},
    "reuse": {"policy": {"name": "reuse", "max_uses": 2}},
}


def build(path: str, n: int) -> trajstore.Store:
    store = trajstore.connect(f"sqlite:///{path}/store.db", payload=f"{path}/payload")
    for i in range(n):
        store.append(trajectory_events(CFG, i, version=i // 8))
    Materializer(store).run()
    return store


def epoch(reader: SampleReader) -> tuple[float, int, int]:
    """(seconds, tokens, steps) of one epoch, every array touched."""
    t0 = time.perf_counter()
    tokens = steps = 0
    for batch in reader:
        reader.current_model_version = 2 + steps // 4
        for s in batch:
            for a in (s.prompt_ids, s.response_ids, s.rollout_logprobs, s.routed_experts):
                if a is not None and a.size:
                    a.reshape(-1)[0].item()
            tokens += s.num_tokens
        steps += 1
    return time.perf_counter() - t0, tokens, steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trajectories", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from trajstore.replay import ReplayReader
    from trajstore.replay._server import ReplayServer

    with tempfile.TemporaryDirectory() as tmp:
        store = build(tmp, args.trajectories)
        server_store = trajstore.connect(store.url, payload=store.payload.location, migrate=False, create=False)
        server = ReplayServer(server_store, "grpc://127.0.0.1:0", tokens=None, close_store=True)
        threading.Thread(target=server.serve, daemon=True).start()
        location = f"grpc://127.0.0.1:{server.port}"
        runs: dict[str, dict[str, list]] = {p: {"local": [], "remote": []} for p in VARIANTS}
        for _ in range(args.rounds):
            for name, settings in VARIANTS.items():
                for where in ("local", "remote"):
                    reader = (SampleReader(store, batch_size=args.batch_size, **settings) if where == "local"
                              else ReplayReader(location, batch_size=args.batch_size, **settings))
                    with reader:
                        runs[name][where].append(epoch(reader))
        server.shutdown()
        store.close()
    out = {"trajectories": args.trajectories, "batch_size": args.batch_size, "rounds": args.rounds,
           "routes": f"{CFG.layers}x{CFG.topk}", "variants": {}}
    print(f"{'variant':<16} {'where':<7} {'steps':>6} {'Mtok/s':>8} {'steps/s':>8}  (median of {args.rounds})")
    for name, by in runs.items():
        out["variants"][name] = {}
        for where, results in by.items():
            seconds = statistics.median(r[0] for r in results)
            tokens, steps = results[0][1], results[0][2]
            out["variants"][name][where] = {"seconds": seconds, "tokens": tokens, "steps": steps,
                                            "tokens_per_s": tokens / seconds, "steps_per_s": steps / seconds}
            print(f"{name:<16} {where:<7} {steps:>6} {tokens / seconds / 1e6:>8.2f} {steps / seconds:>8.1f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
