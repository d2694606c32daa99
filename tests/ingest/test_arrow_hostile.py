"""Hostile Arrow IPC bodies against the ingest service: every one gets a 4xx
JSON error with a one-line message, never a 500, never a dead process, and
nothing of it is stored. The out-of-bounds offset once killed the service
with SIGSEGV; it runs here against a real ``trajstore serve`` on loopback."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from openai_upstream import serve_in_thread  # noqa: E402
from trajstore.ingest.arrow_body import (  # noqa: E402
    ARROW_CONTENT_TYPE, ArrowBodyError, decode_arrow_events, encode_arrow_events)
from trajstore.errors import ValidationError  # noqa: E402
from trajstore.ingest.service import make_app  # noqa: E402
from helpers import serve_process  # noqa: E402

TOKEN = "hostile-token"
HEADERS = {"Content-Type": ARROW_CONTENT_TYPE, "Authorization": f"Bearer {TOKEN}"}


def _docs(n: int = 3) -> list[str]:
    return [json.dumps({"type": "trajectory_started", "trajectory_id": f"h{i}"}) for i in range(n)]


def _stream(batch: pa.RecordBatch, **options) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, batch.schema, options=ipc.IpcWriteOptions(**options)) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _strings(offsets: list[int], data: bytes) -> pa.Array:
    """A utf8 array from raw buffers, never validated (what a hostile client can send)."""
    return pa.Array.from_buffers(pa.string(), len(offsets) - 1,
                                 [None, pa.py_buffer(np.array(offsets, np.int32)), pa.py_buffer(data)])


def _event_column(offsets_at: int | None = None, value: int = 0, data: bytes | None = None) -> bytes:
    docs = _docs()
    raw = "".join(docs).encode() if data is None else data
    offsets = [0, *np.cumsum([len(d) for d in docs]).tolist()]
    if offsets_at is not None:
        offsets[offsets_at] = value
    return _stream(pa.record_batch([_strings(offsets, raw)], names=["event"]))


def _out_of_bounds_offset() -> bytes:
    return _event_column(2, 2 * 10**9)  # once: SIGSEGV in to_pylist


def _past_the_buffer() -> bytes:
    return _event_column(2, 100_000)  # once: a 500 (UnicodeDecodeError)


def _offsets_out_of_order() -> bytes:
    return _event_column(1, 200)


def _negative_offset() -> bytes:
    return _event_column(1, -5)


def _invalid_utf8() -> bytes:
    docs = _docs()
    raw = bytearray("".join(docs).encode())
    raw[3] = 0xFF  # inside the first event's JSON
    return _event_column(data=bytes(raw))


def _duplicated_event() -> bytes:
    a = pa.array(_docs())
    return _stream(pa.record_batch([a, a], names=["event", "event"]))


def _duplicated_binary() -> bytes:
    doc = {"type": "generation", "trajectory_id": "d", "seq": 0, "model_version": 0, "output_ids": [1],
           "prompt_ids": {"$arrow": {"dtype": "int32", "shape": [1]}}}
    col = pa.array([np.int32(1).tobytes()], pa.large_binary())
    return _stream(pa.record_batch([pa.array([json.dumps(doc)]), col, col],
                                   names=["event", "prompt_ids", "prompt_ids"]))


def _unknown_column() -> bytes:
    return _stream(pa.record_batch([pa.array(_docs(1)), pa.array([b"x"], pa.large_binary())],
                                   names=["event", "not_a_field"]))


def _bomb(inflated: int = 64 << 20) -> bytes:
    """A few KiB of zstd whose array column inflates to ``inflated`` bytes."""
    doc = {"type": "generation", "trajectory_id": "b", "seq": 0, "model_version": 0, "output_ids": [1],
           "prompt_ids": {"$arrow": {"dtype": "int32", "shape": [inflated // 4]}}}
    col = pa.array([bytes(inflated)], pa.large_binary())
    return _stream(pa.record_batch([pa.array([json.dumps(doc)]), col], names=["event", "prompt_ids"]),
                   compression="zstd")


def _dictionary_event() -> bytes:
    return _stream(pa.record_batch([pa.array(_docs()).dictionary_encode()], names=["event"]))


def _truncated() -> bytes:
    body = encode_arrow_events([{"type": "trajectory_started", "trajectory_id": "x"}])
    return body[: len(body) - 20]


def _event_not_json() -> bytes:
    return _stream(pa.record_batch([pa.array(["{not json", "[1]"])], names=["event"]))


def _marker_dtype_list() -> bytes:  # once: a 500 (TypeError: unhashable type)
    doc = {"type": "generation", "trajectory_id": "d", "seq": 0, "model_version": 0, "output_ids": [1],
           "prompt_ids": {"$arrow": {"dtype": ["int32"], "shape": [1]}}}
    col = pa.array([np.int32(1).tobytes()], pa.large_binary())
    return _stream(pa.record_batch([pa.array([json.dumps(doc)]), col], names=["event", "prompt_ids"]))


def _column_name_not_utf8() -> bytes:  # once: a 500 (UnicodeDecodeError reading the schema)
    body = encode_arrow_events([{"type": "generation", "trajectory_id": "d", "seq": 0, "model_version": 0,
                                 "output_ids": [1], "prompt_ids": np.array([1], np.int32)}])
    return body.replace(b"prompt_ids", b"\xffrompt_ids", 1)


HOSTILE = {
    "out_of_bounds_offset": (_out_of_bounds_offset, 400, "malformed_body"),
    "offset_past_the_buffer": (_past_the_buffer, 400, "malformed_body"),
    "offsets_out_of_order": (_offsets_out_of_order, 400, "malformed_body"),
    "negative_offset": (_negative_offset, 400, "malformed_body"),
    "invalid_utf8": (_invalid_utf8, 400, "malformed_body"),
    "duplicated_event_column": (_duplicated_event, 400, "malformed_body"),
    "duplicated_binary_column": (_duplicated_binary, 400, "malformed_body"),
    "unknown_column": (_unknown_column, 422, "unknown_field"),  # naming event 0
    "zstd_bomb": (_bomb, 415, "compressed_body"),
    "dictionary_event_column": (_dictionary_event, 400, "malformed_body"),
    "truncated_stream": (_truncated, 400, "malformed_body"),
    "event_not_json": (_event_not_json, 400, "malformed_body"),
    "marker_dtype_a_list": (_marker_dtype_list, 422, "array_dtype"),
    "column_name_not_utf8": (_column_name_not_utf8, 400, "malformed_body"),
}


def test_an_offsets_buffer_longer_than_its_rows_need_is_valid():
    """Arrow lets a buffer be longer than its values need, by any number of
    bytes; the array column's int64 offsets were read assuming a multiple of
    8 (once: a 500, ValueError from numpy)."""
    from fuzz_arrow import _batch, _buffer

    ids = np.array([5, 6, 7], np.int32)
    body = bytearray(encode_arrow_events([{"type": "generation", "trajectory_id": "d", "seq": 0,
                                           "model_version": 0, "output_ids": [1], "prompt_ids": ids}]))
    msg = _batch(bytes(body))
    first, _ = msg["buffers"]
    _, length = _buffer(bytes(body), msg, 3 + 1)  # column 1 (prompt_ids): validity, offsets, data
    struct.pack_into("<q", body, first + 16 * 4 + 8, length + 4)
    (event,) = decode_arrow_events(bytes(body))
    assert np.array_equal(event["prompt_ids"], ids)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_decoding_a_hostile_body_raises_arrow_body_error(name):
    make, status, rule = HOSTILE[name]
    with pytest.raises((ArrowBodyError, ValidationError)) as e:
        decode_arrow_events(make())
    got = e.value.status if isinstance(e.value, ArrowBodyError) else 422  # ValidationError: an event's rule
    assert (got, e.value.rule) == (status, rule)
    assert "\n" not in str(e.value)


@pytest.fixture
def service(store):
    from trajstore.ingest._nodelay import NoDelayHTTPProtocol

    with serve_in_thread(make_app(store, token=TOKEN, max_body_bytes=8 << 20), http=NoDelayHTTPProtocol) as url:
        yield url


def test_hostile_bodies_get_a_4xx_json_error_and_store_nothing(service, store):
    with httpx.Client(timeout=60) as client:
        for name, (make, status, rule) in HOSTILE.items():
            resp = client.post(f"{service}/v1/events", content=make(), headers=HEADERS)
            assert resp.status_code == status, (name, resp.status_code, resp.text[:300])
            err = resp.json()["error"]
            assert err["rule"] == rule and "\n" not in err["message"], (name, err)
            assert client.get(f"{service}/healthz").status_code == 200
        assert store.info()["head_position"] == 0
        ok = client.post(f"{service}/v1/events", headers=HEADERS,
                         content=encode_arrow_events([{"type": "trajectory_started", "trajectory_id": "fine"}]))
        assert ok.status_code == 200 and ok.json()["num_appended"] == 1
        assert 'status="500"' not in client.get(f"{service}/metrics").text


# -- a real `trajstore serve` process ------------------------------------------------------------

def _peak_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_a_real_serve_process_survives_every_hostile_body(tmp_path):
    """The out-of-bounds offset killed ``trajstore serve`` with SIGSEGV (rc
    139); the zstd body raised its peak memory by about what it inflates to."""
    env = {**os.environ, "TRAJSTORE_TOKEN": TOKEN}
    with serve_process("--store", f"sqlite:///{tmp_path}/s.db", "serve", env=env, start_timeout_s=60) as (proc, url):
        with httpx.Client(timeout=60) as client:
            bomb = _bomb(256 << 20)
            assert len(bomb) < 64 << 10
            before = _peak_rss_kib(proc.pid)
            for _ in range(3):
                resp = client.post(f"{url}/v1/events", content=bomb, headers=HEADERS)
                assert resp.status_code == 415, resp.text[:300]
            grown_mib = (_peak_rss_kib(proc.pid) - before) / 1024
            assert grown_mib < 32, f"peak RSS grew {grown_mib:.0f} MiB for {len(bomb)}-byte bodies"
            for name, (make, status, _) in HOSTILE.items():
                try:
                    resp = client.post(f"{url}/v1/events", content=make(), headers=HEADERS)
                except httpx.HTTPError as e:
                    pytest.fail(f"{name}: {type(e).__name__} {e}; serve rc {proc.poll()}")
                assert resp.status_code == status, (name, resp.text[:300])
                assert proc.poll() is None, f"{name}: serve exited with {proc.returncode}"
            assert client.get(f"{url}/healthz").status_code == 200
