"""docs/benchmarks.md's summary table ("Current figures") from the benches' JSON output.

    PYTHONPATH=. .venv/bin/python bench/summary.py [bench/results/*.json] [--write docs/benchmarks.md]

Each JSON file is a bench's ``--out`` (default: every ``bench/results/*.json``). A bench
names its own rows: a top-level ``"summary"`` list of ``{"what", "figure", "baseline",
"section"}`` beside its ``"command"`` and ``"date"`` (bench_fold.py writes them);
bench_pipeline.py's output is read by ``_pipeline_rows`` below. Each row's command
cell carries the command and the date of the run that measured it, so a figure is as
fresh as the last run of its bench and a regression shows in the next one.

Without ``--write`` the rows are printed. With it, the rows of the table in the
"Current figures" section whose "what" cell is one of them are replaced (new ones are
appended to the table); the hand-kept rows of benches that write no JSON stay as they are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HEADING = "## Current figures"


def _pipeline_rows(doc: dict[str, Any]) -> list[dict[str, str]]:
    """bench_pipeline.py's materialize figure (the store's fold end to end, SQLite)."""
    res = doc.get("pipeline", {})
    mat = res.get("materialize")
    if not mat:
        return []
    rate = mat["materialize"]["tokens_per_cpu_s"] / 1e6
    raw = mat["raw write sample arrays"]["tokens_per_cpu_s"] / 1e6
    return [{"what": "materialize", "section": "[Every bar beside the original code](#every-bar-beside-the-original-code)",
             "figure": f"{rate:.2f} M tokens/CPU-s (median of {doc.get('rounds')} rounds, 48×8 routes, aggregates on)",
             "baseline": f"raw write of the same sample arrays {raw:.2f} M, same rounds"}]


def rows_of(doc: dict[str, Any]) -> list[dict[str, str]]:
    rows = doc.get("summary") or (_pipeline_rows(doc) if "pipeline" in doc else [])
    command, date = doc.get("command"), doc.get("date")
    out = []
    for r in rows:
        cmd = f"`{command}`" if command else "(command not recorded)"
        out.append(dict(r, command=f"{cmd}, {date}" if date else cmd))
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _line(r: dict[str, str]) -> str:
    return f"| {r['what']} | {r['figure']} | {r['baseline']} | {r['command']} | {r['section']} |"


def rewrite(text: str, rows: list[dict[str, str]]) -> str:
    """``text`` (docs/benchmarks.md) with the summary table's rows of ``rows`` replaced or added."""
    lines = text.split("\n")
    start = lines.index(HEADING)
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("| what |"))
    end = first
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    by_what = {r["what"]: r for r in rows}
    body = []
    for line in lines[first + 2:end]:
        what = _cells(line)[0]
        body.append(_line(by_what.pop(what)) if what in by_what else line)
    body.extend(_line(r) for r in by_what.values())
    return "\n".join(lines[:first + 2] + body + lines[end:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--write", type=Path, default=None, help="the docs file whose summary table to update")
    args = p.parse_args(argv)
    files = args.files or sorted((REPO / "bench" / "results").glob("*.json"))
    rows: list[dict[str, str]] = []
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"bench/summary.py: cannot read {f}: {e}")
        if isinstance(doc, dict):
            rows.extend(rows_of(doc))
    if not rows:
        sys.exit("bench/summary.py: no summary rows in " + ", ".join(map(str, files)))
    if args.write is None:
        for r in rows:
            print(_line(r))
        return
    args.write.write_text(rewrite(args.write.read_text(), rows))
    print(f"{args.write}: {len(rows)} summary row(s) from {len(files)} file(s)")


if __name__ == "__main__":
    main()
