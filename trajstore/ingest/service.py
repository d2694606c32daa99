"""HTTP ingest service: ``POST /v1/events`` into ``store.append``.

A thin edge over the library (ARCHITECTURE "Edges stay thin"): events are
parsed with ``trajstore.events.parse_events`` and stored with ``store.append``;
nothing here re-implements a rule. FastAPI and uvicorn are imported lazily,
so the core never needs them (``pip install 'trajstore[server]'``).

Endpoints:

* ``POST /v1/events``: body ``{"events": [...]}`` or a JSON list of
  wire-format events. 200 only after ``store.append`` returned (durable).
  401 without the bearer token, 413 over ``max_body_bytes``, 400 for bad
  JSON, 422 for a refused event, 409 for a conflict, 503 when the store is
  unreachable (retry). Errors are ``{"error": {"index", "trajectory_id",
  "rule", "message"}}`` and nothing of the request is stored.
* ``GET /healthz``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json``.

Group commit: requests that arrive while an append runs are coalesced into
the next ``store.append`` by one committer thread, so N concurrent clients
cost about one transaction (and one payload file) per round instead of N.
``store.append`` is atomic, so when a coalesced append is refused nothing is
stored and the requests are re-appended one by one: a bad event fails only
its own request. Coalescing never reorders a request's events.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers'
# annotations at runtime, and ``Request`` is imported lazily inside make_app.
import argparse
import asyncio
import concurrent.futures
import json
import logging
import os
import re
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from trajstore.errors import StoreUnavailable, TrajstoreError, ValidationError
from trajstore.events import Generation, parse_events
from trajstore.ingest._http import OPEN_PATHS, BearerAuth, add_server_arguments, run_server, server_token
from trajstore.ingest._http import HTTPError as _HTTPError  # the name the tests and the fuzz harness use

__all__ = [
    "DEFAULT_COMMITTERS", "DEFAULT_GROUP_WAIT_S", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_BYTES_IN_FLIGHT", "ByteBudget", "GroupCommitter", "Metrics",
    "add_cli_arguments", "app_from_env", "decode_json", "main", "make_app", "parse_arrow_body", "parse_body", "serve",
    "serve_from_args"]

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 << 20
DEFAULT_MAX_BYTES_IN_FLIGHT = 128 << 20
# How long a group about to be committed waits for requests still being read or parsed.
DEFAULT_GROUP_WAIT_S = 0.005
# Groups appended at once (GroupCommitter ``committers``): one builds and writes while another waits for its fsyncs.
DEFAULT_COMMITTERS = 1
_ARRAY_FIELDS = frozenset({"prompt_ids", "output_ids", "logprobs", "loss_mask", "token_rewards",
                           "token_model_versions", "routed_experts"})
DEFAULT_PORT = 8700
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """The service's Prometheus metrics (``prometheus_client``), one registry per app.

    Under ``serve --workers N`` every worker writes its values to
    ``$PROMETHEUS_MULTIPROC_DIR`` (``serve`` makes it) and ``render()`` sums
    them, so a scrape sees the whole service, whichever worker answers it."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        p = "trajstore_ingest"
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter(f"{p}_requests", "answers to POST /v1/events, by HTTP status", ["status"],
                                 registry=r)
        self._errors = Counter(f"{p}_errors", "refused requests, by rule", ["rule"], registry=r)
        self._events = Counter(f"{p}_events", "events stored by acknowledged requests (duplicates not counted)",
                               registry=r)
        self._duplicates = Counter(f"{p}_duplicate_events", "events acknowledged that were already stored",
                                   registry=r)
        self._tokens = Counter(f"{p}_tokens", "generated tokens in acknowledged requests", registry=r)
        self._commits = Counter(f"{p}_commits", "store transactions (requests/commits: the mean group size)",
                                registry=r)
        self._latency = Histogram(f"{p}_ack_latency_seconds", "time from request to answer",
                                  buckets=_LATENCY_BUCKETS_S, registry=r)
        self._in_flight = Gauge(f"{p}_body_bytes_in_flight", "request body bytes read, parsed or committing",
                                registry=r, multiprocess_mode="livesum")
        self._peak = Gauge(f"{p}_body_bytes_in_flight_peak", "highest body_bytes_in_flight of a process",
                           registry=r, multiprocess_mode="max")
        self._limit = Gauge(f"{p}_body_bytes_in_flight_limit", "--max-in-flight-mb of a process, in bytes",
                            registry=r, multiprocess_mode="max")

    def observe(self, status: int, latency_s: float, *, events: int = 0, duplicates: int = 0, tokens: int = 0,
                rule: str | None = None) -> None:
        self._requests.labels(status=str(status)).inc()
        if events:
            self._events.inc(events)
        if duplicates:
            self._duplicates.inc(duplicates)
        if tokens:
            self._tokens.inc(tokens)
        if rule is not None:
            self._errors.labels(rule=rule).inc()
        self._latency.observe(latency_s)

    def count_commit(self) -> None:
        self._commits.inc()

    def budget(self, in_flight: int, peak: int, limit: int) -> None:
        self._in_flight.set(in_flight)
        self._peak.set(peak)
        self._limit.set(limit)

    def render(self) -> str:
        from prometheus_client import CollectorRegistry, generate_latest

        if os.environ.get(_MULTIPROC_ENV):
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry).decode()
        return generate_latest(self.registry).decode()


