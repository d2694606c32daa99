"""A simulated vLLM: an OpenAI-compatible engine on CPU, no model, vLLM 0.33's wire shapes.

It answers what ``trajstore proxy`` records, in the shapes vLLM 0.33's
OpenAI server sends (``entrypoints/openai/completion/protocol.py``,
``chat_completion/protocol.py``, ``scale_out/token_in_token_out/protocol.py``):

* ``POST /v1/completions`` and ``/v1/chat/completions``:
  ``choices[i].token_ids`` and ``prompt_token_ids`` when ``return_token_ids``
  is set; logprobs as ``token_logprobs`` (completions) or
  ``content[j].logprob`` (chat); ``routed_experts`` as the base64 of a
  ``.npy`` ``[prompt + output - 1, layers, topk]`` on every non-streamed
  choice (vLLM with ``--enable-return-routed-experts``), from
  ``routed_experts_prompt_start`` on; ``weight_versions`` spans when the
  request sets ``return_weight_versions``; SSE streams with
  ``prompt_token_ids`` on the first chunk, per-chunk ``token_ids``, no routes,
  and ``data: [DONE]``;
* the token-in/token-out ``POST /inference/v1/generate``
  (``GenerateRequest``/``GenerateResponse``): always ``weight_versions``;
  streamed, one token a chunk with routes and spans on the final one;
* the RL control plane a trainer uses (``VLLM_SERVER_DEV_MODE=1`` in vLLM):
  ``POST /update_weight_version {"new_version": LABEL}``, ``/pause``,
  ``/resume``, ``GET /is_paused``; plus ``/health`` and ``/v1/models``.

Weights are labelled as vLLM labels them: ``"default"`` until someone sets a
label. ``weight_update_every=N`` simulates a trainer publishing new weights
in the middle of calls: after every N generated tokens (engine-wide) the
label becomes the next integer (``"1"``, ``"2"``, ...), so calls come back
with spans from two versions, as in an async RL run; a named label set with
``/update_weight_version`` (``"step-42"``) stays until set again.

The "tokenizer" maps a byte b to id b + 10; a chat message renders as
``[ROLE, *content, END]`` and the generation prompt is ``[ASSISTANT]``, so a
conversation's next prompt extends the previous prompt + output exactly.
Outputs, logprobs and route rows are a deterministic function of the
prompt (and of the request's sampling ``seed``, when it sends one); a position recomputed by a later call gets a different route row
(what "a recorded route is never overwritten" must survive).

``trajstore demo --engine`` runs it with a real ``trajstore proxy`` in front
and an agent episode through both (docs/first-hour.md).
"""

# No `from __future__ import annotations`: FastAPI reads handler annotations at runtime.

import asyncio
import json
import threading
from typing import Any, Iterator

import numpy as np

from trajstore.events._wire import encode_npy_b64

__all__: list[str] = []

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


def generate(prompt_ids: list[int], max_tokens: int | None, *, chat: bool,
             limit: int = MAX_OUTPUT_TOKENS, seed: int | None = None) -> tuple[list[int], list[float], str]:
    """Deterministic output ids (lowercase letters), their logprobs and the finish reason.

    ``seed`` (vLLM's ``SamplingParams.seed``, OpenAI's ``seed``) picks another
    answer to the same prompt, as sampling with another seed does: a GRPO
    group's members differ."""
    n = min(max_tokens or limit, limit)
    seed = sum(prompt_ids) + len(prompt_ids) + (0 if seed is None else 7919 * int(seed))
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


def _max_tokens(body: dict) -> int | None:
    return body.get("max_tokens") or body.get("max_completion_tokens")


def respond(body: dict, *, chat: bool, limit: int = MAX_OUTPUT_TOKENS) -> dict:
    """The non-streaming response vLLM would send for ``body``."""
    prompt = _prompt_ids(body, chat)
    out, lps, finish = generate(prompt, _max_tokens(body), chat=chat, limit=limit, seed=body.get("seed"))
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out), "total_tokens": len(prompt) + len(out)}
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{sum(prompt)}", "created": 0, "model": body.get("model", "fake"),
            "usage": usage, "system_fingerprint": None, "kv_transfer_params": None}
    if chat:
        choice = _chat_choice(body, prompt, out, lps, finish)
        return {**base, "object": "chat.completion", "choices": [choice], "prompt_logprobs": None,
                "prompt_token_ids": prompt if body.get("return_token_ids") else None}
    return {**base, "object": "text_completion", "choices": [_completion_choice(body, prompt, out, lps, finish)]}


