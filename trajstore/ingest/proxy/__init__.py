"""OpenAI-compatible recording proxy in front of a vLLM server.

A harness points its OpenAI client at the proxy instead of vLLM and names
the trajectory of each call with the header ``X-Trajstore-Trajectory`` (or
the body field ``"trajstore": {"trajectory_id": ...}``, removed before
forwarding). The proxy forwards ``/v1/completions`` and
``/v1/chat/completions`` with ``return_token_ids``, ``return_weight_versions``
and sampled-token ``logprobs`` switched on
(``trajstore.ingest.vllm.request_params_for_recording``),
and vLLM's token-in/token-out ``POST /inference/v1/generate`` with
``sampling_params.logprobs`` (``request_params_for_tito``), records the call
as the trajectory's next generation event (``seq`` assigned here), and
returns the upstream's response bytes unchanged. Routes come with every
response when vLLM runs with ``--enable-return-routed-experts``.

Only new route rows: when the call's prompt token ids are known before the
call (``/inference/v1/generate``, or ``/v1/completions`` with a token-id
prompt) and they continue the trajectory's recorded sequence, the proxy sets
``routed_experts_prompt_start`` to the number of route rows the trajectory
has recorded (the store's ``route_len``), unless the caller set it; the
engine then returns rows for the new positions only and the event carries
``routed_experts_start``. The sample is the same as with every row sent.

Other headers: ``X-Trajstore-Model-Version`` (else ``--model-version``),
``X-Trajstore-Group`` and ``X-Trajstore-Num-Experts`` (used when the call
starts the trajectory). Calls without a trajectory are forwarded unrecorded
(``X-Trajstore-Unrecorded``, one log line per client). ``POST
/trajstore/finish`` ``{"trajectory_id", "status", "reward"?}`` ends a
trajectory. The response carries ``X-Trajstore-Seq`` when recorded. A
named call that cannot be recorded (the store refused it, the upstream's
answer cannot be read) fails closed: an error status (the store's
409/422/503, or 502) with the reason in the OpenAI error shape and
``X-Trajstore-Error`` (one line); ``pass_through_unrecorded``
(``--pass-through-unrecorded``) gives the upstream's status and bytes with
that header instead. Either way the record is whole or absent, and
``GET /metrics`` counts it. vLLM's RL, render, tokenizer and health
endpoints (``FORWARDED``) are forwarded as sent, unrecorded; a label change
among them with ``X-Trajstore-Model-Version`` also maps its label.
``upstream`` may end in ``/v1`` (dropped).

Auth: with a token (``--token`` / ``$TRAJSTORE_TOKEN``, as ``trajstore
serve``) every endpoint but ``/healthz``, ``/openapi.json``, ``/docs`` and
``/redoc`` needs ``Authorization: Bearer <token>``; the harness's client
sends it as its API key. That header is not forwarded: the upstream gets
``--upstream-api-key`` instead, if any.

Streams (``"stream": true``) are passed through chunk by chunk while the
``data:`` objects are accumulated; the record is appended when the stream
ended whole (every choice has its finish reason), before its ``data:
[DONE]`` reaches the harness, and announced by the SSE comment ``:
X-Trajstore-Seq: N``; a cut stream, or one that cannot be recorded, records
nothing and gets an SSE error event before its ``[DONE]``. vLLM streams no
routes on the OpenAI endpoints (those calls are recorded without them);
``/inference/v1/generate`` sends routes and version spans on the final chunk.

Seqs survive restarts: the first call for a trajectory the proxy has not
seen asks the store for the trajectory's last seq. The record and the
response's durability: the response is sent only after the append returned.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers'
# annotations at runtime, and ``Request`` is imported lazily.
import argparse
import asyncio
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping

import numpy as np

from trajstore._admission import sequence_hash
from trajstore.errors import TrajstoreError, ValidationError
from trajstore.ingest._event_dicts import trajectory_started
# OPEN_PATHS: open without the token, as on every trajstore server (they change nothing, show no recorded data)
from trajstore.ingest._http import (OPEN_PATHS, BearerAuth, HTTPError, add_server_arguments, error_response, run_server,
                                    server_token)
from trajstore.ingest.vllm import (
    OpenAIStreamAccumulator,
    VersionMap,
    generations_from_openai,
    generations_from_tito,
    request_params_for_recording,
    request_params_for_tito,
    routed_experts_prompt_start_of,
)

__all__ = [
    "FORWARDED", "RECORDED", "Recorder", "Tag", "add_cli_arguments", "main", "make_proxy_app", "normalize_upstream",
    "serve_proxy", "serve_proxy_from_args", "tag_of", "version_label_events",
]

log = logging.getLogger("trajstore.ingest.proxy")

DEFAULT_PORT = 8701
_HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
               "upgrade", "proxy-authorization", "proxy-authenticate", "accept-encoding"}
TITO_PATH = "/inference/v1/generate"


@dataclass
class Tag:
    """What the harness said about a call: which trajectory, which policy version."""

    trajectory_id: str
    model_version: int
    group_id: str | None = None
    num_experts: int | None = None


class Recorder:
    """Numbers each trajectory's calls and appends them, one call at a time per trajectory.

    With a ``committer`` (the ingest service's ``GroupCommitter``), records of
    different trajectories that are ready at once are appended together in
    one store append (one payload segment, one transaction): calls from many
    rollouts share the append's fixed cost. A record refused in a group
    fails only its own call.
    """

    def __init__(self, store: Any, committer: Any = None) -> None:
        self.store = store
        self.committer = committer
        self._next_seq: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._mutex = threading.Lock()

    def _lock(self, trajectory_id: str) -> asyncio.Lock:
        with self._mutex:
            return self._locks.setdefault(trajectory_id, asyncio.Lock())

    def _tail(self, trajectory_id: str) -> tuple[bool, int]:
        """(is the trajectory stored?, its next seq) as the store knows it."""
        state = self.store.trajectory_state(trajectory_id)
        return (False, 0) if state is None else (True, state.last_seq + 1)

    async def route_start(self, trajectory_id: str, prompt_ids: list) -> int:
        """Route rows the trajectory has recorded that a call with ``prompt_ids`` need not get again.

        Non-zero only when the prompt continues the recorded sequence (the
        call will merge), so the rows below it are the recorded ones.
        """
        from starlette.concurrency import run_in_threadpool

        state = await run_in_threadpool(self.store.trajectory_state, trajectory_id)
        if state is None or state.status != "running" or state.route_len <= 0:
            return 0
        try:
            prompt = np.asarray(prompt_ids, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            return 0
        if prompt.ndim != 1 or len(prompt) < state.seq_len or (prompt.size and (prompt.min() < 0 or prompt.max() > np.iinfo(np.int32).max)):
            return 0
        if sequence_hash(prompt[: state.seq_len].astype(np.int32)) != state.seq_hash:
            return 0
        return min(state.route_len, len(prompt) - 1)

    async def _append(self, events: list[dict]) -> None:
        from starlette.concurrency import run_in_threadpool

        if self.committer is None:
            await run_in_threadpool(self.store.append, events)
        else:
            await asyncio.wrap_future(self.committer.submit(events))

    async def record(self, tag: Tag, make_events: Callable[[int], list[dict]]) -> int:
        """Append ``make_events(seq)`` (the call's generation) as ``tag``'s next; return its seq."""
        from starlette.concurrency import run_in_threadpool

        async with self._lock(tag.trajectory_id):
            for attempt in (0, 1):
                known = tag.trajectory_id in self._next_seq
                stored, seq = (True, self._next_seq[tag.trajectory_id]) if known else await run_in_threadpool(self._tail, tag.trajectory_id)
                events = make_events(seq)
                if not stored:
                    events.insert(0, trajectory_started(tag.trajectory_id, group_id=tag.group_id, num_experts=tag.num_experts))
                try:
                    await self._append(events)
                except ValidationError as e:
                    # another proxy (or a restart) moved the trajectory: re-read once
                    self._next_seq.pop(tag.trajectory_id, None)
                    if attempt or e.rule not in ("seq_taken", "seq_gap", "conflict", "unknown_trajectory"):
                        raise
                    continue
                self._next_seq[tag.trajectory_id] = seq + len(events) - (0 if stored else 1)
                return seq
        raise AssertionError("unreachable")

    async def finish(self, trajectory_id: str, status: str, reward: float | None) -> None:
        events: list[dict] = []
        if reward is not None:
            events.append({"type": "reward", "trajectory_id": trajectory_id, "reward": reward})
        events.append({"type": "trajectory_finished", "trajectory_id": trajectory_id, "status": status})
        async with self._lock(trajectory_id):
            await self._append(events)
            self._next_seq.pop(trajectory_id, None)
        with self._mutex:
            self._locks.pop(trajectory_id, None)


def _int_or_none(value: Any, what: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValidationError(f"{what} must be an integer, got {value!r}", rule=what) from None


def tag_of(headers: Any, body: dict, default_model_version: int, default_num_experts: int | None) -> Tag | None:
    """The call's Tag from headers or the ``trajstore`` body field (popped), None when unnamed."""
    extra = body.pop("trajstore", None) or {}
    if not isinstance(extra, dict):
        raise ValidationError("the trajstore body field must be an object", rule="trajstore_field")
    tid = headers.get("x-trajstore-trajectory") or extra.get("trajectory_id")
    if not tid:
        return None
    version = headers.get("x-trajstore-model-version", extra.get("model_version"))
    num_experts = headers.get("x-trajstore-num-experts", extra.get("num_experts"))
    return Tag(
        trajectory_id=str(tid),
        model_version=default_model_version if version is None else _int_or_none(version, "model_version"),
        group_id=headers.get("x-trajstore-group", extra.get("group_id")),
        num_experts=default_num_experts if num_experts is None else _int_or_none(num_experts, "num_experts"),
    )


def _forward_headers(headers: Any, *, authenticated: bool, upstream_api_key: str | None) -> dict:
    drop = _HOP_BY_HOP | ({"authorization"} if authenticated or upstream_api_key else set())
    out = {k: v for k, v in headers.items() if k.lower() not in drop and not k.lower().startswith("x-trajstore-")}
    out["Accept-Encoding"] = "identity"  # streamed bytes are parsed as SSE on the way through
    if upstream_api_key:
        out["Authorization"] = f"Bearer {upstream_api_key}"
    return out


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


# The endpoints the proxy records: path -> the adapter that turns (response,
# request body, tag, seq) into the call's generation events. Another engine's
# routes are added here (and to RECORDED_PARAMS for what it must be asked).
RECORDED: dict[str, str] = {"/v1/completions": "completions", "/v1/chat/completions": "chat", TITO_PATH: "tito"}

# Forwarded unrecorded (auth as every other path): the engine's RL control
# plane, its tokenizer and render endpoints, health. vLLM 0.33 serves
# /pause ... /get_world_size with VLLM_SERVER_DEV_MODE=1
# (entrypoints/rl/online/api_router.py), the render/derender and abort
# endpoints with --enable-scale-out or --tokens-only (entrypoints/scale_out/).
FORWARDED: tuple[tuple[str, str], ...] = (
    ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/version"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/tokenizer_info"),
    ("POST", "/inference/v1/abort_requests"), ("POST", "/abort_requests"),
    ("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"),
    ("GET", "/weight_info"), ("POST", "/update_weight_version"), ("POST", "/start_weight_update"),
    ("POST", "/update_weights"), ("POST", "/finish_weight_update"), ("POST", "/init_weight_transfer_engine"),
    ("POST", "/shutdown_weight_transfer_engine"), ("GET", "/get_world_size"),
    ("POST", "/v1/chat/completions/render"), ("POST", "/v1/completions/render"),
    ("POST", "/v1/messages/render"), ("POST", "/v1/responses/render"),
    ("POST", "/v1/chat/completions/derender"), ("POST", "/v1/completions/derender"),
)

# The label-setting endpoints and their body field (entrypoints/rl/online/api_router.py).
_LABEL_FIELDS = {"/update_weight_version": "new_version", "/finish_weight_update": "weight_version"}

UNNAMED = "no X-Trajstore-Trajectory header and no trajstore.trajectory_id body field"
_MAX_NOTED_CLIENTS = 4096


def normalize_upstream(url: str) -> str:
    """The upstream's base URL without a trailing ``/v1`` (the OpenAI ``base_url`` habit).

    The proxy appends the full paths itself (``/v1/completions``,
    ``/inference/v1/generate``, ``/pause``), so ``http://h:8000/v1`` means
    ``http://h:8000``. ValueError, in one line, for anything that is not an
    http(s) URL with a host.
    """
    from urllib.parse import urlsplit

    text = (url or "").strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--upstream must be an http(s) URL with a host, e.g. http://127.0.0.1:8000, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"--upstream must not have a query or fragment, got {url!r}")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"--upstream has a bad port: {url!r}") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
        log.info("upstream %s: using %s (the proxy adds the /v1 paths itself)", url, f"{parts.scheme}://{parts.netloc}{path}")
    return f"{parts.scheme}://{parts.netloc}{path}"


def version_label_events(version_map: Mapping[Any, int]) -> list[dict]:
    """``version_label`` events for a ``{label: model_version}`` map (``--version-map``)."""
    out = []
    for label, version in version_map.items():
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"--version-map: label {label!r} must map to an integer model version, got {version!r}")
        out.append({"type": "version_label", "label": str(label), "model_version": version})
    return out


