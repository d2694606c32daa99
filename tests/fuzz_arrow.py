"""Structure-aware mutation of valid Arrow IPC event bodies, for the ingest service fuzz test.

A case is one simulated trajectory (``trajstore.demo._simulate``) under a
fresh id, encoded as the Writer encodes it (``encode_arrow_events``), then
changed by one mutation that knows the stream's structure:

* ``node_*`` / ``batch_length``: a column's row or null count, the batch's
  row count, patched in the record batch's flatbuffer;
* ``buffer_offset`` / ``buffer_length``: where a buffer lies in the body;
* ``offsets``: one value offset of the ``event`` or an array column set out
  of order, negative, past the data or to 2**31-1 / 2**62;
* ``validity``, ``data_bytes``: random validity bits, bytes flipped inside the
  JSON text (invalid UTF-8, broken JSON, a changed field) or an array's bytes;
* ``schema_*``: a column duplicated, renamed (unknown, or another array
  field's name), dropped, added, retyped, dictionary-encoded;
* ``compressed_*``: the same batch zstd- or lz4-compressed;
* ``marker``: a lying ``$arrow`` dtype or shape;
* ``stream_*``: bytes flipped anywhere, truncated, a message duplicated,
  the end-of-stream marker dropped, garbage appended, two streams joined;
* ``split`` / ``none``: valid bodies (several record batches, or as sent).

Mutations that change bytes are applied to the serialized stream at the
positions the flatbuffers name, never by building invalid arrays in this
process (pyarrow's writer would read them out of bounds here).
"""

from __future__ import annotations

import json
import struct
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from fuzz_events import CONFIG
from trajstore.demo._simulate import trajectory_events
from trajstore.ingest.arrow_body import encode_arrow_events

_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


class _Flat:
    """Just enough of a flatbuffer reader to find Arrow's Message fields (Message.fbs, Schema.fbs)."""

    def __init__(self, buf: bytes, base: int) -> None:
        self.buf, self.base = buf, base  # base: where the flatbuffer starts in the whole stream

    def u32(self, p: int) -> int:
        return struct.unpack_from("<I", self.buf, p)[0]

    def table(self, p: int) -> int:
        return p + self.u32(p)

    def field(self, tab: int, index: int) -> int:
        vt = tab - struct.unpack_from("<i", self.buf, tab)[0]
        slot = 4 + 2 * index
        if slot >= struct.unpack_from("<H", self.buf, vt)[0]:
            return 0
        at = struct.unpack_from("<H", self.buf, vt + slot)[0]
        return tab + at if at else 0

    def vector(self, p: int) -> tuple[int, int]:
        """(position of the first element, count) of the vector an offset field at ``p`` points to."""
        v = self.table(p)
        return v + 4, self.u32(v)


def _messages(body: bytes) -> list[dict[str, Any]]:
    """Each message's absolute positions: metadata, body, and for record batches the
    length field, field nodes and buffers (absolute offsets of the 16-byte structs)."""
    out = []
    pos = 0
    while pos + 8 <= len(body):
        cont, size = struct.unpack_from("<Ii", body, pos)
        if cont != 0xFFFFFFFF or size == 0:
            break
        meta = pos + 8
        flat = _Flat(body, 0)
        root = flat.table(meta)
        header_type = body[flat.field(root, 1)] if flat.field(root, 1) else 0
        body_length_at = flat.field(root, 3)
        body_length = struct.unpack_from("<q", body, body_length_at)[0] if body_length_at else 0
        start = meta + size
        msg = {"start": pos, "meta": meta, "body": start, "end": start + body_length, "type": header_type}
        if header_type == 3:  # RecordBatch
            rb = flat.table(flat.field(root, 2))
            msg["length_at"] = flat.field(rb, 0)
            msg["nodes"] = flat.vector(flat.field(rb, 1)) if flat.field(rb, 1) else (0, 0)
            msg["buffers"] = flat.vector(flat.field(rb, 2)) if flat.field(rb, 2) else (0, 0)
        out.append(msg)
        pos = start + body_length
    return out


def _valid_events(tid: str, index: int) -> list[dict]:
    return [dict(ev, trajectory_id=tid) for ev in trajectory_events(CONFIG, index)]


def _table(body: bytes) -> pa.Table:
    return ipc.open_stream(pa.py_buffer(body)).read_all()


def _write(table: pa.Table | pa.RecordBatch, **options) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema, options=ipc.IpcWriteOptions(**options)) as w:
        if isinstance(table, pa.Table):
            w.write_table(table)
        else:
            w.write_batch(table)
    return sink.getvalue().to_pybytes()


_NUMBERS = (-1, 0, 1, 2, 7, 255, 2**31 - 1, 2**31, 2**32 + 3, 2**62, -(2**63), 100_000)


