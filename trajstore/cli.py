"""The ``trajstore`` command line.

Every command takes ``--store URL`` (default ``$TRAJSTORE_URL``, else the
embedded SQLite store in ``./trajstore-data``), ``--payload`` (where the
payload files live: the log's Arrow IPC segments, the samples' Parquet) and ``--debug``, before or after the command's name.
Only the commands that write (init, ingest, serve, proxy, demo) create a
store; the others say ``no store at ...``. Errors print one line and exit 1
(2 for usage); ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from trajstore._util.argtypes import number
from trajstore._util.config import add_flags, config_from_args, option
from trajstore.errors import TrajstoreError, ValidationError
from trajstore.fold import FoldPolicy

__all__ = ["main"]

Command = Callable[[argparse.Namespace], int]


def _store(args: argparse.Namespace, *, create: bool = False):
    """The store of ``--store``; only commands that write pass ``create=True``."""
    from trajstore.store import connect

    store = connect(args.store, payload=args.payload, create=create)
    args.opened.append(store)  # closed by main when the command returns
    return store


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))



# -- each command's options: a dataclass field with its help is the flag (trajstore._util.config) --
@dataclass(frozen=True)
class _InitOptions:
    reader_login: str | None = option(None, metavar="NAME",
                                      help="PostgreSQL: also make NAME a login holding only the read-only role, for "
                                           "trajstore sql and report (password from $TRAJSTORE_READER_PASSWORD; see "
                                           "docs/sql.md)")


@dataclass(frozen=True)
class _MaterializeOptions:
    """``Store.materialize``'s keywords, and what the command does around them (``--follow``'s loop:
    ``trajstore.scale._config.ShardConfig``)."""

    shard: int = option(0, help="this materializer's shard index (default 0)")
    num_shards: int = option(1, help="number of materializer shards (default 1)")
    max_trajectories: int = option(256, help="finished trajectories folded per transaction (default 256)")
    refold_quarantined: bool = option(False, help="fold this shard's trajectories quarantined for a missing payload "
                                                  "file, once it is back")
    projection: str | None = option(None, metavar="NAME", help="fold into this named projection instead of the "
                                                               "default samples (docs/projections.md)")
    abandon_after_s: float | None = option(None, min=0, min_exclusive=True, metavar="SECONDS",
                                           help="first finish running trajectories with no event for this long as "
                                                "'abandoned' (a dead harness's); with --follow: checked every tenth "
                                                "of it; default: never (docs/materializer.md)")
    follow: bool = option(False, help="keep folding as trajectories finish, one log line per step, until "
                                      "SIGTERM/SIGINT (then exit 0 after the step in progress); shard 0 also collects "
                                      "retired payload")


@dataclass(frozen=True)
class _ExportOptions:
    dir: str = option(flag="dir", help="directory to create with the part-NNNNN.parquet files")
    replace: bool = option(False, help="replace an earlier export in DIR (atomically)")
    projection: str | None = option(None, metavar="NAME", help="export this named projection's samples instead of "
                                                               "the default ones (docs/projections.md)")
    run: str | None = option(None, help="with --step: export the samples of that training step of this run")
    step: int | None = option(None, help="with --run: the training step whose samples to export (every rank, "
                                         "standing attempt)")


@dataclass(frozen=True)
class _GcOptions:
    grace_s: float = option(3600.0, min=0, help="only files retired (or, unreferenced, written) longer ago than "
                                                "this (default 3600)")
    lease_max_age_s: float = option(6 * 3600.0, min=0, help="a reader's lease protects nothing retired longer ago "
                                                            "than this (default 21600: 6 h)")
    compact: bool = option(False, help="first rewrite many small log segments of unfolded trajectories into few")
    target_bytes: int = option(64 << 20, flag="--target-mb", scale=1 / (1 << 20), min=0, min_exclusive=True,
                               help="compacted segment size (default 64 MiB)")


@dataclass
class _DemoOptions:  # not frozen: the demo settles --dir's default on it
    store: str | None = option(None, flag=None, dest="store", help="the global --store")
    payload: str | None = option(None, flag=None, dest="payload", help="the global --payload")
    trajectories: int = option(200, help="simulated trajectories (default 200)")
    workers: int = option(4, help="simulated rollout worker processes (default 4)")
    dir: str | None = option(None, help="where the demo store, export and report go (default ./trajstore-demo; "
                                        "with --engine ./trajstore-engine-demo); files the demo did not make are "
                                        "never touched, and --engine never touches the first demo's store")
    no_train: bool = option(False, help="skip the megatron replay stage")
    engine: bool = option(False, help="instead: agent episodes through a real `trajstore proxy` in front of a "
                                      "simulated vLLM (CPU, no model; needs the server extra), printed call by call "
                                      "(docs/first-hour.md)")
    engine_only: bool = option(False, help="instead: serve the simulated vLLM alone on --host/--port until Ctrl-C")
    host: str = option("127.0.0.1", help="with --engine-only: the address (default 127.0.0.1)")
    port: int = option(8000, min=0, max=65535, help="with --engine-only: the port (default 8000)")
    weight_update_every: int = option(10, min=0, metavar="TOKENS",
                                      help="with --engine-only: the engine moves to the next weight label every this "
                                           "many generated tokens (0: never; default 10)")


@dataclass(frozen=True)
class _ProjectionOptions:
    name: str = option(flag="name", help="the projection's name (letters, digits, '_', '.', '-')")
    merge: str = option("prefix", choices=FoldPolicy.MERGE,
                        help="prefix: merge calls that continue the sequence (the default fold); none: one sample "
                             "per call")
    observation: str = option("prompt", choices=FoldPolicy.OBSERVATION,
                              help="with --merge none: observation tokens only in the next call's prompt (prompt), or "
                                   "also closing the previous call's response, loss mask 0 (response: SkyRL "
                                   "step-wise)")
    routes: str = option("first", choices=FoldPolicy.ROUTES,
                         help="first: a recorded route is never overwritten (R3); last: re-sent rows replace it "
                              "(only trajectories whose re-sent rows did not drift; see docs/projections.md)")


def _cmd_init(args: argparse.Namespace) -> int:
    opts = config_from_args(_InitOptions, args)
    store = _store(args, create=True)
    print(f"store ready: {store!r}")
    if opts.reader_login:
        from trajstore.inspect.sql import create_reader_login

        print(create_reader_login(store, opts.reader_login))
    return 0


def _cmd_ingest(args: argparse.Namespace) -> int:
    """Validate the whole file (nothing stored on any bad event), then append it in bounded batches."""
    from trajstore._util.progress import progress_bar
    from trajstore.ingest.jsonl import ingest_file

    if args.file != "-" and os.path.isdir(args.file):
        raise TrajstoreError(f"{args.file} is a directory: ingest takes one JSONL file (or - for stdin)")
    if args.file != "-" and not os.path.exists(args.file):
        raise TrajstoreError(f"no such file: {args.file}")
    store = _store(args, create=True)
    size = os.path.getsize(args.file) if args.file != "-" else None
    what = "stdin" if args.file == "-" else args.file
    with contextlib.ExitStack() as bars:  # one bar per pass, each counting the file's bytes once
        advance: dict[str, Callable[[int], None]] = {}

        def phase(name: str) -> None:
            bars.close()
            advance["pass"] = bars.enter_context(progress_bar(f"ingest: {name} {what}", total=size, unit="bytes"))

        res = ingest_file(store, args.file, progress=lambda n: advance["pass"](n), phase=phase)
    print(f"appended {res.num_appended} events ({res.num_duplicates} already stored); "
          f"log position {store.log.head_position()}")
    return 0


def _cmd_materialize(args: argparse.Namespace) -> int:
    from trajstore.materializer import Materializer
    from trajstore._util.progress import progress_bar

    store = _store(args)
    opts = config_from_args(_MaterializeOptions, args)
    if args.old_batch_size is not None:
        print("trajstore: --batch-size is deprecated; use --max-trajectories (same meaning)", file=sys.stderr)
        opts = dataclasses.replace(opts, max_trajectories=args.old_batch_size)
    m = Materializer(store, shard_index=opts.shard, num_shards=opts.num_shards,
                     max_trajectories=opts.max_trajectories, projection=opts.projection)
    if opts.follow:
        if opts.refold_quarantined:
            raise ValidationError("--follow folds as trajectories finish; run --refold-quarantined on its own",
                                  rule="cli")
        from trajstore.scale._worker import follow_from_args

        return follow_from_args(args, m)
    if opts.refold_quarantined:
        if opts.projection is not None:
            raise ValidationError("--refold-quarantined folds the default samples; leave out --projection",
                                  rule="cli")
        _print_json(m.refold_quarantined().to_dict())
        still = _quarantined(m)
        if still:
            print(f"trajstore: {_trajectories(len(still))} still quarantined: a payload file they need is "
                  "still missing (trajstore info lists them)", file=sys.stderr)
        return 0
    if opts.abandon_after_s is not None:
        abandoned = m.abandon_idle(opts.abandon_after_s)
        if abandoned:
            print(f"finished {len(abandoned)} idle running trajectories as abandoned", file=sys.stderr)
    before = _quarantined(m)
    what = "trajectories" if opts.projection is None else f"trajectories into projection {opts.projection}"
    with progress_bar(f"materializing {what}", total=m.pending()) as advance:
        m.progress = advance
        stats = m.run()
    metrics = stats.to_dict()
    if not metrics.get("num_steps_before"):
        metrics["merge_ratio"] = "n/a"  # 0 samples from 0 steps is not a ratio
    _print_json(metrics)
    quarantined = _quarantined(m) - before
    if quarantined:
        # folded what it could, but these wait for a file: a script must not take that for success
        shard = "" if opts.num_shards == 1 else f" --shard {opts.shard} --num-shards {opts.num_shards}"
        print(f"error: {_trajectories(len(quarantined))} quarantined: a payload file they need is missing "
              f"(trajstore info lists them); once it is back, run: trajstore materialize --refold-quarantined"
              f"{shard}", file=sys.stderr)
        return 1
    return 0


def _quarantined(m: Any) -> set[str]:
    """This shard's trajectories quarantined for a missing payload file (default samples only)."""
    from trajstore.errors import PayloadMissingError

    if m.projection is not None:
        return set()
    return {r["trajectory_id"] for r in m.index.quarantined(PayloadMissingError.__name__)
            if m.shard.owns(r["trajectory_id"])}


