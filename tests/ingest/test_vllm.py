"""The vLLM adapters: offline CompletionOutput and OpenAI-server JSON shapes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from trajstore.errors import ValidationError
from trajstore.events import Generation, parse_event
from trajstore.ingest.vllm import (
    LOGPROB_FLOOR,
    OpenAIStreamAccumulator,
    generation_from_output,
    generations_from_openai,
    generations_from_tito,
    logprobs_from_vllm,
    request_params_for_recording,
    request_params_for_tito,
    routed_experts_prompt_start_of,
)
from trajstore.events._wire import encode_npy_b64

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


# --- weight versions, skipped route rows, clamped logprobs, stop reasons (issue 11) ---

@dataclass
class WeightVersionSpan:  # one entry of CompletionOutput.weight_versions
    version: str
    start: int
    end: int


@dataclass
class VersionedOutput(CompletionOutput):  # CompletionOutput with the in-flight-update fields
    stop_reason: int | str | None = None
    weight_versions: list | None = None


OUT5 = [21, 22, 23, 24, 25]


def test_weight_version_spans_are_sent_as_the_engine_gave_them():
    """SPEC "Versions": the spans go on the wire verbatim; the store resolves the labels."""
    spans = [WeightVersionSpan("7", 0, 2), WeightVersionSpan("default", 2, 5)]
    out = VersionedOutput(0, "", OUT5, None, [-0.1] * 5, None, "stop", weight_versions=spans)
    ev = generation_from_output(out, PROMPT, trajectory_id="t", seq=0, model_version=9)
    assert ev["weight_versions"] == [{"version": "7", "start": 0, "end": 2}, {"version": "default", "start": 2, "end": 5}]
    assert "token_model_versions" not in ev and ev["model_version"] == 9  # "default" is the call's declared version
    assert "metadata" not in ev and "routed_experts_start" not in ev
    assert parse_event(ev).weight_versions == (("7", 0, 2), ("default", 2, 5))


def test_a_version_map_still_works_and_is_deprecated():
    spans = [{"version": "policy-a", "start": 0, "end": 3}, {"version": "policy-b", "start": 3, "end": 5}]
    out = VersionedOutput(0, "", OUT5, None, None, weight_versions=spans)
    with pytest.warns(DeprecationWarning, match="version_label"):
        ev = generation_from_output(out, PROMPT, trajectory_id="t", seq=0, model_version=0,
                                    version_map={"policy-a": 11, "policy-b": 12})
    assert list(ev["token_model_versions"]) == [11, 11, 11, 12, 12] and ev["model_version"] == 12
    assert ev["weight_versions"] == spans
    with pytest.warns(DeprecationWarning):
        ev = generation_from_output(out, PROMPT, trajectory_id="t", seq=0, model_version=0,
                                    version_map=lambda label: {"policy-a": 1, "policy-b": 2}[label])
    assert list(ev["token_model_versions"]) == [1, 1, 1, 2, 2]
    with pytest.warns(DeprecationWarning):  # a label the map lacks: left to the store's label map
        ev = generation_from_output(out, PROMPT, trajectory_id="t", seq=0, model_version=0, version_map={"policy-a": 1})
    assert "token_model_versions" not in ev and ev["weight_versions"] == spans


@pytest.mark.parametrize("spans, match", [
    ([("-1", 0, 5)], "not a model version"),
    ([("3", 0, 2), ("4", 3, 5)], "must tile the output"),
    ([("3", 0, 2), ("4", 2, 4)], "cover 4 output tokens but output_ids has 5"),
    ([("3", 1, 5)], "must tile the output"),
    ([(None, 0, 5)], "must be a string or an integer"),
    ([(["3"], 0, 5)], "must be a string or an integer"),
    ([("3", "0", 5)], "start must be an integer"),
], ids=["negative", "gap", "short", "late-start", "no-version", "unhashable", "string-start"])
def test_unusable_weight_versions_are_refused_by_the_store_never_guessed(spans, match):
    out = VersionedOutput(0, "", OUT5, None, None, weight_versions=spans)
    ev = generation_from_output(out, PROMPT, trajectory_id="t", seq=0, model_version=0)
    with pytest.raises(ValidationError, match=match) as info:
        parse_event(ev)
    assert info.value.rule == "weight_versions"


def test_spans_that_are_not_a_list_are_refused_by_the_adapter():
    out = VersionedOutput(0, "", OUT5, None, None, weight_versions="7")
    with pytest.raises(ValidationError, match="must be a list of spans"):
        generation_from_output(out, PROMPT, trajectory_id="t", seq=0, model_version=0)


def test_no_spans_means_every_token_has_the_callers_model_version():
    for spans in (None, []):
        out = VersionedOutput(0, "", OUT5, None, None, weight_versions=spans)
        ev = generation_from_output(out, PROMPT, trajectory_id="t", seq=0, model_version=4)
        assert "token_model_versions" not in ev and ev["model_version"] == 4


def test_non_finite_logprobs_get_vllms_floor():
    lps = [{21: Logprob(-0.5)}, {22: Logprob(float("-inf"))}, {23: Logprob(float("nan"))}, {24: Logprob(-1.0)},
           {25: Logprob(-0.25)}]
    out = VersionedOutput(0, "", OUT5, None, lps, None, "length", stop_reason=None)
    ev = generation_from_output(out, PROMPT, trajectory_id="t", seq=0, model_version=1, metadata={"tool": "search"})
    np.testing.assert_array_equal(ev["logprobs"], np.asarray([-0.5, LOGPROB_FLOOR, LOGPROB_FLOOR, -1.0, -0.25], np.float32))
    assert ev["metadata"] == {"tool": "search"}  # the store counts what is at the floor
    assert LOGPROB_FLOOR == -9999.0
    parse_event(ev)  # finite now: the store's non-finite rule no longer refuses the whole batch
    bad = dict(ev, logprobs=[-0.5, float("-inf"), -1.0, -1.0, -1.0])
    with pytest.raises(ValidationError):
        parse_event(bad)  # sent directly, non-finite values are still refused


def test_stop_reason_goes_in_metadata_and_finish_reason_is_kept():
    out = VersionedOutput(0, "", OUT5, None, None, None, "stop", stop_reason=2)
    ev = generation_from_output(out, PROMPT, trajectory_id="t", seq=0, model_version=1)
    assert ev["finish_reason"] == "stop" and ev["metadata"] == {"stop_reason": 2}


def test_routed_experts_prompt_start_is_carried_as_routed_experts_start():
    # 3 prompt + 5 output tokens -> rows for positions 0..6; asked from position 2: rows 2..6
    rows = np.arange(7 * 2 * 3, dtype=np.uint8).reshape(7, 2, 3)[2:]
    out = VersionedOutput(0, "", OUT5, None, None, rows, "stop")
    ev = generation_from_output(out, PROMPT, trajectory_id="t", seq=0, model_version=1, routed_experts_prompt_start=2)
    assert ev["routed_experts_start"] == 2 and len(ev["routed_experts"]) == 5
    parsed = parse_event(ev)
    assert parsed.routed_experts_start == 2 and parsed.routed_experts.shape == (5, 2, 3)


def test_openai_json_choice_with_versions_nan_logprobs_and_skipped_rows():
    import json

    rows = ROUTES[1:]  # the request set routed_experts_prompt_start = 1
    body = _completion_json(routed_experts=encode_npy_b64(rows), stop_reason="</s>",
                            weight_versions=[{"version": "5", "start": 0, "end": 1}, {"version": "6", "start": 1, "end": 2}])
    body["choices"][0]["logprobs"]["token_logprobs"] = [float("nan"), -2.5]
    response = json.loads(json.dumps(body))  # NaN survives as JSON's NaN token
    (ev,) = generations_from_openai(response, trajectory_id="t", seq=0, model_version=0, routed_experts_prompt_start=1)
    assert ev["weight_versions"] == [{"version": "5", "start": 0, "end": 1}, {"version": "6", "start": 1, "end": 2}]
    np.testing.assert_array_equal(ev["logprobs"], np.asarray([LOGPROB_FLOOR, -2.5], np.float32))
    assert ev["metadata"] == {"stop_reason": "</s>"}
    assert ev["routed_experts_start"] == 1 and ev["finish_reason"] == "length"
    np.testing.assert_array_equal(ev["routed_experts"], rows)
    assert parse_event(ev).routed_experts_start == 1


def _tito_response(**choice_extra):
    choice = {"index": 0, "token_ids": OUTPUT, "finish_reason": "stop", "stop_reason": None,
              "logprobs": {"content": [{"token": "a", "logprob": -0.5, "bytes": None, "top_logprobs": []},
                                       {"token": "b", "logprob": -2.5, "bytes": None, "top_logprobs": []}]},
              "routed_experts": encode_npy_b64(ROUTES)}
    choice.update(choice_extra)
    return {"request_id": "r1", "model": "m", "created": 0, "choices": [choice], "usage": None, "prompt_logprobs": None}


def test_tito_response_to_generation():
    request = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "logprobs": 0}}
    spans = [{"version": "9", "start": 0, "end": 2}]
    (ev,) = generations_from_tito(_tito_response(weight_versions=spans), request, trajectory_id="t", seq=3, model_version=0)
    assert ev["seq"] == 3 and list(ev["prompt_ids"]) == PROMPT and list(ev["output_ids"]) == OUTPUT
    np.testing.assert_allclose(ev["logprobs"], [-0.5, -2.5])
    np.testing.assert_array_equal(ev["routed_experts"], ROUTES)
    # the spans say the version: the declared one goes only with a "default" span (SPEC "Versions")
    assert ev["weight_versions"] == spans and "model_version" not in ev
    assert ev["finish_reason"] == "stop" and "routed_experts_start" not in ev and "metadata" not in ev
    parse_event(ev)


def test_tito_request_with_prompt_start_and_params():
    request = request_params_for_tito({"token_ids": PROMPT, "sampling_params": {"routed_experts_prompt_start": 2}})
    assert request["sampling_params"] == {"routed_experts_prompt_start": 2, "logprobs": 0}
    assert routed_experts_prompt_start_of(request) == 2
    assert request_params_for_tito({"token_ids": PROMPT, "sampling_params": {"logprobs": 3}})["sampling_params"]["logprobs"] == 3
    assert routed_experts_prompt_start_of({"prompt": "x", "routed_experts_prompt_start": 4}) == 4  # OpenAI endpoints: top level
    with pytest.raises(ValidationError, match="non-negative"):
        routed_experts_prompt_start_of({"sampling_params": {"routed_experts_prompt_start": -1}})
    (ev,) = generations_from_tito(_tito_response(routed_experts=encode_npy_b64(ROUTES[2:])), request,
                                  trajectory_id="t", seq=0, model_version=1)
    assert ev["routed_experts_start"] == 2 and len(ev["routed_experts"]) == 2
    assert parse_event(ev).routed_experts_start == 2


def test_tito_stream_routes_and_spans_on_the_final_chunk():
    acc = OpenAIStreamAccumulator()
    for i, (tok, lp) in enumerate(zip(OUTPUT, [-0.5, float("-inf")])):
        choice = {"index": 0, "token_ids": [tok], "finish_reason": None,
                  "logprobs": {"content": [{"token": f"token_id:{tok}", "logprob": lp}]}}
        if i == len(OUTPUT) - 1:
            choice.update(finish_reason="length", routed_experts=encode_npy_b64(ROUTES),
                          weight_versions=[{"version": 4, "start": 0, "end": 1}, {"version": 5, "start": 1, "end": 2}])
        acc.add({"request_id": "r", "choices": [choice]})
    (ev,) = generations_from_tito(acc.response(), {"token_ids": PROMPT}, trajectory_id="t", seq=0, model_version=0)
    assert list(ev["output_ids"]) == OUTPUT and ev["finish_reason"] == "length"
    np.testing.assert_array_equal(ev["logprobs"], np.asarray([-0.5, LOGPROB_FLOOR], np.float32))
    np.testing.assert_array_equal(ev["routed_experts"], ROUTES)
    assert ev["weight_versions"] == [{"version": 4, "start": 0, "end": 1}, {"version": 5, "start": 1, "end": 2}]
    assert "metadata" not in ev


def test_skipping_prompt_rows_stores_the_same_sample_as_sending_all(store):
    """End to end through the store (works today): a second call that asks the
    engine for rows past what the first recorded gives the sample that sending
    every row gives."""
    prompt2 = PROMPT + OUT5 + [31, 32]
    full1 = (np.arange(7 * 2 * 3).reshape(7, 2, 3) % 16).astype(np.uint8)
    full2 = ((np.arange(11 * 2 * 3).reshape(11, 2, 3) * 7) % 16).astype(np.uint8)
    for tid, start in (("all", 0), ("skip", 7)):
        first = VersionedOutput(0, "", OUT5, None, [-0.5, float("-inf"), -0.1, -0.1, -0.1], full1, "stop")
        second = VersionedOutput(0, "", [41, 42], None, [-0.2, -0.3], full2[start:], "length")
        store.append([
            {"type": "trajectory_started", "trajectory_id": tid, "num_experts": 16},
            generation_from_output(first, PROMPT, trajectory_id=tid, seq=0, model_version=1),
            generation_from_output(second, prompt2, trajectory_id=tid, seq=1, model_version=1,
                                   routed_experts_prompt_start=start),
            {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"},
        ])
    store.materialize()
    samples = {s.trajectory_id: s for s in store.samples()}
    a, b = samples["all"], samples["skip"]
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "token_model_versions",
                 "routed_experts", "routed_experts_mask"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert np.asarray(a.rollout_logprobs)[1] == 0.0 and not a.logprobs_mask[1]  # the floor is no logprob


def test_adapter_events_end_to_end_versions(store):
    """Needs the capture branch (token_model_versions, generation metadata, Sample.finish_reason):
    what the adapters produce reaches the stored generation and the sample."""
    spans = [WeightVersionSpan("7", 0, 2), WeightVersionSpan("8", 2, 5)]
    lps = [-0.5, float("-inf"), -0.1, -0.1, -0.1]
    out = VersionedOutput(0, "", OUT5, None, lps, None, "length", stop_reason=None, weight_versions=spans)
    store.append([
        {"type": "trajectory_started", "trajectory_id": "v"},
        generation_from_output(out, PROMPT, trajectory_id="v", seq=0, model_version=0),
        {"type": "trajectory_finished", "trajectory_id": "v", "status": "completed"},
    ])
    (gen,) = store.load_generations("v")
    assert list(gen.token_model_versions) == [7, 7, 8, 8, 8] and gen.model_version == 8
    assert gen.metadata is None and gen.finish_reason == "length"
    assert gen.weight_versions == (("7", 0, 2), ("8", 2, 5))  # as the engine sent them
    store.materialize()
    (sample,) = list(store.samples())
    assert list(sample.token_model_versions) == [7, 7, 8, 8, 8]
    assert (sample.min_model_version, sample.max_model_version) == (7, 8)
    assert sample.finish_reason == "length"
    assert np.asarray(sample.rollout_logprobs)[1] == 0.0  # -inf -> vLLM's floor -> missing (SPEC)
    assert list(sample.logprobs_mask) == [True, False, True, True, True]
