"""Sample segments: new ones are uncompressed Arrow IPC read as views of a
memory map; the Parquet/zstd ones that older stores hold still read the same."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import update

import trajstore
from trajstore.sample._codec import sample_table, samples_from_table
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.payload._columns import binary_chunks, binary_column, column_chunks, list_column, routes_from_bytes
from trajstore.payload._format import rows_per_batch
from trajstore.reader import SampleReader
from trajstore.schema import events as events_table, samples as samples_table, segments as segments_table

CFG = RolloutConfig(turns=3, prompt_tokens=30, output_tokens=20, observation_tokens=5, layers=4, topk=2,
                    mismatch_prob=0.3)


def _materialized(tmp_path, name: str, n: int = 12) -> trajstore.Store:
    store = trajstore.connect(f"sqlite:///{tmp_path}/{name}.db", payload=str(tmp_path / f"{name}-payload"))
    for i in range(n):
        store.append(trajectory_events(CFG, i))
    store.materialize()
    return store


def _as_old_parquet_segment(store: trajstore.Store) -> str:
    """Rewrite the store's sample segments as the materializer wrote them before
    (one ``.parquet`` file, zstd on every column, row groups) and point the
    index at it, as in a store written by the older version."""
    samples = list(store.samples())
    table = sample_table(samples)
    name = "samples-0of1-000000000001-000000009999.parquet"
    # small row groups (this test's samples are small) so reads pick some of them
    store.payload.write(name, table, rows_per_batch=rows_per_batch(table, 1 << 12), atomic=True)
    with store.log.write_engine.begin() as conn:
        old = [r.name for r in conn.execute(segments_table.select().where(segments_table.c.kind == "samples"))]
        conn.execute(update(segments_table).where(segments_table.c.name == old[0]).values(name=name))
        # events the materializer re-pointed into the sample rows (one copy) follow them
        row_of = {(s.trajectory_id, s.sample_index): i for i, s in enumerate(samples)}
        moved = {r.segment_row: row_of[(r.trajectory_id, r.sample_index)] for r in conn.execute(
            samples_table.select().where(samples_table.c.segment == old[0]))}
        for old_row, new_row in moved.items():
            conn.execute(update(events_table).where(events_table.c.segment == old[0])
                         .where(events_table.c.segment_row == old_row).values(segment=name, segment_row=new_row))
        for i, s in enumerate(samples):
            conn.execute(update(samples_table)
                         .where(samples_table.c.trajectory_id == s.trajectory_id)
                         .where(samples_table.c.sample_index == s.sample_index)
                         .values(segment=name, segment_row=i))
    return name


def test_new_sample_segments_are_uncompressed_arrow_read_as_views(tmp_path):
    store = _materialized(tmp_path, "new")
    names = [n for n, _ in store.payload.list_names() if n.startswith("samples-")]
    assert names and all(n.endswith(".arrow") for n in names)
    path = store.payload.path(names[0])
    with pa.memory_map(path) as src:
        reader = pa.ipc.open_file(src)
        held = sum(reader.get_batch(i).nbytes for i in range(reader.num_record_batches))
    # uncompressed: the file is at least as large as the buffers it holds (the
    # simulator's routes are consecutive ids, which any codec would shrink)
    assert held > 0 and os.path.getsize(path) >= held
    samples = list(store.samples())
    routed = [s for s in samples if s.routed_experts is not None]
    assert routed
    for s in routed:
        assert not s.routed_experts.flags.owndata and not s.routed_experts.flags.writeable  # a view of the map
    store.close()


def test_parquet_zstd_sample_segments_of_older_stores_still_read(tmp_path):
    new = _materialized(tmp_path, "new")
    old = _materialized(tmp_path, "old")
    name = _as_old_parquet_segment(old)
    meta = pq.ParquetFile(old.payload.path(name)).metadata
    codecs = {meta.row_group(g).column(c).compression for g in range(meta.num_row_groups)
              for c in range(meta.num_columns)}
    assert codecs == {"ZSTD"} and meta.num_row_groups > 1
    assert not [n for n, _ in old.payload.list_names() if n.startswith("samples-") and n.endswith(".arrow")
                and n in old.log.referenced_segments()]
    want = list(new.samples())
    got = list(old.samples())
    assert len(got) == len(want) > 12
    assert all(a.equals(b) for a, b in zip(got, want))
    with SampleReader(old, batch_size=5, read_threads=2) as reader:
        read = [s for batch in reader for s in batch]
    assert len(read) == len(want) and all(a.equals(b) for a, b in zip(read, want))
    new.close()
    old.close()


@pytest.mark.parametrize("dtype", ["uint8", "uint16"])
def test_routes_from_bytes_is_a_view_of_the_bytes(dtype):
    routes = np.arange(5 * 3 * 2, dtype=dtype).reshape(5, 3, 2)
    raw = np.frombuffer(routes.astype(np.dtype(dtype).newbyteorder("<")).tobytes(), np.uint8)
    back = routes_from_bytes(raw, dtype, 3, 2)
    assert back.shape == (5, 3, 2) and np.array_equal(back, routes) and back.base is not None
    assert routes_from_bytes(raw, dtype, 3, 2, rows=5).shape == (5, 3, 2)
    with pytest.raises(ValueError):
        routes_from_bytes(raw, dtype, 3, 2, rows=4)


def test_samples_from_a_many_chunk_table_are_views_not_copies():
    """A table of several record batches (a read of several batches) is split per
    chunk; no column is combined (which would copy the routes)."""
    rng = np.random.default_rng(0)
    store_samples = []
    from trajstore.sample import Sample

    for i in range(6):
        p, r = int(rng.integers(1, 9)), int(rng.integers(1, 9))
        store_samples.append(Sample(
            trajectory_id=f"t{i}", group_id=None if i % 2 else "g", sample_index=0, is_last_step=True,
            status="completed", prompt_ids=rng.integers(0, 100, p, dtype=np.int32),
            response_ids=rng.integers(0, 100, r, dtype=np.int32), loss_mask=np.ones(r, np.uint8),
            rollout_logprobs=-rng.random(r, dtype=np.float32), logprobs_mask=np.ones(r, np.bool_),
            token_model_versions=np.zeros(r, np.int32), finish_reason="stop", reward=1.0,
            token_rewards=None if i % 3 else rng.random(r, dtype=np.float32),
            routed_experts=None if i == 4 else rng.integers(0, 64, (p + r, 3, 2), dtype=np.uint8),
            routed_experts_mask=None if i == 4 else np.zeros(p + r, np.bool_),
            min_model_version=0, max_model_version=0))
    table = sample_table(store_samples)
    batches = [b for k in range(0, 6, 2) for b in table.slice(k, 2).combine_chunks().to_batches()]
    chunked = pa.Table.from_batches(batches)
    assert chunked.column("routed_experts").num_chunks == 3
    back = samples_from_table(chunked, [5, 0, 3])
    assert all(a.equals(b) for a, b in zip(back, [store_samples[5], store_samples[0], store_samples[3]]))
    routes = binary_chunks(chunked.column("routed_experts"))
    assert routes[4] is None and all(r.base is not None for r in routes if r is not None)
    ids = column_chunks(chunked.column("prompt_ids"), np.int32)
    assert [len(x) for x in ids] == [len(s.prompt_ids) for s in store_samples]


def test_row_views_of_sliced_columns_with_nulls():
    """One-row (and longer) slices at offsets that are not multiples of 8, over
    columns with null rows: the views read the validity bitmap at the slice's offset."""
    rng = np.random.default_rng(3)
    rows = [None if i % 3 == 1 else rng.integers(0, 50, int(rng.integers(0, 6)), dtype=np.int32) for i in range(23)]
    blobs = [None if i % 4 == 2 else rng.integers(0, 255, int(rng.integers(1, 7)), dtype=np.uint8) for i in range(23)]
    table = pa.table({"ids": pa.chunked_array([list_column(rows[:11], np.int32), list_column(rows[11:], np.int32)]),
                      "raw": binary_column(blobs)})
    for start, length in [(0, 23), (5, 1), (9, 7), (13, 1), (22, 1)]:
        part = table.slice(start, length)
        ids = column_chunks(part.column("ids"), np.int32)
        raw = binary_chunks(part.column("raw"))
        for k in range(length):
            want = rows[start + k]
            assert (ids[k] is None) == (want is None)
            if want is not None:
                assert np.array_equal(ids[k], want)
            blob = blobs[start + k]
            assert (raw[k] is None) == (blob is None)
            if blob is not None:
                assert bytes(raw[k]) == blob.tobytes()
