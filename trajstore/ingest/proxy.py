"""OpenAI-compatible recording proxy in front of a vLLM server.

A harness points its OpenAI client at the proxy instead of vLLM and names
the trajectory of each call with the header ``X-Trajstore-Trajectory`` (or
the body field ``"trajstore": {"trajectory_id": ...}``, removed before
forwarding). The proxy forwards ``/v1/completions`` and
``/v1/chat/completions`` with ``return_token_ids`` and sampled-token
``logprobs`` switched on (``trajstore.ingest.vllm.request_params_for_recording``),
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
starts the trajectory). Calls without a trajectory are forwarded unrecorded.
``POST /trajstore/finish`` ``{"trajectory_id", "status", "reward"?}`` ends a
trajectory. The response carries ``X-Trajstore-Seq`` when recorded, or
``X-Trajstore-Error`` (one line) when the store refused the record.

Auth: with a token (``--token`` / ``$TRAJSTORE_TOKEN``, as ``trajstore
serve``) every endpoint but ``/healthz``, ``/openapi.json``, ``/docs`` and
``/redoc`` needs ``Authorization: Bearer <token>``; the harness's client
sends it as its API key. That header is not forwarded: the upstream gets
``--upstream-api-key`` instead, if any.

Streams (``"stream": true``) are passed through chunk by chunk while the
``data:`` objects are accumulated; the record is appended when the stream
ends, before the connection closes. vLLM streams no routes on the OpenAI
endpoints (those calls are recorded without them); ``/inference/v1/generate``
sends routes and version spans on the final chunk.

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
from typing import Any, AsyncIterator, Callable

import numpy as np

from trajstore._admission import sequence_hash
from trajstore.errors import TrajstoreError, ValidationError
from trajstore.ingest._event_dicts import trajectory_started
from trajstore.ingest._http import (UNAUTHORIZED, HTTPError, add_server_arguments, bearer_ok, error_response, run_server,
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

__all__ = ["Recorder", "Tag", "add_cli_arguments", "main", "make_proxy_app", "serve_proxy", "serve_proxy_from_args", "tag_of"]

log = logging.getLogger("trajstore.ingest.proxy")

DEFAULT_PORT = 8701
_HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
               "upgrade", "proxy-authorization", "proxy-authenticate", "accept-encoding"}
# Open without the token: they change nothing and show no recorded data.
OPEN_PATHS = frozenset({"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
TITO_PATH = "/inference/v1/generate"


@dataclass
class Tag:
    """What the harness said about a call: which trajectory, which policy version."""

    trajectory_id: str
    model_version: int
    group_id: str | None = None
    num_experts: int | None = None


class Recorder:
    """Numbers each trajectory's calls and appends them, one call at a time per trajectory."""

    def __init__(self, store: Any) -> None:
        self.store = store
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
                    await run_in_threadpool(self.store.append, events)
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
        from starlette.concurrency import run_in_threadpool

        events: list[dict] = []
        if reward is not None:
            events.append({"type": "reward", "trajectory_id": trajectory_id, "reward": reward})
        events.append({"type": "trajectory_finished", "trajectory_id": trajectory_id, "status": status})
        async with self._lock(trajectory_id):
            await run_in_threadpool(self.store.append, events)
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


class _BearerAuth:
    """ASGI middleware: every path outside OPEN_PATHS needs ``Authorization: Bearer <token>``.

    A middleware rather than a check per handler, so an endpoint added later
    is closed unless it is listed as open.
    """

    def __init__(self, app: Any, token: str) -> None:
        self.app, self.token = app, token

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
        if bearer_ok(header, self.token):
            await self.app(scope, receive, send)
            return
        await error_response(401, UNAUTHORIZED, rule="unauthorized")(scope, receive, send)


