"""Segment I/O on the materializer's fast paths gives what the plain paths
give: routes planned by the fold and built only where the sample segment is
written (the same bytes as the plain writer's, direct I/O or not), log
segments read once per step (``PayloadStore.read_many``, as streams when
dense), sample segments mapped with huge pages. The materializer's own SQL
reads are checked in ``test_materializer.py``."""

from __future__ import annotations

import errno
import os
import uuid

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.payload import _direct, _store
from trajstore.errors import CorruptStoreError, ValidationError
from trajstore.events import parse_event
from trajstore.fold import fold
from trajstore.log.base import EventLog
from trajstore.payload import PayloadStore
from trajstore.payload._columns import binary_chunks, column_chunks, list_column
from trajstore.sample._codec import (PlannedRoutes, RoutesPlan, read_segment_samples, routes_column, sample_table,
                                samples_from_table)
from test_fold_step import EXPERTS, TID, trajectories

CFG = RolloutConfig(turns=3, prompt_tokens=30, output_tokens=12, observation_tokens=5, layers=3, topk=2,
                    num_experts=64, mismatch_prob=0.3, seed=5)


def _folded(alloc=None, cfg=CFG, num_experts=64):
    out = []
    for i in range(6):
        gens = [parse_event(e) for e in trajectory_events(cfg, i) if e["type"] == "generation"]
        out.append(fold(gens, trajectory_id=gens[0].trajectory_id, num_experts=num_experts, routes_alloc=alloc))
    return out


def _write_planned(p: PayloadStore, name: str, samples, per: int) -> list:
    deferred: list = []
    table = sample_table(samples, deferred=deferred)
    assert len(deferred) == 1 and table.column("routed_experts").chunk(0).buffers()[2].address == deferred[0].address
    p.write_samples(name, table, per, deferred=deferred)
    return deferred


@pytest.mark.parametrize("num_experts", [64, 300])  # uint8 and uint16 routes
@pytest.mark.parametrize("per", [1, 3, 100])  # record batches cut inside the routes, or one
def test_planned_routes_are_built_where_the_segment_is_written_with_the_plain_bytes(tmp_path, num_experts, per):
    plain = [s for r in _folded(num_experts=num_experts) for s in r.samples]
    fast = [s for r in _folded(RoutesPlan(), num_experts=num_experts) for s in r.samples]
    assert len(fast) == len(plain) > 6  # some trajectories split into several samples
    assert all(isinstance(s.routed_experts, PlannedRoutes) for s in fast)
    p = PayloadStore(str(tmp_path))
    [d] = _write_planned(p, "samples-fast.arrow", fast, per)
    assert d.covered()
    p.write("samples-plain.arrow", sample_table(plain), rows_per_batch=per)  # the plain writer
    assert (tmp_path / "samples-fast.arrow").read_bytes() == (tmp_path / "samples-plain.arrow").read_bytes()
    got = read_segment_samples(p, "samples-fast.arrow", range(len(plain)))
    assert all(a.equals(b) for a, b in zip(got, plain))
    assert plain[0].routed_experts.dtype == (np.uint16 if num_experts > 256 else np.uint8)


def test_planned_routes_without_a_writer_are_built_at_once():
    plain = [s for r in _folded() for s in r.samples]
    fast = [s for r in _folded(RoutesPlan()) for s in r.samples]
    assert all(a.equals(b) for a, b in zip(samples_from_table(sample_table(fast)), plain))
    assert all(np.array_equal(s.routed_experts.array(), t.routed_experts) for s, t in zip(fast, plain))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(trajectories(), st.integers(1, 4))
def test_planned_routes_of_any_trajectory_equal_the_fold(tmp_path, generations, per):
    """Merges, gaps, masked rows and rows a new sample inherits: replayed where
    the segment is written, they are the bytes the plain fold builds."""
    try:
        plain = fold(generations, trajectory_id=TID, num_experts=EXPERTS).samples
    except ValidationError:
        return
    fast = fold(generations, trajectory_id=TID, num_experts=EXPERTS, routes_alloc=RoutesPlan()).samples
    p = PayloadStore(str(tmp_path))
    name = f"samples-{uuid.uuid4().hex}.arrow"
    if any(s.routed_experts is not None for s in fast):
        _write_planned(p, name, fast, per)
    else:
        p.write_samples(name, sample_table(fast), per)
    got = read_segment_samples(p, name, range(len(plain)))
    assert all(a.equals(b) for a, b in zip(got, plain))
    p.delete(name)


def test_a_segment_image_memory_serves_the_next_write_only_once_nothing_views_it(tmp_path, monkeypatch):
    monkeypatch.setattr(_direct, "_SPARE", _direct._Spare())  # this test's own
    plain = [s for r in _folded() for s in r.samples]
    p = PayloadStore(str(tmp_path))
    first = [s for r in _folded(RoutesPlan()) for s in r.samples]
    _write_planned(p, "samples-1.arrow", first, 3)
    kept = first[0].routed_experts.array()  # a view of the first image (as the commit's counts read it)
    assert kept.base is _direct._SPARE._buf
    before = kept.copy()
    second = [s for r in _folded(RoutesPlan()) for s in r.samples][::-1]  # other bytes at those places
    _write_planned(p, "samples-2.arrow", second, 3)
    assert np.array_equal(kept, before)  # still viewed: a new image was made, this one left alone
    assert second[0].routed_experts.array().base is not kept.base
    del second, first, kept
    spare = id(_direct._SPARE._buf)  # (an id: a reference would be a view that keeps it from serving)
    third = [s for r in _folded(RoutesPlan()) for s in r.samples]
    _write_planned(p, "samples-3.arrow", third, 3)
    assert id(third[0].routed_experts.array().base) == spare  # nothing viewed the second image: it served the third
    for name, want in (("samples-1.arrow", plain), ("samples-2.arrow", plain[::-1]), ("samples-3.arrow", plain)):
        got = read_segment_samples(p, name, range(len(want)))
        assert all(a.equals(b) for a, b in zip(got, want))


