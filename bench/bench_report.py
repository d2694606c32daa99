"""How long one refresh of the run view takes (``trajstore report``, ``--serve``), by store size.

Fills a SQLite store with the demo's simulated rollouts (materialized), then
times ``panels.collect`` (every panel's SQL in one read-only snapshot, plus the
token-level panels' segment reads) and its slowest queries. The live page
recomputes no more often than twice this time.

    python bench/bench_report.py --trajectories 500 1000 2000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace


def fill(url: str, n: int) -> None:
    import trajstore
    from trajstore.demo._run import DEMO_CONFIG
    from trajstore.demo._simulate import trajectory_events

    cfg = replace(DEMO_CONFIG, prompt_tokens=64, output_tokens=48, observation_tokens=16)
    with trajstore.connect(url) as store:
        for start in range(0, n, 100):
            batch = []
            for i in range(start, min(n, start + 100)):
                batch.extend(trajectory_events(cfg, i, version=i * 10 // n))
            store.append(batch)
        store.materialize()


def main() -> None:
    from trajstore.inspect import _report_page
    from trajstore.inspect._panels import collect
    from trajstore.inspect.sql import read_only

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, nargs="+", default=[500, 1000, 2000])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for n in args.trajectories:
        with tempfile.TemporaryDirectory() as d:
            url = f"sqlite:///{d}/run.db"
            fill(url, n)
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

                for _ in range(args.rounds):
                    t = time.perf_counter()
                    collect(timed, payload=payload)
                    totals.append(time.perf_counter() - t)
            slowest = sorted(times.items(), key=lambda kv: -min(kv[1]))[:3]
            print(f"{n:6d} trajectories: collect min {min(totals) * 1e3:7.0f} ms, median "
                  f"{sorted(totals)[len(totals) // 2] * 1e3:7.0f} ms over {len(times)} queries; slowest: "
                  + "; ".join(f"{min(v) * 1e3:.0f} ms {k[:60]!r}" for k, v in slowest))


if __name__ == "__main__":
    main()
