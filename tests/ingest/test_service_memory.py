"""The service holds at most ``max_bytes_in_flight`` of request bodies
at once; more requests wait (back-pressure) and still succeed. Figures of peak
RSS are in bench/bench_service_memory.py and docs/ingest.md "Memory" (no timed
or RSS asserts here)."""

from __future__ import annotations

import threading

import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from openai_upstream import serve_in_thread  # noqa: E402
from trajstore.ingest.service import make_app  # noqa: E402
from trajstore.ingest.sinks import encode_events  # noqa: E402

TOKEN = "mem-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def body_of(tid: str, tokens: int) -> bytes:
    return encode_events([
        {"type": "trajectory_started", "trajectory_id": tid},
        {"type": "generation", "trajectory_id": tid, "seq": 0, "model_version": 0, "output_ids": [1, 2],
         "prompt_ids": [i % 10 for i in range(tokens)]},
    ])


def _gauge(url: str, name: str) -> int:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f"trajstore_ingest_{name} "):
            return int(float(line.split()[1]))
    raise AssertionError(f"no gauge {name}")


def test_bodies_in_flight_stay_within_the_budget_and_all_succeed(store):
    budget = 300_000
    bodies = [body_of(f"t{i}", 60_000) for i in range(8)]  # ~120 KB each: at most two at once
    assert all(100_000 < len(b) < budget // 2 for b in bodies)
    with serve_in_thread(make_app(store, token=TOKEN, max_bytes_in_flight=budget)) as url:
        statuses: list[int] = []

        def post(body: bytes) -> None:
            statuses.append(httpx.post(f"{url}/v1/events", content=body, headers=AUTH, timeout=120).status_code)

        threads = [threading.Thread(target=post, args=(b,)) for b in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert statuses == [200] * len(bodies)
        peak = _gauge(url, "body_bytes_in_flight_peak")
        assert max(map(len, bodies)) <= peak <= budget
        assert _gauge(url, "body_bytes_in_flight") == 0  # everything given back
        assert _gauge(url, "body_bytes_in_flight_limit") == budget

        # a body larger than the whole budget is admitted alone, not refused or starved
        big = body_of("big", 400_000)
        assert len(big) > budget
        assert httpx.post(f"{url}/v1/events", content=big, headers=AUTH, timeout=120).status_code == 200
        # refused and malformed requests give their bytes back too
        assert httpx.post(f"{url}/v1/events", content=b'{"events": [', headers=AUTH).status_code == 400
        assert _gauge(url, "body_bytes_in_flight") == 0
    assert store.info() is not None


def test_token_arrays_are_decoded_to_int32_numpy_not_python_lists():
    from trajstore.ingest.service import decode_json, parse_body

    body = body_of("t", 5_000)
    prompt = decode_json(body)["events"][1]["prompt_ids"]
    assert type(prompt).__name__ == "ndarray" and prompt.dtype.name == "int32" and prompt.tolist()[:3] == [0, 1, 2]
    events, num_tokens = parse_body(body)
    assert events[1].prompt_ids.dtype.name == "int32" and num_tokens == 5_002