_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's multiprocess mode (serve --workers N)


@dataclass
class _Request:
    events: list
    num_tokens: int
    trajectories: frozenset
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class GroupCommitter:
    """Committer threads that append queued requests, coalescing those that wait.

    ``submit(events)`` returns a future of ``(group_size, AppendResult)``.
    A group is capped at ``max_group_events`` events and ``max_group_tokens``
    tokens (one request alone may exceed them).

    ``committers``: groups appended at once. An append spends much of its
    time waiting for its fsyncs (the payload segment, the SQL commit); a
    second committer builds and writes the next group meanwhile. Groups in
    flight never share a trajectory, and groups start in arrival order: a
    request that touches a trajectory of a group being appended waits, and
    so does every request queued after it.
    """

    def __init__(self, store: Any, *, max_group_events: int = 8192, max_group_tokens: int = 1 << 21,
                 metrics: Metrics | None = None, max_wait_s: float = DEFAULT_GROUP_WAIT_S,
                 committers: int = 1) -> None:
        self._store = store
        self.max_group_events, self.max_group_tokens = max_group_events, max_group_tokens
        self.max_wait_s = max_wait_s
        self._metrics = metrics
        self._cond = threading.Condition()
        self._queue: deque[_Request] = deque()
        self._expected = 0  # requests announced (body being read or parsed), not submitted yet
        self._in_flight: set = set()  # trajectories of the groups being appended
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"trajstore-group-commit-{i}", daemon=True)
                         for i in range(max(1, committers))]
        for thread in self._threads:
            thread.start()

    def expect(self) -> None:
        """A request is on its way (its body is being read or parsed): a group
        about to be committed waits for it, up to ``max_wait_s``. Every
        ``expect()`` is followed by ``submit(..., expected=True)`` or ``forget()``."""
        with self._cond:
            self._expected += 1

    def forget(self) -> None:
        """An expected request will not be submitted (it failed before)."""
        with self._cond:
            self._expected -= 1
            self._cond.notify_all()

    def submit(self, events: list, num_tokens: int = 0, *, expected: bool = False) -> concurrent.futures.Future:
        req = _Request(events, num_tokens, _trajectories_of(events))
        with self._cond:
            if expected:
                self._expected -= 1
            if self._closed:
                raise StoreUnavailable("the ingest service is shutting down")
            self._queue.append(req)
            self._cond.notify_all()
        return req.future

    def close(self) -> None:
        """Commit what is queued, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def _startable(self) -> bool:
        """The request at the head of the queue may start a group now."""
        return bool(self._queue) and self._in_flight.isdisjoint(self._queue[0].trajectories)

    def _take(self) -> list[_Request]:
        """The next group (its trajectories marked in flight); [] when closed and drained."""
        with self._cond:
            while True:
                self._cond.wait_for(lambda: self._startable() or (self._closed and not self._queue))
                if not self._queue:
                    return []
                if self._expected and not self._closed and self.max_wait_s > 0:
                    # Requests whose bodies are being read or parsed join this group rather
                    # than the next: an append's fixed cost (fsyncs, one transaction) is paid
                    # once for all of them.
                    self._cond.wait_for(lambda: not self._expected or self._closed or self._group_full(),
                                        self.max_wait_s)
                    if not self._startable():
                        continue  # another committer took the queue's head meanwhile
                group: list[_Request] = []
                n_events = n_tokens = 0
                while self._startable():  # in flight: other committers' groups (this one's join below)
                    req = self._queue[0]
                    if group and (n_events + len(req.events) > self.max_group_events
                                  or n_tokens + req.num_tokens > self.max_group_tokens):
                        break
                    group.append(self._queue.popleft())
                    n_events += len(req.events)
                    n_tokens += req.num_tokens
                for req in group:
                    self._in_flight |= req.trajectories
                return group

    def _group_full(self) -> bool:
        return (sum(len(r.events) for r in self._queue) >= self.max_group_events
                or sum(r.num_tokens for r in self._queue) >= self.max_group_tokens)

    def _run(self) -> None:
        while group := self._take():
            try:
                if len(group) == 1:
                    self._commit_alone(group[0])
                else:
                    self._commit_group(group)
            finally:
                with self._cond:
                    for req in group:
                        self._in_flight -= req.trajectories
                    self._cond.notify_all()

    def _append(self, events: list) -> Any:
        result = self._store.append(events)
        if self._metrics is not None:
            self._metrics.count_commit()
        return result

    def _commit_group(self, group: list[_Request]) -> None:
        """Append the group as one; a refused request is dropped and the rest re-tried together.

        Only the refused request fails: a ValidationError names the event
        index in the coalesced append, which maps to exactly one request
        (append is atomic, so nothing was stored). Any other failure (the
        store is unreachable, or a bug an event provoked) re-appends each
        request on its own, so it reaches only the request(s) that hit it."""
        pending = list(group)
        while len(pending) > 1:
            try:
                result = self._append([ev for req in pending for ev in req.events])
            except ValidationError as e:
                culprit = _request_of(pending, e.index)
                if culprit is None:
                    break
                req, offset = culprit
                req.future.set_exception(e.at(e.index - offset))
                pending.remove(req)
                continue
            except Exception:  # noqa: BLE001 - isolated below, request by request
                break
            offset = 0
            for req in pending:
                req.future.set_result((len(pending), _share_of(result, offset, len(req.events))))
                offset += len(req.events)
            return
        for req in pending:
            self._commit_alone(req)

    def _commit_alone(self, req: _Request) -> None:
        try:
            req.future.set_result((1, self._append(req.events)))
        except BaseException as e:
            req.future.set_exception(e)


def _trajectories_of(events: list) -> frozenset:
    """The trajectory ids ``events`` touch (parsed events or wire dicts; anything else counts as None)."""
    tids = set()
    for ev in events:
        tid = ev.get("trajectory_id") if isinstance(ev, dict) else getattr(ev, "trajectory_id", None)
        tids.add(tid if isinstance(tid, str) else None)
    return frozenset(tids)


def _share_of(result: Any, offset: int, n: int) -> Any:
    """One request's own counts out of a coalesced append's result."""
    from trajstore.store import AppendResult

    dups = tuple(i - offset for i in result.duplicate_indices if offset <= i < offset + n)
    return AppendResult(n - len(dups), len(dups), result.last_position, dups)


def _request_of(pending: list[_Request], index: int | None) -> tuple[_Request, int] | None:
    """The request holding event ``index`` of the coalesced append, and its first event's index."""
    if index is None:
        return None
    offset = 0
    for req in pending:
        if index < offset + len(req.events):
            return req, offset
        offset += len(req.events)
    return None


