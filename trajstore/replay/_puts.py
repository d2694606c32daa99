"""What a read token may put (DoPut): one training step's lineage, bounded.

A read token (the trainers') appends training lineage only: every event of a
put is a ``train_step`` or a ``sample_annotation`` (each event is checked, not
the first offender found). And a put is bounded before its body is read: the
client declares the put's size in two headers (``PUT_BYTES``: the UTF-8 bytes
of its events, ``PUT_ROWS``: its events), the server's middleware refuses a
read token's put that declares nothing or more than ``PutLimits`` allows, and
the body is then read message by message and refused as soon as it holds more
than it declared. A ``train_step`` may name at most ``max_rows`` samples.

A read token records only its own runs (``trajstore.log._run_owners``: the
first read token to record a run owns it; a run recorded without a read token
is not a read token's either), and takes attempts in order: a ``train_step`` at
attempt N > 0 needs attempt N - 1 recorded for its (run, step, rank), and an
annotation at N > 0 comes with its step's ``train_step`` at N in the same put.
So it supersedes no other run's step, and no attempt can be squatted at
2**31 - 1 (a redo then overflowing the attempt column).

The write token's puts are not bounded here (its writers are trusted, as the
ingest service's are).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as fl

from trajstore.events import LINEAGE_TYPES
from trajstore.replay import _protocol as proto

__all__ = ["PUT_BYTES", "PUT_ROWS", "PutLimits", "DEFAULT_MAX_PUT_BYTES", "DEFAULT_MAX_PUT_ROWS", "declared_size",
           "value_bytes", "read_put", "parse_events", "check_lineage_only", "check_runs_and_attempts"]

PUT_BYTES = "x-trajstore-put-bytes"
PUT_ROWS = "x-trajstore-put-rows"
DEFAULT_MAX_PUT_BYTES = 64 << 20
"""A read token's put (one step's lineage) at most this many bytes of events by default."""
DEFAULT_MAX_PUT_ROWS = 65_536
"""... and at most this many events, and a ``train_step`` at most this many samples."""
_RULE = " [lineage_put_size]"  # the rule the client's ValidationError carries


@dataclass(frozen=True)
class PutLimits:
    max_bytes: int = DEFAULT_MAX_PUT_BYTES
    max_rows: int = DEFAULT_MAX_PUT_ROWS


@dataclass(frozen=True)
class Declared:
    """The size a put declared in its headers."""

    bytes: int
    rows: int


def _header_int(headers: dict[str, list[Any]], name: str) -> int | None:
    values = headers.get(name) or []
    if len(values) != 1:
        return None
    value = values[0].decode() if isinstance(values[0], bytes) else str(values[0])
    return int(value) if value.isdigit() and len(value) <= 18 else None


def declared_size(headers: dict[str, list[Any]], limits: PutLimits) -> Declared:
    """The put's declared size, checked against ``limits`` in the middleware (before any
    of the body is read); a Flight error naming the bound otherwise."""
    size, rows = _header_int(headers, PUT_BYTES), _header_int(headers, PUT_ROWS)
    if size is None or rows is None:
        raise fl.FlightServerError(f"{proto.INVALID}: a read token's put must declare its size in the {PUT_BYTES} "
                                   f"and {PUT_ROWS} headers (ReplayStore.append does){_RULE}")
    if size > limits.max_bytes or rows > limits.max_rows:
        raise fl.FlightServerError(f"{proto.INVALID}: a lineage put of {rows} events and {size} bytes is over this "
                                   f"server's bound ({limits.max_rows} events, {limits.max_bytes} bytes: "
                                   f"--max-lineage-put-rows, --max-lineage-put-bytes){_RULE}")
    return Declared(size, rows)


def value_bytes(column: pa.Array) -> int:
    """The UTF-8 bytes of a string column's values (what a put declares)."""
    return int(pc.sum(pc.binary_length(column)).as_py() or 0)


