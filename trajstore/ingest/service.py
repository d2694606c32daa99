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
import os
import re
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajstore.errors import StoreUnavailable, TrajstoreError, ValidationError
from trajstore.events import Generation, parse_events
from trajstore.ingest._http import UNAUTHORIZED, add_server_arguments, bearer_ok, server_token
from trajstore.ingest._http import HTTPError as _HTTPError  # the name the tests and the fuzz harness use

__all__ = [
    "DEFAULT_GROUP_WAIT_S", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_BYTES_IN_FLIGHT", "ByteBudget", "GroupCommitter", "Metrics",
    "add_cli_arguments", "app_from_env", "decode_json", "main", "make_app", "parse_arrow_body", "parse_body", "serve",
    "serve_from_args"]

DEFAULT_MAX_BODY_BYTES = 64 << 20
DEFAULT_MAX_BYTES_IN_FLIGHT = 128 << 20
# How long a group about to be committed waits for requests still being read or parsed.
DEFAULT_GROUP_WAIT_S = 0.005
_ARRAY_FIELDS = frozenset({"prompt_ids", "output_ids", "logprobs", "loss_mask", "token_rewards",
                           "token_model_versions", "routed_experts"})
DEFAULT_PORT = 8700
_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """Counters and one latency histogram, rendered as Prometheus text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[int, int] = {}
        self.errors: dict[str, int] = {}
        self.events = self.tokens = self.commits = 0
        self._buckets = [0] * len(_LATENCY_BUCKETS_S)
        self._latency_sum_s = 0.0
        self._latency_count = 0

    def observe(self, status: int, latency_s: float, *, events: int = 0, tokens: int = 0, rule: str | None = None) -> None:
        with self._lock:
            self.requests[status] = self.requests.get(status, 0) + 1
            self.events += events
            self.tokens += tokens
            if rule is not None:
                self.errors[rule] = self.errors.get(rule, 0) + 1
            self._latency_sum_s += latency_s
            self._latency_count += 1
            for i, bound in enumerate(_LATENCY_BUCKETS_S):
                if latency_s <= bound:
                    self._buckets[i] += 1

    def count_commit(self) -> None:
        with self._lock:
            self.commits += 1

    def render(self) -> str:
        p = "trajstore_ingest"
        with self._lock:
            lines = [f"# TYPE {p}_requests_total counter"]
            lines += [f'{p}_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
            lines += [f"# TYPE {p}_errors_total counter"]
            lines += [f'{p}_errors_total{{rule="{r}"}} {n}' for r, n in sorted(self.errors.items())]
            for name, value in (("events", self.events), ("tokens", self.tokens), ("commits", self.commits)):
                lines += [f"# TYPE {p}_{name}_total counter", f"{p}_{name}_total {value}"]
            lines.append(f"# TYPE {p}_ack_latency_seconds histogram")
            lines += [f'{p}_ack_latency_seconds_bucket{{le="{b:g}"}} {n}' for b, n in zip(_LATENCY_BUCKETS_S, self._buckets)]
            lines += [
                f'{p}_ack_latency_seconds_bucket{{le="+Inf"}} {self._latency_count}',
                f"{p}_ack_latency_seconds_sum {self._latency_sum_s:.6f}",
                f"{p}_ack_latency_seconds_count {self._latency_count}",
            ]
        return "\n".join(lines) + "\n"


@dataclass
class _Request:
    events: list
    num_tokens: int
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class GroupCommitter:
    """One thread that appends queued requests, coalescing those that wait.

    ``submit(events)`` returns a future of ``(group_size, AppendResult)``.
    A group is capped at ``max_group_events`` events and ``max_group_tokens``
    tokens (one request alone may exceed them).
    """

    def __init__(self, store: Any, *, max_group_events: int = 8192, max_group_tokens: int = 1 << 21,
                 metrics: Metrics | None = None, max_wait_s: float = DEFAULT_GROUP_WAIT_S) -> None:
        self._store = store
        self.max_group_events, self.max_group_tokens = max_group_events, max_group_tokens
        self.max_wait_s = max_wait_s
        self._metrics = metrics
        self._cond = threading.Condition()
        self._queue: deque[_Request] = deque()
        self._expected = 0  # requests announced (body being read or parsed), not submitted yet
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="trajstore-group-commit", daemon=True)
        self._thread.start()

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
            self._cond.notify()

    def submit(self, events: list, num_tokens: int = 0, *, expected: bool = False) -> concurrent.futures.Future:
        req = _Request(events, num_tokens)
        with self._cond:
            if expected:
                self._expected -= 1
            if self._closed:
                raise StoreUnavailable("the ingest service is shutting down")
            self._queue.append(req)
            self._cond.notify()
        return req.future

    def close(self) -> None:
        """Commit what is queued, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()

    def _take(self) -> list[_Request]:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed)
            if self._expected and not self._closed and self.max_wait_s > 0:
                # Requests whose bodies are being read or parsed join this group rather
                # than the next: an append's fixed cost (fsyncs, one transaction) is paid
                # once for all of them.
                self._cond.wait_for(lambda: not self._expected or self._closed or self._group_full(),
                                    self.max_wait_s)
            group: list[_Request] = []
            n_events = n_tokens = 0
            while self._queue:
                req = self._queue[0]
                if group and (n_events + len(req.events) > self.max_group_events
                              or n_tokens + req.num_tokens > self.max_group_tokens):
                    break
                group.append(self._queue.popleft())
                n_events += len(req.events)
                n_tokens += req.num_tokens
            return group

    def _group_full(self) -> bool:
        return (sum(len(r.events) for r in self._queue) >= self.max_group_events
                or sum(r.num_tokens for r in self._queue) >= self.max_group_tokens)

    def _run(self) -> None:
        while group := self._take():
            if len(group) == 1:
                self._commit_alone(group[0])
            else:
                self._commit_group(group)

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
        raise _HTTPError(400, str(e), rule="malformed_body") from None
    except ValidationError as e:
        raise _HTTPError.from_error(e) from None
    return _parse_events(raw)


