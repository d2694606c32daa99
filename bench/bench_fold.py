"""The materializer's fold with the run aggregates on, beside another source tree, in one run.

    PYTHONPATH=. .venv/bin/python bench/bench_fold.py --before /tmp/before [--rounds 2] [--no-postgres | --no-sqlite]
        [--shards 1,2,4] [--out bench_fold.json]

``--tree NAME=PATH`` (repeatable): more trees measured in the same run (e.g. the tree before a
change). ``--before``: a source tree to compare with (e.g. ``git archive 263364a^ | tar -x -C /tmp/before``,
the tree before the run aggregates entered the materializer's commit); this tree is "after".

Load: 32 trajectories a step (``max_trajectories=32``), ``--steps`` (2) steps a measurement
after one untimed step and, "after", one untimed compaction (first-use costs: imports,
statements); each
trajectory 4 turns, a 100-token first prompt, 500 output and 100 observation tokens a
turn: 2,400 unique tokens, 76,800 a step (bench_pipeline.py's load). Route layouts: none,
24x4 and 48x8 (uint8 ids of 128 experts); 1 or 4 model versions among a step's
trajectories. Stores filled before the clock, each measurement in a fresh process
(trees and cases interleaved, ``--rounds`` times, median).

Figures per case: tokens per CPU second of the materializer process (``materialize``, every
step, its commit included; "after" also the compaction of the run aggregates, once after
the steps as ``Materializer.run`` does, measured apart and included in
``tokens_per_cpu_s_with_compaction``), and on PostgreSQL the server's
CPU per step (every backend of the cluster, /proc). Shards (``--shards``, PostgreSQL,
this tree): N materializer processes of N shards at once over 32*N trajectories each... CPU
per token of the materializers and the server together (this machine has 2 cores: N
processes share them, so only the CPU per token, not the wall time, says whether shards
scale), and the share of 5 ms samples of ``pg_stat_activity`` in which a backend of the
store's database waited on a lock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"none": None, "24x4": (24, 4), "48x8": (48, 8)}
PER_STEP = 32
STEPS = 2


# -- the child: one measurement on one tree ----------------------------------------------------

def _load(n: int, layout: tuple[int, int] | None, versions: int, start: int = 0) -> list[list[dict]]:
    import numpy as np

    from trajstore.demo._simulate import RolloutConfig, trajectory_events

    layers, topk = layout or (1, 1)
    cfg = RolloutConfig(turns=4, prompt_tokens=100, output_tokens=500, observation_tokens=100, layers=layers,
                        topk=topk, num_experts=128, mismatch_prob=0.0, abort_prob=0.0, fail_prob=0.0,
                        route_drift=0.0)
    out = []
    for i in range(start, start + n):
        events = trajectory_events(cfg, i, version=i % versions)
        if layout is None:
            events = [{k: v for k, v in e.items() if k not in ("routed_experts", "num_experts")} for e in events]
        else:
            rng = np.random.default_rng([99, i])
            longest = max(len(e["routed_experts"]) for e in events if e["type"] == "generation")
            table = np.argpartition(rng.random((longest, layers, 128), dtype=np.float32), topk,
                                    axis=-1)[..., :topk].astype(np.uint8)
            events = [dict(e, routed_experts=table[:len(e["routed_experts"])]) if e["type"] == "generation" else e
                      for e in events]
        out.append(events)
    return out


def _family(pid: int):
    """``(process dir, its stat fields after the name)`` of the postmaster ``pid`` and of its
    live children (its backends and workers)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(stat.parent.name) == pid or int(fields[1]) == pid:
                yield stat.parent, fields
        except (OSError, ValueError, IndexError):
            continue


def _schedstat_ns(proc: Path) -> int:
    """A live process's CPU nanoseconds (``/proc/<pid>/schedstat``)."""
    return int((proc / "schedstat").read_text().split()[0])