def _one_line(e: BaseException) -> str:
    text = str(e) if isinstance(e, (TrajstoreError, ValueError)) else f"{type(e).__name__}: {e}"
    return " ".join(text.split())[:500]


class _ProxyMetrics:
    """What a proxy counts, in the app's Prometheus registry (``GET /metrics``).

    ``trajstore_proxy_calls_total{outcome}``: named calls by what became of
    them: ``recorded``; ``refused`` (not recorded, the harness got an error);
    ``passed_through`` (not recorded, the engine's answer given anyway:
    ``--pass-through-unrecorded``); ``upstream_error`` (the engine answered an
    error status); ``stream_cut`` (the stream ended before its end).
    ``trajstore_proxy_unrecorded_total{rule}``: why named calls and label
    changes were not recorded. ``trajstore_proxy_labels_total{outcome}``:
    label changes relayed with ``X-Trajstore-Model-Version`` (``mapped``,
    ``refused``, ``passed_through``). ``trajstore_proxy_unnamed_calls_total``:
    calls forwarded without a trajectory name.
    """

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter

        p = "trajstore_proxy"
        self._calls = Counter(f"{p}_calls", "named calls by outcome", ["outcome"], registry=registry)
        self._unrecorded = Counter(f"{p}_unrecorded", "named calls and label changes not recorded, by rule", ["rule"],
                                   registry=registry)
        self._labels = Counter(f"{p}_labels", "label changes relayed with X-Trajstore-Model-Version, by outcome",
                               ["outcome"], registry=registry)
        self._unnamed = Counter(f"{p}_unnamed_calls", "calls forwarded without a trajectory name", registry=registry)

    def call(self, outcome: str, rule: str | None = None) -> None:
        self._calls.labels(outcome=outcome).inc()
        if rule is not None:
            self._unrecorded.labels(rule=rule).inc()

    def label(self, outcome: str, rule: str | None = None) -> None:
        self._labels.labels(outcome=outcome).inc()
        if rule is not None:
            self._unrecorded.labels(rule=rule).inc()

    def unnamed(self) -> None:
        self._unnamed.inc()


