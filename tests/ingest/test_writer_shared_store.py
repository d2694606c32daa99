"""``Writer``s made from the same store URL in one process share one ``Store`` and its one
group committer (reference-counted: the last writer's close closes them), on each backend:
each writer's close flushes its own calls, and one writer's refused event never fails another's."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from helpers import gen, started

import trajstore
from trajstore.errors import ValidationError
from trajstore.ingest import _group_commit, sinks
from trajstore.ingest.client import Writer


# The store_url these fixtures connect first thing (a store's first connect migrates it): a
# copy of the migrated template (tests/conftest.py).
STORE_URL_CONNECTED_BY = ("url",)


@pytest.fixture
def url(store_url, tmp_path):
    # the payload location is recorded at creation; the writers open the store by URL alone
    trajstore.connect(store_url, payload=str(tmp_path / "payload")).close()
    assert not sinks._STORES
    yield store_url
    assert not sinks._STORES, "a writer's store was left open"


def _stored(url: str, tids: list[str]) -> dict[str, list[str]]:
    """Each trajectory's stored event types, read through a store of its own."""
    with trajstore.connect(url) as s:
        return {t: [r["type"] for r in rows] for t, rows in s.log.trajectory_events(tids).items()}


def _users(store) -> tuple[int, int]:
    """(writers sharing ``store``, users of its one group committer)."""
    return sinks._STORES[store.url][1], _group_commit._SHARED[id(store)][2]


def test_writers_of_one_url_share_one_store_and_one_committer(url):
    w1, w2 = Writer(url, flush_interval_s=0.01), Writer(url, flush_interval_s=0.01)
    store = w1._sink.store
    assert w2._sink.store is store
    w1.put(started("a"))
    w2.put(started("b"))
    w1.flush()
    w2.flush()
    committer = _group_commit._SHARED[id(store)][1]
    assert w1._sink._committer is committer and w2._sink._committer is committer
    assert _users(store) == (2, 2)
    assert committer.num_requests == 2  # both writers' batches went through it
    w1.close()
    w2.close()
    assert id(store) not in _group_commit._SHARED
    assert _stored(url, ["a", "b"]) == {"a": ["trajectory_started"], "b": ["trajectory_started"]}


def test_closing_one_writer_flushes_its_calls_and_leaves_the_other_working(url):
    w1, w2 = Writer(url, flush_interval_s=5.0), Writer(url, flush_interval_s=5.0)
    store = w1._sink.store
    w2.put(started("b"))
    w2.flush()
    w1.put(started("a"))
    w1.put(gen("a", 0, [1, 2], [3]))  # queued: the 5 s linger has not run out
    w1.close()  # sends its own queued calls before it lets go of the shared store
    assert _stored(url, ["a"]) == {"a": ["trajectory_started", "generation"]}
    assert _users(store) == (1, 1)
    with pytest.raises(trajstore.TrajstoreError, match="writer is closed"):
        w1.put(gen("a", 1, [1, 2, 3], [4]))
    w2.put(gen("b", 0, [5], [6]))
    w2.close()  # the last user: the committer and the store close
    assert not sinks._STORES and id(store) not in _group_commit._SHARED
    assert _stored(url, ["b"]) == {"b": ["trajectory_started", "generation"]}
    w3 = Writer(url)  # a later writer opens the store again
    assert w3._sink.store is not store
    w3.put(gen("b", 1, [5, 6], [7]))
    w3.close()
    assert _stored(url, ["b"])["b"][-1] == "generation"


def test_a_refused_event_fails_only_its_own_writer(url):
    good, bad = Writer(url, flush_interval_s=0.02), Writer(url, flush_interval_s=0.02)
    tids = [f"g{i}" for i in range(8)]
    go = threading.Barrier(2)

    def write_good() -> None:
        go.wait()
        for t in tids:
            good.put(started(t))
            good.put(gen(t, 0, [1, 2], [3]))
        good.flush()

    thread = threading.Thread(target=write_good)
    thread.start()
    go.wait()
    bad.put(started("x"))
    bad.put(gen("x", 3, [1], [2]))  # seq 3 after none: refused
    bad.put(gen("nobody", 0, [1], [2]))  # no trajectory_started: refused
    with pytest.raises(ValidationError):
        bad.flush()
    thread.join()
    good.flush()  # nothing of the other writer's refusals reaches it
    assert good.errors == [] and good.num_acked == 2 * len(tids)
    good.close()
    bad.close()
    stored = _stored(url, tids + ["x", "nobody"])
    assert all(stored[t] == ["trajectory_started", "generation"] for t in tids)
    assert not stored.get("x") and not stored.get("nobody")  # a refused trajectory is dropped whole


def test_writers_opened_at_once_on_many_threads_open_one_store(url):
    writers: list[Writer] = []
    lock = threading.Lock()
    go = threading.Barrier(6)

    def open_one() -> None:
        go.wait()
        w = Writer(url)
        with lock:
            writers.append(w)

    threads = [threading.Thread(target=open_one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(w._sink.store) for w in writers}) == 1
    store = writers[0]._sink.store
    for i, w in enumerate(writers):
        w.put(started(f"m{i}"))
    for i, w in enumerate(writers):
        w.close()
        assert (store.url in sinks._STORES) == (i < len(writers) - 1)
    assert sorted(_stored(url, [f"m{i}" for i in range(6)])) == [f"m{i}" for i in range(6)]


def test_a_store_passed_by_the_caller_is_not_shared_nor_closed_by_the_writer(url):
    with trajstore.connect(url) as s:
        w = Writer(s)
        w.put(started("own"))
        w.close()
        assert not sinks._STORES
        assert s.log.trajectory_events(["own"])["own"][0]["type"] == "trajectory_started"  # still open


def test_a_forked_child_opens_a_store_of_its_own(url):
    w = Writer(url)
    w.put(started("parent"))
    w.flush()  # the parent's store and its committer are in use
    pid = os.fork()
    if pid == 0:  # the child: a writer of the same URL must not reach the parent's committer
        code = 1
        signal.alarm(30)  # a child stuck on the parent's committer dies instead of hanging the test
        try:
            child = Writer(url)
            code = 0 if child._sink.store is not w._sink.store else 2
            child.put(started("child"))
            child.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    w.close()
    assert sorted(_stored(url, ["parent", "child"])) == ["child", "parent"]
