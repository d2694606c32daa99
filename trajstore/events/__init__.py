"""Event types of the wire format and their stateless validation.

``parse_event(obj)`` turns one wire-format dict (docs/reference.md "Event wire format")
into a typed, immutable event with numpy arrays, or raises ValidationError.
Rules that need the trajectory's history (seq order, known/finished
trajectory, expert range, route shape, reward mode, route rows below
``routed_experts_start``) live in ``trajstore._append.admission``.

Array dtypes after parsing: token ids int32, logprobs / token rewards float32,
loss mask uint8, routes uint8 when every id < 256 else uint16.

The module is the documented import path; its parts live in private modules:
``_event_types`` (the dataclasses and field lists), ``_event_fields`` (the
typed field checks), ``_event_parse`` (trajectory events), ``_event_lineage``
(the trainer's lineage events), ``_event_ledger`` (the rollout ledger's fields and
``group_dropped``) and ``_event_digest`` (identity and digest).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping  # isinstance against typing.Mapping is ~10x slower
from typing import Any

from trajstore.events import _ledger as _event_ledger
from trajstore.events import _lineage as _event_lineage
from trajstore.events import _parse as _event_parse
# _legacy_content_hash: still importable from here (the digest tests compare both formats)
from trajstore.events._digest import _legacy_content_hash, content_hash, identity_of, same_content  # noqa: F401
from trajstore.events._fields import _id, _printable_id, _short, validate_metadata
from trajstore.events._lineage import lineage_identity
from trajstore.events._parse import decimal_label
from trajstore.events._types import (
    _FIELDS,
    ANNOTATION_ARRAYS,
    ARRAY_FIELDS,
    FINISH_STATUSES,
    LINEAGE_TYPES,
    LOGPROB_PLACEHOLDER,
    TOKEN_FIELDS,
    WHOLE_STATUSES,
    Event,
    Generation,
    GroupDropped,
    Reward,
    SampleAnnotation,
    TrainStep,
    TrajectoryFinished,
    TrajectoryStarted,
    VersionLabel,
    routes_dtype,
)
from trajstore.errors import ValidationError

__all__ = [
    "Event",
    "Generation",
    "Reward",
    "TrajectoryFinished",
    "TrajectoryStarted",
    "VersionLabel",
    "GroupDropped",
    "TrainStep",
    "SampleAnnotation",
    "LINEAGE_TYPES",
    "lineage_identity",
    "ANNOTATION_ARRAYS",
    "FINISH_STATUSES",
    "WHOLE_STATUSES",
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

_PARSERS = {**_event_parse.PARSERS, **_event_lineage.PARSERS, **_event_ledger.PARSERS}
assert set(_PARSERS) == set(_FIELDS)


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
                        SampleAnnotation, GroupDropped)):
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
    if kind in ("version_label", "group_dropped"):
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
