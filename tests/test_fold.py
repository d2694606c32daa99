"""The pure fold: SPEC worked examples, then one test per rule."""

from __future__ import annotations

import numpy as np
import pytest

from trajstore.errors import ValidationError
from trajstore.events import Generation, parse_event
from trajstore.fold import FoldMetrics, fold
from trajstore.sample import FIELDS, Sample

TID = "t1"


def gen(seq, prompt, output, *, version=0, logprobs=None, loss_mask=None, routes=None, start=0, reward=None,
        token_rewards=None, routes_dtype=np.uint8, token_versions=None, finish_reason=None) -> Generation:
    return Generation(
        trajectory_id=TID,
        seq=seq,
        prompt_ids=np.asarray(prompt, np.int32),
        output_ids=np.asarray(output, np.int32),
        model_version=version,
        logprobs=None if logprobs is None else np.asarray(logprobs, np.float32),
        loss_mask=None if loss_mask is None else np.asarray(loss_mask, np.uint8),
        routed_experts=None if routes is None else np.asarray(routes, routes_dtype),
        routed_experts_start=start,
        reward=reward,
        token_rewards=None if token_rewards is None else np.asarray(token_rewards, np.float32),
        token_model_versions=None if token_versions is None else np.asarray(token_versions, np.int32),
        finish_reason=finish_reason,
    )


def rows(values, layers=1, topk=1):
    """Route rows whose every entry of row i is values[i]: [len(values), layers, topk]."""
    return np.broadcast_to(np.asarray(values)[:, None, None], (len(values), layers, topk)).copy()


def assert_array(actual, expected, dtype):
    assert actual.dtype == np.dtype(dtype), actual.dtype
    np.testing.assert_array_equal(actual, np.asarray(expected, dtype))


def run(*generations, **kwargs):
    kwargs.setdefault("trajectory_id", TID)
    return fold(list(generations), **kwargs)


# --- SPEC worked examples -------------------------------------------------------------------


def test_m1_observation_delta_is_merged_with_mask_zero():
    result = run(
        gen(0, [10, 20, 30], [40, 50], logprobs=[-0.1, -0.2]),
        gen(1, [10, 20, 30, 40, 50, 60, 70], [80, 90], logprobs=[-0.3, -0.4]),
    )
    [s] = result.samples
    assert_array(s.prompt_ids, [10, 20, 30], np.int32)
    assert_array(s.response_ids, [40, 50, 60, 70, 80, 90], np.int32)
    assert_array(s.loss_mask, [1, 1, 0, 0, 1, 1], np.uint8)
    assert_array(s.rollout_logprobs, [-0.1, -0.2, 0, 0, -0.3, -0.4], np.float32)
    m = result.metrics
    assert (m.num_steps_before, m.num_samples_after, m.merge_ratio, m.prefix_mismatch_count) == (2, 1, 0.5, 0)


def test_m2_unrelated_prompt_starts_a_new_sample():
    result = run(gen(0, [10, 20, 30], [40, 50]), gen(1, [99, 88, 77], [11, 22]))
    assert [s.is_last_step for s in result.samples] == [False, True]
    assert [s.sample_index for s in result.samples] == [0, 1]
    assert_array(result.samples[1].prompt_ids, [99, 88, 77], np.int32)
    assert_array(result.samples[1].response_ids, [11, 22], np.int32)
    assert result.metrics.prefix_mismatch_count == 1
    assert result.metrics.merge_ratio == 1.0


def test_m3_merge_then_mismatch():
    result = run(
        gen(0, [1, 2, 3], [4, 5]),
        gen(1, [1, 2, 3, 4, 5, 6, 7], [8, 9]),
        gen(2, [100, 200], [11, 22]),
    )
    a, b = result.samples
    assert_array(a.prompt_ids, [1, 2, 3], np.int32)
    assert_array(a.response_ids, [4, 5, 6, 7, 8, 9], np.int32)
    assert_array(a.loss_mask, [1, 1, 0, 0, 1, 1], np.uint8)
    assert_array(b.prompt_ids, [100, 200], np.int32)
    assert_array(b.response_ids, [11, 22], np.int32)
    assert_array(b.loss_mask, [1, 1], np.uint8)
    assert result.metrics.prefix_mismatch_count == 1
    assert result.metrics.merge_ratio == pytest.approx(2 / 3)


