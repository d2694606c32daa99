"""``PayloadStore``: the segment files of one payload location: writes, reads, GC.

Two kinds of segment, named by prefix (``SegmentKind``): the event log's
(``events-*``, one per append call, group commit or compaction) and the
materializer's sample segments (``samples-*``, one per materialization
batch). A segment is written and made durable (fsync of the file and of its
directory on local disks) *before* the SQL transaction that references it
commits, so an index row never points at a missing file. A file that no
``segments`` row names is garbage from a crashed or refused append;
``PayloadStore.collect_garbage`` removes such files once they are older than
a grace period (a live writer may be between its fsync and its commit).
Which files are still needed (``Store.collect_garbage``: named by an index
row, or retired within the grace) is the index's to say (docs/log.md, "One
copy").
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from trajstore._util.pools import LazyPool
from trajstore.errors import CorruptStoreError, StoreUnavailable, first_line
from trajstore.payload._columns import SegmentRows, shared_rows
from trajstore.payload._direct import write_arrow_segment
from trajstore.payload._durable import fsync_path, preallocate, replace_durably
from trajstore.payload._errors import payload_errors
from trajstore.payload._deadline import Remote, deadline
from trajstore.payload._filesystem import _no_secret, deadline_of, filesystem_of, join
from trajstore.payload._format import CODECS, READ_OPTIONS, ROWS_PER_BATCH, SegmentKind, dated_name, write_table
from trajstore.payload._reserve import Reserve

log = logging.getLogger(__name__)

_PREALLOCATE_BYTES = 1 << 20
"""A write's ``at_least`` from which its blocks are allocated ahead (below, a syscall for little)."""

__all__ = ["PayloadStore"]


