"""An event's identity key and the digest of its content (docs/reference.md).

``identity_of`` names the event a retry must match; ``content_hash`` digests
what was sent so that a retry with different content is told apart;
``same_content`` compares a stored digest of either format.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from collections.abc import Mapping  # isinstance against typing.Mapping is ~10x slower
from typing import Any

import numpy as np
import xxhash

from trajstore.events._lineage import lineage_identity
from trajstore.events._types import (Event, Generation, GroupDropped, SampleAnnotation, TrainStep, TrajectoryFinished,
                                    TrajectoryStarted, VersionLabel)

__all__ = ["content_hash", "identity_of", "same_content"]

# fields added later: an event without them keeps the digest it was stored with
_HASH_SKIP_IF_ABSENT = frozenset({"token_model_versions", "metadata", "weight_versions", "run", "prompt_id", "epoch",
                                  "group_size"})


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
    if isinstance(event, GroupDropped):  # (type, run, group_id), a JSON list: ids may hold ":"
        return json.dumps(["group_dropped", event.run, event.group_id], ensure_ascii=False, separators=(",", ":"))
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
    for name, encoded, skip_if_absent in _fields_of(type(event)):
        value = getattr(event, name)
        kind = type(value)
        if value is None:
            if skip_if_absent:
                continue  # fields added later: events without them keep the digest they were stored with
            small.append(encoded)
            small.append(b"None")
        elif kind in _REPR_TYPES:  # the usual scalars: no ABC check (isinstance against Mapping is slow)
            small.append(encoded)
            small.append(repr(value).encode())
        elif kind is np.ndarray or isinstance(value, np.ndarray):
            small.append(encoded)
            small.append(str(value.shape).encode())
            h.update(b"".join(small))
            small.clear()
            if not (value.size and value.flags.c_contiguous and value.dtype.byteorder in _LITTLE):  # else as they are
                value = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
            h.update(memoryview(value).cast("B"))
        elif isinstance(value, Mapping):
            small.append(encoded)
            small.append(json.dumps(value, sort_keys=True, default=str).encode())
        else:
            small.append(encoded)
            small.append(repr(value).encode())
    if small:
        h.update(b"".join(small))
    return h


_LITTLE = ("<", "|") + (("=",) if sys.byteorder == "little" else ())
"""Byte orders (``dtype.byteorder``) an array's bytes are digested in as they lie."""

_REPR_TYPES = frozenset({str, int, float, bool, tuple})
"""Types whose digest piece is their ``repr`` (none of them an array or a Mapping)."""

@functools.cache
def _fields_of(cls: type) -> tuple[tuple[str, bytes, bool], ...]:
    """An event class's fields in declaration order: (name, its bytes, skipped when None)."""
    return tuple((name, name.encode(), name in _HASH_SKIP_IF_ABSENT)
                 for name in cls.__dataclass_fields__)  # type: ignore[attr-defined]