def test_m4_three_single_token_turns():
    result = run(
        gen(0, [1], [2], logprobs=[-1]),
        gen(1, [1, 2, 3], [4], logprobs=[-2]),
        gen(2, [1, 2, 3, 4, 5], [6], logprobs=[-3]),
    )
    [s] = result.samples
    assert_array(s.prompt_ids, [1], np.int32)
    assert_array(s.response_ids, [2, 3, 4, 5, 6], np.int32)
    assert_array(s.loss_mask, [1, 0, 1, 0, 1], np.uint8)
    assert_array(s.rollout_logprobs, [-1, 0, -2, 0, -3], np.float32)


def test_m5_prompt_shorter_than_previous_sequence_is_a_mismatch():
    result = run(gen(0, [10], [20, 30]), gen(1, [10, 20], [30, 40]))
    a, b = result.samples
    assert_array(a.prompt_ids, [10], np.int32)
    assert_array(a.response_ids, [20, 30], np.int32)
    assert_array(b.prompt_ids, [10, 20], np.int32)
    assert_array(b.response_ids, [30, 40], np.int32)
    assert result.metrics.prefix_mismatch_count == 1


def test_r1_recorded_routes_are_never_overwritten():
    result = run(
        gen(0, [10, 20, 30], [40, 50], routes=rows([0, 1, 2, 3])),
        gen(1, [10, 20, 30, 40, 50, 60, 70], [80, 90], routes=rows([100 + p for p in range(8)])),
    )
    [s] = result.samples
    assert_array(s.routed_experts, rows([0, 1, 2, 3, 104, 105, 106, 107, 0]), np.uint8)
    assert_array(s.routed_experts_mask, [0, 0, 0, 0, 0, 0, 0, 0, 1], np.bool_)


def test_a1_async_abort_and_resume_under_new_weights():
    result = run(gen(0, [1, 2, 3], [4, 5], version=5), gen(1, [1, 2, 3, 4, 5], [6, 7, 8], version=6))
    [s] = result.samples
    assert_array(s.response_ids, [4, 5, 6, 7, 8], np.int32)
    assert_array(s.loss_mask, [1, 1, 1, 1, 1], np.uint8)
    assert_array(s.token_model_versions, [5, 5, 6, 6, 6], np.int32)
    assert (s.min_model_version, s.max_model_version) == (5, 6)


def test_a2_in_flight_weight_update_inside_one_call():
    result = run(
        gen(0, [1, 2], [3, 4, 5, 6], version=8, token_versions=[7, 7, 8, 8], logprobs=[-.1, -.2, -.3, -.4],
            finish_reason="length"),
        gen(1, [1, 2, 3, 4, 5, 6, 9], [10], version=8, finish_reason="stop"),
    )
    [s] = result.samples
    assert_array(s.response_ids, [3, 4, 5, 6, 9, 10], np.int32)
    assert_array(s.token_model_versions, [7, 7, 8, 8, -1, 8], np.int32)
    assert_array(s.logprobs_mask, [1, 1, 1, 1, 0, 0], np.bool_)
    assert_array(s.rollout_logprobs, [-.1, -.2, -.3, -.4, 0, 0], np.float32)
    assert (s.min_model_version, s.max_model_version) == (7, 8)
    assert s.finish_reason == "stop"


def test_a2_from_the_wire_and_the_refused_backwards_versions():
    first = {"type": "generation", "trajectory_id": TID, "seq": 0, "prompt_ids": [1, 2], "output_ids": [3, 4, 5, 6],
             "token_model_versions": [7, 7, 8, 8], "logprobs": [-.1, -.2, -.3, -.4], "finish_reason": "length"}
    second = {"type": "generation", "trajectory_id": TID, "seq": 1, "prompt_ids": [1, 2, 3, 4, 5, 6, 9],
              "output_ids": [10], "model_version": 8, "finish_reason": "stop"}
    g0 = parse_event(first)
    assert g0.model_version == 8  # derived: the last token's version
    [s] = run(g0, parse_event(second)).samples
    assert_array(s.token_model_versions, [7, 7, 8, 8, -1, 8], np.int32)
    assert_array(s.logprobs_mask, [1, 1, 1, 1, 0, 0], np.bool_)
    assert (s.min_model_version, s.max_model_version, s.finish_reason) == (7, 8, "stop")
    with pytest.raises(ValidationError, match="never decrease") as e:
        parse_event(first | {"token_model_versions": [8, 7, 8, 8]})
    assert e.value.rule == "token_model_versions"


