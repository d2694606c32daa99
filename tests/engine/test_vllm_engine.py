"""A real vLLM server behind ``trajstore proxy``: every call recorded as the engine answered it.

The engine is vLLM's CPU build (0.32.0) serving a tiny random Qwen3-MoE
(tests/engine/conftest.py). What 0.32's CPU build does not have is tested by
shape elsewhere: routed experts need Model Runner V2 (Triton), and its OpenAI
endpoints ignore ``return_weight_versions`` (0.33 returns spans there); its
``/inference/v1/generate`` returns spans on every call.

The engine is started once per module, the proxy and its store once per backend
(tests/engine/conftest.py): each test's trajectory ids are its own, and it reads back only those.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")

from tiny_model import FLOOR_TOKEN  # noqa: E402

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

GENERATE = "/inference/v1/generate"


@pytest.fixture(autouse=True)
def _running(engine):
    """Each test starts on an engine that is not paused (a paused vLLM queues new calls)."""
    assert httpx.post(f"{engine.url}/resume", timeout=60).status_code == 200


def _h(tid: str, version: int | None = None) -> dict:
    return {"X-Trajstore-Trajectory": tid, **({} if version is None else {"X-Trajstore-Model-Version": str(version)})}


def _recorded(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text[:500]
    assert "x-trajstore-error" not in resp.headers, resp.headers["x-trajstore-error"]
    return int(resp.headers["x-trajstore-seq"])


def _finish(proxy: str, tid: str) -> None:
    assert httpx.post(f"{proxy}/trajstore/finish", json={"trajectory_id": tid}).status_code == 200


def _sample(store, tid: str):
    store.materialize()
    samples = [s for s in store.samples() if s.trajectory_id == tid]
    assert len(samples) == 1, [s.sample_index for s in samples]
    return samples[0]


def _tito(proxy: str, tid: str, prompt: list[int], version: int | None = None, **params) -> dict:
    body = {"model": "tiny", "token_ids": prompt, "sampling_params": {"max_tokens": 8, "temperature": 0, **params}}
    resp = httpx.post(f"{proxy}{GENERATE}", json=body, headers=_h(tid, version), timeout=120)
    seq = _recorded(resp)
    return {"seq": seq, **resp.json()["choices"][0]}


def _completion(proxy: str, tid: str, prompt: list[int], version: int | None = None, **params) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, **params}
    resp = httpx.post(f"{proxy}/v1/completions", json=body, headers=_h(tid, version), timeout=120)
    seq = _recorded(resp)
    return {"seq": seq, **resp.json()["choices"][0]}


def _logprobs(choice: dict) -> list[float]:
    lp = choice["logprobs"]
    return [c["logprob"] for c in lp["content"]] if "content" in lp else lp["token_logprobs"]


def _episode(proxy: str, tid: str, call, version: int) -> tuple[list[int], list[dict], list[list[int]]]:
    """Three turns: each prompt = previous prompt + output + an observation; returns (first prompt, choices, observations)."""
    prompt = [11, 12, 13, 14]
    first, choices, observations = list(prompt), [], []
    for turn in range(3):
        choice = call(proxy, tid, prompt, version)
        assert choice["seq"] == turn and len(choice["token_ids"]) == 8
        choices.append(choice)
        observation = [20 + turn, 30 + turn]
        observations.append(observation)
        prompt = prompt + choice["token_ids"] + observation
    _finish(proxy, tid)
    return first, choices, observations[:-1]


@pytest.mark.parametrize("endpoint", ["generate", "completions"])
def test_a_multi_turn_episode_is_one_sample_equal_to_what_vllm_returned(engine, proxy, store, endpoint):
    engine.label("default")
    call = _tito if endpoint == "generate" else _completion
    tid = f"ep-{endpoint}"
    first, choices, observations = _episode(proxy, tid, call, version=4)
    sample = _sample(store, tid)
    response, mask, lps = [], [], []
    for i, choice in enumerate(choices):
        response += choice["token_ids"]
        mask += [1] * len(choice["token_ids"])
        lps += _logprobs(choice)
        if i < len(observations):
            response += observations[i]
            mask += [0] * len(observations[i])
            lps += [0.0] * len(observations[i])
    assert list(sample.prompt_ids) == first
    assert list(sample.response_ids) == response and list(sample.loss_mask) == mask
    np.testing.assert_array_equal(sample.rollout_logprobs, np.asarray(lps, dtype=np.float32))
    assert list(sample.logprobs_mask) == [bool(m) for m in mask]
    assert sample.finish_reason == choices[-1]["finish_reason"] == "length"
    # the engine's label is "default": every generated token has the call's declared version
    versions = np.asarray(sample.token_model_versions)
    assert set(versions[np.asarray(mask) == 1]) == {4} and set(versions[np.asarray(mask) == 0]) == {-1}
    gens = store.load_generations(tid)
    if endpoint == "generate":  # the token-in/token-out endpoint always sends spans: stored verbatim
        assert [g.weight_versions for g in gens] == [(("default", 0, 8),)] * 3
    for gen, choice in zip(gens, choices):
        assert list(gen.output_ids) == choice["token_ids"]


def test_completions_ask_for_weight_versions(engine, proxy, store):
    """The proxy asks /v1/completions for spans (``return_weight_versions``, vLLM 0.33); this
    0.32 server accepts the field and sends none, so the call's declared version holds."""
    engine.label("step-1")
    choice = _completion(proxy, "c", [11, 12, 13], version=6)
    assert "weight_versions" not in choice or choice["weight_versions"] is None
    (gen,) = store.load_generations("c")
    assert gen.weight_versions is None and gen.model_version == 6


