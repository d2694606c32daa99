"""Materialized samples: their payload layout and reading them back.

A sample segment (``samples-*.arrow``, uncompressed Arrow IPC) holds one row
per sample with the docs/reference.md field names as columns; the token-level ones are
Arrow lists, routes one binary value per sample (raw little-endian bytes)
with ``routes_dtype``, ``route_layers``, ``route_topk`` beside them, and the
masks ``routed_experts_mask`` and ``logprobs_mask`` list<uint8> (read back as
bool views). Segments written before were Parquet with zstd (``.parquet``);
they are read the same way. The SQL ``samples`` table indexes them for
filtering and ordering.

Reading is zero-copy on a local store: the file is memory-mapped and every
array of a ``Sample`` is a read-only view of the page cache (routes included);
the per-sample Python work is a few slices. ``sample_columns`` is the one
Sample -> Arrow mapping, shared with the Parquet export (``inspect/export.py``).
"""

from __future__ import annotations

import bisect
import mmap
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from trajstore.payload._columns import (binary_chunks, column_chunks, list_column, routes_from_bytes, scalar_column,
                                        string_column)
from trajstore.sample import Sample

__all__ = ["sample_table", "sample_columns", "routes_column", "RoutesPlan", "PlannedRoutes", "DeferredRoutes", "samples_from_table", "read_segment_samples", "load_samples",
           "iter_samples", "token_chunks", "READ_CHUNK_TOKENS", "SAMPLE_LIST_COLUMNS", "MASK_COLUMNS",
           "SAMPLE_BATCH_BYTES"]

# list columns of a sample segment and their numpy dtypes
SAMPLE_LIST_COLUMNS: dict[str, type] = {
    "prompt_ids": np.int32,
    "response_ids": np.int32,
    "loss_mask": np.uint8,
    "rollout_logprobs": np.float32,
    "logprobs_mask": np.uint8,
    "token_model_versions": np.int32,
    "token_rewards": np.float32,
    "routed_experts_mask": np.uint8,
}
MASK_COLUMNS = ("logprobs_mask", "routed_experts_mask")
"""Boolean per-token masks: list<uint8> in a sample segment, list<bool> in an export."""

SAMPLE_BATCH_BYTES = 16 << 20
"""Target size of a sample segment's record batches (the materializer writes them)."""

_SCALARS = ("trajectory_id", "group_id", "sample_index", "is_last_step", "status", "finish_reason", "reward",
            "min_model_version", "max_model_version")


def sample_columns(samples: Sequence[Sample], *, int_type: pa.DataType = pa.int64(),
                   bool_masks: bool = False) -> dict[str, pa.Array]:
    """Every field of ``samples`` but the routes, as Arrow columns named by field.

    Integer fields (sample index, model versions) are ``int_type``; the masks
    are list<uint8>, or list<bool> with ``bool_masks``. Lists are built from
    the numpy buffers (no per-token Python). Routes are laid out differently
    by each user: binary values in a sample segment (``sample_table``), typed
    nested lists in an export."""
    def ints(name: str) -> pa.Array:
        return scalar_column([getattr(s, name) for s in samples], int_type)

    cols: dict[str, pa.Array] = {
        "trajectory_id": string_column([s.trajectory_id for s in samples]),
        "group_id": string_column([s.group_id for s in samples]),
        "sample_index": ints("sample_index"),
        "is_last_step": scalar_column([s.is_last_step for s in samples], pa.bool_()),
        "status": string_column([s.status for s in samples]),
        "finish_reason": string_column([s.finish_reason for s in samples]),
        "reward": scalar_column([s.reward for s in samples], pa.float64()),
        "min_model_version": ints("min_model_version"),
        "max_model_version": ints("max_model_version"),
    }
    for name, dtype in SAMPLE_LIST_COLUMNS.items():
        cols[name] = list_column([getattr(s, name) for s in samples], np.bool_ if bool_masks and name in MASK_COLUMNS
                                 else dtype)
    return cols


