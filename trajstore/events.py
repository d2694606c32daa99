"""Event types of the wire format and their stateless validation.

``parse_event(obj)`` turns one wire-format dict (SPEC "Event wire format")
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
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import numpy as np

from trajstore.errors import ValidationError
from trajstore._wire import decode_array

__all__ = [
    "Event",
    "Generation",
    "Reward",
    "TrajectoryFinished",
    "TrajectoryStarted",
    "FINISH_STATUSES",
    "content_hash",
    "identity_of",
    "parse_event",
    "routes_dtype",
]

FINISH_STATUSES = ("completed", "truncated", "aborted", "failed")
_INT32_MAX = np.iinfo(np.int32).max
_ROUTE_ID_LIMIT = 1 << 16  # stored as uint16 at most


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
    model_version: int  # the last output token's version when token_model_versions is given
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
    type: str = "generation"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


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


Event = Union[TrajectoryStarted, Generation, Reward, TrajectoryFinished]


def routes_dtype(max_id: int) -> np.dtype:
    """SPEC: uint8 when every expert id < 256, else uint16."""
    return np.dtype(np.uint8) if max_id < 256 else np.dtype(np.uint16)


def parse_event(obj: Any) -> Event:
    """Parse and validate one wire-format event (no history needed)."""
    if isinstance(obj, (TrajectoryStarted, Generation, Reward, TrajectoryFinished)):
        return obj
    if not isinstance(obj, Mapping):
        raise ValidationError(f"an event must be a JSON object, got {type(obj).__name__}", rule="not_object")
    kind = obj.get("type")
    parser = _PARSERS.get(kind)  # type: ignore[arg-type]
    tid = obj.get("trajectory_id")
    if parser is None:
        raise ValidationError(
            f"unknown event type {kind!r} (expected one of {sorted(_PARSERS)})",
            trajectory_id=tid if isinstance(tid, str) else None,
            rule="unknown_type",
        )
    if not isinstance(tid, str) or not tid:
        raise ValidationError(f"trajectory_id must be a non-empty string, got {tid!r}", rule="trajectory_id")
    try:
        return parser(obj, tid)
    except ValidationError as e:
        raise ValidationError(e.reason, trajectory_id=tid, rule=e.rule) from None


def _optional_str(obj: Mapping, key: str) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        raise ValidationError(f"{key} must be a string, got {type(value).__name__}", rule=key)
    return value


def _int(obj: Mapping, key: str, *, default: int | None = None, minimum: int = 0) -> int:
    value = obj.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValidationError(f"{key} must be an integer, got {value!r}", rule=key)
    if value < minimum:
        raise ValidationError(f"{key} must be >= {minimum}, got {value}", rule=key)
    return int(value)


def _finite(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValidationError(f"{key} must be a number, got {value!r}", rule=key)
    value = float(value)
    if not math.isfinite(value):
        raise ValidationError(f"{key} must be finite, got {value}", rule="non_finite")
    return value


def _parse_started(obj: Mapping, tid: str) -> TrajectoryStarted:
    num_experts = obj.get("num_experts")
    if num_experts is not None:
        num_experts = _int(obj, "num_experts", minimum=1)
        if num_experts > _ROUTE_ID_LIMIT:
            raise ValidationError(f"num_experts must be <= {_ROUTE_ID_LIMIT}, got {num_experts}", rule="num_experts")
    metadata = obj.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise ValidationError(f"metadata must be an object, got {type(metadata).__name__}", rule="metadata")
    return TrajectoryStarted(
        trajectory_id=tid,
        group_id=_optional_str(obj, "group_id"),
        num_experts=num_experts,
        metadata=dict(metadata),
        event_id=_optional_str(obj, "event_id"),
    )


def _token_ids(value: Any, key: str) -> np.ndarray:
    arr = decode_array(value, field=key, ndim=1).reshape(-1)
    if arr.dtype.kind == "f":
        if arr.size and not np.all(np.mod(arr, 1) == 0):
            raise ValidationError(f"{key} holds non-integer token ids", rule="token_ids")
    elif arr.dtype.kind not in "iub":
        raise ValidationError(f"{key} must hold integers, got {arr.dtype}", rule="token_ids")
    if arr.size:
        lo, hi = arr.min(), arr.max()
        if lo < 0:
            raise ValidationError(f"{key} holds a negative token id ({int(lo)})", rule="negative_token_id")
        if hi > _INT32_MAX:
            raise ValidationError(f"{key} holds a token id above int32 ({int(hi)})", rule="token_ids")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _per_token(obj: Mapping, key: str, n: int, dtype: type, *, finite: bool) -> np.ndarray | None:
    value = obj.get(key)
    if value is None:
        return None
    arr = decode_array(value, field=key, ndim=1).reshape(-1)
    if len(arr) != n:
        raise ValidationError(f"{key} has {len(arr)} values but output_ids has {n}", rule="length_mismatch")
    if finite and arr.size and not np.all(np.isfinite(arr)):
        raise ValidationError(f"{key} holds non-finite values", rule="non_finite")
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
        if arr.size and not np.all(np.mod(arr, 1) == 0):
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
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
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
    model_version = _model_version(obj, token_versions)
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
        finish_reason=_optional_str(obj, "finish_reason"),
        event_id=_optional_str(obj, "event_id"),
        token_model_versions=token_versions,
        metadata=_generation_metadata(obj),
    )


def _token_model_versions(obj: Mapping, n_out: int) -> np.ndarray | None:
    """SPEC "Versions": one non-negative int32 per output token, never decreasing."""
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


def _model_version(obj: Mapping, token_versions: np.ndarray | None) -> int:
    """``model_version``, or the last token's version when only the spans are given."""
    if "model_version" not in obj or obj["model_version"] is None:
        if token_versions is None:
            raise ValidationError("generation needs model_version", rule="missing_field")
        if not len(token_versions):
            raise ValidationError(
                "generation with no output tokens needs model_version (token_model_versions is empty)",
                rule="missing_field",
            )
        return int(token_versions[-1])
    version = _int(obj, "model_version")
    if version > _INT32_MAX:
        raise ValidationError(f"model_version must fit int32, got {version}", rule="model_version")
    if token_versions is not None and len(token_versions) and version != int(token_versions[-1]):
        raise ValidationError(
            f"model_version {version} differs from the last of token_model_versions ({int(token_versions[-1])})",
            rule="model_version",
        )
    return version


