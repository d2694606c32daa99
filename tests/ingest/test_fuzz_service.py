"""Over HTTP: mutated events and hostile bodies against the real
ingest service on loopback. Every request is stored (200) or refused with a
4xx and the JSON error body; the service never answers 500 and never dies;
counts change only by what was acknowledged; ``materialize`` works after.

Also the service's JSON decoding: long integer arrays are parsed straight to
numpy (docs/ingest.md "Memory"); hypothesis checks that this gives exactly
what ``json.loads`` gives."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from fuzz_events import Refused, make_units, run_fuzz_concurrently  # noqa: E402
from openai_upstream import serve_in_thread  # noqa: E402
from sqlalchemy import func, select  # noqa: E402
from trajstore.ingest.arrow_body import ARROW_CONTENT_TYPE, encode_arrow_events  # noqa: E402
from trajstore.ingest._http import HTTPError as _HTTPError  # noqa: E402
from trajstore.ingest.service import decode_json, make_app  # noqa: E402
from trajstore.ingest.sinks import encode_events  # noqa: E402
from trajstore.schema import events as events_table  # noqa: E402

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def _serve(store):
    from trajstore.ingest._nodelay import NoDelayHTTPProtocol  # the protocol `trajstore serve` runs

    return serve_in_thread(make_app(store, token=TOKEN, max_body_bytes=8 << 20), http=NoDelayHTTPProtocol)


@pytest.fixture
def service(store):
    with _serve(store) as url:
        yield url


@pytest.fixture(scope="module")
def refusing(module_store_url, tmp_path_factory):
    """One service per backend for the hostile bodies: each is refused, so the store stays
    empty and every test checks that against all the bodies sent before it too."""
    import trajstore

    store = trajstore.connect(module_store_url, payload=str(tmp_path_factory.mktemp("hostile") / "payload"))
    try:
        with _serve(store) as url:
            yield url, store
    finally:
        store.close()


def _count_events(store) -> int:
    with store.log.read_engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(events_table)).scalar_one()


_BODIES = {"json": (encode_events, "application/json"), "arrow": (encode_arrow_events, ARROW_CONTENT_TYPE)}


def _poster(url: str, client: "httpx.Client", body: str = "json"):
    encode, content_type = _BODIES[body]
    headers = {**AUTH, "Content-Type": content_type}
    if body == "json":
        encode = _json_encoder()

    def append(events: list) -> int:
        resp = client.post(f"{url}/v1/events", content=encode(events), headers=headers)
        if resp.status_code == 200:
            return resp.json()["num_appended"]
        assert 400 <= resp.status_code < 500, f"{resp.status_code}: {resp.text[:500]}"
        err = resp.json()["error"]
        assert set(err) == {"index", "trajectory_id", "rule", "message"} and "\n" not in err["message"]
        raise Refused(resp.status_code, err["index"], err["rule"])

    return append


def _json_encoder():
    """``encode_events``'s bytes, each event encoded once: a refusal drops one unit of a
    request and sends the rest again, and encoding them anew each time was a fifth of
    the 10,000-event run. ``{"events":[a,b]}`` is ``{"events":[`` + a + ``,`` + b + ``]}``
    in compact JSON; the first body is checked against ``encode_events`` itself."""
    encoded: dict[int, tuple[dict, bytes]] = {}  # id(event) -> (the event, kept alive; its JSON)
    checked = False

    def encode(events: list) -> bytes:
        nonlocal checked
        parts = []
        for ev in events:
            hit = encoded.get(id(ev))
            if hit is None:
                hit = encoded[id(ev)] = (ev, encode_events([ev])[len(b'{"events":['):-len(b"]}")])
            parts.append(hit[1])
        got = b'{"events":[' + b",".join(parts) + b"]}"
        if not checked:
            assert got == encode_events(events)
            checked = True
        return got

    return encode


# Eight clients at once (one at a time, 10,000 took ~9 minutes: each request
# waits for its own commit). 1,000 run on both backends and both bodies (the
# Writer sends Arrow IPC by default, and the same mutated events must be stored
# or refused with a 4xx there too); 10,000 run with the slow tests on
# PostgreSQL only (the service's production backend) with JSON bodies, where
# the wire mutations land (test_fuzz_service_10k.py: a file of its own, as long
# as this one); the same 10,000 go through store.append on both backends in
# test_fuzz_wire.py, and a second HTTP run added little but time.
@pytest.mark.parametrize("body", ["json", "arrow"])
def test_mutated_events_over_http_are_stored_or_refused(service, store, body):
    _fuzz_over_http(service, store, 1_000, body)


def _fuzz_over_http(service: str, store, num_mutated: int, body: str) -> None:
    units = make_units(num_mutated, seed=7)
    clients: list = []

    def make_append():
        clients.append(httpx.Client(timeout=60))
        return _poster(service, clients[-1], body)

    try:
        stats = run_fuzz_concurrently(make_append, units, clients=8, refusal=Refused)
    finally:
        for c in clients:
            c.close()
    with httpx.Client(timeout=60) as client:
        assert client.get(f"{service}/healthz").status_code == 200
        metrics = client.get(f"{service}/metrics").text
    assert stats.refused_units > num_mutated // 5 and stats.accepted_units > num_mutated // 20, stats
    assert 'status="500"' not in metrics
    assert _count_events(store) == stats.appended_events
    assert store.materialize().num_samples_after > 0


def _deep(depth: int) -> bytes:
    return b'{"events": [' + b"[" * depth + b"]" * depth + b"]}"


@pytest.mark.parametrize("body, status, rule", [
    (b"[" * 100_000 + b"]" * 100_000, 400, "malformed_json"),
    (_deep(100_000), 400, "malformed_json"),
    (b'{"events": [' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"]}", 400, "malformed_json"),
    (b'{"events": [{"type": "reward", "trajectory_id": "t", "reward": 1, "x": ' + b"[" * 500 + b"]" * 500 + b"}]}",
     422, "unknown_field"),
    (b'{"events": [{"type": "generation", "trajectory_id": "t", "seq": 0, "prompt_ids": '
     + b"[" * 900 + b"1" + b"]" * 900 + b', "output_ids": [1], "model_version": 0}]}', 422, "array_shape"),
    (b'{"events": [{"type": "trajectory_started", "trajectory_id": "t", "metadata": '
     + b'{"a":' * 900 + b"1" + b"}" * 900 + b"}]}", 422, "metadata"),
    (b"\xff\xfe{}", 400, "malformed_json"),
    (b'{"events": [{"type": "trajectory_started", "trajectory_id": "\\udc80"}]}', 422, "trajectory_id"),
    (b'{"events": [{"type": ["generation"], "trajectory_id": "t"}]}', 422, "unknown_type"),
    (b'{"events": [{"type": "reward", "trajectory_id": "t", "reward": NaN}]}', 422, "non_finite"),
    (b'{"events": [{"type": "reward", "trajectory_id": "t", "reward": 1e400}]}', 422, "non_finite"),
    (b'{"events": [{"type": "reward", "trajectory_id": "t", "reward": ' + b"9" * 5000 + b"}]}", 400, "malformed_json"),
    (b'{"events": [{"type": "generation", "trajectory_id": "t", "seq": 0, "model_version": 0, "output_ids": [1], '
     b'"prompt_ids": [' + b",".join([b"1"] * 100 + [b"99999999999999999999"]) + b"]}]}", 422, "int32_range"),
    (b'{"events": [{"type": "generation", "trajectory_id": "t", "seq": 0, "model_version": 0, "output_ids": [1], '
     b'"prompt_ids": [' + b",".join([b"1"] * 100 + [b"2147483648"]) + b"]}]}", 422, "int32_range"),
    (b'{"events": [{"type": "generation", "trajectory_id": "t", "seq": 0, "model_version": 0, "output_ids": [1], '
     b'"prompt_ids": [' + b",".join([b"1"] * 100 + [b"-1"]) + b"]}]}", 422, "negative_token_id"),
    (b'{"events": 5}', 400, "malformed_body"),
])
def test_hostile_bodies_get_4xx_never_500(refusing, body, status, rule):
    service, store = refusing
    resp = httpx.post(f"{service}/v1/events", content=body, headers=AUTH, timeout=60)
    assert (resp.status_code, resp.json()["error"]["rule"]) == (status, rule), resp.text[:300]
    assert httpx.get(f"{service}/healthz").status_code == 200
    assert _count_events(store) == 0


# --- the fast integer-array path of the service's JSON decoding --------------------------------

def _plain(value):
    """``value`` with numpy arrays as lists (what json.loads would have built)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


