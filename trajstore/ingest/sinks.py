"""Where a ``Writer``'s batches go: the ``Sink`` interface and its two implementations.

``StoreSink`` appends to an in-process ``Store``; ``HttpSink`` POSTs to the
HTTP ingest service (``POST /v1/events``) with the standard library only,
an Arrow IPC body by default (``arrow_body``). ``encode_events`` builds the
JSON body (numpy arrays as ``{b64,dtype,shape}``) and ``error_from_response`` turns the service's error
answer back into the library error it stands for. ``make_sink`` picks a sink
for a ``Writer``'s ``sink`` argument. All are re-exported by ``client.py``.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
from typing import Any, Protocol
from urllib.parse import urlsplit

from trajstore.errors import StoreUnavailable, TrajstoreError, ValidationError
from trajstore.log._errors import retriable_error
from trajstore.ingest._event_dicts import json_default
from trajstore.ingest._http import error_class
from trajstore.ingest.arrow_body import ARROW_CONTENT_TYPE, encode_arrow_events

__all__ = ["BODY_FORMATS", "HttpSink", "Sink", "StoreSink", "encode_events", "error_from_response", "make_sink"]


class Sink(Protocol):
    """Where a writer's batches go. ``send`` is atomic: all events stored or none.

    It raises ValidationError / ConflictError for refused events (never
    retried; ``index`` names the event), StoreUnavailable or OSError for
    failures worth retrying with the same events. Anything else is a failure
    the writer cannot classify: it isolates the trajectories of the batch and
    fails the one that keeps failing. ``name`` says where the events go (for
    log lines; no credentials).
    """

    name: str

    def send(self, events: list[dict]) -> None: ...

    def close(self) -> None: ...


class StoreSink:
    """Appends to an in-process store (``trajstore.connect(...)``) through the store's one group
    committer in this process (``_group_commit.shared_committer``): the batches of several writers
    of one store sent at once share a payload object and an index transaction, and each is
    acknowledged when that append returned; a refused batch fails alone. ``owned``: the sink
    lets go of the store when it closes (``_release_store``: a store shared by writers of one
    URL closes with the last of them)."""

    def __init__(self, store: Any, *, owned: bool = False) -> None:
        self.store = store
        self._owned = owned
        self.name = repr(store)
        self._committer: Any = None
        self._lock = threading.Lock()

    def send(self, events: list[dict]) -> None:
        from trajstore.ingest._group_commit import shared_committer

        try:
            with self._lock:
                if self._committer is None:
                    self._committer = shared_committer(self.store)
                committer = self._committer
            committer.submit(events).result()
        except Exception as e:
            # the store translates driver errors itself; this is the writer's second line
            # of defence, so that a database restart never fails trajectories
            retriable = retriable_error(e, self.name)
            if retriable is not None:
                raise retriable from None
            raise

    def close(self) -> None:
        with self._lock:
            committer, self._committer = self._committer, None
            owned, self._owned = self._owned, False
        if committer is not None:
            from trajstore.ingest._group_commit import release_shared

            release_shared(self.store)
        if owned:
            _release_store(self.store)

    def rollout_state(self, run: str) -> Any:
        """The store's resume plan of ``run`` (docs/reference.md "Rollout ledger")."""
        return self.store.rollout_state(run)


# The stores that Writers made from a URL, one per URL in this process: (store, users).
_STORES: dict[str, tuple[Any, int]] = {}
_STORES_LOCK = threading.Lock()


def _forget_stores_in_forked_children() -> None:
    # A forked child's writers open stores of their own: the parent's committer threads
    # do not exist in the child, and its lock may have been held at the fork.
    global _STORES_LOCK
    _STORES.clear()
    _STORES_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_stores_in_forked_children)


def _shared_store(url: str | None) -> Any:
    """The one ``Store`` of ``url`` (None: ``$TRAJSTORE_URL``, else the default) that this
    process's writers share, opened on first use: ``Writer``s made from the same URL
    then share its group committer (payload objects and index transactions). Every
    call is paired with ``_release_store(store)``; the last one closes the store."""
    from trajstore.store import connect, resolve_url

    key = resolve_url(url)
    with _STORES_LOCK:  # held while opening: two writers starting at once open it once
        found = _STORES.get(key)
        store = connect(key) if found is None else found[0]
        _STORES[key] = (store, 1 if found is None else found[1] + 1)
        return store


def _release_store(store: Any) -> None:
    """One user of ``_shared_store(url)`` is done with ``store``; the last one closes it.
    A store that is not shared is closed at once."""
    with _STORES_LOCK:
        key = next((k for k, (s, _) in _STORES.items() if s is store), None)
        if key is not None:
            users = _STORES[key][1] - 1
            if users:
                _STORES[key] = (store, users)
                return
            del _STORES[key]
    store.close()



def encode_events(events: list[dict]) -> bytes:
    """The JSON ``POST /v1/events`` body for ``events`` (numpy arrays as {b64,dtype,shape})."""
    return json.dumps({"events": events}, default=json_default, separators=(",", ":")).encode()


