"""Dense layers in recorded routes, replayed into real megatron-core TransformerBlocks on the CPU.

Engines record one route entry per hidden layer, dense layers included (vLLM
writes zeros there); megatron builds routers only in its MoE layers. These
tests build blocks with megatron's own ``moe_layer_freq`` (first-k-dense and
every-other-layer), read routes back from a store, and check megatron's own
routing map: every MoE layer's router chose exactly the experts recorded for
that layer.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

pytest.importorskip("megatron.core", reason="needs the extra: pip install 'trajstore[megatron]'")

import torch
from megatron_cpu import HIDDEN_SIZE, NUM_EXPERTS, TOPK, build_block, causal_mask, cpu_megatron, moe_config

import trajstore
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.errors import ValidationError
from trajstore.reader import SampleReader
from trajstore.train.collate import collate
from trajstore.train.megatron import moe_layer_ids, replay_indices, replay_routes

VOCAB = 300
# (moe_layer_freq, number of layers, its MoE layers)
PATTERNS = {
    "first-k-dense": ([0, 1, 1], 3, [1, 2]),
    "every-other": (2, 4, [0, 2]),
}


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    with cpu_megatron():
        yield


def dense_zeroed(events: list[dict], dense_layers: list[int]) -> list[dict]:
    """The events as vLLM sends them for a model with dense layers: those layers' entries are 0."""
    out = []
    for event in events:
        if "routed_experts" in event:
            routes = np.array(event["routed_experts"])
            routes[:, dense_layers] = 0
            event = {**event, "routed_experts": routes}
        out.append(event)
    return out


@pytest.fixture(scope="module", params=list(PATTERNS))
def pattern_store(request, tmp_path_factory):
    freq, num_layers, moe_layers = PATTERNS[request.param]
    dense = [i for i in range(num_layers) if i not in moe_layers]
    cfg = RolloutConfig(turns=2, prompt_tokens=6, output_tokens=5, observation_tokens=2, layers=num_layers,
                        topk=TOPK, num_experts=NUM_EXPERTS, vocab=VOCAB, mismatch_prob=0.2, abort_prob=0.3,
                        seed=5)
    path = tmp_path_factory.mktemp(f"dense-{request.param}")
    store = trajstore.connect(f"sqlite:///{path / 'store.db'}", payload=str(path / "payload"))
    for i in range(6):
        store.append(dense_zeroed(trajectory_events(cfg, i), dense))
    store.materialize()
    yield store, freq, num_layers, moe_layers
    store.close()


@contextlib.contextmanager
def chosen_experts(routers: list):
    """Per router, the [T, K] experts megatron's routing map sent each token to (ascending)."""
    calls: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [r.register_forward_hook(lambda m, a, o, c=c: c.append(o[1].nonzero()[:, 1].view(-1, TOPK)))
             for r, c in zip(routers, calls)]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def routers_of(module: torch.nn.Module) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in module.modules() if isinstance(m, TopKRouter)]


def test_moe_layer_ids_follow_megatrons_own_layer_specs():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    for freq, num_layers in [(1, 3), (2, 5), (3, 7), ([0, 0, 1, 1, 1], 5), ([1, 0, 1, 1], 4)]:
        config = moe_config(num_layers=num_layers, moe_layer_freq=freq, ffn_hidden_size=32)
        specs = get_gpt_decoder_layer_specs(config, use_transformer_engine=False)
        built_moe = [i for i, spec in enumerate(specs) if spec.submodules.mlp.submodules is not None
                     and hasattr(spec.submodules.mlp.submodules, "experts")]
        assert moe_layer_ids(config) == built_moe, freq
    # DeepSeek-V3: first_k_dense_replace=3 of 61 layers, as Megatron-Bridge writes it
    config = moe_config(num_layers=61, moe_layer_freq=[0] * 3 + [1] * 58, ffn_hidden_size=32)
    assert moe_layer_ids(config) == list(range(3, 61))


def test_store_routes_drive_each_moe_layer_to_the_recorded_experts(pattern_store):
    store, freq, num_layers, moe_layers = pattern_store
    block = build_block(freq, num_layers=num_layers)
    assert [r.layer_number - 1 for r in routers_of(block)] == moe_layers
    stored = {(s.trajectory_id, s.sample_index): s for s in store.samples()}
    batch = collate(next(SampleReader(store, batch_size=4)), layout="padded", padding_side="left")
    num_rows, seq_len = batch["input_ids"].shape
    assert batch["routed_experts"].shape[2] == num_layers  # every hidden layer recorded, dense included
    indices = replay_indices(batch["routed_experts"], batch["routed_experts_mask"],
                             attention_mask_BS=batch["attention_mask"], config=block.config)
    assert sorted(indices) == moe_layers
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(VOCAB, HIDDEN_SIZE)
    with chosen_experts(routers_of(block)) as calls, replay_routes(block, indices, backward_recompute=False):
        hidden_SBH = embedding(batch["input_ids"]).transpose(0, 1).contiguous()
        out_SBH = block(hidden_SBH, attention_mask=causal_mask(seq_len))
        (out_SBH.pow(2).sum(-1) * batch["attention_mask"].T).sum().backward()

    checked = 0
    for row, (tid, index) in enumerate(zip(batch["trajectory_ids"], batch["sample_indices"])):
        sample = stored[(tid, index)]
        start = seq_len - sample.num_tokens  # left padding
        for router_calls, layer in zip(calls, moe_layers):
            (chosen_TK,) = router_calls
            for j in np.flatnonzero(~sample.routed_experts_mask):
                t = (start + j) * num_rows + row  # megatron's token order is s-major
                expected = np.sort(sample.routed_experts[j, layer].astype(np.int64)).tolist()
                assert chosen_TK[t].tolist() == expected, f"{tid}#{index} position {j} layer {layer}"
                checked += 1
    assert checked > 50
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers_of(block))


