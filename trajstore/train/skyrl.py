"""SkyRL: reader batches as SkyRL 0.4.0's ``GeneratorOutput``.

SkyRL's trainer takes a ``GeneratorOutput`` (``skyrl/train/generators/base.py``,
a TypedDict of per-trajectory lists) from its generator. ``generator_output``
builds exactly that dict from a ``SampleReader`` batch, so a SkyRL trainer can
train on what a trajstore log holds instead of its in-memory buffer::

    from trajstore.train.skyrl import skyrl_batches

    for batch in skyrl_batches(reader):          # one per reader step
        train_on(batch.output)                   # SkyRL's GeneratorOutput
        checkpoint["reader"] = batch.reader_state

Fields SkyRL has no place for (per-token policy versions, which response
tokens have a logprob, which route rows were captured, the trajectory ids
themselves) travel next to it on the ``SkyRLBatch``.

Nothing here imports SkyRL: the output is plain lists, numpy arrays and
SkyRL's ``TrajectoryID`` when SkyRL is importable (else an equal dataclass of
the same two fields; see ``trajectory_id_type``).

Routes follow SkyRL's convention (``utils/routed_experts.py``,
``train/dataset/preprocess.py``): per trajectory the captured prefix of
``[rows, layers, topk]`` rows, row t being the route of the forward pass at
position t, in SkyRL's canonical dtypes (uint8, int16, int32). Every recorded
layer is kept, dense layers included as the engine recorded them: SkyRL maps
them to megatron's MoE routers itself by layer number
(``backends/skyrl_train/utils/replay_utils.py``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np

from trajstore.errors import ValidationError
from trajstore.sample import Sample
from trajstore.train._rows import loss_masks as _loss_masks
from trajstore.train._rows import rewards as _rewards

__all__ = ["SkyRLBatch", "generator_output", "skyrl_batches", "trajectory_id_type"]

_RULE = "skyrl"

MissingLogprobs = Literal["mask", "refuse", "keep"]


@dataclasses.dataclass
class _TrajectoryID:
    """Stand-in with SkyRL's ``TrajectoryID`` fields when SkyRL is not importable."""

    instance_id: str
    repetition_id: int

    def to_string(self) -> str:
        return f"{self.instance_id}_{self.repetition_id}"


def trajectory_id_type() -> type:
    """SkyRL's ``TrajectoryID`` when importable, else a dataclass with its two fields.

    SkyRL 0.4.0's package ``__init__`` files import pydantic models that need
    Python >= 3.12, so on 3.11 ``skyrl.train.generators.base`` may not import
    (docs/skyrl.md); SkyRL's own trainer process always has it. A failed
    import is not retried for every batch, but a module imported since is used.
    """
    module = sys.modules.get("skyrl.train.generators.base")
    if module is not None:
        return module.TrajectoryID
    if not _import_failed:
        try:
            from skyrl.train.generators.base import TrajectoryID
        except Exception:  # noqa: BLE001 - any import failure means: not usable here
            _import_failed.append(True)
        else:
            return TrajectoryID
    return _TrajectoryID


_import_failed: list[bool] = []


@dataclasses.dataclass
class SkyRLBatch:
    """One reader batch for SkyRL: ``output`` and what SkyRL has no field for."""

    output: dict[str, Any]
    """SkyRL's ``GeneratorOutput``: every key of the TypedDict, in its types."""
    trajectory_ids: list[str]
    """trajstore's trajectory id of each row (``output["trajectory_ids"]`` holds
    SkyRL's ``TrajectoryID(group, repetition)`` instead)."""
    sample_indices: list[int]
    group_ids: list[str | None]
    token_model_versions: list[np.ndarray]
    """Per row, int32 ``[R]``: the policy version of each response token (-1 on observations)."""
    logprobs_mask: list[np.ndarray]
    """Per row, bool ``[R]``: True where ``rollout_logprobs`` holds a logprob the engine reported."""
    routed_experts_mask: list[np.ndarray] | None
    """Per row, bool ``[P+R]``: True where no route was captured (docs/reference.md); None without routes."""
    masked_missing_logprobs: int = 0
    """Trained tokens whose loss mask was zeroed because they had no logprob (``missing_logprobs="mask"``)."""
    step: int | None = None
    """The reader's global step of this batch (``skyrl_batches``)."""
    reader_state: dict[str, Any] | None = None
    """The reader state after this batch: save it with the trainer checkpoint (``skyrl_batches``)."""


