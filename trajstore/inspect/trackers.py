"""Push a run's store-side metrics to the experiment trackers RL teams already use.

``trajstore track`` (and ``workers/trackers.py``) reads a few read-only
queries over the inspection views (docs/sql.md) plus the newest samples'
routes, and logs the figures to TensorBoard (event files written with the
``tensorboard`` package's own event writer: no torch), MLflow (its tracking
client) and Weights & Biases (its own library, online or offline) with each
library's own API: the figures land beside the trainer's own curves, under
``trajstore/``.

Each push is keyed by a step: the newest training step the store recorded
(``train_steps``, when the trainer records lineage), else the newest model
version in the log, so curves line up with the trainer's. Rates
(``ingest/*_per_s``) are measured between two pushes of one pusher.

The figures, by name (all floats):

* ``trajectories``, ``trajectories_finished``, ``samples``, ``held_back``,
  ``unfoldable``: counts;
* ``ingest/calls_per_s``, ``ingest/tokens_per_s``: engine calls and generated
  tokens appended per second since the previous push;
* ``staleness/mean``, ``staleness/max``: ``sample_summary.staleness`` over the
  newest ``RECENT_SAMPLES`` samples;
* ``length_finish_share``: of those samples, the share whose last call ended
  on ``length``; ``response_len/mean`` likewise;
* ``zero_variance_group_share``: of the finished groups with two or more
  rewards, the share whose rewards are all equal (GRPO learns nothing from them);
* ``route_drift_share``: re-sent route rows that moved, over the rows compared;
* ``moe/max_vio/max``, ``moe/max_vio/avg``: expert load imbalance over the
  newest samples' generated tokens, per MoE layer as verl 0.9.1 defines it
  (``verl/trainer/ppo/metric_utils.py``: a layer's ``max_e(load_e / total *
  num_experts) - 1``); layers whose every entry is 0 (vLLM's dense layers)
  are left out;
* with lineage: ``train/<metric>`` of the newest step (its ranks' mean,
  computed without overflow; non-finite values are left out), and
  ``mismatch/k3_mean`` over its annotated tokens.

Distributions, where the tracker has them (TensorBoard and W&B histograms;
MLflow has none): ``hist/staleness`` and ``hist/response_len`` of the newest
``RECENT_SAMPLES`` samples, and ``hist/k3`` (each annotated sample's k3
mean) of the newest step.

MLflow accepts only letters, digits and ``_ - . / : space`` in a metric name;
a trainer's metric named otherwise is renamed for MLflow (``mlflow_name``):
``@`` becomes ``_at_``, ``%`` ``_pct``, ``(`` ``_``, ``)`` nothing, any other
refused character ``_`` (``acc@1`` -> ``acc_at_1``, ``kl(avg)`` -> ``kl_avg``,
``reward%`` -> ``reward_pct``). No tracker is ever sent a non-finite value.

A reading equal to the last one pushed (same step, same figures: the trainer
and the rollouts have stopped) is not pushed again.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, Protocol, Sequence

from trajstore._util.config import add_flags, config_from_args, option
from trajstore.errors import CorruptStoreError, StoreUnavailable, TrajstoreError, first_line
from trajstore.inspect.sql import Query, QueryResult

__all__ = ["StoreMetrics", "TrackerSink", "TensorBoardSink", "MLflowSink", "WandbSink", "TrackerPusher",
           "store_metrics", "expert_load_violation", "mlflow_name", "add_cli_arguments", "add_tracker_arguments",
           "sinks_from_args", "wants_trackers", "run_from_args"]

log = logging.getLogger(__name__)

PREFIX = "trajstore/"
RECENT_SAMPLES = 1024
"""Sample-level figures cover the newest this many samples: a push costs the same late in a run."""
ROUTE_SAMPLES = 256
"""The expert-load figures read the routes of the newest this many samples from the payload."""

_COUNTS_SQL = (
    "SELECT count(*), count(*) FILTER (WHERE status <> 'running'), coalesce(sum(num_generations), 0), "
    "coalesce(sum(num_generated_tokens), 0), count(*) FILTER (WHERE is_held_back), "
    "max(max_model_version), sum(route_rows_drifted), sum(route_rows_resent) FROM trajectory_summary")
_SAMPLES_SQL = (
    "SELECT count(*), avg(staleness), max(staleness), "
    "avg(CASE WHEN finish_reason = 'length' THEN 1.0 ELSE 0.0 END), avg(response_len) FROM ("
    "SELECT staleness, finish_reason, response_len FROM sample_summary "
    f"ORDER BY finished_position DESC, sample_index DESC LIMIT {RECENT_SAMPLES}) recent")
_NUM_SAMPLES_SQL = "SELECT count(*) FROM samples"
_UNFOLDABLE_SQL = "SELECT count(*) FROM unfoldable_trajectories"
_GROUPS_SQL = (
    "SELECT count(*), count(*) FILTER (WHERE lo = hi) FROM ("
    "SELECT min(reward) AS lo, max(reward) AS hi FROM trajectory_summary "
    "WHERE group_id IS NOT NULL AND status <> 'running' AND reward IS NOT NULL "
    "GROUP BY group_id HAVING count(*) > 1) g")
_ROUTES_SQL = (
    "SELECT s.trajectory_id, s.sample_index, s.segment, s.segment_row, t.num_experts "
    "FROM samples s JOIN trajectories t ON t.trajectory_id = s.trajectory_id "
    f"ORDER BY s.finished_position DESC, s.sample_index DESC LIMIT {ROUTE_SAMPLES}")
_HAS_LINEAGE_SQL = "SELECT count(*) FROM train_steps"
_STEP_SQL = "SELECT run, step, metrics FROM train_steps WHERE step = (SELECT max(step) FROM train_steps)"
_RECENT_DIST_SQL = (
    "SELECT staleness, response_len FROM sample_summary "
    f"ORDER BY finished_position DESC, sample_index DESC LIMIT {RECENT_SAMPLES}")
_K3_SQL = ("SELECT k3_mean FROM train_rollout_mismatch WHERE step = (SELECT max(step) FROM train_steps) "
           "AND k3_mean IS NOT NULL")
_MISMATCH_SQL = (
    "SELECT sum(k3_mean * tokens_compared), sum(tokens_compared) FROM train_rollout_mismatch "
    "WHERE step = (SELECT max(step) FROM train_steps)")


@dataclass(frozen=True)
class StoreMetrics:
    """One reading of the store: the figures (names without ``trajstore/``) and the step they belong to."""

    step: int
    values: dict[str, float]
    counters: dict[str, float] = field(default_factory=dict)
    """Cumulative counts the pusher turns into rates (calls, generated tokens)."""
    at: float = field(default_factory=time.time)
    distributions: dict[str, list[float]] = field(default_factory=dict)
    """Per-sample values (finite) the trackers that have histograms draw."""


def _num(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _share(part: Any, whole: Any) -> float | None:
    part, whole = _num(part), _num(whole)
    return None if not whole else (part or 0.0) / whole


def expert_load_violation(routes: Iterable[Any], num_experts: int) -> dict[str, float]:
    """verl's ``max_vio`` over route rows: for each layer, ``max_e(load_e / total * num_experts) - 1``.

    ``routes``: arrays [tokens, layers, topk] of expert ids (one per sample,
    one layer layout; with several, the busiest). Layers whose every entry is 0
    (the dense layers vLLM records as zeros) are left out. Returns ``{}`` when
    no layer has routes."""
    import numpy as np

    from trajstore.inspect._routes import count_routes

    by_layout: dict[tuple[int, ...], list[Any]] = {}
    for r in routes:
        r = np.asarray(r)
        if r.ndim == 3 and r.size:
            by_layout.setdefault(r.shape[1:], []).append(r)
    if not by_layout:
        return {}
    rows = np.concatenate(max(by_layout.values(), key=lambda rs: sum(len(r) for r in rs)))
    return _violation(count_routes(rows, num_experts)[0])


def _violation(per_layer: Any) -> dict[str, float]:
    """``max_vio`` figures from ``counts[layer, expert]`` (``_routes.max_violation``), dense layers left out."""
    from trajstore.inspect._routes import max_violation, moe_layers

    moe = moe_layers(per_layer)
    if not moe.any():
        return {}
    max_vio = max_violation(per_layer[moe])
    return {"moe/max_vio/max": float(max_vio.max()), "moe/max_vio/avg": float(max_vio.mean())}


def _expert_load(query: Query, payload: str | None) -> dict[str, float]:
    if payload is None:
        return {}
    from trajstore.inspect._panels import _read_samples
    from trajstore.inspect._routes import expert_load

    rows = query(_ROUTES_SQL).rows
    if not rows:
        return {}
    try:
        samples = _read_samples(payload, rows)
    except (StoreUnavailable, CorruptStoreError, ValueError) as e:
        log.warning("trackers: cannot read the newest sample segments under %s: %s", payload,
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return {}
    load = expert_load(samples, max([int(r[4]) for r in rows if r[4]] + [0]) or None)
    if load is None:
        return {}
    return _violation(load.counts.sum(axis=0))


def _lineage(query: Query) -> tuple[int | None, dict[str, float]]:
    """The newest training step and its figures, or (None, {}) when the store has no lineage."""
    try:
        if not query(_HAS_LINEAGE_SQL).rows[0][0]:
            return None, {}
    except TrajstoreError:  # a store made before training lineage: no such view
        return None, {}
    rows = query(_STEP_SQL).rows
    step = int(rows[0][1])
    sums: dict[str, list[float]] = {}
    for _, _, metrics in rows:
        for k, v in (json.loads(metrics) if isinstance(metrics, str) else (metrics or {})).items():
            v = _num(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
            if v is not None:
                sums.setdefault(k, []).append(v)
    # the mean as a sum of x/n: finite whatever the values (sum(v) / len(v) overflows to inf near the float limit)
    values = {f"train/{k}": math.fsum(x / len(v) for x in v) for k, v in sums.items()}
    k3_sum, tokens = query(_MISMATCH_SQL).rows[0]
    if _num(tokens):
        values["mismatch/k3_mean"] = float(k3_sum) / float(tokens)
    return step, values


def store_metrics(query: Query, *, payload: str | None = None) -> StoreMetrics:
    """One reading of the store through ``query`` (one read-only snapshot, see ``inspect.sql.read_only``)."""
    (trajectories, finished, calls, tokens, held, newest_version, drifted, resent) = query(_COUNTS_SQL).rows[0]
    _, stale_mean, stale_max, length_share, response_len = query(_SAMPLES_SQL).rows[0]
    groups, flat = query(_GROUPS_SQL).rows[0]
    values: dict[str, float | None] = {
        "trajectories": _num(trajectories), "trajectories_finished": _num(finished),
        "samples": _num(query(_NUM_SAMPLES_SQL).rows[0][0]), "held_back": _num(held),
        "unfoldable": _num(query(_UNFOLDABLE_SQL).rows[0][0]),
        "staleness/mean": _num(stale_mean), "staleness/max": _num(stale_max),
        "length_finish_share": _num(length_share), "response_len/mean": _num(response_len),
        "zero_variance_group_share": _share(flat, groups), "route_drift_share": _share(drifted, resent),
    }
    values.update(_expert_load(query, payload))
    step, train = _lineage(query)
    values.update(train)
    if step is None:
        step = int(newest_version) if newest_version is not None else 0
    return StoreMetrics(step=step, values={k: float(v) for k, v in values.items() if v is not None and math.isfinite(v)},
                        counters={"calls": float(calls or 0), "tokens": float(tokens or 0)},
                        distributions=_distributions(query, with_k3=step is not None and "mismatch/k3_mean" in train))


def _distributions(query: Query, *, with_k3: bool) -> dict[str, list[float]]:
    rows = query(_RECENT_DIST_SQL).rows
    out = {"hist/staleness": [v for v in (_num(r[0]) for r in rows) if v is not None],
           "hist/response_len": [v for v in (_num(r[1]) for r in rows) if v is not None]}
    if with_k3:
        out["hist/k3"] = [v for v in (_num(r[0]) for r in query(_K3_SQL).rows) if v is not None]
    return {k: v for k, v in out.items() if v}


class TrackerSink(Protocol):
    """Where a push goes: one tracker run."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def _need(module: str, extra: str = "trackers") -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise TrajstoreError(f"{module.split('.')[0]} is not installed: pip install 'trajstore[{extra}]'") from None


