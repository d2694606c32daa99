"""The one duplicate rule of an append: identical retries dropped, conflicting ones refused.

An event with an identity (``events.identity_of``: its ``event_id``, else its
natural key) that is already stored, or came earlier in the batch, is a retry:
dropped when its content digest is the same (idempotency, docs/log.md), refused
with ``ConflictError`` naming it when it differs. ``Store.append`` and
``AppendCheck`` both apply it (``split_retries``); they differ only in what
they know is stored.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from trajstore.errors import ConflictError
from trajstore.events import Event, VersionLabel, same_content

__all__ = ["split_retries"]


def split_retries(parsed: Sequence[tuple[Event, str | None]], known: Mapping[str, bytes],
                   digest: Callable[[int], bytes], mapped: Callable[[str], int | None] = lambda label: None,
                   ) -> tuple[list[int], list[int], dict[str, int]]:
    """The one duplicate rule of ``append`` and ``AppendCheck``: an event whose identity is
    ``known`` (its content digest, stored or seen before) or came earlier in the batch is a retry,
    dropped when its content is the same and refused (ConflictError) when it differs.
    ``digest(i)``: the content digest of ``parsed[i]``, asked only of events with an identity that
    repeat or are first in the batch (a caller may compute them lazily). ``mapped(label)``: the
    stored label map's version for ``label`` (asked only to name both versions when a
    ``version_label`` remaps a stored label).
    Returns (fresh indices, duplicate indices, identity -> index of its first fresh event)."""
    first: dict[str, int] = {}
    fresh: list[int] = []
    duplicates: list[int] = []
    for i, (ev, ident) in enumerate(parsed):
        if ident is not None:
            if ident in known or ident in first:
                earlier = known[ident] if ident in known else digest(first[ident])
                if not same_content(earlier, ev, digest(i)):
                    if isinstance(ev, VersionLabel):
                        before = parsed[first[ident]][0] if ident in first else None
                        raise _label_conflict(ev, ident, before.model_version if isinstance(before, VersionLabel)
                                              and before.label == ev.label else mapped(ev.label), i)
                    raise _conflict(ev, ident, i)
                duplicates.append(i)
                continue
            first[ident] = i
        fresh.append(i)
    return fresh, duplicates, first


def _conflict(ev: Event, ident: str, index: int) -> ConflictError:
    if ev.event_id:
        what = f"event_id {ev.event_id!r}"
    elif ident.startswith("["):  # a lineage key (events.lineage_identity)
        what = ident
    else:
        what = ident.split(":")[0]
    return ConflictError(f"{what} is already stored with different content", index=index,
                         trajectory_id=ev.trajectory_id or None)


def _label_conflict(ev: VersionLabel, ident: str, known: int | None, index: int) -> ConflictError:
    """A version_label whose identity is taken: named by its label and both versions when it remaps one."""
    if known is None or known == ev.model_version:  # not a remap: an event_id reused for other content
        return _conflict(ev, ident, index)
    return ConflictError(f"version label {ev.label!r} is already mapped to model_version {known}, "
                         f"not {ev.model_version}", index=index)
