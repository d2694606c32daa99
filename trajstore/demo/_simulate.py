"""Synthetic rollouts: multi-turn MoE agent trajectories as wire-format events.

Used by ``trajstore demo``, the benchmarks and the tests. Each trajectory is a
pure function of ``(config, index)``, so a run is reproducible.

What a trajectory looks like (like a tool-using agent on vLLM):
* turn 0: a fresh prompt; each later turn's prompt is the previous sequence
  plus an observation (a merge), or, with ``mismatch_prob``, a rewritten
  context (a prefix mismatch: e.g. the harness summarized the history);
* with ``abort_prob`` a turn is aborted mid-generation and resumed from the
  partial sequence under the next model version (an async partial rollout);
* routes are what vLLM returns: rows for positions ``0 .. N-2`` of every call,
  the prompt rows recomputed (and, with ``route_drift``, some changed);
* a final ``reward`` event, then ``trajectory_finished`` (``failed`` with
  ``fail_prob``).
Arrays are numpy: events are appended in-process without JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DEMO_CONFIG", "RolloutConfig", "trajectory_events"]


@dataclass(frozen=True)
class RolloutConfig:
    turns: int = 4
    """Engine calls per trajectory (before abort splits)."""
    prompt_tokens: int = 256
    output_tokens: int = 256
    observation_tokens: int = 64
    layers: int = 8
    """MoE layers whose routes are recorded."""
    topk: int = 2
    num_experts: int = 64
    vocab: int = 32000
    group_size: int = 4
    """Trajectories per GRPO group (same prompt)."""
    mismatch_prob: float = 0.1
    abort_prob: float = 0.1
    fail_prob: float = 0.03
    route_drift: float = 0.01
    """Share of re-sent prompt rows the engine recomputes differently."""
    model_version: int = 0
    seed: int = 0


DEMO_CONFIG = RolloutConfig(
    turns=4, prompt_tokens=192, output_tokens=128, observation_tokens=48,
    layers=8, topk=2, num_experts=64, mismatch_prob=0.15, abort_prob=0.2, fail_prob=0.05,
)
"""The demo's rollouts (``trajstore demo`` and its train stage)."""


def trajectory_events(cfg: RolloutConfig, index: int, *, version: int | None = None) -> list[dict[str, Any]]:
    """All events of trajectory ``index`` (started ... finished)."""
    rng = np.random.default_rng([cfg.seed, index])
    group = index // cfg.group_size
    tid = f"traj-{cfg.seed}-{index:06d}"
    v = cfg.model_version if version is None else version
    events: list[dict[str, Any]] = [{
        "type": "trajectory_started", "trajectory_id": tid, "group_id": f"group-{cfg.seed}-{group:05d}",
        "num_experts": cfg.num_experts, "metadata": {"env": "simulated", "index": index},
    }]
    prompt_rng = np.random.default_rng([cfg.seed, 1_000_000 + group])
    prompt = prompt_rng.integers(0, cfg.vocab, cfg.prompt_tokens, dtype=np.int32)
    routes = np.zeros((0, cfg.layers, cfg.topk), np.uint8)  # the engine's view of routes so far
    seq = 0
    for turn in range(cfg.turns):
        if turn > 0:
            if rng.random() < cfg.mismatch_prob:
                prompt = rng.integers(0, cfg.vocab, cfg.prompt_tokens, dtype=np.int32)
                routes = routes[:0]
            else:
                obs = rng.integers(0, cfg.vocab, cfg.observation_tokens, dtype=np.int32)
                prompt = np.concatenate([prompt, obs])
        n_out = int(cfg.output_tokens)
        splits = [n_out]
        if rng.random() < cfg.abort_prob and n_out > 1:
            cut = int(rng.integers(1, n_out))
            splits = [cut, n_out - cut]
        for part, n in enumerate(splits):
            output = rng.integers(0, cfg.vocab, n, dtype=np.int32)
            routes = _engine_routes(rng, cfg, routes, len(prompt) + n - 1)
            aborted = part < len(splits) - 1
            events.append({
                "type": "generation", "trajectory_id": tid, "seq": seq,
                "prompt_ids": prompt, "output_ids": output,
                "logprobs": -rng.random(n, dtype=np.float32),
                "model_version": v, "routed_experts": routes,
                "finish_reason": "abort" if aborted else "stop",
            })
            seq += 1
            prompt = np.concatenate([prompt, output])
            if aborted:
                v += 1  # resumed under the next policy version
        prompt = prompt.copy()
    failed = rng.random() < cfg.fail_prob
    events.append({"type": "reward", "trajectory_id": tid, "reward": 0.0 if failed else float(rng.random() < 0.5)})
    events.append({"type": "trajectory_finished", "trajectory_id": tid, "status": "failed" if failed else "completed"})
    return events


def _engine_routes(rng: np.random.Generator, cfg: RolloutConfig, previous: np.ndarray, rows: int) -> np.ndarray:
    """Rows for positions 0..rows-1: the known prefix recomputed (some drift), the rest new."""
    keep = min(len(previous), rows)
    out = np.empty((rows, cfg.layers, cfg.topk), np.uint8)
    out[:keep] = previous[:keep]
    if keep and cfg.route_drift:
        drift = rng.random(keep) < cfg.route_drift
        out[:keep][drift] = _topk_rows(rng, cfg, int(drift.sum()))
    out[keep:] = _topk_rows(rng, cfg, rows - keep)
    return out


def _topk_rows(rng: np.random.Generator, cfg: RolloutConfig, n: int) -> np.ndarray:
    """n rows of topk DISTINCT experts per layer."""
    base = rng.integers(0, cfg.num_experts, (n, cfg.layers, 1), dtype=np.int64)
    step = np.arange(cfg.topk, dtype=np.int64)
    return ((base + step) % cfg.num_experts).astype(np.uint8)