_FLOAT32_MAX = 3.4028234663852886e38


class TensorBoardSink:
    """TensorBoard event files in ``logdir``, written with the ``tensorboard`` package's own
    event writer (``tensorboard.summary.writer``; no torch, no TensorFlow): scalars and histograms."""

    def __init__(self, logdir: str) -> None:
        _need("tensorboard")
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary, self._histo = event_pb2.Event, summary_pb2.Summary, summary_pb2.HistogramProto
        self._too_large: set[str] = set()
        try:
            self._writer = EventFileWriter(logdir)
        except OSError as e:
            raise TrajstoreError(f"trackers: cannot write TensorBoard files in {logdir}: {e.strerror or e}") from None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        values = []
        for name, value in metrics.items():
            if abs(value) > _FLOAT32_MAX:  # a scalar event holds a float32: it would read back as inf
                if name not in self._too_large:
                    self._too_large.add(name)
                    log.warning("trackers: %s = %g is beyond a TensorBoard scalar's float32 range; left out", name,
                                value)
                continue
            values.append(self._summary.Value(tag=name, simple_value=float(value)))
        self._writer.add_event(self._event(wall_time=time.time(), step=int(step),
                                           summary=self._summary(value=values)))
        self._writer.flush()

    def log_distributions(self, distributions: Mapping[str, Sequence[float]], step: int) -> None:
        values = [self._summary.Value(tag=name, histo=self._histogram(xs)) for name, xs in distributions.items() if xs]
        if values:
            self._writer.add_event(self._event(wall_time=time.time(), step=int(step),
                                               summary=self._summary(value=values)))
            self._writer.flush()

    def _histogram(self, xs: Sequence[float]) -> Any:
        import numpy as np

        a = np.asarray(xs, dtype=np.float64)
        counts, edges = np.histogram(a, bins=min(30, max(1, len(np.unique(a)))))
        return self._histo(min=float(a.min()), max=float(a.max()), num=float(a.size), sum=float(a.sum()),
                           sum_squares=float(np.dot(a, a)), bucket_limit=[float(e) for e in edges[1:]],
                           bucket=[float(c) for c in counts])

    def close(self) -> None:
        self._writer.close()


