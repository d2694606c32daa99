"""A log segment's blocks allocated ahead of its write (``PayloadStore.write(at_least=...)``):
the file holds exactly what was written, whatever the hint."""

from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow as pa
import pytest

from trajstore.payload import PayloadStore
from trajstore.payload._columns import binary_column, list_column
from trajstore.payload._durable import preallocate


def _table(rows: int = 6) -> tuple[pa.Table, int]:
    rng = np.random.default_rng(3)
    routes = [rng.integers(0, 128, (200 + 50 * i, 48, 8), dtype=np.uint8) for i in range(rows)]
    ids = [rng.integers(0, 32_000, 250 + i, dtype=np.int32) for i in range(rows)]
    table = pa.table({"output_ids": list_column(ids, np.int32), "routes": binary_column(routes)})
    return table, sum(r.nbytes for r in routes)


def _files(root: str) -> dict[str, bytes]:
    return {name: open(os.path.join(root, name), "rb").read() for name in os.listdir(root)
            if name.startswith("events-")}


@pytest.mark.parametrize("hint", ["routes", "beyond", "none"])
def test_a_preallocated_segment_is_byte_equal_to_a_plain_one(tmp_path, hint):
    table, routes_bytes = _table()
    plain, ahead = PayloadStore(str(tmp_path / "plain")), PayloadStore(str(tmp_path / "ahead"))
    name = "events-20261129-0123456789abcdef0123456789abcdef.arrow"
    size = plain.write(name, table, rows_per_batch=1)
    at_least = {"routes": routes_bytes, "beyond": 4 * size, "none": 0}[hint]
    assert ahead.write(name, table, rows_per_batch=1, at_least=at_least) == size
    assert os.path.getsize(os.path.join(ahead.root, name)) == size
    assert _files(ahead.root) == _files(plain.root)
    back = ahead.read_rows(name, range(table.num_rows)).table
    assert back.column("routes").to_pylist() == table.column("routes").to_pylist()
    plain.close()
    ahead.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fallocate is Linux's")
def test_preallocate_allocates_the_blocks_before_the_write(tmp_path):
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if not preallocate(fd, 4 << 20):
            pytest.skip("this filesystem has no fallocate")
        st = os.fstat(fd)
        assert st.st_size == 4 << 20 and st.st_blocks * 512 >= 4 << 20
    finally:
        os.close(fd)


def test_a_log_compressed_segment_is_not_preallocated(tmp_path):
    """A compressed file may be smaller than the raw bytes: the hint is not used (nothing to truncate)."""
    table, routes_bytes = _table()
    p = PayloadStore(str(tmp_path / "z"), log_compression="zstd")
    name = "events-20261129-fedcba9876543210fedcba9876543210.arrow"
    size = p.write(name, table, rows_per_batch=1, at_least=routes_bytes)
    assert size < routes_bytes  # smaller than the raw bytes: a preallocated file would need cutting back
    assert os.path.getsize(os.path.join(p.root, name)) == size
    assert p.read_rows(name, [0]).table.num_rows == 1
    p.close()
