"""A deterministic HTTP upstream that answers in SGLang 0.5.23's shapes.

Same tokens as ``openai_upstream`` (its tokenizer, chat rendering, outputs,
logprobs and route rows), so an SGLang rollout and a vLLM rollout of the
same conversation can be compared. What it mimics, read from SGLang 0.5.23
(paths inside ``sglang/srt/``):

* native ``POST /generate`` (``entrypoints/http_server.py``,
  ``managers/tokenizer_manager.py`` ``_handle_batch_output``): ``{"text",
  "output_ids", "meta_info"}``; ``meta_info`` has ``id``, ``finish_reason``
  (``FINISH_MATCHED_TOKEN.to_json()`` = ``{"type": "stop", "matched": id}``,
  ``FINISH_LENGTH`` = ``{"type": "length", "length": n}``, ``FINISH_ABORT``),
  ``prompt_tokens``, ``weight_version``, ``completion_tokens``,
  ``cached_tokens``, ``weight_versions`` (finished only,
  ``utils/weight_versions.py``), ``output_token_logprobs`` triples and
  ``output_token_logprobs_length`` (``return_logprob``), ``routed_experts``
  (base64 of raw int32, ``return_routed_experts``, rows from
  ``routed_experts_start_len``); ``prompt_token_ids`` with
  ``return_prompt_token_ids``. Streams: cumulative ``output_ids`` and
  logprobs per chunk, or deltas when ``app.state.incremental`` (the server's
  ``--incremental-streaming-output``); routes and spans on the final chunk;
  ``data: [DONE]``.
* ``/v1/completions`` and ``/v1/chat/completions``
  (``entrypoints/openai/serving_completions.py``, ``serving_chat.py``,
  ``protocol.py``): ``metadata`` = ``build_endpoint_weight_version_metadata``
  of the first output, ``sglext.routed_experts`` at response level, chat
  ids in ``sglext.input_ids`` / ``output_ids``; streams end with a
  ``choices: []`` chunk holding ``sglext`` and carry no ``metadata``.
  A logprob of ``-inf`` is serialised as ``null`` (orjson / pydantic).

``tests/ingest/test_sglang_types.py`` checks these builders against
SGLang's own pydantic types and functions where they import.

State: ``app.state.weight_update = (at, before, after)`` (output tokens from
``at`` on were sampled by weights ``after``; SGLang's default label is
``"default"``), ``app.state.missing_logprob = i`` (output position ``i``
has no logprob: vLLM writes -9999.0, SGLang ``null``).

Live generation and the RL control plane (``entrypoints/http_server.py``,
``managers/io_struct.py``, ``managers/tokenizer_manager.py``): with
``app.state.token_delay_s`` set, a streamed ``/generate`` (``input_ids``)
makes ``max_new_tokens`` tokens, one per delay under the engine's current label ``app.state.label`` (its spans
follow the label as it changes), waits while paused, and ends with
``FINISH_ABORT().to_json()`` (``{"type": "abort", "message": "Aborted",
...}``) when aborted. ``POST /pause_generation {"mode": "abort" |
"retract" | "in_place"}`` (abort ends every running request),
``/continue_generation``, ``/abort_request {"rid", "abort_all"}`` and
``/update_weight_version {"new_version", "abort_all_requests": true}``,
which aborts every running request unless ``abort_all_requests`` is false,
answer as SGLang does. ``app.state.control`` keeps the control calls.
"""

# No `from __future__ import annotations`: FastAPI reads handler annotations at runtime.

import asyncio
import base64
from typing import Any, AsyncIterator, Iterator

import numpy as np

from openai_upstream import END, decode, encode, generate, render_chat, route_rows
from raw_upstream import SSE_DONE, sse_event

DEFAULT_VERSION = "default"