def _server_cpu(pid: int | None) -> float:
    """CPU seconds of the postmaster ``pid``, its live children (backends) and the children it
    reaped: a live process's from ``/proc/<pid>/schedstat`` (nanoseconds; ``stat`` counts in
    10 ms ticks, coarser than a step's server CPU), the reaped ones' from ``stat`` (ticks)."""
    if pid is None:
        return 0.0
    ticks, ns = 0, 0
    for proc, fields in _family(pid):
        try:
            ns += _schedstat_ns(proc)
        except (OSError, ValueError, IndexError):
            continue
        if int(proc.name) == pid:
            ticks += int(fields[13]) + int(fields[14])
    return ns / 1e9 + ticks / os.sysconf("SC_CLK_TCK")


def _database_cpu(pid: int | None, url: str) -> dict[int, int]:
    """CPU nanoseconds (``/proc/<pid>/schedstat``) of each live child of the postmaster
    ``pid`` that serves the database of ``url``: its backends and the autovacuum workers
    in it (their process titles name the database). The cluster's figure
    (``_server_cpu``) also holds every other database's autovacuum workers, and a reaped
    worker in 10 ms ticks: noise of a few ms a step here, where each case has a database."""
    if pid is None:
        return {}
    name = url.rsplit("/", 1)[-1].split("?", 1)[0]
    out = {}
    for proc, _ in _family(pid):
        try:
            title = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").split()
            if int(proc.name) != pid and name in title:
                out[int(proc.name)] = _schedstat_ns(proc)
        except (OSError, ValueError, IndexError):
            continue
    return out


def _database_cpu_since(pid: int | None, url: str, before: dict[int, int]) -> float:
    """Seconds of CPU the database's processes spent since ``before`` (``_database_cpu``)."""
    return sum(ns - before.get(p, 0) for p, ns in _database_cpu(pid, url).items()) / 1e9


def _cpu() -> float:
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def child(args: argparse.Namespace) -> dict:
    import trajstore
    from trajstore.materializer import Materializer

    layout = LAYOUTS[args.layout]
    store = trajstore.connect(args.url, payload=args.payload)
    if args.fill:
        for events in _load(args.fill, layout, args.versions):
            store.append(events)
        store.close()
        return {}
    if args.expert_every is not None:  # this tree's store setting (docs/report.md "Aggregates")
        from trajstore.log._aggregate_counts import EXPERT_SAMPLE_SETTING
        from trajstore.log._dialect import execute

        store.log.db.transaction("setting the expert-load sampling", lambda conn, d: execute(
            conn, f"INSERT INTO store_settings (name, value, updated_at) VALUES ({d.marks(3)})",
            (EXPERT_SAMPLE_SETTING, str(args.expert_every), time.time())))
    # a shard's step: 32 of its own trajectories (a step reads the next finished events of every shard)
    m = Materializer(store, max_trajectories=PER_STEP * args.num_shards, shard_index=args.shard,
                     num_shards=args.num_shards)
    after = "compact" in Materializer.run.__code__.co_varnames
    warm_cpu = _cpu()
    m.run(max_steps=1, compact=False) if after else m.run(max_steps=1)  # warm: first-use costs (imports, SQL)
    if after:  # the compaction's too: a materializer or GC worker compacts every pass, its statements built once
        from trajstore._upkeep.gc import compact_run_aggregates

        compact_run_aggregates(store)
    warm_cpu = _cpu() - warm_cpu
    counted = {s.trajectory_id for s in store.samples()}
    db0 = _database_cpu(args.postmaster, args.url)
    server0, cpu0, wall0 = _server_cpu(args.postmaster), _cpu(), time.perf_counter()
    stats = m.run(compact=False) if after else m.run()
    cpu1, server1, wall1 = _cpu(), _server_cpu(args.postmaster), time.perf_counter()
    db_cpu = _database_cpu_since(args.postmaster, args.url, db0)
    compact_cpu = compact_server = 0.0
    if after:
        compact_run_aggregates(store)
        compact_cpu, compact_server = _cpu() - cpu1, _server_cpu(args.postmaster) - server1
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in store.samples() if s.trajectory_id not in counted)
    store.close()
    return {"warm_step_cpu_s": warm_cpu, "cpu_s": cpu1 - cpu0, "server_cpu_s": server1 - server0,
            "database_cpu_s": db_cpu, "wall_s": wall1 - wall0,
            "compact_cpu_s": compact_cpu, "compact_server_cpu_s": compact_server, "tokens": tokens,
            "trajectories": stats.num_trajectories}


