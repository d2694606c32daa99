"""The ingest service's /metrics (prometheus_client): duplicates are not
counted as ingested, and with ``serve --workers N`` every scrape sees the
whole service (multiprocess mode), not one random worker's counters."""

from __future__ import annotations

import os

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


def test_every_scrape_of_a_multi_worker_service_sees_all_workers(tmp_path):
    with serve_process("--store", f"sqlite:///{tmp_path}/s.db", "serve", "--workers", "2",
                       env={**os.environ, "TRAJSTORE_TOKEN": TOKEN}) as (_, url):
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
    leftovers = [d for d in os.listdir(os.environ.get("TMPDIR", "/tmp")) if d.startswith("trajstore-serve-metrics-")]
    assert not leftovers, leftovers


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
