"""The reader's settings and counters: ``ReaderConfig`` and ``ReaderStats``.

Re-exported by ``trajstore.reader`` (their documented home); ``SampleReader``,
``SampleDataset`` and ``ReplayReader`` take ``ReaderConfig``'s fields as
keywords (``_settings``).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from trajstore.reader._policies import SamplingPolicy, policy_from
from trajstore.errors import ValidationError

__all__ = ["ReaderConfig", "ReaderStats"]


def _settings(owner: str, config: "ReaderConfig | None", fields: dict[str, Any]) -> dict[str, Any]:
    """A reader's settings as ``ReaderConfig`` keywords, for ``owner.__init__`` to
    call. A ``ReaderConfig`` given as well is the deprecated form: its fields,
    overridden by ``fields``; the warning points at the constructor's caller."""
    if config is None:
        return fields
    warnings.warn(f"{owner}(..., config) is deprecated; pass the settings as keywords "
                  f"({owner}(..., batch_size=8, ...), or **dataclasses.asdict(config))",
                  DeprecationWarning, stacklevel=3)
    return {**asdict(config), **fields}


@dataclass(frozen=True)
class ReaderConfig:
    batch_size: int | None = None
    """Samples per rank batch (a group counts as its samples). Default 8 when
    ``max_tokens_per_batch`` is not set either."""
    max_tokens_per_batch: int | None = None
    """Prompt+response tokens per rank batch instead of a sample count; units
    are spread over ranks so their token counts balance. A unit larger than
    this gets a batch of its own."""
    keep_groups: bool = False
    """Keep each GRPO group whole: in one batch of one rank, or skipped whole."""
    group_size: int | None = None
    """Trajectories per group; needed with ``keep_groups``. A group is read
    once that many of its trajectories are materialized."""
    status: tuple[str, ...] | None = None
    """Keep only samples with one of these statuses (None: all)."""
    drop_finish_reasons: tuple[str, ...] | None = None
    """Leave out samples whose ``finish_reason`` is one of these, e.g.
    ``("length",)`` for overlong responses (as SkyRL's filter does). Decided
    as each batch is loaded: the batch holds fewer samples than planned; the
    steps, and so the resume state, do not change. Counted in
    ``stats.dropped_samples``."""
    mask_finish_reasons: tuple[str, ...] | None = None
    """Keep samples whose ``finish_reason`` is one of these, with their
    ``loss_mask`` zeroed: they are in the batch (group baselines see them) but
    add no loss. Counted in ``stats.masked_samples``."""
    max_staleness: int | None = None
    """Skip units whose oldest token is older than ``current_model_version - max_staleness``."""
    follow: bool = False
    """Keep polling for newly materialized samples (async RL)."""
    timeout_s: float = 60.0
    """With ``follow``: stop after this long without a new sample."""
    poll_interval_s: float = 0.5
    """With ``follow``: sleep between polls that found nothing. A step is
    handed over as soon as it is full, so this bounds the hand-over delay."""
    unavailable_timeout_s: float = 120.0
    """How long a read of an unavailable store (``StoreUnavailable``: a
    database restarting, the replay service's database down) is retried with
    backoff before the error is raised; 0 raises at once."""
    drop_last: bool = False
    """Leave a final step that is not full unconsumed instead of yielding it
    (then a rank may get an empty batch); a later reader picks it up."""
    prefetch: bool = True
    """Load the next step's batch in a background thread while this one is
    used (payload decoding releases the GIL). Off with ``max_staleness`` and
    with the ``ready_first`` policy, whose next step is planned only once
    ``current_model_version`` is set."""
    read_threads: int = 2
    """Threads decoding one batch's payload from Parquet sample segments (the
    format before Arrow; a Parquet read decodes on one core). Arrow segments
    are memory-mapped views and need no decoding."""
    num_shards: int | None = None
    """Materializer shards writing this store (their checkpoints bound what is
    safe to read). None: as many as the stored checkpoints name; when given it
    must agree with them."""
    page_rows: int = 1024
    """Sample rows per SQL query."""
    projection: str | None = None
    """Read the samples of this named projection (``trajstore projection create``;
    docs/projections.md) instead of the default fold's. Its own checkpoints bound
    what is safe to read."""
    policy: str | Mapping[str, Any] | SamplingPolicy = "fifo"
    """Which ready units each step takes (docs/reader.md, "Sampling policies"):
    ``"fifo"`` (completion order, each once; the default), ``"ready_first"``,
    ``"freshness"``, ``"reuse"``; a name, a mapping ``{"name": ..., parameters}``
    or a policy object (``trajstore.reader.ReusePolicy(max_uses=2)``, ...).
    Held as the policy object; part of the resume state's fingerprint."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", policy_from(self.policy))
        for name in ("status", "drop_finish_reasons", "mask_finish_reasons"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
            elif value is not None:
                object.__setattr__(self, name, tuple(value))
        both = set(self.drop_finish_reasons or ()) & set(self.mask_finish_reasons or ())
        if both:
            raise ValidationError(f"finish reasons {sorted(both)} are both dropped and masked; choose one",
                                  rule="reader_config")
        if self.batch_size is not None and self.max_tokens_per_batch is not None:
            raise ValidationError("set batch_size or max_tokens_per_batch, not both", rule="reader_config")
        for name in ("batch_size", "max_tokens_per_batch", "group_size", "num_shards", "page_rows", "read_threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValidationError(f"{name} must be a positive integer, got {value!r}", rule="reader_config")
        if self.keep_groups and self.group_size is None:
            raise ValidationError("keep_groups=True needs group_size (trajectories per group)", rule="reader_config")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValidationError(f"max_staleness must be >= 0, got {self.max_staleness}", rule="reader_config")
        for name in ("timeout_s", "poll_interval_s", "unavailable_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValidationError(f"{name} must be a number of seconds >= 0, got {value!r}", rule="reader_config")

    @property
    def capacity(self) -> int:
        """Cost a rank batch may hold: samples, or tokens."""
        return self.max_tokens_per_batch or self.batch_size or 8

    def fingerprint(self) -> dict[str, Any]:
        """What defines the unit sequence; a state must be resumed with the same."""
        out = {"keep_groups": self.keep_groups, "group_size": self.group_size,
               "status": None if self.status is None else sorted(self.status)}
        if self.projection is not None:  # absent for the default: states saved before projections load
            out["projection"] = self.projection
        if self.policy.pooled:  # absent for fifo: states saved before policies load
            out["policy"] = self.policy.to_dict()
        return out


@dataclass
class ReaderStats:
    steps: int = 0
    """Global steps consumed (the same on every rank)."""
    batches: int = 0
    """Batches this rank yielded in this process."""
    samples: int = 0
    """Samples this rank yielded in this process."""
    tokens: int = 0
    """Prompt+response tokens this rank yielded in this process."""
    stale_units: int = 0
    """Units (samples or groups) skipped as too stale, over all ranks."""
    stale_samples: int = 0
    filtered_samples: int = 0
    """Samples dropped by the status filter, over all ranks."""
    dropped_samples: int = 0
    """Samples this rank left out by ``drop_finish_reasons`` in this process."""
    masked_samples: int = 0
    """Samples this rank loss-masked by ``mask_finish_reasons`` in this process."""
    open_groups: int = 0
    """Groups seen but not complete yet (waiting for members)."""
    polls: int = 0
    """Polls in follow mode that found nothing new."""
    unavailable_waits: int = 0
    """Times this reader found the store unavailable and waited for it (one per outage)."""
    unavailable_s: float = 0.0
    """Seconds this reader waited for an unavailable store, over the outages that ended."""

    _SAVED = ("steps", "stale_units", "stale_samples", "filtered_samples")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)
