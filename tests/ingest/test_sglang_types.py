"""tests/sglang_upstream.py answers exactly as SGLang 0.5.23's own types and functions do.

Runs where ``sglang==0.5.23`` imports: ``.ci/sglang_types`` makes that venv
(``sglang`` without its dependencies, plus the few pure-Python ones its
OpenAI protocol module and weight-version helpers import) and runs this
file in it. In the main venv the module is skipped, saying so: SGLang's
pins (torch 2.14.1, transformers 5.19) would replace the project's.

Checked against SGLang's code itself:

* ``entrypoints/openai/protocol.py``: every OpenAI response and stream
  chunk the fake upstream sends is what SGLang's pydantic model serialises
  (validate, dump, compare), and the bodies the proxy forwards validate as
  SGLang's request models with the fields the proxy adds;
* ``entrypoints/api_contract.py``: the proxy's ``/generate`` bodies pass
  SGLang's HTTP contract gate;
* ``utils/weight_versions.py``: spans and endpoint ``metadata`` from
  SGLang's own functions equal the upstream's;
* routes: base64 of raw int32, decoded as SGLang's
  ``extract_routed_experts_from_meta_info`` would (``np.frombuffer(...,
  int32)``; the function's module needs torchvision, see docs/sglang.md).

Not importable here: ``managers/io_struct.py`` and
``managers/schedule_batch.py`` (``FINISH_*.to_json``) import the multimodal
stack, whose torchvision wheel does not load against CPU torch ("operator
torchvision::nms does not exist"); the finish-reason dicts are copied from
that source (cited in tests/sglang_upstream.py).
"""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import numpy as np
import pytest

protocol = pytest.importorskip(
    "sglang.srt.entrypoints.openai.protocol",
    reason="needs sglang==0.5.23's own modules; .ci/sglang_types runs this file in a venv that has them")
weight_versions = pytest.importorskip("sglang.srt.utils.weight_versions")
api_contract = pytest.importorskip("sglang.srt.entrypoints.api_contract")

from openai_upstream import END, NUM_LAYERS, TOPK, encode, route_rows  # noqa: E402
from sglang_upstream import (  # noqa: E402
    native_response, openai_response, openai_stream, raw_routes, weight_version_spans,
)
from trajstore.ingest.sglang import (  # noqa: E402
    generation_from_generate, generations_from_openai, request_params_for_generate, request_params_for_openai,
)


def test_the_installed_sglang_is_the_one_read():
    import sglang

    assert sglang.__version__ == "0.5.23"


@pytest.mark.parametrize("n", [0, 1, 4, 6])
@pytest.mark.parametrize("update", [None, (0, "3", "4"), (2, "3", "4"), (2, "4", "4"), (6, "3", "4"), (9, "a", "b")])
def test_spans_are_sglangs(update, n):
    events = [] if update is None else [weight_versions.WeightVersionEvent(old_version=update[1],
                                                                          num_output_tokens=update[0])]
    current = "default" if update is None else update[2]
    spans = weight_versions.compute_weight_version_spans(events, current_version=current, num_output_tokens=n)
    meta: dict = {"weight_version": "default"}
    weight_versions.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=n)
    assert meta["weight_versions"] == weight_version_spans(update, n)
    assert meta["weight_version"] == weight_version_spans(update, n)[-1]["version"]


def _state(chat=False, **kw):
    # a chat logprob is a plain float in SGLang's model: -inf is sent as null but cannot be parsed back
    return SimpleNamespace(**{"weight_update": (2, "3", "4"), "missing_logprob": None if chat else 1,
                              "incremental": False, **kw})


def test_minus_infinity_goes_out_as_null():
    """What SGLang sends for a logprob it has none for: the upstream's None, the adapter's LOGPROB_FLOOR."""
    import orjson  # the native endpoints' serialiser (utils/json_response.py)

    token = protocol.ChatCompletionTokenLogprob(token="a", bytes=[97], logprob=float("-inf"), top_logprobs=[])
    assert json.loads(token.model_dump_json())["logprob"] is None
    assert json.loads(protocol.LogProbs(token_logprobs=[float("-inf")]).model_dump_json())["token_logprobs"] == [None]
    assert orjson.loads(orjson.dumps([-float("inf"), 21, None])) == [None, 21, None]


