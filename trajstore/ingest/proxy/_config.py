"""A recording proxy's settings (``ProxyConfig``): each field is also its ``trajstore proxy``
flag (``trajstore._util.config``), and the engines' app builders take the settings whole."""

import json
from dataclasses import dataclass
from typing import Any, Literal, Mapping, get_args

from trajstore._util.config import config_from_args, option
from trajstore.errors import ValidationError
from trajstore.ingest._group_commit import DEFAULT_LINGER_S, DEFAULT_MAX_GROUP_BYTES
from trajstore.ingest._http import server_options
from trajstore.ingest.sglang import route_layout as _route_layout
from trajstore.ingest.vllm import VersionMap

DEFAULT_PORT = 8701


def _version_map_arg(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--version-map is not JSON ({e})") from None
    if not isinstance(value, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        raise ValueError("--version-map must be a JSON object of integers, e.g. '{\"ckpt-a\": 3}'")
    return value


_SERVER = server_options(port=DEFAULT_PORT, open_help="accept calls without a token",
                         token_help="bearer token every call but /healthz and the API docs must send")


@dataclass(frozen=True)
class ProxyConfig:
    """Every setting of a recording proxy: what ``trajstore proxy`` builds from its flags
    (:meth:`from_args`; each field is one flag), ``serve_proxy`` from its keywords, and ``serve`` runs.

    The engine's app reads the calls' part (``upstream`` ... ``max_batch_bytes``);
    ``serve`` the rest (the token, where the store is, where to listen)."""

    upstream: str = option(help="base URL of the vLLM server, e.g. http://127.0.0.1:8000 (a trailing /v1 is dropped)")
    """The engine's base URL (a trailing ``/v1`` is dropped: ``normalize_upstream``)."""
    engine: Literal["vllm", "sglang"] = option("vllm", help="the inference server behind the proxy (default vllm)")
    """The inference server behind the proxy: one of ``ENGINES``."""
    store_url: str | None = option(None, flag=None, dest="store", help="store URL (the CLI's global --store)")
    """Store URL (None: ``$TRAJSTORE_URL`` or the embedded default)."""
    payload: str | None = option(None, flag=None, help="payload location (the CLI's global --payload)")
    """Where payload segments go when the store does not say (``connect(payload=)``)."""
    host: str = _SERVER["host"]
    """Address to bind."""
    port: int = _SERVER["port"]
    """Port to bind (0: any free port)."""
    token: str | None = _SERVER["token"]
    """Bearer token callers must send; ``serve`` falls back to ``$TRAJSTORE_TOKEN`` and refuses to
    start without one unless ``insecure_no_auth``."""
    insecure_no_auth: bool = _SERVER["insecure_no_auth"]
    """Let ``serve`` run without a token."""
    upstream_api_key: str | None = option(
        None, help="bearer token sent to the upstream (default $TRAJSTORE_UPSTREAM_API_KEY; none)")
    """Bearer token sent to the engine; ``serve`` falls back to ``$TRAJSTORE_UPSTREAM_API_KEY``."""
    model_version: int = option(0, help="model version recorded when a call has no X-Trajstore-Model-Version "
                                        "header (default 0)")
    """Model version of a call without ``X-Trajstore-Model-Version``."""
    num_experts: int | None = option(None, help="num_experts of trajectories the proxy starts (default: not declared)")
    """``num_experts`` of the trajectories the proxy starts (None: not declared)."""
    version_map: VersionMap = option(
        None, parse=_version_map_arg,
        help='JSON object from vLLM weight-version labels to model versions, e.g. \'{"ckpt-a": 3}\', '
             "appended to the store's label map at start (labels can also be mapped later with "
             "version_label events; decimal labels and \"default\" need none)")
    """Weight-version labels -> model versions, appended to the store's label map at start (vLLM
    also takes a callable, applied to the spans it records)."""
    route_layout: tuple[int, int] | None = option(
        None, metavar="LAYERSxTOPK",
        help="SGLang: the model's num_hidden_layers x num_experts_per_tok, e.g. 48x8; SGLang's "
             "routes carry no shape (default: only calls sending X-Trajstore-Route-Layout get routes)")
    """SGLang: the model's (layers, topk), for calls without ``X-Trajstore-Route-Layout``."""
    skip_recorded_routes: bool = option(
        True, flag="--no-route-skip",
        help="never ask the engine for only the new route rows (routed_experts_prompt_start)")
    """Ask the engine for only the route rows the trajectory has not recorded."""
    pass_through_unrecorded: bool = option(
        False, help="a named call the store cannot take (a finished trajectory reused, an answer that cannot "
                    "be read) still gets the engine's answer, with X-Trajstore-Error (counted in /metrics); "
                    "default: the harness gets an error status with the reason")
    """A named call the store cannot take still gets the engine's answer, with ``X-Trajstore-Error``."""
    linger_s: float = option(
        DEFAULT_LINGER_S, flag="--linger-ms", scale=1e3, min=0,
        help="how long a call's record waits for other calls to share its payload object and index "
             f"transaction (default {DEFAULT_LINGER_S * 1e3:g}; 0: append at once)")
    """How long a call's record waits for other calls to share its payload object and index
    transaction (Kafka's ``linger.ms``; 0: appended as soon as a committer is free)."""
    max_batch_bytes: int = option(
        DEFAULT_MAX_GROUP_BYTES, flag="--max-batch-mb", scale=1 / (1 << 20), min=0, min_exclusive=True,
        help="a group of records' bound in MiB: a full group is appended without waiting out the "
             f"linger (default {DEFAULT_MAX_GROUP_BYTES / (1 << 20):g})")
    """A group of records' bound in bytes (Kafka's ``batch.size``): a full group is appended at once."""
    log_level: str = _SERVER["log_level"]
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
    def from_args(cls, args: Any) -> "ProxyConfig":
        """The settings the flags of ``add_cli_arguments`` (one per field) parsed into ``args`` stand for."""
        layout = getattr(args, "route_layout", None)
        if layout is not None and getattr(args, "engine", "vllm") == "sglang":  # else refused as vLLM's
            try:
                layout = _route_layout(layout)
            except ValidationError as e:
                raise ValueError(f"--route-layout: {e.reason}") from None
        return config_from_args(cls, args, route_layout=layout)


ENGINES: tuple[str, ...] = get_args(ProxyConfig.__annotations__["engine"])  # --engine's choices
