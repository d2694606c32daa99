"""The recording proxy over real loopback HTTP, in front of a fake vLLM server."""

from __future__ import annotations

import json

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from openai_upstream import (  # noqa: E402
    ASSISTANT, END, NUM_LAYERS, SYSTEM, TOPK, USER, encode, make_upstream, render_chat, respond, route_rows,
    serve_in_thread, tito_respond,
)
from helpers import proxy_process  # noqa: E402
from proxy_faults import ENGINE_DOWN, assert_unreachable  # noqa: E402
from trajstore.ingest.proxy import make_proxy_app  # noqa: E402
from trajstore.ingest.vllm import OpenAIStreamAccumulator, request_params_for_recording  # noqa: E402


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
    with serve_in_thread(make_proxy_app(store, upstream_url, pass_through_unrecorded=True)) as proxy:
        resp = httpx.post(f"{proxy}/v1/completions", json={"prompt": "x"}, headers=_headers("done"))
    assert resp.status_code == 200 and "done" in resp.headers["x-trajstore-error"]


def test_unreachable_upstream_gets_502(store):
    with serve_in_thread(make_proxy_app(store, ENGINE_DOWN)) as proxy:
        resp = httpx.post(f"{proxy}/v1/completions", json={"prompt": "x"}, headers=_headers("u"))
    assert_unreachable(resp)


def test_finish_errors_are_clear(store, upstream):
    upstream_url, _ = upstream
    with serve_in_thread(make_proxy_app(store, upstream_url)) as proxy:
        unknown = httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": "never-started"})
        malformed = httpx.post(f"{proxy}/trajstore/finish", json={"status": "completed"})
    assert unknown.status_code == 422 and "never-started" in unknown.json()["error"]["message"]
    assert malformed.status_code == 400 and malformed.json()["error"]["rule"] == "malformed_body"


# --- the token-in/token-out endpoint, only-new-route-rows, weight versions (issue 11) ---

@pytest.fixture
def upstream_app():
    app = make_upstream()
    with serve_in_thread(app) as url:
        yield url, app


def _tito(proxy_url, tid, token_ids, *, stream=False, headers=None, **params):
    body = {"model": "fake", "token_ids": token_ids, "sampling_params": {"max_tokens": 6, **params}}
    h = {**_headers(tid), **(headers or {})}
    if not stream:
        resp = httpx.post(f"{proxy_url}/inference/v1/generate", json=body, headers=h)
        assert resp.status_code == 200 and "x-trajstore-error" not in resp.headers, resp.headers.get("x-trajstore-error")
        return resp.json()["choices"][0]["token_ids"]
    acc = OpenAIStreamAccumulator()
    with httpx.stream("POST", f"{proxy_url}/inference/v1/generate", json={**body, "stream": True}, headers=h) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                acc.add(json.loads(line[5:]))
    return acc.response()["choices"][0]["token_ids"]


def _tito_conversation(proxy_url, tid, *, turns=3, stream=False):
    """A multi-turn token-in/token-out episode; returns its (prompt, output) calls."""
    prompt, calls = [SYSTEM, *encode("be brief"), END, USER, *encode("hi"), END, ASSISTANT], []
    for turn in range(turns):
        out = _tito(proxy_url, tid, prompt, stream=stream)
        calls.append((prompt, out))
        prompt = prompt + out + [USER, *encode(f"turn {turn + 2}"), END, ASSISTANT]
    return calls


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_tito_calls_are_recorded(store, upstream, stream):
    upstream_url, requests = upstream
    prompt = [3, 20, 21, 2, 5]
    with serve_in_thread(make_proxy_app(store, upstream_url)) as proxy:
        out = _tito(proxy, "g", prompt, stream=stream)
    sent = requests[-1]
    assert sent["sampling_params"]["logprobs"] == 0 and "trajstore" not in sent  # asked for the sampled logprobs
    assert "routed_experts_prompt_start" not in sent["sampling_params"]  # nothing recorded yet: all rows
    expected = tito_respond(sent)["choices"][0]
    (gen,) = store.load_generations("g")
    assert list(gen.prompt_ids) == prompt and list(gen.output_ids) == out == expected["token_ids"]
    np.testing.assert_allclose(gen.logprobs, [c["logprob"] for c in expected["logprobs"]["content"]], rtol=1e-6)
    np.testing.assert_array_equal(gen.routed_experts, route_rows(prompt + out, len(prompt)))  # routes on the final chunk too
    assert gen.finish_reason == "stop" and gen.model_version == 3 and gen.routed_experts_start == 0


