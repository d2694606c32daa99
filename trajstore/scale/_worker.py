"""The processes a user runs beside a run: ``trajstore materialize --follow`` and
``trajstore worker`` (docs/materializer.md, "One worker beside the run").

``materialize --follow`` folds as trajectories finish (``trajstore.materializer._follow``:
one transaction a step, a database outage waited out with one log line per
wait) and, on shard 0, collects retired payload. ``worker`` runs that and,
each switchable, the tracker pusher (``trajstore.inspect.trackers``) and the
live run page (``trajstore report --serve``) in one process, each part in a
thread of its own. ``worker`` takes the Ray shards' options as flags, one per
``ShardConfig`` field (``trajstore.scale._config``: ``--shard``, ``--num-shards``,
``--max-trajectories``, ``--abandon-after-s``, ``--poll-s``, ``--gc-grace-s``,
``--gc-interval-s``, ``--unavailable-timeout-s``, ``--no-gc``; the keywords of
``trajstore.scale.ray_actors``), ``materialize --follow`` the loop's part. Both log one line per step that folded something
on stderr and one JSON line of its stats on stdout, and stop on SIGTERM or
SIGINT after the step in progress commits, exiting 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import Any, Callable

from trajstore._util.config import add_flags
from trajstore.errors import TrajstoreError, first_line
from trajstore.scale._config import LOOP_FIELDS, PAGE_FIELDS, ShardConfig, WorkerConfig

__all__ = ["add_cli_arguments", "add_follow_arguments", "follow_from_args", "run_from_args"]

log = logging.getLogger("trajstore.worker")


def add_follow_arguments(p: Any, *, when: str = "with --follow: ") -> None:
    """The long-running loop's flags (``materialize --follow`` and ``worker``): ``ShardConfig``'s loop fields."""
    add_flags(p, ShardConfig, only=LOOP_FIELDS, help_prefix=when)


def _log_to_stderr(debug: bool) -> None:
    """The library's INFO lines on stderr, unless the embedding program set up logging."""
    root = logging.getLogger()
    ours = logging.getLogger("trajstore")
    if root.handlers or ours.handlers:
        return
    # on the root logger, for trajstore's records only: they still propagate (a program or a
    # test that runs the command in its own process keeps seeing them), other libraries'
    # INFO lines stay out
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    handler.addFilter(logging.Filter("trajstore"))
    root.addHandler(handler)
    ours.setLevel(logging.DEBUG if debug else logging.INFO)


