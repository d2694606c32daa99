"""Content digests: a generation decoded from the wire is digested right after its
parse; large appends of events passed as objects are hashed on a process-wide pool
(not a new thread per call); the pool survives fork (a child gets its own) and
idempotency still sees the same digests whichever path hashed them."""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np
import pytest

import trajstore
from trajstore._append.digests import INLINE_DIGEST_BYTES
from trajstore.errors import ConflictError


def _big(tid: str, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    n = INLINE_DIGEST_BYTES // 4 + 100  # int32 prompt over the inline threshold: hashed on the pool
    return [{"type": "trajectory_started", "trajectory_id": tid},
            {"type": "generation", "trajectory_id": tid, "seq": 0,
             "prompt_ids": rng.integers(0, 1000, n - 10, dtype=np.int32),
             "output_ids": rng.integers(0, 1000, 10, dtype=np.int32),
             "logprobs": -rng.random(10, dtype=np.float32), "model_version": 0}]


def _child_append(url: str, payload: str) -> None:
    with trajstore.connect(url, payload=payload) as s:
        s.append(_big("child", 2))


@pytest.mark.parametrize("form", ["objects", "wire"])
def test_large_appends_share_one_pool_and_stay_idempotent(tmp_path, form):
    from trajstore.events import parse_events

    def big(tid: str, seed: int) -> list:
        return parse_events(_big(tid, seed)) if form == "objects" else _big(tid, seed)

    with trajstore.connect(f"sqlite:///{tmp_path}/d.db") as s:
        for i in range(6):
            s.append(big(f"t{i}", i))
        pool_threads = {t.ident for t in threading.enumerate() if t.name.startswith("trajstore-digest")}
        assert 1 <= len(pool_threads) <= 4
        assert s.append(big("t0", 0)).num_duplicates == 2  # same digests: a retry
        assert s.append(_big("t0", 0) if form == "objects" else parse_events(_big("t0", 0))).num_duplicates == 2
        changed = big("t0", 99)
        with pytest.raises(ConflictError):
            s.append(changed)
        for i in range(6, 12):
            s.append(big(f"t{i}", i))
        # the same pool: its threads stay, and it never grows past its 4 (an executor may start one
        # of its 4 later, when a hash is submitted before a thread it has is idle again)
        after = {t.ident for t in threading.enumerate() if t.name.startswith("trajstore-digest")}
        assert pool_threads <= after and len(after) <= 4


def test_a_generation_from_the_wire_is_digested_at_its_parse(tmp_path):
    """Each generation parsed from a dict has its digest when the parse returns (hashed
    while its arrays are in cache), the same bytes ``content_hash`` gives; an event
    passed as an object is digested later, on demand; a refusal is located as before."""
    from sqlalchemy import select

    from trajstore._append.pipeline import _parse_digesting
    from trajstore.errors import ValidationError
    from trajstore.events import content_hash, parse_event
    from trajstore.schema import events

    batch = _big("w", 3) + [{"type": "reward", "trajectory_id": "w", "reward": 1.0}]
    parsed, digests = _parse_digesting(batch)
    assert set(digests.cache) == {1}
    assert digests.cache[1] == content_hash(parse_event(batch[1]))
    as_objects = [parse_event(e) for e in batch]
    _, later = _parse_digesting(as_objects)
    assert later.cache == {} and later.get(1) == digests.cache[1]
    with pytest.raises(ValidationError) as e:
        _parse_digesting(batch[:1] + [dict(batch[1], seq="x")])
    assert e.value.index == 1
    with trajstore.connect(f"sqlite:///{tmp_path}/w.db") as s:
        s.append(batch)
        with s.log.write_engine.connect() as conn:
            stored = conn.execute(select(events.c.content_hash).where(events.c.type == "generation")).scalar_one()
    assert bytes(stored) == digests.cache[1]


def test_a_forked_child_appends_with_its_own_pool(tmp_path):
    url, payload = f"sqlite:///{tmp_path}/f.db", str(tmp_path / "payload")
    with trajstore.connect(url, payload=payload) as s:
        s.append(_big("parent", 1))  # the parent's pool exists now
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_child_append, args=(url, payload))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    with trajstore.connect(url, payload=payload) as s:
        assert s.trajectory_state("child") is not None
        assert len(s.load_generations("child")) == 1


