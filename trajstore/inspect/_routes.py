"""Expert load from samples' recorded routes: what the report's expert-load panel and
``trajstore track`` both count, in one pass of numpy over the route rows.

The route row that produced generated token j is the row of the position
before it (docs/reference.md "Routed experts"): the decode routes. Rows without a captured
route (``routed_experts_mask``) are left out. Layers whose every entry is 0 are
dense layers as vLLM records them (zeros), and are dropped from the figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from trajstore.log._aggregate_counts import count_routes, decode_routes

__all__: list[str] = []  # decode_routes and count_routes are trajstore.log._aggregate_counts'


@dataclass(frozen=True)
class ExpertLoad:
    """Routed-to counts ``counts[version, layer, expert]`` over decode routes."""

    versions: list[int]
    layers: list[int]
    """The MoE layers' indexes in the recorded layout (dense all-zero layers left out)."""
    counts: np.ndarray

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[2])

    def max_violation(self) -> np.ndarray:
        """Per version and layer: verl's ``max_vio`` (``max_violation``)."""
        return max_violation(self.counts)


def moe_layers(counts: np.ndarray) -> np.ndarray:
    """Which layers of ``counts[..., layer, expert]`` are MoE layers: routed to at all, and
    not only to expert 0 (vLLM records a dense layer's routes as zeros). The one place
    dense layers are told apart."""
    per_layer = counts.reshape(-1, *counts.shape[-2:]).sum(axis=0)  # [layer, expert] over versions
    return (per_layer.sum(axis=1) > 0) & (per_layer[:, 1:].sum(axis=1) > 0)


def max_violation(counts: np.ndarray) -> np.ndarray:
    """verl's ``max_vio`` of each layer of routed-to counts ``counts[..., layer, expert]``
    (``verl/trainer/ppo/metric_utils.py``): ``max_e(load_e / total * num_experts) - 1``,
    ``num_experts`` the last axis's size; -1 for a layer without routes. Callers keep the
    MoE layers (``moe_layers``) first."""
    counts = np.asarray(counts, np.float64)
    total = counts.sum(axis=-1, keepdims=True)
    return (counts / np.maximum(total, 1) * counts.shape[-1] - 1.0).max(axis=-1)


def expert_load(samples: Sequence[Any], num_experts: int | None = None) -> ExpertLoad | None:
    """The load of the samples' decode routes; the busiest layout when samples mix layouts.
    None when no sample has a routed generated token."""
    parts: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
    for s in samples:
        got = decode_routes(s)
        if got is not None and len(got[0]):
            parts.setdefault(got[0].shape[1:], []).append(got)
    if not parts:
        return None
    layout = max(parts, key=lambda k: sum(len(v) for _, v in parts[k]))
    rows = np.concatenate([r for r, _ in parts[layout]])
    versions_of = np.concatenate([v for _, v in parts[layout]])
    versions, vi = np.unique(versions_of, return_inverse=True)  # per token: small next to the entries
    counts = count_routes(rows, max(int(num_experts or 0), int(rows.max()) + 1), vi, len(versions))
    moe = moe_layers(counts)
    return ExpertLoad([int(v) for v in versions], [int(i) for i in np.flatnonzero(moe)], counts[:, moe, :])


ROUTES_MAX_BYTES = 4 << 20
"""A sample's routes go into the trace's data up to this size (the MoE layers' rows, raw)."""


def routes_view(sample: Any, n: int) -> dict[str, Any] | None:
    """Which experts each token was routed to, for the page's hover: the MoE layers' rows
    (layers whose every entry is 0 are vLLM's dense layers: left out) as raw little-endian
    bytes in base64, ``masked`` where the sample has no captured route. None without routes;
    ``{"too_large": bytes}`` past ``ROUTES_MAX_BYTES``."""
    import base64

    if sample.routed_experts is None:
        return None
    routes = np.asarray(sample.routed_experts)
    if routes.ndim != 3 or routes.shape[0] != n:
        return None
    moe = np.flatnonzero(routes.any(axis=(0, 2)))
    kept = np.ascontiguousarray(routes[:, moe, :])
    if kept.nbytes > ROUTES_MAX_BYTES:
        return {"too_large": int(kept.nbytes)}
    dtype = "uint8" if kept.dtype.itemsize == 1 else "uint16"
    mask = np.asarray(sample.routed_experts_mask, bool) if sample.routed_experts_mask is not None \
        else np.zeros(n, bool)
    return {"b64": base64.b64encode(kept.astype("<" + ("u1" if dtype == "uint8" else "u2")).tobytes()).decode(),
            "dtype": dtype, "shape": list(kept.shape), "layers": moe.tolist(), "masked": mask.astype(np.int8).tolist()}
