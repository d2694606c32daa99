"""docs/benchmarks.md's "Current figures" table is exactly what bench/summary.py makes of the
benches' committed JSON (bench/results/*.json): a figure edited by hand, or a bench run whose
rows were not written into the page, fails here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "benchmarks.md"
RESULTS = sorted((REPO / "bench" / "results").glob("*.json"))


def _summary():
    spec = importlib.util.spec_from_file_location("bench_summary", REPO / "bench" / "summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_table_is_generated_from_the_benches_json():
    summary = _summary()
    rows = summary.rows_of_files(RESULTS)
    assert rows, "no bench/results/*.json with summary rows"
    assert summary.table_rows(DOC.read_text()) == [summary._line(r) for r in rows], (
        "docs/benchmarks.md's summary table is stale: run PYTHONPATH=. python bench/summary.py --write docs/benchmarks.md")


def test_every_results_file_names_its_run_and_gives_rows():
    """A JSON file under bench/results/ says which command made it and when, and gives at least
    one row (a file the script cannot read rows from would drop out of the table unseen)."""
    summary = _summary()
    assert RESULTS
    for f in RESULTS:
        doc = json.loads(f.read_text())
        assert doc.get("command") and doc.get("date"), f
        rows = summary.rows_of(doc)
        assert rows, f
        for r in rows:
            assert set(r) == {"what", "figure", "baseline", "section", "command"}, (f, r)
            assert doc["date"] in r["command"], (f, r)


def test_a_stale_figure_is_caught(tmp_path):
    """The check itself: one figure changed by hand makes the table differ from the JSON."""
    summary = _summary()
    rows = summary.rows_of_files(RESULTS)
    text = DOC.read_text()
    line = summary._line(rows[0])
    stale = text.replace(line, line.replace(rows[0]["figure"], rows[0]["figure"] + " (edited)"), 1)
    assert stale != text
    assert summary.table_rows(stale) != [summary._line(r) for r in rows]
    assert summary.rewrite(stale, rows) == summary.rewrite(text, rows)
