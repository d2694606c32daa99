"""The service's HTTP protocol reads a POST body with a Content-Length whole
into one buffer (``trajstore.ingest._nodelay``, ASGI extension
``BODY_EXTENSION``): multi-read bodies, ``Expect: 100-continue``, pipelined
requests, a client that leaves mid-body, a body longer or shorter than
declared, through a bare ASGI app and through the ingest app."""

from __future__ import annotations

import hashlib
import json
import socket
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("httptools", reason="the whole-body path extends uvicorn's httptools protocol")

from openai_upstream import serve_in_thread  # noqa: E402
from trajstore.ingest._nodelay import BODY_EXTENSION, NoDelayHTTPProtocol  # noqa: E402
from trajstore.ingest.arrow_body import ARROW_CONTENT_TYPE, encode_arrow_events  # noqa: E402
from trajstore.ingest.service import make_app  # noqa: E402

TOKEN = "body-token"


async def _read_messages(receive) -> bytes:
    """A request's body read as an ASGI app does without the extension: message by message."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def _digest_app(scope, receive, send):
    """Answers ``{"whole": <extension used>, "n": <bytes>, "sha": <sha256>}`` for any POST."""
    if scope["type"] != "http":
        return
    ext = scope.get("extensions", {}).get(BODY_EXTENSION)
    if ext is not None:
        body = bytes(await ext())
    else:
        body = await _read_messages(receive)
    data = json.dumps({"whole": ext is not None, "n": len(body), "sha": hashlib.sha256(body).hexdigest()}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _read_responses(sock: socket.socket, count: int) -> list[bytes]:
    """``count`` HTTP responses' bodies (each with a Content-Length) from ``sock``."""
    data, out = b"", []
    sock.settimeout(30)
    while len(out) < count:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, "connection closed early"
            data += chunk
        head, _, data = data.partition(b"\r\n\r\n")
        if head.startswith(b"HTTP/1.1 100"):
            continue
        length = int([h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")][0])
        while len(data) < length:
            data += sock.recv(65536)
        out.append(data[:length])
        data = data[length:]
    return out


def test_a_multi_read_body_arrives_whole_and_intact():
    body = np.random.default_rng(1).integers(0, 256, 5 << 20, dtype=np.uint8).tobytes()
    with serve_in_thread(_digest_app, http=NoDelayHTTPProtocol) as url:
        got = httpx.post(f"{url}/x", content=body, timeout=30).json()
        chunked = httpx.post(f"{url}/x", content=iter([body[:1000], body[1000:]]), timeout=30).json()
    assert got == {"whole": True, "n": len(body), "sha": hashlib.sha256(body).hexdigest()}
    # without a Content-Length (chunked) the app reads the ASGI messages as before
    assert chunked == {"whole": False, "n": len(body), "sha": hashlib.sha256(body).hexdigest()}


async def _receive_app(scope, receive, send):
    """Offered the extension but reads ``receive`` (a mounted app, say): answers like ``_digest_app``."""
    if scope["type"] != "http":
        return
    body = await _read_messages(receive)
    data = json.dumps({"offered": BODY_EXTENSION in scope.get("extensions", {}), "n": len(body),
                       "sha": hashlib.sha256(body).hexdigest()}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def test_an_app_that_reads_receive_gets_the_pieces_kept_before_it_asked():
    # The protocol keeps the first pieces of an offered body aside (for the extension):
    # an app that reads ASGI messages instead must still get every byte, in order.
    rng = np.random.default_rng(3)
    bodies = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (10, 70_000, 3 << 20)]
    with serve_in_thread(_receive_app, http=NoDelayHTTPProtocol) as url:
        with socket.create_connection(("127.0.0.1", _port(url))) as sock:
            for body in bodies:
                sock.sendall(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body))
                time.sleep(0.05)  # the head alone first: the body comes in later reads
                sock.sendall(body[:1000])
                time.sleep(0.05)
                sock.sendall(body[1000:])
                answer = _read_responses(sock, 1)[0]
                assert json.loads(answer) == {"offered": True, "n": len(body), "sha": hashlib.sha256(body).hexdigest()}


def test_expect_100_continue_and_pipelined_requests_on_one_connection():
    bodies = [b"a" * 300_000, b"b" * 10, b""]
    with serve_in_thread(_digest_app, http=NoDelayHTTPProtocol) as url:
        with socket.create_connection(("127.0.0.1", _port(url))) as sock:
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
                         % len(bodies[0]))
            sock.settimeout(10)
            assert sock.recv(64).startswith(b"HTTP/1.1 100 Continue")  # sent when the app asks for the body
            sock.sendall(bodies[0])
            first = _read_responses(sock, 1)
            sock.sendall(b"".join(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(b), b)
                                  for b in bodies[1:]))  # two requests in one write
            rest = _read_responses(sock, 2)
    for body, answer in zip(bodies, first + rest):
        assert json.loads(answer) == {"whole": True, "n": len(body), "sha": hashlib.sha256(body).hexdigest()}


def _events(tid: str, tokens: int) -> list[dict]:
    rng = np.random.default_rng(len(tid))
    return [{"type": "trajectory_started", "trajectory_id": tid, "num_experts": 16},
            {"type": "generation", "trajectory_id": tid, "seq": 0, "model_version": 1,
             "prompt_ids": rng.integers(0, 1000, tokens, dtype=np.int32), "output_ids": np.arange(4, dtype=np.int32),
             "logprobs": np.full(4, -0.5, np.float32),
             "routed_experts": rng.integers(0, 16, (tokens + 3, 4, 2), dtype=np.uint8)}]


def _in_flight(url: str) -> int:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("trajstore_ingest_body_bytes_in_flight "):
            return int(float(line.split()[1]))
    raise AssertionError("no gauge")


def test_ingest_app_reads_whole_bodies_and_survives_clients_that_leave(store):
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": ARROW_CONTENT_TYPE}
    big = encode_arrow_events(_events("big", 200_000))  # ~2 MB: several reads
    with serve_in_thread(make_app(store, token=TOKEN), http=NoDelayHTTPProtocol) as url:
        port = _port(url)
        # half a body, then the client goes away: nothing stored, the budget given back
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/events HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer %s\r\nContent-Type: %s\r\n"
                         b"Content-Length: %d\r\n\r\n" % (TOKEN.encode(), ARROW_CONTENT_TYPE.encode(), len(big))
                         + big[: len(big) // 2])
            time.sleep(0.2)
        for _ in range(100):
            if _in_flight(url) == 0:
                break
            time.sleep(0.05)
        assert _in_flight(url) == 0
        # a body shorter than its Content-Length, closed: same
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/events HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer %s\r\nContent-Length: 10\r\n"
                         b"\r\n{}" % TOKEN.encode())
            sock.shutdown(socket.SHUT_WR)
            time.sleep(0.2)
        resp = httpx.post(f"{url}/v1/events", content=big, headers=headers, timeout=60)
        assert resp.status_code == 200 and resp.json()["num_appended"] == 2
        # JSON bodies take the same path; a refused one is still a 4xx
        bad = httpx.post(f"{url}/v1/events", content=b'{"events": [{"type": "nope"}]}',
                         headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert bad.status_code == 422 and bad.json()["error"]["rule"] == "unknown_type"
        assert _in_flight(url) == 0
    # only the whole request was stored (the halves and the short body left nothing)
    assert [g.trajectory_id for g in store.load_generations("big")] == ["big"]
    assert store.trajectory_state("big") is not None and store.info()["samples"] == 0
