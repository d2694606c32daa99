"""Routing replay against real megatron-core 0.16.1 MoE layers on the CPU.

The routers' own output (the routing map megatron dispatches tokens with) is
what we check, not trajstore's bookkeeping: a test passes only if megatron
really sent every recorded token to its recorded experts.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

pytest.importorskip("megatron.core", reason="needs the extra: pip install 'trajstore[megatron]'")

import torch
from megatron_cpu import HIDDEN_SIZE, NUM_EXPERTS, TOPK, MoEStack, cpu_megatron

from trajstore.errors import ValidationError
from trajstore.train.megatron import replay_indices, replay_routes

NUM_RECORDED_LAYERS = 3
# The model holds recorded layers 1 and 2, as a second pipeline stage would.
MOE_LAYER_IDS = [1, 2]
GARBAGE = 5  # written into padding rows; repeated ids, so only exclusion makes them valid


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    with cpu_megatron():
        yield


@pytest.fixture
def model() -> MoEStack:
    return MoEStack(len(MOE_LAYER_IDS))


def routers(model: MoEStack) -> list[torch.nn.Module]:
    return [layer.router for layer in model.layers if hasattr(layer, "router")]


@contextlib.contextmanager
def chosen_experts(model: MoEStack):
    """Collect, per router and per call, the [T, K] experts megatron's router really chose."""
    calls: list[list[torch.Tensor]] = [[] for _ in routers(model)]

    def record(layer_calls, module, args, output):
        routing_map_TE = output[1]
        assert (routing_map_TE.sum(dim=-1) == TOPK).all(), "router chose a wrong number of experts"
        # nonzero() is row-major, so each row's K experts come out in ascending order.
        layer_calls.append(routing_map_TE.nonzero()[:, 1].view(-1, TOPK))

    hooks = [
        router.register_forward_hook(lambda m, a, o, c=layer_calls: record(c, m, a, o))
        for router, layer_calls in zip(routers(model), calls)
    ]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def distinct_routes_BSLK(num_rows: int, seq_len: int, *, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_rows, seq_len, NUM_RECORDED_LAYERS, NUM_EXPERTS, generator=generator)
    return scores.argsort(dim=-1)[..., :TOPK].to(torch.uint8)


def padded_batch(padding_side: str, *, seed: int = 0) -> dict:
    """Three rows of lengths 7, 5, 3; the last real token of each row has no captured route."""
    lengths, seq_len = [7, 5, 3], 7
    routes_BSLK = distinct_routes_BSLK(len(lengths), seq_len, seed=seed)
    attention_mask_BS = torch.zeros(len(lengths), seq_len, dtype=torch.bool)
    mask_BS = torch.zeros_like(attention_mask_BS)
    for b, length in enumerate(lengths):
        real = slice(0, length) if padding_side == "right" else slice(seq_len - length, seq_len)
        attention_mask_BS[b, real] = True
        mask_BS[b, real.stop - 1] = True
        routes_BSLK[b, real.stop - 1] = torch.arange(TOPK)
    routes_BSLK[~attention_mask_BS] = GARBAGE
    return {
        "routes_BSLK": routes_BSLK,
        "mask_BS": mask_BS,
        "attention_mask_BS": attention_mask_BS,
        "layout": "padded",
    }


def packed_batch(*, seed: int = 0) -> dict:
    """Sequences of 4, 6 and 3 tokens packed into one row of 15 (two tail padding tokens)."""
    cu_seqlens = torch.tensor([0, 4, 10, 13], dtype=torch.int32)
    routes_BSLK = distinct_routes_BSLK(1, 15, seed=seed)
    mask_BS = torch.zeros(1, 15, dtype=torch.bool)
    for end in cu_seqlens[1:].tolist():
        mask_BS[0, end - 1] = True
        routes_BSLK[0, end - 1] = torch.arange(TOPK)
    routes_BSLK[0, 13:] = GARBAGE
    return {
        "routes_BSLK": routes_BSLK,
        "mask_BS": mask_BS,
        "cu_seqlens": cu_seqlens,
        "layout": "packed",
    }