def _generation_metadata(obj: Mapping) -> Mapping[str, Any] | None:
    """A generation's free-form ``metadata`` (mirrors trajectory_started's)."""
    metadata = obj.get("metadata")
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise ValidationError(f"metadata must be an object, got {type(metadata).__name__}", rule="metadata")
    try:  # SQL stores it as JSON: refuse what JSON cannot hold rather than fail in the driver
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValidationError(f"metadata is not a JSON object of finite numbers and strings ({e})",
                              rule="metadata") from None
    return dict(metadata)


def _parse_reward(obj: Mapping, tid: str) -> Reward:
    if "reward" not in obj:
        raise ValidationError("reward event needs reward", rule="missing_field")
    return Reward(trajectory_id=tid, reward=_finite(obj["reward"], "reward"), event_id=_optional_str(obj, "event_id"))


def _parse_finished(obj: Mapping, tid: str) -> TrajectoryFinished:
    status = obj.get("status")
    if status not in FINISH_STATUSES:
        raise ValidationError(f"status must be one of {list(FINISH_STATUSES)}, got {status!r}", rule="status")
    return TrajectoryFinished(trajectory_id=tid, status=status, event_id=_optional_str(obj, "event_id"))


_PARSERS = {
    "trajectory_started": _parse_started,
    "generation": _parse_generation,
    "reward": _parse_reward,
    "trajectory_finished": _parse_finished,
}


_HASH_SKIP_IF_ABSENT = frozenset({"token_model_versions", "metadata"})


def identity_of(event: Event) -> str | None:
    """The event's identity key (SPEC): event_id, else (type, trajectory, seq)."""
    if event.event_id is not None:
        return "id:" + event.event_id
    if isinstance(event, Generation):
        return f"generation:{event.trajectory_id}:{event.seq}"
    if isinstance(event, (TrajectoryStarted, TrajectoryFinished)):
        return f"{event.type}:{event.trajectory_id}"
    return None  # a reward without event_id replaces the earlier reward


def content_hash(event: Event) -> bytes:
    """A digest of the event's content as sent, independent of its ARRAY encoding.

    SHA-256 (truncated to 128 bits): with the CPU's SHA extensions it hashes
    about twice as fast as BLAKE2b, and routes make this the hottest loop of
    an append."""
    h = hashlib.sha256()
    for name in event.__dataclass_fields__:  # type: ignore[union-attr]
        value = getattr(event, name)
        if value is None and name in _HASH_SKIP_IF_ABSENT:
            continue  # fields added later: events without them keep the digest they were stored with
        h.update(name.encode())
        if isinstance(value, np.ndarray):
            h.update(str(value.shape).encode())
            h.update(memoryview(np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))).cast("B"))
        elif isinstance(value, Mapping):
            h.update(json.dumps(value, sort_keys=True, default=str).encode())
        else:
            h.update(repr(value).encode())
    return h.digest()[:16]
