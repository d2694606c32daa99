"""Server-sent events on the way through: the ``data:`` payloads of an upstream's stream, the
events and comments the proxy adds, an unrecorded stream passed on."""

import json
import logging
from typing import Any, AsyncIterator, Mapping

log = logging.getLogger("trajstore.ingest.proxy")


class _SSEData:
    """Splits an SSE byte stream into ``data:`` payloads (decoded JSON values).

    ``done`` is set by ``data: [DONE]``; ``bad`` names the first data line
    that is not JSON (the call is then not recorded: a dropped chunk would
    be a half record).

    ``hold_done``: :meth:`take` passes on only whole lines, and holds back
    the ``data: [DONE]`` line and everything after it, which :meth:`end`
    hands back: the proxy sends the stream's end only once it knows whether
    the call is recorded, so an error event can come before ``[DONE]``
    (an OpenAI client stops reading at ``[DONE]``).
    """

    def __init__(self, hold_done: bool = False) -> None:
        self._buffer = b""
        self._held = b""
        self.hold_done = hold_done
        self.done = False
        self.bad: str | None = None

    def take(self, chunk: bytes) -> tuple[list, bytes]:
        """(the data objects the chunk completes, the bytes to pass on now)."""
        if self.hold_done and self.done:
            self._held += chunk
            return self._parse(chunk), b""
        if b"\n" not in chunk:  # no line ends here: no re-split of a long line per chunk
            self._buffer += chunk
            return [], b"" if self.hold_done else chunk
        data = self._buffer + chunk
        end = data.rfind(b"\n") + 1
        whole, self._buffer = data[:end], data[end:]
        out, done_at = self._lines(whole)
        if not self.hold_done:
            return out, chunk
        if done_at is None:
            return out, whole
        self._held = whole[done_at:] + self._buffer  # the buffer is still read (take, end)
        return out, whole[:done_at]

    def _parse(self, chunk: bytes) -> list:
        """Data objects after ``[DONE]`` (held back, still read: a record holds every token sent)."""
        if b"\n" not in chunk:
            self._buffer += chunk
            return []
        data = self._buffer + chunk
        end = data.rfind(b"\n") + 1
        self._buffer = data[end:]
        return self._lines(data[:end])[0]

    def _lines(self, whole: bytes) -> tuple[list, int | None]:
        """(data objects of these whole lines, the offset of the first ``[DONE]`` line if it is among them)."""
        out, done_at, offset = [], None, 0
        for raw in whole.split(b"\n")[:-1]:
            start, offset = offset, offset + len(raw) + 1
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                if not self.done:
                    done_at = start
                self.done = True
            elif data:
                try:
                    out.append(json.loads(data))
                except ValueError as e:
                    self.bad = self.bad or f"a data line is not JSON ({type(e).__name__})"
        return out, done_at

    def end(self) -> tuple[list, bytes, bytes]:
        """At the stream's end: (data objects of a last line without its newline, the bytes not passed on
        before ``[DONE]``, the held ``[DONE]`` line and what followed it)."""
        last, self._buffer = self._buffer, b""
        if self.hold_done and self.done:
            held, self._held = self._held, b""
            return self._lines(last + b"\n")[0], b"", held
        objs, done_at = self._lines(last + b"\n")
        if not self.hold_done:
            return objs, b"", b""
        if done_at is not None:
            return objs, b"", last
        return objs, last, b""


def _sse_event(obj: dict) -> bytes:
    return b"\n\ndata: " + json.dumps(obj).encode() + b"\n\n"


def _sse_comments(headers: Mapping[str, str]) -> bytes:
    return "".join(f": {k}: {v}\n" for k, v in headers.items()).encode("utf-8", "replace") + b"\n"


async def _passthrough(resp: Any, sse: bool = False) -> AsyncIterator[bytes]:
    """The upstream's bytes; an upstream that breaks off mid-stream ends with an SSE error event."""
    import httpx

    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    except httpx.HTTPError as e:
        log.warning("upstream stream broke off: %s: %s", type(e).__name__, e)
        if sse:
            message = f"trajstore proxy: the upstream stream broke off ({type(e).__name__})"
            yield _sse_event({"error": {"message": message, "type": "UpstreamStreamCut", "param": None, "code": 502}})
    finally:
        await resp.aclose()
