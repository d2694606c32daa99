"""OpenAI-compatible recording proxy in front of a vLLM server.

A harness points its OpenAI client at the proxy instead of vLLM and names
the trajectory of each call with the header ``X-Trajstore-Trajectory`` (or
the body field ``"trajstore": {"trajectory_id": ...}``, removed before
forwarding). The proxy forwards ``/v1/completions`` and
``/v1/chat/completions`` with ``return_token_ids`` and sampled-token
``logprobs`` switched on (``trajstore.ingest.vllm.request_params_for_recording``),
records the call as the trajectory's next generation event (``seq`` assigned
here), and returns the upstream's response bytes unchanged. Routes come
with every non-streaming response when vLLM runs with
``--enable-return-routed-experts``.

Other headers: ``X-Trajstore-Model-Version`` (else ``--model-version``),
``X-Trajstore-Group`` and ``X-Trajstore-Num-Experts`` (used when the call
starts the trajectory). Calls without a trajectory are forwarded unrecorded.
``POST /trajstore/finish`` ``{"trajectory_id", "status", "reward"?}`` ends a
trajectory. The response carries ``X-Trajstore-Seq`` when recorded, or
``X-Trajstore-Error`` (one line) when the store refused the record.

Streams (``"stream": true``) are passed through chunk by chunk while the
``data:`` objects are accumulated; the record is appended when the stream
ends, before the connection closes. vLLM does not stream routes, so streamed
calls are recorded without them.

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
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator

from trajstore.errors import TrajstoreError, ValidationError
from trajstore.ingest.vllm import OpenAIStreamAccumulator, generations_from_openai, request_params_for_recording

__all__ = ["Recorder", "Tag", "add_cli_arguments", "main", "make_proxy_app", "serve_proxy", "serve_proxy_from_args", "tag_of"]

log = logging.getLogger("trajstore.ingest.proxy")

DEFAULT_PORT = 8701
_HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
               "upgrade", "proxy-authorization", "proxy-authenticate", "accept-encoding"}


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

    async def record(self, tag: Tag, response: dict) -> int:
        """Append ``response`` as ``tag``'s next generation; return its seq."""
        from starlette.concurrency import run_in_threadpool

        async with self._lock(tag.trajectory_id):
            for attempt in (0, 1):
                known = tag.trajectory_id in self._next_seq
                stored, seq = (True, self._next_seq[tag.trajectory_id]) if known else await run_in_threadpool(self._tail, tag.trajectory_id)
                events = generations_from_openai(response, trajectory_id=tag.trajectory_id, seq=seq,
                                                 model_version=tag.model_version)
                if not stored:
                    events.insert(0, _started(tag))
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


def _started(tag: Tag) -> dict:
    event: dict = {"type": "trajectory_started", "trajectory_id": tag.trajectory_id}
    if tag.group_id is not None:
        event["group_id"] = tag.group_id
    if tag.num_experts is not None:
        event["num_experts"] = tag.num_experts
    return event


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


def _forward_headers(headers: Any) -> dict:
    out = {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP and not k.lower().startswith("x-trajstore-")}
    out["Accept-Encoding"] = "identity"  # streamed bytes are parsed as SSE on the way through
    return out


def _error(status: int, message: str, rule: str) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "rule": rule}}, status_code=status)


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


