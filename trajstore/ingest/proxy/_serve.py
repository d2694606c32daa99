"""How a recording proxy starts: one start path (``serve``) for every engine, of the settings
``ProxyConfig`` holds (``_config``: each field is one ``trajstore proxy`` flag); ``serve_proxy``
and ``main`` are its keyword and command-line faces."""

import argparse
import os
from dataclasses import replace
from typing import Any, Callable

from trajstore._util.config import add_flags
from trajstore.errors import TrajstoreError
from trajstore.ingest._http import run_server, server_token
from trajstore.ingest.proxy._app import normalize_upstream
from trajstore.ingest.proxy._config import DEFAULT_PORT, ENGINES, ProxyConfig
from trajstore.ingest.proxy._sglang import sglang_app
from trajstore.ingest.proxy._vllm import vllm_app
from trajstore.ingest.vllm import VersionMap

__all__ = ["DEFAULT_PORT", "ENGINES", "ProxyConfig", "add_cli_arguments", "main", "serve", "serve_proxy",
           "serve_proxy_from_args"]

UPSTREAM_API_KEY_ENV = "TRAJSTORE_UPSTREAM_API_KEY"


# --engine -> (store, config, token, upstream key) -> the engine's app; its keys are ENGINES
_APPS: dict[str, Callable[[Any, ProxyConfig, str | None, str | None], Any]] = {
    "vllm": vllm_app, "sglang": sglang_app,
}


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
    """The flags of ``trajstore proxy``: one per ``ProxyConfig`` field (``--store`` and ``--payload``
    are the CLI's global flags)."""
    add_flags(parser, ProxyConfig)


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