def _parse_events(raw: list) -> tuple[list, int]:
    """Each wire event parsed (a refusal names its index in the body), and their token count."""
    try:
        events = parse_events(raw)
    except ValidationError as e:
        raise _HTTPError.from_error(e) from None
    return events, sum(ev.num_tokens for ev in events if isinstance(ev, Generation))


def _is_arrow(request: Any) -> bool:
    from trajstore.ingest.arrow_body import ARROW_CONTENT_TYPE

    return request.headers.get("content-type", "").split(";")[0].strip().lower() == ARROW_CONTENT_TYPE


# Memory (docs/ingest.md "Memory"): ``json.loads`` turns a list of N small
# ints into a Python list (8 bytes a slot) plus numpy's int64 copy, ~12x the
# 2-byte "1," it came from. Long flat integer arrays that are the value of an
# object member (``"prompt_ids": [...]``) are therefore parsed straight to
# numpy (C speed, int32 when no number has 10 digits) and put back in place
# of a placeholder string only this process can produce. The scan skips JSON
# strings whole, so a "[1,2,...]" inside a string is never touched; an array
# that is not strictly JSON integers is left to ``json.loads``.
_MIN_FAST_ARRAY_BYTES = 256  # shorter arrays are not worth it
_SCAN = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"|:[ \t\r\n]*+\[')
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
    """``body`` with long integer arrays replaced by placeholders, and the arrays."""
    arrays: list = []
    pieces: list[bytes] = []
    pos = last = 0
    while m := _SCAN.search(body, pos):
        pos = m.end()
        if body[m.start()] == 0x22:  # a string: skipped
            continue
        end = body.find(b"]", pos)
        if end < 0:
            break
        arr = _int_list(bytes(memoryview(body)[pos:end])) if end - pos >= _MIN_FAST_ARRAY_BYTES else None
        if arr is None:
            continue
        arrays.append(arr)
        pieces += [bytes(body[last:pos - 1]), b'%s%d"' % (_PLACEHOLDER_JSON, len(arrays) - 1)]
        pos = last = end + 1
    if not arrays:
        return body, arrays
    pieces.append(bytes(body[last:]))
    return b"".join(pieces), arrays


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


async def _read_body(request: Any, max_body_bytes: int) -> bytes | bytearray:
    """The body, refused (413) as soon as it is over the limit.

    With a ``Content-Length`` the chunks are copied straight into one buffer
    of that size (no growth, no re-allocation of a MiB-sized body); without
    one they are appended to a growing buffer. Never joined."""
    declared = _declared_length(request)
    if declared is not None and declared > max_body_bytes:
        raise _HTTPError(413, f"body of {declared} bytes is over the {max_body_bytes}-byte limit", rule="body_too_large")
    if declared:
        body = bytearray(declared)
        view = memoryview(body)
        got = 0
        async for chunk in request.stream():
            end = got + len(chunk)
            if end > declared:  # more than declared: the server would have refused; be safe anyway
                raise _HTTPError(400, f"body is longer than its Content-Length of {declared} bytes", rule="malformed_body")
            view[got:end] = chunk
            got = end
        view.release()
        if got != declared:
            raise _HTTPError(400, f"body ended after {got} of its {declared} bytes", rule="malformed_body")
        return body
    grown = bytearray()
    async for chunk in request.stream():
        if len(grown) + len(chunk) > max_body_bytes:
            raise _HTTPError(413, f"body is over the {max_body_bytes}-byte limit", rule="body_too_large")
        grown += chunk
    return grown


