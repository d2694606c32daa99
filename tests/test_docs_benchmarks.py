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


def test_pipeline_append_and_bytes_rows():
    """bench_pipeline.py's JSON: the append rows come only from a run that had the append path
    (a ``--only materialize`` run times an append to build its store, not as a figure); the
    turn-major append row gives each round's ratio; the bytes row names the smallest store
    size from which every measured size is within 420 bytes per token."""
    summary = _summary()
    batch = {"tokens_per_s": 1, "tokens_per_cpu_s": 1, "vs_raw": 0.4, "cpu_vs_raw": 0.3,
             "vs_raw_per_round": 0.512, "cpu_vs_raw_per_round": 0.345}
    one = {"tokens_per_s": 1, "tokens_per_cpu_s": 1, "vs_raw": 0.3, "cpu_vs_raw": 0.2}
    pipeline = {"append": {"append, calls of 64 events turn-major": batch, "append, one call per trajectory": one}}
    sizes = {str(n): {"after_gc": {"total": t, "samples": 399.0, "sql": t - 399.0, "log": 0.0}}
             for n, t in ((1, 627.8), (8, 427.9), (16, 412.0), (32, 406.9))}
    doc = {"command": "bench/bench_pipeline.py --only append,bytes", "date": "2026-01-01 00:00 UTC", "rounds": 5,
           "only": ["append", "bytes"], "pipeline": pipeline, "bytes_by_store_size": sizes}
    rows = summary.rows_of(doc)
    assert [r["what"].split(",")[0] for r in rows] == ["append", "append", "bytes per unique token right after GC"]
    assert rows[0]["figure"] == "0.512× wall, 0.345× CPU (median of 5 rounds' ratios)"
    assert rows[2]["figure"] == "1: 627.8 · 8: 427.9 · 16: 412.0 · 32: 406.9 (≤ 420 from 16 trajectories)"
    for without_append in ({"only": ["materialize"]}, {"command": "bench/bench_pipeline.py --only materialize"}):
        other = {k: v for k, v in doc.items() if k not in ("only", "bytes_by_store_size")} | without_append
        assert summary.rows_of(other) == []
    assert len(summary.rows_of({k: v for k, v in doc.items() if k != "only"} | {"command": "bench/bench_pipeline.py"})) == 3


def test_pipeline_append_row_names_the_new_rows_bound():
    """The turn-major append row's baseline cell carries the same calls sending only the
    route rows not recorded yet, when the run measured them (the bound of any saving on
    the re-sent rows), and says nothing of it when it did not."""
    summary = _summary()
    batch = {"tokens_per_s": 1, "tokens_per_cpu_s": 1, "vs_raw": 0.4, "cpu_vs_raw": 0.3,
             "vs_raw_per_round": 0.444, "cpu_vs_raw_per_round": 0.429}
    bound = dict(batch, vs_raw_per_round=0.561, cpu_vs_raw_per_round=0.532)
    doc = {"command": "bench/bench_pipeline.py --only append", "date": "2026-01-01 00:00 UTC", "rounds": 9,
           "only": ["append"], "pipeline": {"append": {
               "append, calls of 64 events turn-major": batch,
               "append, new route rows only, calls of 64 events turn-major": bound}}}
    (row,) = summary.rows_of(doc)
    assert row["figure"] == "0.444× wall, 0.429× CPU (median of 9 rounds' ratios)"
    assert row["baseline"].endswith("only the rows not recorded yet (routed_experts_start): 0.561× wall, 0.532× CPU")
    del doc["pipeline"]["append"]["append, new route rows only, calls of 64 events turn-major"]
    (row,) = summary.rows_of(doc)
    assert "routed_experts_start" not in row["baseline"]
