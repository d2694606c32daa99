"""Event types of the wire format and their stateless validation.

``parse_event(obj)`` turns one wire-format dict (docs/reference.md "Event wire format")
into a typed, immutable event with numpy arrays, or raises ValidationError.
Rules that need the trajectory's history (seq order, known/finished
trajectory, expert range, route shape, reward mode, route rows below
``routed_experts_start``) live in ``trajstore._admission``.

Array dtypes after parsing: token ids int32, logprobs / token rewards float32,
loss mask uint8, routes uint8 when every id < 256 else uint16.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping  # isinstance against typing.Mapping is ~10x slower
from typing import Any, Union

import numpy as np
import xxhash

from trajstore.errors import ValidationError
from trajstore._wire import decode_array

__all__ = [
    "Event",
    "Generation",
    "Reward",
    "TrajectoryFinished",
    "TrajectoryStarted",
    "VersionLabel",
    "TrainStep",
    "SampleAnnotation",
    "LINEAGE_TYPES",
    "lineage_identity",
    "ANNOTATION_ARRAYS",
    "FINISH_STATUSES",
    "LOGPROB_PLACEHOLDER",
    "ARRAY_FIELDS",
    "TOKEN_FIELDS",
    "decimal_label",
    "content_hash",
    "identity_of",
    "parse_event",
    "parse_events",
    "routes_dtype",
    "same_content",
    "validate_metadata",
]

FINISH_STATUSES = ("completed", "truncated", "aborted", "failed", "abandoned")
LOGPROB_PLACEHOLDER = -9999.0
"""docs/reference.md: a logprob at or below this is not a logprob but the placeholder vLLM and
SkyRL write where the engine had none. Accepted as sent; the fold stores it as
missing (``logprobs_mask`` false, ``rollout_logprobs`` 0.0) and the index counts
it per event (``events.num_placeholder_logprobs``)."""
_INT32_MAX = np.iinfo(np.int32).max
_ROUTE_ID_LIMIT = 1 << 16  # stored as uint16 at most
_MAX_ID_CHARS = 255
"""ids (``trajectory_id``, ``group_id``, ``event_id``): at most this many code points."""
_MAX_FINISH_REASON_CHARS = 64
_MAX_METADATA_BYTES = 64 << 10
"""``metadata`` as compact UTF-8 JSON: at most this many bytes."""
_MAX_METADATA_DEPTH = 64
"""``metadata``: at most this many nested objects/lists (deeper is refused, not recursed into)."""
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_F32_MAX = float(np.finfo(np.float32).max)

# docs/reference.md "Event wire format": the fields each event type may carry. Anything
# else is refused (``unknown_field``): a misspelled ``logprob`` must never be
# dropped silently.
_FIELDS = {
    "trajectory_started": frozenset({"type", "trajectory_id", "group_id", "num_experts", "metadata", "event_id"}),
    "generation": frozenset({
        "type", "trajectory_id", "seq", "prompt_ids", "output_ids", "logprobs", "loss_mask", "model_version",
        "token_model_versions", "weight_versions", "routed_experts", "routed_experts_start", "reward",
        "token_rewards", "finish_reason", "metadata", "event_id"}),
    "reward": frozenset({"type", "trajectory_id", "reward", "event_id"}),
    "trajectory_finished": frozenset({"type", "trajectory_id", "status", "event_id"}),
    "version_label": frozenset({"type", "label", "model_version", "event_id"}),
}
# The generation fields that are ARRAYs (``_wire``): a body decoder may parse them straight to numpy,
# and a Generation's arrays are these attributes.
ARRAY_FIELDS = ("prompt_ids", "output_ids", "logprobs", "loss_mask", "token_rewards", "token_model_versions",
                "routed_experts")
# The fields whose lengths are an event's tokens (``Generation.num_tokens``, the writers' batch budgets).
TOKEN_FIELDS = ("prompt_ids", "output_ids")
assert set(ARRAY_FIELDS) <= _FIELDS["generation"] and set(TOKEN_FIELDS) <= set(ARRAY_FIELDS)


@dataclass(frozen=True, slots=True, eq=False)
class TrajectoryStarted:
    trajectory_id: str
    group_id: str | None = None
    num_experts: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    event_id: str | None = None
    type: str = "trajectory_started"


@dataclass(frozen=True, slots=True, eq=False)
class Generation:
    """One engine call. Arrays are numpy; optional ones are None when absent."""

    trajectory_id: str
    seq: int
    prompt_ids: np.ndarray  # int32 [P], the FULL prompt of this call
    output_ids: np.ndarray  # int32 [O]
    # The last output token's version when token_model_versions is given (or derived from
    # weight_versions); as sent, possibly None, while weight_versions holds an unresolved label.
    model_version: int | None
    logprobs: np.ndarray | None = None  # float32 [O]
    loss_mask: np.ndarray | None = None  # uint8 [O]
    routed_experts: np.ndarray | None = None  # uint8/uint16 [rows, layers, topk]
    routed_experts_start: int = 0
    reward: float | None = None
    token_rewards: np.ndarray | None = None  # float32 [O]
    finish_reason: str | None = None
    event_id: str | None = None
    token_model_versions: np.ndarray | None = None  # int32 [O], non-decreasing; last == model_version
    metadata: Mapping[str, Any] | None = None  # small JSON object, free-form
    # The engine's spans as sent: ((label, start, end), ...) tiling the output, label a str or int.
    weight_versions: tuple[tuple[str | int, int, int], ...] | None = None
    type: str = "generation"

    @property
    def num_tokens(self) -> int:
        return sum(len(getattr(self, name)) for name in TOKEN_FIELDS)


@dataclass(frozen=True, slots=True, eq=False)
class Reward:
    trajectory_id: str
    reward: float
    event_id: str | None = None
    type: str = "reward"


@dataclass(frozen=True, slots=True, eq=False)
class TrajectoryFinished:
    trajectory_id: str
    status: str
    event_id: str | None = None
    type: str = "trajectory_finished"


@dataclass(frozen=True, slots=True, eq=False)
class VersionLabel:
    """Store-wide: the engine's weight-version ``label`` means policy ``model_version``.

    Not part of any trajectory (``trajectory_id`` is ``""``)."""

    label: str
    model_version: int
    event_id: str | None = None
    type: str = "version_label"
    trajectory_id: str = ""


Event = Union[TrajectoryStarted, Generation, Reward, TrajectoryFinished, VersionLabel, "TrainStep",
              "SampleAnnotation"]


def routes_dtype(max_id: int) -> np.dtype:
    """docs/reference.md: uint8 when every expert id < 256, else uint16."""
    return np.dtype(np.uint8) if max_id < 256 else np.dtype(np.uint16)


def parse_events(objs: Iterable[Any]) -> list[Event]:
    """``parse_event`` of each; a refusal is located at its index in ``objs``."""
    out = []
    for i, obj in enumerate(objs):
        try:
            out.append(parse_event(obj))
        except ValidationError as e:
            raise e.at(i) from None
    return out


def parse_event(obj: Any) -> Event:
    """Parse and validate one wire-format event (no history needed)."""
    if isinstance(obj, (TrajectoryStarted, Generation, Reward, TrajectoryFinished, VersionLabel, TrainStep,
                        SampleAnnotation)):
        return obj
    if not isinstance(obj, Mapping):
        raise ValidationError(f"an event must be a JSON object, got {type(obj).__name__}", rule="not_object")
    kind = obj.get("type")
    parser = _PARSERS.get(kind) if isinstance(kind, str) else None
    tid = obj.get("trajectory_id")
    if parser is None:
        raise ValidationError(
            f"unknown event type {_short(kind)} (expected one of {sorted(_PARSERS)})",
            trajectory_id=_printable_id(tid),
            rule="unknown_type",
        )
    if kind == "version_label":
        tid = ""  # store-wide: no trajectory
    elif kind == "train_step":
        tid = None  # store-wide: its errors name no trajectory
    elif kind == "sample_annotation":
        tid = _printable_id(tid) or ""  # located by its sample (checked by its parser)
    else:
        tid = _id(tid, "trajectory_id")
    try:
        unknown = [k for k in obj if k not in _FIELDS[kind]]
        if unknown:
            raise ValidationError(
                f"unknown field {_short(unknown[0])} in a {kind} event (allowed: {', '.join(sorted(_FIELDS[kind]))})",
                rule="unknown_field",
            )
        return parser(obj, tid)
    except ValidationError as e:
        raise ValidationError(e.reason, trajectory_id=tid, rule=e.rule) from None
    except RecursionError:  # a pathologically nested value: refused, never a crash
        raise ValidationError("a value is nested too deeply", trajectory_id=tid, rule="too_deep") from None


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


def _parse_started(obj: Mapping, tid: str) -> TrajectoryStarted:
    num_experts = obj.get("num_experts")
    if num_experts is not None:
        num_experts = _int(obj, "num_experts", minimum=1)
        if num_experts > _ROUTE_ID_LIMIT:
            raise ValidationError(f"num_experts must be <= {_ROUTE_ID_LIMIT}, got {num_experts}", rule="num_experts")
    metadata = obj.get("metadata")
    return TrajectoryStarted(
        trajectory_id=tid,
        group_id=_optional_id(obj, "group_id"),
        num_experts=num_experts,
        metadata={} if metadata is None else validate_metadata(metadata),
        event_id=_optional_id(obj, "event_id"),
    )


def _all_integral(arr: np.ndarray) -> bool:
    """Every value a whole number (NaN and inf are not)."""
    with np.errstate(invalid="ignore"):
        return bool(np.all(np.mod(arr, 1) == 0))


def _token_ids(value: Any, key: str) -> np.ndarray:
    arr = decode_array(value, field=key, ndim=1).reshape(-1)
    if arr.dtype.kind == "f":
        if arr.size and not _all_integral(arr):
            raise ValidationError(f"{key} holds non-integer token ids", rule="token_ids")
    elif arr.dtype.kind not in "iub":
        raise ValidationError(f"{key} must hold integers, got {arr.dtype}", rule="token_ids")
    if arr.size:
        lo, hi = arr.min(), arr.max()
        if lo < 0:
            raise ValidationError(f"{key} holds a negative token id ({int(lo)})", rule="negative_token_id")
        if hi > _INT32_MAX:
            raise ValidationError(f"{key} holds a token id that does not fit in int32 ({hi})", rule="int32_range")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _per_token(obj: Mapping, key: str, n: int, dtype: type, *, finite: bool) -> np.ndarray | None:
    value = obj.get(key)
    if value is None:
        return None
    arr = decode_array(value, field=key, ndim=1).reshape(-1)
    if len(arr) != n:
        raise ValidationError(f"{key} has {len(arr)} values but output_ids has {n}", rule="length_mismatch")
    if arr.dtype.kind not in "biuf":
        raise ValidationError(f"{key} must hold numbers, got {arr.dtype}", rule="array_dtype")
    if finite and arr.size:
        if not np.all(np.isfinite(arr)):
            raise ValidationError(f"{key} holds non-finite values", rule="non_finite")
        if dtype is np.float32 and arr.dtype.kind == "f" and arr.dtype.itemsize > 4 and np.abs(arr).max() > _F32_MAX:
            raise ValidationError(f"{key} holds values beyond float32 (they would be stored as inf)",
                                  rule="non_finite")
    return np.ascontiguousarray(arr, dtype=dtype)


def _routes(obj: Mapping, num_tokens: int, start: int) -> np.ndarray | None:
    value = obj.get("routed_experts")
    if value is None:
        return None
    arr = decode_array(value, field="routed_experts")
    if arr.ndim != 3:
        raise ValidationError(
            f"routed_experts must have shape [rows, layers, topk], got {list(arr.shape)}", rule="routes_shape"
        )
    if arr.shape[1] == 0 or arr.shape[2] == 0:
        raise ValidationError(f"routed_experts has an empty [layers, topk] = {list(arr.shape[1:])}", rule="routes_shape")
    if arr.dtype.kind == "f":
        if arr.size and not _all_integral(arr):
            raise ValidationError("routed_experts holds non-integer expert ids", rule="non_integer_expert")
    elif arr.dtype.kind not in "iub":
        raise ValidationError(f"routed_experts must hold integers, got {arr.dtype}", rule="non_integer_expert")
    if len(arr) == 0:
        return None  # no rows is no routes: nothing to record, the recorded length stays
    max_rows = num_tokens - start
    if len(arr) > max_rows:
        raise ValidationError(
            f"routed_experts has {len(arr)} rows but prompt+output-routed_experts_start allows {max_rows}",
            rule="too_many_route_rows",
        )
    hi = 0
    if arr.dtype == np.uint8:
        pass  # every id fits and stays uint8: no scan (the re-sent rows make these arrays large)
    elif arr.size:
        lo, hi = (0 if arr.dtype.kind in "ub" else int(arr.min())), int(arr.max())
        if lo < 0:
            raise ValidationError(f"routed_experts holds a negative expert id ({lo})", rule="expert_id_range")
        if hi >= _ROUTE_ID_LIMIT:
            raise ValidationError(f"routed_experts holds expert id {hi} (limit {_ROUTE_ID_LIMIT})", rule="expert_id_range")
    return np.ascontiguousarray(arr, dtype=routes_dtype(hi))


def _parse_generation(obj: Mapping, tid: str) -> Generation:
    seq = _int(obj, "seq")
    if "prompt_ids" not in obj or "output_ids" not in obj:
        raise ValidationError("generation needs prompt_ids and output_ids", rule="missing_field")
    prompt = _token_ids(obj["prompt_ids"], "prompt_ids")
    output = _token_ids(obj["output_ids"], "output_ids")
    n_out = len(output)
    token_versions = _token_model_versions(obj, n_out)
    spans = _weight_versions(obj, n_out)
    model_version = _model_version(obj, token_versions, spans)
    start = _int(obj, "routed_experts_start", default=0)
    reward = obj.get("reward")
    token_rewards = _per_token(obj, "token_rewards", n_out, np.float32, finite=True)
    if reward is not None and token_rewards is not None:
        raise ValidationError("a generation carries reward or token_rewards, not both", rule="reward_mode")
    loss_mask = _per_token(obj, "loss_mask", n_out, np.float64, finite=True)
    if loss_mask is not None:
        if loss_mask.size and not np.all((loss_mask == 0) | (loss_mask == 1)):
            raise ValidationError("loss_mask must hold only 0 and 1", rule="loss_mask")
        loss_mask = loss_mask.astype(np.uint8)
    return Generation(
        trajectory_id=tid,
        seq=seq,
        prompt_ids=prompt,
        output_ids=output,
        model_version=model_version,
        logprobs=_per_token(obj, "logprobs", n_out, np.float32, finite=True),
        loss_mask=loss_mask,
        routed_experts=_routes(obj, len(prompt) + n_out, start),
        routed_experts_start=start,
        reward=None if reward is None else _finite(reward, "reward"),
        token_rewards=token_rewards,
        finish_reason=_finish_reason(obj),
        event_id=_optional_id(obj, "event_id"),
        token_model_versions=token_versions,
        metadata=None if obj.get("metadata") is None else validate_metadata(obj["metadata"], "metadata"),
        weight_versions=spans,
    )


_DECIMAL = re.compile(r"-?[0-9]+")
_DEFAULT_LABEL = "default"


def decimal_label(label: str | int) -> int | None:
    """The version a span label names by itself (docs/reference.md "Versions"): an int, or a
    string that is an integer in decimal; None for any other label (``"default"``
    and the store's label map are resolved elsewhere). Raises ValidationError for
    a negative or out-of-int32 one."""
    if isinstance(label, str):
        if not _DECIMAL.fullmatch(label):
            return None
        value = int(label)
    else:
        value = int(label)
    if value < 0 or value > _INT32_MAX:
        raise ValidationError(f"weight version label {_short(label)} is not a model version (0 .. {_INT32_MAX})",
                              rule="weight_versions")
    return value


def _weight_versions(obj: Mapping, n_out: int) -> tuple[tuple[str | int, int, int], ...] | None:
    """docs/reference.md "Versions": the engine's spans ``[{version, start, end}]``, in order, tiling the output once."""
    value = obj.get("weight_versions")
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise ValidationError(f"weight_versions must be a list of spans, got {type(value).__name__}",
                              rule="weight_versions")
    out = []
    expected = 0
    for i, span in enumerate(value):
        if not isinstance(span, Mapping):
            raise ValidationError(f"weight_versions[{i}] must be an object {{version, start, end}}, got "
                                  f"{type(span).__name__}", rule="weight_versions")
        extra = [k for k in span if k not in ("version", "start", "end")]
        if extra or "version" not in span:
            what = f"has unknown key {_short(extra[0])}" if extra else "has no version"
            raise ValidationError(f"weight_versions[{i}] {what} (keys: version, start, end)", rule="weight_versions")
        label = span["version"]
        if isinstance(label, (bool, np.bool_)) or not isinstance(label, (str, int, np.integer)):
            raise ValidationError(f"weight_versions[{i}].version must be a string or an integer, got "
                                  f"{_short(label)}", rule="weight_versions")
        if isinstance(label, str):
            label = _text(label, f"weight_versions[{i}].version", max_chars=_MAX_ID_CHARS, allow_empty=False)
        else:
            label = int(label)
        decimal_label(label)  # a negative or out-of-range number is refused here, not at admission
        start, end = span.get("start"), span.get("end")
        for key, v in (("start", start), ("end", end)):
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ValidationError(f"weight_versions[{i}].{key} must be an integer, got {_short(v)}",
                                      rule="weight_versions")
        start, end = int(start), int(end)
        if start != expected or end < start:
            raise ValidationError(f"weight_versions[{i}] is [{start}, {end}) but the spans must tile the output "
                                  f"in order from token {expected}", rule="weight_versions")
        expected = end
        out.append((label, start, end))
    if expected != n_out:
        raise ValidationError(f"weight_versions cover {expected} output tokens but output_ids has {n_out}",
                              rule="weight_versions")
    return tuple(out)


def _token_model_versions(obj: Mapping, n_out: int) -> np.ndarray | None:
    """docs/reference.md "Versions": one non-negative int32 per output token, never decreasing."""
    value = obj.get("token_model_versions")
    if value is None:
        return None
    key = "token_model_versions"
    arr = decode_array(value, field=key, ndim=1).reshape(-1)
    if len(arr) != n_out:
        raise ValidationError(f"{key} has {len(arr)} values but output_ids has {n_out}", rule="length_mismatch")
    if arr.dtype.kind == "f":
        if arr.size and not np.all(np.mod(arr, 1) == 0):
            raise ValidationError(f"{key} holds non-integer versions", rule=key)
    elif arr.dtype.kind not in "iub":
        raise ValidationError(f"{key} must hold integers, got {arr.dtype}", rule=key)
    if arr.size:
        lo, hi = arr.min(), arr.max()
        if lo < 0:
            raise ValidationError(f"{key} holds a negative version ({int(lo)})", rule=key)
        if hi > _INT32_MAX:
            raise ValidationError(f"{key} holds a version above int32 ({int(hi)})", rule=key)
        back = np.flatnonzero(np.diff(arr) < 0)
        if back.size:
            i = int(back[0])
            raise ValidationError(
                f"{key} goes back from {int(arr[i])} to {int(arr[i + 1])} at output token {i + 1} "
                "(versions never decrease)",
                rule=key,
            )
    return np.ascontiguousarray(arr, dtype=np.int32)


def _model_version(obj: Mapping, token_versions: np.ndarray | None,
                   spans: tuple[tuple[str | int, int, int], ...] | None) -> int | None:
    """``model_version``, or the last token's version when only the per-token
    versions are given; None when only the spans are (resolved by admission)."""
    if "model_version" not in obj or obj["model_version"] is None:
        if token_versions is None and spans is not None:
            if not spans:
                raise ValidationError("generation with no output tokens needs model_version (weight_versions is "
                                      "empty)", rule="missing_field")
            if any(label == _DEFAULT_LABEL for label, _, _ in spans):
                raise ValidationError('weight_versions uses the label "default", which means the event\'s '
                                      "model_version, but the event has none", rule="weight_versions")
            return None
        if token_versions is None:
            raise ValidationError("generation needs model_version (or token_model_versions or weight_versions)",
                                  rule="missing_field")
        if not len(token_versions):
            raise ValidationError(
                "generation with no output tokens needs model_version (token_model_versions is empty)",
                rule="missing_field",
            )
        return int(token_versions[-1])
    version = _int(obj, "model_version")
    if token_versions is not None and len(token_versions) and version != int(token_versions[-1]):
        raise ValidationError(
            f"model_version {version} differs from the last of token_model_versions ({int(token_versions[-1])})",
            rule="version_conflict",
        )
    return version


def _finish_reason(obj: Mapping) -> str | None:
    value = obj.get("finish_reason")
    if value is None:
        return None
    return _text(value, "finish_reason", max_chars=_MAX_FINISH_REASON_CHARS, allow_empty=True)


def _parse_reward(obj: Mapping, tid: str) -> Reward:
    if "reward" not in obj:
        raise ValidationError("reward event needs reward", rule="missing_field")
    return Reward(trajectory_id=tid, reward=_finite(obj["reward"], "reward"), event_id=_optional_id(obj, "event_id"))


def _parse_finished(obj: Mapping, tid: str) -> TrajectoryFinished:
    status = obj.get("status")
    if status not in FINISH_STATUSES:
        raise ValidationError(f"status must be one of {list(FINISH_STATUSES)}, got {_short(status)}", rule="status")
    return TrajectoryFinished(trajectory_id=tid, status=status, event_id=_optional_id(obj, "event_id"))


def _parse_version_label(obj: Mapping, tid: str) -> VersionLabel:
    if "label" not in obj or "model_version" not in obj:
        raise ValidationError("version_label needs label and model_version", rule="missing_field")
    label = _text(obj["label"], "label", max_chars=_MAX_ID_CHARS, allow_empty=False)
    if label == _DEFAULT_LABEL or decimal_label(label) is not None:
        raise ValidationError(f"label {_short(label)} cannot be mapped: a decimal label is its own version and "
                              '"default" is each event\'s model_version', rule="version_label")
    return VersionLabel(label=label, model_version=_int(obj, "model_version"), event_id=_optional_id(obj, "event_id"))


_PARSERS = {
    "trajectory_started": _parse_started,
    "generation": _parse_generation,
    "reward": _parse_reward,
    "trajectory_finished": _parse_finished,
    "version_label": _parse_version_label,
}


_HASH_SKIP_IF_ABSENT = frozenset({"token_model_versions", "metadata", "weight_versions"})


def identity_of(event: Event) -> str | None:
    """The event's identity key (docs/reference.md): event_id, else (type, trajectory, seq)."""
    if event.event_id is not None:
        return "id:" + event.event_id
    if isinstance(event, Generation):
        return f"generation:{event.trajectory_id}:{event.seq}"
    if isinstance(event, (TrajectoryStarted, TrajectoryFinished)):
        return f"{event.type}:{event.trajectory_id}"
    if isinstance(event, VersionLabel):
        return f"version_label:{event.label}"
    if isinstance(event, (TrainStep, SampleAnnotation)):
        return lineage_identity(event)
    return None  # a reward without event_id replaces the earlier reward


def content_hash(event: Event) -> bytes:
    """A digest of the event's content as sent, independent of its ARRAY encoding.

    17 bytes: a format byte (``_DIGEST_XXH3``) and XXH3-128 of the event's
    fields (names, array shapes and little-endian bytes, scalar reprs). The
    routes re-sent on every turn make this the hottest loop of an append: XXH3
    reads them at memory speed (~0.1 ms per call of the benchmark's load, 20x
    less than SHA-256 with the CPU's SHA extensions). It detects a retry that
    differs from what was stored, not an adversary: a writer able to forge
    collisions could as well send the conflicting event under a new id.

    Events stored before this format carry 16 bytes (SHA-256, truncated):
    compare a stored digest with ``same_content``, never with ``==``."""
    return _DIGEST_XXH3 + _digest_fields(event, xxhash.xxh3_128()).digest()


def same_content(stored: bytes, event: Event, digest: bytes | None = None) -> bool:
    """Does ``stored`` (a digest from the log, of either format) digest ``event``?
    ``digest``: ``content_hash(event)`` if the caller has it."""
    stored = bytes(stored)
    if len(stored) == _LEGACY_DIGEST_BYTES:
        return stored == _legacy_content_hash(event)
    return stored == (digest if digest is not None else content_hash(event))


_DIGEST_XXH3 = b"\x02"
_LEGACY_DIGEST_BYTES = 16


def _legacy_content_hash(event: Event) -> bytes:
    """The digest of events stored before ``_DIGEST_XXH3``: SHA-256 truncated to 128 bits."""
    return _digest_fields(event, hashlib.sha256()).digest()[:16]


def _digest_fields(event: Event, h: Any) -> Any:
    # The bytes hashed, in order: each field's name, then an array's shape and its
    # little-endian bytes, a mapping's sorted JSON, or a scalar's repr. Consecutive
    # small pieces go in as one update (the same stream, so the same digest: a call
    # per piece cost more than hashing the routes).
    small: list[bytes] = []
    for name in event.__dataclass_fields__:  # type: ignore[union-attr]
        value = getattr(event, name)
        if value is None and name in _HASH_SKIP_IF_ABSENT:
            continue  # fields added later: events without them keep the digest they were stored with
        small.append(name.encode())
        if isinstance(value, np.ndarray):
            small.append(str(value.shape).encode())
            h.update(b"".join(small))
            small.clear()
            h.update(memoryview(np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))).cast("B"))
        elif isinstance(value, Mapping):
            small.append(json.dumps(value, sort_keys=True, default=str).encode())
        else:
            small.append(repr(value).encode())
    if small:
        h.update(b"".join(small))
    return h


