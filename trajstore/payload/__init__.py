"""Payload segments: the heavy token-level columns, in Arrow IPC and Parquet files."""

from trajstore.payload._store import (  # noqa: F401
    S3_DEFAULTS,
    PayloadStore,
    SegmentRows,
    binary_chunks,
    binary_column,
    column_chunks,
    filesystem_of,
    fsync_dir,
    is_uri,
    list_column,
    routes_from_bytes,
    rows_per_batch,
    write_arrow_segment,
)

__all__ = ["PayloadStore", "SegmentRows", "list_column", "binary_column", "column_chunks", "binary_chunks",
           "routes_from_bytes", "rows_per_batch", "fsync_dir", "write_arrow_segment", "filesystem_of", "is_uri"]
