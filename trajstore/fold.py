"""The pure fold: one trajectory's generation events -> training samples.

Everything SPEC.md says about merging, loss masks, logprobs (and whether the
engine reported them), model versions (per token, SPEC "Versions"), finish
reasons, rewards and routed experts lives here and nowhere else. No I/O, no clock, no
globals: the same events always give the same samples, so the materializer
can re-fold a trajectory after a crash and get byte-identical rows.

Shape of the algorithm:

1. ``_split`` walks the events once and groups them into samples: an event
   joins the current sample iff its prompt starts with the sample's sequence
   so far (prompt + output of the previous event), compared with numpy.
2. ``_make_sample`` builds each sample with one ``np.concatenate`` for the
   response ids and preallocated arrays filled by per-event slices for the
   rest, so the cost is a few numpy calls per event, never a Python loop per
   token. Routes are copied exactly once, into the sample's own array.

Routes bookkeeping (SPEC "Routed experts"): each sample keeps a *recorded
length* ``w``, a watermark. An event's rows cover absolute positions
``start .. start+rows-1``; the part below ``w`` is ignored (a recorded route
is never overwritten), the part above is appended, and a gap between ``w``
and ``start`` stays masked ("never captured") for good, masked rows count as
recorded. Positions past the final watermark (at least the last token) are
masked too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from trajstore.errors import ValidationError
from trajstore.events import Generation, routes_dtype
from trajstore.sample import Sample

__all__ = ["FoldMetrics", "FoldResult", "fold"]


@dataclass(frozen=True)
class FoldMetrics:
    """SPEC "Metrics of a materialization"; ``+`` aggregates over trajectories."""

    num_steps_before: int = 0
    """Generation events folded."""
    num_samples_after: int = 0
    """Samples produced."""
    prefix_mismatch_count: int = 0
    """Events that closed a sample and started a new one."""

    @property
    def merge_ratio(self) -> float:
        return self.num_samples_after / self.num_steps_before if self.num_steps_before else 0.0

    def __add__(self, other: FoldMetrics) -> FoldMetrics:
        if not isinstance(other, FoldMetrics):
            return NotImplemented
        return FoldMetrics(
            self.num_steps_before + other.num_steps_before,
            self.num_samples_after + other.num_samples_after,
            self.prefix_mismatch_count + other.prefix_mismatch_count,
        )

    def to_dict(self) -> dict[str, float | int]:
        return {
            "num_steps_before": self.num_steps_before,
            "num_samples_after": self.num_samples_after,
            "merge_ratio": self.merge_ratio,
            "prefix_mismatch_count": self.prefix_mismatch_count,
        }


@dataclass(frozen=True)
class FoldResult:
    samples: list[Sample]
    metrics: FoldMetrics
    calls_per_sample: tuple[int, ...] = ()
    """Generation events merged into each sample (1 = no merge)."""


@dataclass(frozen=True)
class _RouteSpec:
    """Per-trajectory route layout: every sample's routes share it."""

    dtype: np.dtype
    layers: int
    topk: int


@dataclass(frozen=True)
class _Trajectory:
    trajectory_id: str
    group_id: str | None
    status: str
    reward_mode: str | None  # "scalar", "token" or None
    routes: _RouteSpec | None  # None: the trajectory carries no routes at all


def fold(
    generations: Sequence[Generation],
    *,
    trajectory_id: str,
    group_id: str | None = None,
    status: str = "completed",
    final_reward: float | None = None,
    num_experts: int | None = None,
) -> FoldResult:
    """Fold one trajectory's generation events (in seq order) into samples.

    ``final_reward`` is the trajectory-level ``reward`` event; it overrides the
    final sample's reward. ``num_experts`` (from trajectory_started) fixes the
    route dtype; without it the largest expert id seen decides. Raises
    ValidationError for rules that only the whole trajectory reveals:
    ``reward_mode``, ``routes_shape``, ``missing_route_rows``.
    """
    if not generations:
        return FoldResult([], FoldMetrics())
    for gen in generations:
        if gen.trajectory_id != trajectory_id:
            raise ValidationError(
                f"generation seq {gen.seq} belongs to {gen.trajectory_id!r}, not {trajectory_id!r}",
                trajectory_id=trajectory_id,
                rule="trajectory_id",
            )
    traj = _Trajectory(
        trajectory_id,
        group_id,
        status,
        _reward_mode(generations, trajectory_id),
        _route_spec(generations, num_experts, trajectory_id),
    )
    groups = _split(generations)
    samples: list[Sample] = []
    prev: Sample | None = None
    prev_recorded = 0
    for index, group in enumerate(groups):
        prev, prev_recorded = _make_sample(group, index, len(groups), prev, prev_recorded, traj)
        samples.append(prev)
    if final_reward is not None:
        samples[-1].reward = float(final_reward)
    return FoldResult(samples, FoldMetrics(len(generations), len(samples), len(groups) - 1),
                      tuple(len(g) for g in groups))


