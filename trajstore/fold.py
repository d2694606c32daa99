"""The fold: one trajectory's generation events -> training samples.

Every rule docs/reference.md states about merging, loss masks, logprobs (and whether
the engine reported them: a -9999.0 placeholder is not a report), model versions (per token, docs/reference.md "Versions"),
finish reasons, rewards and routed experts lives here. No I/O, no clock, no
globals: the same events always give the same samples, so the materializer
can re-fold a trajectory after a crash and get byte-identical rows.

The fold is a reduction of one pure step over a trajectory's events:

* ``fold_step(tail, generation, previous)`` applies the per-event rules to
  the trajectory's tail state (``FoldTail``: the current sequence's length
  and hash, the current sample, the route watermark, the reward mode, the
  route layout) and returns the outcome (``FoldStep``: merged or a new
  sample, the sample index, ``prefix_len``, the route rows kept) and the new
  tail. It raises every refusal these rules make: ``reward_mode``,
  ``routes_shape``, ``missing_route_rows``.
  Admission (``trajstore._append.admission``) applies it once per appended event and
  stores the outcome (``events.sample_index``, ``is_merged``, ``prefix_len``,
  the rows kept) and the tail (the ``trajectories`` row); the SQL views read
  the stored outcome.
* ``fold()`` applies the same step to each event, then builds each sample
  from its events and their outcomes: one ``np.concatenate`` for the
  response ids and preallocated arrays filled by per-event slices for the
  rest, so the cost is a few numpy calls per event, never a Python loop per
  token. Routes are copied exactly once, into the sample's own array. The
  route dtype is a whole-trajectory decision (``num_experts``, else the
  largest id kept), so it is made here, not in the step; ids a dtype cannot
  hold are refused (``expert_id_range``).

A named projection (docs/projections.md) folds under another
``FoldPolicy`` (one sample per call, SkyRL's step-wise observation layout,
routes from the last call): a parameter of the same step and reduction, the
default being docs/reference.md's fold.

The merge rule (docs/reference.md fold rule 1) needs the previous call's sequence
``S_prev``. Admission holds only its length and a 128-bit hash
(``sequence_hash``), kept in the ``trajectories`` row, and decides by
hashing ``prompt[:seq_len]``; the fold holds the previous call's tokens and
compares them (hashing every event would cost the fold a third of its
speed). ``tests/test_fold_step.py`` checks that both give the same outcomes.

Routes bookkeeping (docs/reference.md "Routed experts"): each sample keeps a *recorded
length* ``route_len``, a watermark. An event's rows cover absolute positions
``start .. start+rows-1``; the part below the watermark is dropped (a
recorded route is never overwritten), the part above is kept, and a gap
between the watermark and ``start`` stays masked ("never captured") for good:
masked rows count as recorded. Positions past the final watermark (at least
the last token) are masked too. A call that starts a new sample with
``routed_experts_start > 0`` takes the rows below it from the previous
sample, which must have recorded them for the very same prompt tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence, Union

import numpy as np

from trajstore.errors import ValidationError
from trajstore.events import LOGPROB_PLACEHOLDER, Generation, routes_dtype
from trajstore.sample import Sample

__all__ = ["FoldMetrics", "FoldPolicy", "FoldResult", "FoldTail", "FoldStep", "fold", "fold_step", "sequence_hash",
           "EMPTY_HASH", "DEFAULT_POLICY", "first_model_version"]


def sequence_hash(tokens: np.ndarray) -> bytes:
    """128-bit digest of a token sequence (int32 little-endian bytes)."""
    return hashlib.blake2b(np.ascontiguousarray(tokens, dtype="<i4").tobytes(), digest_size=16).digest()


EMPTY_HASH = sequence_hash(np.zeros(0, dtype=np.int32))


@dataclass(frozen=True)
class FoldMetrics:
    """docs/reference.md "Metrics of a materialization"; ``+`` aggregates over trajectories."""

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
class FoldPolicy:
    """How the fold groups calls into samples: a parameter of ``fold_step`` and ``fold``.

    The default is docs/reference.md's fold. A named projection (docs/projections.md)
    re-folds the log under another policy; every rule not named here is the
    same for all policies."""

    merge: str = "prefix"
    """"prefix": a call whose prompt continues ``S_prev`` joins the current
    sample (docs/reference.md fold rule 1). "none": every call is a sample of its own
    (SkyRL's step-wise samples without merging)."""
    observation: str = "prompt"
    """With ``merge="none"``: where the observation tokens a call appended
    after ``S_prev`` go. "prompt": only in that call's prompt. "response": also
    at the end of the previous call's response, loss mask 0 (SkyRL's
    step-wise layout: a turn's response is its output + the next observation)."""
    routes: str = "first"
    """"first": a recorded route is never overwritten (R3, docs/reference.md). "last": rows
    a later call of the same sequence re-sent replace the recorded ones."""

    MERGE = ("prefix", "none")
    OBSERVATION = ("prompt", "response")
    ROUTES = ("first", "last")

    def __post_init__(self) -> None:
        for name, allowed in (("merge", self.MERGE), ("observation", self.OBSERVATION), ("routes", self.ROUTES)):
            if getattr(self, name) not in allowed:
                raise ValidationError(f"fold policy {name}={getattr(self, name)!r}: want one of "
                                      f"{', '.join(allowed)}", rule="fold_policy")
        if self.observation != "prompt" and self.merge != "none":
            raise ValidationError(f"fold policy observation={self.observation!r} needs merge='none' (merged "
                                  "samples keep observations in the response)", rule="fold_policy")

    def to_dict(self) -> dict[str, str]:
        return {"merge": self.merge, "observation": self.observation, "routes": self.routes}


DEFAULT_POLICY = FoldPolicy()


class FoldTail(NamedTuple):
    """What the fold knows of a trajectory after its last generation event.

    Admission keeps it in the ``trajectories`` row (these are its columns), so
    the next event is checked without reading payload. Immutable (a named
    tuple: the fold makes one per event, and a frozen dataclass costs 4x more
    to build)."""

    num_samples: int = 0
    """Samples started so far; the current sample is ``num_samples - 1``."""
    seq_len: int = 0
    """Length of ``S_prev``, the last call's prompt + output."""
    seq_hash: bytes | None = EMPTY_HASH
    """``sequence_hash(S_prev)``; None when the caller holds ``S_prev``'s tokens instead (the fold)."""
    route_len: int = 0
    """The current sample's recorded route length (the watermark)."""
    reward_mode: str | None = None
    """"scalar" or "token" once a call carried a reward."""
    route_layers: int | None = None
    """[layers, topk] of the trajectory's routes, once a call carried any."""
    route_topk: int | None = None


class FoldStep(NamedTuple):
    """The outcome of one generation event: what admission stores, what the fold builds from.

    Immutable (a named tuple, like ``FoldTail``); it holds an array, so compare fields, not steps."""

    merged: bool
    """The prompt continued ``S_prev``: the call joins the current sample."""
    sample_index: int
    """The sample the call folds into."""
    prefix_len: int
    """Prompt tokens that are ``S_prev`` (its length on a merge, else 0)."""
    routes: np.ndarray | None
    """Route rows kept, [rows, layers, topk] (a view of the call's rows); None without routes."""
    routes_start: int
    """Absolute position of ``routes[0]``."""
    continued: bool | None = None
    """The prompt continued ``S_prev`` (None: same as ``merged``; they differ
    only under ``FoldPolicy(merge="none")``)."""
    inherit: int | None = None
    """Route rows a new sample takes from the previous one (None: the rows
    below ``routes_start``, docs/reference.md's rule for a new sample with skipped rows)."""

    @property
    def inherited_rows(self) -> int:
        """Rows below ``routes_start`` a new sample takes from the previous one."""
        if self.merged:
            return 0
        if self.inherit is not None:
            return self.inherit
        return self.routes_start if self.routes is not None else 0

    @property
    def continues(self) -> bool:
        return self.merged if self.continued is None else self.continued


# S_prev as the caller holds it: the last call's (prompt_ids, output_ids), or a
# function returning its tokens (called only for the skipped-rows check).
Previous = Union[tuple[np.ndarray, np.ndarray], Callable[[], np.ndarray]]


def fold_step(
    tail: FoldTail, gen: Generation, previous: Previous, policy: FoldPolicy = DEFAULT_POLICY
) -> tuple[FoldStep, FoldTail]:
    """Apply one generation event to a trajectory's tail; return its outcome and the new tail.

    ``previous`` is ``S_prev``: the last call's ``(prompt_ids, output_ids)``
    when the caller holds them (the merge is decided by comparing tokens), or
    a function returning ``S_prev``'s tokens, called only when a new sample
    skips route rows (the merge is decided by ``tail.seq_hash``). The new
    tail carries a hash only if ``tail`` did. Raises ValidationError
    (``reward_mode``, ``routes_shape``, ``missing_route_rows``) without a
    trajectory or event index: the caller locates it.

    ``policy`` (default docs/reference.md's fold): with ``merge="none"`` a call that
    continues ``S_prev`` starts a sample of its own that inherits the rows
    its sequence recorded below the call's kept rows (the watermark carries
    on along the sequence); with ``routes="last"`` a continuing call's rows
    replace recorded ones instead of being ignored.
    """
    reward_mode = _reward_mode(gen, tail.reward_mode)
    layers, topk = _route_layout(gen, tail)
    continues = tail.num_samples > 0 and _starts_with_sequence(gen.prompt_ids, tail, previous)
    rows, start = gen.routed_experts, gen.routed_experts_start
    if continues:
        if policy.routes == "last":
            kept, kept_start, route_len = _last_routes(rows, start, tail.route_len)
        else:
            kept, kept_start, route_len = _merge_routes(rows, start, tail.route_len)
        if policy.merge == "prefix":
            step = FoldStep(True, tail.num_samples - 1, tail.seq_len, kept, kept_start)
        else:
            step = FoldStep(False, tail.num_samples, 0, kept, kept_start, True, min(kept_start, tail.route_len))
    else:
        _check_skipped_rows(gen, tail, previous)
        route_len = 0 if rows is None else start + len(rows)
        step = FoldStep(False, tail.num_samples, 0, rows, start)
    # num_samples, seq_len, seq_hash, route_len, reward_mode, route_layers, route_topk
    new = FoldTail(step.sample_index + 1, gen.num_tokens, None if tail.seq_hash is None else _hash_call(gen),
                   route_len, reward_mode, layers, topk)
    return step, new


def _hash_call(gen: Generation) -> bytes:
    """``sequence_hash(prompt + output)`` without concatenating them."""
    h = hashlib.blake2b(np.ascontiguousarray(gen.prompt_ids, dtype="<i4").tobytes(), digest_size=16)
    h.update(np.ascontiguousarray(gen.output_ids, dtype="<i4").tobytes())
    return h.digest()


def _starts_with_sequence(prompt: np.ndarray, tail: FoldTail, previous: Previous) -> bool:
    """docs/reference.md fold rule 1: the prompt is ``S_prev`` + a (possibly empty) delta."""
    n = tail.seq_len
    if len(prompt) < n:
        return False
    if isinstance(previous, tuple):
        p_prompt, p_output = previous
        p = len(p_prompt)
        return _equal(prompt[:p], p_prompt) and _equal(prompt[p:n], p_output)
    if tail.seq_hash is None:
        raise TypeError("fold_step: a tail without seq_hash needs the previous call's tokens")
    return sequence_hash(prompt[:n]) == tail.seq_hash


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """``np.array_equal`` of two token arrays; one ``memcmp`` when their dtypes agree."""
    if a.shape != b.shape:
        return False
    if a.dtype == b.dtype and a.dtype.kind in "iub":
        return a.tobytes() == b.tobytes()
    return bool(np.array_equal(a, b))


def _reward_mode(gen: Generation, mode: str | None) -> str | None:
    """docs/reference.md fold rule 5: one trajectory uses scalar or token rewards, never both."""
    if gen.reward is not None and gen.token_rewards is not None:
        raise ValidationError(f"generation seq {gen.seq} carries reward and token_rewards", rule="reward_mode")
    this = "token" if gen.token_rewards is not None else "scalar" if gen.reward is not None else None
    if this is not None and mode is not None and this != mode:
        raise ValidationError(
            f"{this} rewards (seq {gen.seq}) in a trajectory that already uses {mode} rewards", rule="reward_mode"
        )
    return mode or this


def _route_layout(gen: Generation, tail: FoldTail) -> tuple[int | None, int | None]:
    """Every call of a trajectory has the same [layers, topk]."""
    r = gen.routed_experts
    if r is None:
        return tail.route_layers, tail.route_topk
    layers, topk = int(r.shape[1]), int(r.shape[2])
    if tail.route_layers is not None and (layers, topk) != (tail.route_layers, tail.route_topk):
        raise ValidationError(
            f"generation seq {gen.seq} has routed_experts [layers, topk] = [{layers}, {topk}] but the "
            f"trajectory uses [{tail.route_layers}, {tail.route_topk}]",
            rule="routes_shape",
        )
    return layers, topk


def _merge_routes(rows: np.ndarray | None, start: int, route_len: int) -> tuple[np.ndarray | None, int, int]:
    """On a merge, keep only rows past the watermark (a recorded route is never overwritten)."""
    if rows is None:
        return None, route_len, route_len
    skip = max(0, route_len - start)
    kept = rows[skip:]
    # rows that reach past the watermark move it; none (or only recorded ones) leave it
    return kept, start + skip, start + len(rows) if len(kept) else route_len


def _last_routes(rows: np.ndarray | None, start: int, route_len: int) -> tuple[np.ndarray | None, int, int]:
    """``routes="last"``: keep every row the call sent; re-sent positions take the call's rows."""
    if rows is None:
        return None, route_len, route_len
    return rows, start, max(route_len, start + len(rows))


def _check_skipped_rows(gen: Generation, tail: FoldTail, previous: Previous) -> None:
    """A new sample's rows below routed_experts_start come from the previous sample (docs/reference.md R3).

    The engine skipped those prompt positions because the caller said they
    were recorded; they are only usable if the previous sample recorded them
    for the very same tokens."""
    start = gen.routed_experts_start
    if gen.routed_experts is None or start == 0:
        return
    if tail.num_samples == 0 or start > tail.route_len or start > len(gen.prompt_ids):
        raise ValidationError(
            f"generation seq {gen.seq} starts a new sample with routed_experts_start={start}, which skips route "
            f"rows that were never recorded (the previous sample recorded {tail.route_len})",
            rule="missing_route_rows",
        )
    before = np.concatenate(previous)[:start] if isinstance(previous, tuple) else previous()[:start]
    if not np.array_equal(before, gen.prompt_ids[:start]):
        raise ValidationError(
            f"generation seq {gen.seq} starts a new sample with routed_experts_start={start}, but its prompt "
            f"differs from the previous sample's tokens on the {start} skipped positions",
            rule="missing_route_rows",
        )


@dataclass(frozen=True)
class FoldResult:
    samples: list[Sample]
    metrics: FoldMetrics
    calls_per_sample: tuple[int, ...] = ()
    """Generation events merged into each sample (1 = no merge)."""
    steps: tuple[FoldStep, ...] = ()
    """Each event's outcome, in event order (what admission stores for it)."""


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


_NO_TOKENS = np.zeros(0, np.int32)

RoutesAlloc = Callable[[tuple[int, int, int], np.dtype], np.ndarray]
"""``(shape, dtype) -> array``: where a sample's routes are built (uninitialised, C-contiguous).

The fold only assigns to it (``routes[slice] = rows``, ``routes[mask] = ids``) and
slices it (a new sample's inherited rows: ``prev.routed_experts[:n]``), so it may
also be an object that records those assignments and replays them later
(``_samples.RoutesPlan``: the materializer builds the routes where it writes them)."""


def fold(
    generations: Sequence[Generation],
    *,
    trajectory_id: str,
    group_id: str | None = None,
    status: str = "completed",
    final_reward: float | None = None,
    num_experts: int | None = None,
    routes_alloc: RoutesAlloc | None = None,
    policy: FoldPolicy = DEFAULT_POLICY,
) -> FoldResult:
    """Fold one trajectory's generation events (in seq order) into samples.

    ``final_reward`` is the trajectory-level ``reward`` event; it overrides the
    final sample's reward. ``num_experts`` (from trajectory_started) fixes the
    route dtype; without it the largest expert id kept decides. Raises
    ValidationError naming the trajectory for a refusal of ``fold_step``.
    ``routes_alloc(shape, dtype)`` gives the (uninitialised) array each
    sample's routes are built in (default ``np.empty``), or a deferred one
    (``RoutesAlloc``): the materializer builds them straight in the buffer it
    writes the sample segment from. ``policy``: how calls are grouped into
    samples (``FoldPolicy``; default docs/reference.md's fold).
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
    steps, tail = _steps(generations, trajectory_id, policy)
    routes = _route_spec(steps, tail, num_experts, trajectory_id)
    traj = _Trajectory(trajectory_id, group_id, status, tail.reward_mode, routes)
    bounds = [i for i, s in enumerate(steps) if not s.merged] + [len(steps)]
    samples: list[Sample] = []
    prev: Sample | None = None
    alloc = routes_alloc or np.empty
    for index, (a, b) in enumerate(zip(bounds, bounds[1:])):
        # observation="response": the next call's observation (the prompt tokens after
        # this sample's sequence) closes this sample's response, with the next call's
        # routes for those positions (SkyRL's step-wise layout)
        after = steps[b] if policy.observation == "response" and b < len(steps) and steps[b].continues else None
        prev = _make_sample(generations[a:b], steps[a:b], index, len(bounds) - 1, prev, traj, alloc,
                            (generations[b], after) if after is not None else None)
        samples.append(prev)
    if final_reward is not None:
        samples[-1].reward = float(final_reward)
    mismatches = sum(1 for s in steps[1:] if not s.continues)
    return FoldResult(samples, FoldMetrics(len(generations), len(samples), mismatches),
                      tuple(b - a for a, b in zip(bounds, bounds[1:])), tuple(steps))


def _steps(generations: Sequence[Generation], trajectory_id: str,
           policy: FoldPolicy = DEFAULT_POLICY) -> tuple[list[FoldStep], FoldTail]:
    """``fold_step`` over the events, deciding merges by tokens (the fold holds them)."""
    tail = FoldTail(seq_hash=None)
    previous: tuple[np.ndarray, np.ndarray] = (_NO_TOKENS, _NO_TOKENS)
    steps = []
    for gen in generations:
        try:
            step, tail = fold_step(tail, gen, previous, policy)
        except ValidationError as e:
            raise ValidationError(e.reason, trajectory_id=trajectory_id, rule=e.rule) from None
        steps.append(step)
        previous = (gen.prompt_ids, gen.output_ids)
    return steps, tail


def _route_spec(steps: Sequence[FoldStep], tail: FoldTail, num_experts: int | None,
                trajectory_id: str) -> _RouteSpec | None:
    """docs/reference.md: uint8 when every expert id < 256 (num_experts decides when given), else uint16.

    Whole-trajectory, so not a step rule: the dtype of every sample's routes.
    Admission refuses ids >= num_experts as they arrive (``_admission``); the
    fold refuses kept ids its dtype cannot hold rather than wrap them."""
    if tail.route_layers is None or tail.route_topk is None:
        return None
    max_id = 0
    for step in steps:
        # uint8 rows cannot decide between uint8 and uint16, so only wider ones are scanned
        if step.routes is not None and step.routes.dtype != np.uint8 and step.routes.size:
            max_id = max(max_id, int(step.routes.max()))
    dtype = routes_dtype(max_id if num_experts is None else num_experts - 1)
    if max_id > np.iinfo(dtype).max:
        raise ValidationError(f"expert id {max_id} does not fit num_experts={num_experts}",
                              trajectory_id=trajectory_id, rule="expert_id_range")
    return _RouteSpec(dtype, tail.route_layers, tail.route_topk)


def _make_sample(
    group: Sequence[Generation],
    steps: Sequence[FoldStep],
    index: int,
    num_samples: int,
    prev: Sample | None,
    traj: _Trajectory,
    routes_alloc: RoutesAlloc,
    observation: tuple[Generation, FoldStep] | None = None,
) -> Sample:
    """Build sample ``index`` from its events and their outcomes; ``observation``:
    the next call and its outcome, whose observation tokens close the response."""
    trailing = None
    if observation is not None:
        trailing = observation[0].prompt_ids[group[-1].num_tokens:]
    response, loss_mask, logprobs, logprobs_mask, versions, outputs = _tokens(group, steps, trailing)
    token_rewards = _token_rewards(outputs, len(response)) if traj.reward_mode == "token" else None
    routes = mask = None
    if traj.routes is not None:
        more = (observation[1],) if observation is not None else ()
        routes, mask = _sample_routes(group[-1].num_tokens + (0 if trailing is None else len(trailing)),
                                      (*steps, *more), prev, traj.routes, routes_alloc)
    rewards = [g.reward for g in group if g.reward is not None]
    # Over generated tokens (versions never decrease within a call, so its first
    # token has its oldest); a sample with no generated token still names the policy called.
    producing = [(first_model_version(g), g.model_version) for g in group if len(g.output_ids)] or [
        (g.model_version, g.model_version) for g in group]
    return Sample(
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


def first_model_version(gen: Generation) -> int:
    """The version that produced a generation's first output token (its per-token versions, else
    ``model_version``): a sample's ``min_model_version`` and an event row's read it the same way."""
    tv = gen.token_model_versions
    return gen.model_version if tv is None or not len(tv) else int(tv[0])


def _tokens(
    group: Sequence[Generation], steps: Sequence[FoldStep], trailing: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[tuple[int, Generation]]]:
    """Response arrays of one sample, and (offset, event) for each event's output;
    ``trailing``: observation tokens after the last output (loss mask 0, like a delta)."""
    pieces = [group[0].output_ids]
    outputs = [(0, group[0])]
    offset = len(group[0].output_ids)
    for gen, step in zip(group[1:], steps[1:]):
        delta = gen.prompt_ids[step.prefix_len :]  # the observation tokens after S_prev
        pieces += (delta, gen.output_ids)
        offset += len(delta)
        outputs.append((offset, gen))
        offset += len(gen.output_ids)
    if trailing is not None:
        pieces.append(trailing)
        offset += len(trailing)
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
            # docs/reference.md: a logprob <= -9999.0 is the engine's placeholder for none: stored as missing
            reported = gen.logprobs > LOGPROB_PLACEHOLDER
            logprobs[out] = np.where(reported, gen.logprobs, np.float32(0.0))
            logprobs_mask[out] = reported
        versions[out] = gen.model_version if gen.token_model_versions is None else gen.token_model_versions
    return response, loss_mask, logprobs, logprobs_mask, versions, outputs


def _token_rewards(outputs: list[tuple[int, Generation]], num_response: int) -> np.ndarray:
    """0.0 on observation tokens and on calls of the trajectory that sent none."""
    rewards = np.zeros(num_response, np.float32)
    for start, gen in outputs:
        if gen.token_rewards is not None:
            rewards[start : start + len(gen.output_ids)] = gen.token_rewards
    return rewards


def _sample_routes(
    num_tokens: int, steps: Sequence[FoldStep], prev: Sample | None, spec: _RouteSpec, alloc: RoutesAlloc
) -> tuple[np.ndarray, np.ndarray]:
    """Routes and mask [P+R] of one sample: the rows its steps kept, at their positions."""
    routes = alloc((num_tokens, spec.layers, spec.topk), spec.dtype)
    mask = np.ones(num_tokens, np.bool_)
    inherited = steps[0].inherited_rows
    if inherited:
        assert prev is not None  # fold_step refuses a skip without a previous sample
        routes[:inherited] = prev.routed_experts[:inherited]
        mask[:inherited] = prev.routed_experts_mask[:inherited]
    for step in steps:
        if step.routes is not None and len(step.routes):
            # clipped to the sample: an observation="response" sample takes only the
            # next call's rows for its own positions
            n = min(len(step.routes), num_tokens - step.routes_start)
            if n <= 0:
                continue
            at = slice(step.routes_start, step.routes_start + n)
            routes[at] = step.routes if n == len(step.routes) else step.routes[:n]
            mask[at] = False
    routes[mask] = np.arange(spec.topk, dtype=spec.dtype)
    return routes, mask