def parse_body(body: bytes | bytearray) -> tuple[list, int]:
    """The parsed events of a request body and their token count; raises _HTTPError."""
    doc = decode_json(body)
    raw = doc.get("events") if isinstance(doc, dict) else doc
    if not isinstance(raw, list):
        raise _HTTPError(400, 'body must be {"events": [...]} or a JSON list of events', rule="malformed_body")
    return _parse_events(raw)


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
    return _parse_events(raw)


def _parse_events(raw: list) -> tuple[list, int]:
    """Each wire event parsed (a refusal names its index in the body), and their token count."""
    try:
        events = parse_events(raw)
    except ValidationError as e:
        raise _HTTPError.from_error(e) from None
    return events, sum(ev.num_tokens for ev in events if isinstance(ev, Generation))


def _is_arrow(content_type: str | None) -> bool:
    from trajstore.ingest.arrow_body import ARROW_CONTENT_TYPE

    return (content_type or "").split(";")[0].strip().lower() == ARROW_CONTENT_TYPE


# Memory (docs/ingest.md "Memory"): ``json.loads`` turns a list of N small
# ints into a Python list (8 bytes a slot) plus numpy's int64 copy, ~12x the
# 2-byte "1," it came from. Long flat integer arrays that are the value of an
# object member (``"prompt_ids": [...]``) are therefore parsed straight to
# numpy (C speed, int32 when no number has 10 digits) and put back in place
# of a placeholder string only this process can produce. The scan skips JSON
# strings whole, so a "[1,2,...]" inside a string is never touched; an array
# that is not strictly JSON integers is left to ``json.loads``.
_MIN_FAST_ARRAY_BYTES = 256  # shorter arrays are not worth it
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"')  # a JSON string with escapes, whole
_JSON_SPACE = b" \t\r\n"
_INT_LIST_TEXT = re.compile(rb"[0-9,\- \t\r\n]*+\]")  # what may stand between "[" and "]" of integers
_NOT_INT_LIST = re.compile(rb"[^0-9,\- ]")
_TEN_DIGITS = re.compile(rb"[0-9]{10}")
_NINETEEN_DIGITS = re.compile(rb"[0-9]{19}")
_PLACEHOLDER = "\x00trajstore-array-" + secrets.token_hex(8) + "-"
_PLACEHOLDER_JSON = b'"' + _PLACEHOLDER.encode().replace(b"\x00", b"\\u0000")