# -- growth: the aggregate tables per hour at 3,300 calls/s ------------------------------------

CALLS_PER_S = 3300
CALLS_PER_TRAJECTORY = 4
GROUP_SIZE = 8
VERSIONS_PER_HOUR = 6  # a new policy every 10 minutes


def growth(url: str, payload: str, trajectories: int, seconds: float) -> dict:
    """Fill a PostgreSQL store with ``trajectories`` trajectories of 4 calls (groups of 8, a new
    model version every 10 minutes of the clock) appended on a clock spread over ``seconds``,
    fold and compact them, then measure each aggregate table: its rows, its bytes
    (``pg_total_relation_size``, indexes and the compacted deltas' dead rows included: an
    upper bound) and a row's width (``pg_column_size``), before and after an
    archive of every trajectory but the newest hour's. The rows per hour at 3,300 calls/s
    follow from the keys (docs/benchmarks.md states how)."""
    import types

    import trajstore
    from trajstore._append import facts
    from trajstore._upkeep.gc import compact_run_aggregates
    from trajstore._upkeep.retention import archive_events
    from trajstore.demo._simulate import RolloutConfig, trajectory_events
    from trajstore.log._aggregates import FOLD_DELTA_TABLES, TABLES

    start = time.time() - seconds - 7200
    clock = [start]
    facts.time = types.SimpleNamespace(time=lambda: clock[0])  # this process only
    store = trajstore.connect(url, payload=payload)
    cfg = RolloutConfig(turns=CALLS_PER_TRAJECTORY, prompt_tokens=32, output_tokens=16, observation_tokens=8,
                        layers=2, topk=2, num_experts=8, group_size=GROUP_SIZE, seed=3)
    for i in range(trajectories):
        clock[0] = start + seconds * i / trajectories
        store.append(trajectory_events(cfg, i, version=int((clock[0] - start) // 600)))
    store.materialize()
    compact_run_aggregates(store)
    names = sorted({*TABLES, "agg_expert_load", "agg_trajectory_stats"} - set(FOLD_DELTA_TABLES.values()))

    def measure() -> dict:
        out = {}
        with store.log.read_engine.connect() as conn:
            conn.exec_driver_sql("ANALYZE")
            for name in names:
                rows = conn.exec_driver_sql(f"SELECT count(*) FROM {name}").scalar_one()
                size = conn.exec_driver_sql(f"SELECT pg_total_relation_size('{name}')").scalar_one()
                fine = conn.exec_driver_sql(f"SELECT count(*) FROM {name} WHERE width_s = 1").scalar_one() \
                    if "width_s" in conn.exec_driver_sql(f"SELECT * FROM {name} LIMIT 0").keys() else None
                width = conn.exec_driver_sql(f"SELECT avg(pg_column_size(t.*)) FROM {name} t").scalar_one()
                out[name] = {"rows": rows, "bytes": size, "bytes_per_row": size / rows if rows else None,
                             "rows_1s": fine, "row_width": float(width) if width is not None else None}
        return out

    before = measure()
    with tempfile.TemporaryDirectory() as archive:
        archive_events(store, archive, older_than_s=time.time() - (start + seconds - 3600))
    after = measure()
    store.close()
    return {"trajectories": trajectories, "seconds": seconds, "before_archive": before, "after_archive": after}


# -- the parent ---------------------------------------------------------------------------------

def _run_child(tree: Path, extra: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, str(REPO / "bench" / "bench_fold.py"), "--child", "--out", out.name, *extra],
                       check=True, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, cwd=tree)
        return json.loads(Path(out.name).read_text() or "{}")


class _LockWaits:
    """Samples, every 5 ms until ``stop``, whether a backend of database ``url`` waits on a
    lock (``pg_stat_activity.wait_event_type = 'Lock'``): the shards' lock waits."""

    def __init__(self, url: str) -> None:
        import threading

        import psycopg

        self.conn = psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)
        self.waiting = self.samples = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.005):
            n = self.conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                  "AND wait_event_type = 'Lock'").fetchone()[0]
            self.samples += 1
            self.waiting += int(n > 0)

    def stop(self) -> tuple[int, int]:
        self.done.set()
        self.thread.join()
        self.conn.close()
        return self.waiting, self.samples


