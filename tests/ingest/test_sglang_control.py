"""SGLang's RL control plane through the recording proxy, over real loopback HTTP, on both backends.

The proxy relays SGLang's control calls (pause, continue, abort, weight
updates and version labels) as sent and maps a label change's label in the
store when the call declares ``X-Trajstore-Model-Version``, as the vLLM proxy
does. SGLang's ``/update_weight_version`` aborts every running request unless
``abort_all_requests: false`` (io_struct.py ``UpdateWeightVersionReqInput``):
the test upstream (tests/sglang_upstream.py) does the same, and the
relabel-without-losing-rollouts recipe of docs/sglang.md is run here.
"""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

import sglang_upstream  # noqa: E402
from openai_upstream import NUM_LAYERS, TOPK, serve_in_thread  # noqa: E402
from raw_upstream import RawUpstream, framed  # noqa: E402
from trajstore.ingest.proxy._sglang import FORWARDED, LABEL_FIELDS, make_sglang_proxy_app  # noqa: E402

LAYOUT = f"{NUM_LAYERS}x{TOPK}"


def test_every_control_endpoint_is_forwarded_as_sent_behind_the_token(store):
    def reply(method, path, body):
        answer = json.dumps({"echo": [method, path, body.decode()]}).encode()
        return framed([answer], status=400 if path.startswith("/flush_cache") else 200)

    with RawUpstream(reply) as up, serve_in_thread(make_sglang_proxy_app(store, up.url, token="tok")) as proxy:
        auth = {"Authorization": "Bearer tok"}
        for method, path in FORWARDED:
            body = b'{"abort_all_requests": false}' if method == "POST" else b""
            resp = httpx.request(method, f"{proxy}{path}?mode=in_place", content=body, headers=auth)
            assert resp.json() == {"echo": [method, f"{path}?mode=in_place", body.decode()]}, path
            assert resp.status_code == (400 if path == "/flush_cache" else 200), path
        n = len(up.requests)
        refused = [httpx.request(m, f"{proxy}{p}") for m, p in FORWARDED]
    assert n == len(FORWARDED) and len(up.requests) == n  # no token: nothing reached the engine
    assert {r.status_code for r in refused} == {401}
    assert store.info()["events_by_type"] == {}
    for needed in ("/pause_generation", "/continue_generation", "/abort_request", "/update_weight_version",
                   "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
                   "/init_weights_update_group", "/release_memory_occupation", "/resume_memory_occupation",
                   "/flush_cache", "/health", "/get_model_info", "/server_info"):
        assert needed in {p for _, p in FORWARDED}, needed


def test_a_label_change_with_a_declared_version_maps_its_label(store):
    ok = json.dumps({"success": True, "message": "Weight version updated to x", "new_version": "x"}).encode()
    with RawUpstream(lambda m, p, b: framed([ok], status=400 if b"fail" in b else 200)) as up, \
            serve_in_thread(make_sglang_proxy_app(store, up.url)) as proxy:
        relabel = httpx.post(f"{proxy}/update_weight_version", headers={"X-Trajstore-Model-Version": "7"},
                             json={"new_version": "step-7", "abort_all_requests": False})
        disk = httpx.post(f"{proxy}/update_weights_from_disk", headers={"X-Trajstore-Model-Version": "8"},
                          json={"model_path": "/ckpt/8", "weight_version": "step-8"})
        failed = httpx.post(f"{proxy}/update_weights_from_disk", headers={"X-Trajstore-Model-Version": "9"},
                            json={"model_path": "fail", "weight_version": "step-9"})
        plain = httpx.post(f"{proxy}/update_weight_version", json={"new_version": "step-10"})
        clash = httpx.post(f"{proxy}/update_weight_version", headers={"X-Trajstore-Model-Version": "70"},
                           json={"new_version": "step-7"})
        unlabelled = httpx.post(f"{proxy}/update_weights_from_tensor", headers={"X-Trajstore-Model-Version": "11"},
                                json={"serialized_named_tensors": []})
    assert relabel.headers["x-trajstore-label"] == "step-7=7" and disk.headers["x-trajstore-label"] == "step-8=8"
    assert relabel.json() == json.loads(ok)  # the engine's answer
    assert failed.status_code == 400 and "x-trajstore-label" not in failed.headers  # the engine refused: no label
    assert plain.status_code == 200 and "x-trajstore-label" not in plain.headers
    # the store refused the mapping: the trainer is told (the engine took the label), by default
    assert clash.status_code in (409, 422) and "step-7" in clash.json()["error"]["message"]
    assert "the engine took the label change" in clash.json()["error"]["message"]
    assert unlabelled.status_code == 422 and "weight_version" in unlabelled.json()["error"]["message"]
    assert up.requests[0][2] == b'{"new_version":"step-7","abort_all_requests":false}'  # relayed as sent
    assert set(LABEL_FIELDS) == {"/update_weight_version", "/update_weights_from_disk", "/update_weights_from_tensor",
                                 "/update_weights_from_distributed", "/update_weights_from_ipc"}


