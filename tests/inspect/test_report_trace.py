"""The trace view's data (one trajectory token by token) and the per-step, per-task and
length-over-time panels, on both backends under the reader login; the time buckets.

The pages are loaded in chromium in ``test_report_trace_browser.py``."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import trajstore
from tests.helpers import reader_url_for
from tests.inspect.test_report import NUM_TRAJECTORIES, RUNNING, TASKS, run_events, run_store  # noqa: F401
from trajstore.cli import main
from trajstore.inspect import _trace
from trajstore.inspect._panels import collect
from trajstore.inspect._timeaxis import BUCKET_WIDTHS_S, MAX_BUCKETS, MIN_BUCKET_S, bucket_width
from trajstore.inspect.sql import read_only

# conftest: these fixtures connect store_url first thing, so it starts as a migrated copy
STORE_URL_CONNECTED_BY = ("run_store",)

HOSTILE_ID = "t'1<img src=x onerror=\"window.__pwned=1\">/a?b#c"
HOSTILE_TEXT = "</script><script>window.__pwned=2</script><b>bold</b>"


def _annotated(query) -> str:
    return query("SELECT min(trajectory_id) FROM train_rollout_mismatch WHERE tokens_compared > 0").rows[0][0]


def test_trace_colours_every_token_from_the_samples(run_store):
    store, _ = run_store
    with read_only(reader_url_for(store.url)) as query:
        tid = _annotated(query)
        data = _trace.trace_data(query, tid, payload=store.payload.location)
        calls = [dict(zip(data["calls"]["columns"], r)) for r in data["calls"]["rows"]]
        (n_calls,) = query(f"SELECT count(*) FROM generation_events WHERE trajectory_id = '{tid}'").rows[0]
    assert data["found"] and data["note"] is None and len(calls) == n_calls
    samples = {s.sample_index: s for s in store.samples(trajectory_ids=[tid])}
    assert [s["sample_index"] for s in data["samples"]] == sorted(samples)
    annotations = trajstore.lineage.read_annotations(store, run="run-a", trajectory_id=tid)
    trainer = {}
    for a in sorted(annotations, key=lambda a: a.step):
        if a.trainer_logprobs is not None:
            trainer[a.sample_index] = np.asarray(a.trainer_logprobs, np.float64)  # the newest step wins
    assert trainer
    resent_anywhere = False
    for got in data["samples"]:
        s = samples[got["sample_index"]]
        p, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.response_ids)
        assert got["ids"] == [*s.prompt_ids.tolist(), *s.response_ids.tolist()]
        gen = np.zeros(n, bool)
        gen[p:] = s.token_model_versions >= 0
        lp_ok = np.zeros(n, bool)
        lp_ok[p:] = s.logprobs_mask & (s.token_model_versions >= 0)
        want = np.full(n, -1)
        want[lp_ok] = np.digitize(s.rollout_logprobs[lp_ok[p:]].astype(np.float64), _trace.LOGPROB_EDGES)
        assert got["colors"]["logprob"] == want.tolist()
        versions = np.where(gen, np.concatenate([np.full(p, -1), s.token_model_versions]), -1)
        assert got["version"] == versions.tolist()
        vmin = min(x.min_model_version for x in samples.values())
        assert got["colors"]["version"] == np.where(gen, (versions - vmin) % len(_trace.CATEGORY_COLORS), -1).tolist()
        if got["sample_index"] in trainer:
            t = trainer[got["sample_index"]]
            ok = lp_ok[p:]
            assert got["has_trainer"]
            assert np.allclose([got["trainer"][p + j] for j in np.flatnonzero(ok)], t[ok], atol=1e-4)
            ratio = t[ok] - s.rollout_logprobs[ok].astype(np.float64)
            assert np.allclose([got["mismatch"][p + j] for j in np.flatnonzero(ok)], ratio, atol=2e-4)
            assert all(got["colors"]["mismatch"][p + j] >= 0 for j in np.flatnonzero(ok))
        else:
            assert set(got["colors"]["trainer"]) == {-1}
        # the call of each generated token: its call's [prompt_len, prompt_len + output_len)
        for c in calls:
            if c["sample_index"] == got["sample_index"]:
                lo, hi = c["prompt_len"], c["prompt_len"] + c["output_len"]
                assert set(got["call"][lo:hi]) <= {c["seq"]}
        # route drift: each position counts the calls that re-sent its row; the share is their moved rows
        resent_by = np.zeros(n, int)
        rows = np.zeros(n)
        moved = np.zeros(n)
        for c in calls:
            if c["sample_index"] == got["sample_index"] and c["route_rows_resent"] and c["num_route_rows_stored"] \
                    and c["route_rows_drifted"] is not None:
                lo = c["routes_start"] - c["route_rows_resent"]
                resent_by[lo:c["routes_start"]] += 1
                rows[lo:c["routes_start"]] += c["route_rows_resent"]
                moved[lo:c["routes_start"]] += c["route_rows_drifted"]
        assert got["resent_by"] == resent_by.tolist()
        hit = resent_by > 0
        resent_anywhere |= bool(hit.any())
        assert np.allclose([got["drift"][j] for j in np.flatnonzero(hit)], (moved / np.maximum(rows, 1))[hit],
                           atol=1e-4)
        assert all(got["drift"][j] is None for j in np.flatnonzero(~hit))
        assert [c >= 0 for c in got["colors"]["drift"]] == hit.tolist()
    assert resent_anywhere  # the demo engine re-sends routes on merged calls


def test_trace_of_a_running_and_of_an_unknown_trajectory(run_store):
    store, _ = run_store
    running = f"traj-0-{min(RUNNING):06d}"
    with read_only(reader_url_for(store.url)) as query:
        data = _trace.trace_data(query, running, payload=store.payload.location)
        (calls,) = query(f"SELECT count(*) FROM generation_events WHERE trajectory_id = '{running}'").rows[0]
        unknown = _trace.trace_data(query, "no-such-trajectory", payload=store.payload.location)
    assert data["found"] and data["samples"] == [] and len(data["calls"]["rows"]) == calls > 0
    assert data["note"].startswith("no materialized samples yet")
    assert dict(data["summary"])["status"] == "running"
    assert not unknown["found"] and unknown["note"] == "the store has no trajectory with this id"


def _hostile_store(url: str, payload: str):
    """A store whose one trajectory has an id and metadata made of markup (and a quote)."""
    store = trajstore.connect(url, payload=payload)
    events = run_events(0, 1)[0]
    for e in events:
        if "trajectory_id" in e:
            e["trajectory_id"] = HOSTILE_ID
        if e["type"] == "trajectory_started":
            e["metadata"] = {"task": HOSTILE_TEXT, "note": HOSTILE_TEXT}
    store.append(events)
    store.materialize()
    return store


def test_trace_cli_writes_a_static_page_and_markup_stays_text(store_url, tmp_path, capsys):
    store = _hostile_store(store_url, str(tmp_path / "payload"))
    url = reader_url_for(store_url)
    out = tmp_path / "traces"
    assert main(["--store", url, "--payload", store.payload.location, "report", "--trace", HOSTILE_ID, str(out)]) == 0
    path = out / _trace.trace_file_name(HOSTILE_ID)
    assert capsys.readouterr().out == f"wrote {path}\n"
    assert os.listdir(out) == [path.name] and path.name.startswith("trace-t_1_img_src_x_onerror")
    page = path.read_text()
    # the id and the metadata reach the page only as escaped text and as JSON with '<' escaped
    assert "<img" not in page and "<b>bold" not in page and "</script><script>window" not in page
    data = json.loads(page.split("<script id='trajstore-data' type='application/json'>")[1].split("</script>")[0])
    assert data["found"] and data["trajectory_id"] == HOSTILE_ID and data["samples"]
    assert json.loads([v for k, v in data["summary"] if k == "metadata"][0]) == {"note": HOSTILE_TEXT,
                                                                                "task": HOSTILE_TEXT}
    # the SQL quotes the id: it found the trajectory on this backend
    assert f"WHERE trajectory_id = {_trace.sql_string(HOSTILE_ID)}" in data["sql"][0]
    store.close()


def test_trace_flag_with_serve_is_one_error(run_store, capsys):
    store, _ = run_store
    assert main(["--store", reader_url_for(store.url), "report", "--serve", "--trace", "x", "--token", "t"]) == 1
    assert capsys.readouterr().err == ("error: report --serve serves every trace at /trace/ID; --trace writes one "
                                       "into OUT_DIR\n")


def test_sql_string_refuses_nul():
    assert _trace.sql_string("a'b") == "'a''b'"
    with pytest.raises(trajstore.errors.TrajstoreError, match="without NUL"):
        _trace.sql_string("a\x00b")


# -- the new panels ---------------------------------------------------------------------------

def _panels(store) -> tuple[dict, object]:
    url = reader_url_for(store.url)
    with read_only(url) as query:
        data = collect(query, stuck_after_s=0.0, payload=store.payload.location)
    return {p["name"]: p for p in data["panels"]}, url


def test_never_trained_share_per_step(run_store):
    store, _ = run_store
    panels, url = _panels(store)
    fig = panels["never_trained"]["figure"]
    bars, share = fig["data"][0], fig["data"][1]
    with read_only(url) as query:
        steps = query("SELECT step, min(position) FROM train_steps GROUP BY step ORDER BY step").rows
        finished = [r[0] for r in query("SELECT finished_position FROM samples").rows]
        consumed = query("SELECT step, trajectory_id, sample_index FROM sample_consumption").rows
    assert list(bars["x"]) == [s for s, _ in steps] == list(share["x"])
    for i, (step, position) in enumerate(steps):
        available = sum(1 for f in finished if f < position)
        trained = len({(t, k) for s, t, k in consumed if s <= step})
        assert bars["y"][i] == sum(1 for s, *_ in consumed if s == step)
        assert share["y"][i] == pytest.approx(1 - trained / available, rel=5e-3)  # 3 significant digits
        assert share["customdata"][i] == [trained, available]
    assert 0 < share["y"][-1] < 1


def test_the_training_panels_read_no_pass_over_the_samples(run_store):
    """What never_trained and training_steps read of the samples grows with the steps and what they
    consumed, not with the store: ranges of ix_samples_order (each sample counted at most once) and
    primary-key probes; no scan of samples, no sort of them."""
    import sqlite3

    from trajstore.inspect._panels_lineage import _steps_sql
    from trajstore.inspect._step_panels import _never_trained_sql

    store, _ = run_store
    if not store.url.startswith("sqlite"):
        pytest.skip("query plans: SQLite's EXPLAIN QUERY PLAN")
    db = sqlite3.connect(store.url.removeprefix("sqlite:///"))
    try:
        for q, index in ((_never_trained_sql(None)[0], "ix_samples_order"), (_steps_sql(None)[1], "samples_1")):
            plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + q)]
            on_samples = [step for step in plan if step.startswith(("SCAN s ", "SEARCH s ", "SCAN samples"))
                          and "lineage_steps" not in step]
            assert on_samples and all(step.startswith("SEARCH s USING COVERING INDEX") and index in step
                                      for step in on_samples), plan
    finally:
        db.close()


def test_run_trends_cover_every_version_and_step(run_store):
    """The whole run by bucket: each version bucket's length quantiles are those of its engine calls,
    its reward the mean over its rewarded trajectories; each step bucket's staleness that of what its
    steps consumed (against the views, over every version and step, not the newest few)."""
    from trajstore.inspect._figures import _VERSION_STATS_SQL
    from trajstore.inspect._panels_trends import QUANTILES, TREND_BUCKETS

    store, _ = run_store
    panels, url = _panels(store)
    p10, p50, p90, reward, failed, stale, max_stale = panels["run_trends"]["figure"]["data"]
    with read_only(url) as query:
        calls = query("SELECT model_version, output_len FROM generation_events WHERE model_version >= 0").rows
        consumed = query("SELECT step, staleness FROM sample_consumption").rows
    lo, hi = min(v for v, _ in calls), max(v for v, _ in calls)
    buckets: dict[int, list] = {}
    for v, n in calls:
        buckets.setdefault((v - lo) * TREND_BUCKETS // (hi - lo + 1), []).append((v, n))
    assert len(p50["x"]) == len(buckets) > 1
    for i, b in enumerate(sorted(buckets)):
        versions = [v for v, _ in buckets[b]]
        assert p50["x"][i] == (min(versions) + max(versions)) / 2
        lengths = np.sort([n for _, n in buckets[b]])
        for trace, q in zip((p10, p50, p90), QUANTILES):
            assert trace["y"][i] == lengths[int(np.ceil(q * len(lengths))) - 1]
    assert all(a <= b <= c for a, b, c in zip(p10["y"], p50["y"], p90["y"]))
    # reward and failures: agg_versions' rows (one per version, as the per-version panels read them) by bucket
    with read_only(url) as query:
        stats = [r for r in query(_VERSION_STATS_SQL).rows if r[0] is not None]
    vlo, vhi = min(r[0] for r in stats), max(r[0] for r in stats)
    by: dict[int, list] = {}
    for v, _, n, _, mean, rewarded, failed_n, aborted in stats:
        a = by.setdefault((v - vlo) * TREND_BUCKETS // (vhi - vlo + 1), [0.0, 0, 0, 0])
        a[0] += (mean or 0.0) * (rewarded or 0)
        a[1] += rewarded or 0
        a[2] += (failed_n or 0) + (aborted or 0)
        a[3] += n
    assert len(reward["x"]) == len(by) > 1
    assert reward["y"] == pytest.approx([a[0] / a[1] if a[1] else None for _, a in sorted(by.items())], rel=5e-3)
    assert failed["y"] == pytest.approx([a[2] / a[3] for _, a in sorted(by.items())], rel=5e-3)
    assert any(a[2] for a in by.values())
    steps = sorted({s for s, _ in consumed})
    slo, shi = steps[0], steps[-1]
    per: dict[int, list] = {}
    for s, st in consumed:
        per.setdefault((s - slo) * TREND_BUCKETS // (shi - slo + 1), []).append(st)
    assert stale["y"] == pytest.approx([np.mean(per[b]) for b in sorted(per)], rel=5e-3)
    assert list(max_stale["y"]) == [max(per[b]) for b in sorted(per)]
    assert len(stale["x"]) == len(per) > 1


def test_trainer_metrics_one_plot_per_key(run_store):
    store, _ = run_store
    panels, _ = _panels(store)
    fig = panels["trainer_metrics"]["figure"]
    titles = [a["text"] for a in fig["layout"]["annotations"]]
    assert titles == ["kl", "loss"]  # both on every step: alphabetical
    loss = next(t for t in fig["data"] if t["xaxis"] == "x2")
    assert list(loss["y"]) == pytest.approx([1.0 / (s + 1) for s in loss["x"]])


def test_per_task_panel_groups_by_the_metadata_task(run_store):
    store, _ = run_store
    panels, url = _panels(store)
    reward, per_call, failed = panels["per_task"]["figure"]["data"]
    assert sorted(reward["x"]) == sorted(TASKS)
    with read_only(url) as query:
        # the finished trajectories (the materializer counts each as it takes it)
        rows = query("SELECT trajectory_id, reward, num_generated_tokens, num_generations FROM trajectory_summary "
                     "WHERE status <> 'running'").rows
    for i, task in enumerate(reward["x"]):
        mine = [r for r in rows if TASKS[int(r[0][-6:]) % len(TASKS)] == task]
        rewards = [r[1] for r in mine if r[1] is not None]
        assert reward["customdata"][i] == [len(rewards), len(mine)]
        # the page's 3 significant digits
        assert reward["y"][i] == pytest.approx(sum(rewards) / len(rewards), rel=5e-3)
        assert per_call["y"][i] == pytest.approx(sum(r[2] for r in mine) / sum(r[3] for r in mine), rel=5e-3)
    assert sum(c[1] for c in reward["customdata"]) == NUM_TRAJECTORIES - len(RUNNING)


def test_response_length_over_time_and_the_buckets(run_store):
    store, _ = run_store
    panels, url = _panels(store)
    fig = panels["response_length_over_time"]["figure"]
    mean, biggest, cut = fig["data"]
    with read_only(url) as query:
        calls, longest, length = query("SELECT count(*), max(output_len), count(*) FILTER (WHERE finish_reason = "
                                       "'length') FROM generation_events").rows[0]
    assert sum(mean["customdata"]) == calls and max(biggest["y"]) == longest
    assert sum(s * n for s, n in zip(cut["y"], mean["customdata"])) == pytest.approx(length, rel=5e-3)  # 3 digits
    # the test run appends within seconds: the width the run's span and calls give
    from trajstore.inspect._figures import _clock

    with read_only(url) as query:
        page = _clock(query, 300.0, None)
    assert fig["layout"]["xaxis"]["title"]["text"] == f"time (UTC; {page.width_s} s buckets)"
    assert fig["layout"]["xaxis"]["range"] == [page.time_of(0), page.time_of(page.num_buckets)]


def test_trajectories_to_look_at_link_to_the_trace_view(run_store):
    store, _ = run_store
    panels, url = _panels(store)
    drift, k3, longest = panels["trajectories_to_look_at"]["figure"]["data"]
    with read_only(url) as query:
        # the finished trajectories (the materializer counts each as it takes it)
        worst = [r[0] for r in query("SELECT trajectory_id FROM trajectory_summary WHERE route_drift_share > 0 "
                                     "AND status <> 'running' ORDER BY route_drift_share DESC, trajectory_id "
                                     "LIMIT 10").rows]
        most = [r[0] for r in query("SELECT trajectory_id FROM trajectory_summary WHERE status <> 'running' "
                                    "ORDER BY num_generated_tokens DESC, trajectory_id LIMIT 10").rows]
    assert worst and list(drift["y"]) == worst[::-1] and drift["meta"]["trajectory_ids"] == worst[::-1]
    assert list(longest["y"]) == most[::-1] == longest["meta"]["trajectory_ids"]
    assert k3["meta"]["trajectory_ids"] == list(k3["y"]) and k3["y"]
    stuck = panels["stuck"]["figure"]["data"][0]
    assert stuck["meta"]["trajectory_ids"] == list(stuck["y"])
    assert sorted(stuck["meta"]["trajectory_ids"]) == sorted(f"traj-0-{i:06d}" for i in RUNNING)


# -- time buckets ---------------------------------------------------------------------------------

@pytest.mark.parametrize("every_s", [0.5, 1, 2, 3, 7, 30, 120])
@pytest.mark.parametrize("span_s", [20, 60, 300, 3600, 6 * 3600, 3 * 86400])
def test_buckets_never_comb_a_regular_writer(every_s, span_s):
    """A writer appending every ``every_s`` seconds fills every bucket (no empty bucket between
    full ones, as 1 s buckets gave a writer appending every 2 s), at most MAX_BUCKETS of them."""
    times = np.arange(0, span_s, every_s)
    width = bucket_width(span_s, len(times))
    assert width in BUCKET_WIDTHS_S and width >= MIN_BUCKET_S
    counts = np.bincount((times // width).astype(int))
    assert len(counts) <= MAX_BUCKETS + 1
    assert counts[:-1].min(initial=1) >= 1 and (len(counts) < 3 or counts[1:-1].min() >= 2)


def test_bucket_width_of_an_idle_or_empty_run():
    assert bucket_width(0.0, 0) == MIN_BUCKET_S
    assert bucket_width(5.0, 1) == 30  # one call: four calls' worth of its gap (20 s), rounded up the ladder
    assert bucket_width(1e9, 10) == BUCKET_WIDTHS_S[-1]


@pytest.mark.parametrize("span_s, width", [(5.0, 1), (9.9, 1), (12.0, 2), (19.0, 2), (0.4, MIN_BUCKET_S)])
def test_a_short_run_gets_several_buckets(span_s, width):
    """The demo's 5-second run was one 10-s bucket: lines of one point, millisecond ticks."""
    assert bucket_width(span_s, 200) == width


