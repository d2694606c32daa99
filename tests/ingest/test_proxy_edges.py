"""Both recording proxies (vLLM and SGLang) at their edges, over real loopback HTTP, on both backends:

* a named call the store cannot take fails closed (an error status, or an
  error event before a stream's ``[DONE]``, with the reason in the OpenAI
  error shape), unless ``pass_through_unrecorded``; both counted in
  ``GET /metrics``;
* a stream that ends with ``[DONE]`` but without its final chunk (no finish
  reason) is not recorded, on either engine;
* an engine that is down, or cuts an error body, gets the same clean
  answers from both proxies (a 502, an SSE error event), never a 500 or a
  broken response.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

import openai_upstream  # noqa: E402
import sglang_upstream  # noqa: E402
from openai_upstream import NUM_LAYERS, TOPK, serve_in_thread  # noqa: E402
from helpers import proxy_process  # noqa: E402
from proxy_faults import ENGINE_DOWN, assert_unreachable, engine_answering  # noqa: E402
from raw_upstream import RawUpstream, framed, sse  # noqa: E402
from trajstore.ingest.proxy import _sglang as _sglang_proxy  # noqa: E402
from trajstore.ingest.proxy import FORWARDED, make_proxy_app  # noqa: E402
from trajstore.ingest.sglang import request_params_for_generate, request_params_for_openai  # noqa: E402
from trajstore.ingest.vllm import request_params_for_tito  # noqa: E402

LAYOUT = f"{NUM_LAYERS}x{TOPK}"
H = {"X-Trajstore-Trajectory": "t", "X-Trajstore-Model-Version": "3"}
ENGINES = ["vllm", "sglang"]


def _app(engine: str, store, url: str, **kwargs):
    if engine == "sglang":
        return _sglang_proxy.make_sglang_proxy_app(store, url, route_layout=LAYOUT, **kwargs)
    return make_proxy_app(store, url, **kwargs)


def _upstream(engine: str):
    return sglang_upstream.make_upstream() if engine == "sglang" else openai_upstream.make_upstream()


def _call(engine: str) -> tuple[str, dict]:
    """A named generate call of each engine's own endpoint (path, body)."""
    if engine == "sglang":
        return "/generate", {"input_ids": [3, 20, 21, 2, 5], "sampling_params": {"max_new_tokens": 4}}
    return "/inference/v1/generate", {"token_ids": [3, 20, 21, 2, 5], "sampling_params": {"max_tokens": 4}}


def openai_client_reads(raw: bytes) -> list:
    """The data objects an OpenAI client acts on: up to ``[DONE]`` (it stops there); an object with an
    ``error`` raises, as ``openai.Stream`` raises ``APIError``."""
    out = []
    for line in raw.decode().split("\n"):
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data.startswith("[DONE]"):
            break
        obj = json.loads(data)
        if isinstance(obj, dict) and obj.get("error"):
            raise RuntimeError(obj["error"]["message"])
        out.append(obj)
    return out


def _finished(store, tid: str = "t") -> None:
    store.append([{"type": "trajectory_started", "trajectory_id": tid},
                  {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}])


def _metric(proxy: str, name: str, **labels) -> float:
    text = httpx.get(f"{proxy}/metrics").text
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(want + " ")]
    return values[0] if values else 0.0


