"""Training lineage from the trainer's side: record what a step consumed, read it back.

A trainer records, when a step ends, in one call through the reader it
already uses, which samples each rank consumed, with the step's metrics and
optional per-sample arrays (docs/reference.md "Training lineage"; docs/reference.md)::

    for step, batch in enumerate(reader):            # SampleReader, rank r of w
        loss, logprobs = train_on(batch)
        reader.record_step(step, run="grpo-a", policy_version=step,
                           metrics={"loss": loss},
                           annotations={(s.trajectory_id, s.sample_index): {"trainer_logprobs": lp}
                                        for s, lp in zip(batch, logprobs)})

``StepRecorder`` is that call's machinery, shared by every reader: it keeps
the sample keys the reader handed out since the last record and appends one
``train_step`` event (and the annotations) atomically. Its attempt rule makes
a restored trainer's replay safe: without an explicit ``attempt`` a step this
rank has not recorded goes in at attempt 0, and one it has at the standing
(highest) attempt of its ``(run, step, rank)``, and when that attempt holds
other content (a step redone differently after a restore) at the next one.
Replaying a step exactly is a no-op. The usual record (a new step) reads
nothing first: it tries attempt 0, and only a conflict or a replay there asks
for the standing attempt (a step whose attempts were all given explicitly,
none of them 0, is therefore not looked up).

``read_annotations`` reads the arrays the trainer recorded back from the
payload (the SQL views hold only their aggregates).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
from trajstore.errors import ConflictError, ProjectionChangedError, ValidationError
from trajstore.events import ANNOTATION_ARRAYS

__all__ = ["RecordedStep", "StepRecorder", "store_recorder", "step_samples", "Annotation", "read_annotations", "annotation_events"]

_MAX_ATTEMPTS = 64
"""Attempts ``StepRecorder.record`` tries past the standing one before giving up (each lost a race)."""


@dataclass(frozen=True)
class RecordedStep:
    """What ``record_step`` stored: the step's key, the attempt it took, how many
    samples and annotations it named, and whether it was already recorded (a replay)."""

    run: str
    step: int
    rank: int
    attempt: int
    num_samples: int
    num_annotations: int
    replayed: bool


class StepRecorder:
    """The sample keys a reader handed out since its last record, and the record call.

    ``append(events)`` stores wire-format events atomically (``Store.append``,
    or a remote writer); ``standing_attempt(run, step, rank)`` is the highest
    attempt recorded for that key (None: none). ``rank``, ``world_size`` and
    ``projection`` are the reader's."""

    def __init__(self, append: Callable[[list[dict[str, Any]]], Any],
                 standing_attempt: Callable[[str, int, int], int | None], *, rank: int = 0, world_size: int = 1,
                 projection: str | None = None) -> None:
        self._append = append
        self._standing = standing_attempt
        self.rank, self.world_size, self.projection = rank, world_size, projection
        self._keys: list[tuple[str, int]] = []

    def handed_out(self, samples: Iterable[Any]) -> None:
        """Note samples (objects with ``trajectory_id`` and ``sample_index``) the reader handed out."""
        self._keys.extend((str(s.trajectory_id), int(s.sample_index)) for s in samples)

    @property
    def pending(self) -> list[tuple[str, int]]:
        """The keys the next ``record`` names (handed out since the last one), in order."""
        return list(self._keys)

    def forget(self) -> None:
        """Drop the keys handed out so far (a reader restored from a checkpoint)."""
        self._keys.clear()

    def record(self, step: int, *, run: str, policy_version: int, metrics: Mapping[str, float] | None = None,
               annotations: Any = None, attempt: int | None = None,
               samples: Sequence[tuple[str, int]] | None = None) -> RecordedStep:
        """Record step ``step`` of ``run`` for this rank: one ``train_step`` naming
        ``samples`` (default: the keys handed out since the last record) and one
        ``sample_annotation`` per entry of ``annotations``, in one atomic append.

        ``annotations``: ``{(trajectory_id, sample_index): {"trainer_logprobs": ...,
        "advantages": ..., "entropy": ..., "metrics": {...}}}``, or a list of
        such dicts carrying ``trajectory_id`` and ``sample_index``. ``attempt``:
        None picks it (the module doc's rule); an int is used as it is (a
        conflict raises ConflictError). On success the handed-out keys are
        cleared; on an error they stay, and the call may be retried."""
        # the handed-out keys are (str, int) pairs already: copied, not rebuilt (a step's
        # hundreds of objects fewer for the trainer's garbage collector)
        keys = list(self._keys) if samples is None else [(str(t), int(i)) for t, i in samples]
        notes = _annotation_list(annotations)
        if attempt is not None:
            events = self._events(step, run, policy_version, metrics, notes, keys, attempt)
            result = self._append(events)
            replayed = getattr(result, "num_appended", 1) == 0
        else:
            attempt, replayed = self._record_auto(step, run, policy_version, metrics, notes, keys)
        if samples is None:
            self._keys.clear()
        return RecordedStep(run, int(step), self.rank, attempt, len(keys), len(notes), replayed)

    def _record_auto(self, step: int, run: str, policy_version: int, metrics: Mapping[str, float] | None,
                     notes: list[dict[str, Any]], keys: list[tuple[str, int]]) -> tuple[int, bool]:
        """The module doc's attempt rule, with no read in the usual case: a step not
        recorded yet goes in at attempt 0 straight away. Only a conflict (attempt 0
        holds other content) or a replay (attempt 0 holds this content, and a higher
        attempt may stand) reads the standing attempt, and continues from it."""
        attempt, looked = 0, False
        for _ in range(_MAX_ATTEMPTS):
            events = self._events(step, run, policy_version, metrics, notes, keys, attempt)
            try:
                result = self._append(events)
            except ConflictError:
                if not looked:  # continue from the standing attempt (at least the next one)
                    looked = True
                    attempt = max(self._standing(run, step, self.rank) or 0, attempt + 1)
                else:
                    attempt += 1  # this attempt holds other content: the step was redone
                continue
            replayed = getattr(result, "num_appended", 1) == 0
            if replayed and not looked:
                looked = True
                standing = self._standing(run, step, self.rank)
                if standing is not None and standing > attempt:
                    attempt = standing  # a redone step stands: the replay is judged against it
                    continue
            return attempt, replayed
        raise ConflictError(f"step {step} of run {run!r}, rank {self.rank}: {_MAX_ATTEMPTS} attempts after "
                            "the standing one are taken")

    def _events(self, step: int, run: str, policy_version: int, metrics: Mapping[str, float] | None,
                notes: list[dict[str, Any]], keys: list[tuple[str, int]], attempt: int) -> list[dict[str, Any]]:
        if policy_version is None:
            raise ValidationError("record_step needs policy_version (the version of the weights this step "
                                  "trained; a reader's current_model_version when set)", rule="missing_field")
        train_step: dict[str, Any] = {"type": "train_step", "run": run, "step": step, "rank": self.rank,
                                      "world_size": self.world_size, "policy_version": policy_version,
                                      "samples": keys, "attempt": attempt}
        if metrics:
            train_step["metrics"] = dict(metrics)
        if self.projection is not None:
            train_step["projection"] = self.projection
        return [train_step] + annotation_events(notes, run=run, step=step, attempt=attempt,
                                                projection=self.projection)