def test_a_time_panels_bucket_floors_like_the_aggregates(run_store):
    """A second's last half millisecond belongs to that second's bucket on both backends, as in
    the aggregates (floor of created_at): PostgreSQL's CAST of a double to BIGINT rounds, and put
    a call at 1234.9996 s into the next second's bucket, where its aggregated rows were not."""
    from trajstore.inspect._figures import _clock
    from dataclasses import replace

    store, _ = run_store
    with read_only(reader_url_for(store.url)) as query:
        c = replace(_clock(query, 300.0, None), first_s=1000.0, width_s=1)
        rows = query(f"SELECT {c.bucket('x')} FROM (SELECT CAST(1234.9996 AS DOUBLE PRECISION) AS x) t").rows
        assert [int(r[0]) for r in rows] == [234]


@pytest.mark.parametrize("shift", [0.0, 0.5])
def test_route_drift_buckets_are_the_pages_at_every_width(run_store, shift):
    """The drift panel sums the stored 1/60/3600 s buckets of agg_route_drift into the page's
    buckets: at every width of the ladder (and the first event moved half a bucket) they are
    exactly generation_events' route drift bucketed like the other time panels."""
    from dataclasses import replace

    from trajstore.inspect._figures import _clock
    from trajstore.inspect._panels_tokens import _drift_sql

    store, _ = run_store
    with read_only(reader_url_for(store.url)) as query:
        page = _clock(query, 300.0, None)
        (calls,) = query("SELECT count(*) FROM generation_events").rows[0]
        assert page.width_s == bucket_width(page.last_s - page.first_s, calls) >= 10  # not the old 1 s
        for width in BUCKET_WIDTHS_S:
            c = replace(page, width_s=width, first_s=page.first_s - shift * width)
            stored = {int(b): (int(n), int(d or 0)) for b, n, d, _ in query(_drift_sql(c)[0]).rows if n}
            direct = {int(b): (int(n), int(d or 0)) for b, n, d in query(
                f"SELECT {c.bucket('created_at')}, sum(route_rows_resent), sum(route_rows_drifted) "
                "FROM generation_events WHERE route_rows_resent > 0 AND route_rows_drifted IS NOT NULL "
                "GROUP BY 1").rows}
            assert stored == direct and stored, width