# -- Training lineage (docs/reference.md "Training lineage"): the trainer's store-wide events ------------------
#
# ``train_step``: the samples one rank consumed in one optimizer step, with the step's
# metrics; ``sample_annotation``: what the trainer computed on one sample in a step
# (its recomputed logprobs, advantages, entropy, metrics). Rules that need the store
# (the samples exist, arrays have one entry per response token) are admission's
# (``trajstore._lineage``).

LINEAGE_TYPES = ("train_step", "sample_annotation")
ANNOTATION_ARRAYS = ("trainer_logprobs", "advantages", "entropy")
"""The per-token arrays of a ``sample_annotation`` (``advantages`` may be one number instead)."""
_MAX_STEP_SAMPLES = 1 << 20
"""A ``train_step`` names at most this many samples (a rank's share of one step)."""
_MAX_METRICS = 256
"""A ``metrics`` object holds at most this many entries."""

_FIELDS.update({
    "train_step": frozenset({"type", "run", "step", "rank", "world_size", "policy_version", "samples",
                             "projection", "attempt", "metrics", "event_id"}),
    "sample_annotation": frozenset({"type", "run", "step", "attempt", "trajectory_id", "sample_index",
                                    "projection", *ANNOTATION_ARRAYS, "metrics", "event_id"}),
})


