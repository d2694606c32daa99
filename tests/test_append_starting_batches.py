"""A batch that starts every trajectory it touches is admitted without reading the
index first (its trajectories and identities are expected absent; the unique keys
check that at commit). Whatever the log already holds, the outcome is the one the
reading path gives: duplicates found, conflicts refused, nothing half-written."""

from __future__ import annotations

import pytest

from helpers import gen, routes, snapshot, started
from trajstore.errors import ConflictError, ValidationError


@pytest.fixture
def reads(store):
    """How many times the append read the index state (a spy around the real read)."""
    real = store.log.load_append_state
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    store.log.load_append_state = counted
    return calls


def _batch(tid: str, **started_kw) -> list[dict]:
    return [started(tid, **started_kw),
            gen(tid, 0, [1, 2, 3], [4, 5], routed_experts=routes(4, 2, 2).tolist()),
            gen(tid, 1, [1, 2, 3, 4, 5, 6], [7], routed_experts=routes(7, 2, 2).tolist())]


def _referenced_files_only(store) -> None:
    assert {n for n, _ in store.payload.list_names()} == store.log.referenced_segments()


def test_a_batch_starting_its_trajectories_does_not_read_the_index(store, reads):
    r = store.append(_batch("a") + _batch("b"))
    assert (r.num_appended, r.num_duplicates) == (6, 0)
    assert reads == []
    # a batch continuing a trajectory reads its state as before
    r = store.append([gen("a", 2, [1, 2, 3, 4, 5, 6, 7, 8], [9], routed_experts=routes(9, 2, 2).tolist())])
    assert r.num_appended == 1 and len(reads) == 1
    assert store.trajectory_state("a").last_seq == 2 and store.trajectory_state("b").last_seq == 1
    assert [g.seq for g in store.load_generations("b")] == [0, 1]


def test_an_identical_retry_is_all_duplicates_and_leaves_no_file(store, reads):
    first = store.append(_batch("a"))
    before = snapshot(store)
    again = store.append(_batch("a"))
    assert (again.num_appended, again.num_duplicates, again.duplicate_indices) == (0, 3, (0, 1, 2))
    assert again.last_position is None and first.last_position == before["head"]
    assert snapshot(store) == before  # the first attempt's segment file was deleted
    assert len(reads) == 1  # the attempt after the lost race read the index
    _referenced_files_only(store)


def test_a_started_trajectory_sent_again_with_new_events_stores_only_the_new(store):
    store.append(_batch("a")[:1])
    r = store.append(_batch("a"))
    assert (r.num_appended, r.num_duplicates, r.duplicate_indices) == (2, 1, (0,))
    assert store.trajectory_state("a").last_seq == 1
    _referenced_files_only(store)


def test_a_trajectory_started_again_differently_is_refused_and_nothing_is_stored(store):
    store.append(_batch("a")[:1])
    before = snapshot(store)
    with pytest.raises(ConflictError) as e:
        store.append(_batch("b") + _batch("a", group_id="g2"))
    assert e.value.index == 3 and e.value.trajectory_id == "a"
    assert snapshot(store) == before


def test_an_event_id_taken_by_another_trajectory_is_a_conflict(store):
    store.append([started("a", event_id="e1")])
    before = snapshot(store)
    with pytest.raises(ConflictError):
        store.append([started("b", event_id="e1")])
    assert snapshot(store) == before


def test_a_refused_event_in_a_starting_batch_stores_nothing(store):
    batch = _batch("a")
    batch[2]["seq"] = 5  # a gap
    with pytest.raises(ValidationError) as e:
        store.append(batch)
    assert e.value.rule == "seq_gap" and e.value.index == 2
    assert snapshot(store)["counts"]["events"] == 0
    _referenced_files_only(store)


@pytest.mark.parametrize("same", [True, False])
def test_writers_racing_to_start_one_trajectory(store_url, tmp_path, same):
    """Several stores (one connection pool each) start the same trajectory at once,
    every one skipping the read: exactly one stores it; the others see their batch as
    a duplicate (same content) or a conflict (different content), never a driver error."""
    import threading

    import trajstore

    n = 4
    stores = [trajstore.connect(store_url, payload=str(tmp_path / "payload")) for _ in range(n)]
    barrier = threading.Barrier(n)
    outcomes: list = [None] * n

    def run(k: int) -> None:
        batch = _batch("t") if same else _batch("t", group_id=f"g{k}")
        barrier.wait()
        try:
            outcomes[k] = stores[k].append(batch)
        except Exception as e:  # noqa: BLE001 - recorded and asserted below
            outcomes[k] = e

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.close()  # each deletes its unused reserve files
    stored = [o for o in outcomes if not isinstance(o, Exception) and o.num_appended == 3]
    assert len(stored) == 1, outcomes
    others = [o for o in outcomes if o is not stored[0]]
    if same:
        assert all(not isinstance(o, Exception) and (o.num_appended, o.num_duplicates) == (0, 3)
                   for o in others), outcomes
    else:
        assert all(isinstance(o, ConflictError) for o in others), outcomes
    with trajstore.connect(store_url, payload=str(tmp_path / "payload")) as after:
        assert snapshot(after)["counts"]["events"] == 3
        assert [g.seq for g in after.load_generations("t")] == [0, 1]
        _referenced_files_only(after)  # the losers' segment files were deleted
