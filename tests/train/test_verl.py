"""Reader batches as verl 0.9.1's DataProto, checked against verl's own code.

The oracle is verl itself: the same samples, given to verl's agent-loop
post-processing (``AgentLoopWorker._agent_loop_postprocess`` and
``_postprocess`` in ``experimental/agent_loop/agent_loop.py``, run on a worker
holding only what those methods read: a tokenizer, the rollout lengths, no
processor, no reward workers) must give the tensors ``data_proto`` gives. Then
verl's R3 path runs on our batch as its megatron engine runs it
(``workers/utils/padding.py`` ``left_right_2_no_padding``,
``utils/megatron/router_replay_utils.py`` ``align_r3_router_replay_data``,
``build_r3_replay_mask``, ``set_router_replay_data`` with verl's router patch)
in a real megatron-core block with a dense layer on the CPU, and megatron's
routing map must be the stored routes. CPU shims: tests/megatron_cpu.py, and
``router_replay_utils.device_name`` set to "cpu" (verl registers no CPU
platform and falls back to "cuda").

verl's trainer steps (``RayPPOTrainer`` in ``trainer/ppo/ray_trainer.py``:
balancing, reward extraction, old log probs and the actor update through
``DataProto.to_tensordict`` / ``from_tensordict``, advantages) run on the
adapter's batch too. Those conversions assert tensordict >= 0.10, which the
project's venv does not have (docs/verl.md "Tests"): they run in
``.venv-verl`` (``.ci/verl_venv``), which ``test_trainer_steps_in_verls_environment``
runs this file in.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import types
from pathlib import Path
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("verl", reason="pip install --no-deps verl==0.9.1 and the dev extra (.ci/run does)")
pytest.importorskip("megatron.core", reason="needs the extra: pip install 'trajstore[megatron]'")

import torch
from megatron_cpu import HIDDEN_SIZE, TOPK, build_block, causal_mask, cpu_megatron
from packaging.version import Version
from rollout_store import LAYERS, MOE_LAYER_FREQ, MOE_LAYERS, NUM_EXPERTS, build_store, generation

import trajstore
from trajstore.errors import ValidationError
from trajstore.reader import SampleReader
from trajstore.train.verl import data_proto, verl_batches

PAD = 0
ROOT = Path(__file__).resolve().parents[2]
VERLS_TENSORDICT = Version(__import__("tensordict").__version__) >= Version("0.10")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = build_store(tmp_path_factory.mktemp("verl"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def samples(store):
    return next(SampleReader(store, batch_size=4))


def tokenizer():
    """A real Hugging Face fast tokenizer (word level, built locally): verl pads with ``tokenizer.pad``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, **{f"w{i}": i for i in range(1, 100)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>")


def verl_postprocess(samples, loss_masks, prompt_length: int, response_length: int):
    """verl's own agent-loop output for these samples (what its rollout would hand the trainer)."""
    from verl.experimental.agent_loop import agent_loop as al

    worker = object.__new__(al.AgentLoopWorker)
    worker.tokenizer, worker.processor, worker.mm_processor_kwargs = tokenizer(), None, None
    worker.rollout_config = types.SimpleNamespace(prompt_length=prompt_length, response_length=response_length)
    worker.reward_loop_worker_handles, worker.distillation_enabled = None, False
    internals = []
    for s, loss_mask in zip(samples, loss_masks):
        captured = int(np.argmax(s.routed_experts_mask))  # the engine's rows: the captured prefix
        output = al.AgentLoopOutput(
            prompt_ids=s.prompt_ids.tolist(), response_ids=s.response_ids.tolist(), response_mask=loss_mask,
            response_logprobs=s.rollout_logprobs.tolist(), routed_experts=np.array(s.routed_experts[:captured]),
            reward_score=0.0 if s.reward is None else s.reward, num_turns=2, metrics=al.AgentLoopMetrics(),
            extra_fields={"min_global_steps": s.min_model_version, "max_global_steps": s.max_model_version})
        internals.append(asyncio.run(worker._agent_loop_postprocess(output, False, raw_prompt=[])))
    return worker._postprocess(internals)


def test_same_tensors_as_verls_agent_loop(samples):
    ours = data_proto(samples, prompt_length=6, response_length=12, missing_logprobs="keep")
    loss_masks = [s.loss_mask.astype(int).tolist() for s in samples]
    theirs = verl_postprocess(samples, loss_masks, prompt_length=6, response_length=12)
    for key in theirs.batch.keys():
        mine, verls = ours.batch[key], theirs.batch[key]
        assert mine.dtype == verls.dtype and mine.shape == verls.shape, key
        if key != "rm_scores":
            assert torch.equal(mine, verls), key
    # rm_scores: verl's (the reward on the last response token) except where token rewards were recorded.
    token_rewards = [i for i, s in enumerate(samples) if s.token_rewards is not None]
    assert token_rewards == [1]
    keep = [i for i in range(len(samples)) if i not in token_rewards]
    assert torch.equal(ours.batch["rm_scores"][keep], theirs.batch["rm_scores"][keep])
    assert ours.batch["rm_scores"][1, :3].tolist() == [0.0, 0.25, 0.0]
    for key in ("min_global_steps", "max_global_steps"):
        assert ours.non_tensor_batch[key].dtype == theirs.non_tensor_batch[key].dtype
        assert ours.non_tensor_batch[key].tolist() == theirs.non_tensor_batch[key].tolist()
    assert ours.non_tensor_batch["__num_turns__"].dtype == theirs.non_tensor_batch["__num_turns__"].dtype
    assert ours.non_tensor_batch["min_global_steps"].tolist() == [3, 4, 4, 5]  # A1: resumed under version 4
    assert set(theirs.meta_info) - {"metrics"} <= set(ours.meta_info)  # the manager swaps metrics for timing
    # Every field verl's agent loop hands the trainer (ray_trainer.py reads multi_modal_inputs of every row),
    # with the same values for a text row; raw_prompt holds the dataset's chat messages, which the store has not.
    assert set(theirs.non_tensor_batch) <= set(ours.non_tensor_batch)
    mm_inputs = theirs.non_tensor_batch["multi_modal_inputs"].tolist()
    assert ours.non_tensor_batch["multi_modal_inputs"].tolist() == mm_inputs == [{}] * len(samples)
    assert ours.non_tensor_batch["raw_prompt"].tolist() == [None] * len(samples)
    assert ours.meta_info["temperature"] == 1.0  # fit() sets it on the batch the rollout is joined to
    assert data_proto(samples, temperature=0.7).meta_info["temperature"] == 0.7


def test_fields_verl_has_no_place_for_ride_along(samples):
    batch = data_proto(samples)
    width_p = batch.batch["prompts"].shape[1]
    for i, s in enumerate(samples):
        r = len(s.response_ids)
        assert batch.batch["token_model_versions"][i, :r].tolist() == s.token_model_versions.tolist()
        assert (batch.batch["token_model_versions"][i, r:] == -1).all()
        assert batch.batch["rollout_log_probs_mask"][i, :r].tolist() == s.logprobs_mask.tolist()
        start = width_p - len(s.prompt_ids)
        route_mask = batch.batch["routed_experts_mask"][i]
        assert route_mask[start: start + s.num_tokens].tolist() == s.routed_experts_mask.tolist()
        assert route_mask[:start].all() and route_mask[start + s.num_tokens:].all()
        assert batch.non_tensor_batch["trajectory_id"][i] == s.trajectory_id
        assert batch.non_tensor_batch["finish_reason"][i] == s.finish_reason
    assert batch.non_tensor_batch["uid"].tolist() == ["g0", "g0", "g1", "g1"]
    # multi's last turn had no logprobs: those two generated tokens leave response_mask by default
    assert batch.batch["response_mask"][0, :9].tolist() == [1, 1, 1, 1, 1, 0, 0, 0, 0]
    assert batch.meta_info["trajstore"]["masked_missing_logprobs"] == 2
    assert batch.batch["routed_experts"].dtype == torch.int16
    assert (batch.batch["routed_experts"][..., 0, :] == 0).all()  # dense layer 0 as recorded


def test_verl_protocol_operations_keep_the_batch_whole(store):
    from verl.protocol import DataProto

    first, second = list(verl_batches(SampleReader(store, batch_size=4), response_length=12, prompt_length=6))
    # verl's rollout manager splits a batch over workers and concatenates their outputs.
    halves = first.chunk(2)
    assert torch.equal(halves[1].batch["routed_experts"], first.batch["routed_experts"][2:])
    whole = DataProto.concat(halves)
    assert whole.meta_info["trajstore"]["step"] == 0
    assert all(torch.equal(whole.batch[k], first.batch[k]) for k in first.batch.keys())
    assert whole.non_tensor_batch["trajectory_id"].tolist() == ["multi", "short", "mismatch", "mismatch"]
    # Two steps carry two reader states; verl's concat refuses differing meta_info (protocol.py).
    with pytest.raises(AssertionError, match="Conflicting values for meta_info key 'trajstore'"):
        DataProto.concat([first, second])
    second.meta_info.pop("trajstore")
    first.meta_info.pop("trajstore")
    both = DataProto.concat([first, second])
    assert both.non_tensor_batch["trajectory_id"].tolist()[4:] == ["late", "later"]


def test_resume_state_rides_in_meta_info(store):
    batches = list(verl_batches(SampleReader(store, batch_size=4)))
    state = batches[0].meta_info["trajstore"]["reader_state"]
    resumed = SampleReader(store, batch_size=4)
    resumed.load_state_dict(state)
    (again,) = list(verl_batches(resumed))
    assert again.non_tensor_batch["trajectory_id"].tolist() == ["late", "later"]
    assert torch.equal(again.batch["input_ids"], batches[1].batch["input_ids"])
    assert again.meta_info["trajstore"]["step"] == 1


def test_bad_widths_and_missing_rewards(samples):
    with pytest.raises(ValidationError, match="multi#0 has 9 tokens, more than response_length=8"):
        data_proto(samples, response_length=8)
    without = list(samples)
    without[0] = type(samples[0])(**{f: getattr(samples[0], f) for f in samples[0].FIELDS})
    without[0].reward = None
    assert "rm_scores" not in data_proto(without).batch.keys()  # as verl's agent loop: no score, no rm_scores
    assert data_proto(without, missing_reward=-1.0).batch["rm_scores"][0, 8].item() == -1.0
    with pytest.raises(ValidationError, match="multi#0: trained response token 7 has no rollout logprob"):
        data_proto(samples, missing_logprobs="refuse")
    without[1] = type(samples[1])(**{f: getattr(samples[1], f) for f in samples[1].FIELDS})
    without[1].routed_experts = without[1].routed_experts_mask = None
    with pytest.raises(ValidationError, match="short#0 has no routes but other samples of the batch do"):
        data_proto(without, missing_reward=0.0)


@contextlib.contextmanager
def verl_router_patch():
    """verl's router replay patch, undone afterwards: it rebinds megatron classes process-wide."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
    from megatron.core.transformer.transformer_config import TransformerConfig
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    rebound = [(TopKRouter, "__init__"), (TopKRouter, "routing"), (TransformerConfig, "__init__"),
               (MoEAlltoAllTokenDispatcher, "preprocess")]
    flags = [(TopKRouter, "_router_replay_patched"), (TransformerConfig, "_verl_router_patched"),
             (MoEAlltoAllTokenDispatcher, "_preprocess_patched")]
    saved = [(owner, name, owner.__dict__[name]) for owner, name in rebound]
    init_signature = TransformerConfig.__init__.__dict__.get("__signature__")
    apply_router_replay_patch()
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        for owner, name in flags:
            if name in owner.__dict__:
                delattr(owner, name)
        if init_signature is None:
            TransformerConfig.__init__.__dict__.pop("__signature__", None)


def test_verls_r3_replay_drives_each_moe_layer_to_the_stored_experts(samples):
    from megatron.core.transformer.moe.router import TopKRouter
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.utils.megatron import router_replay_utils as rru
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.workers.utils.padding import left_right_2_no_padding

    batch = data_proto(samples)
    with cpu_megatron(), verl_router_patch(), mock.patch.object(rru, "device_name", "cpu"):
        block = build_block(MOE_LAYER_FREQ, num_layers=LAYERS)
        routers = [m for m in block.modules() if isinstance(m, TopKRouter)]
        assert [r.layer_number - 1 for r in routers] == MOE_LAYERS
        # verl's megatron engine, R3 mode (workers/engine/megatron/transformer_impl.py)
        data = left_right_2_no_padding(batch.batch.clone())
        routes = rru.align_r3_router_replay_data(data["routed_experts"], data["input_ids"])
        replay_mask = rru.build_r3_replay_mask(data["input_ids"], batch.batch["response_mask"])
        rru.set_router_replay_data(routes, None, block.config, replay_mask=replay_mask, model=block)
        rru.set_model_router_replay_action(block, RouterReplayAction.REPLAY_FORWARD)
        packed_ids, params, *_ = preprocess_thd_engine(data["input_ids"], pre_process=True)
        calls = {r.layer_number - 1: [] for r in routers}
        hooks = [r.register_forward_hook(lambda m, a, o: calls[m.layer_number - 1].append(o[1]))
                 for r in routers]
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(100, HIDDEN_SIZE)
        num_tokens = packed_ids.shape[1]
        block(embedding(packed_ids).transpose(0, 1).contiguous(), attention_mask=causal_mask(num_tokens))
        for hook in hooks:
            hook.remove()

    offsets = params.cu_seqlens_q.tolist()
    checked = 0
    for i, s in enumerate(samples):
        for layer in MOE_LAYERS:
            (routing_map_TE,) = calls[layer]
            chosen = routing_map_TE[offsets[i]: offsets[i + 1]]
            for j in np.flatnonzero(~s.routed_experts_mask):
                expected = sorted(s.routed_experts[j, layer].tolist())
                assert chosen[j].nonzero().flatten().tolist() == expected, f"{s.trajectory_id} {j} layer {layer}"
                checked += 1
    assert checked == sum(int((~s.routed_experts_mask).sum()) for s in samples) * len(MOE_LAYERS)


# -- routes that were not captured -------------------------------------------------------------------------

@pytest.fixture
def routeless_samples(store_url, tmp_path):
    """A batch where a turn was recorded without routes (a streamed OpenAI call: ``streamed``'s second
    call), a trajectory without any (``plain``) and one with all of them (``whole``), on both backends."""
    rng = np.random.default_rng(3)
    prompt = [11, 12, 13]
    first = generation("streamed", 0, prompt, [21, 22], rng, logprobs=[-0.1, -0.2], model_version=1,
                       finish_reason="stop")
    second = generation("streamed", 1, prompt + [21, 22, 31], [41, 42], rng, logprobs=[-0.3, -0.4],
                        model_version=1, finish_reason="stop")
    plain = generation("plain", 0, prompt, [51, 52], rng, logprobs=[-0.5, -0.6], model_version=1,
                       finish_reason="stop")
    whole = generation("whole", 0, prompt, [61, 62, 63], rng, logprobs=[-0.7, -0.8, -0.9], model_version=1,
                       finish_reason="stop")
    del second["routed_experts"], plain["routed_experts"]
    store = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    try:
        for tid, events in {"streamed": [first, second], "plain": [plain], "whole": [whole]}.items():
            store.append([{"type": "trajectory_started", "trajectory_id": tid, "group_id": "g",
                           "num_experts": NUM_EXPERTS}, *events,
                          {"type": "reward", "trajectory_id": tid, "reward": float(len(tid) % 2)},
                          {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}])
        store.materialize()
        samples = next(SampleReader(store, batch_size=8))
    finally:
        store.close()
    assert [s.trajectory_id for s in samples] == ["streamed", "plain", "whole"]
    assert samples[0].routed_experts_mask.tolist() == [False] * 4 + [True] * 4  # the first call's rows only
    assert samples[1].routed_experts is None
    return samples


def replayed_without_route(batch):
    """Per row: the positions verl's R3 replays (its own mask builder, on the unpadded batch its megatron
    engine builds) where the batch has no captured route."""
    from verl.utils.megatron.router_replay_utils import build_r3_replay_mask
    from verl.workers.utils.padding import left_right_2_no_padding

    data = left_right_2_no_padding(batch.batch.clone())
    replay = build_r3_replay_mask(data["input_ids"], batch.batch["response_mask"])
    valid = batch.batch["attention_mask"].bool()
    out = []
    for i, replayed in enumerate(replay.unbind()):
        uncaptured = batch.batch["routed_experts_mask"][i][valid[i]]
        out.append(torch.nonzero(replayed & uncaptured).flatten().tolist())
    return out, [bool(r.any()) for r in replay.unbind()]


def test_routes_verl_would_replay_as_expert_0_are_refused(routeless_samples):
    with pytest.raises(ValidationError, match=r"streamed#0 has no captured route at position 4: verl's R3 replays"):
        data_proto(routeless_samples)
    with pytest.raises(ValidationError, match="plain#0 has no routes but other samples of the batch do"):
        data_proto(routeless_samples[1:])
    with pytest.raises(ValidationError, match="missing_routes must be 'refuse' or 'mask'"):
        data_proto(routeless_samples, missing_routes="zero")
    # Without routes anywhere there is nothing to replay (verl's R3 then stops on the missing field).
    assert "routed_experts" not in data_proto(routeless_samples[1:2]).batch.keys()


def test_masked_rows_are_never_replayed_by_verls_r3(routeless_samples):
    batch = data_proto(routeless_samples, missing_routes="mask")
    assert batch.batch["response_mask"][:2].sum() == 0  # streamed and plain train nothing
    assert batch.batch["response_mask"][2].tolist() == [1, 1, 1, 0, 0]
    assert batch.meta_info["trajstore"]["masked_missing_routes"] == 4 + 2
    # The zero fill stays where it was: verl's mask, built as its megatron engine builds it, replays none of it.
    assert (batch.batch["routed_experts"][0, 4:] == 0).all() and (batch.batch["routed_experts"][1] == 0).all()
    bad, replayed = replayed_without_route(batch)
    assert bad == [[], [], []]
    assert replayed == [False, False, True]
    # With the trained tokens kept (what the adapter gave before), verl replays expert 0 at streamed's
    # uncaptured rows 4..6 (all but its last) and at every row of plain but the last.
    batch.batch["response_mask"][:2] = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 0, 0, 0]])
    bad, _ = replayed_without_route(batch)
    assert bad == [[4, 5, 6], [0, 1, 2, 3], []]


# -- verl's trainer steps on the batch (they need verl's tensordict: .venv-verl) ---------------------------

class ActorWorkers:
    """The actor worker group ``RayPPOTrainer`` calls, standing in for the model only: it reads the
    TensorDict it is sent as verl's megatron engine does (``workers/engine/megatron/transformer_impl.py``:
    ``batch["temperature"]``, ``prepare_model_inputs``, the R3 routes and replay mask) and answers with
    log probs of the unpadded shape."""

    def __init__(self):
        self.seen = []

    def _read(self, td):
        from verl.utils import tensordict_utils as tu
        from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, build_r3_replay_mask
        from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

        td["temperature"]  # noqa: B018 - the engine's first read: a KeyError without it
        inputs = MegatronEngineWithLMHead.prepare_model_inputs(None, td)  # reads no engine state
        assert inputs["multi_modal_inputs"] == {}
        routes = align_r3_router_replay_data(inputs["routed_experts"], inputs["input_ids"])
        replay = build_r3_replay_mask(td["input_ids"], td["response_mask"])
        self.seen.append({"temperature": tu.get(td, "temperature"), "routes": routes, "replay": replay,
                          "route_mask": td["routed_experts_mask"], "attention_mask": td["attention_mask"]})

    def compute_log_prob(self, td):
        from verl.utils import tensordict_utils as tu

        self._read(td)
        offsets = td["input_ids"].offsets()
        values = torch.full((int(offsets[-1]),), -0.5)
        nested = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
        return tu.get_tensordict({"log_probs": nested, "entropy": nested.clone()}, {"metrics": {"mfu": 0.0}})

    def update_actor(self, td):
        from verl.utils import tensordict_utils as tu

        self._read(td)
        assert tu.get(td, "global_batch_size") == len(td)  # ppo_mini_batch_size 3 x rollout.n 2
        return tu.get_tensordict({}, {"metrics": {"mfu": 0.0, "pg_loss": 0.0}})


def verls_trainer(actor):
    """verl's ``RayPPOTrainer`` without its Ray workers: the config fields its steps read, two DP ranks."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.config = OmegaConf.create({"actor_rollout_ref": {
        "rollout": {"temperature": 0.7, "n": 2, "multi_turn": {"enable": True}},
        "actor": {"calculate_entropy": False, "entropy_coeff": 0.0, "ppo_mini_batch_size": 3, "ppo_epochs": 1,
                  "data_loader_seed": 0, "shuffle": False}}})
    trainer.actor_rollout_wg = actor
    trainer._get_dp_size = lambda worker_group, role: 2
    return trainer