def _bodies():
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    completion = {"model": "fake", "prompt": [3, 20, 21, 2, 5], "max_tokens": 5}
    return [(True, request_params_for_openai(chat, chat=True, routes=True)),
            (False, request_params_for_openai(completion, chat=False, routes=True))]


def _roundtrip(model, data):
    """``data`` parsed by SGLang's model and serialised back as SGLang sends it (``model_dump_json``).

    A chat choice's ``logprobs`` is ``Union[LogProbs, ChoiceLogprobs]``; SGLang builds a
    ``ChoiceLogprobs`` (serving_chat.py), which validation alone would not pick.
    """
    obj = model.model_validate(data)
    for parsed, raw in zip(obj.choices, data["choices"]):
        if isinstance(raw.get("logprobs"), dict) and "content" in raw["logprobs"]:
            parsed.logprobs = protocol.ChoiceLogprobs.model_validate(raw["logprobs"])
    return json.loads(obj.model_dump_json())


@pytest.mark.parametrize("chat, body", _bodies(), ids=["chat", "completions"])
def test_openai_responses_are_what_sglangs_models_serialise(chat, body):
    request_model = protocol.ChatCompletionRequest if chat else protocol.CompletionRequest
    parsed = request_model.model_validate(body)  # the proxy's additions are SGLang request fields
    added = set(body) - {"model", "messages", "prompt", "max_tokens"}
    assert added <= set(request_model.model_fields) and all(getattr(parsed, k) == body[k] for k in added)
    resp = openai_response(body, chat, _state(chat))
    model = protocol.ChatCompletionResponse if chat else protocol.CompletionResponse
    assert _roundtrip(model, resp) == resp
    meta = {"weight_version": "4", "weight_versions": weight_version_spans((2, "3", "4"), 6 if chat else 5)}
    assert resp["metadata"] == weight_versions.build_endpoint_weight_version_metadata(meta)
    assert resp["choices"][0]["logprobs"] is not None
    (event,) = generations_from_openai(_roundtrip(model, resp), body, trajectory_id="t", seq=0, model_version=3,
                                       route_layout=(NUM_LAYERS, TOPK))
    assert event["weight_versions"] == meta["weight_versions"] and event["routed_experts"]["dtype"] == "int32"


@pytest.mark.parametrize("chat, body", _bodies(), ids=["chat", "completions"])
def test_stream_chunks_are_what_sglangs_models_serialise(chat, body):
    model = protocol.ChatCompletionStreamResponse if chat else protocol.CompletionStreamResponse
    chunks = list(openai_stream({**body, "stream": True}, chat, _state(chat)))
    for chunk in chunks:
        assert _roundtrip(model, chunk) == chunk
    assert chunks[-1]["choices"] == [] and set(chunks[-1]["sglext"]) >= {"routed_experts"}
    assert all("metadata" not in c for c in chunks)


def test_generate_bodies_pass_sglangs_contract_gate():
    for raw in ({"input_ids": [3, 20, 2, 5], "sampling_params": {"max_new_tokens": 4, "stop_token_ids": [END]}},
                {"text": "hi", "stream": True},
                {"input_ids": [3, 20, 2, 5], "routed_experts_start_len": 3}):
        body = request_params_for_generate(raw, routes=True)
        assert api_contract.generate_contract_error(body) is None, body
    assert api_contract.generate_contract_error({"input_ids": [1], "return_logprob": "yes"}) is not None


def test_routes_are_raw_int32_as_sglang_encodes_them():
    prompt, out = [3, 20, 21, 2, 5], [40, 41, 42]
    rows = route_rows(prompt + out, len(prompt)).astype(np.int32)
    import pybase64  # what the detokenizer encodes with (managers/detokenizer_manager.py)

    assert raw_routes(prompt, out, 2) == pybase64.b64encode(rows[2:].tobytes()).decode("utf-8")
    flat = np.frombuffer(base64.b64decode(raw_routes(prompt, out, 0)), dtype=np.int32)  # extract_routed_experts_...
    np.testing.assert_array_equal(flat, rows.reshape(-1))
    body = request_params_for_generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}}, routes=True)
    event = generation_from_generate(native_response(body, _state()), body, trajectory_id="t", seq=0,
                                     model_version=0, route_layout=(NUM_LAYERS, TOPK))
    assert event["routed_experts"]["shape"] == [len(prompt) + 3 - 1, NUM_LAYERS, TOPK]
    assert list(event["prompt_ids"]) == prompt and list(event["output_ids"]) != encode("x")