@pytest.mark.parametrize("change, rule", [
    ({"token_model_versions": [7, 7, 8]}, "length_mismatch"),
    ({"token_model_versions": [7, 7, 8, 8], "model_version": 7}, "version_conflict"),
    ({"token_model_versions": [-1, 7, 8, 8]}, "token_model_versions"),
    ({"token_model_versions": [7, 7, 8, 2**31]}, "token_model_versions"),
    ({"token_model_versions": [7, 7.5, 8, 8]}, "token_model_versions"),
    ({"token_model_versions": None}, "missing_field"),
    ({"output_ids": [], "token_model_versions": [], "logprobs": None}, "missing_field"),
    ({"metadata": [1, 2]}, "metadata"),
    ({"metadata": {"x": float("nan")}}, "metadata"),
])
def test_token_model_versions_and_metadata_rules(change, rule):
    event = {"type": "generation", "trajectory_id": TID, "seq": 0, "prompt_ids": [1, 2], "output_ids": [3, 4, 5, 6],
             "token_model_versions": [7, 7, 8, 8]} | change
    event = {k: v for k, v in event.items() if v is not None}
    with pytest.raises(ValidationError) as e:
        parse_event(event)
    assert e.value.rule == rule


def test_model_version_alone_and_with_agreeing_spans():
    base = {"type": "generation", "trajectory_id": TID, "seq": 0, "prompt_ids": [1], "output_ids": [2, 3]}
    assert parse_event(base | {"model_version": 4}).token_model_versions is None
    g = parse_event(base | {"model_version": 5, "token_model_versions": [4, 5], "metadata": {"tool": "search"}})
    assert g.model_version == 5 and g.metadata == {"tool": "search"}
    assert_array(g.token_model_versions, [4, 5], np.int32)
    empty = parse_event(base | {"output_ids": [], "model_version": 3, "token_model_versions": []})
    assert empty.model_version == 3 and len(empty.token_model_versions) == 0


def test_finish_reason_is_the_last_merged_calls_own():
    result = run(gen(0, [1], [2], finish_reason="length"), gen(1, [1, 2], [3]),
                 gen(2, [9], [8], finish_reason="abort"), gen(3, [9, 8], [7], finish_reason="stop"))
    assert [s.finish_reason for s in result.samples] == [None, "stop"]


def test_logprobs_mask_marks_only_reported_logprobs():
    result = run(gen(0, [1], [2, 3], logprobs=[0.0, -1.0]), gen(1, [1, 2, 3, 4], [5]),
                 gen(2, [1, 2, 3, 4, 5], [6], logprobs=[0.0]))
    [s] = result.samples
    assert_array(s.rollout_logprobs, [0, -1, 0, 0, 0], np.float32)
    assert_array(s.logprobs_mask, [1, 1, 0, 0, 1], np.bool_)


# --- merging ---------------------------------------------------------------------------------


def test_empty_delta_merges_when_prompt_equals_previous_sequence():
    result = run(gen(0, [1, 2], [3], version=1), gen(1, [1, 2, 3], [4, 5], version=2, loss_mask=[0, 1]))
    [s] = result.samples
    assert_array(s.response_ids, [3, 4, 5], np.int32)
    assert_array(s.loss_mask, [1, 0, 1], np.uint8)
    assert_array(s.token_model_versions, [1, 2, 2], np.int32)


@pytest.mark.parametrize(
    "second_prompt",
    [[1, 2, 9, 4], [1, 2, 3, 5, 6], [1, 2], [7, 1, 2, 3, 4]],
    ids=["diverges-inside", "longer-but-different", "strict-prefix", "shifted"],
)
def test_every_non_extension_is_a_mismatch(second_prompt):
    result = run(gen(0, [1, 2], [3, 4]), gen(1, second_prompt, [8]))
    assert result.metrics.num_samples_after == 2
    assert_array(result.samples[1].prompt_ids, second_prompt, np.int32)


