"""The recording proxy over real loopback HTTP, in front of a fake vLLM server."""

from __future__ import annotations

import json

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from openai_upstream import NUM_LAYERS, TOPK, encode, make_upstream, render_chat, respond, route_rows, serve_in_thread  # noqa: E402
from trajstore.ingest.proxy import make_proxy_app  # noqa: E402
from trajstore.ingest.vllm import request_params_for_recording  # noqa: E402


@pytest.fixture
def upstream():
    app = make_upstream()
    with serve_in_thread(app) as url:
        yield url, app.state.requests


def _headers(tid, version=3):
    return {"X-Trajstore-Trajectory": tid, "X-Trajstore-Model-Version": str(version), "X-Trajstore-Num-Experts": "16"}


def _chat(proxy_url, messages, tid):
    resp = httpx.post(f"{proxy_url}/v1/chat/completions", json={"model": "fake", "messages": messages}, headers=_headers(tid))
    assert resp.status_code == 200 and "x-trajstore-error" not in resp.headers, resp.headers.get("x-trajstore-error")
    return resp


def _expected_routes(calls):
    """A sample's routes per SPEC: each position from the first call that covered it; the last masked."""
    full = calls[-1][0] + calls[-1][1]
    routes = np.zeros((len(full), NUM_LAYERS, TOPK), dtype=np.uint8)
    recorded = 0
    for prompt, output in calls:
        rows = route_rows(prompt + output, len(prompt))
        routes[recorded:len(rows)] = rows[recorded:]
        recorded = len(rows)
    routes[-1] = np.arange(TOPK)  # masked rows hold 0..topk-1
    return routes, np.arange(len(full)) == len(full) - 1


def test_three_turn_conversation_materializes_into_one_merged_sample(store, upstream):
    upstream_url, _ = upstream
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    calls, seqs = [], []
    for turn in range(3):
        # a fresh proxy (a restart) per turn: each seq must continue from the store
        with serve_in_thread(make_proxy_app(store, upstream_url)) as proxy:
            resp = _chat(proxy, messages, "conv")
            body = resp.json()
            seqs.append(int(resp.headers["x-trajstore-seq"]))
            calls.append((render_chat(messages), body["choices"][0]["token_ids"]))
            messages = messages + [body["choices"][0]["message"], {"role": "user", "content": f"turn {turn + 2}"}]
            if turn == 2:
                done = httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": "conv", "reward": 1.0})
                assert done.status_code == 200
    assert seqs == [0, 1, 2]
    stats = store.materialize()
    assert (stats.num_steps_before, stats.num_samples_after, stats.prefix_mismatch_count) == (3, 1, 0)
    (sample,) = list(store.samples())
    (p1, o1), (p2, o2), (p3, o3) = calls
    assert list(sample.prompt_ids) == p1
    assert list(sample.response_ids) == o1 + p2[len(p1 + o1):] + o2 + p3[len(p2 + o2):] + o3
    mask = [1] * len(o1) + [0] * (len(p2) - len(p1 + o1)) + [1] * len(o2) + [0] * (len(p3) - len(p2 + o2)) + [1] * len(o3)
    assert list(sample.loss_mask) == mask
    assert set(sample.token_model_versions[np.asarray(mask) == 1]) == {3}
    assert sample.reward == 1.0 and sample.status == "completed" and sample.is_last_step
    routes, route_mask = _expected_routes(calls)
    np.testing.assert_array_equal(sample.routed_experts, routes)
    np.testing.assert_array_equal(sample.routed_experts_mask, route_mask)
    lps = np.asarray(sample.rollout_logprobs)
    assert np.all(lps[np.asarray(mask) == 1] < 0) and np.all(lps[np.asarray(mask) == 0] == 0)


