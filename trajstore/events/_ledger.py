"""Parsing the rollout ledger's wire fields (docs/reference.md "Rollout ledger").

The four fields a ``trajectory_started`` may carry (``run``, ``prompt_id``,
``epoch``, ``group_size``: all or none) and the store-wide ``group_dropped``
event. Rules that need the store (a group's fields agree, a prompt answered
once per epoch, a dropped group takes nothing) are admission's
(``trajstore.rollout._ledger``).
"""

from __future__ import annotations

from collections.abc import Mapping  # isinstance against typing.Mapping is ~10x slower

from trajstore.events._fields import _MAX_ID_CHARS, _id, _int, _optional_id, _text
from trajstore.events._types import LEDGER_FIELDS, GroupDropped
from trajstore.errors import ValidationError

__all__ = ["MAX_GROUP_SIZE", "PARSERS", "ledger_fields"]

MAX_GROUP_SIZE = 65535
"""A group is whole after at most this many finished episodes."""


def ledger_fields(obj: Mapping, group_id: str | None) -> dict:
    """The ledger fields of a ``trajectory_started`` (empty when it sends none).
    All four or none, and a ledger trajectory names its ``group_id``."""
    sent = [k for k in LEDGER_FIELDS if obj.get(k) is not None]
    if not sent:
        return {}
    if len(sent) != len(LEDGER_FIELDS):
        missing = [k for k in LEDGER_FIELDS if k not in sent]
        raise ValidationError(f"trajectory_started sends {', '.join(sent)} without {', '.join(missing)} "
                              f"(the rollout ledger's fields go all together or not at all)", rule="missing_field")
    if group_id is None:
        raise ValidationError("trajectory_started sends the rollout ledger's fields without group_id",
                              rule="missing_field")
    group_size = _int(obj, "group_size", minimum=1)
    if group_size > MAX_GROUP_SIZE:
        raise ValidationError(f"group_size must be <= {MAX_GROUP_SIZE}, got {group_size}", rule="group_size")
    return {"run": _id(obj["run"], "run"), "prompt_id": _id(obj["prompt_id"], "prompt_id"),
            "epoch": _int(obj, "epoch"), "group_size": group_size}


def _parse_group_dropped(obj: Mapping, tid: str) -> GroupDropped:
    if "run" not in obj or "group_id" not in obj:
        raise ValidationError("group_dropped needs run and group_id", rule="missing_field")
    reason = obj.get("reason")
    return GroupDropped(run=_id(obj["run"], "run"), group_id=_id(obj["group_id"], "group_id"),
                        reason=None if reason is None else _text(reason, "reason", max_chars=_MAX_ID_CHARS,
                                                                  allow_empty=True),
                        event_id=_optional_id(obj, "event_id"))


PARSERS = {"group_dropped": _parse_group_dropped}
