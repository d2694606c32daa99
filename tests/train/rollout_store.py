"""A small store of agent rollouts with everything a trainer adapter must carry.

Trajectories (each a list of wire events, SPEC "Event wire format"):

- ``multi``: two turns; the first call aborted at version 3 and resumed at
  version 4 (A1), then an observation and a turn generated without logprobs
  (A2's missing logprobs), finish "stop", reward 1.0;
- ``short``: one call stopped by length, token rewards, reward 0.0 — same group;
- ``mismatch``: the second call's prompt does not extend the first: two samples;
- ``late`` and ``later``: one call each, another group, for a second reader step.

Routes record ``LAYERS`` layers of which layer 0 is dense (zeros, as vLLM
records a dense layer) and ``MOE_LAYERS`` are MoE layers with distinct experts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import trajstore

LAYERS, MOE_LAYERS, TOPK, NUM_EXPERTS = 3, [1, 2], 2, 8
MOE_LAYER_FREQ = [0, 1, 1]


def engine_routes(rng: np.random.Generator, rows: int) -> np.ndarray:
    """Rows as vLLM returns them: every hidden layer, the dense one zero."""
    routes = np.zeros((rows, LAYERS, TOPK), np.uint8)
    for layer in MOE_LAYERS:
        routes[:, layer] = np.argsort(rng.random((rows, NUM_EXPERTS)), axis=1)[:, :TOPK]
    return routes


def generation(tid: str, seq: int, prompt: list[int], output: list[int], rng: np.random.Generator,
               **fields: Any) -> dict[str, Any]:
    event = {"type": "generation", "trajectory_id": tid, "seq": seq, "prompt_ids": prompt, "output_ids": output,
             "routed_experts": engine_routes(rng, len(prompt) + len(output) - 1)}
    event.update(fields)
    return event


def trajectories() -> dict[str, list[dict[str, Any]]]:
    rng = np.random.default_rng(7)
    lp = lambda n: (-rng.random(n) - 0.01).round(4).tolist()  # noqa: E731
    out: dict[str, list[dict[str, Any]]] = {}
    p = [11, 12, 13, 14]
    first = generation("multi", 0, p, [21, 22], rng, logprobs=lp(2), model_version=3, finish_reason="abort")
    resumed = generation("multi", 1, p + [21, 22], [23, 24, 25], rng, logprobs=lp(3), model_version=4,
                         finish_reason="stop")
    seq = p + [21, 22, 23, 24, 25]
    second = generation("multi", 2, seq + [31, 32], [41, 42], rng, model_version=4, finish_reason="stop")
    # A recorded route is never overwritten: the re-sent prefix keeps the first call's rows.
    resumed["routed_experts"][:5] = first["routed_experts"][:5]
    second["routed_experts"][:8] = resumed["routed_experts"][:8]
    out["multi"] = [first, resumed, second]
    out["short"] = [generation("short", 0, [11, 12, 13, 14], [51, 52, 53], rng, logprobs=lp(3), model_version=4,
                               finish_reason="length", token_rewards=[0.0, 0.25, 0.0])]
    out["mismatch"] = [
        generation("mismatch", 0, [61, 62], [63, 64], rng, logprobs=lp(2), model_version=4, finish_reason="stop"),
        generation("mismatch", 1, [70, 71, 72], [73], rng, logprobs=lp(1), model_version=5, finish_reason="stop"),
    ]
    out["late"] = [generation("late", 0, [81, 82, 83], [84, 85], rng, logprobs=lp(2), model_version=5,
                              finish_reason="stop")]
    out["later"] = [generation("later", 0, [81, 82, 83], [86], rng, logprobs=lp(1), model_version=6,
                               finish_reason="stop")]
    return out


GROUPS = {"multi": "g0", "short": "g0", "mismatch": "g1", "late": "g2", "later": "g2"}
REWARDS = {"multi": 1.0, "short": 0.0, "mismatch": 0.5, "late": 1.0, "later": 0.0}


def build_store(path) -> trajstore.Store:
    store = trajstore.connect(f"sqlite:///{path / 'store.db'}", payload=str(path / "payload"))
    for tid, events in trajectories().items():
        store.append([{"type": "trajectory_started", "trajectory_id": tid, "group_id": GROUPS[tid],
                       "num_experts": NUM_EXPERTS}, *events,
                      {"type": "reward", "trajectory_id": tid, "reward": REWARDS[tid]},
                      {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}])
    store.materialize()
    return store
