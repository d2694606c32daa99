"""Tokens a killed rollout driver generates again: resuming from the ledger vs restarting its groups.

Runs the kill -9 harness of the rollout driver (tests/rollout_kill.py: the
simulated engine, a real ``trajstore proxy``, the reference driver
``python -m trajstore.demo._rollout``) on a fresh store: one uninterrupted
run, then the same seed while SIGKILL hits the driver (and the proxy and the
engine) at random moments of its work. Reports, over all the kills:

* ``again_calls`` / ``again_tokens``: calls (output tokens) the engine
  generated that never reached the store, i.e. generated twice: the calls in
  flight at a kill;
* ``scratch_tokens``: the output tokens already recorded in the groups that
  were open at each driver kill, which a driver that restarts its open
  groups from scratch (what verl's and SkyRL's checkpoints amount to for the
  groups in flight) generates again.

    python bench/bench_rollout_resume.py --backend sqlite
    python bench/bench_rollout_resume.py --backend postgres --prompts 24 --kills 12

``--out FILE`` also writes the JSON (with the ``summary`` row bench/summary.py puts in
docs/benchmarks.md's table); default ``bench/results/bench_rollout_resume_<backend>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from rollout_kill import Setup, run_proof  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    p.add_argument("--prompts", type=int, default=Setup.prompts)
    p.add_argument("--group-size", type=int, default=Setup.group_size)
    p.add_argument("--turns", type=int, default=Setup.turns)
    p.add_argument("--kills", type=int, default=len(Setup.kills), help="driver kills, plus one proxy and one engine kill")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write the JSON (default bench/results/bench_rollout_resume_<backend>.json)")
    args = p.parse_args()
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    kills = ["driver"] * max(args.kills - 2, 1)
    kills[1:1] = ["proxy"]
    kills[3:3] = ["engine"]
    setup = Setup(prompts=args.prompts, group_size=args.group_size, turns=args.turns, kills=tuple(kills))
    with tempfile.TemporaryDirectory() as tmp:
        if args.backend == "postgres":
            from pg_cluster import PgCluster

            with PgCluster() as cluster:
                proof = run_proof(cluster.create_database("bench_rollout"), Path(tmp) / "work", setup, timeout_s=300)
        else:
            proof = run_proof(f"sqlite:///{tmp}/store.db", Path(tmp) / "work", setup, timeout_s=300)
    again = proof.engine_calls - proof.recorded
    out = {
        "command": " ".join(["bench/bench_rollout_resume.py", *sys.argv[1:]]), "date": date,
        "load_average": os.getloadavg()[0],
        "backend": args.backend, "prompts": setup.prompts, "group_size": setup.group_size, "turns": setup.turns,
        "kills": [k.victim for k in proof.kills],
        "calls_uninterrupted": sum(proof.ref_recorded.values()),
        "output_tokens_uninterrupted": sum(n * key[2] for key, n in proof.ref_recorded.items()),
        "again_calls": sum(again.values()),
        "again_tokens": sum(n * key[2] for key, n in again.items()),
        "scratch_tokens": sum(k.scratch_tokens for k in proof.kills),
        "continued_trajectories": sum(k.continued for k in proof.kills),
        "same_calls_as_uninterrupted": proof.recorded == proof.ref_recorded,
    }
    out["summary"] = summary_rows(out)
    print(json.dumps(out, indent=1))
    path = args.out or ROOT / "bench" / "results" / f"bench_rollout_resume_{args.backend}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))


def summary_rows(out: dict) -> list[dict[str, str]]:
    """docs/benchmarks.md's summary row of one run (bench/summary.py)."""
    kills = out["kills"]
    counts = " / ".join(str(kills.count(v)) for v in ("driver", "proxy", "engine"))
    name = "SQLite" if out["backend"] == "sqlite" else "PostgreSQL"
    return [{"what": f"rollout driver killed {len(kills)} times ({counts} driver / proxy / engine), {name}",
             "figure": (f"generated again: {out['again_calls']} calls, {out['again_tokens']} output tokens of "
                        f"{out['output_tokens_uninterrupted']:,} ({out['prompts']} prompts × {out['group_size']} "
                        f"episodes × {out['turns']} calls); same calls as uninterrupted: "
                        f"{'yes' if out['same_calls_as_uninterrupted'] else 'NO'}"),
             "baseline": f"restarting the open groups from scratch: {out['scratch_tokens']:,} tokens",
             "section": "[Rollout driver resume](#rollout-driver-resume-after-kill--9--benchbench_rollout_resumepy)"}]


if __name__ == "__main__":
    main()
