"""The recording proxy against a fuzzed upstream: mutated JSON and SSE answers
from a real loopback server (tests/raw_upstream.py), on both store backends.

Each case is one named call (completions, chat or token-in/token-out; plain
or streamed) whose answer is a valid vLLM answer for the request, then
mutated: structure-aware (a key dropped, a value replaced by another type,
a list cut or doubled, a chunk dropped or repeated, the finish reason or
``[DONE]`` removed) and byte-level (cut at a random offset, a byte flipped),
sent with a random framing (Content-Length, chunked, chunked and cut, close-
delimited) and sometimes an error status. What must hold for every case:

* the proxy never answers its own 500, and never breaks the harness's
  response: the harness gets the upstream's status and bytes, or a 502
  with a JSON error when the upstream's body broke off;
* the record is whole or absent: a call is recorded (``X-Trajstore-Seq``,
  or the stream's ``: X-Trajstore-Seq`` comment) only when the answer was
  complete and readable, and then the stored generation holds every output
  token the upstream sent; otherwise nothing is stored for the trajectory
  and the harness is told (``X-Trajstore-Error`` / an SSE error event or
  comment / ``X-Trajstore-Unrecorded`` for an error status).

The first test runs the proxy with ``pass_through_unrecorded`` (every
answer's bytes reach the harness as sent); the second with the default, where
a call that cannot be recorded is the harness's error: an error status, or an
error event before the stream's ``[DONE]``, the upstream's bytes otherwise
unchanged.

``$TRAJSTORE_PROXY_FUZZ_CASES`` sets the number of cases per backend
(default 300, and half as many through the fail-closed proxy; the documented run uses 10,000).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from openai_upstream import respond, serve_in_thread, stream_chunks, tito_respond, tito_stream_chunks  # noqa: E402
from raw_upstream import FRAMINGS, SSE_DONE, RawUpstream, framed  # noqa: E402
from trajstore.ingest.proxy import make_proxy_app  # noqa: E402

CASES = int(os.environ.get("TRAJSTORE_PROXY_FUZZ_CASES", "300"))
SEED = int(os.environ.get("TRAJSTORE_PROXY_FUZZ_SEED", "20261125"))
CLIENTS = 4

_ODD_VALUES = [None, 0, -1, 1.5, 2**70, "", "x", "token_id:abc", True, [], [1, "a"], [[1]], {}, {"a": 1},
               float("nan"), -9999.0, "\udcff"]


# --- structure-aware mutation --------------------------------------------------------------

def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:4]):
            yield from _paths(v, prefix + (i,))


def _mutate_json(obj, rng: random.Random):
    obj = copy.deepcopy(obj)
    for _ in range(rng.randint(1, 3)):
        paths = [p for p in _paths(obj) if p]
        if not paths:
            return copy.deepcopy(rng.choice(_ODD_VALUES))
        path = rng.choice(paths)
        parent = obj
        for key in path[:-1]:
            parent = parent[key]
        key = path[-1]
        op = rng.randrange(6)
        if op == 0 and isinstance(parent, dict):
            del parent[key]
        elif op == 1 and isinstance(parent[key], list) and parent[key]:
            parent[key] = parent[key][: rng.randrange(len(parent[key]))]
        elif op == 2 and isinstance(parent[key], list):
            parent[key] = parent[key] + parent[key][:1]
        elif op == 3 and isinstance(parent[key], int) and not isinstance(parent[key], bool):
            parent[key] = rng.choice([float(parent[key]), -parent[key] - 1, str(parent[key]), parent[key] + 2**40])
        elif op == 4:
            parent[key] = [parent[key]]
        else:
            parent[key] = copy.deepcopy(rng.choice(_ODD_VALUES))  # not shared: a later mutation in place
    return obj


def _dumps(obj) -> bytes:
    return json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")


def _loads(data: bytes):
    try:
        return json.loads(data)
    except ValueError:
        return None


def _mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    if not data:
        return data
    i = rng.randrange(len(data))
    if rng.random() < 0.5:
        return data[:i]
    return data[:i] + bytes([rng.randrange(256)]) + data[i + 1:]


class Case:
    """One fuzz case: the request the harness sends and the bytes the upstream answers."""

    def __init__(self, index: int, rng: random.Random) -> None:
        self.tid = f"fz-{index}"
        self.kind = rng.choice(["completions", "chat", "tito"])
        self.stream = rng.random() < 0.5
        self.framing = rng.choice(FRAMINGS) if rng.random() < 0.5 else ("length" if not self.stream else "chunked")
        self.status = 200 if rng.random() < 0.9 else rng.choice([400, 500, 503])
        self.mutate = rng.random() < 0.85
        self.seed = rng.random()  # answer() draws from its own generator: a re-sent request gets the same bytes
        if self.kind == "tito":
            self.path = "/inference/v1/generate"
            self.body = {"token_ids": [3, 20 + index % 50, 21, 2, 5], "sampling_params": {"max_tokens": 1 + index % 6}}
        elif self.kind == "chat":
            self.path = "/v1/chat/completions"
            self.body = {"model": "m", "messages": [{"role": "user", "content": f"hi {index}"}], "max_tokens": 2 + index % 5}
        else:
            self.path = "/v1/completions"
            self.body = {"model": "m", "prompt": [10, 20 + index % 50, 30], "max_tokens": 1 + index % 6}
        if self.stream:
            self.body["stream"] = True
        self.body["fuzz_case"] = index
        self.sent: bytes = b""  # the body bytes the upstream wrote
        self.complete = True  # whether the framing delivered the whole body

    def answer(self, request: dict) -> list[bytes]:
        rng = random.Random(self.seed)
        if self.stream:
            if self.kind == "tito":
                chunks = list(tito_stream_chunks(request))
            else:
                chunks = list(stream_chunks(request, chat=self.kind == "chat"))
            pieces = [_dumps(c) for c in chunks]
            if self.mutate:
                for _ in range(rng.randint(1, 2)):
                    op = rng.randrange(7)
                    j = rng.randrange(len(pieces))
                    if op == 0 and _loads(pieces[j]) is not None:
                        pieces[j] = _dumps(_mutate_json(_loads(pieces[j]), rng))
                    elif op == 1:
                        del pieces[j]
                    elif op == 2:
                        pieces.insert(j, pieces[j])
                    elif op == 3:
                        pieces[j] = _mutate_bytes(pieces[j], rng)
                    elif op == 4 and isinstance(_loads(pieces[-1]), dict):
                        last = _loads(pieces[-1])
                        for c in last.get("choices") or []:
                            if isinstance(c, dict):
                                c["finish_reason"] = None
                        pieces[-1] = _dumps(last)
                    elif op == 5:
                        pieces.insert(j, b"[1, 2, 3]")
                    else:
                        pieces = pieces[:j]
                    if not pieces:
                        break
            lines = [b"data: " + p + b"\n\n" for p in pieces]
            if not self.mutate or rng.random() < 0.7:
                lines.append(SSE_DONE)
            if self.mutate and rng.random() < 0.2:  # cut mid-line
                joined = b"".join(lines)
                lines = [joined[: rng.randrange(len(joined) + 1)]]
            pieces_out = lines
            content_type = "text/event-stream"
        else:
            if self.kind == "tito":
                answer = tito_respond(request)
            else:
                answer = respond(request, chat=self.kind == "chat")
            data = _dumps(_mutate_json(answer, rng) if self.mutate and rng.random() < 0.8 else answer)
            if self.mutate and rng.random() < 0.25:
                data = _mutate_bytes(data, rng)
            pieces_out = [data[: len(data) // 2], data[len(data) // 2:]]
            content_type = "application/json"
        self.sent = b"".join(pieces_out)
        self.complete = self.framing != "chunked-cut"
        return framed(pieces_out, framing=self.framing, status=self.status, content_type=content_type)


def _sse_tokens(raw: bytes) -> tuple[list[int] | None, bool]:
    """(output token ids of a whole readable stream, whether every choice finished), by a plain reading."""
    tokens: list[int] = []
    finished = False
    for line in raw.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:") or line[5:].strip() in (b"", b"[DONE]"):
            continue
        try:
            chunk = json.loads(line[5:])
            for c in chunk.get("choices") or []:
                tokens += c.get("token_ids") or []
                finished = finished or c.get("finish_reason") is not None
        except (ValueError, AttributeError, TypeError):
            return None, False
    return tokens, finished


def _run(case: Case, proxy: str, client: "httpx.Client", store) -> str:
    """One case; returns how it ended ('recorded', 'refused', 'unrecorded', '502'); asserts the invariants."""
    headers = {"X-Trajstore-Trajectory": case.tid, "X-Trajstore-Model-Version": "1"}
    if case.stream:
        with client.stream("POST", f"{proxy}{case.path}", json=case.body, headers=headers) as resp:
            raw = resp.read()  # a proxy that broke the response raises here
            status, resp_headers = resp.status_code, resp.headers
    else:
        resp = client.post(f"{proxy}{case.path}", json=case.body, headers=headers)
        raw, status, resp_headers = resp.content, resp.status_code, resp.headers
    state = store.trajectory_state(case.tid)
    if status == 502:
        assert resp_headers.get("content-type") == "application/json"
        assert json.loads(raw)["error"]["rule"] == "upstream_unreachable"
        assert not case.complete, (case.framing, case.sent[:100])
        assert state is None
        return "502"
    assert status == case.status, (status, case.status, raw[:300])
    assert raw.startswith(case.sent), "the harness did not get the upstream's bytes"
    if status != 200:
        assert raw == case.sent or (not case.complete and b"broke off" in raw[len(case.sent):])
        assert "x-trajstore-unrecorded" in resp_headers and state is None
        return "unrecorded"
    if not case.stream:
        assert raw == case.sent
        if "x-trajstore-seq" in resp_headers:
            assert "x-trajstore-error" not in resp_headers and resp_headers["x-trajstore-seq"] == "0"
            (gen,) = store.load_generations(case.tid)
            (choice,) = json.loads(case.sent)["choices"]
            ids = choice.get("token_ids")
            if ids is None:  # the adapter's fallback: the token ids named in the logprobs
                ids = [c["token_id"] if "token_id" in c else int(c["token"].split(":")[1])
                       for c in choice["logprobs"]["content"]]
            assert list(gen.output_ids) == list(ids)
            return "recorded"
        assert resp_headers["x-trajstore-error"] and "\n" not in resp_headers["x-trajstore-error"]
        assert state is None, "a refused record left events behind"
        return "refused"
    tail = raw[len(case.sent):]
    if b": X-Trajstore-Seq: 0" in tail:
        tokens, finished = _sse_tokens(case.sent)
        assert case.complete and finished, "a stream that did not finish was recorded"
        (gen,) = store.load_generations(case.tid)
        assert tokens is not None and list(gen.output_ids) == tokens, "a half record"
        return "recorded"
    assert b"not recorded" in tail or b"X-Trajstore-Error" in tail, tail[:300]
    assert state is None, "an unrecorded stream left events behind"
    return "refused"


def _replying(cases: dict, generator_errors: list[str]):
    """The raw engine's reply: the answer of the case the request names (``fuzz_case``). A
    generator bug is kept in ``generator_errors`` (the test fails on it, not the server thread)."""
    def reply(method, path, body):
        request = json.loads(body)
        try:
            return cases[request["fuzz_case"]].answer(request)
        except Exception as e:  # a bug of the generator, not of the proxy: fail the test, not the thread
            generator_errors.append(repr(e))
            raise

    return reply


def test_fuzzed_upstream_answers_are_passed_on_and_recorded_whole_or_not_at_all(store, caplog):
    rng = random.Random(SEED)
    cases = {i: Case(i, rng) for i in range(CASES)}
    generator_errors: list[str] = []
    reply = _replying(cases, generator_errors)

    outcomes: dict[str, int] = {}
    with caplog.at_level(logging.ERROR), RawUpstream(reply) as up, \
            serve_in_thread(make_proxy_app(store, up.url, pass_through_unrecorded=True)) as proxy, \
            httpx.Client(timeout=60) as client, ThreadPoolExecutor(CLIENTS) as pool:
        for outcome in pool.map(lambda c: _run(c, proxy, client, store), cases.values()):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert not generator_errors, generator_errors[:3]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors[:5]]  # uvicorn logs a handler's crash as an ERROR
    print(f"proxy fuzz: {CASES} cases: {dict(sorted(outcomes.items()))}")
    # the fuzzer reaches every outcome (a generator that never produced a bad answer would test nothing)
    assert {"recorded", "refused"} <= set(outcomes)
    counts = store.info()["events_by_type"]
    assert counts.get("generation", 0) == outcomes["recorded"]
    assert np.all([store.trajectory_state(c.tid) is None or len(store.load_generations(c.tid)) == 1
                   for c in list(cases.values())[:50]])


# --- the default: a call that cannot be recorded fails closed ------------------------------------

_PROXY_ERROR = b'\n\ndata: {"error": {"message": "trajstore proxy: '


def _is_done(line: bytes) -> bool:
    line = line.strip()
    return line.startswith(b"data:") and line[5:].strip() == b"[DONE]"


def _run_closed(case: Case, proxy: str, client: "httpx.Client", store) -> str:
    """One case through a fail-closed proxy; returns how it ended; asserts the invariants: the record
    whole or absent, and a call not recorded is the harness's error (an error status, or an error
    event before the stream's first [DONE]), the upstream's bytes otherwise unchanged."""
    headers = {"X-Trajstore-Trajectory": case.tid, "X-Trajstore-Model-Version": "1"}
    if case.stream:
        with client.stream("POST", f"{proxy}{case.path}", json=case.body, headers=headers) as resp:
            raw = resp.read()
            status, resp_headers = resp.status_code, resp.headers
    else:
        resp = client.post(f"{proxy}{case.path}", json=case.body, headers=headers)
        raw, status, resp_headers = resp.content, resp.status_code, resp.headers
    state = store.trajectory_state(case.tid)
    if status in (409, 422, 502, 503) and resp_headers.get("content-type") == "application/json" \
            and (case.status == 200 or status == 502):
        error = json.loads(raw)["error"]
        if error.get("rule") == "upstream_unreachable":
            assert not case.complete and state is None
            return "502"
        assert error["type"] == "TrajstoreNotRecorded" and "not recorded" in error["message"]
        assert not case.stream and case.status == 200 and state is None
        return "refused"
    assert status == case.status, (status, case.status, raw[:300])
    if status != 200:
        assert raw.startswith(case.sent) and "x-trajstore-unrecorded" in resp_headers and state is None
        return "unrecorded"
    if not case.stream:
        assert raw == case.sent and resp_headers["x-trajstore-seq"] == "0"
        (gen,) = store.load_generations(case.tid)
        (choice,) = json.loads(case.sent)["choices"]
        ids = choice.get("token_ids")
        if ids is None:  # the adapter's fallback: the token ids named in the logprobs
            ids = [c["token_id"] if "token_id" in c else int(c["token"].split(":")[1])
                   for c in choice["logprobs"]["content"]]
        assert list(gen.output_ids) == list(ids), "a half record"
        return "recorded"
    if raw == case.sent + b": X-Trajstore-Seq: 0\n\n":
        tokens, finished = _sse_tokens(case.sent)
        assert case.complete and finished, "a stream that did not finish was recorded"
        (gen,) = store.load_generations(case.tid)
        assert tokens is not None and list(gen.output_ids) == tokens, "a half record"
        return "recorded"
    start = raw.rfind(_PROXY_ERROR)
    assert start >= 0, raw[-300:]
    end = raw.index(b"\n\n", start + 2) + 2
    assert raw[:start] + raw[end:] == case.sent, "the proxy changed the upstream's bytes"
    assert not any(_is_done(line) for line in raw[:start].split(b"\n")), "the error came after [DONE]"
    assert state is None, "an unrecorded stream left events behind"
    return "refused"


def test_fuzzed_upstream_answers_fail_closed_when_they_cannot_be_recorded(store, caplog):
    rng = random.Random(SEED + 1)
    cases = {i: Case(i, rng) for i in range(max(CASES // 2, 20))}
    generator_errors: list[str] = []
    reply = _replying(cases, generator_errors)

    outcomes: dict[str, int] = {}
    with caplog.at_level(logging.ERROR), RawUpstream(reply) as up, \
            serve_in_thread(make_proxy_app(store, up.url)) as proxy, \
            httpx.Client(timeout=60) as client, ThreadPoolExecutor(CLIENTS) as pool:
        for outcome in pool.map(lambda c: _run_closed(c, proxy, client, store), cases.values()):
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert not generator_errors, generator_errors[:3]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors[:5]]
    print(f"proxy fuzz, fail closed: {len(cases)} cases: {dict(sorted(outcomes.items()))}")
    assert {"recorded", "refused"} <= set(outcomes)
    assert store.info()["events_by_type"].get("generation", 0) == outcomes["recorded"]
