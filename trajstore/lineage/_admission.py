"""Admission of the training lineage events (docs/reference.md "Training lineage").

``train_step`` and ``sample_annotation`` events are store-wide: they belong to
no trajectory and change no trajectory state. What admission checks beyond
``events.parse_event``, against the store as it is when the batch is appended:

* every sample a ``train_step`` names, and the sample an annotation names,
  exists in the sample index of its projection (the default samples when it
  names none), else ``unknown_sample``;
* an annotation's per-token arrays have one entry per response token of that
  sample (``length_mismatch``);
* a lineage key (``(run, step, rank, attempt)`` of a step, ``(run, step,
  attempt, trajectory_id, sample_index)`` of an annotation) is recorded by one
  event only: another event (another ``event_id``) for a recorded key is a
  conflict, as an identity stored with different content is.

The facts it returns are the rows the log adds in the append's transaction
(``log._lineage``) and, for annotations, the arrays the append writes to one
payload segment (``annotation_table``): the arrays are never SQL values. The
train/rollout mismatch the views report is aggregated here, once, with numpy:
over the tokens where the sample's ``loss_mask`` and ``logprobs_mask`` are
both true, r = trainer logprob - rollout logprob and k3 = exp(r) - 1 - r,
summed per annotation and per model version of the tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from trajstore.errors import ConflictError, ValidationError
from trajstore.log._lineage import STEP_SAMPLE_COLUMNS  # noqa: F401 - the order of LineageFact.sample_rows
from trajstore.events import ANNOTATION_ARRAYS, Event, SampleAnnotation, TrainStep
from trajstore.payload._columns import list_column
from trajstore.sample import Sample

__all__ = ["LineageFact", "LineagePlan", "SampleSource", "admit_lineage", "event_columns", "is_lineage", "rollout_mismatch", "annotation_table",
           "lineage_key", "MAX_LOG_RATIO", "SUMMED_K3_BOUND", "rollout_mismatches", "checkable_in_sql", "unread_step_facts"]

MAX_LOG_RATIO = 700.0
"""|r| is clipped here before exp (exp(709) overflows float64): a k3 stays finite."""

SUMMED_K3_BOUND = 1e100
"""A token's k3 and every sum of k3 stored (per annotation, per model version) are
clamped to this, like the rewards' ``SUMMED_REWARD_BOUND``: a k3 near exp(700) is
finite, but a few of them summed overflow float64 and the views' ``SUM`` over them
fails on PostgreSQL (``value out of range: overflow``). ``log_ratio_max_abs`` and
the |r| sums keep the values (|r| <= ``MAX_LOG_RATIO``)."""


def is_lineage(event: Event) -> bool:
    return isinstance(event, (TrainStep, SampleAnnotation))


def lineage_key(event: TrainStep | SampleAnnotation) -> tuple:
    """The event's key in the lineage tables, its type first."""
    return (event.type, *event.key)


@dataclass(frozen=True, slots=True, eq=False)
class LineageFact:
    """A lineage event as the log stores it: rows of the lineage tables (without
    ``position``, which the append takes) and the annotation's arrays."""

    event: TrainStep | SampleAnnotation
    step_row: dict[str, Any] | None = None
    sample_rows: list[tuple] = field(default_factory=list)  # in STEP_SAMPLE_COLUMNS order
    annotation_row: dict[str, Any] | None = None
    version_rows: list[dict[str, Any]] = field(default_factory=list)
    unread: bool = False  # a step admitted without reading the store: the database checks it (``unread_step_facts``)

    @property
    def has_arrays(self) -> bool:
        ev = self.event
        return isinstance(ev, SampleAnnotation) and ev.num_tokens is not None


