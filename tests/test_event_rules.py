"""SPEC "Ordering and validation": the id, integer, finish_reason, metadata and
unknown-field rules. Each bad event is refused through ``store.append`` on both
backends with a ValidationError naming the event and the rule, and the store
is unchanged (no driver error, no crash)."""

from __future__ import annotations

import base64
import io
import math

import numpy as np
import pytest

from helpers import finished, gen, snapshot, started
from trajstore.errors import ValidationError
from trajstore.events import parse_event, validate_metadata

INT32_MAX = 2**31 - 1


def _nested(depth: int) -> dict:
    root = node = {}
    for _ in range(depth):
        node["a"] = {}
        node = node["a"]
    return root


def _nested_list(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


def _npy_with_header(header: str, data: bytes = b"") -> str:
    text = header.encode("latin1")
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    raw = b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text + data
    return base64.b64encode(raw).decode()


def _object_npy() -> str:
    buf = io.BytesIO()
    np.save(buf, np.array([1, "a"], dtype=object), allow_pickle=True)
    return base64.b64encode(buf.getvalue()).decode()


G = gen("t", 0, [1, 2, 3], [4, 5], version=1)
S = started("t", num_experts=8)

# (name, the bad event (appended after a valid trajectory_started), rule)
BAD = [
    ("type-unhashable", dict(G, type=["generation"]), "unknown_type"),
    ("type-dict", dict(G, type={"a": 1}), "unknown_type"),
    ("tid-lone-surrogate", dict(G, trajectory_id="a\udc80"), "trajectory_id"),
    ("tid-nul", dict(G, trajectory_id="a\x00b"), "trajectory_id"),
    ("tid-256", dict(G, trajectory_id="x" * 256), "trajectory_id"),
    ("tid-empty", dict(G, trajectory_id=""), "trajectory_id"),
    ("tid-int", dict(G, trajectory_id=5), "trajectory_id"),
    ("event-id-300", dict(G, event_id="e" * 300), "event_id"),
    ("event-id-surrogate", dict(G, event_id="\ud800"), "event_id"),
    ("event-id-empty", dict(G, event_id=""), "event_id"),
    ("group-id-nul", started("t2", group_id="g\x00"), "group_id"),
    ("group-id-256", started("t2", group_id="g" * 256), "group_id"),
    ("model-version-2**31", dict(G, model_version=2**31), "int32_range"),
    ("seq-2**31", dict(G, seq=2**31), "int32_range"),
    ("seq-huge", dict(G, seq=10**30), "int32_range"),
    ("seq-5000-digits", dict(G, seq=10**5000), "int32_range"),
    ("model-version-minus-5000-digits", dict(G, model_version=-(10**5000)), "model_version"),
    ("routes-start-2**31", dict(G, routed_experts_start=2**31), "int32_range"),
    ("num-experts-2**40", started("t2", num_experts=2**40), "int32_range"),
    ("token-id-2**31", dict(G, prompt_ids=[1, 2**31]), "int32_range"),
    ("token-id-2**63", dict(G, output_ids=[2**63, 1]), "int32_range"),
    ("token-id-2**64", dict(G, output_ids=[2**64, 1]), "int32_range"),
    ("finish-reason-65", dict(G, finish_reason="x" * 65), "finish_reason"),
    ("finish-reason-nul", dict(G, finish_reason="st\x00p"), "finish_reason"),
    ("finish-reason-surrogate", dict(G, finish_reason="\udfff"), "finish_reason"),
    ("finish-reason-int", dict(G, finish_reason=1), "finish_reason"),
    ("unknown-logprob", dict(G, logprob=[-0.1, -0.2]), "unknown_field"),
    ("unknown-routed-expert", dict(G, routed_expert=[[[1]]] * 4), "unknown_field"),
    ("unknown-on-reward", {"type": "reward", "trajectory_id": "t", "reward": 1.0, "seq": 0}, "unknown_field"),
    ("unknown-on-finished", finished("t", reason="x"), "unknown_field"),
    ("unknown-on-started", started("t2", model_version=1), "unknown_field"),
    ("logprob-beyond-float32", dict(G, logprobs=[-1e300, 0.0]), "non_finite"),
    ("logprobs-inf-and-minus-inf", dict(G, logprobs=[float("inf"), float("-inf")]), "non_finite"),
    ("logprobs-finite-sum-beyond-float64", dict(G, logprobs=[1.7e308, 1.7e308]), "non_finite"),
    ("token-rewards-one-nan", dict(G, token_rewards=[0.5, float("nan")]), "non_finite"),
    ("token-reward-beyond-float32", dict(G, token_rewards=[1e39, 0.0]), "non_finite"),
    ("reward-huge-int", {"type": "reward", "trajectory_id": "t", "reward": 10**400}, "non_finite"),
    ("metadata-nan", started("t2", metadata={"x": math.nan}), "metadata"),
    ("metadata-inf", started("t2", metadata={"x": [1.0, -math.inf]}), "metadata"),
    ("metadata-nul", started("t2", metadata={"x": "a\x00"}), "metadata"),
    ("metadata-nul-key", started("t2", metadata={"a\x00": 1}), "metadata"),
    ("metadata-surrogate", started("t2", metadata={"x": {"y": "\udc80"}}), "metadata"),
    ("metadata-too-big", started("t2", metadata={"x": "y" * (64 << 10)}), "metadata"),
    ("metadata-many-items", started("t2", metadata={"x": list(range(70000))}), "metadata"),
    ("metadata-list", started("t2", metadata=[1, 2]), "metadata"),
    ("metadata-string", started("t2", metadata="x"), "metadata"),
    ("metadata-int-key", started("t2", metadata={1: 2}), "metadata"),
    ("metadata-huge-int", started("t2", metadata={"x": 10**30}), "metadata"),
    ("metadata-deep", started("t2", metadata=_nested(200)), "metadata"),
    ("metadata-object", started("t2", metadata={"x": object()}), "metadata"),
    ("b64-shape-product-overflows",
     dict(G, routed_experts={"b64": "", "dtype": "uint8", "shape": [0, 2**62, 2**62]}), "array_shape"),
    ("b64-shape-product-wraps-int64",
     dict(G, routed_experts={"b64": "AAAA", "dtype": "uint8", "shape": [2**32, 2**32, 3]}), "array_shape"),
    ("b64-shape-5000-digits", dict(G, routed_experts={"b64": "", "dtype": "uint8", "shape": [10**5000]}),
     "array_shape"),
    ("b64-dtype-5000-digits", dict(G, routed_experts={"b64": "", "dtype": 10**5000, "shape": [0]}), "array_dtype"),
    ("b64-shape-not-list", dict(G, routed_experts={"b64": "AA==", "dtype": "uint8", "shape": {"a": 1}}), "array_shape"),
    ("b64-shape-negative", dict(G, routed_experts={"b64": "", "dtype": "uint8", "shape": [-1, 0, 1]}), "array_shape"),
    ("b64-shape-float", dict(G, routed_experts={"b64": "AA==", "dtype": "uint8", "shape": [1.0, 1, 1]}), "array_shape"),
    ("b64-dtype-list", dict(G, routed_experts={"b64": "", "dtype": ["uint8"], "shape": [0]}), "array_dtype"),
    ("b64-dtype-object", dict(G, routed_experts={"b64": "", "dtype": "object", "shape": [0]}), "array_dtype"),
    ("b64-dtype-bogus", dict(G, routed_experts={"b64": "", "dtype": "<U3", "shape": [0]}), "array_dtype"),
    ("b64-not-string", dict(G, routed_experts={"b64": 5, "dtype": "uint8", "shape": [0]}), "array_encoding"),
    ("b64-extra-key", dict(G, routed_experts={"b64": "", "dtype": "uint8", "shape": [0], "x": 1}), "array_encoding"),
    ("b64-truncated", dict(G, routed_experts={"b64": "AAA", "dtype": "uint8", "shape": [1, 1, 2]}), "array_encoding"),
    ("npy-object-dtype", dict(G, routed_experts=_object_npy()), "array_dtype"),
    ("npy-huge-shape", dict(G, routed_experts=_npy_with_header(
        "{'descr': '<u1', 'fortran_order': False, 'shape': (4611686018427387904, 4611686018427387904, 2), }")),
     "array_shape"),
    ("npy-shape-lies", dict(G, routed_experts=_npy_with_header(
        "{'descr': '<u1', 'fortran_order': False, 'shape': (1000, 1, 1), }", b"\x00" * 10)), "array_encoding"),
    ("npy-struct-dtype", dict(G, routed_experts=_npy_with_header(
        "{'descr': [('a', '<u1')], 'fortran_order': False, 'shape': (1, 1, 1), }", b"\x00")), "array_dtype"),
    ("npy-bad-header", dict(G, routed_experts=_npy_with_header("{'descr': __import__('os'), }")), "array_encoding"),
    ("list-ragged", dict(G, routed_experts=[[[1]], [[1, 2]]]), "array_shape"),
    ("list-deep", dict(G, prompt_ids=_nested_list(500)), "array_shape"),
    ("list-2d-tokens", dict(G, prompt_ids=[[1, 2], [3, 4]]), "array_shape"),
    ("list-strings", dict(G, prompt_ids=["1", "2"]), "array_dtype"),
    ("list-huge-and-float", dict(G, prompt_ids=[1.5, 10**400]), "array_shape"),
    ("logprobs-strings", dict(G, logprobs=["a", "b"]), "array_dtype"),
]


@pytest.mark.parametrize("name, event, rule", BAD, ids=[b[0] for b in BAD])
def test_bad_event_is_refused_naming_index_and_rule(store, name, event, rule):
    store.append([S])
    before = snapshot(store)
    with pytest.raises(ValidationError) as e:
        store.append([gen("t", 0, [9], [9], version=1), event])  # a valid event first: the index is 1
    assert (e.value.index, e.value.rule) == (1, rule), str(e.value)
    assert "\n" not in str(e.value) and len(str(e.value)) < 600
    assert snapshot(store) == before


def test_every_field_spec_lists_is_allowed(store):
    store.append([started("t", group_id="g" * 255, num_experts=8, event_id="s" * 255,
                          metadata={"tool": "search", "latency_s": 0.25, "n": [1, 2, None, True], "ü": "😀"})])
    ev = dict(gen("t", 0, [1, 2, 3], [4, 5], version=INT32_MAX), logprobs=[-0.1, -0.2], loss_mask=[1, 0],
              routed_experts=[[[1]], [[2]], [[3]], [[4]]], routed_experts_start=0, reward=0.5,
              finish_reason="x" * 64, metadata={"tool": "search"}, event_id="😀" * 255,
              token_model_versions=[INT32_MAX, INT32_MAX])
    store.append([ev, {"type": "reward", "trajectory_id": "t", "reward": 1.0, "event_id": "r"},
                  finished("t", event_id="f")])
    assert store.materialize().num_samples_after == 1
    assert store.append([ev]).num_duplicates == 1  # an identical retry


def test_ids_count_code_points_not_bytes():
    ev = parse_event(dict(G, trajectory_id="😀" * 255))
    assert len(ev.trajectory_id.encode()) == 4 * 255


def test_validate_metadata_returns_plain_json_and_names_where():
    out = validate_metadata({"a": (1, np.int64(2)), "b": np.float32(0.5), "c": np.arange(3)}, "generation metadata")
    assert out == {"a": [1, 2], "b": 0.5, "c": [0, 1, 2]}
    with pytest.raises(ValidationError, match="generation metadata holds a non-finite") as e:
        validate_metadata({"x": float("inf")}, "generation metadata")
    assert e.value.rule == "metadata"
    cyclic: dict = {}
    cyclic["self"] = cyclic
    with pytest.raises(ValidationError, match="nested deeper"):
        validate_metadata(cyclic)
    assert validate_metadata(_nested(63)) == _nested(63)
