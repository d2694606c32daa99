"""Payload segments: the heavy token-level columns, in Arrow IPC and Parquet files.

Two kinds of segment, named by prefix: the event log's (``events-*``, one
per append call, group commit or compaction) and the materializer's sample segments
(``samples-*``, one per materialization batch). A segment is written and
made durable (fsync of the file and of its directory on local disks)
*before* the SQL transaction that references it commits, so an index row
never points at a missing file. A file that no ``segments`` row names is
garbage from a crashed or refused append; ``PayloadStore.collect_garbage``
removes such files once they are older than a grace period (a live writer
may be between its fsync and its commit).
Which files are still needed (``Store.collect_garbage``: named by an index
row, or retired within the grace) is the index's to say (docs/log.md, "One
copy").

Columns are built from numpy buffers with ``pa.ListArray.from_arrays`` /
binary buffers: no per-token Python objects. Routes are stored as one binary
value per row (raw little-endian uint8/uint16 bytes) with their dtype and
``[layers, topk]`` beside them (in SQL for the log, in columns of the sample
segment); ``routes_from_bytes`` turns such a value back into its array.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import mmap
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from trajstore._pools import LazyPool
from trajstore.errors import CorruptStoreError, PayloadMissingError, StoreUnavailable, first_line

log = logging.getLogger(__name__)

__all__ = ["PayloadStore", "SegmentRows", "list_column", "binary_column", "column_chunks", "binary_chunks",
           "routes_from_bytes", "rows_per_batch", "fsync_dir", "write_arrow_segment", "filesystem_of", "is_uri"]

# Sample segments (``samples-*.arrow``) are uncompressed Arrow IPC: the reader maps
# them and hands out views, and zstd on near-random route ids saved ~13% of the
# bytes for most of the materializer's CPU (docs/benchmarks.md, "Sample segments").
_SAMPLE_COMPRESSION: str | None = None
# Sample segments written before that were Parquet with zstd on every column;
# they are still read, and a ``.parquet`` segment is still written this way.
_PARQUET_COMPRESSION = "zstd"
_CODECS = (None, "lz4", "zstd")


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
    flat = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    return flat.reshape(-1 if rows is None else int(rows), int(layers), int(topk))


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


def is_uri(location: str) -> bool:
    """A filesystem URI (``s3://...``, ``gs://...``), not a local path (``file://`` is local)."""
    scheme = urlparse(location).scheme
    return bool(scheme) and len(scheme) > 1 and scheme != "file"


# S3 options trajstore reads from an ``s3://`` location's query (docs/deploy.md,
# "Object storage"), with its defaults: an unresponsive server fails an append
# within about connect + request timeout x attempts, never hangs it.
S3_DEFAULTS = {"connect_timeout": 5.0, "request_timeout": 30.0, "retries": 3}
_S3_FLOAT = ("connect_timeout", "request_timeout")
_S3_STR = ("region", "scheme", "endpoint_override", "access_key", "secret_key", "session_token", "role_arn",
           "tls_ca_file_path")
_S3_BOOL = ("anonymous", "force_virtual_addressing", "allow_bucket_creation", "background_writes")


def _s3_filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """An ``S3FileSystem`` from ``s3://[KEY:SECRET@]bucket/path?option=value&...``: the
    options pyarrow's own URI parser knows, plus the timeouts and ``retries`` it
    refuses there (``S3_DEFAULTS``); an unknown option is refused by name."""
    from urllib.parse import parse_qsl, unquote

    parsed = urlparse(location)
    opts: dict[str, Any] = {}
    numbers = dict(S3_DEFAULTS)
    for key, value in parse_qsl(parsed.query, keep_blank_values=True):
        try:
            if key in _S3_FLOAT:
                numbers[key] = float(value)
            elif key == "retries":
                numbers[key] = int(value)
            elif key in _S3_STR:
                opts[key] = value
            elif key in _S3_BOOL:
                opts[key] = value.lower() in ("1", "true", "yes")
            else:
                raise ValueError(f"unknown option {key!r} (known: {', '.join(sorted((*_S3_FLOAT, 'retries', *_S3_STR, *_S3_BOOL)))})")
        except ValueError as e:
            raise StoreUnavailable(f"payload location {_no_secret(location)!r}: {key}={value!r}: {e}") from None
    if parsed.username:
        opts.setdefault("access_key", unquote(parsed.username))
        opts.setdefault("secret_key", unquote(parsed.password or ""))
    fs = pafs.S3FileSystem(connect_timeout=numbers["connect_timeout"], request_timeout=numbers["request_timeout"],
                           retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=max(1, numbers["retries"])),
                           **opts)
    return fs, f"{parsed.hostname or ''}{parsed.path}".rstrip("/")


