"""Group commit on its own (``trajstore.ingest._group_commit``): threads and a
real store on each backend, no FastAPI and no HTTP."""

from __future__ import annotations

import threading

import pytest
from helpers import finished, gen, started

from trajstore.errors import StoreUnavailable, ValidationError
from trajstore.ingest._group_commit import GroupCommitter


def _trajectory(tid: str) -> list[dict]:
    return [started(tid), gen(tid, 0, [1, 2, 3], [4, 5]), finished(tid)]


class _Gated:
    """The store, whose first append blocks until ``gate`` opens: requests queue meanwhile."""

    def __init__(self, store) -> None:
        self.store, self.gate, self.appends, self.entered = store, threading.Event(), [], threading.Event()

    def append(self, events):
        self.appends.append([ev["trajectory_id"] for ev in events])
        self.entered.set()
        if len(self.appends) == 1:
            self.gate.wait(30)
        return self.store.append(events)


def test_requests_queued_during_an_append_are_one_append_and_each_gets_its_own_counts(store):
    gated = _Gated(store)
    committer = GroupCommitter(gated)
    try:
        first = committer.submit(_trajectory("a"))
        assert gated.entered.wait(30)
        again = committer.submit(_trajectory("a"))  # a retry of the first: all duplicates
        fresh = committer.submit(_trajectory("b"))
        gated.gate.set()
        size, result = first.result(30)
        assert size == 1 and result.num_appended == 3
        (size_again, again_result), (size_fresh, fresh_result) = again.result(30), fresh.result(30)
        assert size_again == size_fresh == 2  # one coalesced append for both
        assert (again_result.num_appended, again_result.num_duplicates) == (0, 3)
        assert again_result.duplicate_indices == (0, 1, 2)  # indices within its own request
        assert (fresh_result.num_appended, fresh_result.num_duplicates) == (3, 0)
    finally:
        committer.close()
    assert gated.appends == [["a"] * 3, ["a"] * 3 + ["b"] * 3]


def test_a_refused_request_fails_alone_and_names_its_own_event(store):
    gated = _Gated(store)
    committer = GroupCommitter(gated)
    try:
        committer.submit(_trajectory("a"))
        assert gated.entered.wait(30)
        bad = _trajectory("bad")
        bad[1]["seq"] = 3  # seq must start at 0
        futures = [committer.submit(_trajectory("x")), committer.submit(bad), committer.submit(_trajectory("y"))]
        gated.gate.set()
        assert futures[0].result(30)[1].num_appended == 3 and futures[2].result(30)[1].num_appended == 3
        with pytest.raises(ValidationError) as e:
            futures[1].result(30)
        assert (e.value.index, e.value.trajectory_id) == (1, "bad")
    finally:
        committer.close()
    assert gated.appends[1:] == [["x"] * 3 + ["bad"] * 3 + ["y"] * 3, ["x"] * 3 + ["y"] * 3]
    bad[1]["seq"] = 0
    assert store.append(bad).num_appended == 3  # nothing of the refused request was stored


def test_a_group_stops_at_max_group_events_but_one_larger_request_goes_alone(store):
    gated = _Gated(store)
    committer = GroupCommitter(gated, max_group_events=4)
    try:
        committer.submit(_trajectory("a"))
        assert gated.entered.wait(30)
        big = [started("big")] + [gen("big", i, [1], [2]) for i in range(5)] + [finished("big")]
        futures = [committer.submit(_trajectory("b")), committer.submit(big), committer.submit(_trajectory("c"))]
        gated.gate.set()
        assert [f.result(30)[0] for f in futures] == [1, 1, 1]
    finally:
        committer.close()
    assert [len(a) for a in gated.appends] == [3, 3, 7, 3]


def test_close_commits_what_is_queued_then_refuses_more(store):
    gated = _Gated(store)
    committer = GroupCommitter(gated)
    committer.submit(_trajectory("a"))
    assert gated.entered.wait(30)
    queued = committer.submit(_trajectory("b"))
    closing = threading.Thread(target=committer.close)
    closing.start()
    gated.gate.set()
    closing.join(30)
    assert not closing.is_alive()
    assert queued.result(0)[1].num_appended == 3
    with pytest.raises(StoreUnavailable):
        committer.submit(_trajectory("c"))
