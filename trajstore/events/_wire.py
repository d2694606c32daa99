"""Decoding the wire format's ARRAY values into numpy arrays.

An ARRAY on the wire is one of (docs/reference.md "Event wire format"):

* a JSON nested list of numbers;
* ``{"b64": ..., "dtype": "uint8", "shape": [rows, layers, topk]}``: raw
  little-endian C-order bytes;
* a base64 string of a ``.npy`` file (what vLLM's OpenAI-compatible server
  puts in ``choices[i].routed_experts``).

Numpy arrays are accepted as they are (in-process callers, vLLM adapters).
Decoding never loops over elements in Python: lists go through ``np.asarray``
and bytes through ``np.frombuffer``.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
from typing import Any

import numpy as np

try:  # SIMD base64 (AVX2/NEON): decodes 25-35x faster than CPython's, same strictness
    import pybase64 as _b64
except ImportError:  # pragma: no cover - pybase64 is a core dependency; stdlib only as a fallback
    _b64 = base64

from trajstore.errors import ValidationError, first_line

__all__ = ["decode_array", "encode_b64", "encode_npy_b64"]

_ALLOWED_DTYPES = {
    "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "float32", "float64", "bool",
}
_LITTLE_ENDIAN = {name: np.dtype(name).newbyteorder("<") for name in _ALLOWED_DTYPES}  # how the wire lays them out


def decode_array(value: Any, *, field: str, ndim: int | None = None) -> np.ndarray:
    """Decode one ARRAY value of field ``field``; raise ValidationError naming it."""
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, (list, tuple)):
        arr = _from_list(value, field)
    elif isinstance(value, dict):
        arr = _from_b64_object(value, field)
    elif isinstance(value, (str, bytes)):
        arr = _from_npy_b64(value, field)
    else:
        raise ValidationError(
            f"{field} must be a list, a {{b64,dtype,shape}} object or a base64 .npy string, "
            f"got {type(value).__name__}",
            rule="array_encoding",
        )
    if ndim is not None and arr.ndim != ndim and not (arr.size == 0 and ndim > 1):
        raise ValidationError(
            f"{field} must have {ndim} dimension(s), got shape {list(arr.shape)}",
            rule="array_shape",
        )
    return arr


_MAX_NDIM = 8
_MAX_DIM = (1 << 31) - 1  # no dimension of any wire array exceeds int32


def _from_list(value: list | tuple, field: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:  # ragged nesting, too deep, ints beyond float
        raise ValidationError(f"{field} is not a rectangular list of numbers ({first_line(e, limit=120)})",
                              rule="array_shape") from None
    except RecursionError:
        raise ValidationError(f"{field} is nested too deeply", rule="array_shape") from None
    if arr.dtype == object:
        if arr.ndim and all(isinstance(x, int) and not isinstance(x, bool) for x in arr.flat):  # error path only
            raise ValidationError(f"{field} holds an integer beyond 64 bits", rule="int32_range")
        raise ValidationError(f"{field} is a ragged or mixed-type list", rule="array_shape")
    if arr.size and arr.dtype.kind not in "biuf":
        raise ValidationError(f"{field} holds non-numeric values ({arr.dtype})", rule="array_dtype")
    if arr.size == 0:
        arr = arr.astype(np.int64)
    return arr


def _safe_repr(value: Any, limit: int = 40) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int over 4,300 digits has no str()
        text = f"<huge {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _b64decode(text: Any, field: str) -> bytes:
    if not isinstance(text, (str, bytes)):
        raise ValidationError(f"{field} b64 must be a base64 string, got {type(text).__name__}", rule="array_encoding")
    try:
        return _b64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        pass
    # What pybase64 refuses, CPython may still accept (e.g. excess trailing
    # "=" after a full quantum): it has the last word, so acceptance is exactly
    # what it was. Only refused input pays for the second decode.
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValidationError(f"{field} is not valid base64 ({first_line(e, limit=120)})", rule="array_encoding") from None


def _check_shape(shape: Any, field: str) -> tuple[int, ...]:
    """A list of at most ``_MAX_NDIM`` non-negative ints, none above int32 (products are Python ints)."""
    if type(shape) is list and len(shape) == 1 and type(shape[0]) is int and 0 <= shape[0] <= _MAX_DIM:
        return (shape[0],)  # a per-token array's [n], as JSON gives it
    if type(shape) in (list, tuple) and len(shape) <= _MAX_NDIM and all(
            type(d) is int and 0 <= d <= _MAX_DIM for d in shape):
        return tuple(shape)  # plain ints (what JSON gives): no ABC checks
    if (not isinstance(shape, (list, tuple)) or len(shape) > _MAX_NDIM
            or not all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_))
                       and 0 <= d <= _MAX_DIM for d in shape)):
        try:
            text = repr(shape)
        except ValueError:  # an int over 4,300 digits has no str()
            text = f"<{type(shape).__name__} holding a huge integer>"
        text = text if len(text) <= 80 else text[:77] + "..."
        raise ValidationError(
            f"{field} shape must be a list of at most {_MAX_NDIM} integers in [0, {_MAX_DIM}], got {text}",
            rule="array_shape")
    return tuple(int(d) for d in shape)


def _from_b64_object(value: dict, field: str) -> np.ndarray:
    if not (len(value) == 3 and "b64" in value and "dtype" in value and "shape" in value):  # exactly the three keys
        missing = {"b64", "dtype", "shape"} - value.keys()
        if missing:
            raise ValidationError(
                f"{field} object lacks {sorted(missing)} (needs b64, dtype, shape)", rule="array_encoding"
            )
        extra = [k for k in value if k not in ("b64", "dtype", "shape")]
        raise ValidationError(f"{field} object has unknown key {_safe_repr(extra[0])} (b64, dtype, shape only)",
                              rule="array_encoding")
    dtype_name = value["dtype"]
    dtype = _LITTLE_ENDIAN.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise ValidationError(f"{field} has unsupported dtype {_safe_repr(dtype_name)}", rule="array_dtype")
    shape = _check_shape(value["shape"], field)
    raw = _b64decode(value["b64"], field)
    expected = math.prod(shape) * dtype.itemsize  # Python ints: a huge shape cannot overflow
    if len(raw) != expected:
        raise ValidationError(
            f"{field} holds {len(raw)} bytes but dtype {dtype_name} and shape {list(shape)} need {expected}",
            rule="array_shape",
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _from_npy_b64(value: str | bytes, field: str) -> np.ndarray:
    """A base64 ``.npy`` file: the header is read and checked here (numeric dtypes only, the
    data length must match the shape), then the data is viewed in place. Never unpickles."""
    raw = _b64decode(value, field)
    fast = _npy_header(raw)
    if fast is not None:
        shape, fortran, dtype, offset = fast
    else:
        buf = io.BytesIO(raw)
        try:
            version = np.lib.format.read_magic(buf)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
            elif version in ((2, 0), (3, 0)):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(buf)
            else:
                raise ValueError(f"unsupported .npy version {version}")
        except Exception as e:  # noqa: BLE001 - any failure to read a hostile header is a refusal
            raise ValidationError(f"{field} is not a base64 .npy file ({first_line(e, limit=120)})",
                                  rule="array_encoding") from None
        offset = buf.tell()
    if dtype.hasobject or dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None:
        raise ValidationError(f"{field} .npy holds unsupported dtype {str(dtype)[:40]}", rule="array_dtype")
    shape = _check_shape(shape, field)
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) - offset != expected:
        raise ValidationError(
            f"{field} is not a base64 .npy file ({len(raw) - offset} data bytes, shape {list(shape)} "
            f"of {dtype} needs {expected})", rule="array_encoding")
    arr = np.frombuffer(raw, dtype=dtype, count=math.prod(shape), offset=offset)
    return arr.reshape(shape, order="F" if fortran else "C")


# The header ``np.save`` writes for a plain numeric array, exactly (numpy's own
# parser, ``read_array_header_*``, goes through ``ast.literal_eval``: ~0.1 ms
# per array, 4x the base64 decoding of a 600-row route table). Any other
# header, however valid, takes numpy's parser.
_NPY_HEADER = re.compile(rb"\{'descr': '([<>|=][biuf][0-9]{1,2})', 'fortran_order': (True|False), "
                         rb"'shape': \(((?:[0-9]{1,12}, )*[0-9]{1,12},?|)\), \} *\n")


def _npy_header(raw: bytes) -> tuple[tuple[int, ...], bool, np.dtype, int] | None:
    """(shape, fortran order, dtype, data offset) of a ``.npy`` header in
    ``np.save``'s exact form, else None (numpy's parser decides)."""
    if len(raw) < 12 or raw[:6] != b"\x93NUMPY":
        return None
    major = raw[6]
    if major == 1:
        start = 10
        length = int.from_bytes(raw[8:10], "little")
    elif major in (2, 3):
        start = 12
        length = int.from_bytes(raw[8:12], "little")
    else:
        return None
    m = _NPY_HEADER.fullmatch(raw, start, start + length)
    if m is None:
        return None
    dims = m.group(3).decode("ascii").rstrip(",")
    shape = tuple(int(d) for d in dims.split(", ")) if dims else ()
    if len(shape) == 1 and not m.group(3).endswith(b","):
        return None  # "(5)" is not numpy's tuple syntax
    return shape, m.group(2) == b"True", np.dtype(m.group(1).decode("ascii")), start + length


def encode_b64(arr: np.ndarray) -> dict:
    """The ``{b64, dtype, shape}`` wire form of ``arr`` (little-endian, C order)."""
    arr = np.ascontiguousarray(arr)
    le = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return {"b64": _b64.b64encode(le.tobytes()).decode("ascii"), "dtype": arr.dtype.name, "shape": list(arr.shape)}


def encode_npy_b64(arr: np.ndarray) -> str:
    """The base64 ``.npy`` wire form of ``arr`` (as vLLM's OpenAI server sends routes)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return _b64.b64encode(buf.getvalue()).decode("ascii")
