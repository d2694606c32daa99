"""Sampling policies: which of the ready units each of the reader's steps takes.

A *unit* is one sample, or with ``keep_groups`` one whole group (``_batch_plan``).
``fifo`` (the default) takes the units in completion order, each once: the
reader's cursor over the prefix-stable unit sequence is its whole state.
Every other policy keeps a *pool*: up to ``window`` units read in completion
order and not used up yet. Each step the policy ranks the pool; the step
takes the longest prefix of that ranking that packs into the ranks'
batches (``plan_step``), and each unit taken counts one use. A unit leaves
the pool after ``max_uses`` uses (1 except for ``reuse``).

* ``ready_first(bound)``: units at most ``bound`` policy versions stale first,
  in completion order; staler ones wait (they are not dropped) and are
  taken when fewer fresh units than a step are ready.
* ``freshness(decay, seed)``: a weighted draw without replacement, weight
  ``decay ** staleness``.
* ``reuse(max_uses, seed)``: a uniform draw; a unit is taken at most
  ``max_uses`` times, once per step at most (off-policy replay).

Staleness is ``current_model_version - oldest token's version`` (the
``staleness`` of the ``sample_consumption`` view); before the trainer sets
``current_model_version`` the newest version in the pool stands for it.

Determinism. A draw's generator is seeded by ``(seed, global step)``, and
the pool is filled the same way whatever the timing (in a snapshot read:
until it holds ``window`` units or the samples end), so a step is a pure
function of the reader state before it. The state records the pool as the
keys of its units and their uses: a reader restored from it rescans those
rows and takes exactly the steps the uninterrupted reader would have.

Policies are frozen dataclasses, JSON-able through ``to_dict`` (their name
included), and picked from ``POLICIES`` by name (``policy_from``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, ClassVar, Iterator, Mapping

import numpy as np

from trajstore.reader._plan import Key, Step, Unit, plan_step
from trajstore.errors import ResumeStateError, ValidationError

__all__ = ["FifoPolicy", "FreshnessPolicy", "IDLE", "POLICIES", "ReadyFirstPolicy", "ReusePolicy", "SamplingPolicy",
           "policy_from", "pooled_steps"]

IDLE: Any = object()
"""Put in the unit stream by a follow read when a poll found nothing new: the
pool stops filling there once it holds a step's worth."""


def _check_int(policy: str, name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValidationError(f"policy {policy!r}: {name} must be an integer >= {lo}, got {value!r}",
                              rule="reader_config")


class SamplingPolicy:
    """The interface: ``rank(pool, step, current)`` orders the pool for one step."""

    name: str
    pooled: ClassVar[bool] = True
    """False for ``fifo``: no pool, the reader's plain cursor."""
    uses_version: ClassVar[bool] = False
    """Whether the ranking reads ``current_model_version`` (then the next step
    is not planned ahead: the trainer sets the version after each batch)."""
    window: int = 1
    max_uses: int = 1

    def to_dict(self) -> dict[str, Any]:
        """The policy as JSON: its name and parameters."""
        out = asdict(self)  # type: ignore[call-overload]
        return {"name": out.pop("name"), **out}

    def rank(self, versions: np.ndarray, *, step: int, current: int | None) -> np.ndarray:
        """Pool indices, most wanted first; ``versions`` are the units' oldest
        token versions, in completion order. Pure: the same inputs, the same order."""
        raise NotImplementedError

    def _check(self) -> None:
        _check_int(self.name, "window", self.window, 1)


def _staleness(versions: np.ndarray, current: int | None) -> np.ndarray:
    reference = current if current is not None else int(versions.max())
    return np.maximum(reference - versions, 0)


def _generator(seed: int, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, step])


@dataclass(frozen=True)
class FifoPolicy(SamplingPolicy):
    """Completion order, each unit once: the plain cursor (no pool, no draw).
    The order the store's samples became ready in; nothing is preferred."""

    name: str = field(default="fifo", init=False)
    pooled: ClassVar[bool] = False


