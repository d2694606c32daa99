"""``trajstore report --serve`` for real: the CLI's server on loopback, its token rules over
HTTP, and the page in Debian's chromium, headless (driven by playwright, never a downloaded
browser): every panel drawn by plotly, no console error, redrawn when events arrive; the
static export opens from the file system the same way."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import trajstore
from tests.inspect.test_report import RUNNING, fill, run_events
from trajstore.inspect._panels import PANELS

TOKEN = "s3cret-report-token"
CHROMIUM = os.environ.get("TRAJSTORE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
                  "--disable-dev-shm-usage"]


def start_report_server(url: str, *args: str, lines: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """``trajstore report --serve`` on a free port; returns the process and its base URL once it listens."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRAJSTORE_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "trajstore.cli", "--store", url, "report", "--serve", "--port", "0",
                             *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + 60
    lines = [] if lines is None else lines
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+/)", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise AssertionError(f"report server did not start: {''.join(lines)}{proc.stderr.read()}")


def stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


@pytest.fixture
def sqlite_run(tmp_path, migrated_template):
    url = migrated_template.sqlite_copy(tmp_path / "run.db")
    store = trajstore.connect(url)  # the payload in its default place, where the report looks
    fill(store)
    yield store
    store.close()


@pytest.fixture
def served(sqlite_run):
    proc, base = start_report_server(sqlite_run.url, "--token", TOKEN, "--refresh-s", "1", "--stuck-after-s", "0")
    yield sqlite_run, base
    stop(proc)


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory, migrated_template):
    """``sqlite_run``, filled once per module for the tests that only read it."""
    store = trajstore.connect(migrated_template.sqlite_copy(tmp_path_factory.mktemp("run") / "run.db"))
    fill(store)
    yield store
    store.close()


@pytest.fixture(scope="module")
def shared_served(shared_run):
    """``served`` on ``shared_run``: one report server per module for the tests that only read."""
    proc, base = start_report_server(shared_run.url, "--token", TOKEN, "--refresh-s", "1", "--stuck-after-s", "0")
    yield shared_run, base
    stop(proc)


PATHS = ["/", "/plotly.min.js", "/api/data", "/api/stream", "/healthz", "/no-such-page", "/trace/traj-0-000000",
         "/api/trace?id=traj-0-000000"]


def test_every_path_is_denied_without_the_token(shared_served):
    _, base = shared_served
    with httpx.Client(base_url=base, timeout=30) as http:
        for path in PATHS:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                            {"Cookie": f"trajstore_report={TOKEN}"}):
                r = http.get(path, headers=headers)
                assert r.status_code == 401, (path, headers, r.status_code)
                assert r.headers["www-authenticate"] == "Bearer"
                if path == "/":  # a browser gets a page saying how to open it; nothing of the run
                    assert "needs its token" in r.text and "plotly" not in r.text
                else:
                    assert r.json()["error"]["rule"] == "unauthorized"
        for method in ("POST", "PUT", "DELETE"):
            assert http.request(method, "/api/data").status_code == 401
        assert http.get("/?token=wrong").status_code == 401
        assert http.get("/api/data?token=" + TOKEN).status_code == 401  # the token in a URL only logs in at /