# --- fail closed ----------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_a_call_the_store_refuses_fails_closed_with_the_reason(store, engine):
    """A finished trajectory reused: the harness gets the store's refusal, not a 200 it cannot tell apart."""
    _finished(store)
    path, body = _call(engine)
    with serve_in_thread(_upstream(engine)) as url, \
            serve_in_thread(_app(engine, store, url, token="tok")) as proxy:
        auth = {**H, "Authorization": "Bearer tok"}
        plain = httpx.post(f"{proxy}{path}", json=body, headers=auth)
        with httpx.stream("POST", f"{proxy}{path}", json={**body, "stream": True}, headers=auth) as resp:
            streamed, raw = resp.status_code, resp.read()
        refused = _metric(proxy, "trajstore_proxy_calls_total", outcome="refused")
        by_rule = _metric(proxy, "trajstore_proxy_unrecorded_total", rule="finished_trajectory")
    assert plain.status_code == 422, plain.text
    error = plain.json()["error"]
    # the OpenAI error shape (an OpenAI client raises with this message), and trajstore's rule
    assert error["type"] == "TrajstoreNotRecorded" and error["code"] == 422 and error["param"] is None
    assert error["rule"] == "finished_trajectory" and error["trajectory_id"] == "t"
    assert "not recorded" in error["message"] and "finished" in error["message"]
    assert "finished" in plain.headers["x-trajstore-error"] and "x-trajstore-seq" not in plain.headers
    # a stream's bytes are sent as they come; its end says the call is not recorded, before [DONE]
    assert streamed == 200 and b"data: [DONE]" in raw
    with pytest.raises(RuntimeError, match="not recorded.*finished"):
        openai_client_reads(raw)
    assert raw.index(b'"TrajstoreNotRecorded"') < raw.index(b"data: [DONE]")
    assert refused == 2 and by_rule == 2
    assert len(store.load_generations("t")) == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_pass_through_is_an_explicit_flag_and_counted(store, engine):
    _finished(store)
    path, body = _call(engine)
    with serve_in_thread(_upstream(engine)) as url, \
            serve_in_thread(_app(engine, store, url, pass_through_unrecorded=True)) as proxy:
        plain = httpx.post(f"{proxy}{path}", json=body, headers=H)
        with httpx.stream("POST", f"{proxy}{path}", json={**body, "stream": True}, headers=H) as resp:
            raw = resp.read()
        passed = _metric(proxy, "trajstore_proxy_calls_total", outcome="passed_through")
        refused = _metric(proxy, "trajstore_proxy_calls_total", outcome="refused")
    assert plain.status_code == 200 and "finished" in plain.headers["x-trajstore-error"]
    assert openai_client_reads(raw) and raw.rstrip().splitlines()[-1].startswith(b": X-Trajstore-Error: not recorded")
    assert (passed, refused) == (2, 0)
    assert len(store.load_generations("t")) == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_an_answer_the_adapter_cannot_read_fails_closed_as_a_bad_gateway(store, engine):
    path, body = _call(engine)
    with RawUpstream(lambda m, p, b: framed([b'{"choices": ["x"], "meta_info": []}'])) as up, \
            serve_in_thread(_app(engine, store, up.url)) as proxy:
        resp = httpx.post(f"{proxy}{path}", json=body, headers=H)
        recorded = _metric(proxy, "trajstore_proxy_calls_total", outcome="recorded")
    assert resp.status_code == 502 and resp.json()["error"]["type"] == "TrajstoreNotRecorded", resp.text
    assert resp.json()["error"]["rule"] and "\n" not in resp.headers["x-trajstore-error"]
    assert store.trajectory_state("t") is None and recorded == 0


def test_the_metrics_are_open_as_on_the_ingest_service(store):
    with serve_in_thread(make_proxy_app(store, ENGINE_DOWN, token="tok")) as proxy:
        metrics = httpx.get(f"{proxy}/metrics")
        other = httpx.post(f"{proxy}/v1/completions", json={"prompt": "x"})
    assert metrics.status_code == 200 and "trajstore_proxy_calls_total" in metrics.text
    assert other.status_code == 401


# --- a stream without its final chunk ---------------------------------------------------------

def _streams_without_their_final_chunk(engine: str, kind: str) -> list[dict]:
    """The engine's own stream chunks for a call, the final one (finish reason, routes, spans) dropped."""
    if engine == "sglang" and kind == "generate":
        body = request_params_for_generate(_call("sglang")[1], routes=True)
        chunks = list(sglang_upstream.native_stream(body, sglang_upstream_state()))
        assert chunks[-1]["meta_info"]["finish_reason"] and chunks[-1]["meta_info"].get("routed_experts")
    elif engine == "sglang":
        body = request_params_for_openai({"prompt": "hi", "max_tokens": 4, "stream": True}, chat=False, routes=True)
        chunks = [c for c in sglang_upstream.openai_stream(body, False, sglang_upstream_state()) if c["choices"]]
        assert chunks[-1]["choices"][0]["finish_reason"]
    else:
        body = request_params_for_tito(_call("vllm")[1])
        chunks = list(openai_upstream.tito_stream_chunks(body))
        assert chunks[-1]["choices"][0]["finish_reason"]
    return chunks[:-1]


