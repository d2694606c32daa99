"""Reading a ``POST /v1/events`` body off raw ASGI, the byte budget on bodies in flight, and the
Arrow body parsed into events.

``read_body`` refuses a body (413) as soon as it is over the limit;
``ByteBudget`` bounds the bytes of bodies read, parsed or committing at once
(docs/ingest.md "Memory"). Errors are ``trajstore.ingest._http.HTTPError``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Mapping, Sequence

from trajstore.errors import ValidationError
from trajstore.events import Generation, parse_events
from trajstore.ingest._http import HTTPError as _HTTPError

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_BYTES_IN_FLIGHT", "ByteBudget", "ClientGone", "declared_length",
           "events_of", "header", "is_arrow", "parse_arrow_body", "read_body", "send_json"]

log = logging.getLogger("trajstore.ingest.service")  # refused bodies are logged as the service's

DEFAULT_MAX_BODY_BYTES = 64 << 20
DEFAULT_MAX_BYTES_IN_FLIGHT = 128 << 20


def parse_arrow_body(body: bytes) -> tuple[list, int]:
    """``parse_body`` for an Arrow IPC stream body (``trajstore.ingest.arrow_body``)."""
    from trajstore.ingest.arrow_body import ArrowBodyError, decode_arrow_events

    try:
        raw = decode_arrow_events(body)
    except ArrowBodyError as e:
        raise _HTTPError(e.status, str(e), rule=e.rule) from None
    except ValidationError as e:
        raise _HTTPError.from_error(e) from None
    except Exception as e:  # noqa: BLE001 - whatever else the bytes provoke is the body's fault, not a 500
        log.warning("Arrow body refused by an unexpected %s: %s", type(e).__name__, e)
        raise _HTTPError(400, f"body is not a readable Arrow IPC stream ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''})",
                         rule="malformed_body") from None
    return events_of(raw)


def events_of(raw: list) -> tuple[list, int]:
    """Each wire event parsed (a refusal names its index in the body), and their token count."""
    try:
        events = parse_events(raw)
    except ValidationError as e:
        raise _HTTPError.from_error(e) from None
    return events, sum(ev.num_tokens for ev in events if isinstance(ev, Generation))


def is_arrow(content_type: str | None) -> bool:
    from trajstore.ingest.arrow_body import ARROW_CONTENT_TYPE

    return (content_type or "").split(";")[0].strip().lower() == ARROW_CONTENT_TYPE


_WHOLE_BODY = "trajstore.whole_body"  # trajstore.ingest._nodelay.BODY_EXTENSION (that module needs uvicorn)


class ClientGone(Exception):
    """The client disconnected before its body was read: nobody to answer."""


async def read_body(scope: Mapping[str, Any], receive: Any, declared: int | None,
                     max_body_bytes: int) -> bytes | bytearray:
    """The request body, refused (413) as soon as it is over the limit.

    Served by ``serve`` (``trajstore.ingest._nodelay``), a body with a
    ``Content-Length`` is read whole into one buffer by the HTTP protocol.
    Otherwise it comes from ASGI ``receive``: a body that arrives in one
    message is used as it is (no copy); otherwise,
    with a ``Content-Length`` the chunks are copied straight into one buffer
    of that size (no growth, no re-allocation of a MiB-sized body); without
    one they are appended to a growing buffer. Never joined."""
    whole = scope.get("extensions", {}).get(_WHOLE_BODY) if declared is not None else None
    if whole is not None and whole.length == declared:
        try:
            return await whole()
        except ConnectionError:
            raise ClientGone() from None
    message = await receive()
    if message["type"] != "http.request":
        raise ClientGone()
    chunk = message.get("body", b"")
    if not message.get("more_body", False):
        if len(chunk) > max_body_bytes:
            raise _HTTPError(413, f"body is over the {max_body_bytes}-byte limit", rule="body_too_large")
        if declared is not None and len(chunk) != declared:
            raise _HTTPError(400, f"body of {len(chunk)} bytes does not match its Content-Length of {declared}",
                             rule="malformed_body")
        return chunk
    if declared:
        body = bytearray(declared)
        view = memoryview(body)
        got = 0
        while True:
            end = got + len(chunk)
            if end > declared:  # more than declared: the server would have refused; be safe anyway
                raise _HTTPError(400, f"body is longer than its Content-Length of {declared} bytes",
                                 rule="malformed_body")
            view[got:end] = chunk
            got = end
            if not message.get("more_body", False):
                break
            message = await receive()
            if message["type"] != "http.request":
                raise ClientGone()
            chunk = message.get("body", b"")
        view.release()
        if got != declared:
            raise _HTTPError(400, f"body ended after {got} of its {declared} bytes", rule="malformed_body")
        return body
    grown = bytearray()
    while True:
        if len(grown) + len(chunk) > max_body_bytes:
            raise _HTTPError(413, f"body is over the {max_body_bytes}-byte limit", rule="body_too_large")
        grown += chunk
        if not message.get("more_body", False):
            return grown
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone()
        chunk = message.get("body", b"")


def header(scope: Mapping[str, Any], name: bytes) -> str | None:
    """The first value of header ``name`` (lower case) of an ASGI request, as latin-1 text."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def declared_length(scope: Mapping[str, Any]) -> int | None:
    declared = header(scope, b"content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


async def send_json(send: Any, status: int, body: Any, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """A JSON answer, as FastAPI's ``JSONResponse`` renders it."""
    data = json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(data)).encode()), (b"content-type", b"application/json"),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


class ByteBudget:
    """Back-pressure on the bytes of request bodies in flight (read, parsed, waiting for commit).

    A request takes its declared size (or the body limit when it declares
    none) before its body is read, and gives it back after its response;
    while the budget is spent, new requests wait (their bodies stay in the
    client's socket). One request larger than the whole budget runs alone.
    This bounds the service's memory: decoding costs a small multiple of the
    body (docs/ingest.md "Memory")."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.in_flight = 0
        self.peak = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> int:
        n = min(n, self.max_bytes)
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_flight == 0 or self.in_flight + n <= self.max_bytes)
            self.in_flight += n
            self.peak = max(self.peak, self.in_flight)
        return n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.in_flight -= n
            self._cond.notify_all()