def read_put(reader: fl.MetadataRecordBatchReader, declared: Declared | None) -> pa.Table:
    """The put's table (one string column ``event``), read message by message; with
    ``declared``, refused (BadRequest) once it holds more events or bytes than that."""
    schema = reader.schema
    if schema.names != ["event"] or not pa.types.is_string(schema.field("event").type):
        raise proto.BadRequest(f"a put must be a table with one string column 'event', got {schema}")
    batches, rows, size = [], 0, 0
    while True:
        try:
            chunk = reader.read_chunk()
        except StopIteration:
            break
        batch = chunk.data
        if batch is None:
            continue
        rows += batch.num_rows
        size += value_bytes(batch.column(0))
        if declared is not None and (rows > declared.rows or size > declared.bytes):
            raise proto.BadRequest(f"the put holds more than it declared ({declared.rows} events, {declared.bytes} "
                                   f"bytes): refused after {rows} events, {size} bytes{_RULE}")
        batches.append(batch)
    return pa.Table.from_batches(batches, schema=schema)


def parse_events(table: pa.Table) -> list[dict[str, Any]]:
    events = []
    for i, text in enumerate(table.column("event").to_pylist()):
        try:
            ev = json.loads(text) if text is not None else None
        except ValueError as e:
            raise proto.BadRequest(f"event {i} is not JSON ({e})") from None
        if not isinstance(ev, dict):
            raise proto.BadRequest(f"event {i} must be a JSON object")
        events.append(ev)
    return events


def check_lineage_only(events: list[dict[str, Any]], limits: PutLimits) -> None:
    """Every event of a read token's put is training lineage (each one checked), and a
    ``train_step`` names at most ``limits.max_rows`` samples; FlightUnauthorizedError
    (another type) or BadRequest (too many samples) naming the event."""
    for i, ev in enumerate(events):
        kind = ev.get("type")
        if kind not in LINEAGE_TYPES:
            raise fl.FlightUnauthorizedError(f"a read token cannot write {str(kind)[:40]!r} events (event {i}; it may "
                                             "record training lineage only: train_step, sample_annotation)")
        samples = ev.get("samples")
        if kind == "train_step" and isinstance(samples, list) and len(samples) > limits.max_rows:
            raise proto.BadRequest(f"event {i}: a train_step of {len(samples)} samples is over this server's bound "
                                   f"of {limits.max_rows} (--max-lineage-put-rows){_RULE}")


def check_runs_and_attempts(store: Any, events: list[dict[str, Any]], owner: str) -> None:
    """A read token's lineage put (already ``check_lineage_only``): its runs claimed for
    ``owner`` (FlightUnauthorizedError naming a run it may not record), then its
    attempts taken in order (BadRequest naming the event)."""
    from trajstore.log._run_owners import claim_runs

    runs = {ev["run"] for ev in events if isinstance(ev.get("run"), str)}
    refused = claim_runs(store.log.db, runs, owner) if runs else {}
    if refused:
        run, why = sorted(refused.items())[0]
        raise fl.FlightUnauthorizedError(f"run {run!r} {why}: a read token records only the runs it began")
    steps = {(ev.get("run"), ev.get("step"), ev.get("attempt", 0)) for ev in events if ev.get("type") == "train_step"}
    for i, ev in enumerate(events):
        attempt = ev.get("attempt", 0)
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt <= 0:
            continue  # attempt 0, or a value the store's checks refuse
        run, step = ev.get("run"), ev.get("step")
        if ev.get("type") == "train_step":
            rank = ev.get("rank")
            if not (isinstance(run, str) and isinstance(step, int) and isinstance(rank, int)):
                continue
            standing = store.log.standing_attempt(run, step, rank)
            if standing is None or attempt > standing + 1:
                raise proto.BadRequest(
                    f"event {i}: attempt {attempt} of step {step} of run {run!r}, rank {rank} skips attempts (the "
                    f"standing one is {standing}): a read token takes the next attempt only [attempt]")
        elif (run, step, attempt) not in steps:
            raise proto.BadRequest(f"event {i}: an annotation at attempt {attempt} of step {step} of run {run!r} "
                                   "comes with that attempt's train_step in the same put [attempt]")