@dataclass
class PayloadStore:
    """Where segment files live: a local directory or any pyarrow filesystem URI.

    Two formats, chosen by the name's suffix (``SegmentKind``):
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
    create: bool = field(default=True, kw_only=True, repr=False, compare=False)
    """Create the location's root directory if missing. ``Store`` passes False: a
    store's payload root is created only with its marker, when the location is
    recorded (``payload/_home.py``), never by a later open."""
    _reserve: "Reserve | None" = field(default=None, init=False, repr=False, compare=False)
    _bulk: Any = field(default=None, init=False, repr=False, compare=False)
    _remote: "Remote | None" = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.log_compression not in CODECS:
            raise ValueError(f"log_compression must be one of {list(CODECS)}, got {self.log_compression!r}")
        self.fs, self.root, self.local = filesystem_of(self.location)
        if not self.local:
            self._remote = Remote(deadline_of(self.location), _no_secret(self.location))
        if self.create:
            with payload_errors("cannot create payload directory", self.location):
                self.fs.create_dir(self.root, recursive=True)
        if self.local:
            self._reserve = Reserve(self.root)

    def path(self, name: str) -> str:
        return join(self.root, name)

    def deadline(self) -> Any:
        """A block whose object-store requests (this thread's) share one deadline
        (``deadline=`` of the location, ``payload/_deadline.py``); local: no deadline."""
        return deadline(None if self._remote is None else self._remote.seconds)

    def _call(self, what: str, request: Any, undo: Any = None) -> Any:
        return request() if self._remote is None else self._remote.call(what, request, undo=undo)

    def new_name(self, kind: str, suffix: str = ".arrow") -> str:
        """A new unique name ``{kind}-{date}-{hex}{suffix}`` (``SegmentKind.new_name`` for the log's and samples')."""
        return dated_name(f"{kind}-", suffix)

    def new_log_segment(self) -> str:
        """A name for an append's log segment (``write(..., durable=False)``, then
        ``make_durable``): a file of the reserve when it has one (created empty
        ahead of time, its directory entry already durable, so making it durable
        is one ``fdatasync``; see ``Reserve``), else a new name."""
        if self._reserve is not None:
            name = self._reserve.take()
            if name is not None:
                return name
        return SegmentKind.EVENTS.new_name()

    def close(self) -> None:
        """Delete the reserve's unused files (a crashed writer's are garbage for ``collect_garbage``)."""
        if self._reserve is not None:
            self._reserve.close()

    def write(self, name: str, table: pa.Table, *, rows_per_batch: int | None = None, atomic: bool = False,
              durable: bool = True, at_least: int = 0) -> int:
        """Write ``table`` durably as segment ``name``; return its size in bytes.

        ``rows_per_batch``: rows per record batch / row group (reads of single
        rows decompress only their batch). ``atomic``: write to a temporary
        name and rename, for segments whose name is deterministic and may be
        rewritten (with the same bytes) while a reader has the old file open.
        ``durable=False`` (not with ``atomic``): written but not yet synced;
        the caller must ``make_durable(name)`` before anything references it
        (an append overlaps that fsync with its SQL statements).
        ``at_least``: bytes the file is sure to hold when written uncompressed
        (the raw bytes of a column written whole, e.g. a log segment's routes);
        a local file allocates them before the write (``preallocate``)."""
        path = self.path(name)
        rows_per_batch = max(1, rows_per_batch or table.num_rows or 1)
        table = table.replace_schema_metadata({ROWS_PER_BATCH: str(rows_per_batch)})
        if atomic and not durable:
            raise ValueError("an atomic write is durable")
        with payload_errors("cannot write payload segment", path):
            if not self.local:
                # one object in one request where it fits: built in memory, then written whole
                # (the IPC writer's many small writes made an object store start a multipart upload)
                sink = pa.BufferOutputStream()
                write_table(name, table, sink, rows_per_batch, self.log_compression)
                data = sink.getvalue()

                def put() -> None:
                    with self.fs.open_output_stream(path) as out:
                        out.write(data)

                self._call(f"cannot write payload segment {path!r}", put, lambda: self.fs.delete_file(path))
                return data.size

            def write_file(target: str) -> int:
                # a native file: no Python object between Arrow and the kernel, so the
                # GIL is released for the whole write; buffered: the IPC writer's many
                # small writes (metadata, offsets) become a few syscalls, and the large
                # buffers pass through
                with pa.OSFile(target, "wb") as raw, pa.BufferedOutputStream(raw, 1 << 16) as f:
                    if at_least >= _PREALLOCATE_BYTES and self.log_compression is None:
                        preallocate(raw.fileno(), at_least)  # uncompressed: at least these bytes follow
                    write_table(name, table, f, rows_per_batch, self.log_compression)
                    size = f.tell()
                if size < at_least:  # a hint beyond what was written: the file is what was written
                    os.truncate(target, size)
                if durable:
                    fsync_path(target)
                return size

            if atomic:
                return replace_durably(path, self.root, write_file)
            size = write_file(path)
            if durable:
                fsync_path(self.root)  # its directory entry
            return size

    def make_durable(self, name: str) -> None:
        """Finish a ``write(..., durable=False)``: fsync the file, then its
        directory (a no-op on a remote filesystem: its stream's close is what
        it offers). Raises StoreUnavailable."""
        if not self.local:
            return
        path = self.path(name)
        with payload_errors("cannot sync payload segment", path):
            if self._reserve is not None and self._reserve.sync_taken(name):
                return
            fsync_path(path)
            fsync_path(self.root)  # its directory entry

    def read_rows(self, name: str, rows: Iterable[int]) -> SegmentRows:
        """The given rows of a segment, decompressing only the batches that hold them."""
        batches, schema, index = self._read_batches(name, rows)
        return SegmentRows(pa.Table.from_batches(batches, schema=schema), index)

    def _read_batches(self, name: str, rows: Iterable[int]
                      ) -> tuple[list[pa.RecordBatch], pa.Schema, dict[int, int]]:
        """The record batches (row groups) of a segment that hold ``rows``, its schema,
        and each wanted row's position in those batches laid end to end."""
        wanted = sorted(set(int(r) for r in rows))
        kind = SegmentKind.of(name)
        if kind.is_arrow and self.local:
            batches, schema, per, numbers = _arrow_batches(self._map(name), wanted, self.path(name))
        else:
            batches, schema, per, numbers = self._call(f"cannot read payload segment {self.path(name)!r}",
                                                       lambda: self._read_opened(name, kind, wanted))
        first = {b: i * per for i, b in enumerate(numbers)}
        return batches, schema, {r: first[r // per] + r % per for r in wanted}

    def _read_opened(self, name: str, kind: SegmentKind, wanted: list[int]) -> tuple:
        with self._open(name) as src:
            if kind.is_arrow and _read_whole(kind, src.size(), len(wanted)):
                return _arrow_batches(src.read_buffer(), wanted, self.path(name))
            if kind.is_arrow:
                reader = ipc.open_file(src, options=READ_OPTIONS)
                schema = reader.schema
                per = int(schema.metadata[ROWS_PER_BATCH.encode()])
                numbers = sorted({r // per for r in wanted})
                return [reader.get_batch(b) for b in numbers], schema, per, numbers
            pf = pq.ParquetFile(src)
            schema = pf.schema_arrow
            per = int(schema.metadata[ROWS_PER_BATCH.encode()])
            numbers = sorted({r // per for r in wanted})
            # a row group may come back as several batches: positions count rows, not batches
            return pf.read_row_groups(numbers).to_batches(), schema, per, numbers

    def _map(self, name: str) -> pa.Buffer:
        """A local segment's bytes, memory-mapped (read-only; unmapped when no buffer uses it)."""
        path = self.path(name)
        with payload_errors("cannot open payload segment", path, missing="payload segment"):
            fd = os.open(path, os.O_RDONLY)
        try:
            with payload_errors("cannot map payload segment", path):
                m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        except ValueError:  # an empty file (mmap's own refusal, no I/O error)
            raise CorruptStoreError(f"payload segment {path!r} is empty") from None
        finally:
            os.close(fd)
        if SegmentKind.of(name) is SegmentKind.SAMPLES:
            _huge(m)
        return pa.py_buffer(m)

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
            out.update(shared_rows(members))
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
        with payload_errors("cannot open payload segment", path, missing="payload segment"):
            src = pa.memory_map(path) if self.local else self.fs.open_input_file(path)
        with payload_errors("cannot read payload segment", path, corrupt="payload segment"), src:
            yield src

    def delete(self, name: str) -> None:
        """Delete segment ``name`` (gone already: nothing to do). Raises StoreUnavailable."""
        if self._reserve is not None:
            self._reserve.forget(name)
        path = self.path(name)
        with payload_errors("cannot delete payload segment", path, absent_ok=True):  # gone already: done
            self._call(f"cannot delete payload segment {path!r}", lambda: self.fs.delete_file(path))

    def discard(self, name: str, *, after: BaseException | None = None) -> None:
        """Best-effort delete of a segment nothing references (an append or a
        materialization that failed before its commit): never raises, so the
        error being handled (``after``) is the one the caller sees. A file left
        behind is unreferenced garbage ``collect_garbage`` removes after its grace.

        On an object store a write that failed because the store is unreachable
        (``after`` a StoreUnavailable) left no object or a complete one nothing
        names: no delete is tried then, it would only wait out the timeouts again."""
        if not self.local and isinstance(after, StoreUnavailable):
            if self._reserve is not None:
                self._reserve.forget(name)
            log.info("payload segment %r not deleted (the store is unreachable); left for gc", name)
            return
        try:
            self.delete(name)
        except StoreUnavailable as e:
            log.warning("payload segment %r left for gc: %s", name, first_line(e))

    def holds_any(self) -> bool:
        """Does the location hold any segment file (False: unmounted, emptied, or the wrong place)?"""
        with payload_errors("cannot list payload location", self.location):
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True, recursive=False))
        # (non-empty: the reserve's files are empty)
        return any(i.type == pafs.FileType.File and SegmentKind.of(i.base_name).is_segment and i.size
                   for i in infos)

    def list_names(self) -> list[tuple[str, float]]:
        """(name, modification time) of every segment file, temporary ones
        included; not the empty files this store holds in its reserve."""
        with payload_errors("cannot list payload location", self.location):
            infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        held = self._reserve.held() if self._reserve is not None else frozenset()
        return [
            (i.base_name, i.mtime.timestamp() if i.mtime else 0.0)
            for i in infos
            if i.type == pafs.FileType.File and SegmentKind.of(i.base_name) is not SegmentKind.OTHER
            and i.base_name not in held
        ]

    def collect_garbage(self, referenced: set[str], *, grace_s: float = 3600.0) -> list[str]:
        """Delete segment files not in ``referenced`` (the ones still needed)
        written more than ``grace_s`` ago; return their names.

        "Ago" is by the storage's own clock (``storage_time``): an object's
        LastModified is compared with the server's time, never this machine's.
        On an object store the checks and deletes run in parallel
        (``_GC_THREADS``): one HEAD and one DELETE per file, each a round trip."""
        if self._remote is not None:
            self._remote.settle()  # writes given up on finish first (and delete what they wrote)
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

    def delete_many(self, names: Sequence[str]) -> list[str]:
        """Delete segments ``names`` (the GC's, from the index's retired list: no
        listing); return the ones deleted or already gone. Local: one unlink each;
        S3: one ``DeleteObjects`` per 1,000 keys (boto3, the ``s3`` extra; else one
        request per object, in parallel). Raises StoreUnavailable."""
        names = list(names)
        if not names:
            return []
        if self.local or len(names) < 2:
            for n in names:
                self.delete(n)
            return names
        if self._bulk is None:
            from trajstore.payload._bulk_delete import s3_batch_deleter

            self._bulk = (s3_batch_deleter(self.location, self.root) if urlparse(self.location).scheme == "s3"
                          else None) or False
        if self._bulk is False:
            return [n for n in _GC_POOL.get().map(lambda n: (self.delete(n), n)[1], names)]
        return self._bulk(names)

    def storage_time(self) -> float:
        """The payload storage's clock, seconds since the epoch: this machine's for a
        local disk; for an object store the LastModified of a small probe object
        written now (and deleted), so the GC grace does not depend on clock agreement."""
        if self.local:
            return time.time()
        name = f"clock-{uuid.uuid4().hex}.probe"
        path = self.path(name)
        try:
            with payload_errors("cannot write to payload location", self.location):
                with self.fs.open_output_stream(path) as out:
                    out.write(b"")
                info = self.fs.get_file_info(path)
        finally:
            try:
                with payload_errors("cannot delete the clock probe", path, absent_ok=True):
                    self.fs.delete_file(path)
            except StoreUnavailable as e:  # best effort: an unnamed probe object is the GC's
                log.info("%s", e)
        return info.mtime.timestamp() if info.mtime else time.time()

    def _mtime(self, name: str) -> float:
        with payload_errors("cannot stat payload segment", self.path(name)):
            info = self.fs.get_file_info(self.path(name))
        if info.type == pafs.FileType.NotFound:
            return 0.0
        return info.mtime.timestamp() if info.mtime else 0.0

    def write_samples(self, name: str, table: pa.Table, rows_per_batch: int, *, deferred: Sequence[Any] = ()) -> int:
        """Write a sample segment (``write_arrow_segment``); return its size in bytes."""
        return write_arrow_segment(self, name, table, rows_per_batch, deferred=deferred)


_GC_THREADS = 32  # parallel HEAD + DELETE requests of a GC on an object store
_GC_POOL = LazyPool(_GC_THREADS, "trajstore-gc")


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
        except OSError:  # control flow, not an error: no huge pages here, the map works without them
            pass


WHOLE_READ_BYTES = 16 << 20
"""An Arrow segment on an object store larger than this is never fetched whole."""
REQUEST_BYTES = 1 << 20
"""What one more request to an object store costs, in bytes transferred (its latency)."""


def _read_whole(kind: SegmentKind, size: int, rows: int) -> bool:
    """Whether to fetch a remote Arrow segment of ``size`` bytes whole, in one
    request, to read ``rows`` of its rows: else its footer is read (two requests)
    and then each record batch wanted (one each). A log segment holds one engine
    call per batch and the materializer wants most of a segment's calls at once:
    whole when that is cheaper than 2 + ``rows`` requests; one row of a large log
    segment (a trace, a lineage read) is ranged. A sample segment of at most
    ``WHOLE_READ_BYTES`` is one record batch (``SAMPLE_BATCH_BYTES``): whole."""
    if size > WHOLE_READ_BYTES:
        return False
    return kind is SegmentKind.SAMPLES or size <= (2 + rows) * REQUEST_BYTES


def _arrow_batches(data: pa.Buffer, wanted: list[int], where: str
                   ) -> tuple[list[pa.RecordBatch], pa.Schema, int, list[int]]:
    """The record batches of an Arrow segment's bytes ``data`` that hold the rows
    ``wanted`` (sorted): (batches, schema, rows per batch, batch numbers). The
    stream part (after the 8-byte magic) is read in order up to the last batch
    wanted when they are dense (a log segment: one row per batch, all of them
    wanted), else through the footer's index (a large compacted segment)."""
    try:
        with payload_errors("cannot read payload segment", where, corrupt="payload segment", in_memory=True):
            stream = ipc.open_stream(data.slice(8), options=READ_OPTIONS)
            schema = stream.schema
            per = int(schema.metadata[ROWS_PER_BATCH.encode()])
            numbers = sorted({r // per for r in wanted})
            if numbers and numbers[-1] + 1 <= 2 * len(numbers) + 4:
                batches = [stream.read_next_batch() for _ in range(numbers[-1] + 1)]
                if len(numbers) < len(batches):
                    batches = [batches[k] for k in numbers]
            else:
                reader = ipc.open_file(data, options=READ_OPTIONS)
                batches = [reader.get_batch(b) for b in numbers]
    except StopIteration:
        raise CorruptStoreError(f"payload segment {where!r} has no row {wanted[-1]}") from None
    return batches, schema, per, numbers
