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
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("verl", reason="pip install --no-deps verl==0.9.1 and the dev extra (.ci/run does)")
pytest.importorskip("megatron.core", reason="needs the extra: pip install 'trajstore[megatron]'")

import torch
from megatron_cpu import HIDDEN_SIZE, TOPK, build_block, causal_mask, cpu_megatron
from rollout_store import LAYERS, MOE_LAYER_FREQ, MOE_LAYERS, build_store

from trajstore.errors import ValidationError
from trajstore.reader import SampleReader
from trajstore.train.verl import data_proto, verl_batches

PAD = 0


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
