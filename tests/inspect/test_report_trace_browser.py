"""The trace view and the new panels in Debian's chromium, headless (as test_report_browser.py):
a panel's link and a click on a panel's bar open the trace view of a real trajectory, its
tokens painted per channel; time panels share their zoom; the static export's links open
the trace files; markup in an id or metadata renders as text; no console error anywhere."""

from __future__ import annotations

import json
from urllib.parse import quote

import pytest

import trajstore
from tests.inspect.test_report_browser import (TOKEN, Page, assert_every_panel_drawn, browser,  # noqa: F401
                                               chromium, open_static_export, served, shared_run, shared_served,
                                               sqlite_run, start_report_server, stop)
from tests.inspect.test_report import NUM_TRAJECTORIES, fill
from tests.inspect.test_report_trace import HOSTILE_ID, HOSTILE_TEXT, _hostile_store, make_tokenizer, word

CHANNELS = ("logprob", "trainer", "mismatch", "version", "drift", "call")


def open_report(page: Page, base: str) -> None:
    page.page.goto(f"{base}?token={TOKEN}")
    page.page.wait_for_function("Number(document.body.dataset.refreshes) >= 1 && "
                                "document.querySelectorAll('#panels > section').length > 0", timeout=60_000)


def painted(page: Page) -> dict[str, int]:
    """Per channel: how many token spans the page painted (a background colour)."""
    out = {}
    for channel in CHANNELS:
        page.page.check(f"#channels input[value='{channel}']")
        page.page.wait_for_function(f"document.body.dataset.channel === '{channel}'")
        out[channel] = page.page.evaluate(
            "Array.from(document.querySelectorAll('section.sample span.t')).filter(s => s.style.background).length")
    return out


def assert_trace_drawn(page: Page) -> None:
    page.page.wait_for_function("document.body.dataset.rendered === '1'", timeout=60_000)
    assert int(page.page.evaluate("Number(document.body.dataset.samples)")) >= 1
    spans = page.page.evaluate("document.querySelectorAll('section.sample span.t').length")
    colours = painted(page)
    # every channel paints tokens of this trajectory (it has trainer logprobs and re-sent routes)
    assert all(0 < n <= spans for n in colours.values()), colours
    assert colours["logprob"] < spans  # prompt tokens have no rollout logprob
    rows = page.page.evaluate("document.querySelectorAll('#calls tr').length")
    assert rows >= 2  # the header and the engine calls


def test_a_panel_link_opens_the_trace_view(shared_served, browser):
    _, base = shared_served
    page = Page(browser)
    open_report(page, base)
    assert_every_panel_drawn(page)
    links = page.page.locator("#trajectories_to_look_at a.trace-link")
    assert links.count() >= 3
    # the trajectory with the highest k3 has trainer logprobs: open it from its link
    k3_ids = page.page.evaluate(
        "(() => { const p = document.querySelector('#trajectories_to_look_at .plot');"
        " return p.data[1].meta.trajectory_ids; })()")
    target = k3_ids[-1]
    page.page.locator("#trajectories_to_look_at a.trace-link", has_text=target).first.click()
    page.page.wait_for_url(f"{base}trace/**")
    assert page.page.url == f"{base}trace/{quote(target, safe='')}"
    assert_trace_drawn(page)
    assert page.page.inner_text("#tid") == target
    assert page.errors == []
    assert all(u.startswith(base) for u in page.requests)


def test_clicking_a_bar_opens_the_trace_view(shared_served, browser):
    _, base = shared_served
    page = Page(browser)
    open_report(page, base)
    section = page.page.locator("#trajectories_to_look_at")
    section.scroll_into_view_if_needed()
    bar = section.locator(".plot .point path").first
    ids = page.page.evaluate("document.querySelector('#trajectories_to_look_at .plot').data[0].meta.trajectory_ids")
    bar.click(force=True)
    page.page.wait_for_url(f"{base}trace/**", timeout=30_000)
    opened = page.page.url.split("/trace/", 1)[1]
    assert opened in [quote(i, safe="") for i in ids]
    page.page.wait_for_function("document.body.dataset.rendered === '1'", timeout=60_000)
    assert page.errors == []


