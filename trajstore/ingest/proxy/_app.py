"""A recording proxy's FastAPI app: the routes an engine's module lists, then ``POST
/trajstore/finish``, ``GET /healthz`` and ``GET /metrics``, behind the token; the recorder and the
metrics it runs with; the upstream URL and the ``--version-map`` labels checked."""

# No ``from __future__ import annotations``: FastAPI reads the handlers'
# annotations at runtime.
import logging
from typing import Any, Callable, Mapping

# OPEN_PATHS: open without the token, as on every trajstore server (they change nothing, show no recorded data)
from trajstore.ingest._group_commit import DEFAULT_LINGER_S, DEFAULT_MAX_GROUP_BYTES
from trajstore.ingest._http import OPEN_PATHS, BearerAuth
from trajstore.ingest.proxy._forward import _UpstreamForwarder
from trajstore.ingest.proxy._metrics import _ProxyMetrics
from trajstore.ingest.proxy._record import Recorder

log = logging.getLogger("trajstore.ingest.proxy")


def normalize_upstream(url: str) -> str:
    """The upstream's base URL without a trailing ``/v1`` (the OpenAI ``base_url`` habit).

    The proxy appends the full paths itself (``/v1/completions``,
    ``/inference/v1/generate``, ``/pause``), so ``http://h:8000/v1`` means
    ``http://h:8000``. ValueError, in one line, for anything that is not an
    http(s) URL with a host.
    """
    from urllib.parse import urlsplit

    text = (url or "").strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--upstream must be an http(s) URL with a host, e.g. http://127.0.0.1:8000, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"--upstream must not have a query or fragment, got {url!r}")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"--upstream has a bad port: {url!r}") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
        log.info("upstream %s: using %s (the proxy adds the /v1 paths itself)", url, f"{parts.scheme}://{parts.netloc}{path}")
    return f"{parts.scheme}://{parts.netloc}{path}"


def version_label_events(version_map: Mapping[Any, int]) -> list[dict]:
    """``version_label`` events for a ``{label: model_version}`` map (``--version-map``)."""
    out = []
    for label, version in version_map.items():
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"--version-map: label {label!r} must map to an integer model version, got {version!r}")
        out.append({"type": "version_label", "label": str(label), "model_version": version})
    return out


def _proxy_app(fwd: _UpstreamForwarder, *, title: str, token: str | None,
              routes: list[tuple[str, str, str, Callable[[Any], Any]]], on_close: Callable[[], None] | None = None,
              metrics: Any = None) -> Any:
    """The FastAPI app of a recording proxy: ``routes`` (method, path, name, ``call(request)``), then
    ``POST /trajstore/finish``, ``GET /healthz`` and, with ``metrics`` (an ingest ``Metrics``, whose
    registry holds the forwarder's counters), ``GET /metrics``; every path but ``OPEN_PATHS`` and
    ``/metrics`` behind the token (``token=None``: no auth). Its shutdown closes the upstream client,
    then ``on_close()``."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse

    @asynccontextmanager
    async def lifespan(app: Any):
        yield
        await fwd.client.aclose()
        if on_close is not None:
            on_close()

    app = FastAPI(title=title, version="1", lifespan=lifespan)
    app.state.recorder = fwd.recorder
    if token is not None:
        # Prometheus scrapes without a token, as on the ingest service; counters carry no recorded data
        app.add_middleware(BearerAuth, token=token, open_paths=OPEN_PATHS | {"/metrics"})

    def handler_of(call: Callable[[Any], Any]) -> Callable:
        async def handler(request: Request) -> Any:
            return await call(request)
        return handler

    for method, path, name, call in routes:
        app.add_api_route(path, handler_of(call), methods=[method], name=name)

    @app.post("/trajstore/finish")
    async def finish(request: Request) -> Any:
        return await fwd.finish(request)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    if metrics is not None:
        @app.get("/metrics", response_class=PlainTextResponse)
        async def get_metrics() -> str:
            return metrics.render()

    return app


def _recorder_and_metrics(store: Any, group_commit: bool, linger_s: float = DEFAULT_LINGER_S,
                          max_batch_bytes: int = DEFAULT_MAX_GROUP_BYTES) -> tuple[Recorder, Any, _ProxyMetrics, Any]:
    """A proxy's recorder (group-committing unless told not to: calls of many trajectories share a
    payload object and an index transaction, each waiting up to ``linger_s`` for others, a group
    bounded by ``max_batch_bytes``), its ingest ``Metrics`` (the commits and the registry ``GET
    /metrics`` renders), its ``_ProxyMetrics``, and what to call at shutdown."""
    from trajstore.ingest.service import GroupCommitter, Metrics

    metrics = Metrics()
    committer = (GroupCommitter(store, metrics=metrics, max_wait_s=0.0, linger_s=linger_s,
                                max_group_bytes=max_batch_bytes) if group_commit else None)
    # closing the committer appends what is queued first
    return (Recorder(store, committer), metrics, _ProxyMetrics(metrics.registry),
            None if committer is None else committer.close)


def _engine_app(forwarder: type, store: Any, config: Any, *, title: str, forwarded: Any, token: str | None,
                upstream_api_key: str | None, group_commit: bool = True, timeout_s: float = 600.0,
                **engine: Any) -> Any:
    """An engine's proxy app, set up by ``config`` (a ``ProxyConfig``, read here and only here): the
    ``version_map`` labels appended to the store, a ``forwarder`` (an ``_UpstreamForwarder`` class,
    also given the ``engine``'s own settings) for the normalized upstream, its recorded paths and the
    ``forwarded`` (method, path) pairs as routes, the recorder and metrics of
    :func:`_recorder_and_metrics`. ``app.state.forwarder`` and ``app.state.commit_metrics`` hold them."""
    if isinstance(config.version_map, Mapping):
        # The labels go into the store's label map: every process resolves them, and a
        # trajectory held back on one of them is released.
        store.append(version_label_events(config.version_map))
    recorder, metrics, proxy_metrics, on_close = _recorder_and_metrics(store, group_commit, config.linger_s,
                                                                       config.max_batch_bytes)
    fwd = forwarder(recorder, normalize_upstream(config.upstream), authenticated=token is not None,
                    metrics=proxy_metrics, model_version=config.model_version, num_experts=config.num_experts,
                    timeout_s=timeout_s, upstream_api_key=upstream_api_key,
                    skip_recorded_routes=config.skip_recorded_routes, pass_through=config.pass_through_unrecorded,
                    **engine)

    def recorded(path: str) -> Callable:
        return lambda request: fwd.forward(request, path)

    def relayed(path: str) -> Callable:
        return lambda request: fwd.relay(request, path)

    routes = [("POST", path, f"record {path}", recorded(path)) for path in fwd.recorded]
    routes += [(method, path, f"forward {method} {path}", relayed(path)) for method, path in forwarded]
    app = _proxy_app(fwd, title=title, token=token, routes=routes, on_close=on_close, metrics=metrics)
    app.state.forwarder = fwd
    app.state.commit_metrics = metrics
    return app
