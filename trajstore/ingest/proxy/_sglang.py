"""The recording proxy in front of an SGLang server, and ``trajstore proxy --engine``.

``trajstore proxy --engine sglang --route-layout 48x8 --upstream URL``
forwards SGLang's native ``POST /generate`` and its OpenAI-compatible
``/v1/completions`` and ``/v1/chat/completions`` (plain and streamed),
asking for what a record needs (``trajstore.ingest.sglang``
``request_params_for_generate`` / ``request_params_for_openai``: sampled
logprobs, token ids, and routes when the layout is known), records each
call as the trajectory's next generation event and returns SGLang's bytes
unchanged (a stream: recorded once its final chunk came, before its
``data: [DONE]`` is passed on, then a ``: X-Trajstore-Seq`` comment; cut
short or without its final chunk: nothing recorded, an error event). SGLang's
RL control plane (``FORWARDED``: pause, continue, abort, weight updates) is
relayed as sent; a label change (``LABEL_FIELDS``) with
``X-Trajstore-Model-Version`` maps its label in the store. Naming the
trajectory, ``X-Trajstore-*`` headers, the ``trajstore`` body field, ``POST
/trajstore/finish``, auth, failing closed (or ``--pass-through-unrecorded``),
``GET /metrics`` and relaying are the vLLM proxy's
(``trajstore.ingest.proxy``), whose recorder, upstream forwarding, recording
and relaying (``_UpstreamForwarder``) and app (``_proxy_app``) this uses:
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
from typing import Any, Callable

from trajstore.errors import TrajstoreError, ValidationError
from trajstore.ingest._http import error_response, server_token
from trajstore.ingest.proxy import _serve as _vllm_proxy
from trajstore.ingest.proxy._app import _proxy_app, _recorder_and_metrics
from trajstore.ingest.proxy._forward import UNNAMED, _BadCall, _token_ids, _UpstreamForwarder
from trajstore.ingest.proxy._record import Recorder, Tag, tag_of
from trajstore.ingest.proxy._sse import _passthrough
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

__all__ = ["ENGINES", "FORWARDED", "LABEL_FIELDS", "LAYOUT_HEADER", "SGLangForwarder", "add_cli_arguments",
           "make_sglang_proxy_app", "serve_from_args"]

log = logging.getLogger("trajstore.ingest.proxy")

ENGINES = ("vllm", "sglang")
LAYOUT_HEADER = "x-trajstore-route-layout"
_KINDS = {"/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat"}

# Forwarded unrecorded (auth as every other path), read from SGLang 0.5.23's
# entrypoints/http_server.py: its RL control plane (pause, continue, abort,
# weight updates and their version labels, memory release), tokenizer,
# health and info endpoints.
FORWARDED: tuple[tuple[str, str], ...] = (
    ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/health_generate"), ("GET", "/ready"),
    ("GET", "/model_info"), ("GET", "/get_model_info"), ("GET", "/server_info"), ("GET", "/get_server_info"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("POST", "/v1/tokenize"), ("POST", "/v1/detokenize"),
    ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/abort_request"),
    ("POST", "/update_weight_version"), ("POST", "/update_weights_from_disk"),
    ("POST", "/update_weights_from_tensor"), ("POST", "/update_weights_from_distributed"),
    ("POST", "/update_weights_from_ipc"), ("POST", "/init_weights_update_group"),
    ("POST", "/destroy_weights_update_group"), ("POST", "/begin_weight_update"), ("POST", "/end_weight_update"),
    ("GET", "/get_weights_by_name"), ("POST", "/get_weights_by_name"),
    ("GET", "/release_memory_occupation"), ("POST", "/release_memory_occupation"),
    ("GET", "/resume_memory_occupation"), ("POST", "/resume_memory_occupation"),
    ("GET", "/flush_cache"), ("POST", "/flush_cache"),
)

# The endpoints that set the engine's weight-version label and their body field
# (managers/io_struct.py: UpdateWeightVersionReqInput.new_version, the weight updates' weight_version).
LABEL_FIELDS = {"/update_weight_version": "new_version", "/update_weights_from_disk": "weight_version",
                "/update_weights_from_tensor": "weight_version",
                "/update_weights_from_distributed": "weight_version", "/update_weights_from_ipc": "weight_version"}


class SGLangForwarder(_UpstreamForwarder):
    """Forwards one call to SGLang and records it (the handlers of :func:`make_sglang_proxy_app`)."""

    label_fields = LABEL_FIELDS

    def __init__(self, recorder: Recorder, upstream: str, *, model_version: int, num_experts: int | None,
                 timeout_s: float, authenticated: bool, upstream_api_key: str | None, layout: Any,
                 skip_recorded_routes: bool, pass_through: bool = False, metrics: Any = None) -> None:
        super().__init__(recorder, upstream, model_version=model_version, num_experts=num_experts,
                         timeout_s=timeout_s, authenticated=authenticated, upstream_api_key=upstream_api_key,
                         pass_through=pass_through, metrics=metrics)
        self.layout, self.skip_recorded_routes = route_layout(layout), skip_recorded_routes
        self._abort_noted = False

    async def relay(self, request: Any, path: str) -> Any:
        """As the vLLM proxy relays (``_UpstreamForwarder.relay``); logs once that an
        ``/update_weight_version`` without ``"abort_all_requests": false`` aborts SGLang's running calls."""
        if path == "/update_weight_version" and not self._abort_noted:
            try:
                body = json.loads(await request.body())
            except ValueError:
                body = None
            if isinstance(body, dict) and body.get("abort_all_requests", True) is not False:
                self._abort_noted = True
                log.warning('/update_weight_version without "abort_all_requests": false: SGLang aborts every '
                            "running request (they are recorded as aborts); see docs/sglang.md")
        return await super().relay(request, path)

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
                sse = "text/event-stream" in (media_type or "")
                if resp.status_code != 200 or tag is None:
                    extra = self.note_unrecorded(request, UNNAMED) if tag is None else self.upstream_error(resp.status_code)
                    return StreamingResponse(_passthrough(resp, sse), status_code=resp.status_code,
                                             media_type=media_type, headers=extra)
                acc = GenerateStreamAccumulator() if kind == "generate" else OpenAIStreamAccumulator()
                recorded = self.recorded_stream(resp, tag, acc, self._events(kind, body, tag, layout), sse)
                return StreamingResponse(recorded, media_type=media_type)
            resp = await self.client.post(path, json=body, headers=headers)
            content = resp.content
        except _BadCall as e:
            return error_response(e.status, str(e), rule=e.rule)
        except httpx.HTTPError as e:  # refused, reset, timed out, cut mid-body
            return self._unreachable(e)
        if tag is not None and resp.status_code == 200:
            return await self.answer(tag, resp, content, self._events(kind, body, tag, layout))
        extra = self.note_unrecorded(request, UNNAMED) if tag is None else self.upstream_error(resp.status_code)
        return Response(content, status_code=resp.status_code, headers=extra, media_type=resp.headers.get("content-type"))


