"""``trajstore archive DIR`` and ``trajstore restore DIR``: the retention commands (docs/deploy.md, "Index growth")."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from trajstore._util.argtypes import number

__all__ = ["add_partition_command", "add_retention_commands"]


def _cmd_archive(args: argparse.Namespace, store: Any) -> int:
    from trajstore._upkeep.retention import ArchiveBatch, archive_events

    verb = "would archive" if args.dry_run else "archived"

    def progress(b: ArchiveBatch) -> None:
        where = f" into {b.path}" if b.path else ""
        print(f"{verb} {b.trajectories} trajectories ({b.events} events, up to position {b.last_position}){where}",
              file=sys.stderr, flush=True)

    done = archive_events(store, args.dir, before_position=args.before_position,
                          older_than_s=args.older_than_s, skip_lagging=args.skip_lagging, dry_run=args.dry_run,
                          batch_trajectories=args.batch_trajectories, on_batch=progress)
    for name, pos in done["skipped_for"].items():
        print(f"kept the events projection {name!r} has not folded (its checkpoint: position {pos})")
    tail = "" if args.dry_run else (f" in {len(done['files'])} file(s) under {args.dir}; their index rows are "
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
    a.add_argument("dir", help="archive directory (created); each batch adds one part-*.parquet file")
    a.add_argument("--older-than-s", type=number(float, min=0), default=3600.0, metavar="SECONDS",
                   help="only trajectories not updated for this long (default 3600: a writer's retry of an "
                        "archived event is refused, not dropped as a duplicate)")
    a.add_argument("--before-position", type=number(int, min=0), default=None, metavar="N",
                   help="only trajectories whose every event is below log position N")
    a.add_argument("--skip-lagging", action="store_true",
                   help="when a named projection has not folded some trajectories yet, archive only what "
                        "every projection folded (default: refuse, naming the projections)")
    a.add_argument("--dry-run", action="store_true", help="count what would be archived; write and delete nothing")
    a.add_argument("--batch-trajectories", type=number(int, min=1), default=100, metavar="N",
                   help="trajectories per archive file and per index transaction (default 100; a batch's "
                        "events are held in memory, about twice their token data)")
    r = add("restore", lambda args: _cmd_restore(args, open_store(args, create=True)),
            "append the events of an archive made by trajstore archive to a store (normally a new one)")
    r.add_argument("dir", help="the archive directory")


def _cmd_partition(args: argparse.Namespace, index_engines: Callable[[argparse.Namespace], Any]) -> int:
    from trajstore.log._registry import backend_of

    url, write_engine, _ = index_engines(args)
    done = backend_of(url).partition_events(write_engine, rows=args.rows, ahead=args.ahead,
                                            drop_empty=args.drop_empty)
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
    p.add_argument("--rows", type=number(int, min=1), default=100_000_000, metavar="N",
                   help="positions per new partition (default 100,000,000: about 5 h at 5,800 events/s)")
    p.add_argument("--ahead", type=number(int, min=1), default=2, metavar="K",
                   help="partitions to keep past the log's head (default 2; run it again, e.g. hourly)")
    p.add_argument("--drop-empty", action="store_true",
                   help="also drop the partitions below the head that hold no row any more "
                        "(emptied by trajstore archive): their space goes back at once")
