"""``trajstore report --serve``: the report as a live page, read-only, behind a bearer token.

The page keeps one ``GET api/stream`` open (server-sent events). The server
checks every ``refresh_s`` whether the store changed (``CHANGED_SQL``: a few
indexed maxima, no count, one token per kind of write), and only then recomputes the panels
whose tables that kind of write changes (``_sources``; ``panels.collect``,
in one read-only snapshot as ``trajstore sql`` opens it, once whatever the number
of viewers, never more often than twice its own cost); the clock-dependent panels
(stuck trajectories) are recomputed at least every ``MAX_AGE_S`` as well. Each
viewer is sent only the panels whose content changed since what it was sent
last, and the page redraws only those. ``GET api/data`` answers the whole data
at once (scripts, and the static export's format).

Access follows the ingest service's rules (``trajstore serve``): it does not
start without a token (``--token`` or ``$TRAJSTORE_TOKEN``) unless
``--insecure-no-auth``, and every path, the page and its script included,
answers 401 without it. A browser cannot send an ``Authorization`` header on
its own, so ``GET /?token=TOKEN`` trades the token for a cookie (HttpOnly,
SameSite=Strict, a keyed digest of the token rather than the token) and
redirects to ``/``, out of the address bar and history; scripts may send
``Authorization: Bearer TOKEN`` instead. Only GET and HEAD are served.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import hmac
import json
import logging
import socket
import sys
import threading
import time
from typing import Any, Callable
from urllib.parse import parse_qs

from trajstore.errors import StoreUnavailable, TrajstoreError, first_line
from trajstore._util.auth import same_token
from trajstore.ingest._http import BearerAuth, bearer_ok, error_body
from trajstore.inspect import _report_page, _trace
from trajstore.inspect._panels import DEFAULT_STUCK_AFTER_S, collect, plotly_js
from trajstore.inspect._sources import SIGNALS_SQL, moved, tokens

__all__ = ["DEFAULT_PORT", "DEFAULT_REFRESH_S", "make_app", "serve_report"]

log = logging.getLogger("trajstore.inspect.live")  # the logger name logging configs already use

DEFAULT_PORT = 8713
DEFAULT_REFRESH_S = 1.0
# The clock-dependent panels (a running trajectory becomes stuck after --stuck-after-s with no
# event) change with no new event: the data is recomputed at least this often while viewed.
MAX_AGE_S = 30.0
# A stream with nothing new says so this often (a comment line): proxies keep it open, and a
# viewer that went away is noticed.
KEEPALIVE_S = 15.0
COOKIE = "trajstore_report"

# What the panels show changes only when one of these does: an append (every event, training
# lineage and labels included, takes the next log position), a fold (a shard's or a
# projection's checkpoint moves), the background compaction (it counts the expert load of the
# segments noted in agg_expert_pending and settles the groups of agg_groups_delta, deleting
# what it counted). Maxima over primary keys and ix_events_type_position, and tables as small as
# the compaction's lag: nothing that grows with the store. One token per kind of write
# (``_sources``): a recomputation reruns only the SQL of the panels whose tables that kind changes.
CHANGED_SQL = SIGNALS_SQL


def _cookie_value(token: str) -> str:
    return hmac.new(token.encode(), b"trajstore report cookie", hashlib.sha256).hexdigest()


def _cookie_ok(header: str | None, token: str) -> bool:
    want = _cookie_value(token)
    for part in (header or "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE and same_token(value, want):
            return True
    return False


_LOCKED_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>trajstore report: token needed</title></head>
<body style="font-family: sans-serif; max-width: 40em; margin: 3em auto">
<h1>This page needs its token</h1>
<p>The live report reads the run's data, so it asks for the token it was started with
(<code>--token</code> or <code>$TRAJSTORE_TOKEN</code>).</p>
<p>Open the link <code>trajstore report --serve</code> printed when it started
(<code>http://HOST:PORT/?token=TOKEN</code>) once: the page then keeps a cookie and this address works
on its own. A wrong token shows this page again.</p>
</body></html>
"""