def test_routes_column_nulls_and_planned_among_plain_arrays():
    plan = RoutesPlan()
    a, b = plan((2, 2, 2), np.uint8), plan((2, 2, 2), np.uint8)
    a[:] = np.ones((2, 2, 2), np.uint8)
    b[:] = np.full((2, 2, 2), 2, np.uint8)
    deferred: list = []
    col = routes_column([a, None, b], deferred=deferred)
    assert col.null_count == 1 and len(deferred) == 1
    part = np.zeros(13, np.uint8)
    deferred[0].fill(part, 3)  # any byte range: part of a sample, then a whole one
    assert part.tolist() == 5 * [1] + 8 * [2] and not deferred[0].covered()
    deferred[0].fill(np.zeros(3, np.uint8), 0)
    assert deferred[0].covered()
    c = plan((1, 2, 2), np.uint8)
    c[:] = np.full((1, 2, 2), 5, np.uint8)
    mixed = routes_column([c, np.full((1, 2, 2), 7, np.uint8)], deferred=(seen := []))
    assert not seen  # a plain array among them: all built now, one copy
    got = binary_chunks(mixed)
    assert bytes(got[0]) == bytes(4 * [5]) and bytes(got[1]) == bytes(4 * [7])


def test_a_writer_that_copies_the_placeholder_gets_the_routes_built_first(tmp_path, monkeypatch, caplog):
    plain = [s for r in _folded() for s in r.samples]
    fast = [s for r in _folded(RoutesPlan()) for s in r.samples]
    write = _direct._Image.write
    monkeypatch.setattr(_direct._Image, "write", lambda self, data: write(self, bytes(data)))  # copies all
    p = PayloadStore(str(tmp_path))
    _write_planned(p, "samples-fast.arrow", fast, 4)
    assert "not written in place" in caplog.text
    got = read_segment_samples(p, "samples-fast.arrow", range(len(plain)))
    assert all(a.equals(b) for a, b in zip(got, plain))


def test_sample_segment_written_plainly_where_direct_io_is_refused(tmp_path, monkeypatch):
    plain = [s for r in _folded() for s in r.samples]
    opened = []
    real_open = os.open

    def no_direct(path, flags, *a):
        opened.append(flags)
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "no direct I/O here")
        return real_open(path, flags, *a)

    p = PayloadStore(str(tmp_path))
    p.write_samples("samples-a.arrow", sample_table(plain), 5)
    monkeypatch.setattr(os, "open", no_direct)
    p.write_samples("samples-b.arrow", sample_table(plain), 5)
    monkeypatch.undo()
    assert any(f & getattr(os, "O_DIRECT", 0) for f in opened)
    assert (tmp_path / "samples-a.arrow").read_bytes() == (tmp_path / "samples-b.arrow").read_bytes()
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


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


def test_read_many_an_empty_or_garbled_segment_is_corrupt_and_the_others_are_read(tmp_path):
    p = PayloadStore(str(tmp_path))
    ids = _segment(p, "events-a.arrow", 4)
    (tmp_path / "events-empty.arrow").write_bytes(b"")
    (tmp_path / "events-garbled.arrow").write_bytes(b"ARROW1\0\0" + bytes(range(200)))
    good = (tmp_path / "events-a.arrow").read_bytes()
    (tmp_path / "events-cut.arrow").write_bytes(good[: len(good) // 3])
    segs, bad = p.read_many({"events-a.arrow": [3], "events-empty.arrow": [0], "events-garbled.arrow": [0],
                             "events-cut.arrow": [3]})
    assert set(bad) == {"events-empty.arrow", "events-garbled.arrow", "events-cut.arrow"}
    assert all(isinstance(e, CorruptStoreError) for e in bad.values())
    np.testing.assert_array_equal(segs["events-a.arrow"].lists("ids", np.int32)[segs["events-a.arrow"].index[3]], ids[3])


def test_sample_segments_are_mapped_with_huge_pages_log_segments_as_they_are(tmp_path, monkeypatch):
    """A sample segment (written with O_DIRECT) is first read into the page cache
    through its map: asking for huge pages there makes it 2-MB folios (payload._store._huge)."""
    asked = []
    monkeypatch.setattr(_store, "_huge", lambda m: asked.append(len(m)))
    p = PayloadStore(str(tmp_path))
    _segment(p, "events-a.arrow", 3)
    plain = [s for r in _folded() for s in r.samples]
    p.write_samples("samples-a.arrow", sample_table(plain), 4)
    p.read_many({"events-a.arrow": [0, 1, 2]})
    assert asked == []
    got = read_segment_samples(p, "samples-a.arrow", [0, 5])
    assert asked == [(tmp_path / "samples-a.arrow").stat().st_size]
    assert got[1].equals(plain[5])