def test_proxy_adds_recording_params_and_returns_upstream_bytes_unchanged(store, upstream):
    upstream_url, requests = upstream
    body = {"model": "fake", "prompt": [10, 20, 30], "max_tokens": 4, "trajstore": {"trajectory_id": "c1", "model_version": 2}}
    with serve_in_thread(make_proxy_app(store, upstream_url)) as proxy:
        resp = httpx.post(f"{proxy}/v1/completions", json=body)
    assert resp.status_code == 200 and resp.headers["x-trajstore-seq"] == "0"
    sent = requests[-1]
    assert "trajstore" not in sent and sent["return_token_ids"] is True and sent["logprobs"] == 0
    expected = respond(request_params_for_recording({k: v for k, v in body.items() if k != "trajstore"}, chat=False), chat=False)
    assert resp.json() == json.loads(json.dumps(expected))
    (gen,) = store.load_generations("c1")
    assert list(gen.prompt_ids) == [10, 20, 30] and gen.model_version == 2 and gen.routed_experts is not None
    np.testing.assert_allclose(gen.logprobs, expected["choices"][0]["logprobs"]["token_logprobs"], rtol=1e-6)


def test_unnamed_calls_pass_through_unrecorded(store, upstream, store_url):
    upstream_url, requests = upstream
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}]}
    with serve_in_thread(make_proxy_app(store, upstream_url)) as proxy:
        resp = httpx.post(f"{proxy}/v1/chat/completions", json=body)
        models = httpx.get(f"{proxy}/v1/models")
    assert resp.status_code == 200 and "x-trajstore-seq" not in resp.headers
    assert requests[-1] == body and models.json()["data"][0]["id"] == "fake"
    assert store.info()["events_by_type"] == {}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_streamed_calls_pass_through_and_are_recorded_without_routes(store, upstream, chat):
    upstream_url, _ = upstream
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "fake", "stream": True, **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    with serve_in_thread(make_proxy_app(store, upstream_url)) as proxy:
        with httpx.stream("POST", f"{proxy}{path}", json=body, headers=_headers("s")) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and len(lines) > 3
    (gen,) = store.load_generations("s")
    prompt = render_chat(body["messages"]) if chat else encode("hi")
    assert list(gen.prompt_ids) == prompt and len(gen.output_ids) == 6
    assert gen.routed_experts is None and gen.logprobs is not None and gen.model_version == 3


def test_recorded_calls_must_have_one_choice(store, upstream):
    upstream_url, requests = upstream
    with serve_in_thread(make_proxy_app(store, upstream_url)) as proxy:
        resp = httpx.post(f"{proxy}/v1/completions", json={"prompt": "x", "n": 2}, headers=_headers("n2"))
    assert resp.status_code == 400 and resp.json()["error"]["rule"] == "n" and requests == []


def test_refused_record_is_reported_in_a_header(store, upstream):
    upstream_url, _ = upstream
    store.append([{"type": "trajectory_started", "trajectory_id": "done"},
                  {"type": "trajectory_finished", "trajectory_id": "done", "status": "completed"}])
    with serve_in_thread(make_proxy_app(store, upstream_url)) as proxy:
        resp = httpx.post(f"{proxy}/v1/completions", json={"prompt": "x"}, headers=_headers("done"))
    assert resp.status_code == 200 and "done" in resp.headers["x-trajstore-error"]


def test_unreachable_upstream_gets_502(store):
    with serve_in_thread(make_proxy_app(store, "http://127.0.0.1:9")) as proxy:
        resp = httpx.post(f"{proxy}/v1/completions", json={"prompt": "x"}, headers=_headers("u"))
    assert resp.status_code == 502 and resp.json()["error"]["rule"] == "upstream_unreachable"


def test_finish_errors_are_clear(store, upstream):
    upstream_url, _ = upstream
    with serve_in_thread(make_proxy_app(store, upstream_url)) as proxy:
        unknown = httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": "never-started"})
        malformed = httpx.post(f"{proxy}/trajstore/finish", json={"status": "completed"})
    assert unknown.status_code == 422 and "never-started" in unknown.json()["error"]["message"]
    assert malformed.status_code == 400 and malformed.json()["error"]["rule"] == "malformed_body"
