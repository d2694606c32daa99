"""What turning reader batches into SkyRL's and verl's batch types costs, beside collate.

    python bench/bench_trainers.py [--trajectories 128] [--out bench/results/bench_trainers.json]

Batches of 16 samples (~1,400 tokens each, routes 48 layers x top-8) are read
from a store once and kept in memory; each round converts every batch with
``collate`` (padded), ``trajstore.train.skyrl.generator_output`` and
``trajstore.train.verl.data_proto``. Reported: tokens per second, best of
``ROUNDS`` interleaved rounds (docs/skyrl.md and docs/verl.md quote them).
SkyRL's ``GeneratorOutput`` is Python lists of token ids by its own type, so
its conversion is bound by ``ndarray.tolist``; verl's is numpy slices into
padded arrays.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trajstore  # noqa: E402
from trajstore.demo._simulate import RolloutConfig, trajectory_events  # noqa: E402
from trajstore.reader import SampleReader  # noqa: E402

CFG = RolloutConfig(turns=2, prompt_tokens=768, output_tokens=256, observation_tokens=64, layers=48, topk=8,
                    num_experts=128, mismatch_prob=0.1, abort_prob=0.1, fail_prob=0.0, route_drift=0.0)
BATCH_SIZE = 16
ROUNDS = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trajectories", type=int, default=128)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "bench_trainers.json"))
    args = parser.parse_args()

    from trajstore.train.collate import collate
    from trajstore.train.skyrl import generator_output
    from trajstore.train.verl import data_proto

    with tempfile.TemporaryDirectory() as tmp:
        store = trajstore.connect(f"sqlite:///{tmp}/store.db", payload=f"{tmp}/payload")
        for i in range(args.trajectories):
            store.append(trajectory_events(CFG, i))
        store.materialize()
        batches = [[s for s in batch] for batch in SampleReader(store, batch_size=BATCH_SIZE)]
        tokens = sum(s.num_tokens for batch in batches for s in batch)
        converters = {
            "collate (padded)": lambda b: collate(b),
            "skyrl.generator_output": lambda b: generator_output(b),
            "verl.data_proto": lambda b: data_proto(b),
        }
        for convert in converters.values():  # warm up: imports (verl pulls Ray, transformers)
            convert(batches[0])
        best = {name: float("inf") for name in converters}
        for _ in range(ROUNDS):
            for name, convert in converters.items():
                start = time.perf_counter()
                for batch in batches:
                    convert(batch)
                best[name] = min(best[name], time.perf_counter() - start)
        store.close()

    result = {
        "batches": len(batches), "samples": sum(map(len, batches)), "tokens": tokens,
        "layers": CFG.layers, "topk": CFG.topk, "rounds": ROUNDS,
        "tokens_per_s": {name: round(tokens / seconds) for name, seconds in best.items()},
        "ms_per_batch": {name: round(1000 * seconds / len(batches), 2) for name, seconds in best.items()},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
