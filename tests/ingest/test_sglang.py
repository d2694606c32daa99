"""The SGLang adapter on responses shaped as SGLang 0.5.23 sends them (tests/sglang_upstream.py)."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import numpy as np
import pytest

from openai_upstream import ASSISTANT, END, NUM_LAYERS, SYSTEM, TOPK, USER, encode, generate, route_rows
from sglang_upstream import native_response, native_stream, openai_response, openai_stream
from trajstore.events._wire import decode_array
from trajstore.errors import ValidationError
from trajstore.ingest.sglang import (
    GenerateStreamAccumulator,
    OpenAIStreamAccumulator,
    finish_reason_of,
    generation_from_generate,
    generations_from_openai,
    logprobs_from_sglang,
    request_params_for_generate,
    request_params_for_openai,
    route_layout,
    routed_experts_start_len_of,
    routes_from_sglang,
)
from trajstore.ingest.vllm import LOGPROB_FLOOR

LAYOUT = (NUM_LAYERS, TOPK)
PROMPT = [SYSTEM, *encode("be brief"), END, USER, *encode("hi"), END, ASSISTANT]


def _state(**kw):
    return SimpleNamespace(**{"weight_update": None, "missing_logprob": None, "incremental": False, **kw})


def _body(**kw):
    return request_params_for_generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6,
                                                                                 "stop_token_ids": [END]}, **kw},
                                       routes=True)


def _routes(ev):
    return decode_array(ev["routed_experts"], field="routed_experts", ndim=3)


def test_native_generate_becomes_one_event_with_everything():
    body = _body()
    ev = generation_from_generate(native_response(body, _state()), body, trajectory_id="t", seq=4, model_version=7,
                                  route_layout=LAYOUT)
    out, lps, _ = generate(PROMPT, 6, chat=True)
    assert list(ev["prompt_ids"]) == PROMPT and list(ev["output_ids"]) == out and out[-1] == END
    np.testing.assert_allclose(ev["logprobs"], lps, rtol=1e-6)
    assert ev["routed_experts"]["dtype"] == "int32" and ev["routed_experts"]["shape"] == [len(PROMPT + out) - 1,
                                                                                           NUM_LAYERS, TOPK]
    np.testing.assert_array_equal(_routes(ev), route_rows(PROMPT + out, len(PROMPT)))
    assert ev["finish_reason"] == "stop" and ev["metadata"] == {"stop_reason": END}
    assert ev["model_version"] == 7 and ev["seq"] == 4 and "routed_experts_start" not in ev
    assert ev["weight_versions"] == [{"version": "default", "start": 0, "end": len(out)}]


def test_routes_are_handed_over_as_the_raw_bytes():
    body = _body()
    resp = native_response(body, _state())
    ev = generation_from_generate(resp, body, trajectory_id="t", seq=0, model_version=0, route_layout="2x2")
    assert ev["routed_experts"]["b64"] is resp["meta_info"]["routed_experts"]  # no decode, no copy


def test_routed_experts_start_len_becomes_routed_experts_start():
    body = _body(routed_experts_start_len=5)
    ev = generation_from_generate(native_response(body, _state()), body, trajectory_id="t", seq=0, model_version=0,
                                  route_layout=LAYOUT)
    out = list(ev["output_ids"])
    assert ev["routed_experts_start"] == 5
    np.testing.assert_array_equal(_routes(ev), route_rows(PROMPT + out, len(PROMPT))[5:])


@pytest.mark.parametrize("layout, message", [
    ((NUM_LAYERS + 1, TOPK), "does not fit"),
    ((NUM_LAYERS * 2, TOPK), "does not fit"),   # divides the bytes, but not this call's rows
    (None, "without a shape"),
])
def test_a_layout_that_does_not_fit_is_refused_in_one_line(layout, message):
    body = _body()
    resp = native_response(body, _state())
    with pytest.raises(ValidationError, match=message) as e:
        generation_from_generate(resp, body, trajectory_id="t", seq=0, model_version=0, route_layout=layout)
    assert "\n" not in str(e.value) and e.value.rule == "route_layout"


def test_routes_of_unknown_row_count_must_be_whole_rows():
    raw = base64.b64encode(np.arange(10, dtype=np.int32).tobytes()).decode()
    with pytest.raises(ValidationError, match="not whole int32 rows"):
        routes_from_sglang(raw, (2, 2))
    assert routes_from_sglang(raw, (5, 1))["shape"] == [2, 5, 1]
    with pytest.raises(ValidationError, match="not base64"):
        routes_from_sglang("abc", (1, 1))


def test_route_layout_forms():
    assert route_layout("48x8") == route_layout("48,8") == route_layout((48, 8)) == route_layout(
        {"layers": 48, "topk": 8}) == (48, 8)
    assert route_layout(None) is None
    for bad in ("48", "0x8", "axb", (1, 2, 3), (True, 2), -1):
        with pytest.raises(ValidationError, match="LAYERSxTOPK"):
            route_layout(bad)


def test_null_logprobs_become_the_floor_and_token_ids_are_checked():
    lps = logprobs_from_sglang([[-0.5, 21, "a"], [None, 22, None]], np.asarray([21, 22]))
    np.testing.assert_array_equal(lps, np.asarray([-0.5, LOGPROB_FLOOR], dtype=np.float32))
    with pytest.raises(ValidationError, match="position 1 is for token 23"):
        logprobs_from_sglang([[-0.5, 21, "a"], [-1.0, 23, None]], np.asarray([21, 22]))
    with pytest.raises(ValidationError, match="2 entries but the call has 3"):
        logprobs_from_sglang([[-0.5, 21, "a"], [-1.0, 22, None]], np.asarray([21, 22, 23]))
    body = _body()
    ev = generation_from_generate(native_response(body, _state(missing_logprob=2)), body, trajectory_id="t", seq=0,
                                  model_version=0, route_layout=LAYOUT)
    assert ev["logprobs"][2] == LOGPROB_FLOOR and np.all(np.delete(ev["logprobs"], 2) > LOGPROB_FLOOR)


def test_finish_reasons():
    assert finish_reason_of({"type": "stop", "matched": "</s>"}) == ("stop", {"stop_reason": "</s>"})
    assert finish_reason_of({"type": "stop", "matched": [2, 3]}) == ("stop", {"stop_reason": [2, 3]})
    assert finish_reason_of({"type": "length", "length": 6}) == ("length", {})
    assert finish_reason_of({"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}) == (
        "abort", {"abort_message": "Aborted"})
    assert finish_reason_of(None) == (None, {})
    with pytest.raises(ValidationError, match="finish_reason"):
        finish_reason_of({"matched": 1})


def test_weight_update_spans_are_passed_as_sent():
    body = _body()
    resp = native_response(body, _state(weight_update=(2, "3", "step-4")))
    ev = generation_from_generate(resp, body, trajectory_id="t", seq=0, model_version=3, route_layout=LAYOUT)
    n = len(ev["output_ids"])
    assert ev["weight_versions"] == [{"version": "3", "start": 0, "end": 2}, {"version": "step-4", "start": 2, "end": n}]
    # the spans say every token's version: the declared one would have to be the last (SPEC "Versions")
    assert "model_version" not in ev
    ev = generation_from_generate(native_response(body, _state(weight_update=(2, "default", "step-4"))), body,
                                  trajectory_id="t", seq=0, model_version=3, route_layout=LAYOUT)
    assert ev["model_version"] == 3  # the "default" label's version


def test_a_single_weight_version_label_is_one_span():
    body = _body()
    resp = native_response(body, _state())
    del resp["meta_info"]["weight_versions"]
    resp["meta_info"]["weight_version"] = "9"
    ev = generation_from_generate(resp, body, trajectory_id="t", seq=0, model_version=3, route_layout=LAYOUT)
    assert ev["weight_versions"] == [{"version": "9", "start": 0, "end": len(ev["output_ids"])}]


def _same_event(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_native_streams_accumulate_to_the_plain_response(incremental):
    body = _body(routed_experts_start_len=3, return_prompt_token_ids=True)
    state = _state(weight_update=(3, "1", "2"), incremental=incremental)
    acc = GenerateStreamAccumulator()
    chunks = list(native_stream(body, state))
    assert len(chunks) == 6 and "routed_experts" in chunks[-1]["meta_info"]
    for chunk in chunks:
        acc.add(chunk)
    args = dict(trajectory_id="t", seq=0, model_version=0, route_layout=LAYOUT)
    _same_event(generation_from_generate(acc.response(), body, **args),
                generation_from_generate(native_response(body, state), body, **args))


def test_a_text_prompt_takes_the_returned_prompt_ids():
    body = request_params_for_generate({"text": "hi", "sampling_params": {"max_new_tokens": 3}}, routes=False)
    assert body["return_prompt_token_ids"] is True and body["return_logprob"] is True
    assert "return_routed_experts" not in body
    ev = generation_from_generate(native_response(body, _state()), body, trajectory_id="t", seq=0, model_version=0)
    assert list(ev["prompt_ids"]) == encode("hi") and ev["finish_reason"] == "length" and "routed_experts" not in ev
    with pytest.raises(ValidationError, match="return_prompt_token_ids"):
        generation_from_generate({"output_ids": [1], "meta_info": {}}, {"text": "x"}, trajectory_id="t", seq=0,
                                 model_version=0)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_openai_responses_give_the_native_event(chat):
    native_body = _body()
    native = generation_from_generate(native_response(native_body, _state(weight_update=(2, "3", "4"))), native_body,
                                      trajectory_id="t", seq=0, model_version=0, route_layout=LAYOUT)
    if chat:
        raw = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    else:
        raw = {"prompt": PROMPT, "max_tokens": 6}
    body = request_params_for_openai(raw, chat=chat, routes=True)
    (ev,) = generations_from_openai(openai_response(body, chat, _state(weight_update=(2, "3", "4"))), body,
                                    trajectory_id="t", seq=0, model_version=0, route_layout=LAYOUT)
    if chat:
        _same_event(ev, native)
    else:  # completions stop on length, the same tokens but the last (no END)
        assert list(ev["output_ids"]) == list(native["output_ids"])[:-1] + [ev["output_ids"][-1]]
        assert ev["finish_reason"] == "length" and ev["weight_versions"][0] == {"version": "3", "start": 0, "end": 2}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_openai_streams_carry_routes_but_no_versions(chat):
    raw = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": PROMPT, "max_tokens": 6})
    body = request_params_for_openai({**raw, "stream": True}, chat=chat, routes=True)
    state = _state(weight_update=(2, "3", "4"))
    acc = OpenAIStreamAccumulator()
    chunks = list(openai_stream(body, chat, state))
    assert chunks[-1]["choices"] == [] and "routed_experts" in chunks[-1]["sglext"]
    for chunk in chunks:
        acc.add(chunk)
    (ev,) = generations_from_openai(acc.response(), body, trajectory_id="t", seq=0, model_version=5,
                                    route_layout=LAYOUT)
    (plain,) = generations_from_openai(openai_response(body, chat, state), body, trajectory_id="t", seq=0,
                                       model_version=5, route_layout=LAYOUT)
    assert "weight_versions" not in ev and ev["model_version"] == 5  # the call's declared version
    del plain["weight_versions"]
    assert "model_version" not in plain  # its spans ("3", "4") said the versions
    _same_event(ev, {**plain, "model_version": 5})


def test_stream_errors_are_not_recorded():
    acc = GenerateStreamAccumulator()
    acc.add({"error": {"message": "boom", "type": "invalid_request_error", "code": 400}})
    with pytest.raises(ValidationError, match="boom"):
        acc.response()


def test_request_params():
    assert request_params_for_generate({"input_ids": [1], "return_logprob": False}, routes=True) == {
        "input_ids": [1], "return_logprob": False, "return_routed_experts": True}
    chat = request_params_for_openai({"messages": []}, chat=True, routes=False)
    assert chat == {"messages": [], "logprobs": True, "return_input_ids_in_sglext": True,
                    "return_output_ids_in_sglext": True}
    comp = request_params_for_openai({"prompt": "x", "return_routed_experts": False}, chat=False, routes=True)
    assert comp["return_token_ids"] is True and comp["logprobs"] == 0 and comp["return_routed_experts"] is False
    assert routed_experts_start_len_of({"routed_experts_start_len": 4}) == 4
    with pytest.raises(ValidationError, match="non-negative"):
        routed_experts_start_len_of({"routed_experts_start_len": -1})


@pytest.mark.parametrize("via", ["store", "json", "arrow"])
def test_the_writer_sends_sglang_events_as_they_are(store, via):
    """The docs' harness lines: an SGLang event put on a Writer, in process or through the ingest
    service (JSON or Arrow body), is stored with its raw int32 routes and spans."""
    from openai_upstream import serve_in_thread
    from trajstore.ingest.client import Writer
    from trajstore.ingest.service import make_app

    body = _body(routed_experts_start_len=0)
    event = generation_from_generate(native_response(body, _state(weight_update=(2, "3", "4"))), body,
                                     trajectory_id="w", seq=0, model_version=3, route_layout=LAYOUT)
    events = [{"type": "trajectory_started", "trajectory_id": "w"}, event,
              {"type": "trajectory_finished", "trajectory_id": "w", "status": "completed"}]
    if via == "store":
        with Writer(store) as writer:
            for e in events:
                writer.put(e)
    else:
        with serve_in_thread(make_app(store, token="t")) as url:
            with Writer(url, token="t", body=via) as writer:
                for e in events:
                    writer.put(e)
    (gen,) = store.load_generations("w")
    out = list(event["output_ids"])
    np.testing.assert_array_equal(gen.routed_experts, route_rows(PROMPT + out, len(PROMPT)))
    assert list(gen.token_model_versions) == [3, 3] + [4] * (len(out) - 2)


def _mutations():
    from hypothesis import strategies as st

    junk = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                     st.text(max_size=5), st.lists(st.integers(-3, 2**33), max_size=4),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    paths = st.sampled_from([("output_ids",), ("meta_info",), ("meta_info", "finish_reason"),
                             ("meta_info", "output_token_logprobs"), ("meta_info", "routed_experts"),
                             ("meta_info", "weight_versions"), ("meta_info", "weight_version"),
                             ("meta_info", "output_token_logprobs", 0), ("meta_info", "output_token_logprobs", 0, 1),
                             ("meta_info", "weight_versions", 0), ("output_ids", 0), ("prompt_token_ids",)])
    return st.lists(st.tuples(paths, st.one_of(junk, st.just("<delete>"))), min_size=1, max_size=3)


def _mutate(response, mutations):
    import copy

    out = copy.deepcopy(response)
    for path, value in mutations:
        node = out
        for key in path[:-1]:
            try:
                node = node[key]
            except (KeyError, IndexError, TypeError):
                break
        else:
            try:
                if value == "<delete>":
                    del node[path[-1]]
                else:
                    node[path[-1]] = value
            except (KeyError, IndexError, TypeError):
                pass
    return out


def test_any_mangled_answer_gives_a_valid_event_or_a_validation_error():
    """Whatever SGLang (or something in between) sends, the adapter returns an event the store's parser
    takes, or a one-line ValidationError: never another exception."""
    from hypothesis import given, settings

    from trajstore.events import parse_event

    body = _body(routed_experts_start_len=2)
    good = native_response(body, _state(weight_update=(2, "3", "4")))

    @settings(max_examples=300, deadline=None)
    @given(_mutations())
    def check(mutations):
        response = _mutate(good, mutations)
        try:
            event = generation_from_generate(response, body, trajectory_id="t", seq=0, model_version=3,
                                             route_layout=LAYOUT)
            parse_event(event)
        except ValidationError as e:
            assert "\n" not in str(e)

    check()


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_any_mangled_openai_answer_gives_a_valid_event_or_a_validation_error(chat):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from trajstore.events import parse_event

    raw = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": PROMPT, "max_tokens": 6}
    body = request_params_for_openai(raw, chat=chat, routes=True)
    good = openai_response(body, chat, _state(weight_update=(2, "3", "4")))
    junk = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                     st.text(max_size=5), st.lists(st.integers(-3, 2**33), max_size=4), st.just({}), st.just([{}]))
    paths = st.sampled_from([("choices",), ("choices", 0), ("choices", 0, "logprobs"), ("choices", 0, "token_ids"),
                             ("choices", 0, "prompt_token_ids"), ("choices", 0, "finish_reason"),
                             ("choices", 0, "matched_stop"), ("choices", 0, "index"),
                             ("choices", 0, "logprobs", "content"), ("choices", 0, "logprobs", "token_logprobs"),
                             ("sglext",), ("sglext", "routed_experts"), ("sglext", "input_ids"),
                             ("sglext", "output_ids"), ("sglext", "output_ids", 0), ("metadata",),
                             ("metadata", "weight_versions"), ("metadata", "weight_version")])

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.tuples(paths, st.one_of(junk, st.just("<delete>"))), min_size=1, max_size=3))
    def check(mutations):
        response = _mutate(good, mutations)
        try:
            for event in generations_from_openai(response, body, trajectory_id="t", seq=0, model_version=3,
                                                 route_layout=LAYOUT):
                parse_event(event)
        except ValidationError as e:
            assert "\n" not in str(e)

    check()


@pytest.mark.parametrize("kind", ["generate", "chat", "completions"])
def test_any_mangled_stream_gives_a_valid_event_or_a_validation_error(kind):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from trajstore.events import parse_event

    state = _state(weight_update=(2, "3", "4"))
    if kind == "generate":
        body = _body()
        chunks, acc_type = list(native_stream(body, state)), GenerateStreamAccumulator
        paths = [("output_ids",), ("meta_info",), ("meta_info", "completion_tokens"), ("meta_info", "finish_reason"),
                 ("meta_info", "output_token_logprobs"), ("meta_info", "output_token_logprobs_length"),
                 ("meta_info", "routed_experts"), ("meta_info", "weight_versions"), ("error",)]
    else:
        chat = kind == "chat"
        raw = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": PROMPT, "max_tokens": 6}
        body = request_params_for_openai({**raw, "stream": True}, chat=chat, routes=True)
        chunks, acc_type = list(openai_stream(body, chat, state)), OpenAIStreamAccumulator
        paths = [("choices",), ("choices", 0), ("choices", 0, "token_ids"), ("choices", 0, "logprobs"),
                 ("choices", 0, "logprobs", "content"), ("choices", 0, "logprobs", "token_logprobs"),
                 ("choices", 0, "finish_reason"), ("choices", 0, "index"), ("sglext",), ("sglext", "output_ids"),
                 ("sglext", "routed_experts"), ("object",)]
    junk = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**33), st.text(max_size=4),
                     st.lists(st.integers(-3, 2**33), max_size=3), st.just({}), st.just([{}]), st.just("<delete>"))

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, len(chunks) - 1), st.sampled_from(paths), junk), min_size=1, max_size=3))
    def check(mutations):
        mangled = [dict(c) for c in chunks]
        for i, path, value in mutations:
            mangled[i] = _mutate(mangled[i], [(path, value)])
        acc = acc_type()
        args = dict(trajectory_id="t", seq=0, model_version=3, route_layout=LAYOUT)
        try:
            for chunk in mangled:
                acc.add(chunk)
            response = acc.response()
            events = ([generation_from_generate(response, body, **args)] if kind == "generate"
                      else generations_from_openai(response, body, **args))
            for event in events:
                parse_event(event)
        except ValidationError as e:
            assert "\n" not in str(e)

    check()
