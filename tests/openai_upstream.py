"""A deterministic OpenAI-compatible upstream that answers in vLLM's shapes.

What it mimics (vLLM's ``CompletionResponse`` / ``ChatCompletionResponse``):
``choices[i].token_ids`` and ``prompt_token_ids`` (in the choice for
completions, top level for chat) only when ``return_token_ids`` is set;
logprobs as ``token_logprobs`` (completions, ``logprobs: int``) or
``content[j].logprob`` (chat, ``logprobs: true``); ``routed_experts`` as a
base64 ``.npy`` of shape ``[prompt + output - 1, layers, topk]`` on every
non-streaming choice (vLLM started with ``--enable-return-routed-experts``);
SSE streams with ``prompt_token_ids`` on the first chunk, per-chunk
``token_ids`` deltas, no routes, and ``data: [DONE]``. A request's
``routed_experts_prompt_start`` (top level here, ``sampling_params`` for the
token-in/token-out endpoint) is honoured: rows start at that position.

The token-in/token-out ``POST /inference/v1/generate`` (vLLM's
``GenerateRequest`` / ``GenerateResponse``): the prompt is ``token_ids``,
``sampling_params`` holds ``max_tokens``, ``logprobs``, ``stop_token_ids``
and ``routed_experts_prompt_start`` (refused, as vLLM does, unless below the
prompt length); each choice has ``token_ids``, ``logprobs.content``,
``finish_reason``, ``stop_reason`` and ``routed_experts``. Streamed, every
chunk carries one token and the final one also the routes and version spans.

In-flight weight updates: set ``app.state.weight_update = (at, before,
after)`` and every choice carries ``weight_versions`` spans: output tokens
``[0, at)`` sampled by label ``before``, the rest by ``after``.

The "tokenizer" maps a byte b to id b + 10; a chat message renders as
``[ROLE, *content, END]`` and the generation prompt is ``[ASSISTANT]``, so a
conversation's next prompt extends the previous prompt + output exactly.
Route rows depend on the call's prompt length, so a position recomputed by a
later call gets a different row (what "a recorded route is never
overwritten" must survive).

Also ``serve_in_thread(app)``: runs any ASGI app with uvicorn on 127.0.0.1.
"""

# No `from __future__ import annotations`: FastAPI reads handler annotations at runtime.

import contextlib
import json
import socket
import threading
import time
from typing import Any, Iterator

import numpy as np

from trajstore._wire import encode_npy_b64

END, SYSTEM, USER, ASSISTANT, TOOL = 2, 3, 4, 5, 6
ROLE_IDS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
NUM_LAYERS, TOPK, NUM_EXPERTS = 2, 2, 16
MAX_OUTPUT_TOKENS = 6


def encode(text: str) -> list[int]:
    return [b + 10 for b in text.encode()]


def decode(ids: list[int]) -> str:
    return bytes(i - 10 for i in ids if i >= 10).decode(errors="replace")