def _continues(prev: Generation, gen: Generation) -> bool:
    """True when gen's prompt is prev's prompt + output + (possibly empty) delta."""
    p, o = len(prev.prompt_ids), len(prev.output_ids)
    return (
        len(gen.prompt_ids) >= p + o
        and np.array_equal(gen.prompt_ids[:p], prev.prompt_ids)
        and np.array_equal(gen.prompt_ids[p : p + o], prev.output_ids)
    )


def _split(generations: Sequence[Generation]) -> list[list[Generation]]:
    """Group events into samples; each new group is one prefix mismatch."""
    groups = [[generations[0]]]
    for gen in generations[1:]:
        if _continues(groups[-1][-1], gen):
            groups[-1].append(gen)
        else:
            groups.append([gen])
    return groups


def _reward_mode(generations: Sequence[Generation], trajectory_id: str) -> str | None:
    scalar = [g.seq for g in generations if g.reward is not None]
    token = [g.seq for g in generations if g.token_rewards is not None]
    if scalar and token:
        raise ValidationError(
            f"scalar reward (seq {scalar[0]}) and token_rewards (seq {token[0]}) mixed in one trajectory",
            trajectory_id=trajectory_id,
            rule="reward_mode",
        )
    return "token" if token else "scalar" if scalar else None


def _route_spec(generations: Sequence[Generation], num_experts: int | None, trajectory_id: str) -> _RouteSpec | None:
    routed = [g for g in generations if g.routed_experts is not None]
    if not routed:
        return None
    layers, topk = routed[0].routed_experts.shape[1:]
    max_id = 0
    for gen in routed:
        if gen.routed_experts.shape[1:] != (layers, topk):
            raise ValidationError(
                f"generation seq {gen.seq} has routes [layers, topk] = {list(gen.routed_experts.shape[1:])}, "
                f"earlier events have {[layers, topk]}",
                trajectory_id=trajectory_id,
                rule="routes_shape",
            )
        # uint8 rows cannot decide between uint8 and uint16, so only wider inputs are scanned.
        if gen.routed_experts.dtype != np.uint8 and gen.routed_experts.size:
            max_id = max(max_id, int(gen.routed_experts.max()))
    dtype = routes_dtype(max_id if num_experts is None else num_experts - 1)
    if max_id > np.iinfo(dtype).max:
        # Casting would wrap silently; admission should have refused these ids already.
        raise ValidationError(
            f"expert id {max_id} does not fit num_experts={num_experts}",
            trajectory_id=trajectory_id,
            rule="expert_id_range",
        )
    return _RouteSpec(dtype, layers, topk)


def _make_sample(
    group: list[Generation],
    index: int,
    num_samples: int,
    prev: Sample | None,
    prev_recorded: int,
    traj: _Trajectory,
) -> tuple[Sample, int]:
    """Build sample ``index`` from its events; also return its recorded route length."""
    response, loss_mask, logprobs, logprobs_mask, versions, outputs = _tokens(group)
    token_rewards = _token_rewards(outputs, len(response)) if traj.reward_mode == "token" else None
    routes = mask = None
    recorded = 0
    if traj.routes is not None:
        inherited = _inherited_rows(group[0], prev, prev_recorded, traj.trajectory_id)
        routes, mask, recorded = _sample_routes(group, inherited, traj.routes)
    rewards = [g.reward for g in group if g.reward is not None]
    # Over generated tokens (versions never decrease within a call, so its first
    # token has its oldest); a sample with no generated token still names the policy called.
    producing = [(_first_version(g), g.model_version) for g in group if len(g.output_ids)] or [
        (g.model_version, g.model_version) for g in group]
    sample = Sample(
        trajectory_id=traj.trajectory_id,
        group_id=traj.group_id,
        sample_index=index,
        is_last_step=index == num_samples - 1,
        status=traj.status,
        prompt_ids=np.array(group[0].prompt_ids, dtype=np.int32),
        response_ids=response,
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        logprobs_mask=logprobs_mask,
        token_model_versions=versions,
        finish_reason=group[-1].finish_reason,
        reward=rewards[-1] if rewards else None,
        token_rewards=token_rewards,
        routed_experts=routes,
        routed_experts_mask=mask,
        min_model_version=int(min(lo for lo, _ in producing)),
        max_model_version=int(max(hi for _, hi in producing)),
    )
    return sample, recorded


