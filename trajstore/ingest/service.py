"""HTTP ingest service: ``POST /v1/events`` into ``store.append``.

A thin edge over the library (docs/design.md: edges stay thin): events are
parsed with ``trajstore.events.parse_events`` and stored with ``store.append``;
nothing here re-implements a rule. FastAPI and uvicorn are imported lazily,
so the core never needs them (``pip install 'trajstore[server]'``).

Endpoints:

* ``POST /v1/events``: body ``{"events": [...]}`` or a JSON list of
  wire-format events. 200 only after ``store.append`` returned (durable).
  401 without the bearer token, 413 over ``max_body_bytes``, 400 for bad
  JSON, 422 for a refused event, 409 for a conflict, 503 when the store is
  unreachable (retry). Errors are ``{"error": {"index", "trajectory_id",
  "rule", "message"}}`` and nothing of the request is stored.
* ``GET /healthz``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json``.

This module holds the app (``make_app``), its settings (``ServeConfig``) and
how it is served (``serve``, the ``trajstore serve`` flags). The jobs it
composes live beside it: ``_group_commit`` (requests coalesced into one
``store.append``), ``_body`` (reading the body off ASGI, the byte budget, the
Arrow body), ``_json_body`` (the JSON body with integer arrays straight to
numpy), ``_metrics`` (Prometheus).
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers'
# annotations at runtime, and ``Request`` is imported lazily inside make_app.
import argparse
import asyncio
import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

from trajstore._util.config import add_flags, config_from_args, option
from trajstore.errors import TrajstoreError
from trajstore.ingest._body import (DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_BYTES_IN_FLIGHT, ByteBudget, ClientGone,
                                    declared_length, header, is_arrow, parse_arrow_body, read_body, send_json)
from trajstore.ingest._group_commit import (DEFAULT_COMMITTERS, DEFAULT_GROUP_WAIT_S, DEFAULT_LINGER_S,
                                            DEFAULT_MAX_GROUP_BYTES, GroupCommitter)
from trajstore.ingest._http import OPEN_PATHS, BearerAuth, run_server, server_options, server_token
from trajstore.ingest._http import HTTPError as _HTTPError
from trajstore.ingest._json_body import decode_json, parse_body
from trajstore.ingest._metrics import MULTIPROC_ENV, Metrics, make_multiproc_dir

# The body parsers, the byte budget, the metrics and the defaults come from the
# service's internals (_body, _json_body, _metrics, _group_commit): importable
# here, not its API. GroupCommitter is named in the docs as the service's.
__all__ = ["DEFAULT_PORT", "GroupCommitter", "ServeConfig", "add_cli_arguments", "app_from_env", "main", "make_app",
           "serve", "serve_from_args"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 8700


_SERVER = server_options(port=DEFAULT_PORT, token_help="bearer token clients must send",
                         open_help="accept requests without a token")


@dataclass(frozen=True)
class ServeConfig:
    """Every setting of the ingest service: what ``trajstore serve`` builds from its flags (each
    field is one flag: :func:`add_cli_arguments`), ``serve`` runs, and each worker process receives
    (``to_env`` / ``from_env``).

    ``make_app`` reads the app's part (``token`` and the request settings);
    ``serve`` the rest (where the store is, where to listen, how many processes)."""

    store_url: str | None = option(None, flag=None, dest="store", help="store URL (the CLI's global --store)")
    """Store URL (None: ``$TRAJSTORE_URL`` or the embedded default)."""
    payload: str | None = option(None, flag=None, help="payload location (the CLI's global --payload)")
    """Where payload segments go when the store does not say (``connect(payload=)``)."""
    host: str = _SERVER["host"]
    """Address to bind."""
    port: int = _SERVER["port"]
    """Port to bind (0: any free port)."""
    token: str | None = _SERVER["token"]
    """Bearer token clients must send. ``serve`` falls back to ``$TRAJSTORE_TOKEN`` and refuses
    to start without one unless ``insecure_no_auth``; for ``make_app``, None means no auth."""
    insecure_no_auth: bool = _SERVER["insecure_no_auth"]
    """Let ``serve`` run without a token (anyone who can reach the port can write)."""
    max_body_bytes: int = option(DEFAULT_MAX_BODY_BYTES, flag="--max-body-mb", scale=1 / (1 << 20), min=0,
                                 min_exclusive=True, help="largest request body in MiB (default 64); larger ones get 413")
    """Largest request body; a larger one gets 413, refused before it is read when it declares its length."""
    max_bytes_in_flight: int = option(
        DEFAULT_MAX_BYTES_IN_FLIGHT, flag="--max-in-flight-mb", scale=1 / (1 << 20), min=0, min_exclusive=True,
        help="request bodies read, parsed or committing at once, in MiB (default 128); "
             "more requests wait (bounds the service's memory)")
    """Request bodies read, parsed or committing at once, in bytes (``ByteBudget``); more requests
    wait. Bounds the service's memory (docs/ingest.md "Memory")."""
    group_commit: bool = option(True, help="append each request on its own instead of coalescing concurrent ones")
    """Coalesce concurrent requests into one ``store.append`` (``GroupCommitter``); False appends
    each request on its own."""
    group_wait_s: float = option(DEFAULT_GROUP_WAIT_S, flag="--group-wait-ms", scale=1e3, min=0,
                                 help="how long a group commit waits for requests still being read or parsed "
                                      f"(default {DEFAULT_GROUP_WAIT_S * 1e3:g}; 0: never)")
    """How long a group about to be committed waits for requests still being read or parsed
    (``GroupCommitter.max_wait_s``; 0: never)."""
    committers: int = option(DEFAULT_COMMITTERS,
                             help="group appends in flight at once per process: one writes while another waits "
                                  f"for its fsyncs (default {DEFAULT_COMMITTERS})")
    """Group appends in flight at once per process: one writes while another waits for its fsyncs
    (``GroupCommitter``'s ``committers``)."""
    linger_s: float = option(DEFAULT_LINGER_S, flag="--linger-ms", scale=1e3, min=0,
                             help="how long a request waits for others to share its payload object and index "
                                  f"transaction (default {DEFAULT_LINGER_S * 1e3:g}; 0: commit at once)")
    """How long a request waits for others to share its payload object and index transaction
    (``GroupCommitter.linger_s``, Kafka's ``linger.ms``; 0: commit as soon as a committer is free)."""
    max_batch_bytes: int = option(DEFAULT_MAX_GROUP_BYTES, flag="--max-batch-mb", scale=1 / (1 << 20), min=0,
                                  min_exclusive=True,
                                  help="a group's bound in request body MiB: a full group commits without waiting "
                                       f"out the linger (default {DEFAULT_MAX_GROUP_BYTES / (1 << 20):g})")
    """A group's bound in request body bytes (``GroupCommitter.max_group_bytes``, Kafka's
    ``batch.size``): a full group is committed without waiting out the linger."""
    workers: int = option(1, help="server processes on the port, each with its own store connection (default 1)")
    """Server processes on the port, each with its own store connection and group committer
    (one process is bound by its GIL to about one core)."""
    log_level: str = _SERVER["log_level"]
    """uvicorn's log level."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_bytes_in_flight", "committers", "workers", "max_batch_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if not self.group_wait_s >= 0:
            raise ValueError(f"group_wait_s must be 0 or more, got {self.group_wait_s!r}")
        if not self.linger_s >= 0:
            raise ValueError(f"linger_s must be 0 or more, got {self.linger_s!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be within 0..65535, got {self.port!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServeConfig":
        """The settings the flags of ``add_cli_arguments`` (one per field) parsed into ``args`` stand for."""
        return config_from_args(cls, args)

    def to_env(self) -> str:
        """These settings as the JSON text ``serve`` hands its workers in ``$TRAJSTORE_SERVE_CONFIG``."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls, text: str) -> "ServeConfig":
        """The settings ``to_env`` wrote."""
        return cls(**json.loads(text))