class LineagePlan:
    """What admitting a batch's lineage events will read (``SampleSource.state``),
    planned from the parsed batch so that the log can answer it in the read the
    append makes anyway (``EventLog.load_append_state(..., lineage=plan)`` sets
    ``result``): a step's record then costs no read of its own."""

    def __init__(self, events: Sequence[TrainStep | SampleAnnotation]) -> None:
        self.keys: set[tuple] = {lineage_key(ev) for ev in events}
        self.wanted: dict[str | None, set[tuple[str, int]]] = _wanted(events)
        self.result: tuple[Mapping[tuple, str], Mapping[str | None, dict[tuple[str, int], dict[str, Any]]]] | None = None

    @staticmethod
    def of(events: Sequence[Event]) -> "LineagePlan | None":
        """The plan of a batch's lineage events (None: it has none)."""
        found = [ev for ev in events if is_lineage(ev)]
        return LineagePlan(found) if found else None  # type: ignore[arg-type]

    def answers(self, keys: set[tuple], wanted: Mapping[str | None, set[tuple[str, int]]]) -> bool:
        return (self.result is not None and keys <= self.keys
                and all(k in self.wanted and v <= self.wanted[k] for k, v in wanted.items()))


def _wanted(events: Sequence[TrainStep | SampleAnnotation]) -> dict[str | None, set[tuple[str, int]]]:
    """The sample keys events name, per projection."""
    wanted: dict[str | None, set[tuple[str, int]]] = {}
    for ev in events:
        keys = wanted.setdefault(ev.projection, set())
        if isinstance(ev, TrainStep):
            keys.update(ev.samples)
        else:
            keys.add((ev.trajectory_id, ev.sample_index))
    return wanted


class SampleSource:
    """What admission reads from the store (the store supplies it), in one read:
    ``state(keys, wanted)`` returns the identity recording each of the lineage
    ``keys`` already recorded, and per projection (None: the default samples)
    the sample rows (``response_len``, ``min_model_version``,
    ``max_model_version``, ``segment``, ``segment_row``) of those ``wanted``
    ``(trajectory_id, sample_index)`` keys that exist; ``samples(rows)`` their
    Sample objects (only for annotations with ``trainer_logprobs``)."""

    def __init__(self, state: Callable[[set[tuple], dict[str | None, set[tuple[str, int]]]],
                                       tuple[Mapping[tuple, str], Mapping[str | None, dict[tuple[str, int], dict[str, Any]]]]],
                 samples: Callable[[Sequence[dict[str, Any]]], list[Sample]], *,
                 plan: LineagePlan | None = None) -> None:
        self._state = state
        self.samples = samples
        self.plan = plan

    def state(self, keys: set[tuple], wanted: dict[str | None, set[tuple[str, int]]]
              ) -> tuple[Mapping[tuple, str], Mapping[str | None, dict[tuple[str, int], dict[str, Any]]]]:
        """The plan's result when it answers (read with the append's state), else one read."""
        if self.plan is not None and self.plan.answers(keys, wanted):
            return self.plan.result  # type: ignore[return-value]
        return self._state(keys, wanted)


def admit_lineage(events: Sequence[tuple[int, TrainStep | SampleAnnotation, str]], source: SampleSource,
                  known: Mapping[tuple, str] | None = None) -> list[LineageFact]:
    """Check lineage events (``(index in the append, event, identity)``) against the store.

    ``known``: lineage keys the caller knows are recorded (a dry run's earlier
    batches) and their identities; the store is read for the others, and for the
    samples named, in one read (``SampleSource.state``). Raises ValidationError
    (``unknown_sample``, ``length_mismatch``) or ConflictError, located at the
    event's index."""
    if not events:
        return []
    known = known or {}
    wanted = _wanted([ev for _, ev, _ in events])
    lineage_keys = {lineage_key(ev) for _, ev, _ in events}
    stored, found = source.state(lineage_keys - known.keys(), wanted)
    recorded = {**stored, **known}
    claimed: dict[tuple, str] = {}
    for i, ev, identity in events:
        key = lineage_key(ev)
        known_identity = recorded.get(key, claimed.get(key))
        if known_identity is not None and known_identity != identity:
            what = "rank" if isinstance(ev, TrainStep) else "sample"
            raise ConflictError(f"{ev.type} {_describe(ev)} is already recorded by another event "
                                f"(one event per {what} and attempt)", index=i)
        claimed[key] = identity
    now = time.time()
    out: list[LineageFact] = []
    compare: list[tuple[int, dict[str, Any]]] = []  # (fact index, sample row) of annotations with trainer logprobs
    for i, ev, identity in events:
        rows = found[ev.projection]
        try:
            if isinstance(ev, TrainStep):
                out.append(_step_fact(ev, identity, rows, now))
            else:
                row = _sample_row(rows, ev.trajectory_id, ev.sample_index, ev.projection)
                n = ev.num_tokens
                if n is not None and n != int(row["response_len"]):
                    raise ValidationError(f"the arrays have {n} entries but sample "
                                          f"[{ev.trajectory_id!r}, {ev.sample_index}] has {row['response_len']} "
                                          "response tokens", rule="length_mismatch")
                out.append(_annotation_fact(ev, identity, now))
                if ev.trainer_logprobs is not None:
                    compare.append((len(out) - 1, row))
        except ValidationError as e:
            raise e.at(i, ev.trajectory_id or None) from None
    if compare:
        samples = source.samples([row for _, row in compare])
        pairs = []
        for k, _ in compare:
            ev = out[k].event
            assert isinstance(ev, SampleAnnotation) and ev.trainer_logprobs is not None
            pairs.append(ev.trainer_logprobs)
        for (k, _), (n, k3_sum, abs_sum, max_abs, per_version) in zip(compare, rollout_mismatches(pairs, samples)):
            fact = out[k]
            ev = fact.event
            assert isinstance(ev, SampleAnnotation) and fact.annotation_row is not None
            fact.annotation_row.update(tokens_compared=n, k3_sum=k3_sum, abs_log_ratio_sum=abs_sum,
                                       log_ratio_max_abs=max_abs)
            fact.version_rows.extend({**_annotation_key(ev), "model_version": v, "tokens_compared": c,
                                      "k3_sum": k3, "abs_log_ratio_sum": a} for v, c, k3, a in per_version)
    return out


