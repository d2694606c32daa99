"""What recording training lineage costs the trainer, beside the step's read.

    python bench/bench_lineage.py [--samples 512] [--tokens 2000] [--url URL] [--out bench/results/bench_lineage.json]

A store of ``--samples`` one-call trajectories of ``--tokens`` response tokens
(with logprobs) is materialized; each round a fresh ``SampleReader`` reads one
step of all of them and records it: ``record_step`` with metrics only (one
``train_step`` naming every sample), then with per-token ``trainer_logprobs``
for every sample (one ``sample_annotation`` each, the mismatch aggregated at
admission). Reported: the read and both records (median of ``ROUNDS``), and
the bytes at rest of the annotations' payload
against the raw float32 logprobs (docs/benchmarks.md, "Training lineage").
``--url``: a PostgreSQL store instead of a temporary SQLite one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trajstore  # noqa: E402

ROUNDS = 5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--url", default=None)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "bench_lineage.json"))
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    url = args.url or f"sqlite:///{tmp}/store.db"
    store = trajstore.connect(url, payload=os.path.join(tmp, "payload"))
    rng = np.random.default_rng(0)
    n, r = args.samples, args.tokens
    events = []
    for i in range(n):
        events += [{"type": "trajectory_started", "trajectory_id": f"t{i}"},
                   {"type": "generation", "trajectory_id": f"t{i}", "seq": 0, "prompt_ids": np.arange(64),
                    "output_ids": np.arange(r) % 1000, "logprobs": -rng.random(r).astype(np.float32),
                    "model_version": 1},
                   {"type": "trajectory_finished", "trajectory_id": f"t{i}", "status": "completed"}]
    for k in range(0, len(events), 300):
        store.append(events[k:k + 300])
    store.materialize()

    read_s, plain_s, notes_s = [], [], []
    for round_ in range(ROUNDS):
        reader = trajstore.SampleReader(store, batch_size=n)
        t = time.perf_counter()
        batch = next(reader)
        read_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        reader.record_step(2 * round_, run="bench", policy_version=1, metrics={"loss": 1.0})
        plain_s.append(time.perf_counter() - t)
        notes = {(s.trajectory_id, s.sample_index): {"trainer_logprobs": s.rollout_logprobs - 0.01} for s in batch}
        reader._lineage_recorder().handed_out(batch)  # the same samples again, annotated
        t = time.perf_counter()
        reader.record_step(2 * round_ + 1, run="bench", policy_version=1, annotations=notes)
        notes_s.append(time.perf_counter() - t)
        reader.close()
    names = [name for name, _ in store.payload.list_names() if name.startswith("lineage-")]
    at_rest = sum(os.path.getsize(store.payload.path(name)) for name in names) / len(names)
    result = {
        "backend": store.log.write_engine.dialect.name, "samples": n, "tokens_per_sample": r,
        "read_ms": statistics.median(read_s) * 1e3,
        "record_ms": statistics.median(plain_s) * 1e3,
        "record_with_logprobs_ms": statistics.median(notes_s) * 1e3,
        "annotation_bytes_per_float_byte": at_rest / (n * r * 4),
    }
    print(json.dumps(result, indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
