"""The expert-load figures (report panel, ``trajstore track``) over the newest samples:
the one-bincount count against the per-version masks it replaced, side by side.

    python bench/bench_expert_load.py [--samples 256] [--tokens 2000] [--layouts 24x4 48x8 60x8]

Builds samples shaped like a real run's (prompt 1/3, 8 model versions,
every route layout given), then times each way of counting over the same
samples; prints ms per call (median of --rounds) and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np

from trajstore.inspect._routes import expert_load


def samples(n: int, tokens: int, layers: int, topk: int, experts: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = tokens // 3
        versions = np.full(tokens - p, i * 8 // n, np.int32)
        out.append(SimpleNamespace(prompt_ids=np.zeros(p, np.int32), token_model_versions=versions,
                                   routed_experts=rng.integers(0, experts, (tokens, layers, topk), dtype=np.uint8),
                                   routed_experts_mask=np.zeros(tokens, bool)))
    return out


def before(ss: list, experts: int) -> np.ndarray:
    """The panel's former count: every entry flattened with its version, one mask per version."""
    all_ids, all_versions = [], []
    for s in ss:
        versions = np.asarray(s.token_model_versions)
        gen = np.nonzero(versions >= 0)[0]
        rows = len(s.prompt_ids) + gen - 1
        ok = (rows >= 0) & (rows < len(s.routed_experts))
        ok[ok] &= ~np.asarray(s.routed_experts_mask, bool)[rows[ok]]
        ids = np.asarray(s.routed_experts)[rows[ok]].astype(np.int64)
        all_ids.append(ids.reshape(len(ids), -1))
        all_versions.append(np.repeat(versions[gen[ok]], ids[0].size if len(ids) else 0))
    ids = np.concatenate([x.ravel() for x in all_ids])
    version_of = np.concatenate(all_versions)
    return np.stack([np.bincount(ids[version_of == x], minlength=experts) for x in np.unique(version_of)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--layouts", nargs="+", default=["24x4", "48x8", "60x8"])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print(f"{a.samples} samples x {a.tokens} tokens, {a.experts} experts; median of {a.rounds} rounds")
    print(f"{'layout':>8} {'entries':>12} {'before ms':>10} {'now ms':>8} {'ratio':>6}")
    for layout in a.layouts:
        layers, topk = map(int, layout.split("x"))
        ss = samples(a.samples, a.tokens, layers, topk, a.experts)
        times = {"before": [], "now": []}
        for _ in range(a.rounds):  # interleaved: both see the same machine
            t = time.perf_counter()
            old = before(ss, a.experts)
            times["before"].append(time.perf_counter() - t)
            t = time.perf_counter()
            new = expert_load(ss, a.experts)
            times["now"].append(time.perf_counter() - t)
        assert (new.counts.sum(axis=1) == old).all()  # the same figures
        b, n = (statistics.median(times[k]) * 1000 for k in ("before", "now"))
        entries = a.samples * (a.tokens - a.tokens // 3) * layers * topk
        print(f"{layout:>8} {entries:>12,} {b:>10.0f} {n:>8.0f} {b / n:>6.1f}x")


if __name__ == "__main__":
    main()