def test_decimal_and_mapped_labels_and_a_label_mapped_after_the_calls(engine, proxy, store):
    engine.label("17")
    _tito(proxy, "decimal", [11, 12, 13])
    store.append([{"type": "version_label", "label": "step-42", "model_version": 42}])
    engine.label("step-42")
    _tito(proxy, "mapped-before", [11, 12, 13])
    engine.label("step-43")  # mapped only after the calls: the trajectory waits for it
    _tito(proxy, "mapped-after", [11, 12, 13])
    for tid in ("decimal", "mapped-before", "mapped-after"):
        _finish(proxy, tid)
    store.materialize()
    done = {s.trajectory_id: s for s in store.samples()
            if s.trajectory_id in ("decimal", "mapped-before", "mapped-after")}
    assert set(done) == {"decimal", "mapped-before"}  # held back, not dropped
    assert set(done["decimal"].token_model_versions) == {17}
    assert set(done["mapped-before"].token_model_versions) == {42}
    (held,) = store.load_generations("mapped-after")
    assert held.weight_versions == (("step-43", 0, 8),)
    store.append([{"type": "version_label", "label": "step-43", "model_version": 43}])
    assert set(_sample(store, "mapped-after").token_model_versions) == {43}


def _stream_generate(proxy: str, tid: str, prompt: list[int], max_tokens: int, on_tokens, headers: dict | None = None):
    """Stream a generate call through the proxy; ``on_tokens(n)`` after each chunk; returns (choice, raw lines)."""
    body = {"model": "tiny", "token_ids": prompt, "stream": True,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}
    tokens, final, lines = [], {}, []
    with httpx.stream("POST", f"{proxy}{GENERATE}", json=body, headers={**_h(tid), **(headers or {})}, timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            lines.append(line)
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                choice = json.loads(line[5:])["choices"][0]
                tokens += choice.get("token_ids") or []
                final.update({k: v for k, v in choice.items() if v is not None})
                on_tokens(len(tokens))
    final["token_ids"] = tokens
    return final, lines


# The label change and the pause race vLLM's engine core, which on a loaded machine can finish a whole
# generation before a control call sent at the harness's first streamed token lands (docs/vllm.md,
# "Control calls and the proxy's CPU"). What the proxy controls does not depend on who wins: the
# record equals what vLLM reports either way, the label is mapped as the engine takes it, and the
# change lands for the engine's next tokens. Each test asserts that for the outcome vLLM reports,
# and tries a few generations so that the mid-generation case is the one usually checked.
_TRIES = 3


def _spans_as_versions(spans: list[dict], labels: dict[str, int]) -> np.ndarray:
    assert spans[0]["start"] == 0 and all(a["end"] == b["start"] for a, b in zip(spans, spans[1:])), spans
    return np.repeat([labels[s["version"]] for s in spans], [s["end"] - s["start"] for s in spans])


def test_a_label_changed_during_a_generation_is_recorded_as_vllm_reports_it(engine, proxy, store):
    """An in-flight weight update: the trainer freezes the running call at the engine (``/pause?mode=keep``
    straight to vLLM, as docs/vllm.md advises for control calls), changes the label through the proxy
    (what the proxy does: relay the change, map its label from ``X-Trajstore-Model-Version``), and
    resumes. vLLM reports whether the change landed before the generation's end (two spans) or after
    it (one span); the record holds vLLM's spans, the per-token versions follow them, and the engine's
    next call runs under the new, mapped label."""
    changed: list[threading.Thread] = []
    failed: list[BaseException] = []
    relabelled: list[httpx.Response] = []

    def change() -> None:
        try:
            assert httpx.post(f"{engine.url}/pause?mode=keep", timeout=60).json() == {"status": "paused"}
            relabelled.append(httpx.post(f"{proxy}/update_weight_version", json={"new_version": "step-21"},
                                         headers={"X-Trajstore-Model-Version": "21"}, timeout=120))
        except BaseException as e:  # reported below, not lost in the thread
            failed.append(e)
        finally:
            httpx.post(f"{engine.url}/resume", timeout=60)

    def on_tokens(n):  # the trainer, from its own thread, while the harness reads on
        if n >= 1 and not changed:
            changed.append(threading.Thread(target=change))
            changed[-1].start()

    for attempt in range(_TRIES):
        tid = f"mid{attempt}"
        engine.label("20")
        changed.clear()
        relabelled.clear()
        choice, lines = _stream_generate(proxy, tid, [11, 12, 13], 4000, on_tokens)
        for thread in changed:  # its calls are done before anything else is asserted
            thread.join(180)
        assert not failed, failed
        (resp,) = relabelled
        assert resp.status_code == 200 and resp.headers["x-trajstore-label"] == "step-21=21", resp.text
        assert [line for line in lines if line][-1] == ": X-Trajstore-Seq: 0"
        _finish(proxy, tid)
        spans = choice["weight_versions"]
        # as vLLM reports it: the change landed before the generation's end, or the generation ended first
        assert [s["version"] for s in spans] in (["20"], ["20", "step-21"]), spans
        assert spans[-1]["end"] == 4000 and all(s["end"] > s["start"] for s in spans), spans
        (gen,) = store.load_generations(tid)
        assert gen.weight_versions == tuple((s["version"], s["start"], s["end"]) for s in spans)
        np.testing.assert_array_equal(_sample(store, tid).token_model_versions,
                                      _spans_as_versions(spans, {"20": 20, "step-21": 21}))
        # the change landed at the engine, mapped by the proxy: the next call runs under it
        after = _tito(proxy, f"after{attempt}", [11, 12, 13])
        assert after["weight_versions"] == [{"version": "step-21", "start": 0, "end": 8}]
        _finish(proxy, f"after{attempt}")
        assert set(_sample(store, f"after{attempt}").token_model_versions) == {21}
        if len(spans) > 1:
            break


def test_pause_abort_then_resume_under_new_weights_is_one_sample(engine, proxy, store):
    """Interruptible trajectories finished by a newer policy (fully-async RL): pause with
    abort through the proxy while a long generation streams, move the label, resume, and
    let the harness continue from prompt + partial output. vLLM reports whether the abort found
    the generation running (``abort``, a partial output) or finished (``length``, all of it);
    either way the continuation under the new label makes one sample, versions old then new."""
    paused: list[threading.Thread] = []
    failed: list[BaseException] = []

    def pause() -> None:  # the running call is frozen first (mode=keep): the abort finds it unfinished
        try:
            assert httpx.post(f"{proxy}/pause?mode=keep", timeout=60).json() == {"status": "paused"}
            assert httpx.post(f"{proxy}/pause?mode=abort", timeout=60).json() == {"status": "paused"}
        except BaseException as e:  # reported below, not lost in the thread
            failed.append(e)

    def on_tokens(n):  # the trainer pauses from its own thread while the harness reads on
        if n >= 1 and not paused:
            paused.append(threading.Thread(target=pause))
            paused[-1].start()

    prompt = [11, 12, 13]
    for attempt in range(_TRIES):
        tid = f"async{attempt}"
        engine.label("30")
        httpx.post(f"{proxy}/resume", timeout=60)
        paused.clear()
        # long (8,000 tokens of an 8,192 context) so that the abort usually finds it running
        partial, _ = _stream_generate(proxy, tid, prompt, 8000, on_tokens)
        for thread in paused:  # the pause has landed before the label moves
            thread.join(60)
        assert not failed, failed
        n = len(partial["token_ids"])
        assert (partial["finish_reason"] == "abort" and 1 <= n < 8000) or \
            (partial["finish_reason"] == "length" and n == 8000), (partial["finish_reason"], n)
        assert httpx.get(f"{proxy}/is_paused").json() == {"is_paused": True}
        assert httpx.post(f"{proxy}/update_weight_version", json={"new_version": "31"}).status_code == 200
        assert httpx.post(f"{proxy}/resume").json() == {"status": "resumed"}
        rest = _tito(proxy, tid, prompt + partial["token_ids"], max_tokens=16)
        assert rest["seq"] == 1 and rest["weight_versions"] == [{"version": "31", "start": 0, "end": 16}]
        _finish(proxy, tid)
        sample = _sample(store, tid)
        assert list(sample.prompt_ids) == prompt
        assert list(sample.response_ids) == partial["token_ids"] + rest["token_ids"]
        assert list(sample.loss_mask) == [1] * (n + 16)
        np.testing.assert_array_equal(sample.token_model_versions, [30] * n + [31] * 16)
        assert (sample.min_model_version, sample.max_model_version) == (30, 31)
        from sqlalchemy import text

        with store.log.read_engine.connect() as conn:
            rows = conn.execute(text("SELECT seq, finish_reason FROM events WHERE trajectory_id = :t "
                                     "AND type = 'generation' ORDER BY seq"), {"t": tid}).all()
        assert [tuple(r) for r in rows] == [(0, partial["finish_reason"]), (1, "length")]
        if partial["finish_reason"] == "abort":
            break


@pytest.mark.parametrize("endpoint", ["generate", "completions"])
def test_vllms_floor_logprob_is_stored_as_missing_and_counted(engine, proxy, store, endpoint):
    """The tiny model gives FLOOR_TOKEN a logit near -16,000; forced with allowed_token_ids,
    vLLM reports its logprob as -9999.0 (its floor): not a logprob."""
    engine.label("default")
    call = _tito if endpoint == "generate" else _completion
    tid = f"floor-{endpoint}"
    free = call(proxy, tid, [11, 12, 13], 2, max_tokens=3)
    forced = call(proxy, tid, [11, 12, 13] + free["token_ids"], 2, max_tokens=3, allowed_token_ids=[FLOOR_TOKEN])
    assert forced["token_ids"] == [FLOOR_TOKEN] * 3 and _logprobs(forced) == [-9999.0] * 3
    _finish(proxy, tid)
    sample = _sample(store, tid)
    assert list(sample.logprobs_mask) == [True] * 3 + [False] * 3
    np.testing.assert_array_equal(sample.rollout_logprobs[3:], 0.0)
    np.testing.assert_array_equal(sample.rollout_logprobs[:3], np.asarray(_logprobs(free), dtype=np.float32))
    from sqlalchemy import text

    with store.log.read_engine.connect() as conn:
        counted = conn.execute(text("SELECT seq, num_placeholder_logprobs FROM events WHERE trajectory_id = :t "
                                    "AND type = 'generation' ORDER BY seq"), {"t": tid}).all()
    assert [tuple(r) for r in counted] == [(0, 0), (1, 3)]