_MLFLOW_REFUSED = re.compile(r"[^A-Za-z0-9_\-./: ]")
_MLFLOW_SPELLED = {"@": "_at_", "%": "_pct", "(": "_", ")": ""}


def mlflow_name(name: str) -> str:
    """``name`` as MLflow accepts it (letters, digits, ``_ - . / : space``): ``@`` -> ``_at_``,
    ``%`` -> ``_pct``, ``(`` -> ``_``, ``)`` dropped, any other refused character -> ``_``."""
    return _MLFLOW_REFUSED.sub(lambda m: _MLFLOW_SPELLED.get(m.group(0), "_"), name)


class MLflowSink:
    """One MLflow run (``mlflow.MlflowClient``): ``tracking_uri`` as MLflow takes it (a server,
    ``sqlite:///mlflow.db``, ``file:./mlruns``); ``run_id`` continues an existing run (the trainer's)."""

    def __init__(self, tracking_uri: str | None = None, *, experiment: str = "trajstore",
                 run_id: str | None = None, run_name: str | None = None) -> None:
        mlflow = _need("mlflow")
        self._client = mlflow.MlflowClient(tracking_uri=tracking_uri)
        self._metric = _need("mlflow.entities").Metric
        self.created = run_id is None  # a run given (the trainer's) is never ended here
        if run_id is None:
            found = self._client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
            run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        self.run_id = run_id
        self._renamed: dict[str, str] = {}

    def _name(self, name: str) -> str:
        renamed = mlflow_name(name)
        if renamed != name and self._renamed.get(name) != renamed:
            self._renamed[name] = renamed
            log.info("trackers: MLflow metric %r is logged as %r (MLflow refuses the name)", name, renamed)
        return renamed

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[self._metric(self._name(k), float(v), now, int(step))
                                                     for k, v in metrics.items() if math.isfinite(v)])

    def close(self) -> None:
        if self.created:
            self._client.set_terminated(self.run_id)