def _cookie_of(scope: dict, token: str) -> bool:
    """Whether the request carries the page's cookie (what a browser sends instead of the header)."""
    header = next((v.decode("latin-1") for k, v in reversed(scope["headers"]) if k == b"cookie"), None)
    return _cookie_ok(header, token)


class _Parts:
    """One computed snapshot, cut for pushing: ``head`` (everything but the panels, as JSON
    text), each panel's JSON text and digest in page order, and ``version`` (bumped only when
    some content changed)."""

    __slots__ = ("version", "head", "order", "panels", "digests", "listed")

    def __init__(self, version: int, head: str, order: list[str], panels: dict[str, str], listed: bool = True) -> None:
        self.listed = listed  # the data had a "panels" list
        self.version = version
        self.head = head
        self.order = order
        self.panels = panels
        self.digests = {name: hashlib.blake2b(text.encode(), digest_size=16).digest() for name, text in panels.items()}

    def body(self) -> bytes:
        """The whole data (``GET api/data``): ``collect``'s dict, as JSON."""
        if not self.listed:
            return self.head.encode()
        return (self.head[:-1] + (", " if self.head != "{}" else "") + '"panels": ['
                + ", ".join(self.panels[n] for n in self.order) + "]}").encode()

    def delta(self, sent: dict[str, bytes]) -> str:
        """The message for a viewer that was sent ``sent`` (panel -> digest; updated): the head,
        the panels' order, and only the panels whose content changed."""
        changed = [n for n in self.order if sent.get(n) != self.digests[n]]
        for name in list(sent):
            if name not in self.digests:
                del sent[name]
        for name in changed:
            sent[name] = self.digests[name]
        return ('{"version": %d, "head": %s, "order": %s, "panels": {%s}}'
                % (self.version, self.head, json.dumps(self.order),
                   ", ".join(f"{json.dumps(n)}: {self.panels[n]}" for n in changed)))


_UNASKED = object()


class _Snapshot:
    """The page's data, shared by every viewer. Recomputed only when ``changed()`` (a cheap
    query, asked at most every ``check_s``) says the store moved, or the data is older than
    ``max_age_s``; never more often than ``min_age_s`` and twice its own computing time (a
    big store's views take seconds: the page then refreshes more slowly rather than keep the
    database busy); one computation at a time. ``changed=None``: recomputed on age alone."""

    def __init__(self, compute: Callable[..., dict[str, Any]], min_age_s: float, *,
                 changed: Callable[[], Any] | None = None, check_s: float = 1.0,
                 max_age_s: float = MAX_AGE_S, with_tokens: bool = False) -> None:
        self._compute = compute
        self._with_tokens = with_tokens  # compute(before, now): the change tokens (before None: a full one)
        self._changed = changed
        self._min_age_s = min_age_s
        self._check_s = check_s
        self._max_age_s = max_age_s
        self._lock = threading.Lock()
        self._at = 0.0
        self._took = 0.0
        self._checked_at = -math.inf
        self._token: Any = None
        self._parts: _Parts | None = None
        self._texts: dict[str, tuple[Any, str]] = {}
        self.computed = 0

    def _due(self, now: float) -> tuple[bool, Any]:
        """Whether to recompute now, and the change query's answer when this asked it
        (``_UNASKED`` otherwise: the recomputation asks it then, once)."""
        if self._parts is None:
            return True, _UNASKED
        age = now - self._at
        if age < max(self._min_age_s, 2 * self._took):
            return False, _UNASKED
        if self._changed is None or age >= self._max_age_s:
            return True, _UNASKED
        if now - self._checked_at < self._check_s:
            return False, _UNASKED
        self._checked_at = now
        token = self._changed()
        return token != self._token, token

    def parts(self) -> _Parts:
        with self._lock:
            now = time.monotonic()
            due, token = self._due(now)
            if due:
                from plotly.utils import PlotlyJSONEncoder

                start = time.monotonic()
                full = token is _UNASKED  # the first, or one on age alone: everything is recomputed
                if full:
                    token = self._changed() if self._changed is not None else None
                data = self._compute(None if full else self._token, token) if self._with_tokens else self._compute()
                listed = "panels" in data
                texts = self._texts  # a panel collect returned again (the same object) keeps its JSON text
                self._texts = {p["name"]: (p, texts[p["name"]][1] if p["name"] in texts and texts[p["name"]][0] is p
                                           else json.dumps(p, cls=PlotlyJSONEncoder)) for p in data.pop("panels", [])}
                panels = {name: text for name, (_, text) in self._texts.items()}
                head = json.dumps(data, cls=PlotlyJSONEncoder)
                before = self._parts
                version = 1 if before is None else before.version
                if before is not None and (before.head != head or before.panels != panels):
                    version += 1
                self._parts = _Parts(version, head, list(panels), panels, listed)
                self._token = token
                self._at = self._checked_at = time.monotonic()
                self._took = self._at - start
                self.computed += 1
            return self._parts

    def get(self) -> bytes:
        return self.parts().body()


