"""``trajstore report``: the panels' SQL and figures on both backends (under the
read-only login), the static export, an empty store's page, the CLI's lines.

The page itself is loaded in Debian's chromium in ``test_report_browser.py``."""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import replace

import pytest

import trajstore
from tests.helpers import brute_force_expert_load, reader_url_for
from trajstore.log._aggregate_counts import EXPERT_SAMPLE_EVERY
from trajstore.cli import main
from trajstore.demo._run import DEMO_CONFIG
from trajstore.demo._simulate import trajectory_events
from trajstore.inspect._panels import PANELS, collect
from trajstore.inspect.report import render_report
from trajstore.inspect.sql import read_only

# conftest: these fixtures connect store_url first thing, so it starts as a migrated copy
STORE_URL_CONNECTED_BY = ("run_store",)

NUM_TRAJECTORIES = 40
RUNNING = {5, 17, 33}
"""Trajectories left without trajectory_finished (running; the stuck panel lists them)."""
TASKS = ("math", "code", "search")
"""The task each trajectory's metadata names (trajectory i: TASKS[i % 3])."""
LENGTH_CUT = {2, 9, 21}
"""Trajectories whose last call ended by the length limit."""


def run_events(first: int, count: int, *, version_base: int = 0) -> list[list[dict]]:
    """The demo's rollout shape, smaller: versions advance over the run, aborts resume,
    a few trajectories still running and a few cut by the length limit."""
    cfg = replace(DEMO_CONFIG, prompt_tokens=24, output_tokens=16, observation_tokens=8)
    out = []
    for i in range(first, first + count):
        events = trajectory_events(cfg, i, version=version_base + i * 4 // NUM_TRAJECTORIES)
        events[0]["metadata"]["task"] = TASKS[i % len(TASKS)]  # the per-task panel groups by it
        if i in LENGTH_CUT:
            [e for e in events if e["type"] == "generation"][-1]["finish_reason"] = "length"
        if i in RUNNING:
            events = [e for e in events if e["type"] not in ("reward", "trajectory_finished")]
        out.append(events)
    return out


def fill(store, first: int = 0, count: int = NUM_TRAJECTORIES, *, version_base: int = 0):
    for events in run_events(first, count, version_base=version_base):
        store.append(events)
    stats = store.materialize()
    train(store, first)
    return stats


def train(store, first_step: int, steps: int = 2) -> None:
    """A trainer's lineage: ``steps`` steps of 8 samples, with metrics and the trainer's
    logprobs of two samples a step (the training panels draw them)."""
    import numpy as np

    reader = trajstore.SampleReader(store, batch_size=8)
    for k, batch in zip(range(steps), reader):
        annotations = {(s.trajectory_id, s.sample_index):
                       {"trainer_logprobs": np.asarray(s.rollout_logprobs, np.float32) - 0.05 * (k + 1)}
                       for s in batch[:2]}
        reader.record_step(first_step + k, run="run-a", policy_version=max(s.max_model_version for s in batch),
                           metrics={"loss": 1.0 / (first_step + k + 1), "kl": 0.01},
                           annotations=annotations)


@pytest.fixture
def run_store(store_url, tmp_path):
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    stats = fill(store)
    yield store, stats
    store.close()


def test_every_panel_draws_from_the_views_under_the_reader_login(run_store):
    store, stats = run_store
    with read_only(reader_url_for(store.url)) as query:
        data = collect(query, stuck_after_s=0.0, payload=store.payload.location)
    assert not data["empty"]
    names = [p["name"] for p in data["panels"]]
    assert names == [p.name for p in PANELS] and len(names) >= 14
    for panel in data["panels"]:
        assert panel["note"] is None, (panel["name"], panel["note"])
        traces = panel["figure"]["data"]
        assert traces and any(len(t.get("x") or t.get("y") or ()) for t in traces), panel["name"]
        assert panel["sql"] and all(q.lstrip().upper().startswith("SELECT") for q in panel["sql"])
    by_name = {p["name"]: p for p in data["panels"]}
    # The stuck panel: the running trajectories, every one idle past a 0 s threshold, oldest first.
    stuck = by_name["stuck"]["figure"]
    assert sorted(stuck["data"][0]["y"]) == sorted(f"traj-0-{i:06d}" for i in RUNNING)
    assert stuck["layout"]["title"]["text"].startswith(f"{len(RUNNING)} running, ")
    # The length share per version: exactly the calls cut by the limit.
    finish = by_name["finish_reasons"]
    length_calls = sum(int(calls[0]) for calls in finish["figure"]["data"][-1]["customdata"])
    assert length_calls == len(LENGTH_CUT)
    # Merge ratio headline agrees with the materializer.
    merge = json.dumps(by_name["merge_ratio"]["figure"]["layout"])
    assert f"run: {stats.merge_ratio:.3f}" in merge
    summary = dict(data["summary"])
    assert summary["trajectories"].startswith(f"{NUM_TRAJECTORIES} (") and f"running {len(RUNNING)}" in summary["trajectories"]


def test_each_panel_sql_is_what_ran(run_store, capsys):
    """The SQL on the page re-derives the panel: run through `trajstore sql`, it gives the same rows."""
    store, _ = run_store
    url = reader_url_for(store.url)
    with read_only(url) as query:
        data = collect(query)
        ran = {q: query(q).rows for p in data["panels"] for q in p["sql"]}
    for sql, rows in list(ran.items())[:6]:
        assert main(["--store", url, "sql", "--format", "json", sql]) == 0
        assert len(json.loads(capsys.readouterr().out)) == len(rows)


def test_static_export(run_store, tmp_path):
    store, stats = run_store
    out = tmp_path / "report"
    written = render_report(reader_url_for(store.url), str(out), title="run 7", payload=store.payload.location)
    # the page, its script, and the trace view of every trajectory a panel links to
    traces = sorted(os.path.basename(t) for t in written["traces"])
    assert traces and all(t.startswith("trace-") and t.endswith(".html") for t in traces)
    assert sorted(os.listdir(out)) == sorted(["index.html", "plotly.min.js", *traces])
    assert written["panels"] == [p.name for p in PANELS]
    assert written["notes"] == {} and written["plotted"] == written["panels"]
    page = (out / "index.html").read_text()
    assert "<title>run 7</title>" in page
    assert "<script src='plotly.min.js'></script>" in page
    assert not re.search(r"https?://(?!127\.0\.0\.1)", page.split("<script id='trajstore-data'")[0])  # no CDN
    data = json.loads(re.search(r"<script id='trajstore-data' type='application/json'>(.*?)</script>", page,
                                re.S).group(1))
    assert [p["name"] for p in data["panels"]] == written["panels"]
    assert sorted(data["trace_files"].values()) == traces  # the page's links open these files
    # Every panel's SQL is on the page for the reader (escaped in JSON, shown by the script).
    for panel in data["panels"]:
        for q in panel["sql"]:
            assert json.dumps(q).replace("<", "\\u003c")[1:-1] in page
    script = (out / "plotly.min.js").read_text()
    assert len(script) > 1_000_000 and "plotly.js" in script[:500]


def test_report_finds_the_payload_the_store_recorded_from_any_directory(run_store, tmp_path):
    """Run as its own process from an unrelated directory without --payload: the token
    panels read the payload the store recorded (not ./trajstore-payload or the default
    beside the database); a --payload naming another place is refused in one line."""
    import subprocess
    from pathlib import Path

    store, _ = run_store
    root = Path(__file__).resolve().parents[2]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRAJSTORE_PAYLOAD_DIR"}
    env["PYTHONPATH"] = str(root)
    cmd = [sys.executable, "-m", "trajstore.cli", "--store", reader_url_for(store.url), "report"]
    done = subprocess.run(cmd + [str(tmp_path / "r")], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote {tmp_path / 'r' / 'index.html'} with {len(PANELS)} panels"
    wrong = subprocess.run(cmd + ["--payload", str(elsewhere), str(tmp_path / "r2")], cwd=elsewhere, env=env,
                           capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 1 and wrong.stderr.count("\n") == 1
    assert "disagrees with" in wrong.stderr and "the one this store recorded" in wrong.stderr
    assert not (tmp_path / "r2").exists()


def test_report_command_counts_what_the_page_shows(run_store, tmp_path, capsys):
    store, _ = run_store
    url = reader_url_for(store.url)
    assert main(["--store", url, "--payload", store.payload.location, "report", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    # Default threshold 300 s: the running trajectories are not stuck, but they are drawn.
    assert out.strip() == f"wrote {tmp_path / 'r' / 'index.html'} with {len(PANELS)} panels"


def test_a_panel_with_nothing_to_draw_is_named(store_url, tmp_path, capsys):
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    store.append(run_events(0, 1)[0])  # finished, not materialized: no samples yet; nothing running
    store.close()
    url = reader_url_for(store_url)
    assert main(["--store", url, "report", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out.strip()
    m = re.fullmatch(rf"wrote {re.escape(str(tmp_path / 'r' / 'index.html'))} with {len(PANELS)} panels "
                     r"\((\d+) with nothing to draw yet: ([a-z_, ]+)\)", out)
    assert m, out
    named = m.group(2).split(", ")
    assert int(m.group(1)) == len(named)
    assert {"stuck", "staleness_over_time", "staleness", "logprobs", "expert_load"} <= set(named)
    page = (tmp_path / "r" / "index.html").read_text()
    data = json.loads(re.search(r"type='application/json'>(.*?)</script>", page.split("trajstore-data")[1], re.S)
                      .group(1))
    assert sorted(p["name"] for p in data["panels"] if p["figure"] is None) == sorted(named)


def test_an_empty_store_is_one_no_data_page(store_url, tmp_path, capsys):
    trajstore.connect(store_url, payload=str(tmp_path / "payload")).close()
    url = reader_url_for(store_url)
    assert main(["--store", url, "report", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert out == f"wrote {tmp_path / 'r' / 'index.html'}: no data yet (the store has no trajectories), 0 panels\n"
    page = (tmp_path / "r" / "index.html").read_text()
    data = json.loads(re.search(r"<script id='trajstore-data' type='application/json'>(.*?)</script>", page,
                                re.S).group(1))
    assert data["empty"] is True and data["panels"] == [] and data["summary"] == []


def test_report_into_a_file_is_one_clear_error(run_store, tmp_path, capsys):
    store, _ = run_store
    (tmp_path / "afile").write_text("x")
    assert main(["--store", reader_url_for(store.url), "report", str(tmp_path / "afile")]) == 1
    assert capsys.readouterr().err == f"error: report: {tmp_path / 'afile'} is a file; the report writes a directory (index.html and plotly.min.js)\n"
    assert (tmp_path / "afile").read_text() == "x"


def test_report_needs_a_directory_or_serve(run_store, capsys):
    store, _ = run_store
    assert main(["--store", reader_url_for(store.url), "report"]) == 1
    assert capsys.readouterr().err == ("error: report needs OUT_DIR (the static page) or --serve (the live page)\n")


def test_without_plotly_the_error_says_what_to_install(run_store, tmp_path, capsys, monkeypatch):
    store, _ = run_store
    monkeypatch.setitem(sys.modules, "plotly.graph_objects", None)  # import fails
    rc = main(["--store", reader_url_for(store.url), "report", str(tmp_path / "r")])
    assert rc == 1
    assert capsys.readouterr().err == ("error: trajstore report needs plotly: pip install -e '.[report]' "
                                       "in the trajstore checkout\n")
    assert not (tmp_path / "r").exists()


def test_token_panels_agree_with_the_samples(run_store):
    """Logprobs and expert loads come from the run aggregates the materializer counted; they
    equal what Store.samples() reads for the same samples."""
    import numpy as np

    store, _ = run_store
    with read_only(reader_url_for(store.url)) as query:
        data = collect(query, payload=store.payload.location)
    panels = {p["name"]: p for p in data["panels"]}
    samples = list(store.samples())
    assert len(samples) < 256  # every sample is among the newest read
    versions = np.concatenate([s.token_model_versions for s in samples])
    logprobs = np.concatenate([s.rollout_logprobs for s in samples])
    keep = (versions >= 0) & np.concatenate([s.logprobs_mask & s.loss_mask.astype(bool) for s in samples])
    mean = panels["logprobs"]["figure"]["data"][-1]
    for v, got, n in zip(mean["x"], mean["y"], mean["customdata"]):
        sel = keep & (versions == int(v))
        # the page shows 3 significant digits (_figures.rounded)
        assert n == sel.sum() and got == pytest.approx(logprobs[sel].mean(), rel=5e-3)
    # Expert loads: the counted generated tokens' route rows (the row of the position before it), by version.
    heat = panels["expert_load"]["figure"]["data"][0]
    expected: dict[int, np.ndarray] = {}
    for (v, _, e), n in brute_force_expert_load(samples, EXPERT_SAMPLE_EVERY).items():
        expected.setdefault(v, np.zeros(DEMO_CONFIG.num_experts))[e] += n
    assert f"1 decode route in {EXPERT_SAMPLE_EVERY} counted" in panels["expert_load"]["figure"]["layout"]["title"]["text"]
    assert [int(v) for v in heat["y"]] == sorted(expected)
    for v, row in zip(heat["y"], heat["z"]):
        want = expected[int(v)]
        assert np.allclose(row, want / want.mean(), rtol=5e-3, atol=0)


def test_token_panels_need_no_payload(run_store, tmp_path):
    """Logprobs and expert loads are drawn from the run aggregates (counted as the samples were
    written): a page without the payload draws them all the same, and creates nothing there."""
    store, _ = run_store
    with read_only(reader_url_for(store.url)) as query:
        data = collect(query, payload=str(tmp_path / "elsewhere"))
    panels = {p["name"]: p for p in data["panels"]}
    assert panels["logprobs"]["figure"] and panels["expert_load"]["figure"]
    assert not any(p["note"] for p in data["panels"])
    assert not (tmp_path / "elsewhere").exists()


def test_the_live_data_is_not_recomputed_faster_than_twice_its_cost():
    """A big store's views take seconds: the live page then refreshes more slowly rather than
    keep the database busy (at most once per half refresh, and per twice the computing time)."""
    import time

    from trajstore.inspect._live import _Snapshot

    calls = []

    def compute():
        calls.append(time.monotonic())
        time.sleep(0.2)
        return {"n": len(calls)}

    snapshot = _Snapshot(compute, min_age_s=0.05)
    assert json.loads(snapshot.get()) == {"n": 1}
    assert json.loads(snapshot.get()) == {"n": 1}  # within 2 x 0.2 s of the last: the same data
    time.sleep(2 * (time.monotonic() - calls[0]) + 0.05)
    assert json.loads(snapshot.get()) == {"n": 2}


def test_route_drift_panel_counts_the_drifted_rows_of_the_log(run_store):
    """The simulator's engine recomputes about 1% of the re-sent rows differently; the panel's run total
    is the log's own (admission measured it, generation_events carries it)."""
    store, _ = run_store
    url = reader_url_for(store.url)
    with read_only(url) as query:
        data = collect(query, payload=store.payload.location)
        compared, drifted = query("SELECT sum(route_rows_resent) FILTER (WHERE route_rows_drifted IS NOT NULL), "
                                  "sum(route_rows_drifted) FROM generation_events").rows[0]
        per_version = {int(v): share for v, share in query(
            "SELECT model_version, route_drift_share FROM model_version_stats WHERE route_rows_resent > 0").rows}
    assert 0 < drifted < compared
    panel = next(p for p in data["panels"] if p["name"] == "route_drift")
    assert f"run: {drifted} of {compared}, " in json.dumps(panel["figure"]["layout"])
    bars = panel["figure"]["data"][-1]
    assert {int(v): y for v, y in zip(bars["x"], bars["y"])} == pytest.approx(per_version, rel=5e-3)  # 3 digits
    over_time = panel["figure"]["data"][0]
    assert sum(over_time["y"]) == drifted


def test_route_drift_panel_without_routes_or_before_drift_was_measured(store_url, tmp_path):
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    for events in run_events(0, 4):
        for e in events:
            e.pop("routed_experts", None)
        store.append(events)
    url = reader_url_for(store_url)
    with read_only(url) as query:
        note = next(p for p in collect(query)["panels"] if p["name"] == "route_drift")["note"]
    assert note.startswith("no call re-sent route rows for recorded positions yet")
    # Calls stored before drift was measured: re-sent rows, drift NULL (a store migrated from 0008).
    fill(store, 10, 4)
    with store.log.write_engine.begin() as conn:
        from sqlalchemy import text

        conn.execute(text("UPDATE events SET route_rows_drifted = NULL"))
    from trajstore.inspect._rebuild import rebuild_aggregates

    rebuild_aggregates(store)  # what migration 0015 counts from such a log
    store.close()
    with read_only(url) as query:
        note = next(p for p in collect(query)["panels"] if p["name"] == "route_drift")["note"]
    assert note.startswith("route rows were re-sent, but none was compared with the recording")


def test_problems_panel_counts_what_waits_and_what_failed(store_url, tmp_path):
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    fill(store, 0, 12)  # materialized
    for events in run_events(12, 6):  # finished after the materialize: waiting to be folded (15 fails)
        store.append(events)
    store.close()
    with read_only(reader_url_for(store_url)) as query:
        data = collect(query)
        (failed,) = query("SELECT count(*) FROM trajectory_summary WHERE status = 'failed'").rows[0]
    panel = next(p for p in data["panels"] if p["name"] == "problems")
    finished_late = sum(1 for i in range(12, 18) if i not in RUNNING)
    assert panel["figure"]["data"][-1]["y"] == [finished_late, 0, 0]  # waiting, held back, unfoldable
    assert failed == 1 and sum(panel["figure"]["data"][0]["y"]) == failed


def test_the_live_data_is_recomputed_when_the_store_changed_and_only_then():
    """The live page's data is recomputed when the change query's answer moved (an append, a
    fold), or when it is older than the clock-dependent panels allow; never on a timer when
    nothing changed. Each viewer is then sent only the panels whose content changed."""
    import time

    from trajstore.inspect._live import _Snapshot

    token, computed, checks = [0], [], []

    def changed():
        checks.append(time.monotonic())
        return token[0]

    def compute():
        computed.append(token[0])
        return {"generated_at": 1.0, "panels": [{"name": "a", "figure": token[0] // 2}, {"name": "b", "figure": 7}]}

    snapshot = _Snapshot(compute, min_age_s=0.0, changed=changed, check_s=0.05, max_age_s=3600)
    first = snapshot.parts()
    sent: dict = {}
    assert json.loads(first.delta(sent))["panels"] == {"a": {"name": "a", "figure": 0}, "b": {"name": "b", "figure": 7}}
    for _ in range(5):
        time.sleep(0.06)
        assert snapshot.parts() is first  # asked whether anything changed, and nothing did
    assert computed == [0] and len(checks) >= 5
    token[0] = 1  # the store moved, the panels' content did not
    time.sleep(0.06)
    same = snapshot.parts()
    assert computed == [0, 1] and same.version == first.version  # recomputed; nothing new to push
    token[0] = 2
    time.sleep(0.06)
    moved = snapshot.parts()
    assert computed == [0, 1, 2] and moved.version == first.version + 1
    message = json.loads(moved.delta(sent))
    assert message["order"] == ["a", "b"] and message["panels"] == {"a": {"name": "a", "figure": 1}}  # b unchanged
    assert json.loads(moved.body()) == {"generated_at": 1.0, "panels": [{"name": "a", "figure": 1},
                                                                          {"name": "b", "figure": 7}]}
    old = _Snapshot(compute, min_age_s=0.0, changed=changed, check_s=0.05, max_age_s=0.1)
    old.parts()
    time.sleep(0.15)
    old.parts()
    assert computed[-2:] == [2, 2]  # no change, but older than max_age_s: recomputed (the clock's panels)
