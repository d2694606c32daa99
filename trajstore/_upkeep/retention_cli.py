"""``trajstore archive DIR`` and ``trajstore restore DIR``: the retention commands (docs/deploy.md, "Index growth")."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable

from trajstore._util.config import add_flags, config_from_args, option

__all__ = ["add_partition_command", "add_retention_commands"]


@dataclass(frozen=True)
class ArchiveOptions:
    """``trajstore archive``'s options: ``archive_events``' keywords, each also its flag."""

    out_dir: str = option(flag="dir", help="archive directory (created); each batch adds one part-*.parquet file")
    older_than_s: float = option(3600.0, min=0, metavar="SECONDS",
                                 help="only trajectories not updated for this long (default 3600: a writer's retry "
                                      "of an archived event is refused, not dropped as a duplicate)")
    before_position: int | None = option(None, min=0, metavar="N",
                                         help="only trajectories whose every event is below log position N")
    skip_lagging: bool = option(False, help="when a named projection has not folded some trajectories yet, archive "
                                            "only what every projection folded (default: refuse, naming the "
                                            "projections)")
    dry_run: bool = option(False, help="count what would be archived; write and delete nothing")
    batch_trajectories: int = option(100, min=1, metavar="N",
                                     help="trajectories per archive file and per index transaction (default 100; a "
                                          "batch's events are held in memory, about twice their token data)")


@dataclass(frozen=True)
class PartitionOptions:
    """``trajstore partition``'s options: the backend's ``partition_events`` keywords, each also its flag."""

    rows: int = option(100_000_000, min=1, metavar="N",
                       help="positions per new partition (default 100,000,000: about 5 h at 5,800 events/s)")
    ahead: int = option(2, min=1, metavar="K",
                        help="partitions to keep past the log's head (default 2; run it again, e.g. hourly)")
    drop_empty: bool = option(False, help="also drop the partitions below the head that hold no row any more "
                                          "(emptied by trajstore archive): their space goes back at once")


def _cmd_archive(args: argparse.Namespace, store: Any) -> int:
    from trajstore._upkeep.retention import ArchiveBatch, archive_events

    options = config_from_args(ArchiveOptions, args)
    verb = "would archive" if options.dry_run else "archived"

    def progress(b: ArchiveBatch) -> None:
        where = f" into {b.path}" if b.path else ""
        print(f"{verb} {b.trajectories} trajectories ({b.events} events, up to position {b.last_position}){where}",
              file=sys.stderr, flush=True)

    done = archive_events(store, **asdict(options), on_batch=progress)
    for name, pos in done["skipped_for"].items():
        print(f"kept the events projection {name!r} has not folded (its checkpoint: position {pos})")
    tail = "" if options.dry_run else (f" in {len(done['files'])} file(s) under {options.out_dir}; their index rows are "
                                    "deleted (trajstore gc frees the log segments they emptied)")
    print(f"{verb} {done['trajectories']} trajectories ({done['events']} events){tail}")
    return 0


def _cmd_restore(args: argparse.Namespace, store: Any) -> int:
    from trajstore._upkeep.retention import restore_archive

    done = restore_archive(store, args.dir,
                           on_batch=lambda n: print(f"appended {n} events", file=sys.stderr, flush=True))
    print(f"restored {done['trajectories']} trajectories ({done['events']} events, repeated ones dropped as "
          "retries); trajstore materialize folds them")
    return 0


def add_retention_commands(add: Callable[..., argparse.ArgumentParser],
                           open_store: Callable[..., Any]) -> None:
    """Register the two commands; ``add(name, fn, help)`` is the CLI's, ``open_store(args, create=...)`` its store."""
    a = add("archive", lambda args: _cmd_archive(args, open_store(args)),
            "move the events of folded trajectories out of the index into a Parquet archive in DIR "
            "(re-foldable: trajstore restore); samples and trajectory rows stay")
    add_flags(a, ArchiveOptions)
    r = add("restore", lambda args: _cmd_restore(args, open_store(args, create=True)),
            "append the events of an archive made by trajstore archive to a store (normally a new one)")
    r.add_argument("dir", help="the archive directory")


def _cmd_partition(args: argparse.Namespace, index_engines: Callable[[argparse.Namespace], Any]) -> int:
    from trajstore.log._registry import backend_of

    url, write_engine, _ = index_engines(args)
    done = backend_of(url).partition_events(write_engine, **asdict(config_from_args(PartitionOptions, args)))
    if done["converted"]:
        print("events is now partitioned by position (the existing rows are partition events_legacy; "
              "identities are in event_identities)")
    if done["dropped"]:
        print(f"dropped {len(done['dropped'])} empty partition(s) below the head: {', '.join(done['dropped'])}")
    print(f"created {len(done['created'])} partition(s); {len(done['partitions'])} in all")
    return 0


def add_partition_command(add: Callable[..., argparse.ArgumentParser],
                          index_engines: Callable[[argparse.Namespace], Any]) -> None:
    """``index_engines(args)``: the CLI's ``(url, write engine, read engine)`` of an existing, migrated store."""
    p = add("partition", lambda args: _cmd_partition(args, index_engines),
            "PostgreSQL: partition the event index by position (once), then keep partitions ahead of the head")
    add_flags(p, PartitionOptions)
