"""Payload segments: local directories and pyarrow filesystem URIs, row-selective
reads, garbage collection."""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pytest

import trajstore
from trajstore.payload import PayloadStore
from trajstore.payload._columns import binary_column, binary_chunks, column_chunks, list_column
from trajstore.demo._simulate import RolloutConfig, trajectory_events

CFG = RolloutConfig(turns=3, prompt_tokens=20, output_tokens=10, observation_tokens=4, layers=3, topk=2)


def test_store_on_a_pyarrow_filesystem_uri(tmp_path):
    """The non-local path (object storage): pyarrow's in-memory mock filesystem."""
    store = trajstore.connect(f"sqlite:///{tmp_path}/s.db", payload="mock:///bucket/run1")
    assert not store.payload.local
    for i in range(6):
        store.append(trajectory_events(CFG, i))
    stats = store.materialize()
    samples = list(store.samples())
    assert len(samples) == stats.num_samples_after >= 6
    local = trajstore.connect(f"sqlite:///{tmp_path}/l.db", payload=str(tmp_path / "local"))
    for i in range(6):
        local.append(trajectory_events(CFG, i))
    local.materialize()
    assert all(a.equals(b) for a, b in zip(samples, local.samples()))
    names = {n for n, _ in store.payload.list_names()}
    # the log segments are retired (their events re-pointed into the samples), not deleted yet
    assert names == store.log.segments_in_use(retired_before=float("-inf"))
    store.collect_garbage(grace_s=0)
    assert {n for n, _ in store.payload.list_names()} == store.log.referenced_segments()
    assert all(a.equals(b) for a, b in zip(store.samples(), local.samples()))


