"""``trajstore demo``: the main job end to end on the embedded SQLite store.

1. Rollout: ``--workers`` processes simulate agent rollouts (multi-turn MoE
   trajectories with prefix mismatches, aborts resumed under a newer model
   version, a few failures; ``trajstore.demo._simulate``) and write them through
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
import shlex
import shutil
import sys

import numpy as np

from trajstore._util.progress import progress_bar
from trajstore.demo._simulate import DEMO_CONFIG, RolloutConfig, trajectory_events
from trajstore.errors import TrajstoreError, first_line

__all__ = ["next_steps", "run_demo"]


def _rollout_worker(url: str, payload: str | None, cfg: RolloutConfig, indices: list[int], total: int,
                    done: "mp.Queue[int | str]") -> None:
    from trajstore.ingest.client import Writer
    from trajstore.store import connect

    try:
        store = connect(url, payload=payload, migrate=False)
        with Writer(store, max_batch_events=32) as writer:
            for i in indices:
                # The policy advances 4 versions over the run, as in async RL.
                writer.extend(trajectory_events(cfg, i, version=cfg.model_version + i * 4 // total))
                done.put(1)
        store.close()
    except BaseException as e:  # one line to the parent, which reports it; no worker traceback
        done.put(f"{type(e).__name__}: {first_line(e) if str(e).strip() else ''}")


def _rollout(url: str, payload: str | None, cfg: RolloutConfig, n: int, workers: int) -> None:
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    shares = [list(range(w, n, workers)) for w in range(workers)]
    procs = [ctx.Process(target=_rollout_worker, args=(url, payload, cfg, s, n, done)) for s in shares if s]
    for p in procs:
        p.start()
    try:
        with progress_bar(f"rollout ({len(procs)} workers)", total=n) as advance:
            finished = 0
            while finished < n:
                item = done.get(timeout=600)
                if isinstance(item, str):
                    raise TrajstoreError(f"demo rollout worker failed: {item}")
                finished += item
                advance(item)
    except BaseException:
        for p in procs:
            p.terminate()
            p.join()
        raise
    for p in procs:
        p.join()  # each worker's Writer flushes its last batch on the way out
    errors = []
    while not done.empty():
        item = done.get()
        if isinstance(item, str):
            errors.append(item)
    if errors:
        raise TrajstoreError(f"demo rollout worker failed: {errors[0]}")
    for p in procs:
        if p.exitcode != 0:
            raise TrajstoreError(f"demo rollout worker exited with {p.exitcode}")


# What the demo makes in its directory; it removes only these, and only where its marker says it made
# them. Not the report: the user makes that (with the command the demo prints), and it stays theirs.
_MARKER = ".trajstore-demo"
_DB = "trajstore.db"
_MADE = (_DB, _DB + "-wal", _DB + "-shm", _DB + "-journal", _DB + ".payload", "export", _MARKER)
ENGINE_DB = "engine-demo.db"
_ENGINE_MADE = (ENGINE_DB, ENGINE_DB + "-wal", ENGINE_DB + "-shm", ENGINE_DB + "-journal", ENGINE_DB + ".payload")
DEFAULT_DIR, ENGINE_DIR = "trajstore-demo", "trajstore-engine-demo"


def _prepare_dir(path: str, made: tuple[str, ...] = _MADE) -> None:
    """Make ``path`` ready for a fresh demo store without deleting anything the demo did not make:
    only ``made`` (this demo's own files; ``demo --engine`` has its own, so it never deletes
    the first demo's store)."""
    os.makedirs(path, exist_ok=True)
    made_by_demo = os.path.isfile(os.path.join(path, _MARKER))
    present = [n for n in made if n != _MARKER and os.path.lexists(os.path.join(path, n))]
    if present and not made_by_demo:
        raise TrajstoreError(f"{os.path.join(path, present[0])} exists and was not made by trajstore demo; "
                             "choose another --dir")
    for name in present:  # an earlier demo's store, export and report
        target = os.path.join(path, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        else:
            os.unlink(target)
    with open(os.path.join(path, _MARKER), "w") as f:
        f.write("made by trajstore demo: it may replace " + ", ".join(_MADE[:-1] + _ENGINE_MADE)
                + " in this directory\n")


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console

    from trajstore.store import connect

    # Off a terminal rich would wrap at 80 columns and cut the tables' cells.
    console = Console(width=None if sys.stdout.isatty() else 160)
    url = args.store
    args.dir = args.dir or DEFAULT_DIR
    if url is None:
        _prepare_dir(args.dir)
        url = f"sqlite:///{os.path.abspath(os.path.join(args.dir, _DB))}"
    else:
        os.makedirs(args.dir, exist_ok=True)
    store = connect(url, payload=args.payload)
    if sum(store.info()["trajectories_by_status"].values()):
        raise TrajstoreError(f"{store!r} already holds trajectories; the demo needs an empty store "
                             "(omit --store to use a fresh one in --dir)")
    console.print(f"[bold]trajstore demo[/bold]: {store!r}", markup=True)
    _rollout(url, args.payload, DEMO_CONFIG, args.trajectories, args.workers)
    from trajstore.materializer import Materializer

    m = Materializer(store)
    with progress_bar("materialize", total=m.pending()) as advance:
        m.progress = advance
        stats = m.run()
    from trajstore.inspect.export import export_samples

    export_dir = os.path.join(args.dir, "export")
    counts = export_samples(store.samples(), export_dir, replace=True)
    _summary(console, store, stats, export_dir, counts)
    if not args.no_train:
        _train_stage(console, url, args)
    store.close()
    print(next_steps(url, args.payload, args.dir), flush=True)  # plain: never wrapped, copy-pasteable
    return 0


def _program() -> list[str]:
    """How the user can call trajstore from here: ``trajstore`` when that is on PATH and is us."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if os.path.basename(argv0) == "trajstore":
        found = shutil.which("trajstore")
        if found and os.path.realpath(found) == os.path.realpath(argv0):
            return ["trajstore"]
        return [argv0]
    return [sys.executable, "-m", "trajstore.cli"]


def _has_report_extra() -> bool:
    import importlib.util

    return importlib.util.find_spec("plotly") is not None


def next_steps(url: str, payload: str | None, directory: str) -> str:
    """The commands to run next, exactly as they work from the current directory."""
    from trajstore.log._registry import backend_of

    base = _program() + ["--store", url] + (["--payload", payload] if payload else [])
    q = " ".join(shlex.quote(a) for a in base)
    query = ("SELECT trajectory_id, status, num_samples, reward FROM trajectory_summary "
             "ORDER BY trajectory_id LIMIT 5")
    report = shlex.quote(os.path.join(directory, "report"))
    export = shlex.quote(os.path.join(directory, "export"))
    reader_logins = backend_of(url).reader_logins  # a reader login is how sql and report read it
    return "\n".join([
        "",
        "next: look at the demo's store",
        *([f"  {q} init --reader-login trajstore_analyst   # on PostgreSQL, run sql and report "
           "with the reader URL this prints (docs/sql.md)"] if reader_logins else []),
        f"  {q} sql {shlex.quote(query)}",
        f"  {q} report {report}" + ("" if _has_report_extra() else "   # needs the report extra: pip install -e '.[report]'"),
        f"  {q} export --replace {export}",
        f"  {q} info",
    ])


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
        from trajstore.demo._train_stage import demo_train
    except ImportError as e:
        console.print(f"train stage skipped ({e}); pip install -e '.[megatron]' to run it", markup=False)
        return
    demo_train(console, url, args)