def _declared_length(request: Any) -> int | None:
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


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
             max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT, group_wait_s: float = DEFAULT_GROUP_WAIT_S) -> Any:
    """The FastAPI app over ``store``. ``token=None`` means no auth (the caller decided).

    ``close_store``: close the store when the app shuts down.
    ``max_bytes_in_flight``: request bodies being read, parsed or committed at
    once, in bytes (see ``ByteBudget``); more waits.
    ``group_wait_s``: how long a group commit waits for requests still being
    read or parsed (``GroupCommitter.max_wait_s``).
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse
    from starlette.concurrency import run_in_threadpool

    metrics = Metrics()
    committer = GroupCommitter(store, metrics=metrics, max_wait_s=group_wait_s) if group_commit else None

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

    async def read_and_parse(request: Any) -> tuple[list, int]:
        parse = parse_arrow_body if _is_arrow(request) else parse_body
        return await run_in_threadpool(parse, await _read_body(request, max_body_bytes))

    async def commit(events: list, num_tokens: int) -> tuple[int, Any]:
        if committer is not None:
            return await asyncio.wrap_future(committer.submit(events, num_tokens, expected=True))
        return 1, await run_in_threadpool(store.append, events)

    @app.post("/v1/events", openapi_extra=_EVENTS_OPENAPI)
    async def post_events(request: Request) -> Any:
        start = time.perf_counter()
        try:
            if not bearer_ok(request.headers.get("authorization"), token):
                raise _HTTPError(401, UNAUTHORIZED, rule="unauthorized")
            declared = _declared_length(request)
            if declared is not None and declared > max_body_bytes:  # refused before taking any budget
                raise _HTTPError(413, f"body of {declared} bytes is over the {max_body_bytes}-byte limit",
                                 rule="body_too_large")
            taken = await budget.acquire(declared if declared is not None else max_body_bytes)
            try:
                if committer is not None:
                    committer.expect()
                try:
                    events, num_tokens = await read_and_parse(request)
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
        except _HTTPError as e:
            metrics.observe(e.status, time.perf_counter() - start, rule=e.rule)
            return e.response()
        metrics.observe(200, time.perf_counter() - start, events=num_events, tokens=num_tokens)
        return _ack_body(num_events, result)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics() -> str:
        p = "trajstore_ingest"
        return metrics.render() + "".join(
            f"# TYPE {p}_{name} gauge\n{p}_{name} {value}\n" for name, value in (
                ("body_bytes_in_flight", budget.in_flight), ("body_bytes_in_flight_peak", budget.peak),
                ("body_bytes_in_flight_limit", budget.max_bytes)))

    return app


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
    parser.add_argument("--workers", type=int, default=1,
                        help="server processes on the port, each with its own store connection (default 1)")


def serve(store_url: str | None = None, host: str = "127.0.0.1", port: int = DEFAULT_PORT, token: str | None = None,
          *, insecure_no_auth: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          group_commit: bool = True, workers: int = 1, log_level: str = "warning", payload: str | None = None,
          max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT, group_wait_s: float = DEFAULT_GROUP_WAIT_S) -> None:
    """Run the ingest service until SIGINT/SIGTERM (in-flight requests finish first).

    Refuses to start without a token (``token`` or ``$TRAJSTORE_TOKEN``)
    unless ``insecure_no_auth``. ``workers > 1`` runs that many processes on
    one port, each with its own store connection and group committer: one
    process is bound by its GIL to about one core.
    """
    token = server_token(token, insecure_no_auth=insecure_no_auth)
    import uvicorn

    import trajstore

    # Connect once here: a bad URL fails before the server starts, and a new
    # database is migrated by one process, not raced by every worker.
    trajstore.connect(store_url, payload=payload).close()
    os.environ[_CONFIG_ENV] = json.dumps(
        {"store_url": store_url, "payload": payload, "token": token, "max_body_bytes": max_body_bytes,
         "group_commit": group_commit, "max_bytes_in_flight": max_bytes_in_flight, "group_wait_s": group_wait_s})
    # uvicorn builds each worker's app from the import string; the settings
    # reach it through the environment the workers inherit.
    # http=: TCP_NODELAY on every accepted connection; with workers > 1 uvicorn
    # binds a proto-0 socket and asyncio would leave Nagle on (see _nodelay).
    uvicorn.run("trajstore.ingest.service:app_from_env", factory=True, workers=workers if workers > 1 else None,
                host=host, port=port, log_level=log_level, access_log=False,
                http="trajstore.ingest._nodelay:NoDelayHTTPProtocol")


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
          group_wait_s=getattr(args, "group_wait_ms", DEFAULT_GROUP_WAIT_S * 1e3) / 1e3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trajstore-ingest", description="trajstore HTTP ingest service")
    parser.add_argument("--store", default=None, help="store URL (default $TRAJSTORE_URL or the embedded default)")
    add_cli_arguments(parser)
    args = parser.parse_args(argv)
    try:
        serve_from_args(args)
    except (ValueError, TrajstoreError) as e:
        raise SystemExit(f"trajstore serve: {e}") from None
