"""What the HTTP edges (the ingest service, the recording proxies, the live report) answer alike.

One error body, ``{"error": {"index", "trajectory_id", "rule", "message"}}``
(``index`` and ``trajectory_id`` are null when no event is at fault), one
table of statuses per library error (``ERROR_STATUS``, read back by the client's sinks), one bearer-token check, one rule for starting without a token, the
command-line flags both servers take. FastAPI is imported only
when a response is built, so importing this module needs no extra.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import sys
import threading
import time
import urllib.request
from typing import Any, Callable

from trajstore._util.auth import bearer_token, same_token
from trajstore.errors import ConflictError, StoreUnavailable, TrajstoreError, ValidationError

__all__ = ["ERROR_STATUS", "OPEN_PATHS", "BearerAuth", "HTTPError", "UNAUTHORIZED", "bearer_ok",
           "error_body", "error_class", "error_response", "error_status", "run_server", "server_options",
           "server_token"]

log = logging.getLogger(__name__)

UNAUTHORIZED = "missing or wrong bearer token"


# The one mapping between library errors and HTTP statuses, most specific first: a server
# answers each error with its status (``error_status``); a client turns the status back
# into the error (``error_class``). Anything else a server fails on is a 500.
ERROR_STATUS: tuple[tuple[type[TrajstoreError], int], ...] = (
    (ConflictError, 409), (ValidationError, 422), (StoreUnavailable, 503))
# Statuses a client also reads as one of those errors: a body the server refused before
# reading its events (400 malformed, 413 too large), and what a proxy or gateway in
# between answers while the service is overloaded or restarting (retried).
_CLIENT_ALSO = {400: ValidationError, 413: ValidationError,
                429: StoreUnavailable, 502: StoreUnavailable, 504: StoreUnavailable}
_ERROR_OF_STATUS = {status: cls for cls, status in ERROR_STATUS} | _CLIENT_ALSO


def error_status(e: BaseException) -> int:
    """The status a server answers ``e`` with (``ERROR_STATUS``; 500 for anything else)."""
    return next((status for cls, status in ERROR_STATUS if isinstance(e, cls)), 500)


def error_class(status: int) -> type[TrajstoreError] | None:
    """The library error an error answer's ``status`` stands for (the inverse of ``error_status``,
    plus the body and gateway statuses); None when the status names no library error."""
    return _ERROR_OF_STATUS.get(status)


def error_body(message: str, *, rule: str, index: int | None = None, trajectory_id: str | None = None) -> dict:
    """The JSON body of an error answer."""
    return {"error": {"index": index, "trajectory_id": trajectory_id, "rule": rule, "message": message}}


class HTTPError(Exception):
    """An error answer: ``status`` plus its ``body`` (``error_body``)."""

    def __init__(self, status: int, message: str, *, rule: str, index: int | None = None,
                 trajectory_id: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.rule = rule
        self.body = error_body(message, rule=rule, index=index, trajectory_id=trajectory_id)

    @classmethod
    def from_error(cls, e: BaseException, *, message: str | None = None) -> "HTTPError":
        """409 for a conflict, 422 for another refusal, 503 when the store is
        unreachable (retry), 500 for anything else. ``message`` replaces the
        error's own reason."""
        status = error_status(e)
        if isinstance(e, ValidationError):
            return cls(status, e.reason if message is None else message, rule=e.rule, index=e.index,
                       trajectory_id=e.trajectory_id)
        if isinstance(e, StoreUnavailable):
            return cls(status, str(e) if message is None else message, rule="store_unavailable")
        return cls(status, f"{type(e).__name__}: {e}" if message is None else message, rule="internal")

    def response(self) -> Any:
        """The FastAPI response (401s name the scheme in ``WWW-Authenticate``)."""
        from fastapi.responses import JSONResponse

        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body, status_code=self.status, headers=headers)


def error_response(status: int, message: str, *, rule: str) -> Any:
    """The FastAPI response of an error no event is at fault for."""
    return HTTPError(status, message, rule=rule).response()