def test_time_panels_share_their_zoom(served, browser):  # its own run: it appends
    _, base = served
    page = Page(browser)
    open_report(page, base)
    time_panels = page.page.evaluate(
        "Array.from(document.querySelectorAll('#panels > section')).filter(s => { const p = s.querySelector('.plot');"
        " return p._fullLayout && Object.keys(p._fullLayout).some(k => /^xaxis[0-9]*$/.test(k) && "
        "p._fullLayout[k].type === 'date'); }).map(s => s.dataset.panel)")
    assert {"ingest_rate", "reward_curve", "response_length_over_time", "route_drift"} <= set(time_panels)
    from datetime import datetime, timedelta

    r = page.page.evaluate("document.querySelector('#ingest_rate .plot')._fullLayout.xaxis.range.map(String)")
    start, end = (datetime.fromisoformat(x) for x in r)
    span = end - start
    # zoom into the middle of the range, and out to an hour around it: every other time axis follows
    for lo, hi in ((start + span / 4, end - span / 4), (start - timedelta(minutes=30), end + timedelta(minutes=30))):
        zoom = [lo.strftime("%Y-%m-%d %H:%M:%S.%f")[:23], hi.strftime("%Y-%m-%d %H:%M:%S.%f")[:23]]
        syncs = int(page.page.evaluate("Number(document.body.dataset.zoomSyncs || 0)"))
        page.page.evaluate(f"Plotly.relayout(document.querySelector('#ingest_rate .plot'), "
                           f"{{'xaxis.range[0]': {json.dumps(zoom[0])}, 'xaxis.range[1]': {json.dumps(zoom[1])}}})")
        page.page.wait_for_function(f"Number(document.body.dataset.zoomSyncs || 0) > {syncs}")
        for name in time_panels:
            got = page.page.evaluate(f"(() => {{ const fl = document.querySelector('#{name} .plot')._fullLayout;"
                                     " return Object.keys(fl).filter(k => /^xaxis[0-9]*$/.test(k) && "
                                     "fl[k].type === 'date').map(k => fl[k].range.map(String)); })()")
            assert got and all([x[:23] for x in rr] == zoom for rr in got), (name, got, zoom)
    # a version axis (category) is left alone
    assert page.page.evaluate("document.querySelector('#versions .plot')._fullLayout.xaxis.type") == "category"
    # and a redraw keeps the zoom: new data moves the run's clock, and with it the figure's own time range
    store, _ = served
    redrawn = ("ingest_rate", "reward_curve")
    draws = {name: int(page.page.evaluate(f"Number(document.getElementById('{name}').dataset.draws || 0)"))
             for name in redrawn}
    fill(store, first=NUM_TRAJECTORIES, count=2)  # appends, folds and trains
    for name in redrawn:
        page.page.locator(f"#{name}").scroll_into_view_if_needed()
        page.page.wait_for_function(f"Number(document.getElementById('{name}').dataset.draws || 0) > {draws[name]}",
                                    timeout=60_000)
        kept = f"document.querySelector('#{name} .plot')._fullLayout.xaxis.range.map(x => String(x).slice(0, 23))"
        try:
            page.page.wait_for_function(f"JSON.stringify({kept}) === {json.dumps(json.dumps(zoom, separators=(',', ':')))}",
                                        timeout=10_000)
        except Exception:
            raise AssertionError((name, page.page.evaluate(kept), zoom)) from None
    assert page.errors == []


def test_the_static_export_links_open_trace_files(shared_run, browser, tmp_path):
    out = tmp_path / "export"
    page = open_static_export(shared_run.url, browser, out)
    stuck_links = page.page.locator("#stuck a.trace-link")
    assert stuck_links.count() >= 1  # a running trajectory: its calls, no samples yet
    target = page.page.evaluate("document.querySelector('#trajectories_to_look_at .plot').data[1].meta"
                                ".trajectory_ids.slice(-1)[0]")  # the highest k3: it has trainer logprobs
    link = page.page.locator("#trajectories_to_look_at a.trace-link", has_text=target).first
    href = link.get_attribute("href")
    assert href.startswith("trace-") and href.endswith(".html")
    link.click()
    page.page.wait_for_url(f"file://{out}/{href}")
    assert_trace_drawn(page)
    page.page.click("header a")  # back to the report
    page.page.wait_for_url(f"file://{out}/index.html")
    stuck = page.page.locator("#stuck a.trace-link").first
    stuck.click()
    page.page.wait_for_function("document.body.dataset.rendered === '1'", timeout=30_000)
    assert page.page.inner_text("#trace-note").startswith("no materialized samples yet")
    assert page.errors == []
    assert all(u.startswith("file://") for u in page.requests), page.requests