_UNSET: Any = object()


_EVENTS_OPENAPI = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"oneOf": [
            {"type": "object", "required": ["events"],
             "properties": {"events": {"type": "array", "items": {"type": "object"}}}},
            {"type": "array", "items": {"type": "object"}},
        ]}},
            # one Arrow IPC stream, arrays as raw bytes: see trajstore.ingest.arrow_body
            "application/vnd.apache.arrow.stream": {"schema": {"type": "string", "format": "binary"}}},
    },
    "responses": {
        "200": {"description": "stored (durable): num_events, num_appended, num_duplicates, last_position"},
        "400": {"description": "malformed JSON or body shape"},
        "401": {"description": "missing or wrong bearer token"},
        "409": {"description": "an event conflicts with a stored one"},
        "413": {"description": "body over the size limit"},
        "422": {"description": "an event breaks a rule; error names index, trajectory_id, rule"},
        "503": {"description": "store unreachable; retry the same events"},
    },
}


def make_app(store: Any, config: ServeConfig | None = None, *, token: str | None = _UNSET,
             close_store: bool = False, **settings: Any) -> Any:
    """The FastAPI app over ``store``, set up by ``config`` (``ServeConfig``).

    ``token``: the bearer token clients must send; None means no auth (the
    caller decided). Required unless ``config`` is given (then it replaces
    ``config.token``). ``settings``: other ``ServeConfig`` fields the app
    reads, replacing ``config``'s: ``max_body_bytes``, ``max_bytes_in_flight``
    (request bodies being read, parsed or committed at once, in bytes; see
    ``ByteBudget``), ``group_commit``, ``group_wait_s`` (how long a group
    commit waits for requests still being read or parsed) and ``committers``
    (group appends at once; see ``GroupCommitter``).
    ``close_store``: close the store when the app shuts down.
    """
    if config is None and token is _UNSET:
        raise TypeError("make_app() needs token= (None: no auth) or a ServeConfig")
    if token is not _UNSET:
        settings["token"] = token
    config = dataclasses.replace(config or ServeConfig(), **settings)
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse, Response
    from starlette.concurrency import run_in_threadpool

    token, max_body_bytes = config.token, config.max_body_bytes
    metrics = Metrics()
    metrics.budget(0, 0, config.max_bytes_in_flight)
    committer = (GroupCommitter(store, metrics=metrics, max_wait_s=config.group_wait_s, committers=config.committers,
                                linger_s=config.linger_s, max_group_bytes=config.max_batch_bytes)
                 if config.group_commit else None)

    @asynccontextmanager
    async def lifespan(app: Any):
        yield
        if committer is not None:
            committer.close()
        if close_store:
            store.close()

    app = FastAPI(title="trajstore ingest", version="1", lifespan=lifespan)
    app.state.metrics = metrics
    app.state.committer = committer  # None without group commit
    budget = app.state.budget = ByteBudget(config.max_bytes_in_flight)

    async def parse(scope: Mapping[str, Any], body: bytes | bytearray) -> tuple[list, int]:
        if is_arrow(header(scope, b"content-type")):
            # Arrow: buffers mapped, not converted; parsing it on the event loop costs less than a thread hop
            return parse_arrow_body(body)
        return await run_in_threadpool(parse_body, body)  # JSON: milliseconds per MiB, off the event loop

    async def commit(events: list, num_tokens: int, nbytes: int) -> tuple[int, Any]:
        if committer is not None:
            return await asyncio.wrap_future(committer.submit(events, num_tokens, expected=True, nbytes=nbytes))
        return 1, await run_in_threadpool(store.append, events)

    async def post_events(scope: Mapping[str, Any], receive: Any, send: Any) -> None:
        """``POST /v1/events`` on raw ASGI: the body read straight from ``receive``, the answer sent as JSON."""
        start = time.perf_counter()
        try:
            declared = declared_length(scope)
            if declared is not None and declared > max_body_bytes:  # refused before taking any budget
                raise _HTTPError(413, f"body of {declared} bytes is over the {max_body_bytes}-byte limit",
                                 rule="body_too_large")
            taken = await budget.acquire(declared if declared is not None else max_body_bytes)
            metrics.budget(budget.in_flight, budget.peak, budget.max_bytes)
            try:
                if committer is not None:
                    committer.expect()
                try:
                    body = await read_body(scope, receive, declared, max_body_bytes)
                    nbytes = len(body)
                    events, num_tokens = await parse(scope, body)
                    del body
                except BaseException:
                    if committer is not None:
                        committer.forget()
                    raise
                num_events = len(events)
                try:
                    group_size, result = await commit(events, num_tokens, nbytes)
                except Exception as e:
                    raise _HTTPError.from_error(e) from None
                finally:
                    del events  # the parsed arrays go before the budget is given back
            finally:
                await budget.release(taken)
                metrics.budget(budget.in_flight, budget.peak, budget.max_bytes)
        except ClientGone:
            metrics.observe(499, time.perf_counter() - start, rule="client_gone")
            return
        except Exception as e:  # noqa: BLE001 - every answer is a trajstore error body
            error = e if isinstance(e, _HTTPError) else _HTTPError.from_error(e)
            if error.status >= 500 and not isinstance(e, _HTTPError):
                log.exception("ingest request failed")
            metrics.observe(error.status, time.perf_counter() - start, rule=error.rule)
            await send_json(send, error.status, error.body,
                             [(b"www-authenticate", b"Bearer")] if error.status == 401 else ())
            return
        metrics.observe(200, time.perf_counter() - start, events=result.num_appended or 0,
                        duplicates=result.num_duplicates or 0, tokens=num_tokens)
        await send_json(send, 200, _ack_body(num_events, result))

    class _Handled(Response):
        """What the FastAPI route returns: it runs ``post_events`` on the connection itself."""

        def __init__(self) -> None:  # noqa: D107 - nothing to render up front
            pass

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            await post_events(scope, receive, send)

    # The route documents the endpoint (OpenAPI) and serves it when the app is
    # mounted under another; _IngestApp below answers it without FastAPI's
    # routing and middleware on the hot path.
    @app.post("/v1/events", openapi_extra=_EVENTS_OPENAPI, response_class=Response)
    async def post_events_route() -> Any:
        return _Handled()

    @app.get("/v1/rollout_state")
    async def rollout_state(run: str) -> Any:
        """A rollout run's resume plan (docs/reference.md "Rollout ledger"), as ``_ledger.plan_to_json``."""
        from fastapi.responses import JSONResponse

        from trajstore.rollout import _ledger
        from trajstore.events._fields import _id

        try:
            plan = await run_in_threadpool(lambda: store.rollout_state(_id(run, "run")))
        except Exception as e:  # noqa: BLE001 - every answer is a trajstore error body
            error = _HTTPError.from_error(e)
            if error.status >= 500:
                log.exception("rollout_state request failed")
            return error.response()
        return JSONResponse(_ledger.plan_to_json(plan))

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics() -> str:
        return metrics.render()

    # One rule for every endpoint, deny by default: the token is checked before any handler,
    # on the fast path and (when the FastAPI app is mounted elsewhere) on FastAPI's own.
    open_paths = OPEN_PATHS | {"/metrics"}  # Prometheus scrapes without a token; counters carry no data
    app.add_middleware(BearerAuth, token=token, open_paths=open_paths)

    def denied(scope: Any) -> None:
        metrics.observe(401, 0.0, rule="unauthorized")

    return _IngestApp(app, BearerAuth(post_events, token, open_paths, on_deny=denied))


