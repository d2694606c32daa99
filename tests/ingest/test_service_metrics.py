"""The ingest service's /metrics (prometheus_client): duplicates are not
counted as ingested, and with ``serve --workers N`` every scrape sees the
whole service (multiprocess mode), not one random worker's counters."""

from __future__ import annotations

import os
import time

import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from openai_upstream import serve_in_thread  # noqa: E402
from trajstore.ingest.service import make_app  # noqa: E402
from trajstore.ingest.sinks import encode_events  # noqa: E402
from helpers import serve_process  # noqa: E402

TOKEN = "metrics-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _events(tid: str) -> list[dict]:
    return [{"type": "trajectory_started", "trajectory_id": tid},
            {"type": "reward", "trajectory_id": tid, "reward": 1.0, "event_id": f"{tid}-r"},
            {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}]


def test_duplicates_are_counted_apart_from_ingested_events(store):
    with serve_in_thread(make_app(store, token=TOKEN)) as url:
        body = encode_events(_events("dup"))
        for _ in range(2):
            assert httpx.post(f"{url}/v1/events", content=body, headers=HEADERS).status_code == 200
        got = _samples(httpx.get(f"{url}/metrics").text)
    assert got[("trajstore_ingest_events_total", ())] == 3
    assert got[("trajstore_ingest_duplicate_events_total", ())] == 3
    assert got[("trajstore_ingest_requests_total", (("status", "200"),))] == 2
    assert got[("trajstore_ingest_body_bytes_in_flight", ())] == 0


def _own_tmp(tmp_path) -> tuple[str, dict]:
    """A temp dir of this test's own for serve (its metrics directories), and the env naming it:
    other serves on the machine make theirs elsewhere."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return str(tmp), {**os.environ, "TRAJSTORE_TOKEN": TOKEN, "TMPDIR": str(tmp)}


def _metrics_dirs(tmp: str) -> list[str]:
    return sorted(d for d in os.listdir(tmp) if d.startswith("trajstore-serve-metrics-"))


def test_every_scrape_of_a_multi_worker_service_sees_all_workers(tmp_path):
    tmp, env = _own_tmp(tmp_path)
    with serve_process("--store", f"sqlite:///{tmp_path}/s.db", "serve", "--workers", "2", env=env) as (_, url):
        n = 24
        for i in range(n):  # a new connection each: the kernel spreads them over the workers
            assert httpx.post(f"{url}/v1/events", content=encode_events(_events(f"w{i}")),
                              headers=HEADERS).status_code == 200
        seen = []
        for _ in range(8):
            got = _samples(httpx.get(f"{url}/metrics").text)
            seen.append((got[("trajstore_ingest_requests_total", (("status", "200"),))],
                         got[("trajstore_ingest_events_total", ())]))
        assert seen == [(n, 3 * n)] * 8, seen
    assert not _metrics_dirs(tmp)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def test_a_serve_killed_with_minus_9_leaves_a_metrics_directory_the_next_serve_removes(tmp_path):
    """``serve --workers N`` killed with -9 cannot remove its multiprocess metrics directory:
    the next ``serve`` removes the ones whose serve and workers are gone, and keeps a live one's."""
    import signal

    tmp, env = _own_tmp(tmp_path)
    live = os.path.join(tmp, f"trajstore-serve-metrics-{os.getpid()}-live")  # this process: alive
    os.mkdir(live)
    args = ("--store", f"sqlite:///{tmp_path}/s.db", "serve", "--workers", "2")
    with serve_process(*args, env=env) as (proc, url):
        assert httpx.post(f"{url}/v1/events", content=encode_events(_events("k")), headers=HEADERS).status_code == 200
        workers = _children(proc.pid)
        (killed,) = [d for d in _metrics_dirs(tmp) if not d.endswith("-live")]
        for pid in [proc.pid, *workers]:
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    for pid in workers:  # reaped by init once their parent is gone
        for _ in range(200):
            if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.05)
    assert _metrics_dirs(tmp) == sorted([killed, os.path.basename(live)])
    with serve_process(*args, env=env) as (proc, url):
        assert httpx.get(f"{url}/healthz").status_code == 200
        now = _metrics_dirs(tmp)
        assert killed not in now and os.path.basename(live) in now and len(now) == 2, now
    assert _metrics_dirs(tmp) == [os.path.basename(live)]


def test_the_token_rule_denies_by_default_every_endpoint_not_listed_open(store):
    app = make_app(store, token=TOKEN)

    @app.fastapi.get("/added-later")
    async def added_later() -> dict:
        return {"secret": 1}

    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serve_in_thread(app) as url:
        for path in ("/healthz", "/openapi.json", "/metrics"):
            assert httpx.get(f"{url}{path}").status_code == 200, path
        for method, path in (("GET", "/added-later"), ("POST", "/v1/events"), ("GET", "/no-such-path"),
                             ("DELETE", "/v1/events")):
            resp = httpx.request(method, f"{url}{path}", content=b"{}")
            assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer", (method, path)
            assert resp.json()["error"]["rule"] == "unauthorized"
        assert httpx.get(f"{url}/added-later", headers=auth).json() == {"secret": 1}
        assert httpx.get(f"{url}/no-such-path", headers=auth).status_code == 404
        got = _samples(httpx.get(f"{url}/metrics").text)
    assert got[("trajstore_ingest_requests_total", (("status", "401"),))] == 1  # the POST /v1/events