def _trajectories(n: int) -> str:
    return f"{n} trajector{'y' if n == 1 else 'ies'}"


def _cmd_export(args: argparse.Namespace) -> int:
    from trajstore.inspect.export import export_samples
    from trajstore._util.progress import progress_bar

    from trajstore.errors import ValidationError

    store = _store(args)
    opts = config_from_args(_ExportOptions, args)
    if (opts.run is None) != (opts.step is None):
        raise ValidationError("export --run and --step go together (the samples of one training step)",
                              rule="export")
    if opts.run is not None:
        from trajstore.lineage import step_samples

        samples = step_samples(store, run=opts.run, step=opts.step)
        if not samples:
            raise TrajstoreError(f"export: run {opts.run!r} has no samples recorded for step {opts.step}; "
                                 f"{_recorded_steps(store)} (SampleReader.record_step records them)")
        counts = export_samples(samples, opts.dir, replace=opts.replace)
        print(f"exported {counts['samples']} samples of step {opts.step} of run {opts.run!r} to "
              f"{counts['files']} Parquet file(s) in {opts.dir}")
        return 0
    if opts.projection is None:
        total = store.info()["samples"]
    else:
        total = store.materialized.projection(opts.projection).count_samples()
    with progress_bar("exporting samples", total=total) as advance:
        counts = export_samples(store.samples(projection=opts.projection), opts.dir, progress=advance,
                                replace=opts.replace)
    print(f"exported {counts['samples']} samples to {counts['files']} Parquet file(s) in {opts.dir}")
    return 0