def checkable_in_sql(events: Sequence[Event]) -> bool:
    """Can the database itself make every check admission reads the store for
    (``unread_step_facts``)? A batch of ``train_step`` events only, no identity twice:
    their samples' existence, the step's facts taken from the sample rows, and a
    lineage key or identity already recorded are all decided by the statements
    that write them. An annotation needs its sample's length (and, with trainer
    logprobs, its tokens) before anything is written."""
    return bool(events) and all(isinstance(ev, TrainStep) for ev in events)


def unread_step_facts(events: Sequence[tuple[int, TrainStep, str]]) -> list[LineageFact]:
    """The facts of ``train_step`` events admitted without reading the store (the
    optimistic path, docs/log.md "Recording a step in one round trip"): the step
    row without ``num_response_tokens`` and no sample rows; the log inserts the
    consumption rows from the sample index in the append's transaction, fills in
    the counts, and refuses the whole append (nothing stored) when a sample is
    missing or the key or identity is recorded. The caller then admits the batch
    the usual way (``admit_lineage``), which finds the precise error, no-op or
    conflict."""
    now = time.time()
    out = []
    for _, ev, identity in events:
        step_row = {"run": ev.run, "step": ev.step, "rank": ev.rank, "attempt": ev.attempt,
                    "world_size": ev.world_size, "policy_version": ev.policy_version,
                    "projection": ev.projection, "num_samples": len(ev.samples), "num_response_tokens": None,
                    "metrics": _metrics_text(ev.metrics), "identity": identity, "created_at": now}
        out.append(LineageFact(ev, step_row=step_row, unread=True))
    return out


def event_columns(fact: LineageFact) -> dict[str, Any]:
    """What a lineage event's ``events`` row holds beyond the common columns: it is
    store-wide (``trajectory_id`` ``""``) and ``lineage`` (not a column) carries the
    fact to the log. Its ``model_version`` stays NULL: the views read that column as
    the versions that generated (a step's policy version is in ``lineage_steps``)."""
    return {"trajectory_id": "", "model_version": None, "lineage": fact}


Mismatch = tuple[int, float, float, "float | None", list[tuple[int, int, float, float]]]


def rollout_mismatch(trainer_logprobs: np.ndarray, sample: Sample) -> Mismatch:
    """The train/rollout mismatch of one sample: over the tokens where ``loss_mask``
    and ``logprobs_mask`` are both true, r = trainer - rollout logprob (float64,
    |r| clipped at ``MAX_LOG_RATIO``), k3 = exp(r) - 1 - r. Returns (tokens
    compared, sum of k3, sum of |r|, max |r| (None without tokens), and per model
    version of the tokens: (version, tokens, sum of k3, sum of |r|))."""
    return rollout_mismatches([trainer_logprobs], [sample])[0]