def _postmaster(cluster) -> int:
    return int((Path(cluster.data_dir) / "postmaster.pid").read_text().split()[0])


SECTION = "[The fold with the run aggregates](#the-fold-with-the-run-aggregates--benchbench_foldpy)"


def summary_rows(summary: dict[str, dict], label: str = "") -> list[dict[str, str]]:
    """docs/benchmarks.md's summary rows of these results (bench/summary.py); ``label``: added to
    each row's "what" (a run of a few cases beside the full one's rows)."""
    def rate(key: str, with_compaction: bool = False) -> str:
        m = summary.get(key)
        if m is None:
            return "-"
        fold = f"{m['tokens_per_cpu_s'] / 1e6:.2f}"
        return f"{fold} ({m['tokens_per_cpu_s_with_compaction'] / 1e6:.2f})" if with_compaction else fold

    trees = sorted({k.rsplit(" ", 1)[1] for k in summary if "shards" not in k} - {"after", "before"})
    rows = []
    for backend in ("sqlite", "postgresql"):
        if not any(k.startswith(backend) and "shards" not in k for k in summary):
            continue
        layouts = [x for x in LAYOUTS if any(k.startswith(f"{backend} {x} ") for k in summary)]
        cells = [f"{layout} {rate(f'{backend} {layout} v1 after', True)} / {rate(f'{backend} {layout} v4 after', True)}"
                 for layout in layouts]
        base = [f"{layout} {rate(f'{backend} {layout} v1 before')} / {rate(f'{backend} {layout} v4 before')}"
                for layout in layouts]
        others = []
        for tree in trees:
            others.append(f"{tree}: " + ", ".join(
                f"{layout} {rate(f'{backend} {layout} v1 {tree}', True)} / {rate(f'{backend} {layout} v4 {tree}', True)}"
                for layout in layouts))
        figure = "M tokens/CPU-s, 1 / 4 versions a step, fold (with the compaction): " + ", ".join(cells)
        if backend == "postgresql":
            for v in ("v1", "v4"):
                a, b = summary.get(f"postgresql 48x8 {v} after"), summary.get(f"postgresql 48x8 {v} before")
                if a and b:
                    figure += (f"; server CPU per step (48×8, {v[1]} version{'s' if v == 'v4' else ''}) "
                               f"{1e3 * a['server_cpu_s_per_step']:.1f} ms (before {1e3 * b['server_cpu_s_per_step']:.1f})")
                    if "database_cpu_s_per_step" in a and "database_cpu_s_per_step" in b:
                        figure += (f", its database's processes {1e3 * a['database_cpu_s_per_step']:.1f} ms "
                                   f"(before {1e3 * b['database_cpu_s_per_step']:.1f})")
        rows.append({"what": f"the fold with the run aggregates, {backend}{label}", "figure": figure,
                     "baseline": "; ".join(["the tree before: " + ", ".join(base), *others]), "section": SECTION})
    shards = sorted((int(k.split()[-1]), m) for k, m in summary.items() if "shards" in k)
    if shards:
        rows.append({"what": f"the fold's shards on PostgreSQL, 48×8, aggregates on{label}",
                     "figure": "CPU (materializers + server) per token: " + ", ".join(
                         f"{k} shard{'s' if k > 1 else ''} {m['cpu_us_per_token_all']:.2f} µs" for k, m in shards)
                     + " (2 cores)" + ("; samples with a lock wait: " + ", ".join(
                         f"{100 * m['lock_wait_share']:.1f} %" for _, m in shards)
                         if all("lock_wait_share" in m for _, m in shards) else ""),
                     "baseline": "1 shard", "section": SECTION})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path)
    p.add_argument("--label", default="", help="added to the summary rows' \"what\" (e.g. ', 48x8 only')")
    p.add_argument("--exact", action="store_true",
                   help="also this tree counting every decode route (case 'exact': store_settings "
                        "expert_load_sample_every = 1) beside its default sampling")
    p.add_argument("--expert-every", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="another source tree measured in the same run (e.g. main=/tmp/main), beside before and after")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=STEPS, help="measured steps a case (after one untimed step)")
    p.add_argument("--no-postgres", action="store_true")
    p.add_argument("--no-sqlite", action="store_true", help="PostgreSQL's cases only (and its shards)")
    p.add_argument("--layouts", default="none,24x4,48x8")
    p.add_argument("--versions", default="1,4")
    p.add_argument("--shards", default="1,2,4", help="shard counts on PostgreSQL (empty: none)")
    p.add_argument("--out", default=None)
    p.add_argument("--growth", type=int, default=0, metavar="N",
                   help="instead: the aggregate tables' rows and bytes after N trajectories over --growth-s seconds "
                        "of clock (PostgreSQL), before and after an archive of all but the newest hour")
    p.add_argument("--growth-s", type=float, default=3 * 3600)
    # child options
    p.add_argument("--child", action="store_true")
    p.add_argument("--url")
    p.add_argument("--payload")
    p.add_argument("--layout", default="48x8")
    p.add_argument("--fill", type=int, default=0)
    p.add_argument("--postmaster", type=int, default=None)
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=1)
    args = p.parse_args()
    if args.child:
        args.versions = int(args.versions)
        got = child(args)
        Path(args.out).write_text(json.dumps(got))
        return
    if args.growth:
        sys.path.insert(0, str(REPO / "tests"))
        from pg_cluster import PgCluster

        cluster = PgCluster()
        cluster.start()
        try:
            with tempfile.TemporaryDirectory() as tmp:
                got = growth(cluster.create_database("growth"), f"{tmp}/p", args.growth, args.growth_s)
        finally:
            cluster.stop()
        got.update(command=" ".join(["bench/bench_fold.py", *sys.argv[1:]]),
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), loadavg=os.getloadavg())
        print(json.dumps(got, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(got, indent=1))
        return
    trees = {"after": REPO, **({"before": args.before.resolve()} if args.before else {}),
             **{t.split("=", 1)[0]: Path(t.split("=", 1)[1]).resolve() for t in args.tree}}
    if args.exact:
        trees["exact"] = REPO
    cluster = None
    if args.no_sqlite and args.no_postgres:
        p.error("--no-sqlite and --no-postgres leave nothing to measure")
    backends = [] if args.no_sqlite else ["sqlite"]
    if not args.no_postgres:
        sys.path.insert(0, str(REPO / "tests"))
        from pg_cluster import PgCluster

        cluster = PgCluster()
        cluster.start()
        backends.append("postgresql")
    results: dict[str, list[dict]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            n = 0

            def fresh(backend: str) -> tuple[str, str, list[str]]:
                nonlocal n
                n += 1
                url = f"sqlite:///{tmp}/s{n}.db" if backend == "sqlite" else cluster.create_database(f"b{n}")
                pm = [] if backend == "sqlite" else ["--postmaster", str(_postmaster(cluster))]
                return url, f"{tmp}/p{n}", pm

            for r in range(args.rounds):
                for backend in backends:
                    for layout in args.layouts.split(","):
                        for versions in args.versions.split(","):
                            for name, tree in trees.items():
                                url, payload, pm = fresh(backend)
                                common = ["--url", url, "--payload", payload, "--layout", layout,
                                          "--versions", versions]
                                _run_child(tree, [*common, "--fill", str(PER_STEP * (args.steps + 1))])
                                every = ["--expert-every", "1"] if name == "exact" else []
                                got = _run_child(tree, [*common, *pm, *every])
                                key = f"{backend} {layout} v{versions} {name}"
                                results.setdefault(key, []).append(got)
                                print(f"round {r + 1} {key}: {got}", file=sys.stderr, flush=True)
            shards = [int(x) for x in args.shards.split(",") if x] if cluster is not None else []
            for r in range(args.rounds):
                for k in shards:
                    url, payload, pm = fresh("postgresql")
                    common = ["--url", url, "--payload", payload, "--layout", "48x8", "--versions", "1"]
                    _run_child(REPO, [*common, "--fill", str(PER_STEP * (args.steps + 1) * k)])
                    server0 = _server_cpu(_postmaster(cluster))
                    waits = _LockWaits(url)
                    t0 = time.perf_counter()
                    outs = []
                    procs = []
                    for i in range(k):
                        f = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
                        outs.append(f.name)
                        procs.append(subprocess.Popen(
                            [sys.executable, str(REPO / "bench" / "bench_fold.py"), "--child", "--out", f.name,
                             *common, "--shard", str(i), "--num-shards", str(k)],
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, cwd=REPO))
                    for pr in procs:
                        assert pr.wait() == 0
                    wall = time.perf_counter() - t0
                    lock_samples, samples = waits.stop()
                    server = _server_cpu(_postmaster(cluster)) - server0
                    parts = [json.loads(Path(o).read_text()) for o in outs]
                    tokens = sum(x["trajectories"] for x in parts) * 2400  # one 2,400-token sample each
                    got = {"shards": k, "tokens": tokens, "wall_s": wall, "server_cpu_s": server,
                           "cpu_s": sum(x["cpu_s"] for x in parts),
                           "compact_cpu_s": sum(x["compact_cpu_s"] for x in parts),
                           "trajectories": sum(x["trajectories"] for x in parts),
                           "lock_wait_share": lock_samples / max(samples, 1), "activity_samples": samples}
                    results.setdefault(f"postgresql shards {k}", []).append(got)
                    print(f"round {r + 1} shards {k}: {got}", file=sys.stderr, flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
    summary = {}
    for key, runs in results.items():
        med = {f: statistics.median(x[f] for x in runs) for f in runs[0] if isinstance(runs[0][f], (int, float))}
        tokens = med["tokens"] or PER_STEP * args.steps * 2400
        med["tokens_per_cpu_s"] = tokens / med["cpu_s"]
        med["tokens_per_cpu_s_with_compaction"] = tokens / (med["cpu_s"] + med.get("compact_cpu_s", 0.0))
        med["server_cpu_s_per_step"] = med["server_cpu_s"] / args.steps if "shards" not in key else med["server_cpu_s"]
        if "database_cpu_s" in med:
            med["database_cpu_s_per_step"] = med["database_cpu_s"] / args.steps
        if "shards" in key:
            med["cpu_us_per_token_all"] = 1e6 * (med["cpu_s"] + med["compact_cpu_s"] + med["server_cpu_s"]) / tokens
        summary[key] = med
    doc = {"bench": "bench_fold", "command": " ".join(["bench/bench_fold.py", *sys.argv[1:]]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg": os.getloadavg(),
           "rounds": args.rounds, "results": summary, "runs": results, "summary": summary_rows(summary, args.label)}
    print(f"{'case':34s} {'M tok/CPU-s':>11s} {'+compact':>9s} {'server CPU ms/step':>18s} {'its database':>12s}")
    for key, med in summary.items():
        print(f"{key:34s} {med['tokens_per_cpu_s'] / 1e6:11.2f} {med['tokens_per_cpu_s_with_compaction'] / 1e6:9.2f} "
              f"{1e3 * med['server_cpu_s_per_step']:18.1f} {1e3 * med.get('database_cpu_s_per_step', 0.0):12.1f}"
              + (f"  all CPU {med['cpu_us_per_token_all']:.3f} us/token"
                                                            if "cpu_us_per_token_all" in med else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
