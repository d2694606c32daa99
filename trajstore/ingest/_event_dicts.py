"""Building wire-format event dicts on the client side (the Writer, the proxy, the vLLM adapters).

``trajectory_started`` builds that event from its optional fields;
``to_numpy`` turns an engine's torch tensor into numpy (without importing
torch); ``json_default`` is the ``json.dumps`` hook that
sends numpy values the way the service reads them (arrays as
``{b64, dtype, shape}``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from trajstore._wire import encode_b64

__all__ = ["json_default", "to_numpy", "trajectory_started"]


def trajectory_started(trajectory_id: str, *, group_id: str | None = None, num_experts: int | None = None,
                       metadata: Mapping | None = None, run: str | None = None, prompt_id: str | None = None,
                       epoch: int | None = None, group_size: int | None = None) -> dict:
    """A ``trajectory_started`` event; fields left None are left out."""
    event: dict = {"type": "trajectory_started", "trajectory_id": trajectory_id}
    for key, value in (("group_id", group_id), ("num_experts", num_experts), ("metadata", metadata), ("run", run),
                       ("prompt_id", prompt_id), ("epoch", epoch), ("group_size", group_size)):
        if value is not None:
            event[key] = value
    return event


def to_numpy(value: Any) -> Any:
    """A torch tensor as a numpy array (torch itself is never imported); anything else as it is."""
    if hasattr(value, "detach"):  # a torch tensor
        return value.detach().cpu().numpy()
    return value


def json_default(value: Any) -> Any:
    """``json.dumps``'s ``default``: numpy arrays as ``{b64, dtype, shape}`` (compact, and decoded
    without a per-element Python loop on the other side), numpy scalars as Python numbers."""
    if isinstance(value, np.ndarray):
        return encode_b64(value)
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot send a {type(value).__name__} in an event")
