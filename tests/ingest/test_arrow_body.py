"""The ingest service's binary body (Arrow IPC stream): same events, same
rules, same answers as the JSON body, over real loopback HTTP."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from openai_upstream import serve_in_thread  # noqa: E402
from trajstore.ingest.arrow_body import ARROW_CONTENT_TYPE, decode_arrow_events, encode_arrow_events  # noqa: E402
from trajstore.ingest.service import make_app  # noqa: E402
from trajstore.ingest.sinks import encode_events  # noqa: E402

TOKEN = "test-token"


def _events(tid: str, turns: int = 3, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out: list[dict] = [{"type": "trajectory_started", "trajectory_id": tid, "num_experts": 16,
                        "metadata": {"env": "arrow", "k": [1, 2]}}]
    prompt = rng.integers(0, 1000, 20, dtype=np.int32)
    for seq in range(turns):
        output = rng.integers(0, 1000, 7, dtype=np.int32)
        rows = len(prompt) + len(output) - 1
        out.append({"type": "generation", "trajectory_id": tid, "seq": seq, "prompt_ids": prompt,
                    "output_ids": output, "logprobs": -rng.random(7, dtype=np.float32), "model_version": seq,
                    "routed_experts": rng.integers(0, 16, (rows, 3, 2), dtype=np.uint8),
                    "finish_reason": "stop"})
        prompt = np.concatenate([prompt, output, rng.integers(0, 1000, 4, dtype=np.int32)])
    out.append({"type": "reward", "trajectory_id": tid, "reward": 0.5})
    out.append({"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"})
    return out


def _post(url: str, body: bytes, content_type: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/events", content=body, timeout=60,
                      headers={"Content-Type": content_type, "Authorization": f"Bearer {TOKEN}"})


def test_round_trip_keeps_every_field_and_array():
    events = _events("t")
    events[1]["output_ids"] = events[1]["output_ids"].astype(">i4")  # big-endian in, little-endian on the wire
    back = decode_arrow_events(encode_arrow_events(events))
    assert len(back) == len(events)
    for a, b in zip(events, back):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], np.ndarray):
                assert np.array_equal(a[k], b[k]) and a[k].shape == b[k].shape
            else:
                assert a[k] == b[k]
    assert decode_arrow_events(encode_arrow_events([])) == []


@pytest.fixture
def service(store):
    with serve_in_thread(make_app(store, token=TOKEN, max_body_bytes=8 << 20)) as url:
        yield url


def test_arrow_and_json_bodies_store_the_same_samples(service, store):
    assert _post(service, encode_arrow_events(_events("a", seed=1)), ARROW_CONTENT_TYPE).status_code == 200
    assert _post(service, encode_events(_events("j", seed=1)), "application/json").status_code == 200
    ga, gj = store.load_generations("a"), store.load_generations("j")
    assert len(ga) == len(gj) == 3
    for x, y in zip(ga, gj):
        for name in ("prompt_ids", "output_ids", "logprobs", "routed_experts"):
            assert np.array_equal(getattr(x, name), getattr(y, name)), name
    store.materialize()
    by_tid = {}
    for s in store.samples():
        by_tid.setdefault(s.trajectory_id, []).append(s)
    assert [s.num_tokens for s in by_tid["a"]] == [s.num_tokens for s in by_tid["j"]]
    for x, y in zip(by_tid["a"], by_tid["j"]):
        assert np.array_equal(x.routed_experts, y.routed_experts) and np.array_equal(x.response_ids, y.response_ids)


def test_retrying_an_arrow_body_is_idempotent(service, store):
    body = encode_arrow_events(_events("r"))
    first, again = _post(service, body, ARROW_CONTENT_TYPE), _post(service, body, ARROW_CONTENT_TYPE)
    assert first.status_code == again.status_code == 200
    assert again.json()["num_appended"] == 0


def test_not_an_arrow_stream_gets_400(service, store):
    for body in (b"", b"not arrow at all", encode_events(_events("x"))):
        resp = _post(service, body, ARROW_CONTENT_TYPE)
        assert resp.status_code == 400 and resp.json()["error"]["rule"] == "malformed_body"
    # a stream without the event column
    sink = pa.BufferOutputStream()
    table = pa.table({"other": pa.array([1])})
    with ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    resp = _post(service, sink.getvalue().to_pybytes(), ARROW_CONTENT_TYPE)
    assert resp.status_code == 400 and resp.json()["error"]["rule"] == "malformed_body"
    assert store.info()["head_position"] == 0


def test_array_bytes_that_do_not_match_their_shape_get_422_naming_the_event(service, store):
    events = _events("bad")
    body = encode_arrow_events(events)
    # same bytes, a lying shape: event 2's first array (prompt_ids) marked 1000x larger
    table = ipc.open_stream(pa.py_buffer(body)).read_all()
    docs = table.column("event").to_pylist()
    docs[2] = docs[2].replace('"shape":[', '"shape":[1000,', 1)
    table = table.set_column(0, "event", pa.array(docs, pa.string()))
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    resp = _post(service, sink.getvalue().to_pybytes(), ARROW_CONTENT_TYPE)
    assert resp.status_code == 422
    err = resp.json()["error"]
    assert err["index"] == 2 and err["trajectory_id"] == "bad" and err["rule"] == "array_shape"
    assert store.info()["head_position"] == 0


def test_event_rules_apply_to_arrow_bodies(service, store):
    events = _events("rule")
    events[2]["logprobs"] = events[2]["logprobs"][:1]  # one logprob for 7 output tokens
    resp = _post(service, encode_arrow_events(events), ARROW_CONTENT_TYPE)
    assert resp.status_code == 422
    err = resp.json()["error"]
    assert (err["index"], err["trajectory_id"], err["rule"]) == (2, "rule", "length_mismatch")
    assert store.info()["head_position"] == 0


def test_a_stream_of_several_record_batches_decodes_in_order_with_null_array_cells():
    """A client may write its events in several record batches; an array
    column is null in the rows of events without that field."""
    events = _events("m", turns=2)
    whole = ipc.open_stream(pa.py_buffer(encode_arrow_events(events))).read_all()
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, whole.schema) as writer:
        for batch in whole.to_batches(max_chunksize=2):
            writer.write_batch(batch)
    back = decode_arrow_events(sink.getvalue().to_pybytes())
    assert [ev["type"] for ev in back] == [ev["type"] for ev in events]
    assert "routed_experts" not in back[0] and "routed_experts" not in back[-1]
    for a, b in zip(events, back):
        for k, v in a.items():
            if isinstance(v, np.ndarray):
                assert np.array_equal(v, b[k]) and v.shape == b[k].shape