def test_observation_tokens_carry_version_minus_one_and_defaults():
    result = run(gen(0, [1], [2, 3], version=4), gen(1, [1, 2, 3, 7, 8], [9], version=4))
    [s] = result.samples
    assert_array(s.token_model_versions, [4, 4, -1, -1, 4], np.int32)
    assert_array(s.rollout_logprobs, [0, 0, 0, 0, 0], np.float32)
    assert s.token_rewards is None and s.reward is None and s.routed_experts is None


def test_min_max_versions_ignore_observations_per_sample():
    result = run(
        gen(0, [1], [2], version=3),
        gen(1, [1, 2, 5], [6], version=7),
        gen(2, [9], [8], version=8),
        gen(3, [9, 8], [7], version=9),
    )
    assert [(s.min_model_version, s.max_model_version) for s in result.samples] == [(3, 7), (8, 9)]


def test_empty_outputs_still_name_the_policy_called():
    [s] = run(gen(0, [1], [], version=4)).samples
    assert (s.min_model_version, s.max_model_version) == (4, 4)
    assert s.response_ids.dtype == np.int32 and len(s.response_ids) == 0


@pytest.mark.parametrize("status", ["completed", "truncated", "aborted", "failed"])
def test_status_and_group_travel_on_every_sample(status):
    result = run(gen(0, [1], [2]), gen(1, [5], [6]), status=status, group_id="g")
    assert [s.status for s in result.samples] == [status, status]
    assert [s.group_id for s in result.samples] == ["g", "g"]
    assert [s.trajectory_id for s in result.samples] == [TID, TID]


def test_no_generations_fold_to_nothing():
    result = run()
    assert result.samples == [] and result.metrics == FoldMetrics()


def test_foreign_trajectory_refused():
    with pytest.raises(ValidationError) as e:
        fold([gen(0, [1], [2])], trajectory_id="other")
    assert e.value.rule == "trajectory_id"


# --- rewards ---------------------------------------------------------------------------------


def test_scalar_reward_is_last_of_merged_calls():
    result = run(
        gen(0, [1], [2], reward=0.1),
        gen(1, [1, 2], [3], reward=0.2),
        gen(2, [1, 2, 3], [4]),
        gen(3, [9], [8]),
        gen(4, [7], [6], reward=0.5),
    )
    assert [s.reward for s in result.samples] == [pytest.approx(0.2), None, 0.5]
    assert all(s.token_rewards is None for s in result.samples)


def test_trajectory_reward_overrides_final_sample_only():
    result = run(gen(0, [1], [2], reward=0.1), gen(1, [5], [6], reward=0.2), final_reward=1.0)
    assert [s.reward for s in result.samples] == [pytest.approx(0.1), 1.0]
    assert isinstance(result.samples[-1].reward, float)


def test_token_rewards_concatenate_like_logprobs():
    result = run(
        gen(0, [1], [2, 3], token_rewards=[0.5, 0.25]),
        gen(1, [1, 2, 3, 4], [5], token_rewards=[1.0]),
        gen(2, [1, 2, 3, 4, 5, 6], [7]),  # no token rewards on this call: 0.0
    )
    [s] = result.samples
    assert_array(s.token_rewards, [0.5, 0.25, 0, 1.0, 0, 0], np.float32)
    assert s.reward is None


def test_token_rewards_on_every_sample_of_a_token_reward_trajectory():
    result = run(gen(0, [1], [2], token_rewards=[0.5]), gen(1, [9], [8, 7]), final_reward=2.0)
    assert_array(result.samples[0].token_rewards, [0.5], np.float32)
    assert_array(result.samples[1].token_rewards, [0, 0], np.float32)
    assert result.samples[1].reward == 2.0


def test_mixing_scalar_and_token_rewards_refused():
    with pytest.raises(ValidationError) as e:
        run(gen(0, [1], [2], reward=1.0), gen(1, [9], [8], token_rewards=[0.5]))
    assert e.value.rule == "reward_mode"
    assert e.value.trajectory_id == TID


# --- routes ----------------------------------------------------------------------------------


