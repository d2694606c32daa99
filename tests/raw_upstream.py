"""A loopback HTTP server that answers with exactly the bytes a test gives it.

The recording proxy must survive whatever an engine sends: odd JSON, a
stream cut after some chunks, a close-delimited body that just stops. A real
server framework would not send such bytes, so this one writes the raw
response itself: ``RawUpstream.reply`` is called with (method, path, body)
and returns the list of byte strings to write; the connection is closed
after the last one (or mid-body, when the reply is a cut).

Framings (``framed``): ``length`` (Content-Length), ``chunked``
(Transfer-Encoding, terminated), ``chunked-cut`` (no terminating chunk: the
reader sees a broken body), ``close`` (no length: the body ends when the
connection closes, so a cut cannot be told from the end).

Server-sent events (``sse_event``, ``sse``, ``SSE_DONE``): the ``data:`` lines
every test engine streams, a JSON object each, and the ``data: [DONE]`` that
ends an OpenAI-style stream.
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any, Callable, Iterable

FRAMINGS = ("length", "chunked", "chunked-cut", "close")

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(obj: Any) -> bytes:
    """One server-sent event: ``data:`` and ``obj`` as JSON, then the blank line that ends it."""
    return f"data: {json.dumps(obj)}\n\n".encode()


def sse(objs: Iterable[Any], *, done: bool = False) -> list[bytes]:
    """The events of a stream of JSON objects, and ``data: [DONE]`` after them when ``done``."""
    return [sse_event(obj) for obj in objs] + ([SSE_DONE] if done else [])


def framed(pieces: list[bytes], *, framing: str = "length", status: int = 200,
           content_type: str = "application/json") -> list[bytes]:
    """The writes of one HTTP/1.1 response whose body is ``pieces`` (sent one write each)."""
    head = f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\nconnection: close\r\n"
    if framing == "length":
        return [(head + f"content-length: {sum(map(len, pieces))}\r\n\r\n").encode(), *pieces]
    if framing in ("chunked", "chunked-cut"):
        chunks = [b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p]
        tail = [] if framing == "chunked-cut" else [b"0\r\n\r\n"]
        return [(head + "transfer-encoding: chunked\r\n\r\n").encode(), *chunks, *tail]
    if framing == "close":
        return [(head + "\r\n").encode(), *pieces]
    raise ValueError(framing)


class RawUpstream:
    """Serves on 127.0.0.1 until ``close()``; ``url`` is its base URL, ``requests`` what it received."""

    def __init__(self, reply: Callable[[str, str, bytes], list[bytes]]) -> None:
        self.reply = reply
        self.requests: list[tuple[str, str, bytes]] = []
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:
                got = conn.recv(65536)
                if not got:
                    return
                data += got
            head, _, body = data.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            while len(body) < length:
                got = conn.recv(65536)
                if not got:
                    return
                body += got
            self.requests.append((method, path, body))
            for piece in self.reply(method, path, body):
                conn.sendall(piece)
        except OSError:
            pass
        finally:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def __enter__(self) -> "RawUpstream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