def test_the_token_reads_and_nothing_writes(shared_served):
    _, base = shared_served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=base, timeout=30) as http:
        assert http.get("/", headers=auth).status_code == 200
        assert http.get("/healthz", headers=auth).json() == {"status": "ok"}
        data = http.get("/api/data", headers=auth).json()
        assert [p["name"] for p in data["panels"]] == [p.name for p in PANELS]
        assert http.get("/no-such-page", headers=auth).status_code == 404
        trace = http.get("/api/trace?id=traj-0-000000", headers=auth).json()
        assert trace["found"] and trace["samples"] and trace["trajectory_id"] == "traj-0-000000"
        assert http.get("/api/trace", headers=auth).json()["error"]["message"] == "api/trace needs ?id=TRAJECTORY_ID"
        # the trace page finds its data relative to its own URL, whatever '/' the id brings
        assert '"api": "../api/trace?id=traj-0-000000"' in http.get("/trace/traj-0-000000", headers=auth).text
        assert '"api": "../../api/trace?id=a%2Fb"' in http.get("/trace/a/b", headers=auth).text
        assert '"api": "../api/trace?id=a%2Fb"' in http.get("/trace/a%2Fb", headers=auth).text
        assert http.post("/api/trace?id=x", headers=auth).status_code == 405
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            assert http.request(method, "/api/data", headers=auth).status_code == 405
        # The browser's way in: the token once in the URL, then a cookie; the URL loses the token.
        r = http.get(f"/?token={TOKEN}")
        assert r.status_code == 303 and r.headers["location"] == "./"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and TOKEN not in cookie
        assert http.get("/api/data").status_code == 200  # the client kept the cookie


def test_insecure_no_auth_serves_open_and_says_so(shared_run):
    env_line = []
    proc, base = start_report_server(shared_run.url, "--insecure-no-auth", lines=env_line)
    try:
        assert "WARNING: no token, anyone who can reach the port can read the run" in env_line[-1]
        with httpx.Client(base_url=base, timeout=30) as http:
            assert http.get("/api/data").status_code == 200
            assert http.post("/api/data").status_code == 405
    finally:
        stop(proc)


def test_the_server_refuses_to_start_without_a_token(shared_run):
    env = {k: v for k, v in os.environ.items() if k != "TRAJSTORE_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "trajstore.cli", "--store", shared_run.url, "report", "--serve"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1
    assert r.stderr == "error: no token: pass --token or set $TRAJSTORE_TOKEN (or --insecure-no-auth to run open)\n"


def test_a_taken_port_is_one_error_line(shared_run):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "trajstore.cli", "--store", shared_run.url, "report", "--serve",
                            "--token", TOKEN, "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


# -- in the browser -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def chromium():
    """One headless chromium per test module (a launch costs seconds); tests use ``browser``."""
    if not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
        pytest.fail(f"no chromium at {CHROMIUM}: apt-get install chromium (.ci/run does)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        # launch() gives the browser a fresh temporary profile (user data dir)
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        yield b
        b.close()


@pytest.fixture
def browser(chromium):
    """The module's chromium for one test: each ``Page`` is a context of its own (its own cookies,
    storage and cache, as a new browser's), and every context the test opened is closed after it."""
    yield chromium
    for context in list(chromium.contexts):
        context.close()


class Page:
    """A page with every console error and uncaught exception recorded."""

    def __init__(self, browser):
        self.context = browser.new_context(viewport={"width": 1300, "height": 900})
        self.page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.requests: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))

    def panels(self) -> dict[str, tuple[str, int]]:
        """Each panel's state and how many plotly SVG layers it drew."""
        return dict(self.page.evaluate(
            "Array.from(document.querySelectorAll('#panels > section')).map(s => "
            "[s.dataset.panel, [s.dataset.state, s.querySelectorAll('.plot .main-svg').length]])"))

    def refreshes(self) -> int:
        return int(self.page.evaluate("Number(document.body.dataset.refreshes || 0)"))

    def summary(self) -> dict[str, str]:
        return dict(self.page.evaluate(
            "Array.from(document.querySelectorAll('#summary tr')).map(r => [r.cells[0].textContent, r.cells[1].textContent])"))


def assert_every_panel_drawn(page: Page) -> None:
    panels = page.panels()
    assert list(panels) == [p.name for p in PANELS]
    for name, (state, svgs) in panels.items():
        assert state == "plotted" and svgs >= 1, (name, state, svgs)
    # plotly drew marks, not only axes: bars, lines or areas in every panel
    marks = page.page.evaluate(
        "Array.from(document.querySelectorAll('#panels > section')).map(s => "
        "s.querySelectorAll('.plot .point path, .plot .scatterlayer path.js-line, .plot .scatterlayer path.js-fill').length)")
    assert all(n > 0 for n in marks), marks


