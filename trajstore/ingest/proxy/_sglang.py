"""The recording proxy in front of an SGLang server (``trajstore proxy --engine sglang``).

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
``GET /metrics`` and relaying are every engine's (``_forward``'s
``_UpstreamForwarder``, ``_app``, ``_record``), as is how the proxy starts
(``_serve``): this module holds only what is SGLang's.

Routes: SGLang returns raw int32 without a shape, so the proxy asks for
them (``return_routed_experts``) only when it knows the layout: the call's
``X-Trajstore-Route-Layout: LAYERSxTOPK`` header (or ``"trajstore":
{"route_layout": "48x8"}``), else ``--route-layout``. A call that asks for
routes itself without a layout is refused (400) before it reaches the
engine. Only new route rows: when a call's token-id prompt continues the
trajectory's recorded sequence, ``routed_experts_start_len`` is set to the
recorded rows (``--no-route-skip`` turns that off; a caller's value is kept).

Weight versions go to the store as SGLang's spans, which it resolves
(docs/reference.md "Versions"); ``--version-map '{"step-42": 42}'`` appends those
``version_label`` events to the store's label map when the proxy starts.
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers'
# annotations at runtime.
import json
import logging
from typing import Any, Callable

from trajstore.ingest._group_commit import DEFAULT_LINGER_S, DEFAULT_MAX_GROUP_BYTES
from trajstore.ingest.proxy._app import _engine_app
from trajstore.ingest.proxy._config import ProxyConfig
from trajstore.ingest.proxy._forward import _BadCall, _UpstreamForwarder
from trajstore.ingest.proxy._record import Recorder, Tag, tag_of
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

__all__ = ["FORWARDED", "LABEL_FIELDS", "LAYOUT_HEADER", "RECORDED", "SGLangForwarder", "make_sglang_proxy_app"]

log = logging.getLogger("trajstore.ingest.proxy")

LAYOUT_HEADER = "x-trajstore-route-layout"
# The endpoints the proxy records: path -> the kind of call
RECORDED: dict[str, str] = {"/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat"}

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

# The forwarded calls that may be sent twice with the effect of once (reads, pause and continue,
# aborts by id, a label set to a value, the cache flush); the weight updates and memory moves are not.
RESEND_SAFE = frozenset(path for method, path in FORWARDED if method == "GET" and "memory" not in path) | {
    "/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize", "/pause_generation", "/continue_generation",
    "/abort_request", "/update_weight_version", "/get_weights_by_name", "/flush_cache"}

# The endpoints that set the engine's weight-version label and their body field
# (managers/io_struct.py: UpdateWeightVersionReqInput.new_version, the weight updates' weight_version).
LABEL_FIELDS = {"/update_weight_version": "new_version", "/update_weights_from_disk": "weight_version",
                "/update_weights_from_tensor": "weight_version",
                "/update_weights_from_distributed": "weight_version", "/update_weights_from_ipc": "weight_version"}


class SGLangForwarder(_UpstreamForwarder):
    """Forwards one call to SGLang and records it (the handlers of :func:`make_sglang_proxy_app`)."""

    recorded = RECORDED
    label_fields = LABEL_FIELDS
    resend_safe = RESEND_SAFE

    def __init__(self, recorder: Recorder, upstream: str, *, layout: Any = None, **kwargs: Any) -> None:
        super().__init__(recorder, upstream, **kwargs)
        self.layout = route_layout(layout)
        self._abort_noted = False

    async def relay(self, request: Any, path: str) -> Any:
        """As every engine's proxy relays (``_UpstreamForwarder.relay``); logs once that an
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

    async def parse(self, request: Any, kind: str, body: dict) -> tuple[dict, Tag | None, Any]:
        """The body, the tag and the call's route layout."""
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
        if kind != "chat" and body.get("return_routed_experts"):  # a chat prompt is rendered upstream
            await self.ask_only_new_rows(tag, body, "routed_experts_start_len",
                                         body.get("input_ids") if kind == "generate" else body.get("prompt"),
                                         lambda: routed_experts_start_len_of(body))
        return body, tag, layout

    def events(self, kind: str, body: dict, tag: Tag, ctx: Any) -> Callable[[Any], Callable[[int], list[dict]]]:
        def for_response(response: Any) -> Callable[[int], list[dict]]:
            ids = {"trajectory_id": tag.trajectory_id, "model_version": tag.model_version, "route_layout": ctx}
            if kind == "generate":
                return lambda seq: [generation_from_generate(response, body, seq=seq, **ids)]
            return lambda seq: generations_from_openai(response, body, seq=seq, **ids)
        return for_response

    def accumulator(self, kind: str) -> Any:
        return GenerateStreamAccumulator() if kind == "generate" else OpenAIStreamAccumulator()


def make_sglang_proxy_app(store: Any, upstream: str, *, token: str | None = None, model_version: int = 0,
                          num_experts: int | None = None, timeout_s: float = 600.0,
                          upstream_api_key: str | None = None, route_layout: Any = None,
                          skip_recorded_routes: bool = True, group_commit: bool = True,
                          pass_through_unrecorded: bool = False, linger_s: float = DEFAULT_LINGER_S,
                          max_batch_bytes: int = DEFAULT_MAX_GROUP_BYTES) -> Any:
    """The FastAPI app recording SGLang calls into ``store`` and forwarding them to ``upstream``.

    ``route_layout``: the model's ``(layers, topk)`` (or ``"48x8"``), used
    for calls without an ``X-Trajstore-Route-Layout`` header; None: routes
    are asked for only by calls that name their layout. The rest as for the
    vLLM proxy (:func:`trajstore.ingest.proxy.make_proxy_app`).
    """
    config = ProxyConfig(upstream=upstream, engine="sglang", model_version=model_version, num_experts=num_experts,
                         route_layout=route_layout, skip_recorded_routes=skip_recorded_routes,
                         pass_through_unrecorded=pass_through_unrecorded, linger_s=linger_s,
                         max_batch_bytes=max_batch_bytes)
    return sglang_app(store, config, token, upstream_api_key, group_commit=group_commit, timeout_s=timeout_s)


def sglang_app(store: Any, config: ProxyConfig, token: str | None, upstream_api_key: str | None, *,
               group_commit: bool = True, timeout_s: float = 600.0) -> Any:
    """The SGLang proxy's app for ``config`` (its engine's part; ``token``/``upstream_api_key`` as resolved
    by ``serve``); :func:`make_sglang_proxy_app` is its keyword face."""
    return _engine_app(SGLangForwarder, store, config, title="trajstore recording proxy (SGLang)",
                       forwarded=FORWARDED, token=token, upstream_api_key=upstream_api_key,
                       group_commit=group_commit, timeout_s=timeout_s, layout=config.route_layout)
