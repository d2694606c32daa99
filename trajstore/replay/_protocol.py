"""What the replay server and its client say to each other.

Tickets and action bodies are small JSON objects (``{"v": 1, "kind": ...}``),
checked field by field on the server before anything touches the store: a
malformed one is refused with one line naming the field. Errors travel as
Flight errors whose message starts with a fixed prefix, which the client
turns back into trajstore errors.

Kinds:
    rows     DoGet: one page of sample index rows (``where``, ``after``, ``page_rows``)
    samples  DoGet: the payload rows ``rows`` of one sample segment, in segment order
    watermark, count_events, hello, standing_attempt, pacing   DoAction
    projection  DoAction: a projection's identity token (``name``), the one the
             reader's ``rows`` and ``watermark`` requests then carry
    lease    DoAction: take, renew or release a reader's GC lease (``name``,
             ``holder``, ``ttl_s``, ``since``, ``release``), written by the
             server in the store's ``reader_leases`` for its trainer

``rows`` and ``watermark`` read the default samples, or a named projection's
with ``projection`` (absent: the default; requests without it are those of
clients from before projections, and mean the same). With ``projection_token``
too, the server refuses ("projection changed") a request when the projection of
that name is no longer the one created with that token (dropped, or dropped and
created again): a reader never reads on into another fold of the same name.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pyarrow as pa
import sqlalchemy as sa

from trajstore.payload._format import SegmentKind
from trajstore.schema import samples as samples_table

__all__ = ["BadRequest", "ROWS_SCHEMA", "ROW_COUNT", "complete", "counted", "decode", "encode", "message", "rows_table"]

VERSION = 1
MAX_TICKET_BYTES = 1 << 20
MAX_PAGE_ROWS = 65_536
MAX_SEGMENT_ROWS = 65_536

ROWS, SAMPLES = "rows", "samples"
WATERMARK, COUNT_EVENTS, HELLO = "watermark", "count_events", "hello"
STANDING_ATTEMPT = "standing_attempt"
PACING = "pacing"
LEASE = "lease"
PROJECTION = "projection"
ACTIONS = (WATERMARK, COUNT_EVENTS, HELLO, STANDING_ATTEMPT, PACING, LEASE, PROJECTION)
MAX_LEASE_TTL_S = 600.0

# Error message prefixes (the client maps them back; see client._raise).
INVALID = "invalid request"
CONFLICT = "conflict"
CORRUPT = "corrupt store"
UNAVAILABLE = "store unavailable"
RATE_LIMITED = "rate limited"
PROJECTION_CHANGED = "projection changed"
INTERNAL = "internal error"

# what a sample segment's name may hold between its kind's prefix and suffix
_SEGMENT_STEM = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_SAMPLE_KINDS = (SegmentKind.SAMPLES, SegmentKind.SAMPLES_PARQUET)
_WHERE_KEYS = {"status", "min_model_version", "max_model_version", "group_id", "trajectory_ids",
               "max_finished_position"}


class BadRequest(ValueError):
    """A ticket or action body that does not follow this protocol."""


def encode(kind: str, **fields: Any) -> bytes:
    return json.dumps({"v": VERSION, "kind": kind, **fields}, separators=(",", ":")).encode()


def decode(raw: bytes, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A request as a checked dict; BadRequest naming the first thing wrong."""
    if len(raw) > MAX_TICKET_BYTES:
        raise BadRequest(f"request of {len(raw)} bytes is over the {MAX_TICKET_BYTES} byte limit")
    try:
        req = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise BadRequest(f"request is not JSON ({e})") from None
    except RecursionError:
        raise BadRequest("request is nested too deeply (a ticket is a flat JSON object)") from None
    if not isinstance(req, dict):
        raise BadRequest(f"request must be a JSON object, got {type(req).__name__}")
    if req.get("v") != VERSION:
        raise BadRequest(f"request protocol version {req.get('v')!r} is not the supported {VERSION}")
    kind = req.get("kind")
    if kind not in allowed:
        raise BadRequest(f"request kind {kind!r} is not one of {list(allowed)}")
    check = _CHECKS.get(kind)
    if check is not None:
        check(req)
    return req


def _int(req: dict, name: str, *, lo: int = 0, hi: int | None = None, optional: bool = True) -> None:
    value = req.get(name)
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        raise BadRequest(f"{name} must be an integer in [{lo}, {hi if hi is not None else 'inf'}], got {value!r}")


def _strings(value: Any, name: str) -> None:
    if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise BadRequest(f"{name} must be a list of strings or null, got {value!r:.80}")


def _check_rows(req: dict) -> None:
    where = req.get("where")
    if not isinstance(where, dict):
        raise BadRequest(f"where must be an object, got {where!r:.80}")
    unknown = set(where) - _WHERE_KEYS
    if unknown:
        raise BadRequest(f"where has unknown keys {sorted(unknown)}")
    st = where.get("status")
    if isinstance(st, str):
        where["status"] = [st]
    _strings(where.get("status"), "where.status")
    _strings(where.get("trajectory_ids"), "where.trajectory_ids")
    if where.get("group_id") is not None and not isinstance(where["group_id"], str):
        raise BadRequest(f"where.group_id must be a string or null, got {where['group_id']!r:.80}")
    for name in ("min_model_version", "max_model_version", "max_finished_position"):
        _int(where, name, lo=-(1 << 62), hi=1 << 62)
    after = req.get("after")
    if after is not None and not (isinstance(after, list) and len(after) == 2
                                  and all(isinstance(v, int) and not isinstance(v, bool) and -(1 << 62) <= v < 1 << 62
                                          for v in after)):
        raise BadRequest(f"after must be null or [finished_position, sample_index], got {after!r:.80}")
    _int(req, "page_rows", lo=1, hi=MAX_PAGE_ROWS, optional=False)
    _projection(req)


