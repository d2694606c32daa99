"""Exporting samples as a Parquet dataset anyone can read (pyarrow, DuckDB,
Polars, Hugging Face ``datasets``) with no trajstore code.

Columns carry the docs/reference.md sample field names, in plain Arrow types (docs/reference.md
"Exported columns"). Token-level fields are lists of numbers:
``routed_experts`` is a list (one entry per token of prompt + response) of
fixed-size lists ``[layers]`` of fixed-size lists ``[topk]`` of uint8/uint16,
so its type carries the layout; ``routed_experts_mask`` and ``logprobs_mask``
are lists of booleans, ``loss_mask`` a list of uint8.
Rows stream in sample order into ``part-NNNNN.parquet`` files; a new file
starts when the route layout changes (it is part of the schema).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import warnings
from typing import Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trajstore.errors import TrajstoreError
from trajstore.payload._durable import fsync_path
from trajstore.sample import Sample
from trajstore.sample._codec import sample_columns

__all__ = ["export_samples", "export_table", "routes_from_export"]

# the exported columns, in docs/reference.md order ("Exported columns")
_ORDER = ("trajectory_id", "group_id", "sample_index", "is_last_step", "status", "finish_reason",
          "prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "token_model_versions", "token_rewards",
          "logprobs_mask", "routed_experts_mask", "reward", "routed_experts", "min_model_version",
          "max_model_version")


def export_table(samples: Sequence[Sample]) -> pa.Table:
    """One Arrow table of samples that share a route layout.

    The columns are the sample segment's (``sample_columns``, the one Sample ->
    Arrow mapping) in plain types: int32 indices and versions, boolean masks,
    and routes as typed nested lists instead of raw bytes."""
    cols = sample_columns(samples, int_type=pa.int32(), bool_masks=True)
    cols["routed_experts"] = _routes_column(samples)
    return pa.table({name: cols[name] for name in _ORDER})


def _route_layout(s: Sample) -> tuple[str, int, int] | None:
    r = s.routed_experts
    return None if r is None else (r.dtype.name, r.shape[1], r.shape[2])


def _routes_column(samples: Sequence[Sample]) -> pa.Array:
    """list<fixed_size_list<fixed_size_list<uintN, topk>, layers>>, one list per sample.

    Built from one numpy buffer (the samples' routes concatenated) wrapped
    twice in FixedSizeListArray: no Python per token."""
    layout = next((_route_layout(s) for s in samples if s.routed_experts is not None), None)
    dtype, layers, topk = layout if layout is not None else ("uint8", 1, 1)
    present = [s.routed_experts.reshape(-1) for s in samples if s.routed_experts is not None]
    flat = np.concatenate(present) if present else np.zeros(0, dtype)
    per_token = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.from_numpy_dtype(np.dtype(dtype))), topk), layers)
    lengths = np.fromiter((0 if s.routed_experts is None else len(s.routed_experts) for s in samples),
                          np.int64, len(samples))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    mask = pa.array(np.fromiter((s.routed_experts is None for s in samples), np.bool_, len(samples)))
    return pa.LargeListArray.from_arrays(pa.array(offsets), per_token, mask=mask)


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
        fsync_path(tmp)
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
_PROGRESS_EVERY = 32  # samples per progress report


def _write_parts(samples: Iterable[Sample], out_dir: str, rows_per_file: int,
                 progress: Callable[[int], None] | None) -> dict[str, int]:
    files = rows = 0
    pending: list[Sample] = []
    unreported = 0  # samples read since progress was last told: reading is the slow part, not one file's write

    def flush() -> None:
        nonlocal files, rows
        if pending:
            path = os.path.join(out_dir, f"part-{files:05d}.parquet")
            pq.write_table(export_table(pending), path, compression="zstd")
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            files += 1
            rows += len(pending)
            pending.clear()

    for s in samples:
        if pending and (len(pending) >= rows_per_file or _route_layout(s) not in (_route_layout(pending[0]), None)):
            flush()
        pending.append(s)
        unreported += 1
        if progress and unreported >= _PROGRESS_EVERY:
            progress(unreported)
            unreported = 0
    flush()
    if progress and unreported:
        progress(unreported)
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
    fsync_path(os.path.dirname(out_dir))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def routes_from_export(table: pa.Table, row: int) -> np.ndarray | None:
    """Deprecated: one exported row's ``routed_experts`` as ``[P+R, layers, topk]``.

    The exported column's Arrow type now carries the layout, so
    ``np.array(table["routed_experts"][row].as_py(), dtype=...)`` (or any
    Arrow reader) gives the same array; this stays for code written when the
    column was raw bytes. None where the row has no routes.
    """
    warnings.warn("routes_from_export is deprecated: the exported routed_experts column is a nested list "
                  "of [layers][topk] expert ids any Arrow reader decodes", DeprecationWarning, stacklevel=2)
    cell = table.column("routed_experts")[row]
    if not cell.is_valid:
        return None
    tokens = cell.values                       # fixed_size_list<fixed_size_list<uint>> [P+R]
    layers = tokens.type.list_size
    topk = tokens.type.value_type.list_size
    ids = tokens.flatten().flatten().to_numpy(zero_copy_only=False)
    return ids.reshape(len(tokens), layers, topk)
