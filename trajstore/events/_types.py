"""The wire format's event types: immutable dataclasses with numpy arrays.

What each event type may carry (``_FIELDS``, docs/reference.md "Event wire
format") and the typed events ``parse_event`` returns. Import them from
``trajstore.events``, their documented path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

__all__ = [
    "ANNOTATION_ARRAYS", "ARRAY_FIELDS", "Event", "FINISH_STATUSES", "Generation", "GroupDropped", "LEDGER_FIELDS",
    "LINEAGE_TYPES", "WHOLE_STATUSES",
    "LOGPROB_PLACEHOLDER", "Reward", "SampleAnnotation", "TOKEN_FIELDS", "TrainStep", "TrajectoryFinished",
    "TrajectoryStarted", "VersionLabel", "routes_dtype",
]

FINISH_STATUSES = ("completed", "truncated", "aborted", "failed", "abandoned")
WHOLE_STATUSES = ("completed", "truncated")
"""docs/reference.md "Rollout ledger": the finish statuses that count toward a group's ``group_size``."""
LEDGER_FIELDS = ("run", "prompt_id", "epoch", "group_size")
"""docs/reference.md "Rollout ledger": the ``trajectory_started`` fields sent all together or not at all."""
LOGPROB_PLACEHOLDER = -9999.0
"""docs/reference.md: a logprob at or below this is not a logprob but the placeholder vLLM and
SkyRL write where the engine had none. Accepted as sent; the fold stores it as
missing (``logprobs_mask`` false, ``rollout_logprobs`` 0.0) and the index counts
it per event (``events.num_placeholder_logprobs``)."""

# docs/reference.md "Event wire format": the fields each event type may carry. Anything
# else is refused (``unknown_field``): a misspelled ``logprob`` must never be
# dropped silently.
_FIELDS = {
    "trajectory_started": frozenset({"type", "trajectory_id", "group_id", "num_experts", "metadata", "event_id",
                                     "run", "prompt_id", "epoch", "group_size"}),
    "generation": frozenset({
        "type", "trajectory_id", "seq", "prompt_ids", "output_ids", "logprobs", "loss_mask", "model_version",
        "token_model_versions", "weight_versions", "routed_experts", "routed_experts_start", "reward",
        "token_rewards", "finish_reason", "metadata", "event_id"}),
    "reward": frozenset({"type", "trajectory_id", "reward", "event_id"}),
    "trajectory_finished": frozenset({"type", "trajectory_id", "status", "event_id"}),
    "version_label": frozenset({"type", "label", "model_version", "event_id"}),
}
# The generation fields that are ARRAYs (``_wire``): a body decoder may parse them straight to numpy,
# and a Generation's arrays are these attributes.
ARRAY_FIELDS = ("prompt_ids", "output_ids", "logprobs", "loss_mask", "token_rewards", "token_model_versions",
                "routed_experts")
# The fields whose lengths are an event's tokens (``Generation.num_tokens``, the writers' batch budgets).
TOKEN_FIELDS = ("prompt_ids", "output_ids")
assert set(ARRAY_FIELDS) <= _FIELDS["generation"] and set(TOKEN_FIELDS) <= set(ARRAY_FIELDS)

# -- Training lineage (docs/reference.md "Training lineage"): the trainer's store-wide events ------------------
#
# ``train_step``: the samples one rank consumed in one optimizer step, with the step's
# metrics; ``sample_annotation``: what the trainer computed on one sample in a step
# (its recomputed logprobs, advantages, entropy, metrics). Rules that need the store
# (the samples exist, arrays have one entry per response token) are admission's
# (``trajstore.lineage._admission``).

LINEAGE_TYPES = ("train_step", "sample_annotation")
ANNOTATION_ARRAYS = ("trainer_logprobs", "advantages", "entropy")
"""The per-token arrays of a ``sample_annotation`` (``advantages`` may be one number instead)."""

_FIELDS.update({
    "train_step": frozenset({"type", "run", "step", "rank", "world_size", "policy_version", "samples",
                             "projection", "attempt", "metrics", "event_id"}),
    "sample_annotation": frozenset({"type", "run", "step", "attempt", "trajectory_id", "sample_index",
                                    "projection", *ANNOTATION_ARRAYS, "metrics", "event_id"}),
})


@dataclass(frozen=True, slots=True, eq=False)
class TrajectoryStarted:
    """``run``, ``prompt_id``, ``epoch``, ``group_size``: the rollout ledger's fields
    (docs/reference.md "Rollout ledger"), all None or all set (then ``group_id`` is set too)."""

    trajectory_id: str
    group_id: str | None = None
    num_experts: int | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    event_id: str | None = None
    type: str = "trajectory_started"
    run: str | None = None
    prompt_id: str | None = None
    epoch: int | None = None
    group_size: int | None = None

    @property
    def ledger(self) -> tuple[str, str, int, int] | None:
        """``(run, prompt_id, epoch, group_size)``, or None for a trajectory outside the ledger."""
        if self.run is None:
            return None
        return (self.run, self.prompt_id, self.epoch, self.group_size)  # type: ignore[return-value]


