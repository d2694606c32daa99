"""Arrow columns from numpy buffers and back, and ``SegmentRows`` (rows read from segments).

Columns are built from numpy buffers with ``pa.Array.from_buffers``: no
per-token Python objects. Routes are stored as one binary value per row (raw
little-endian uint8/uint16 bytes) with their dtype and ``[layers, topk]``
beside them (in SQL for the log, in columns of the sample segment);
``routes_from_bytes`` turns such a value back into its array.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

__all__ = ["list_column", "scalar_column", "string_column", "binary_column", "column_chunks", "binary_chunks", "routes_from_bytes", "SegmentRows",
           "shared_rows"]


def list_column(chunks: Sequence[np.ndarray | None], dtype: np.dtype) -> pa.Array:
    """A large_list<dtype> column from per-row numpy arrays (None = null row).

    Built from buffers (``pa.Array.from_buffers``): the rows are concatenated
    once, cast to ``dtype`` as ``astype`` would, and the offsets, validity
    bitmap and values handed to Arrow without another copy or conversion (no
    ``pa.array``, no compute kernel for the mask: ~0.15 ms per column less)."""
    dtype = np.dtype(dtype)
    n = len(chunks)
    value_type = pa.from_numpy_dtype(dtype)
    list_type = pa.large_list(value_type)
    present = [c for c in chunks if c is not None]
    if not present:
        return pa.nulls(n, list_type)
    lengths = np.fromiter((0 if c is None else len(c) for c in chunks), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(present, dtype=dtype, casting="unsafe") if len(present) > 1 \
        else present[0].astype(dtype, copy=False).reshape(-1)
    if dtype == np.bool_:  # Arrow booleans are bits
        data = pa.py_buffer(np.packbits(values.view(np.uint8), bitorder="little"))
    else:
        data = pa.py_buffer(np.ascontiguousarray(values))
    child = pa.Array.from_buffers(value_type, len(values), [None, data], null_count=0)
    validity, nulls = None, n - len(present)
    if nulls:
        valid = np.fromiter((c is not None for c in chunks), dtype=bool, count=n)
        validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(list_type, n, [validity, pa.py_buffer(offsets)], null_count=nulls, children=[child])


def _validity(values: Sequence[Any]) -> tuple[Any, int, np.ndarray | None]:
    valid = np.fromiter((v is not None for v in values), np.bool_, len(values))
    nulls = len(values) - int(valid.sum())
    return (pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None), nulls, (valid if nulls else None)


def scalar_column(values: Sequence[Any], type_: pa.DataType) -> pa.Array:
    """A column of Python scalars (None = null) of a numeric or boolean ``type_``, built from
    buffers. (``pa.array`` imports pandas on its first call, ~0.3 s: the first fold step of
    a process paid it.)"""
    validity, nulls, valid = _validity(values)
    dtype = np.bool_ if pa.types.is_boolean(type_) else type_.to_pandas_dtype()
    data = np.fromiter((0 if v is None else v for v in values), dtype, len(values)) if nulls \
        else np.fromiter(values, dtype, len(values))
    buf = pa.py_buffer(np.packbits(data, bitorder="little") if dtype is np.bool_ else data)
    return pa.Array.from_buffers(type_, len(values), [validity, buf], null_count=nulls)


def string_column(values: Sequence[str | None]) -> pa.Array:
    """A string column (None = null) built from its buffers (no ``pa.array``: see ``scalar_column``)."""
    validity, nulls, _ = _validity(values)
    encoded = [b"" if v is None else v.encode() for v in values]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, encoded), np.int32, len(encoded)), out=offsets[1:])
    return pa.Array.from_buffers(pa.string(), len(encoded), [validity, pa.py_buffer(offsets),
                                                             pa.py_buffer(b"".join(encoded))], null_count=nulls)


def binary_column(chunks: Sequence[np.ndarray | None]) -> pa.ChunkedArray:
    """A large_binary column holding each array's raw C-order bytes.

    Zero-copy: each row is its own one-value chunk over the array's memory
    (routes are the bulk of the payload; copying them would double the memory
    an append needs)."""
    parts = []
    for c in chunks:
        if c is None:
            parts.append(pa.nulls(1, pa.large_binary()))
            continue
        c = np.ascontiguousarray(c)
        offsets = pa.py_buffer(np.array([0, c.nbytes], dtype=np.int64))
        parts.append(pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, pa.py_buffer(c.reshape(-1).view(np.uint8))]))
    return pa.chunked_array(parts, type=pa.large_binary())


def column_chunks(column: pa.ChunkedArray | pa.Array, dtype: np.dtype) -> list[np.ndarray | None]:
    """Per-row numpy views of a list column (None = null row).

    Zero-copy: taken chunk by chunk straight from the Arrow buffers (no
    ``combine_chunks``, which copies; no compute kernel per chunk)."""
    dtype = np.dtype(dtype)
    out: list[np.ndarray | None] = []
    chunks = _chunks(column)
    if not chunks:
        return out
    # the value type is the column's: checked once, not per chunk
    direct = dtype != np.bool_ and chunks[0].type.value_type == pa.from_numpy_dtype(dtype)
    for arr in chunks:
        bufs = arr.buffers()  # [validity, offsets, child validity, child values]
        if direct and bufs[2] is None:  # no null value (no child validity bitmap)
            data = bufs[3]
            values = np.frombuffer(data, dtype)[arr.values.offset:] if data is not None else np.zeros(0, dtype)
        else:  # another value type (an older segment), or null values: convert
            values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
        out.extend(_split(arr, values, bufs))
    return out


def binary_chunks(column: pa.ChunkedArray | pa.Array) -> list[np.ndarray | None]:
    """Per-row uint8 views of a (large) binary column (None = null row), zero-copy."""
    out: list[np.ndarray | None] = []
    for arr in _chunks(column):
        bufs = arr.buffers()
        data = bufs[2]
        out.extend(_split(arr, np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8), bufs))
    return out


def _chunks(column: pa.ChunkedArray | pa.Array) -> list[pa.Array]:
    return column.chunks if isinstance(column, pa.ChunkedArray) else [column]


_WIDE_OFFSETS = frozenset({pa.large_list(pa.int8()).id, pa.large_binary().id, pa.large_string().id})


def _split(arr: pa.Array, values: np.ndarray, bufs: list[pa.Buffer | None] | None = None) -> list[np.ndarray | None]:
    """``values`` cut at the offsets of a list / binary array (32- or 64-bit offsets).
    ``bufs``: ``arr.buffers()`` if the caller has them."""
    n = len(arr)
    if n == 0:
        return []
    if bufs is None:
        bufs = arr.buffers()
    wide = arr.type.id in _WIDE_OFFSETS
    off = arr.offset
    if n == 1:  # the log's segments hold one row per record batch
        lo, hi = np.frombuffer(bufs[1], np.int64 if wide else np.int32, 2, off * (8 if wide else 4)).tolist()
        views: list[np.ndarray | None] = [values[lo:hi]]
    else:
        offsets = np.frombuffer(bufs[1], np.int64 if wide else np.int32)[off: off + n + 1].tolist()
        views = [values[lo:hi] for lo, hi in zip(offsets[:-1], offsets[1:])]
    if arr.null_count:  # the validity bitmap, LSB first (no compute kernel)
        bits = np.unpackbits(np.frombuffer(bufs[0], np.uint8), bitorder="little")
        views = [v if ok else None for v, ok in zip(views, bits[off: off + n].tolist())]
    return views


def routes_from_bytes(raw: Any, dtype: str, layers: int, topk: int, rows: int | None = None) -> np.ndarray:
    """Routes ``[rows, layers, topk]`` viewing ``raw``, the raw little-endian bytes
    of a binary route value (a view: no copy). ``rows`` None: as many as the bytes
    hold; else they must hold exactly that many."""
    flat = np.frombuffer(raw, dtype=_little_endian(dtype))
    return flat.reshape(-1 if rows is None else int(rows), int(layers), int(topk))


@functools.cache
def _little_endian(dtype: str) -> np.dtype:
    """The little-endian numpy dtype named ``dtype`` (made once per name: a fold views
    every call's routes)."""
    return np.dtype(dtype).newbyteorder("<")


@dataclass
class SegmentRows:
    """Some rows of one segment: ``table`` holds them, ``index`` maps a segment
    row number to its row in ``table``."""

    table: pa.Table
    index: dict[int, int]
    _decoded: dict[tuple[str, Any], list[Any]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def row(self, segment_row: int) -> pa.Table:
        return self.table.slice(self.index[segment_row], 1)

    def has(self, name: str) -> bool:
        names = self._decoded.get(("", "names"))
        if names is None:
            names = self._decoded[("", "names")] = self.table.schema.names
        return name in names

    def lists(self, name: str, dtype: Any) -> list[np.ndarray | None]:
        """``column_chunks`` of list column ``name`` over the whole table, decoded
        once and cached (index it with ``index[segment_row]``): per-row views, no copy."""
        key = (name, np.dtype(dtype).str)
        if key not in self._decoded:
            column = self.table.column(name)
            if column.num_chunks > 1:
                # a log segment has one row per record batch: one chunk per row. Token
                # columns are small (the routes are not decoded here): one copy into
                # one chunk costs less than decoding each chunk apart
                column = column.combine_chunks()
            self._decoded[key] = column_chunks(column, dtype)
        return self._decoded[key]

    def lists_of(self, spec: tuple[tuple[str, Any], ...]) -> tuple[list[np.ndarray | None], ...]:
        """``lists(name, dtype)`` of every ``(name, dtype)`` in ``spec``, cached as one
        entry (a caller indexing several columns per row looks them up once)."""
        key = ("*", spec)
        got = self._decoded.get(key)
        if got is None:
            got = self._decoded[key] = tuple(self.lists(name, dtype) for name, dtype in spec)
        return got

    def binaries(self, name: str) -> list[np.ndarray | None]:
        """``binary_chunks`` of binary column ``name``, decoded once and cached."""
        key = (name, None)
        if key not in self._decoded:
            self._decoded[key] = binary_chunks(self.table.column(name))
        return self._decoded[key]

    def values(self, name: str) -> list[Any]:
        """The Python values of scalar column ``name``, converted once and cached."""
        key = (name, "py")
        if key not in self._decoded:
            self._decoded[key] = self.table.column(name).to_pylist()
        return self._decoded[key]


def shared_rows(members: Sequence[tuple[str, pa.Schema, list[pa.RecordBatch], dict[int, int]]]
                ) -> dict[str, SegmentRows]:
    """``SegmentRows`` of several segments over one table (their batches end to end)
    and one cache of decoded columns (``members`` share one schema)."""
    table = pa.Table.from_batches([b for _, _, bs, _ in members for b in bs],
                                  schema=members[0][1].remove_metadata())
    shared: dict[tuple[str, Any], list[Any]] = {}
    out: dict[str, SegmentRows] = {}
    at = 0
    for name, _, batches, index in members:
        seg = SegmentRows(table, {r: at + i for r, i in index.items()})
        seg._decoded = shared  # same table, same decoded columns
        out[name] = seg
        at += sum(b.num_rows for b in batches)
    return out