def _int_list(text: bytes) -> np.ndarray | None:
    """``text`` (between ``[`` and ``]``) as an int array if it is exactly a JSON list of integers, else None.

    Takes the compact form and ``json.dumps``'s ``", "``; any other whitespace
    is left to ``json.loads``. Extra memory: the result, one copy of the text
    when it has ", ", and O(1 MiB) of checks, whatever the length."""
    if _NOT_INT_LIST.search(text):
        return None  # anything but digits, commas and minus signs (after ", " -> ",")
    if b" " in text:
        text = text.replace(b", ", b",")
        if b" " in text:
            return None
    if not text or text[0] not in b"-0123456789" or text[-1] not in b"0123456789":
        return None
    wide = _TEN_DIGITS.search(text) is not None
    if wide and _NINETEEN_DIGITS.search(text):
        return None  # may not fit in int64: json.loads decides
    if not _json_integers(np.frombuffer(text, np.uint8)):
        return None
    try:
        arr = np.fromstring(text, dtype=np.int64 if wide else np.int32, sep=",")
    except ValueError:  # not expected after the checks above; json.loads decides
        return None
    return arr if len(arr) == text.count(b",") + 1 else None


def _json_integers(b: np.ndarray, step: int = 1 << 20) -> bool:
    """Digits, commas and minus signs that form ``-?digits(,-?digits)*`` with no leading zero:
    every comma between a digit and a number, every minus at a number's start before a
    digit. Checked a MiB at a time, each window with its neighbours (the ends count as commas)."""
    comma = np.array([44], np.uint8)
    for lo in range(0, len(b), step):
        hi = min(lo + step, len(b))
        w = b[max(lo - 1, 0):hi + 1]
        if lo == 0:
            w = np.concatenate((comma, w))
        if hi == len(b):
            w = np.concatenate((w, comma))
        digit = (w >= 48) & (w <= 57)
        prev_digit, next_digit = digit[:-2], digit[2:]
        mid, prev, nxt = w[1:-1], w[:-2], w[2:]
        bad = ((mid == 48) & next_digit & ~prev_digit)  # "01", "-01"
        bad |= (mid == 45) & (~next_digit | (prev != 44))  # "-" then a digit, after a comma or the start
        bad |= (mid == 44) & (~prev_digit | ~(next_digit | (nxt == 45)))  # "1,2", "1,-2"
        if np.any(bad):
            return False
    return True


