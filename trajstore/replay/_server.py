"""``trajstore replay``: the Arrow Flight server trainers read samples through.

The server holds the store's URL and credentials; trainers hold a bearer
token. It answers four questions, each a short, self-contained request (it
keeps no per-trainer state, so any server in front of the store answers any
request, and a restarted one answers the same):

* DoGet ``rows``: one page of sample index rows after a key (the reader plans
  its steps from them, exactly as ``SampleReader`` does on the store);
* DoGet ``samples``: given rows of one sample segment, as Arrow record
  batches sliced out of the memory-mapped segment (nothing is decoded here:
  the trainer makes its ``Sample`` views of the received buffers);
* DoAction ``watermark`` / ``count_events`` / ``hello``;
* DoAction ``lease``: a trainer's GC lease (``trajstore.reader._lease``),
  written here in the store's ``reader_leases`` (trainers hold no database
  login): while the trainer renews it, the payload GC keeps the sample
  segments of the rows pages it read and has not loaded yet; it lapses by
  itself when the trainer dies.

DoPut appends wire-format events (an Arrow table with one ``event`` column
of JSON objects). The write token may append any event; a read token (the
trainers') only training lineage (``train_step``, ``sample_annotation``: what
``ReplayReader.record_step`` sends), bounded in size before its body is read,
of the runs it began only and at attempts in order (``trajstore.replay._puts``),
and DoAction ``standing_attempt`` tells it the attempt a step stands at. Every
call passes through ``_AuthMiddlewareFactory.start_call`` first: a call without a known token is
refused there, and a call the token's role does not allow (deny by default:
only the methods listed in ``_ALLOWED`` pass) too.

Rate limiting (optional, Reverb's idea applied to the sample stream): with
``samples_per_insert`` a ``samples`` request waits while this server has
served more than ``samples_per_insert x samples in the store +
spi_tolerance`` samples; with ``max_staleness`` it waits while the newest
materialized sample is more than that many policy versions behind the
trainer's ``current_model_version``. A wait holds the request at most
``hold_s``, then answers "rate limited" and the client asks again. Each wait
reason is logged once when it starts and counted in the metrics.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.flight as fl
import pyarrow.ipc as ipc

from trajstore._util.auth import bearer_token, same_token
from trajstore._util.config import add_flags
from trajstore.errors import (ConflictError, CorruptStoreError, ProjectionChangedError, StoreUnavailable,
                              TrajstoreError, ValidationError)
from trajstore.log._run_owners import owner_of
from trajstore.payload import SegmentRows
from trajstore.payload._errors import payload_errors
from trajstore.payload._format import READ_OPTIONS, ROWS_PER_BATCH, SegmentKind
from trajstore.replay import _protocol as proto
from trajstore.replay import _puts as puts
from trajstore.replay._config import DEFAULT_PORT, ReplayConfig

__all__ = ["ReplayServer", "add_cli_arguments", "serve_from_args", "DEFAULT_PORT"]

_log = logging.getLogger("trajstore.replay.server")

READ, WRITE = "read", "write"
_M = fl.FlightMethod
# What each role may call; anything else is refused (deny by default).
_ALLOWED = {
    READ: frozenset({_M.DO_GET, _M.DO_ACTION, _M.LIST_ACTIONS, _M.DO_PUT}),  # DoPut: lineage only (do_put)
    WRITE: frozenset({_M.DO_GET, _M.DO_ACTION, _M.LIST_ACTIONS, _M.DO_PUT}),
}
_METHOD_NAMES = {m: m.name.lower() for m in _M}
_ROWS_PER_MESSAGE = 64  # payload rows per record batch sent: bounds one gRPC message


def _list_values(column: pa.ListArray) -> int:
    """How many values the (sliced) list column holds: its last offset less its first."""
    offsets = column.offsets
    return offsets[len(offsets) - 1].as_py() - offsets[0].as_py() if len(column) else 0


class _OpenSegments:
    """The sample segments this server has open, for the next requests: each mapped
    once and each of its record batches read once (views of the map), the most
    recently used ``size`` kept. Mapping a segment per request cost a page fault
    per page sent and an ``munmap`` per request: most of the server's CPU.

    Segments are immutable, so a kept one answers as the file would; one that
    ``trajstore gc`` deleted keeps its disk space until it is dropped from
    here. Segments that are not local Arrow files are read by the payload
    store per request (``PayloadStore.read_rows``)."""

    def __init__(self, payload: Any, size: int = 16) -> None:
        self.payload, self.size = payload, size
        self._lock = threading.Lock()
        self._open: OrderedDict[str, tuple[Any, pa.Schema, int, dict[int, pa.RecordBatch]]] = OrderedDict()

    def read_rows(self, name: str, wanted: list[int]) -> SegmentRows:
        """Rows ``wanted`` (sorted) of segment ``name``, as ``PayloadStore.read_rows`` gives them."""
        if not (self.payload.local and SegmentKind.of(name).is_arrow):
            return self.payload.read_rows(name, wanted)
        reader, schema, per, batches = self._segment(name)
        numbers = sorted({r // per for r in wanted})
        path = self.payload.path(name)
        if numbers and numbers[-1] >= reader.num_record_batches:
            raise CorruptStoreError(f"payload segment {path!r} has no row {wanted[-1]}")
        with payload_errors("cannot read payload segment", path, corrupt="payload segment",
                            in_memory=True), self._lock:
            for b in numbers:
                if b not in batches:
                    batches[b] = reader.get_batch(b)
            got = [batches[b] for b in numbers]
        first = {b: i * per for i, b in enumerate(numbers)}
        return SegmentRows(pa.Table.from_batches(got, schema=schema), {r: first[r // per] + r % per for r in wanted})

    def _segment(self, name: str) -> tuple[Any, pa.Schema, int, dict[int, pa.RecordBatch]]:
        with self._lock:
            segment = self._open.get(name)
            if segment is not None:
                self._open.move_to_end(name)
                return segment
        data = self.payload._map(name)  # noqa: SLF001 - the payload store's own mapping (huge pages, its errors)
        with payload_errors("cannot read payload segment", self.payload.path(name), corrupt="payload segment",
                            in_memory=True):
            reader = ipc.open_file(data, options=READ_OPTIONS)
            per = int(reader.schema.metadata[ROWS_PER_BATCH.encode()])
        segment = (reader, reader.schema, per, {})
        with self._lock:
            segment = self._open.setdefault(name, segment)
            self._open.move_to_end(name)
            while len(self._open) > self.size:
                self._open.popitem(last=False)
        return segment


class _AuthMiddleware(fl.ServerMiddleware):
    def __init__(self, role: str, declared: puts.Declared | None = None, owner: str | None = None) -> None:
        self.role = role
        self.declared = declared  # a read token's put: the size its headers declared
        self.owner = owner  # a read token's put: the digest its runs are owned under


class _AuthMiddlewareFactory(fl.ServerMiddlewareFactory):
    """The one place every call is checked: its bearer token and what the token's role allows."""

    def __init__(self, tokens: dict[str, str] | None, metrics: "_Metrics", limits: puts.PutLimits) -> None:
        self.tokens = tokens  # token -> role; None: no auth (every caller may read and write)
        self.metrics = metrics
        self.limits = limits

    def start_call(self, info: fl.CallInfo, headers: dict[str, list[Any]]) -> _AuthMiddleware:
        method = _METHOD_NAMES.get(info.method, "unknown")
        if self.tokens is None:
            role = WRITE
        else:
            given = _bearer(headers)
            role = matched = None
            if given is not None:
                for token, r in self.tokens.items():  # compare against every token: no early exit to time
                    if same_token(given, token):
                        role, matched = r, token
            if role is None:
                self.metrics.requests.labels(method, "unauthenticated").inc()
                raise fl.FlightUnauthenticatedError("missing or wrong bearer token")
        if info.method not in _ALLOWED[role]:
            self.metrics.requests.labels(method, "denied").inc()
            what = "write" if info.method in (_M.DO_PUT, _M.DO_EXCHANGE) else f"call {method}"
            raise fl.FlightUnauthorizedError(f"a {role} token cannot {what}")
        if info.method == _M.DO_PUT and role == READ:  # bounded here, before any of the body is read
            try:
                return _AuthMiddleware(role, puts.declared_size(headers, self.limits), owner_of(str(matched)))
            except fl.FlightError:
                self.metrics.requests.labels(method, "invalid").inc()
                raise
        return _AuthMiddleware(role)