@pytest.mark.skipif(not VERLS_TENSORDICT, reason="DataProto.to_tensordict needs tensordict >= 0.10: "
                    ".venv-verl (.ci/verl_venv) runs it, see test_trainer_steps_in_verls_environment")
def test_verls_trainer_steps_run_on_the_batch(samples, routeless_samples):
    """RayPPOTrainer.fit's steps from the joined rollout batch to the actor update (ray_trainer.py,
    verl 0.9.1), on a batch with multi-turn, missing logprobs, token rewards, a turn without routes."""
    from verl.protocol import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_throughout_metrics
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
    from verl.trainer.ppo.reward import extract_reward
    from verl.utils.debug.metrics import calculate_debug_metrics

    rows = [*samples[:3], *routeless_samples]  # an even batch: two DP ranks
    batch = data_proto(rows, missing_routes="mask", temperature=0.7)
    actor = ActorWorkers()
    trainer = verls_trainer(actor)
    metrics = {}

    RayPPOTrainer._balance_batch(trainer, batch, metrics=metrics)
    assert sorted(batch.non_tensor_batch["trajectory_id"]) == sorted(s.trajectory_id for s in rows)
    assert "global_seqlen/min" in metrics
    # fit() inline, after balancing (ray_trainer.py lines 1553-1560)
    batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
    images_seqlens_all = []
    for multi_modal_input in batch.non_tensor_batch["multi_modal_inputs"]:
        if "image_grid_thw" not in multi_modal_input.keys():
            continue
    batch.meta_info["images_seqlens"] = images_seqlens_all

    reward_tensor, reward_extra_infos = extract_reward(batch)
    assert torch.equal(reward_tensor, batch.batch["rm_scores"]) and reward_extra_infos == {}

    old_log_prob, mfu = RayPPOTrainer._compute_old_log_prob(trainer, batch)
    old_log_prob.batch.pop("entropys")
    batch = batch.union(old_log_prob)
    valid = batch.batch["response_mask"].bool()
    assert (batch.batch["old_log_probs"][valid] == -0.5).all()
    # fit() compares rollout and actor probs on every response_mask token: each has a real rollout logprob.
    metrics.update(calculate_debug_metrics(batch))
    assert batch.batch["rollout_log_probs_mask"][valid].all()
    expected = (torch.exp(batch.batch["rollout_log_probs"][valid]) - np.exp(-0.5)).abs().max().item()
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(expected)

    batch.batch["token_level_scores"] = reward_tensor
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    batch = compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, num_repeat=2, config=AlgoConfig())
    advantages = batch.batch["advantages"]
    assert torch.isfinite(advantages).all() and (advantages[~valid] == 0).all()
    by_id = dict(zip(batch.non_tensor_batch["trajectory_id"], range(len(batch))))
    # GRPO over the group "g": whole (reward 1) against plain (1) and streamed (0), which train nothing
    # but, their outcomes being samples of the policy, still count in the group's baseline.
    assert advantages[by_id["whole"]][valid[by_id["whole"]]].gt(0).all()

    output = RayPPOTrainer._update_actor(trainer, batch)
    assert output.meta_info["metrics"]["actor/pg_loss"] == 0.0
    metrics.update(compute_data_metrics(batch=batch, use_critic=False))
    metrics.update(compute_throughout_metrics(batch=batch, timing_raw={"step": 1.0}, n_gpus=2))
    assert metrics["num_turns/max"] == 4

    # What the engine received, both times: the temperature, and routes replayed only where captured.
    assert [seen["temperature"] for seen in actor.seen] == [0.7, 0.7]
    for seen in actor.seen:
        for replayed, route_mask, attention in zip(seen["replay"].unbind(), seen["route_mask"],
                                                   seen["attention_mask"]):
            assert not (replayed & route_mask[attention.bool()]).any()
    # The batch round-trips through verl's TensorDict form whole, ride-along fields included.
    back = DataProto.from_tensordict(batch.to_tensordict())
    assert torch.equal(back.batch["token_model_versions"], batch.batch["token_model_versions"])
    assert back.non_tensor_batch["trajectory_id"].tolist() == batch.non_tensor_batch["trajectory_id"].tolist()
    assert back.meta_info["trajstore"]["masked_missing_routes"] == 6


@pytest.mark.timeout(900)
def test_trainer_steps_in_verls_environment():
    """Runs this file where verl's trainer runs: tensordict 0.10.0 (.venv-verl, built by .ci/verl_venv)."""
    if VERLS_TENSORDICT:
        pytest.skip("this interpreter already has verl's tensordict: the trainer steps ran above")
    given = os.environ.get("TRAJSTORE_VERL_PYTHON")
    python = Path(given or ROOT / ".venv-verl" / "bin" / "python")
    if not python.exists():
        message = f"no verl trainer environment at {python}: run `bash .ci/verl_venv` (or set $TRAJSTORE_VERL_PYTHON)"
        if given:
            pytest.fail(message)
        pytest.skip(message)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    select = ["-m", "not postgres"] if os.environ.get("TRAJSTORE_SKIP_POSTGRES") == "1" else []
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rs", *select,
                          "-k", "not in_verls_environment", str(Path(__file__))],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=850)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, run.stdout[-4000:]