def _number(rng: np.random.Generator, near: int) -> int:
    if rng.random() < 0.5:
        return int(_NUMBERS[rng.integers(0, len(_NUMBERS))])
    return int(near + rng.integers(-3, 4))


def _patch_i64(body: bytearray, at: int, rng: np.random.Generator) -> None:
    old = struct.unpack_from("<q", body, at)[0]
    value = _number(rng, old)
    struct.pack_into("<q", body, at, max(-(2**63), min(2**63 - 1, value)))


def _batch(body: bytes) -> dict[str, Any]:
    return next(m for m in _messages(body) if m["type"] == 3)


def _buffer(body: bytes, msg: dict, k: int) -> tuple[int, int]:
    first, _ = msg["buffers"]
    off, length = struct.unpack_from("<qq", body, first + 16 * k)
    return msg["body"] + off, length


def _m_node(body: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    out = bytearray(body)
    msg = _batch(body)
    first, count = msg["nodes"]
    k = int(rng.integers(0, count))
    which = int(rng.integers(0, 2))
    _patch_i64(out, first + 16 * k + 8 * which, rng)
    return bytes(out), ("node_length", "node_null_count")[which]


def _m_batch_length(body: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    out = bytearray(body)
    msg = _batch(body)
    if not msg["length_at"]:
        return body, "none"
    _patch_i64(out, msg["length_at"], rng)
    return bytes(out), "batch_length"


def _m_buffer_place(body: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    out = bytearray(body)
    msg = _batch(body)
    first, count = msg["buffers"]
    k = int(rng.integers(0, count))
    which = int(rng.integers(0, 2))
    _patch_i64(out, first + 16 * k + 8 * which, rng)
    return bytes(out), ("buffer_offset", "buffer_length")[which]


def _m_offsets(body: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """One value offset of a column: buffers are (validity, offsets, data) per column in schema order."""
    out = bytearray(body)
    msg = _batch(body)
    _, count = msg["buffers"]
    column = int(rng.integers(0, count // 3))
    at, length = _buffer(body, msg, 3 * column + 1)
    width = 4 if column == 0 else 8  # event is utf8 (int32 offsets), the arrays large_binary (int64)
    n = length // width
    if n == 0:
        return body, "none"
    i = int(rng.integers(0, n))
    fmt = "<i" if width == 4 else "<q"
    old = struct.unpack_from(fmt, out, at + i * width)[0]
    choice = int(rng.integers(0, 5))
    if choice == 0 and n > 1:  # swap with a neighbour: out of order
        j = i + 1 if i + 1 < n else i - 1
        a, b = struct.unpack_from(fmt, out, at + j * width)[0], old
        struct.pack_into(fmt, out, at + i * width, a)
        struct.pack_into(fmt, out, at + j * width, b)
        return bytes(out), "offsets_swapped"
    value = [-1, old + 1, 2**31 - 1, 100_000 if width == 4 else 2**62, 2 * 10**9][choice]
    value = max(-(2**31), min(2**31 - 1, value)) if width == 4 else value
    struct.pack_into(fmt, out, at + i * width, value)
    return bytes(out), "offsets"


def _m_validity(body: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    out = bytearray(body)
    msg = _batch(body)
    _, count = msg["buffers"]
    for k in range(0, count, 3):
        at, length = _buffer(body, msg, k)
        if length:
            for i in range(length):
                out[at + i] = int(rng.integers(0, 256))
            return bytes(out), "validity"
    # no validity buffer sent: claim nulls the body has no bitmap for
    first, _ = msg["nodes"]
    struct.pack_into("<q", out, first + 8, 1)
    return bytes(out), "validity_missing"


def _m_data(body: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    out = bytearray(body)
    msg = _batch(body)
    _, count = msg["buffers"]
    column = int(rng.integers(0, count // 3)) if rng.random() < 0.5 else 0
    at, length = _buffer(body, msg, 3 * column + 2)
    if length <= 0:
        return body, "none"
    for _ in range(int(rng.integers(1, 4))):
        i = int(rng.integers(0, length))
        out[at + i] = int(rng.choice([0x00, 0xFF, 0xC3, 0x80, 0x22, 0x7B, 0x5C, int(rng.integers(0, 256))]))
    return bytes(out), "data_bytes_event" if column == 0 else "data_bytes_array"


def _m_schema(body: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    table = _table(body)
    names = table.column_names
    k = int(rng.integers(0, len(names)))
    choice = int(rng.integers(0, 8))
    cols = list(table.columns)
    if choice == 0:
        cols.append(cols[k])
        names = names + [names[k]]
        kind = "schema_duplicate"
    elif choice == 1:
        names = list(names)
        names[k] = str(rng.choice(["x", "prompt_id", "Event", "", "event ", "logprobs", "output_ids", "type"]))
        kind = "schema_rename"
    elif choice == 2 and len(names) > 1:
        del cols[k]
        names = names[:k] + names[k + 1:]
        kind = "schema_drop"
    elif choice == 3:
        cols.append(pa.chunked_array([pa.array([b"zz"] * len(table), pa.large_binary())]))
        names = names + ["loss_mask"]
        kind = "schema_add"
    elif choice == 4:
        to = [pa.large_string(), pa.binary(), pa.large_binary(), pa.string()][int(rng.integers(0, 4))]
        try:
            cols[k] = cols[k].cast(to)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return body, "none"
        kind = "schema_retype"
    elif choice == 5:
        cols[k] = pa.chunked_array([pa.array(np.arange(len(table)))])
        kind = "schema_int_column"
    elif choice == 6:
        cols[k] = cols[k].dictionary_encode()
        kind = "schema_dictionary"
    else:
        cols[k] = pa.chunked_array([pa.array([None] * len(table), cols[k].type)])
        kind = "schema_all_null"
    return _write(pa.table(cols, names=names)), kind


def _m_compressed(body: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    codec = str(rng.choice(["zstd", "lz4"]))
    return _write(_table(body), compression=codec), f"compressed_{codec}"


def _m_marker(body: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    table = _table(body)
    docs = table.column("event").to_pylist()
    i = int(rng.integers(0, len(docs)))
    doc = json.loads(docs[i])
    marked = [k for k, v in doc.items() if isinstance(v, dict) and "$arrow" in v]
    if not marked:
        doc["prompt_ids"] = {"$arrow": {"dtype": "int32", "shape": [1]}}
    else:
        mark = doc[str(rng.choice(marked))]["$arrow"]
        mark[str(rng.choice(["dtype", "shape"]))] = [
            "float16", "int64", "object", None, [2**40], [-1], [0], "int32", [1, 2, 3], {"a": 1}, "<i4",
        ][int(rng.integers(0, 11))]
    docs[i] = json.dumps(doc)
    return _write(table.set_column(0, "event", pa.array(docs, pa.string()))), "marker"


def _m_stream(body: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    choice = int(rng.integers(0, 7))
    msgs = _messages(body)
    if choice == 0:
        out = bytearray(body)
        for _ in range(int(rng.integers(1, 9))):
            out[int(rng.integers(0, len(out)))] = int(rng.integers(0, 256))
        return bytes(out), "stream_bytes"
    if choice == 1:
        return body[: int(rng.integers(0, len(body)))], "stream_truncated"
    if choice == 2:
        m = msgs[-1]
        return body[: m["end"]] + body[m["start"]: m["end"]] + _EOS, "stream_batch_twice"
    if choice == 3:
        return body[: msgs[-1]["end"]], "stream_no_eos"
    if choice == 4:
        return body + bytes(rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8)), "stream_garbage"
    if choice == 5:
        s = msgs[0]
        return body[s["start"]: s["end"]] + body[s["start"]: s["end"]] + body[s["end"]:], "stream_schema_twice"
    s, b = msgs[0], msgs[-1]
    return body[b["start"]: b["end"]] + body[s["start"]: s["end"]] + _EOS, "stream_batch_first"


def _m_split(body: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    table = _table(body)
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=int(rng.integers(1, 4))):
            w.write_batch(batch)
    return sink.getvalue().to_pybytes(), "split"


MUTATIONS: list[tuple[float, Callable[[bytes, np.random.Generator], tuple[bytes, str]]]] = [
    (1.0, _m_node), (0.5, _m_batch_length), (1.0, _m_buffer_place), (2.0, _m_offsets), (0.7, _m_validity),
    (1.5, _m_data), (1.5, _m_schema), (0.7, _m_compressed), (0.8, _m_marker), (1.5, _m_stream),
    (0.4, _m_split), (0.6, lambda body, rng: (body, "none")),
]
_WEIGHTS = np.array([w for w, _ in MUTATIONS]) / sum(w for w, _ in MUTATIONS)


def make_cases(n: int, seed: int = 0, prefix: str = "af") -> list[tuple[bytes, str, frozenset]]:
    """``n`` cases: (body, mutation name, the trajectory ids the unmutated body held)."""
    rng = np.random.default_rng(seed)
    cases = []
    for c in range(n):
        tid = f"{prefix}-{seed}-{c}"
        body = encode_arrow_events(_valid_events(tid, c % 64))
        _, mutate = MUTATIONS[int(rng.choice(len(MUTATIONS), p=_WEIGHTS))]
        mutated, name = mutate(body, rng)
        cases.append((mutated, name, frozenset({tid})))
    return cases