def valid_BS(batch: dict) -> torch.Tensor:
    valid_BS = ~batch["mask_BS"]
    if "attention_mask_BS" in batch:
        valid_BS &= batch["attention_mask_BS"]
    if "cu_seqlens" in batch:
        valid_BS[0, int(batch["cu_seqlens"][-1]) :] = False
    return valid_BS


def expected_TK(batch: dict, local_layer: int) -> torch.Tensor:
    """What the router must choose, built position by position (t = s*B + b), sorted per row."""
    routes_BSLK = batch["routes_BSLK"].long()
    num_rows, seq_len = routes_BSLK.shape[:2]
    valid = valid_BS(batch)
    rows = []
    for s in range(seq_len):
        for b in range(num_rows):
            recorded = routes_BSLK[b, s, MOE_LAYER_IDS[local_layer]]
            rows.append(recorded.sort().values if valid[b, s] else torch.arange(TOPK))
    return torch.stack(rows)


def indices_for(batch: dict) -> list[torch.Tensor]:
    return replay_indices(**batch, num_experts=NUM_EXPERTS, moe_layer_ids=MOE_LAYER_IDS)


def hidden_for(batch: dict, *, seed: int = 1) -> torch.Tensor:
    num_rows, seq_len = batch["mask_BS"].shape
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(seq_len, num_rows, HIDDEN_SIZE, generator=generator, requires_grad=True)


def assert_replay_cleared(model: MoEStack) -> None:
    for router in routers(model):
        replay = router.router_replay
        assert replay.router_replay_action is None
        assert replay.target_topk_idx is None and replay.recorded_topk_idx is None
        assert replay.replay_backward_list == []
        assert not router._forward_pre_hooks, "replay_routes left its token-count hook behind"


BATCHES = {
    "padded_left": lambda: padded_batch("left"),
    "padded_right": lambda: padded_batch("right"),
    "packed": packed_batch,
}


# --- replay_indices alone -------------------------------------------------------------------


def test_indices_are_in_sequence_major_router_order():
    num_rows, seq_len = 2, 3
    routes_BSLK = torch.zeros(num_rows, seq_len, 1, TOPK, dtype=torch.uint8)
    for b in range(num_rows):
        for s in range(seq_len):
            routes_BSLK[b, s, 0] = torch.tensor([10 * b + s, 100])
    (indices_TK,) = replay_indices(
        routes_BSLK, torch.zeros(num_rows, seq_len, dtype=torch.bool), num_experts=128
    )
    assert indices_TK.dtype == torch.int64  # the router's gather and scatter need int64
    assert indices_TK[:, 0].tolist() == [0, 10, 1, 11, 2, 12]  # t = s*B + b


def test_masked_and_padding_rows_get_distinct_experts_below_num_experts():
    batch = padded_batch("left")
    for local_layer, indices_TK in enumerate(indices_for(batch)):
        assert torch.equal(indices_TK.sort(dim=-1).values, expected_TK(batch, local_layer))


