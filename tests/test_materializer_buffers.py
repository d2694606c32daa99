"""The materializer's fast paths give what the plain paths give (issue 12,
"materialize end to end"): routes built in one step-wide buffer and written as
a view of it, log segments read once per step (as streams when dense), and
the materializer's own SQL reads, on SQLite and PostgreSQL."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from trajstore.demo.simulate import RolloutConfig, trajectory_events
from trajstore.errors import CorruptStoreError
from trajstore.events import parse_event
from trajstore.fold import fold
from trajstore.log.base import EventLog
from trajstore.payload import PayloadStore, binary_chunks, column_chunks, list_column
from trajstore._samples import RoutesArena, routes_column, sample_table, samples_from_table

CFG = RolloutConfig(turns=3, prompt_tokens=30, output_tokens=12, observation_tokens=5, layers=3, topk=2,
                    num_experts=64, mismatch_prob=0.3, seed=5)


def _folded(arena=None):
    out = []
    for i in range(6):
        gens = [parse_event(e) for e in trajectory_events(CFG, i) if e["type"] == "generation"]
        out.append(fold(gens, trajectory_id=gens[0].trajectory_id, num_experts=64, routes_alloc=arena))
    return out


def test_routes_built_in_one_buffer_equal_the_plain_fold_and_are_written_without_a_copy():
    plain = [s for r in _folded() for s in r.samples]
    arena = RoutesArena(sum(s.routed_experts.nbytes for s in plain))
    fast = [s for r in _folded(arena) for s in r.samples]
    assert len(fast) == len(plain) > 6  # some trajectories split into several samples
    assert all(a.equals(b) for a, b in zip(fast, plain))
    assert arena.used == len(arena.buf)
    col = routes_column([s.routed_experts for s in fast])
    data = col.buffers()[2]
    assert data.address == arena.buf.ctypes.data  # a view of the buffer, not a copy
    copied = routes_column([s.routed_experts for s in plain])  # separate arrays: one copy
    assert copied.equals(col)
    # and the segment reads back the same samples
    assert all(a.equals(b) for a, b in zip(samples_from_table(sample_table(fast)), plain))


def test_routes_column_nulls_and_an_arena_too_small():
    arena = RoutesArena(10)
    a = arena((2, 2, 2), np.uint8)  # fits
    b = arena((2, 2, 2), np.uint8)  # does not: an array of its own
    a[:] = 1
    b[:] = 2
    col = routes_column([a, None, b])
    assert col.null_count == 1
    got = binary_chunks(col)
    assert got[1] is None and bytes(got[0]) == bytes(8 * [1]) and bytes(got[2]) == bytes(8 * [2])
    wide = RoutesArena(64)
    wide((1, 1, 1), np.uint8)
    w = wide((2, 1, 1), np.uint16)  # misaligned in the buffer: an array of its own
    assert w.ctypes.data % 2 == 0


def _segment(p: PayloadStore, name: str, rows: int, dtype=np.int32, per: int = 1) -> list[np.ndarray]:
    ids = [np.arange(k, k + 3 + k % 4, dtype=dtype) for k in range(rows)]
    p.write(name, pa.table({"ids": list_column(ids, dtype)}), rows_per_batch=per)
    return ids


@pytest.mark.parametrize("wanted", [[0, 1, 2, 3, 4, 5], [5, 1], [0], [97, 3, 50]])
def test_read_many_dense_and_sparse_reads_match_read_rows(tmp_path, wanted):
    p = PayloadStore(str(tmp_path))
    ids_a = _segment(p, "events-a.arrow", 100)
    ids_b = _segment(p, "events-b.arrow", 6)
    ids_c = _segment(p, "events-c.arrow", 100, np.int64, per=7)  # other types: a table of its own
    want = {"events-a.arrow": wanted, "events-b.arrow": [r for r in wanted if r < 6] or [0],
            "events-c.arrow": wanted, "events-gone.arrow": [0]}
    segs, bad = p.read_many(want)
    assert set(bad) == {"events-gone.arrow"} and isinstance(bad["events-gone.arrow"], CorruptStoreError)
    for name, ids, dt in (("events-a.arrow", ids_a, np.int32), ("events-b.arrow", ids_b, np.int32),
                          ("events-c.arrow", ids_c, np.int64)):
        one = p.read_rows(name, want[name])
        for r in want[name]:
            np.testing.assert_array_equal(segs[name].lists("ids", dt)[segs[name].index[r]], ids[r])
            np.testing.assert_array_equal(column_chunks(one.row(r).column("ids"), dt)[0], ids[r])
    assert segs["events-a.arrow"].table is segs["events-b.arrow"].table  # one table, one decode
    assert segs["events-c.arrow"].table is not segs["events-a.arrow"].table


def test_read_rows_beyond_the_segment_is_corrupt(tmp_path):
    p = PayloadStore(str(tmp_path))
    _segment(p, "events-a.arrow", 3)
    with pytest.raises(CorruptStoreError):
        p.read_rows("events-a.arrow", [0, 4])


def test_materializer_reads_equal_the_generic_ones(store):
    for i in range(5):
        evs = trajectory_events(CFG, i)
        store.append(evs if i != 3 else evs[:-1])  # one unfinished
    unfinished = trajectory_events(CFG, 3)[0]["trajectory_id"]
    store.append([{"type": "reward", "trajectory_id": unfinished, "reward": 0.5}])
    log = store.log
    for after, limit in ((0, 100), (0, 2), (5, 3)):
        assert log.finished_after(after, limit) == EventLog.finished_after(log, after, limit)
    ids = [r["trajectory_id"] for r in log.finished_after(0, 100)] + [unfinished, "none"]
    trajs, events = log.fold_inputs(ids)
    assert any(r["type"] == "reward" for r in events[unfinished])
    g_trajs, g_events = EventLog.fold_inputs(log, ids)
    assert set(trajs) == set(g_trajs) and set(events) == set(g_events) == set(ids)
    for tid in trajs:
        assert trajs[tid] == {k: g_trajs[tid][k] for k in trajs[tid]}
    for tid in events:
        assert [r["position"] for r in events[tid]] == [r["position"] for r in g_events[tid]]
        for got, want in zip(events[tid], g_events[tid]):
            for k, v in got.items():
                assert (bool(v) if isinstance(want[k], bool) else v) == want[k], (tid, k)
    stats = store.materialize()
    assert stats.num_trajectories == 4
    assert store.materialize().num_trajectories == 0