class WandbSink:
    """One Weights & Biases run (``wandb.init``); ``mode="offline"`` writes it under ``dir``
    for ``wandb sync`` later. The step is logged as ``trajstore/step`` (W&B's own step
    must only grow, and two pushes can share a training step)."""

    def __init__(self, project: str, *, mode: str = "online", dir: str | None = None, name: str | None = None,
                 run_id: str | None = None) -> None:
        wandb = _need("wandb")
        self._run = wandb.init(project=project, mode=mode, dir=dir, name=name, id=run_id, resume="allow",
                               reinit="create_new")
        self._run.define_metric(f"{PREFIX}*", step_metric=f"{PREFIX}step")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log({**metrics, f"{PREFIX}step": step})

    def log_distributions(self, distributions: Mapping[str, Sequence[float]], step: int) -> None:
        import wandb

        hists = {name: wandb.Histogram(list(xs)) for name, xs in distributions.items() if xs}
        if hists:  # into the row the next log() commits
            self._run.log(hists, commit=False)

    def close(self) -> None:
        self._run.finish()


class TrackerPusher:
    """Reads the store every ``interval_s`` and logs its figures to every sink.

    The store is read with the read-only connection ``trajstore sql`` uses (on
    PostgreSQL: a reader login, docs/sql.md)."""

    def __init__(self, url: str | None, sinks: Sequence[TrackerSink], *, payload: str | None = None) -> None:
        from trajstore.inspect import _report_page

        if not sinks:
            raise TrajstoreError("trackers: name at least one tracker (--tensorboard, --mlflow, --wandb-project)")
        self.url = url
        self.sinks = list(sinks)
        self.payload = _report_page.payload_location(url, payload)
        self._last: StoreMetrics | None = None

    def read(self) -> StoreMetrics:
        from trajstore.inspect.sql import read_only

        with read_only(self.url) as query:
            return store_metrics(query, payload=self.payload)

    def push(self) -> dict[str, float]:
        """One reading, logged to every sink; returns what was logged (with the prefix), ``{}``
        when the reading equals the last one pushed (nothing moved: it is not pushed again)."""
        now = self.read()
        if self._last is not None and now.step == self._last.step and now.values == self._last.values \
                and now.counters == self._last.counters:
            log.debug("trackers: nothing changed since the push at step %d; not pushed again", now.step)
            return {}
        values = dict(now.values)
        if self._last is not None and now.at > self._last.at:
            dt = now.at - self._last.at
            values["ingest/calls_per_s"] = max(0.0, now.counters["calls"] - self._last.counters["calls"]) / dt
            values["ingest/tokens_per_s"] = max(0.0, now.counters["tokens"] - self._last.counters["tokens"]) / dt
        self._last = now
        logged = {PREFIX + k: v for k, v in sorted(values.items()) if math.isfinite(v)}  # never a NaN or an inf
        distributions = {PREFIX + k: xs for k, xs in sorted(now.distributions.items())}
        for sink in self.sinks:
            if distributions and hasattr(sink, "log_distributions"):  # first: W&B makes one row of both
                sink.log_distributions(distributions, now.step)
            sink.log(logged, now.step)
        log.info("trackers: pushed %d figures at step %d to %d tracker(s)", len(logged), now.step, len(self.sinks))
        return logged

    def run(self, interval_s: float, *, pushes: int | None = None, stop: Any = None) -> int:
        """Push every ``interval_s`` until ``pushes`` were made or ``stop`` (a threading.Event) is set."""
        done = 0
        failing = False
        while pushes is None or done < pushes:
            try:
                self.push()
                if failing:
                    log.info("trackers: the store answers again; pushing")
                failing = False
            except StoreUnavailable as e:  # a database restart: the next push reads again (one line per outage)
                if pushes is not None:
                    raise
                if not failing:
                    log.warning("trackers: store unavailable (%s); pushing again when it answers", first_line(e))
                failing = True
            done += 1
            if pushes is not None and done >= pushes:
                break
            if stop is not None:
                if stop.wait(interval_s):
                    break
            else:
                time.sleep(interval_s)
        return done

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