def make_app(url: str | None, *, token: str | None, title: str = "trajstore report",
             refresh_s: float = DEFAULT_REFRESH_S, stuck_after_s: float = DEFAULT_STUCK_AFTER_S,
             payload: str | None = None, tokenizer: str | None = None, compare: str | None = None) -> Any:
    """The ASGI app of the live page over store ``url``. ``token=None``: no auth (the caller decided).
    ``payload``: the store's payload location when not the default. ``tokenizer``: a tokenizer.json
    (or its directory) the trace view decodes tokens with (None: it shows ids). ``compare``: a second
    store whose run is drawn on the same panels (``trajstore.inspect._compare``)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
    from starlette.routing import Route

    from trajstore.inspect.sql import READER_ROLE, read_only
    from trajstore.log._registry import backend_of
    from trajstore.store import resolve_url

    _check_refresh(refresh_s)
    payload = _report_page.payload_location(url, payload)
    resolved = resolve_url(url)

    memo: dict[str, Any] = {}  # the panels drawn last time: unchanged rows are not drawn again
    other = None if compare is None else (resolve_url(compare), _report_page.payload_location(compare, None), {})

    def compute(before: Any, now: Any) -> dict[str, Any]:
        """The page's data; ``before``/``now``: each store's change tokens at the last computation and
        now (``before`` None: recompute every panel's SQL)."""
        kinds = [None if before is None else moved(before[i], now[i]) for i in range(len(now))]
        with read_only(url) as query:
            data = collect(query, stuck_after_s=stuck_after_s, payload=payload, memo=memo, moved=kinds[0])
        if other is None:
            return data
        from trajstore.inspect._compare import merge, store_labels

        with read_only(other[0]) as query:
            data_b = collect(query, stuck_after_s=stuck_after_s, payload=other[1], memo=other[2], moved=kinds[1])
        return merge(data, data_b, store_labels(_report_page.store_label(url), _report_page.store_label(other[0])))

    def changed() -> Any:
        # the schema was brought up to date when the first snapshot was computed: straight to the backend
        out = []
        for at in (resolved,) if other is None else (resolved, other[0]):
            with backend_of(at).read_only(at, None, READER_ROLE) as query:
                out.append(tokens(query(CHANGED_SQL)[1][0]))
        return tuple(out)

    snapshot = _Snapshot(compute, min_age_s=min(refresh_s, 0.25), changed=changed, check_s=refresh_s,
                         with_tokens=True)
    label = _report_page.store_label(url) + ("" if compare is None else f" compared with {_report_page.store_label(compare)}")
    index = _report_page.page(title, label, live=True, refresh_s=refresh_s).encode()
    script = plotly_js().encode()
    script_etag = '"' + hashlib.sha256(script).hexdigest()[:32] + '"'

    async def get_index(request: Any) -> Any:
        return HTMLResponse(index, headers={"Cache-Control": "no-store"})

    async def get_script(request: Any) -> Any:
        if request.headers.get("if-none-match") == script_etag:
            return Response(status_code=304, headers={"ETag": script_etag})
        return Response(script, media_type="application/javascript",
                        headers={"ETag": script_etag, "Cache-Control": "private, max-age=3600"})

    async def parts() -> tuple[_Parts | None, dict[str, Any] | None, int]:
        """The snapshot, or the error body and status a viewer is told instead."""
        try:
            return await run_in_threadpool(snapshot.parts), None, 200
        except StoreUnavailable as e:
            return None, error_body(str(e), rule="store_unavailable"), 503
        except TrajstoreError as e:
            return None, error_body(str(e), rule="store_error"), 503
        except Exception as e:  # noqa: BLE001 - a driver error mid-run: say so, the page keeps its last data
            log.exception("report data failed")
            return None, error_body(f"{type(e).__name__}: {first_line(e)}", rule="internal"), 500

    async def get_data(request: Any) -> Any:
        got, problem, status = await parts()
        if got is None:
            return JSONResponse(problem, status_code=status)
        return Response(got.body(), media_type="application/json", headers={"Cache-Control": "no-store"})

    async def get_stream(request: Any) -> Any:
        async def events() -> Any:
            sent: dict[str, bytes] = {}
            version, said, quiet_since = None, None, time.monotonic()
            yield f"retry: {int(refresh_s * 1000)}\n\n"
            while True:
                got, problem, _ = await parts()
                if got is None:
                    text = json.dumps(problem)
                    if text != said:  # once per distinct problem; the page keeps its last data
                        said = text
                        yield f"event: problem\ndata: {text}\n\n"
                elif got.version != version:
                    version, said, quiet_since = got.version, None, time.monotonic()
                    yield f"data: {got.delta(sent)}\n\n"
                if time.monotonic() - quiet_since >= KEEPALIVE_S:
                    quiet_since = time.monotonic()
                    yield ": nothing new\n\n"
                await asyncio.sleep(min(refresh_s, 0.25))

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def healthz(request: Any) -> Any:
        return JSONResponse({"status": "ok"})

    routes = [Route("/", get_index, methods=["GET", "HEAD"]),
              Route(f"/{_report_page.PLOTLY_JS}", get_script, methods=["GET", "HEAD"]),
              Route("/api/data", get_data, methods=["GET", "HEAD"]),
              Route("/api/stream", get_stream, methods=["GET"]),
              Route("/healthz", healthz, methods=["GET", "HEAD"]),
              *_trace.live_routes(url, payload, _report_page.store_label(url), tokenizer)]  # the trace view
    # Deny by default, as on every trajstore server; no path is open, not even /healthz (the page is the run's data).
    inner = BearerAuth(Starlette(routes=routes), token, open_paths=frozenset(),
                       also_accept=None if token is None else lambda scope: _cookie_of(scope, token))

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if token is not None and scope["type"] == "http" and scope["path"] == "/" and scope["method"] in ("GET", "HEAD"):
            given = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token")
            if given and same_token(given[-1], token):
                response: Any = RedirectResponse("./", status_code=303)
                response.set_cookie(COOKIE, _cookie_value(token), httponly=True, samesite="strict", path="/")
                await response(scope, receive, send)
                return
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            if not (bearer_ok(header, token) or _cookie_of(scope, token)):
                # a browser without the token: a page that says how to open it (the API answers JSON)
                await HTMLResponse(_LOCKED_PAGE, status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
                return
        await inner(scope, receive, send)

    return app


class _Server:
    """uvicorn on a socket bound here (a taken port is one clear error, before anything is printed),
    saying "listening" once it is."""

    def __init__(self, app: Any, sock: socket.socket, log_level: str, announce: str) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            async def startup(self, sockets: Any = None) -> None:
                await super().startup(sockets=sockets)
                if not self.should_exit:
                    print(announce, file=sys.stderr, flush=True)

        self.sock = sock
        # open streams (api/stream) never end on their own: a stop closes them after a grace
        self.server = Server(uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                                            timeout_graceful_shutdown=1))

    def run(self) -> None:
        self.server.run(sockets=[self.sock])


def _check_refresh(refresh_s: float) -> None:
    if not (isinstance(refresh_s, (int, float)) and math.isfinite(refresh_s) and refresh_s > 0):
        # NaN would reach the page's JSON, and the page would never redraw
        raise TrajstoreError(f"--refresh-s must be a positive number of seconds, got {refresh_s!r}")


def serve_report(url: str | None, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT, token: str | None,
                 title: str = "trajstore report", refresh_s: float = DEFAULT_REFRESH_S,
                 stuck_after_s: float = DEFAULT_STUCK_AFTER_S, log_level: str = "warning",
                 payload: str | None = None, tokenizer: str | None = None, compare: str | None = None) -> None:
    """Serve the live page until SIGINT/SIGTERM. ``token=None`` serves it open (the caller decided).
    ``tokenizer``: what the trace view decodes tokens with; ``compare``: a second store (``make_app``)."""
    server = report_server(url, host=host, port=port, token=token, title=title, refresh_s=refresh_s,
                           stuck_after_s=stuck_after_s, log_level=log_level, payload=payload, tokenizer=tokenizer,
                           compare=compare)
    try:
        server.run()
    finally:
        server.sock.close()


def page_url(host: str, port: int, token: str | None) -> str:
    """The page's address, with the token when there is one (a link that opens it, as Jupyter prints)."""
    from urllib.parse import quote

    shown = f"[{host}]" if ":" in host else host
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else shown)
    return f"http://{shown}:{port}/" + ("" if token is None else f"?token={quote(token, safe='')}")


