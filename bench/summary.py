"""docs/benchmarks.md's summary table ("Current figures") from the benches' JSON output.

    PYTHONPATH=. .venv/bin/python bench/summary.py [bench/results/*.json] [--write docs/benchmarks.md]

Each JSON file is a bench's ``--out`` (default: every ``bench/results/*.json``, committed).
A bench names its own rows: a top-level ``"summary"`` list of ``{"what", "figure",
"baseline", "section"}`` beside its ``"command"``, ``"date"`` and load average
(``"loadavg"`` or ``"load_average"``): bench_fold.py, bench_ledger.py and
bench_rollout_resume.py write them; bench_pipeline.py's output is read by
``_pipeline_rows`` below. Each row's command cell carries the command, the date and the
load average of the run that measured it, so a figure is as fresh as the last run of
its bench and a regression shows in the next one.

Without ``--write`` the rows are printed. With it, the table of the "Current figures"
section becomes exactly these rows, files in name order, each file's rows in its order
(nothing in it is kept by hand: benches without JSON have their rows in the section
after it). ``--check`` exits 1 when the file's table is not that.
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
    """bench_pipeline.py's figures on SQLite: the append and the materializer against a raw
    Arrow write of the same arrays, and the bytes per unique token at rest."""
    res = doc.get("pipeline", {})
    section = "[Every bar beside the original code](benchmarks-history.md#every-bar-beside-the-original-code)"
    rounds = doc.get("rounds")
    rows = []
    appended = _ran(doc, "append")  # a run without the append path times it only to build its store
    batched = next((v for k, v in res.get("append", {}).items() if k.startswith("append, calls of")), None)
    new_rows = next((v for k, v in res.get("append", {}).items() if k.startswith("append, new route rows only")),
                    None)
    if appended and batched:
        bound = "" if not new_rows else (
            f"; the same calls sending only the rows not recorded yet (routed_experts_start): "
            f"{new_rows['vs_raw_per_round']:.3f}× wall, {new_rows['cpu_vs_raw_per_round']:.3f}× CPU")
        rows.append({"what": "append, calls of 64 wire events turn-major (routes re-sent each turn), vs raw "
                             "Parquet write",
                     "figure": f"{batched['vs_raw_per_round']:.3f}× wall, {batched['cpu_vs_raw_per_round']:.3f}× "
                               f"CPU (median of {rounds} rounds' ratios)",
                     "baseline": "a raw Parquet write (uncompressed, fsync) of the unique arrays, each round" + bound,
                     "section": "[Append in batches of 64](benchmarks-history.md#append-in-batches-of-64-as-a-writer-"
                                "sends-them--paired_appendpy---batch-64)"})
    app = res.get("append", {}).get("append, one call per trajectory")
    if app and appended:
        rows.append({"what": "append, one call per trajectory, vs raw Arrow + SQLite", "section": section,
                     "figure": f"{app['vs_raw']:.3f}× wall, {app['cpu_vs_raw']:.3f}× CPU (median of {rounds} rounds)",
                     "baseline": "a raw Arrow write of the same unique arrays, same rounds"})
    mat = res.get("materialize")
    if mat:
        rate = mat["materialize"]["tokens_per_cpu_s"] / 1e6
        raw = mat["raw write sample arrays"]["tokens_per_cpu_s"] / 1e6
        rows.append({"what": "materialize", "section": section,
                     "figure": f"{rate:.2f} M tokens/CPU-s (median of {rounds} rounds, 48×8 routes, aggregates on)",
                     "baseline": f"raw write of the same sample arrays {raw:.2f} M, same rounds"})
    rest = res.get("bytes_per_unique_token_after_gc_at_rest")
    if rest:
        before = res.get("bytes_per_unique_token", {}).get("total")
        rows.append({"what": "bytes per unique token at rest (after GC)", "section": section,
                     "figure": f"{rest['total']:.1f} (samples {rest['samples']:.1f}, SQL {rest['sql']:.1f}, "
                               f"log {rest['log']:.1f})",
                     "baseline": f"before the GC {before:.1f} (the log's copy and the samples')" if before else "-"})
    sizes = doc.get("bytes_by_store_size")
    if sizes:
        totals = {int(n): v["after_gc"]["total"] for n, v in sizes.items()}
        under = [n for n in sorted(totals) if all(totals[m] <= 420 for m in totals if m >= n)]
        samples = [v["after_gc"]["samples"] for v in sizes.values()]
        rows.append({"what": "bytes per unique token right after GC, by store size (trajectories of 2,400 tokens)",
                     "section": "[The whole pipeline](#the-whole-pipeline-on-the-rl-load--benchbench_pipelinepy)",
                     "figure": " · ".join(f"{n}: {totals[n]:.1f}" for n in sorted(totals))
                               + (f" (≤ 420 from {under[0]} trajectories)" if under else ""),
                     "baseline": f"the sample segments alone {min(samples):.1f}–{max(samples):.1f}; the SQL file "
                                 f"of an empty store is ~0.5 MB"})
    return rows


def _ran(doc: dict[str, Any], path: str) -> bool:
    """Did bench_pipeline's run include ``path`` (its ``--only``, recorded or in its command)?"""
    if "only" in doc:
        return path in doc["only"]
    words = (doc.get("command") or "").split()
    if "--only" in words[:-1]:
        return path in words[words.index("--only") + 1].split(",")
    return not any(w.startswith("--only=") and path not in w for w in words)