@dataclass(frozen=True)
class ReadyFirstPolicy(SamplingPolicy):
    """Units at most ``bound`` versions stale first, in completion order; the
    staler ones wait, and are taken when fewer fresh units than a step are in
    the pool (pacing instead of discarding: a slow rollout is trained on
    later, never dropped)."""

    bound: int = 1
    """Staleness (policy versions) a unit may have to be taken first."""
    window: int = 64
    """Units the pool holds (read in completion order, not used up yet)."""
    name: str = field(default="ready_first", init=False)
    uses_version: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self._check()
        _check_int(self.name, "bound", self.bound, 0)

    def rank(self, versions: np.ndarray, *, step: int, current: int | None) -> np.ndarray:
        fresh = _staleness(versions, current) <= self.bound
        return np.concatenate([np.flatnonzero(fresh), np.flatnonzero(~fresh)])


@dataclass(frozen=True)
class FreshnessPolicy(SamplingPolicy):
    """A seeded draw without replacement, weight ``decay ** staleness``: fresh
    units are likelier, stale ones still come (later); each unit once. The
    weights' ratios do not change as the trainer's version moves, so the draw
    does not read it: the next step is planned ahead (prefetch)."""

    decay: float = 0.5
    """Weight ratio of a unit one version staler than another, in (0, 1]; 1 draws uniformly."""
    window: int = 64
    """Units the pool holds (read in completion order, not used up yet)."""
    seed: int = 0
    """Seeds the draw, with the global step."""
    name: str = field(default="freshness", init=False)

    def __post_init__(self) -> None:
        self._check()
        _check_int(self.name, "seed", self.seed, 0)
        d = self.decay
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d <= 1:
            raise ValidationError(f"policy 'freshness': decay must be a number in (0, 1], got {d!r}",
                                  rule="reader_config")

    def rank(self, versions: np.ndarray, *, step: int, current: int | None) -> np.ndarray:
        # Efraimidis-Spirakis: u ** (1 / w), largest first, is a weighted draw without
        # replacement; in logs, smallest first: log(-log u) - log w. With w = decay **
        # (current - version), log w = (current - version) log decay, and the current
        # version adds the same to every key: the order depends only on the versions,
        # so the draw needs no current_model_version (and plans ahead).
        u = 1.0 - _generator(self.seed, step).random(len(versions))  # in (0, 1]
        with np.errstate(divide="ignore"):  # u = 1: log 0 = -inf, first
            keys = np.log(-np.log(u)) + versions * math.log(self.decay)
        return np.argsort(keys, kind="stable")


@dataclass(frozen=True)
class ReusePolicy(SamplingPolicy):
    """A seeded uniform draw over the pool; each unit is taken up to ``max_uses``
    times (at most once per step) before it leaves the pool: off-policy replay."""

    max_uses: int = 2
    """Times a unit is taken at most (``k``)."""
    window: int = 64
    """Units the pool holds (read in completion order, not used up yet)."""
    seed: int = 0
    """Seeds the draw, with the global step."""
    name: str = field(default="reuse", init=False)

    def __post_init__(self) -> None:
        self._check()
        _check_int(self.name, "max_uses", self.max_uses, 1)
        _check_int(self.name, "seed", self.seed, 0)

    def rank(self, versions: np.ndarray, *, step: int, current: int | None) -> np.ndarray:
        return _generator(self.seed, step).permutation(len(versions))


POLICIES: dict[str, type[SamplingPolicy]] = {
    "fifo": FifoPolicy, "ready_first": ReadyFirstPolicy, "freshness": FreshnessPolicy, "reuse": ReusePolicy,
}
"""The policies by name: ``ReaderConfig(policy=name)`` picks one here."""