def make_tokenizer(path) -> str:
    """A word-level tokenizer.json over the demo's ids: id i is ``w{i}``, every 7th one markup."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {(f"<i>w{i}</i>" if i % 7 == 0 else f"w{i}"): i for i in range(32000)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    file = str(path / "tokenizer.json")
    tok.save(file)
    return file


def word(i: int) -> str:
    return f"<i>w{i}</i>" if i % 7 == 0 else f"w{i}"


def test_trace_decodes_tokens_with_a_tokenizer(run_store, tmp_path, capsys):
    store, _ = run_store
    make_tokenizer(tmp_path)
    decoder = _trace.load_tokenizer(str(tmp_path))  # the directory holding tokenizer.json
    with read_only(reader_url_for(store.url)) as query:
        tid = _annotated(query)
        data = _trace.trace_data(query, tid, payload=store.payload.location, tokenizer=decoder,
                                 tokenizer_name=str(tmp_path))
        plain = _trace.trace_data(query, tid, payload=store.payload.location)
    assert data["tokenizer"] == str(tmp_path) and plain["tokenizer"] is None
    for s in data["samples"]:
        assert s["text"] == [word(i) for i in s["ids"]]
    assert all(s["text"] is None for s in plain["samples"])
    # the CLI: decoded on the static trace page (markup in a token stays JSON text); a bad path is one line
    out = tmp_path / "t"
    url = reader_url_for(store.url)
    assert main(["--store", url, "report", "--trace", tid, "--tokenizer", str(tmp_path / "tokenizer.json"),
                 str(out)]) == 0
    page = (out / _trace.trace_file_name(tid)).read_text()
    assert "\\u003ci>w" in page and "<i>w" not in page
    capsys.readouterr()
    assert main(["--store", url, "report", "--trace", tid, "--tokenizer", str(tmp_path / "nope"), str(out)]) == 1
    assert capsys.readouterr().err == f"error: --tokenizer {tmp_path / 'nope'}: no tokenizer.json at {tmp_path / 'nope'}\n"