def weight_version_spans(update: Any, num_tokens: int) -> list[dict]:
    """SGLang's ``meta_info["weight_versions"]`` for a finished output under ``update``.

    ``compute_weight_version_spans`` + ``add_weight_versions_to_meta_info``:
    one event per weight swap at the output length it happened, spans
    merged by label, a zero-length output still has ``[{current, 0, 0}]``.
    """
    if update is None:
        return [{"version": DEFAULT_VERSION, "start": 0, "end": num_tokens}]
    at, before, after = update
    changes = [(before, at), (after, num_tokens)]
    spans: list[dict] = []
    for version, end in changes:
        end = min(end, num_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return [s for s in spans if s["start"] < num_tokens or s["start"] == 0]


def raw_routes(prompt: list[int], out: list[int], start: int) -> str:
    """``meta_info["routed_experts"]``: base64 of the int32 rows ``[start, len(prompt + out) - 1)``."""
    start = min(start, len(prompt) + len(out) - 1)
    rows = route_rows(prompt + out, len(prompt))[start:].astype(np.int32)
    return base64.b64encode(rows.tobytes()).decode("ascii")


def _logprob_values(lps: list[float], missing: Any) -> list:
    return [None if i == missing else lp for i, lp in enumerate(lps)]


def _finish(out: list[int], chat: bool, max_tokens: int) -> dict:
    if chat and out and out[-1] == END:
        return {"type": "stop", "matched": END}
    return {"type": "length", "length": max_tokens}


def native_outputs(body: dict, state: Any) -> tuple[list[int], list[int], list, dict]:
    """(prompt, output, logprob values (None = missing), finish_reason) of a /generate call."""
    prompt = list(body["input_ids"]) if body.get("input_ids") is not None else encode(body["text"])
    params = body.get("sampling_params") or {}
    chat = END in (params.get("stop_token_ids") or [])
    out, lps, _ = generate(prompt, params.get("max_new_tokens"), chat=chat)
    return prompt, out, _logprob_values(lps, state.missing_logprob), _finish(out, chat, len(out))


def native_meta(body: dict, prompt: list[int], out: list[int], values: list, finish: Any, update: Any,
                *, finished: bool) -> dict:
    meta: dict = {"id": "sgl-1", "finish_reason": finish if finished else None, "prompt_tokens": len(prompt),
                  "weight_version": DEFAULT_VERSION, "num_retractions": 0}
    if body.get("return_logprob"):
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[v, t, None] for v, t in zip(values, out)]
        meta["output_token_logprobs_length"] = len(out)
    meta.update({"reasoning_tokens": 0, "completion_tokens": len(out), "cached_tokens": 0})
    if finished:
        spans = weight_version_spans(update, len(out))
        meta["weight_versions"] = spans
        meta["weight_version"] = spans[-1]["version"]
    elif update is not None:
        meta["weight_version"] = update[2] if len(out) >= update[0] else update[1]
    if finished and body.get("return_routed_experts"):
        meta["routed_experts"] = raw_routes(prompt, out, body.get("routed_experts_start_len") or 0)
    return meta


def native_response(body: dict, state: Any) -> dict:
    prompt, out, values, finish = native_outputs(body, state)
    start = body.get("routed_experts_start_len") or 0
    if body.get("return_routed_experts") and start > len(prompt):
        # scheduler.py: an out-of-range start aborts the request
        finish = {"type": "abort", "message": f"recv_req.routed_experts_start_len={start} is higher than the number "
                  "of input tokens", "status_code": None, "err_type": None}
        out, values = [], []
        body = {**body, "return_routed_experts": False}
    resp = {"text": decode(out), "output_ids": out,
            "meta_info": native_meta(body, prompt, out, values, finish, state.weight_update, finished=True)}
    if body.get("return_prompt_token_ids"):
        resp["prompt_token_ids"] = prompt
    return resp


def native_stream(body: dict, state: Any) -> Iterator[dict]:
    """One chunk per output token; cumulative unless ``state.incremental``."""
    prompt, out, values, finish = native_outputs(body, state)
    for n in range(1, len(out) + 1):
        last = n == len(out)
        meta = native_meta(body, prompt, out[:n], values[:n], finish, state.weight_update, finished=last)
        ids = out[:n]
        if state.incremental:
            ids = out[n - 1:n]
            if "output_token_logprobs" in meta:
                meta["output_token_logprobs"] = meta["output_token_logprobs"][n - 1:]
        chunk = {"text": decode(ids), "output_ids": ids, "meta_info": meta}
        if body.get("return_prompt_token_ids"):
            chunk["prompt_token_ids"] = prompt
        yield chunk


def _openai_prompt(body: dict, chat: bool) -> list[int]:
    if chat:
        return render_chat(body["messages"], body.get("add_generation_prompt", True))
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else encode(prompt)


def _openai_outputs(body: dict, chat: bool, state: Any) -> tuple[list[int], list[int], list, dict]:
    prompt = _openai_prompt(body, chat)
    out, lps, _ = generate(prompt, body.get("max_tokens") or body.get("max_completion_tokens"), chat=chat)
    return prompt, out, _logprob_values(lps, state.missing_logprob), _finish(out, chat, len(out))


