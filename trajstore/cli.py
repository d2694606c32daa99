"""The ``trajstore`` command line.

Every command takes ``--store URL`` (default ``$TRAJSTORE_URL``, else the
embedded SQLite store in ``./trajstore-data``) and ``--payload`` (where the
Parquet segments live). Errors print one line and exit 1 (2 for usage);
``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Iterator

from trajstore.errors import TrajstoreError

__all__ = ["main"]

Command = Callable[[argparse.Namespace], int]


def _store(args: argparse.Namespace):
    from trajstore.store import connect

    return connect(args.store, payload=args.payload)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))


def _cmd_init(args: argparse.Namespace) -> int:
    store = _store(args)
    print(f"store ready: {store!r}")
    return 0


def _read_jsonl(path: str) -> Iterator[dict]:
    from trajstore.errors import ValidationError

    stream = sys.stdin if path == "-" else open(path, encoding="utf-8")
    with stream:
        for lineno, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValidationError(f"line {lineno} of {path} is not JSON ({e.msg} at column {e.colno})",
                                      rule="json") from None


def _cmd_ingest(args: argparse.Namespace) -> int:
    """All events of the file in one atomic append: any bad event stores nothing."""
    from trajstore._progress import progress_bar

    with progress_bar("reading events", total=None) as advance:
        events = []
        for ev in _read_jsonl(args.file):
            events.append(ev)
            advance(1)
    store = _store(args)
    res = store.append(events)
    print(f"appended {res.num_appended} events ({res.num_duplicates} already stored); "
          f"log position {store.log.head_position()}")
    return 0


def _cmd_materialize(args: argparse.Namespace) -> int:
    from trajstore.materializer import Materializer
    from trajstore._progress import progress_bar

    store = _store(args)
    m = Materializer(store, shard_index=args.shard, num_shards=args.num_shards, batch_size=args.batch_size)
    with progress_bar("materializing trajectories", total=m.pending()) as advance:
        m.progress = advance
        stats = m.run()
    _print_json(stats.to_dict())
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from trajstore.inspect.export import export_samples
    from trajstore._progress import progress_bar

    store = _store(args)
    total = store.info()["samples"]
    with progress_bar("exporting samples", total=total) as advance:
        counts = export_samples(store.samples(), args.dir, progress=advance)
    print(f"exported {counts['samples']} samples to {counts['files']} Parquet file(s) in {args.dir}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    store = _store(args)
    info = store.info()
    # finished trajectories the materializer recorded and skipped (docs/materializer.md)
    info["unfoldable_trajectories"] = store.materialized.unfoldable_trajectories(limit=10)
    _print_json(info)
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    removed = _store(args).collect_garbage(grace_s=args.grace_s)
    print(f"removed {len(removed)} unreferenced payload file(s)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from trajstore.demo.run import run_demo

    return run_demo(args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trajstore", description="Event-sourced trajectory store for RL of LLM agents.")
    p.add_argument("--store", default=None, help="store URL (default: $TRAJSTORE_URL, else sqlite:///trajstore-data/trajstore.db)")
    p.add_argument("--payload", default=None, help="payload location: a path or pyarrow filesystem URI")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Command, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(func=fn)
        return sp

    add("init", _cmd_init, "create the store (runs the Alembic migrations)")
    add("ingest", _cmd_ingest, "append wire-format events from a JSONL file (or - for stdin), atomically") \
        .add_argument("file")
    m = add("materialize", _cmd_materialize, "fold finished trajectories into samples; print the metrics")
    m.add_argument("--shard", type=int, default=0)
    m.add_argument("--num-shards", type=int, default=1)
    m.add_argument("--batch-size", type=int, default=256, help="trajectories per transaction")
    add("export", _cmd_export, "write the samples as a Parquet dataset").add_argument("dir")
    add("info", _cmd_info, "counts per status, event type and model version; unfoldable trajectories")
    add("gc", _cmd_gc, "delete payload files no index row references") \
        .add_argument("--grace-s", type=float, default=3600.0, help="only files older than this")
    d = add("demo", _cmd_demo, "the main job end to end on the embedded store, with simulated rollouts")
    d.add_argument("--trajectories", type=int, default=200)
    d.add_argument("--workers", type=int, default=4, help="simulated rollout worker processes")
    d.add_argument("--dir", default="trajstore-demo", help="where the demo store and export go")
    d.add_argument("--no-train", action="store_true", help="skip the megatron replay stage")
    _add_edge_commands(sub, add)
    return p


_EDGES = (
    # name, module, function that runs the parsed args, help
    ("serve", "trajstore.ingest.service", "serve_from_args", "run the HTTP ingest service"),
    ("proxy", "trajstore.ingest.proxy", "serve_proxy_from_args", "run the OpenAI-compatible recording proxy in front of vLLM"),
    ("sql", "trajstore.inspect.sql", "run_from_args", "run a read-only SQL query against the store"),
    ("report", "trajstore.inspect.report", "run_from_args", "render an HTML report with plots of the run"),
)


def _add_edge_commands(sub, add) -> None:
    """Commands whose code lives in edge modules; each module defines
    ``add_cli_arguments(parser)`` and the run function named above."""
    import importlib

    for name, module, run, help in _EDGES:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue  # an edge not present in this build
        sp = add(name, _edge(mod, run), help)
        mod.add_cli_arguments(sp)


def _edge(mod: Any, run: str) -> Command:
    def call(args: argparse.Namespace) -> int:
        try:
            return int(getattr(mod, run)(args) or 0)
        except ValueError as e:  # edges report bad flags as ValueError
            raise TrajstoreError(str(e)) from None

    return call


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (TrajstoreError, OSError, ImportError) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
