"""The trainer's side of the replay service: ``ReplayReader`` and the store it reads through.

``ReplayReader`` *is* a ``SampleReader`` (a subclass that changes nothing
of its planning, filtering, prefetching or resume state) whose store is a
``ReplayStore``: the sample index rows, the watermark and the sample payload
come from replay servers instead of the database and the payload files. So
for the same config and state it yields the same batches, byte for byte, and
its ``state_dict()`` is a ``SampleReader`` state: a state saved from either
resumes in the other, and on any server.

The plan (which samples form which batch) is computed here, from index rows
(small); the servers only slice the wanted payload rows out of the segments,
and the received Arrow buffers become the ``Sample`` arrays without a copy:
nothing is decoded twice. The payload store asks the reader to prefetch
``streams`` steps ahead (``read_ahead``): that many requests are in flight.

Every request is self-contained and idempotent, so a failure is retried: the
client moves to the next server of ``locations`` (a server killed mid-stream,
restarted, or replaced) until ``retry_timeout_s`` passes without an answer;
a page or a batch is used only when it arrived whole. A server that answers
that its store is unavailable (its database restarting) raises
``StoreUnavailable`` at once: the reader waits that out as it does locally,
for its ``unavailable_timeout_s``. A server's rate limiter
("rate limited") is waited out as long as it lasts, counted and logged.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl

from trajstore._util.backoff import Backoff
from trajstore.reader._seam import ReaderEventLog, ReaderPayload, ReaderSampleIndex
from trajstore.events._wire import encode_b64
from trajstore.errors import (ConflictError, CorruptStoreError, ProjectionChangedError, StoreUnavailable,
                              TrajstoreError, ValidationError)
from trajstore.payload import SegmentRows
from trajstore.reader import ReaderConfig, SampleReader, _settings
from trajstore.replay import _protocol as proto
from trajstore.replay._puts import PUT_BYTES, PUT_ROWS, value_bytes
from trajstore.store import AppendResult

__all__ = ["ReplayReader", "ReplayStore", "parse_locations"]

_log = logging.getLogger("trajstore.replay.client")

TOKEN_ENV = "TRAJSTORE_REPLAY_TOKEN"
_DENIED = re.compile(r"Detail: (Unauthenticated|Unauthorized)\b")
# gRPC's words for a TLS handshake that OpenSSL refused (a certificate not trusted,
# TLS against a plaintext port) or a certificate for another host name: the
# setup is wrong, and asking again (or another server of the same deployment) cannot help.
_TLS_REFUSED = re.compile(r"Ssl handshake failed \([A-Z_]+\): SSL_ERROR_SSL: (?:error:[0-9A-F]+:SSL routines::)?"
                          r"(?P<ssl>[^;\n]+)|(?P<peer>Peer name \S+ is not in peer certificate)")


def parse_locations(locations: str | Sequence[str]) -> list[str]:
    """``"grpc://a:8815,grpc://b:8815"`` or a list of such URIs, checked."""
    items = [s.strip() for s in locations.split(",")] if isinstance(locations, str) else [str(s) for s in locations]
    items = [s for s in items if s]
    if not items:
        raise ValidationError("no replay server location given (e.g. grpc://host:8815)", rule="replay_location")
    for s in items:
        if not s.startswith(("grpc://", "grpc+tcp://", "grpc+tls://", "grpc+unix://")):
            raise ValidationError(f"replay server location {s!r} must start with grpc://, grpc+tcp://, grpc+tls:// "
                                  f"or grpc+unix://", rule="replay_location")
    return items


class _Waits:
    """Client-side waiting, made visible: Prometheus counters and one log line per wait episode."""

    _lock = threading.Lock()
    _metrics: tuple[Any, Any] | None = None

    @classmethod
    def metrics(cls) -> tuple[Any, Any]:
        with cls._lock:
            if cls._metrics is None:
                try:
                    from prometheus_client import Counter
                except ImportError:  # the trainer has no `replay` extra: waits are still logged
                    cls._metrics = (_Uncounted(), _Uncounted())
                    return cls._metrics
                cls._metrics = (
                    Counter("trajstore_replay_client_wait_seconds", "Time a replay reader waited, by reason",
                            ["reason"]),
                    Counter("trajstore_replay_client_reconnects", "Replay requests retried on another server"),
                )
            return cls._metrics


class _Uncounted:
    """Stands in for a Prometheus counter when prometheus_client is not installed."""

    def labels(self, *args: Any) -> "_Uncounted":
        return self

    def inc(self, amount: float = 1.0) -> None:
        pass


class _Client:
    """One Flight client and the calls using it. A client is closed only when
    no call uses it any more: closing a ``FlightClient`` while another thread
    is inside one of its calls frees what that call still reads (a crash, not
    an error)."""

    def __init__(self, client: fl.FlightClient) -> None:
        self.client = client
        self.users = 0
        self.retired = False

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - a dead connection may not close cleanly
            _log.debug("replay reader: closing a Flight client failed", exc_info=True)


class _Connection:
    """Flight clients to the replay servers, one at a time, failing over in order."""

    def __init__(self, locations: list[str], token: str | None, *, retry_timeout_s: float, call_timeout_s: float,
                 tls_root_certs: bytes | None, first: int = 0) -> None:
        self.locations, self.retry_timeout_s = locations, retry_timeout_s
        self.closing = threading.Event()  # set by close(): a call waiting out a hold or a failover gives up
        self.headers = [] if token is None else [(b"authorization", f"Bearer {token}".encode())]
        self.call_timeout_s = call_timeout_s
        self.options = fl.FlightCallOptions(headers=self.headers, timeout=call_timeout_s)
        self._tls_root_certs = tls_root_certs
        self._lock = threading.Lock()
        self._outage = False  # calls are failing: the first says so, the first answer after says it is over
        self._outage_since = 0.0
        self._index = first % len(locations)
        self._client: _Client | None = None
        self._warned: set[str] = set()  # wait episodes already logged: once, not once per parallel stream

    def _warn_once(self, episode: str, msg: str, *args: Any) -> None:
        with self._lock:
            if episode in self._warned:
                return
            self._warned.add(episode)
        _log.warning(msg, *args)

    def _waited(self) -> None:
        """A call that had waited got its answer: the episode is over, the next one is logged again."""
        with self._lock:
            self._warned.clear()

    def _acquire(self) -> tuple[int, _Client]:
        with self._lock:
            if self.closing.is_set():
                raise StoreUnavailable("replay reader closed")
            if self._client is None:
                kwargs = {} if self._tls_root_certs is None else {"tls_root_certs": self._tls_root_certs}
                self._client = _Client(fl.connect(self.locations[self._index], **kwargs))
            self._client.users += 1
            return self._index, self._client

    def _release(self, held: _Client) -> None:
        with self._lock:
            held.users -= 1
            last = held.retired and held.users == 0
        if last:
            held.close()

    def _retire(self) -> None:
        """Drop the current client (under the lock); it closes when its last call ends."""
        held, self._client = self._client, None
        if held is not None:
            held.retired = True
            if held.users == 0:
                held.close()

    def _fail_over(self, index: int) -> None:
        with self._lock:
            if index == self._index:  # another thread may have moved on already
                self._retire()
                self._index = (self._index + 1) % len(self.locations)

    def call(self, what: str, fn: Callable[[fl.FlightClient, fl.FlightCallOptions], Any]) -> Any:
        wait_metric, reconnects = _Waits.metrics()
        failing: Backoff | None = None  # the pauses between reconnects, from the first failure on
        limited_since: float | None = None
        try:
            while True:
                if self.closing.is_set():
                    raise StoreUnavailable(f"replay reader closed while {what} waited")
                index, held = self._acquire()
                try:
                    try:
                        result = fn(held.client, self.options)
                    finally:
                        self._release(held)
                    if limited_since is not None:
                        self._waited()  # the next rate-limited wait is logged again
                    if self._outage:
                        self._recovered(index)
                    return result
                except (fl.FlightUnauthenticatedError, fl.FlightUnauthorizedError) as e:
                    raise ValidationError(f"replay server {self.locations[index]} refused {what}: {proto.message(e)}",
                                          rule="unauthorized") from None
                except fl.FlightServerError as e:
                    raise _error(self.locations[index], what, proto.message(e)) from None
                except (fl.FlightError, OSError) as e:
                    text = proto.message(e)
                    if not isinstance(e, fl.FlightError) and _DENIED.search(str(e)):
                        # pyarrow reports some refused calls (GetSchema) as a bare OSError: a refusal, not an outage
                        raise ValidationError(f"replay server {self.locations[index]} refused {what}: {text}",
                                              rule="unauthorized") from None
                    tls = _TLS_REFUSED.search(text)
                    if tls:
                        raise ValidationError(f"replay server {self.locations[index]} failed the TLS handshake for "
                                              f"{what} ({tls.group('ssl') or tls.group('peer')}): pass its certificate "
                                              f"or CA as tls_root_certs= and the host name that certificate names",
                                              rule="replay_tls") from None
                    if text.startswith(proto.UNAVAILABLE):
                        # The server is up, the store behind it is not: every server of the list
                        # shares that store. The reader waits it out (its unavailable_timeout_s).
                        raise StoreUnavailable(f"replay server {self.locations[index]}: {text}") from None
                    if text.startswith(proto.RATE_LIMITED):
                        if limited_since is None:
                            limited_since = time.monotonic()
                            self._warn_once("rate_limited", "replay reader waits: server %s holds %s (%s)",
                                            self.locations[index], what, text)
                        time.sleep(0.05)
                        continue
                    if failing is None:
                        failing = Backoff(first_s=0.05, max_s=1.0)
                        if self._failed():  # one line per outage, not one per parallel stream
                            _log.warning("replay reader: %s failed on %s (%s); retrying%s", what,
                                         self.locations[index], text,
                                         " on the next server" if len(self.locations) > 1 else "")
                    elif failing.elapsed() >= self.retry_timeout_s:
                        raise StoreUnavailable(f"no replay server answered {what} for {self.retry_timeout_s:g} s "
                                               f"({', '.join(self.locations)}): {text}") from None
                    reconnects.inc()
                    self._fail_over(index)
                    failing.pause()
        finally:
            if limited_since is not None:
                wait_metric.labels("rate_limited").inc(time.monotonic() - limited_since)
            if failing is not None:
                wait_metric.labels("reconnect").inc(failing.elapsed())

    def _failed(self) -> bool:
        """A call starts failing; whether it is the first since the last answer
        (one warning per outage, however many calls or parallel streams fail)."""
        with self._lock:
            first = not self._outage
            if first:
                self._outage, self._outage_since = True, time.monotonic()
            return first

    def _recovered(self, index: int) -> None:
        """An answer after failures: the outage is over (said once)."""
        with self._lock:
            was, self._outage = self._outage, False
        if was:
            _log.info("replay reader: %s answers again after %.1f s", self.locations[index],
                      time.monotonic() - self._outage_since)

    def get(self, what: str, ticket: bytes) -> pa.Table:
        """A DoGet's whole answer (a stream cut short is retried whole)."""
        def run(c: fl.FlightClient, o: fl.FlightCallOptions) -> pa.Table:
            table = c.do_get(fl.Ticket(ticket), o).read_all()
            if not proto.complete(table):  # the stream ended early without an error: ask again
                raise fl.FlightUnavailableError(f"incomplete answer ({table.num_rows} rows)")
            return table
        return self.call(what, run)

    def action(self, what: str, kind: str, **fields: Any) -> Any:
        def run(c: fl.FlightClient, o: fl.FlightCallOptions) -> Any:
            results = list(c.do_action(fl.Action(kind, proto.encode(kind, **fields)), o))
            return json.loads(results[0].body.to_pybytes())
        return self.call(what, run)

    def close(self) -> None:
        self.closing.set()
        with self._lock:
            self._retire()