def sample_table(samples: Sequence[Sample], *, deferred: list | None = None) -> pa.Table:
    """The sample segment's table: ``sample_columns`` plus the routes as one binary
    value per sample and their layout. Every column is one chunk, so that
    record batches are slices of it (no ``combine_chunks`` when writing).

    Routes planned by a ``RoutesPlan`` are not built here: with a ``deferred``
    list, the routes column's bytes are a placeholder and the ``DeferredRoutes``
    that fills them is appended to it, for the writer
    (``PayloadStore.write_samples(deferred=)``); without one they are built now."""
    routes = [s.routed_experts for s in samples]
    cols: dict[str, Any] = sample_columns(samples)
    cols["routed_experts"] = routes_column(routes, deferred=deferred)
    cols["routes_dtype"] = string_column([None if r is None else r.dtype.name for r in routes])
    cols["route_layers"] = scalar_column([None if r is None else r.shape[1] for r in routes], pa.int32())
    cols["route_topk"] = scalar_column([None if r is None else r.shape[2] for r in routes], pa.int32())
    return pa.table(cols)


def routes_column(routes: Sequence[Any], *, deferred: list | None = None) -> pa.Array:
    """One large_binary value per sample: each array's raw C-order bytes (None = null).

    The arrays are copied once, into one buffer. When every one of them is
    planned (``PlannedRoutes``) and a ``deferred`` list is given, nothing is
    copied: the column's data is a placeholder of the right size, and the
    ``DeferredRoutes`` appended to ``deferred`` writes the bytes where the
    writer wants them."""
    n = len(routes)
    present = [r for r in routes if r is not None]
    planned = sum(isinstance(r, PlannedRoutes) for r in present)
    if planned and (deferred is None or planned < len(present)):
        routes = [r.array() if isinstance(r, PlannedRoutes) else r for r in routes]
        present = [r for r in routes if r is not None]
        planned = 0
    sizes = np.fromiter((0 if r is None else r.nbytes for r in routes), np.int64, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if planned:
        later = DeferredRoutes(routes, offsets)
        assert deferred is not None
        deferred.append(later)
        data = later.buffer
    elif present:
        data = pa.py_buffer(np.concatenate([np.ascontiguousarray(r).reshape(-1).view(np.uint8) for r in present]))
    else:
        data = pa.py_buffer(np.zeros(0, np.uint8))
    validity, nulls = None, n - len(present)
    if nulls:
        validity = pa.py_buffer(np.packbits(np.fromiter((r is not None for r in routes), np.bool_, n),
                                            bitorder="little"))
    return pa.Array.from_buffers(pa.large_binary(), n, [validity, pa.py_buffer(offsets), data], null_count=nulls)


class RoutesPlan:
    """``routes_alloc`` for ``fold`` that builds no routes yet: each sample's
    routes are a ``PlannedRoutes`` recording the fold's assignments (views of
    the log segments' memory-mapped rows, the fill of masked rows, the rows a
    new sample inherits from the previous one). The sample segment's writer
    replays them straight into the file's bytes (``DeferredRoutes``), so the
    routes are copied once, from the log's pages to the segment, and no
    step-wide buffer is filled before."""

    def __call__(self, shape: tuple[int, ...], dtype: Any) -> "PlannedRoutes":
        return PlannedRoutes(tuple(int(x) for x in shape), np.dtype(dtype))


class PlannedRoutes:
    """A sample's routes as the fold's assignments to them, in order: ``place(out)``
    replays them into an (uninitialised) array, which gives the bytes the fold
    would have built in it. Supports what the fold does to its routes array:
    assignment to a slice or a boolean mask, and slicing (``_PlannedRows``)."""

    __slots__ = ("shape", "dtype", "ops", "out")
    ndim = 3

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.shape = shape
        self.dtype = dtype
        self.ops: list[tuple[Any, Any]] = []
        self.out: np.ndarray | None = None  # where it was last placed

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.ops.append((key, value))

    def __getitem__(self, key: slice) -> "_PlannedRows":
        if not isinstance(key, slice):
            # not a TypeError: the materializer would take it for a fact about the trajectory's data
            raise NotImplementedError(f"planned routes are sliced by row ranges, not by {type(key).__name__}")
        return _PlannedRows(self, key)

    def place(self, out: np.ndarray) -> np.ndarray:
        """Build the routes in ``out`` (shape and dtype of these routes)."""
        for key, value in self.ops:
            out[key] = value.array() if isinstance(value, _PlannedRows) else value
        self.out = out
        return out

    def array(self) -> np.ndarray:
        """The routes as an array: where they were placed, else a new one."""
        return self.out if self.out is not None else self.place(np.empty(self.shape, self.dtype))


class _PlannedRows:
    """Rows ``key`` of planned routes (what a new sample inherits from the previous one)."""

    __slots__ = ("routes", "key")

    def __init__(self, routes: PlannedRoutes, key: slice) -> None:
        self.routes, self.key = routes, key

    def array(self) -> np.ndarray:
        return self.routes.array()[self.key]


class DeferredRoutes:
    """The bytes of a routes column of planned routes, built only when written.

    ``buffer`` is the column's data: a placeholder of the right size (an
    untouched anonymous map: it costs no memory, and reads as zeros should
    anything read it). The segment writer recognises its address and calls
    ``fill(dest, start)`` for bytes ``[start, start + len(dest))`` instead of
    copying it (``payload._direct.write_arrow_segment``), and checks with ``covered``
    that every byte was filled that way."""

    def __init__(self, routes: Sequence[PlannedRoutes | None], offsets: np.ndarray) -> None:
        self.routes = list(routes)
        self.offsets = offsets.tolist()
        self.size = self.offsets[-1]
        self._map = mmap.mmap(-1, max(1, self.size))
        self.buffer = pa.py_buffer(self._map).slice(0, self.size)
        self.address = self.buffer.address
        self._filled: list[tuple[int, int]] = []

    def fill(self, dest: np.ndarray, start: int) -> None:
        """Write bytes ``[start, start + len(dest))`` of the column's data into ``dest`` (uint8)."""
        stop = start + len(dest)
        offsets = self.offsets
        i = max(0, bisect.bisect_right(offsets, start) - 1)
        while i < len(self.routes) and offsets[i] < stop:
            r, lo, hi = self.routes[i], offsets[i], offsets[i + 1]
            if r is not None and hi > lo:
                if start <= lo and hi <= stop:  # the whole sample: built in place
                    r.place(dest[lo - start : hi - start].view(r.dtype).reshape(r.shape))
                else:  # part of it (a batch's padding reaches into the next sample)
                    a, b = max(lo, start), min(hi, stop)
                    dest[a - start : b - start] = r.array().reshape(-1).view(np.uint8)[a - lo : b - lo]
            i += 1
        self._filled.append((start, stop))

    def covered(self) -> bool:
        """Whether ``fill`` wrote every byte of the column."""
        at = 0
        for lo, hi in sorted(self._filled):
            if lo > at:
                return False
            at = max(at, hi)
        return at >= self.size


def samples_from_table(table: pa.Table, rows: Sequence[int] | None = None) -> list[Sample]:
    """Sample objects for ``rows`` (default: every row) of (part of) a sample segment,
    in that order. Arrays are views of the table's buffers, whatever its chunking."""
    n = table.num_rows
    rows = range(n) if rows is None else rows
    names = set(table.schema.names)
    lists = {name: column_chunks(table.column(name), dt) for name, dt in SAMPLE_LIST_COLUMNS.items() if name in names}
    raw_routes = binary_chunks(table.column("routed_experts"))
    py = {name: table.column(name).to_pylist() for name in _SCALARS if name in names}
    # Segments written before logprobs_mask / finish_reason existed: nonzero logprobs
    # were reported (an exact 0.0 cannot be told apart), finish reasons unknown.
    if "logprobs_mask" not in lists:
        lists["logprobs_mask"] = [None if lp is None else (lp != 0).view(np.uint8) for lp in lists["rollout_logprobs"]]
    finish = py.get("finish_reason") or [None] * n
    dtypes, layers, topks = (table.column(c).to_pylist() for c in ("routes_dtype", "route_layers", "route_topk"))
    out = []
    for i in rows:
        mask = lists["routed_experts_mask"][i]
        raw = raw_routes[i]
        out.append(Sample(
            trajectory_id=py["trajectory_id"][i],
            group_id=py["group_id"][i],
            sample_index=py["sample_index"][i],
            is_last_step=py["is_last_step"][i],
            status=py["status"][i],
            prompt_ids=lists["prompt_ids"][i],
            response_ids=lists["response_ids"][i],
            loss_mask=lists["loss_mask"][i],
            rollout_logprobs=lists["rollout_logprobs"][i],
            logprobs_mask=lists["logprobs_mask"][i].view(np.bool_),
            token_model_versions=lists["token_model_versions"][i],
            finish_reason=finish[i],
            reward=py["reward"][i],
            token_rewards=lists["token_rewards"][i],
            routed_experts=None if raw is None or dtypes[i] is None else routes_from_bytes(
                raw, dtypes[i], layers[i], topks[i]),
            routed_experts_mask=None if mask is None else mask.view(np.bool_),
            min_model_version=py["min_model_version"][i],
            max_model_version=py["max_model_version"][i],
        ))
    return out


def iter_samples(
    store,
    *,
    status: str | Sequence[str] | None = None,
    min_model_version: int | None = None,
    max_model_version: int | None = None,
    group_id: str | None = None,
    trajectory_ids: Iterable[str] | None = None,
    page_rows: int = 256,
    projection: str | None = None,
) -> Iterator[Sample]:
    """Materialized samples in their stable order (finished position, sample index);
    ``projection``: the samples of that named projection instead of the default ones.

    ``min_model_version`` keeps samples whose oldest token is at least that
    version; ``max_model_version`` those whose newest token is at most that.
    Memory stays bounded: index rows are read ``page_rows`` at a time, and
    their payload is decoded a run of at most ``READ_CHUNK_TOKENS`` tokens at a
    time (not the whole page: 256 long samples with routes are hundreds of MB)."""
    where = {
        "status": status,
        "min_model_version": min_model_version,
        "max_model_version": max_model_version,
        "group_id": group_id,
        "trajectory_ids": list(trajectory_ids) if trajectory_ids is not None else None,
    }
    index = store.materialized if projection is None else store.materialized.projection(projection)
    for rows in index.iter_sample_rows(where=where, after=None, page_rows=page_rows):
        for chunk in token_chunks(rows, READ_CHUNK_TOKENS):
            yield from load_samples(store, chunk)


READ_CHUNK_TOKENS = 65_536
"""Tokens of sample payload ``iter_samples`` decodes at once (about 26 MB with 48x8 routes)."""


def token_chunks(rows: Sequence[dict[str, Any]], max_tokens: int) -> Iterator[Sequence[dict[str, Any]]]:
    """Consecutive runs of sample rows holding at most ``max_tokens`` tokens each
    (a longer sample is a run of its own)."""
    start, tokens = 0, 0
    for i, r in enumerate(rows):
        n = int(r["prompt_len"]) + int(r["response_len"])
        if i > start and tokens + n > max_tokens:
            yield rows[start:i]
            start, tokens = i, 0
        tokens += n
    if start < len(rows):
        yield rows[start:]


def read_segment_samples(payload, segment: str, segment_rows: Sequence[int]) -> list[Sample]:
    """The samples at ``segment_rows`` of one sample segment, in that order.

    Only the record batches (row groups) holding them are read; their arrays
    are views of the read buffers (``Table.take`` would copy every selected
    row, routes included), of the memory-mapped file for an Arrow segment."""
    part = payload.read_rows(segment, segment_rows)
    return samples_from_table(part.table, [part.index[r] for r in segment_rows])


def load_samples(store, rows: Sequence[dict[str, Any]]) -> list[Sample]:
    """Samples for SQL sample rows, in the rows' order, reading each segment once."""
    by_segment: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_segment.setdefault(r["segment"], []).append(i)
    out: list[Sample | None] = [None] * len(rows)
    for name, idx in by_segment.items():
        for i, s in zip(idx, read_segment_samples(store.payload, name, [rows[i]["segment_row"] for i in idx])):
            out[i] = s
    return out  # type: ignore[return-value]