def generator_output(samples: Sequence[Sample], *, missing_logprobs: MissingLogprobs = "mask",
                     missing_reward: float | None = None) -> SkyRLBatch:
    """SkyRL's ``GeneratorOutput`` for a batch of samples, one row per sample.

    ``rewards``: each sample's reward (``List[float]``); when any sample has
    ``token_rewards``, every row is a per-token list (``List[List[float]]``)
    holding its token rewards plus its reward on the last response token.
    The store gives a trajectory's reward to its last sample; an earlier step
    (``is_last_step`` False, a prefix mismatch) has none and gets 0.0, as
    SkyRL's step-wise training reads only the last step's reward. A last step
    without a reward is refused unless ``missing_reward`` is given.

    ``rollout_logprobs`` is None when no sample has a logprob. Otherwise SkyRL
    reads every loss-masked token's entry as a real logprob, so a trained token
    without one (``logprobs_mask`` False) would get an importance ratio against
    0.0; ``missing_logprobs`` says what to do: ``"mask"`` zeroes those tokens'
    loss mask (counted in ``masked_missing_logprobs``), ``"refuse"`` raises,
    ``"keep"`` passes 0.0 as is.

    ``rollout_expert_indices`` is None when no sample has routes; otherwise
    every sample needs them, and its captured prefix (up to the first position
    without a captured route) must reach every trained token, as SkyRL's own
    validation demands; a sample that trains nothing gets one filler row.
    """
    if not samples:
        raise ValidationError("cannot convert an empty batch", rule=_RULE)
    loss_masks, masked = _loss_masks(samples, missing_logprobs, _RULE)
    any_logprobs = any(bool(s.logprobs_mask.any()) for s in samples)
    with_routes = [s.routed_experts is not None for s in samples]
    trajectory_id = trajectory_id_type()
    output: dict[str, Any] = {
        "prompt_token_ids": [s.prompt_ids.tolist() for s in samples],
        "response_ids": [s.response_ids.tolist() for s in samples],
        "rewards": _rewards(samples, missing_reward, _RULE),
        "loss_masks": loss_masks,
        "stop_reasons": _stop_reasons(samples),
        "rollout_metrics": _metrics(samples, masked),
        "rollout_logprobs": [s.rollout_logprobs.tolist() for s in samples] if any_logprobs else None,
        "trajectory_ids": [trajectory_id(instance, repetition) for instance, repetition in _repetitions(samples)],
        "trajectory_generation_times": None,
        "trajectory_time_splits": None,
        "rollout_expert_indices": _routes(samples, loss_masks) if any(with_routes) else None,
        "rollout_sample_support": None,
        "is_last_step": [bool(s.is_last_step) for s in samples],
        "env_metrics": None,
        "pixel_values": None,
        "image_grid_thw": None,
    }
    return SkyRLBatch(
        output=output,
        trajectory_ids=[s.trajectory_id for s in samples],
        sample_indices=[s.sample_index for s in samples],
        group_ids=[s.group_id for s in samples],
        token_model_versions=[s.token_model_versions for s in samples],
        logprobs_mask=[s.logprobs_mask for s in samples],
        routed_experts_mask=[s.routed_experts_mask for s in samples] if any(with_routes) else None,
        masked_missing_logprobs=masked,
    )


def skyrl_batches(reader: Any, **kwargs: Any) -> Iterator[SkyRLBatch]:
    """``generator_output`` of each batch of a ``SampleReader``, with its step and the
    reader state after it (resume: ``reader.load_state_dict(batch.reader_state)``).
    An empty batch (a rank with nothing in a final step) is skipped; its step still
    advances the state."""
    for step, samples in reader.iter_steps():
        if not samples:
            continue
        batch = generator_output(samples, **kwargs)
        batch.step, batch.reader_state = step, reader.state_dict()
        yield batch


def _stop_reasons(samples: Sequence[Sample]) -> list[Any] | None:
    """Each sample's finish reason; None when no sample has one. A sample without one
    keeps None (SkyRL's overlong filter, which keeps only ``"stop"``, masks it)."""
    reasons = [s.finish_reason for s in samples]
    return None if all(r is None for r in reasons) else reasons


def _metrics(samples: Sequence[Sample], masked: int) -> dict[str, Any]:
    return {
        "trajstore/min_model_version": min(s.min_model_version for s in samples),
        "trajstore/max_model_version": max(s.max_model_version for s in samples),
        "trajstore/masked_missing_logprobs": masked,
    }


def _repetitions(samples: Sequence[Sample]) -> list[tuple[str, int]]:
    """SkyRL's (instance_id, repetition_id): the group (the prompt; GRPO groups by it)
    and the trajectory's ordinal in its group in this batch, so that
    ``TrajectoryID.to_string()`` names each trajectory once and its steps share it."""
    ordinals: dict[str, dict[str, int]] = {}
    out = []
    for s in samples:
        instance = s.group_id if s.group_id is not None else s.trajectory_id
        members = ordinals.setdefault(instance, {})
        out.append((instance, members.setdefault(s.trajectory_id, len(members))))
    return out


def _routes(samples: Sequence[Sample], loss_masks: list[list[int]]) -> list[np.ndarray]:
    layer_topk = {s.routed_experts.shape[1:] for s in samples if s.routed_experts is not None}
    if len(layer_topk) > 1:
        raise ValidationError(f"samples disagree on routes [layers, topk]: {sorted(layer_topk)}", rule=_RULE)
    out = []
    for s, loss_mask in zip(samples, loss_masks):
        trained = np.flatnonzero(np.asarray(loss_mask))
        # Row t is the forward pass at position t, which predicts token t+1:
        # a trained response token j needs rows up to P+j-1 captured.
        needed = len(s.prompt_ids) + int(trained[-1]) if trained.size else 0
        if s.routed_experts is None:
            if needed:
                raise ValidationError(
                    f"sample {s.trajectory_id}#{s.sample_index} has no routes but other samples of the batch do; "
                    "SkyRL replays all rows or none", rule=_RULE)
            topk = next(iter(layer_topk))
            out.append(np.broadcast_to(np.arange(topk[1], dtype=np.uint8), (1, *topk)).copy())
            continue
        missing = np.flatnonzero(s.routed_experts_mask)
        captured = int(missing[0]) if missing.size else s.num_tokens
        if captured < needed:
            raise ValidationError(
                f"sample {s.trajectory_id}#{s.sample_index}: no captured route at position {captured}, before "
                f"trained token {needed}; SkyRL replays only a captured prefix", rule=_RULE)
        out.append(_canonical(s.routed_experts[:max(captured, 1)]))
    return out


def _canonical(routes: np.ndarray) -> np.ndarray:
    """SkyRL's canonical route dtypes (``compact_routed_expert_indices``): uint8, int16, int32."""
    if routes.dtype == np.uint8:
        return np.ascontiguousarray(routes)
    top = int(routes.max(initial=0))
    return np.ascontiguousarray(routes, dtype=np.int16 if top < 2**15 else np.int32)
