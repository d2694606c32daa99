"""One client's bad events never fail another client's requests,
group commit included. A real service on loopback, real concurrent clients
(threads with their own HTTP connections), both backends."""

from __future__ import annotations

import threading
import time

import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")
pytest.importorskip("fastapi", reason="needs the extra: pip install 'trajstore[server]'")

from openai_upstream import serve_in_thread  # noqa: E402
from trajstore.errors import StoreUnavailable, ValidationError  # noqa: E402
from trajstore.ingest.service import GroupCommitter, make_app  # noqa: E402
from trajstore.ingest.sinks import encode_events  # noqa: E402

TOKEN = "iso-token"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def good_trajectory(tid: str) -> list[dict]:
    return [
        {"type": "trajectory_started", "trajectory_id": tid, "num_experts": 8},
        {"type": "generation", "trajectory_id": tid, "seq": 0, "prompt_ids": [1, 2, 3], "output_ids": [4, 5],
         "model_version": 1, "logprobs": [-0.5, -0.25], "routed_experts": [[[1, 2]], [[3, 4]], [[5, 6]], [[7, 0]]]},
        {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"},
    ]


def unstorable(k: int) -> list[dict]:
    """Events the drivers used to choke on: each must be a 4xx for its own request only."""
    tid = f"bad-{k}"
    started = {"type": "trajectory_started", "trajectory_id": tid}
    gen = {"type": "generation", "trajectory_id": tid, "seq": 0, "prompt_ids": [1], "output_ids": [2],
           "model_version": 0}
    variants = [
        [dict(started, trajectory_id=tid + "\udc80")],
        [dict(started, trajectory_id=tid + "x" * 300)],
        [dict(started, trajectory_id=tid + "\x00")],
        [dict(started, metadata={"x": float("nan")})],
        [dict(started, metadata={"x": "\x00"})],
        [started, dict(gen, model_version=2**31)],
        [started, dict(gen, event_id="e" * 256)],
        [started, dict(gen, seq=2**31)],
        [started, dict(gen, finish_reason="x" * 100)],
        [started, dict(gen, logprob=[-1.0])],
    ]
    return variants[k % len(variants)]


@pytest.fixture
def service(store):
    from trajstore.ingest._nodelay import NoDelayHTTPProtocol  # the protocol `trajstore serve` runs

    app = make_app(store, token=TOKEN, max_body_bytes=1 << 20)
    with serve_in_thread(app, http=NoDelayHTTPProtocol) as url:
        yield url, app


def test_a_client_posting_unstorable_events_fails_no_innocent_request(service, store):
    url, app = service
    num_clients, per_client = 6, 20
    statuses: dict[str, list[int]] = {"good": [], "bad": []}
    lock = threading.Lock()
    done = threading.Event()

    def innocent(c: int) -> None:
        with httpx.Client(timeout=60) as client:
            for j in range(per_client):
                resp = client.post(f"{url}/v1/events", content=encode_events(good_trajectory(f"g{c}-{j}")),
                                   headers=AUTH)
                with lock:
                    statuses["good"].append(resp.status_code)

    def bad() -> None:
        with httpx.Client(timeout=60) as client:
            k = 0
            while not done.is_set() or k < 20:
                resp = client.post(f"{url}/v1/events", content=encode_events(unstorable(k)), headers=AUTH)
                with lock:
                    statuses["bad"].append(resp.status_code)
                assert resp.json()["error"]["rule"]
                k += 1

    bad_thread = threading.Thread(target=bad)
    bad_thread.start()
    threads = [threading.Thread(target=innocent, args=(c,)) for c in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    done.set()
    bad_thread.join(300)
    assert statuses["good"] == [200] * num_clients * per_client
    assert statuses["bad"] and set(statuses["bad"]) == {422}, sorted(set(statuses["bad"]))
    counts = store.info()
    stored = sum(1 for _ in _stored_trajectories(store))
    assert stored == num_clients * per_client, counts
    assert "status=\"500\"" not in httpx.get(f"{url}/metrics").text
    assert store.materialize().num_samples_after == num_clients * per_client


def _stored_trajectories(store):
    from sqlalchemy import select

    from trajstore.schema import trajectories

    with store.log.read_engine.connect() as conn:
        yield from conn.execute(select(trajectories.c.trajectory_id))


class FaultyStore:
    """The real store, with a bug injected: appending trajectory "boom" raises RuntimeError,
    and "down" raises StoreUnavailable (as a driver fault translated would)."""

    def __init__(self, store, gate: threading.Event) -> None:
        self.store, self.gate, self.calls = store, gate, []

    def append(self, events):
        self.calls.append(sorted({ev["trajectory_id"] for ev in events}))
        self.gate.wait(30)
        tids = {ev["trajectory_id"] for ev in events}
        if "boom" in tids:
            raise RuntimeError("injected bug")
        if "down" in tids:
            raise StoreUnavailable("injected outage")
        return self.store.append(events)


def _wait_until_blocked(faulty: "FaultyStore") -> None:
    """Until the committer is blocked inside its first append (so the next submits coalesce)."""
    for _ in range(200):
        if faulty.calls:
            return
        time.sleep(0.01)


@pytest.mark.parametrize("culprit, error", [("boom", RuntimeError), ("down", StoreUnavailable)])
def test_a_non_validation_failure_reaches_only_its_own_request(store, culprit, error):
    gate = threading.Event()
    faulty = FaultyStore(store, gate)
    committer = GroupCommitter(faulty)
    try:
        first = committer.submit(good_trajectory("first"))
        _wait_until_blocked(faulty)
        futures = {tid: committer.submit(good_trajectory(tid)) for tid in ("a", culprit, "b", "c")}
        gate.set()
        assert first.result(30)[0] == 1
        for tid in ("a", "b", "c"):
            assert futures[tid].result(30)[0] >= 1
        with pytest.raises(error):
            futures[culprit].result(30)
    finally:
        gate.set()
        committer.close()
    assert {r[0] for r in _stored_trajectories(store)} == {"first", "a", "b", "c"}
    assert faulty.calls[1] == sorted(["a", culprit, "b", "c"])  # they were coalesced, then isolated


def test_refused_requests_are_dropped_and_the_rest_commit_together(store):
    gate = threading.Event()
    faulty = FaultyStore(store, gate)
    committer = GroupCommitter(faulty)
    try:
        committer.submit(good_trajectory("first"))
        _wait_until_blocked(faulty)
        bad1 = good_trajectory("x1")
        bad1[1]["seq"] = 3  # a gap: refused by admission, inside the coalesced append
        bad2 = good_trajectory("x2")
        bad2[2]["status"] = "done"
        subs = [committer.submit(e) for e in (good_trajectory("a"), bad1, good_trajectory("b"), bad2,
                                                good_trajectory("c"))]
        gate.set()
        assert [subs[i].result(30)[0] for i in (0, 2, 4)] == [3, 3, 3]  # committed as one group of three
        for i, rule in ((1, "seq_gap"), (3, "status")):
            with pytest.raises(ValidationError) as e:
                subs[i].result(30)
            assert e.value.rule == rule and e.value.index in (1, 2)  # located in its own request
    finally:
        gate.set()
        committer.close()
    assert len(faulty.calls) <= 4  # first, the group, minus bad1, minus bad2: never one append per request


def test_each_request_of_a_group_gets_its_own_counts(store):
    """Coalesced with retries of stored events, every request still learns exactly how
    many of its own events were new (the HTTP fuzz from eight clients once got
    ``num_appended: null`` back for such a group)."""
    gate = threading.Event()
    faulty = FaultyStore(store, gate)
    committer = GroupCommitter(faulty)
    store.append(good_trajectory("old"))
    try:
        committer.submit(good_trajectory("first"))
        _wait_until_blocked(faulty)
        subs = [committer.submit(e) for e in (good_trajectory("old"), good_trajectory("new"),
                                                good_trajectory("old") + good_trajectory("newer"))]
        gate.set()
        results = [f.result(30) for f in subs]
    finally:
        gate.set()
        committer.close()
    n = len(good_trajectory("x"))
    assert [size for size, _ in results] == [3, 3, 3]  # one coalesced append
    assert [(r.num_appended, r.num_duplicates) for _, r in results] == [(0, n), (n, 0), (n, n)]
    assert results[2][1].duplicate_indices == tuple(range(n))