def test_markup_in_ids_and_metadata_renders_as_text(tmp_path, browser):
    url = f"sqlite:///{tmp_path / 'hostile.db'}"
    _hostile_store(url, str(tmp_path / "payload")).close()
    # the payload the store recorded; a tokenizer whose every 7th token is markup
    proc, base = start_report_server(url, "--token", TOKEN, "--refresh-s", "1", "--tokenizer",
                                     make_tokenizer(tmp_path))
    try:
        page = Page(browser)
        open_report(page, base)
        page.page.wait_for_function("Array.from(document.querySelectorAll('#panels > section'))"
                                    ".every(s => s.dataset.state)", timeout=30_000)
        link = page.page.locator("a.trace-link").first
        assert link.inner_text() == HOSTILE_ID
        link.click()
        page.page.wait_for_function("document.body.dataset.rendered === '1'", timeout=60_000)
        assert page.page.inner_text("#tid") == HOSTILE_ID
        meta = page.page.evaluate("Array.from(document.querySelectorAll('#summary tr')).find(r => "
                                  "r.cells[0].textContent === 'metadata').cells[1].textContent")
        assert json.loads(meta) == {"note": HOSTILE_TEXT, "task": HOSTILE_TEXT}
        assert page.page.evaluate("typeof window.__pwned") == "undefined"
        assert page.page.evaluate("document.querySelectorAll('img, b').length") == 0
        assert page.page.title() == f"trace {HOSTILE_ID}"
        # decoded tokens, markup ones included, are the spans' text
        ids, texts = page.page.evaluate("[Array.from(document.querySelectorAll('section.sample span.t')).map(s => "
                                        "s.title.match(/token id (\\d+)/)[1]), Array.from(document.querySelectorAll("
                                        "'section.sample span.t')).map(s => s.textContent)]")
        assert texts == [word(int(i)) for i in ids] and any(t.startswith("<i>") for t in texts)
        assert page.page.evaluate("document.querySelectorAll('section.sample i').length") == 0
        assert page.page.inner_text("#tokens-shown").startswith("Tokens are decoded one by one")
        assert page.errors == []
        # the per-task panel names the task as text too
        open_report(page, base)
        assert page.page.evaluate("typeof window.__pwned") == "undefined"
        assert page.page.evaluate("document.querySelectorAll('#panels img, #panels b').length") == 0
    finally:
        stop(proc)


def test_hovering_a_token_shows_the_experts_it_was_routed_to(shared_served, browser):
    """The trace view names, on hover, the experts each token was routed to (the sample's own
    route rows, MoE layers only); the engine-call table scrolls inside its card, the page
    never widens."""
    store, base = shared_served
    sample = next(s for s in store.samples() if s.routed_experts is not None and len(s.response_ids) > 2)
    page = Page(browser)
    page.page.set_viewport_size({"width": 700, "height": 900})  # narrow: the call table is wider than this
    page.page.goto(f"{base}?token={TOKEN}")
    page.page.goto(f"{base}trace/{quote(sample.trajectory_id, safe='')}")
    page.page.wait_for_function("document.body.dataset.rendered === '1'", timeout=60_000)
    position = len(sample.prompt_ids) + 1  # a generated token
    span = page.page.locator(f"section.sample[data-sample='{sample.sample_index}'] span.t").nth(position)
    span.hover()
    title = span.get_attribute("title")
    routes = sample.routed_experts
    moe = [layer for layer in range(routes.shape[1]) if routes[:, layer, :].any()]
    lines = title.split("routed experts (MoE layers):\n")[1].split("\n")
    shown = [line.strip() for line in lines if line.strip().startswith("layer ")]
    assert shown[0] == f"layer {moe[0]}: " + " ".join(str(int(e)) for e in routes[position, moe[0]])
    assert len(shown) == min(len(moe), 12)
    span.hover()  # a second hover adds nothing
    assert span.get_attribute("title") == title
    # the engine-call table scrolls in its card: the page itself is no wider than the window
    assert page.page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert page.page.evaluate("document.querySelector('#calls').scrollWidth > document.querySelector('#calls').clientWidth")
    assert page.errors == []
