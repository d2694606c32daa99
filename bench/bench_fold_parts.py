"""Where a materializer step's CPU goes: thread CPU per step of its parts, and of the compaction.

    PYTHONPATH=. .venv/bin/python bench/bench_fold_parts.py [--versions 1] [--layout 48x8] [--steps 6]
        [--url URL]

bench_fold.py's load (32 trajectories a step of 2,400 tokens, routes of 128 experts), one
process, on SQLite unless ``--url``: fills the store, folds one untimed step, then times
``--steps`` steps and one compaction after them, each part by ``time.thread_time`` around
it (parts nest: ``_fold`` holds ``fold_inputs``, ``_read_segments``, ``generations_from_log``
and ``fold``; ``commit_samples`` holds ``count_commit``). Figures of one process on a shared
machine: compare parts of one run, not runs.
"""

from __future__ import annotations

import argparse
import collections
import functools
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--versions", type=int, default=1)
    p.add_argument("--layout", default="48x8", choices=["none", "24x4", "48x8"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--url", default=None)
    args = p.parse_args()

    import bench_fold as bf

    import trajstore
    import trajstore.log._aggregate_counts as counts
    import trajstore.log._aggregates as agg
    import trajstore.log._samples as samples
    import trajstore.materializer as mat
    import trajstore.payload._direct as direct
    import trajstore.sample._codec as codec
    from trajstore._upkeep import gc

    tmp = tempfile.mkdtemp()
    store = trajstore.connect(args.url or f"sqlite:///{tmp}/s.db", payload=f"{tmp}/p")
    for events in bf._load(bf.PER_STEP * (args.steps + 1), bf.LAYOUTS[args.layout], args.versions):
        store.append(events)
    spent: collections.Counter = collections.Counter()

    def wrap(owner, name: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def timed(*a, **k):
            t = time.thread_time()
            try:
                return f(*a, **k)
            finally:
                spent[name] += time.thread_time() - t
        setattr(owner, name, timed)

    for owner, names in ((mat.Materializer, ("_step", "_fold", "_write", "_read_segments", "_counts")),
                         (mat, ("fold", "sample_table")), (mat.facts, ("generations_from_log",)),
                         (store.log, ("fold_inputs", "pending_labels", "finished_after")),
                         (store.payload, ("write_samples",)), (store.materialized, ("commit_samples",)),
                         (samples, ("count_commit", "insert_fold_deltas", "repoint")),
                         (gc, ("compact_aggregates", "count_pending_experts")), (agg, ("count_trajectories",)),
                         (direct, ("_image_capacity", "write_table", "_write_file")),
                         (codec.PlannedRoutes, ("place",)), (mat, ("sample_counts",)),
                         (counts, ("_decode_rows", "count_routes", "_logprob_counts")),
                         (store.payload, ("read_many",)), (store.log, ("held_generations",))):
        for name in names:
            wrap(owner, name)
    m = mat.Materializer(store, max_trajectories=bf.PER_STEP)
    m.run(max_steps=1, compact=False)
    gc.compact_run_aggregates(store)
    spent.clear()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    m.run(compact=False)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    gc.compact_run_aggregates(store)
    r2 = resource.getrusage(resource.RUSAGE_SELF)
    store.close()
    fold = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / args.steps
    compact = (r2.ru_utime + r2.ru_stime - r1.ru_utime - r1.ru_stime) / args.steps
    tokens = bf.PER_STEP * 2400
    print(f"{args.layout}, {args.versions} version(s) a step: fold {1e3 * fold:.1f} ms/step, compaction "
          f"{1e3 * compact:.1f} ms/step; M tokens/CPU-s {tokens / fold / 1e6:.2f} "
          f"(with the compaction {tokens / (fold + compact) / 1e6:.2f})")
    print(f"  (of the fold: user {1e3 * (r1.ru_utime - r0.ru_utime) / args.steps:.1f}, system "
          f"{1e3 * (r1.ru_stime - r0.ru_stime) / args.steps:.1f} ms/step, "
          f"{(r1.ru_minflt - r0.ru_minflt) / args.steps:.0f} minor page faults/step)")
    for name, s in sorted(spent.items(), key=lambda x: -x[1]):
        print(f"  {name:24s} {1e3 * s / args.steps:7.1f} ms/step")


if __name__ == "__main__":
    main()