def test_a_pipeline_stage_replays_only_the_layers_it_holds():
    """A chunk holding only the last layer (as the last pipeline stage would) takes that layer's routes."""
    block = build_block([0, 1, 1], num_layers=3)
    routes_BSLK = torch.zeros(1, 4, 3, TOPK, dtype=torch.uint8)
    routes_BSLK[0, :, 1] = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    routes_BSLK[0, :, 2] = torch.tensor([[7, 6], [5, 4], [3, 1], [2, 0]])
    indices = replay_indices(routes_BSLK, torch.zeros(1, 4, dtype=torch.bool), config=block.config)
    last = block.layers[2]
    with chosen_experts(routers_of(last)) as calls, replay_routes([last], indices, backward_recompute=False):
        last(torch.randn(4, 1, HIDDEN_SIZE), attention_mask=causal_mask(4))
    assert calls[0][0].tolist() == [[6, 7], [4, 5], [1, 3], [0, 2]]


def test_recorded_layer_count_must_match_the_model():
    config = moe_config(num_layers=3, moe_layer_freq=[0, 1, 1], ffn_hidden_size=32)
    routes_BSLK = torch.zeros(1, 4, 2, TOPK, dtype=torch.uint8)  # only the 2 MoE layers recorded
    routes_BSLK[..., 1] = 1
    with pytest.raises(ValidationError, match="routes record 2 layers but the model has num_layers=3"):
        replay_indices(routes_BSLK, torch.zeros(1, 4, dtype=torch.bool), config=config)


def test_dense_zeros_without_a_config_are_refused_with_the_way_out():
    routes_BSLK = torch.zeros(1, 4, 3, TOPK, dtype=torch.uint8)
    routes_BSLK[..., 1:, 1] = 1
    with pytest.raises(ValidationError, match="layer 0 is all zeros, as engines record a dense layer: pass config="):
        replay_indices(routes_BSLK, torch.zeros(1, 4, dtype=torch.bool), num_experts=NUM_EXPERTS)


def test_a_config_that_does_not_match_the_model_is_refused():
    block = build_block(2, num_layers=3)  # MoE layers 0 and 2
    routes_BSLK = torch.zeros(1, 4, 3, TOPK, dtype=torch.uint8)
    routes_BSLK[..., 1] = 1
    other = moe_config(num_layers=3, moe_layer_freq=[0, 1, 1], ffn_hidden_size=32)  # MoE layers 1, 2
    indices = replay_indices(routes_BSLK, torch.zeros(1, 4, dtype=torch.bool), config=other)
    with pytest.raises(ValidationError, match="MoE layer 0 .* has no replay indices; they cover MoE layers \\[1, 2\\]"):
        with replay_routes(block, indices):
            pass


@pytest.mark.parametrize("overrides, message", [
    ({"moe_layer_freq": [0, 1]}, "must list 3 entries of 0 \\(dense\\) or 1 \\(MoE\\)"),
    ({"moe_layer_freq": [0, 2, 1]}, "must list 3 entries"),
    ({"num_moe_experts": None}, "no MoE layers"),
])
def test_unusable_configs_are_refused(overrides, message):
    config = moe_config(num_layers=3, ffn_hidden_size=32)
    for key, value in overrides.items():
        object.__setattr__(config, key, value)
    with pytest.raises(ValidationError, match=message):
        moe_layer_ids(config)


def test_config_and_explicit_layers_or_experts_must_agree():
    config = moe_config(num_layers=3, moe_layer_freq=[0, 1, 1], ffn_hidden_size=32)
    routes_BSLK = torch.zeros(1, 2, 3, TOPK, dtype=torch.uint8)
    routes_BSLK[..., 1] = 1
    mask_BS = torch.zeros(1, 2, dtype=torch.bool)
    with pytest.raises(ValidationError, match="config or moe_layer_ids, not both"):
        replay_indices(routes_BSLK, mask_BS, config=config, moe_layer_ids=[1, 2])
    with pytest.raises(ValidationError, match="num_experts=4 disagrees with config.num_moe_experts=8"):
        replay_indices(routes_BSLK, mask_BS, config=config, num_experts=4)
    with pytest.raises(ValidationError, match="num_experts is required"):
        replay_indices(routes_BSLK, mask_BS)


def test_a_models_mtp_block_is_left_out():
    """GPTModel keeps multi-token-prediction layers in ``.mtp``, their layer numbers restarting at 1;
    engines record no routes for them, so only the ``.decoder``'s routers replay."""

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = build_block([0, 1, 1], num_layers=3)
            self.mtp = build_block(1, num_layers=1, seed=1)  # one MoE layer, layer_number 1

    model = Model()
    routes_BSLK = torch.zeros(1, 4, 3, TOPK, dtype=torch.uint8)
    routes_BSLK[..., 1:, 1] = 1
    indices = replay_indices(routes_BSLK, torch.zeros(1, 4, dtype=torch.bool), config=model.decoder.config)
    with replay_routes(model, indices, backward_recompute=False) as replay:
        assert replay.num_layers == 2
        assert routers_of(model.mtp)[0].router_replay.router_replay_action is None
        assert all(r.router_replay.router_replay_action is not None for r in routers_of(model.decoder))
