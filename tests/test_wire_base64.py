"""The wire's base64 decoding goes through pybase64 (SIMD) and accepts and
refuses exactly what CPython's strict ``base64.b64decode(validate=True)`` does."""

from __future__ import annotations

import base64
import binascii

import numpy as np
import pybase64
import pytest
from hypothesis import example, given, settings, strategies as st

from trajstore.events import _wire
from trajstore.events._wire import decode_array, encode_b64, encode_npy_b64
from trajstore.errors import ValidationError

B64_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


def test_the_simd_decoder_is_the_one_in_use():
    assert _wire._b64 is pybase64


def _stdlib(text):
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(B64_CHARS + " \n-_.é"), max_size=40))
@example("0000=")  # pybase64 refuses excess padding, CPython accepts it: CPython decides
@example("0000==")
@example("00=0")
def test_same_strictness_as_cpython(text):
    expected = _stdlib(text)
    value = {"b64": text, "dtype": "uint8", "shape": [len(expected) if expected is not None else 0]}
    if expected is None:
        with pytest.raises(ValidationError):
            decode_array(value, field="f")
    else:
        assert decode_array(value, field="f").tobytes() == expected


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=3000))
def test_round_trip_through_both_encodings(raw):
    arr = np.frombuffer(raw, dtype=np.uint8)
    assert decode_array(encode_b64(arr), field="f").tobytes() == raw
    assert base64.b64decode(encode_b64(arr)["b64"]) == raw  # what any client decodes
    assert np.array_equal(decode_array(encode_npy_b64(arr), field="f"), arr)