def test_the_live_page_draws_every_panel_and_refreshes(served, browser, tmp_path):
    store, base = served
    page = Page(browser)
    response = page.page.goto(f"{base}?token={TOKEN}")
    assert response.status == 200 and page.page.url == base  # the token left the address bar
    page.page.wait_for_function("Number(document.body.dataset.refreshes) >= 1", timeout=30_000)
    assert_every_panel_drawn(page)
    assert page.summary()["trajectories"].startswith(f"40 (completed ")
    assert f"running {len(RUNNING)}" in page.summary()["trajectories"]
    # the SQL of each panel is on the page
    sql = page.page.evaluate("Array.from(document.querySelectorAll('#panels pre')).map(p => p.textContent)")
    assert len(sql) >= len(PANELS)
    assert all(q.startswith("SELECT") for q in sql)
    page.page.screenshot(path=str(tmp_path / "live.png"), full_page=True)

    # New events arrive (a later policy version, a new batch of trajectories): the page redraws.
    before = page.refreshes()
    fill(store, 40, 8, version_base=9)
    page.page.wait_for_function(
        "Array.from(document.querySelectorAll('#summary tr')).some(r => r.cells[0].textContent === 'trajectories' "
        "&& r.cells[1].textContent.startsWith('48 ('))", timeout=30_000)
    # the summary shows first; the update counts once the panels in view are drawn
    page.page.wait_for_function(f"Number(document.body.dataset.refreshes) > {before}", timeout=30_000)
    newest = max(e["model_version"] for events in run_events(40, 8, version_base=9) for e in events
                 if e["type"] == "generation")
    assert page.summary()["model versions (newest = the policy now)"] == f"0 .. {newest}"
    assert_every_panel_drawn(page)
    assert page.errors == []
    assert all(u.startswith(base) for u in page.requests), [u for u in page.requests if not u.startswith(base)]


def _page_state(page: Page) -> dict:
    """What the page drew: its data version, each panel's redraw count, and the server's data
    (api/data, fetched by the page with its cookie) at the same moment."""
    return page.page.evaluate("""async () => {
        const draws = {};
        for (const s of document.querySelectorAll('#panels > section')) draws[s.dataset.panel] = Number(s.dataset.draws);
        const r = await fetch('api/data', {cache: 'no-store', credentials: 'same-origin'});
        return {version: Number(document.body.dataset.version), generated_at: Number(document.body.dataset.generatedAt),
                redraws: Number(document.body.dataset.redraws), draws: draws, server: await r.json()};
    }""")