def policy_from(value: Any) -> SamplingPolicy:
    """A policy from its name, its ``to_dict()`` form (``{"name": ..., parameters}``)
    or itself; ``ValidationError`` naming what is wrong."""
    if isinstance(value, SamplingPolicy):
        return value
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping):
        raise ValidationError(f"policy must be a name ({', '.join(map(repr, POLICIES))}), a mapping or a policy "
                              f"object, got {type(value).__name__}", rule="reader_config")
    params = dict(value)
    name = params.pop("name", None)
    cls = POLICIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValidationError(f"policy must be one of {', '.join(map(repr, POLICIES))}, got {name!r}",
                              rule="reader_config")
    known = [f.name for f in fields(cls) if f.init]  # type: ignore[arg-type]
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValidationError(f"policy {name!r} takes {known or 'no parameters'}, got {unknown}",
                              rule="reader_config")
    return cls(**params)


@dataclass(eq=False)
class _Entry:
    unit: Unit
    uses: int = 0


def pooled_steps(policy: SamplingPolicy, units: Iterator[Unit], *, cursor: Key | None, restored: dict[Key, int],
                 world_size: int, capacity: int, cost: Callable[[Unit], int], stale: Callable[[Unit], bool],
                 current: Callable[[], int | None], counts: dict[str, int], drop_last: bool,
                 state_after: Callable[[Key | None, list[Unit], list[int]], dict[str, Any]]) -> Iterator[Step]:
    """The global steps of a pooled policy (see the module doc).

    ``units``: the unit stream from the committed state on: first the pool's
    units (keys at or before ``cursor``, uses in ``restored``), then the units
    after the cursor, with ``IDLE`` when a follow poll found nothing new.
    ``stale(unit)`` says ``max_staleness`` drops it (at the step, counted);
    ``counts`` are the saved stats, updated; ``state_after(cursor, pool units,
    their uses)`` is the reader state a step carries."""
    pool: list[_Entry] = []
    budget = world_size * capacity
    restore_until, missing = cursor, dict(restored)
    ended = False
    while True:
        while not ended and len(pool) < policy.window:
            unit = next(units, None)
            if unit is None:
                ended = True
            elif unit is IDLE:
                if sum(cost(e.unit) for e in pool) >= budget:
                    break  # a follow read: nothing more now, and enough for a step
            elif restore_until is not None and unit.key <= restore_until:
                pool.append(_Entry(unit, missing.pop(unit.key)))
            else:
                if missing:
                    break  # checked below
                counts["filtered_samples"] += len(unit.rows) - len(unit.kept)
                cursor = unit.key
                if unit.kept:
                    pool.append(_Entry(unit))
        if missing:
            raise ResumeStateError(f"the state's pool names {len(missing)} units the store no longer has "
                                   f"(first {list(min(missing))}): was it saved reading another store?")
        dropped = [e for e in pool if stale(e.unit)]
        if dropped:
            pool = [e for e in pool if not stale(e.unit)]
            counts["stale_units"] += len(dropped)
            counts["stale_samples"] += sum(len(e.unit.kept) for e in dropped)
        total = sum(cost(e.unit) for e in pool)
        if not pool or (ended and drop_last and total < budget):
            if dropped:  # the drops move the state on
                yield Step(counts["steps"], None, _state(state_after, cursor, pool))
            if ended:
                return
            continue
        versions = np.fromiter((e.unit.oldest_version for e in pool), np.int64, len(pool))
        ranked = policy.rank(versions, step=counts["steps"], current=current())
        n, _ = plan_step([cost(pool[i].unit) for i in ranked], world_size, capacity)
        chosen = sorted(int(i) for i in ranked[:n])  # in completion order
        taken = [pool[i].unit for i in chosen]
        _, bins = plan_step([cost(u) for u in taken], world_size, capacity)
        for i in chosen:
            pool[i].uses += 1
        pool = [e for e in pool if e.uses < policy.max_uses]
        counts["steps"] += 1
        yield Step(counts["steps"] - 1, [[taken[j] for j in b] for b in bins], _state(state_after, cursor, pool))


def _state(state_after: Callable[[Key | None, list[Unit], list[int]], dict[str, Any]], cursor: Key | None,
           pool: list[_Entry]) -> dict[str, Any]:
    return state_after(cursor, [e.unit for e in pool], [e.uses for e in pool])