def _recorded_steps(store: Any, limit: int = 10) -> str:
    """What training lineage the store has, in words: each run and its steps' range."""
    from sqlalchemy import func, select

    from trajstore.schema import lineage_steps

    s = lineage_steps.c
    q = (select(s.run, func.min(s.step), func.max(s.step), func.count(func.distinct(s.step)))
         .group_by(s.run).order_by(s.run).limit(limit + 1))
    with store.log.db.reading("reading the recorded training runs") as conn:
        rows = conn.execute(q).all()
    if not rows:
        return "the store has no training steps recorded"
    runs = [f"{run!r} (steps {lo}..{hi}, {n} recorded)" if lo != hi else f"{run!r} (step {lo})"
            for run, lo, hi, n in rows[:limit]]
    return "recorded: " + ", ".join(runs) + (", ..." if len(rows) > limit else "")


def _cmd_info(args: argparse.Namespace) -> int:
    store = _store(args)
    info = store.info()
    # finished trajectories the materializer recorded and skipped (docs/materializer.md)
    info["unfoldable_trajectories"] = store.materialized.unfoldable_trajectories(limit=10)
    # ... and the ones a bug in the fold kept from folding, retried by the next run
    from trajstore.log.base import INTERNAL_ERROR

    info["internal_errors"] = store.materialized.unfoldable_trajectories(limit=10, kind=INTERNAL_ERROR)
    _print_json(info)
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    import time

    store = _store(args)
    opts = config_from_args(_GcOptions, args)
    if opts.compact:
        done = store.compact(target_bytes=opts.target_bytes)
        print(f"compacted: {done['events_moved']} running event(s) from {done['segments_retired']} small log "
              f"segment(s) into {done['segments_written']} (the old ones are retired)")
    now = time.time()
    keep = store.log.segments_in_use(retired_before=now - opts.grace_s)
    young = sum(1 for name, mtime in store.payload.list_names()
                if name not in keep and now - mtime < opts.grace_s)
    removed = store.collect_garbage(grace_s=opts.grace_s, lease_max_age_s=opts.lease_max_age_s)
    retired = len(store.log.segments_in_use(retired_before=float("-inf")) - store.log.referenced_segments())
    print(f"removed {len(removed)} payload file(s) (retired log segments or unreferenced); kept {young} younger "
          f"than --grace-s {opts.grace_s:g} (they may belong to appends still running) and {retired} retired "
          "within it (a reader may still have them open)")
    return 0