def store_recorder(store: Any, *, rank: int = 0, world_size: int = 1,
                   projection: str | None = None) -> StepRecorder:
    """A ``StepRecorder`` that appends to ``store`` (a ``Store``)."""
    return StepRecorder(store.append, store.log.standing_attempt, rank=rank, world_size=world_size,
                        projection=projection)


def annotation_events(notes: Iterable[Mapping[str, Any]], *, run: str, step: int, attempt: int = 0,
                      projection: str | None = None) -> list[dict[str, Any]]:
    """``sample_annotation`` wire events for annotation dicts (each with
    ``trajectory_id``, ``sample_index`` and any of the arrays and ``metrics``).
    Torch tensors become numpy arrays."""
    out = []
    for note in notes:
        ev: dict[str, Any] = {"type": "sample_annotation", "run": run, "step": step, "attempt": attempt,
                              "trajectory_id": note["trajectory_id"], "sample_index": int(note["sample_index"])}
        for name in ANNOTATION_ARRAYS:
            value = note.get(name)
            if value is not None:
                ev[name] = _plain(value)
        if note.get("metrics"):
            ev["metrics"] = dict(note["metrics"])
        if projection is not None:
            ev["projection"] = projection
        extra = set(note) - {"trajectory_id", "sample_index", "metrics", *ANNOTATION_ARRAYS}
        if extra:
            raise ValidationError(f"an annotation has unknown key {sorted(extra)[0]!r} (allowed: trajectory_id, "
                                  f"sample_index, metrics, {', '.join(ANNOTATION_ARRAYS)})", rule="unknown_field")
        out.append(ev)
    return out


def _annotation_list(annotations: Any) -> list[dict[str, Any]]:
    if annotations is None:
        return []
    if isinstance(annotations, Mapping):
        out = []
        for key, value in annotations.items():
            tid, index = key
            out.append({"trajectory_id": tid, "sample_index": int(index), **dict(value)})
        return out
    return [dict(a) for a in annotations]