def test_tito_response_bytes_come_back_unchanged(store, upstream):
    upstream_url, requests = upstream
    body = {"token_ids": [3, 20, 21], "sampling_params": {"max_tokens": 3}}
    with serve_in_thread(make_proxy_app(store, upstream_url)) as proxy:
        resp = httpx.post(f"{proxy}/inference/v1/generate", json=body, headers=_headers("b"))
        bad = httpx.post(f"{proxy}/inference/v1/generate", json={**body, "sampling_params": {"n": 2}}, headers=_headers("b"))
    assert resp.status_code == 200 and resp.headers["x-trajstore-seq"] == "0"
    assert resp.json() == json.loads(json.dumps(tito_respond(requests[0])))
    assert bad.status_code == 400 and bad.json()["error"]["rule"] == "n" and len(requests) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_proxy_asks_only_for_new_route_rows(store, upstream, stream):
    upstream_url, requests = upstream
    with serve_in_thread(make_proxy_app(store, upstream_url)) as proxy:
        skipped = _tito_conversation(proxy, "skip", stream=stream)
        asked = [r["sampling_params"].get("routed_experts_prompt_start") for r in requests]
        del requests[:]
    with serve_in_thread(make_proxy_app(store, upstream_url, skip_recorded_routes=False)) as proxy:
        full = _tito_conversation(proxy, "full", stream=stream)
        assert all("routed_experts_prompt_start" not in r["sampling_params"] for r in requests)
    assert skipped == full
    # the upstream was asked for rows past the recorded length: prompt + output of the last call - 1
    (p1, o1), (p2, o2), _ = skipped
    assert asked == [None, len(p1 + o1) - 1, len(p2 + o2) - 1]
    gens = store.load_generations("skip")
    assert [g.routed_experts_start for g in gens] == [0, len(p1 + o1) - 1, len(p2 + o2) - 1]
    assert [len(g.routed_experts) for g in gens] == [len(p + o) - 1 - s for (p, o), s in zip(skipped, [0] + asked[1:])]
    # rows the engine sent (it honours the start): each position's row crossed the wire once,
    # O(new tokens) per call instead of O(sequence)
    p3, o3 = skipped[-1]
    assert sum(len(p + o) - 1 - (s or 0) for (p, o), s in zip(skipped, asked)) == len(p3 + o3) - 1
    # with every row sent the store keeps the same rows (it drops the recorded ones); only the wire differs
    for g_full, g_skip in zip(store.load_generations("full"), gens):
        assert g_full.routed_experts_start == g_skip.routed_experts_start
        np.testing.assert_array_equal(g_full.routed_experts, g_skip.routed_experts)
    for tid in ("skip", "full"):
        store.append([{"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}])
    store.materialize()
    samples = {s.trajectory_id: s for s in store.samples()}
    assert len(samples) == 2
    a, b = samples["skip"], samples["full"]
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "token_model_versions",
                 "routed_experts", "routed_experts_mask"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    routes, mask = _expected_routes(skipped)
    np.testing.assert_array_equal(a.routed_experts, routes)
    np.testing.assert_array_equal(a.routed_experts_mask, mask)


def test_route_start_is_left_alone_when_the_prompt_does_not_continue_or_the_caller_set_it(store, upstream):
    upstream_url, requests = upstream
    with serve_in_thread(make_proxy_app(store, upstream_url)) as proxy:
        out = _tito(proxy, "m", [3, 20, 21, 2, 5])
        out2 = _tito(proxy, "m", [3, 99, 2, 5])  # a new sample: the recorded rows are not this prompt's
        _tito(proxy, "m", [3, 99, 2, 5] + out2 + [6], routed_experts_prompt_start=0)  # continues, but the caller said 0
        resp = httpx.post(f"{proxy}/v1/completions", headers=_headers("c"),
                          json={"prompt": [10, 20, 30], "max_tokens": 3})
        cont = resp.json()["choices"][0]["token_ids"]
        resp2 = httpx.post(f"{proxy}/v1/completions", headers=_headers("c"),
                           json={"prompt": [10, 20, 30] + cont + [40], "max_tokens": 3})
    assert out and [r["sampling_params"].get("routed_experts_prompt_start") for r in requests[:3]] == [None, None, 0]
    # /v1/completions with a token-id prompt that continues: top-level field, recorded rows skipped
    assert requests[4]["routed_experts_prompt_start"] == 3 + len(cont) - 1
    assert resp2.status_code == 200 and "x-trajstore-error" not in resp2.headers
    assert store.load_generations("c")[1].routed_experts_start == 3 + len(cont) - 1


def test_weight_versions_reach_the_record(store, upstream_app):
    url, app = upstream_app
    app.state.weight_update = (2, "3", "4")  # tokens 0-1 sampled by weights "3", the rest by "4"
    with serve_in_thread(make_proxy_app(store, url)) as proxy:
        _tito(proxy, "w", [3, 20, 21, 2, 5], headers={"X-Trajstore-Model-Version": "0"})
        app.state.weight_update = (2, "ckpt-a", "ckpt-b")
        held = httpx.post(f"{proxy}/inference/v1/generate", headers=_headers("w"),
                          json={"token_ids": [3, 20, 2, 5], "sampling_params": {"max_tokens": 4}})
        assert httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": "w"}).status_code == 200
    assert held.status_code == 200 and held.headers["x-trajstore-seq"] == "1"  # recorded as sent, not refused
    first, second = store.load_generations("w")
    assert first.model_version == 4 and list(first.token_model_versions[:2]) == [3, 3]
    assert second.weight_versions == (("ckpt-a", 0, 2), ("ckpt-b", 2, 4))
    assert store.materialize().num_samples_after == 0  # held back until its labels are mapped
    # --version-map fills the store's label map when the proxy starts: the trajectory folds
    with serve_in_thread(make_proxy_app(store, url, version_map={"ckpt-a": 5, "ckpt-b": 6})):
        pass
    store.materialize()
    samples = sorted(store.samples(), key=lambda s: s.sample_index)
    assert list(samples[1].token_model_versions) == [5, 5, 6, 6]


def test_weight_versions_end_to_end_versions(store, upstream_app):
    """Needs the capture branch: per-token versions, stop_reason metadata and the finish reason reach the sample."""
    url, app = upstream_app
    app.state.weight_update = (2, "3", "4")
    with serve_in_thread(make_proxy_app(store, url)) as proxy:
        out = _tito(proxy, "w", [3, 20, 21, 2, 5], stop_token_ids=[END])
        assert httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": "w"}).status_code == 200
    (gen,) = store.load_generations("w")
    assert list(gen.token_model_versions) == [3, 3] + [4] * (len(out) - 2)
    assert dict(gen.metadata) == {"stop_reason": END}
    store.materialize()
    (sample,) = list(store.samples())
    assert list(sample.token_model_versions) == [3, 3] + [4] * (len(out) - 2)
    assert sample.finish_reason == "stop" and (sample.min_model_version, sample.max_model_version) == (3, 4)


# --- auth (issue 9.10): the proxy changes the store only with the ingest token ---

TOKEN = "s3cret-token"


def test_unauthenticated_calls_are_refused_and_store_nothing(store, upstream):
    upstream_url, requests = upstream
    store.append([{"type": "trajectory_started", "trajectory_id": "victim"}])
    before = store.info()
    calls = [
        ("POST", "/trajstore/finish", {"trajectory_id": "victim", "status": "failed", "reward": -100}),
        ("POST", "/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "x"}]}),
        ("POST", "/v1/completions", {"prompt": "x"}),
        ("POST", "/inference/v1/generate", {"token_ids": [3, 4], "sampling_params": {}}),
        ("GET", "/v1/models", None),
    ]
    with serve_in_thread(make_proxy_app(store, upstream_url, token=TOKEN)) as proxy:
        for auth in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            for method, path, body in calls:
                resp = httpx.request(method, f"{proxy}{path}", json=body, headers={**_headers("victim"), **auth})
                assert resp.status_code == 401, (path, auth, resp.status_code)
                assert resp.json()["error"]["rule"] == "unauthorized" and resp.headers["www-authenticate"] == "Bearer"
        for path in ("/healthz", "/openapi.json", "/docs"):  # open: they change nothing and show no data
            assert httpx.get(f"{proxy}{path}").status_code == 200, path
    assert requests == []  # nothing reached the engine either
    assert store.info() == before
    state = store.trajectory_state("victim")
    assert state.status == "running" and state.reward is None and state.last_seq == -1


def test_authenticated_calls_work_and_the_token_stays_with_the_proxy(store, upstream_app):
    url, app = upstream_app
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with serve_in_thread(make_proxy_app(store, url, token=TOKEN)) as proxy:
        _tito(proxy, "ok", [3, 20, 2, 5], headers=auth)
        done = httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": "ok", "reward": 1.0}, headers=auth)
    with serve_in_thread(make_proxy_app(store, url, token=TOKEN, upstream_api_key="engine-key")) as proxy:
        models = httpx.get(f"{proxy}/v1/models", headers=auth)
    assert done.status_code == 200 and models.status_code == 200
    assert store.trajectory_state("ok").status == "completed"
    first, second = app.state.headers
    assert "authorization" not in first  # the store's credential is not passed on to the engine
    assert second["authorization"] == "Bearer engine-key"


def test_serve_proxy_refuses_to_start_without_a_token(monkeypatch):
    from trajstore.ingest.proxy import serve_proxy

    monkeypatch.delenv("TRAJSTORE_TOKEN", raising=False)
    with pytest.raises(ValueError, match="no token"):
        serve_proxy("http://127.0.0.1:9", "sqlite:///unused.db")


def test_trajstore_proxy_process_takes_its_token_from_the_environment(tmp_path, upstream):
    """`trajstore proxy` as deployed: a real process, the token from $TRAJSTORE_TOKEN."""
    import trajstore

    upstream_url, requests = upstream
    url = f"sqlite:///{tmp_path / 'p.db'}"
    with proxy_process("--store", url, "proxy", "--upstream", upstream_url, env={"TRAJSTORE_TOKEN": TOKEN}) as proxy:
        body = {"token_ids": [3, 20, 2, 5], "sampling_params": {"max_tokens": 3}}
        anonymous = httpx.post(f"{proxy}/inference/v1/generate", json=body, headers=_headers("p"))
        finish = httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": "p", "status": "failed", "reward": -100})
        auth = {"Authorization": f"Bearer {TOKEN}"}
        recorded = httpx.post(f"{proxy}/inference/v1/generate", json=body, headers={**_headers("p"), **auth})
    assert anonymous.status_code == 401 and finish.status_code == 401 and len(requests) == 1
    assert recorded.status_code == 200 and recorded.headers["x-trajstore-seq"] == "0"
    store = trajstore.connect(url)  # the payload location is the one the store recorded
    try:
        state = store.trajectory_state("p")
        assert state.status == "running" and state.reward is None and state.last_seq == 0
    finally:
        store.close()
