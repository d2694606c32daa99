"""The JSON ``POST /v1/events`` body: ``json.loads`` with long integer arrays parsed straight to numpy.

``decode_json`` is the scanner (below, why); ``parse_body`` turns a body into
parsed events and their token count. Errors are ``trajstore.ingest._http.HTTPError`` (400).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

import numpy as np

from trajstore.events import ARRAY_FIELDS
from trajstore.ingest._body import events_of
from trajstore.ingest._http import HTTPError as _HTTPError

__all__ = ["decode_json", "parse_body"]

_ARRAY_FIELDS = frozenset(ARRAY_FIELDS)


def parse_body(body: bytes | bytearray) -> tuple[list, int]:
    """The parsed events of a request body and their token count; raises _HTTPError."""
    doc = decode_json(body)
    raw = doc.get("events") if isinstance(doc, dict) else doc
    if not isinstance(raw, list):
        raise _HTTPError(400, 'body must be {"events": [...]} or a JSON list of events', rule="malformed_body")
    return events_of(raw)




# Memory (docs/ingest.md "Memory"): ``json.loads`` turns a list of N small
# ints into a Python list (8 bytes a slot) plus numpy's int64 copy, ~12x the
# 2-byte "1," it came from. Long flat integer arrays that are the value of an
# object member (``"prompt_ids": [...]``) are therefore parsed straight to
# numpy (C speed, int32 when no number has 10 digits) and put back in place
# of a placeholder string only this process can produce. The scan skips JSON
# strings whole, so a "[1,2,...]" inside a string is never touched; an array
# that is not strictly JSON integers is left to ``json.loads``.
_MIN_FAST_ARRAY_BYTES = 256  # shorter arrays are not worth it
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"')  # a JSON string with escapes, whole
_JSON_SPACE = b" \t\r\n"
_INT_LIST_TEXT = re.compile(rb"[0-9,\- \t\r\n]*+\]")  # what may stand between "[" and "]" of integers
_NOT_INT_LIST = re.compile(rb"[^0-9,\- ]")
_TEN_DIGITS = re.compile(rb"[0-9]{10}")
_NINETEEN_DIGITS = re.compile(rb"[0-9]{19}")
_PLACEHOLDER = "\x00trajstore-array-" + secrets.token_hex(8) + "-"
_PLACEHOLDER_JSON = b'"' + _PLACEHOLDER.encode().replace(b"\x00", b"\\u0000")


def _int_list(text: bytes) -> np.ndarray | None:
    """``text`` (between ``[`` and ``]``) as an int array if it is exactly a JSON list of integers, else None.

    Takes the compact form and ``json.dumps``'s ``", "``; any other whitespace
    is left to ``json.loads``. Extra memory: the result, one copy of the text
    when it has ", ", and O(1 MiB) of checks, whatever the length."""
    if _NOT_INT_LIST.search(text):
        return None  # anything but digits, commas and minus signs (after ", " -> ",")
    if b" " in text:
        text = text.replace(b", ", b",")
        if b" " in text:
            return None
    if not text or text[0] not in b"-0123456789" or text[-1] not in b"0123456789":
        return None
    wide = _TEN_DIGITS.search(text) is not None
    if wide and _NINETEEN_DIGITS.search(text):
        return None  # may not fit in int64: json.loads decides
    if not _json_integers(np.frombuffer(text, np.uint8)):
        return None
    try:
        arr = np.fromstring(text, dtype=np.int64 if wide else np.int32, sep=",")
    except ValueError:  # not expected after the checks above; json.loads decides
        return None
    return arr if len(arr) == text.count(b",") + 1 else None


def _json_integers(b: np.ndarray, step: int = 1 << 20) -> bool:
    """Digits, commas and minus signs that form ``-?digits(,-?digits)*`` with no leading zero:
    every comma between a digit and a number, every minus at a number's start before a
    digit. Checked a MiB at a time, each window with its neighbours (the ends count as commas)."""
    comma = np.array([44], np.uint8)
    for lo in range(0, len(b), step):
        hi = min(lo + step, len(b))
        w = b[max(lo - 1, 0):hi + 1]
        if lo == 0:
            w = np.concatenate((comma, w))
        if hi == len(b):
            w = np.concatenate((w, comma))
        digit = (w >= 48) & (w <= 57)
        prev_digit, next_digit = digit[:-2], digit[2:]
        mid, prev, nxt = w[1:-1], w[:-2], w[2:]
        bad = ((mid == 48) & next_digit & ~prev_digit)  # "01", "-01"
        bad |= (mid == 45) & (~next_digit | (prev != 44))  # "-" then a digit, after a comma or the start
        bad |= (mid == 44) & (~prev_digit | ~(next_digit | (nxt == 45)))  # "1,2", "1,-2"
        if np.any(bad):
            return False
    return True


def _fast_arrays(body: bytes | bytearray) -> tuple[bytes | bytearray, list]:
    """``body`` with long integer arrays replaced by placeholders, and the arrays.

    The scan goes from one ``[`` outside strings to the next with
    ``bytes.find`` (memchr speed): a megabyte of base64 routes in a string
    costs a few microseconds to step over, against ~7 ms for a regular
    expression walking it character by character (half the service's CPU for
    a 1-MiB JSON event, docs/benchmarks.md). Only a string holding a backslash
    is matched by ``_STRING``."""
    arrays: list = []
    pieces: list[bytes] = []
    pos = last = 0
    bracket = -1
    while True:
        if bracket < pos:
            bracket = body.find(b"[", pos)
            if bracket < 0:
                break
        quote = body.find(b'"', pos, bracket)
        if quote >= 0:  # a string starts first: step over it (the "[" may be inside)
            pos = _string_end(body, quote)
            if pos < 0:
                break  # unterminated: json.loads decides
            continue
        # no string between pos and the "[": is it an object member's value (":" then "[")?
        member = bytes(memoryview(body)[pos:bracket]).rstrip(_JSON_SPACE).endswith(b":")
        pos = bracket + 1
        if not member:
            continue
        m = _INT_LIST_TEXT.match(body, pos)  # stops at the first character no integer list has
        if m is None or m.end() - 1 - pos < _MIN_FAST_ARRAY_BYTES:
            continue
        end = m.end() - 1
        arr = _int_list(bytes(memoryview(body)[pos:end]))
        if arr is None:
            continue
        arrays.append(arr)
        pieces += [bytes(body[last:bracket]), b'%s%d"' % (_PLACEHOLDER_JSON, len(arrays) - 1)]
        pos = last = end + 1
    if not arrays:
        return body, arrays
    pieces.append(bytes(body[last:]))
    return b"".join(pieces), arrays


def _string_end(body: bytes | bytearray, quote: int) -> int:
    """The index after the JSON string that opens at ``quote``; -1 if it never closes."""
    close = body.find(b'"', quote + 1)
    if close < 0:
        return -1
    if body.find(b"\\", quote + 1, close) < 0:
        return close + 1  # no escape before the next quote: it closes the string
    m = _STRING.match(body, quote)
    return m.end() if m else -1


def decode_json(body: bytes | bytearray) -> Any:
    """``json.loads(body)`` with long integer arrays decoded to numpy; raises _HTTPError (400)."""

    def restore(obj: dict) -> dict:
        for key, value in obj.items():
            if isinstance(value, str) and value.startswith(_PLACEHOLDER):
                arr = arrays[int(value[len(_PLACEHOLDER):])]
                obj[key] = arr if key in _ARRAY_FIELDS else arr.tolist()
        return obj

    try:
        body, arrays = _fast_arrays(body)
        return json.loads(body, object_hook=restore if arrays else None)
    except (ValueError, UnicodeDecodeError) as e:
        raise _HTTPError(400, f"body is not valid JSON ({e})", rule="malformed_json") from None
    except RecursionError:
        raise _HTTPError(400, "body is not valid JSON (nested too deeply)", rule="malformed_json") from None