def _sglext(body: dict, prompt: list[int], out: list[int], chat: bool) -> dict | None:
    ext: dict = {}
    if body.get("return_routed_experts"):
        ext["routed_experts"] = raw_routes(prompt, out, body.get("routed_experts_start_len") or 0)
    if chat and body.get("return_input_ids_in_sglext"):
        ext["input_ids"] = prompt
    if chat and body.get("return_output_ids_in_sglext"):
        ext["output_ids"] = [out]
    return ext or None


def _completion_logprobs(out: list[int], values: list) -> dict:
    return {"text_offset": [-1] * len(out), "token_logprobs": values, "tokens": [decode([t]) for t in out],
            "top_logprobs": []}


def _chat_logprobs(out: list[int], values: list) -> dict:
    return {"content": [{"token": decode([t]), "bytes": list(decode([t]).encode()), "logprob": v,
                         "top_logprobs": []} for t, v in zip(out, values)]}


def openai_response(body: dict, chat: bool, state: Any) -> dict:
    """``CompletionResponse`` / ``ChatCompletionResponse`` as SGLang serialises it."""
    prompt, out, values, finish = _openai_outputs(body, chat, state)
    spans = weight_version_spans(state.weight_update, len(out))
    usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(out), "completion_tokens": len(out),
             "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}
    matched = finish.get("matched")
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": decode(out), "reasoning_content": None},
                  "logprobs": _chat_logprobs(out, values) if body.get("logprobs") else None,
                  "finish_reason": finish["type"], "matched_stop": matched}
        if body.get("return_token_ids"):
            choice["prompt_token_ids"], choice["response_token_ids"] = prompt, out
    else:
        choice = {"index": 0, "text": decode(out),
                  "logprobs": _completion_logprobs(out, values) if body.get("logprobs") is not None else None,
                  "finish_reason": finish["type"], "matched_stop": matched}
        if body.get("return_token_ids"):
            choice["token_ids"], choice["prompt_token_ids"] = out, prompt
    resp = {"id": "sgl-1", "object": "chat.completion" if chat else "text_completion", "created": 0,
            "model": body.get("model", "fake"), "choices": [choice], "usage": usage,
            "metadata": {"weight_version": spans[-1]["version"], "weight_versions": spans}}
    ext = _sglext(body, prompt, out, chat)
    if ext is not None:
        resp["sglext"] = ext
    return resp


def openai_stream(body: dict, chat: bool, state: Any) -> Iterator[dict]:
    """The SSE objects: one token per chunk, then a ``choices: []`` chunk with ``sglext``; no metadata."""
    prompt, out, values, finish = _openai_outputs(body, chat, state)
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": "sgl-1", "object": obj, "created": 0, "model": body.get("model", "fake")}
    for i, (tok, v) in enumerate(zip(out, values)):
        last = i == len(out) - 1
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": finish["type"] if last else None,
                        "matched_stop": finish.get("matched") if last else None}
        if chat:
            choice["delta"] = {"role": "assistant" if i == 0 else None, "content": decode([tok]),
                               "reasoning_content": None}
            if body.get("logprobs"):
                choice["logprobs"] = _chat_logprobs([tok], [v])
        else:
            choice["text"] = decode([tok])
            if body.get("logprobs") is not None:
                choice["logprobs"] = _completion_logprobs([tok], [v])
            if body.get("return_token_ids"):
                choice["token_ids"] = [tok]
                if i == 0:
                    choice["prompt_token_ids"] = prompt
        yield {**base, "choices": [choice], "usage": None}
    ext = _sglext(body, prompt, out, chat)
    if ext is not None:
        yield {**base, "choices": [], "usage": None, "sglext": ext}


ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # FINISH_ABORT().to_json()


def live_spans(labels: list[str], first: str) -> list[dict]:
    """The spans of an output whose token ``i`` was sampled under ``labels[i]`` (``first``: the label at
    its start, the one span of an empty output)."""
    spans = [{"version": first, "start": 0, "end": 0}]
    for label in labels:
        if label != spans[-1]["version"]:
            spans.append({"version": label, "start": spans[-1]["end"], "end": spans[-1]["end"]})
        spans[-1]["end"] += 1
    return spans  # a swap before the first token leaves a zero-length first span, as SGLang's do