def _no_secret(location: str) -> str:
    p = urlparse(location)
    if p.password is None:
        return location
    return location.replace(f":{p.password}@", ":***@", 1)


def filesystem_of(location: str) -> tuple[pafs.FileSystem, str, bool]:
    """``(filesystem, root path in it, is local)`` of a payload location; creates nothing."""
    if is_uri(location):
        try:
            if urlparse(location).scheme == "s3":
                fs, root = _s3_filesystem(location)
            else:
                fs, root = pafs.FileSystem.from_uri(location)
        except (pa.ArrowInvalid, ValueError, OSError) as e:
            raise StoreUnavailable(f"payload location {_no_secret(location)!r}: {first_line(e)}") from None
        return fs, root, False
    parsed = urlparse(location)
    path = parsed.path if parsed.scheme == "file" else location
    return pafs.LocalFileSystem(), os.path.abspath(path), True


@dataclass
class PayloadStore:
    """Where segment files live: a local directory or any pyarrow filesystem URI.

    Two formats, chosen by the name's suffix:
    * ``.arrow``: Arrow IPC file, for the event log and the sample segments.
      Writing is a buffer-by-buffer stream with no re-encoding (uncompressed,
      an append's routes are not copied at all), record batches of bounded
      size let a reader take only the rows it needs, and an uncompressed file
      read through a memory map gives arrays that are views of the page cache;
    * ``.parquet``: sample segments written before they became Arrow IPC
      (zstd on every column); still read.

    ``log_compression`` is the codec of the log's buffers: None (default),
    "lz4" or "zstd". Routes are high-entropy ids: zstd saves about 12% of the
    disk (340 vs 389 bytes per token for 48x8 routes of ids < 128) but makes
    an append about 2x slower and needs a compressed copy of the routes in
    memory; see docs/benchmarks.md.
    """

    location: str
    log_compression: str | None = None
    _reserve: "_Reserve | None" = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.log_compression not in _CODECS:
            raise ValueError(f"log_compression must be one of {list(_CODECS)}, got {self.log_compression!r}")
        self.fs, self.root, self.local = filesystem_of(self.location)
        try:
            self.fs.create_dir(self.root, recursive=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot create payload directory {self.location!r}: {e}") from None
        if self.local:
            self._reserve = _Reserve(self.root)

    def path(self, name: str) -> str:
        return _join(self.root, name)

    def new_name(self, kind: str, suffix: str = ".arrow") -> str:
        return _segment_name(kind, suffix)

    def new_log_segment(self) -> str:
        """A name for an append's log segment (``write(..., durable=False)``, then
        ``make_durable``): a file of the reserve when it has one (created empty
        ahead of time, its directory entry already durable, so making it durable
        is one ``fdatasync``; see ``_Reserve``), else a new name."""
        if self._reserve is not None:
            name = self._reserve.take()
            if name is not None:
                return name
        return _segment_name("events", ".arrow")

    def close(self) -> None:
        """Delete the reserve's unused files (a crashed writer's are garbage for ``collect_garbage``)."""
        if self._reserve is not None:
            self._reserve.close()

    def write(self, name: str, table: pa.Table, *, rows_per_batch: int | None = None, atomic: bool = False,
              durable: bool = True) -> int:
        """Write ``table`` durably as segment ``name``; return its size in bytes.

        ``rows_per_batch``: rows per record batch / row group (reads of single
        rows decompress only their batch). ``atomic``: write to a temporary
        name and rename, for segments whose name is deterministic and may be
        rewritten (with the same bytes) while a reader has the old file open.
        ``durable=False`` (not with ``atomic``): written but not yet synced;
        the caller must ``make_durable(name)`` before anything references it
        (an append overlaps that fsync with its SQL statements)."""
        path = self.path(name)
        rows_per_batch = max(1, rows_per_batch or table.num_rows or 1)
        table = table.replace_schema_metadata({_ROWS_PER_BATCH: str(rows_per_batch)})
        if atomic and not durable:
            raise ValueError("an atomic write is durable")
        try:
            if not self.local:
                # one object in one request where it fits: built in memory, then written whole
                # (the IPC writer's many small writes made an object store start a multipart upload)
                sink = pa.BufferOutputStream()
                _write_table(name, table, sink, rows_per_batch, self.log_compression)
                data = sink.getvalue()
                with self.fs.open_output_stream(path) as out:
                    out.write(data)
                return data.size
            target = path + f".{uuid.uuid4().hex}.tmp" if atomic else path
            # a native file: no Python object between Arrow and the kernel, so the
            # GIL is released for the whole write; buffered: the IPC writer's many
            # small writes (metadata, offsets) become a few syscalls, and the large
            # buffers pass through
            with pa.OSFile(target, "wb") as raw, pa.BufferedOutputStream(raw, 1 << 16) as f:
                _write_table(name, table, f, rows_per_batch, self.log_compression)
                size = f.tell()
            if durable:
                _fsync_path(target)
            if atomic:
                os.replace(target, path)
            if durable:
                fsync_dir(self.root)
            return size
        except OSError as e:
            raise StoreUnavailable(f"cannot write payload segment {path!r}: {e}") from None

    def make_durable(self, name: str) -> None:
        """Finish a ``write(..., durable=False)``: fsync the file, then its
        directory (a no-op on a remote filesystem: its stream's close is what
        it offers). Raises StoreUnavailable."""
        if not self.local:
            return
        path = self.path(name)
        try:
            if self._reserve is not None and self._reserve.sync_taken(name):
                return
            _fsync_path(path)
            fsync_dir(self.root)
        except OSError as e:
            raise StoreUnavailable(f"cannot sync payload segment {path!r}: {e}") from None

    def read_rows(self, name: str, rows: Iterable[int]) -> SegmentRows:
        """The given rows of a segment, decompressing only the batches that hold them."""
        batches, schema, index = self._read_batches(name, rows)
        return SegmentRows(pa.Table.from_batches(batches, schema=schema), index)

    def _read_batches(self, name: str, rows: Iterable[int]
                      ) -> tuple[list[pa.RecordBatch], pa.Schema, dict[int, int]]:
        """The record batches (row groups) of a segment that hold ``rows``, its schema,
        and each wanted row's position in those batches laid end to end."""
        wanted = sorted(set(int(r) for r in rows))
        if name.endswith(".arrow") and self.local:
            # The file's stream part (after the 8-byte magic) read in order up to the
            # last batch wanted when they are dense (a log segment: one row per batch,
            # all of them wanted), else the footer's index (a large compacted segment).
            data = self._map(name)
            try:
                stream = ipc.open_stream(data.slice(8), options=_READ_OPTIONS)
                schema = stream.schema
                per = int(schema.metadata[_ROWS_PER_BATCH.encode()])
                numbers = sorted({r // per for r in wanted})
                if numbers and numbers[-1] + 1 <= 2 * len(numbers) + 4:
                    batches = [stream.read_next_batch() for _ in range(numbers[-1] + 1)]
                    if len(numbers) < len(batches):
                        batches = [batches[k] for k in numbers]
                else:
                    reader = ipc.open_file(data, options=_READ_OPTIONS)
                    batches = [reader.get_batch(b) for b in numbers]
            except StopIteration:
                raise CorruptStoreError(f"payload segment {self.path(name)!r} has no row {wanted[-1]}") from None
            except (pa.ArrowInvalid, KeyError, TypeError, ValueError) as e:
                raise CorruptStoreError(f"payload segment {self.path(name)!r} is unreadable: {e}") from None
        else:
            with self._open(name) as src:
                if name.endswith(".arrow"):
                    reader = ipc.open_file(src, options=_READ_OPTIONS)
                    schema = reader.schema
                    per = int(schema.metadata[_ROWS_PER_BATCH.encode()])
                    numbers = sorted({r // per for r in wanted})
                    batches = [reader.get_batch(b) for b in numbers]
                else:
                    pf = pq.ParquetFile(src)
                    schema = pf.schema_arrow
                    per = int(schema.metadata[_ROWS_PER_BATCH.encode()])
                    numbers = sorted({r // per for r in wanted})
                    batches = pf.read_row_groups(numbers).to_batches()
                    # a row group may come back as several batches: positions count rows, not batches
        first = {b: i * per for i, b in enumerate(numbers)}
        return batches, schema, {r: first[r // per] + r % per for r in wanted}

    def _map(self, name: str) -> pa.Buffer:
        """A local segment's bytes, memory-mapped (read-only; unmapped when no buffer uses it)."""
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise PayloadMissingError(f"payload segment {path!r} is missing") from None
        except OSError as e:
            raise StoreUnavailable(f"cannot open payload segment {path!r}: {e}") from None
        try:
            m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
            if name.startswith("samples-"):
                _huge(m)
            return pa.py_buffer(m)
        except ValueError:  # an empty file
            raise CorruptStoreError(f"payload segment {path!r} is empty") from None
        except OSError as e:
            raise StoreUnavailable(f"cannot map payload segment {path!r}: {e}") from None
        finally:
            os.close(fd)

    def read_many(self, wanted: Mapping[str, Iterable[int]]
                  ) -> tuple[dict[str, SegmentRows], dict[str, BaseException]]:
        """The rows ``wanted[name]`` of several segments: ``{name: SegmentRows}``,
        and apart ``{name: error}`` for a segment that is missing or unreadable
        (``CorruptStoreError``; ``StoreUnavailable`` propagates).

        Segments of one schema share one table (their batches end to end) and
        its decoded columns: a column is decoded once for all of them (a log
        segment holds one row per record batch; decoding row by row costs
        more than the one copy of the small token columns ``SegmentRows.lists``
        makes)."""
        # grouped by schema (names, types, nullability; metadata aside): one shared table each
        groups: list[tuple[pa.Schema, list[tuple[str, pa.Schema, list[pa.RecordBatch], dict[int, int]]]]] = []
        bad: dict[str, BaseException] = {}
        for name in sorted(wanted):
            try:
                batches, schema, index = self._read_batches(name, wanted[name])
            except CorruptStoreError as e:
                bad[name] = e
                continue
            for like, members in groups:
                if like.equals(schema):  # (metadata aside)
                    members.append((name, schema, batches, index))
                    break
            else:
                groups.append((schema, [(name, schema, batches, index)]))
        out: dict[str, SegmentRows] = {}
        for _, members in groups:
            out.update(_shared_rows(members))
        return out, bad

    def read_locators(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, SegmentRows]:
        """The payload rows that index ``rows`` (``segment``, ``segment_row``) point at, one read per segment."""
        wanted: dict[str, list[int]] = {}
        for r in rows:
            if r["segment"] is not None:
                wanted.setdefault(r["segment"], []).append(int(r["segment_row"]))
        return {name: self.read_rows(name, idx) for name, idx in sorted(wanted.items())}

    @contextlib.contextmanager
    def _open(self, name: str):
        path = self.path(name)
        try:
            src = pa.memory_map(path) if self.local else self.fs.open_input_file(path)
        except FileNotFoundError:
            raise PayloadMissingError(f"payload segment {path!r} is missing") from None
        except OSError as e:
            raise StoreUnavailable(f"cannot open payload segment {path!r}: {e}") from None
        try:
            with src:
                yield src
        except (pa.ArrowInvalid, KeyError, TypeError, ValueError) as e:
            raise CorruptStoreError(f"payload segment {path!r} is unreadable: {e}") from None

    def delete(self, name: str) -> None:
        if self._reserve is not None:
            self._reserve.forget(name)
        try:
            self.fs.delete_file(self.path(name))
        except FileNotFoundError:
            pass

    def holds_any(self) -> bool:
        """Does the location hold any segment file (False: unmounted, emptied, or the wrong place)?"""
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True, recursive=False))
        except OSError as e:
            raise StoreUnavailable(f"cannot list payload location {self.location!r}: {first_line(e)}") from None
        # (non-empty: the reserve's files are empty)
        return any(i.type == pafs.FileType.File and i.base_name.endswith((".arrow", ".parquet")) and i.size
                   for i in infos)

    def list_names(self) -> list[tuple[str, float]]:
        """(name, modification time) of every segment file, temporary ones
        included; not the empty files this store holds in its reserve."""
        infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        held = self._reserve.held() if self._reserve is not None else frozenset()
        return [
            (i.base_name, i.mtime.timestamp() if i.mtime else 0.0)
            for i in infos
            if i.type == pafs.FileType.File and i.base_name.endswith((".arrow", ".parquet", ".tmp"))
            and i.base_name not in held
        ]

    def collect_garbage(self, referenced: set[str], *, grace_s: float = 3600.0) -> list[str]:
        """Delete segment files not in ``referenced`` (the ones still needed)
        written more than ``grace_s`` ago; return their names.

        "Ago" is by the storage's own clock (``storage_time``): an object's
        LastModified is compared with the server's time, never this machine's.
        On an object store the checks and deletes run in parallel
        (``_GC_THREADS``): one HEAD and one DELETE per file, each a round trip."""
        now = self.storage_time()
        candidates = [name for name, mtime in self.list_names() if name not in referenced and now - mtime >= grace_s]

        def one(name: str) -> str | None:
            # (asked again right before deleting: a deterministic name may have just been rewritten)
            if now - self._mtime(name) >= grace_s:
                self.delete(name)
                return name
            return None

        if self.local or len(candidates) < 2:
            done = [one(n) for n in candidates]
        else:
            done = list(_GC_POOL.get().map(one, candidates))
        return [n for n in done if n is not None]

    def storage_time(self) -> float:
        """The payload storage's clock, seconds since the epoch: this machine's for a
        local disk; for an object store the LastModified of a small probe object
        written now (and deleted), so the GC grace does not depend on clock agreement."""
        if self.local:
            return time.time()
        name = f"clock-{uuid.uuid4().hex}.probe"
        path = self.path(name)
        try:
            with self.fs.open_output_stream(path) as out:
                out.write(b"")
            info = self.fs.get_file_info(path)
        except OSError as e:
            raise StoreUnavailable(f"cannot write to payload location {self.location!r}: {first_line(e)}") from None
        finally:
            with contextlib.suppress(OSError):
                self.fs.delete_file(path)
        return info.mtime.timestamp() if info.mtime else time.time()

    def _mtime(self, name: str) -> float:
        info = self.fs.get_file_info(self.path(name))
        if info.type == pafs.FileType.NotFound:
            return 0.0
        return info.mtime.timestamp() if info.mtime else 0.0

    def write_samples(self, name: str, table: pa.Table, rows_per_batch: int, *, deferred: Sequence[Any] = ()) -> int:
        """Write a sample segment (``write_arrow_segment``); return its size in bytes."""
        return write_arrow_segment(self, name, table, rows_per_batch, deferred=deferred)


_GC_THREADS = 32  # parallel HEAD + DELETE requests of a GC on an object store
_GC_POOL = LazyPool(_GC_THREADS, "trajstore-gc")


# The reserve of empty log segment files (``_Reserve``): refilled to _RESERVE_HIGH
# when fewer than _RESERVE_LOW are left; a file is handed out only this young.
_RESERVE_LOW, _RESERVE_HIGH = 2, 8
_RESERVE_MAX_AGE_S = 30.0
_RESERVE_CLOSE_WAIT_S = 10.0  # a refill makes a few empty files and fsyncs their directory


class _Reserve:
    """Empty log segment files, made ahead of the appends that will fill them.

    An append writes its events into a segment of its own and makes it durable
    before its index transaction commits. For a new file that is an fsync that
    also journals a new inode and directory entry, then an fsync of the
    directory: here ~0.5 ms more than the ~0.6 ms of an ``fdatasync`` of the
    same megabyte written into a file that already exists (docs/benchmarks.md,
    "Append: where the time goes"). So files are created in the background, a batch
    at a time with one fsync of the directory, and an append takes one whose
    directory entry is already durable: its ``make_durable`` is one
    ``fdatasync`` (the file's new size is part of what it syncs).

    Safety:
    * ``take`` opens the file (without creating it) and keeps it open until
      ``sync_taken``: the inode it syncs cannot be freed and reused meanwhile,
      and ``sync_taken`` compares it with the inode the name now points to. If
      the write re-created the file (someone removed it), the file and the
      directory are fsynced as for a new file; if it is gone, the append fails
      (StoreUnavailable) before anything references it.
    * A file is handed out only while younger than ``_RESERVE_MAX_AGE_S``;
      older ones are deleted. ``collect_garbage`` removes only files nothing
      references and older than its grace (an hour by default; a grace shorter
      than an append takes between its write and its commit was never safe).
    * The reserve belongs to the process that made it: a forked child neither
      takes nor deletes its parent's files.
    * ``held`` names are not listed as segment files by their own store
      (``PayloadStore.list_names``): its GC never takes them. A crashed
      writer's leftovers are empty unreferenced files, removed by any GC after
      the grace; ``close`` deletes the ones left.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._ready: collections.deque[tuple[str, float]] = collections.deque()  # (name, made at, monotonic)
        self._pending: set[str] = set()  # being created by a refill
        self._taken: dict[str, int] = {}  # name -> descriptor held open until it is synced
        self._refilling = False
        self._refilled = threading.Condition(self._lock)  # notified when a refill ends
        self._closed = False
        self._pid = os.getpid()
        # a store nobody closed leaves no empty files behind at exit (or when collected)
        weakref.finalize(self, _delete_ready, root, self._ready, self._lock, self._pid)

    def _path(self, name: str) -> str:
        return _join(self.root, name)

    def take(self) -> str | None:
        """A reserved file's name (now this caller's to write), or None (write a new file)."""
        if os.getpid() != self._pid:
            return None
        stale: list[str] = []
        name = None
        while name is None:
            with self._lock:
                if not self._ready:
                    break
                candidate, made = self._ready.popleft()
            if time.monotonic() - made >= _RESERVE_MAX_AGE_S:
                stale.append(candidate)
                continue
            try:
                fd = os.open(self._path(candidate), os.O_WRONLY)
            except OSError:  # removed meanwhile (a GC with a short grace): not a reserved file any more
                continue
            with self._lock:
                self._taken[candidate] = fd
            name = candidate
        for old in stale:
            _unlink_quietly(self._path(old))
        # a writer slow enough to find stale files gets new ones made only when it asks again
        self._maybe_refill(allowed=not stale)
        return name

    def _maybe_refill(self, *, allowed: bool) -> None:
        with self._lock:
            if not allowed or self._closed or self._refilling or len(self._ready) >= _RESERVE_LOW:
                return
            self._refilling = True
        try:
            _REFILL_POOL.get().submit(self._refill)
        except RuntimeError:  # the interpreter is shutting down
            with self._lock:
                self._refilling = False

    def _refill(self) -> None:
        made: list[str] = []
        try:
            with self._lock:
                names = [_segment_name("events", ".arrow") for _ in range(_RESERVE_HIGH - len(self._ready))]
                self._pending.update(names)
            born = time.monotonic()
            try:
                for name in names:
                    os.close(os.open(self._path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                    made.append(name)
                fsync_dir(self.root)
            except OSError as e:
                log.info("cannot reserve log segment files in %s (%s); appends create their own", self.root, e)
                for name in made:
                    _unlink_quietly(self._path(name))
                made = []
            with self._lock:
                self._pending.difference_update(names)
                if not self._closed:
                    self._ready.extend((name, born) for name in made)
                    made = []
            for name in made:  # closed meanwhile
                _unlink_quietly(self._path(name))
        except Exception:  # never let a background refill fail silently
            log.exception("refilling the log segment reserve in %s failed", self.root)
        finally:
            with self._lock:
                self._refilling = False
                self._refilled.notify_all()

    def sync_taken(self, name: str) -> bool:
        """Make a taken file durable (``fdatasync``); False if ``name`` was not
        taken from the reserve, or the write re-created it (the caller then
        syncs it as a new file). Raises OSError, e.g. when it is gone."""
        with self._lock:
            fd = self._taken.pop(name, None)
        if fd is None:
            return False
        try:
            if os.stat(self._path(name)).st_ino != os.fstat(fd).st_ino:
                return False
            _fdatasync(fd)
            return True
        finally:
            os.close(fd)

    def forget(self, name: str) -> None:
        """A taken file is being deleted (its append failed)."""
        with self._lock:
            fd = self._taken.pop(name, None)
        if fd is not None:
            os.close(fd)

    def held(self) -> frozenset[str]:
        """The names this reserve holds (not yet taken)."""
        if os.getpid() != self._pid:
            return frozenset()
        with self._lock:
            return frozenset([n for n, _ in self._ready] + list(self._pending))

    def close(self) -> None:
        """Delete the unused files; a refill in flight is waited for (it deletes
        what it made once it sees the reserve closed), so none is left behind."""
        with self._lock:
            self._closed = True
            if os.getpid() == self._pid:  # a forked child's copy has no refill thread
                self._refilled.wait_for(lambda: not self._refilling, timeout=_RESERVE_CLOSE_WAIT_S)
        _delete_ready(self.root, self._ready, self._lock, self._pid)


def _delete_ready(root: str, ready: collections.deque, lock: threading.Lock, pid: int) -> None:
    """Delete a reserve's files not taken (only in the process that made them)."""
    if os.getpid() != pid:
        return
    with lock:
        names = [n for n, _ in ready]
        ready.clear()
    for name in names:
        _unlink_quietly(_join(root, name))


def _segment_name(kind: str, suffix: str) -> str:
    return f"{kind}-{time.strftime('%Y%m%d')}-{uuid.uuid4().hex}{suffix}"


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


# fdatasync where the OS has it (Linux); fsync elsewhere (macOS has no fdatasync).
_fdatasync = getattr(os, "fdatasync", os.fsync)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


# One thread per process for the reserves' refills.
_REFILL_POOL = LazyPool(1, "trajstore-reserve")


def _huge(m: mmap.mmap) -> None:
    """Ask for huge pages on a sample segment's map. A sample segment is written
    with ``O_DIRECT`` (``write_arrow_segment``): it reaches the page cache when
    first read, and read through such a map it comes in as 2-MB folios mapped
    whole, as a buffered write would have left it (touching every page of
    30 MB read back: ~0.4 ms of CPU, ~0.1 ms warm; without: ~3.7 and ~1.2 ms
    here). Best effort: ignored where the kernel has no transparent huge pages."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:
            pass


def _shared_rows(members: Sequence[tuple[str, pa.Schema, list[pa.RecordBatch], dict[int, int]]]
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


_ROWS_PER_BATCH = "trajstore.rows_per_batch"
# A segment's buffers are views of its memory map: nothing for threads to do but hand work over.
_READ_OPTIONS = ipc.IpcReadOptions(use_threads=False)


def _write_table(name: str, table: pa.Table, sink, rows_per_batch: int, log_compression: str | None) -> None:
    if name.endswith(".arrow"):
        codec = _SAMPLE_COMPRESSION if name.startswith("samples-") else log_compression
        options = ipc.IpcWriteOptions(compression=codec)
        with ipc.new_file(sink, table.schema, options=options) as writer:
            # Exactly rows_per_batch rows per record batch: read_rows finds a row's
            # batch by division. write_table would also split at every column
            # chunk boundary (the routes column is one chunk per row), which for
            # one row per batch is what is asked: one call, no loop here.
            if rows_per_batch == 1:
                writer.write_table(table, max_chunksize=1)
                return
            for start in range(0, table.num_rows, rows_per_batch):
                part = table.slice(start, rows_per_batch)
                batches = part.to_batches()
                if len(batches) != 1:
                    batches = part.combine_chunks().to_batches()
                writer.write_batch(batches[0])
    else:
        pq.write_table(table, sink, compression=_PARQUET_COMPRESSION, use_dictionary=False,
                       write_statistics=False, row_group_size=rows_per_batch)


def rows_per_batch(table: pa.Table, target_bytes: int = 1 << 20) -> int:
    """Rows per record batch so that a batch holds about ``target_bytes``."""
    if table.num_rows == 0:
        return 1
    return max(1, int(target_bytes * table.num_rows // max(1, table.nbytes)))


def _fsync_path(path: str) -> None:
    """fsync a written file by path (fsync flushes its pages whatever descriptor asks)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_arrow_segment(store: PayloadStore, name: str, table: pa.Table, rows_per_batch: int, *,
                        deferred: Sequence[Any] = ()) -> int:
    """Write ``table`` durably and atomically as Arrow IPC segment ``name``
    (uncompressed, exactly ``rows_per_batch`` rows per record batch); return its size.

    The sample segments' writer. The file's bytes are laid out in one
    page-aligned buffer (``_Image``: record batches are zero-copy slices of the
    table when every column is one chunk, ``sample_table``), then written in one
    call with ``O_DIRECT`` where the filesystem allows it: no copy into the page
    cache and no writeback at ``fsync`` (most of the kernel time of a 30 MB
    segment); elsewhere a plain write. Written to a temporary name, fsynced,
    renamed into place and the directory fsynced, as ``PayloadStore.write(atomic=True)``
    does. ``deferred``: buffers of the table whose bytes are filled where they
    are written (``_samples.DeferredRoutes``: ``address``, ``size``, ``fill``,
    ``covered``); they are never copied from."""
    rows_per_batch = max(1, rows_per_batch or table.num_rows or 1)
    if not name.endswith(".arrow"):
        if deferred:
            raise ValueError(f"deferred buffers are written only to Arrow segments, not {name!r}")
        return store.write(name, table, rows_per_batch=rows_per_batch, atomic=True)
    table = table.replace_schema_metadata({_ROWS_PER_BATCH: str(rows_per_batch)})
    image = _Image(_image_capacity(table, rows_per_batch), deferred)
    _write_table(name, table, image, rows_per_batch, store.log_compression)
    if not all(d.covered() for d in deferred):
        # the writer copied a deferred buffer instead of handing it over (another pyarrow?): build them, again
        log.warning("segment %s: deferred buffers were not written in place; building them first", name)
        image = _Image(_image_capacity(table, rows_per_batch), ())
        _write_table(name, _filled_table(table, deferred), image, rows_per_batch, store.log_compression)
    data, size = image.buf, image.pos
    path = store.path(name)
    if not store.local:
        try:
            with store.fs.open_output_stream(path) as out:
                out.write(pa.py_buffer(data[:size]))
            return size
        except OSError as e:
            raise StoreUnavailable(f"cannot write payload segment {path!r}: {e}") from None
    target = path + f".{uuid.uuid4().hex}.tmp"
    try:
        _write_file(target, data, size)
        os.replace(target, path)
        fsync_dir(store.root)
        return size
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(target)
        raise StoreUnavailable(f"cannot write payload segment {path!r}: {e}") from None


_BLOCK = 4096  # alignment of an O_DIRECT write's memory, offset and length (a multiple of any disk's block)


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + _BLOCK, np.uint8)
    at = -raw.ctypes.data % _BLOCK
    return raw[at : at + nbytes]


class _Image:
    """A file's bytes, laid out in one page-aligned buffer by a writer that
    takes it for a file (``write``/``tell``: what ``pa.PythonFile`` needs).
    A buffer the writer hands over that lies in a ``deferred`` one's
    placeholder is filled in place by it, never copied from."""

    def __init__(self, capacity: int, deferred: Sequence[Any]) -> None:
        self.buf = _aligned(-(-max(capacity, 1) // _BLOCK) * _BLOCK)
        self.pos = 0
        self.closed = False
        self.deferred = [(d.address, d.address + d.size, d) for d in deferred if d.size]

    def write(self, data: Any) -> int:
        if isinstance(data, pa.Buffer):
            n = data.size
            addr = data.address
            for lo, hi, d in self.deferred:
                if lo <= addr and addr + n <= hi:
                    self._reserve(n)
                    d.fill(self.buf[self.pos : self.pos + n], addr - lo)
                    self.pos += n
                    return n
        else:
            data = memoryview(data)
            n = data.nbytes
        self._reserve(n)
        self.buf[self.pos : self.pos + n] = np.frombuffer(data, np.uint8)
        self.pos += n
        return n

    def _reserve(self, n: int) -> None:
        if self.pos + n + _BLOCK > len(self.buf):  # (the room to pad the last block too)
            bigger = _aligned(-(-max(2 * len(self.buf), self.pos + n + _BLOCK) // _BLOCK) * _BLOCK)
            bigger[: self.pos] = self.buf[: self.pos]
            self.buf = bigger

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def writable(self) -> bool:
        return True


def _image_capacity(table: pa.Table, rows_per_batch: int) -> int:
    """Room for an Arrow IPC file of ``table``: its buffers, and per record batch
    its metadata and padding (an underestimate only costs a copy, ``_Image``)."""
    batches = -(-table.num_rows // rows_per_batch) + 1
    buffers = sum(len(chunk.buffers()) for col in table.columns for chunk in col.chunks[:1])
    return table.nbytes + (batches + 2) * (buffers * 96 + 4096) + 64 * len(table.schema.to_string())


def _filled_table(table: pa.Table, deferred: Sequence[Any]) -> pa.Table:
    """``table`` with every buffer that lies in a deferred one replaced by its bytes
    (flat columns only: the routes column)."""
    built = []
    for d in deferred:
        data = np.empty(d.size, np.uint8)
        if d.size:
            d.fill(data, 0)
        built.append((d.address, d.address + d.size, data))

    def real(buf: pa.Buffer | None) -> pa.Buffer | None:
        for lo, hi, data in built:
            if buf is not None and buf.size and lo <= buf.address < hi:
                return pa.py_buffer(data[buf.address - lo : buf.address - lo + buf.size])
        return buf

    cols = []
    for col in table.columns:
        chunks = []
        for chunk in col.chunks:
            bufs = chunk.buffers()
            new = [real(b) for b in bufs]
            if any(a is not b for a, b in zip(bufs, new)):
                if chunk.type.num_fields:
                    raise ValueError("deferred buffers are supported in flat columns only")
                chunk = pa.Array.from_buffers(chunk.type, len(chunk), new, null_count=chunk.null_count,
                                              offset=chunk.offset)
            chunks.append(chunk)
        cols.append(pa.chunked_array(chunks, type=col.type))
    return pa.Table.from_arrays(cols, schema=table.schema)


def _write_file(path: str, data: np.ndarray, size: int) -> None:
    """Create ``path`` holding ``data[:size]`` (page-aligned, with room to pad its last
    block), durably: with ``O_DIRECT`` where the filesystem takes it, else buffered."""
    direct = getattr(os, "O_DIRECT", 0)
    padded = -(-size // _BLOCK) * _BLOCK
    if direct and size and padded <= len(data):
        data[size:padded] = 0
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | direct, 0o666)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this filesystem has no direct I/O
                raise
        else:
            try:
                _write_all(fd, data, padded)
                os.ftruncate(fd, size)
                os.fsync(fd)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: it refuses this alignment; write it plainly
                    raise
            finally:
                os.close(fd)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        _write_all(fd, data, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: np.ndarray, size: int) -> None:
    view = memoryview(data)
    done = 0
    while done < size:
        done += os.write(fd, view[done:size])