def render_chat(messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    ids: list[int] = []
    for m in messages:
        ids += [ROLE_IDS[m["role"]], *encode(m.get("content") or ""), END]
    return ids + [ASSISTANT] if add_generation_prompt else ids


def generate(prompt_ids: list[int], max_tokens: int | None, *, chat: bool) -> tuple[list[int], list[float], str]:
    """Deterministic output ids (lowercase letters), their logprobs and the finish reason."""
    n = min(max_tokens or MAX_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS)
    seed = sum(prompt_ids) + len(prompt_ids)
    letters = [10 + ord("a") + (seed + 7 * i) % 26 for i in range(n - 1 if chat else n)]
    logprobs = [-0.05 * ((seed + i) % 10 + 1) for i in range(n)]
    if chat:
        return letters + [END], logprobs, "stop"
    return letters, logprobs, "length"


def route_rows(sequence: list[int], prompt_len: int) -> np.ndarray:
    """Rows for positions 0 .. len(sequence) - 2 of a call whose prompt has ``prompt_len`` tokens."""
    pos = np.arange(len(sequence) - 1)[:, None, None]
    tok = np.asarray(sequence[:-1])[:, None, None]
    layer = np.arange(NUM_LAYERS)[None, :, None]
    k = np.arange(TOPK)[None, None, :]
    return ((tok * 3 + pos * 7 + prompt_len * 11 + layer * 5 + k) % NUM_EXPERTS).astype(np.uint8)


def weight_version_spans(update: tuple | None, num_tokens: int) -> list[dict] | None:
    """``weight_versions`` for an output of ``num_tokens`` under ``update = (at, before, after)``."""
    if update is None:
        return None
    at, before, after = update
    at = min(at, num_tokens)
    spans = [{"version": before, "start": 0, "end": at}] if at else []
    if at < num_tokens:
        spans.append({"version": after, "start": at, "end": num_tokens})
    return spans


def routes_from(body_or_params: dict, prompt: list[int], out: list[int]) -> np.ndarray:
    """The rows vLLM returns: from ``routed_experts_prompt_start`` on."""
    start = body_or_params.get("routed_experts_prompt_start") or 0
    return route_rows(prompt + out, len(prompt))[start:]


def _completion_choice(body: dict, prompt: list[int], out: list[int], lps: list[float], finish: str) -> dict:
    want_ids = bool(body.get("return_token_ids"))
    logprobs = None
    if body.get("logprobs") is not None:
        tokens = [decode([t]) for t in out]
        logprobs = {"text_offset": list(range(len(out))), "token_logprobs": lps, "tokens": tokens,
                    "top_logprobs": [None] * len(out)}
    return {"index": 0, "text": decode(out), "logprobs": logprobs, "finish_reason": finish, "stop_reason": None,
            "token_ids": out if want_ids else None, "prompt_logprobs": None,
            "prompt_token_ids": prompt if want_ids else None,
            "routed_experts": encode_npy_b64(routes_from(body, prompt, out))}


def _chat_choice(body: dict, prompt: list[int], out: list[int], lps: list[float], finish: str) -> dict:
    logprobs = None
    if body.get("logprobs"):
        logprobs = {"content": [{"token": decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                                for t, lp in zip(out, lps)]}
    return {"index": 0, "message": {"role": "assistant", "content": decode(out), "tool_calls": [], "reasoning": None},
            "logprobs": logprobs, "finish_reason": finish, "stop_reason": None,
            "token_ids": out if body.get("return_token_ids") else None,
            "routed_experts": encode_npy_b64(routes_from(body, prompt, out))}


def _prompt_ids(body: dict, chat: bool) -> list[int]:
    if chat:
        return render_chat(body["messages"], body.get("add_generation_prompt", True))
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else encode(prompt)


def respond(body: dict, *, chat: bool) -> dict:
    """The non-streaming response vLLM would send for ``body``."""
    prompt = _prompt_ids(body, chat)
    out, lps, finish = generate(prompt, body.get("max_tokens") or body.get("max_completion_tokens"), chat=chat)
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out), "total_tokens": len(prompt) + len(out)}
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{sum(prompt)}", "created": 0, "model": body.get("model", "fake"),
            "usage": usage, "system_fingerprint": None, "kv_transfer_params": None}
    if chat:
        choice = _chat_choice(body, prompt, out, lps, finish)
        return {**base, "object": "chat.completion", "choices": [choice], "prompt_logprobs": None,
                "prompt_token_ids": prompt if body.get("return_token_ids") else None}
    return {**base, "object": "text_completion", "choices": [_completion_choice(body, prompt, out, lps, finish)]}


def stream_chunks(body: dict, *, chat: bool) -> Iterator[dict]:
    """The SSE ``data:`` objects vLLM would stream for ``body`` (routes are never streamed)."""
    prompt = _prompt_ids(body, chat)
    out, lps, finish = generate(prompt, body.get("max_tokens") or body.get("max_completion_tokens"), chat=chat)
    want_ids = bool(body.get("return_token_ids"))
    obj = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        first = {"object": obj, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        if want_ids:
            first["prompt_token_ids"] = prompt
        yield first
    for i, (tok, lp) in enumerate(zip(out, lps)):
        choice: dict = {"index": 0, "finish_reason": finish if i == len(out) - 1 else None}
        if chat:
            choice["delta"] = {"content": decode([tok])}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [{"token": decode([tok]), "logprob": lp, "top_logprobs": []}]}
        else:
            choice["text"] = decode([tok])
            if body.get("logprobs") is not None:
                choice["logprobs"] = {"token_logprobs": [lp], "tokens": [decode([tok])]}
            if want_ids and i == 0:
                choice["prompt_token_ids"] = prompt
        if want_ids:
            choice["token_ids"] = [tok]
        yield {"object": obj, "choices": [choice]}