async def live_stream(body: dict, app: Any) -> AsyncIterator[dict]:
    """A streamed ``/generate`` made token by token under the engine's live label, pause and aborts."""
    state = app.state
    prompt = list(body["input_ids"])
    n_max = (body.get("sampling_params") or {}).get("max_new_tokens") or 16
    seed = sum(prompt) + len(prompt)
    out = [10 + ord("a") + (seed + 7 * i) % 26 for i in range(n_max)]  # as openai_upstream.generate, any length
    values = [-0.05 * ((seed + i) % 10 + 1) for i in range(n_max)]
    finish = {"type": "length", "length": n_max}
    me = {"aborted": False}
    state.running.append(me)
    labels: list[str] = []
    first = state.label
    try:
        for n in range(1, len(out) + 1):
            await asyncio.sleep(state.token_delay_s)
            while state.paused and not me["aborted"]:
                await asyncio.sleep(0.005)
            if me["aborted"]:
                break
            labels.append(state.label)
            last = n == len(out)
            meta = native_meta(body, prompt, out[:n], values[:n], finish, None, finished=last)
            if last:
                meta["weight_versions"] = live_spans(labels, first)
                meta["weight_version"] = labels[-1]
            else:
                meta["weight_version"] = labels[-1]
            yield {"text": decode(out[:n]), "output_ids": out[:n], "meta_info": meta}
        if me["aborted"]:
            n = len(labels)
            meta = native_meta(body, prompt, out[:n], values[:n], ABORTED, None, finished=True)
            meta["weight_versions"] = live_spans(labels, first)
            meta["weight_version"] = state.label
            yield {"text": decode(out[:n]), "output_ids": out[:n], "meta_info": meta}
    finally:
        state.running.remove(me)


def _abort_all(app: Any) -> None:
    for running in app.state.running:
        running["aborted"] = True


def make_upstream() -> Any:
    """The FastAPI app; ``app.state.requests`` keeps every request body received."""
    from types import SimpleNamespace

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    app.state.requests = []
    app.state.weight_update = None
    app.state.missing_logprob = None
    app.state.incremental = False
    app.state.token_delay_s = None
    app.state.label = DEFAULT_VERSION
    app.state.paused = False
    app.state.running = []
    app.state.control = []

    def sse(chunks: Iterator[dict]) -> Any:
        def body() -> Iterator[bytes]:
            for chunk in chunks:
                yield sse_event(chunk)
            yield SSE_DONE
        return StreamingResponse(body(), media_type="text/event-stream")

    def state() -> Any:
        return SimpleNamespace(weight_update=app.state.weight_update, missing_logprob=app.state.missing_logprob,
                               incremental=app.state.incremental)

    @app.post("/generate")
    async def native(request: Request) -> Any:
        body = await request.json()
        app.state.requests.append(body)
        if isinstance(body.get("input_ids"), list) and body["input_ids"] and isinstance(body["input_ids"][0], list):
            return JSONResponse([native_response({**body, "input_ids": ids}, state()) for ids in body["input_ids"]])
        if body.get("stream") and app.state.token_delay_s is not None:
            async def live() -> AsyncIterator[bytes]:
                async for chunk in live_stream(body, app):
                    yield sse_event(chunk)
                yield SSE_DONE
            return StreamingResponse(live(), media_type="text/event-stream")
        if body.get("stream"):
            return sse(list(native_stream(body, state())))
        return JSONResponse(native_response(body, state()))

    async def openai(request: Request, chat: bool) -> Any:
        body = await request.json()
        app.state.requests.append(body)
        if chat and body.get("stream") and body.get("return_token_ids"):
            return JSONResponse({"object": "error", "message": "return_token_ids is not supported with streaming on "
                                 "/v1/chat/completions.", "type": "BadRequestError", "param": None, "code": 400},
                                status_code=400)
        if body.get("stream"):
            return sse(list(openai_stream(body, chat, state())))
        return JSONResponse(openai_response(body, chat, state()))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await openai(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await openai(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    async def control(request: Request) -> dict:
        body = await request.json() if await request.body() else {}
        app.state.control.append((request.url.path, body))
        return body

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Any:
        body = await control(request)
        if body.get("abort_all_requests", True):  # UpdateWeightVersionReqInput's default
            _abort_all(app)
        app.state.label = body["new_version"]
        return JSONResponse({"success": True, "message": f"Weight version updated to {body['new_version']}",
                             "new_version": body["new_version"]})

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> Any:
        body = await control(request)
        app.state.paused = True
        if body.get("mode", "abort") == "abort":
            _abort_all(app)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> Any:
        await control(request)
        app.state.paused = False
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Any:
        from fastapi.responses import Response

        body = await control(request)
        if body.get("abort_all"):
            _abort_all(app)
        return Response(status_code=200)

    return app
