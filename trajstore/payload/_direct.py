"""The sample segments' writer: one Arrow IPC file laid out in memory, written with ``O_DIRECT``.

The file's bytes are laid out in one page-aligned buffer (``_Image``), then
written in one call with ``O_DIRECT`` where the filesystem allows it: no
copy into the page cache and no writeback at ``fsync``.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import sys
import threading
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from trajstore.payload._durable import replace_durably
from trajstore.payload._errors import payload_errors
from trajstore.payload._format import ROWS_PER_BATCH, SegmentKind, write_table

log = logging.getLogger(__name__)

__all__ = ["write_arrow_segment"]


def write_arrow_segment(store: Any, name: str, table: pa.Table, rows_per_batch: int, *,
                        deferred: Sequence[Any] = ()) -> int:
    """Write ``table`` durably and atomically as Arrow IPC segment ``name`` of
    ``store`` (a ``PayloadStore``), uncompressed, exactly ``rows_per_batch`` rows
    per record batch; return its size.

    The sample segments' writer. The file's bytes are laid out in one
    page-aligned buffer (``_Image``: record batches are zero-copy slices of the
    table when every column is one chunk, ``sample_table``), then written in one
    call with ``O_DIRECT`` where the filesystem allows it: no copy into the page
    cache and no writeback at ``fsync`` (most of the kernel time of a 30 MB
    segment); elsewhere a plain write. Written to a temporary name, fsynced,
    renamed into place and the directory fsynced (``replace_durably``, as
    ``PayloadStore.write(atomic=True)``). ``deferred``: buffers of the table whose
    bytes are filled where they are written (``_samples.DeferredRoutes``:
    ``address``, ``size``, ``fill``, ``covered``); they are never copied from."""
    rows_per_batch = max(1, rows_per_batch or table.num_rows or 1)
    if not SegmentKind.of(name).is_arrow:
        if deferred:
            raise ValueError(f"deferred buffers are written only to Arrow segments, not {name!r}")
        return store.write(name, table, rows_per_batch=rows_per_batch, atomic=True)
    table = table.replace_schema_metadata({ROWS_PER_BATCH: str(rows_per_batch)})
    image = _Image(_image_capacity(table, rows_per_batch), deferred)
    write_table(name, table, image, rows_per_batch, store.log_compression)
    if not all(d.covered() for d in deferred):
        # the writer copied a deferred buffer instead of handing it over (another pyarrow?): build them, again
        log.warning("segment %s: deferred buffers were not written in place; building them first", name)
        image = _Image(_image_capacity(table, rows_per_batch), ())
        write_table(name, _filled_table(table, deferred), image, rows_per_batch, store.log_compression)
    data, size = image.buf, image.pos
    path = store.path(name)
    try:
        with payload_errors("cannot write payload segment", path):
            if not store.local:
                with store.fs.open_output_stream(path) as out:
                    out.write(pa.py_buffer(data[:size]))
                return size
            replace_durably(path, store.root, lambda target: _write_file(target, data, size))
            return size
    finally:
        del data
        image.release()


_BLOCK = 4096  # alignment of an O_DIRECT write's memory, offset and length (a multiple of any disk's block)


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + _BLOCK, np.uint8)
    at = -raw.ctypes.data % _BLOCK
    return raw[at : at + nbytes]


_HUGE = 2 << 20  # a transparent huge page


class _Spare:
    """The last segment image's memory, kept for the next one (a materializer writes
    one segment a step): private anonymous memory in transparent huge pages
    (``MADV_HUGEPAGE``, where the kernel has them), faulted in once, not at every
    step nor at a process's first steps (a fresh heap's growth). Reused only when
    no array views it any more (the routes of the last step's samples view it until
    they are dropped: then a new one is made)."""

    def __init__(self) -> None:
        self._buf: np.ndarray | None = None
        self._lock = threading.Lock()  # materializers of several shards may write from threads of one process
        self._heap_primed = False

    def take(self, nbytes: int) -> np.ndarray:
        """At least ``nbytes`` of page-aligned memory that nothing views."""
        with self._lock:
            buf, self._buf = self._buf, None
        if buf is not None and len(buf) >= nbytes and sys.getrefcount(buf) <= 2:  # (``buf`` and the argument)
            return buf
        del buf
        if not self._heap_primed:
            # The image was the process's largest malloc: glibc serves one above its mmap threshold
            # (128 KB at start) with a map of its own and, once it is freed, raises the threshold to
            # its size, so that the step's other arrays up to that size came from the heap. Kept
            # here, it never is freed: one block of its size, never touched, is freed in its place
            # (a fresh process, 48x8 routes: 420 page faults a step instead of 1,650). Elsewhere: nothing.
            self._heap_primed = True
            np.empty(nbytes, np.uint8)
        private = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
        if None in private:  # no such map here (Windows): the heap's, not kept (``give``)
            return _aligned(nbytes)
        m = mmap.mmap(-1, -(-nbytes // _HUGE) * _HUGE, flags=private[0] | private[1])
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:
            try:
                m.madvise(advice)
            except OSError:  # control flow: no huge pages here, the memory works without them
                pass
        return np.frombuffer(m, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """``buf`` (from ``take``) may serve the next image once nothing views it."""
        if isinstance(buf.base, np.ndarray):  # the heap's (``_aligned``): its views name the array it slices
            return
        with self._lock:
            if self._buf is None or len(buf) >= len(self._buf):
                self._buf = buf


_SPARE = _Spare()


class _Image:
    """A file's bytes, laid out in one page-aligned buffer by a writer that
    takes it for a file (``write``/``tell``: what ``pa.PythonFile`` needs).
    A buffer the writer hands over that lies in a ``deferred`` one's
    placeholder is filled in place by it, never copied from."""

    def __init__(self, capacity: int, deferred: Sequence[Any]) -> None:
        self._memory: np.ndarray | None = _SPARE.take(-(-max(capacity, 1) // _BLOCK) * _BLOCK)
        self.buf = self._memory
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

    def release(self) -> None:
        """Done with the bytes: the memory may serve the next image."""
        memory, self._memory = self._memory, None
        self.buf = None
        if memory is not None:
            _SPARE.give(memory)

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