def _projection(req: dict) -> None:
    name = req.get("projection")
    if name is not None and not (isinstance(name, str) and 0 < len(name) <= 200):
        raise BadRequest(f"projection must be a name (1 to 200 characters) or null, got {name!r:.80}")
    token = req.get("projection_token")
    if token is not None and not (name is not None and isinstance(token, str) and 0 < len(token) <= 200):
        raise BadRequest(f"projection_token must be a projection's token (1 to 200 characters) with its projection, "
                         f"got {token!r:.80}")


def _check_projection(req: dict) -> None:
    if req.get("projection") is None:
        raise BadRequest("projection must name a projection")
    _projection(req)


def _is_sample_segment(name: str) -> bool:
    kind = SegmentKind.of(name)
    return (kind in _SAMPLE_KINDS and name.startswith(kind.prefix)
            and _SEGMENT_STEM.fullmatch(name[len(kind.prefix):-len(kind.suffix)]) is not None)


def _check_samples(req: dict) -> None:
    segment = req.get("segment")
    if not isinstance(segment, str) or not _is_sample_segment(segment) or ".." in segment:
        raise BadRequest(f"segment must name a sample segment (samples-*.arrow or .parquet), got {segment!r:.80}")
    rows = req.get("rows")
    if not (isinstance(rows, list) and 0 < len(rows) <= MAX_SEGMENT_ROWS
            and all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 1 << 31 for r in rows)):
        raise BadRequest(f"rows must be a list of 1 to {MAX_SEGMENT_ROWS} segment row numbers, got {rows!r:.80}")
    _int(req, "current_model_version", lo=-(1 << 62), hi=1 << 62)


def _check_watermark(req: dict) -> None:
    _int(req, "num_shards", lo=1, hi=1 << 16)
    _projection(req)


def _check_count_events(req: dict) -> None:
    _int(req, "after_position", lo=0, hi=1 << 62, optional=False)
    _strings(req.get("types"), "types")


def _check_standing_attempt(req: dict) -> None:
    if not isinstance(req.get("run"), str) or not 0 < len(req["run"]) <= 255:
        raise BadRequest(f"run must be a non-empty string, got {req.get('run')!r:.80}")
    _int(req, "step", lo=0, hi=(1 << 31) - 1, optional=False)
    _int(req, "rank", lo=0, hi=(1 << 31) - 1, optional=False)


_LEASE_NAME = re.compile(r"samples:[0-9a-f]{32}")  # a sample reader's lease (trajstore.log._leases.SAMPLES_ONLY)


def _number(req: dict, name: str, *, lo: float, hi: float, optional: bool) -> None:
    value = req.get(name)
    if value is None and optional:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r:.80}")


def _check_lease(req: dict) -> None:
    if not isinstance(req.get("name"), str) or not _LEASE_NAME.fullmatch(req["name"]):
        raise BadRequest(f"name must be a sample reader's lease name (samples: and 32 hex digits), got {req.get('name')!r:.80}")
    if not isinstance(req.get("holder", ""), str) or len(req.get("holder", "")) > 200:
        raise BadRequest(f"holder must be a string of at most 200 characters, got {req.get('holder')!r:.80}")
    if not isinstance(req.get("release", False), bool):
        raise BadRequest(f"release must be true or false, got {req.get('release')!r:.80}")
    _number(req, "ttl_s", lo=1.0, hi=MAX_LEASE_TTL_S, optional=bool(req.get("release")))
    _number(req, "since", lo=0.0, hi=1e12, optional=True)


_CHECKS = {ROWS: _check_rows, SAMPLES: _check_samples, WATERMARK: _check_watermark, COUNT_EVENTS: _check_count_events,
           STANDING_ATTEMPT: _check_standing_attempt, LEASE: _check_lease, PROJECTION: _check_projection}


def _arrow_type(column: sa.Column) -> pa.DataType:
    t = column.type
    if isinstance(t, sa.Boolean):
        return pa.bool_()
    if isinstance(t, sa.Integer):  # BigInteger included
        return pa.int64()
    if isinstance(t, sa.Float):
        return pa.float64()
    return pa.string()


ROWS_SCHEMA = pa.schema([pa.field(c.name, _arrow_type(c)) for c in samples_table.columns])
"""Sample index rows on the wire: one column per column of the ``samples`` table."""


ROW_COUNT = b"trajstore.replay.rows"
"""Schema metadata of every DoGet answer: how many rows it holds. It travels in
the first message, so a stream cut short is told apart from a short answer."""


def counted(table: pa.Table) -> pa.Table:
    """``table`` with its row count in the schema metadata (``ROW_COUNT``)."""
    return table.replace_schema_metadata({**(table.schema.metadata or {}), ROW_COUNT: str(table.num_rows).encode()})


def complete(table: pa.Table) -> bool:
    """Whether a received answer holds the rows its schema announced."""
    meta = table.schema.metadata or {}
    return ROW_COUNT in meta and int(meta[ROW_COUNT]) == table.num_rows


def rows_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.table({f.name: pa.array([r[f.name] for r in rows], f.type) for f in ROWS_SCHEMA}, schema=ROWS_SCHEMA)


def message(error: BaseException) -> str:
    """A Flight error's own message, without the transport's details."""
    text = str(error)
    for cut in (". Detail:", ". gRPC client debug context"):
        text = text.split(cut, 1)[0]
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__
