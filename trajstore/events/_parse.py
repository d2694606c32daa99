"""Parsing the trajectory events of the wire format (no history needed).

``trajectory_started``, ``generation`` (token ids, per-token arrays, routes,
versions), ``reward``, ``trajectory_finished`` and the store-wide
``version_label``: one parser each, in ``PARSERS``; ``trajstore.events.parse_event``
dispatches to them after the checks every type shares.
"""

from __future__ import annotations

import re
from collections.abc import Mapping  # isinstance against typing.Mapping is ~10x slower
from typing import Any

import numpy as np

from trajstore.events._fields import (
    _F32_MAX,
    _INT32_MAX,
    _MAX_ID_CHARS,
    _finite,
    _int,
    _optional_id,
    _short,
    _text,
    validate_metadata,
)
from trajstore.events._ledger import ledger_fields
from trajstore.events._types import (
    FINISH_STATUSES,
    Generation,
    Reward,
    TrajectoryFinished,
    TrajectoryStarted,
    VersionLabel,
    routes_dtype,
)
from trajstore.events._wire import decode_array
from trajstore.errors import ValidationError

__all__ = ["PARSERS", "decimal_label"]

_ROUTE_ID_LIMIT = 1 << 16  # stored as uint16 at most
_MAX_FINISH_REASON_CHARS = 64


def _parse_started(obj: Mapping, tid: str) -> TrajectoryStarted:
    num_experts = obj.get("num_experts")
    if num_experts is not None:
        num_experts = _int(obj, "num_experts", minimum=1)
        if num_experts > _ROUTE_ID_LIMIT:
            raise ValidationError(f"num_experts must be <= {_ROUTE_ID_LIMIT}, got {num_experts}", rule="num_experts")
    metadata = obj.get("metadata")
    group_id = _optional_id(obj, "group_id")
    return TrajectoryStarted(
        trajectory_id=tid,
        group_id=group_id,
        num_experts=num_experts,
        metadata={} if metadata is None else validate_metadata(metadata),
        event_id=_optional_id(obj, "event_id"),
        **ledger_fields(obj, group_id),
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
        # a bound the dtype cannot cross is not scanned for (int32 ids: only the sign)
        kind, size = arr.dtype.kind, arr.dtype.itemsize
        if kind not in "ub":
            lo = np.minimum.reduce(arr)
            if lo < 0:
                raise ValidationError(f"{key} holds a negative token id ({int(lo)})", rule="negative_token_id")
        if not (kind == "b" or (kind == "i" and size <= 4) or (kind == "u" and size < 4)):
            hi = np.maximum.reduce(arr)
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
    # rows for exactly positions start .. num_tokens-2 (SPEC v5): the last sampled token
    # was never forwarded, so it has none (docs/reference.md "Routed experts"); more rows,
    # or fewer, would be misaligned without a word.
    want_rows = num_tokens - 1 - start
    if len(arr) > want_rows:
        raise ValidationError(
            f"routed_experts has {len(arr)} rows but positions routed_experts_start ({start}) .. "
            f"len(prompt_ids)+len(output_ids)-2 ({num_tokens - 2}) are {max(want_rows, 0)}: the last token "
            f"has no route", rule="too_many_route_rows")
    if len(arr) < want_rows:
        raise ValidationError(
            f"routed_experts has {len(arr)} rows but positions routed_experts_start ({start}) .. "
            f"len(prompt_ids)+len(output_ids)-2 ({num_tokens - 2}) are {want_rows}: rows for part of the "
            f"sequence would be misaligned", rule="too_few_route_rows")
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


PARSERS = {
    "trajectory_started": _parse_started,
    "generation": _parse_generation,
    "reward": _parse_reward,
    "trajectory_finished": _parse_finished,
    "version_label": _parse_version_label,
}
