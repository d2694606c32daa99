"""Coalescing engine calls (``GroupCommitter``'s linger and byte bound) on each backend:
many trajectories' calls in one payload object and one index transaction, each
acknowledged only once its group is durable, a bad call failing alone, and a
service killed with SIGKILL mid-linger losing only calls it had not acknowledged."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import free_port, gen, started

import trajstore
from trajstore.errors import StoreUnavailable, ValidationError
from trajstore.ingest._group_commit import GroupCommitter
from trajstore.ingest.sinks import encode_events


def _segments_of(store, tids) -> dict[str, set]:
    """Each trajectory's generations' payload segments."""
    rows = store.log.trajectory_events(tids)
    return {t: {r["segment"] for r in rs if r["type"] == "generation"} for t, rs in rows.items()}


def _call(tid: str, seq: int = 0) -> list[dict]:
    return [gen(tid, seq, [1, 2, 3], [4, 5], logprobs=[-0.5, -0.25])]


def test_calls_of_many_trajectories_lingering_together_are_one_object_and_one_transaction(store):
    tids = [f"c{i}" for i in range(24)]
    store.append([started(t) for t in tids])
    committer = GroupCommitter(store, linger_s=1.0)
    try:
        t0 = time.monotonic()
        futures = [committer.submit(_call(t)) for t in tids]
        time.sleep(0.2)
        assert not any(f.done() for f in futures)  # lingering: nothing acknowledged before its group is stored
        results = [f.result(30) for f in futures]
        assert time.monotonic() - t0 >= 0.9
    finally:
        committer.close()
    assert {size for size, _ in results} == {24}
    assert all(r.num_appended == 1 for _, r in results)
    assert (committer.num_groups, committer.num_requests) == (1, 24)
    segments = _segments_of(store, tids)
    assert len(set().union(*segments.values())) == 1  # one payload object for all 24 calls


def test_a_group_full_by_bytes_is_committed_without_waiting_out_the_linger(store):
    tids = [f"b{i}" for i in range(8)]
    store.append([started(t) for t in tids])
    committer = GroupCommitter(store, linger_s=60.0, max_group_bytes=4096)
    try:
        t0 = time.monotonic()
        futures = [committer.submit(_call(t), nbytes=1024) for t in tids]
        for f in futures:
            f.result(30)
        assert time.monotonic() - t0 < 30  # not the 60 s linger
    finally:
        committer.close()
    assert committer.num_groups == 2  # 4 requests of 1 KiB fill a 4 KiB group
    assert len(set().union(*_segments_of(store, tids).values())) == 2


def test_a_bad_call_in_a_lingering_group_fails_alone_with_a_one_line_error(store):
    tids = [f"v{i}" for i in range(6)]
    store.append([started(t) for t in tids])
    committer = GroupCommitter(store, linger_s=0.3)
    try:
        bad = _call("v3", seq=5)  # seq must be 0
        futures = [committer.submit(bad if t == "v3" else _call(t)) for t in tids]
        with pytest.raises(ValidationError) as e:
            futures[3].result(30)
        others = [f.result(30) for i, f in enumerate(futures) if i != 3]
    finally:
        committer.close()
    assert e.value.trajectory_id == "v3" and e.value.index == 0
    assert "\n" not in str(e.value) and "seq" in str(e.value)
    assert all(r.num_appended == 1 for _, r in others)
    segments = _segments_of(store, tids)
    assert segments["v3"] == set()
    assert len(set().union(*segments.values())) == 1  # the five others still went together


class _Down:
    """A store whose appends fail: the database went away."""

    def __init__(self) -> None:
        self.calls = 0

    def append(self, events):
        self.calls += 1
        raise StoreUnavailable("database unavailable (test)")


def test_a_failed_group_acknowledges_none_of_its_calls():
    down = _Down()
    committer = GroupCommitter(down, linger_s=0.2)
    try:
        futures = [committer.submit(_call(f"d{i}")) for i in range(5)]
        for f in futures:
            with pytest.raises(StoreUnavailable):
                f.result(30)
    finally:
        committer.close()
    assert down.calls >= 1


# -- a real service process killed mid-linger -------------------------------------------

def _post(port: int, events: list[dict], timeout_s: float = 60.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/events", encode_events(events), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _start_service(store_url: str, payload: str, port: int, linger_ms: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "trajstore.cli", "--store", store_url, "serve", "--port", str(port),
                             "--insecure-no-auth", "--linger-ms", str(linger_ms)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TRAJSTORE_PAYLOAD_DIR": payload}, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.1)


def test_a_service_killed_mid_linger_loses_only_unacknowledged_calls(store_url, tmp_path):
    payload = str(tmp_path / "payload")
    trajstore.connect(store_url, payload=payload).close()
    port = free_port()
    proc = _start_service(store_url, payload, port, linger_ms=1500)
    answers: dict[str, object] = {}
    try:
        acked = [f"a{i}" for i in range(4)]
        threads = [threading.Thread(target=lambda t=t: answers.__setitem__(t, _post(port, [started(t), *_call(t)])))
                   for t in acked]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(answers[t] == 200 for t in acked), answers  # acknowledged: one lingering group, stored

        def unacked_post(tid: str) -> None:
            try:
                answers[tid] = _post(port, [started(tid), *_call(tid)])
            except OSError as e:  # the connection died with the process: not acknowledged
                answers[tid] = e

        lost = [f"l{i}" for i in range(4)]
        threads = [threading.Thread(target=unacked_post, args=(t,)) for t in lost]
        for t in threads:
            t.start()
        time.sleep(0.6)  # read and queued, lingering (1.5 s)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        for t in threads:
            t.join(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert all(isinstance(answers[t], OSError) for t in lost), answers  # none was acknowledged
    with trajstore.connect(store_url, payload=payload) as s:
        segments = _segments_of(s, acked + lost)
        assert all(len(segments[t]) == 1 for t in acked)  # every acknowledged call is stored...
        assert len(set().union(*(segments[t] for t in acked))) == 1  # ...from its one lingering group
        for t in acked:
            assert len(s.load_generations(t)) == 1  # its payload is there (durable before the ack)
        assert all(s.trajectory_state(t) is None for t in lost)  # killed mid-linger: nothing half-stored
        assert s.append([e for t in lost for e in [started(t), *_call(t)]]).num_appended == 8  # a retry stores them