def _stop_on_signals() -> threading.Event:
    """An event set by the first SIGTERM or SIGINT (the step in progress finishes first)."""
    stop = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        if not stop.is_set():
            log.info("trajstore: %s received; stopping after the step in progress",
                     signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stop


def _print_step(stats: Any) -> None:
    print(json.dumps(stats.to_dict()), flush=True)


def _fold(m: Any, config: ShardConfig, stop: threading.Event, on_step: Callable[[Any], None]) -> None:
    from trajstore.materializer._follow import follow

    pending = m.pending()
    kwargs = config.follow_kwargs()
    log.info("materializer shard %s: following the log of %r (%d finished trajector%s pending)%s", m.shard,
             m.store, pending, "y" if pending == 1 else "ies",
             "" if kwargs["gc_grace_s"] is None else
             f"; collecting retired payload {config.gc_grace_s:g} s after retirement")
    follow(m, stop, on_step=on_step, pending_in_line=m.num_shards == 1, **kwargs)


def follow_from_args(args: argparse.Namespace, m: Any) -> int:
    """``trajstore materialize --follow`` with materializer ``m``: until SIGTERM/SIGINT, exit 0."""
    _log_to_stderr(args.debug)
    stop = _stop_on_signals()
    _fold(m, ShardConfig.from_args(args), stop, _print_step)
    log.info("materializer shard %s: stopped", m.shard)
    return 0


# -- trajstore worker -------------------------------------------------------------------

def add_cli_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``trajstore worker``: one per field of ``WorkerConfig``, ``ShardConfig`` and the trackers'."""
    from trajstore.inspect.trackers import add_tracker_arguments

    fold = p.add_argument_group("folding (on unless --no-fold; the Ray shards' options)")
    add_flags(fold, WorkerConfig, only=("fold",))
    add_flags(fold, ShardConfig)
    add_flags(p, WorkerConfig, only=("reader_store",))
    track = p.add_argument_group("trackers (on when one is named)")
    add_tracker_arguments(track)
    add_flags(track, WorkerConfig, only=("track_interval_s",))
    add_flags(p.add_argument_group("the live run page (on with --serve-report)"), WorkerConfig, only=PAGE_FIELDS)


class _Part:
    """One part of the worker in a thread of its own; an error in it stops the worker (exit 1)."""

    def __init__(self, name: str, target: Callable[[], Any], stop: threading.Event) -> None:
        self.name, self.error = name, None
        self._target, self._stop = target, stop
        self.thread = threading.Thread(target=self._run, name=f"trajstore-worker-{name}", daemon=True)

    def _run(self) -> None:
        try:
            self._target()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread, which exits 1
            self.error = e
            self._stop.set()


def run_from_args(args: argparse.Namespace) -> int:
    """``trajstore worker``: fold, collect, push, serve, each switchable, until SIGTERM/SIGINT."""
    from trajstore.inspect.trackers import TrackerPusher, sinks_from_args, wants_trackers

    _log_to_stderr(getattr(args, "debug", False))
    worker = WorkerConfig.from_args(args)
    if not worker.fold and not wants_trackers(args) and not worker.serve_report:
        raise TrajstoreError("worker: nothing to do (--no-fold, no tracker, no --serve-report)")
    shard = ShardConfig.from_args(args)
    if shard.shard >= shard.num_shards:
        raise TrajstoreError(f"worker: --shard {shard.shard} is not below --num-shards {shard.num_shards}")
    stop = _stop_on_signals()
    parts: list[_Part] = []
    closers: list[Callable[[], None]] = []
    try:
        if worker.fold:
            parts.append(_fold_part(worker, shard, stop, closers))
        elif shard.collects() is not None:
            parts.append(_gc_part(worker, shard, stop, closers))
        if wants_trackers(args):
            pusher = TrackerPusher(worker.reading, sinks_from_args(args), payload=worker.payload)
            closers.append(pusher.close)
            log.info("trackers: pushing every %g s to %d tracker(s)", worker.track_interval_s, len(pusher.sinks))
            parts.append(_Part("trackers", lambda: pusher.run(worker.track_interval_s, stop=stop), stop))
        if worker.serve_report:
            parts.append(_page_part(worker, stop))
        for part in parts:
            part.thread.start()
        while not stop.wait(0.5):
            pass
        for part in parts:
            part.thread.join()
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - the worker's outcome stands; say why the close failed
                log.warning("worker: closing: %s", first_line(e))
    failed = [p for p in parts if p.error is not None]
    for part in failed:
        print(f"error: worker {part.name}: {first_line(part.error)}", file=sys.stderr)
    if not failed:
        log.info("trajstore worker: stopped")
    return 1 if failed else 0


def _fold_part(worker: WorkerConfig, shard: ShardConfig, stop: threading.Event, closers: list) -> _Part:
    from trajstore.materializer import Materializer
    from trajstore.store import connect

    store = connect(worker.store_url, payload=worker.payload)
    closers.append(store.close)
    m = Materializer(store, shard_index=shard.shard, num_shards=shard.num_shards,
                     max_trajectories=shard.max_trajectories)
    return _Part("fold", lambda: _fold(m, shard, stop, _print_step), stop)


def _gc_part(worker: WorkerConfig, shard: ShardConfig, stop: threading.Event, closers: list) -> _Part:
    from trajstore._upkeep.gc import GcWorker
    from trajstore.store import connect

    store = connect(worker.store_url, payload=worker.payload)
    closers.append(store.close)

    def run() -> None:
        log.info("gc: collecting retired payload %g s after retirement", shard.gc_grace_s)
        with GcWorker(store, margin_s=shard.gc_grace_s, interval_s=shard.gc_interval_s):
            stop.wait()

    return _Part("gc", run, stop)


def _page_part(worker: WorkerConfig, stop: threading.Event) -> _Part:
    from trajstore.ingest._http import server_token
    from trajstore.inspect._live import DEFAULT_PORT, DEFAULT_REFRESH_S, report_server
    from trajstore.inspect._panels import DEFAULT_STUCK_AFTER_S

    try:
        token = server_token(worker.token, insecure_no_auth=worker.insecure_no_auth, host=worker.report_host)
    except ValueError as e:
        raise TrajstoreError(f"worker --serve-report: {e}") from None
    server = report_server(worker.reading, host=worker.report_host,
                           port=DEFAULT_PORT if worker.report_port is None else worker.report_port, token=token,
                           refresh_s=DEFAULT_REFRESH_S if worker.refresh_s is None else worker.refresh_s,
                           stuck_after_s=DEFAULT_STUCK_AFTER_S, payload=worker.payload)

    def run() -> None:
        def stopper() -> None:
            stop.wait()
            server.server.should_exit = True

        threading.Thread(target=stopper, name="trajstore-worker-page-stop", daemon=True).start()
        try:
            server.run()
        finally:
            server.sock.close()

    return _Part("page", run, stop)