BODY_FORMATS = {"arrow": (ARROW_CONTENT_TYPE, encode_arrow_events), "json": ("application/json", encode_events)}


class HttpSink:
    """POSTs batches to the ingest service over one kept-alive connection.

    ``body="arrow"`` (the default) sends an Arrow IPC stream
    (``trajstore.ingest.arrow_body``): numpy arrays travel as their raw
    bytes, no JSON text and no base64 for them on either side;
    ``body="json"`` sends ``{"events": [...]}`` with arrays as
    ``{b64, dtype, shape}``. Either way the service applies the same rules
    and a refusal names the event's index in the batch and its trajectory."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 120.0,
                 max_body_bytes: int = 64 << 20, body: str = "arrow") -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValidationError(f"ingest URL must be http(s)://host:port, got {url!r}", rule="url")
        if body not in BODY_FORMATS:
            raise ValidationError(f"body must be one of {sorted(BODY_FORMATS)}, got {body!r}", rule="body_format")
        self.body = body
        content_type, self._encode = BODY_FORMATS[body]
        self._parts = parts
        self.name = f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}{parts.path.rstrip('/')}"
        self._path = parts.path.rstrip("/") + "/v1/events"
        self._timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self._headers = {"Content-Type": content_type}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
        return cls(self._parts.hostname, self._parts.port, timeout=self._timeout_s)

    def send(self, events: list[dict]) -> None:
        body = self._encode(events)
        if len(body) > self.max_body_bytes:  # the service would answer 413: let the writer split first
            raise ValidationError(f"body of {len(body)} bytes is over the {self.max_body_bytes}-byte limit",
                                  rule="body_too_large")
        status, data = self.post(body)
        if status != 200:
            raise error_from_response(status, data)

    def post(self, body: bytes) -> tuple[int, bytes]:
        """One POST; a dropped kept-alive connection is reopened once (safe: ids make it idempotent)."""
        for attempt in (0, 1):
            conn = self._conn or self._connect()
            try:
                conn.request("POST", self._path, body, self._headers)
                resp = conn.getresponse()
                data = resp.read()
                self._conn = None if resp.will_close else conn
                return resp.status, data
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                self._conn = None
                if attempt:
                    raise StoreUnavailable(f"ingest service at {self.name} unreachable: {e}") from None
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def rollout_state(self, run: str) -> Any:
        """``GET /v1/rollout_state?run=``: the run's resume plan (docs/reference.md "Rollout ledger")."""
        from urllib.parse import quote

        from trajstore.rollout._ledger import plan_from_json

        path = self._parts.path.rstrip("/") + "/v1/rollout_state?run=" + quote(run, safe="")
        headers = {k: v for k, v in self._headers.items() if k != "Content-Type"}
        conn = self._connect()  # its own connection: the writer's sender thread owns the kept-alive one
        try:
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise StoreUnavailable(f"ingest service at {self.name} unreachable: {e}") from None
        finally:
            conn.close()
        if resp.status != 200:
            raise error_from_response(resp.status, data)
        return plan_from_json(json.loads(data))


def error_from_response(status: int, data: bytes) -> TrajstoreError:
    """The library error an ingest-service error response stands for."""
    try:
        err = json.loads(data)["error"]
        message = str(err.get("message"))
    except (ValueError, KeyError, TypeError, AttributeError):
        err, message = {}, data[:200].decode("utf-8", "replace")
    cls = error_class(status)
    if cls is StoreUnavailable:  # overloaded, restarting, behind a gateway: retried
        return StoreUnavailable(f"ingest service answered {status}: {message}")
    if cls is not None:  # ValidationError or ConflictError: the event at fault, when the body names one
        return cls(message, index=err.get("index"), trajectory_id=err.get("trajectory_id"), rule=err.get("rule") or f"http_{status}")
    if status >= 500:  # the service failed on this request: not retried blindly (the writer isolates it)
        error = TrajstoreError(f"ingest service failed on the request ({status}): {message}")
    else:  # 401, 403, 404: every request would get the same answer
        error = TrajstoreError(f"ingest service refused the request ({status}): {message}")
    error.http_status = status  # type: ignore[attr-defined]
    return error


def make_sink(sink: Any, token: str | None, timeout_s: float, body: str = "arrow") -> Sink:
    """The sink a ``Writer(sink, ...)`` argument stands for (see ``Writer``); ``body``: an HTTP sink's body format."""
    if isinstance(sink, str) and sink.startswith(("http://", "https://")):
        return HttpSink(sink, token=token if token is not None else os.environ.get("TRAJSTORE_TOKEN"), timeout_s=timeout_s,
                        body=body)
    if isinstance(sink, str) or sink is None:
        return StoreSink(_shared_store(sink), owned=True)
    if hasattr(sink, "send"):
        return sink
    if hasattr(sink, "append"):
        return StoreSink(sink)
    raise TypeError(f"sink must be an http(s) URL, a store URL, a Store or a Sink, got {type(sink).__name__}")
