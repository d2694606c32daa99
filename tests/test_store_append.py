"""``Store.append``: every SPEC validation and idempotency rule, on SQLite and
a real PostgreSQL (the ``store`` fixture runs both); a batch that starts its
trajectories is admitted without reading the index first, with the same outcome."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trajstore.errors import ConflictError, ContentionError, StoreUnavailable, ValidationError
from trajstore.events._wire import encode_b64, encode_npy_b64
from tests.helpers import finished, gen, reward, routes, snapshot, started


def _base(tid="t1", **kw):
    return [started(tid, num_experts=8, **kw), gen(tid, 0, [1, 2, 3], [4, 5], logprobs=[-0.1, -0.2],
                                                   routed_experts=routes(4, 2, 2))]


def refused(store, batch, rule, index=None):
    before = snapshot(store)
    with pytest.raises(ValidationError) as info:
        store.append(batch)
    err = info.value
    assert err.rule == rule, str(err)
    if index is not None:
        assert err.index == index, str(err)
        assert f"event {index}" in str(err)
    assert "\n" not in str(err)
    assert snapshot(store) == before, "a refused append changed the store"
    return err


BAD_GENERATIONS = [
    ("seq_gap", dict(seq=2)),
    ("length_mismatch", dict(logprobs=[-0.1])),
    ("length_mismatch", dict(loss_mask=[1, 1, 1])),
    ("length_mismatch", dict(token_rewards=[0.5])),
    ("negative_token_id", dict(prompt_ids=[1, -2, 3, 4, 5])),
    ("negative_token_id", dict(output_ids=[-1])),
    ("non_integer_expert", dict(routed_experts=np.full((6, 2, 2), 1.5))),
    ("expert_id_range", dict(routed_experts=routes(6, 2, 2, value=8))),
    ("expert_id_range", dict(routed_experts=routes(6, 2, 2, value=-1, dtype=np.int64))),
    ("routes_shape", dict(routed_experts=routes(6, 2, 3))),
    ("routes_shape", dict(routed_experts=routes(6, 3, 2))),
    ("too_many_route_rows", dict(routed_experts=routes(8, 2, 2))),
    ("too_many_route_rows", dict(routed_experts=routes(7, 2, 2))),  # a row for the last token too (v5: exactly)
    ("too_many_route_rows", dict(routed_experts=routes(6, 2, 2), routed_experts_start=2)),
    # v5: rows must reach position len(prompt)+len(output)-2 (here 5)
    ("too_few_route_rows", dict(routed_experts=routes(5, 2, 2))),
    ("too_few_route_rows", dict(routed_experts=routes(2, 2, 2))),  # only the output's rows: misaligned
    ("too_few_route_rows", dict(routed_experts=routes(3, 2, 2), routed_experts_start=2)),
    ("non_finite", dict(logprobs=[float("nan"), -0.1])),
    ("non_finite", dict(logprobs=[-0.1, float("-inf")])),
    ("non_finite", dict(reward=float("inf"))),
    ("non_finite", dict(token_rewards=[0.0, float("nan")])),
    ("reward_mode", dict(reward=1.0, token_rewards=[0.0, 1.0])),
    ("loss_mask", dict(loss_mask=[2, 1])),
    ("missing_field", dict(model_version=None)),
    ("array_encoding", dict(routed_experts="not base64 !!")),
    ("array_encoding", dict(routed_experts={"b64": "AAAA", "dtype": "uint8"})),
    ("array_shape", dict(routed_experts={"b64": encode_b64(routes(6, 2, 2))["b64"], "dtype": "uint8", "shape": [6, 2, 3]})),
]


@pytest.mark.parametrize("rule,change", BAD_GENERATIONS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD_GENERATIONS)])
def test_bad_generation_refused_and_store_unchanged(store, rule, change):
    store.append(_base())
    event = gen("t1", 1, [1, 2, 3, 4, 5], [6, 7], logprobs=[-0.3, -0.4], routed_experts=routes(6, 2, 2))
    event.update(change)
    if change.get("model_version", 0) is None:
        del event["model_version"]
    # the bad event is the second of the batch: the first (valid) one must not be stored either
    refused(store, [started("t9"), event], rule, index=1)


def test_unknown_and_finished_trajectories_refused(store):
    refused(store, [gen("nope", 0, [1], [2])], "unknown_trajectory", index=0)
    store.append(_base() + [finished("t1")])
    refused(store, [gen("t1", 1, [1, 2, 3, 4, 5], [6])], "finished_trajectory", index=0)
    refused(store, [reward("t1", 1.0)], "finished_trajectory", index=0)


def test_mixing_scalar_and_token_rewards_refused(store):
    store.append([started("t1"), gen("t1", 0, [1], [2], reward=1.0)])
    refused(store, [gen("t1", 1, [1, 2], [3], token_rewards=[1.0])], "reward_mode", index=0)


def test_missing_skipped_route_rows_refused(store):
    store.append([started("t1"), gen("t1", 0, [1, 2, 3], [4], routed_experts=routes(3))])
    # mismatch (new prompt) that claims rows below position 2 exist: they do not agree
    refused(store, [gen("t1", 1, [9, 9, 9], [4], routed_experts=routes(1), routed_experts_start=2)],
            "missing_route_rows", index=0)
    # first event cannot skip rows at all
    refused(store, [started("t2"), gen("t2", 0, [1, 2, 3], [4], routed_experts=routes(1), routed_experts_start=2)],
            "missing_route_rows", index=1)
    # a mismatch whose prompt agrees on the skipped positions is accepted
    store.append([gen("t1", 1, [1, 2, 7], [8], routed_experts=routes(1), routed_experts_start=2)])


def test_wire_level_errors_name_the_event(store):
    refused(store, [started("a"), {"type": "bogus", "trajectory_id": "a"}], "unknown_type", index=1)
    refused(store, [started("a"), {"type": "generation", "seq": 0}], "trajectory_id", index=1)
    refused(store, [started("a"), finished("a", status="done")], "status", index=1)
    refused(store, ["not an object"], "not_object", index=0)
    refused(store, [started("a", num_experts=0)], "num_experts", index=0)


def test_all_three_array_encodings_store_the_same_routes(store):
    r = routes(4, 2, 2)
    for tid, enc in (("list", r.tolist()), ("b64", encode_b64(r)), ("npy", encode_npy_b64(r)), ("np", r)):
        store.append([started(tid), gen(tid, 0, [1, 2, 3], [4, 5], routed_experts=enc, prompt_ids=encode_b64(np.array([1, 2, 3], np.int32)) if tid == "b64" else [1, 2, 3])])
        (g,) = store.load_generations(tid)
        assert g.routed_experts.dtype == np.uint8
        np.testing.assert_array_equal(g.routed_experts, r)
        np.testing.assert_array_equal(g.prompt_ids, [1, 2, 3])


def test_identical_retry_is_a_noop(store):
    batch = _base() + [reward("t1", 0.5), finished("t1")]
    first = store.append(batch)
    assert first.num_appended == 4
    before = snapshot(store)
    again = store.append(batch)
    assert (again.num_appended, again.num_duplicates) == (0, 4)
    assert snapshot(store) == before


def test_retry_by_event_id_with_other_encoding_is_a_noop(store):
    r = routes(4, 2, 2)
    store.append([started("t1", event_id="s1"), gen("t1", 0, [1, 2, 3], [4, 5], routed_experts=r.tolist(), event_id="g1")])
    before = snapshot(store)
    res = store.append([gen("t1", 0, [1, 2, 3], [4, 5], routed_experts=encode_npy_b64(r), event_id="g1")])
    assert res.num_duplicates == 1 and snapshot(store) == before


def test_conflicting_duplicate_refused(store):
    store.append([started("t1"), gen("t1", 0, [1], [2], event_id="g1")])
    err = refused(store, [gen("t1", 0, [1], [3], event_id="g1")], "conflict", index=0)
    assert isinstance(err, ConflictError) and "g1" in str(err)
    refused(store, [gen("t1", 0, [1], [3])], "seq_taken", index=0)  # other content at a taken seq
    refused(store, [started("t1", group_id="other")], "conflict", index=0)


def test_duplicate_inside_one_batch(store):
    e = gen("t1", 0, [1], [2])
    res = store.append([started("t1"), e, dict(e)])
    assert (res.num_appended, res.num_duplicates) == (2, 1)
    with pytest.raises(ConflictError):
        store.append([started("t2"), gen("t2", 0, [1], [2]), gen("t2", 0, [1], [3])])


def test_batch_with_one_bad_event_stores_nothing(store):
    good = [started(f"t{i}") for i in range(5)] + [gen(f"t{i}", 0, [1, 2], [3]) for i in range(5)]
    bad = gen("t3", 1, [1, 2, 3], [4], logprobs=[math.nan])
    refused(store, good + [bad] + [finished("t0")], "non_finite", index=10)
    assert store.info()["head_position"] == 0


def test_reward_without_event_id_replaces_and_retry_after_finish_is_noop(store):
    store.append([started("t1"), reward("t1", 0.1), reward("t1", 0.7), finished("t1")])
    rows = store.log.load_trajectories(["t1"])["t1"]
    assert rows["reward"] == pytest.approx(0.7)
    assert store.append([reward("t1", 0.7)]).num_duplicates == 1
    refused(store, [reward("t1", 0.2)], "finished_trajectory", index=0)


def test_positions_are_consecutive_and_ordered(store):
    a = store.append(_base("a"))
    b = store.append(_base("b") + [finished("b")])
    assert (a.last_position, b.last_position) == (2, 5)
    rows = store.log.read_events(after_position=0, limit=100)
    assert [r["position"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["trajectory_id"] for r in rows] == ["a", "a", "b", "b", "b"]


def test_merged_prompt_and_seen_routes_are_not_stored_twice(store):
    """Storage grows with tokens, not turns x tokens: a merged call stores only its new tail and new route rows."""
    p0 = list(range(100))
    store.append([started("t1"), gen("t1", 0, p0, [100, 101], routed_experts=routes(101))])
    store.append([gen("t1", 1, p0 + [100, 101, 102], [103], routed_experts=routes(103))])
    rows = [r for r in store.log.trajectory_events(["t1"])["t1"] if r["type"] == "generation"]
    assert [r["prefix_len"] for r in rows] == [0, 102]
    assert [r["num_route_rows_sent"] for r in rows] == [101, 103]
    assert [r["num_route_rows"] for r in rows] == [101, 2]
    g = store.load_generations("t1")
    np.testing.assert_array_equal(g[1].prompt_ids, p0 + [100, 101, 102])
    assert g[1].routed_experts_start == 101


def test_uint16_routes_kept_compact(store):
    store.append([started("t1", num_experts=300), gen("t1", 0, [1, 2], [3], routed_experts=routes(2, value=299, dtype=np.int64))])
    (g,) = store.load_generations("t1")
    assert g.routed_experts.dtype == np.uint16 and int(g.routed_experts.max()) == 299


def test_endless_write_races_give_up_with_the_reason(store, monkeypatch):
    """A writer that loses every optimistic-concurrency race stops with one line saying why."""
    from trajstore.log.base import StaleState

    def always_stale(*args, **kwargs):
        raise StaleState("trajectory 't1' changed concurrently")

    monkeypatch.setattr(store.log, "commit_append", always_stale)
    with pytest.raises(ContentionError, match="gave up after 20 .*'t1' changed concurrently") as info:
        store.append([started("t1"), gen("t1", 0, [1, 2], [3])])
    # retriable, not a refusal of the events
    assert isinstance(info.value, StoreUnavailable) and not isinstance(info.value, ValidationError)
    monkeypatch.undo()
    assert store.info()["head_position"] == 0
    assert store.payload.list_names() == []  # each lost attempt deleted its segment


def test_payload_is_synced_before_the_commit_and_a_failed_sync_stores_nothing(store, monkeypatch):
    """The segment's fsync overlaps the index statements, but the commit waits for it:
    when it finishes no row referencing the segment is visible yet; when it fails,
    the append raises StoreUnavailable, stores nothing and deletes the segment."""
    real = type(store.payload).make_durable
    seen = []

    def checked(self, name):
        real(self, name)
        seen.append((name, store.log.head_position()))  # another connection: only committed rows

    monkeypatch.setattr(type(store.payload), "make_durable", checked)
    store.append(_base("t1"))
    ((name, head_when_synced),) = seen
    assert head_when_synced == 0 and store.info()["head_position"] == 2
    assert [n for n, _ in store.payload.list_names()] == [name]

    def failing(self, name):
        raise StoreUnavailable(f"cannot sync payload segment {name!r}: [Errno 5] Input/output error")

    monkeypatch.setattr(type(store.payload), "make_durable", failing)
    before = snapshot(store)
    with pytest.raises(StoreUnavailable, match="cannot sync payload segment"):
        store.append(_base("t2"))
    assert snapshot(store) == before
    assert [n for n, _ in store.payload.list_names()] == [name]  # the refused append's file is gone
    monkeypatch.undo()
    assert store.append(_base("t2")).num_appended == 2


# ----------------------------------------------------------------------------
# A batch that starts every trajectory it touches is admitted without reading the
# index first (its trajectories and identities are expected absent; the unique keys
# check that at commit). Whatever the log already holds, the outcome is the one the
# reading path gives: duplicates found, conflicts refused, nothing half-written.


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
            gen(tid, 1, [1, 2, 3, 4, 5, 6], [7], routed_experts=routes(6, 2, 2).tolist())]


def _referenced_files_only(store) -> None:
    assert {n for n, _ in store.payload.list_names()} == store.log.referenced_segments()


def test_a_batch_starting_its_trajectories_does_not_read_the_index(store, reads):
    r = store.append(_batch("a") + _batch("b"))
    assert (r.num_appended, r.num_duplicates) == (6, 0)
    assert reads == []
    # a batch continuing a trajectory reads its state as before
    r = store.append([gen("a", 2, [1, 2, 3, 4, 5, 6, 7, 8], [9], routed_experts=routes(8, 2, 2).tolist())])
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