def _tito_choice(params: dict, prompt: list[int], out: list[int], lps: list[float], finish: str,
                 update: tuple | None) -> dict:
    logprobs = None
    if params.get("logprobs") is not None:
        logprobs = {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                for t, lp in zip(out, lps)]}
    choice = {"index": 0, "logprobs": logprobs, "finish_reason": finish, "token_ids": out,
              "stop_reason": END if END in (params.get("stop_token_ids") or []) else None,
              "routed_experts": encode_npy_b64(routes_from(params, prompt, out))}
    if update is not None:
        choice["weight_versions"] = weight_version_spans(update, len(out))
    return choice


def _tito_check(body: dict) -> tuple[list[int], dict]:
    prompt, params = list(body["token_ids"]), dict(body.get("sampling_params") or {})
    start = params.get("routed_experts_prompt_start") or 0
    if not 0 <= start < len(prompt):
        raise ValueError("sampling_params.routed_experts_prompt_start must be less than the prompt length")
    return prompt, params


def tito_respond(body: dict, update: tuple | None = None) -> dict:
    """The ``GenerateResponse`` vLLM's ``/inference/v1/generate`` would send for ``body``."""
    prompt, params = _tito_check(body)
    out, lps, finish = generate(prompt, params.get("max_tokens"), chat=True)
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out), "total_tokens": len(prompt) + len(out)}
    return {"request_id": f"gen-{sum(prompt)}", "model": body.get("model"), "created": 0,
            "choices": [_tito_choice(params, prompt, out, lps, finish, update)], "usage": usage,
            "prompt_logprobs": None, "kv_transfer_params": None}


def tito_stream_chunks(body: dict, update: tuple | None = None) -> Iterator[dict]:
    """The ``GenerateStreamResponse`` chunks: one token each; routes and version spans on the final one."""
    prompt, params = _tito_check(body)
    out, lps, finish = generate(prompt, params.get("max_tokens"), chat=True)
    whole = _tito_choice(params, prompt, out, lps, finish, update)
    for i, (tok, lp) in enumerate(zip(out, lps)):
        choice: dict = {"index": 0, "finish_reason": None, "token_ids": [tok], "logprobs": None}
        if params.get("logprobs") is not None:
            choice["logprobs"] = {"content": [whole["logprobs"]["content"][i]]}
        if i == len(out) - 1:
            for key in ("finish_reason", "stop_reason", "routed_experts", "weight_versions"):
                if key in whole:
                    choice[key] = whole[key]
        yield {"request_id": f"gen-{sum(prompt)}", "choices": [choice], "usage": None}


def make_upstream() -> Any:
    """The FastAPI app; ``app.state.requests`` keeps every request body received, ``app.state.headers`` their headers."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    app.state.requests = []
    app.state.headers = []
    app.state.weight_update = None

    def sse(chunks: Iterator[dict]) -> Any:
        def body() -> Iterator[bytes]:
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        app.state.requests.append(body)
        app.state.headers.append(dict(request.headers))
        if body.get("stream"):
            return sse(stream_chunks(body, chat=chat))
        response = respond(body, chat=chat)
        spans = weight_version_spans(app.state.weight_update, len(response["choices"][0]["token_ids"] or []))
        if spans is not None:
            response["choices"][0]["weight_versions"] = spans
        return response

    @app.post("/inference/v1/generate")
    async def tito(request: Request) -> Any:
        body = await request.json()
        app.state.requests.append(body)
        app.state.headers.append(dict(request.headers))
        try:
            if body.get("stream"):
                return sse(list(tito_stream_chunks(body, app.state.weight_update)))
            return tito_respond(body, app.state.weight_update)
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e), "type": "BadRequestError", "code": 400}}, status_code=400)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        app.state.headers.append(dict(request.headers))
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    return app


@contextlib.contextmanager
def serve_in_thread(app: Any, http: Any = "auto") -> Iterator[str]:
    """Run ``app`` with uvicorn on a free loopback port; yields its base URL.
    ``http``: uvicorn's HTTP protocol (the ingest service's own: ``trajstore.ingest._nodelay``)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # timeout_keep_alive: uvicorn closes a connection idle for 5 s by default; a request a
    # client sends on it at that moment gets no answer ("Server disconnected without
    # sending a response"). The Writer's sink retries that; the tests' plain httpx clients,
    # idle longer than 5 s on a loaded machine, would fail on it.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", http=http,
                                           timeout_keep_alive=300))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(500):
        if server.started:
            break
        time.sleep(0.01)
    else:
        raise RuntimeError("test server did not start in 5 s")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