def _bearer(headers: dict[str, list[Any]]) -> str | None:
    """The first bearer token among the call's ``authorization`` headers (the HTTP servers' parsing)."""
    return next((t for t in map(bearer_token, headers.get("authorization", [])) if t is not None), None)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ImportError("the replay server needs the 'replay' extra (prometheus_client is not installed): "
                          "pip install -e '.[replay]' in the trajstore checkout (or pip install 'trajstore[replay]')"
                          ) from None
    return prometheus_client


class _Metrics:
    def __init__(self, registry: "CollectorRegistry") -> None:
        Counter, Gauge = _prometheus().Counter, _prometheus().Gauge
        p = "trajstore_replay_"
        self.registry = registry
        self.requests = Counter(p + "requests", "Replay calls by method and outcome", ["method", "outcome"],
                                registry=registry)
        self.rows = Counter(p + "rows_served", "Sample index rows served", registry=registry)
        self.samples = Counter(p + "samples_served", "Samples whose payload was served", registry=registry)
        self.tokens = Counter(p + "tokens_served", "Prompt+response tokens of the samples served", registry=registry)
        self.bytes = Counter(p + "payload_bytes_served", "Arrow bytes of the payload batches served",
                             registry=registry)
        self.active = Gauge(p + "active_requests", "Requests being answered now", registry=registry)
        self.waiting = Gauge(p + "waiting_requests", "Sample requests held by the rate limiter", ["reason"],
                             registry=registry)
        self.wait_seconds = Counter(p + "wait_seconds", "Time sample requests were held, by reason", ["reason"],
                                    registry=registry)