def test_numpy_uint16_routes_are_accepted():
    batch = packed_batch()
    routes_BSLK = batch["routes_BSLK"].numpy().astype(np.uint16)
    as_numpy = replay_indices(
        routes_BSLK,
        batch["mask_BS"].numpy(),
        layout="packed",
        cu_seqlens=batch["cu_seqlens"].numpy(),
        num_experts=NUM_EXPERTS,
    )
    as_torch = replay_indices(**batch, num_experts=NUM_EXPERTS)
    assert all(torch.equal(a, b) for a, b in zip(as_numpy, as_torch))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda batch: batch["routes_BSLK"].__setitem__((0, 0, 1), 9), "must be < num_experts"),
        (lambda batch: batch["routes_BSLK"].__setitem__((0, 0, 1), 3), "repeat an expert"),
        (lambda batch: batch["attention_mask_BS"].fill_(True), "repeat an expert"),
        (lambda batch: batch.update(layout="packed"), "packed layout needs one row"),
        (lambda batch: batch.update(mask_BS=batch["mask_BS"][:, :-1]), "mask_BS must have shape"),
        (
            lambda batch: batch.update(routes_BSLK=batch["routes_BSLK"][0]),
            "must be \\[B, S, L, K\\]",
        ),
    ],
    ids=[
        "expert-out-of-range",
        "repeated-expert",
        "padding-unmarked",
        "packed-many-rows",
        "mask-shape",
        "routes-rank",
    ],
)
def test_bad_routes_are_refused_with_the_offending_value(change, message):
    batch = padded_batch("right")
    batch["routes_BSLK"][0, 0, 1] = torch.tensor([3, 4])
    change(batch)
    with pytest.raises(ValidationError, match=message):
        indices_for(batch)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"moe_layer_ids": [1, 3]}, "moe_layer_ids \\[3\\] out of range for 3 recorded layers"),
        ({"cu_seqlens": [0, 4, 3]}, "cu_seqlens must increase"),
        ({"cu_seqlens": [0, 16]}, "end <= T=15"),
        ({"num_experts": 1}, "top-k 2 exceeds num_experts=1"),
        ({"layout": "thd"}, "layout must be 'padded' or 'packed'"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    arguments = {**packed_batch(), "num_experts": NUM_EXPERTS, **kwargs}
    with pytest.raises(ValidationError, match=message):
        replay_indices(**arguments)


# --- replay in real megatron-core MoE layers -------------------------------------------------


@pytest.mark.parametrize("layout", list(BATCHES))
def test_router_chooses_the_recorded_experts(model, layout):
    batch = BATCHES[layout]()
    with chosen_experts(model) as calls, replay_routes(model, indices_for(batch)):
        model(hidden_for(batch))
    for local_layer, layer_calls in enumerate(calls):
        (chosen_TK,) = layer_calls
        assert torch.equal(chosen_TK, expected_TK(batch, local_layer))


def test_without_replay_the_router_chooses_differently(model):
    batch = padded_batch("right")
    with chosen_experts(model) as calls:
        model(hidden_for(batch))
    valid_T = valid_BS(batch).transpose(0, 1).reshape(-1)
    for local_layer, (chosen_TK,) in enumerate(calls):
        same_T = (chosen_TK == expected_TK(batch, local_layer)).all(dim=-1)
        assert same_T[valid_T].float().mean() < 0.5


def test_backward_reaches_the_replayed_experts_and_the_router(model):
    batch = packed_batch()
    with (
        chosen_experts(model) as calls,
        replay_routes(model, indices_for(batch), backward_recompute=False),
    ):
        model(hidden_for(batch)).pow(2).sum().backward()
    for router, layer_calls in zip(routers(model), calls):
        layer = next(layer for layer in model.layers if getattr(layer, "router", None) is router)
        used = set(layer_calls[0].unique().tolist())
        assert router.weight.grad.abs().sum() > 0, "replayed probs must stay differentiable"
        for expert_id, expert in enumerate(layer.experts.local_experts):
            grad = expert.linear_fc1.weight.grad
            has_grad = grad is not None and bool(grad.abs().sum() > 0)
            assert has_grad == (expert_id in used), f"expert {expert_id}"


def test_recompute_replays_each_microbatch_in_forward_order():
    recompute_model = MoEStack(len(MOE_LAYER_IDS), recompute=True)
    plain_model = MoEStack(len(MOE_LAYER_IDS))
    plain_model.load_state_dict(recompute_model.state_dict())
    microbatches = [padded_batch("left", seed=0), padded_batch("left", seed=1)]
    with (
        chosen_experts(recompute_model) as calls,
        replay_routes(recompute_model, indices_for(microbatches[0])) as replay,
    ):
        loss_0 = recompute_model(hidden_for(microbatches[0])).pow(2).sum()
        replay.backward_phase()
        replay.next_microbatch(indices_for(microbatches[1]))
        loss_1 = recompute_model(hidden_for(microbatches[1])).pow(2).sum()
        replay.backward_phase()
        # 1F1B order: the first microbatch's backward runs first.
        loss_0.backward()
        loss_1.backward()
    for local_layer, layer_calls in enumerate(calls):
        expected = [expected_TK(batch, local_layer) for batch in microbatches]
        assert len(layer_calls) == 4  # two forwards, then two recomputes
        assert all(torch.equal(a, b) for a, b in zip(layer_calls, expected + expected))
    assert_replay_cleared(recompute_model)

    for batch in microbatches:
        with replay_routes(plain_model, indices_for(batch), backward_recompute=False):
            plain_model(hidden_for(batch)).pow(2).sum().backward()
    for recomputed, plain in zip(recompute_model.parameters(), plain_model.parameters()):
        assert (recomputed.grad is None) == (plain.grad is None)
        if plain.grad is not None:
            torch.testing.assert_close(recomputed.grad, plain.grad)


def test_replay_state_is_cleared_on_exit_and_on_error(model):
    batch = padded_batch("right")
    with chosen_experts(model) as free_calls:
        model(hidden_for(batch))
    with replay_routes(model, indices_for(batch)):
        model(hidden_for(batch))
    assert_replay_cleared(model)
    with (
        pytest.raises(RuntimeError, match="trainer failed"),
        replay_routes(model, indices_for(batch)),
    ):
        model(hidden_for(batch))
        raise RuntimeError("trainer failed")
    assert_replay_cleared(model)
    with chosen_experts(model) as calls_after:
        model(hidden_for(batch))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(free_calls, calls_after))