def _fast_arrays(body: bytes | bytearray) -> tuple[bytes | bytearray, list]:
    """``body`` with long integer arrays replaced by placeholders, and the arrays.

    The scan goes from one ``[`` outside strings to the next with
    ``bytes.find`` (memchr speed): a megabyte of base64 routes in a string
    costs a few microseconds to step over, against ~7 ms for a regular
    expression walking it character by character (half the service's CPU for
    a 1-MiB JSON event, docs/benchmarks.md). Only a string holding a backslash
    is matched by ``_STRING``."""
    arrays: list = []
    pieces: list[bytes] = []
    pos = last = 0
    bracket = -1
    while True:
        if bracket < pos:
            bracket = body.find(b"[", pos)
            if bracket < 0:
                break
        quote = body.find(b'"', pos, bracket)
        if quote >= 0:  # a string starts first: step over it (the "[" may be inside)
            pos = _string_end(body, quote)
            if pos < 0:
                break  # unterminated: json.loads decides
            continue
        # no string between pos and the "[": is it an object member's value (":" then "[")?
        member = bytes(memoryview(body)[pos:bracket]).rstrip(_JSON_SPACE).endswith(b":")
        pos = bracket + 1
        if not member:
            continue
        m = _INT_LIST_TEXT.match(body, pos)  # stops at the first character no integer list has
        if m is None or m.end() - 1 - pos < _MIN_FAST_ARRAY_BYTES:
            continue
        end = m.end() - 1
        arr = _int_list(bytes(memoryview(body)[pos:end]))
        if arr is None:
            continue
        arrays.append(arr)
        pieces += [bytes(body[last:bracket]), b'%s%d"' % (_PLACEHOLDER_JSON, len(arrays) - 1)]
        pos = last = end + 1
    if not arrays:
        return body, arrays
    pieces.append(bytes(body[last:]))
    return b"".join(pieces), arrays


def _string_end(body: bytes | bytearray, quote: int) -> int:
    """The index after the JSON string that opens at ``quote``; -1 if it never closes."""
    close = body.find(b'"', quote + 1)
    if close < 0:
        return -1
    if body.find(b"\\", quote + 1, close) < 0:
        return close + 1  # no escape before the next quote: it closes the string
    m = _STRING.match(body, quote)
    return m.end() if m else -1


def decode_json(body: bytes | bytearray) -> Any:
    """``json.loads(body)`` with long integer arrays decoded to numpy; raises _HTTPError (400)."""

    def restore(obj: dict) -> dict:
        for key, value in obj.items():
            if isinstance(value, str) and value.startswith(_PLACEHOLDER):
                arr = arrays[int(value[len(_PLACEHOLDER):])]
                obj[key] = arr if key in _ARRAY_FIELDS else arr.tolist()
        return obj

    try:
        body, arrays = _fast_arrays(body)
        return json.loads(body, object_hook=restore if arrays else None)
    except (ValueError, UnicodeDecodeError) as e:
        raise _HTTPError(400, f"body is not valid JSON ({e})", rule="malformed_json") from None
    except RecursionError:
        raise _HTTPError(400, "body is not valid JSON (nested too deeply)", rule="malformed_json") from None


_WHOLE_BODY = "trajstore.whole_body"  # trajstore.ingest._nodelay.BODY_EXTENSION (that module needs uvicorn)


class _ClientGone(Exception):
    """The client disconnected before its body was read: nobody to answer."""


