"""The wire format's typed field checks, shared by every event type's parser.

Ids, bounded text, int32 integers, finite numbers and ``metadata`` objects:
each check returns the value it accepts or raises ValidationError naming the
field and the bad value in one line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping  # isinstance against typing.Mapping is ~10x slower
from typing import Any

import numpy as np

from trajstore.errors import ValidationError

__all__ = ["validate_metadata"]

_INT32_MAX = np.iinfo(np.int32).max
_MAX_ID_CHARS = 255
"""ids (``trajectory_id``, ``group_id``, ``event_id``): at most this many code points."""
_MAX_METADATA_BYTES = 64 << 10
"""``metadata`` as compact UTF-8 JSON: at most this many bytes."""
_MAX_METADATA_DEPTH = 64
"""``metadata``: at most this many nested objects/lists (deeper is refused, not recursed into)."""
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_F32_MAX = float(np.finfo(np.float32).max)


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to one short line (error messages name the value, not all of it)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__ must not turn a refusal into a crash
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _printable_id(value: Any) -> str | None:
    """``value`` when it is a valid id (to locate an error), else None."""
    try:
        return _id(value, "trajectory_id")
    except ValidationError:
        return None


def _text(value: Any, key: str, *, max_chars: int, allow_empty: bool) -> str:
    """A string of valid Unicode (no lone surrogates), without NUL, of at most ``max_chars`` code points."""
    if not isinstance(value, str):
        raise ValidationError(f"{key} must be a string, got {type(value).__name__}", rule=key)
    if not value and not allow_empty:
        raise ValidationError(f"{key} must be a non-empty string", rule=key)
    if len(value) > max_chars:
        raise ValidationError(f"{key} has {len(value)} characters (at most {max_chars})", rule=key)
    if "\x00" in value:
        raise ValidationError(f"{key} {_short(value)} contains NUL", rule=key)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(f"{key} {_short(value)} is not valid Unicode (a lone surrogate)", rule=key) from None
    return value


def _id(value: Any, key: str) -> str:
    return _text(value, key, max_chars=_MAX_ID_CHARS, allow_empty=False)


def _optional_id(obj: Mapping, key: str) -> str | None:
    value = obj.get(key)
    return None if value is None else _id(value, key)


def _int(obj: Mapping, key: str, *, default: int | None = None, minimum: int = 0) -> int:
    value = obj.get(key, default)
    if value is None or isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValidationError(f"{key} must be an integer, got {_short(value)}", rule=key)
    if value < minimum:
        raise ValidationError(f"{key} must be >= {minimum}, got {_short(value)}", rule=key)
    if value > _INT32_MAX:  # _short: str() of an int over 4,300 digits raises
        raise ValidationError(f"{key} {_short(value)} does not fit in int32 (at most {_INT32_MAX})",
                              rule="int32_range")
    return int(value)


def _finite(value: Any, key: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValidationError(f"{key} must be a number, got {_short(value)}", rule=key)
    try:
        value = float(value)
    except OverflowError:  # an int beyond float64
        raise ValidationError(f"{key} must be finite, got an integer of {value.bit_length()} bits",
                              rule="non_finite") from None
    if not math.isfinite(value):
        raise ValidationError(f"{key} must be finite, got {value}", rule="non_finite")
    return value


def validate_metadata(value: Any, where: str = "metadata") -> dict:
    """A ``metadata`` value checked against docs/reference.md and returned as a plain dict.

    A JSON object (string keys) of at most ``_MAX_METADATA_BYTES`` as compact
    UTF-8 JSON and ``_MAX_METADATA_DEPTH`` levels; numbers finite (integers in
    int64), strings (keys too) valid Unicode without NUL. Tuples become lists
    and numpy scalars or arrays Python numbers or lists. Raises ValidationError (rule
    ``metadata``) naming ``where``. Iterative: no recursion on hostile input.
    """
    if not isinstance(value, Mapping):
        raise ValidationError(f"{where} must be a JSON object, got {type(value).__name__}", rule="metadata")
    root: dict = {}
    # (source container, destination container, depth); items are copied into
    # fresh dicts/lists so the stored value is exactly what was checked.
    stack: list[tuple[Any, Any, int]] = [(value, root, 1)]
    budget = _MAX_METADATA_BYTES  # every value costs at least one byte of JSON
    while stack:
        src, dst, depth = stack.pop()
        if depth > _MAX_METADATA_DEPTH:
            raise ValidationError(f"{where} is nested deeper than {_MAX_METADATA_DEPTH} levels", rule="metadata")
        items = src.items() if isinstance(src, Mapping) else enumerate(src)
        for key, item in items:
            budget -= 1
            if budget < 0:
                raise ValidationError(f"{where} is larger than {_MAX_METADATA_BYTES} bytes as JSON", rule="metadata")
            if isinstance(src, Mapping):
                if not isinstance(key, str):
                    raise ValidationError(f"{where} has a non-string key {_short(key)}", rule="metadata")
                _metadata_text(key, where)
            if isinstance(item, np.ndarray):  # in-process callers: as the list it stands for
                item = item.tolist() if item.size <= budget else item.reshape(-1)[: budget + 1].tolist()
            elif isinstance(item, np.generic):
                item = item.item()
            if item is None or isinstance(item, bool):
                pass
            elif isinstance(item, int):
                if not _INT64_MIN <= item <= _INT64_MAX:
                    raise ValidationError(f"{where} holds an integer outside int64", rule="metadata")
            elif isinstance(item, float):
                if not math.isfinite(item):
                    raise ValidationError(f"{where} holds a non-finite number ({item})", rule="metadata")
            elif isinstance(item, str):
                _metadata_text(item, where)
            elif isinstance(item, (Mapping, list, tuple)):
                if len(item) > budget:
                    raise ValidationError(f"{where} is larger than {_MAX_METADATA_BYTES} bytes as JSON",
                                          rule="metadata")
                child: Any = {} if isinstance(item, Mapping) else [None] * len(item)
                stack.append((item, child, depth + 1))
                item = child
            else:
                raise ValidationError(f"{where} holds a {type(item).__name__}, not a JSON value", rule="metadata")
            dst[key] = item
    size = len(json.dumps(root, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8"))
    if size > _MAX_METADATA_BYTES:
        raise ValidationError(f"{where} is {size} bytes as compact JSON (at most {_MAX_METADATA_BYTES})",
                              rule="metadata")
    return root


def _metadata_text(text: str, where: str) -> None:
    if "\x00" in text:
        raise ValidationError(f"{where} holds a string with NUL", rule="metadata")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(f"{where} holds a string that is not valid Unicode (a lone surrogate)",
                              rule="metadata") from None
