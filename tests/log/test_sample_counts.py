"""``sample_counts`` counts a batch of samples at once (their token columns laid end to end):
the same logprob histogram and the same expert-load arrays as counting them sample by sample
through ``decode_routes``, the per-sample definition, for any mix of layouts, dtypes, masks,
missing routes and sampling strides."""

from __future__ import annotations

import numpy as np
import pytest

from trajstore.log._aggregate_counts import (LOGPROB_BINS, _add_array, _groups, count_routes, decode_routes,
                                             logprob_bins, sample_counts)
from trajstore.sample import Sample
from trajstore.sample._codec import RoutesPlan


def _reference(samples, num_experts, every):
    """Sample by sample, as the counts are defined."""
    hist: dict = {}
    for s in samples:
        v = np.asarray(s.token_model_versions)
        keep = (v >= 0) & np.asarray(s.logprobs_mask, bool) & np.asarray(s.loss_mask, bool)
        for version, lp in zip(v[keep].tolist(), np.asarray(s.rollout_logprobs, np.float64)[keep]):
            have = hist.setdefault((version, int(logprob_bins(np.asarray([lp]))[0])), [0, 0.0])
            have[0] += 1
            have[1] += float(lp)
    routed: dict = {}
    for s in samples:
        got = decode_routes(s, every)
        if got is None or not len(got[0]):
            continue
        have = routed.setdefault(got[0].shape[1:], ([], [], [0]))
        have[0].append(got[0])
        have[1].append(got[1])
        have[2][0] = max(have[2][0], int(num_experts.get(s.trajectory_id) or 0))
    arrays: dict = {}
    for rows_of, versions_of, (declared,) in routed.values():
        rows = np.concatenate(rows_of)
        versions, vi = _groups(np.concatenate(versions_of))
        counts = count_routes(rows, max(declared, int(rows.max()) + 1), vi, len(versions)) * every
        for i, version in enumerate(versions.tolist()):
            _add_array(arrays, version, counts[i])
    return hist, arrays


def _samples(rng, n):
    out = []
    for i in range(n):
        p, r = int(rng.integers(0, 6)), int(rng.integers(0, 40))
        layout = [(2, 3), (4, 1)][int(rng.integers(0, 2))]
        dtype = [np.uint8, np.uint16][int(rng.integers(0, 2))]
        versions = np.where(rng.random(r) < 0.7, rng.integers(0, 3, r), -1).astype(np.int32)
        routes = mask = None
        if rng.random() < 0.85:
            rows = p + r - int(rng.integers(0, 3)) if p + r > 2 else p + r  # sometimes fewer rows than tokens
            high = 300 if dtype == np.uint16 else 64
            routes = rng.integers(0, high, (rows, *layout)).astype(dtype)
            mask = None if rng.random() < 0.3 else rng.random(rows) < 0.2
            if rng.random() < 0.3:  # planned routes, as the materializer's fold makes them
                planned = RoutesPlan()(routes.shape, routes.dtype)
                planned[:] = routes
                routes = planned
        out.append(Sample(
            trajectory_id=f"t{int(rng.integers(0, 4))}", group_id=None, sample_index=i, is_last_step=True,
            status="completed", prompt_ids=np.zeros(p, np.int32), response_ids=np.zeros(r, np.int32),
            loss_mask=(rng.random(r) < 0.8).astype(np.uint8) * np.uint8(int(rng.integers(1, 3))),
            rollout_logprobs=(-rng.exponential(3.0, r)).astype(np.float32), logprobs_mask=rng.random(r) < 0.9,
            token_model_versions=versions, finish_reason=None, reward=None, token_rewards=None,
            routed_experts=routes, routed_experts_mask=mask, min_model_version=0, max_model_version=2))
    return out


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("every", [1, 3, 32])
def test_a_batch_counts_what_its_samples_count_one_by_one(seed, every):
    rng = np.random.default_rng(seed)
    samples = _samples(rng, int(rng.integers(1, 30)))
    num_experts = {"t0": 64, "t1": None, "t2": 300}
    hist, arrays = _reference(samples, num_experts, every)
    got = sample_counts(samples, num_experts, every=every)
    assert got.get("agg_logprobs", {}) == {k: [c, total] for k, (c, total) in hist.items()}
    assert all(type(c) is int and type(total) is float for c, total in got.get("agg_logprobs", {}).values())
    loads = got.get("agg_expert_load", {})
    assert sorted(loads) == sorted((v,) for v in arrays)
    for (version,), counts in loads.items():
        want = arrays[version]
        assert counts.dtype == np.int64 and counts.shape == want.shape and (counts == want).all()
    assert sample_counts(samples, num_experts, every=every, experts=False).keys() <= {"agg_logprobs"}
    assert sample_counts(samples, num_experts, every=every, logprobs=False).keys() <= {"agg_expert_load"}


def test_the_logprob_bins_of_a_batch_are_summed_in_token_order():
    """The histogram's sums are float64 sums in token order: bit-equal to the per-sample count's."""
    rng = np.random.default_rng(7)
    samples = _samples(rng, 25)
    hist, _ = _reference(samples, {}, 1)
    got = sample_counts(samples, experts=False)["agg_logprobs"]
    assert len(got) > LOGPROB_BINS // 4
    assert all(got[k][1] == hist[k][1] for k in hist)  # exactly, not approximately


def test_nothing_to_count():
    assert sample_counts([]) == {}
    rng = np.random.default_rng(1)
    s = _samples(rng, 1)[0]
    s.token_model_versions = np.full(len(s.token_model_versions), -1, np.int32)  # observation tokens only
    assert sample_counts([s], every=1) == {}
