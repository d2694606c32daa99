"""How long one refresh of the run view takes (``trajstore report``, ``--serve``), and how
long an append takes to reach the page, by store size.

Fills a SQLite store through the public append path (``Store.append``, batches of
``--batch`` trajectories of the demo's simulated rollouts, ``--layers`` x ``--topk``
routes over ``--experts`` experts), materializes it, then:

* per panel: each panel's SQL, drawing and JSON on its own (the clock and the
  summary as panels of their own), best of ``--rounds``;
* refresh: times ``panels.collect`` (every panel's SQL in one read-only snapshot,
  as the live page runs it) over ``--rounds`` rounds, and names the slowest queries;
* append to page: appends ``--probe`` new trajectories under a new model version,
  runs the materializer's pass over them (what ``trajstore materialize --follow``
  does on its next poll) and one refresh, and checks the new version is on the
  expert-load and length panels; reports each part and their sum.

``--old DIR`` also times the refresh of another trajstore tree on the same store, in a
subprocess, for a side by side comparison (its panels read only what that tree knows).
An older tree needs this store's newest migrations to open it:
``git archive <commit> trajstore | tar -x -C DIR; cp trajstore/migrations/versions/0018_*
trajstore/migrations/versions/0019_* DIR/trajstore/migrations/versions/`` (and 0015 for a tree
from before the first aggregates).

    python bench/bench_report.py --trajectories 1000 10000 --layers 48 --topk 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

OLD_REFRESH = r"""
import json, sys, time
from trajstore.inspect._panels import collect
from trajstore.inspect.sql import read_only
url, payload, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
times, cpu = [], []
with read_only(url) as query:
    for _ in range(rounds):
        t, c = time.perf_counter(), time.process_time()
        collect(query, payload=payload)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
probe = []
if len(sys.argv) > 4:  # append to page by this tree: the probe's events (JSON), one materializer pass, one refresh
    import trajstore
    import pandas  # pyarrow's first sample table imports it once: not the probe's cost
    with open(sys.argv[4]) as f:
        events = json.load(f)
    with trajstore.connect(url) as store:
        t0 = time.perf_counter()
        store.append(events)
        t1 = time.perf_counter()
        store.materialize()
        t2 = time.perf_counter()
    with read_only(url) as query:
        collect(query, payload=payload)
    probe = [t1 - t0, t2 - t1, time.perf_counter() - t2]
print(json.dumps([times, cpu, probe]))
"""


def config(args: argparse.Namespace):
    from trajstore.demo._run import DEMO_CONFIG

    return replace(DEMO_CONFIG, prompt_tokens=64, output_tokens=48, observation_tokens=16, layers=args.layers,
                   topk=args.topk, num_experts=args.experts)


def fill(store, cfg, first: int, n: int, batch: int, versions: int, total: int) -> float:
    """Append trajectories ``first .. first + n`` in batches; returns the seconds spent appending."""
    from trajstore.demo._simulate import trajectory_events

    spent = 0.0
    for start in range(first, first + n, batch):
        events = []
        for i in range(start, min(first + n, start + batch)):
            events.extend(trajectory_events(cfg, i, version=i * versions // max(total, 1)))
        t = time.perf_counter()
        store.append(events)
        spent += time.perf_counter() - t
    return spent


def per_panel(query, payload: str, rounds: int) -> None:
    """Each panel's cost, its best of ``rounds``: SQL, drawing (Python and plotly's figure) and the
    figure's JSON; the clock and the summary count as panels of their own."""
    from trajstore.inspect import _panels
    from trajstore.inspect._figures import _clock, drawing, figure_json

    best: dict[str, list[float]] = {}

    def keep(name: str, sql: float, draw: float, js: float) -> None:
        have = best.get(name)
        best[name] = [sql, draw, js] if have is None else [min(a, b) for a, b in zip(have, (sql, draw, js))]

    for _ in range(rounds):
        t = time.perf_counter()
        clock = _clock(query, _panels.DEFAULT_STUCK_AFTER_S, payload)
        keep("(clock)", time.perf_counter() - t, 0.0, 0.0)
        t = time.perf_counter()
        _panels._summary(query)
        keep("(summary)", time.perf_counter() - t, 0.0, 0.0)
        with drawing():
            for panel in _panels.PANELS:
                t0 = time.perf_counter()
                results = [query(q) for q in panel.queries(clock)]
                t1 = time.perf_counter()
                drawn = panel.draw(clock, results)
                t2 = time.perf_counter()
                if not isinstance(drawn, str):
                    figure_json(drawn)
                keep(panel.name, t1 - t0, t2 - t1, time.perf_counter() - t2)
    total = [sum(v[i] for v in best.values()) for i in range(3)]
    print(f"  per panel (ms, best of {rounds}): SQL / draw / JSON; total {total[0] * 1e3:.0f} / "
          f"{total[1] * 1e3:.0f} / {total[2] * 1e3:.0f}")
    for name, (sql, draw, js) in sorted(best.items(), key=lambda kv: -sum(kv[1])):
        print(f"    {name:28s} {sql * 1e3:8.1f} {draw * 1e3:8.1f} {js * 1e3:8.1f}")


def _plain(event: dict) -> dict:
    """An event as JSON can carry it (arrays as lists)."""
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in event.items()}


class _kept:
    """``DIR/N``, made if missing and kept."""

    def __init__(self, root: str, n: int) -> None:
        self.path = os.path.join(root, str(n))

    def __enter__(self) -> str:
        os.makedirs(self.path, exist_ok=True)
        return self.path

    def __exit__(self, *exc: object) -> None:
        pass