def test_the_live_page_is_pushed_only_what_changed(served, browser):
    """Nothing changes: nothing is sent and nothing is redrawn. New events: the page is pushed
    the panels whose content changed, and redraws exactly those."""
    store, base = served
    page = Page(browser)
    stream_requests = []
    page.page.on("request", lambda r: "api/stream" in r.url and stream_requests.append(r.url))
    page.page.goto(f"{base}?token={TOKEN}")
    page.page.wait_for_function("Number(document.body.dataset.refreshes) >= 1", timeout=30_000)
    assert_every_panel_drawn(page)
    first = _page_state(page)
    assert set(first["draws"].values()) == {1}  # each panel drawn once
    assert first["server"]["generated_at"] == first["generated_at"]  # the page has the server's data

    time.sleep(4)  # four change checks (--refresh-s 1) with nothing new in the store
    idle = _page_state(page)
    assert idle["version"] == first["version"] and idle["redraws"] == first["redraws"], (first, idle)
    assert len(stream_requests) == 1  # one stream, kept open: no polling

    # one engine call of a new trajectory, still running: a few panels change, not all
    store.append([{"type": "trajectory_started", "trajectory_id": "one-more"},
                  {"type": "generation", "trajectory_id": "one-more", "seq": 0, "prompt_ids": [1, 2, 3],
                   "output_ids": [4, 5], "model_version": 3}])
    page.page.wait_for_function(f"Number(document.body.dataset.version) > {idle['version']} && "
                                "document.body.dataset.drawn === document.body.dataset.shown", timeout=30_000)
    after = _page_state(page)
    assert after["server"]["generated_at"] == after["generated_at"], "the page shows the server's newest data"
    before_panels = {p["name"]: p for p in first["server"]["panels"]}
    changed = {p["name"] for p in after["server"]["panels"] if p != before_panels.get(p["name"])}
    assert changed and changed != set(before_panels), changed  # some panels changed, not all
    # the changed panels in view are redrawn; those out of view wait (data-stale) until they are seen
    redrawn = {name for name, n in after["draws"].items() if n > first["draws"][name]}
    stale = set(page.page.evaluate("Array.from(document.querySelectorAll('#panels > section[data-stale]'))"
                                   ".map(s => s.dataset.panel)"))
    assert redrawn and stale and redrawn | stale == changed and not redrawn & stale, (redrawn, stale, changed)
    in_view = set(page.page.evaluate("Array.from(document.querySelectorAll('#panels > section')).filter(s => { "
                                     "const r = s.getBoundingClientRect(); return r.bottom > 0 && r.top < innerHeight; "
                                     "}).map(s => s.dataset.panel)"))
    assert not stale & in_view, (stale, in_view)
    for name in sorted(stale, key=list(before_panels).index):  # scrolled to: drawn
        page.page.locator(f"section[data-panel='{name}']").scroll_into_view_if_needed()
        page.page.wait_for_function(f"!document.querySelector(\"section[data-panel='{name}']\").dataset.stale",
                                    timeout=10_000)
    after = _page_state(page)
    redrawn = {name for name, n in after["draws"].items() if n > first["draws"][name]}
    assert redrawn == changed  # exactly the panels whose content changed were redrawn, each once
    assert all(after["draws"][name] == 2 for name in changed), after["draws"]
    assert page.errors == []


def test_the_live_page_without_the_token_is_401(shared_served, browser):
    _, base = shared_served
    page = Page(browser)
    assert page.page.goto(base).status == 401
    assert page.page.goto(f"{base}?token=wrong").status == 401
    assert page.page.goto(f"{base}api/data").status == 401


def test_the_live_page_of_an_empty_store_then_its_first_events(tmp_path, browser):
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    trajstore.connect(url).close()
    proc, base = start_report_server(url, "--token", TOKEN, "--refresh-s", "1")
    try:
        page = Page(browser)
        page.page.goto(f"{base}?token={TOKEN}")
        page.page.wait_for_function("Number(document.body.dataset.refreshes) >= 1", timeout=30_000)
        assert page.page.is_visible("#empty")
        assert page.page.inner_text("#empty h2") == "No data yet"
        assert page.panels() == {} and not page.page.is_visible("#summary")
        with trajstore.connect(url) as store:
            fill(store)
        # The page may first catch the store between the appends and the materialize; it redraws
        # until every panel has its data.
        page.page.wait_for_function(
            "Number(document.body.dataset.panels) > 0 && Array.from(document.querySelectorAll('#panels > section'))"
            ".every(s => s.dataset.state === 'plotted')", timeout=30_000)
        assert not page.page.is_visible("#empty")
        assert_every_panel_drawn(page)
        assert page.errors == []
    finally:
        stop(proc)


def open_static_export(store_url: str, browser, out) -> "Page":
    """``trajstore report OUT`` (the static export) of ``store_url``, opened from its files
    in ``browser``: every panel asserted drawn once the page has refreshed."""
    from trajstore.cli import main

    assert main(["--store", store_url, "report", "--stuck-after-s", "0", str(out)]) == 0
    page = Page(browser)
    page.page.goto(f"file://{out}/index.html")
    page.page.wait_for_function("Number(document.body.dataset.refreshes) >= 1", timeout=30_000)
    assert_every_panel_drawn(page)
    return page


def test_the_static_export_opens_offline(shared_run, browser, tmp_path):
    page = open_static_export(shared_run.url, browser, tmp_path / "export")
    assert page.errors == []
    assert all(u.startswith("file://") for u in page.requests), page.requests
