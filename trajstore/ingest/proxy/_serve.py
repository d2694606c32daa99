"""How a recording proxy starts: ``trajstore proxy``'s flags, ``serve_proxy``, ``main``."""

import argparse
import json
import os

from trajstore.errors import TrajstoreError
from trajstore.ingest._http import add_server_arguments, run_server, server_token
from trajstore.ingest.proxy._app import normalize_upstream
from trajstore.ingest.proxy._vllm import make_proxy_app
from trajstore.ingest.vllm import VersionMap

__all__ = ["DEFAULT_PORT", "add_cli_arguments", "main", "serve_proxy", "serve_proxy_from_args"]

DEFAULT_PORT = 8701


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


def serve_proxy(upstream: str, store_url: str | None = None, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                token: str | None = None, insecure_no_auth: bool = False, upstream_api_key: str | None = None,
                model_version: int = 0, num_experts: int | None = None, version_map: VersionMap = None,
                skip_recorded_routes: bool = True, log_level: str = "warning",
                payload: str | None = None, pass_through_unrecorded: bool = False) -> None:
    """Run the recording proxy until SIGINT/SIGTERM.

    Refuses to start without a token (``token`` or ``$TRAJSTORE_TOKEN``)
    unless ``insecure_no_auth``, as ``trajstore serve`` does.
    """
    token = server_token(token, insecure_no_auth=insecure_no_auth)
    upstream = normalize_upstream(upstream)  # a bad URL is refused before anything starts
    upstream_api_key = upstream_api_key or os.environ.get("TRAJSTORE_UPSTREAM_API_KEY") or None
    import trajstore

    store = trajstore.connect(store_url, payload=payload)
    try:
        app = make_proxy_app(store, upstream, token=token, model_version=model_version, num_experts=num_experts,
                             upstream_api_key=upstream_api_key, version_map=version_map,
                             skip_recorded_routes=skip_recorded_routes,
                             pass_through_unrecorded=pass_through_unrecorded)
        run_server(app, name="proxy", host=host, port=port, store_url=store_url, payload=payload, log_level=log_level)
    finally:
        store.close()


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
    serve_proxy(args.upstream, getattr(args, "store", None), args.host, args.port, token=args.token,
                insecure_no_auth=args.insecure_no_auth, upstream_api_key=args.upstream_api_key,
                model_version=args.model_version, num_experts=args.num_experts,
                version_map=_version_map_arg(args.version_map), skip_recorded_routes=not args.no_route_skip,
                log_level=args.log_level, payload=getattr(args, "payload", None),
                pass_through_unrecorded=getattr(args, "pass_through_unrecorded", False))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trajstore-proxy", description="OpenAI-compatible recording proxy for vLLM")
    parser.add_argument("--store", default=None, help="store URL (default $TRAJSTORE_URL or the embedded default)")
    add_cli_arguments(parser)
    try:
        serve_proxy_from_args(parser.parse_args(argv))
    except (ValueError, TrajstoreError) as e:
        raise SystemExit(f"trajstore proxy: {e}") from None
