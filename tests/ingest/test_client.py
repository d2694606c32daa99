"""The batching writer: ids, retries, back-pressure, error isolation, threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import trajstore
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.ingest.client import Writer, encode_events, error_from_response
from trajstore.errors import ConflictError, StoreUnavailable, TrajstoreError, ValidationError


class RecordingSink:
    """Stores batches; optionally fails the first ``flaky`` sends AFTER storing
    them (the ack is lost), like a connection dropped mid-response."""

    def __init__(self, flaky: int = 0, refuse: str | None = None, max_events: int | None = None):
        self.batches: list[list[dict]] = []
        self.stored: dict[str, dict] = {}
        self.flaky, self.refuse, self.max_events = flaky, refuse, max_events
        self.lock = threading.Lock()

    def send(self, events):
        with self.lock:
            if self.max_events is not None and len(events) > self.max_events:
                raise ValidationError("body too large", rule="body_too_large")
            for i, ev in enumerate(events):
                if ev["trajectory_id"] == self.refuse and ev["type"] == "generation":
                    raise ValidationError("bad event", index=i, trajectory_id=self.refuse, rule="test")
            self.batches.append(list(events))
            for ev in events:
                self.stored.setdefault(ev["event_id"], ev)
            if self.flaky:
                self.flaky -= 1
                raise StoreUnavailable("connection reset after commit")

    def close(self):
        pass


def _gen(tid, seq):
    return {"type": "generation", "trajectory_id": tid, "seq": seq, "prompt_ids": [1, 2], "output_ids": [3], "model_version": 0}


def test_batches_by_size_and_flush():
    sink = RecordingSink()
    with Writer(sink, max_batch_events=4, flush_interval_s=30.0) as w:
        for i in range(10):
            w.put(_gen("t", i))
        w.flush(timeout_s=10)
        assert [len(b) for b in sink.batches] == [4, 4, 2]
    assert len(sink.stored) == 10


def test_batches_by_time():
    sink = RecordingSink()
    with Writer(sink, max_batch_events=1000, flush_interval_s=0.05) as w:
        w.put(_gen("t", 0))
        for _ in range(200):
            if sink.batches:
                break
            threading.Event().wait(0.01)
        assert len(sink.batches) == 1


def test_batches_by_tokens():
    sink = RecordingSink()
    with Writer(sink, max_batch_events=1000, max_batch_tokens=6, flush_interval_s=30.0) as w:
        for i in range(5):  # 3 tokens each
            w.put(_gen("t", i))
        w.flush(timeout_s=10)
    assert [len(b) for b in sink.batches] == [2, 2, 1]


def test_retry_resends_the_same_event_ids():
    sink = RecordingSink(flaky=2)
    acked = []
    with Writer(sink, max_batch_events=3, flush_interval_s=30.0, on_ack=acked.extend) as w:
        for i in range(3):
            w.put(_gen("t", i))
        w.flush(timeout_s=10)
    assert len(sink.batches) == 3  # sent three times: two acks lost
    ids = [[ev["event_id"] for ev in b] for b in sink.batches]
    assert ids[0] == ids[1] == ids[2] and len(set(ids[0])) == 3
    assert len(sink.stored) == 3 and [ev["event_id"] for ev in acked] == ids[0]


def test_back_pressure_blocks_then_times_out():
    gate = threading.Event()

    class BlockedSink(RecordingSink):
        def send(self, events):
            gate.wait(10)
            super().send(events)

    sink = BlockedSink()
    w = Writer(sink, max_batch_events=1, flush_interval_s=0.0, max_pending_events=2, put_timeout_s=0.2)
    w.put(_gen("t", 0))
    w.put(_gen("t", 1))
    with pytest.raises(StoreUnavailable, match="queue stayed full"):
        w.put(_gen("t", 2))
    gate.set()
    w.put(_gen("t", 2))  # room again once the sink moves
    w.close()
    assert len(sink.stored) == 3


def test_refused_event_fails_only_its_trajectory():
    sink = RecordingSink(refuse="bad")
    w = Writer(sink, max_batch_events=100, flush_interval_s=30.0)
    w.put({"type": "trajectory_started", "trajectory_id": "bad"})
    for i in range(3):
        w.put(_gen("good", i))
        w.put(_gen("bad", i))
    with pytest.raises(ValidationError, match="bad event"):
        w.flush(timeout_s=10)
    stored = sorted((ev["trajectory_id"], ev.get("seq", -1)) for ev in sink.stored.values())
    assert stored == [("good", 0), ("good", 1), ("good", 2)]
    with pytest.raises(ValidationError):
        w.put(_gen("bad", 3))
    w.put(_gen("good", 3))
    w.close()
    assert len(sink.stored) == 4


def test_too_large_batches_are_split():
    sink = RecordingSink(max_events=3)
    with Writer(sink, max_batch_events=10, flush_interval_s=30.0) as w:
        for i in range(10):
            w.put(_gen("t", i))
    assert len(sink.stored) == 10 and all(len(b) <= 3 for b in sink.batches)
    order = [ev["seq"] for b in sink.batches for ev in b]
    assert order == list(range(10))


def test_concurrent_producers_exactly_once_in_order():
    sink = RecordingSink()
    n_threads, n_events = 8, 200
    with Writer(sink, max_batch_events=64, flush_interval_s=0.01, max_pending_events=100) as w:
        def produce(k):
            for i in range(n_events):
                w.put(_gen(f"t{k}", i))
        threads = [threading.Thread(target=produce, args=(k,)) for k in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    sent = [ev for b in sink.batches for ev in b]
    assert len(sent) == len(sink.stored) == n_threads * n_events
    for k in range(n_threads):
        assert [ev["seq"] for ev in sent if ev["trajectory_id"] == f"t{k}"] == list(range(n_events))


def test_trajectory_handle_numbers_generations_and_finishes():
    sink = RecordingSink()
    routes = np.zeros((2, 2, 1), dtype=np.uint8)
    with Writer(sink, flush_interval_s=0.0) as w:
        with w.trajectory("t1", group_id="g", num_experts=8) as traj:
            assert traj.generation([1], [2], model_version=1, logprobs=[-0.5]) == 0
            assert traj.generation([1, 2, 3], [4], model_version=1, routed_experts=routes, reward=None) == 1
            traj.reward(1.0)
        with pytest.raises(RuntimeError):
            with w.trajectory("t2") as traj2:
                raise RuntimeError("harness crashed")
    events = [ev for b in sink.batches for ev in b]
    kinds = [(ev["trajectory_id"], ev["type"], ev.get("seq"), ev.get("status")) for ev in events]
    assert kinds == [
        ("t1", "trajectory_started", None, None), ("t1", "generation", 0, None), ("t1", "generation", 1, None),
        ("t1", "reward", None, None), ("t1", "trajectory_finished", None, "completed"),
        ("t2", "trajectory_started", None, None), ("t2", "trajectory_finished", None, "failed"),
    ]
    assert events[0]["group_id"] == "g" and events[0]["num_experts"] == 8 and "reward" not in events[2]
    assert traj2.finished


def test_closed_writer_refuses_puts():
    w = Writer(RecordingSink())
    w.close()
    with pytest.raises(TrajstoreError, match="closed"):
        w.put(_gen("t", 0))


def test_encode_events_sends_arrays_as_b64():
    body = encode_events([{"routed_experts": np.ones((2, 3, 1), dtype=np.uint8), "seq": np.int64(3)}])
    assert b'"dtype":"uint8"' in body and b'"shape":[2,3,1]' in body and b'"seq":3' in body


def test_error_from_response_maps_statuses():
    err = error_from_response(422, b'{"error": {"index": 2, "trajectory_id": "t", "rule": "seq_gap", "message": "gap"}}')
    assert type(err) is ValidationError and err.index == 2 and err.rule == "seq_gap"
    assert type(error_from_response(409, b'{"error": {"message": "x"}}')) is ConflictError
    assert type(error_from_response(503, b"down")) is StoreUnavailable
    assert type(error_from_response(500, b"boom")) is TrajstoreError  # not retried blindly: the writer isolates it
    assert type(error_from_response(401, b'{"error": {"message": "no"}}')) is TrajstoreError
    assert error_from_response(413, b'{"error": {"rule": "body_too_large", "message": "big"}}').rule == "body_too_large"


def test_from_vllm_accepts_offline_outputs_and_server_json():
    from test_vllm import ROUTES, CompletionOutput, RequestOutput, _chat_json, _dict_logprobs

    sink = RecordingSink()
    with Writer(sink, flush_interval_s=0.0) as w:
        traj = w.trajectory("v", num_experts=64)
        assert traj.from_vllm(RequestOutput([11, 12, 13], [CompletionOutput(0, "", [21, 22], None, _dict_logprobs(), ROUTES)]),
                              model_version=1) == 0
        assert traj.from_vllm(_chat_json(), model_version=2) == 1
        traj.finish()
    gens = [ev for b in sink.batches for ev in b if ev["type"] == "generation"]
    assert [(g["seq"], g["model_version"]) for g in gens] == [(0, 1), (1, 2)]
    assert all(isinstance(g["routed_experts"], np.ndarray) for g in gens)


def test_writer_at_a_down_url_warns_once_per_burst_naming_url_and_error(caplog):
    import logging
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    caplog.set_level(logging.DEBUG, logger="trajstore.ingest.client")
    w = Writer(url, token="t", max_batch_events=10, flush_interval_s=30.0, retry_timeout_s=0.5)
    w.put(_gen("t", 0))
    with pytest.raises(StoreUnavailable, match="gave up sending 1 events to http://127.0.0.1"):
        w.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert url in warnings[0].getMessage() and "refused" in warnings[0].getMessage().lower()
    assert "retrying for up to 0.5 s" in warnings[0].getMessage()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and url in errors[0].getMessage()


def test_writer_logs_when_the_sink_is_back(caplog):
    import logging

    caplog.set_level(logging.INFO, logger="trajstore.ingest.client")
    sink = RecordingSink(flaky=2)
    with Writer(sink, max_batch_events=3, flush_interval_s=30.0) as w:
        for i in range(3):
            w.put(_gen("t", i))
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    assert "is back" in caplog.records[1].getMessage()


def test_a_malformed_ingest_url_is_a_one_line_validation_error():
    with pytest.raises(ValidationError, match=r"ingest URL must be http\(s\)://host:port, got 'http://'"):
        Writer("http://")


def test_writer_records_per_token_versions_and_metadata_into_a_store(tmp_path):
    """A call that spans a weight update, written through a Writer into a real store (SPEC A2)."""
    import trajstore

    store = trajstore.connect(f"sqlite:///{tmp_path / 's.db'}", payload=str(tmp_path / "p"))
    with Writer(store, flush_interval_s=0.0) as w:
        with w.trajectory("t1") as traj:
            traj.generation([1, 2], [3, 4, 5, 6], token_model_versions=[7, 7, 8, 8], logprobs=[-0.1] * 4,
                            finish_reason="length", metadata={"tool": "search"})
            traj.generation([1, 2, 3, 4, 5, 6, 9], [10], model_version=8, finish_reason="stop")
    store.materialize()
    (sample,) = store.samples()
    assert sample.token_model_versions.tolist() == [7, 7, 8, 8, -1, 8]
    assert sample.logprobs_mask.tolist() == [True, True, True, True, False, False]
    assert (sample.min_model_version, sample.max_model_version, sample.finish_reason) == (7, 8, "stop")
    store.close()


# ----------------------------------------------------------------------------
# The old keyword Writer(batch_size=) still works, with a DeprecationWarning.

OLD_NAMES_CFG = RolloutConfig(turns=2, prompt_tokens=8, output_tokens=4, observation_tokens=2, layers=2, topk=2, seed=1)


def test_writer_batch_size_is_max_batch_events(tmp_path):
    from trajstore.ingest.client import Writer

    with trajstore.connect(f"sqlite:///{tmp_path}/w.db") as store:
        with pytest.warns(DeprecationWarning, match="batch_size= is deprecated; use max_batch_events="):
            writer = Writer(store, batch_size=3, flush_interval_s=30.0)
        with writer:
            assert writer.max_batch_events == 3
            for ev in trajectory_events(OLD_NAMES_CFG, 0):
                writer.put(ev)
        assert store.log.head_position() == len(trajectory_events(OLD_NAMES_CFG, 0))
