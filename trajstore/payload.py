"""Payload segments: the heavy token-level columns, in Parquet files.

One segment file per append call (group commit) or per materialization
batch. A segment is written and made durable (fsync of the file and of its
directory on local disks) *before* the SQL transaction that references it
commits, so an index row never points at a missing file. A file that no
``segments`` row names is garbage from a crashed or refused append;
``PayloadStore.collect_garbage`` removes such files once they are older than
a grace period (a live writer may be between its fsync and its commit).

Columns are built from numpy buffers with ``pa.ListArray.from_arrays`` /
binary buffers: no per-token Python objects. Routes are stored as one binary
value per row (raw little-endian uint8/uint16 bytes); their dtype and
``[layers, topk]`` live in SQL.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Iterable, Sequence
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from trajstore.errors import CorruptStoreError, StoreUnavailable

__all__ = ["PayloadStore", "list_column", "binary_column", "column_chunks"]

_COMPRESSION = "zstd"


def list_column(chunks: Sequence[np.ndarray | None], dtype: np.dtype) -> pa.Array:
    """A list<dtype> column from per-row numpy arrays (None = null row)."""
    lengths = np.fromiter((0 if c is None else len(c) for c in chunks), dtype=np.int64, count=len(chunks))
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    present = [c for c in chunks if c is not None]
    values = np.concatenate(present).astype(dtype, copy=False) if present else np.zeros(0, dtype=dtype)
    mask = None
    if any(c is None for c in chunks):
        mask = pa.array(np.fromiter((c is None for c in chunks), dtype=bool, count=len(chunks)))
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values), mask=mask)


def binary_column(chunks: Sequence[np.ndarray | None]) -> pa.Array:
    """A large_binary column holding each array's raw C-order bytes."""
    sizes = np.fromiter((0 if c is None else c.nbytes for c in chunks), dtype=np.int64, count=len(chunks))
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    data = np.empty(int(offsets[-1]), dtype=np.uint8)
    for c, lo, hi in zip(chunks, offsets[:-1], offsets[1:]):
        if c is not None and hi > lo:
            data[lo:hi] = np.ascontiguousarray(c).reshape(-1).view(np.uint8)
    validity = None
    nulls = np.fromiter((c is None for c in chunks), dtype=bool, count=len(chunks))
    if nulls.any():
        validity = pa.array(~nulls).buffers()[1]
    return pa.Array.from_buffers(
        pa.large_binary(), len(chunks), [validity, pa.py_buffer(offsets), pa.py_buffer(data)],
        null_count=int(nulls.sum()),
    )


def column_chunks(column: pa.ChunkedArray | pa.Array, dtype: np.dtype) -> list[np.ndarray | None]:
    """Per-row numpy views of a list column (zero-copy where Arrow allows)."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(arr) == 0:
        return []
    offsets = np.asarray(arr.offsets)
    values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    valid = np.asarray(arr.is_valid())
    return [values[lo:hi] if ok else None for lo, hi, ok in zip(offsets[:-1], offsets[1:], valid)]


def binary_chunks(column: pa.ChunkedArray | pa.Array) -> list[memoryview | None]:
    """Per-row byte views of a binary column."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if len(arr) == 0:
        return []
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset: arr.offset + len(arr) + 1]
    data = arr.buffers()[2]
    data_np = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    valid = np.asarray(arr.is_valid())
    return [data_np[lo:hi] if ok else None for lo, hi, ok in zip(offsets[:-1], offsets[1:], valid)]


@dataclass
class PayloadStore:
    """Where segment files live: a local directory or any pyarrow filesystem URI."""

    location: str

    def __post_init__(self) -> None:
        parsed = urlparse(self.location)
        if parsed.scheme and len(parsed.scheme) > 1 and parsed.scheme != "file":
            self.fs, self.root = pafs.FileSystem.from_uri(self.location)
            self.local = False
        else:
            path = parsed.path if parsed.scheme == "file" else self.location
            self.fs, self.root = pafs.LocalFileSystem(), os.path.abspath(path)
            self.local = True
        try:
            self.fs.create_dir(self.root, recursive=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot create payload directory {self.location!r}: {e}") from None

    def path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def new_name(self, kind: str) -> str:
        return f"{kind}-{time.strftime('%Y%m%d')}-{uuid.uuid4().hex}.parquet"

    def write(self, name: str, table: pa.Table, *, atomic: bool = False) -> int:
        """Write ``table`` durably as segment ``name``; return its size in bytes.

        ``atomic``: write to a temporary name and rename, for segments whose
        name is deterministic and may be rewritten (with the same bytes) while
        a reader has the old file open."""
        path = self.path(name)
        try:
            if self.local:
                target = path + f".{uuid.uuid4().hex}.tmp" if atomic else path
                with open(target, "wb") as f:
                    pq.write_table(table, f, compression=_COMPRESSION, use_dictionary=False,
                                   write_statistics=False)
                    f.flush()
                    os.fsync(f.fileno())
                    size = f.tell()
                if atomic:
                    os.replace(target, path)
                _fsync_dir(self.root)
                return size
            with self.fs.open_output_stream(path) as out:
                pq.write_table(table, out, compression=_COMPRESSION, use_dictionary=False, write_statistics=False)
                return out.tell()
        except OSError as e:
            raise StoreUnavailable(f"cannot write payload segment {path!r}: {e}") from None

    def read(self, name: str, columns: Iterable[str] | None = None) -> pa.Table:
        path = self.path(name)
        try:
            if self.local:
                return pq.read_table(path, columns=list(columns) if columns else None, memory_map=True)
            return pq.read_table(path, columns=list(columns) if columns else None, filesystem=self.fs)
        except FileNotFoundError:
            raise CorruptStoreError(f"payload segment {path!r} is missing") from None
        except (OSError, pa.ArrowInvalid) as e:
            raise CorruptStoreError(f"payload segment {path!r} is unreadable: {e}") from None

    def delete(self, name: str) -> None:
        try:
            self.fs.delete_file(self.path(name))
        except FileNotFoundError:
            pass

    def list_names(self) -> list[tuple[str, float]]:
        """(name, modification time) of every segment file."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        return [
            (i.base_name, i.mtime.timestamp() if i.mtime else 0.0)
            for i in infos
            if i.type == pafs.FileType.File and i.base_name.endswith((".parquet", ".tmp"))
        ]

    def collect_garbage(self, referenced: set[str], *, grace_s: float = 3600.0) -> list[str]:
        """Delete unreferenced segment files older than ``grace_s``; return their names."""
        now = time.time()
        removed = []
        for name, mtime in self.list_names():
            if name not in referenced and now - mtime >= grace_s:
                self.delete(name)
                removed.append(name)
        return removed


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
