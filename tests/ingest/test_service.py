"""The HTTP ingest service over real loopback HTTP: auth, limits, errors,
idempotent retries, group commit, concurrent clients, SIGKILL mid-load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from openai_upstream import serve_in_thread  # noqa: E402
from trajstore.ingest.client import Writer, encode_events  # noqa: E402
from trajstore.errors import ValidationError  # noqa: E402
from trajstore.ingest.service import GroupCommitter, make_app, serve  # noqa: E402
from helpers import free_port  # noqa: E402

TOKEN = "test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REPO = Path(__file__).resolve().parents[2]


def stored_events(store_url: str) -> list[tuple]:
    """(event_id, trajectory_id, type, seq) of every event in the log, in position order."""
    import sqlalchemy as sa

    engine = sa.create_engine(store_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT event_id, trajectory_id, type, seq FROM events ORDER BY position"))
            return [tuple(r) for r in rows]
    finally:
        engine.dispose()


def trajectory_events(tid: str, num_generations: int = 2) -> list[dict]:
    events: list[dict] = [{"type": "trajectory_started", "trajectory_id": tid, "num_experts": 16}]
    prompt = [1, 2, 3]
    for seq in range(num_generations):
        output = [10 + seq, 11 + seq]
        rows = len(prompt) + len(output) - 1
        events.append({
            "type": "generation", "trajectory_id": tid, "seq": seq, "prompt_ids": prompt, "output_ids": output,
            "logprobs": [-0.5, -0.25], "model_version": 1,
            "routed_experts": (np.arange(rows * 4) % 16).astype(np.uint8).reshape(rows, 2, 2),
        })
        prompt = prompt + output + [7]
    events.append({"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"})
    return events


@pytest.fixture
def service(store):
    with serve_in_thread(make_app(store, token=TOKEN, max_body_bytes=1 << 20)) as url:
        yield url


def _post(url, body, headers=AUTH, **kw):
    return httpx.post(f"{url}/v1/events", content=body, headers={"Content-Type": "application/json", **headers}, **kw)


def test_concurrent_clients_store_everything_once(service, store_url):
    num_clients, per_client = 16, 3

    def client(k):
        with Writer(service, token=TOKEN, max_batch_events=4, flush_interval_s=0.005) as w:
            for j in range(per_client):
                w.extend(trajectory_events(f"c{k}-t{j}"))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    rows = stored_events(store_url)
    assert len(rows) == num_clients * per_client * 4
    assert len({r[0] for r in rows}) == len(rows)
    for k in range(num_clients):
        seqs = [r[3] for r in rows if r[1] == f"c{k}-t0" and r[2] == "generation"]
        assert seqs == [0, 1]
    metrics = httpx.get(f"{service}/metrics").text
    assert f"trajstore_ingest_events_total {len(rows)}" in metrics
    tokens_per_trajectory = (3 + 2) + (6 + 2)  # prompt + output of its two generations
    assert f"trajstore_ingest_tokens_total {tokens_per_trajectory * num_clients * per_client}" in metrics
    assert 'trajstore_ingest_ack_latency_seconds_bucket{le="+Inf"}' in metrics


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}],
                         ids=["missing", "wrong", "no-scheme"])
def test_requests_without_the_token_get_401_and_store_nothing(service, store_url, headers):
    resp = _post(service, encode_events(trajectory_events("t")), headers=headers)
    assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
    assert resp.json()["error"]["rule"] == "unauthorized"
    assert stored_events(store_url) == []


def test_refuses_to_start_without_a_token(store_url, monkeypatch):
    monkeypatch.delenv("TRAJSTORE_TOKEN", raising=False)
    with pytest.raises(ValueError, match="no token"):
        serve(store_url, port=1)


def test_oversized_bodies_get_413_and_store_nothing(service, store_url):
    big = encode_events(trajectory_events("t") + [{"type": "reward", "trajectory_id": "t", "reward": 1.0, "pad": "x" * (1 << 20)}])
    resp = _post(service, big)
    assert resp.status_code == 413 and resp.json()["error"]["rule"] == "body_too_large"

    def chunked():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    resp = _post(service, chunked())
    assert resp.status_code == 413 and "limit" in resp.json()["error"]["message"]
    assert stored_events(store_url) == []


def test_writer_splits_batches_the_service_finds_too_large(service, store_url):
    rng = np.random.default_rng(0)
    events = []
    for i in range(6):  # ~360 KB each on the wire; the service takes 1 MiB per request
        tid = f"big{i}"
        events += [{"type": "trajectory_started", "trajectory_id": tid},
                   {"type": "generation", "trajectory_id": tid, "seq": 0, "prompt_ids": list(range(600)),
                    "output_ids": [1] * 100, "model_version": 0,
                    "routed_experts": rng.integers(0, 128, (699, 48, 8), dtype=np.uint8)}]
    with Writer(service, token=TOKEN, max_batch_events=100, flush_interval_s=30.0) as w:
        w.extend(events)
    assert len(stored_events(store_url)) == 12


@pytest.mark.parametrize("body, rule", [(b'{"events": [', "malformed_json"), (b'{"event": []}', "malformed_body"),
                                        (b'"x"', "malformed_body")])
def test_malformed_bodies_get_400(service, store_url, body, rule):
    resp = _post(service, body)
    assert resp.status_code == 400 and resp.json()["error"]["rule"] == rule
    assert stored_events(store_url) == []


def test_bad_event_gets_422_naming_it_and_nothing_of_the_request_is_stored(service, store_url):
    events = trajectory_events("t")
    events[2]["logprobs"] = [-0.5]  # one logprob for two output tokens
    resp = _post(service, encode_events(events))
    assert resp.status_code == 422
    err = resp.json()["error"]
    assert (err["index"], err["trajectory_id"], err["rule"]) == (2, "t", "length_mismatch")
    assert "logprobs" in err["message"]
    assert stored_events(store_url) == []


def test_conflicting_event_id_gets_409(service, store_url):
    events = trajectory_events("t", 1)[:2]
    events[1]["event_id"] = "e1"
    assert _post(service, encode_events(events)).status_code == 200
    changed = dict(events[1], output_ids=[99, 98])
    resp = _post(service, encode_events([changed]))
    assert resp.status_code == 409 and resp.json()["error"]["index"] == 0
    assert len(stored_events(store_url)) == 2


def test_retried_request_is_idempotent(service, store_url):
    body = encode_events([dict(ev, event_id=f"e{i}") for i, ev in enumerate(trajectory_events("t"))])
    first = _post(service, body).json()
    second = _post(service, body).json()
    assert first["num_events"] == second["num_events"] == 4
    assert first["num_appended"] == 4 and second["num_duplicates"] == 4
    assert len(stored_events(store_url)) == 4


def test_group_commit_keeps_a_bad_request_from_failing_others(store, store_url):
    gate, calls = threading.Event(), []

    class Gated:
        def append(self, events):
            calls.append(len(events))
            gate.wait(10)
            return store.append(events)

    committer = GroupCommitter(Gated())
    first = committer.submit(trajectory_events("a", 1))
    time.sleep(0.2)  # the committer is now blocked inside the first append
    bad = trajectory_events("b", 1)
    bad[1]["seq"] = 5
    futures = [committer.submit(trajectory_events("g1", 1)), committer.submit(bad), committer.submit(trajectory_events("g2", 1))]
    gate.set()
    assert first.result(10)[0] == 1
    # the refused request is dropped and the other two re-tried together (one group of 2)
    assert futures[0].result(10)[0] == 2 and futures[2].result(10)[0] == 2
    with pytest.raises(ValidationError) as e:
        futures[1].result(10)
    assert e.value.index == 1 and e.value.trajectory_id == "b"
    committer.close()
    assert calls == [3, 9, 6]  # the first request, the coalesced three, the two innocent ones again
    assert {r[1] for r in stored_events(store_url)} == {"a", "g1", "g2"}


def test_a_group_waits_for_requests_whose_bodies_are_still_being_read(store, store_url):
    """Announced requests (``expect``) join the group about to be committed:
    one append for all of them; one that fails before it is parsed
    (``forget``) is not waited for."""
    committer = GroupCommitter(store, max_wait_s=60)
    for _ in range(3):
        committer.expect()
    first = committer.submit(trajectory_events("a", 1), expected=True)
    second = committer.submit(trajectory_events("b", 1), expected=True)
    committer.forget()
    assert first.result(30)[0] == 2 and second.result(30)[0] == 2
    committer.close()
    assert {r[1] for r in stored_events(store_url)} == {"a", "b"}


def test_two_committers_append_apart_trajectories_at_once_and_one_trajectory_in_order(store, store_url):
    """``committers=2``: while one group's append is blocked, a group of other
    trajectories is appended beside it; a request touching a trajectory in
    flight (and everything queued behind it) waits for that append to end."""
    gate, calls = threading.Event(), []

    class Gated:
        def append(self, events):
            tids = sorted({ev["trajectory_id"] for ev in events})
            calls.append(tids)
            if tids == ["a"] and len(calls) == 1:
                gate.wait(30)  # the first append of "a" blocks until the gate opens
            return store.append(events)

    whole = trajectory_events("a", 2)
    committer = GroupCommitter(Gated(), committers=2)
    try:
        first = committer.submit(whole[:2])  # started + seq 0 of "a"
        for _ in range(500):
            if calls:
                break
            time.sleep(0.01)
        assert calls == [["a"]]
        beside = committer.submit(trajectory_events("b", 1))
        assert beside.result(30)[0] == 1  # appended by the other committer while "a" is still blocked
        later = committer.submit(whole[2:])  # seq 1 of "a": must wait for seq 0's append
        behind = committer.submit(trajectory_events("c", 1))  # queued behind it: waits too (arrival order)
        time.sleep(0.2)
        assert calls == [["a"], ["b"]] and not later.done() and not behind.done()
        gate.set()
        assert first.result(30)[0] == 1 and later.result(30)[0] >= 1 and behind.result(30)[0] >= 1
    finally:
        gate.set()
        committer.close()
    assert calls[:2] == [["a"], ["b"]] and sorted(calls[2:]) in ([["a"], ["c"]], [["a", "c"]])
    a_events = [r for r in stored_events(store_url) if r[1] == "a"]
    assert [(r[2], r[3]) for r in a_events] == [("trajectory_started", None), ("generation", 0), ("generation", 1),
                                                 ("trajectory_finished", None)]


def test_health_metrics_openapi(service):
    assert httpx.get(f"{service}/healthz").json() == {"status": "ok"}
    assert "trajstore_ingest_requests_total" in httpx.get(f"{service}/metrics").text
    schema = httpx.get(f"{service}/openapi.json").json()
    assert "requestBody" in schema["paths"]["/v1/events"]["post"]


def _start_service(store_url: str, port: int, payload: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "workers" / "ingest_server.py"), "--store", store_url, "--port", str(port)]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRAJSTORE_TOKEN": TOKEN, "PYTHONPATH": path, "TRAJSTORE_PAYLOAD_DIR": str(payload)}
    proc = subprocess.Popen(cmd, env=env, cwd=REPO)
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.05)
        if proc.poll() is not None:
            raise RuntimeError(f"ingest service exited with {proc.returncode}")
    proc.kill()
    raise RuntimeError("ingest service did not come up in 15 s")


@pytest.mark.slow
def test_sigkill_mid_load_every_acknowledged_event_stored_once(store_url, tmp_path):
    port = free_port()
    proc = _start_service(store_url, port, tmp_path / "payload")
    acked: list[str] = []
    lock = threading.Lock()

    def on_ack(events):
        with lock:
            acked.extend(ev["event_id"] for ev in events)

    num_trajectories = 60
    writer = Writer(f"http://127.0.0.1:{port}", token=TOKEN, max_batch_events=8, flush_interval_s=0.002,
                    retry_timeout_s=60, on_ack=on_ack)
    producer = threading.Thread(target=lambda: [writer.extend(trajectory_events(f"t{i}", 3)) for i in range(num_trajectories)])
    try:
        producer.start()
        for _ in range(1000):  # kill once part of the load is acknowledged
            if len(acked) >= 40:
                break
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert 40 <= len(acked) < num_trajectories * 5, "the kill did not land mid-load"
        proc = _start_service(store_url, port, tmp_path / "payload")
        producer.join(60)
        writer.close(timeout_s=60)
    finally:
        proc.kill()
        proc.wait(10)
    rows = stored_events(store_url)
    ids = [r[0] for r in rows]
    assert len(ids) == len(set(ids)), "duplicate events"
    assert set(acked) <= set(ids), "acknowledged events missing"
    assert len(ids) == num_trajectories * 5 and len(acked) == len(ids)


def test_edges_import_fastapi_lazily():
    code = ("import sys, trajstore.ingest.client, trajstore.ingest.service, trajstore.ingest.proxy, trajstore.ingest.vllm; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'httpx', 'starlette') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert out.stdout.strip() == "[]"