class _IngestApp:
    """The ASGI app ``make_app`` returns: ``POST /v1/events`` goes straight to its
    handler; everything else (health, metrics, OpenAPI, lifespan, 404/405) to FastAPI."""

    def __init__(self, app: Any, post_events: Any) -> None:
        self.fastapi = app
        self.state = app.state
        self._post_events = post_events  # behind BearerAuth, as FastAPI's routes are

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] == "/v1/events":
            await self._post_events(scope, receive, send)
        else:
            await self.fastapi(scope, receive, send)


def _ack_body(num_events: int, result: Any) -> dict:
    # ``result`` is this request's own share of a coalesced append (_share_of).
    return {"num_events": num_events, "num_appended": result.num_appended, "num_duplicates": result.num_duplicates,
            "last_position": result.last_position}


def _ack_body(num_events: int, result: Any) -> dict:
    # ``result`` is this request's own share of a coalesced append (_group_commit._share_of).
    return {"num_events": num_events, "num_appended": result.num_appended, "num_duplicates": result.num_duplicates,
            "last_position": result.last_position}


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``trajstore serve``: one per ``ServeConfig`` field (``--store`` and ``--payload`` are
    the CLI's global flags); ``ServeConfig.from_args`` reads them."""
    add_flags(parser, ServeConfig)


_POSITIONAL = ("host", "port", "token")  # serve(store_url, host, port, token): the call docs/ingest.md shows


def serve(config: ServeConfig | str | None = None, *args: Any, **settings: Any) -> None:
    """Run the ingest service until SIGINT/SIGTERM (in-flight requests finish first).

    ``serve(ServeConfig(...))``; ``serve(store_url, host, port, token, **fields)``
    builds the ``ServeConfig`` from ``ServeConfig``'s fields (``settings``
    replace a given config's). Refuses to start without a token (``token``
    or ``$TRAJSTORE_TOKEN``) unless ``insecure_no_auth``. ``workers > 1``
    runs that many processes on one port, each with its own store connection
    and group committer: one process is bound by its GIL to about one core.
    """
    config = _serve_config(config, args, settings)
    config = dataclasses.replace(config, token=server_token(config.token, insecure_no_auth=config.insecure_no_auth,
                                                                       host=config.host))
    from trajstore.store import connect

    # Connect once here: a bad URL fails before the server starts, and a new
    # database is migrated by one process, not raced by every worker.
    connect(config.store_url, payload=config.payload).close()
    # uvicorn builds each worker's app from the import string; the settings
    # reach it through the environment the workers inherit.
    os.environ[_CONFIG_ENV] = config.to_env()
    metrics_dir = None
    if config.workers > 1 and not os.environ.get(MULTIPROC_ENV):
        # every worker counts into this directory; a scrape of any worker sums them (Metrics.render)
        metrics_dir = os.environ[MULTIPROC_ENV] = make_multiproc_dir()
    try:
        # http=: TCP_NODELAY on every accepted connection, whatever socket the
        # workers were handed (see _nodelay).
        run_server("trajstore.ingest.service:app_from_env", name="serve", factory=True, workers=config.workers,
                   host=config.host, port=config.port, store_url=config.store_url, payload=config.payload,
                   log_level=config.log_level, http="trajstore.ingest._nodelay:NoDelayHTTPProtocol")
    finally:
        if metrics_dir is not None:
            import shutil

            del os.environ[MULTIPROC_ENV]
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _serve_config(config: ServeConfig | str | None, args: tuple, settings: dict) -> ServeConfig:
    """The ``ServeConfig`` a ``serve(...)`` call stands for."""
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"serve() takes at most {len(_POSITIONAL) + 1} positional arguments")
    settings = {**settings, **dict(zip(_POSITIONAL, args))}
    if isinstance(config, ServeConfig):
        return dataclasses.replace(config, **settings)
    return ServeConfig(store_url=config, **settings)