def stream_chunks(body: dict, *, chat: bool, limit: int = MAX_OUTPUT_TOKENS) -> Iterator[dict]:
    """The SSE ``data:`` objects vLLM would stream for ``body`` (routes are never streamed)."""
    prompt = _prompt_ids(body, chat)
    out, lps, finish = generate(prompt, _max_tokens(body), chat=chat, limit=limit, seed=body.get("seed"))
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


def tito_respond(body: dict, update: tuple | None = None, *, limit: int = MAX_OUTPUT_TOKENS) -> dict:
    """The ``GenerateResponse`` vLLM's ``/inference/v1/generate`` would send for ``body``."""
    prompt, params = _tito_check(body)
    out, lps, finish = generate(prompt, params.get("max_tokens"), chat=True, limit=limit, seed=params.get("seed"))
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(out), "total_tokens": len(prompt) + len(out)}
    return {"request_id": f"gen-{sum(prompt)}", "model": body.get("model"), "created": 0,
            "choices": [_tito_choice(params, prompt, out, lps, finish, update)], "usage": usage,
            "prompt_logprobs": None, "kv_transfer_params": None}


def tito_stream_chunks(body: dict, update: tuple | None = None, *, limit: int = MAX_OUTPUT_TOKENS) -> Iterator[dict]:
    """The ``GenerateStreamResponse`` chunks: one token each; routes and version spans on the final one."""
    prompt, params = _tito_check(body)
    out, lps, finish = generate(prompt, params.get("max_tokens"), chat=True, limit=limit, seed=params.get("seed"))
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


class WeightClock:
    """The engine's weight label, as vLLM keeps it: ``"default"`` until set; with
    ``update_every`` it moves to the next integer label every that many generated tokens."""

    def __init__(self, update_every: int | None = None) -> None:
        self.label = "default"
        self.update_every = update_every
        self._generated = 0
        self._lock = threading.Lock()

    def set(self, label: str) -> None:
        with self._lock:
            self.label = str(label)

    def _next(self, label: str) -> str:
        """The label after ``label``: the next integer; a named label (``"step-42"``, set by
        ``/update_weight_version``) stays until set again (a trainer that names its weights names
        each one): moving on to ``"1"`` would take a trajectory's versions back from 42 to 1."""
        if label.isdigit():
            return str(int(label) + 1)
        return "1" if label == "default" else label

    def spans(self, num_tokens: int) -> list[dict]:
        """The spans of a call generating ``num_tokens`` now: ``[{version, start, end}, ...]``."""
        with self._lock:
            spans: list[dict] = []
            start = 0
            while start < num_tokens:
                end = num_tokens
                if self.update_every:
                    left = self.update_every - self._generated % self.update_every
                    end = min(num_tokens, start + left)
                spans.append({"version": self.label, "start": start, "end": end})
                self._generated += end - start
                if self.update_every and self._generated % self.update_every == 0:
                    self.label = self._next(self.label)
                start = end
            return spans

    def update(self, num_tokens: int) -> tuple | None:
        """The spans as ``(at, before, after)`` for the response builders (at most two labels a call)."""
        spans = self.spans(num_tokens)
        if not spans:
            return None
        if len(spans) == 1:
            return (num_tokens, spans[0]["version"], spans[0]["version"])
        return (spans[0]["end"], spans[0]["version"], spans[-1]["version"])