# -- trajstore payload: where the store's payload lives (docs/deploy.md) ------------
def _index_engines(args: argparse.Namespace):
    """The engines of an existing store's index, migrated, without opening its payload."""
    from trajstore.log._migrate import upgrade
    from trajstore.log._registry import backend_of
    from trajstore.store import resolve_url

    url = resolve_url(args.store)
    backend = backend_of(url)
    backend.require_database(url)
    write_engine, read_engine = backend.make_engines(url)
    backend.require_schema(url, read_engine)
    upgrade(write_engine)
    return url, write_engine, read_engine


def _cmd_payload(args: argparse.Namespace) -> int:
    from trajstore.payload import _home as home

    if args.action == "show":
        url, _, read_engine = _index_engines(args)
        rec = home.read_recorded(read_engine)
        print(home.opened_form(rec, url) if rec is not None else "no payload location recorded")
        return 0 if rec is not None else 1
    if args.action == "set":
        url, write_engine, _ = _index_engines(args)
        print(f"recorded payload location {home.set_location(url, write_engine, args.location, force=args.force)}")
        return 0
    from trajstore._util.progress import progress_bar

    store = _store(args)
    with progress_bar(f"copying payload to {args.location}", total=len(store.payload.list_names())) as advance:
        done = home.move(store, args.location, delete_old=args.delete_old, progress=advance)
    print(f"moved the payload: {done['files']} file(s), {done['bytes']} bytes copied to {done['to']}; recorded "
          f"{done['recorded']}; {done['deleted_old']} old file(s) deleted"
          + (f"; {len(done['missing'])} segment(s) the index names were at neither place" if done["missing"] else ""))
    return 0