def _error(location: str, what: str, text: str) -> TrajstoreError:
    if text.startswith(proto.CONFLICT):
        text = re.sub(r" \[conflict\]$", "", text)
        return ConflictError(f"replay server {location} refused {what}: {text}", index=_index_of(text))
    if text.startswith(proto.INVALID):
        rule = re.search(r" \[([a-z_0-9]+)\]$", text)  # the store's rule, when it was the store's refusal
        return ValidationError(f"replay server {location} refused {what}: {text[:rule.start()] if rule else text}",
                               rule=rule.group(1) if rule else "replay_request", index=_index_of(text))
    if text.startswith(proto.CORRUPT):
        return CorruptStoreError(f"replay server {location}: {text}")
    if text.startswith(proto.PROJECTION_CHANGED):
        return ProjectionChangedError(f"replay server {location}: {text[len(proto.PROJECTION_CHANGED) + 2:]}")
    return TrajstoreError(f"replay server {location} failed {what}: {text}")


def _index_of(text: str) -> int | None:
    found = re.search(r": event (\d+)[,:]", text)
    return int(found.group(1)) if found else None


class _RemoteSamples(ReaderSampleIndex):
    """The sample index reads of the reader's seam, over Flight: the default
    samples, or (``projection``) a named projection's, as created with ``token``
    (its identity: the server refuses a request once the name holds another)."""

    def __init__(self, conn: _Connection, projection: str | None = None, token: str | None = None) -> None:
        self.conn = conn
        self.projection_name = projection
        self.token = token
        self._waiting_at: int | None = None  # the watermark a follow poll last found nothing below
        self._waiting_since = 0.0

    def _named(self) -> dict[str, Any]:
        """The request fields naming the sample index (none for the default samples)."""
        if self.projection_name is None:
            return {}
        return {"projection": self.projection_name, **({} if self.token is None else {"projection_token": self.token})}

    def projection(self, name: str) -> "_RemoteSamples":
        """Projection ``name``'s samples, as the projection of that name is now (its
        token); ``ValidationError`` when the store has none of that name."""
        if not isinstance(name, str):
            raise ValidationError(f"projection must be a name, got {name!r}", rule="projection")
        try:  # the server refuses an unknown projection
            token = self.conn.action("reading a projection", proto.PROJECTION, projection=name)["token"]
        except ValidationError as e:
            if "unknown action" not in str(e):
                raise
            token = None  # a server from before projection tokens: the name only
        index = _RemoteSamples(self.conn, name, token)
        index.watermark()
        return index

    def iter_sample_rows(self, *, where: Mapping[str, Any], after: tuple[int, int] | None,
                         page_rows: int) -> Iterator[list[dict[str, Any]]]:
        where = {k: (list(v) if isinstance(v, (tuple, set, frozenset)) else v) for k, v in where.items() if v is not None}
        first = True
        while True:
            ticket = proto.encode(proto.ROWS, where=where, after=None if after is None else list(after),
                                  page_rows=page_rows, **self._named())
            rows = self.conn.get("reading sample rows", ticket).to_pylist()
            if not rows:
                if first:
                    self._nothing_new(where.get("max_finished_position"))
                return
            if self._waiting_at is not None:
                _Waits.metrics()[0].labels("no_new_samples").inc(time.monotonic() - self._waiting_since)
                self._waiting_at = None
            first = False
            yield rows
            after = (rows[-1]["finished_position"], rows[-1]["sample_index"])

    def _nothing_new(self, watermark: int | None) -> None:
        """A follow poll found nothing: say so once per wait, not once per poll."""
        if self._waiting_at is None:
            self._waiting_at, self._waiting_since = watermark, time.monotonic()
            _log.info("replay reader waits for new materialized samples (watermark %s)", watermark)

    def watermark(self, num_shards: int | None = None) -> int:
        return int(self.conn.action("reading the watermark", proto.WATERMARK, num_shards=num_shards,
                                    **self._named()))

    def count_samples(self) -> int:  # not served: readers do not need it
        raise TrajstoreError("a replay store does not count samples; ask the store")


