"""The Writer's HTTP body: an Arrow IPC stream by default (numpy arrays as raw
bytes, no JSON or base64 for them), JSON on request; same events stored, same
refusals (index in the batch, trajectory, rule), over a real loopback server."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from openai_upstream import serve_in_thread  # noqa: E402
from trajstore.events._wire import encode_b64, encode_npy_b64  # noqa: E402
from trajstore.errors import ConflictError, ValidationError  # noqa: E402
from trajstore.ingest.arrow_body import ARROW_CONTENT_TYPE  # noqa: E402
from trajstore.ingest.client import HttpSink, Writer  # noqa: E402
from trajstore.ingest.service import make_app  # noqa: E402

TOKEN = "tok"


class _ContentTypes:
    """ASGI middleware in front of the real app: records each POST's Content-Type."""

    def __init__(self, app):
        self.app, self.seen = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            self.seen.append(dict(scope["headers"]).get(b"content-type", b"").decode())
        await self.app(scope, receive, send)


@pytest.fixture
def served(store):
    app = _ContentTypes(make_app(store, token=TOKEN))
    with serve_in_thread(app) as url:
        yield url, app.seen


def _trajectory(writer: Writer, tid: str, seed: int) -> None:
    """Arrays in every form a harness may hold: numpy (int32/int64/float32/uint8/bool), lists,
    numpy scalars, {b64,dtype,shape}, a base64 .npy string of routes."""
    rng = np.random.default_rng(seed)
    with writer.trajectory(tid, group_id="g", num_experts=16, metadata={"seed": np.int64(seed)}) as traj:
        prompt = rng.integers(0, 1000, 12, dtype=np.int32)
        out = rng.integers(0, 1000, 5, dtype=np.int64)
        traj.generation(prompt, out, model_version=np.int32(3), logprobs=-rng.random(5, dtype=np.float32),
                        routed_experts=rng.integers(0, 16, (16, 2, 2), dtype=np.uint8),
                        loss_mask=np.ones(5, dtype=bool))
        prompt2 = np.concatenate([prompt, out.astype(np.int32), [7, 8]]).tolist()
        traj.generation(prompt2, encode_b64(np.array([4, 5, 6], dtype=np.int32)), model_version=4,
                        logprobs=[-0.1, -0.2, -0.3],
                        routed_experts=encode_npy_b64(rng.integers(0, 16, (len(prompt2) + 2, 2, 2), dtype=np.uint8)))
        traj.finish("completed", reward=np.float64(0.5))


def test_writer_sends_arrow_by_default_and_stores_what_json_stores(served, store):
    url, seen = served
    with Writer(url, token=TOKEN, max_batch_events=3, flush_interval_s=0.01) as arrow:
        _trajectory(arrow, "a", seed=1)
    assert seen and set(seen) == {ARROW_CONTENT_TYPE}
    del seen[:]
    with Writer(url, token=TOKEN, max_batch_events=3, flush_interval_s=0.01, body="json") as json_writer:
        _trajectory(json_writer, "j", seed=1)
    assert seen and set(seen) == {"application/json"}
    ga, gj = store.load_generations("a"), store.load_generations("j")
    assert len(ga) == len(gj) == 2
    for x, y in zip(ga, gj):
        for name in ("prompt_ids", "output_ids", "logprobs", "loss_mask", "routed_experts"):
            a, b = getattr(x, name), getattr(y, name)
            assert (a is None and b is None) or (np.array_equal(a, b) and a.dtype == b.dtype), name
        assert x.model_version == y.model_version
    sa, sj = store.trajectory_state("a"), store.trajectory_state("j")
    assert sa.status == sj.status == "completed" and sa.last_seq == sj.last_seq == 1


@pytest.mark.parametrize("body", ["arrow", "json"])
def test_a_refusal_names_the_event_index_and_trajectory_in_both_bodies(served, store, body):
    url, _ = served
    sink = HttpSink(url, token=TOKEN, body=body)
    ok = [{"type": "trajectory_started", "trajectory_id": "ok"},
          {"type": "generation", "trajectory_id": "ok", "seq": 0, "prompt_ids": np.array([1, 2], np.int32),
           "output_ids": np.array([3], np.int32), "model_version": 1}]
    bad = {"type": "generation", "trajectory_id": "ok", "seq": 1, "prompt_ids": np.array([1, 2, 3], np.int32),
           "output_ids": np.array([4, 5], np.int32), "logprobs": np.array([-0.5], np.float32), "model_version": 1}
    with pytest.raises(ValidationError) as refused:
        sink.send(ok + [bad])
    assert (refused.value.index, refused.value.trajectory_id, refused.value.rule) == (2, "ok", "length_mismatch")
    assert store.trajectory_state("ok") is None  # nothing of the request stored
    sink.send(ok)
    with pytest.raises(ConflictError) as conflict:
        sink.send([{**ok[1], "output_ids": np.array([9], np.int32)}])
    assert (conflict.value.index, conflict.value.trajectory_id) == (0, "ok")
    sink.close()


def test_an_unknown_body_format_is_refused_at_once():
    with pytest.raises(ValidationError, match="body must be one of"):
        HttpSink("http://127.0.0.1:1", body="msgpack")