def make_sglang_proxy_app(store: Any, upstream: str, *, token: str | None = None, model_version: int = 0,
                          num_experts: int | None = None, timeout_s: float = 600.0,
                          upstream_api_key: str | None = None, route_layout: Any = None,
                          skip_recorded_routes: bool = True, group_commit: bool = True,
                          pass_through_unrecorded: bool = False) -> Any:
    """The FastAPI app recording SGLang calls into ``store`` and forwarding them to ``upstream``.

    ``route_layout``: the model's ``(layers, topk)`` (or ``"48x8"``), used
    for calls without an ``X-Trajstore-Route-Layout`` header; None: routes
    are asked for only by calls that name their layout. ``group_commit``
    and ``pass_through_unrecorded`` as for the vLLM proxy
    (:func:`trajstore.ingest.proxy.make_proxy_app`).
    """
    recorder, metrics, proxy_metrics, on_close = _recorder_and_metrics(store, group_commit)
    fwd = SGLangForwarder(recorder, upstream, model_version=model_version, num_experts=num_experts,
                          timeout_s=timeout_s, authenticated=token is not None, upstream_api_key=upstream_api_key,
                          layout=route_layout, skip_recorded_routes=skip_recorded_routes,
                          pass_through=pass_through_unrecorded, metrics=proxy_metrics)

    def post(path: str) -> Callable:
        return lambda request: fwd.forward(request, path)

    def forwarded(path: str) -> Callable:
        return lambda request: fwd.relay(request, path)

    routes = [("POST", path, f"record {path}", post(path)) for path in _KINDS]
    routes += [(method, path, f"forward {method} {path}", forwarded(path)) for method, path in FORWARDED]
    app = _proxy_app(fwd, title="trajstore recording proxy (SGLang)", token=token, routes=routes, on_close=on_close,
                     metrics=metrics)
    app.state.forwarder = fwd
    app.state.commit_metrics = metrics
    return app


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
                                    route_layout=layout, skip_recorded_routes=not args.no_route_skip,
                                    pass_through_unrecorded=getattr(args, "pass_through_unrecorded", False))
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        store.close()
