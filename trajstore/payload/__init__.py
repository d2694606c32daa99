"""Payload segments: the heavy token-level columns, in Arrow IPC (and older Parquet) files.

The public surface is ``PayloadStore`` (``Store.payload``: the segment files of
a payload location) and ``SegmentRows`` (rows it reads). The modules:

* ``_store.py``       ``PayloadStore``: segment writes, reads, listing, GC;
* ``_format.py``      ``SegmentKind`` (what a file is, by its name) and a segment's layout;
* ``_columns.py``     Arrow columns from numpy buffers and back, ``SegmentRows``;
* ``_filesystem.py``  a payload location (path or URI, S3 options) as a pyarrow filesystem;
* ``_deadline.py``    one deadline for an append's object-store requests;
* ``_durable.py``     fsync by path, the one atomic durable write (temporary file, rename);
* ``_reserve.py``     the reserve of empty log segment files an append fills;
* ``_direct.py``      the sample segments' writer (one laid-out image, ``O_DIRECT``);
* ``_home.py``        where the payload lives: recorded in the store, marked, checked at open, moved.

Names this module once exported that are internal now (``list_column``,
``fsync_dir``, ``write_arrow_segment``, ...) still import from here, with a
``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from trajstore.payload._columns import SegmentRows
from trajstore.payload._store import PayloadStore

__all__ = ["PayloadStore", "SegmentRows"]

# name once exported here -> (its module now, its name there)
_MOVED_NAMES = {
    "list_column": ("trajstore.payload._columns", "list_column"),
    "binary_column": ("trajstore.payload._columns", "binary_column"),
    "column_chunks": ("trajstore.payload._columns", "column_chunks"),
    "binary_chunks": ("trajstore.payload._columns", "binary_chunks"),
    "routes_from_bytes": ("trajstore.payload._columns", "routes_from_bytes"),
    "rows_per_batch": ("trajstore.payload._format", "rows_per_batch"),
    "fsync_dir": ("trajstore.payload._durable", "fsync_path"),
    "write_arrow_segment": ("trajstore.payload._direct", "write_arrow_segment"),
    "filesystem_of": ("trajstore.payload._filesystem", "filesystem_of"),
    "is_uri": ("trajstore.payload._filesystem", "is_uri"),
    "S3_DEFAULTS": ("trajstore.payload._filesystem", "S3_DEFAULTS"),
}


def __getattr__(name: str) -> Any:
    moved = _MOVED_NAMES.get(name)
    if moved is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, new = moved
    warnings.warn(f"trajstore.payload.{name} is internal now and deprecated here; it is {module}.{new}",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), new)