def bearer_ok(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (always true without a token;
    the rule is ``trajstore._util.auth``'s, the replay server's too)."""
    return token is None or same_token(bearer_token(header), token)


# What any trajstore server answers without the token: health checks and the API's description.
OPEN_PATHS = frozenset({"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class BearerAuth:
    """ASGI middleware: every HTTP request outside ``open_paths`` needs ``Authorization: Bearer <token>``.

    Deny by default: an endpoint added later is closed unless it is listed
    as open. ``token=None`` lets everything through (the operator chose
    ``--insecure-no-auth``). ``on_deny(scope)`` is called for each refusal
    (the ingest service counts it). ``also_accept(scope)``: another
    credential the server takes instead of the header (the live report's
    cookie, which a browser sends on its own)."""

    def __init__(self, app: Any, token: str | None, open_paths: frozenset = OPEN_PATHS,
                 on_deny: Any = None, also_accept: Callable[[Any], bool] | None = None) -> None:
        self.app, self.token, self.open_paths, self.on_deny = app, token, open_paths, on_deny
        self.also_accept = also_accept

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.token is None or scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if bearer_ok(header, self.token) or (self.also_accept is not None and self.also_accept(scope)):
            await self.app(scope, receive, send)
            return
        if self.on_deny is not None:
            self.on_deny(scope)
        body = json.dumps(error_body(UNAUTHORIZED, rule="unauthorized"), separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-length", str(len(body)).encode()), (b"content-type", b"application/json"),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})


def server_token(token: str | None, *, insecure_no_auth: bool, host: str | None = None) -> str | None:
    """The token a server requires: ``token``, else ``$TRAJSTORE_TOKEN``; ValueError when there is
    none, unless the operator chose to run open (``insecure_no_auth``: then None). Running open is
    warned about unless ``host`` is a loopback address (only this machine reaches the port)."""
    token = token or os.environ.get("TRAJSTORE_TOKEN") or None
    if token is None and not insecure_no_auth:
        raise ValueError("no token: pass --token or set $TRAJSTORE_TOKEN (or --insecure-no-auth to run open)")
    if token is None and not is_loopback(host):
        log.warning("warning: running open (--insecure-no-auth) on %s: anyone who can reach the port can use it; "
                    "bind to 127.0.0.1 or set a token", host or "an unnamed address")
    return token


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` names only this machine (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if host is None:
        return False
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def server_options(*, port: int, token_help: str, open_help: str, group: str | None = None) -> dict[str, Any]:
    """The fields every server's settings hold, each its flag (``trajstore._util.config.option``):
    ``host``, ``port``, ``token``, ``insecure_no_auth``, ``log_level``, by name. A settings class
    declares each (``host: str = options["host"]``).
    ``group``: the title of the argument group their flags go in."""
    from trajstore._util.config import option

    return {
        "host": option("127.0.0.1", group=group, help="address to bind (default 127.0.0.1)"),
        "port": option(port, group=group, help=f"port (default {port})", min=0, max=65535),
        "token": option(None, group=group, help=f"{token_help} (default $TRAJSTORE_TOKEN)"),
        "insecure_no_auth": option(False, group=group, help=open_help),
        "log_level": option("warning", group=group, help="uvicorn log level (default warning)"),
    }


def run_server(app: Any, *, name: str, host: str, port: int, store_url: str | None = None,
               payload: str | None = None, workers: int = 1, log_level: str = "warning", factory: bool = False,
               http: Any = "auto") -> None:
    """Serve ``app`` (an ASGI app, or an import string with ``factory``) with
    uvicorn until SIGINT/SIGTERM, the way both servers start.

    The port is bound here first, so a taken port is one TrajstoreError
    naming it rather than uvicorn's log line and exit code 3. ``trajstore
    NAME: listening on ...`` goes to stderr only once the app answers
    ``/healthz`` on the bound socket: a client started after that line
    connects. ``workers > 1``: that many processes share the socket."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    sock = _bind(host, port)
    try:
        config = uvicorn.Config(app, host=host, port=sock.getsockname()[1], log_level=log_level, access_log=False,
                                factory=factory, workers=workers if workers > 1 else None, http=http)
        server = uvicorn.Server(config)
        stopped = threading.Event()
        where = f"http://{_url_host(host)}:{sock.getsockname()[1]}"
        about = [f"store {_safe_store(store_url)}"] if name == "serve" or store_url else []
        about += [f"payload {payload}"] if payload else []
        line = f"trajstore {name}: listening on {where} ({'; '.join(about + ['Ctrl-C stops'])})"
        threading.Thread(target=_announce_when_up, args=(_probe_url(host, sock), line, stopped), daemon=True,
                         name=f"trajstore-{name}-announce").start()
        interrupted = False
        try:
            if config.workers > 1:
                Multiprocess(config, sockets=[sock]).run()
            else:
                server.run(sockets=[sock])
        except KeyboardInterrupt:
            interrupted = True
        finally:
            stopped.set()
        if config.workers == 1 and not server.started:
            if interrupted:
                raise KeyboardInterrupt  # Ctrl-C while starting: the CLI says "interrupted"
            raise TrajstoreError(f"trajstore {name} did not start on {where} (see the log above)")
    finally:
        sock.close()


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise TrajstoreError(f"cannot listen on {host}:{port}: unknown host ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
        sock.set_inheritable(True)  # the worker processes of workers > 1 serve it
    except OSError as e:
        sock.close()
        hint = {errno.EADDRINUSE: " (another process has it: stop that one or pick another --port)",
                errno.EACCES: " (ports below 1024 need privileges: pick another --port)",
                errno.EADDRNOTAVAIL: " (no interface of this machine has that address: check --host)"}
        raise TrajstoreError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint.get(e.errno, '')}") from None
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _probe_url(host: str, sock: socket.socket) -> str:
    """The /healthz URL on the bound socket (a wildcard address probed on loopback)."""
    address = sock.getsockname()[0]
    if address in ("0.0.0.0", ""):
        address = "127.0.0.1"
    elif address == "::":
        address = "::1"
    return f"http://{_url_host(address)}:{sock.getsockname()[1]}/healthz"


def _announce_when_up(url: str, line: str, stopped: threading.Event, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not stopped.is_set() and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    print(line, file=sys.stderr, flush=True)
                    return
        except OSError:  # not answering yet (URLError, refused, reset)
            pass
        stopped.wait(0.02)


def _safe_store(store_url: str | None) -> str:
    from trajstore.log._backend import safe_url
    from trajstore.store import resolve_url

    return safe_url(resolve_url(store_url))