def main() -> None:
    import trajstore
    from trajstore.inspect import _report_page
    from trajstore.inspect._panels import collect
    from trajstore.inspect.sql import read_only

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--versions", type=int, default=10, help="model versions over the run")
    p.add_argument("--batch", type=int, default=200, help="trajectories per append")
    p.add_argument("--probe", type=int, default=8, help="trajectories appended for the append-to-page latency")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--old", default=None, help="a directory holding another trajstore tree to time as well")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="build the stores in DIR/N and keep them; a later run with the same DIR resumes filling and "
                        "materializing where the last one stopped (a 10,000-trajectory store takes a while)")
    args = p.parse_args()
    cfg = config(args)
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"routes {cfg.layers} layers x top-{cfg.topk} of {cfg.num_experts} experts")
    for n in args.trajectories:
        with (tempfile.TemporaryDirectory() if args.keep is None else _kept(args.keep, n)) as d:
            url = f"sqlite:///{d}/run.db"
            with trajstore.connect(url) as store:
                t = time.perf_counter()
                have = len(store.log.load_trajectories([f"traj-{cfg.seed}-{i:06d}" for i in range(n)]))
                appending = fill(store, cfg, have, n - have, args.batch, args.versions, n)
                built = time.perf_counter() - t
                t = time.perf_counter()
                store.materialize()
                materializing = time.perf_counter() - t
                size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
                print(f"{n:7d} trajectories: built in {built:.0f} s ({appending:.0f} s in append), materialized in "
                      f"{materializing:.0f} s, {size / 1e9:.2f} GB")
                payload = _report_page.payload_location(url, None)
                times: dict[str, list[float]] = {}
                totals = []
                with read_only(url) as query:
                    def timed(sql: str):
                        t = time.perf_counter()
                        try:
                            return query(sql)
                        finally:
                            times.setdefault(sql, []).append(time.perf_counter() - t)

                    cpu = []
                    for _ in range(args.rounds):
                        t, c = time.perf_counter(), time.process_time()
                        collect(timed, payload=payload)
                        totals.append(time.perf_counter() - t)
                        cpu.append(time.process_time() - c)
                with read_only(url) as query:
                    per_panel(query, payload, args.rounds)
                sql_s = sum(min(v) for v in times.values())
                slowest = sorted(times.items(), key=lambda kv: -min(kv[1]))[:3]
                print(f"  refresh (new): min {min(totals) * 1e3:6.0f} ms, median {sorted(totals)[len(totals) // 2] * 1e3:6.0f}"
                      f" ms, CPU min {min(cpu) * 1e3:.0f} ms ({sql_s * 1e3:.0f} ms in {len(times)} queries); slowest: "
                      + "; ".join(f"{min(v) * 1e3:.0f} ms {k[:50]!r}" for k, v in slowest))
                # append to page: new trajectories under a new version, one materializer pass, one refresh
                newest = args.versions + 1
                # trajectories of their own each run (a kept store has the last run's probe already)
                probe_cfg = replace(cfg, seed=1 + int(time.time()) % 1_000_000)
                from trajstore.demo._simulate import trajectory_events

                events = [e for i in range(args.probe) for e in trajectory_events(probe_cfg, i, version=newest)]
                import pandas  # noqa: F401 - pyarrow's first sample table imports it (~1 s once): a running
                # materializer did long ago, so the probe does not pay it
                t0 = time.perf_counter()
                store.append(events)
                t1 = time.perf_counter()
                store.materialize()
                t2 = time.perf_counter()
                with read_only(url) as query:
                    data = collect(query, payload=payload)
                t3 = time.perf_counter()
                panels = {q["name"]: q for q in data["panels"]}
                shown = (str(newest) in panels["expert_load"]["figure"]["data"][0]["y"]
                         and any(tr.get("name") == f"version {newest}" for tr in panels["response_length"]["figure"]["data"]))
                print(f"  append to page: {(t3 - t0) * 1e3:6.0f} ms (append {(t1 - t0) * 1e3:.0f} ms, materialize "
                      f"{(t2 - t1) * 1e3:.0f} ms, refresh {(t3 - t2) * 1e3:.0f} ms); new version on the page: {shown}")
                sys.stdout.flush()
                if args.old:  # last: with the store closed (an old tree's connection in another process
                    # beside this one's open store made its next SQLite open fail with a disk I/O error)
                    store.close()
                    # cwd: not this checkout, or ``-c`` would import its trajstore before PYTHONPATH's
                    # the old tree's own append to page: trajectories of their own, under the same new version
                    old_cfg = replace(cfg, seed=2 + int(time.time()) % 1_000_000)
                    probe_file = os.path.join(d, "old-probe.json")
                    with open(probe_file, "w") as f:
                        json.dump([_plain(e) for i in range(args.probe)
                                   for e in trajectory_events(old_cfg, i, version=newest)], f)
                    out = subprocess.run([sys.executable, "-c", OLD_REFRESH, url, payload, str(args.rounds), probe_file],
                                         env={**os.environ, "PYTHONPATH": os.path.abspath(args.old)},
                                         capture_output=True, text=True, cwd=args.old)
                    if out.returncode:
                        print(f"  refresh (old): failed: {out.stderr.strip().splitlines()[-1]}")
                    else:
                        old, old_cpu, probe = json.loads(out.stdout.strip().splitlines()[-1])
                        print(f"  refresh (old): min {min(old) * 1e3:6.0f} ms, median "
                              f"{sorted(old)[len(old) // 2] * 1e3:6.0f} ms, CPU min {min(old_cpu) * 1e3:.0f} ms")
                        if probe:
                            print(f"  append to page (old): {sum(probe) * 1e3:6.0f} ms (append {probe[0] * 1e3:.0f} ms, "
                                  f"materialize {probe[1] * 1e3:.0f} ms, refresh {probe[2] * 1e3:.0f} ms)")


if __name__ == "__main__":
    main()
