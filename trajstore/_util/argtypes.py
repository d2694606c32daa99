"""The one argparse type of every numeric command-line flag: finite, in range.

``float("nan")`` and ``float("inf")`` parse; a flag that took them would put
NaN into a page's JSON or a loop's sleep. Every numeric flag is declared with
``number(...)``, so argparse refuses such a value in one line (exit 2)::

    parser.add_argument("--refresh-s", type=number(float, min=0, min_exclusive=True), ...)
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

__all__ = ["number"]


def number(kind: type = float, *, min: float | None = None, max: float | None = None,
           min_exclusive: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: ``kind`` (float or int) parsed from the flag's text, finite,
    at least ``min`` (more than it, with ``min_exclusive``) and at most ``max``."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if min is not None and (value <= min if min_exclusive else value < min):
            raise argparse.ArgumentTypeError(f"{text} must be {'more than' if min_exclusive else 'at least'} {min:g}")
        if max is not None and value > max:
            raise argparse.ArgumentTypeError(f"{text} must be at most {max:g}")
        return value

    parse.__name__ = "integer" if kind is int else "number"  # argparse's "invalid <name> value"
    return parse
