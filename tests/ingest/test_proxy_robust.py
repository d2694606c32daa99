"""The recording proxy against an upstream that sends odd bytes, cuts streams,
or is named the OpenAI-client way; the RL endpoints it forwards; the
abort-and-resume pattern through it. The upstream is a real loopback server
writing raw HTTP (tests/raw_upstream.py); both store backends."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from openai_upstream import make_upstream, respond, serve_in_thread, stream_chunks, tito_respond  # noqa: E402
from proxy_faults import ENGINE_DOWN, assert_unreachable, engine_answering  # noqa: E402
from raw_upstream import RawUpstream, framed, sse, sse_event  # noqa: E402
from trajstore.ingest.proxy import FORWARDED, make_proxy_app  # noqa: E402
from trajstore.ingest.proxy._app import normalize_upstream  # noqa: E402
from trajstore.ingest.vllm import request_params_for_recording  # noqa: E402

H = {"X-Trajstore-Trajectory": "t", "X-Trajstore-Model-Version": "3"}


def _nothing_recorded(store, tid: str = "t") -> bool:
    return store.trajectory_state(tid) is None


def _completion(**choice) -> dict:
    body = request_params_for_recording({"prompt": [10, 20, 30], "max_tokens": 3}, chat=False)
    resp = respond(body, chat=False)
    resp["choices"][0].update(choice)
    return resp


ODD_ANSWERS = {
    "top-level list": json.dumps([{"choices": []}]).encode(),
    "choices of strings": json.dumps({"choices": ["x"]}).encode(),
    "logprobs.content of integers": json.dumps(_completion(logprobs={"content": [1, 2, 3]})).encode(),
    "token_ids an object": json.dumps(_completion(token_ids={"a": 1})).encode(),
    "token_ids floats": json.dumps(_completion(token_ids=[1.5, 2.5, 3.5])).encode(),
    "token_ids nested": json.dumps(_completion(token_ids=[[1], [2], [3]])).encode(),
    "prompt ids strings": json.dumps(_completion(prompt_token_ids=["a", "b"])).encode(),
    "logprob strings": json.dumps(_completion(logprobs={"token_logprobs": ["-1", "-2", "-3"], "tokens": None})).encode(),
    "finish_reason an object": json.dumps(_completion(finish_reason={"why": 1})).encode(),
    "index a string": json.dumps(_completion(index="0")).encode(),
    "routes garbage": json.dumps(_completion(routed_experts="not base64 npy")).encode(),
    "spans garbage": json.dumps(_completion(weight_versions=[{"version": "1", "start": "0", "end": 3}])).encode(),
    "not JSON": b"<html>gateway says hi</html>",
    "invalid UTF-8": b'{"choices": "\xff\xfe"}',
    "huge integer": b'{"choices": [{"token_ids": [1e400, 99999999999999999999999999], "prompt_token_ids": [1]}]}',
    "null": b"null",
}


@pytest.mark.parametrize("name", list(ODD_ANSWERS))
def test_odd_upstream_json_reaches_the_harness_unchanged_and_records_nothing(store, name):
    answer = ODD_ANSWERS[name]
    with RawUpstream(lambda m, p, b: framed([answer])) as up, \
            serve_in_thread(make_proxy_app(store, up.url, pass_through_unrecorded=True)) as proxy:
        resp = httpx.post(f"{proxy}/v1/completions", json={"prompt": [10, 20, 30]}, headers=H)
    assert resp.status_code == 200 and resp.content == answer
    error = resp.headers["x-trajstore-error"]
    assert error and "\n" not in error and "x-trajstore-seq" not in resp.headers
    assert _nothing_recorded(store)


def test_the_same_answer_well_formed_is_recorded(store):
    answer = json.dumps(_completion()).encode()
    with RawUpstream(lambda m, p, b: framed([answer])) as up, serve_in_thread(make_proxy_app(store, up.url)) as proxy:
        resp = httpx.post(f"{proxy}/v1/completions", json={"prompt": [10, 20, 30]}, headers=H)
    assert resp.content == answer and resp.headers["x-trajstore-seq"] == "0"
    (gen,) = store.load_generations("t")
    assert list(gen.output_ids) == json.loads(answer)["choices"][0]["token_ids"]


def _stream_pieces(chat: bool = False) -> list[bytes]:
    body = request_params_for_recording({"prompt": "hi", "max_tokens": 3, "stream": True}, chat=chat)
    return sse(list(stream_chunks(body, chat=False)), done=True)


def _stream(proxy: str, path: str = "/v1/completions", body: dict | None = None) -> tuple[int, bytes]:
    with httpx.stream("POST", f"{proxy}{path}", json=body or {"prompt": "hi", "max_tokens": 3, "stream": True},
                      headers=H) as resp:
        return resp.status_code, resp.read()


def _events_of(raw: bytes) -> tuple[list, list[str]]:
    """(data objects, comment lines) of an SSE body."""
    data, comments = [], []
    for line in raw.split(b"\n"):
        if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
            data.append(json.loads(line[5:]))
        elif line.startswith(b":"):
            comments.append(line[1:].decode().strip())
    return data, comments


@pytest.mark.parametrize("framing", ["close", "chunked-cut"])
def test_a_stream_cut_after_two_of_three_chunks_records_nothing_and_says_so(store, framing):
    pieces = _stream_pieces()
    assert len(pieces) == 4  # three tokens, [DONE]
    cut = pieces[:2]
    with engine_answering(cut, framing=framing) as up, \
            serve_in_thread(make_proxy_app(store, up.url)) as proxy:
        status, raw = _stream(proxy)
    assert status == 200 and raw.startswith(b"".join(cut))  # the harness got every byte the upstream sent
    data, _ = _events_of(raw)
    assert "not recorded" in data[-1]["error"]["message"] and data[-1]["error"]["code"] == 502
    assert _nothing_recorded(store)


@pytest.mark.parametrize("framing", ["close", "chunked", "length"])
def test_a_whole_stream_is_recorded_whatever_its_framing(store, framing):
    pieces = _stream_pieces()
    with engine_answering(pieces, framing=framing) as up, \
            serve_in_thread(make_proxy_app(store, up.url)) as proxy:
        status, raw = _stream(proxy)
    assert status == 200 and raw.startswith(b"".join(pieces))
    assert raw[len(b"".join(pieces)):] == b": X-Trajstore-Seq: 0\n\n"  # an SSE comment: clients skip it
    (gen,) = store.load_generations("t")
    assert len(gen.output_ids) == 3 and gen.finish_reason == "length"


def test_a_stream_without_finish_reason_is_not_recorded_even_with_done(store):
    pieces = _stream_pieces()
    last = json.loads(pieces[2][5:])
    last["choices"][0]["finish_reason"] = None
    pieces[2] = sse_event(last)
    with engine_answering(pieces) as up, \
            serve_in_thread(make_proxy_app(store, up.url)) as proxy:
        _, raw = _stream(proxy)
    assert "not recorded" in _events_of(raw)[0][-1]["error"]["message"] and _nothing_recorded(store)


@pytest.mark.parametrize("bad", [b'data: {"choices": ["x"]}\n\n', b"data: {not json\n\n", b"data: [1, 2]\n\n"])
def test_an_unreadable_chunk_records_nothing_and_the_stream_goes_on(store, bad):
    pieces = _stream_pieces()
    pieces.insert(1, bad)
    with engine_answering(pieces) as up, \
            serve_in_thread(make_proxy_app(store, up.url, pass_through_unrecorded=True)) as proxy:
        status, raw = _stream(proxy)
    assert status == 200 and raw.startswith(b"".join(pieces))
    comments = _events_of(raw[len(b"".join(pieces)):])[1]
    assert len(comments) == 1 and comments[0].startswith("X-Trajstore-Error: not recorded")
    assert _nothing_recorded(store)


@pytest.mark.parametrize("framing", ["chunked-cut", "short"])
def test_a_body_cut_before_its_end_gets_a_clear_502(store, framing):
    answer = json.dumps(_completion()).encode()

    def reply(m, p, b):
        if framing == "short":  # Content-Length promises more than comes
            return [framed([answer])[0].replace(b"content-length: %d" % len(answer), b"content-length: %d" % (len(answer) + 50)), answer]
        return framed([answer[:20], answer[20:]], framing=framing)

    with RawUpstream(reply) as up, serve_in_thread(make_proxy_app(store, up.url)) as proxy:
        resp = httpx.post(f"{proxy}/v1/completions", json={"prompt": [10, 20, 30]}, headers=H)
    assert_unreachable(resp)
    assert _nothing_recorded(store)


def test_an_upstream_that_closes_without_answering_gets_a_clear_502(store):
    with RawUpstream(lambda m, p, b: []) as up, serve_in_thread(make_proxy_app(store, up.url)) as proxy:
        resp = httpx.post(f"{proxy}/v1/completions", json={"prompt": [10, 20, 30]}, headers=H)
        stream = httpx.post(f"{proxy}/v1/completions", json={"prompt": [10, 20, 30], "stream": True}, headers=H)
    assert resp.status_code == stream.status_code == 502 and _nothing_recorded(store)


def _closing_first(paths_seen: list) -> "RawUpstream":
    """An engine that closes the first connection of each path without answering (a kept-alive
    connection it dropped as the call went out), then answers ``{"status": "ok"}``."""
    def reply(method, path, body):
        first = path not in paths_seen
        paths_seen.append(path)
        return [] if first else framed([b'{"status": "ok"}'])
    return RawUpstream(reply)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_an_idempotent_control_call_the_engine_dropped_unanswered_is_sent_once_more(store, engine, caplog):
    """A trainer's pause must not fail because the engine closed a kept-alive connection as the
    pause went out: a call that has the effect of once when sent twice is sent once more."""
    from trajstore.ingest.proxy._sglang import make_sglang_proxy_app

    make = make_proxy_app if engine == "vllm" else make_sglang_proxy_app
    calls = [("POST", "/pause?mode=abort"), ("POST", "/resume"), ("GET", "/is_paused")] if engine == "vllm" else \
        [("POST", "/pause_generation"), ("POST", "/continue_generation"), ("GET", "/health")]
    seen: list = []
    with caplog.at_level(logging.INFO, logger="trajstore.ingest.proxy"), _closing_first(seen) as up, \
            serve_in_thread(make(store, up.url)) as proxy:
        answers = [httpx.request(method, f"{proxy}{path}", timeout=30) for method, path in calls]
    assert [(a.status_code, a.json()) for a in answers] == [(200, {"status": "ok"})] * 3
    assert [m for m, _, _ in up.requests] == [m for m, _ in calls for _ in range(2)]
    assert sum("without answering" in r.getMessage() for r in caplog.records) == 3


@pytest.mark.parametrize("engine, path", [("vllm", "/update_weights"), ("vllm", "/start_weight_update"),
                                          ("sglang", "/update_weights_from_disk"),
                                          ("sglang", "/release_memory_occupation")])
def test_a_weight_transfer_the_engine_dropped_unanswered_is_never_sent_twice(store, engine, path):
    from trajstore.ingest.proxy._sglang import make_sglang_proxy_app

    make = make_proxy_app if engine == "vllm" else make_sglang_proxy_app
    seen: list = []
    with _closing_first(seen) as up, serve_in_thread(make(store, up.url)) as proxy:
        resp = httpx.post(f"{proxy}{path}", json={}, timeout=30)
    assert_unreachable(resp)
    assert [p for _, p, _ in up.requests] == [path]


# --- the upstream URL, unnamed calls -------------------------------------------------------

@pytest.mark.parametrize("given, used", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
    ("https://gw.example/vllm/v1", "https://gw.example/vllm"),
])
def test_an_openai_style_upstream_url_is_accepted(given, used):
    assert normalize_upstream(given) == used


@pytest.mark.parametrize("bad", ["127.0.0.1:8000", "ftp://h/x", "http://", "http://h:99999", "http://h/?a=1", ""])
def test_a_bad_upstream_url_is_refused_in_one_line(bad):
    with pytest.raises(ValueError, match="--upstream") as e:
        normalize_upstream(bad)
    assert "\n" not in str(e.value)


def test_a_v1_upstream_works_end_to_end(store):
    with serve_in_thread(make_upstream()) as upstream, serve_in_thread(make_proxy_app(store, upstream + "/v1")) as proxy:
        resp = httpx.post(f"{proxy}/v1/completions", json={"prompt": [10, 20, 30]}, headers=H)
        models = httpx.get(f"{proxy}/v1/models")
    assert resp.status_code == 200 and resp.headers["x-trajstore-seq"] == "0" and models.status_code == 200


def test_the_cli_refuses_a_bad_upstream_in_one_line(tmp_path, capsys):
    from trajstore.cli import main

    rc = main(["--store", f"sqlite:///{tmp_path}/s.db", "proxy", "--upstream", "localhost:8000", "--insecure-no-auth"])
    err = capsys.readouterr().err
    assert rc == 1 and "error: --upstream must be an http(s) URL" in err and "Traceback" not in err


def test_unnamed_calls_say_why_in_a_header_and_are_logged_once_per_client(store, caplog):
    with serve_in_thread(make_upstream()) as upstream, serve_in_thread(make_proxy_app(store, upstream)) as proxy:
        with caplog.at_level(logging.WARNING, logger="trajstore.ingest.proxy"):
            answers = [httpx.post(f"{proxy}/v1/completions", json={"prompt": "x"}, headers={"User-Agent": ua})
                       for ua in ("harness-a", "harness-a", "harness-a", "harness-b")]
            streamed = httpx.post(f"{proxy}/v1/completions", json={"prompt": "x", "stream": True},
                                  headers={"User-Agent": "harness-a"})
    assert all(a.status_code == 200 and "X-Trajstore-Trajectory" in a.headers["x-trajstore-unrecorded"]
               for a in answers + [streamed])
    notes = [r.getMessage() for r in caplog.records if "unrecorded" in r.getMessage()]
    assert len(notes) == 2 and "harness-a" in notes[0] and "harness-b" in notes[1]
    assert all("X-Trajstore-Trajectory" in n for n in notes)
    assert store.info()["events_by_type"] == {}


# --- the RL endpoints, forwarded unrecorded --------------------------------------------------

def test_every_rl_endpoint_is_forwarded_as_sent_and_answered_with_the_upstreams_bytes(store):
    def reply(method, path, body):
        answer = json.dumps({"echo": [method, path, body.decode()]}).encode()
        return framed([answer], status=207 if path.startswith("/pause") else 200)

    with RawUpstream(reply) as up, serve_in_thread(make_proxy_app(store, up.url, token="tok")) as proxy:
        auth = {"Authorization": "Bearer tok"}
        for method, path in FORWARDED:
            body = b'{"new_version": "step-7"}' if method == "POST" else b""
            resp = httpx.request(method, f"{proxy}{path}?mode=abort&x=1", content=body, headers=auth)
            assert resp.json() == {"echo": [method, f"{path}?mode=abort&x=1", body.decode()]}, path
            assert resp.status_code == (207 if path == "/pause" else 200)
        n = len(up.requests)
        refused = [httpx.request(m, f"{proxy}{p}") for m, p in FORWARDED]
    assert n == len(FORWARDED) and len(up.requests) == n  # no token: nothing reached the engine
    assert {r.status_code for r in refused} == {401}
    assert store.info()["events_by_type"] == {}
    paths = {p for _, p in FORWARDED}
    for needed in ("/inference/v1/abort_requests", "/abort_requests", "/pause", "/resume", "/is_paused", "/weight_info",
                   "/update_weight_version", "/finish_weight_update", "/v1/chat/completions/render",
                   "/v1/completions/render", "/v1/chat/completions/derender", "/v1/completions/derender",
                   "/tokenize", "/detokenize", "/health"):
        assert needed in paths


def test_an_unreachable_upstream_on_a_forwarded_endpoint_gets_a_clear_502(store):
    with serve_in_thread(make_proxy_app(store, ENGINE_DOWN)) as proxy:
        resp = httpx.post(f"{proxy}/pause?mode=abort")
    assert_unreachable(resp)


# --- abort, then resume under new weights: one sample (SPEC A1) ------------------------------

def test_an_aborted_call_and_its_continuation_under_new_weights_fold_into_one_sample(store):
    """The fully-async pattern: a call aborted by ``/pause?mode=abort`` comes back with
    ``finish_reason: "abort"`` and its partial output; after the weight update the harness
    sends prompt + partial output and the engine continues. Both calls are recorded;
    the fold merges them (the second prompt extends the first sequence)."""
    calls = []

    def reply(method, path, body):
        req = json.loads(body) if body else {}
        calls.append((path, req))
        if path == "/inference/v1/generate":
            first = len(calls) == 1
            out = [40, 50] if first else [60, 70, 80]
            answer = {"request_id": "r", "choices": [{
                "index": 0, "token_ids": out, "finish_reason": "abort" if first else "stop",
                "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in out]},
                "weight_versions": [{"version": "5" if first else "6", "start": 0, "end": len(out)}]}]}
            return framed([json.dumps(answer).encode()])
        return framed([b'{"status": "ok"}'])

    with RawUpstream(reply) as up, serve_in_thread(make_proxy_app(store, up.url)) as proxy:
        first = httpx.post(f"{proxy}/inference/v1/generate", json={"token_ids": [1, 2, 3]}, headers=H)
        httpx.post(f"{proxy}/pause?mode=abort")
        httpx.post(f"{proxy}/update_weight_version", json={"new_version": "6"})
        httpx.post(f"{proxy}/resume")
        partial = first.json()["choices"][0]["token_ids"]
        second = httpx.post(f"{proxy}/inference/v1/generate", json={"token_ids": [1, 2, 3] + partial}, headers=H)
        httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": "t"})
    assert [p for p, _ in calls] == ["/inference/v1/generate", "/pause?mode=abort", "/update_weight_version", "/resume",
                                     "/inference/v1/generate"]
    assert first.headers["x-trajstore-seq"] == "0" and second.headers["x-trajstore-seq"] == "1"
    assert [g.finish_reason for g in store.load_generations("t")] == ["abort", "stop"]
    stats = store.materialize()
    assert (stats.num_steps_before, stats.num_samples_after) == (2, 1)
    (sample,) = list(store.samples())
    assert list(sample.response_ids) == [40, 50, 60, 70, 80] and list(sample.loss_mask) == [1] * 5
    assert list(sample.token_model_versions) == [5, 5, 6, 6, 6]
    assert (sample.min_model_version, sample.max_model_version) == (5, 6) and sample.finish_reason == "stop"
    np.testing.assert_allclose(sample.rollout_logprobs, -0.5)
    # the abort is in SQL
    from sqlalchemy import text

    with store.log.read_engine.connect() as conn:
        rows = conn.execute(text("SELECT seq, finish_reason FROM events WHERE trajectory_id = 't' "
                                 "AND type = 'generation' ORDER BY seq")).all()
    assert [tuple(r) for r in rows] == [(0, "abort"), (1, "stop")]


def test_tito_answer_from_vllm_033_names_token_ids_in_logprobs(store):
    """vLLM 0.33's generate logprobs carry ``token_id`` (no tokenizer there): recorded as sent."""
    body = {"token_ids": [3, 20, 21], "sampling_params": {"max_tokens": 3, "logprobs": 0}}
    answer = tito_respond(body)
    for entry, t in zip(answer["choices"][0]["logprobs"]["content"], answer["choices"][0]["token_ids"]):
        entry.pop("token")
        entry["token_id"] = t
    with RawUpstream(lambda m, p, b: framed([json.dumps(answer).encode()])) as up, \
            serve_in_thread(make_proxy_app(store, up.url)) as proxy:
        resp = httpx.post(f"{proxy}/inference/v1/generate", json=body, headers=H)
    assert resp.headers["x-trajstore-seq"] == "0"
    (gen,) = store.load_generations("t")
    assert list(gen.output_ids) == answer["choices"][0]["token_ids"]


