"""TCP_NODELAY on the service's accepted connections, however the listening
socket was bound (``--workers N`` binds it with proto 0, and asyncio then
leaves Nagle's algorithm on: ~40 ms per response on a kept-alive connection)."""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn", reason="needs the extra: pip install 'trajstore[server]'")

from trajstore.ingest._nodelay import NoDelayHTTPProtocol  # noqa: E402


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _server_side_nodelay(client_addr: tuple[str, int]) -> int:
    """TCP_NODELAY of this process's socket whose peer is ``client_addr``."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.family == socket.AF_INET and s.type == socket.SOCK_STREAM and s.getpeername() == client_addr:
                return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        except OSError:
            pass
        finally:
            s.close()
    raise AssertionError(f"no server socket connected to {client_addr}")


def _nodelay_of_served_connection(protocol) -> int:
    # bound like uvicorn's Config.bind_socket does for --workers > 1
    listener = socket.socket(family=socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    assert listener.proto == 0
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_app, http=protocol, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/")
        assert conn.getresponse().read() == b"ok"
        value = _server_side_nodelay(conn.sock.getsockname())
        conn.close()
        return value
    finally:
        server.should_exit = True
        thread.join(10)
        listener.close()


def test_plain_uvicorn_protocol_leaves_nagle_on_for_a_proto_0_listener():
    # the bug this module works around; if uvicorn or asyncio fix it, this says so
    assert _nodelay_of_served_connection("auto") == 0


def test_nodelay_protocol_sets_tcp_nodelay_on_accepted_connections():
    assert _nodelay_of_served_connection(NoDelayHTTPProtocol) != 0


def test_service_with_two_workers_answers_on_kept_alive_connections(tmp_path):
    """`trajstore serve --workers 2` starts with the protocol (an import string
    uvicorn resolves in each worker) and serves several requests per connection."""
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "TRAJSTORE_TOKEN": "t", "PYTHONPATH": str(repo)}
    proc = subprocess.Popen([sys.executable, str(repo / "workers" / "ingest_server.py"), "--store",
                             f"sqlite:///{tmp_path}/s.db", "--port", str(port), "--workers", "2"], env=env)
    try:
        for _ in range(600):
            assert proc.poll() is None, "service exited"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for _ in range(5):
            conn.request("GET", "/healthz")
            assert conn.getresponse().read() == b'{"status":"ok"}'
        conn.close()
    finally:
        proc.terminate()
        proc.wait(30)