_CONFIG_ENV = "TRAJSTORE_SERVE_CONFIG"


def app_from_env() -> Any:
    """The app ``serve`` described in ``$TRAJSTORE_SERVE_CONFIG``; it owns (and closes) its store."""
    from trajstore.store import connect

    config = ServeConfig.from_env(os.environ[_CONFIG_ENV])
    _return_big_buffers_to_the_os()
    store = connect(config.store_url, payload=config.payload)
    return make_app(store, config, close_store=True)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def _return_big_buffers_to_the_os(threshold: int = 1 << 20) -> None:
    """Pin glibc's mmap threshold so buffers of 1 MiB and more are mmapped and go back to the OS when freed.

    glibc raises the threshold to the size of each big block freed (up to 32
    MiB), after which multi-MB body and array buffers come from the heap and
    fragment it: under a stream of large bodies the service's RSS then grows
    with the number of requests served, not with the bytes in flight
    (docs/ingest.md "Memory"). A no-op off glibc."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):  # no mallopt: leave malloc as it is
        pass


def serve_from_args(args: argparse.Namespace) -> None:
    serve(ServeConfig.from_args(args))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trajstore-ingest", description="trajstore HTTP ingest service")
    parser.add_argument("--store", default=None, help="store URL (default $TRAJSTORE_URL or the embedded default)")
    add_cli_arguments(parser)
    args = parser.parse_args(argv)
    try:
        serve_from_args(args)
    except (ValueError, TrajstoreError) as e:
        raise SystemExit(f"trajstore serve: {e}") from None
