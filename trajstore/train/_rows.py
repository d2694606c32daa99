"""Per-row values the trainer adapters (SkyRL, verl) derive the same way."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from trajstore.errors import ValidationError
from trajstore.sample import Sample

_log = logging.getLogger("trajstore.train")


def loss_masks(samples: Sequence[Sample], missing_logprobs: str, rule: str) -> tuple[list[list[int]], int]:
    """Each sample's loss mask as a list, and how many trained tokens without a
    logprob ``missing_logprobs="mask"`` took out of it."""
    if missing_logprobs not in ("mask", "refuse", "keep"):
        raise ValidationError(f"missing_logprobs must be 'mask', 'refuse' or 'keep', got {missing_logprobs!r}",
                              rule=rule)
    any_logprobs = any(bool(s.logprobs_mask.any()) for s in samples)
    out, masked = [], 0
    for s in samples:
        loss_mask = s.loss_mask
        missing = (loss_mask != 0) & ~s.logprobs_mask
        if any_logprobs and missing_logprobs != "keep" and bool(missing.any()):
            if missing_logprobs == "refuse":
                position = int(np.flatnonzero(missing)[0])
                raise ValidationError(
                    f"sample {s.trajectory_id}#{s.sample_index}: trained response token {position} has no "
                    "rollout logprob (the trainer would read 0.0); pass missing_logprobs='mask' to leave such tokens "
                    "out of the loss", rule=rule)
            loss_mask = np.where(missing, 0, loss_mask).astype(loss_mask.dtype)
            masked += int(missing.sum())
        out.append(loss_mask.astype(np.int64).tolist())
    if masked:
        _log.info("%d trained tokens without a rollout logprob left out of the loss", masked)
    return out, masked


def rewards(samples: Sequence[Sample], missing_reward: float | None, rule: str) -> list[Any]:
    """One reward per sample, or (when any sample has token rewards) per-token lists
    with the sample's reward added on its last response token."""
    out = []
    for s in samples:
        reward = s.reward
        if reward is None:
            if missing_reward is None and s.is_last_step:
                raise ValidationError(
                    f"sample {s.trajectory_id}#{s.sample_index} has no reward; the trainer needs one per row "
                    "(pass missing_reward=... to fill it)", rule=rule)
            reward = 0.0 if missing_reward is None else missing_reward
        out.append(float(reward))
    if all(s.token_rewards is None for s in samples):
        return out
    per_token = []
    for s, reward in zip(samples, out):
        if s.token_rewards is None:
            row = np.zeros(len(s.response_ids), np.float64)
        else:
            row = s.token_rewards.astype(np.float64)
        if len(row):
            row[-1] += reward
        per_token.append(row.tolist())
    return per_token