def make_engine(*, weight_update_every: int | None = None, max_output_tokens: int = MAX_OUTPUT_TOKENS,
                weight_clock: bool = True, call_log: str | None = None, latency_s: float = 0.0) -> Any:
    """The simulated engine's FastAPI app.

    ``call_log``: a file that gets one JSON line per answer the engine starts
    generating (``{"seed", "prompt_len", "output_len"}``): what it generated,
    to count the work done again after a crash. ``latency_s``: each answer
    takes that long (a generation's time).

    ``weight_clock=False``: no spans unless ``app.state.weight_update`` is set (an
    engine that reports no versions, as vLLM before 0.33).

    ``app.state.requests`` / ``app.state.headers`` keep every request body and its
    headers; ``app.state.weight_update = (at, before, after)`` forces every call's
    spans (output tokens ``[0, at)`` under ``before``, the rest under ``after``),
    overriding the engine's own label clock (``app.state.weights``)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="trajstore simulated engine (vLLM 0.33 shapes)")
    app.state.requests = []
    app.state.headers = []
    app.state.weight_update = None
    app.state.weights = WeightClock(weight_update_every)
    app.state.paused = False
    limit = max_output_tokens

    async def generating(prompt: list[int], body: dict, max_tokens: int | None, chat: bool) -> None:
        if call_log is not None:
            n = len(generate(prompt, max_tokens, chat=chat, limit=limit)[0])
            line = json.dumps({"seed": body.get("seed"), "prompt_len": len(prompt), "output_len": n}) + "\n"
            with open(call_log, "a") as f:
                f.write(line)
        if latency_s:
            await asyncio.sleep(latency_s)

    def update_for(num_tokens: int) -> tuple | None:
        forced = app.state.weight_update
        if forced is not None or not weight_clock:
            return forced
        return app.state.weights.update(num_tokens)

    def sse(chunks: Iterator[dict]) -> Any:
        def body() -> Iterator[bytes]:
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        return StreamingResponse(body(), media_type="text/event-stream")

    def paused() -> Any:
        return JSONResponse({"error": {"message": "the engine is paused", "type": "ServiceUnavailable",
                                       "code": 503}}, status_code=503)

    async def handle(request: Request, chat: bool) -> Any:
        body = await request.json()
        app.state.requests.append(body)
        app.state.headers.append(dict(request.headers))
        if app.state.paused:
            return paused()
        await generating(_prompt_ids(body, chat), body, _max_tokens(body), chat)
        if body.get("stream"):
            return sse(stream_chunks(body, chat=chat, limit=limit))
        response = respond(body, chat=chat, limit=limit)
        choice = response["choices"][0]
        if app.state.weight_update is not None:
            choice["weight_versions"] = weight_version_spans(app.state.weight_update, len(choice["token_ids"] or []))
        elif weight_clock and body.get("return_weight_versions"):
            num_tokens = len(generate(_prompt_ids(body, chat), _max_tokens(body), chat=chat, limit=limit)[0])
            choice["weight_versions"] = app.state.weights.spans(num_tokens)
        return response

    @app.post("/inference/v1/generate")
    async def tito(request: Request) -> Any:
        body = await request.json()
        app.state.requests.append(body)
        app.state.headers.append(dict(request.headers))
        if app.state.paused:
            return paused()
        try:
            prompt, params = _tito_check(body)
            await generating(prompt, params, params.get("max_tokens"), True)
            update = update_for(len(generate(prompt, params.get("max_tokens"), chat=True, limit=limit)[0]))
            if body.get("stream"):
                return sse(list(tito_stream_chunks(body, update, limit=limit)))
            return tito_respond(body, update, limit=limit)
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse({"error": {"message": str(e), "type": "BadRequestError", "code": 400}}, status_code=400)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await handle(request, chat=True)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> Any:
        body = await request.json()
        label = body.get("new_version")
        if label is None:
            return JSONResponse({"error": "new_version is required"}, status_code=400)
        app.state.weights.set(label)
        return {"status": "ok", "weight_version": str(label)}

    @app.post("/pause")
    async def pause() -> dict:
        app.state.paused = True
        return {"status": "paused"}

    @app.post("/resume")
    async def resume() -> dict:
        app.state.paused = False
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused() -> dict:
        return {"is_paused": app.state.paused}

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        app.state.headers.append(dict(request.headers))
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    return app