def rows_of(doc: dict[str, Any]) -> list[dict[str, str]]:
    rows = doc.get("summary") or (_pipeline_rows(doc) if "pipeline" in doc else [])
    command, date = doc.get("command"), doc.get("date")
    load = doc.get("loadavg", doc.get("load_average"))
    if isinstance(load, list):
        load = load[0]
    cell = f"`{command}`" if command else "(command not recorded)"
    if date:
        cell += f", {date}"
    if load is not None:
        cell += f", load average {load:.1f}"
    return [dict(r, command=cell) for r in rows]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _line(r: dict[str, str]) -> str:
    return f"| {r['what']} | {r['figure']} | {r['baseline']} | {r['command']} | {r['section']} |"


def _table(lines: list[str]) -> tuple[int, int]:
    """The first and past-the-last line of the summary table's rows (after its header)."""
    start = lines.index(HEADING)
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("| what |")) + 2
    end = first
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return first, end


def table_rows(text: str) -> list[str]:
    """The summary table's row lines of ``text`` (docs/benchmarks.md) as they stand."""
    lines = text.split("\n")
    first, end = _table(lines)
    return lines[first:end]


def rewrite(text: str, rows: list[dict[str, str]]) -> str:
    """``text`` (docs/benchmarks.md) with the summary table's rows exactly ``rows``."""
    lines = text.split("\n")
    first, end = _table(lines)
    return "\n".join(lines[:first] + [_line(r) for r in rows] + lines[end:])


def rows_of_files(files: list[Path]) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for f in sorted(files, key=lambda f: f.name):
        try:
            doc = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            sys.exit(f"bench/summary.py: cannot read {f}: {e}")
        if isinstance(doc, dict):
            rows.extend(rows_of(doc))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", type=Path)
    p.add_argument("--write", type=Path, default=None, help="the docs file whose summary table to update")
    p.add_argument("--check", type=Path, default=None, help="exit 1 if this docs file's summary table is not the rows")
    args = p.parse_args(argv)
    files = args.files or sorted((REPO / "bench" / "results").glob("*.json"))
    rows = rows_of_files(files)
    if not rows:
        sys.exit("bench/summary.py: no summary rows in " + ", ".join(map(str, files)))
    if args.check is not None:
        text = args.check.read_text()
        if rewrite(text, rows) != text:
            sys.exit(f"{args.check}: its summary table is not what bench/summary.py makes of {len(files)} file(s): "
                     f"run bench/summary.py --write {args.check}")
        print(f"{args.check}: summary table up to date ({len(rows)} row(s))")
        return
    if args.write is None:
        for r in rows:
            print(_line(r))
        return
    args.write.write_text(rewrite(args.write.read_text(), rows))
    print(f"{args.write}: {len(rows)} summary row(s) from {len(files)} file(s)")


if __name__ == "__main__":
    main()
