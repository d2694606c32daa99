"""The Writer under real faults: a PostgreSQL crashing under it, unstorable events
next to good trajectories, on both sinks (in-process Store and HTTP)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

import psycopg

import trajstore
from trajstore.errors import StoreUnavailable, TrajstoreError
from trajstore.ingest.client import Writer

from pg_cluster import crash_cluster, start_cluster_again

NUM_TRAJ, NUM_GEN = 12, 30


def _produce(writer: Writer, k: int, pause_s: float) -> None:
    with writer.trajectory(f"t{k}", group_id=f"g{k % 3}", num_experts=4) as traj:
        prompt = [1, 2]
        for i in range(NUM_GEN):  # multi-turn: each prompt extends the last sequence
            traj.generation(prompt, [100 + i], model_version=1, logprobs=[-0.5])
            prompt = prompt + [100 + i, 7]
            time.sleep(pause_s)
        traj.finish("completed", reward=1.0)


def _wait_for_a_transaction(cluster, dbname: str) -> None:
    """Return once a backend of ``dbname`` is inside a transaction (an append in flight)."""
    with psycopg.connect(host="127.0.0.1", port=cluster.port, user="postgres", dbname="postgres",
                         autocommit=True) as conn:
        for _ in range(2000):
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND "
                               "(state = 'active' OR state LIKE 'idle in transaction%%')", (dbname,)).fetchone()
            if row[0]:
                return
            time.sleep(0.002)


@pytest.mark.parametrize("via", ["in_process", "http"])
def test_writer_survives_two_postgres_crashes(fault_cluster, tmp_path, monkeypatch, via):
    cluster = fault_cluster  # crashed twice: never the suite's main cluster
    url = cluster.create_database()
    monkeypatch.setenv("TRAJSTORE_PAYLOAD_DIR", str(tmp_path / "payload"))
    with contextlib.ExitStack() as stack:
        target = url
        if via == "http":
            pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")
            from openai_upstream import serve_in_thread
            from trajstore.ingest.service import make_app

            service_store = stack.enter_context(trajstore.connect(url))
            target = stack.enter_context(serve_in_thread(make_app(service_store, token="tok")))
        writer = Writer(target, token="tok", max_batch_events=4, flush_interval_s=0.01)
        producers = [threading.Thread(target=_produce, args=(writer, k, 0.05)) for k in range(NUM_TRAJ)]
        for t in producers:
            t.start()
        for _ in range(2):  # two crashes while the producers write, each with an append in flight
            _wait_for_a_transaction(cluster, url.rsplit("/", 1)[1])
            crash_cluster(cluster)
            time.sleep(0.5)
            start_cluster_again(cluster)
        for t in producers:
            t.join()
        writer.close()  # clean: no error raised
    assert writer.errors == []
    with trajstore.connect(url, payload=str(tmp_path / "payload")) as store:
        states = {f"t{k}": store.trajectory_state(f"t{k}") for k in range(NUM_TRAJ)}
        missing = sorted(tid for tid, st in states.items() if st is None)
        assert missing == []
        assert {tid: st.status for tid, st in states.items()} == {f"t{k}": "completed" for k in range(NUM_TRAJ)}
        assert {tid: st.last_seq for tid, st in states.items()} == {f"t{k}": NUM_GEN - 1 for k in range(NUM_TRAJ)}
        store.materialize()
        assert sorted({s.trajectory_id for s in store.samples()}) == sorted(f"t{k}" for k in range(NUM_TRAJ))


# -- one bad event next to good trajectories ----------------------

def _good(tid: str) -> list[dict]:
    return [
        {"type": "trajectory_started", "trajectory_id": tid, "group_id": "g"},
        {"type": "generation", "trajectory_id": tid, "seq": 0, "prompt_ids": [1, 2], "output_ids": [3, 4],
         "logprobs": [-0.5, -0.25], "model_version": 1},
        {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"},
    ]


# Each poisons trajectory "bad": refused today (a seq gap, a conflicting re-send) or,
# before the store refuses it, crashing it (TypeError, UnicodeEncodeError; an HTTP 500).
POISONS = {
    "seq_gap": [{"type": "trajectory_started", "trajectory_id": "bad"},
                {"type": "generation", "trajectory_id": "bad", "seq": 3, "prompt_ids": [1], "output_ids": [2],
                 "model_version": 1}],
    "conflict": [{"type": "trajectory_started", "trajectory_id": "bad", "event_id": "same"},
                 {"type": "reward", "trajectory_id": "bad", "reward": 1.0, "event_id": "same"}],
    "type_is_a_list": [{"type": "trajectory_started", "trajectory_id": "bad"},
                       {"type": ["generation"], "trajectory_id": "bad"}],
    "lone_surrogate": [{"type": "trajectory_started", "trajectory_id": "bad"},
                       {"type": "reward", "trajectory_id": "bad", "reward": 1.0, "event_id": "x\udc80"}],
}


@pytest.fixture(params=["store", "http", "http-json"])
def sink(request, store):
    if request.param == "store":
        yield store
        return
    pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")
    from openai_upstream import serve_in_thread
    from trajstore.ingest.client import HttpSink
    from trajstore.ingest.service import make_app

    with serve_in_thread(make_app(store, token="tok")) as url:
        # "http": the Writer's default body (Arrow IPC); "http-json": the JSON body
        yield url if request.param == "http" else HttpSink(url, token="tok", body="json")


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_one_bad_event_fails_only_its_trajectory(sink, store, poison):
    good = [f"ok{k}" for k in range(4)]
    events = _good(good[0]) + _good(good[1]) + POISONS[poison] + _good(good[2]) + _good(good[3])
    sends = []
    # One batch holds everything; a regression that retries the batch gives up
    # after retry_timeout_s with StoreUnavailable, which the assertions catch.
    writer = Writer(sink, token="tok", max_batch_events=100, flush_interval_s=30.0, retry_timeout_s=5.0,
                    on_ack=sends.append)
    writer.extend(events)
    with pytest.raises(TrajstoreError) as refused:
        writer.close()
    assert not isinstance(refused.value, StoreUnavailable), refused.value
    assert "bad" in str(refused.value) or "event 1" in str(refused.value), refused.value
    assert writer.errors == []  # one error, raised once
    states = {tid: store.trajectory_state(tid) for tid in good}
    assert {tid: (st.status if st else None) for tid, st in states.items()} == dict.fromkeys(good, "completed")
    stored_bad = store.trajectory_state("bad")
    assert stored_bad is None or stored_bad.status == "running"  # its bad event, and what follows it, never stored
    acked = {ev["trajectory_id"] for batch in sends for ev in batch}
    assert set(good) <= acked


def test_a_wrong_token_fails_the_batch_at_once_with_one_line(store, caplog):
    pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")
    from openai_upstream import serve_in_thread
    from trajstore.ingest.service import make_app

    with serve_in_thread(make_app(store, token="right")) as url:
        writer = Writer(url, token="wrong", max_batch_events=100, flush_interval_s=30.0, retry_timeout_s=20.0)
        writer.extend(_good("a") + _good("b"))
        with pytest.raises(TrajstoreError, match=r"refused the request \(401\)") as refused:
            writer.close()
    assert not isinstance(refused.value, StoreUnavailable)
    assert "\n" not in str(refused.value)
    assert store.trajectory_state("a") is None and store.trajectory_state("b") is None
    assert [r.levelname for r in caplog.records if r.name == "trajstore.ingest.client"] == ["ERROR"]