@dataclass(frozen=True)
class _Trackers:
    """The trackers a command pushes to (``track`` and ``worker``): each field is also its flag."""

    tensorboard: str | None = option(None, metavar="LOGDIR", help="write TensorBoard event files into LOGDIR")
    mlflow: str | None = option(None, metavar="TRACKING_URI", bare="",
                                help="log to MLflow (its tracking URI; bare flag: MLflow's own default)")
    mlflow_experiment: str = option("trajstore", help="MLflow experiment name")
    mlflow_run_id: str | None = option(None, help="log into this existing MLflow run (e.g. the trainer's); "
                                                  "it is never ended here")
    wandb_project: str | None = option(None, help="log to this Weights & Biases project")
    wandb_mode: Literal["online", "offline"] = option(
        "online", help="offline: write the run under --wandb-dir for `wandb sync` later")
    wandb_dir: str | None = option(None, help="where W&B keeps its files")

    def wanted(self) -> bool:
        return bool(self.tensorboard or self.mlflow is not None or self.wandb_project)

    def sinks(self) -> list[TrackerSink]:
        """The sinks named (each made once, in flag order)."""
        sinks: list[TrackerSink] = []
        try:
            if self.tensorboard:
                sinks.append(TensorBoardSink(self.tensorboard))
            if self.mlflow is not None:
                sinks.append(MLflowSink(self.mlflow or None, experiment=self.mlflow_experiment,
                                        run_id=self.mlflow_run_id))
            if self.wandb_project:
                sinks.append(WandbSink(self.wandb_project, mode=self.wandb_mode, dir=self.wandb_dir))
        except BaseException:
            for sink in sinks:
                sink.close()
            raise
        return sinks


