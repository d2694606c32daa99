"""The replay server's settings (``ReplayConfig``): each field is also its ``trajstore replay``
flag (``trajstore._util.config``), and ``serve_from_args`` runs on the settings whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trajstore._util.config import config_from_args, option
from trajstore.replay import _puts as puts

DEFAULT_PORT = 8815


@dataclass(frozen=True)
class ReplayConfig:
    """Every setting of ``trajstore replay``: where the store is, where to listen, who may read and
    write, and the rate limiter's bounds."""

    store_url: str | None = option(None, flag=None, dest="store", help="store URL (the CLI's global --store)")
    payload: str | None = option(None, flag=None, help="payload location (the CLI's global --payload)")
    host: str = option("127.0.0.1", help="address to bind (default 127.0.0.1)")
    port: int = option(DEFAULT_PORT, min=0, max=65535, help=f"port (default {DEFAULT_PORT}; 0: any free)")
    token: tuple[str, ...] | None = option(
        None, help="read-only bearer token trainers send (default $TRAJSTORE_REPLAY_TOKEN); repeat it for "
                   "one token per team: each records the lineage of the runs it began only")
    write_token: str | None = option(
        None, help="bearer token that may also append events with DoPut (default: none, no writes)")
    insecure_no_auth: bool = option(False, help="accept calls without a token (reads and writes)")
    tls_cert: str | None = option(None, help="PEM certificate chain: serve grpc+tls")
    tls_key: str | None = option(None, help="PEM private key of --tls-cert")
    metrics_port: int | None = option(None, min=0, max=65535,
                                      help="serve Prometheus metrics on this port (default: off)")
    samples_per_insert: float | None = option(
        None, min=0, min_exclusive=True,
        help="hold sample requests while this server has served more than this many times the "
             "samples in the store (plus --spi-tolerance); default off")
    spi_tolerance: int = option(0, min=0, help="samples the limiter lets learners run ahead of --samples-per-insert "
                                               "(default 0)")
    max_staleness: int | None = option(
        None, min=0, help="hold sample requests while the newest sample is more than this many policy versions "
                          "behind the trainer's current_model_version; default off")
    max_lineage_put_bytes: int = option(
        puts.DEFAULT_MAX_PUT_BYTES, min=1,
        help="largest training-lineage put a read token may send, in bytes of events (refused "
             f"before its body is read; default {puts.DEFAULT_MAX_PUT_BYTES})")
    max_lineage_put_rows: int = option(
        puts.DEFAULT_MAX_PUT_ROWS, min=1,
        help=f"most events in a read token's put, and samples in one train_step (default {puts.DEFAULT_MAX_PUT_ROWS})")
    hold_s: float = option(5.0, min=0, help="longest a request is held by the rate limiter before the client asks "
                                            "again (default 5)")

    @classmethod
    def from_args(cls, args: Any) -> "ReplayConfig":
        """The settings the flags of ``add_cli_arguments`` (one per field) parsed into ``args`` stand for."""
        return config_from_args(cls, args)
