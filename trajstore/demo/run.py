"""``trajstore demo``: the main job end to end on the embedded SQLite store.

1. Rollout: ``--workers`` processes simulate agent rollouts (multi-turn MoE
   trajectories with prefix mismatches, aborts resumed under a newer model
   version, a few failures; ``trajstore.demo.simulate``) and write them through
   the batching ``Writer`` into one store, concurrently.
2. Materialize: fold every finished trajectory into samples.
3. Export the samples as Parquet, and summarize what came out.
4. Train (when megatron-core is installed): stream batches with the reader
   and run a tiny megatron-core MoE layer on CPU with router replay.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import numpy as np

from trajstore._progress import progress_bar
from trajstore.demo.simulate import DEMO_CONFIG, RolloutConfig, trajectory_events

__all__ = ["run_demo"]


def _rollout_worker(url: str, cfg: RolloutConfig, indices: list[int], total: int, done: "mp.Queue[int]") -> None:
    from trajstore.ingest.client import Writer
    from trajstore.store import connect

    store = connect(url, migrate=False)
    with Writer(store, batch_size=32) as writer:
        for i in indices:
            # The policy advances 4 versions over the run, as in async RL.
            writer.extend(trajectory_events(cfg, i, version=cfg.model_version + i * 4 // total))
            done.put(1)
    store.close()


def _rollout(url: str, cfg: RolloutConfig, n: int, workers: int) -> None:
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    shares = [list(range(w, n, workers)) for w in range(workers)]
    procs = [ctx.Process(target=_rollout_worker, args=(url, cfg, s, n, done)) for s in shares if s]
    for p in procs:
        p.start()
    with progress_bar(f"rollout ({len(procs)} workers)", total=n) as advance:
        for _ in range(n):
            advance(done.get(timeout=600))
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"rollout worker exited with {p.exitcode}")


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from trajstore.store import connect

    console = Console()
    url = args.store
    if url is None:
        shutil.rmtree(args.dir, ignore_errors=True)
        url = f"sqlite:///{os.path.join(args.dir, 'trajstore.db')}"
    store = connect(url, payload=args.payload)
    console.print(f"[bold]trajstore demo[/bold]: {store!r}")
    _rollout(url, DEMO_CONFIG, args.trajectories, args.workers)
    from trajstore.materializer import Materializer

    m = Materializer(store)
    with progress_bar("materialize", total=m.pending()) as advance:
        m.progress = advance
        stats = m.run()
    from trajstore.inspect.export import export_samples

    export_dir = os.path.join(args.dir, "export")
    counts = export_samples(store.samples(), export_dir)
    _summary(console, store, stats, export_dir, counts)
    if not args.no_train:
        _train_stage(console, url, args)
    store.close()
    return 0


def _summary(console, store, stats, export_dir: str, counts: dict) -> None:
    from rich.table import Table

    n_tokens = n_routes_bytes = n_masked = 0
    statuses: dict[str, int] = {}
    versions: list[int] = []
    for s in store.samples():
        n_tokens += s.num_tokens
        statuses[s.status] = statuses.get(s.status, 0) + 1
        versions.append(s.max_model_version - s.min_model_version)
        if s.routed_experts is not None:
            n_routes_bytes += s.routed_experts.nbytes
            n_masked += int(s.routed_experts_mask.sum())
    payload_bytes = sum(os.path.getsize(store.payload.path(n)) for n, _ in store.payload.list_names())
    info = store.info()
    t = Table(title="what came out", show_header=False)
    t.add_row("trajectories", str(sum(info["trajectories_by_status"].values())))
    t.add_row("generation events (steps before)", str(stats.num_steps_before))
    t.add_row("samples (after)", str(stats.num_samples_after))
    t.add_row("merge ratio", f"{stats.merge_ratio:.3f}")
    t.add_row("prefix mismatches", str(stats.prefix_mismatch_count))
    t.add_row("samples by status", ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())))
    t.add_row("samples spanning >1 model version", str(int(np.count_nonzero(np.array(versions) > 0))))
    t.add_row("model versions", ", ".join(str(r["model_version"]) for r in info["generations_by_model_version"]))
    t.add_row("tokens in samples", str(n_tokens))
    t.add_row("routes in samples", f"{n_routes_bytes / 2**20:.1f} MiB ({n_masked} masked rows)")
    t.add_row("payload on disk (log + samples)", f"{payload_bytes / 2**20:.1f} MiB")
    t.add_row("export", f"{counts['samples']} samples in {counts['files']} file(s) under {export_dir}")
    console.print(t)


def _train_stage(console, url: str, args: argparse.Namespace) -> None:
    try:
        from trajstore.demo.train_stage import demo_train
    except ImportError as e:
        console.print(f"train stage skipped ({e}); pip install -e '.[megatron]' to run it", markup=False)
        return
    demo_train(console, url, args)