def report_server(url: str | None, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT, token: str | None,
                  title: str = "trajstore report", refresh_s: float = DEFAULT_REFRESH_S,
                  stuck_after_s: float = DEFAULT_STUCK_AFTER_S, log_level: str = "warning",
                  payload: str | None = None, tokenizer: str | None = None, compare: str | None = None) -> "_Server":
    """The live page's server, its port bound, not yet serving: ``.run()`` serves (in any thread;
    signals are handled only in the main one), ``.server.should_exit = True`` stops it."""
    from trajstore.inspect.sql import read_only

    _check_refresh(refresh_s)
    with read_only(url) as query:  # a wrong store URL or login fails here, in one line, before serving
        collect(query, stuck_after_s=stuck_after_s, payload=_report_page.payload_location(url, payload, query))
    if compare is not None:
        with read_only(compare) as query:  # the compared store too
            collect(query, stuck_after_s=stuck_after_s, payload=_report_page.payload_location(compare, None, query))
    app = make_app(url, token=token, title=title, refresh_s=refresh_s, stuck_after_s=stuck_after_s, payload=payload,
                   tokenizer=tokenizer, compare=compare)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family = infos[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(infos[0][4])
        sock.listen(128)
    except OSError as e:
        raise TrajstoreError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    bound = sock.getsockname()[1]
    where = f"http://{host}:{bound}/"
    announce = (f"trajstore report: listening on {where} (store {_report_page.store_label(url)}; checks for changes every {refresh_s:g} s; "
                + ("" if token is not None else "WARNING: no token, anyone who can reach the port can read the run; ")
                + "Ctrl-C stops)"
                # the link with the token, as Jupyter prints it: once opened, the page keeps a cookie
                + (f"; open the page: {page_url(host, bound, token)}" if token is not None else ""))
    return _Server(app, sock, log_level, announce)