def rollout_mismatches(trainer_logprobs: Sequence[np.ndarray], samples: Sequence[Sample]) -> list[Mismatch]:
    """``rollout_mismatch`` of many samples at once: their tokens concatenated and
    reduced per sample and per (sample, version) with ``bincount``, no per-sample
    numpy calls (a step's 512 annotations of 2,000 tokens are one pass)."""
    n = len(samples)
    if not n:
        return []
    lengths = np.fromiter((len(s.response_ids) for s in samples), np.int64, n)
    mask = (np.concatenate([s.loss_mask for s in samples]).astype(bool)
            & np.concatenate([np.asarray(s.logprobs_mask, dtype=bool) for s in samples]))
    owner = np.repeat(np.arange(n), lengths)[mask]
    r = (np.concatenate(trainer_logprobs)[mask].astype(np.float64)
         - np.concatenate([s.rollout_logprobs for s in samples])[mask].astype(np.float64))
    np.clip(r, -MAX_LOG_RATIO, MAX_LOG_RATIO, out=r)
    k3 = np.expm1(r) - r
    np.minimum(k3, SUMMED_K3_BOUND, out=k3)  # k3 >= 0; a sum of n stays below n * 1e100
    absr = np.abs(r)
    versions = np.concatenate([s.token_model_versions for s in samples])[mask].astype(np.int64)
    # (sample, version) groups: versions are int32, so one int64 key holds both
    pair = owner.astype(np.int64) << 32 | (versions & 0xFFFFFFFF)
    if pair.size and np.all(pair[1:] >= pair[:-1]):
        # the usual case, with no sort: a sample's generated tokens never go back in
        # version, and ``owner`` is sorted; the groups are runs, reduced in one pass
        # each, and the per-sample figures are sums (and the max) over the groups
        starts = np.flatnonzero(np.concatenate([[True], pair[1:] != pair[:-1]]))
        keys = pair[starts]
        g_counts = np.diff(np.append(starts, len(pair)))
        g_k3 = np.add.reduceat(k3, starts)
        g_abs = np.add.reduceat(absr, starts)
        g_owner = (keys >> 32).astype(np.intp)
        counts = np.bincount(g_owner, weights=g_counts, minlength=n).astype(np.int64)
        k3_sums = np.bincount(g_owner, weights=g_k3, minlength=n)
        abs_sums = np.bincount(g_owner, weights=g_abs, minlength=n)
        max_abs = np.zeros(n)
        np.maximum.at(max_abs, g_owner, np.maximum.reduceat(absr, starts))  # one entry per group
    else:
        keys, inverse = np.unique(pair, return_inverse=True)
        g_counts = np.bincount(inverse, minlength=len(keys))
        g_k3 = np.bincount(inverse, weights=k3, minlength=len(keys))
        g_abs = np.bincount(inverse, weights=absr, minlength=len(keys))
        counts = np.bincount(owner, minlength=n)
        k3_sums = np.bincount(owner, weights=k3, minlength=n)
        abs_sums = np.bincount(owner, weights=absr, minlength=n)
        max_abs = np.zeros(n)
        np.maximum.at(max_abs, owner, absr)
    np.minimum(g_k3, SUMMED_K3_BOUND, out=g_k3)
    np.minimum(k3_sums, SUMMED_K3_BOUND, out=k3_sums)
    per_version: list[list[tuple[int, int, float, float]]] = [[] for _ in range(n)]
    for key, c, k, a in zip(keys.tolist(), g_counts.tolist(), g_k3.tolist(), g_abs.tolist()):
        v = key & 0xFFFFFFFF
        per_version[key >> 32].append((v - (1 << 32) if v >= 1 << 31 else v, c, k, a))
    return [(int(counts[i]), float(k3_sums[i]), float(abs_sums[i]), float(max_abs[i]) if counts[i] else None,
             per_version[i]) for i in range(n)]