def test_events_stored_with_the_legacy_digest_still_compare(store):
    """Digests are versioned by length: events stored before XXH3 (16-byte SHA-256)
    are still recognised as identical retries, and a changed retry still conflicts."""
    from sqlalchemy import update

    from trajstore.events import _legacy_content_hash, content_hash, parse_events
    from trajstore.schema import events

    batch = _big("old", 5) + [{"type": "reward", "trajectory_id": "old", "reward": 1.0, "event_id": "r-1"}]
    store.append(batch)
    with store.log.write_engine.begin() as conn:  # as a store written before the format byte
        for ev in parse_events(batch):
            ident = f"id:{ev.event_id}" if ev.event_id else (
                f"generation:old:{ev.seq}" if ev.type == "generation" else f"{ev.type}:old")
            conn.execute(update(events).where(events.c.identity == ident)
                         .values(content_hash=_legacy_content_hash(ev)))
            assert len(content_hash(ev)) == 17 and len(_legacy_content_hash(ev)) == 16
    assert store.append(batch).num_duplicates == 3
    assert store.check(batch).num_duplicates == 3
    changed = _big("old", 6)
    with pytest.raises(ConflictError):
        store.append(changed)
    with pytest.raises(ConflictError):
        store.check(changed)
    with pytest.raises(ConflictError):
        store.append([dict(batch[-1], reward=2.0)])


def test_content_digests_are_stable_across_releases():
    """The digests stored in the log decide whether a retry is identical: the bytes
    hashed for an event must never change (values pinned from the store's format)."""
    from trajstore.events import _legacy_content_hash, content_hash, parse_events

    evs = [
        {"type": "trajectory_started", "trajectory_id": "g", "group_id": "grp", "metadata": {"b": 1, "a": [1, 2]}},
        {"type": "generation", "trajectory_id": "g", "seq": 0, "prompt_ids": np.arange(5, dtype=np.int32),
         "output_ids": np.array([7, 8, 9], np.int32), "logprobs": np.array([-0.5, -0.25, -1.0], np.float32),
         "routed_experts": (np.arange(7 * 2 * 2) % 5).astype(np.uint8).reshape(7, 2, 2), "model_version": 3,
         "finish_reason": "stop"},
        {"type": "reward", "trajectory_id": "g", "reward": 1.5, "event_id": "r-1"},
        {"type": "trajectory_finished", "trajectory_id": "g", "status": "completed"},
    ]
    pinned = [("023662b88208c3255ce23065b9fafcf748", "fdb40e49ed4b58c839b947735b3526eb"),
              ("02c735b4f8f40aba9d34fbf0a53b3168d8", "2b4e1ec19af09e1b15c8a395aa8e93f1"),
              ("02dcc2414943b6dfda64e1e1ce0450b13f", "c3483f76c2180e67baafc977b28eea91"),
              ("027a78d9ea26d780b538e145865a72664f", "70852fe8ca8fdb6a39c24cefdc91f3ea")]
    got = [(content_hash(ev).hex(), _legacy_content_hash(ev).hex()) for ev in parse_events(evs)]
    assert got == pinned


def test_a_digest_is_the_same_whatever_the_arrays_byte_order_and_layout():
    """An event passed as an object may hold big-endian or strided arrays: its digest is
    that of the same values little-endian and contiguous (what the wire's decoding gives)."""
    from trajstore.events import Generation, content_hash

    routes = (np.arange(6 * 2 * 2) % 5).astype(np.uint8).reshape(6, 2, 2)
    plain = Generation(trajectory_id="g", seq=0, prompt_ids=np.arange(5, dtype=np.int32),
                       output_ids=np.array([7, 8], np.int32), model_version=1,
                       logprobs=np.array([-0.5, -1.0], np.float32), routed_experts=routes)
    wide = np.zeros((6, 2, 4), np.uint8)
    wide[:, :, ::2] = routes
    other = Generation(trajectory_id="g", seq=0, prompt_ids=np.arange(5, dtype=">i4"),
                       output_ids=np.array([0, 7, 0, 8], np.int32)[1::2], model_version=1,
                       logprobs=np.array([-0.5, -1.0], ">f4"), routed_experts=wide[:, :, ::2])
    assert not other.output_ids.flags.c_contiguous and not other.routed_experts.flags.c_contiguous
    assert content_hash(other) == content_hash(plain)
    assert content_hash(plain).hex() != content_hash(Generation(
        trajectory_id="g", seq=0, prompt_ids=np.arange(5, dtype=np.int32), output_ids=np.array([7, 9], np.int32),
        model_version=1, logprobs=np.array([-0.5, -1.0], np.float32), routed_experts=routes)).hex()
