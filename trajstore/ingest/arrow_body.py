"""A binary ``POST /v1/events`` body: one Arrow IPC stream, no JSON arrays, no base64.

Content type ``application/vnd.apache.arrow.stream``. A client that holds
numpy arrays (a rollout worker, the proxy) sends their bytes as they are; the
service maps them back as zero-copy numpy views of the request body.

Layout: one row per event.

* column ``event`` (utf8): the event as JSON, except that each top-level field
  whose value is a numpy array is replaced by the marker
  ``{"$arrow": {"dtype": "<numpy dtype name>", "shape": [...]}}``;
* one ``large_binary`` column per such field name (``prompt_ids``,
  ``routed_experts``, ...): the array's raw little-endian C-order bytes in the
  event's row, null in rows where that field is not an array.

Every event rule still applies after decoding (``trajstore.events``); this
module only checks what the transport itself must: a readable stream, the
``event`` column, markers naming a column and a dtype/shape whose size equals
the bytes sent (refused with the same rules as a ``{b64, dtype, shape}``
ARRAY: ``array_dtype``, ``array_shape``).
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from trajstore._wire import _ALLOWED_DTYPES, _LITTLE_ENDIAN
from trajstore.errors import ValidationError
from trajstore.ingest._event_dicts import json_default

__all__ = ["ARROW_CONTENT_TYPE", "ArrowBodyError", "decode_arrow_events", "encode_arrow_events"]

ARROW_CONTENT_TYPE = "application/vnd.apache.arrow.stream"
_MARK = "$arrow"


class ArrowBodyError(ValueError):
    """The body is not an Arrow IPC stream of the layout above (HTTP 400)."""


def encode_arrow_events(events: Sequence[Mapping[str, Any]]) -> bytes:
    """The Arrow IPC stream body for ``events``: each top-level numpy array
    (of a dtype the wire format takes) is sent as its raw bytes; every other
    value goes into the event's JSON exactly as the JSON body sends it (lists
    as lists, numpy scalars as numbers, other arrays as ``{b64, dtype,
    shape}``), so both bodies are held to the same rules."""
    docs: list[str] = []
    columns: dict[str, list[Any]] = {}
    for i, ev in enumerate(events):
        doc = {}
        for key, value in ev.items():
            if isinstance(value, np.ndarray) and value.dtype.name in _ALLOWED_DTYPES:
                arr = np.ascontiguousarray(value)
                arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
                doc[key] = {_MARK: {"dtype": arr.dtype.name, "shape": list(arr.shape)}}
                columns.setdefault(key, [None] * len(events))[i] = arr.reshape(-1).view(np.uint8)
            else:
                doc[key] = value
        docs.append(json.dumps(doc, separators=(",", ":"), default=json_default))
    arrays = {"event": pa.array(docs, pa.string())}
    for key, values in columns.items():
        arrays[key] = _binary(values)
    table = pa.table(arrays)
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def decode_arrow_events(body: bytes | memoryview) -> list[dict[str, Any]]:
    """The events of an Arrow body, arrays as numpy views of ``body``.

    Raises ArrowBodyError for an unreadable body and ValidationError (with the
    event's index) for an array marker that does not match its bytes. Works on
    the record batches' buffers directly (no table, no Python objects per
    value, nothing from ``pyarrow.compute``): a ~1-MiB event decodes in tens of
    microseconds."""
    try:
        reader = ipc.open_stream(pa.py_buffer(body))
        batches = list(reader)
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise ArrowBodyError(f"body is not an Arrow IPC stream ({e})") from None
    schema = reader.schema
    if "event" not in schema.names or not pa.types.is_string(schema.field("event").type):
        raise ArrowBodyError("Arrow body lacks a utf8 'event' column")
    binary_names = []
    for field in schema:
        if field.name == "event":
            continue
        if not pa.types.is_large_binary(field.type):
            raise ArrowBodyError(f"Arrow body column {field.name!r} must be large_binary")
        binary_names.append(field.name)
    out: list[dict[str, Any]] = []
    for batch in batches:
        binaries = {name: _row_views(batch.column(name)) for name in binary_names}
        for j, text in enumerate(batch.column("event").to_pylist()):
            i = len(out)
            try:
                doc = json.loads(text) if text is not None else None
            except ValueError as e:
                raise ArrowBodyError(f"event {i} is not valid JSON ({e})") from None
            if not isinstance(doc, dict):
                raise ArrowBodyError(f"event {i} must be a JSON object")
            for key, value in doc.items():
                if isinstance(value, dict) and _MARK in value:
                    try:
                        doc[key] = _array(value[_MARK], binaries.get(key), j, key)
                    except ValidationError as e:
                        tid = doc.get("trajectory_id")
                        raise e.at(i, tid if isinstance(tid, str) else None) from None
            out.append(doc)
    return out


def _binary(values: list[np.ndarray | None]) -> pa.Array:
    lengths = np.fromiter((0 if v is None else v.nbytes for v in values), np.int64, len(values))
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    present = [v for v in values if v is not None]
    data = np.concatenate(present) if present else np.zeros(0, np.uint8)
    validity = None
    if any(v is None for v in values):
        validity = pa.array(np.fromiter((v is not None for v in values), bool, len(values))).buffers()[1]
    return pa.Array.from_buffers(pa.large_binary(), len(values),
                                 [validity, pa.py_buffer(offsets), pa.py_buffer(data)])


def _row_views(chunk: pa.Array) -> list[np.ndarray | None]:
    """Per-row uint8 views of a large_binary array (zero-copy; reads the buffers, no compute kernels)."""
    n = len(chunk)
    validity, offsets_buf, data = chunk.buffers()
    offsets = np.frombuffer(offsets_buf, np.int64)[chunk.offset: chunk.offset + n + 1].tolist()
    data_np = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
    if chunk.null_count == 0:
        return [data_np[offsets[k]:offsets[k + 1]] for k in range(n)]
    bits = np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")[chunk.offset: chunk.offset + n]
    return [data_np[offsets[k]:offsets[k + 1]] if bits[k] else None for k in range(n)]


def _array(mark: Any, views: list[np.ndarray | None] | None, row: int, field: str) -> np.ndarray:
    if not isinstance(mark, dict) or views is None or views[row] is None:
        raise ValidationError(f"{field} is marked as an Arrow array but its column has no bytes for this event",
                              rule="array_encoding")
    dtype_name, shape = mark.get("dtype"), mark.get("shape")
    if dtype_name not in _ALLOWED_DTYPES:
        raise ValidationError(f"{field} has unsupported dtype {dtype_name!r}", rule="array_dtype")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValidationError(f"{field} shape must be a list of non-negative ints, got {shape!r}", rule="array_shape")
    raw = views[row]
    dtype = _LITTLE_ENDIAN[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if raw.nbytes != expected:
        raise ValidationError(
            f"{field} holds {raw.nbytes} bytes but dtype {dtype_name} and shape {shape} need {expected}",
            rule="array_shape")
    return raw.view(dtype).reshape(shape)