class _RemoteLog(ReaderEventLog):
    """The event log read of the reader's seam, over Flight."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn

    def count_events(self, *, after_position: int, types: Collection[str] | None = None) -> int:
        return int(self.conn.action("counting events", proto.COUNT_EVENTS, after_position=after_position,
                                    types=None if types is None else list(types)))

    def standing_attempt(self, run: str, step: int, rank: int) -> int | None:
        return self.conn.action("reading a step's attempts", proto.STANDING_ATTEMPT, run=run, step=int(step),
                                rank=int(rank))


_IN_FLIGHT_BYTES = 8 << 20
"""Payload bytes a reader has under way at most (one request is always let go): large
batches (long samples with routes) are fetched one or two at a time, as more of them
at once only compete for the same cores and memory bandwidth; small ones ``streams``
at a time, which hides the round trips."""


class _RemotePayload(ReaderPayload):
    """The payload read of the reader's seam (``PayloadStore.read_rows``), over Flight.

    One call is one request. A reader keeps ``read_ahead`` (its ``streams``)
    steps' requests in flight at once (``SampleReader``'s read-ahead): the
    round trips, the server's work and the transfer of several batches
    overlap, and one gRPC stream's window does not bound the transfer; as
    long as their answers weigh at most ``_IN_FLIGHT_BYTES`` together."""

    def __init__(self, conn: _Connection, location: str, streams: int) -> None:
        self.conn = conn
        self.location = location
        self.streams = streams
        self.current_model_version: Callable[[], int | None] = lambda: None
        self._paced: bool | None = None  # whether the server paces samples (samples_per_insert); None: not asked
        self._in_flight_changed = threading.Condition()
        self._in_flight = 0  # bytes of the answers under way
        self._row_bytes = 0.0  # bytes of a row in the last answer

    @property
    def read_ahead(self) -> int:
        """Steps the reader fetches ahead: ``streams``, or one from a server that paces
        samples (``samples_per_insert``): its budget goes to the requests that ask first,
        and a step fetched ahead must not take what the step the trainer waits for needs."""
        if self._paced is None:
            try:
                pacing = self.conn.action("asking the server's pacing", proto.PACING)
            except ValidationError:  # a server from before the pacing action: it says nothing
                pacing = {}
            except TrajstoreError:  # unreachable now: one step ahead, and ask again next time
                return 1
            self._paced = isinstance(pacing, dict) and pacing.get("samples_per_insert") is not None
        return 1 if self._paced else self.streams

    def read_rows(self, name: str, rows: Iterable[int]) -> SegmentRows:
        wanted = sorted(set(int(r) for r in rows))
        need = int(self._row_bytes * len(wanted))  # what the answer will weigh, by the answers so far
        with self._in_flight_changed:
            while self._in_flight and self._in_flight + need > _IN_FLIGHT_BYTES:
                self._in_flight_changed.wait()
            self._in_flight += need
        try:
            table = self._fetch(name, wanted)
        finally:
            with self._in_flight_changed:
                self._in_flight -= need
                self._in_flight_changed.notify_all()
        if table.num_rows:
            # the received buffers are its own, whole: their total is its size (nbytes walks every list, 0.07 ms)
            self._row_bytes = table.get_total_buffer_size() / table.num_rows
        return SegmentRows(table, {r: i for i, r in enumerate(wanted)})

    def _fetch(self, name: str, wanted: list[int]) -> pa.Table:
        ticket = proto.encode(proto.SAMPLES, segment=name, rows=wanted,
                              current_model_version=self.current_model_version())
        table = self.conn.get(f"reading {len(wanted)} samples of {name}", ticket)
        if table.num_rows != len(wanted):
            raise CorruptStoreError(f"replay server sent {table.num_rows} rows of {name} for {len(wanted)} asked")
        return table

    def close(self) -> None:
        pass


class _RemoteLeases:
    """A reader's GC lease (``trajstore.reader._lease``), written by the replay
    server in the store's database (the ``lease`` action)."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn

    def hold(self, name: str, holder: str, ttl_s: float, since: float | None) -> tuple[float, bool]:
        got = self.conn.action("holding a GC lease", proto.LEASE, name=name, holder=holder[:200], ttl_s=ttl_s,
                               since=since)
        return float(got["now"]), bool(got["taken"])

    def release(self, name: str) -> None:
        self.conn.action("releasing a GC lease", proto.LEASE, name=name, release=True)


