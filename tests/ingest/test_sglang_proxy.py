"""The recording proxy in front of an SGLang-shaped HTTP server, over real loopback HTTP.

The key property: an SGLang rollout and a vLLM rollout of the same tokens
(each through its own proxy, in front of an upstream answering in that
engine's shapes) give the same samples, on both store backends.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

import openai_upstream  # noqa: E402
import sglang_upstream  # noqa: E402
from openai_upstream import (  # noqa: E402
    ASSISTANT, END, NUM_LAYERS, SYSTEM, TOPK, USER, encode, render_chat, route_rows, serve_in_thread, tito_respond,
)
from helpers import proxy_process  # noqa: E402
from proxy_faults import engine_answering  # noqa: E402
from raw_upstream import sse  # noqa: E402
from test_proxy import _expected_routes  # noqa: E402
from trajstore.ingest.proxy._sglang import make_sglang_proxy_app  # noqa: E402
from trajstore.ingest.proxy import make_proxy_app  # noqa: E402
from trajstore.ingest.sglang import GenerateStreamAccumulator, OpenAIStreamAccumulator  # noqa: E402
from trajstore.ingest.vllm import OpenAIStreamAccumulator as VLLMStreamAccumulator  # noqa: E402

LAYOUT = f"{NUM_LAYERS}x{TOPK}"
SAMPLE_FIELDS = ("group_id", "sample_index", "is_last_step", "status", "prompt_ids", "response_ids", "loss_mask",
                 "rollout_logprobs", "logprobs_mask", "token_model_versions", "finish_reason", "reward",
                 "token_rewards", "routed_experts", "routed_experts_mask", "min_model_version", "max_model_version")


@pytest.fixture
def sglang():
    app = sglang_upstream.make_upstream()
    with serve_in_thread(app) as url:
        yield url, app


@pytest.fixture
def vllm():
    app = openai_upstream.make_upstream()
    with serve_in_thread(app) as url:
        yield url, app


def _headers(tid, version=3, **extra):
    return {"X-Trajstore-Trajectory": tid, "X-Trajstore-Model-Version": str(version), "X-Trajstore-Num-Experts": "16",
            **extra}


def _sse(url, body, headers, acc):
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=headers) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                acc.add(json.loads(line[5:]))
    return acc.response()


def _sglang_generate(proxy, tid, prompt, *, stream=False, headers=None, **extra):
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6, "stop_token_ids": [END]}, **extra}
    h = _headers(tid, **(headers or {}))
    if stream:
        return _sse(f"{proxy}/generate", body, h, GenerateStreamAccumulator())["output_ids"]
    resp = httpx.post(f"{proxy}/generate", json=body, headers=h)
    assert resp.status_code == 200 and "x-trajstore-error" not in resp.headers, resp.headers.get("x-trajstore-error")
    return resp.json()["output_ids"]


def _vllm_generate(proxy, tid, prompt, *, stream=False):
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 6, "stop_token_ids": [END]}}
    if stream:
        return _sse(f"{proxy}/inference/v1/generate", body, _headers(tid), VLLMStreamAccumulator())["choices"][0][
            "token_ids"]
    resp = httpx.post(f"{proxy}/inference/v1/generate", json=body, headers=_headers(tid))
    assert resp.status_code == 200 and "x-trajstore-error" not in resp.headers, resp.headers.get("x-trajstore-error")
    return resp.json()["choices"][0]["token_ids"]


def _episode(call, proxy, tid, apps, *, stream):
    """Three turns; the weights change in the middle of turn 2 ("3" -> "4") and turn 3 runs on "4"."""
    prompt, calls = [SYSTEM, *encode("be brief"), END, USER, *encode("hi"), END, ASSISTANT], []
    for turn, update in enumerate([None, (2, "3", "4"), (0, "4", "4")]):
        for app in apps:
            app.state.weight_update = update
        out = call(proxy, tid, prompt, stream=stream)
        calls.append((prompt, out))
        prompt = prompt + out + [USER, *encode(f"turn {turn + 2}"), END, ASSISTANT]
    done = httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": tid, "reward": 1.0})
    assert done.status_code == 200
    return calls


def _samples(store):
    store.materialize()
    return {s.trajectory_id: s for s in store.samples()}


def _assert_same_samples(a, b):
    for name in SAMPLE_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x.dtype == y.dtype, name
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            assert x == y, name


@pytest.mark.parametrize("mode", ["json", "sse", "sse-incremental"])
def test_an_sglang_rollout_and_a_vllm_rollout_of_the_same_tokens_give_the_same_sample(store, sglang, vllm, mode):
    (s_url, s_app), (v_url, v_app) = sglang, vllm
    s_app.state.incremental = mode == "sse-incremental"
    stream = mode != "json"
    with serve_in_thread(make_sglang_proxy_app(store, s_url, route_layout=LAYOUT)) as proxy:
        s_calls = _episode(_sglang_generate, proxy, "sglang", [s_app], stream=stream)
    with serve_in_thread(make_proxy_app(store, v_url)) as proxy:
        v_calls = _episode(_vllm_generate, proxy, "vllm", [v_app], stream=stream)
    assert s_calls == v_calls
    # only the new route rows crossed the wire, on both engines
    asked = [r.get("routed_experts_start_len") for r in s_app.state.requests]
    assert asked == [r["sampling_params"].get("routed_experts_prompt_start") for r in v_app.state.requests]
    (p1, o1), (p2, o2), _ = s_calls
    assert asked == [None, len(p1 + o1) - 1, len(p2 + o2) - 1]
    assert [g.routed_experts_start for g in store.load_generations("sglang")] == [0, *asked[1:]]
    samples = _samples(store)
    s, v = samples["sglang"], samples["vllm"]
    _assert_same_samples(s, v)
    # and what they hold is right: one merged sample, versions from the spans, routes recorded once
    n1, n2, n3 = (len(o) for _, o in s_calls)
    obs2, obs3 = len(p2) - len(p1 + o1), len(s_calls[2][0]) - len(p2 + o2)
    assert list(s.token_model_versions) == [3] * n1 + [-1] * obs2 + [3, 3] + [4] * (n2 - 2) + [-1] * obs3 + [4] * n3
    assert (s.min_model_version, s.max_model_version) == (3, 4)
    assert s.finish_reason == "stop" and s.reward == 1.0 and s.is_last_step and bool(s.logprobs_mask[0])
    expected, _ = _expected_routes(s_calls)
    np.testing.assert_array_equal(s.routed_experts, expected)


def test_chat_through_both_proxies_gives_the_same_sample(store, sglang, vllm):
    (s_url, s_app), (v_url, v_app) = sglang, vllm
    for app in (s_app, v_app):
        app.state.weight_update = (1, "3", "4")
    results = {}
    for name, proxy_app in (("sglang", make_sglang_proxy_app(store, s_url, route_layout=LAYOUT)),
                            ("vllm", make_proxy_app(store, v_url))):
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        with serve_in_thread(proxy_app) as proxy:
            for turn in range(2):
                resp = httpx.post(f"{proxy}/v1/chat/completions", json={"model": "fake", "messages": messages},
                                  headers=_headers(name))
                assert resp.status_code == 200 and "x-trajstore-error" not in resp.headers, \
                    resp.headers.get("x-trajstore-error")
                messages = messages + [resp.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
            assert httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": name}).status_code == 200
        results[name] = messages
    sent = s_app.state.requests[0]
    assert sent["return_input_ids_in_sglext"] and sent["return_output_ids_in_sglext"] and sent["logprobs"] is True
    assert sent["return_routed_experts"] is True and "return_token_ids" not in sent
    samples = _samples(store)
    _assert_same_samples(samples["sglang"], samples["vllm"])
    assert samples["sglang"].max_model_version == 4 and samples["sglang"].routed_experts is not None


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_openai_streams_are_recorded_with_routes_and_the_declared_version(store, sglang, chat):
    url, app = sglang
    app.state.weight_update = (2, "7", "8")  # SGLang streams no metadata: the spans never reach the proxy
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "fake", **({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})}
    with serve_in_thread(make_sglang_proxy_app(store, url, route_layout=LAYOUT)) as proxy:
        got = _sse(f"{proxy}{path}", body, _headers("s", version=5), OpenAIStreamAccumulator())
    assert got["sglext"]["routed_experts"]  # the client saw SGLang's own last chunk
    (gen,) = store.load_generations("s")
    prompt = render_chat(body["messages"]) if chat else encode("hi")
    assert list(gen.prompt_ids) == prompt and len(gen.output_ids) == 6
    np.testing.assert_array_equal(gen.routed_experts, route_rows(prompt + list(gen.output_ids), len(prompt)))
    assert gen.model_version == 5 and (gen.token_model_versions is None or set(gen.token_model_versions) == {5})
    assert gen.finish_reason == ("stop" if chat else "length") and gen.logprobs is not None


def test_recording_params_and_unchanged_bytes(store, sglang):
    url, app = sglang
    body = {"input_ids": [3, 20, 21, 2, 5], "sampling_params": {"max_new_tokens": 4},
            "trajstore": {"trajectory_id": "b", "model_version": 2, "route_layout": LAYOUT}}
    with serve_in_thread(make_sglang_proxy_app(store, url)) as proxy:
        resp = httpx.post(f"{proxy}/generate", json=body)
        unnamed = httpx.post(f"{proxy}/generate", json={"text": "x"})
        models = httpx.get(f"{proxy}/v1/models")
    sent = app.state.requests[0]
    assert "trajstore" not in sent and sent["return_logprob"] is True and sent["return_routed_experts"] is True
    assert resp.status_code == 200 and resp.headers["x-trajstore-seq"] == "0"
    assert resp.json() == json.loads(json.dumps(sglang_upstream.native_response(sent, _plain_state())))
    assert app.state.requests[1] == {"text": "x"} and "x-trajstore-seq" not in unnamed.headers
    assert models.json()["data"][0]["id"] == "fake"
    (gen,) = store.load_generations("b")
    assert gen.model_version == 2 and gen.routed_experts.shape == (5 + 4 - 1, NUM_LAYERS, TOPK)


def _plain_state():
    from types import SimpleNamespace

    return SimpleNamespace(weight_update=None, missing_logprob=None, incremental=False)


def test_the_route_layout_is_never_guessed(store, sglang):
    url, app = sglang
    prompt = [3, 20, 21, 2, 5]
    with serve_in_thread(make_sglang_proxy_app(store, url, pass_through_unrecorded=True)) as proxy:  # no --route-layout
        asked = httpx.post(f"{proxy}/generate", headers=_headers("a"),
                           json={"input_ids": prompt, "return_routed_experts": True})
        plain = httpx.post(f"{proxy}/generate", headers=_headers("a"), json={"input_ids": prompt})
        wrong = httpx.post(f"{proxy}/generate", headers=_headers("w", **{"X-Trajstore-Route-Layout": "3x2"}),
                           json={"input_ids": prompt})
        bad = httpx.post(f"{proxy}/generate", headers=_headers("w", **{"X-Trajstore-Route-Layout": "two"}),
                         json={"input_ids": prompt})
    # asking for routes without a layout is refused before the engine sees it
    assert asked.status_code == 400 and asked.json()["error"]["rule"] == "route_layout"
    assert bad.status_code == 400 and "LAYERSxTOPK" in bad.json()["error"]["message"]
    assert len(app.state.requests) == 2 and "return_routed_experts" not in app.state.requests[0]
    assert plain.status_code == 200 and store.load_generations("a")[0].routed_experts is None
    # a layout that does not fit: the engine's answer comes back, nothing is stored, the reason is one line
    assert wrong.status_code == 200 and "does not fit" in wrong.headers["x-trajstore-error"]
    assert store.trajectory_state("w") is None


def test_recorded_calls_must_be_one_prompt_and_one_choice(store, sglang):
    url, app = sglang
    with serve_in_thread(make_sglang_proxy_app(store, url, route_layout=LAYOUT)) as proxy:
        calls = [("/generate", {"input_ids": [[3, 4], [5, 6]]}), ("/generate", {"text": ["a", "b"]}),
                 ("/generate", {"input_ids": [3, 4], "sampling_params": {"n": 2}}),
                 ("/v1/completions", {"prompt": "x", "n": 2})]
        for path, body in calls:
            resp = httpx.post(f"{proxy}{path}", json=body, headers=_headers("n"))
            assert resp.status_code == 400 and resp.json()["error"]["rule"] == "n", (path, body)
    assert app.state.requests == []


def test_a_missing_logprob_is_stored_as_vllm_stores_its_floor(store, sglang):
    from trajstore.ingest.sglang import generation_from_generate, request_params_for_generate
    from trajstore.ingest.vllm import LOGPROB_FLOOR, generations_from_tito

    prompt = [3, 20, 21, 2, 5]
    body = request_params_for_generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 6,
                                                                                 "stop_token_ids": [END]}},
                                       routes=True)
    state = _plain_state()
    state.missing_logprob = 1
    s_event = generation_from_generate(sglang_upstream.native_response(body, state), body, trajectory_id="s", seq=0,
                                       model_version=3, route_layout=LAYOUT)
    v_body = {"token_ids": prompt, "sampling_params": {"max_tokens": 6, "logprobs": 0}}
    v_resp = tito_respond(v_body)
    v_resp["choices"][0]["logprobs"]["content"][1]["logprob"] = LOGPROB_FLOOR  # what vLLM writes for "none"
    (v_event,) = generations_from_tito(v_resp, v_body, trajectory_id="v", seq=0, model_version=3)
    for event in (s_event, v_event):
        tid = event["trajectory_id"]
        store.append([{"type": "trajectory_started", "trajectory_id": tid}, event,
                      {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}])
    samples = _samples(store)
    _assert_same_samples(samples["s"], samples["v"])
    assert not samples["s"].logprobs_mask[1] and samples["s"].rollout_logprobs[1] == 0.0


def test_cli_flags_are_checked(tmp_path, sglang):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRAJSTORE_TOKEN": "tok",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    base = [sys.executable, "-m", "trajstore.cli", "--store", f"sqlite:///{tmp_path / 'p.db'}", "proxy",
            "--upstream", sglang[0]]
    for extra, message in ((["--engine", "sglang", "--route-layout", "2"], "LAYERSxTOPK"),
                           (["--engine", "sglang", "--version-map", '{"a": "b"}'], "--version-map"),
                           (["--route-layout", "2x2"], "--engine sglang")):
        bad = subprocess.run(base + extra, env=env, cwd=repo, capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and message in bad.stderr and bad.stderr.strip().splitlines()[-1].startswith(
            "error: "), bad.stderr


def test_cli_runs_the_sglang_proxy(tmp_path, sglang):
    """`trajstore proxy --engine sglang` as deployed: a real process, the token from $TRAJSTORE_TOKEN."""
    import trajstore

    url_up, app = sglang
    url = f"sqlite:///{tmp_path / 'p.db'}"
    app.state.weight_update = (0, "step-5", "step-5")  # the engine runs weights the operator named
    with proxy_process("--store", url, "proxy", "--upstream", url_up, "--engine", "sglang", "--route-layout", LAYOUT,
                       "--version-map", '{"step-5": 5}', env={"TRAJSTORE_TOKEN": "tok"}) as proxy:
        body = {"input_ids": [3, 20, 2, 5], "sampling_params": {"max_new_tokens": 3}}
        anonymous = httpx.post(f"{proxy}/generate", json=body, headers=_headers("p"))
        recorded = httpx.post(f"{proxy}/generate", json=body, headers={**_headers("p"), "Authorization": "Bearer tok"})
        finished = httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": "p"},
                              headers={"Authorization": "Bearer tok"})
    assert anonymous.status_code == 401 and len(app.state.requests) == 1
    assert recorded.status_code == 200 and recorded.headers["x-trajstore-seq"] == "0"
    store = trajstore.connect(url)  # the payload the proxy's store recorded
    try:
        (gen,) = store.load_generations("p")
        assert gen.routed_experts.shape == (4 + 3 - 1, NUM_LAYERS, TOPK) and finished.status_code == 200
        store.materialize()
        (sample,) = list(store.samples())
        assert list(sample.token_model_versions) == [5, 5, 5]  # "step-5" resolved by the proxy's --version-map
    finally:
        store.close()


ODD_ANSWERS = [b'{"output_ids": "abc", "meta_info": {}}', b"[1, 2]", b'{"meta_info": []}', b"not json",
               b'{"output_ids": [1], "meta_info": {"output_token_logprobs": [5]}}',
               b'{"output_ids": [1], "meta_info": {"finish_reason": 3}}', b'{"choices": [5]}',
               b'{"choices": [{"token_ids": [1], "prompt_token_ids": [2], "logprobs": {"content": [1]}}]}']
ODD_STREAMS = [b'data: {"meta_info": 5}\n\ndata: [DONE]\n\n', b"data: [1, [2]]\n\ndata: [DONE]\n\n",
               b'data: {"choices": [{"logprobs": {"content": [3]}}]}\n\n', b"data: {nope\n\n"]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_odd_upstream_answers_reach_the_caller_and_store_nothing(store, path):
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse

    odd = FastAPI()
    odd.state.reply = b""

    async def answer(request):
        if (await request.json()).get("stream"):
            return StreamingResponse(iter([odd.state.reply]), media_type="text/event-stream")
        return Response(odd.state.reply, media_type="application/json")

    answer.__annotations__ = {"request": Request}  # this module's annotations are strings
    odd.add_api_route(path, answer, methods=["POST"])

    body = {"input_ids": [3, 4], "prompt": [3, 4]}
    with serve_in_thread(odd) as url, \
            serve_in_thread(make_sglang_proxy_app(store, url, route_layout=LAYOUT, pass_through_unrecorded=True)) as proxy:
        for reply in ODD_ANSWERS:
            odd.state.reply = reply
            resp = httpx.post(f"{proxy}{path}", json=body, headers=_headers("odd"))
            assert resp.status_code == 200 and resp.content == reply, reply
            assert "x-trajstore-error" in resp.headers and "\n" not in resp.headers["x-trajstore-error"], reply
        for reply in ODD_STREAMS:
            odd.state.reply = reply
            with httpx.stream("POST", f"{proxy}{path}", json={**body, "stream": True}, headers=_headers("odd")) as r:
                got = r.read()
            # the caller gets every byte, then why nothing was recorded: an SSE comment when the stream
            # ended ([DONE]) but cannot be read, else (no [DONE], or no final chunk) an error event
            assert r.status_code == 200 and got.startswith(reply), reply
            tail = got[len(reply):]
            if tail.startswith(b": X-Trajstore-Error: "):
                assert b"[DONE]" in reply and tail.count(b"\n") == 2, tail
            else:
                assert b'"UpstreamStreamCut"' in tail and b"call not recorded" in tail, tail
    assert store.trajectory_state("odd") is None


def test_a_stream_the_upstream_cuts_is_not_recorded_and_the_caller_is_told(store):
    """SGLang dies mid-stream: the caller gets the chunks that came and an error event; nothing is stored."""
    body = {"input_ids": [3, 20, 21, 2, 5], "sampling_params": {"max_new_tokens": 6}, "stream": True}
    from trajstore.ingest.sglang import request_params_for_generate

    # what the engine streams for the body the proxy forwards
    chunks = list(sglang_upstream.native_stream(request_params_for_generate(body, routes=True), _plain_state()))
    sent = [c for c in chunks if len(c["output_ids"]) <= 2]  # the engine dies after its second chunk
    assert len(sent) == 2 < len(chunks)
    with engine_answering(sse(sent), framing="chunked-cut") as up, \
            serve_in_thread(make_sglang_proxy_app(store, up.url, route_layout=LAYOUT)) as proxy:
        with httpx.stream("POST", f"{proxy}/generate", json=body, headers=_headers("cut")) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data:")]
    assert len(lines) == 3 and json.loads(lines[1][5:])["output_ids"] == [  # two chunks, then the error
        *json.loads(lines[0][5:])["output_ids"], json.loads(lines[1][5:])["output_ids"][-1]]
    assert json.loads(lines[2][5:])["error"]["type"] == "UpstreamStreamCut"
    assert store.trajectory_state("cut") is None


def test_a_recorded_stream_ends_with_its_seq(store, sglang):
    url, _ = sglang
    body = {"input_ids": [3, 20, 21, 2, 5], "sampling_params": {"max_new_tokens": 3}, "stream": True}
    with serve_in_thread(make_sglang_proxy_app(store, url, route_layout=LAYOUT)) as proxy:
        for expected in ("0", "1"):
            with httpx.stream("POST", f"{proxy}/generate", json=body, headers=_headers("seq")) as r:
                lines = list(r.iter_lines())
            assert lines.index(": X-Trajstore-Seq: " + expected) > lines.index("data: [DONE]"), lines[-4:]
    assert len(store.load_generations("seq")) == 2


def test_sglang_labels_resolve_in_the_store(store):
    """SGLang's own labels: a zero-length first span (a swap before the first token), "default", and a
    label the store does not know yet: the trajectory waits until a version_label maps it."""
    from trajstore.ingest.sglang import generation_from_generate, request_params_for_generate

    prompt = [SYSTEM, *encode("hi"), END, ASSISTANT]
    events, calls = [], []
    for seq, update in enumerate([(0, "3", "4"), None, (2, "4", "step-5")]):
        body = request_params_for_generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 6,
                                                                                     "stop_token_ids": [END]}},
                                           routes=True)
        state = _plain_state()
        state.weight_update = update
        event = generation_from_generate(sglang_upstream.native_response(body, state), body, trajectory_id="L",
                                         seq=seq, model_version=4, route_layout=LAYOUT)
        events.append(event)
        calls.append((prompt, list(event["output_ids"])))
        prompt = prompt + calls[-1][1] + [USER, *encode("go"), END, ASSISTANT]
    assert events[0]["weight_versions"][0] == {"version": "3", "start": 0, "end": 0}
    assert events[1]["weight_versions"] == [{"version": "default", "start": 0, "end": len(calls[1][1])}]
    store.append([{"type": "trajectory_started", "trajectory_id": "L"}, *events,
                  {"type": "trajectory_finished", "trajectory_id": "L", "status": "completed"}])
    assert _samples(store) == {}  # "step-5" is not mapped yet: held back, not dropped
    store.append([{"type": "version_label", "label": "step-5", "model_version": 5}])
    (sample,) = _samples(store).values()
    (p1, o1), (p2, o2), (p3, o3) = calls
    obs = lambda p, prev: [-1] * (len(p) - len(prev))  # noqa: E731
    assert list(sample.token_model_versions) == ([4] * len(o1) + obs(p2, p1 + o1) + [4] * len(o2) + obs(p3, p2 + o2)
                                                 + [4, 4] + [5] * (len(o3) - 2))
    assert (sample.min_model_version, sample.max_model_version) == (4, 5)