@pytest.mark.parametrize("suffix", [".arrow", ".parquet"])
@pytest.mark.parametrize("per", [1, 4])
def test_read_rows_reads_exactly_the_rows_asked(tmp_path, suffix, per):
    payload = PayloadStore(str(tmp_path))
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 100, rng.integers(0, 9), dtype=np.int32) for _ in range(50)]
    routes = [None if i % 7 == 0 else rng.integers(0, 255, (3, 2, 2), dtype=np.uint8) for i in range(50)]
    # ids: one chunk of 50 rows; routes: one chunk per row (binary_column)
    table = pa.table({"ids": list_column(chunks, np.int32), "routes": binary_column(routes)})
    name = payload.new_name("t", suffix)
    payload.write(name, table, rows_per_batch=per)
    if suffix == ".arrow":  # read_rows finds a row's batch by division: exactly `per` rows in each
        with pa.ipc.open_file(payload.path(name)) as f:
            sizes = [f.get_batch(i).num_rows for i in range(f.num_record_batches)]
        assert sizes == [per] * (50 // per) + ([50 % per] if 50 % per else [])
    wanted = [49, 0, 13, 14, 3]
    part = payload.read_rows(name, wanted)
    assert part.table.num_rows < 50  # only the batches holding those rows
    for r in wanted:
        row = part.row(r)
        np.testing.assert_array_equal(column_chunks(row.column("ids"), np.int32)[0], chunks[r])
        raw = binary_chunks(row.column("routes"))[0]
        if routes[r] is None:
            assert raw is None
        else:
            assert bytes(raw) == routes[r].tobytes()


def test_garbage_collection_respects_grace_and_references(tmp_path):
    payload = PayloadStore(str(tmp_path))
    for name in ("keep.arrow", "old.arrow", "new.arrow", "old.parquet.abc.tmp"):
        open(os.path.join(tmp_path, name), "wb").write(b"x")
    old = time.time() - 7200
    for name in ("keep.arrow", "old.arrow", "old.parquet.abc.tmp"):
        os.utime(os.path.join(tmp_path, name), (old, old))
    removed = payload.collect_garbage({"keep.arrow"}, grace_s=3600)
    assert sorted(removed) == ["old.arrow", "old.parquet.abc.tmp"]
    assert sorted(n for n, _ in payload.list_names()) == ["keep.arrow", "new.arrow"]


def test_missing_segment_is_a_clear_error(tmp_path):
    from trajstore.errors import CorruptStoreError

    store = trajstore.connect(f"sqlite:///{tmp_path}/s.db")
    store.append(trajectory_events(CFG, 0))
    for name, _ in store.payload.list_names():
        os.remove(store.payload.path(name))
    tid = trajectory_events(CFG, 0)[0]["trajectory_id"]
    with pytest.raises(CorruptStoreError, match="is missing"):
        store.load_generations(tid)
    # every file gone: the location is wrong, not one file: the materializer stops and
    # records nothing (docs/materializer.md, "Quarantine")
    from trajstore.errors import StoreUnavailable

    with pytest.raises(StoreUnavailable, match="holds no file"):
        store.materialize()
    assert store.materialized.unfoldable_trajectories()["count"] == 0
    # one file of several gone: that trajectory is quarantined, the others fold
    store.append(trajectory_events(CFG, 1))
    assert store.materialize().num_unfoldable == 1
    (recent,) = store.materialized.unfoldable_trajectories()["recent"]
    assert (recent["trajectory_id"], recent["error"]) == (tid, "PayloadMissingError") and "is missing" in recent["message"]


def test_bad_log_compression_refused(tmp_path):
    with pytest.raises(ValueError, match="log_compression"):
        PayloadStore(str(tmp_path), log_compression="gzip")
    store = trajstore.connect(f"sqlite:///{tmp_path}/z.db", log_compression="zstd")
    store.append(trajectory_events(CFG, 0))
    assert store.materialize().num_trajectories == 1


def test_segment_rows_decode_each_column_once_and_match_per_row_reads(tmp_path):
    """SegmentRows.lists/binaries/values (decoded once per segment, one row per
    record batch, null rows included) give what a one-row slice per row gives."""
    p = PayloadStore(str(tmp_path / "payload"))
    toks = [np.arange(7, 12, dtype=np.int32), None, np.arange(3, dtype=np.int32), np.zeros(0, np.int32)]
    raw = [np.full(6, k, np.uint8) for k in range(3)] + [None]
    table = pa.table({"ids": list_column(toks, np.int32), "routes": binary_column(raw),
                      "dtype": pa.array(["uint8", None, "uint8", "int16"])})
    p.write("events-x.arrow", table, rows_per_batch=1)
    seg = p.read_rows("events-x.arrow", [3, 0, 2, 1])
    assert seg.table.column("ids").num_chunks == 4
    for r in range(4):
        i = seg.index[r]
        one = seg.row(r)
        [want_ids], [want_raw] = column_chunks(one.column("ids"), np.int32), binary_chunks(one.column("routes"))
        got_ids, got_raw = seg.lists("ids", np.int32)[i], seg.binaries("routes")[i]
        assert (got_ids is None) == (want_ids is None) and (got_ids is None or np.array_equal(got_ids, want_ids))
        assert (got_raw is None) == (want_raw is None) and (got_raw is None or np.array_equal(got_raw, want_raw))
        assert seg.values("dtype")[i] == one.column("dtype")[0].as_py()
    assert seg.lists("ids", np.int32) is seg.lists("ids", np.int32)  # cached


@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.uint8, np.bool_, np.int64])
def test_list_column_from_buffers_keeps_nulls_casts_and_values(dtype):
    """list_column builds the column from buffers: null rows, empty rows, values cast
    as astype would (int64 / float64 / bool sources), booleans as bits; valid Arrow."""
    rng = np.random.default_rng(7)
    rows = [rng.integers(0, 2, 5).astype(np.int64), None, np.zeros(0, np.float64), rng.random(3) > 0.5,
            None, np.arange(4, dtype=np.uint8)]
    col = list_column(rows, dtype)
    col.validate(full=True)
    assert col.type == pa.large_list(pa.from_numpy_dtype(np.dtype(dtype)))
    assert col.null_count == 2
    assert col.to_pylist() == [None if r is None else r.astype(dtype).tolist() for r in rows]
    assert list_column([None, None], dtype).to_pylist() == [None, None]
    assert list_column([], dtype).to_pylist() == []
    single = list_column([np.arange(6, dtype=np.int64)[::2]], dtype)  # one strided row
    assert single.to_pylist() == [np.arange(6)[::2].astype(dtype).tolist()]
