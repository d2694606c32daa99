"""Parsing the trainer's store-wide lineage events (docs/reference.md "Training lineage").

``train_step`` and ``sample_annotation``: one parser each, in ``PARSERS``, and
their identity (``lineage_identity``). Rules that need the store are
admission's (``trajstore.lineage._admission``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping  # isinstance against typing.Mapping is ~10x slower
from typing import Any

import numpy as np

from trajstore.events._fields import _F32_MAX, _INT32_MAX, _MAX_ID_CHARS, _finite, _id, _int, _optional_id, _short, _text
from trajstore.events._types import SampleAnnotation, TrainStep
from trajstore.events._wire import decode_array
from trajstore.errors import ValidationError

__all__ = ["PARSERS", "lineage_identity"]

_MAX_STEP_SAMPLES = 1 << 20
"""A ``train_step`` names at most this many samples (a rank's share of one step)."""
_MAX_METRICS = 256
"""A ``metrics`` object holds at most this many entries."""


def lineage_identity(event: "TrainStep | SampleAnnotation") -> str:
    """docs/reference.md identity of a lineage event without ``event_id``: ``(type, run, step, rank,
    attempt)`` for a train_step, ``(type, run, step, attempt, trajectory_id,
    sample_index)`` for a sample_annotation. Written as a JSON list (ids may hold
    ``:``); a key longer than the index column holds is its SHA-256."""
    if event.event_id is not None:
        return "id:" + event.event_id
    key = json.dumps([event.type, *event.key], ensure_ascii=False, separators=(",", ":"))
    if len(key) <= _MAX_IDENTITY_CHARS:
        return key
    return f"{event.type}:sha256:{hashlib.sha256(key.encode()).hexdigest()}"


_MAX_IDENTITY_CHARS = 600  # events.identity


def _metrics(obj: Mapping) -> dict[str, float]:
    """``metrics``: a JSON object of finite numbers, keys ids (non-empty, at most 255 code points)."""
    value = obj.get("metrics")
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValidationError(f"metrics must be a JSON object of numbers, got {type(value).__name__}",
                              rule="metrics")
    if len(value) > _MAX_METRICS:
        raise ValidationError(f"metrics has {len(value)} entries (at most {_MAX_METRICS})", rule="metrics")
    out = {}
    for key, number in value.items():
        try:
            name = _text(key, "metrics key", max_chars=_MAX_ID_CHARS, allow_empty=False)
        except ValidationError as e:
            raise ValidationError(e.reason, rule="metrics") from None
        try:
            out[name] = _finite(number, f"metrics[{name!r}]")
        except ValidationError as e:
            raise ValidationError(e.reason, rule="non_finite" if e.rule == "non_finite" else "metrics") from None
    return out


def _projection_name(obj: Mapping) -> str | None:
    value = obj.get("projection")
    if value is None:
        return None
    return _text(value, "projection", max_chars=64, allow_empty=False)


def _run(obj: Mapping) -> str:
    if "run" not in obj:
        raise ValidationError(f"{obj.get('type')} needs run", rule="missing_field")
    return _id(obj["run"], "run")


def _required_int(obj: Mapping, key: str, minimum: int = 0) -> int:
    if key not in obj:
        raise ValidationError(f"{obj.get('type')} needs {key}", rule="missing_field")
    return _int(obj, key, minimum=minimum)


def _step_samples(value: Any) -> tuple[tuple[str, int], ...]:
    """``samples``: a list of ``[trajectory_id, sample_index]`` pairs, no pair twice."""
    if not isinstance(value, (list, tuple)):
        raise ValidationError(f"samples must be a list of [trajectory_id, sample_index] pairs, got "
                              f"{type(value).__name__}", rule="samples")
    if len(value) > _MAX_STEP_SAMPLES:
        raise ValidationError(f"samples has {len(value)} entries (at most {_MAX_STEP_SAMPLES})", rule="samples")
    out = []
    for i, pair in enumerate(value):
        if (type(pair) in (list, tuple) and len(pair) == 2 and type(pair[0]) is str and type(pair[1]) is int
                and 0 < len(pair[0]) <= _MAX_ID_CHARS and "\x00" not in pair[0] and 0 <= pair[1] <= _INT32_MAX
                and pair[0].isprintable()):
            # the usual pair, every rule checked inline (a tuple kept as it is: no new object)
            out.append(pair if type(pair) is tuple else (pair[0], pair[1]))
            continue
        if isinstance(pair, np.ndarray):
            pair = pair.tolist()
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ValidationError(f"samples[{i}] must be a pair [trajectory_id, sample_index], got {_short(pair)}",
                                  rule="samples")
        tid = _id(pair[0], f"samples[{i}] trajectory_id")
        out.append((tid, _int({"sample_index": pair[1]}, "sample_index")))
    if len(set(out)) != len(out):
        seen: set = set()
        dup = next(p for p in out if p in seen or seen.add(p))  # type: ignore[func-returns-value]
        raise ValidationError(f"samples names {list(dup)} twice", rule="samples")
    return tuple(out)


def _parse_train_step(obj: Mapping, tid: str) -> TrainStep:
    if "samples" not in obj:
        raise ValidationError("train_step needs samples", rule="missing_field")
    run = _run(obj)
    step = _required_int(obj, "step")
    rank = _required_int(obj, "rank")
    world_size = _required_int(obj, "world_size", minimum=1)
    if rank >= world_size:
        raise ValidationError(f"rank {rank} must be < world_size {world_size}", rule="rank")
    return TrainStep(run=run, step=step, rank=rank, world_size=world_size,
                     policy_version=_required_int(obj, "policy_version"), samples=_step_samples(obj["samples"]),
                     projection=_projection_name(obj), attempt=_int(obj, "attempt", default=0),
                     metrics=_metrics(obj), event_id=_optional_id(obj, "event_id"))


def _annotation_array(obj: Mapping, key: str) -> np.ndarray | None:
    value = obj.get(key)
    if value is None:
        return None
    arr = decode_array(value, field=key, ndim=1).reshape(-1)
    if arr.dtype.kind not in "biuf":
        raise ValidationError(f"{key} must hold numbers, got {arr.dtype}", rule="array_dtype")
    if arr.size:
        if not np.all(np.isfinite(arr)):
            raise ValidationError(f"{key} holds non-finite values", rule="non_finite")
        if arr.dtype.kind == "f" and arr.dtype.itemsize > 4 and np.abs(arr).max() > _F32_MAX:
            raise ValidationError(f"{key} holds values beyond float32 (they would be stored as inf)",
                                  rule="non_finite")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _parse_annotation(obj: Mapping, tid: str) -> SampleAnnotation:
    if "trajectory_id" not in obj or "sample_index" not in obj:
        raise ValidationError("sample_annotation needs trajectory_id and sample_index", rule="missing_field")
    tid = _id(obj["trajectory_id"], "trajectory_id")
    advantages: np.ndarray | float | None
    raw = obj.get("advantages")
    if raw is not None and not isinstance(raw, (bool, np.bool_)) and isinstance(
            raw, (int, float, np.integer, np.floating)):
        advantages = _finite(raw, "advantages")
        if abs(advantages) > _F32_MAX:
            raise ValidationError("advantages is beyond float32", rule="non_finite")
    else:
        advantages = _annotation_array(obj, "advantages")
    arrays = {"trainer_logprobs": _annotation_array(obj, "trainer_logprobs"), "advantages": advantages,
              "entropy": _annotation_array(obj, "entropy")}
    lengths = {k: len(v) for k, v in arrays.items() if isinstance(v, np.ndarray)}
    if len(set(lengths.values())) > 1:
        raise ValidationError("the per-token arrays differ in length (" + ", ".join(
            f"{k} {n}" for k, n in lengths.items()) + ")", rule="length_mismatch")
    return SampleAnnotation(run=_run(obj), step=_required_int(obj, "step"), trajectory_id=tid,
                            sample_index=_required_int(obj, "sample_index"), attempt=_int(obj, "attempt", default=0),
                            projection=_projection_name(obj), trainer_logprobs=arrays["trainer_logprobs"],
                            advantages=advantages, entropy=arrays["entropy"], metrics=_metrics(obj),
                            event_id=_optional_id(obj, "event_id"))


PARSERS = {"train_step": _parse_train_step, "sample_annotation": _parse_annotation}