def _plain(value: Any) -> Any:
    """A tensor as a numpy array (``detach().cpu()``); numbers and arrays as they are."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu()
        if hasattr(value, "float") and str(getattr(value, "dtype", "")) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    return value


def step_samples(store: Any, *, run: str, step: int) -> list[Any]:
    """The ``Sample`` objects step ``step`` of ``run`` consumed (every rank, its
    standing attempt), in (rank, order consumed): the step's data, to export or
    to train on again. Exactly those, or ``ProjectionChangedError``: when the step
    read a projection that was dropped (or dropped and created again: another
    fold under the same name) since, or when some of its samples no longer exist,
    never other samples or fewer."""
    keys = store.log.step_samples(run=run, step=step)
    out = []
    for projection in dict.fromkeys(k["projection"] for k in keys):
        if projection is not None:
            _same_projection(store, run, step, projection,
                             {k.get("projection_token") for k in keys if k["projection"] == projection} - {None})
        wanted = {(k["trajectory_id"], k["sample_index"]): i for i, k in enumerate(keys)
                  if k["projection"] == projection}
        for s in store.samples(trajectory_ids=sorted({t for t, _ in wanted}), projection=projection):
            i = wanted.get((s.trajectory_id, s.sample_index))
            if i is not None:
                out.append((i, s))
    if len(out) != len(keys):
        found = {i for i, _ in out}
        k = next(k for i, k in enumerate(keys) if i not in found)
        raise ProjectionChangedError(
            f"step {step} of run {run!r} trained on {len(keys)} samples, {len(keys) - len(out)} of which no longer "
            f"exist (the first: [{k['trajectory_id']!r}, {k['sample_index']}] of "
            + ("the default samples" if k["projection"] is None else f"projection {k['projection']!r}") + ")")
    return [s for _, s in sorted(out, key=lambda pair: pair[0])]


def _same_projection(store: Any, run: str, step: int, name: str, tokens: set[str]) -> None:
    """The step's samples of projection ``name`` are the current projection's: its
    recorded identity is the current one (steps recorded before identities were kept
    have none: their samples are checked one by one only)."""
    try:
        current = store.materialized.projection(name).token
    except ValidationError:
        current = None
    if current is None or (tokens and tokens != {current}):
        raise ProjectionChangedError(
            f"step {step} of run {run!r} trained on projection {name!r} as it was before it was dropped"
            + ("" if current is None else " and created again") + ": those samples no longer exist "
            "(a projection created again is another fold; export it with --projection)")


@dataclass(frozen=True, eq=False)
class Annotation:
    """A ``sample_annotation`` as stored: its key, arrays (float32 views, None when not
    sent; ``advantages`` a float when sent as one number) and metrics."""

    run: str
    step: int
    attempt: int
    trajectory_id: str
    sample_index: int
    trainer_logprobs: np.ndarray | None
    advantages: np.ndarray | float | None
    entropy: np.ndarray | None
    metrics: dict[str, float]
    standing: bool
    """The highest attempt recorded for its (run, step, sample)."""


def read_annotations(store: Any, *, run: str, step: int | None = None, trajectory_id: str | None = None,
                     standing_only: bool = True) -> list[Annotation]:
    """The annotations of ``run`` (of one ``step``, of one trajectory's samples),
    ordered by (step, trajectory_id, sample_index, attempt); with ``standing_only``
    (default) only the standing attempt of each. Arrays are read from the payload."""
    rows = store.log.annotation_rows(run=run, step=step, trajectory_id=trajectory_id)
    top: dict[tuple, int] = {}
    for r in rows:
        k = (r["step"], r["trajectory_id"], r["sample_index"])
        top[k] = max(top.get(k, -1), r["attempt"])
    tables = store.payload.read_locators(rows)
    out = []
    for r in rows:
        standing = top[(r["step"], r["trajectory_id"], r["sample_index"])] == r["attempt"]
        if standing_only and not standing:
            continue
        arrays: dict[str, Any] = dict.fromkeys(ANNOTATION_ARRAYS)
        if r["segment"] is not None:
            part = tables[r["segment"]]
            at = part.index[int(r["segment_row"])]
            for name in ANNOTATION_ARRAYS:
                arrays[name] = part.lists(name, np.float32)[at]
        if r["advantage"] is not None:
            arrays["advantages"] = float(r["advantage"])
        out.append(Annotation(r["run"], int(r["step"]), int(r["attempt"]), r["trajectory_id"],
                              int(r["sample_index"]), arrays["trainer_logprobs"], arrays["advantages"],
                              arrays["entropy"], json.loads(r["metrics"]), standing))
    return out
