"""uvicorn's HTTP protocol with ``TCP_NODELAY`` on every accepted connection.

asyncio sets ``TCP_NODELAY`` on an accepted socket only when the socket's
``proto`` is ``IPPROTO_TCP``. With ``--workers N`` uvicorn binds the
listening socket itself as ``socket.socket(family)``, whose ``proto`` is 0,
and so are the sockets it accepts: asyncio leaves Nagle's algorithm on, and
every response on a kept-alive connection waits for the client's delayed ACK
(~40 ms on Linux). This protocol sets the option itself, whatever bound the
socket. Imported by ``trajstore.ingest.service.serve`` only (it needs uvicorn).
"""

from __future__ import annotations

import socket

from uvicorn.protocols.http.auto import AutoHTTPProtocol

__all__ = ["NoDelayHTTPProtocol", "set_nodelay"]


def set_nodelay(transport) -> None:
    """Turn Nagle's algorithm off on ``transport``'s TCP socket (no-op for others)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:  # already closed by the peer: nothing to speed up
        pass


class NoDelayHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    def connection_made(self, transport) -> None:  # type: ignore[override]
        set_nodelay(transport)
        super().connection_made(transport)
