"""The training row that folding a trajectory produces (docs/reference.md "Sample fields").

Array dtypes: token ids and model versions int32, loss mask uint8, logprobs
and token rewards float32, logprobs mask bool ``[R]`` (True where the engine
reported the logprob), routes uint8/uint16 ``[P+R, layers, topk]``,
route mask bool ``[P+R]`` (True = no captured route at that position).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

__all__ = ["Sample", "FIELDS"]


@dataclass(slots=True, eq=False)
class Sample:
    """One training row. Field names are the export column names; do not rename."""

    trajectory_id: str
    group_id: str | None
    sample_index: int
    is_last_step: bool
    status: str
    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [R]
    loss_mask: np.ndarray  # uint8 [R]
    rollout_logprobs: np.ndarray  # float32 [R], 0.0 where not given
    logprobs_mask: np.ndarray  # bool [R], True where rollout_logprobs holds a logprob the engine reported
    token_model_versions: np.ndarray  # int32 [R], -1 on observation tokens
    finish_reason: str | None  # the last merged generation event's own finish_reason
    reward: float | None
    token_rewards: np.ndarray | None  # float32 [R]
    routed_experts: np.ndarray | None  # uint8/uint16 [P+R, layers, topk]
    routed_experts_mask: np.ndarray | None  # bool [P+R]
    min_model_version: int
    max_model_version: int

    FIELDS: ClassVar[tuple[str, ...]]

    @property
    def num_tokens(self) -> int:
        """Prompt plus response length (P+R), the number of route rows."""
        return len(self.prompt_ids) + len(self.response_ids)

    def equals(self, other: object) -> bool:
        """Field-by-field equality; arrays must match in dtype, shape and values."""
        if not isinstance(other, Sample):
            return False
        return all(_same(getattr(self, name), getattr(other, name)) for name in FIELDS)


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(np.array_equal(a, b))
        )
    return (a is None) == (b is None) and bool(a == b)


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Sample))
Sample.FIELDS = FIELDS
