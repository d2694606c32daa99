"""The append of bench_pipeline.py's load on two source trees, paired round by round.

    python bench/paired_append.py BEFORE_TREE AFTER_TREE [--rounds 20] [--batch 64]
    python bench/paired_append.py --steps TREE [--rounds 6]
    python bench/paired_append.py --coalesce TREE [--rounds 10] [--linger-ms 20]

On a machine whose speed drifts from one minute to the next, separate runs of
``bench_pipeline.py`` differ as much between runs of one tree as between
trees. Here two long-lived processes, one per tree, each encode the load once
(32 trajectories x 4 turns as wire events, bench_pipeline.arrays_load) and
then, alternately and in alternating order, run one round: the raw Parquet
write of the unique arrays, then the 32 one-call-per-trajectory appends into
a new SQLite store. Each round of one tree is compared with the round of the
other run next to it.

``--batch N``: the calls are the 224 wire events turn-major (event k of
every trajectory, then event k+1: what a Writer or the service receives from
32 trajectories generating at once) in batches of N events per
``store.append`` (64: what a busy Writer sends), instead of one call per
trajectory. Each round's files are deleted after it (page-cache pages are
then reused, as in a steady store, instead of ever new ones). Both trees'
rounds report wall and CPU (user + system of the process).

``--coalesce``: one tree, each round the raw write, then the same 32 calls
appended one after the other (each its own payload object and transaction),
then submitted at once to the group committer (``GroupCommitter``, the
coalescer of the ingest service, the proxies and the Writer: calls share
payload objects and transactions, bounded by its linger and bytes), each
into a new store; prints both ratios to the raw write and the calls per
object.

``--steps``: one tree, the time and CPU of each step of ``Store.append`` per
call (timers wrapped around the functions it calls; the last rounds after a
warm-up). ``--small-arrays``: the same events, calls and SQL with every array
cut to a few tokens and 2 x 2 routes: the append's cost that does not grow
with the arrays (also with two trees: the per-event and per-call work paired).

``--preallocation``: one tree, the same process appending each round with a
log segment's blocks allocated ahead (``PayloadStore.write(at_least=...)``) and
without, alternating which goes first, for calls of ``--batch`` events (64 by
default) and one call per trajectory; wall and CPU of each, and their ratios
per pair.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _load(tree: str, small_arrays: bool = False):
    sys.path[:0] = [tree, os.path.join(tree, "bench")]
    import bench_pipeline as bp
    import trajstore

    if small_arrays:
        import dataclasses

        bp.CFG = dataclasses.replace(bp.CFG, prompt_tokens=4, output_tokens=4, observation_tokens=4, layers=2, topk=2)

    if not os.path.realpath(trajstore.__file__).startswith(os.path.realpath(tree)):
        raise SystemExit(f"imported {trajstore.__file__}, not the tree {tree}")
    trajs = bp.arrays_load(bp.TRAJECTORIES)
    return bp, trajstore, trajs, [bp.to_wire(t) for t in trajs]


def turn_major(wire: list[list[dict]], batch: int) -> list[list[dict]]:
    """The trajectories' events interleaved turn by turn, in appends of ``batch`` events."""
    flat = [t[k] for k in range(max(map(len, wire))) for t in wire if k < len(t)]
    return [flat[i:i + batch] for i in range(0, len(flat), batch)]


def child(tree: str, scratch: str, batch: int = 0, small_arrays: bool = False) -> None:
    """Serve rounds: one line in, one JSON line out."""
    bp, trajstore, trajs, wire = _load(tree, small_arrays)
    unique = bp.unique_table(trajs)
    calls = turn_major(wire, batch) if batch else wire
    print("ready", flush=True)
    for r, _ in enumerate(sys.stdin):
        t0, c0 = time.perf_counter(), time.process_time()
        bp.raw_write(unique, f"{scratch}/u{r}.parquet")
        raw, raw_cpu = time.perf_counter() - t0, time.process_time() - c0
        s = trajstore.connect(f"sqlite:///{scratch}/a{r}.db", payload=f"{scratch}/p{r}")
        t0, c0 = time.perf_counter(), time.process_time()
        for t in calls:
            s.append(t)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        s.close()
        if batch:
            for f in os.listdir(scratch):
                path = os.path.join(scratch, f)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        print(json.dumps({"raw": raw, "raw_cpu": raw_cpu, "wall": wall, "cpu": cpu}), flush=True)


