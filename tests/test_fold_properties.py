"""Property tests of the fold against a per-token Python reference on random trajectories."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from trajstore.events import Generation
from trajstore.fold import fold

LAYERS, TOPK = 2, 3
TID = "t"

# Small vocabularies make accidental prefix agreements (and thus tricky mismatches) likely.
token_lists = st.lists(st.integers(0, 4), min_size=0, max_size=6)


@st.composite
def next_prompt(draw, prev_seq: list[int] | None) -> list[int]:
    """A merge (prev + delta) or one of the mismatch shapes."""
    kind = "fresh" if prev_seq is None else draw(st.sampled_from(["merge", "merge", "fresh", "prefix", "edit"]))
    if kind == "merge":
        return prev_seq + draw(token_lists)
    if kind == "prefix":
        return prev_seq[: draw(st.integers(1, max(1, len(prev_seq) - 1)))]
    if kind == "edit":
        prompt = prev_seq + draw(token_lists)
        i = draw(st.integers(0, len(prompt) - 1))
        prompt[i] += 1 + draw(st.integers(0, 3))
        return prompt
    return draw(st.lists(st.integers(0, 4), min_size=1, max_size=8))


@st.composite
def trajectories(draw) -> list[Generation]:
    generations: list[Generation] = []
    prev_seq = None
    for seq in range(draw(st.integers(1, 6))):
        prompt = draw(next_prompt(prev_seq))
        output = draw(token_lists)
        n = len(prompt) + len(output)
        routes = None
        if draw(st.integers(0, 3)):  # most calls carry routes, some do not
            seed = draw(st.integers(0, 2**32 - 1))
            routes = np.random.default_rng(seed).integers(0, 256, (n - 1, LAYERS, TOPK), dtype=np.uint8)
        generations.append(
            Generation(
                trajectory_id=TID,
                seq=seq,
                prompt_ids=np.array(prompt, np.int32),
                output_ids=np.array(output, np.int32),
                model_version=draw(st.integers(0, 9)),
                logprobs=np.array([-(seq + 1) - k / 10 for k in range(len(output))], np.float32),
                routed_experts=routes,
            )
        )
        prev_seq = prompt + output
    return generations


def reference_groups(generations: list[Generation]) -> list[list[Generation]]:
    groups: list[list[Generation]] = []
    for gen in generations:
        prompt = gen.prompt_ids.tolist()
        if groups:
            last = groups[-1][-1]
            prev_seq = last.prompt_ids.tolist() + last.output_ids.tolist()
            if prompt[: len(prev_seq)] == prev_seq and len(prompt) >= len(prev_seq):
                groups[-1].append(gen)
                continue
        groups.append([gen])
    return groups


def reference_tokens(group: list[Generation]) -> dict[str, list]:
    """Per-token lists of one sample, one Python step per token."""
    out = {"response": [], "mask": [], "logprobs": [], "versions": []}
    seq_len = len(group[0].prompt_ids)
    for gen in group:
        for token in gen.prompt_ids.tolist()[seq_len:]:
            out["response"].append(token), out["mask"].append(0)
            out["logprobs"].append(0.0), out["versions"].append(-1)
        for token, logprob in zip(gen.output_ids.tolist(), gen.logprobs.tolist()):
            out["response"].append(token), out["mask"].append(1)
            out["logprobs"].append(logprob), out["versions"].append(gen.model_version)
        seq_len = gen.num_tokens
    return out


def check_routes(sample, group: list[Generation]) -> None:
    """Row i equals the row of the FIRST call of the sample that provided position i."""
    for i in range(sample.num_tokens):
        provider = next((g for g in group if g.routed_experts is not None and i < len(g.routed_experts)), None)
        if provider is None:
            assert sample.routed_experts_mask[i]
            np.testing.assert_array_equal(sample.routed_experts[i], np.broadcast_to(np.arange(TOPK), (LAYERS, TOPK)))
        else:
            assert not sample.routed_experts_mask[i]
            np.testing.assert_array_equal(sample.routed_experts[i], provider.routed_experts[i])


@settings(max_examples=100, deadline=None)
@given(trajectories())
def test_fold_matches_per_token_reference(generations):
    result = fold(generations, trajectory_id=TID)
    groups = reference_groups(generations)
    has_routes = any(g.routed_experts is not None for g in generations)

    assert len(result.samples) == len(groups)
    assert result.metrics.num_steps_before == len(generations)
    assert result.metrics.num_samples_after == result.metrics.prefix_mismatch_count + 1
    assert [s.is_last_step for s in result.samples] == [False] * (len(groups) - 1) + [True]

    for index, (sample, group) in enumerate(zip(result.samples, groups)):
        assert sample.sample_index == index
        r = len(sample.response_ids)
        assert r == len(sample.loss_mask) == len(sample.rollout_logprobs) == len(sample.token_model_versions)
        last = group[-1]
        full = np.concatenate((sample.prompt_ids, sample.response_ids))
        np.testing.assert_array_equal(full, np.concatenate((last.prompt_ids, last.output_ids)))

        ref = reference_tokens(group)
        assert sample.response_ids.tolist() == ref["response"]
        assert sample.loss_mask.tolist() == ref["mask"]
        np.testing.assert_array_equal(sample.rollout_logprobs, np.array(ref["logprobs"], np.float32))
        assert sample.token_model_versions.tolist() == ref["versions"]

        if has_routes:
            assert sample.routed_experts.shape == (sample.num_tokens, LAYERS, TOPK)
            assert sample.routed_experts.dtype == np.uint8
            assert sample.routed_experts_mask.shape == (sample.num_tokens,)
            check_routes(sample, group)
        else:
            assert sample.routed_experts is None and sample.routed_experts_mask is None