def test_other_models_routers_do_not_get_in_the_way(model):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    other = MoEStack(1)  # e.g. a reference model in the same process
    assert len(RouterReplay.global_router_replay_instances) > len(routers(model))
    batch = packed_batch()
    with chosen_experts(model) as calls, replay_routes(model, indices_for(batch)):
        model(hidden_for(batch))
        assert other.layers[0].router.router_replay.router_replay_action is None
    assert torch.equal(calls[0][0], expected_TK(batch, 0))


def test_model_without_the_config_flag_is_refused():
    model = MoEStack(1, routing_replay=False)
    batch = packed_batch()
    with (
        pytest.raises(ValidationError, match="moe_enable_routing_replay=True"),
        replay_routes(model, indices_for(batch)[:1]),
    ):
        pass


def test_wrong_layer_count_is_refused_and_leaves_no_state(model):
    batch = packed_batch()
    with (
        pytest.raises(ValidationError, match="indices for 1 MoE layers"),
        replay_routes(model, indices_for(batch)[:1]),
    ):
        pass
    assert_replay_cleared(model)


def test_token_count_mismatch_is_refused(model):
    batch = packed_batch()
    hidden_SBH = hidden_for(batch)[:-1]  # one token short of the replayed indices
    with (
        pytest.raises(ValidationError, match="router sees 14 tokens"),
        replay_routes(model, indices_for(batch)),
    ):
        model(hidden_SBH)
    assert_replay_cleared(model)


def test_nested_replay_is_refused(model):
    batch = packed_batch()
    with (
        replay_routes(model, indices_for(batch)),
        pytest.raises(ValidationError, match="already active"),
        replay_routes(model, indices_for(batch)),
    ):
        pass


def test_backward_phase_needs_backward_recompute(model):
    batch = packed_batch()
    with (
        replay_routes(model, indices_for(batch), backward_recompute=False) as replay,
        pytest.raises(ValidationError, match="backward_recompute=True"),
    ):
        replay.backward_phase()
    assert_replay_cleared(model)