async def _read_body(scope: Mapping[str, Any], receive: Any, declared: int | None,
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
            raise _ClientGone() from None
    message = await receive()
    if message["type"] != "http.request":
        raise _ClientGone()
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
                raise _ClientGone()
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
            raise _ClientGone()
        chunk = message.get("body", b"")


def _header(scope: Mapping[str, Any], name: bytes) -> str | None:
    """The first value of header ``name`` (lower case) of an ASGI request, as latin-1 text."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _declared_length(scope: Mapping[str, Any]) -> int | None:
    declared = _header(scope, b"content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


async def _send_json(send: Any, status: int, body: Any, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
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


_EVENTS_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"oneOf": [
            {"type": "object", "required": ["events"],
             "properties": {"events": {"type": "array", "items": {"type": "object"}}}},
            {"type": "array", "items": {"type": "object"}},
        ]}},
            # one Arrow IPC stream, arrays as raw bytes: see trajstore.ingest.arrow_body
            "application/vnd.apache.arrow.stream": {"schema": {"type": "string", "format": "binary"}}},
    },
    "responses": {
        "200": {"description": "stored (durable): num_events, num_appended, num_duplicates, last_position"},
        "400": {"description": "malformed JSON or body shape"},
        "401": {"description": "missing or wrong bearer token"},
        "409": {"description": "an event conflicts with a stored one"},
        "413": {"description": "body over the size limit"},
        "422": {"description": "an event breaks a rule; error names index, trajectory_id, rule"},
        "503": {"description": "store unreachable; retry the same events"},
    },
}


def make_app(store: Any, *, token: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
             group_commit: bool = True, close_store: bool = False,
             max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT, group_wait_s: float = DEFAULT_GROUP_WAIT_S,
             committers: int = DEFAULT_COMMITTERS) -> Any:
    """The FastAPI app over ``store``. ``token=None`` means no auth (the caller decided).

    ``close_store``: close the store when the app shuts down.
    ``max_bytes_in_flight``: request bodies being read, parsed or committed at
    once, in bytes (see ``ByteBudget``); more waits.
    ``group_wait_s``: how long a group commit waits for requests still being
    read or parsed (``GroupCommitter.max_wait_s``).
    ``committers``: group appends at once (``GroupCommitter.committers``).
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse, Response
    from starlette.concurrency import run_in_threadpool

    metrics = Metrics()
    metrics.budget(0, 0, max_bytes_in_flight)
    committer = (GroupCommitter(store, metrics=metrics, max_wait_s=group_wait_s, committers=committers)
                 if group_commit else None)

    @asynccontextmanager
    async def lifespan(app: Any):
        yield
        if committer is not None:
            committer.close()
        if close_store:
            store.close()

    app = FastAPI(title="trajstore ingest", version="1", lifespan=lifespan)
    app.state.metrics = metrics
    budget = app.state.budget = ByteBudget(max_bytes_in_flight)

    async def parse(scope: Mapping[str, Any], body: bytes | bytearray) -> tuple[list, int]:
        if _is_arrow(_header(scope, b"content-type")):
            # Arrow: buffers mapped, not converted; parsing it on the event loop costs less than a thread hop
            return parse_arrow_body(body)
        return await run_in_threadpool(parse_body, body)  # JSON: milliseconds per MiB, off the event loop

    async def commit(events: list, num_tokens: int) -> tuple[int, Any]:
        if committer is not None:
            return await asyncio.wrap_future(committer.submit(events, num_tokens, expected=True))
        return 1, await run_in_threadpool(store.append, events)

    async def post_events(scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        """``POST /v1/events`` on raw ASGI: the body read straight from ``receive``, the answer sent as JSON."""
        start = time.perf_counter()
        try:
            declared = _declared_length(scope)
            if declared is not None and declared > max_body_bytes:  # refused before taking any budget
                raise _HTTPError(413, f"body of {declared} bytes is over the {max_body_bytes}-byte limit",
                                 rule="body_too_large")
            taken = await budget.acquire(declared if declared is not None else max_body_bytes)
            metrics.budget(budget.in_flight, budget.peak, budget.max_bytes)
            try:
                if committer is not None:
                    committer.expect()
                try:
                    events, num_tokens = await parse(scope, await _read_body(scope, receive, declared, max_body_bytes))
                except BaseException:
                    if committer is not None:
                        committer.forget()
                    raise
                num_events = len(events)
                try:
                    group_size, result = await commit(events, num_tokens)
                except Exception as e:
                    raise _HTTPError.from_error(e) from None
                finally:
                    del events  # the parsed arrays go before the budget is given back
            finally:
                await budget.release(taken)
                metrics.budget(budget.in_flight, budget.peak, budget.max_bytes)
        except _ClientGone:
            metrics.observe(499, time.perf_counter() - start, rule="client_gone")
            return
        except Exception as e:  # noqa: BLE001 - every answer is a trajstore error body
            error = e if isinstance(e, _HTTPError) else _HTTPError.from_error(e)
            if error.status >= 500 and not isinstance(e, _HTTPError):
                log.exception("ingest request failed")
            metrics.observe(error.status, time.perf_counter() - start, rule=error.rule)
            await _send_json(send, error.status, error.body,
                             [(b"www-authenticate", b"Bearer")] if error.status == 401 else ())
            return
        metrics.observe(200, time.perf_counter() - start, events=result.num_appended or 0,
                        duplicates=result.num_duplicates or 0, tokens=num_tokens)
        await _send_json(send, 200, _ack_body(num_events, result))

    class _Handled(Response):
        """What the FastAPI route returns: it runs ``post_events`` on the connection itself."""

        def __init__(self) -> None:  # noqa: D107 - nothing to render up front
            pass

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await post_events(scope, receive, send)

    # The route documents the endpoint (OpenAPI) and serves it when the app is
    # mounted under another; _IngestApp below answers it without FastAPI's
    # routing and middleware on the hot path.
    @app.post("/v1/events", openapi_extra=_EVENTS_OPENAPI, response_class=Response)
    async def post_events_route() -> Any:
        return _Handled()

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics() -> str:
        return metrics.render()

    # One rule for every endpoint, deny by default: the token is checked before any handler,
    # on the fast path and (when the FastAPI app is mounted elsewhere) on FastAPI's own.
    open_paths = OPEN_PATHS | {"/metrics"}  # Prometheus scrapes without a token; counters carry no data
    app.add_middleware(BearerAuth, token=token, open_paths=open_paths)

    def denied(scope: Any) -> None:
        metrics.observe(401, 0.0, rule="unauthorized")

    return _IngestApp(app, BearerAuth(post_events, token, open_paths, on_deny=denied))


class _IngestApp:
    """The ASGI app ``make_app`` returns: ``POST /v1/events`` goes straight to its
    handler; everything else (health, metrics, OpenAPI, lifespan, 404/405) to FastAPI."""

    def __init__(self, app: Any, post_events: Any) -> None:
        self.fastapi = app
        self.state = app.state
        self._post_events = post_events  # behind BearerAuth, as FastAPI's routes are

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/v1/events":
            await self._post_events(scope, receive, send)
        else:
            await self.fastapi(scope, receive, send)


def _ack_body(num_events: int, result: Any) -> dict:
    # ``result`` is this request's own share of a coalesced append (_share_of).
    return {"num_events": num_events, "num_appended": result.num_appended, "num_duplicates": result.num_duplicates,
            "last_position": result.last_position}


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``trajstore serve`` (``--store`` is the CLI's global flag)."""
    add_server_arguments(parser, port=DEFAULT_PORT, token_help="bearer token clients must send",
                         open_help="accept requests without a token")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / (1 << 20),
                        help="largest request body in MiB (default 64); larger ones get 413")
    parser.add_argument("--max-in-flight-mb", type=float, default=DEFAULT_MAX_BYTES_IN_FLIGHT / (1 << 20),
                        help="request bodies read, parsed or committing at once, in MiB (default 128); "
                             "more requests wait (bounds the service's memory)")
    parser.add_argument("--no-group-commit", action="store_true",
                        help="append each request on its own instead of coalescing concurrent ones")
    parser.add_argument("--group-wait-ms", type=float, default=DEFAULT_GROUP_WAIT_S * 1e3,
                        help="how long a group commit waits for requests still being read or parsed "
                             f"(default {DEFAULT_GROUP_WAIT_S * 1e3:g}; 0: never)")
    parser.add_argument("--committers", type=int, default=DEFAULT_COMMITTERS,
                        help="group appends in flight at once per process: one writes while another waits "
                             f"for its fsyncs (default {DEFAULT_COMMITTERS})")
    parser.add_argument("--workers", type=int, default=1,
                        help="server processes on the port, each with its own store connection (default 1)")


def serve(store_url: str | None = None, host: str = "127.0.0.1", port: int = DEFAULT_PORT, token: str | None = None,
          *, insecure_no_auth: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          group_commit: bool = True, workers: int = 1, log_level: str = "warning", payload: str | None = None,
          max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT, group_wait_s: float = DEFAULT_GROUP_WAIT_S,
          committers: int = DEFAULT_COMMITTERS) -> None:
    """Run the ingest service until SIGINT/SIGTERM (in-flight requests finish first).

    Refuses to start without a token (``token`` or ``$TRAJSTORE_TOKEN``)
    unless ``insecure_no_auth``. ``workers > 1`` runs that many processes on
    one port, each with its own store connection and group committer: one
    process is bound by its GIL to about one core.
    """
    token = server_token(token, insecure_no_auth=insecure_no_auth)
    import trajstore

    # Connect once here: a bad URL fails before the server starts, and a new
    # database is migrated by one process, not raced by every worker.
    trajstore.connect(store_url, payload=payload).close()
    os.environ[_CONFIG_ENV] = json.dumps(
        {"store_url": store_url, "payload": payload, "token": token, "max_body_bytes": max_body_bytes,
         "group_commit": group_commit, "max_bytes_in_flight": max_bytes_in_flight, "group_wait_s": group_wait_s,
         "committers": committers})
    # uvicorn builds each worker's app from the import string; the settings
    # reach it through the environment the workers inherit.
    # http=: TCP_NODELAY on every accepted connection, whatever socket the
    # workers were handed (see _nodelay).
    metrics_dir = None
    if workers > 1 and not os.environ.get(_MULTIPROC_ENV):
        import tempfile

        # every worker counts into this directory; a scrape of any worker sums them (Metrics.render)
        metrics_dir = os.environ[_MULTIPROC_ENV] = tempfile.mkdtemp(prefix="trajstore-serve-metrics-")
    try:
        run_server("trajstore.ingest.service:app_from_env", name="serve", factory=True, workers=workers,
                   host=host, port=port, store_url=store_url, payload=payload, log_level=log_level,
                   http="trajstore.ingest._nodelay:NoDelayHTTPProtocol")
    finally:
        if metrics_dir is not None:
            import shutil

            del os.environ[_MULTIPROC_ENV]
            shutil.rmtree(metrics_dir, ignore_errors=True)



_CONFIG_ENV = "TRAJSTORE_SERVE_CONFIG"


def app_from_env() -> Any:
    """The app ``serve`` described in ``$TRAJSTORE_SERVE_CONFIG``; it owns (and closes) its store."""
    import trajstore

    config = json.loads(os.environ[_CONFIG_ENV])
    _return_big_buffers_to_the_os()
    store = trajstore.connect(config.pop("store_url"), payload=config.pop("payload", None))
    return make_app(store, close_store=True, **config)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def _return_big_buffers_to_the_os(threshold: int = 1 << 20) -> None:
    """Pin glibc's mmap threshold so buffers of 1 MiB and more are mmapped and go back to the OS when freed.

    glibc raises the threshold to the size of each big block freed (up to 32
    MiB), after which multi-MB body and array buffers come from the heap and
    fragment it: under a stream of large bodies the service's RSS then grows
    with the number of requests served, not with the bytes in flight
    (docs/ingest.md "Memory"). A no-op off glibc."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):  # no mallopt: leave malloc as it is
        pass


def serve_from_args(args: argparse.Namespace) -> None:
    serve(getattr(args, "store", None), args.host, args.port, args.token, insecure_no_auth=args.insecure_no_auth,
          max_body_bytes=int(args.max_body_mb * (1 << 20)), group_commit=not args.no_group_commit,
          workers=args.workers, log_level=args.log_level, payload=getattr(args, "payload", None),
          max_bytes_in_flight=int(args.max_in_flight_mb * (1 << 20)),
          group_wait_s=getattr(args, "group_wait_ms", DEFAULT_GROUP_WAIT_S * 1e3) / 1e3,
          committers=getattr(args, "committers", DEFAULT_COMMITTERS))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trajstore-ingest", description="trajstore HTTP ingest service")
    parser.add_argument("--store", default=None, help="store URL (default $TRAJSTORE_URL or the embedded default)")
    add_cli_arguments(parser)
    args = parser.parse_args(argv)
    try:
        serve_from_args(args)
    except (ValueError, TrajstoreError) as e:
        raise SystemExit(f"trajstore serve: {e}") from None
