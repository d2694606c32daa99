"""uvicorn's HTTP protocol as the ingest service runs it: ``TCP_NODELAY``, and whole bodies read into one buffer.

``TCP_NODELAY``: asyncio sets it on an accepted socket only when the socket's
``proto`` is ``IPPROTO_TCP``. With ``--workers N`` uvicorn binds the
listening socket itself as ``socket.socket(family)``, whose ``proto`` is 0,
and so are the sockets it accepts: asyncio leaves Nagle's algorithm on, and
every response on a kept-alive connection waits for the client's delayed ACK
(~40 ms on Linux). This protocol sets the option itself, whatever bound the
socket.

Whole bodies (httptools only): uvicorn hands a body to the app in pieces of
about 64 KiB, each copied twice on the way (into the cycle's buffer, then out
of it as ``bytes``) and each a pause and resume of the socket and a wake-up
of the app's task: for a 1-MiB event that is a quarter of the service's CPU
outside ``store.append``. A ``POST`` with a ``Content-Length`` gets the ASGI
extension ``scope["extensions"][BODY_EXTENSION]``: an async function the app
calls once (after it has taken the body's bytes from its budget) that
returns the whole body in one buffer of that size. From that call on, the
body's chunks are copied straight into the buffer as they are parsed, the
socket is not paused, and the app is woken once, when the message is
complete. Until the app calls it, uvicorn's own flow control holds the body
in the client's socket as before (about 64 KiB plus one read are taken
meanwhile: kept as the pieces the parser gave, not joined; a body that
arrived whole in one piece is returned as it is, without a copy; an app that
reads ``receive`` instead gets them joined in its first message).
``ConnectionError`` when the client goes away first. Imported by ``trajstore.ingest.service.serve`` only (it needs
uvicorn).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT

__all__ = ["BODY_EXTENSION", "NoDelayHTTPProtocol", "set_nodelay"]

BODY_EXTENSION = "trajstore.whole_body"
# Bytes asyncio reads from a socket per call (its default is 256 KiB): a 1-MiB body in one or two reads.
_READ_SIZE = 1 << 20


def set_nodelay(transport) -> None:
    """Turn Nagle's algorithm off on ``transport``'s TCP socket (no-op for others)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:  # already closed by the peer: nothing to speed up
        pass


class _Sink:
    """The buffer one request's body is being copied into."""

    __slots__ = ("cycle", "buffer", "view", "got", "done")

    def __init__(self, cycle: Any, buffer: bytearray, got: int, done: asyncio.Future) -> None:
        self.cycle, self.buffer, self.view, self.got, self.done = cycle, buffer, memoryview(buffer), got, done