def sglang_upstream_state():
    from types import SimpleNamespace

    return SimpleNamespace(weight_update=None, missing_logprob=None, incremental=False)


@pytest.mark.parametrize("engine, kind", [("vllm", "generate"), ("sglang", "generate"), ("sglang", "completions")])
def test_a_stream_ended_by_done_without_its_final_chunk_is_not_recorded(store, engine, kind):
    chunks = _streams_without_their_final_chunk(engine, kind)
    pieces = sse(chunks, done=True)
    path, body = _call(engine)
    if kind == "completions":
        path, body = "/v1/completions", {"prompt": "hi", "max_tokens": 4}
    with engine_answering(pieces, framing="chunked") as up, \
            serve_in_thread(_app(engine, store, up.url)) as proxy:
        with httpx.stream("POST", f"{proxy}{path}", json={**body, "stream": True}, headers=H) as resp:
            raw = resp.read()
        cut = _metric(proxy, "trajstore_proxy_calls_total", outcome="stream_cut")
    assert resp.status_code == 200 and raw.startswith(b"".join(pieces[:-1]))  # every chunk reached the harness
    with pytest.raises(RuntimeError, match="ended before its end.*not recorded"):
        openai_client_reads(raw)  # the error comes before [DONE]
    assert store.trajectory_state("t") is None and cut == 1


# --- the engine down, an error body cut ---------------------------------------------------------

SGLANG_GETS = [(m, p) for m, p in _sglang_proxy.FORWARDED if m == "GET"]


@pytest.mark.parametrize("engine", ENGINES)
def test_every_passthrough_answers_a_clean_502_when_the_engine_is_down(store, engine):
    forwarded = _sglang_proxy.FORWARDED if engine == "sglang" else FORWARDED
    with serve_in_thread(_app(engine, store, ENGINE_DOWN)) as proxy:
        answers = {(m, p): httpx.request(m, f"{proxy}{p}", json={} if m == "POST" else None) for m, p in forwarded}
    for (method, path), resp in answers.items():
        assert_unreachable(resp, (method, path))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("named", [True, False], ids=["named", "unnamed"])
@pytest.mark.parametrize("content_type", ["text/event-stream", "application/json"])
def test_an_error_body_the_engine_cuts_ends_the_harness_response_cleanly(store, engine, named, content_type):
    cut = [b'{"error": {"message": "out of mem', b'ory']
    path, body = _call(engine)
    with engine_answering(cut, framing="chunked-cut", status=503, content_type=content_type) as up, \
            serve_in_thread(_app(engine, store, up.url)) as proxy:
        with httpx.stream("POST", f"{proxy}{path}", json={**body, "stream": True},
                          headers=H if named else {}) as resp:
            raw = resp.read()  # a response the proxy broke off raises here (RemoteProtocolError)
    assert resp.status_code == 503 and raw.startswith(b'{"error": {"message": "out of memory')
    if content_type == "text/event-stream":
        assert b'"UpstreamStreamCut"' in raw
    assert store.trajectory_state("t") is None


# --- the CLI flag ----------------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINES)
def test_the_cli_fails_closed_unless_told_to_pass_through(tmp_path, engine):
    """``trajstore proxy`` as deployed (a real process): a reused trajectory is refused by default,
    passed through with ``--pass-through-unrecorded``."""
    import trajstore

    url = f"sqlite:///{tmp_path / 'p.db'}"
    with trajstore.connect(url) as store:
        _finished(store)
    path, body = _call(engine)
    answers = []
    with serve_in_thread(_upstream(engine)) as upstream:
        for extra in ([], ["--pass-through-unrecorded"]):
            engine_args = ["--engine", engine] + (["--route-layout", LAYOUT] if engine == "sglang" else [])
            with proxy_process("--store", url, "proxy", "--upstream", upstream, "--insecure-no-auth", *engine_args,
                               *extra, tries=600) as proxy:
                answers.append(httpx.post(f"{proxy}{path}", json=body, headers=H, timeout=60))
    closed, passed = answers
    assert closed.status_code == 422 and closed.json()["error"]["rule"] == "finished_trajectory"
    assert passed.status_code == 200 and "finished" in passed.headers["x-trajstore-error"]