def annotation_table(facts: Sequence[LineageFact]) -> pa.Table:
    """The payload segment of an append's annotations with arrays: one row each,
    the key and the three arrays (list<float32>, null when not sent; a scalar
    ``advantages`` is in SQL, ``lineage_annotations.advantage``)."""
    evs: list[SampleAnnotation] = [f.event for f in facts]  # type: ignore[misc]

    def arrays(name: str) -> list[np.ndarray | None]:
        return [v if isinstance(v := getattr(ev, name), np.ndarray) else None for ev in evs]

    return pa.table({
        "run": pa.array([ev.run for ev in evs], pa.string()),
        "step": pa.array([ev.step for ev in evs], pa.int32()),
        "attempt": pa.array([ev.attempt for ev in evs], pa.int32()),
        "trajectory_id": pa.array([ev.trajectory_id for ev in evs], pa.string()),
        "sample_index": pa.array([ev.sample_index for ev in evs], pa.int32()),
        **{name: list_column(arrays(name), np.float32) for name in ANNOTATION_ARRAYS},
    })


def _describe(ev: TrainStep | SampleAnnotation) -> str:
    if isinstance(ev, TrainStep):
        return f"(run {ev.run!r}, step {ev.step}, rank {ev.rank}, attempt {ev.attempt})"
    return (f"(run {ev.run!r}, step {ev.step}, attempt {ev.attempt}, sample [{ev.trajectory_id!r}, "
            f"{ev.sample_index}])")


def _sample_row(rows: Mapping[tuple[str, int], dict[str, Any]], tid: str, index: int,
                projection: str | None) -> dict[str, Any]:
    row = rows.get((tid, index))
    if row is None:
        where = "the default samples" if projection is None else f"projection {projection!r}"
        raise ValidationError(f"sample [{tid!r}, {index}] is not in {where} (materialize it first)",
                              rule="unknown_sample")
    return row


def _metrics_text(metrics: Mapping[str, float]) -> str:
    return json.dumps(dict(metrics), separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _step_fact(ev: TrainStep, identity: str, rows: Mapping[tuple[str, int], dict[str, Any]],
               now: float) -> LineageFact:
    key = (ev.run, ev.step, ev.rank, ev.attempt)
    found = [rows.get(pair) for pair in ev.samples]
    if None in found:
        tid, index = ev.samples[found.index(None)]
        _sample_row(rows, tid, index, ev.projection)  # raises unknown_sample, naming the first missing one
    # one tuple per sample, in STEP_SAMPLE_COLUMNS order: the rows go to one executemany as they are
    sample_rows = [(*key, tid, index, ordinal, row["response_len"], row["min_model_version"],
                    row["max_model_version"]) for ordinal, ((tid, index), row) in enumerate(zip(ev.samples, found))]
    tokens = sum(row["response_len"] for row in found)  # type: ignore[index]
    step_row = {"run": ev.run, "step": ev.step, "rank": ev.rank, "attempt": ev.attempt,
                "world_size": ev.world_size, "policy_version": ev.policy_version,
                "projection": ev.projection, "num_samples": len(ev.samples), "num_response_tokens": int(tokens),
                "metrics": _metrics_text(ev.metrics), "identity": identity, "created_at": now}
    return LineageFact(ev, step_row=step_row, sample_rows=sample_rows)


def _annotation_key(ev: SampleAnnotation) -> dict[str, Any]:
    return {"run": ev.run, "step": ev.step, "attempt": ev.attempt, "trajectory_id": ev.trajectory_id,
            "sample_index": ev.sample_index}


def _annotation_fact(ev: SampleAnnotation, identity: str, now: float) -> LineageFact:
    row = {**_annotation_key(ev), "projection": ev.projection, "num_tokens": ev.num_tokens,
           "has_trainer_logprobs": ev.trainer_logprobs is not None,
           "has_advantages": isinstance(ev.advantages, np.ndarray),
           "advantage": ev.advantages if isinstance(ev.advantages, float) else None,
           "has_entropy": ev.entropy is not None, "metrics": _metrics_text(ev.metrics),
           "tokens_compared": None, "k3_sum": None, "abs_log_ratio_sum": None, "log_ratio_max_abs": None,
           "identity": identity, "segment": None, "segment_row": None, "created_at": now}
    return LineageFact(ev, annotation_row=row)