def test_a_label_change_with_a_declared_version_maps_the_label_in_the_store(store):
    with RawUpstream(lambda m, p, b: framed([b'{"success": true}'])) as up, \
            serve_in_thread(make_proxy_app(store, up.url, pass_through_unrecorded=True)) as proxy:
        mapped = httpx.post(f"{proxy}/update_weight_version", json={"new_version": "step-7"},
                            headers={"X-Trajstore-Model-Version": "7"})
        finished = httpx.post(f"{proxy}/finish_weight_update", json={"weight_version": "step-8"},
                              headers={"X-Trajstore-Model-Version": "8"})
        plain = httpx.post(f"{proxy}/update_weight_version", json={"new_version": "step-9"})
        clash = httpx.post(f"{proxy}/update_weight_version", json={"new_version": "step-7"},
                           headers={"X-Trajstore-Model-Version": "70"})
    assert mapped.headers["x-trajstore-label"] == "step-7=7" and finished.headers["x-trajstore-label"] == "step-8=8"
    assert "x-trajstore-label" not in plain.headers
    assert clash.status_code == 200 and "step-7" in clash.headers["x-trajstore-error"]  # the engine's answer stands
    assert [b for _, _, b in up.requests][0] == b'{"new_version":"step-7"}'
    assert "'step-7' is already mapped to model_version 7, not 70" in clash.headers["x-trajstore-error"]
    # a call sampled under step-7 resolves through the map (the spans say its version: no model_version beside)
    store.append([{"type": "trajectory_started", "trajectory_id": "l"},
                  {"type": "generation", "trajectory_id": "l", "seq": 0, "prompt_ids": [1], "output_ids": [2, 3],
                   "weight_versions": [{"version": "step-7", "start": 0, "end": 2}]},
                  {"type": "trajectory_finished", "trajectory_id": "l", "status": "completed"}])
    store.materialize()
    (sample,) = list(store.samples())
    assert list(sample.token_model_versions) == [7, 7]


# --- group commit: concurrent calls share appends ----------------------------------------------

def test_concurrent_calls_are_group_committed_and_a_refused_one_fails_alone(store):
    from concurrent.futures import ThreadPoolExecutor

    store.append([{"type": "trajectory_started", "trajectory_id": "done"},
                  {"type": "trajectory_finished", "trajectory_id": "done", "status": "completed"}])
    tids = [f"g{i}" for i in range(64)] + ["done"] * 4
    with serve_in_thread(make_upstream()) as upstream:
        app = make_proxy_app(store, upstream, pass_through_unrecorded=True)
        with serve_in_thread(app) as proxy, httpx.Client(timeout=60) as client, ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda tid: client.post(f"{proxy}/v1/completions", json={"prompt": [10, 20]},
                                                            headers={"X-Trajstore-Trajectory": tid}), tids))
    assert all(a.status_code == 200 for a in answers)
    assert [a.headers.get("x-trajstore-seq") for a in answers[:64]] == ["0"] * 64
    assert all("done" in a.headers["x-trajstore-error"] for a in answers[64:])
    assert store.info()["events_by_type"]["generation"] == 64
    commits = app.state.commit_metrics.commits
    assert 0 < commits < 64 + 4, commits  # calls that were ready together shared an append
