"""The vLLM adapters: offline CompletionOutput and OpenAI-server JSON shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from trajstore.errors import ValidationError
from trajstore.events import Generation, parse_event
from trajstore.ingest.vllm import (
    OpenAIStreamAccumulator,
    generation_from_output,
    generations_from_openai,
    logprobs_from_vllm,
    request_params_for_recording,
)
from trajstore._wire import encode_npy_b64

PROMPT = [11, 12, 13]
OUTPUT = [21, 22]
ROUTES = np.arange(4 * 2 * 3, dtype=np.int32).reshape(4, 2, 3) % 64  # [P+O-1, layers, topk]


@dataclass
class Logprob:  # the shape of vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # the shape of vllm.outputs.CompletionOutput
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: object
    routed_experts: np.ndarray | None = None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    prompt_token_ids: list
    outputs: list


@dataclass
class FlatLogprobs:  # the shape of vllm.logprobs.FlatLogprobs
    start_indices: list = field(default_factory=list)
    end_indices: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)


def _dict_logprobs():
    # top-2 per position; the sampled token is not always the most likely one
    return [{21: Logprob(-0.5), 99: Logprob(-1.0)}, {98: Logprob(-0.1), 22: Logprob(-2.5)}]


def test_completion_output_with_dict_logprobs_and_routes():
    out = CompletionOutput(0, "ab", OUTPUT, -3.0, _dict_logprobs(), ROUTES, "stop")
    ev = generation_from_output(out, PROMPT, trajectory_id="t", seq=0, model_version=3)
    np.testing.assert_allclose(ev["logprobs"], [-0.5, -2.5])
    assert ev["routed_experts"] is ROUTES or np.array_equal(ev["routed_experts"], ROUTES)
    assert isinstance(ev["routed_experts"], np.ndarray)
    parsed = parse_event(ev)
    assert isinstance(parsed, Generation)
    assert parsed.routed_experts.dtype == np.uint8 and parsed.routed_experts.shape == (4, 2, 3)
    assert parsed.finish_reason == "stop" and list(parsed.prompt_ids) == PROMPT


def test_request_output_supplies_prompt_ids():
    req = RequestOutput(PROMPT, [CompletionOutput(0, "", OUTPUT, None, [-0.25, -0.75])])
    ev = generation_from_output(req, None, trajectory_id="t", seq=2, model_version=1, reward=1.0)
    assert list(ev["prompt_ids"]) == PROMPT and ev["seq"] == 2 and ev["reward"] == 1.0
    np.testing.assert_allclose(ev["logprobs"], [-0.25, -0.75])
    assert "routed_experts" not in ev


def test_flat_logprobs_sampled_token_found_even_when_not_first():
    flat = FlatLogprobs([0, 2], [2, 4], [21, 5, 7, 22], [-0.1, -0.2, -0.3, -0.4])
    np.testing.assert_allclose(logprobs_from_vllm(flat, OUTPUT), [-0.1, -0.4])


def test_missing_sampled_token_is_a_clear_error():
    with pytest.raises(ValidationError, match="lacks the sampled token 22"):
        logprobs_from_vllm([{21: Logprob(-0.5)}, {98: Logprob(-0.1)}], OUTPUT)


def _completion_json(**choice_extra):
    choice = {
        "index": 0, "text": "ab", "finish_reason": "length", "stop_reason": None,
        "logprobs": {"text_offset": [0, 1], "token_logprobs": [-0.5, -2.5], "tokens": ["a", "b"], "top_logprobs": [None, None]},
        "token_ids": OUTPUT, "prompt_token_ids": PROMPT, "routed_experts": encode_npy_b64(ROUTES),
    }
    choice.update(choice_extra)
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [choice], "usage": {}}


def _chat_json(**choice_extra):
    choice = {
        "index": 0, "message": {"role": "assistant", "content": "ab"}, "finish_reason": "stop",
        "logprobs": {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": []}, {"token": "b", "logprob": -2.5, "top_logprobs": []}]},
        "token_ids": OUTPUT, "routed_experts": encode_npy_b64(ROUTES),
    }
    choice.update(choice_extra)
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": [choice], "prompt_token_ids": PROMPT}


@pytest.mark.parametrize("response", [_completion_json(), _chat_json()], ids=["completions", "chat"])
def test_openai_json_to_generation(response):
    (ev,) = generations_from_openai(response, trajectory_id="t", seq=4, model_version=7)
    assert ev["seq"] == 4 and ev["model_version"] == 7
    assert list(ev["prompt_ids"]) == PROMPT and list(ev["output_ids"]) == OUTPUT
    np.testing.assert_allclose(ev["logprobs"], [-0.5, -2.5])
    assert isinstance(ev["routed_experts"], np.ndarray)
    np.testing.assert_array_equal(ev["routed_experts"], ROUTES)
    parse_event(ev)


def test_token_ids_recovered_from_token_id_names():
    response = _chat_json(token_ids=None)
    for entry, tid in zip(response["choices"][0]["logprobs"]["content"], OUTPUT):
        entry["token"] = f"token_id:{tid}"
    (ev,) = generations_from_openai(response, trajectory_id="t", seq=0, model_version=0)
    assert list(ev["output_ids"]) == OUTPUT


def test_response_without_token_ids_says_what_to_request():
    with pytest.raises(ValidationError, match="return_token_ids"):
        generations_from_openai(_chat_json(token_ids=None), trajectory_id="t", seq=0, model_version=0)


def test_request_params_for_recording():
    chat = request_params_for_recording({"messages": [], "logprobs": False}, chat=True)
    assert chat["return_token_ids"] is True and chat["logprobs"] is True
    comp = request_params_for_recording({"prompt": "x"}, chat=False)
    assert comp["logprobs"] == 0 and comp["return_token_ids"] is True
    assert request_params_for_recording({"prompt": "x", "logprobs": 5}, chat=False)["logprobs"] == 5


def test_stream_accumulator_chat_and_completions():
    chat = OpenAIStreamAccumulator()
    chat.add({"object": "chat.completion.chunk", "prompt_token_ids": PROMPT, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    for tok, lp in zip(OUTPUT, [-0.5, -2.5]):
        chat.add({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [tok],
                                                                  "logprobs": {"content": [{"token": "x", "logprob": lp}]}}]})
    chat.add({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    (ev,) = generations_from_openai(chat.response(), trajectory_id="t", seq=0, model_version=0)
    assert list(ev["prompt_ids"]) == PROMPT and list(ev["output_ids"]) == OUTPUT and ev["finish_reason"] == "stop"
    np.testing.assert_allclose(ev["logprobs"], [-0.5, -2.5])

    comp = OpenAIStreamAccumulator()
    comp.add({"object": "text_completion", "choices": [{"index": 0, "text": "a", "prompt_token_ids": PROMPT, "token_ids": [21],
                                                        "logprobs": {"token_logprobs": [-0.5], "tokens": ["a"]}}]})
    comp.add({"object": "text_completion", "choices": [{"index": 0, "text": "b", "token_ids": [22], "finish_reason": "length",
                                                        "logprobs": {"token_logprobs": [-2.5], "tokens": ["b"]}}]})
    (ev,) = generations_from_openai(comp.response(), trajectory_id="t", seq=0, model_version=0)
    assert list(ev["prompt_ids"]) == PROMPT and list(ev["output_ids"]) == OUTPUT
    np.testing.assert_allclose(ev["logprobs"], [-0.5, -2.5])
