"""Exporting samples as a Parquet dataset anyone can read (pyarrow, DuckDB, Polars).

Columns carry the SPEC sample field names. Token-level fields are lists;
``routed_experts`` is a list with one ``fixed_size_binary[layers*topk*itemsize]``
value per token (raw little-endian bytes of that token's ``[layers, topk]``
expert ids), and ``routed_experts_dtype`` / ``route_layers`` / ``route_topk``
columns say how to view it; ``routed_experts_mask`` is a list<bool>.
Rows stream in sample order into ``part-NNNNN.parquet`` files; a new file
starts when the route layout changes (the binary width is part of the schema).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trajstore.errors import TrajstoreError
from trajstore.payload import list_column
from trajstore.sample import Sample
from trajstore._samples import SAMPLE_LIST_COLUMNS

__all__ = ["export_samples", "export_table", "routes_from_export"]

# the sample segment's list columns; the route mask is exported as list<bool> instead
_LISTS = {k: v for k, v in SAMPLE_LIST_COLUMNS.items() if k != "routed_experts_mask"}


def export_table(samples: Sequence[Sample]) -> pa.Table:
    """One Arrow table of samples that share a route layout."""
    cols: dict[str, pa.Array] = {
        "trajectory_id": pa.array([s.trajectory_id for s in samples], pa.string()),
        "group_id": pa.array([s.group_id for s in samples], pa.string()),
        "sample_index": pa.array([s.sample_index for s in samples], pa.int32()),
        "is_last_step": pa.array([s.is_last_step for s in samples], pa.bool_()),
        "status": pa.array([s.status for s in samples], pa.string()),
    }
    for name, dtype in _LISTS.items():
        cols[name] = list_column([getattr(s, name) for s in samples], dtype)
    cols["reward"] = pa.array([s.reward for s in samples], pa.float64())
    cols["routed_experts"] = _routes_column(samples)
    masks = [s.routed_experts_mask for s in samples]
    cols["routed_experts_mask"] = list_column(masks, np.bool_)
    r0 = next((s.routed_experts for s in samples if s.routed_experts is not None), None)
    has = [s.routed_experts is not None for s in samples]
    cols["routed_experts_dtype"] = pa.array([r0.dtype.name if h else None for h in has], pa.string())
    cols["route_layers"] = pa.array([r0.shape[1] if h else None for h in has], pa.int32())
    cols["route_topk"] = pa.array([r0.shape[2] if h else None for h in has], pa.int32())
    cols["min_model_version"] = pa.array([s.min_model_version for s in samples], pa.int32())
    cols["max_model_version"] = pa.array([s.max_model_version for s in samples], pa.int32())
    return pa.table(cols)


def _route_layout(s: Sample) -> tuple[str, int, int] | None:
    r = s.routed_experts
    return None if r is None else (r.dtype.name, r.shape[1], r.shape[2])


def _routes_column(samples: Sequence[Sample]) -> pa.Array:
    layout = next((_route_layout(s) for s in samples if s.routed_experts is not None), None)
    if layout is None:
        return pa.nulls(len(samples), pa.large_list(pa.binary(1)))
    width = np.dtype(layout[0]).itemsize * layout[1] * layout[2]
    present = [s.routed_experts for s in samples if s.routed_experts is not None]
    data = np.concatenate([np.ascontiguousarray(r).reshape(-1).view(np.uint8) for r in present])
    values = pa.FixedSizeBinaryArray.from_buffers(pa.binary(width), len(data) // width, [None, pa.py_buffer(data)])
    lengths = np.array([0 if s.routed_experts is None else len(s.routed_experts) for s in samples], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    mask = pa.array([s.routed_experts is None for s in samples])
    return pa.LargeListArray.from_arrays(pa.array(offsets), values, mask=mask)


def routes_from_export(table: pa.Table, row: int) -> np.ndarray | None:
    """The ``[P+R, layers, topk]`` routes of one exported row (how a reader decodes them)."""
    cell = table.column("routed_experts")[row]
    if not cell.is_valid:
        return None
    dtype = np.dtype(table.column("routed_experts_dtype")[row].as_py()).newbyteorder("<")
    layers, topk = table.column("route_layers")[row].as_py(), table.column("route_topk")[row].as_py()
    values = cell.values
    raw = np.frombuffer(values.buffers()[1], np.uint8)[values.offset * values.type.byte_width:]
    return raw[: len(values) * values.type.byte_width].view(dtype).reshape(len(values), layers, topk)


def export_samples(
    samples: Iterable[Sample], out_dir: str, *, rows_per_file: int = 1024,
    progress: Callable[[int], None] | None = None, replace: bool = False,
) -> dict[str, int]:
    """Write samples to ``out_dir/part-NNNNN.parquet``; return counts.

    The dataset appears whole or not at all: the files are written into a
    hidden temporary directory beside ``out_dir`` and renamed into place at
    the end, so an interrupted export (Ctrl-C, kill -9) never leaves a
    directory that reads as a complete dataset, and no part file of an
    earlier export mixes in. An existing non-empty ``out_dir`` is an error
    unless ``replace`` (then it must hold only an earlier export's files,
    and it is swapped out atomically)."""
    out_dir = os.path.abspath(out_dir)
    _check_target(out_dir, replace)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.exporting-", dir=parent)
    try:
        counts = _write_parts(samples, tmp, rows_per_file, progress)
        _fsync_dir(tmp)
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return counts


def _check_target(out_dir: str, replace: bool) -> None:
    if not os.path.lexists(out_dir):
        return
    if not os.path.isdir(out_dir) or os.path.islink(out_dir):
        raise TrajstoreError(f"cannot export to {out_dir}: it exists and is not a directory")
    names = os.listdir(out_dir)
    if not names:
        return
    if not replace:
        raise TrajstoreError(f"{out_dir} is not empty; pass --replace (replace=True) to replace an earlier export")
    foreign = [n for n in names if not _PART.fullmatch(n)]
    if foreign:
        raise TrajstoreError(f"will not replace {out_dir}: it holds files that are not an export's "
                             f"(e.g. {sorted(foreign)[0]!r})")


_PART = re.compile(r"part-\d{5,}\.parquet")


def _write_parts(samples: Iterable[Sample], out_dir: str, rows_per_file: int,
                 progress: Callable[[int], None] | None) -> dict[str, int]:
    files = rows = 0
    pending: list[Sample] = []

    def flush() -> None:
        nonlocal files, rows
        if pending:
            path = os.path.join(out_dir, f"part-{files:05d}.parquet")
            pq.write_table(export_table(pending), path, compression="zstd")
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            files += 1
            rows += len(pending)
            if progress:
                progress(len(pending))
            pending.clear()

    for s in samples:
        if pending and (len(pending) >= rows_per_file or _route_layout(s) not in (_route_layout(pending[0]), None)):
            flush()
        pending.append(s)
    flush()
    return {"files": files, "samples": rows}


def _swap_into_place(tmp: str, out_dir: str) -> None:
    """Rename the finished export to ``out_dir``; an old one is renamed aside first, then removed."""
    old = None
    if os.path.isdir(out_dir):
        if os.listdir(out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.replaced-", dir=os.path.dirname(out_dir))
            os.rename(out_dir, os.path.join(old, "export"))
        else:
            os.rmdir(out_dir)
    os.rename(tmp, out_dir)
    _fsync_dir(os.path.dirname(out_dir))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
