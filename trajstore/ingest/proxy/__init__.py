"""OpenAI-compatible recording proxy in front of a vLLM (or SGLang) server.

A harness points its OpenAI client at the proxy instead of vLLM and names
the trajectory of each call with the header ``X-Trajstore-Trajectory`` (or
the body field ``"trajstore": {"trajectory_id": ...}``, removed before
forwarding). The proxy forwards ``/v1/completions`` and
``/v1/chat/completions`` with ``return_token_ids``, ``return_weight_versions``
and sampled-token ``logprobs`` switched on
(``trajstore.ingest.vllm.request_params_for_recording``),
and vLLM's token-in/token-out ``POST /inference/v1/generate`` with
``sampling_params.logprobs`` (``request_params_for_tito``), records the call
as the trajectory's next generation event (``seq`` assigned here), and
returns the upstream's response bytes unchanged. Routes come with every
response when vLLM runs with ``--enable-return-routed-experts``.

Only new route rows: when the call's prompt token ids are known before the
call (``/inference/v1/generate``, or ``/v1/completions`` with a token-id
prompt) and they continue the trajectory's recorded sequence, the proxy sets
``routed_experts_prompt_start`` to the number of route rows the trajectory
has recorded (the store's ``route_len``), unless the caller set it; the
engine then returns rows for the new positions only and the event carries
``routed_experts_start``. The sample is the same as with every row sent.

Other headers: ``X-Trajstore-Model-Version`` (else ``--model-version``),
``X-Trajstore-Group`` and ``X-Trajstore-Num-Experts``, and a rollout driver's
``X-Trajstore-Run``, ``X-Trajstore-Prompt``, ``X-Trajstore-Epoch`` and
``X-Trajstore-Group-Size`` (used when the call starts the trajectory; the
rollout ledger, docs/reference.md). Calls without a trajectory are forwarded unrecorded
(``X-Trajstore-Unrecorded``, one log line per client). ``POST
/trajstore/finish`` ``{"trajectory_id", "status", "reward"?}`` ends a
trajectory. The response carries ``X-Trajstore-Seq`` when recorded. A
named call that cannot be recorded (the store refused it, the upstream's
answer cannot be read) fails closed: an error status (the store's
409/422/503, or 502) with the reason in the OpenAI error shape and
``X-Trajstore-Error`` (one line); ``pass_through_unrecorded``
(``--pass-through-unrecorded``) gives the upstream's status and bytes with
that header instead. Either way the record is whole or absent, and
``GET /metrics`` counts it. vLLM's RL, render, tokenizer and health
endpoints (``FORWARDED``) are forwarded as sent, unrecorded; a label change
among them with ``X-Trajstore-Model-Version`` also maps its label.
``upstream`` may end in ``/v1`` (dropped).

Auth: with a token (``--token`` / ``$TRAJSTORE_TOKEN``, as ``trajstore
serve``) every endpoint but ``/healthz``, ``/openapi.json``, ``/docs`` and
``/redoc`` needs ``Authorization: Bearer <token>``; the harness's client
sends it as its API key. That header is not forwarded: the upstream gets
``--upstream-api-key`` instead, if any.

Streams (``"stream": true``) are passed through chunk by chunk while the
``data:`` objects are accumulated; the record is appended when the stream
ended whole (every choice has its finish reason), before its ``data:
[DONE]`` reaches the harness, and announced by the SSE comment ``:
X-Trajstore-Seq: N``; a cut stream, or one that cannot be recorded, records
nothing and gets an SSE error event before its ``[DONE]``. vLLM streams no
routes on the OpenAI endpoints (those calls are recorded without them);
``/inference/v1/generate`` sends routes and version spans on the final chunk.

Seqs survive restarts: the first call for a trajectory the proxy has not
seen asks the store for the trajectory's last seq. The record and the
response's durability: the response is sent only after the append returned.

The package: ``_record`` (``Tag``, ``Recorder``), ``_sse`` (SSE on the way
through), ``_forward`` (``_UpstreamForwarder``, what every engine's proxy does
alike), ``_metrics`` (``GET /metrics``), ``_app`` (the FastAPI app), one
module per engine (``_vllm``, ``_sglang``: what they record and relay, and
how they ask for it, and their app of a ``ProxyConfig``), ``_config``
(``ProxyConfig``: each setting one field, which is also its flag), ``_serve``
(``serve``, the one start path for every engine, whose faces ``serve_proxy``
and ``main`` are).
"""

import importlib
import warnings
from typing import Any

from trajstore.ingest.proxy._record import Recorder, Tag
from trajstore.ingest.proxy._serve import add_cli_arguments, main, serve_proxy, serve_proxy_from_args
from trajstore.ingest.proxy._vllm import FORWARDED, RECORDED, make_proxy_app

__all__ = [
    "FORWARDED", "RECORDED", "Recorder", "Tag", "add_cli_arguments", "main", "make_proxy_app", "serve_proxy",
    "serve_proxy_from_args",
]

# names this package exported before they became internals -> the module that holds them
_INTERNAL_NOW = {
    "normalize_upstream": "trajstore.ingest.proxy._app",
    "version_label_events": "trajstore.ingest.proxy._app",
    "tag_of": "trajstore.ingest.proxy._record",
}


def __getattr__(name: str) -> Any:
    module = _INTERNAL_NOW.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"trajstore.ingest.proxy.{name} is internal now and deprecated here; it is {module}.{name}",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
