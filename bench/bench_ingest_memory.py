"""Peak memory of ``trajstore ingest FILE`` against the file's size.

Writes a JSONL file of simulated MoE trajectories (routes as nested JSON
lists, as a harness would dump them) of about ``--mb`` MB, then runs, each in
a fresh process on a fresh SQLite store, and reports the peak RSS
(``ru_maxrss``) of:

* ``stream``: ``trajstore ingest FILE`` (validate the whole file, then append
  in bounded batches; trajstore.ingest.jsonl);
* ``whole``: what ingest did before: every event of the file in one list,
  then one ``Store.append``.

    PYTHONPATH=. python bench/bench_ingest_memory.py --mb 200

Results and the command: docs/log.md, "Ingesting a file".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

WHOLE = """
import json, sys, trajstore
events = [json.loads(line) for line in open(sys.argv[2]) if line.strip()]
trajstore.connect(sys.argv[1]).append(events)
"""

def write_file(path: str, mb: float) -> tuple[int, int]:
    from trajstore.demo._simulate import RolloutConfig, trajectory_events

    cfg = RolloutConfig(turns=4, prompt_tokens=256, output_tokens=256, observation_tokens=64, layers=8, topk=2)
    n = size = 0
    with open(path, "w") as f:
        i = 0
        while size < mb * 1e6:
            for ev in trajectory_events(cfg, i):
                line = json.dumps({k: v.tolist() if hasattr(v, "tolist") else v for k, v in ev.items()}) + "\n"
                f.write(line)
                size += len(line)
                n += 1
            i += 1
    return n, size


def peak_rss_mb(argv: list[str]) -> tuple[float, float]:
    """Run ``argv`` in a child; its peak RSS in MiB and wall seconds."""
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1]) / 1024, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=200, help="size of the JSONL file to ingest (default 200)")
    ap.add_argument("--skip-whole", action="store_true", help="measure only the streaming ingest")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="trajstore-bench-ingest-") as tmp:
        path = os.path.join(tmp, "events.jsonl")
        n, size = write_file(path, args.mb)
        print(f"file: {size / 1e6:.0f} MB, {n} events")
        modes = [("stream", [sys.executable, "-m", "trajstore.cli", "--store", f"sqlite:///{tmp}/a.db", "ingest", path])]
        if not args.skip_whole:
            modes.append(("whole", [sys.executable, "-c", WHOLE, f"sqlite:///{tmp}/b.db", path]))
        for name, argv in modes:
            rss, wall = peak_rss_mb(argv)
            print(f"{name:7s} peak RSS {rss:7.0f} MiB  ({rss * 2**20 / size:.2f} x file)  wall {wall:5.1f} s")


if __name__ == "__main__":
    main()
