"""The recording proxy in front of an SGLang server, and ``trajstore proxy --engine``.

``trajstore proxy --engine sglang --route-layout 48x8 --upstream URL``
forwards SGLang's native ``POST /generate`` and its OpenAI-compatible
``/v1/completions`` and ``/v1/chat/completions`` (plain and streamed),
asking for what a record needs (``trajstore.ingest.sglang``
``request_params_for_generate`` / ``request_params_for_openai``: sampled
logprobs, token ids, and routes when the layout is known), records each
call as the trajectory's next generation event and returns SGLang's bytes
unchanged (a stream: recorded once it ended with ``data: [DONE]``, then a
``: X-Trajstore-Seq`` comment; cut short: nothing recorded, an error event).
Naming the trajectory, ``X-Trajstore-*`` headers, the
``trajstore`` body field, ``POST /trajstore/finish``, auth and the
``X-Trajstore-Seq`` / ``X-Trajstore-Error`` answers are the vLLM proxy's
(``trajstore.ingest.proxy``), whose recorder, upstream forwarding
(``_UpstreamForwarder``), app (``_proxy_app``) and SSE reading this uses:
this module holds only what is SGLang's.

Routes: SGLang returns raw int32 without a shape, so the proxy asks for
them (``return_routed_experts``) only when it knows the layout: the call's
``X-Trajstore-Route-Layout: LAYERSxTOPK`` header (or ``"trajstore":
{"route_layout": "48x8"}``), else ``--route-layout``. A call that asks for
routes itself without a layout is refused (400) before it reaches the
engine. Only new route rows: when a call's token-id prompt continues the
trajectory's recorded sequence, ``routed_experts_start_len`` is set to the
recorded rows (``--no-route-skip`` turns that off; a caller's value is kept).

Weight versions go to the store as SGLang's spans, which it resolves
(SPEC "Versions"); ``--version-map '{"step-42": 42}'`` appends those
``version_label`` events to the store's label map when the proxy starts.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers'
# annotations at runtime.
import argparse
import json
import logging
import os
from typing import Any, AsyncIterator, Callable

from trajstore.errors import TrajstoreError, ValidationError
from trajstore.ingest import proxy as _vllm_proxy
from trajstore.ingest._http import error_response, server_token
from trajstore.ingest.proxy import Recorder, Tag, _BadCall, _proxy_app, _SSEData, _token_ids, _UpstreamForwarder, tag_of
from trajstore.ingest.sglang import (
    GenerateStreamAccumulator,
    OpenAIStreamAccumulator,
    generation_from_generate,
    generations_from_openai,
    request_params_for_generate,
    request_params_for_openai,
    route_layout,
    routed_experts_start_len_of,
)

log = logging.getLogger("trajstore.ingest.proxy")

ENGINES = ("vllm", "sglang")
LAYOUT_HEADER = "x-trajstore-route-layout"
_KINDS = {"/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat"}
_PASSTHROUGH_GETS = ("/v1/models", "/model_info", "/get_model_info", "/server_info", "/get_server_info")


async def _passthrough(resp: Any) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    finally:
        await resp.aclose()


class SGLangForwarder(_UpstreamForwarder):
    """Forwards one call to SGLang and records it (the handlers of :func:`make_sglang_proxy_app`)."""

    def __init__(self, recorder: Recorder, upstream: str, *, model_version: int, num_experts: int | None,
                 timeout_s: float, authenticated: bool, upstream_api_key: str | None, layout: Any,
                 skip_recorded_routes: bool) -> None:
        super().__init__(recorder, upstream, model_version=model_version, num_experts=num_experts,
                         timeout_s=timeout_s, authenticated=authenticated, upstream_api_key=upstream_api_key)
        self.layout, self.skip_recorded_routes = route_layout(layout), skip_recorded_routes

    def _layout_of(self, request: Any, body: dict) -> Any:
        extra = body.get("trajstore")
        given = request.headers.get(LAYOUT_HEADER)
        if given is None and isinstance(extra, dict):
            given = extra.pop("route_layout", None)
        return self.layout if given is None else route_layout(given)

    async def _parse(self, request: Any, kind: str) -> tuple[dict, Tag | None, Any]:
        try:
            body = await request.json()
        except ValueError as e:
            raise _BadCall(400, f"body is not JSON ({e})", "malformed_json") from None
        if not isinstance(body, dict):
            raise _BadCall(400, "body must be a JSON object", "malformed_json")
        try:
            layout = self._layout_of(request, body)
            tag = tag_of(request.headers, body, self.model_version, self.num_experts)
            if tag is None:
                return body, None, layout
            if kind == "generate":
                params = body.get("sampling_params")
                n = params.get("n") if isinstance(params, dict) else None
                batch = isinstance(body.get("text"), list) or (
                    isinstance(body.get("input_ids"), list) and any(isinstance(x, list) for x in body["input_ids"]))
                if batch or isinstance(params, list):
                    raise _BadCall(400, "a recorded /generate call must have one prompt (one trajectory per call)", "n")
            else:
                n = body.get("n")
            if (n or 1) != 1:
                raise _BadCall(400, "a recorded call must have n = 1 (one trajectory per choice)", "n")
            if body.get("return_routed_experts") and layout is None:
                raise _BadCall(400, "return_routed_experts needs the route layout to be recorded: send "
                               "X-Trajstore-Route-Layout: LAYERSxTOPK or start the proxy with --route-layout",
                               "route_layout")
            routes = layout is not None and body.get("return_routed_experts") is not False
            if kind == "generate":
                body = request_params_for_generate(body, routes=routes)
            else:
                body = request_params_for_openai(body, chat=kind == "chat", routes=routes)
            await self._ask_only_new_rows(kind, body, tag)
        except ValidationError as e:
            raise _BadCall(400, e.reason, e.rule) from None
        return body, tag, layout

    async def _ask_only_new_rows(self, kind: str, body: dict, tag: Tag) -> None:
        if not self.skip_recorded_routes or kind == "chat" or not body.get("return_routed_experts"):
            return  # a chat prompt is rendered upstream: the proxy cannot tell whether it continues
        if body.get("routed_experts_start_len") is not None:
            routed_experts_start_len_of(body)  # the caller's choice, checked, kept
            return
        prompt = body.get("input_ids") if kind == "generate" else body.get("prompt")
        if not _token_ids(prompt):
            return
        try:
            start = await self.recorder.route_start(tag.trajectory_id, prompt)
        except TrajstoreError as e:  # the call still goes through, with every row
            log.warning("could not read %s's recorded routes: %s", tag.trajectory_id, e)
            return
        if start:
            body["routed_experts_start_len"] = start

    def _events(self, kind: str, body: dict, tag: Tag, layout: Any) -> Callable[[Any], Callable[[int], list[dict]]]:
        def for_response(response: Any) -> Callable[[int], list[dict]]:
            ids = {"trajectory_id": tag.trajectory_id, "model_version": tag.model_version, "route_layout": layout}
            if kind == "generate":
                return lambda seq: [generation_from_generate(response, body, seq=seq, **ids)]
            return lambda seq: generations_from_openai(response, body, seq=seq, **ids)
        return for_response

    async def record_headers(self, tag: Tag, data: Any, make: Callable[[Any], Callable[[int], list[dict]]]) -> dict:
        try:
            if isinstance(data, (bytes, str)):
                data = json.loads(data)
            return {"X-Trajstore-Seq": str(await self.recorder.record(tag, make(data)))}
        except (TrajstoreError, ValueError, TypeError, AttributeError, LookupError) as e:  # odd upstream JSON too
            log.warning("not recorded: %s", e)
            return {"X-Trajstore-Error": str(e).replace("\n", " ")[:500]}

    async def forward(self, request: Any, path: str) -> Any:
        import httpx
        from fastapi.responses import Response, StreamingResponse

        kind = _KINDS[path]
        try:
            body, tag, layout = await self._parse(request, kind)
            headers = self.headers(request)
            if body.get("stream"):
                resp = await self.client.send(self.client.build_request("POST", path, json=body, headers=headers),
                                              stream=True)
                media_type = resp.headers.get("content-type")
                if resp.status_code != 200 or tag is None:
                    return StreamingResponse(_passthrough(resp), status_code=resp.status_code, media_type=media_type)
                make = self._events(kind, body, tag, layout)
                sse = "text/event-stream" in (media_type or "")
                return StreamingResponse(self._recorded(resp, tag, kind, make, sse), media_type=media_type)
            resp = await self.client.post(path, json=body, headers=headers)
        except _BadCall as e:
            return error_response(e.status, str(e), rule=e.rule)
        except httpx.HTTPError as e:  # refused, reset, timed out, cut mid-body
            return self._unreachable(e)
        extra = {}
        if tag is not None and resp.status_code == 200:
            extra = await self.record_headers(tag, resp.content, self._events(kind, body, tag, layout))
        return Response(resp.content, status_code=resp.status_code, headers=extra,
                        media_type=resp.headers.get("content-type"))

    async def _recorded(self, resp: Any, tag: Tag, kind: str, make: Callable[[Any], Callable[[int], list[dict]]],
                        sse_media: bool) -> AsyncIterator[bytes]:
        """SGLang's bytes as they come; the record once the stream has ended whole (``data: [DONE]``).

        As the vLLM proxy does: a stream the upstream cut records nothing and
        ends with an SSE ``data: {"error": ...}`` event (SGLang's own shape
        for an error mid-stream); a whole stream that cannot be recorded ends
        with the comment ``: X-Trajstore-Error: ...``, a recorded one with
        ``: X-Trajstore-Seq: <seq>`` (SSE clients skip comments).
        """
        import httpx

        acc = GenerateStreamAccumulator() if kind == "generate" else OpenAIStreamAccumulator()
        sse = _SSEData()
        unreadable: str | None = None
        cut: str | None = None

        def take(objs: list) -> None:
            nonlocal unreadable
            for obj in objs:
                if unreadable is None:
                    try:  # a chunk the proxy cannot read must not cut the caller's stream
                        acc.add(obj)
                    except (ValueError, TypeError, AttributeError, LookupError) as e:
                        unreadable = f"a chunk cannot be read ({type(e).__name__}: {' '.join(str(e).split())})"

        try:
            async for chunk in resp.aiter_raw():
                take(sse.feed(chunk))
                yield chunk
        except httpx.HTTPError as e:
            cut = f"the upstream stream broke off ({type(e).__name__}: {' '.join(str(e).split())})"
        finally:
            await resp.aclose()
        if cut is None:
            take(sse.feed(b"\n"))  # a last data line without its newline still counts
            unreadable = unreadable or sse.bad
            if not sse.done:
                cut = "the upstream stream ended before its data: [DONE]"
        if cut is not None:
            reason = f"{cut}: call not recorded"
            log.warning("%s: %s", tag.trajectory_id, reason)
            error = {"error": {"message": f"trajstore proxy: {reason}", "type": "UpstreamStreamCut", "code": 502}}
            if sse_media:
                yield b"\n\ndata: " + json.dumps(error).encode() + b"\n\n"
            return
        # Every byte is sent; the record is appended before the response ends,
        # so a harness that saw the end can rely on it.
        try:
            if unreadable is not None:
                raise ValidationError(unreadable, rule="upstream_shape")
            headers = await self.record_headers(tag, acc.response(), make)
        except ValidationError as e:
            log.warning("%s: stream not recorded: %s", tag.trajectory_id, e)
            headers = {"X-Trajstore-Error": f"not recorded: {e}".replace("\n", " ")[:500]}
        if sse_media:
            yield "".join(f": {k}: {v}\n" for k, v in headers.items()).encode("utf-8", "replace") + b"\n"


def make_sglang_proxy_app(store: Any, upstream: str, *, token: str | None = None, model_version: int = 0,
                          num_experts: int | None = None, timeout_s: float = 600.0,
                          upstream_api_key: str | None = None, route_layout: Any = None,
                          skip_recorded_routes: bool = True) -> Any:
    """The FastAPI app recording SGLang calls into ``store`` and forwarding them to ``upstream``.

    ``route_layout``: the model's ``(layers, topk)`` (or ``"48x8"``), used
    for calls without an ``X-Trajstore-Route-Layout`` header; None: routes
    are asked for only by calls that name their layout.
    """
    fwd = SGLangForwarder(Recorder(store), upstream, model_version=model_version, num_experts=num_experts,
                          timeout_s=timeout_s, authenticated=token is not None, upstream_api_key=upstream_api_key,
                          layout=route_layout, skip_recorded_routes=skip_recorded_routes)

    def post(path: str) -> Callable:
        return lambda request: fwd.forward(request, path)

    def get(path: str) -> Callable:
        async def call(request: Any) -> Any:
            from fastapi.responses import Response

            resp = await fwd.client.get(path, headers=fwd.headers(request))
            return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))
        return call

    routes = [("POST", path, path, post(path)) for path in _KINDS]
    routes += [("GET", path, path, get(path)) for path in _PASSTHROUGH_GETS]
    return _proxy_app(fwd, title="trajstore recording proxy (SGLang)", token=token, routes=routes)


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """``trajstore proxy``'s flags: the vLLM proxy's, ``--engine`` and ``--route-layout``."""
    _vllm_proxy.add_cli_arguments(parser)
    parser.add_argument("--engine", choices=ENGINES, default="vllm",
                        help="the inference server behind the proxy (default vllm)")
    parser.add_argument("--route-layout", default=None, metavar="LAYERSxTOPK",
                        help="SGLang: the model's num_hidden_layers x num_experts_per_tok, e.g. 48x8; SGLang's "
                             "routes carry no shape (default: only calls sending X-Trajstore-Route-Layout get routes)")


def serve_from_args(args: argparse.Namespace) -> None:
    """Run the proxy ``--engine`` names."""
    engine = getattr(args, "engine", "vllm")
    if engine == "vllm":
        if getattr(args, "route_layout", None) is not None:
            raise ValueError("--route-layout is for --engine sglang (vLLM's routes carry their shape)")
        return _vllm_proxy.serve_proxy_from_args(args)
    labels = [{"type": "version_label", "label": str(label), "model_version": version}
              for label, version in (_vllm_proxy._version_map_arg(getattr(args, "version_map", None)) or {}).items()]
    try:
        layout = route_layout(args.route_layout)
    except ValidationError as e:
        raise ValueError(f"--route-layout: {e.reason}") from None
    token = server_token(args.token, insecure_no_auth=args.insecure_no_auth)
    upstream_api_key = args.upstream_api_key or os.environ.get("TRAJSTORE_UPSTREAM_API_KEY") or None
    import uvicorn

    import trajstore

    store = trajstore.connect(getattr(args, "store", None), payload=getattr(args, "payload", None))
    try:
        if labels:  # the store resolves SGLang's span labels through its label map
            store.append(labels)
        app = make_sglang_proxy_app(store, args.upstream, token=token, model_version=args.model_version,
                                    num_experts=args.num_experts, upstream_api_key=upstream_api_key,
                                    route_layout=layout, skip_recorded_routes=not args.no_route_skip)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        store.close()