def test_routed_experts_start_in_merge_appends_after_recorded_rows():
    # Call 1 skips positions 0..3 (already recorded) and supplies 4..6.
    result = run(
        gen(0, [1, 2, 3], [4, 5], routes=rows([10, 11, 12, 13])),
        gen(1, [1, 2, 3, 4, 5, 6], [7, 8], routes=rows([24, 25, 26]), start=4),
    )
    [s] = result.samples
    assert_array(s.routed_experts, rows([10, 11, 12, 13, 24, 25, 26, 0]), np.uint8)
    assert_array(s.routed_experts_mask, [0] * 7 + [1], np.bool_)


def test_route_gap_beyond_recorded_length_is_masked():
    result = run(
        gen(0, [1, 2, 3], [4, 5], routes=rows([10, 11, 12, 13])),
        gen(1, [1, 2, 3, 4, 5, 6, 7], [8, 9], routes=rows([26, 27]), start=6),
        gen(2, [1, 2, 3, 4, 5, 6, 7, 8, 9], [10], routes=rows(range(30, 39))),
    )
    [s] = result.samples
    # Positions 4, 5 were never captured; call 2 does not backfill them (they count as recorded).
    assert_array(s.routed_experts_mask, [0, 0, 0, 0, 1, 1, 0, 0, 0, 1], np.bool_)
    assert_array(s.routed_experts[:, 0, 0], [10, 11, 12, 13, 0, 0, 26, 27, 38, 0], np.uint8)


def test_mismatch_inherits_rows_below_start_when_prompt_agrees():
    result = run(
        gen(0, [1, 2, 3], [4, 5], routes=rows([10, 11, 12, 13])),
        # Rewrites token 5 (e.g. a trimmed history): positions 0..3 agree with sample 0.
        gen(1, [1, 2, 3, 4, 6], [7], routes=rows([24]), start=4),
    )
    a, b = result.samples
    assert_array(b.routed_experts[:, 0, 0], [10, 11, 12, 13, 24, 0], np.uint8)
    assert_array(b.routed_experts_mask, [0, 0, 0, 0, 0, 1], np.bool_)
    assert_array(a.routed_experts[:, 0, 0], [10, 11, 12, 13, 0], np.uint8)


def test_inherited_masked_row_stays_masked():
    result = run(
        gen(0, [1, 2, 3], [4, 5], routes=rows([10, 11]), start=0),
        gen(1, [1, 2, 3, 4, 5, 6], [7], routes=rows([13, 14, 15]), start=3),  # gap at position 2
        gen(2, [1, 2, 3, 4, 9], [8], routes=rows([24]), start=4),
    )
    b = result.samples[1]
    assert_array(b.routed_experts_mask, [0, 0, 1, 0, 0, 1], np.bool_)
    assert_array(b.routed_experts[:, 0, 0], [10, 11, 0, 13, 24, 0], np.uint8)


def test_mismatch_with_start_refused_when_prompt_disagrees():
    with pytest.raises(ValidationError) as e:
        run(
            gen(0, [1, 2, 3], [4, 5], routes=rows([10, 11, 12, 13])),
            gen(1, [1, 9, 3, 4, 6], [7], routes=rows([24, 25]), start=4),
        )
    assert e.value.rule == "missing_route_rows"


def test_mismatch_with_start_refused_when_rows_never_recorded():
    with pytest.raises(ValidationError) as e:
        run(
            gen(0, [1, 2, 3], [4, 5], routes=rows([10, 11])),
            gen(1, [1, 2, 3, 4, 6], [7], routes=rows([24, 25]), start=4),
        )
    assert e.value.rule == "missing_route_rows"


def test_first_event_with_start_refused():
    with pytest.raises(ValidationError) as e:
        run(gen(0, [1, 2, 3], [4, 5], routes=rows([12, 13]), start=2))
    assert e.value.rule == "missing_route_rows"


def test_masked_rows_hold_range_of_topk():
    [s] = run(gen(0, [1, 2], [3, 4], routes=np.full((3, 2, 4), 7))).samples
    assert_array(s.routed_experts[3], [[0, 1, 2, 3], [0, 1, 2, 3]], np.uint8)
    assert_array(s.routed_experts[:3], np.full((3, 2, 4), 7), np.uint8)
    assert s.routed_experts.shape == (s.num_tokens, 2, 4)