@dataclass(frozen=True, slots=True, eq=False)
class Generation:
    """One engine call. Arrays are numpy; optional ones are None when absent."""

    trajectory_id: str
    seq: int
    prompt_ids: np.ndarray  # int32 [P], the FULL prompt of this call
    output_ids: np.ndarray  # int32 [O]
    # The last output token's version when token_model_versions is given (or derived from
    # weight_versions); as sent, possibly None, while weight_versions holds an unresolved label.
    model_version: int | None
    logprobs: np.ndarray | None = None  # float32 [O]
    loss_mask: np.ndarray | None = None  # uint8 [O]
    routed_experts: np.ndarray | None = None  # uint8/uint16 [rows, layers, topk]
    routed_experts_start: int = 0
    reward: float | None = None
    token_rewards: np.ndarray | None = None  # float32 [O]
    finish_reason: str | None = None
    event_id: str | None = None
    token_model_versions: np.ndarray | None = None  # int32 [O], non-decreasing; last == model_version
    metadata: Mapping[str, Any] | None = None  # small JSON object, free-form
    # The engine's spans as sent: ((label, start, end), ...) tiling the output, label a str or int.
    weight_versions: tuple[tuple[str | int, int, int], ...] | None = None
    type: str = "generation"

    @property
    def num_tokens(self) -> int:
        return sum(len(getattr(self, name)) for name in TOKEN_FIELDS)


@dataclass(frozen=True, slots=True, eq=False)
class Reward:
    trajectory_id: str
    reward: float
    event_id: str | None = None
    type: str = "reward"


@dataclass(frozen=True, slots=True, eq=False)
class TrajectoryFinished:
    trajectory_id: str
    status: str
    event_id: str | None = None
    type: str = "trajectory_finished"


@dataclass(frozen=True, slots=True, eq=False)
class VersionLabel:
    """Store-wide: the engine's weight-version ``label`` means policy ``model_version``.

    Not part of any trajectory (``trajectory_id`` is ``""``)."""

    label: str
    model_version: int
    event_id: str | None = None
    type: str = "version_label"
    trajectory_id: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class GroupDropped:
    """Store-wide (docs/reference.md "Rollout ledger"): group ``group_id`` of ``run`` is
    dropped: never whole, takes no new trajectory, its samples never handed out.
    Not part of any trajectory (``trajectory_id`` is ``""``)."""

    run: str
    group_id: str
    reason: str | None = None
    event_id: str | None = None
    type: str = "group_dropped"
    trajectory_id: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class TrainStep:
    """Store-wide: rank ``rank`` of ``world_size`` consumed ``samples`` in step ``step`` of ``run``.

    ``attempt``: a step redone after a restore takes a higher one; for every
    ``(run, step, rank)`` the highest stands. Not part of any trajectory
    (``trajectory_id`` is ``""``)."""

    run: str
    step: int
    rank: int
    world_size: int
    policy_version: int
    samples: tuple[tuple[str, int], ...]  # (trajectory_id, sample_index), in the order consumed
    projection: str | None = None  # None: the default samples
    attempt: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    event_id: str | None = None
    type: str = "train_step"
    trajectory_id: str = ""

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.run, self.step, self.rank, self.attempt)


@dataclass(frozen=True, slots=True, eq=False)
class SampleAnnotation:
    """What the trainer computed on sample ``(trajectory_id, sample_index)`` in step
    ``step`` (attempt ``attempt``) of ``run``. Arrays are float32, one entry per
    response token; ``advantages`` may instead be one number (a float)."""

    run: str
    step: int
    trajectory_id: str
    sample_index: int
    attempt: int = 0
    projection: str | None = None
    trainer_logprobs: np.ndarray | None = None  # float32 [R]
    advantages: np.ndarray | float | None = None  # float32 [R], or one number for the whole sample
    entropy: np.ndarray | None = None  # float32 [R]
    metrics: Mapping[str, float] = field(default_factory=dict)
    event_id: str | None = None
    type: str = "sample_annotation"

    @property
    def key(self) -> tuple[str, int, int, str, int]:
        return (self.run, self.step, self.attempt, self.trajectory_id, self.sample_index)

    @property
    def num_tokens(self) -> int | None:
        """Entries of its per-token arrays (None when it has none)."""
        for name in ANNOTATION_ARRAYS:
            value = getattr(self, name)
            if isinstance(value, np.ndarray):
                return len(value)
        return None

_FIELDS["group_dropped"] = frozenset({"type", "run", "group_id", "reason", "event_id"})

Event = Union[TrajectoryStarted, Generation, Reward, TrajectoryFinished, VersionLabel, TrainStep, SampleAnnotation,
              GroupDropped]


def routes_dtype(max_id: int) -> np.dtype:
    """docs/reference.md: uint8 when every expert id < 256, else uint16."""
    return np.dtype(np.uint8) if max_id < 256 else np.dtype(np.uint16)