@dataclass(frozen=True, slots=True, eq=False)
class TrainStep:
    """Store-wide: rank ``rank`` of ``world_size`` consumed ``samples`` in step ``step`` of ``run``.

    ``attempt``: a step redone after a restore takes a higher one; for every
    ``(run, step, rank)`` the highest stands. Not part of any trajectory
    (``trajectory_id`` is ``""``)."""

    run: str
    step: int
    rank: int
    world_size: int
    policy_version: int
    samples: tuple[tuple[str, int], ...]  # (trajectory_id, sample_index), in the order consumed
    projection: str | None = None  # None: the default samples
    attempt: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    event_id: str | None = None
    type: str = "train_step"
    trajectory_id: str = ""

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.run, self.step, self.rank, self.attempt)


@dataclass(frozen=True, slots=True, eq=False)
class SampleAnnotation:
    """What the trainer computed on sample ``(trajectory_id, sample_index)`` in step
    ``step`` (attempt ``attempt``) of ``run``. Arrays are float32, one entry per
    response token; ``advantages`` may instead be one number (a float)."""

    run: str
    step: int
    trajectory_id: str
    sample_index: int
    attempt: int = 0
    projection: str | None = None
    trainer_logprobs: np.ndarray | None = None  # float32 [R]
    advantages: np.ndarray | float | None = None  # float32 [R], or one number for the whole sample
    entropy: np.ndarray | None = None  # float32 [R]
    metrics: Mapping[str, float] = field(default_factory=dict)
    event_id: str | None = None
    type: str = "sample_annotation"

    @property
    def key(self) -> tuple[str, int, int, str, int]:
        return (self.run, self.step, self.attempt, self.trajectory_id, self.sample_index)

    @property
    def num_tokens(self) -> int | None:
        """Entries of its per-token arrays (None when it has none)."""
        for name in ANNOTATION_ARRAYS:
            value = getattr(self, name)
            if isinstance(value, np.ndarray):
                return len(value)
        return None


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
            out.append((pair[0], pair[1]))  # the usual pair, every rule checked inline
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


_PARSERS.update({"train_step": _parse_train_step, "sample_annotation": _parse_annotation})
