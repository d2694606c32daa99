"""Two runs on the same panels (``trajstore report --serve --compare STORE_URL``), in Debian's
chromium: each panel that has data in both draws both runs, each in its own colour, named for its
store; the summary has a column a run; a new event in the compared store reaches the page."""

from __future__ import annotations

import pytest

import trajstore
from tests.inspect.test_report import fill
from tests.inspect.test_report_browser import TOKEN, Page, browser, chromium, start_report_server, stop  # noqa: F401
from trajstore.inspect._compare import COLORS

# panels with both runs' data in this fixture (time, per version, distribution, training)
BOTH = ("ingest_rate", "reward_curve", "versions", "response_length", "staleness", "training_steps",
        "trainer_metrics", "per_task")


@pytest.fixture
def two_runs(tmp_path):
    stores = []
    for name, first, count in (("run-a", 0, 40), ("run-b", 100, 24)):
        (tmp_path / name).mkdir()
        store = trajstore.connect(f"sqlite:///{tmp_path / name / 'run.db'}")
        fill(store, first, count)
        stores.append(store)
    yield stores
    for store in stores:
        store.close()


def _runs_of(page: Page, panel: str) -> dict[str, set[str]]:
    """The colours each run's traces are drawn in on ``panel``, read from plotly's drawn data."""
    return {k: set(v) for k, v in page.page.evaluate("""(panel) => {
        const gd = document.querySelector(`section[data-panel='${panel}'] .plot`);
        const out = {};
        for (const t of gd._fullData) {
            const run = String(t.name || '').split(':')[0];
            const colour = t.type === 'bar' || !t.line ? t.marker.color : t.line.color;
            (out[run] = out[run] || []).push(String(colour));
        }
        return out;
    }""", panel).items()}


def test_two_runs_on_the_same_panels(two_runs, browser, tmp_path):
    a, b = two_runs
    proc, base = start_report_server(a.url, "--token", TOKEN, "--refresh-s", "1", "--compare", b.url)
    try:
        page = Page(browser)
        page.page.goto(f"{base}?token={TOKEN}")
        page.page.wait_for_function("Number(document.body.dataset.refreshes) >= 1", timeout=60_000)
        header = page.page.evaluate("Array.from(document.querySelectorAll('#summary th')).map(h => h.textContent)")
        assert header == ["", "run-a/run.db", "run-b/run.db"]
        summary = page.page.evaluate("Array.from(document.querySelectorAll('#summary tr')).filter(r => r.cells.length)"
                                     ".map(r => Array.from(r.cells).map(c => c.textContent))")
        trajectories = next(row for row in summary if row[0] == "trajectories")
        assert trajectories[1].startswith("40 (") and trajectories[2].startswith("24 (")
        for panel in BOTH:
            runs = _runs_of(page, panel)
            assert runs.get("run-a/run.db") == {COLORS[0]} and runs.get("run-b/run.db") == {COLORS[1]}, (panel, runs)
        # time panels: minutes since each run's start, both runs from 0
        axis = page.page.evaluate("document.querySelector(\"section[data-panel='ingest_rate'] .plot\")"
                                  "._fullLayout.xaxis.type")
        assert axis == "linear"
        page.page.screenshot(path=str(tmp_path / "compare.png"), full_page=True)

        # the compared store moves: the page shows it
        fill(b, 200, 4)
        page.page.wait_for_function(
            "Array.from(document.querySelectorAll('#summary tr')).some(r => r.cells.length > 2 && "
            "r.cells[0].textContent === 'trajectories' && r.cells[2].textContent.startsWith('28 ('))", timeout=30_000)
        assert page.errors == []
    finally:
        stop(proc)


def test_a_static_export_compares_too(two_runs, browser, tmp_path):
    from trajstore.inspect.report import render_report

    a, b = two_runs
    written = render_report(a.url, str(tmp_path / "out"), compare=b.url)
    assert not written["empty"] and "ingest_rate" in written["plotted"]
    page = Page(browser)
    page.page.goto(f"file://{written['index']}")
    page.page.wait_for_function("Number(document.body.dataset.refreshes) >= 1", timeout=60_000)
    runs = _runs_of(page, "reward_curve")
    assert runs == {"run-a/run.db": {COLORS[0]}, "run-b/run.db": {COLORS[1]}}, runs
    assert page.errors == []


def test_a_compared_store_that_is_not_there_is_one_line_and_nothing_written(two_runs, tmp_path, capsys):
    from trajstore.cli import main

    a, _ = two_runs
    out = tmp_path / "out"
    missing = tmp_path / "nowhere" / "run.db"
    assert main(["--store", a.url, "report", str(out), "--compare", f"sqlite:///{missing}"]) == 1
    assert capsys.readouterr().err == f"error: no store at {missing} (trajstore init, ingest or demo makes one)\n"
    assert not out.exists()