# -- named projections (docs/projections.md) ------------------------------------
def _cmd_projection(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.action == "create":
        opts = config_from_args(_ProjectionOptions, args)
        row = store.create_projection(opts.name, merge=opts.merge, observation=opts.observation, routes=opts.routes)
        print(f"created projection {row['name']} (merge={row['merge']}, observation={row['observation']}, "
              f"routes={row['routes']}); fill it with: trajstore materialize --projection {row['name']}")
    elif args.action == "list":
        rows = [{k: r[k] for k in ("name", "merge", "observation", "routes", "num_samples", "num_unfoldable")}
                for r in store.projections()]
        _print_json(rows)
    else:
        done = store.drop_projection(args.name)
        print(f"dropped projection {args.name}: {done['samples']} sample(s); {done['segments']} sample segment(s) "
              "retired (trajstore gc deletes them after its grace)")
    return 0


def _add_projection_command(add) -> None:
    pr = add("projection", _cmd_projection, "named projections: the log re-folded under another fold policy")
    acts = pr.add_subparsers(dest="action", required=True, metavar="ACTION",
                             help="create, list or drop (ACTION -h: its options)")

    def action(name: str, help: str) -> argparse.ArgumentParser:
        sp = acts.add_parser(name, help=help, description=help)
        _add_global_options(sp, top=False)
        return sp

    add_flags(action("create", "define a projection (then: trajstore materialize --projection NAME)"), _ProjectionOptions)
    action("list", "every projection: its policy, samples and unfoldable trajectories")
    action("drop", "delete a projection's samples (nothing else)").add_argument("name", help="the projection")


def _cmd_demo(args: argparse.Namespace) -> int:
    opts = config_from_args(_DemoOptions, args)
    if opts.engine_only or opts.engine:
        from trajstore.demo._agent import run_engine_demo, serve_engine

        try:
            return (serve_engine if opts.engine_only else run_engine_demo)(opts)
        except ModuleNotFoundError as e:
            missing = _missing_extra("demo --engine", e)
            if missing is None:
                raise
            raise missing from None
    from trajstore.demo._run import run_demo

    return run_demo(opts)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trajstore")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _add_global_options(p: argparse.ArgumentParser, *, top: bool) -> None:
    """The options every command takes, before or after its name.

    On a subcommand they default to SUPPRESS, so ``trajstore --store X info``
    and ``trajstore info --store X`` mean the same and one does not reset the other."""
    default = (lambda v: v) if top else (lambda v: argparse.SUPPRESS)
    p.add_argument("--store", default=default(None), metavar="URL",
                   help="store URL: sqlite:///PATH.db or postgresql+psycopg://... "
                        "(default: $TRAJSTORE_URL, else sqlite:///trajstore-data/trajstore.db)")
    p.add_argument("--payload", default=default(None), metavar="PATH_OR_URI",
                   help="where the Arrow payload lives: a path or pyarrow filesystem URI. The store records it "
                        "when created and every later command finds it there; a different one is refused "
                        "(default for a new store: beside the SQLite file; for PostgreSQL $TRAJSTORE_PAYLOAD_DIR)")
    p.add_argument("--debug", action="store_true", default=default(False), help="show tracebacks on errors")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trajstore", description="Event-sourced trajectory store for RL of LLM agents.")
    p.add_argument("--version", action="version", version=f"trajstore {_version()}",
                   help="print the version and exit")
    _add_global_options(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do (COMMAND -h: its options)")

    def add(name: str, fn: Command, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        _add_global_options(sp, top=False)
        sp.set_defaults(func=fn)
        return sp

    add_flags(add("init", _cmd_init, "create the store (runs the Alembic migrations)"), _InitOptions)
    add("ingest", _cmd_ingest, "validate a JSONL file of wire-format events (or - for stdin), then append it; "
                               "a bad event stores nothing") \
        .add_argument("file", help="JSONL file, one wire-format event per line; - reads stdin")
    m = add("materialize", _cmd_materialize, "fold finished trajectories into samples; print the metrics")
    add_flags(m, _MaterializeOptions, skip=("refold_quarantined", "projection", "abandon_after_s", "follow"))
    m.add_argument("--batch-size", type=number(int), default=None, dest="old_batch_size", help=argparse.SUPPRESS)
    add_flags(m, _MaterializeOptions, only=("refold_quarantined", "projection", "abandon_after_s", "follow"))
    from trajstore.scale._worker import add_follow_arguments

    add_follow_arguments(m)
    add_flags(add("export", _cmd_export, "write the samples as a Parquet dataset (appears whole or not at all)"),
              _ExportOptions)
    add("info", _cmd_info, "counts per status, event type and model version; unfoldable trajectories")
    add_flags(add("gc", _cmd_gc, "delete payload files no index row needs (retired log segments, crash leftovers)"),
              _GcOptions)
    pl = add("payload", _cmd_payload, "where the store's payload lives: show, set (record only) or move it")
    pl_sub = pl.add_subparsers(dest="action", required=True, metavar="ACTION", help="show, set or move")
    _add_global_options(pl_sub.add_parser("show", help="print the recorded payload location"), top=False)
    ps = pl_sub.add_parser("set", help="record LOCATION without moving anything (a store with none or a wrong one)")
    ps.add_argument("location", metavar="LOCATION", help="a path or pyarrow filesystem URI")
    _add_global_options(ps, top=False)
    ps.add_argument("--force", action="store_true", help="record it even if the newest segment is not there")
    pm = pl_sub.add_parser("move", help="copy every payload file to LOCATION, then record it "
                                        "(stop the store's writers and materializers first)")
    pm.add_argument("location", metavar="LOCATION", help="a path or pyarrow filesystem URI")
    _add_global_options(pm, top=False)
    pm.add_argument("--delete-old", action="store_true", help="delete the old files once the new place is recorded")
    add_flags(add("demo", _cmd_demo, "the main job end to end on the embedded store, with simulated rollouts"),
              _DemoOptions)
    _add_projection_command(add)
    from trajstore._upkeep.retention_cli import add_partition_command, add_retention_commands

    add_retention_commands(add, _store)
    add_partition_command(add, _index_engines)
    _add_edge_commands(sub, add)
    return p


_EDGES = (
    # name, module, function that runs the parsed args, help
    ("serve", "trajstore.ingest.service", "serve_from_args", "run the HTTP ingest service"),
    # --engine vllm or sglang: one start path (trajstore.ingest.proxy's ProxyConfig and serve)
    ("proxy", "trajstore.ingest.proxy", "serve_proxy_from_args", "run the recording proxy in front of vLLM or SGLang"),
    ("sql", "trajstore.inspect.sql", "run_from_args", "run a read-only SQL query against the store"),
    ("report", "trajstore.inspect.report", "run_from_args", "render an HTML report with plots of the run"),
    # store-side figures to TensorBoard, MLflow, W&B (docs/report.md "Trackers")
    ("track", "trajstore.inspect.trackers", "run_from_args",
     "push the run's store-side metrics to TensorBoard, MLflow or Weights & Biases"),
    # beside a run: fold, collect garbage, push to trackers, serve the page (docs/materializer.md)
    ("worker", "trajstore.scale._worker", "run_from_args",
     "run beside a run: fold as trajectories finish, collect garbage, push to trackers, serve the page"),
    # the replay service: trainers elsewhere read samples over Arrow Flight (docs/replay.md)
    ("replay", "trajstore.replay._server", "serve_from_args", "run the Arrow Flight replay service trainers read from"),
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
        sp = add(name, _edge(mod, run, name), help)
        mod.add_cli_arguments(sp)


# The extra each edge command needs (pyproject.toml, README "Extras") and the packages it brings.
_EXTRA_OF = {"serve": "server", "proxy": "server", "report": "report", "replay": "replay",
             "demo --engine": "server", "track": "trackers"}
_EXTRA_PACKAGES = {
    "server": {"fastapi", "starlette", "uvicorn", "httpx", "httptools", "prometheus_client"},
    "report": {"plotly", "starlette", "uvicorn"},
    "replay": {"prometheus_client"},
    "trackers": {"tensorboard", "mlflow", "wandb"},
}


def _missing_extra(command: str, e: ModuleNotFoundError) -> TrajstoreError | None:
    """A missing package of ``command``'s extra as one line naming the extra and its install command."""
    extra = _EXTRA_OF.get(command)
    package = (e.name or "").split(".")[0]
    if extra is None or package not in _EXTRA_PACKAGES[extra]:
        return None
    return TrajstoreError(f"trajstore {command} needs the '{extra}' extra ({package} is not installed): "
                          f"pip install -e '.[{extra}]' in the trajstore checkout (or pip install 'trajstore[{extra}]')")


def _edge(mod: Any, run: str, name: str = "") -> Command:
    def call(args: argparse.Namespace) -> int:
        # serve and proxy say "listening on ..." themselves, once they answer (ingest._http.run_server)
        try:
            return int(getattr(mod, run)(args) or 0)
        except ValueError as e:  # edges report bad flags as ValueError
            raise TrajstoreError(str(e)) from None
        except ModuleNotFoundError as e:
            missing = _missing_extra(name, e)
            if missing is None:
                raise
            raise missing from None

    return call


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    args.opened = []
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _broken_pipe()
    except Exception as e:
        if args.debug:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    finally:
        for store in args.opened:
            _close_quietly(store)


def _close_quietly(store: Any) -> None:
    try:
        store.close()
    except Exception as e:  # the command's outcome stands; say why the close failed
        logging.getLogger(__name__).warning("closing %r: %s", store, _one_line(e))


def _one_line(e: BaseException) -> str:
    """A trajstore error's message; anything else (a bug or a driver error) named by its type."""
    from trajstore.errors import ValidationError
    from trajstore.log._errors import database_error_line

    database_error = database_error_line(e)
    if database_error is not None:
        text = database_error
    elif isinstance(e, ValidationError) and e.rule == "url":
        text = e.reason  # a mistyped --store: the [rule] tag is for events
    elif isinstance(e, (TrajstoreError, OSError, ImportError)):
        text = str(e)
    else:
        text = f"{type(e).__name__}: {e} (--debug shows where)"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


def _broken_pipe() -> int:
    """The reader of our stdout went away (``| head``): stop quietly, as cat does."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush cannot fail again
    except (OSError, ValueError):
        pass
    return 141  # 128 + SIGPIPE, what a shell reports for a killed writer


if __name__ == "__main__":
    sys.exit(main())
