"""How a recording proxy starts: its settings (``ProxyConfig``), built from ``trajstore proxy``'s
flags in one place, and one start path (``serve``) for every engine; ``serve_proxy`` and ``main``
are its keyword and command-line faces."""

import argparse
import json
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from trajstore.errors import TrajstoreError, ValidationError
from trajstore.ingest._group_commit import DEFAULT_LINGER_S, DEFAULT_MAX_GROUP_BYTES
from trajstore.ingest._http import add_server_arguments, run_server, server_token
from trajstore.ingest.proxy._app import normalize_upstream, version_label_events
from trajstore.ingest.proxy._sglang import make_sglang_proxy_app
from trajstore.ingest.proxy._vllm import make_proxy_app
from trajstore.ingest.sglang import route_layout as _route_layout
from trajstore.ingest.vllm import VersionMap

__all__ = ["DEFAULT_PORT", "ENGINES", "ProxyConfig", "add_cli_arguments", "main", "serve", "serve_proxy",
           "serve_proxy_from_args"]

DEFAULT_PORT = 8701
UPSTREAM_API_KEY_ENV = "TRAJSTORE_UPSTREAM_API_KEY"


@dataclass(frozen=True)
class ProxyConfig:
    """Every setting of a recording proxy: what ``trajstore proxy`` builds from its flags
    (:meth:`from_args`), ``serve_proxy`` from its keywords, and :func:`serve` runs.

    The engine's app reads the calls' part (``upstream`` ... ``pass_through_unrecorded``);
    ``serve`` the rest (the token, where the store is, where to listen)."""

    upstream: str
    """The engine's base URL (a trailing ``/v1`` is dropped: :func:`normalize_upstream`)."""
    engine: str = "vllm"
    """The inference server behind the proxy: one of ``ENGINES``."""
    store_url: str | None = None
    """Store URL (None: ``$TRAJSTORE_URL`` or the embedded default)."""
    payload: str | None = None
    """Where payload segments go when the store does not say (``connect(payload=)``)."""
    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = DEFAULT_PORT
    """Port to bind (0: any free port)."""
    token: str | None = None
    """Bearer token callers must send; ``serve`` falls back to ``$TRAJSTORE_TOKEN`` and refuses to
    start without one unless ``insecure_no_auth``."""
    insecure_no_auth: bool = False
    """Let ``serve`` run without a token."""
    upstream_api_key: str | None = None
    """Bearer token sent to the engine; ``serve`` falls back to ``$TRAJSTORE_UPSTREAM_API_KEY``."""
    model_version: int = 0
    """Model version of a call without ``X-Trajstore-Model-Version``."""
    num_experts: int | None = None
    """``num_experts`` of the trajectories the proxy starts (None: not declared)."""
    version_map: VersionMap = None
    """Weight-version labels -> model versions, appended to the store's label map at start (vLLM
    also takes a callable, applied to the spans it records)."""
    route_layout: tuple[int, int] | None = None
    """SGLang: the model's (layers, topk), for calls without ``X-Trajstore-Route-Layout``."""
    skip_recorded_routes: bool = True
    """Ask the engine for only the route rows the trajectory has not recorded."""
    pass_through_unrecorded: bool = False
    """A named call the store cannot take still gets the engine's answer, with ``X-Trajstore-Error``."""
    linger_s: float = DEFAULT_LINGER_S
    """How long a call's record waits for other calls to share its payload object and index
    transaction (Kafka's ``linger.ms``; 0: appended as soon as a committer is free)."""
    max_batch_bytes: int = DEFAULT_MAX_GROUP_BYTES
    """A group of records' bound in bytes (Kafka's ``batch.size``): a full group is appended at once."""
    log_level: str = "warning"
    """uvicorn's log level."""

    def __post_init__(self) -> None:
        if not self.linger_s >= 0:
            raise ValueError(f"--linger-ms must be 0 or more, got {self.linger_s * 1e3!r}")
        if not self.max_batch_bytes >= 1:
            raise ValueError(f"--max-batch-mb must be more than 0, got {self.max_batch_bytes / (1 << 20)!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.route_layout is not None and self.engine != "sglang":
            raise ValueError("--route-layout is for --engine sglang (vLLM's routes carry their shape)")
        if self.version_map is not None and not isinstance(self.version_map, Mapping) and self.engine != "vllm":
            raise ValueError("a callable version_map is for --engine vllm; SGLang's spans are resolved by the store")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ProxyConfig":
        """The settings ``add_cli_arguments``' flags parsed into ``args`` stand for."""
        engine = getattr(args, "engine", "vllm")
        layout = getattr(args, "route_layout", None)
        if layout is not None and engine == "sglang":
            try:
                layout = _route_layout(layout)
            except ValidationError as e:
                raise ValueError(f"--route-layout: {e.reason}") from None
        return cls(upstream=args.upstream, engine=engine, store_url=getattr(args, "store", None),
                   payload=getattr(args, "payload", None), host=args.host, port=args.port, token=args.token,
                   insecure_no_auth=args.insecure_no_auth, upstream_api_key=args.upstream_api_key,
                   model_version=args.model_version, num_experts=args.num_experts,
                   version_map=_version_map_arg(args.version_map), route_layout=layout,
                   skip_recorded_routes=not args.no_route_skip,
                   pass_through_unrecorded=getattr(args, "pass_through_unrecorded", False),
                   linger_s=getattr(args, "linger_ms", DEFAULT_LINGER_S * 1e3) / 1e3,
                   max_batch_bytes=int(getattr(args, "max_batch_mb", DEFAULT_MAX_GROUP_BYTES / (1 << 20)) * (1 << 20)),
                   log_level=args.log_level)


def _vllm_app(store: Any, config: ProxyConfig, token: str | None, upstream_api_key: str | None) -> Any:
    return make_proxy_app(store, config.upstream, token=token, model_version=config.model_version,
                          num_experts=config.num_experts, upstream_api_key=upstream_api_key,
                          version_map=config.version_map, skip_recorded_routes=config.skip_recorded_routes,
                          pass_through_unrecorded=config.pass_through_unrecorded, linger_s=config.linger_s,
                          max_batch_bytes=config.max_batch_bytes)


def _sglang_app(store: Any, config: ProxyConfig, token: str | None, upstream_api_key: str | None) -> Any:
    if config.version_map:  # the store resolves SGLang's span labels through its label map
        store.append(version_label_events(config.version_map))
    return make_sglang_proxy_app(store, config.upstream, token=token, model_version=config.model_version,
                                 num_experts=config.num_experts, upstream_api_key=upstream_api_key,
                                 route_layout=config.route_layout, skip_recorded_routes=config.skip_recorded_routes,
                                 pass_through_unrecorded=config.pass_through_unrecorded, linger_s=config.linger_s,
                                 max_batch_bytes=config.max_batch_bytes)


# --engine -> (store, config, token, upstream key) -> the engine's app
_APPS: dict[str, Callable[[Any, ProxyConfig, str | None, str | None], Any]] = {
    "vllm": _vllm_app, "sglang": _sglang_app,
}
ENGINES = tuple(_APPS)


def serve(config: ProxyConfig) -> None:
    """Run the recording proxy ``config`` describes until SIGINT/SIGTERM.

    Refuses to start without a token (``config.token`` or ``$TRAJSTORE_TOKEN``)
    unless ``insecure_no_auth``, as ``trajstore serve`` does; a bad upstream URL
    is refused before anything starts."""
    token = server_token(config.token, insecure_no_auth=config.insecure_no_auth, host=config.host)
    config = replace(config, upstream=normalize_upstream(config.upstream))
    upstream_api_key = config.upstream_api_key or os.environ.get(UPSTREAM_API_KEY_ENV) or None
    from trajstore.store import connect

    store = connect(config.store_url, payload=config.payload)
    try:
        app = _APPS[config.engine](store, config, token, upstream_api_key)
        run_server(app, name="proxy", host=config.host, port=config.port, store_url=config.store_url,
                   payload=config.payload, log_level=config.log_level)
    finally:
        store.close()


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``trajstore proxy`` (``--store`` is the CLI's global flag)."""
    parser.add_argument("--upstream", required=True, help="base URL of the vLLM server, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped)")
    add_server_arguments(parser, port=DEFAULT_PORT, open_help="accept calls without a token",
                         token_help="bearer token every call but /healthz and the API docs must send")
    parser.add_argument("--upstream-api-key", default=None,
                        help="bearer token sent to the upstream (default $TRAJSTORE_UPSTREAM_API_KEY; none)")
    parser.add_argument("--model-version", type=int, default=0,
                        help="model version recorded when a call has no X-Trajstore-Model-Version header (default 0)")
    parser.add_argument("--num-experts", type=int, default=None,
                        help="num_experts of trajectories the proxy starts (default: not declared)")
    parser.add_argument("--version-map", default=None,
                        help='JSON object from vLLM weight-version labels to model versions, e.g. \'{"ckpt-a": 3}\', '
                             "appended to the store's label map at start (labels can also be mapped later with "
                             "version_label events; decimal labels and \"default\" need none)")
    parser.add_argument("--no-route-skip", action="store_true",
                        help="never ask the engine for only the new route rows (routed_experts_prompt_start)")
    parser.add_argument("--pass-through-unrecorded", action="store_true",
                        help="a named call the store cannot take (a finished trajectory reused, an answer that cannot "
                             "be read) still gets the engine's answer, with X-Trajstore-Error (counted in /metrics); "
                             "default: the harness gets an error status with the reason")
    parser.add_argument("--engine", choices=ENGINES, default="vllm",
                        help="the inference server behind the proxy (default vllm)")
    parser.add_argument("--route-layout", default=None, metavar="LAYERSxTOPK",
                        help="SGLang: the model's num_hidden_layers x num_experts_per_tok, e.g. 48x8; SGLang's "
                             "routes carry no shape (default: only calls sending X-Trajstore-Route-Layout get routes)")
    from trajstore._util.argtypes import number
    parser.add_argument("--linger-ms", type=number(float, min=0), default=DEFAULT_LINGER_S * 1e3,
                        help="how long a call's record waits for other calls to share its payload object and index "
                             f"transaction (default {DEFAULT_LINGER_S * 1e3:g}; 0: append at once)")
    parser.add_argument("--max-batch-mb", type=number(float, min=0, min_exclusive=True),
                        default=DEFAULT_MAX_GROUP_BYTES / (1 << 20),
                        help="a group of records' bound in MiB: a full group is appended without waiting out the "
                             f"linger (default {DEFAULT_MAX_GROUP_BYTES / (1 << 20):g})")


def serve_proxy(upstream: str, store_url: str | None = None, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                token: str | None = None, insecure_no_auth: bool = False, upstream_api_key: str | None = None,
                model_version: int = 0, num_experts: int | None = None, version_map: VersionMap = None,
                skip_recorded_routes: bool = True, log_level: str = "warning",
                payload: str | None = None, pass_through_unrecorded: bool = False) -> None:
    """Run the recording proxy in front of vLLM until SIGINT/SIGTERM (:func:`serve` of these settings).

    Refuses to start without a token (``token`` or ``$TRAJSTORE_TOKEN``)
    unless ``insecure_no_auth``, as ``trajstore serve`` does.
    """
    serve(ProxyConfig(upstream=upstream, store_url=store_url, host=host, port=port, token=token,
                      insecure_no_auth=insecure_no_auth, upstream_api_key=upstream_api_key,
                      model_version=model_version, num_experts=num_experts, version_map=version_map,
                      skip_recorded_routes=skip_recorded_routes, log_level=log_level, payload=payload,
                      pass_through_unrecorded=pass_through_unrecorded))


def _version_map_arg(text: str | None) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--version-map is not JSON ({e})") from None
    if not isinstance(value, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        raise ValueError("--version-map must be a JSON object of integers, e.g. '{\"ckpt-a\": 3}'")
    return value


def serve_proxy_from_args(args: argparse.Namespace) -> None:
    """Run the proxy ``add_cli_arguments``' flags describe (``--engine`` picks the engine)."""
    serve(ProxyConfig.from_args(args))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trajstore-proxy", description="OpenAI-compatible recording proxy for vLLM or SGLang")
    parser.add_argument("--store", default=None, help="store URL (default $TRAJSTORE_URL or the embedded default)")
    add_cli_arguments(parser)
    try:
        serve_proxy_from_args(parser.parse_args(argv))
    except (ValueError, TrajstoreError) as e:
        raise SystemExit(f"trajstore proxy: {e}") from None