def add_tracker_arguments(parser: Any) -> None:
    """The trackers' flags (``track`` and ``worker`` take them): one per field of ``_Trackers``."""
    add_flags(parser, _Trackers)


def wants_trackers(args: Any) -> bool:
    return config_from_args(_Trackers, args).wanted()


def sinks_from_args(args: Any) -> list[TrackerSink]:
    """The sinks the flags of ``add_tracker_arguments`` name (each made once, in flag order)."""
    return config_from_args(_Trackers, args).sinks()


@dataclass(frozen=True)
class _Track:
    """``trajstore track``'s own settings beside the trackers' (``_Trackers``): each field is also its flag."""

    store_url: str | None = option(None, flag=None, dest="store", help="store URL (the CLI's global --store)")
    payload: str | None = option(None, flag=None, help="payload location (the CLI's global --payload)")
    interval_s: float = option(30.0, min=0, min_exclusive=True, help="seconds between pushes (default 30)")
    once: bool = option(False, help="push once and exit")


def add_cli_arguments(parser: Any) -> None:
    """The flags of ``trajstore track``: the trackers' and its own, one per settings field."""
    add_tracker_arguments(parser)
    add_flags(parser, _Track)


def run_from_args(args: Any) -> int:
    options = config_from_args(_Track, args)
    if not (math.isfinite(options.interval_s) and options.interval_s > 0):  # a Namespace built by hand
        raise TrajstoreError(f"--interval-s must be a finite number > 0, not {options.interval_s}")
    trackers = config_from_args(_Trackers, args)
    if not trackers.wanted():
        raise TrajstoreError("trackers: name at least one tracker (--tensorboard, --mlflow, --wandb-project)")
    pusher = TrackerPusher(options.store_url, trackers.sinks(), payload=options.payload)
    try:
        pusher.run(options.interval_s, pushes=1 if options.once else None)
    except KeyboardInterrupt:
        pass
    finally:
        pusher.close()
    return 0