def _first_version(gen: Generation) -> int:
    tv = gen.token_model_versions
    return gen.model_version if tv is None or not len(tv) else int(tv[0])


def _tokens(
    group: list[Generation],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[tuple[int, Generation]]]:
    """Response arrays of one sample, and (offset, event) for each event's output."""
    pieces = [group[0].output_ids]
    outputs = [(0, group[0])]
    offset = len(group[0].output_ids)
    for prev, gen in zip(group, group[1:]):
        delta = gen.prompt_ids[prev.num_tokens :]
        pieces += (delta, gen.output_ids)
        offset += len(delta)
        outputs.append((offset, gen))
        offset += len(gen.output_ids)
    response = np.concatenate(pieces, dtype=np.int32)
    # Defaults are the observation (delta) values; outputs overwrite their slices.
    loss_mask = np.zeros(offset, np.uint8)
    logprobs = np.zeros(offset, np.float32)
    logprobs_mask = np.zeros(offset, np.bool_)
    versions = np.full(offset, -1, np.int32)
    for start, gen in outputs:
        out = slice(start, start + len(gen.output_ids))
        loss_mask[out] = 1 if gen.loss_mask is None else gen.loss_mask
        if gen.logprobs is not None:
            logprobs[out] = gen.logprobs
            logprobs_mask[out] = True
        versions[out] = gen.model_version if gen.token_model_versions is None else gen.token_model_versions
    return response, loss_mask, logprobs, logprobs_mask, versions, outputs


def _token_rewards(outputs: list[tuple[int, Generation]], num_response: int) -> np.ndarray:
    """0.0 on observation tokens and on calls of the trajectory that sent none."""
    rewards = np.zeros(num_response, np.float32)
    for start, gen in outputs:
        if gen.token_rewards is not None:
            rewards[start : start + len(gen.output_ids)] = gen.token_rewards
    return rewards


def _inherited_rows(
    gen: Generation, prev: Sample | None, prev_recorded: int, trajectory_id: str
) -> tuple[np.ndarray, np.ndarray] | None:
    """Rows below a new sample's routed_experts_start, taken from the previous sample.

    The engine skipped those positions because the caller said they were
    recorded; they are only usable if the previous sample recorded them for
    the very same tokens. Masked rows there stay masked.
    """
    start = gen.routed_experts_start
    if gen.routed_experts is None or start == 0:
        return None
    if prev is None or prev_recorded < start or not _same_prefix(gen, prev, start):
        raise ValidationError(
            f"generation seq {gen.seq} starts a new sample with routed_experts_start={start}, "
            "but the previous sample did not record routes for the same first "
            f"{start} tokens",
            trajectory_id=trajectory_id,
            rule="missing_route_rows",
        )
    return prev.routed_experts[:start], prev.routed_experts_mask[:start]


def _same_prefix(gen: Generation, prev: Sample, n: int) -> bool:
    """Whether gen's sequence and prev's sequence agree on their first n tokens."""
    ours = np.concatenate((gen.prompt_ids[:n], gen.output_ids[:n]))[:n]
    theirs = np.concatenate((prev.prompt_ids[:n], prev.response_ids[:n]))[:n]
    return len(ours) == n and len(theirs) == n and np.array_equal(ours, theirs)


def _sample_routes(
    group: list[Generation], inherited: tuple[np.ndarray, np.ndarray] | None, spec: _RouteSpec
) -> tuple[np.ndarray, np.ndarray, int]:
    """Routes and mask [P+R] of one sample, and its recorded length (watermark)."""
    segments: list[tuple[int, np.ndarray, np.ndarray | None]] = []
    recorded = 0
    if inherited is not None:
        segments.append((0, *inherited))
        recorded = len(inherited[0])
    for gen in group:
        rows, start = gen.routed_experts, gen.routed_experts_start
        if rows is None or len(rows) == 0 or start + len(rows) <= recorded:
            continue
        skip = max(recorded - start, 0)  # already recorded: never overwritten
        segments.append((start + skip, rows[skip:], None))
        recorded = start + len(rows)
    num_tokens = group[-1].num_tokens
    routes = np.empty((num_tokens, spec.layers, spec.topk), spec.dtype)
    mask = np.ones(num_tokens, np.bool_)
    for pos, rows, rows_mask in segments:
        routes[pos : pos + len(rows)] = rows
        mask[pos : pos + len(rows)] = False if rows_mask is None else rows_mask
    routes[mask] = np.arange(spec.topk, dtype=spec.dtype)
    return routes, mask, recorded
