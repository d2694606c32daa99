"""What a payload file is, told by its name, and how a table is laid out in a segment.

A file's kind (``SegmentKind``) is the one place names are told apart: its
suffix says the format (Arrow IPC ``.arrow``, Parquet ``.parquet``, a
temporary ``.tmp``), and among Arrow files the ``samples-`` prefix says a
sample segment. Every segment records its rows per record batch (row group)
in its schema metadata (``ROWS_PER_BATCH``): a reader finds a row's batch by
division.
"""

from __future__ import annotations

import enum
import time
import uuid

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

__all__ = ["SegmentKind", "dated_name", "SAMPLE_COMPRESSION", "PARQUET_COMPRESSION", "CODECS", "ROWS_PER_BATCH",
           "READ_OPTIONS", "write_table", "rows_per_batch"]


def dated_name(prefix: str, suffix: str) -> str:
    """A new unique file name: ``prefix``, today's date, a random hex, ``suffix``."""
    return f"{prefix}{time.strftime('%Y%m%d')}-{uuid.uuid4().hex}{suffix}"


class SegmentKind(enum.Enum):
    """What a file of the payload location is, by its name (``of``): (prefix, suffix)."""

    EVENTS = ("events-", ".arrow")  # the event log's: one per append call, group commit or compaction
    SAMPLES = ("samples-", ".arrow")  # the materializer's: one per materialization batch
    SAMPLES_PARQUET = ("samples-", ".parquet")  # sample segments written before they were Arrow IPC; still read
    TEMPORARY = ("", ".tmp")  # an atomic write's file before its rename
    OTHER = ("", "")  # not a payload file (a clock probe, anything else)

    @classmethod
    def of(cls, name: str) -> SegmentKind:
        """The kind of file ``name`` is. By its suffix first (the format); an Arrow
        file not named ``samples-`` is written and read as the log's, a Parquet
        file is an old sample segment whatever its prefix."""
        if name.endswith(".arrow"):
            return cls.SAMPLES if name.startswith(cls.SAMPLES.prefix) else cls.EVENTS
        if name.endswith(".parquet"):
            return cls.SAMPLES_PARQUET
        if name.endswith(".tmp"):
            return cls.TEMPORARY
        return cls.OTHER

    @property
    def prefix(self) -> str:
        return self.value[0]

    @property
    def suffix(self) -> str:
        return self.value[1]

    @property
    def is_arrow(self) -> bool:
        """An Arrow IPC file (else Parquet, when it is a segment)."""
        return self.suffix == ".arrow"

    @property
    def is_segment(self) -> bool:
        """A finished segment file, one an index row may name."""
        return self in (SegmentKind.EVENTS, SegmentKind.SAMPLES, SegmentKind.SAMPLES_PARQUET)

    def new_name(self) -> str:
        """A new unique name of this kind (``dated_name``)."""
        return dated_name(self.prefix, self.suffix)


# Sample segments (``samples-*.arrow``) are uncompressed Arrow IPC: the reader maps
# them and hands out views, and zstd on near-random route ids saved ~13% of the
# bytes for most of the materializer's CPU (docs/benchmarks.md, "Sample segments").
SAMPLE_COMPRESSION: str | None = None
# Sample segments written before that were Parquet with zstd on every column;
# they are still read, and a ``.parquet`` segment is still written this way.
PARQUET_COMPRESSION = "zstd"
CODECS = (None, "lz4", "zstd")

ROWS_PER_BATCH = "trajstore.rows_per_batch"
# A segment's buffers are views of its memory map: nothing for threads to do but hand work over.
READ_OPTIONS = ipc.IpcReadOptions(use_threads=False)


def write_table(name: str, table: pa.Table, sink, rows_per_batch: int, log_compression: str | None) -> None:
    """Write ``table`` to ``sink`` in the format of segment ``name`` (``SegmentKind``)."""
    kind = SegmentKind.of(name)
    if kind.is_arrow:
        codec = SAMPLE_COMPRESSION if kind is SegmentKind.SAMPLES else log_compression
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
        pq.write_table(table, sink, compression=PARQUET_COMPRESSION, use_dictionary=False,
                       write_statistics=False, row_group_size=rows_per_batch)


def rows_per_batch(table: pa.Table, target_bytes: int = 1 << 20) -> int:
    """Rows per record batch so that a batch holds about ``target_bytes``."""
    if table.num_rows == 0:
        return 1
    return max(1, int(target_bytes * table.num_rows // max(1, table.nbytes)))
