"""A progress bar for long operations (rich), silent when not on a terminal."""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, *, unit: str = "items") -> Iterator[Callable[[int], None]]:
    """Yield ``advance(n)``; the bar shows on stderr when it is a terminal.

    ``unit="bytes"`` shows the count as sizes (``12.3/45.6 MB``)."""
    count = DownloadColumn() if unit == "bytes" else MofNCompleteColumn()
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), count, TimeElapsedColumn(),
        disable=not sys.stderr.isatty(), transient=False,
    )
    with progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)