ints = st.integers(-(2**63), 2**63 - 1) | st.integers(-300, 300) | st.integers(0, 2**31)
int_lists = st.lists(ints, min_size=0, max_size=200)
leaf = st.none() | st.booleans() | ints | st.floats(allow_nan=False) | st.text(max_size=20) | int_lists
documents = st.recursive(leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                         max_leaves=20)
separators = st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["prompt_ids", "output_ids", "meta", "x", "routed_experts"]), documents,
                       max_size=5), separators)
def test_decode_json_equals_json_loads(doc, seps):
    body = json.dumps({"events": [doc], "s": json.dumps(doc)}, separators=seps).encode()
    assert _plain(decode_json(body)) == json.loads(body)


def test_decode_json_parses_long_integer_arrays_to_numpy_only_where_arrays_belong():
    ids = list(range(1000))
    text = json.dumps(ids)
    body = json.dumps({"events": [{"prompt_ids": ids, "metadata": {"ids": ids, "s": text}},
                                  {"output_ids": [2**40] * 100}]}).encode()
    doc = decode_json(body)
    ev = doc["events"][0]
    assert isinstance(ev["prompt_ids"], np.ndarray) and ev["prompt_ids"].dtype == np.int32
    assert ev["metadata"]["ids"] == ids and ev["metadata"]["s"] == text  # plain JSON outside ARRAY fields
    assert doc["events"][1]["output_ids"].dtype == np.int64
    with pytest.raises(_HTTPError) as e:
        decode_json(b'{"prompt_ids": [' + b"01," * 100 + b"1]}")  # not JSON: a leading zero
    assert e.value.status == 400
    assert math.isnan(decode_json(b"[NaN]")[0])


