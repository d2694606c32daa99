"""One benchmark path of bench_pipeline.py on two source trees, interleaved.

    python bench/compare_trees.py BEFORE_TREE AFTER_TREE [--only append] [--rounds 3]

Each round runs ``bench_pipeline.py --only PATH --rounds 1 --no-postgres`` in a
fresh process on BEFORE, then on AFTER (the same bench file in both trees:
copy this tree's bench/bench_pipeline.py into BEFORE first), and the medians
of the CPU seconds per measurement are printed side by side with their ratio.
CPU seconds are steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _run(tree: Path, only: str) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, str(tree / "bench" / "bench_pipeline.py"), "--only", only, "--rounds", "1",
                        "--no-postgres", "--out", out.name], cwd=tree, check=True, stdout=subprocess.DEVNULL,
                       env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})
        doc = json.loads(Path(out.name).read_text())
    return doc["pipeline"]["cpu_s_median"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--only", default="append")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for name in ("before", "after"):
            runs[name].append(_run(getattr(args, name).resolve(), args.only))
            print(f"round {r + 1} {name}: {runs[name][-1]}", file=sys.stderr)
    print(f"{'measurement':40s} {'before CPU s':>12s} {'after CPU s':>12s} {'after/before':>12s}")
    for key in runs["before"][0]:
        b = statistics.median(x[key] for x in runs["before"])
        a = statistics.median(x[key] for x in runs["after"])
        print(f"{key:40s} {b:12.3f} {a:12.3f} {a / b:12.2f}")


if __name__ == "__main__":
    main()