def paired(before: str, after: str, rounds: int, batch: int = 0, small_arrays: bool = False) -> None:
    trees = {"before": before, "after": after}
    procs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for k, tree in trees.items():
            os.makedirs(f"{scratch}/{k}")
            procs[k] = subprocess.Popen([sys.executable, __file__, "--child", tree, f"{scratch}/{k}", str(batch),
                                         "small" if small_arrays else "full"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=dict(os.environ, PYTHONPATH=tree))
        for p in procs.values():
            if p.stdout.readline().strip() != "ready":
                raise SystemExit("a tree's process did not start")
        res: dict[str, list[dict]] = {k: [] for k in trees}
        for i in range(rounds):
            for k in (("before", "after") if i % 2 == 0 else ("after", "before")):
                procs[k].stdin.write("go\n")
                procs[k].stdin.flush()
                res[k].append(json.loads(procs[k].stdout.readline()))
            print(f"round {i + 1}/{rounds}", file=sys.stderr)
        for p in procs.values():
            p.stdin.close()
            p.wait()
    for k, rs in res.items():
        wall = [r["wall"] * 1e3 for r in rs]
        print(f"{k} ({trees[k]}): append wall median {statistics.median(wall):.1f} ms (min {min(wall):.1f}), "
              f"CPU median {statistics.median(r['cpu'] * 1e3 for r in rs):.1f} ms, "
              f"raw write median {statistics.median(r['raw'] * 1e3 for r in rs):.1f} ms")
        if batch:
            med = statistics.median
            print(f"  {k}: vs raw write, per round: wall {med(r['raw'] / r['wall'] for r in rs):.3f}x "
                  f"(min {min(r['raw'] / r['wall'] for r in rs):.3f}, max {max(r['raw'] / r['wall'] for r in rs):.3f}), "
                  f"CPU {med(r['raw_cpu'] / r['cpu'] for r in rs):.3f}x (raw write CPU median "
                  f"{med(r['raw_cpu'] * 1e3 for r in rs):.1f} ms)")
    ratio = [b["wall"] / a["wall"] for b, a in zip(res["before"], res["after"])]
    print(f"per round, before wall / after wall: median {statistics.median(ratio):.3f}, "
          f"after faster in {sum(x > 1 for x in ratio)} of {len(ratio)}")
    cpu_ratio = [b["cpu"] / a["cpu"] for b, a in zip(res["before"], res["after"])]
    print(f"per round, before CPU / after CPU: median {statistics.median(cpu_ratio):.3f}, "
          f"after cheaper in {sum(x > 1 for x in cpu_ratio)} of {len(cpu_ratio)}")


def coalesce(tree: str, rounds: int, linger_ms: float, max_batch_mb: float | None = None,
             committers: int = 1) -> None:
    bp, trajstore, trajs, wire = _load(tree)
    from trajstore.ingest._group_commit import GroupCommitter

    unique = bp.unique_table(trajs)
    res: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            t0 = time.perf_counter()
            bp.raw_write(unique, f"{d}/u{r}.parquet")
            raw = time.perf_counter() - t0
            s = trajstore.connect(f"sqlite:///{d}/a{r}.db", payload=f"{d}/p{r}")
            t0 = time.perf_counter()
            for t in wire:
                s.append(t)
            one_by_one = time.perf_counter() - t0
            s.close()
            s = trajstore.connect(f"sqlite:///{d}/c{r}.db", payload=f"{d}/q{r}")
            bound = {} if max_batch_mb is None else {"max_group_bytes": int(max_batch_mb * (1 << 20))}
            committer = GroupCommitter(s, linger_s=linger_ms / 1e3, committers=committers, **bound)
            t0 = time.perf_counter()
            for f in [committer.submit(t) for t in wire]:
                f.result()
            coalesced = time.perf_counter() - t0
            committer.close()
            s.close()
            res.append({"raw": raw, "one": one_by_one, "coalesced": coalesced,
                        "calls_per_object": committer.num_requests / max(1, committer.num_groups)})
            print(f"round {r + 1}: raw {raw * 1e3:.0f} ms, one by one {one_by_one * 1e3:.0f} ms "
                  f"(vs raw {raw / one_by_one:.3f}), coalesced {coalesced * 1e3:.0f} ms "
                  f"(vs raw {raw / coalesced:.3f}; {committer.num_groups} appends of "
                  f"{res[-1]['calls_per_object']:.1f} calls)", file=sys.stderr)
    med = statistics.median
    print(f"{len(wire)} calls (whole multi-turn trajectories as wire events) per round, {rounds} rounds, medians:")
    print(f"  raw Parquet write of the unique arrays: {med(x['raw'] for x in res) * 1e3:.1f} ms")
    print(f"  one append per call:  {med(x['one'] for x in res) * 1e3:.1f} ms, vs raw "
          f"{med(x['raw'] / x['one'] for x in res):.3f}x (per round)")
    print(f"  coalesced (linger {linger_ms:g} ms, max {max_batch_mb or 'default'} MiB, {committers} committer(s)): {med(x['coalesced'] for x in res) * 1e3:.1f} ms, vs raw "
          f"{med(x['raw'] / x['coalesced'] for x in res):.3f}x (per round), "
          f"{med(x['calls_per_object'] for x in res):.1f} calls per object")


def steps(tree: str, rounds: int, batch: int = 0, small_arrays: bool = False) -> None:
    bp, trajstore, _, wire = _load(tree, small_arrays)
    if batch:
        wire = turn_major(wire, batch)
    import trajstore._append.facts as facts
    try:
        import trajstore.log._events as lsql
    except ImportError:  # a tree from before the SQL index was split by job
        import trajstore.log.sql as lsql
    import trajstore.payload as pl
    try:
        import trajstore._append.pipeline as st  # the append's one pass
    except ImportError:  # a tree from before it left store.py
        import trajstore.store as st

    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])

    def timed(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                totals[label][0] += time.perf_counter() - t0
                totals[label][1] += time.thread_time() - c0

        setattr(owner, name, wrapper)

    if hasattr(st, "_parse_digesting"):  # a generation from the wire is digested at its parse
        timed(st, "_parse_digesting", "parse (+ digests of generations from the wire)")
    else:
        timed(st, "parse_all" if hasattr(st, "parse_all") else "_parse_all", "parse")
    timed(lsql.SqlEventLog, "load_append_state", "identities + trajectory rows")
    timed(st, "admit_batch", "admission")
    timed(facts, "segment_table", "segment table")
    timed(pl.PayloadStore, "write", "segment write")
    timed(st._Digests, "get", "content digests")
    timed(facts, "event_row", "event rows")
    timed(pl.PayloadStore, "make_durable", "segment sync (pooled thread)")
    timed(lsql.SqlEventLog, "commit_append", "index transaction (incl. waiting for the sync)")
    warm = max(1, rounds // 2)
    round_cpu: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            if r == warm:
                totals.clear()
            s = trajstore.connect(f"sqlite:///{d}/a{r}.db", payload=f"{d}/p{r}")
            t0, c0 = time.perf_counter(), time.process_time()
            for t in wire:
                s.append(t)
            round_cpu.append(time.process_time() - c0)
            print(f"round {r + 1}: {(time.perf_counter() - t0) * 1e3:.0f} ms for {len(wire)} calls", file=sys.stderr)
            s.close()
    calls = (rounds - warm) * len(wire)
    for label, (wall, cpu) in totals.items():
        print(f"{label:48s} wall {wall / calls * 1e3:6.3f} ms  CPU {cpu / calls * 1e3:6.3f} ms per call")
    print(f"the append: CPU {statistics.median(round_cpu[warm:]) * 1e3:.1f} ms a round (median, process CPU)")


def preallocation(tree: str, rounds: int, batch: int) -> None:
    bp, trajstore, _, wire = _load(tree)
    import trajstore.payload._store as ps

    forms = {f"calls of {batch}": turn_major(wire, batch), "one call per trajectory": wire}
    on_threshold = ps._PREALLOCATE_BYTES
    res: dict[tuple[str, bool], list[tuple[float, float]]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as d:
        for r in range(rounds):
            for form, calls in forms.items():
                for on in ((True, False) if r % 2 else (False, True)):
                    ps._PREALLOCATE_BYTES = on_threshold if on else 1 << 62
                    s = trajstore.connect(f"sqlite:///{d}/a.db", payload=f"{d}/p")
                    c0, t0 = time.process_time(), time.perf_counter()
                    for t in calls:
                        s.append(t)
                    res[form, on].append((time.perf_counter() - t0, time.process_time() - c0))
                    s.close()
                    for f in os.listdir(d):
                        path = os.path.join(d, f)
                        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            print(f"round {r + 1}/{rounds}", file=sys.stderr)
    ps._PREALLOCATE_BYTES = on_threshold
    med = statistics.median
    for form in forms:
        off, on = res[form, False], res[form, True]
        print(f"{form}: wall without / with {med(x[0] for x in off) * 1e3:.1f} / {med(x[0] for x in on) * 1e3:.1f} ms, "
              f"CPU {med(x[1] for x in off) * 1e3:.1f} / {med(x[1] for x in on) * 1e3:.1f} ms; per pair, without / "
              f"with: wall {med(a[0] / b[0] for a, b in zip(off, on)):.3f}, CPU {med(a[1] / b[1] for a, b in zip(off, on)):.3f} "
              f"(cheaper in {sum(a[1] > b[1] for a, b in zip(off, on))} of {len(on)})")


def main() -> None:
    if len(sys.argv) in (4, 5, 6) and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) >= 5 else 0,
                     len(sys.argv) == 6 and sys.argv[5] == "small")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="+", help="BEFORE AFTER, or one tree with --steps")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--steps", action="store_true")
    ap.add_argument("--coalesce", action="store_true")
    ap.add_argument("--preallocation", action="store_true")
    ap.add_argument("--small-arrays", action="store_true", help="--steps, or two trees: every array a few tokens, 2 x 2 routes")
    ap.add_argument("--linger-ms", type=float, default=20.0)
    ap.add_argument("--max-batch-mb", type=float, default=None, help="--coalesce: the group's byte bound")
    ap.add_argument("--committers", type=int, default=1, help="--coalesce: groups appended at once")
    ap.add_argument("--batch", type=int, default=0,
                    help="two trees: events per store.append, turn-major (0: one call per trajectory)")
    args = ap.parse_args()
    if args.coalesce:
        if len(args.trees) != 1:
            ap.error("--coalesce takes one tree")
        return coalesce(os.path.abspath(args.trees[0]), args.rounds or 10, args.linger_ms, args.max_batch_mb,
                        args.committers)
    if args.preallocation:
        if len(args.trees) != 1:
            ap.error("--preallocation takes one tree")
        return preallocation(os.path.abspath(args.trees[0]), args.rounds or 12, args.batch or 64)
    if args.steps:
        if len(args.trees) != 1:
            ap.error("--steps takes one tree")
        return steps(os.path.abspath(args.trees[0]), args.rounds or 6, args.batch, args.small_arrays)
    if len(args.trees) != 2:
        ap.error("give BEFORE and AFTER trees")
    paired(*(os.path.abspath(t) for t in args.trees), args.rounds or 20, args.batch, args.small_arrays)


if __name__ == "__main__":
    main()
