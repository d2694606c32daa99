"""The reader's resume state: its format, and its validation on load.

A state is a small JSON dict (``SampleReader.state_dict``): the cursor, where
to rescan to rebuild what was open at it, the snapshot, the saved counters
and, for a pooled sampling policy (``_policies``), the pool as its units'
keys and uses. ``validate`` refuses a malformed state, one of another format
version, or one saved with another unit sequence or policy, with one line
naming the mismatch.
"""

from __future__ import annotations

from typing import Any

from trajstore.reader._plan import Key
from trajstore.reader._config import ReaderConfig, ReaderStats
from trajstore.errors import ResumeStateError

__all__ = ["STATE_FORMAT", "STATE_FORMAT_VERSION", "get", "key_or_none", "pool_of", "validate"]

STATE_FORMAT = "trajstore.reader"
STATE_FORMAT_VERSION = 1
# Keys that states saved before the one-name-per-meaning renames used; such states still load.
_LEGACY_KEYS = {"format_version": "version", "current_model_version": "current_version"}


def get(state: dict[str, Any], name: str) -> Any:
    """A state's value under its name, else under its name before the renames."""
    return state[name] if name in state else state[_LEGACY_KEYS[name]]


def key_or_none(value: Any) -> Key | None:
    return None if value is None else (int(value[0]), int(value[1]))


def validate(state: Any, config: ReaderConfig) -> None:
    if not isinstance(state, dict):
        raise ResumeStateError(f"reader state must be a dict, got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        raise ResumeStateError(f"not a trajstore reader state: format {state.get('format')!r}")
    for name in ("format_version", "fingerprint", "cursor", "scan_from", "snapshot_position",
                 "current_model_version", "stats"):
        if name not in state and _LEGACY_KEYS.get(name) not in state:
            raise ResumeStateError(f"reader state lacks {name!r}")
    for name in ("format_version", "version"):
        if name in state and state[name] != STATE_FORMAT_VERSION:
            raise ResumeStateError(f"reader state format version {state[name]!r} is not the supported "
                                   f"{STATE_FORMAT_VERSION}")
    saved, mine = state["fingerprint"], config.fingerprint()
    for name, value in mine.items():
        if name == "policy":
            continue  # below, naming fifo
        if not isinstance(saved, dict) or saved.get(name) != value:
            theirs = saved.get(name) if isinstance(saved, dict) else saved
            raise ResumeStateError(f"state was saved with {name}={theirs!r}, this reader has {name}={value!r}")
    if isinstance(saved, dict) and saved.get("projection") != mine.get("projection"):
        # a projection's samples are another sequence than the default's (absent = the default)
        raise ResumeStateError(f"state was saved with projection={saved.get('projection')!r}, this reader has "
                               f"projection={mine.get('projection')!r}")
    if isinstance(saved, dict) and saved.get("policy") != mine.get("policy"):
        # another policy takes other steps from the same samples (absent = fifo)
        raise ResumeStateError(f"state was saved with policy={saved.get('policy', 'fifo')!r}, this reader has "
                               f"policy={mine.get('policy', 'fifo')!r}")
    for name in ("cursor", "scan_from"):
        value = state[name]
        if value is not None and not (isinstance(value, (list, tuple)) and len(value) == 2
                                      and all(isinstance(v, int) and v >= 0 for v in value)):
            raise ResumeStateError(f"reader state {name} must be null or [finished_position, sample_index], got {value!r}")
    pool = state.get("pool")
    if state["scan_from"] is not None and (state["cursor"] is None or not (config.keep_groups or pool)):
        raise ResumeStateError(f"reader state scan_from {state['scan_from']!r} needs a cursor and keep_groups "
                               "or a pool")
    pool_of(state, config)
    for name in ("snapshot_position", "current_model_version", "current_version"):
        if state.get(name) is not None and not isinstance(state[name], int):
            raise ResumeStateError(f"reader state {name} must be an integer or null, got {state[name]!r}")
    stats = state["stats"]
    if not isinstance(stats, dict) or any(not isinstance(stats.get(n), int) for n in ReaderStats._SAVED):
        raise ResumeStateError(f"reader state stats must hold integers {list(ReaderStats._SAVED)}, got {stats!r}")


def pool_of(state: dict[str, Any], config: ReaderConfig) -> dict[Key, int]:
    """The pool a state holds, ``{unit key: uses}`` (empty for fifo); ResumeStateError
    when it is malformed: each entry ``[finished_position, sample_index, uses]``,
    in order, at or before the cursor, with fewer uses than the policy allows."""
    pool = state.get("pool")
    policy = config.policy
    if pool is None or not policy.pooled:
        if pool:
            raise ResumeStateError(f"reader state has a pool of {len(pool)} units but the policy is fifo")
        return {}
    cursor = state["cursor"]
    out: dict[Key, int] = {}
    last: Key | None = None
    for entry in pool if isinstance(pool, list) else [pool]:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and all(isinstance(v, int) and v >= 0
                                                                            for v in entry)):
            raise ResumeStateError(f"reader state pool entries must be [finished_position, sample_index, uses], "
                                   f"got {entry!r:.80}")
        key = (entry[0], entry[1])
        if cursor is None or key > tuple(cursor) or (last is not None and key <= last):
            raise ResumeStateError(f"reader state pool entry {list(entry)} is out of order or past the cursor "
                                   f"{cursor!r}")
        if entry[2] >= policy.max_uses:
            raise ResumeStateError(f"reader state pool entry {list(entry)} has {entry[2]} uses; policy "
                                   f"{policy.name!r} allows {policy.max_uses}")
        out[key], last = entry[2], key
    return out
