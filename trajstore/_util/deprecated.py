"""Old keyword names kept working for one release, with a ``DeprecationWarning``."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["renamed"]


def renamed(old: str, new: str, old_value: Any, new_value: Any, default: Any, *, stacklevel: int = 3) -> Any:
    """The value of keyword ``new``, or of its old name ``old`` when the caller
    passed that (``old_value`` not None): warns, and refuses both at once."""
    if old_value is None:
        return new_value
    warnings.warn(f"{old}= is deprecated; use {new}= (same meaning)", DeprecationWarning, stacklevel=stacklevel)
    if new_value != default and new_value != old_value:
        raise TypeError(f"pass {new}= or its old name {old}=, not both")
    return old_value