def _whole_bodies_supported() -> bool:
    """uvicorn's httptools protocol, whose parser callbacks this module extends."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return False
    return issubclass(AutoHTTPProtocol, HttpToolsProtocol)


_WHOLE_BODIES = _whole_bodies_supported()


class NoDelayHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    _sink: _Sink | None = None
    _early: _WholeBody | None = None  # the offered extension that keeps the body's first pieces

    def connection_made(self, transport) -> None:  # type: ignore[override]
        set_nodelay(transport)
        if _WHOLE_BODIES and hasattr(transport, "max_size"):
            transport.max_size = _READ_SIZE
        super().connection_made(transport)

    if _WHOLE_BODIES:
        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is None or cycle.scope is not self.scope or self.scope.get("method") != "POST":
                return  # an upgrade (no cycle of its own), or nothing to read whole
            length = None
            for name, value in self.headers:
                if name == b"transfer-encoding":
                    return
                if name == b"content-length" and length is None and value.isdigit():
                    length = int(value)
            if length is None or not all(hasattr(cycle, a) for a in (
                    "body", "more_body", "disconnected", "waiting_for_100_continue", "message_event")):
                return
            whole = self._early = _WholeBody(self, cycle, length)
            self.scope.setdefault("extensions", {})[BODY_EXTENSION] = whole
            receive = cycle.receive

            async def receive_joined() -> Any:  # the app reads ASGI messages after all: pieces kept go first
                whole.join_early()
                return await receive()

            cycle.receive = receive_joined  # run_asgi passes the app ``cycle.receive`` when it starts

        def on_body(self, body: bytes) -> None:
            sink = self._sink
            if sink is None or sink.cycle is not self.cycle:
                early = self._early
                if (early is None or early.cycle is not self.cycle or self.cycle.response_complete
                        or self.parser.should_upgrade()):
                    super().on_body(body)
                    return
                # uvicorn would join the pieces (``cycle.body += body``): one copy of the body's first MiB
                early.pieces.append(body)
                early.got += len(body)
                if early.got > HIGH_WATER_LIMIT:
                    self.flow.pause_reading()
                self.cycle.message_event.set()
                return
            end = sink.got + len(body)
            if end > len(sink.buffer):  # the parser frames by Content-Length: not expected
                if not sink.done.done():
                    sink.done.set_exception(ConnectionError("body longer than its Content-Length"))
                return
            sink.view[sink.got:end] = body
            sink.got = end

        def on_message_complete(self) -> None:
            super().on_message_complete()
            sink = self._sink
            if sink is not None and sink.cycle is self.cycle and not sink.done.done():
                sink.done.set_result(None)

        def connection_lost(self, exc: Exception | None) -> None:
            sink = self._sink
            super().connection_lost(exc)
            if sink is not None and not sink.done.done():
                sink.done.set_exception(ConnectionError("the client closed the connection"))


class _WholeBody:
    """The extension: ``await ext()`` is the request's whole body (see the module docstring)."""

    __slots__ = ("protocol", "cycle", "length", "pieces", "got")

    def __init__(self, protocol: NoDelayHTTPProtocol, cycle: Any, length: int) -> None:
        self.protocol, self.cycle, self.length = protocol, cycle, length
        self.pieces: list[bytes] = []  # what arrived before the app asked, as the parser gave it
        self.got = 0

    def _stop_early(self) -> list[bytes]:
        """The pieces kept so far; from now on uvicorn (or a sink) takes the body."""
        if self.protocol._early is self:
            self.protocol._early = None
        pieces, self.pieces = self.pieces, []
        return pieces

    def join_early(self) -> None:
        """Hand the pieces kept to uvicorn's buffer, for an app that reads ``receive``."""
        pieces = self._stop_early()
        if pieces:
            self.cycle.body = self.cycle.body + b"".join(pieces)

    async def __call__(self) -> bytes | bytearray:
        protocol, cycle = self.protocol, self.cycle
        if cycle.disconnected:
            raise ConnectionError("the client closed the connection")
        if cycle.waiting_for_100_continue and not protocol.transport.is_closing():
            protocol.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        pieces = self._stop_early()
        if cycle.body:  # uvicorn's buffer (not expected: pieces are kept from the first one on)
            pieces.insert(0, bytes(cycle.body))
            cycle.body = type(cycle.body)()
        got = sum(len(p) for p in pieces)
        if got > self.length:
            raise ConnectionError("body longer than its Content-Length")
        if not cycle.more_body:
            if got != self.length:
                raise ConnectionError(f"body ended after {got} of its {self.length} bytes")
            if len(pieces) == 1:
                return pieces[0]  # arrived in one piece: no copy
        buffer = bytearray(self.length)
        at = 0
        for piece in pieces:
            buffer[at:at + len(piece)] = piece
            at += len(piece)
        if not cycle.more_body:
            return buffer
        sink = _Sink(cycle, buffer, got, asyncio.get_running_loop().create_future())
        protocol._sink = sink
        try:
            protocol.flow.resume_reading()
            await sink.done
        finally:
            protocol._sink = None
            sink.view.release()
        if sink.got != self.length:
            raise ConnectionError(f"body ended after {sink.got} of its {self.length} bytes")
        return buffer