class _RateLimiter:
    """Holds sample requests while serving would outrun the rollouts (see the module doc)."""

    def __init__(self, store: Any, metrics: _Metrics, *, samples_per_insert: float | None, spi_tolerance: int,
                 max_staleness: int | None, hold_s: float, poll_s: float = 0.2, cache_s: float = 0.5) -> None:
        self.store, self.metrics = store, metrics
        self.spi, self.tolerance, self.max_staleness = samples_per_insert, spi_tolerance, max_staleness
        self.hold_s, self.poll_s, self.cache_s = hold_s, poll_s, cache_s
        self.served = 0
        self._lock = threading.Lock()
        self._cached: tuple[float, int, int | None] | None = None  # (at, samples in store, newest version)
        self._reasons_logged: set[str] = set()

    @property
    def active(self) -> bool:
        return self.spi is not None or self.max_staleness is not None

    def _facts(self) -> tuple[int, int | None]:
        now = time.monotonic()
        cached = self._cached
        if cached is None or now - cached[0] >= self.cache_s:
            from sqlalchemy import func, select

            from trajstore.schema import samples

            count = self.store.materialized.count_samples()
            newest = None
            if self.max_staleness is not None:
                with self.store.materialized.db.reading("reading the newest sample version") as conn:
                    newest = conn.execute(select(func.max(samples.c.max_model_version))).scalar_one()
            cached = self._cached = (now, count, newest)
        return cached[1], cached[2]

    def _reason(self, n: int, current: int | None) -> str | None:
        inserted, newest = self._facts()
        if self.spi is not None and self.served + n > self.spi * inserted + self.tolerance:
            return (f"samples_per_insert: {self.served} served + {n} asked > {self.spi:g} x {inserted} in the store "
                    f"+ tolerance {self.tolerance}")
        if self.max_staleness is not None and current is not None and (newest is None
                                                                        or newest < current - self.max_staleness):
            return (f"max_staleness: newest sample is from policy {newest}, the trainer is at {current} "
                    f"(max_staleness {self.max_staleness})")
        return None

    def acquire(self, n: int, current: int | None) -> None:
        """Count ``n`` samples as served once allowed; FlightUnavailableError after ``hold_s`` held."""
        if not self.active:
            return
        start = time.monotonic()
        held_reason: str | None = None
        try:
            while True:
                with self._lock:
                    reason = self._reason(n, current)
                    if reason is None:
                        self.served += n
                        if held_reason is not None:
                            self._reasons_logged.discard(held_reason)
                        return
                key = reason.split(":", 1)[0]
                if key != held_reason:
                    if held_reason is not None:
                        self.metrics.waiting.labels(held_reason).dec()
                    self.metrics.waiting.labels(key).inc()
                    held_reason = key
                    with self._lock:
                        first = key not in self._reasons_logged
                        self._reasons_logged.add(key)
                    if first:
                        _log.warning("trajstore replay: holding sample requests (%s)", reason)
                if time.monotonic() - start >= self.hold_s:
                    raise fl.FlightUnavailableError(f"{proto.RATE_LIMITED}: {reason}")
                time.sleep(self.poll_s)
        finally:
            if held_reason is not None:
                self.metrics.waiting.labels(held_reason).dec()
                self.metrics.wait_seconds.labels(held_reason).inc(time.monotonic() - start)


