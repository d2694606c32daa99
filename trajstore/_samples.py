"""Materialized samples: their payload layout and reading them back.

A sample segment (``samples-*.arrow``, uncompressed Arrow IPC) holds one row
per sample with the SPEC field names as columns; the token-level ones are
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

from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from trajstore.payload import binary_chunks, column_chunks, list_column, routes_from_bytes
from trajstore.sample import Sample

__all__ = ["sample_table", "sample_columns", "routes_column", "RoutesArena", "samples_from_table", "read_segment_samples", "load_samples",
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
        return pa.array(np.fromiter((getattr(s, name) for s in samples), np.int64, len(samples)), int_type)

    cols: dict[str, pa.Array] = {
        "trajectory_id": pa.array([s.trajectory_id for s in samples], pa.string()),
        "group_id": pa.array([s.group_id for s in samples], pa.string()),
        "sample_index": ints("sample_index"),
        "is_last_step": pa.array([s.is_last_step for s in samples], pa.bool_()),
        "status": pa.array([s.status for s in samples], pa.string()),
        "finish_reason": pa.array([s.finish_reason for s in samples], pa.string()),
        "reward": pa.array([s.reward for s in samples], pa.float64()),
        "min_model_version": ints("min_model_version"),
        "max_model_version": ints("max_model_version"),
    }
    for name, dtype in SAMPLE_LIST_COLUMNS.items():
        cols[name] = list_column([getattr(s, name) for s in samples], np.bool_ if bool_masks and name in MASK_COLUMNS
                                 else dtype)
    return cols


def sample_table(samples: Sequence[Sample]) -> pa.Table:
    """The sample segment's table: ``sample_columns`` plus the routes as one binary
    value per sample and their layout. Every column is one chunk, so that
    record batches are slices of it (no ``combine_chunks`` when writing)."""
    routes = [s.routed_experts for s in samples]
    cols: dict[str, Any] = sample_columns(samples)
    cols["routed_experts"] = routes_column(routes)
    cols["routes_dtype"] = pa.array([None if r is None else r.dtype.name for r in routes], pa.string())
    cols["route_layers"] = pa.array([None if r is None else r.shape[1] for r in routes], pa.int32())
    cols["route_topk"] = pa.array([None if r is None else r.shape[2] for r in routes], pa.int32())
    return pa.table(cols)


def routes_column(routes: Sequence[np.ndarray | None]) -> pa.Array:
    """One large_binary value per sample: each array's raw C-order bytes (None = null).

    When the arrays lie back to back in one buffer (``RoutesArena``, in this
    order) the column is a view of that buffer: the routes are not copied;
    otherwise they are copied once, into one buffer."""
    n = len(routes)
    sizes = np.fromiter((0 if r is None else r.nbytes for r in routes), np.int64, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    present = [r for r in routes if r is not None]
    data = _back_to_back(present, int(offsets[-1]))
    if data is None:
        data = np.concatenate([np.ascontiguousarray(r).reshape(-1).view(np.uint8) for r in present]) if present \
            else np.zeros(0, np.uint8)
    validity, nulls = None, n - len(present)
    if nulls:
        validity = pa.array(np.fromiter((r is not None for r in routes), np.bool_, n)).buffers()[1]
    return pa.Array.from_buffers(pa.large_binary(), n, [validity, pa.py_buffer(offsets), pa.py_buffer(data)],
                                 null_count=nulls)


def _back_to_back(arrays: Sequence[np.ndarray], nbytes: int) -> np.ndarray | None:
    """A uint8 view of the memory ``arrays`` cover, if they are C-contiguous and
    follow each other in one buffer; else None."""
    if not arrays:
        return None
    root = _root(arrays[0])
    if root.ndim != 1 or root.dtype != np.uint8 or not root.flags.c_contiguous:
        return None
    base = root.__array_interface__["data"][0]
    at = arrays[0].__array_interface__["data"][0]
    start = at - base
    for a in arrays:
        if not a.flags.c_contiguous or a.__array_interface__["data"][0] != at or _root(a) is not root:
            return None
        at += a.nbytes
    if start < 0 or at - base > len(root):
        return None
    return root[start : start + nbytes]


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class RoutesArena:
    """One buffer in which the fold builds the routes of a materialization
    step's samples, back to back in the order they are folded (``fold``'s
    ``routes_alloc``), so that the sample segment's routes column is a view of
    it (``routes_column``). A request that does not fit (or would be
    misaligned) gets an array of its own: correct, only one copy more."""

    def __init__(self, nbytes: int) -> None:
        self.buf = np.empty(max(0, int(nbytes)), np.uint8)
        self.used = 0

    def __call__(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        if self.used % dtype.alignment or self.used + n > len(self.buf):
            return np.empty(shape, dtype)
        out = self.buf[self.used : self.used + n].view(dtype).reshape(shape)
        self.used += n
        return out


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
) -> Iterator[Sample]:
    """Materialized samples in their stable order (finished position, sample index).

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
    for rows in store.materialized.iter_sample_rows(where=where, after=None, page_rows=page_rows):
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
