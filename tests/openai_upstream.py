"""A deterministic OpenAI-compatible upstream that answers in vLLM's shapes: the library's
simulated engine (``trajstore.demo._engine``) without its own weight-label clock.

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

import contextlib
import socket
import threading
import time
from typing import Any, Iterator

from trajstore.demo._engine import (ASSISTANT, END, MAX_OUTPUT_TOKENS, NUM_EXPERTS, NUM_LAYERS, ROLE_IDS,  # noqa: F401
                                    SYSTEM, TOOL, TOPK, USER, decode, encode, generate, make_engine, render_chat,
                                    respond, route_rows, routes_from, stream_chunks, tito_respond,
                                    tito_stream_chunks, weight_version_spans)


def make_upstream() -> Any:
    """The FastAPI app; ``app.state.requests`` keeps every request body received, ``app.state.headers`` their
    headers; ``app.state.weight_update = (at, before, after)`` gives every choice those spans."""
    return make_engine(weight_clock=False)


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
