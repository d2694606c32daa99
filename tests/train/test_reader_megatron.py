"""Store -> reader -> collate -> replay into real megatron-core MoE layers on the CPU.

The check is megatron's own routing map: for every token with a captured
route, the experts the router chose must be the ones stored for that sample
(looked up through ``store.samples()``, not through the batch), in padded
(left and right) and packed layouts; then backward must reach the router,
the experts and the embedding.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

pytest.importorskip("megatron.core", reason="needs the extra: pip install 'trajstore[megatron]'")

import torch
from megatron_cpu import HIDDEN_SIZE, NUM_EXPERTS, TOPK, MoEStack, cpu_megatron

import trajstore
from trajstore.train.collate import collate
from trajstore.train.megatron import replay_indices, replay_routes
from trajstore.reader import SampleReader
from trajstore.demo._simulate import RolloutConfig, trajectory_events

RECORDED_LAYERS = 3
MOE_LAYER_IDS = [0, 2]  # the model's two MoE layers replay recorded layers 0 and 2
VOCAB = 500
CFG = RolloutConfig(turns=3, prompt_tokens=10, output_tokens=6, observation_tokens=3, layers=RECORDED_LAYERS,
                    topk=TOPK, num_experts=NUM_EXPERTS, vocab=VOCAB, mismatch_prob=0.3, abort_prob=0.3, seed=11)


@pytest.fixture(scope="module", autouse=True)
def megatron_world():
    with cpu_megatron():
        yield


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    path = tmp_path_factory.mktemp("megatron-store")
    s = trajstore.connect(f"sqlite:///{path / 'store.db'}", payload=str(path / "payload"))
    for i in range(12):
        s.append(trajectory_events(CFG, i))
    s.materialize()
    yield s
    s.close()


@contextlib.contextmanager
def chosen_experts(model: MoEStack):
    """Per MoE layer, the [T, K] experts megatron's router really chose (ascending per row)."""
    routers = [layer.router for layer in model.layers if hasattr(layer, "router")]
    calls: list[list[torch.Tensor]] = [[] for _ in routers]

    def record(layer_calls, module, args, output):
        layer_calls.append(output[1].nonzero()[:, 1].view(-1, TOPK))  # output[1]: routing map [T, E]

    hooks = [r.register_forward_hook(lambda m, a, o, c=c: record(c, m, a, o)) for r, c in zip(routers, calls)]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def placements(batch: dict, layout: str) -> list[tuple[int, int]]:
    """(row, first position) of each sample in the collated batch."""
    if layout == "packed":
        return [(0, int(c)) for c in batch["cu_seqlens"][:-1]]
    mask = batch["attention_mask"]
    return [(b, int(mask[b].nonzero()[0])) for b in range(mask.shape[0])]


LAYOUTS = {"padded-right": ("padded", "right"), "padded-left": ("padded", "left"), "packed": ("packed", "right")}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_batch_from_the_store_replays_the_stored_experts_and_trains(store, name):
    layout, side = LAYOUTS[name]
    stored = {(s.trajectory_id, s.sample_index): s for s in store.samples()}
    batch = collate(next(SampleReader(store, batch_size=5)), layout=layout, padding_side=side, pad_to_multiple_of=8)
    num_rows, seq_len = batch["input_ids"].shape
    indices = replay_indices(
        batch["routed_experts"], batch["routed_experts_mask"], num_experts=NUM_EXPERTS, layout=layout,
        attention_mask_BS=batch["attention_mask"] if layout == "padded" else None,
        cu_seqlens=batch.get("cu_seqlens"), moe_layer_ids=MOE_LAYER_IDS)
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(VOCAB, HIDDEN_SIZE)
    model = MoEStack(len(MOE_LAYER_IDS))
    with chosen_experts(model) as calls, replay_routes(model, indices, backward_recompute=False):
        hidden_SBH = embedding(batch["input_ids"]).transpose(0, 1).contiguous()
        out_SBH = model(hidden_SBH)
        loss = (out_SBH.pow(2).sum(-1) * batch["attention_mask"].T).sum()
        loss.backward()

    checked = 0
    for (row, start), tid, index in zip(placements(batch, layout), batch["trajectory_ids"], batch["sample_indices"]):
        sample = stored[(tid, index)]
        for local, recorded_layer in enumerate(MOE_LAYER_IDS):
            (chosen_TK,) = calls[local]
            for j in np.flatnonzero(~sample.routed_experts_mask):
                t = (start + j) * num_rows + row  # megatron's token order is s-major
                expected = np.sort(sample.routed_experts[j, recorded_layer].astype(np.int64))
                assert chosen_TK[t].tolist() == expected.tolist(), f"{tid}#{index} position {j} layer {recorded_layer}"
                checked += 1
    assert checked > 100
    assert embedding.weight.grad is not None and embedding.weight.grad.abs().sum() > 0
    for layer in model.layers:
        if hasattr(layer, "router"):
            assert layer.router.weight.grad.abs().sum() > 0, "replayed routing must stay differentiable"
            used = {e for e, expert in enumerate(layer.experts.local_experts)
                    if expert.linear_fc1.weight.grad is not None and expert.linear_fc1.weight.grad.abs().sum() > 0}
            assert used, "no expert received a gradient"
