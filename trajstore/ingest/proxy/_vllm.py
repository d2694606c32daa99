"""The recording proxy in front of vLLM: the endpoints it records (``RECORDED``) and relays
(``FORWARDED``), its forwarder, ``make_proxy_app``."""

# No ``from __future__ import annotations``: FastAPI reads the handlers'
# annotations at runtime.
from typing import Any, Callable, Mapping

from trajstore.errors import ValidationError
from trajstore.ingest._group_commit import DEFAULT_LINGER_S, DEFAULT_MAX_GROUP_BYTES
from trajstore.ingest.proxy._app import _engine_app
from trajstore.ingest.proxy._config import ProxyConfig
from trajstore.ingest.proxy._forward import _BadCall, _UpstreamForwarder
from trajstore.ingest.proxy._record import Recorder, Tag, tag_of
from trajstore.ingest.vllm import (
    OpenAIStreamAccumulator,
    VersionMap,
    generations_from_openai,
    generations_from_tito,
    request_params_for_recording,
    request_params_for_tito,
    routed_experts_prompt_start_of,
)

__all__ = ["FORWARDED", "LABEL_FIELDS", "RECORDED", "VLLMForwarder", "make_proxy_app"]

TITO_PATH = "/inference/v1/generate"

# The endpoints the proxy records: path -> the kind of call (VLLMForwarder.parse
# asks for what a record needs, VLLMForwarder.events picks the adapter).
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

# The forwarded calls that may be sent twice with the effect of once (reads, pause and resume,
# aborts by id, a label set to a value); the weight transfers are not among them.
RESEND_SAFE = frozenset(path for method, path in FORWARDED if method == "GET") | {
    "/tokenize", "/detokenize", "/inference/v1/abort_requests", "/abort_requests", "/pause", "/resume",
    "/update_weight_version", "/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
    "/v1/responses/render", "/v1/chat/completions/derender", "/v1/completions/derender"}

# The label-setting endpoints and their body field (entrypoints/rl/online/api_router.py).
LABEL_FIELDS = {"/update_weight_version": "new_version", "/finish_weight_update": "weight_version"}


class VLLMForwarder(_UpstreamForwarder):
    """Forwards one call to vLLM and records it (the handlers of :func:`make_proxy_app`)."""

    recorded = RECORDED
    label_fields = LABEL_FIELDS
    resend_safe = RESEND_SAFE

    def __init__(self, recorder: Recorder, upstream: str, *, version_map: VersionMap = None, **kwargs: Any) -> None:
        super().__init__(recorder, upstream, **kwargs)
        self.version_map = version_map

    def events(self, kind: str, body: dict, tag: Tag, ctx: Any) -> Callable[[Any], Callable[[int], list[dict]]]:
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

    def accumulator(self, kind: str) -> Any:
        return OpenAIStreamAccumulator()  # /inference/v1/generate streams in the same chunks

    async def parse(self, request: Any, kind: str, body: dict) -> tuple[dict, Tag | None, Any]:
        tag = tag_of(request.headers, body, self.model_version, self.num_experts)
        if tag is None:
            return body, None, None
        params = body.get("sampling_params") if kind == "tito" else body
        if ((params.get("n") if isinstance(params, dict) else None) or 1) != 1:
            raise _BadCall(400, "a recorded call must have n = 1 (one trajectory per choice)", "n")
        if kind == "tito":
            body = request_params_for_tito(body)
        else:
            body = request_params_for_recording(body, chat=kind == "chat")
        if kind != "chat":  # a chat prompt is rendered upstream
            await self.ask_only_new_rows(tag, body["sampling_params"] if kind == "tito" else body,
                                         "routed_experts_prompt_start",
                                         body.get("token_ids") if kind == "tito" else body.get("prompt"),
                                         lambda: routed_experts_prompt_start_of(body))
        return body, tag, None


def _one_choice(events: list[dict]) -> list[dict]:
    if len(events) != 1:  # the request had n = 1 (checked): another count is the upstream's fault
        raise ValidationError(f"the upstream answered {len(events)} choices to a call with n = 1", rule="upstream_response")
    return events


def make_proxy_app(store: Any, upstream: str, *, token: str | None = None, model_version: int = 0,
                   num_experts: int | None = None, timeout_s: float = 600.0, upstream_api_key: str | None = None,
                   version_map: VersionMap = None, skip_recorded_routes: bool = True,
                   group_commit: bool = True, pass_through_unrecorded: bool = False,
                   linger_s: float = DEFAULT_LINGER_S, max_batch_bytes: int = DEFAULT_MAX_GROUP_BYTES) -> Any:
    """The FastAPI app recording calls into ``store`` and forwarding them to ``upstream``.

    ``upstream``: the engine's base URL (a trailing ``/v1`` is dropped,
    :func:`normalize_upstream`). ``token=None`` means no auth (the caller
    decided; ``serve_proxy`` refuses that unless told ``insecure_no_auth``).
    ``upstream_api_key``: the bearer token the upstream wants.
    ``version_map``: weight-version labels to model versions, appended to the
    store as ``version_label`` events when the app is made (the engine's spans
    are recorded as sent and the store resolves them). ``skip_recorded_routes=False``: never set
    ``routed_experts_prompt_start`` (an engine without it). ``group_commit=False``:
    append each call's record on its own (see :class:`Recorder`); otherwise calls of
    many trajectories share one payload object and index transaction, each waiting up
    to ``linger_s`` for others, a group bounded by ``max_batch_bytes`` (docs/ingest.md);
    ``app.state.commit_metrics.commits`` counts the appends.
    ``pass_through_unrecorded=True``: a named call the store cannot take
    still gets the engine's answer, with ``X-Trajstore-Error`` (counted in
    ``GET /metrics``); by default the harness gets an error status with the
    reason in the OpenAI error shape.
    """
    config = ProxyConfig(upstream=upstream, engine="vllm", model_version=model_version, num_experts=num_experts,
                         version_map=version_map, skip_recorded_routes=skip_recorded_routes,
                         pass_through_unrecorded=pass_through_unrecorded, linger_s=linger_s,
                         max_batch_bytes=max_batch_bytes)
    return vllm_app(store, config, token, upstream_api_key, group_commit=group_commit, timeout_s=timeout_s)


def vllm_app(store: Any, config: ProxyConfig, token: str | None, upstream_api_key: str | None, *,
             group_commit: bool = True, timeout_s: float = 600.0) -> Any:
    """The vLLM proxy's app for ``config`` (its engine's part; ``token``/``upstream_api_key`` as resolved
    by ``serve``); :func:`make_proxy_app` is its keyword face."""
    # a callable map resolves the spans the forwarder records; a mapping went to the store's label map
    callable_map = None if isinstance(config.version_map, Mapping) else config.version_map
    return _engine_app(VLLMForwarder, store, config, title="trajstore recording proxy", forwarded=FORWARDED,
                       token=token, upstream_api_key=upstream_api_key, group_commit=group_commit,
                       timeout_s=timeout_s, version_map=callable_map)
