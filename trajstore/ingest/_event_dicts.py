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

from trajstore.events._wire import encode_b64

__all__ = ["ABORT_ROUTES_NOTE", "json_default", "partial_routes_of_abort", "to_numpy", "trajectory_started"]

ABORT_ROUTES_NOTE = "route_rows_dropped"
"""``metadata`` key of an aborted call whose partial route rows were not recorded (how many it sent)."""


def partial_routes_of_abort(event: dict, metadata: dict, rows_sent: int) -> None:
    """An aborted engine call may answer with route rows for only part of its sequence
    (docs/ingest.md "Route rows of an aborted call": vLLM 0.33.0 and SGLang 0.5.23 both
    do). The store refuses rows that stop short of position ``prompt + output - 2``
    (``too_few_route_rows``), so the adapter says so explicitly: when ``event`` (a
    generation with ``routed_experts``) finished ``abort`` with fewer rows than it
    covers, its rows are left out (its positions stay without a captured route, masked)
    and ``metadata["route_rows_dropped"]`` records how many it sent. Anything else is
    left to the store's rules."""
    if event.get("finish_reason") != "abort" or "routed_experts" not in event:
        return
    covered = len(event["prompt_ids"]) + len(event["output_ids"]) - 1 - int(event.get("routed_experts_start", 0))
    if rows_sent < covered:
        del event["routed_experts"]
        event.pop("routed_experts_start", None)
        metadata[ABORT_ROUTES_NOTE] = int(rows_sent)


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