class ReplayStore:
    """A store as replay servers show it: the ``materialized``, ``payload`` and
    ``log`` parts ``SampleReader`` reads (a ``trajstore.reader.ReaderStore``). Requests go to ``locations[first]``
    (``ReplayReader`` passes its rank, which spreads ranks over the servers)
    and move on to the next one that answers when it fails. It reads; its
    ``append`` (DoPut) is for training lineage with a read token."""

    def __init__(self, locations: str | Sequence[str], *, token: str | None = None, retry_timeout_s: float = 60.0,
                 call_timeout_s: float = 60.0, tls_root_certs: bytes | None = None, streams: int = 4,
                 first: int = 0) -> None:
        self.locations = parse_locations(locations)
        if not isinstance(streams, int) or isinstance(streams, bool) or streams < 1:
            raise ValidationError(f"streams must be a positive integer, got {streams!r}", rule="reader_config")
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.url = ",".join(self.locations)
        self._conn = _Connection(self.locations, token, retry_timeout_s=retry_timeout_s,
                                 call_timeout_s=call_timeout_s, tls_root_certs=tls_root_certs, first=first)
        self.materialized = _RemoteSamples(self._conn)
        self.log = _RemoteLog(self._conn)
        self.payload = _RemotePayload(self._conn, self.url, streams)
        self._leases = _RemoteLeases(self._conn)  # a reader's GC lease, held by the server

    def append(self, events: Sequence[Mapping[str, Any]]) -> AppendResult:
        """Append wire-format events through the server (DoPut), atomically and
        idempotently as ``Store.append``. A read token may append training
        lineage only (``train_step``, ``sample_annotation``: what
        ``ReplayReader.record_step`` sends); the write token anything.
        Numpy arrays travel as their bytes (``{b64, dtype, shape}``)."""
        column = pa.array([json.dumps(ev, separators=(",", ":"), default=_json_value) for ev in events], pa.string())
        table = pa.table({"event": column})
        # the put's size, declared: a server bounds a read token's put before reading its body
        size = value_bytes(column)
        conn = self._conn
        declared = fl.FlightCallOptions(headers=[*conn.headers, (PUT_BYTES.encode(), str(size).encode()),
                                                 (PUT_ROWS.encode(), str(len(column)).encode())],
                                        timeout=conn.call_timeout_s)

        def run(c: fl.FlightClient, o: fl.FlightCallOptions) -> dict[str, Any]:
            writer, meta = c.do_put(fl.FlightDescriptor.for_path("events"), table.schema, declared)
            writer.write_table(table)
            writer.done_writing()
            answer = meta.read()
            writer.close()
            return json.loads(answer.to_pybytes())

        got = self._conn.call("appending events", run)
        return AppendResult(int(got["num_appended"]), int(got["num_duplicates"]), None)

    def hello(self) -> dict[str, Any]:
        """The server's answer to ``hello`` (checks the token and the protocol version)."""
        return self._conn.action("hello", proto.HELLO)

    def close(self) -> None:
        self._conn.closing.set()  # first: the fetches the pool waits for stop waiting
        self.payload.close()
        self._conn.close()

    def __enter__(self) -> "ReplayStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _json_value(value: Any) -> Any:
    """JSON for what ``json`` cannot write: numpy arrays as ``{b64, dtype, shape}``, numpy scalars as numbers."""
    if isinstance(value, np.ndarray):
        return encode_b64(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


class ReplayReader(SampleReader):
    """A ``SampleReader`` that reads through replay servers: same config, batches and state.

    ::

        reader = ReplayReader("grpc://replay-a:8815,grpc://replay-b:8815", token=TOKEN,
                              rank=r, world_size=w, batch_size=8, keep_groups=True, group_size=4)
        reader.load_state_dict(checkpoint["reader"])     # a SampleReader state works too
        for batch in reader:                              # list[Sample], as SampleReader gives
            ...

    ``locations``: replay server URIs (a comma-separated string or a list) or a
    ``ReplayStore``; ``token`` defaults to ``$TRAJSTORE_REPLAY_TOKEN``. The
    rest is ``SampleReader``'s (``rank``, ``world_size``,
    ``current_model_version``, ``ReaderConfig`` fields as keywords; a
    ``ReaderConfig`` as ``config`` is deprecated, as there). ``streams``: the steps
    whose payload is fetched ahead, in parallel requests (the read-ahead). A server with a
    ``max_staleness`` limit judges it against this reader's
    ``current_model_version``.
    """

    def __init__(self, locations: str | Sequence[str] | ReplayStore, config: ReaderConfig | None = None, *,
                 token: str | None = None, rank: int = 0, world_size: int = 1,
                 current_model_version: int | None = None, retry_timeout_s: float = 60.0,
                 call_timeout_s: float = 60.0, tls_root_certs: bytes | None = None, streams: int = 4,
                 **fields: Any) -> None:
        owns = not isinstance(locations, ReplayStore)
        store = ReplayStore(locations, token=token, retry_timeout_s=retry_timeout_s, call_timeout_s=call_timeout_s,
                            tls_root_certs=tls_root_certs, streams=streams,
                            first=rank if isinstance(rank, int) else 0) if owns else locations
        try:
            super().__init__(store, rank=rank, world_size=world_size, current_model_version=current_model_version,
                             **_settings(type(self).__name__, config, fields))
        except BaseException:
            if owns:
                store.close()
            raise
        self._owns_store = owns
        store.payload.current_model_version = lambda: self.current_model_version

    def close(self) -> None:
        """Stop prefetching and close the connection this reader opened.

        A call waiting out a server's hold or a failover gives up first, so
        closing never waits for a server to come back."""
        self._closing.set()
        self._lease.close()  # through the server: before the connection stops calling
        if self._owns_store:
            self.store._conn.closing.set()
        super().close()