class _Forwarder:
    """Forwards one call to the upstream and records it (the proxy's handlers)."""

    def __init__(self, recorder: Recorder, upstream: str, *, model_version: int, num_experts: int | None,
                 timeout_s: float) -> None:
        import httpx

        self.recorder, self.upstream = recorder, upstream
        self.model_version, self.num_experts = model_version, num_experts
        self.client = httpx.AsyncClient(base_url=upstream.rstrip("/"), timeout=httpx.Timeout(timeout_s, connect=10.0))

    async def record_headers(self, tag: Tag, data: Any) -> dict:
        try:
            if not isinstance(data, dict):
                data = json.loads(data)
            return {"X-Trajstore-Seq": str(await self.recorder.record(tag, data))}
        except (TrajstoreError, ValueError) as e:
            log.warning("not recorded: %s", e)
            return {"X-Trajstore-Error": str(e).replace("\n", " ")[:500]}

    async def _parse(self, request: Any, chat: bool) -> tuple[dict, Tag | None]:
        """The body to forward and the call's tag; raises _BadCall."""
        try:
            body = await request.json()
        except ValueError as e:
            raise _BadCall(400, f"body is not JSON ({e})", "malformed_json") from None
        if not isinstance(body, dict):
            raise _BadCall(400, "body must be a JSON object", "malformed_json")
        try:
            tag = tag_of(request.headers, body, self.model_version, self.num_experts)
        except ValidationError as e:
            raise _BadCall(400, e.reason, e.rule) from None
        if tag is not None:
            if (body.get("n") or 1) != 1:
                raise _BadCall(400, "a recorded call must have n = 1 (one trajectory per choice)", "n")
            body = request_params_for_recording(body, chat=chat)
        return body, tag

    async def forward(self, request: Any, path: str, chat: bool) -> Any:
        import httpx
        from fastapi.responses import Response

        try:
            body, tag = await self._parse(request, chat)
            headers = _forward_headers(request.headers)
            if body.get("stream"):
                return await self.stream(path, body, headers, tag)
            resp = await self.client.post(path, json=body, headers=headers)
        except _BadCall as e:
            return _error(e.status, str(e), e.rule)
        except httpx.TransportError as e:
            return _error(502, f"upstream {self.upstream} unreachable: {type(e).__name__}: {e}", "upstream_unreachable")
        extra = await self.record_headers(tag, resp.content) if tag is not None and resp.status_code == 200 else {}
        return Response(resp.content, status_code=resp.status_code, headers=extra,
                        media_type=resp.headers.get("content-type"))

    async def stream(self, path: str, body: dict, headers: dict, tag: Tag | None) -> Any:
        from fastapi.responses import StreamingResponse

        resp = await self.client.send(self.client.build_request("POST", path, json=body, headers=headers), stream=True)
        media_type = resp.headers.get("content-type")
        if resp.status_code != 200 or tag is None:
            return StreamingResponse(_passthrough(resp), status_code=resp.status_code, media_type=media_type)
        return StreamingResponse(self._recorded(resp, tag), media_type=media_type)

    async def _recorded(self, resp: Any, tag: Tag) -> AsyncIterator[bytes]:
        acc, sse = OpenAIStreamAccumulator(), _SSEData()
        async for chunk in _passthrough(resp):
            for obj in sse.feed(chunk):
                acc.add(obj)
            yield chunk
        # The stream's bytes are all sent; the record is appended before the
        # response ends, so a harness that saw the end can rely on it.
        await self.record_headers(tag, acc.response())

    async def finish(self, request: Any) -> Any:
        try:
            body = await request.json()
            tid, status = body["trajectory_id"], body.get("status", "completed")
            await self.recorder.finish(tid, status, body.get("reward"))
        except ValidationError as e:
            return _error(409 if e.rule == "conflict" else 422, str(e), e.rule)
        except (ValueError, KeyError, TypeError) as e:
            return _error(400, f'body must be {{"trajectory_id", "status", "reward"?}} ({e})', "malformed_body")
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


def make_proxy_app(store: Any, upstream: str, *, model_version: int = 0, num_experts: int | None = None,
                   timeout_s: float = 600.0) -> Any:
    """The FastAPI app recording calls into ``store`` and forwarding them to ``upstream``."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import Response

    fwd = _Forwarder(Recorder(store), upstream, model_version=model_version, num_experts=num_experts,
                     timeout_s=timeout_s)

    @asynccontextmanager
    async def lifespan(app: Any):
        yield
        await fwd.client.aclose()

    app = FastAPI(title="trajstore recording proxy", version="1", lifespan=lifespan)
    app.state.recorder = fwd.recorder

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await fwd.forward(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await fwd.forward(request, "/v1/chat/completions", chat=True)

    @app.post("/trajstore/finish")
    async def finish(request: Request) -> Any:
        return await fwd.finish(request)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        resp = await fwd.client.get("/v1/models", headers=_forward_headers(request.headers))
        return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    return app


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``trajstore proxy`` (``--store`` is the CLI's global flag)."""
    parser.add_argument("--upstream", required=True, help="base URL of the vLLM OpenAI server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--model-version", type=int, default=0,
                        help="model version recorded when a call has no X-Trajstore-Model-Version header (default 0)")
    parser.add_argument("--num-experts", type=int, default=None,
                        help="num_experts of trajectories the proxy starts (default: not declared)")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def serve_proxy(upstream: str, store_url: str | None = None, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                model_version: int = 0, num_experts: int | None = None, log_level: str = "warning",
                payload: str | None = None) -> None:
    """Run the recording proxy until SIGINT/SIGTERM."""
    import uvicorn

    import trajstore

    store = trajstore.connect(store_url, payload=payload)
    try:
        app = make_proxy_app(store, upstream, model_version=model_version, num_experts=num_experts)
        uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
    finally:
        store.close()


def serve_proxy_from_args(args: argparse.Namespace) -> None:
    serve_proxy(args.upstream, getattr(args, "store", None), args.host, args.port, model_version=args.model_version,
                num_experts=args.num_experts, log_level=args.log_level, payload=getattr(args, "payload", None))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trajstore-proxy", description="OpenAI-compatible recording proxy for vLLM")
    parser.add_argument("--store", default=None, help="store URL (default $TRAJSTORE_URL or the embedded default)")
    add_cli_arguments(parser)
    try:
        serve_proxy_from_args(parser.parse_args(argv))
    except (ValueError, TrajstoreError) as e:
        raise SystemExit(f"trajstore proxy: {e}") from None