def test_every_sample_has_routes_when_any_event_has_them():
    result = run(gen(0, [1], [2]), gen(1, [5, 6], [7], routes=rows([1, 2])))
    a, b = result.samples
    assert_array(a.routed_experts_mask, [1, 1], np.bool_)
    assert_array(a.routed_experts, np.zeros((2, 1, 1)), np.uint8)
    assert_array(b.routed_experts_mask, [0, 0, 1], np.bool_)


def test_event_without_routes_in_a_routed_sample_leaves_positions_open():
    result = run(
        gen(0, [1, 2], [3], routes=rows([10, 11])),
        gen(1, [1, 2, 3, 4], [5]),
        gen(2, [1, 2, 3, 4, 5, 6], [7], routes=rows(range(20, 26))),
    )
    [s] = result.samples
    assert_array(s.routed_experts[:, 0, 0], [10, 11, 22, 23, 24, 25, 0], np.uint8)
    assert_array(s.routed_experts_mask, [0, 0, 0, 0, 0, 0, 1], np.bool_)


@pytest.mark.parametrize(
    "num_experts, max_id, input_dtype, expected",
    [
        (None, 255, np.uint8, np.uint8),
        (None, 255, np.uint16, np.uint8),
        (None, 256, np.uint16, np.uint16),
        (256, 3, np.uint8, np.uint8),
        (257, 3, np.uint8, np.uint16),
        (300, 299, np.uint16, np.uint16),
    ],
)
def test_route_dtype_choice(num_experts, max_id, input_dtype, expected):
    result = run(
        gen(0, [1], [2], routes=rows([max_id]), routes_dtype=input_dtype),
        gen(1, [9], [8], routes=rows([1]), routes_dtype=np.uint8),
        num_experts=num_experts,
    )
    assert all(s.routed_experts.dtype == np.dtype(expected) for s in result.samples)
    assert int(result.samples[0].routed_experts[0, 0, 0]) == max_id


def test_expert_id_beyond_declared_dtype_refused():
    with pytest.raises(ValidationError) as e:
        run(gen(0, [1], [2], routes=rows([300]), routes_dtype=np.uint16), num_experts=128)
    assert e.value.rule == "expert_id_range"


def test_route_shape_change_refused():
    with pytest.raises(ValidationError) as e:
        run(
            gen(0, [1], [2], routes=rows([1], layers=2, topk=2)),
            gen(1, [1, 2], [3], routes=rows([1, 2], layers=2, topk=4)),
        )
    assert e.value.rule == "routes_shape"


# --- metrics and the Sample type ---------------------------------------------------------------


def test_metrics_aggregate_with_plus():
    a = run(gen(0, [1], [2]), gen(1, [1, 2], [3])).metrics
    b = run(gen(0, [1], [2]), gen(1, [5], [3]), gen(2, [6], [3])).metrics
    total = a + b
    assert total == FoldMetrics(num_steps_before=5, num_samples_after=4, prefix_mismatch_count=2)
    assert total.to_dict() == {
        "num_steps_before": 5,
        "num_samples_after": 4,
        "merge_ratio": 0.8,
        "prefix_mismatch_count": 2,
    }
    assert sum([a, b], FoldMetrics()) == total
    assert FoldMetrics().merge_ratio == 0.0


def test_sample_fields_match_spec_order():
    assert FIELDS == Sample.FIELDS == (
        "trajectory_id", "group_id", "sample_index", "is_last_step", "status", "prompt_ids",
        "response_ids", "loss_mask", "rollout_logprobs", "logprobs_mask", "token_model_versions",
        "finish_reason", "reward", "token_rewards", "routed_experts", "routed_experts_mask", "min_model_version",
        "max_model_version",
    )


def test_sample_equals_compares_arrays_and_dtypes():
    events = [gen(0, [1, 2], [3], routes=rows([4, 5]), reward=1.0)]
    [a] = run(*events).samples
    [b] = run(*events).samples
    assert a.equals(b) and not a.equals(object())
    b.loss_mask = b.loss_mask.astype(np.int64)
    assert not a.equals(b)
    [b] = run(*events).samples
    b.reward = None
    assert not a.equals(b)