class _SSEData:
    """Splits an SSE byte stream into ``data:`` payloads (decoded JSON objects)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[dict]:
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        out = []
        for line in lines:
            line = line.strip()
            if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
                try:
                    out.append(json.loads(line[5:]))
                except ValueError:
                    log.warning("unparsable SSE data line from upstream")
        return out


_KINDS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", TITO_PATH: "tito"}


class _Forwarder:
    """Forwards one call to the upstream and records it (the proxy's handlers)."""

    def __init__(self, recorder: Recorder, upstream: str, *, model_version: int, num_experts: int | None,
                 timeout_s: float, authenticated: bool, upstream_api_key: str | None, version_map: VersionMap,
                 skip_recorded_routes: bool) -> None:
        import httpx

        self.recorder, self.upstream = recorder, upstream
        self.model_version, self.num_experts = model_version, num_experts
        self.authenticated, self.upstream_api_key = authenticated, upstream_api_key
        self.version_map, self.skip_recorded_routes = version_map, skip_recorded_routes
        self.client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=httpx.Timeout(timeout_s, connect=10.0))

    def headers(self, request: Any) -> dict:
        return _forward_headers(request.headers, authenticated=self.authenticated, upstream_api_key=self.upstream_api_key)

    def _events(self, kind: str, body: dict, tag: Tag) -> Callable[[Any], Callable[[int], list[dict]]]:
        """response -> (seq -> the call's generation events)."""
        def for_response(response: dict) -> Callable[[int], list[dict]]:
            ids = {"trajectory_id": tag.trajectory_id, "model_version": tag.model_version, "version_map": self.version_map}
            if kind == "tito":
                return lambda seq: generations_from_tito(response, body, seq=seq, **ids)
            start = routed_experts_prompt_start_of(body)
            return lambda seq: generations_from_openai(response, seq=seq, routed_experts_prompt_start=start, **ids)
        return for_response

    async def record_headers(self, tag: Tag, data: Any, make: Callable[[Any], Callable[[int], list[dict]]]) -> dict:
        try:
            if not isinstance(data, dict):
                data = json.loads(data)
            return {"X-Trajstore-Seq": str(await self.recorder.record(tag, make(data)))}
        except (TrajstoreError, ValueError) as e:
            log.warning("not recorded: %s", e)
            return {"X-Trajstore-Error": str(e).replace("\n", " ")[:500]}

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
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
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

        kind = _KINDS[path]
        try:
            body, tag = await self._parse(request, kind)
            headers = self.headers(request)
            if body.get("stream"):
                return await self.stream(path, body, headers, tag, kind)
            resp = await self.client.post(path, json=body, headers=headers)
        except _BadCall as e:
            return error_response(e.status, str(e), rule=e.rule)
        except httpx.TransportError as e:
            return error_response(502, f"upstream {self.upstream} unreachable: {type(e).__name__}: {e}",
                                  rule="upstream_unreachable")
        extra = {}
        if tag is not None and resp.status_code == 200:
            extra = await self.record_headers(tag, resp.content, self._events(kind, body, tag))
        return Response(resp.content, status_code=resp.status_code, headers=extra,
                        media_type=resp.headers.get("content-type"))

    async def stream(self, path: str, body: dict, headers: dict, tag: Tag | None, kind: str) -> Any:
        from fastapi.responses import StreamingResponse

        resp = await self.client.send(self.client.build_request("POST", path, json=body, headers=headers), stream=True)
        media_type = resp.headers.get("content-type")
        if resp.status_code != 200 or tag is None:
            return StreamingResponse(_passthrough(resp), status_code=resp.status_code, media_type=media_type)
        return StreamingResponse(self._recorded(resp, tag, self._events(kind, body, tag)), media_type=media_type)

    async def _recorded(self, resp: Any, tag: Tag, make: Callable[[Any], Callable[[int], list[dict]]]) -> AsyncIterator[bytes]:
        acc, sse = OpenAIStreamAccumulator(), _SSEData()
        async for chunk in _passthrough(resp):
            for obj in sse.feed(chunk):
                acc.add(obj)
            yield chunk
        # The stream's bytes are all sent; the record is appended before the
        # response ends, so a harness that saw the end can rely on it.
        await self.record_headers(tag, acc.response(), make)

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


class _BadCall(Exception):
    def __init__(self, status: int, message: str, rule: str) -> None:
        super().__init__(message)
        self.status, self.rule = status, rule


async def _passthrough(resp: Any) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    finally:
        await resp.aclose()