# Strings the scan must step over whole: long ones (base64 routes), ones holding brackets,
# colons, quotes and backslashes, or an integer list's JSON text.
long_ids = st.lists(st.integers(10**6, 2**31 - 1), min_size=100, max_size=300)  # >= 256 bytes of text
tricky_text = st.one_of(
    st.text(alphabet='[]:,"\\ 0123456789abc/', max_size=40),
    long_ids.map(lambda v: ':' + json.dumps(v)),
    st.integers(1, 5000).map(lambda n: "QUJD" * n),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["prompt_ids", "a", "routed_experts", "meta"]),
                          st.one_of(tricky_text, long_ids, st.lists(tricky_text, max_size=3))),
                min_size=1, max_size=6),
       separators, st.booleans())
def test_decode_json_steps_over_strings_whole(members, seps, escape_slash):
    """Long and tricky strings before, between and inside the members: the integer
    arrays outside strings are found, nothing inside a string is touched."""
    text = json.dumps({"events": [dict(members)], "s": json.dumps(dict(members))}, separators=seps)
    if escape_slash:  # some encoders write "/" as "\/" (base64 has slashes)
        text = text.replace("/", "\\/")
    body = text.encode()
    doc = decode_json(body)
    assert _plain(doc) == json.loads(body)
    assert _plain(decode_json(bytearray(body))) == _plain(doc)  # the service reads into a bytearray
    ev = doc["events"][0]
    if seps[0] not in (",", ", "):
        return  # lists with newlines or tabs are json.loads's (_int_list declines them)
    for key, value in dict(members).items():
        if isinstance(value, list) and value and isinstance(value[0], int) and key in ("prompt_ids", "routed_experts"):
            assert isinstance(ev[key], np.ndarray)  # found after whatever strings came first


def test_decode_json_refuses_deep_nesting_of_member_arrays():
    # every "[" is an object member's value and its "]" lies at the far end: the scan
    # stops at the first character an integer list cannot hold, json.loads refuses
    body = b'{"a":[' * 100_000 + b"1" + b"]}" * 100_000
    with pytest.raises(_HTTPError) as e:
        decode_json(body)
    assert e.value.status == 400


def _json_int_list(text: bytes):
    """What json.loads makes of ``[text]`` when it is a list of int64 integers, else None."""
    try:
        value = json.loads(b"[" + text + b"]")
    except ValueError:
        return None
    if all(isinstance(v, int) and -(2**63) <= v < 2**63 for v in value):
        return value
    return None


@settings(max_examples=500, deadline=None)
@given(st.one_of(
    st.text(alphabet="0123456789,- \n\t", max_size=40).map(str.encode),
    st.lists(st.integers(-(2**70), 2**70), max_size=30).map(lambda v: json.dumps(v)[1:-1].encode()),
    st.tuples(st.lists(ints, min_size=1, max_size=30), st.integers(0, 200), st.sampled_from("0123456789,- \n"))
      .map(lambda t: (lambda s: (s[:t[1]] + t[2] + s[t[1]:]).encode())(json.dumps(t[0])[1:-1])),
))
def test_int_list_is_json_or_declines(text):
    from trajstore.ingest._json_body import _int_list

    got = _int_list(text)
    expected = _json_int_list(text)
    if got is not None:
        assert expected is not None and got.tolist() == expected  # never accepts what JSON refuses
    elif expected is not None:  # declines only whitespace other than json.dumps's ", ", or 19+ digits
        assert (any(c in text.replace(b", ", b",") for c in b" \t\n") or not expected
                or any(abs(v) >= 10**18 for v in expected)), text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789,- ", max_size=60).map(str.encode), st.integers(1, 8))
def test_windowed_json_integer_check_equals_the_whole(text, step):
    from trajstore.ingest._json_body import _json_integers

    b = np.frombuffer(text, np.uint8)
    assert _json_integers(b, step=step) == _json_integers(b, step=1 << 20)
