"""The recording proxy in front of vLLM: the endpoints it records (``RECORDED``) and relays
(``FORWARDED``), its forwarder, ``make_proxy_app``."""

# No ``from __future__ import annotations``: FastAPI reads the handlers'
# annotations at runtime.
import logging
from typing import Any, Callable, Mapping

from trajstore.errors import TrajstoreError, ValidationError
from trajstore.ingest._http import error_response
from trajstore.ingest.proxy._app import _proxy_app, _recorder_and_metrics, normalize_upstream, version_label_events
from trajstore.ingest.proxy._forward import UNNAMED, _BadCall, _token_ids, _UpstreamForwarder
from trajstore.ingest.proxy._record import Recorder, Tag, tag_of
from trajstore.ingest.proxy._sse import _passthrough
from trajstore.ingest.vllm import (
    OpenAIStreamAccumulator,
    VersionMap,
    generations_from_openai,
    generations_from_tito,
    request_params_for_recording,
    request_params_for_tito,
    routed_experts_prompt_start_of,
)

__all__ = ["FORWARDED", "RECORDED", "VLLMForwarder", "make_proxy_app"]

log = logging.getLogger("trajstore.ingest.proxy")

TITO_PATH = "/inference/v1/generate"

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
LABEL_FIELDS = {"/update_weight_version": "new_version", "/finish_weight_update": "weight_version"}


class VLLMForwarder(_UpstreamForwarder):
    """Forwards one call to vLLM and records it (the proxy's handlers)."""

    label_fields = LABEL_FIELDS

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
    fwd = VLLMForwarder(recorder, upstream, model_version=model_version,
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