class ReplayServer(fl.FlightServerBase):
    """Serves ``store``'s samples to trainers over Arrow Flight (see the module doc).

    ``tokens`` maps each accepted bearer token to its role, ``"read"`` or
    ``"write"``; None runs open (anyone may read and write). The server owns
    ``store`` only when ``close_store``."""

    def __init__(self, store: Any, location: str = "grpc://127.0.0.1:0", *, tokens: dict[str, str] | None,
                 samples_per_insert: float | None = None, spi_tolerance: int = 0, max_staleness: int | None = None,
                 hold_s: float = 5.0, registry: CollectorRegistry | None = None, close_store: bool = False,
                 tls_certificates: list[tuple[bytes, bytes]] | None = None,
                 put_limits: puts.PutLimits | None = None) -> None:
        if tokens is not None:
            if not tokens:
                raise ValueError("no token given: a server needs at least one (or tokens=None to run open)")
            bad = {r for r in tokens.values() if r not in (READ, WRITE)}
            if bad:
                raise ValueError(f"token roles must be 'read' or 'write', got {sorted(bad)}")
        self.store, self.close_store = store, close_store
        self.segments = _OpenSegments(store.payload)
        self.metrics = _Metrics(registry if registry is not None else _prometheus().CollectorRegistry())
        self.limiter = _RateLimiter(store, self.metrics, samples_per_insert=samples_per_insert,
                                    spi_tolerance=spi_tolerance, max_staleness=max_staleness, hold_s=hold_s)
        self.put_limits = put_limits or puts.PutLimits()
        try:
            super().__init__(location, middleware={"auth": _AuthMiddlewareFactory(tokens, self.metrics,
                                                                                  self.put_limits)},
                             tls_certificates=tls_certificates or [])
        except pa.ArrowException as e:
            raise ValueError(f"cannot listen on {location} (is the port in use?): {proto.message(e)}") from None

    # -- one wrapper for every handler: metrics and errors -------------------
    def _answer(self, method: str, fn: Any) -> Any:
        self.metrics.active.inc()
        outcome = "ok"
        try:
            return fn()
        except fl.FlightError as e:
            outcome = "unavailable" if isinstance(e, fl.FlightUnavailableError) else "error"
            raise
        except proto.BadRequest as e:
            outcome = "invalid"
            raise fl.FlightServerError(f"{proto.INVALID}: {e}") from None
        except ConflictError as e:
            outcome = "invalid"
            raise fl.FlightServerError(f"{proto.CONFLICT}: {e}") from None
        except ValidationError as e:
            outcome = "invalid"
            raise fl.FlightServerError(f"{proto.INVALID}: {e}") from None
        except ProjectionChangedError as e:
            outcome = "invalid"
            raise fl.FlightServerError(f"{proto.PROJECTION_CHANGED}: {e}") from None
        except CorruptStoreError as e:
            outcome = "error"
            _log.error("trajstore replay: %s: %s", method, e)  # the full message (paths) stays in the server's log
            raise fl.FlightServerError(f"{proto.CORRUPT}: {self._public(e)}") from None
        except StoreUnavailable as e:
            outcome = "unavailable"
            raise fl.FlightUnavailableError(f"{proto.UNAVAILABLE}: {self._public(e)}") from None
        except TrajstoreError as e:
            outcome = "error"
            raise fl.FlightServerError(f"{proto.INTERNAL}: {type(e).__name__}: {self._public(e)}") from None
        except Exception as e:  # a bug: logged here with its traceback, one line to the client
            outcome = "error"
            _log.exception("trajstore replay: %s failed", method)
            raise fl.FlightServerError(f"{proto.INTERNAL}: {type(e).__name__}") from None
        finally:
            self.metrics.active.dec()
            self.metrics.requests.labels(method, outcome).inc()

    def _public(self, e: BaseException) -> str:
        """``e``'s message as a client may see it: the payload location's path left out
        (a segment is named by its name, never by where the server keeps it)."""
        text = str(e)
        root = str(getattr(self.store.payload, "location", "") or "")
        if root:
            text = text.replace(root.rstrip("/") + "/", "").replace(root, "<payload>")
        return text

    def _segment_rows(self, name: str) -> int | None:
        """How many rows the index says segment ``name`` has (None: the index names no such segment)."""
        from sqlalchemy import select

        from trajstore.schema import segments

        with self.store.log.db.reading("reading a segment's row count") as conn:
            return conn.execute(select(segments.c.num_rows).where(segments.c.name == name)).scalar_one_or_none()

    def _refuse_rows_past_the_end(self, segment: str, wanted: list[int]) -> None:
        """A row past the segment's end is the request's fault, not the store's: BadRequest."""
        n = self._segment_rows(segment)
        if n is not None and wanted[-1] >= n:
            raise proto.BadRequest(f"row {wanted[-1]} is past the end of segment {segment} ({n} rows)")

    # -- reads ----------------------------------------------------------------
    def do_get(self, context: fl.ServerCallContext, ticket: fl.Ticket) -> fl.FlightDataStream:
        return self._answer("do_get", lambda: self._get(proto.decode(ticket.ticket, (proto.ROWS, proto.SAMPLES))))

    def _get(self, req: dict[str, Any]) -> fl.FlightDataStream:
        if req["kind"] == proto.ROWS:
            after = None if req.get("after") is None else tuple(req["after"])
            pages = self._index(req).iter_sample_rows(where=req["where"], after=after, page_rows=req["page_rows"])
            rows = next(iter(pages), [])
            self.metrics.rows.inc(len(rows))
            return fl.RecordBatchStream(proto.counted(proto.rows_table(rows)))
        wanted = sorted(set(req["rows"]))
        self.limiter.acquire(len(wanted), req.get("current_model_version"))
        try:
            part = self.segments.read_rows(req["segment"], wanted)
        except CorruptStoreError:
            self._refuse_rows_past_the_end(req["segment"], wanted)
            raise
        table = part.table
        # Only the wanted rows, in segment order: zero-copy slices of the mapped batches.
        positions = [part.index[r] for r in wanted]
        if positions[-1] >= table.num_rows:  # a row past the end of the segment's last batch
            self._refuse_rows_past_the_end(req["segment"], wanted)
            raise CorruptStoreError(f"payload segment {req['segment']} is shorter than its index row says")
        slices, i = [], 0
        while i < len(positions):
            j = i + 1
            while j < len(positions) and j - i < _ROWS_PER_MESSAGE and positions[j] == positions[j - 1] + 1:
                j += 1
            slices.extend(table.slice(positions[i], j - i).to_batches())
            i = j
        out = proto.counted(pa.Table.from_batches(slices, schema=table.schema))
        self.metrics.samples.inc(len(wanted))
        # What is sent: the IPC messages' bytes (a size computed without writing them;
        # RecordBatch.nbytes walks every sliced list's ranges, 0.1-0.2 ms a request).
        self.metrics.bytes.inc(sum(ipc.get_record_batch_size(b) for b in slices))
        if "prompt_ids" in out.column_names:
            self.metrics.tokens.inc(sum(_list_values(b.column(name)) for b in slices
                                        for name in ("prompt_ids", "response_ids")))
        return fl.RecordBatchStream(out)

    def _index(self, req: dict[str, Any]) -> Any:
        """The sample index a request reads: the default samples, or its ``projection``'s;
        with ``projection_token``, that projection only as created with that token (its
        reads raise ``ProjectionChangedError`` once the name holds another one)."""
        name, token = req.get("projection"), req.get("projection_token")
        if name is None:
            return self.store.materialized
        if token is None:  # a client from before projection tokens
            return self.store.materialized.projection(name)
        return self.store.materialized.projection_as(name, token)

    def list_actions(self, context: fl.ServerCallContext) -> list[tuple[str, str]]:
        return [(proto.WATERMARK, "position up to which every materializer shard committed"),
                (proto.COUNT_EVENTS, "events after a position (of some types)"),
                (proto.HELLO, "the server's protocol version"),
                (proto.STANDING_ATTEMPT, "the highest attempt recorded for a training step of a rank"),
                (proto.PACING, "the rate limits sample requests are held by"),
                (proto.LEASE, "take, renew or release a reader's GC lease"),
                (proto.PROJECTION, "a projection's identity token")]

    def do_action(self, context: fl.ServerCallContext, action: fl.Action) -> Iterator[bytes]:
        def run() -> list[bytes]:
            if action.type not in proto.ACTIONS:
                raise proto.BadRequest(f"unknown action {action.type!r:.80} (one of {list(proto.ACTIONS)})")
            body = action.body.to_pybytes() if action.body is not None else b""
            req = proto.decode(body, (action.type,))
            if action.type == proto.WATERMARK:
                value: Any = self._index(req).watermark(req.get("num_shards"))
            elif action.type == proto.COUNT_EVENTS:
                value = self.store.log.count_events(after_position=req["after_position"], types=req.get("types"))
            elif action.type == proto.STANDING_ATTEMPT:
                value = self.store.log.standing_attempt(req["run"], req["step"], req["rank"])
            elif action.type == proto.LEASE:
                value = self._lease(req)
            elif action.type == proto.PROJECTION:
                name = req["projection"]
                value = {"name": name, "token": self.store.materialized.projection(name).token}
            elif action.type == proto.PACING:
                value = {"samples_per_insert": self.limiter.spi, "max_staleness": self.limiter.max_staleness}
            else:
                value = {"protocol": proto.VERSION}
            return [json.dumps(value).encode()]
        return iter(self._answer("do_action", run))

    def _lease(self, req: dict[str, Any]) -> dict[str, Any]:
        """A trainer's GC lease, held in the store's database for it: ``since`` only moves
        forward and the ttl is bounded, so a client holds back no more than it read."""
        from trajstore.log._leases import hold_lease, release_lease

        if req.get("release"):
            release_lease(self.store.log.db, req["name"])
            return {}
        now, anew = hold_lease(self.store.log.db, req["name"], f"replay client {req.get('holder', '')}",
                               float(req["ttl_s"]), req.get("since"))
        return {"now": now, "taken": anew}

    # -- writes (write token only; the middleware refuses the others) -----------
    def do_put(self, context: fl.ServerCallContext, descriptor: fl.FlightDescriptor,
               reader: fl.MetadataRecordBatchReader, writer: fl.FlightMetadataWriter) -> None:
        def run() -> None:
            auth = context.get_middleware("auth")
            read = auth is not None and auth.role == READ
            events = puts.parse_events(puts.read_put(reader, auth.declared if read else None))
            if read:
                try:
                    puts.check_lineage_only(events, self.put_limits)
                    if auth.owner is not None:
                        puts.check_runs_and_attempts(self.store, events, auth.owner)
                except fl.FlightUnauthorizedError:
                    self.metrics.requests.labels("do_put", "denied").inc()
                    raise
            result = self.store.append(events)
            writer.write(pa.py_buffer(json.dumps({"num_appended": result.num_appended,
                                                  "num_duplicates": result.num_duplicates}).encode()))
        self._answer("do_put", run)

    def shutdown(self) -> None:
        super().shutdown()
        if self.close_store:
            self.store.close()


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``trajstore replay``: one per ``ReplayConfig`` field (``--store``/``--payload`` are the
    CLI's global flags)."""
    add_flags(parser, ReplayConfig)


def serve_from_args(args: argparse.Namespace) -> int:
    """Run the replay server the flags describe (``ReplayConfig``) until SIGINT/SIGTERM."""
    from trajstore.store import connect

    config = ReplayConfig.from_args(args)  # the settings, whole: each flag is one field
    if not logging.getLogger().handlers:  # one line per event on stderr, e.g. each rate-limit wait
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    read_tokens = [t for t in config.token or () if t] or [t for t in [os.environ.get("TRAJSTORE_REPLAY_TOKEN")] if t]
    if config.insecure_no_auth:
        tokens = None
    else:
        if not read_tokens and config.write_token is None:
            raise ValueError("no token: pass --token or set $TRAJSTORE_REPLAY_TOKEN (or --insecure-no-auth to run open)")
        if config.write_token is not None and config.write_token in read_tokens:
            raise ValueError("--token and --write-token must differ (a read-only token must not be able to write)")
        tokens = {**{t: READ for t in read_tokens}, **({config.write_token: WRITE} if config.write_token else {})}
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    store = connect(config.store_url, payload=config.payload, migrate=False, create=False)
    scheme = "grpc+tls" if config.tls_cert else "grpc+tcp"
    kwargs: dict[str, Any] = {}
    if config.tls_cert:
        with open(config.tls_cert, "rb") as c, open(config.tls_key, "rb") as k:
            kwargs["tls_certificates"] = [(c.read(), k.read())]
    prometheus = _prometheus()
    registry = prometheus.CollectorRegistry()
    prometheus.ProcessCollector(registry=registry)  # process_cpu_seconds_total: the server's CPU per token served
    server = ReplayServer(store, f"{scheme}://{config.host}:{config.port}", tokens=tokens,
                     samples_per_insert=config.samples_per_insert, spi_tolerance=config.spi_tolerance,
                     max_staleness=config.max_staleness, hold_s=config.hold_s, registry=registry, close_store=True,
                     put_limits=puts.PutLimits(config.max_lineage_put_bytes, config.max_lineage_put_rows), **kwargs)
    if config.metrics_port is not None:
        prometheus.start_http_server(config.metrics_port, addr=config.host, registry=registry)
    from trajstore.log._backend import safe_url

    print(f"trajstore replay: listening on {scheme}://{config.host}:{server.port} (store {safe_url(store.url)}"
          f"{'' if config.metrics_port is None else f'; metrics on http://{config.host}:{config.metrics_port}/metrics'}"
          f"; Ctrl-C stops)", file=sys.stderr, flush=True)

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.serve()
    return 0
