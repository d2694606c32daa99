"""``trajstore ingest FILE``: a JSONL file of wire-format events into a store, in bounded memory.

Two streaming passes over the file, neither of which keeps more than one
batch of events:

1. **Validate.** Every line is parsed and validated (docs/reference.md's stateless rules)
   and admitted against its trajectory's tail state — read from the store,
   then threaded through the file — exactly as ``Store.append`` would, but
   nothing is written. Events already stored (a re-run) are recognized by
   their identity and content digest and skipped, so a file whose
   stored prefix is the retry of an earlier run validates. Only the small
   per-trajectory state (no token arrays) and one 16-byte digest per event
   identity are kept. Any bad event stops here: nothing is stored.
2. **Append.** The file is read again and appended in batches of at most
   ``batch_events`` events / ``batch_bytes`` bytes of JSON; each batch is one
   atomic, idempotent ``Store.append``.

A crash (or kill -9) during pass 2 leaves a prefix of whole batches stored
and nothing of the others; running the same command again skips the stored
prefix (identical retries are no-ops) and appends the rest. docs/log.md says
this in full. Errors name the 1-based line of the file.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator

from trajstore.errors import ValidationError
from trajstore.events import Event, parse_event

__all__ = ["IngestResult", "ingest_file"]

BATCH_EVENTS = 512
BATCH_BYTES = 16 << 20


@dataclass(frozen=True)
class IngestResult:
    num_events: int
    num_appended: int
    num_duplicates: int


def ingest_file(store, path: str, *, progress: Callable[[int], None] | None = None,
                batch_events: int = BATCH_EVENTS, batch_bytes: int = BATCH_BYTES,
                phase: Callable[[str], None] | None = None) -> IngestResult:
    """Validate all of ``path`` (``-`` = stdin, spooled to a temporary file), then append it in batches.

    ``progress(n)`` is called with bytes processed; the whole job is
    ``2 * size`` bytes (validate, then append). ``phase(name)`` is called as
    each pass starts, ``"validate"`` then ``"append"``: a caller showing each
    pass on its own (the CLI) counts the file's bytes once per pass."""
    with _seekable(path) as (file, name):
        if phase:
            phase("validate")
        n = _validate(store, file, name, progress, batch_events, batch_bytes)
        if phase:
            phase("append")
        appended = duplicates = 0
        for batch, lines, nbytes in _batches(file, name, batch_events, batch_bytes):
            try:
                res = store.append(batch)
            except ValidationError as e:  # a concurrent writer changed a trajectory since pass 1
                raise _at_line(e, name, lines[e.index] if e.index is not None else None) from None
            appended += res.num_appended
            duplicates += res.num_duplicates
            if progress:
                progress(nbytes)
    return IngestResult(n, appended, duplicates)


class _seekable:
    """The file opened for two passes; stdin is first copied to a temporary file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tmp: str | None = None

    def __enter__(self):
        if self.path == "-":
            fd, self.tmp = tempfile.mkstemp(prefix="trajstore-ingest-", suffix=".jsonl")
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(sys.stdin.buffer, out, 1 << 20)
            self.file = open(self.tmp, "rb")
            return self.file, "stdin"
        self.file = open(self.path, "rb")
        return self.file, self.path

    def __exit__(self, *exc) -> None:
        self.file.close()
        if self.tmp:
            os.unlink(self.tmp)


def _lines(file, name: str) -> Iterator[tuple[int, int, dict]]:
    """(1-based line number, bytes, decoded object) of every non-blank line."""
    file.seek(0)
    for lineno, raw in enumerate(file, 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            msg = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise ValidationError(f"line {lineno} of {name} is not JSON ({msg})", rule="json") from None
        except RecursionError:
            raise ValidationError(f"line {lineno} of {name} is nested too deeply", rule="json") from None
        yield lineno, len(raw), obj


def _parsed(file, name: str) -> Iterator[tuple[int, int, Event]]:
    for lineno, nbytes, obj in _lines(file, name):
        try:
            ev = parse_event(obj)
        except ValidationError as e:
            raise _at_line(e, name, lineno) from None
        yield lineno, nbytes, ev


def _batches(file, name: str, batch_events: int, batch_bytes: int) -> Iterator[tuple[list[Event], list[int], int]]:
    batch: list[Event] = []
    lines: list[int] = []
    size = 0
    for lineno, nbytes, ev in _parsed(file, name):
        batch.append(ev)
        lines.append(lineno)
        size += nbytes
        if len(batch) >= batch_events or size >= batch_bytes:
            yield batch, lines, size
            batch, lines, size = [], [], 0
    if batch:
        yield batch, lines, size


def _at_line(e: ValidationError, name: str, lineno: int | None) -> ValidationError:
    where = f"line {lineno} of {name}" if lineno is not None else name
    if e.trajectory_id is not None:
        where += f" (trajectory {e.trajectory_id!r})"
    return type(e)(f"{where}: {e.reason}", rule=e.rule)


def _validate(store, file, name: str, progress, batch_events: int, batch_bytes: int) -> int:
    """Pass 1: admit every event against the store's state without writing (``Store.checker``); return the count."""
    checker = store.checker()
    count = 0
    for batch, lines, nbytes in _batches(file, name, batch_events, batch_bytes):
        try:
            checker.check(batch)
        except ValidationError as e:
            raise _at_line(e, name, lines[e.index] if e.index is not None else None) from None
        count += len(batch)
        if progress:
            progress(nbytes)
    return count
