"""What the rollout ledger costs: the resume plan of a long run, and the append.

    python bench/bench_ledger.py [--groups 100000] [--open 64] [--rounds 5] [--appends 300] [--postgres | --url URL]
                                 [--out bench/results/bench_ledger.json]

A store is filled (``Store.append``, batches of 1,000 groups) with a run ``long`` of
``--groups`` groups of one trajectory each, started and finished ``completed``
(whole), then ``--open`` open groups of two trajectories, each with one call of
256 tokens recorded and still running (their tails are read), and a run ``short`` of
100 such whole groups and 8 such open groups. Reported per backend (median of
``--rounds``; wall and process CPU milliseconds; the machine is shared, so CPU is
the steadier figure):

* ``rollout_state("long")``: the plan of the long run (one read of its
  ``ledger_groups`` rows and their trajectories, and the tails of its running
  trajectories);
* ``rollout_state("short")`` in the same store: a run's plan costs its own groups,
  not the log's length or the other runs';
* the append of one trajectory's ``trajectory_started`` + one call + its finish,
  one append per trajectory as a recording proxy makes them (``--appends`` each):
  with the ledger's fields, with a plain ``group_id``, and with neither, side by side
  in one window.

``--postgres`` also runs it on a throwaway PostgreSQL (tests/pg_cluster.py); ``--url``
on a given one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trajstore  # noqa: E402

TOKENS = 256


def _started(tid: str, gid: str, run: str, prompt: str, size: int) -> dict:
    return {"type": "trajectory_started", "trajectory_id": tid, "group_id": gid, "run": run, "prompt_id": prompt,
            "epoch": 0, "group_size": size}


def _call(tid: str) -> dict:
    return {"type": "generation", "trajectory_id": tid, "seq": 0, "prompt_ids": list(range(TOKENS // 2)),
            "output_ids": list(range(TOKENS // 2)), "model_version": 1}


def _fill(store, run: str, whole: int, open_: int) -> None:
    batch = 1000
    for lo in range(0, whole, batch):
        events = []
        for i in range(lo, min(whole, lo + batch)):
            tid = f"{run}-w{i}"
            events += [_started(tid, f"{run}-g{i}", run, f"p{i}", 1),
                       {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}]
        store.append(events)
    events = []
    for i in range(open_):
        for k in range(2):
            tid = f"{run}-o{i}-{k}"
            events += [_started(tid, f"{run}-og{i}", run, f"open{i}", 2), _call(tid)]
    store.append(events)


def _timed(fn, rounds: int) -> dict:
    walls, cpus = [], []
    for _ in range(rounds):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append((time.perf_counter() - w) * 1e3)
        cpus.append((time.process_time() - c) * 1e3)
    return {"wall_ms_median": round(statistics.median(walls), 2), "wall_ms_best": round(min(walls), 2),
            "cpu_ms_median": round(statistics.median(cpus), 2)}


def _appends(store, n: int) -> dict:
    """One append per trajectory (start + call + finish), three kinds interleaved in one window."""
    kinds = {
        "ledger": lambda i: _started(f"a-l{i}", f"a-lg{i}", "appends", f"q{i}", 1),
        "group_id": lambda i: {"type": "trajectory_started", "trajectory_id": f"a-g{i}", "group_id": f"a-gg{i}"},
        "plain": lambda i: {"type": "trajectory_started", "trajectory_id": f"a-p{i}"},
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for i in range(n):
        for name, start in kinds.items():
            ev = start(i)
            tid = ev["trajectory_id"]
            batch = [ev, _call(tid), {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}]
            w, c = time.perf_counter(), time.process_time()
            store.append(batch)
            times[name].append(((time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3))
    return {name: {"wall_ms_median": round(statistics.median(t[0] for t in ts), 3),
                   "cpu_ms_median": round(statistics.median(t[1] for t in ts), 3)} for name, ts in times.items()}


def run(url: str, payload: str, groups: int, open_: int, rounds: int, appends: int) -> dict:
    store = trajstore.connect(url, payload=payload)
    t = time.perf_counter()
    _fill(store, "long", groups, open_)
    _fill(store, "short", 100, 8)
    fill_s = time.perf_counter() - t
    plan = store.rollout_state("long")
    assert len(plan.whole) == groups and len(plan.open) == open_ and len(plan.dispatched) == groups + open_
    assert all(len(g.running) == 2 and len(g.running[0].tokens) == TOKENS for g in plan.open)
    out = {"url": url.split("@")[-1] if "@" in url else "sqlite", "groups": groups, "open": open_,
           "fill_s": round(fill_s, 1), "events": store.log.head_position(),
           "rollout_state_long": _timed(lambda: store.rollout_state("long"), rounds),
           "rollout_state_short": _timed(lambda: store.rollout_state("short"), rounds),
           "append_one_trajectory": _appends(store, appends)}
    store.close()
    return out


SECTION = "[Rollout ledger](#rollout-ledger--benchbench_ledgerpy)"


def summary_rows(results: dict) -> list[dict[str, str]]:
    """docs/benchmarks.md's summary rows of these results (bench/summary.py): per backend, the long
    run's plan, a short run's plan in the same store, and the append with the ledger's fields beside
    the plain one, measured in the same window (medians, process CPU)."""
    rows = []
    for b in results["backends"]:
        name = "SQLite" if b["url"] == "sqlite" else "PostgreSQL"
        long_, short = b["rollout_state_long"], b["rollout_state_short"]
        app = b["append_one_trajectory"]
        rows.append({
            "what": f"rollout ledger, {name}: resume plan and append",
            "figure": (f"plan of {b['groups']:,} whole + {b['open']} open groups {long_['cpu_ms_median']:.0f} ms CPU; "
                       f"a run of 108 groups in the same store {short['cpu_ms_median']:.1f} ms; append of one "
                       f"trajectory with the ledger's fields {app['ledger']['cpu_ms_median']:.1f} ms CPU"),
            "baseline": (f"the same append with a plain group_id {app['group_id']['cpu_ms_median']:.1f} ms, "
                         f"without a group {app['plain']['cpu_ms_median']:.1f} ms, same window"),
            "section": SECTION})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=100_000)
    parser.add_argument("--open", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--appends", type=int, default=300)
    parser.add_argument("--postgres", action="store_true")
    parser.add_argument("--url")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "bench_ledger.json"))
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    results = {"command": " ".join(["bench/bench_ledger.py", *sys.argv[1:]]),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "load_average": os.getloadavg()[0], "backends": []}
    results["backends"].append(run(f"sqlite:///{tmp}/store.db", os.path.join(tmp, "payload"), args.groups, args.open,
                                   args.rounds, args.appends))
    cluster, pg_url = None, args.url
    if args.postgres and pg_url is None:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from pg_cluster import PgCluster

        cluster = PgCluster()
        cluster.start()
        pg_url = cluster.create_database("bench_ledger")
    try:
        if pg_url is not None:
            results["backends"].append(run(pg_url, os.path.join(tmp, "pg-payload"), args.groups, args.open,
                                           args.rounds, args.appends))
    finally:
        if cluster is not None:
            cluster.stop()
    results["load_average_after"] = os.getloadavg()[0]
    results["summary"] = summary_rows(results)
    print(json.dumps(results, indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
