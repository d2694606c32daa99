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
ARRAY: ``array_dtype``, ``array_shape``), no column twice, no column that is
no event field (refused as ``unknown_field`` naming the first event with bytes
in it, before they are read), every batch valid in full, and no compressed batch (refused
with 415: the service bounds its memory by the bytes it receives, and a few
KiB of zstd can inflate to GiBs).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from trajstore.events._wire import _ALLOWED_DTYPES, _LITTLE_ENDIAN
from trajstore.errors import ValidationError
from trajstore.events import _FIELDS
from trajstore.ingest._event_dicts import json_default

__all__ = ["ARROW_CONTENT_TYPE", "ArrowBodyError", "decode_arrow_events", "encode_arrow_events"]

ARROW_CONTENT_TYPE = "application/vnd.apache.arrow.stream"
_MARK = "$arrow"
# Columns a body may carry besides ``event``: the field names of the wire format.
_EVENT_FIELDS = frozenset().union(*_FIELDS.values())


class ArrowBodyError(ValueError):
    """The body is not an Arrow IPC stream of the layout above: HTTP ``status``
    (400; 415 for a compressed body, 422 for a column no event field names)."""

    def __init__(self, message: str, *, status: int = 400, rule: str = "malformed_body") -> None:
        super().__init__(message)
        self.status, self.rule = status, rule


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

    Raises ArrowBodyError for a body that is not this layout and
    ValidationError (with the event's index) for an array marker that does
    not match its bytes. Works on the record batches' buffers directly (no
    table, no Python objects per value, nothing from ``pyarrow.compute``): a
    ~1-MiB event decodes in tens of microseconds.

    Hostile bodies: the schema is checked before any batch is read (only the
    ``event`` column and wire-format field names, each once); a compressed
    batch is refused before it is decompressed (a few KiB of zstd can inflate
    to GiBs the byte budget never counted), so every buffer is a slice of
    ``body`` and decoding holds no more than the body; every batch is fully
    validated (offsets in order and in bounds, UTF-8) before a value is read."""
    try:
        messages = ipc.MessageReader.open_stream(pa.py_buffer(body))
        schema = ipc.read_schema(_next_message(messages, first=True))
    except (pa.ArrowException, OSError, ValueError, TypeError) as e:
        raise ArrowBodyError(f"body is not an Arrow IPC stream ({_first_line(e)})") from None
    binary_names = _check_schema(schema)
    out: list[dict[str, Any]] = []
    while (message := _next_message(messages)) is not None:
        if message.type != "record batch":
            raise ArrowBodyError(f"Arrow body holds a {message.type} message; only record batches are taken")
        if _compressed(message.metadata):
            raise ArrowBodyError("compressed Arrow IPC bodies are not accepted: send the buffers uncompressed "
                                 "(the byte budget counts the bytes sent)", status=415, rule="compressed_body")
        try:
            batch = ipc.read_record_batch(message, schema)
            batch.validate(full=True)
        except (pa.ArrowException, OSError, ValueError, TypeError) as e:
            where = f" after event {len(out) - 1}" if out else ""
            raise ArrowBodyError(f"Arrow record batch{where} is invalid ({_first_line(e)})") from None
        _decode_batch(batch, binary_names, out)
    return out


def _next_message(messages: Any, *, first: bool = False) -> Any:
    try:
        message = messages.read_next_message()
    except StopIteration:
        message = None
    except (pa.ArrowException, OSError, ValueError) as e:
        raise ArrowBodyError(f"body is not an Arrow IPC stream ({_first_line(e)})") from None
    if message is None and first:
        raise ArrowBodyError("body is not an Arrow IPC stream (it is empty)")
    return message


def _check_schema(schema: pa.Schema) -> list[str]:
    """The binary columns' names; ArrowBodyError for a column the layout does not have."""
    try:
        names = schema.names
    except UnicodeDecodeError:
        raise ArrowBodyError("Arrow body has a column name that is not UTF-8") from None
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ArrowBodyError(f"Arrow body has column {_short(name)} twice")
        seen.add(name)
    if "event" not in names or not pa.types.is_string(schema.field("event").type):
        raise ArrowBodyError("Arrow body lacks a utf8 'event' column")
    binary_names = []
    for f in schema:
        if f.name == "event":
            continue
        if not pa.types.is_large_binary(f.type):
            raise ArrowBodyError(f"Arrow body column {_short(f.name)} must be large_binary, not {f.type}")
        binary_names.append(f.name)
    return binary_names


def _decode_batch(batch: pa.RecordBatch, binary_names: list[str], out: list[dict[str, Any]]) -> None:
    for name in binary_names:
        if name not in _EVENT_FIELDS:
            _refuse_unknown_column(batch, name, len(out))
    binaries = {name: _row_views(batch.column(name)) for name in binary_names}
    for j, text in enumerate(batch.column("event").to_pylist()):
        i = len(out)
        try:
            doc = json.loads(text) if text is not None else None
        except (ValueError, RecursionError) as e:
            raise ArrowBodyError(f"event {i} is not valid JSON ({_first_line(e)})") from None
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


def _refuse_unknown_column(batch: pa.RecordBatch, name: str, first_index: int) -> None:
    """A column no event field names is refused before its values are read, naming the
    first event that carries bytes in it (as the JSON body names an event's unknown field)."""
    column = batch.column(name)
    if column.null_count == len(column):
        return  # no event has a value there: nothing to store, nothing to refuse
    row = 0
    if column.null_count:
        validity = column.buffers()[0]
        bits = np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")
        row = int(np.argmax(bits[column.offset:column.offset + len(column)]))
    tid = None
    try:
        doc = json.loads(batch.column("event")[row].as_py() or "null")
        tid = doc.get("trajectory_id") if isinstance(doc, dict) else None
    except ValueError:
        pass
    raise ValidationError(f"unknown field {_short(name)} (an Arrow column no event field names)",
                          rule="unknown_field").at(first_index + row, tid if isinstance(tid, str) else None)


def _compressed(metadata: pa.Buffer) -> bool:
    """Whether a record batch message names a body compression, read from its
    flatbuffer (``Message.header`` -> ``RecordBatch.compression``, Arrow's
    Message.fbs) before pyarrow decompresses anything. pyarrow has verified
    the flatbuffer when it read the message."""
    b = memoryview(metadata)

    def table(pos: int) -> int:  # an offset field: where its table starts
        return pos + struct.unpack_from("<I", b, pos)[0]

    def field(tab: int, index: int) -> int:  # a field's position in its table, 0 when absent
        vtable = tab - struct.unpack_from("<i", b, tab)[0]
        slot = 4 + 2 * index
        if slot >= struct.unpack_from("<H", b, vtable)[0]:
            return 0
        at = struct.unpack_from("<H", b, vtable + slot)[0]
        return tab + at if at else 0

    try:
        header = field(table(0), 2)  # Message: version, header_type, header, bodyLength, custom_metadata
        return bool(header) and bool(field(table(header), 3))  # RecordBatch: length, nodes, buffers, compression
    except struct.error:
        raise ArrowBodyError("body is not an Arrow IPC stream (unreadable message metadata)") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _short(name: str) -> str:
    return repr(name if len(name) <= 64 else name[:64] + "...")


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
    # count: a valid offsets buffer may be longer than the rows need, by any number of bytes
    offsets = np.frombuffer(offsets_buf, np.int64, count=chunk.offset + n + 1)[chunk.offset:].tolist()
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
    if not isinstance(dtype_name, str) or dtype_name not in _ALLOWED_DTYPES:
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
