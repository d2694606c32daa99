"""How one materializer shard follows the log (``ShardConfig``): the options ``trajstore worker``
takes as flags (each field is one, ``trajstore._util.config``), ``materialize --follow`` takes the
loop's part of, and the Ray shards (``trajstore.scale.ray_actors``) take as keywords."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trajstore._upkeep.gc import GC_INTERVAL_S, GC_MARGIN_S
from trajstore._util.config import config_from_args, option

# the long-running loop's fields: the flags ``materialize --follow`` takes too
LOOP_FIELDS = ("poll_s", "gc_grace_s", "gc_interval_s", "unavailable_timeout_s")


@dataclass(frozen=True)
class ShardConfig:
    """One shard's options; :meth:`follow_kwargs` are what ``Materializer.follow`` runs with."""

    shard: int = option(0, min=0, help="this worker's shard index (default 0)")
    """This shard's index (``crc32(trajectory_id) % num_shards``)."""
    num_shards: int = option(1, min=1, help="number of shards (default 1)")
    """How many shards fold the log."""
    max_trajectories: int = option(256, min=1, help="finished trajectories folded per transaction (default 256)")
    """Finished trajectories folded per transaction (``Materializer``)."""
    abandon_after_s: float | None = option(None, min=0, min_exclusive=True, metavar="SECONDS",
                                           help="finish running trajectories with no event for this long as "
                                                "'abandoned' (default: never)")
    """Finish running trajectories with no event for this long as ``abandoned`` (None: never)."""
    poll_s: float = option(1.0, min=0, min_exclusive=True,
                           help="seconds between looks at the log when nothing is pending (default 1)")
    """Seconds between looks at the log when nothing is pending."""
    gc_grace_s: float | None = option(GC_MARGIN_S, metavar="SECONDS",
                                      help="delete retired payload files this long after retirement, or after the "
                                           "oldest live reader lease; only shard 0 collects "
                                           f"(default {GC_MARGIN_S:g}; negative: never)")
    """Retired payload is deleted this long after retirement or the oldest live reader lease, by
    shard 0 only (None or negative: never)."""
    gc_interval_s: float = option(GC_INTERVAL_S, min=0, min_exclusive=True,
                                  help=f"how often the GC looks at the retired list (default {GC_INTERVAL_S:g})")
    """How often the GC looks at the retired list."""
    unavailable_timeout_s: float | None = option(
        None, min=0, min_exclusive=True, metavar="SECONDS",
        help="give up (exit 1) when one database outage lasts this long "
             "(default: wait as long as it takes, one log line per wait)")
    """Give up when one database outage lasts this long (None: wait as long as it takes)."""
    gc: bool = option(True, help="do not collect retired payload (shard 0 does by default)")
    """Collect retired payload (on shard 0)."""

    def collects(self) -> float | None:
        """The GC grace this shard collects with; None when it does not collect (not shard 0,
        ``gc`` off, or a negative grace)."""
        if not self.gc or self.gc_grace_s is None or self.gc_grace_s < 0 or self.shard != 0:
            return None
        return self.gc_grace_s

    def follow_kwargs(self) -> dict[str, Any]:
        """The keywords of ``Materializer.follow`` (and ``materializer._follow.follow``) these options give."""
        return {"poll_s": self.poll_s, "gc_grace_s": self.collects(), "gc_interval_s": self.gc_interval_s,
                "abandon_after_s": self.abandon_after_s, "unavailable_timeout_s": self.unavailable_timeout_s}

    @classmethod
    def from_args(cls, args: Any) -> "ShardConfig":
        """The options the flags parsed into ``args`` stand for (a flag the command lacks: its default)."""
        return config_from_args(cls, args)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# the live run page's fields (``worker --serve-report``)
PAGE_FIELDS = ("serve_report", "report_host", "report_port", "token", "insecure_no_auth", "refresh_s")


@dataclass(frozen=True)
class WorkerConfig:
    """``trajstore worker``'s own options beside its shard's (``ShardConfig``) and its trackers'
    (``trajstore.inspect.trackers``): which parts run, where they read, the live page's settings."""

    store_url: str | None = option(None, flag=None, dest="store", help="store URL (the CLI's global --store)")
    payload: str | None = option(None, flag=None, help="payload location (the CLI's global --payload)")
    fold: bool = option(True, help="do not fold (another process does)")
    reader_store: str | None = option(
        None, metavar="URL",
        help="the store URL the trackers and the page read with: on PostgreSQL a login holding only the "
             "read-only role (trajstore init --reader-login; docs/sql.md), while --store folds "
             "(default: --store, enough on SQLite)")
    track_interval_s: float = option(30.0, min=0, min_exclusive=True, help="seconds between pushes (default 30)")
    serve_report: bool = option(False, help="serve `trajstore report --serve`'s page too")
    report_host: str = option("127.0.0.1", help="the page's address (default 127.0.0.1)")
    report_port: int | None = option(None, min=0, max=65535, help="the page's port (default: report --serve's)")
    token: str | None = option(None, help="bearer token the page asks for (default $TRAJSTORE_TOKEN)")
    insecure_no_auth: bool = option(False, help="serve the page without a token")
    refresh_s: float | None = option(None, min=0, min_exclusive=True,
                                     help="how often the page re-reads the store (default: report --serve's)")

    @property
    def reading(self) -> str | None:
        """The store URL the trackers and the page read with."""
        return self.reader_store or self.store_url

    @classmethod
    def from_args(cls, args: Any) -> "WorkerConfig":
        return config_from_args(cls, args)