class _NotRecorded(Exception):
    """A call (or a label change) the engine answered but the store did not take: the harness's error.

    Its answer is an error status (the store's refusal: 409, 422 or 503, as
    the ingest service answers; 502 when the engine's answer cannot be read)
    with the reason in the OpenAI error shape, which OpenAI clients raise,
    plus trajstore's ``rule``, ``index`` and ``trajectory_id``.
    """

    def __init__(self, status: int, reason: str, *, rule: str, trajectory_id: str | None = None,
                 index: int | None = None, what: str = "call not recorded") -> None:
        super().__init__(reason)
        self.status, self.reason, self.rule, self.what = status, reason, rule, what
        self.trajectory_id, self.index = trajectory_id, index

    @classmethod
    def of(cls, e: BaseException, trajectory_id: str | None, **kwargs: Any) -> "_NotRecorded":
        """The refusal of the store's error ``e`` (409, 422, 503: the ingest service's statuses);
        502 for anything else (the engine's answer cannot be read)."""
        if isinstance(e, TrajstoreError):
            error = HTTPError.from_error(e, message=_one_line(e))
            body = error.body["error"]
            return cls(error.status, _one_line(e), rule=error.rule, trajectory_id=body["trajectory_id"] or trajectory_id,
                       index=body["index"], **kwargs)
        return cls.unreadable(e, trajectory_id, **kwargs)

    @classmethod
    def unreadable(cls, e: BaseException, trajectory_id: str | None, **kwargs: Any) -> "_NotRecorded":
        """The refusal of an engine's answer the adapter cannot record (502, a bad gateway)."""
        reason = _one_line(e) if isinstance(e, (TrajstoreError, ValueError)) else \
            f"cannot read the upstream's answer: {_one_line(e)}"
        return cls(502, reason, rule=getattr(e, "rule", None) or "upstream_response", trajectory_id=trajectory_id,
                   **kwargs)

    @property
    def message(self) -> str:
        return f"trajstore proxy: {self.what}: {self.reason}"

    def error(self) -> dict:
        return {"error": {"message": self.message, "type": "TrajstoreNotRecorded", "param": None,
                          "code": self.status, "rule": self.rule, "index": self.index,
                          "trajectory_id": self.trajectory_id}}

    def response(self) -> Any:
        from fastapi.responses import JSONResponse

        return JSONResponse(self.error(), status_code=self.status, headers={"X-Trajstore-Error": self.reason})


