"""Progress of long operations: a bar on a terminal, a line every few seconds otherwise.

Off a terminal (a batch job, ``nohup``, a CI log) a bar would be invisible,
so the same progress is written as plain lines to stderr, one every
``$TRAJSTORE_PROGRESS_INTERVAL_S`` seconds (default 5), and a last one when
an operation that printed any finishes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Callable, Iterator

from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

DEFAULT_INTERVAL_S = 5.0


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, *, unit: str = "items") -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)``; the bar shows on stderr when it is a terminal, else progress lines.

    ``unit="bytes"`` shows the count as sizes (``12.3/45.6 MB``)."""
    if not sys.stderr.isatty():
        with _progress_lines(description, total, unit) as advance:
            yield advance
        return
    count = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), count, TimeElapsedColumn(), transient=False)
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)


def _interval_s() -> float:
    try:
        return max(0.0, float(os.environ.get("TRAJSTORE_PROGRESS_INTERVAL_S", DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


def _amount(n: float, unit: str) -> str:
    if unit != "bytes":
        return f"{n:,.0f}"
    for size, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= size:
            return f"{n / size:.1f} {name}"
    return f"{n:.0f} bytes"


@contextlib.contextmanager
def _progress_lines(description: str, total: int | None, unit: str) -> Iterator[Callable[[int], None]]:
    start = time.monotonic()
    interval = _interval_s()
    state = {"done": 0, "next": start + interval, "printed": False}

    def line(now: float) -> str:
        done = state["done"]
        of = (f"{_amount(done, unit)} of {_amount(total, unit)} ({100 * done / total:.0f}%)" if total
              else _amount(done, unit) + ("" if unit == "bytes" else f" {unit}"))
        return f"{description}: {of}, {now - start:.0f} s"

    def advance(n: int = 1) -> None:
        state["done"] += n
        now = time.monotonic()
        if now >= state["next"]:
            print(line(now), file=sys.stderr, flush=True)
            state["printed"] = True
            state["next"] = now + interval

    yield advance
    if state["printed"]:
        print(line(time.monotonic()) + " (done)", file=sys.stderr, flush=True)
