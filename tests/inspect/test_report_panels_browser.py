"""The panels as an RL engineer reads them, checked where they are read: drawn by plotly in
Debian's chromium, headless (as test_report_browser.py), from a run with a pause in it. Lines
break over the pause, the response-length axis starts at 0, the expert-load legend and colorbar
keep apart (their boxes), the trainer's metrics each have their own y axis and are drawn once,
hovers show rounded numbers, the whole-run trends span every version. (Routes on hover in the
trace view and its call table within its card: test_report_trace_browser.py.)"""

from __future__ import annotations

import re

import pytest
from sqlalchemy import text

import trajstore
from tests.inspect.test_report import fill
from tests.inspect.test_report_browser import browser, chromium, open_static_export  # noqa: F401
from trajstore.inspect._rebuild import rebuild_aggregates

PAUSE_S = 1800.0


@pytest.fixture
def paused_run(tmp_path):
    """The test run, its second half of the log half an hour after the first (a trainer's pause)."""
    url = f"sqlite:///{tmp_path / 'run.db'}"
    store = trajstore.connect(url)
    fill(store)
    with store.log.write_engine.begin() as conn:
        start, mid = conn.execute(text("SELECT min(created_at), (min(position) + max(position)) / 2 FROM events")).one()
        conn.execute(text(f"UPDATE events SET created_at = {float(start)!r} + position * 0.5 "
                          f"+ CASE WHEN position > {int(mid)} THEN {PAUSE_S!r} ELSE 0 END"))
    rebuild_aggregates(store)
    yield store
    store.close()


def _gd(page, panel: str, script: str):
    """``script`` (a function body of ``gd``, the panel's plotly div) evaluated in the page."""
    return page.page.evaluate(f"() => {{ const gd = document.querySelector(\"section[data-panel='{panel}'] .plot\"); "
                              f"{script} }}")


def _box(page, panel: str, selector: str) -> dict:
    box = page.page.locator(f"section[data-panel='{panel}'] {selector}").first.bounding_box()
    assert box is not None, (panel, selector)
    return box


def _overlap(a: dict, b: dict) -> bool:
    return not (a["x"] + a["width"] <= b["x"] or b["x"] + b["width"] <= a["x"]
                or a["y"] + a["height"] <= b["y"] or b["y"] + b["height"] <= a["y"])


def _significant(number: str) -> int:
    digits = number.replace("-", "").replace(".", "").lstrip("0")
    return len(digits.rstrip("0")) if "." not in number else len(digits)


def test_the_panel_fixes_as_drawn(paused_run, browser, tmp_path):
    page = open_static_export(paused_run.url, browser, tmp_path / "export")

    # lines break over the pause: the mean reward's line is drawn as several pieces, none across it
    pieces = _gd(page, "reward_curve", """
        const i = gd.data.findIndex(t => t.name === 'mean reward');
        const paths = gd.querySelectorAll('.scatterlayer .trace')[i].querySelectorAll('path.js-line');
        return {nulls: gd.data[i].y.filter(v => v === null).length,
                moves: Array.from(paths).map(p => (p.getAttribute('d').match(/M/g) || []).length)
                                        .reduce((a, b) => a + b, 0)};""")
    assert pieces["nulls"] > 0 and pieces["moves"] >= 2, pieces

    # the response length's axis starts at 0 (both plots of the panel)
    ranges = _gd(page, "response_length_over_time", "return [gd._fullLayout.yaxis.range, gd._fullLayout.yaxis2.range];")
    assert all(r[0] == 0 for r in ranges), ranges

    # the expert-load colorbar and the legend: both drawn, apart
    legend, colorbar = _box(page, "expert_load", ".legend"), _box(page, "expert_load", ".colorbar")
    assert not _overlap(legend, colorbar), (legend, colorbar)

    # the trainer's metrics: one plot each, each with its own y axis (kl is not flattened against loss)
    axes = _gd(page, "trainer_metrics", """
        const l = gd._fullLayout;
        return gd.data.filter(t => t.mode && t.mode.includes('lines')).map(t => {
            const a = l['yaxis' + (t.yaxis || 'y').slice(1)];
            return {name: t.yaxis || 'y', range: a.range, matches: a.matches || null, ys: t.y}; });""")
    assert len(axes) == 2 and len({a["name"] for a in axes}) == 2, axes
    assert all(a["matches"] is None for a in axes)
    for a in axes:  # each axis spans its own metric's values
        assert a["range"][0] <= min(a["ys"]) and max(a["ys"]) <= a["range"][1]
    assert axes[0]["range"] != axes[1]["range"]
    # ... and drawn once: the training-steps panel draws no trainer metric, nor does its left title clip
    names = _gd(page, "training_steps", "return gd.data.map(t => t.name);")
    assert not {"loss", "kl"} & set(names), names
    title = _box(page, "training_steps", ".g-ytitle")
    plot = _box(page, "training_steps", ".main-svg")
    assert title["x"] >= plot["x"], (title, plot)

    # hovers: a fractional number shows 3 significant digits
    i = _gd(page, "run_trends", "return gd.data.findIndex(t => t.name === 'mean reward');")
    page.page.locator(f"section[data-panel='run_trends'] .scatterlayer .trace >> nth={i}").locator(
        ".points path").first.hover(force=True)
    page.page.wait_for_function("document.querySelector(\"section[data-panel='run_trends'] .hoverlayer\")"
                                ".textContent.length > 0", timeout=10_000)
    hover = _gd(page, "run_trends", "return gd.querySelector('.hoverlayer').textContent;")
    numbers = [n for n in re.findall(r"-?\d+\.\d+", hover)]
    assert numbers and all(_significant(n) <= 3 for n in numbers), hover

    # the whole run by bucket: its version axis spans every version the run generated with
    span = _gd(page, "run_trends",
               "return [Math.min(...gd.data[1].x), Math.max(...gd.data[1].x), gd.data[1].x.length];")
    with paused_run.log.write_engine.connect() as conn:
        lo, hi = conn.execute(text("SELECT min(model_version), max(model_version) FROM events "
                                   "WHERE type = 'generation' AND model_version >= 0")).one()
    width = (hi - lo + 1) / 40  # the versions a bucket spans: the first and the last bucket reach the ends
    assert 0 <= span[0] - lo < max(width, 1) and 0 <= hi - span[1] < max(width, 1), (span, lo, hi)
    assert span[2] == min(40, hi - lo + 1), (span, lo, hi)
    assert page.errors == []
