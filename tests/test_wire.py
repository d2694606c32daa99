"""Property tests of the wire-format decoder: every ARRAY encoding of a valid
array decodes to the same values; arbitrary garbage raises ValidationError
(never another exception) and the message is one line."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from trajstore.errors import ValidationError
from trajstore.events import parse_event
from trajstore.events._wire import decode_array, encode_b64, encode_npy_b64

route_arrays = hnp.arrays(
    dtype=st.sampled_from([np.uint8, np.uint16, np.int32, np.int64]),
    shape=st.tuples(st.integers(1, 20), st.integers(1, 4), st.integers(1, 4)),
    elements=st.integers(0, 255),
)


@settings(max_examples=150, deadline=None)
@given(route_arrays)
def test_three_encodings_decode_equal(arr):
    for encoded in (arr.tolist(), encode_b64(arr), encode_npy_b64(arr), arr):
        out = decode_array(encoded, field="routed_experts")
        assert out.shape == arr.shape
        np.testing.assert_array_equal(out, arr)


@settings(max_examples=150, deadline=None)
@given(route_arrays, st.integers(0, 1))
def test_generation_with_any_encoding_parses_to_compact_routes(arr, last_row):
    # the rows cover positions 0 .. n-2 exactly; one for the last token too is refused (SPEC v5)
    n = len(arr) + 1 - last_row
    ev = {"type": "generation", "trajectory_id": "t", "seq": 0, "prompt_ids": list(range(n - 1)),
          "output_ids": [1], "model_version": 0}
    for encoded in (arr.tolist(), encode_b64(arr), encode_npy_b64(arr)):
        if last_row:
            with pytest.raises(ValidationError) as e:
                parse_event(dict(ev, routed_experts=encoded))
            assert e.value.rule == "too_many_route_rows"
            continue
        g = parse_event(dict(ev, routed_experts=encoded))
        assert g.routed_experts.dtype == (np.uint8 if arr.max() < 256 else np.uint16)
        np.testing.assert_array_equal(g.routed_experts, arr)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_garbage_array_raises_validation_error_only(value):
    try:
        decode_array(value, field="routed_experts")
    except ValidationError as e:
        assert "\n" not in str(e) and "routed_experts" in str(e)


generation_fields = st.fixed_dictionaries({}, optional={
    "seq": json_values, "prompt_ids": json_values, "output_ids": json_values, "model_version": json_values,
    "logprobs": json_values, "loss_mask": json_values, "routed_experts": json_values,
    "routed_experts_start": json_values, "reward": json_values, "token_rewards": json_values,
    "finish_reason": json_values, "event_id": json_values,
})


@settings(max_examples=400, deadline=None)
@given(generation_fields, st.sampled_from(["generation", "reward", "trajectory_started", "trajectory_finished", "x"]))
def test_random_events_are_parsed_or_refused_cleanly(fields, kind):
    obj = dict(fields, type=kind, trajectory_id="t")
    try:
        parse_event(obj)
    except ValidationError as e:
        assert "\n" not in str(e) and e.rule


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64))
def test_random_base64_payload_is_refused_cleanly(raw):
    assume(not raw.startswith(b"\x93NUMPY"))  # anything but a .npy file
    with pytest.raises(ValidationError, match="routed_experts"):
        decode_array(base64.b64encode(raw).decode(), field="routed_experts")


def test_truncated_npy_and_bad_b64_object_are_refused():
    good = encode_npy_b64(np.zeros((2, 1, 1), np.uint8))
    with pytest.raises(ValidationError, match="not a base64 .npy"):
        decode_array(base64.b64encode(base64.b64decode(good)[:-1]).decode(), field="routed_experts")
    with pytest.raises(ValidationError, match="holds 3 bytes"):
        decode_array({"b64": base64.b64encode(b"abc").decode(), "dtype": "uint8", "shape": [2, 1, 1]}, field="r")
    with pytest.raises(ValidationError, match="unsupported dtype"):
        decode_array({"b64": "", "dtype": "object", "shape": [0]}, field="r")


@pytest.mark.parametrize("version", [None, (2, 0), (3, 0)])
@pytest.mark.parametrize("shape", [(), (0,), (5,), (7, 3, 2), (0, 4)])
@pytest.mark.parametrize("dtype", ["|u1", ">u2", "<i4", "<f8", "|b1"])
def test_npy_fast_header_agrees_with_numpy(version, shape, dtype):
    """The .npy header parser for np.save's exact form gives numpy's own answer
    (shape, order, dtype, data offset); other valid headers still decode."""
    import io

    import numpy.lib.format as npf

    from trajstore.events._wire import _npy_header

    for fortran in (False, True):
        arr = (np.arange(int(np.prod(shape))) % 2).astype(dtype).reshape(shape)
        arr = np.asfortranarray(arr) if fortran else arr
        buf = io.BytesIO()
        npf.write_array(buf, arr, version=version)
        raw = buf.getvalue()
        ref = io.BytesIO(raw)
        v = npf.read_magic(ref)
        want = npf.read_array_header_1_0(ref) if v == (1, 0) else npf.read_array_header_2_0(ref)
        assert _npy_header(raw) == (*want, ref.tell())
        np.testing.assert_array_equal(decode_array(base64.b64encode(raw).decode(), field="x"), arr)
    # a valid header in another spelling (key order, no trailing comma): numpy's parser decodes it
    head = b"{'shape': (2, 3), 'fortran_order': False, 'descr': '<i4'}"
    head += b" " * (63 - (10 + len(head)) % 64) + b"\n"
    raw = b"\x93NUMPY\x01\x00" + len(head).to_bytes(2, "little") + head + np.arange(6, dtype="<i4").tobytes()
    assert _npy_header(raw) is None
    np.testing.assert_array_equal(decode_array(base64.b64encode(raw).decode(), field="x"), np.arange(6).reshape(2, 3))