def _stream(proxy: str, tid: str, version: int, max_new_tokens: int, started: threading.Event, out: dict) -> None:
    body = {"input_ids": [3, 20, 21, 2, 5], "sampling_params": {"max_new_tokens": max_new_tokens}, "stream": True}
    headers = {"X-Trajstore-Trajectory": tid, "X-Trajstore-Model-Version": str(version)}
    lines = []
    try:
        with httpx.stream("POST", f"{proxy}/generate", json=body, headers=headers, timeout=120) as resp:
            for line in resp.iter_lines():
                lines.append(line)
                if line.startswith("data: {"):
                    started.set()
    finally:
        started.set()
        out["lines"] = lines


def _final(lines: list[str]) -> dict:
    chunks = [json.loads(line[5:]) for line in lines if line.startswith("data: {")]
    return chunks[-1]


def test_update_weight_version_aborts_running_calls_unless_told_not_to(store, caplog):
    """SGLang's default aborts the running call (recorded as an abort with its partial output);
    pause in place, relabel with ``abort_all_requests: false``, continue: the call runs on, its tokens
    carry the old label then the new one, and the store resolves both through the mapped labels."""
    app = sglang_upstream.make_upstream()
    app.state.token_delay_s = 0.05  # 25 s for 500 tokens: the control calls land while the calls run
    app.state.label = "step-7"
    store.append([{"type": "version_label", "label": "step-7", "model_version": 7}])
    with serve_in_thread(app) as url, serve_in_thread(make_sglang_proxy_app(store, url, route_layout=LAYOUT)) as proxy, \
            caplog.at_level(logging.WARNING, logger="trajstore.ingest.proxy"):
        # 1. the default: the running call is aborted
        started, first = threading.Event(), {}
        harness = threading.Thread(target=_stream, args=(proxy, "a", 7, 500, started, first))
        harness.start()
        assert started.wait(60)
        relabel = httpx.post(f"{proxy}/update_weight_version", json={"new_version": "step-8"},
                             headers={"X-Trajstore-Model-Version": "8"}, timeout=60)
        harness.join(60)
        # 2. relabel without losing the rollout: pause in place, relabel without the abort, continue
        started, second = threading.Event(), {}
        harness = threading.Thread(target=_stream, args=(proxy, "b", 8, 500, started, second))
        harness.start()
        assert started.wait(60)
        paused = httpx.post(f"{proxy}/pause_generation", json={"mode": "in_place"}, timeout=60)
        kept = httpx.post(f"{proxy}/update_weight_version", json={"new_version": "step-9", "abort_all_requests": False},
                          headers={"X-Trajstore-Model-Version": "9"}, timeout=60)
        app.state.token_delay_s = 0.0  # the rest at once
        resumed = httpx.post(f"{proxy}/continue_generation", json={}, timeout=60)
        harness.join(60)
        for tid in ("a", "b"):
            assert httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": tid}).status_code == 200
    assert relabel.json()["success"] and relabel.headers["x-trajstore-label"] == "step-8=8"
    noted = [r.getMessage() for r in caplog.records if "abort_all_requests" in r.getMessage()]
    assert len(noted) == 1 and "aborts every running request" in noted[0]  # said once, at the aborting call
    aborted = _final(first["lines"])["meta_info"]
    assert aborted["finish_reason"]["type"] == "abort" and [x for x in first["lines"] if x][-1] == ": X-Trajstore-Seq: 0"
    assert paused.json()["status"] == "ok" and resumed.json()["status"] == "ok"
    assert kept.headers["x-trajstore-label"] == "step-9=9"
    assert app.state.control[2] == ("/update_weight_version", {"new_version": "step-9", "abort_all_requests": False})
    whole = _final(second["lines"])["meta_info"]
    assert whole["finish_reason"]["type"] == "length" and [x for x in second["lines"] if x][-1] == ": X-Trajstore-Seq: 0"
    spans = whole["weight_versions"]
    assert [s["version"] for s in spans] == ["step-8", "step-9"] and 1 <= spans[0]["end"] < 500
    # the records: the abort with its partial output, the kept call with SGLang's spans
    (a,) = store.load_generations("a")
    assert a.finish_reason == "abort" and 1 <= len(a.output_ids) < 500
    assert a.metadata.get("abort_message") == "Aborted"
    (b,) = store.load_generations("b")
    assert b.finish_reason == "length" and len(b.output_ids) == 500
    assert b.weight_versions == tuple((s["version"], s["start"], s["end"]) for s in spans)
    store.materialize()
    samples = {s.trajectory_id: s for s in store.samples()}
    assert set(samples["a"].token_model_versions) == {7}
    np.testing.assert_array_equal(samples["b"].token_model_versions,
                                  np.repeat([8, 9], [spans[0]["end"], 500 - spans[0]["end"]]))