class _Unreadable(Exception):
    """The adapter could not make events of the engine's answer (``error`` says why)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


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


class _UpstreamForwarder:
    """What every engine's proxy does alike: the upstream client and the headers forwarded, the 502 of
    an unreachable upstream, recording a call's answer (plain or streamed) and answering the harness,
    relaying the engine's control calls (mapping a label change's label), ``POST /trajstore/finish``.
    An engine's forwarder adds its calls' parsing and its adapters (``_Forwarder`` here for vLLM,
    ``_sglang_proxy.SGLangForwarder``).

    ``pass_through``: a call the store cannot take (a finished trajectory
    reused, an answer the adapter cannot read) still gets the engine's
    answer, with ``X-Trajstore-Error``; by default the harness gets an
    error instead (:class:`_NotRecorded`). Either way it is counted.
    """

    #: label-setting control endpoints -> the body field holding the new label
    label_fields: Mapping[str, str] = {}

    def __init__(self, recorder: Recorder, upstream: str, *, model_version: int, num_experts: int | None,
                 timeout_s: float, authenticated: bool, upstream_api_key: str | None,
                 pass_through: bool = False, metrics: Any = None) -> None:
        import httpx

        self.recorder, self.upstream = recorder, upstream
        self.model_version, self.num_experts = model_version, num_experts
        self.authenticated, self.upstream_api_key = authenticated, upstream_api_key
        self.pass_through = pass_through
        if metrics is None:
            from prometheus_client import CollectorRegistry

            metrics = _ProxyMetrics(CollectorRegistry())
        self.metrics = metrics
        self.client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._noted_clients: set = set()

    def headers(self, request: Any) -> dict:
        return _forward_headers(request.headers, authenticated=self.authenticated, upstream_api_key=self.upstream_api_key)

    def _unreachable(self, e: Exception) -> Any:
        return error_response(502, f"upstream {self.upstream} failed: {type(e).__name__}: {' '.join(str(e).split())}"[:500],
                              rule="upstream_unreachable")

    def note_unrecorded(self, request: Any, reason: str) -> dict:
        """Log once per client (address, user agent) that its calls pass unrecorded, and why."""
        self.metrics.unnamed()
        client = (request.client.host if request.client else "?", request.headers.get("user-agent", ""))
        if client not in self._noted_clients and len(self._noted_clients) < _MAX_NOTED_CLIENTS:
            self._noted_clients.add(client)
            log.warning("calls from %s (%s) pass through unrecorded: %s", client[0], client[1] or "no user agent", reason)
        return {"X-Trajstore-Unrecorded": reason}

    def upstream_error(self, status: int) -> dict:
        self.metrics.call("upstream_error")
        return {"X-Trajstore-Unrecorded": f"the upstream answered {status}"}

    async def record(self, tag: Tag, data: Any, make: Callable[[Any], Callable[[int], list[dict]]]) -> int:
        """Record the call whose answer is ``data`` (bytes or decoded JSON); its seq. Raises _NotRecorded.

        Whatever the upstream sent, the record is whole (one atomic append)
        or absent: an answer the adapter cannot read is a refusal, never an
        exception that would break the harness's response.
        """
        def events(seq: int) -> list[dict]:
            try:
                return make(data)(seq)
            except (TrajstoreError, ValueError) as e:
                raise _Unreadable(e) from None
            except Exception as e:  # an answer shape the adapter does not expect: say so, keep serving
                log.warning("not recorded: cannot read the upstream's answer", exc_info=True)
                raise _Unreadable(e) from None

        try:
            if isinstance(data, (bytes, bytearray, str)):
                try:
                    data = json.loads(data)
                except ValueError as e:
                    raise _Unreadable(e) from None
            seq = await self.recorder.record(tag, events)
        except _Unreadable as e:  # the engine's answer is not one the adapter can record: a bad gateway
            refusal = _NotRecorded.unreadable(e.error, tag.trajectory_id)
        except TrajstoreError as e:  # the store's refusal, with the status the ingest service answers
            refusal = _NotRecorded.of(e, tag.trajectory_id)
        else:
            self.metrics.call("recorded")
            return seq
        self._refused(tag, refusal)
        raise refusal

    def _refused(self, tag: Tag, refusal: _NotRecorded) -> None:
        self.metrics.call("passed_through" if self.pass_through else "refused", refusal.rule)
        log.warning("%s: call not recorded%s: %s", tag.trajectory_id,
                    " (passed through)" if self.pass_through else "", refusal.reason)

    async def answer(self, tag: Tag, resp: Any, content: bytes,
                     make: Callable[[Any], Callable[[int], list[dict]]]) -> Any:
        """The harness's answer to a named call the upstream answered 200: the upstream's bytes with
        ``X-Trajstore-Seq`` once recorded, else the refusal (``pass_through``: the bytes, with
        ``X-Trajstore-Error``)."""
        from fastapi.responses import Response

        try:
            headers = {"X-Trajstore-Seq": str(await self.record(tag, content, make))}
        except _NotRecorded as e:
            if not self.pass_through:
                return e.response()
            headers = {"X-Trajstore-Error": e.reason}
        return Response(content, status_code=resp.status_code, headers=headers, media_type=resp.headers.get("content-type"))

    async def recorded_stream(self, resp: Any, tag: Tag, acc: Any, make: Callable[[Any], Callable[[int], list[dict]]],
                              sse_media: bool) -> AsyncIterator[bytes]:
        """The upstream's bytes as they come; the record once the stream has ended whole.

        ``acc``: the engine's stream accumulator (``add(chunk)``,
        ``finished()``, ``response()``). A stream is whole when it ended
        (every choice has its finish reason; ``[DONE]`` alone is not an end)
        and nothing in it was unreadable. Then the record is appended before
        the stream's end (its ``data: [DONE]``, held back until then) reaches
        the harness, which can rely on it; the comment ``: X-Trajstore-Seq:
        <seq>`` follows. A stream the upstream cut, or one that ended before
        its end, records nothing and gets an SSE ``data: {"error": ...}``
        event (vLLM's and SGLang's own shape for an error mid-stream, which
        an OpenAI client raises) before its ``[DONE]``. A whole stream the
        store refuses or that cannot be read gets such an event too, or,
        ``pass_through``, the comment ``: X-Trajstore-Error: ...`` after the
        stream as it came. SSE clients skip comments.
        """
        import httpx

        sse = _SSEData(hold_done=not self.pass_through)
        unreadable: str | None = None
        cut: str | None = None

        def take(objs: list) -> None:
            nonlocal unreadable
            for obj in objs:
                if unreadable is None:
                    try:  # a chunk the proxy cannot read must not cut the harness's stream
                        acc.add(obj)
                    except (ValueError, TypeError, AttributeError, LookupError) as e:
                        unreadable = f"a chunk cannot be read: {_one_line(e)}"

        try:
            async for chunk in resp.aiter_raw():
                objs, out = sse.take(chunk)
                take(objs)
                if out:
                    yield out
        except httpx.HTTPError as e:
            cut = f"the upstream stream broke off ({type(e).__name__}: {' '.join(str(e).split())})"
        finally:
            await resp.aclose()
        objs, before, after = sse.end()
        if before:
            yield before
        if cut is None:
            take(objs)  # a last data line without its newline still counts
            unreadable = unreadable or sse.bad
            # an unreadable stream that ended ([DONE]) is refused as unreadable, one that did not is cut
            if not acc.finished() and (unreadable is None or not sse.done):
                cut = "the upstream stream ended before its end" + (
                    " (no finish reason)" if sse.done else " (no finish reason, no [DONE])")
        if cut is not None:
            reason = f"{cut}: call not recorded"
            log.warning("%s: %s", tag.trajectory_id, reason)
            self.metrics.call("stream_cut", "stream_cut")
            if sse_media:
                yield _sse_event({"error": {"message": f"trajstore proxy: {reason}", "type": "UpstreamStreamCut",
                                            "param": None, "code": 502}})
            if after:
                yield after
            return
        refusal: _NotRecorded | None = None
        if unreadable is not None:
            refusal = _NotRecorded(502, unreadable, rule="upstream_response", trajectory_id=tag.trajectory_id)
        else:
            try:
                response = acc.response()
            except (TrajstoreError, ValueError) as e:  # e.g. the stream carried the engine's error event
                refusal = _NotRecorded.unreadable(e, tag.trajectory_id)
        if refusal is not None:
            self._refused(tag, refusal)
        else:
            try:
                headers = {"X-Trajstore-Seq": str(await self.record(tag, response, make))}
            except _NotRecorded as e:
                refusal = e
        if refusal is not None:
            if not self.pass_through:
                if sse_media:
                    yield _sse_event(refusal.error())
                if after:
                    yield after
                return
            headers = {"X-Trajstore-Error": f"not recorded: {refusal.reason}"}
        if after:
            yield after
        if sse_media:
            yield _sse_comments(headers)

    async def relay(self, request: Any, path: str) -> Any:
        """Forward a call as it is (method, query, body) and answer the upstream's bytes; nothing recorded.

        A label change (a path of ``label_fields``) that carries
        ``X-Trajstore-Model-Version`` also maps its label in the store (a
        ``version_label`` event) once the engine took it; when the store
        refuses the mapping the harness gets the refusal (the engine kept
        the label), or, ``pass_through``, the engine's answer with
        ``X-Trajstore-Error``.
        """
        import httpx
        from fastapi.responses import Response

        try:
            body = await request.body()
            query = request.url.query
            url = httpx.URL(path, query=query.encode("latin-1")) if query else path
            resp = await self.client.request(request.method, url, content=body, headers=self.headers(request))
            content = resp.content
        except httpx.HTTPError as e:
            return self._unreachable(e)
        extra = {}
        if path in self.label_fields and resp.status_code == 200 and "x-trajstore-model-version" in request.headers:
            try:
                extra = await self._map_label(request.headers["x-trajstore-model-version"], body, self.label_fields[path])
            except _NotRecorded as e:
                if not self.pass_through:
                    return e.response()
                extra = {"X-Trajstore-Error": e.reason}
        return Response(content, status_code=resp.status_code, headers=extra, media_type=resp.headers.get("content-type"))

    async def _map_label(self, version: str, body: bytes, field: str) -> dict:
        from starlette.concurrency import run_in_threadpool

        label: Any = None
        try:
            label = json.loads(body).get(field)
            if not isinstance(label, str) or not label:
                raise ValidationError(f"the body has no {field} label to map", rule="version_label")
            event = {"type": "version_label", "label": label, "model_version": _int_or_none(version, "model_version")}
            await run_in_threadpool(self.recorder.store.append, [event])
        except (TrajstoreError, ValueError, AttributeError) as e:
            reason = f"label {label!r:.80} not mapped to model_version {version!r:.20}: {_one_line(e)}"
            status = HTTPError.from_error(e).status if isinstance(e, TrajstoreError) else 422
            refusal = _NotRecorded(status, reason, rule=getattr(e, "rule", None) or "version_label",
                                   what="the engine took the label change, the store did not map it")
            self.metrics.label("passed_through" if self.pass_through else "refused", refusal.rule)
            log.warning("%s", reason)
            raise refusal from None
        self.metrics.label("mapped")
        return {"X-Trajstore-Label": f"{label}={version}"}

    async def finish(self, request: Any) -> Any:
        try:
            body = await request.json()
            tid, status = body["trajectory_id"], body.get("status", "completed")
            await self.recorder.finish(tid, status, body.get("reward"))
        except ValidationError as e:
            return HTTPError.from_error(e, message=str(e)).response()
        except (ValueError, KeyError, TypeError) as e:
            return error_response(400, f'body must be {{"trajectory_id", "status", "reward"?}} ({e})', rule="malformed_body")
        return {"trajectory_id": tid, "status": status}


def _proxy_app(fwd: _UpstreamForwarder, *, title: str, token: str | None,
              routes: list[tuple[str, str, str, Callable[[Any], Any]]], on_close: Callable[[], None] | None = None,
              metrics: Any = None) -> Any:
    """The FastAPI app of a recording proxy: ``routes`` (method, path, name, ``call(request)``), then
    ``POST /trajstore/finish``, ``GET /healthz`` and, with ``metrics`` (an ingest ``Metrics``, whose
    registry holds the forwarder's counters), ``GET /metrics``; every path but ``OPEN_PATHS`` and
    ``/metrics`` behind the token (``token=None``: no auth). Its shutdown closes the upstream client,
    then ``on_close()``."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse

    @asynccontextmanager
    async def lifespan(app: Any):
        yield
        await fwd.client.aclose()
        if on_close is not None:
            on_close()

    app = FastAPI(title=title, version="1", lifespan=lifespan)
    app.state.recorder = fwd.recorder
    if token is not None:
        # Prometheus scrapes without a token, as on the ingest service; counters carry no recorded data
        app.add_middleware(BearerAuth, token=token, open_paths=OPEN_PATHS | {"/metrics"})

    def handler_of(call: Callable[[Any], Any]) -> Callable:
        async def handler(request: Request) -> Any:
            return await call(request)
        return handler

    for method, path, name, call in routes:
        app.add_api_route(path, handler_of(call), methods=[method], name=name)

    @app.post("/trajstore/finish")
    async def finish(request: Request) -> Any:
        return await fwd.finish(request)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    if metrics is not None:
        @app.get("/metrics", response_class=PlainTextResponse)
        async def get_metrics() -> str:
            return metrics.render()

    return app


def _recorder_and_metrics(store: Any, group_commit: bool) -> tuple[Recorder, Any, _ProxyMetrics, Any]:
    """A proxy's recorder (group-committing unless told not to), its ingest ``Metrics`` (the commits and the
    registry ``GET /metrics`` renders), its ``_ProxyMetrics``, and what to call at shutdown."""
    from trajstore.ingest.service import GroupCommitter, Metrics

    metrics = Metrics()
    committer = GroupCommitter(store, metrics=metrics, max_wait_s=0.0) if group_commit else None
    # closing the committer appends what is queued first
    return (Recorder(store, committer), metrics, _ProxyMetrics(metrics.registry),
            None if committer is None else committer.close)


def _token_ids(value: Any) -> bool:
    """Is ``value`` a non-empty list of token ids (ints, not bools)? Only then can a prompt continue a recording."""
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class _Forwarder(_UpstreamForwarder):
    """Forwards one call to vLLM and records it (the proxy's handlers)."""

    label_fields = _LABEL_FIELDS

    def __init__(self, recorder: Recorder, upstream: str, *, model_version: int, num_experts: int | None,
                 timeout_s: float, authenticated: bool, upstream_api_key: str | None, version_map: VersionMap,
                 skip_recorded_routes: bool, pass_through: bool = False, metrics: Any = None) -> None:
        super().__init__(recorder, upstream, model_version=model_version, num_experts=num_experts,
                         timeout_s=timeout_s, authenticated=authenticated, upstream_api_key=upstream_api_key,
                         pass_through=pass_through, metrics=metrics)
        self.version_map, self.skip_recorded_routes = version_map, skip_recorded_routes

    def _events(self, kind: str, body: dict, tag: Tag) -> Callable[[Any], Callable[[int], list[dict]]]:
        """response -> (seq -> the call's generation events)."""
        def for_response(response: Any) -> Callable[[int], list[dict]]:
            if not isinstance(response, dict):
                raise ValidationError(f"the upstream's answer is a JSON {type(response).__name__}, not an object",
                                      rule="upstream_response")
            ids = {"trajectory_id": tag.trajectory_id, "model_version": tag.model_version, "version_map": self.version_map}
            if kind == "tito":
                make = lambda seq: generations_from_tito(response, body, seq=seq, **ids)  # noqa: E731
            else:
                start = routed_experts_prompt_start_of(body)
                make = lambda seq: generations_from_openai(response, seq=seq, routed_experts_prompt_start=start, **ids)  # noqa: E731
            return lambda seq: _one_choice(make(seq))
        return for_response

    async def _parse(self, request: Any, kind: str) -> tuple[dict, Tag | None]:
        """The body to forward and the call's tag; raises _BadCall."""
        try:
            body = await request.json()
        except ValueError as e:
            raise _BadCall(400, f"body is not JSON ({e})", "malformed_json") from None
        if not isinstance(body, dict):
            raise _BadCall(400, "body must be a JSON object", "malformed_json")
        try:
            tag = tag_of(request.headers, body, self.model_version, self.num_experts)
            if tag is None:
                return body, None
            params = body.get("sampling_params") if kind == "tito" else body
            if ((params.get("n") if isinstance(params, dict) else None) or 1) != 1:
                raise _BadCall(400, "a recorded call must have n = 1 (one trajectory per choice)", "n")
            if kind == "tito":
                body = request_params_for_tito(body)
            else:
                body = request_params_for_recording(body, chat=kind == "chat")
            await self._ask_only_new_rows(kind, body, tag)
        except ValidationError as e:
            raise _BadCall(400, e.reason, e.rule) from None
        return body, tag

    async def _ask_only_new_rows(self, kind: str, body: dict, tag: Tag) -> None:
        """Set routed_experts_prompt_start to the recorded rows when the prompt is known and continues them."""
        if not self.skip_recorded_routes or kind == "chat":
            return  # a chat prompt is rendered upstream: the proxy cannot tell whether it continues
        params = body["sampling_params"] if kind == "tito" else body
        if params.get("routed_experts_prompt_start") is not None:
            routed_experts_prompt_start_of(body)  # the caller's choice, checked, kept
            return
        prompt = body.get("token_ids") if kind == "tito" else body.get("prompt")
        if not _token_ids(prompt):
            return
        try:
            start = await self.recorder.route_start(tag.trajectory_id, prompt)
        except TrajstoreError as e:  # the call still goes through, with every row
            log.warning("could not read %s's recorded routes: %s", tag.trajectory_id, e)
            return
        if start:
            params["routed_experts_prompt_start"] = start

    async def forward(self, request: Any, path: str) -> Any:
        import httpx
        from fastapi.responses import Response

        kind = RECORDED[path]
        try:
            body, tag = await self._parse(request, kind)
            headers = self.headers(request)
            if body.get("stream"):
                return await self.stream(request, path, body, headers, tag, kind)
            resp = await self.client.post(path, json=body, headers=headers)
            content = resp.content
        except _BadCall as e:
            return error_response(e.status, str(e), rule=e.rule)
        except httpx.HTTPError as e:  # refused, reset, timed out, cut mid-body, undecodable
            return self._unreachable(e)
        if tag is not None and resp.status_code == 200:
            return await self.answer(tag, resp, content, self._events(kind, body, tag))
        extra = self.note_unrecorded(request, UNNAMED) if tag is None else self.upstream_error(resp.status_code)
        return Response(content, status_code=resp.status_code, headers=extra, media_type=resp.headers.get("content-type"))

    async def stream(self, request: Any, path: str, body: dict, headers: dict, tag: Tag | None, kind: str) -> Any:
        from fastapi.responses import StreamingResponse

        resp = await self.client.send(self.client.build_request("POST", path, json=body, headers=headers), stream=True)
        media_type = resp.headers.get("content-type")
        sse = "text/event-stream" in (media_type or "")
        if tag is None or resp.status_code != 200:
            extra = self.note_unrecorded(request, UNNAMED) if tag is None else self.upstream_error(resp.status_code)
            return StreamingResponse(_passthrough(resp, sse), status_code=resp.status_code, media_type=media_type,
                                     headers=extra)
        recorded = self.recorded_stream(resp, tag, OpenAIStreamAccumulator(), self._events(kind, body, tag), sse)
        return StreamingResponse(recorded, media_type=media_type)


def _one_choice(events: list[dict]) -> list[dict]:
    if len(events) != 1:  # the request had n = 1 (checked): another count is the upstream's fault
        raise ValidationError(f"the upstream answered {len(events)} choices to a call with n = 1", rule="upstream_response")
    return events


class _BadCall(Exception):
    def __init__(self, status: int, message: str, rule: str) -> None:
        super().__init__(message)
        self.status, self.rule = status, rule


def make_proxy_app(store: Any, upstream: str, *, token: str | None = None, model_version: int = 0,
                   num_experts: int | None = None, timeout_s: float = 600.0, upstream_api_key: str | None = None,
                   version_map: VersionMap = None, skip_recorded_routes: bool = True,
                   group_commit: bool = True, pass_through_unrecorded: bool = False) -> Any:
    """The FastAPI app recording calls into ``store`` and forwarding them to ``upstream``.

    ``upstream``: the engine's base URL (a trailing ``/v1`` is dropped,
    :func:`normalize_upstream`). ``token=None`` means no auth (the caller
    decided; ``serve_proxy`` refuses that unless told ``insecure_no_auth``).
    ``upstream_api_key``: the bearer token the upstream wants.
    ``version_map``: weight-version labels to model versions, appended to the
    store as ``version_label`` events when the app is made (the engine's spans
    are recorded as sent and the store resolves them). ``skip_recorded_routes=False``: never set
    ``routed_experts_prompt_start`` (an engine without it). ``group_commit=False``:
    append each call's record on its own (see :class:`Recorder`);
    ``app.state.commit_metrics.commits`` counts the appends.
    ``pass_through_unrecorded=True``: a named call the store cannot take
    still gets the engine's answer, with ``X-Trajstore-Error`` (counted in
    ``GET /metrics``); by default the harness gets an error status with the
    reason in the OpenAI error shape.
    """
    upstream = normalize_upstream(upstream)
    if isinstance(version_map, Mapping):
        # The labels go into the store's label map: every process resolves them, and a
        # trajectory held back on one of them is released.
        store.append(version_label_events(version_map))
        version_map = None
    recorder, metrics, proxy_metrics, on_close = _recorder_and_metrics(store, group_commit)
    fwd = _Forwarder(recorder, upstream, model_version=model_version,
                     num_experts=num_experts, timeout_s=timeout_s, authenticated=token is not None,
                     upstream_api_key=upstream_api_key, version_map=version_map,
                     skip_recorded_routes=skip_recorded_routes, pass_through=pass_through_unrecorded,
                     metrics=proxy_metrics)

    def recorded(path: str) -> Callable:
        return lambda request: fwd.forward(request, path)

    def forwarded(path: str) -> Callable:
        return lambda request: fwd.relay(request, path)

    routes = [("POST", path, f"record {path}", recorded(path)) for path in RECORDED]
    routes += [(method, path, f"forward {method} {path}", forwarded(path)) for method, path in FORWARDED]
    app = _proxy_app(fwd, title="trajstore recording proxy", token=token, routes=routes, on_close=on_close,
                     metrics=metrics)
    app.state.forwarder = fwd
    app.state.commit_metrics = metrics
    return app


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``trajstore proxy`` (``--store`` is the CLI's global flag)."""
    parser.add_argument("--upstream", required=True, help="base URL of the vLLM server, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped)")
    add_server_arguments(parser, port=DEFAULT_PORT, open_help="accept calls without a token",
                         token_help="bearer token every call but /healthz and the API docs must send")
    parser.add_argument("--upstream-api-key", default=None,
                        help="bearer token sent to the upstream (default $TRAJSTORE_UPSTREAM_API_KEY; none)")
    parser.add_argument("--model-version", type=int, default=0,
                        help="model version recorded when a call has no X-Trajstore-Model-Version header (default 0)")
    parser.add_argument("--num-experts", type=int, default=None,
                        help="num_experts of trajectories the proxy starts (default: not declared)")
    parser.add_argument("--version-map", default=None,
                        help='JSON object from vLLM weight-version labels to model versions, e.g. \'{"ckpt-a": 3}\', '
                             "appended to the store's label map at start (labels can also be mapped later with "
                             "version_label events; decimal labels and \"default\" need none)")
    parser.add_argument("--no-route-skip", action="store_true",
                        help="never ask the engine for only the new route rows (routed_experts_prompt_start)")
    parser.add_argument("--pass-through-unrecorded", action="store_true",
                        help="a named call the store cannot take (a finished trajectory reused, an answer that cannot "
                             "be read) still gets the engine's answer, with X-Trajstore-Error (counted in /metrics); "
                             "default: the harness gets an error status with the reason")


def serve_proxy(upstream: str, store_url: str | None = None, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                token: str | None = None, insecure_no_auth: bool = False, upstream_api_key: str | None = None,
                model_version: int = 0, num_experts: int | None = None, version_map: VersionMap = None,
                skip_recorded_routes: bool = True, log_level: str = "warning",
                payload: str | None = None, pass_through_unrecorded: bool = False) -> None:
    """Run the recording proxy until SIGINT/SIGTERM.

    Refuses to start without a token (``token`` or ``$TRAJSTORE_TOKEN``)
    unless ``insecure_no_auth``, as ``trajstore serve`` does.
    """
    token = server_token(token, insecure_no_auth=insecure_no_auth)
    upstream = normalize_upstream(upstream)  # a bad URL is refused before anything starts
    upstream_api_key = upstream_api_key or os.environ.get("TRAJSTORE_UPSTREAM_API_KEY") or None
    import trajstore

    store = trajstore.connect(store_url, payload=payload)
    try:
        app = make_proxy_app(store, upstream, token=token, model_version=model_version, num_experts=num_experts,
                             upstream_api_key=upstream_api_key, version_map=version_map,
                             skip_recorded_routes=skip_recorded_routes,
                             pass_through_unrecorded=pass_through_unrecorded)
        run_server(app, name="proxy", host=host, port=port, store_url=store_url, payload=payload, log_level=log_level)
    finally:
        store.close()


def _version_map_arg(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--version-map is not JSON ({e})") from None
    if not isinstance(value, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        raise ValueError("--version-map must be a JSON object of integers, e.g. '{\"ckpt-a\": 3}'")
    return value


def serve_proxy_from_args(args: argparse.Namespace) -> None:
    serve_proxy(args.upstream, getattr(args, "store", None), args.host, args.port, token=args.token,
                insecure_no_auth=args.insecure_no_auth, upstream_api_key=args.upstream_api_key,
                model_version=args.model_version, num_experts=args.num_experts,
                version_map=_version_map_arg(args.version_map), skip_recorded_routes=not args.no_route_skip,
                log_level=args.log_level, payload=getattr(args, "payload", None),
                pass_through_unrecorded=getattr(args, "pass_through_unrecorded", False))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trajstore-proxy", description="OpenAI-compatible recording proxy for vLLM")
    parser.add_argument("--store", default=None, help="store URL (default $TRAJSTORE_URL or the embedded default)")
    add_cli_arguments(parser)
    try:
        serve_proxy_from_args(parser.parse_args(argv))
    except (ValueError, TrajstoreError) as e:
        raise SystemExit(f"trajstore proxy: {e}") from None