def make_proxy_app(store: Any, upstream: str, *, token: str | None = None, model_version: int = 0,
                   num_experts: int | None = None, timeout_s: float = 600.0, upstream_api_key: str | None = None,
                   version_map: VersionMap = None, skip_recorded_routes: bool = True) -> Any:
    """The FastAPI app recording calls into ``store`` and forwarding them to ``upstream``.

    ``token=None`` means no auth (the caller decided; ``serve_proxy`` refuses
    that unless told ``insecure_no_auth``). ``upstream_api_key``: the bearer
    token the upstream wants. ``version_map``: weight-version labels to model
    versions (``trajstore.ingest.vllm``). ``skip_recorded_routes=False``:
    never set ``routed_experts_prompt_start`` (an engine without it).
    """
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    fwd = _Forwarder(Recorder(store), upstream, model_version=model_version, num_experts=num_experts,
                     timeout_s=timeout_s, authenticated=token is not None, upstream_api_key=upstream_api_key,
                     version_map=version_map, skip_recorded_routes=skip_recorded_routes)

    @asynccontextmanager
    async def lifespan(app: Any):
        yield
        await fwd.client.aclose()

    app = FastAPI(title="trajstore recording proxy", version="1", lifespan=lifespan)
    app.state.recorder = fwd.recorder
    if token is not None:
        app.add_middleware(_BearerAuth, token=token)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await fwd.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await fwd.forward(request, "/v1/chat/completions")

    @app.post(TITO_PATH)
    async def generate(request: Request) -> Any:
        return await fwd.forward(request, TITO_PATH)

    @app.post("/trajstore/finish")
    async def finish(request: Request) -> Any:
        return await fwd.finish(request)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        resp = await fwd.client.get("/v1/models", headers=fwd.headers(request))
        return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    return app


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``trajstore proxy`` (``--store`` is the CLI's global flag)."""
    parser.add_argument("--upstream", required=True, help="base URL of the vLLM OpenAI server, e.g. http://127.0.0.1:8000")
    add_server_arguments(parser, port=DEFAULT_PORT, open_help="accept calls without a token",
                         token_help="bearer token every call but /healthz and the API docs must send")
    parser.add_argument("--upstream-api-key", default=None,
                        help="bearer token sent to the upstream (default $TRAJSTORE_UPSTREAM_API_KEY; none)")
    parser.add_argument("--model-version", type=int, default=0,
                        help="model version recorded when a call has no X-Trajstore-Model-Version header (default 0)")
    parser.add_argument("--num-experts", type=int, default=None,
                        help="num_experts of trajectories the proxy starts (default: not declared)")
    parser.add_argument("--version-map", default=None,
                        help='JSON object from vLLM weight-version labels to model versions, e.g. \'{"ckpt-a": 3}\' '
                             "(default: labels must be integers)")
    parser.add_argument("--no-route-skip", action="store_true",
                        help="never ask the engine for only the new route rows (routed_experts_prompt_start)")


def serve_proxy(upstream: str, store_url: str | None = None, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                token: str | None = None, insecure_no_auth: bool = False, upstream_api_key: str | None = None,
                model_version: int = 0, num_experts: int | None = None, version_map: VersionMap = None,
                skip_recorded_routes: bool = True, log_level: str = "warning",
                payload: str | None = None) -> None:
    """Run the recording proxy until SIGINT/SIGTERM.

    Refuses to start without a token (``token`` or ``$TRAJSTORE_TOKEN``)
    unless ``insecure_no_auth``, as ``trajstore serve`` does.
    """
    token = server_token(token, insecure_no_auth=insecure_no_auth)
    upstream_api_key = upstream_api_key or os.environ.get("TRAJSTORE_UPSTREAM_API_KEY") or None
    import trajstore

    store = trajstore.connect(store_url, payload=payload)
    try:
        app = make_proxy_app(store, upstream, token=token, model_version=model_version, num_experts=num_experts,
                             upstream_api_key=upstream_api_key, version_map=version_map,
                             skip_recorded_routes=skip_recorded_routes)
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
                log_level=args.log_level, payload=getattr(args, "payload", None))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trajstore-proxy", description="OpenAI-compatible recording proxy for vLLM")
    parser.add_argument("--store", default=None, help="store URL (default $TRAJSTORE_URL or the embedded default)")
    add_cli_arguments(parser)
    try:
        serve_proxy_from_args(parser.parse_args(argv))
    except (ValueError, TrajstoreError) as e:
        raise SystemExit(f"trajstore proxy: {e}") from None
