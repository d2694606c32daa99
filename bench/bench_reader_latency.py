"""Follow-mode hand-over latency: how long after a step's last group becomes
readable the trainer has the step, locally (``SampleReader``) and through the
replay service (``ReplayReader`` and a ``trajstore replay`` process).

    PYTHONPATH=. .venv/bin/python bench/bench_reader_latency.py [--groups 40] [--interval-s 0.25]
        [--group-size 4] [--poll 0.02,0.5] [--store-url URL] [--out FILE]

A writer process finishes one GRPO group every ``--interval-s`` seconds: it
appends the group's trajectories, runs the materializer, and notes the time
the materializer's commit returned (from then on the group is below the
watermark: readable). The reader follows with ``keep_groups`` and one group
per step (``batch_size = group_size``) and notes when each step is handed to
it. Latency = hand-over time - the commit time of the step's group (the same
machine's clock). Reported per path and ``poll_interval_s``: p50, p99, max in
milliseconds, and how many steps arrived. A step is handed over as soon as it
is full, so the latency is bounded by the poll interval plus one poll's
queries; before that change a step waited for the next group (one
``--interval-s``), and the last one for ``timeout_s``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trajstore.demo._simulate import RolloutConfig, trajectory_events  # noqa: E402

CFG = RolloutConfig(turns=1, prompt_tokens=64, output_tokens=32, observation_tokens=8, layers=4, topk=2,
                    num_experts=16, group_size=4, mismatch_prob=0.0, abort_prob=0.0, fail_prob=0.0, seed=5)


def _writer(url: str, payload: str, groups: int, group_size: int, interval_s: float, start: int, out: str) -> None:
    """Finish one group every ``interval_s``; one JSON line per group: its id and commit time."""
    import trajstore
    from trajstore.materializer import Materializer

    cfg = dataclasses.replace(CFG, group_size=group_size)
    store = trajstore.connect(url, payload=payload, migrate=False)
    m = Materializer(store)
    with open(out, "a") as f:
        tick = time.monotonic()
        for g in range(start, start + groups):
            tick += interval_s
            time.sleep(max(0.0, tick - time.monotonic()))
            events = [trajectory_events(cfg, g * group_size + k) for k in range(group_size)]
            for ev in events:
                store.append(ev)
            m.run()
            f.write(json.dumps({"group": events[0][0]["group_id"], "t": time.time()}) + "\n")
            f.flush()
    store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run(kind: str, poll_s: float, url: str, payload: str, args: argparse.Namespace, start: int) -> dict:
    from trajstore.reader import SampleReader
    from trajstore.replay import ReplayReader

    commits = os.path.join(tempfile.mkdtemp(prefix="latency-"), "commits.jsonl")
    server = None
    settings = dict(batch_size=args.group_size, keep_groups=True, group_size=args.group_size, follow=True,
                    timeout_s=60.0, poll_interval_s=poll_s)
    if kind == "remote":
        port = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "trajstore.cli", "replay", "--store", url, "--payload", payload,
                                   "--port", str(port), "--insecure-no-auth"], cwd=REPO, stderr=subprocess.PIPE,
                                  text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        while "listening on" not in (server.stderr.readline() or "listening on"):
            pass
        reader = ReplayReader(f"grpc://127.0.0.1:{port}", **settings)
    else:
        reader = SampleReader(url, payload=payload, **settings)
    writer = subprocess.Popen([sys.executable, __file__, "--writer", url, payload, str(args.groups),
                               str(args.group_size), str(args.interval_s), str(start), commits], cwd=REPO)
    for _ in range(start):  # the groups of the earlier runs
        next(reader)
    handed: dict[str, float] = {}
    try:
        for batch in reader:
            handed[batch[0].group_id] = time.time()
            if len(handed) == args.groups:
                break
    finally:
        writer.wait(timeout=120)
        reader.close()
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
    with open(commits) as f:
        committed = {r["group"]: r["t"] for r in map(json.loads, f)}
    latencies_ms = [1000 * (handed[g] - t) for g, t in committed.items() if g in handed]
    return {"path": kind, "poll_interval_s": poll_s, "steps": len(latencies_ms), "groups": len(committed),
            "p50_ms": round(_percentile(latencies_ms, 50), 1), "p99_ms": round(_percentile(latencies_ms, 99), 1),
            "max_ms": round(max(latencies_ms, default=float("nan")), 1)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=40, help="groups the writer finishes per run")
    p.add_argument("--interval-s", type=float, default=0.25, help="seconds between two finished groups")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--poll", default="0.02,0.5", help="poll_interval_s values, comma-separated")
    p.add_argument("--paths", default="local,remote")
    p.add_argument("--store-url", default=None, help="an empty store (default: a new SQLite one)")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    args = p.parse_args(argv)
    import trajstore

    d = tempfile.mkdtemp(prefix="bench-latency-")
    url = args.store_url or f"sqlite:///{d}/store.db"
    payload = f"{d}/payload"
    trajstore.connect(url, payload=payload).close()
    results, start = [], 0
    for poll_s in [float(x) for x in args.poll.split(",")]:
        for kind in args.paths.split(","):
            r = run(kind, poll_s, url, payload, args, start)
            start += args.groups
            results.append(r)
            print(f"{r['path']:6s} poll {r['poll_interval_s']:<5g} steps {r['steps']}/{r['groups']}  "
                  f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  max {r['max_ms']:7.1f} ms", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["--writer"]:
        u, pl, n, gs, iv, st, out = sys.argv[2:]
        _writer(u, pl, int(n), int(gs), float(iv), int(st), out)
    else:
        main()
