"""Engine faults the proxy tests share: an engine that is down, an answer it cuts.

* ``ENGINE_DOWN``: an upstream URL nothing listens on (the discard port), so a
  connection is refused at once; ``assert_unreachable`` checks the clean 502
  both proxies answer then.
* ``engine_answering(pieces, framing=...)``: a raw loopback engine
  (``raw_upstream.RawUpstream``) that answers every request with ``pieces``,
  a stream by default; ``framing="chunked-cut"`` (or ``"close"``) is an engine
  that dies mid-body.
"""

from __future__ import annotations

from typing import Any

from raw_upstream import RawUpstream, framed

ENGINE_DOWN = "http://127.0.0.1:9"


def assert_unreachable(resp: Any, what: Any = None) -> None:
    """``resp`` is the proxy's clean answer to an engine it cannot reach or read: a 502 naming the rule."""
    assert resp.status_code == 502 and resp.json()["error"]["rule"] == "upstream_unreachable", (
        what if what is not None else resp.text)


def engine_answering(pieces: list[bytes], *, framing: str = "length", status: int = 200,
                     content_type: str = "text/event-stream") -> RawUpstream:
    """An engine on loopback that answers every request with ``pieces`` framed as ``framing``."""
    return RawUpstream(lambda method, path, body: framed(pieces, framing=framing, status=status,
                                                         content_type=content_type))
