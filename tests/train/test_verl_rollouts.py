"""verl 0.9.1's own agent-loop worker recording its rollouts through trajstore (docs/verl.md,
"Record the rollouts"), run as the recipe says.

What runs is verl's code, unchanged: its config (``ppo_trainer.yaml`` composed by hydra with the
recipe's two settings), its ``AgentLoopWorker`` (here ``RecordingAgentLoopWorker``, built from
that config: verl's tokenizer and model config loading from a local model directory, its
dataset class, its agent-loop registry), its ``SingleTurnAgentLoop`` and an ``AgentLoopBase``
subclass that runs two turns with a tool's output between them, its ``LLMServerClient.generate``,
and its ``_agent_loop_postprocess`` / ``_postprocess`` that build the ``DataProto`` its trainer
trains on. What does not run: Ray (the worker is called in-process, as the Ray actor would
run it) and verl's vLLM server actor, which needs a GPU: in its place ``EngineServer`` answers
``generate`` as that actor does (``vllm_async_server.py``: token ids, logprobs, routes,
``stop_reason``, ``global_steps``) by a token-in/token-out call to the simulated engine
(``trajstore.demo._engine``) over loopback HTTP. The calls are recorded into a real
``trajstore serve`` process over each backend; the store's samples, read back through
``trajstore.train.verl.data_proto`` (the trainer side), equal what verl's worker returned.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import uuid
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verl", reason="pip install --no-deps verl==0.9.1 and the dev extra (.ci/run does)")

import httpx
import torch
from helpers import serve_process
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.workers.rollout.llm_server import LLMServerClient

import trajstore
from trajstore.demo._agent import _serving
from trajstore.demo._engine import NUM_EXPERTS, make_engine, route_rows
from trajstore.errors import ValidationError
from trajstore.reader import SampleReader
from trajstore.train.verl import data_proto

TOKEN = "verl-rollouts-token"
PROMPT_LENGTH, RESPONSE_LENGTH, STEP = 64, 32, 3
TOOL_OUTPUT = "w7 w8 w9"


@pytest.fixture(scope="module")
def engine():
    with _serving(make_engine(weight_clock=False), "engine") as url:
        yield url


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model directory verl's ``HFModelConfig`` loads: a word-level tokenizer with a chat
    template, and a Llama config (no weights: the rollout never loads them; a model type verl's
    agent loop tokenizes with its generic Continuous Token builder)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("model")
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 300)}}
    words = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>")
    tokenizer.chat_template = ("{% for m in messages %}w3 {{ m['content'] }} w2 {% endfor %}"
                               "{% if add_generation_prompt %}w5{% endif %}")
    tokenizer.save_pretrained(path)
    LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return path


DOC = Path(__file__).resolve().parents[2] / "docs" / "verl.md"


def recipe_overrides(ingest: str) -> list[str]:
    """The settings docs/verl.md's "Record the rollouts" puts on verl's command line, as written
    (the sink: this test's service)."""
    page = DOC.read_text()
    section = page[page.index("## Record the rollouts"):]
    block = next(b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "verl.trainer.main_ppo" in b)
    overrides = [w for w in block.split() if w.startswith("+")]
    assert overrides == ["+actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                         "trajstore.ingest.verl.RecordingAgentLoopManager", "+trajstore.sink=http://ingest-host:8700"]
    return [o.replace("http://ingest-host:8700", ingest) for o in overrides]


def verl_config(model_dir, *overrides: str):
    """verl's trainer config as its entry point composes it, with the recipe's settings."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
            f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
            "actor_rollout_ref.rollout.calculate_log_probs=true", *overrides])


class EngineServer:
    """In place of verl's vLLM server actor (``vLLMHttpServer.generate``, which needs a GPU):
    the same ``TokenOutput`` from the simulated engine's ``/inference/v1/generate``."""

    def __init__(self, url: str, global_steps: int) -> None:
        self.url, self.global_steps = url, global_steps
        self.generate = self  # verl calls ``server.generate.remote(...)`` on a Ray actor handle

    async def remote(self, *, request_id, prompt_ids, sampling_params, **_kwargs):
        from verl.workers.rollout.replica import TokenOutput

        params = {"max_tokens": RESPONSE_LENGTH, "temperature": sampling_params.get("temperature", 1.0)}
        if sampling_params.get("logprobs"):
            params["logprobs"] = 0
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(f"{self.url}/inference/v1/generate",
                                  json={"token_ids": list(prompt_ids), "sampling_params": params})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        log_probs = [c["logprob"] for c in choice["logprobs"]["content"]] if choice.get("logprobs") else None
        routes = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
        return TokenOutput(token_ids=choice["token_ids"], log_probs=log_probs, routed_experts=routes,
                           stop_reason="completed", extra_fields={"global_steps": self.global_steps})


@register("fails_after_one_call")
class FailingAgentLoop(AgentLoopBase):
    """An agent loop whose tool crashes after the first engine call."""

    async def run(self, sampling_params, **kwargs):
        ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        await self.server_manager.generate(request_id=uuid.uuid4().hex, prompt_ids=ids, sampling_params=sampling_params)
        raise RuntimeError("the tool crashed")


class OneServerClient(LLMServerClient):
    """verl's ``LLMServerClient`` with one server in place of its Ray load balancer (a module-level
    class: Ray's workers unpickle it)."""

    def __init__(self, config, server: EngineServer) -> None:
        super().__init__(config)
        self.server = server

    async def _acquire_server(self, request_id, **extra):
        return "engine", self.server

    def _release_server(self, server_id, request_id=None):
        pass


@register("two_turn_with_a_tool")
class TwoTurnAgentLoop(AgentLoopBase):
    """Two engine calls with a tool's output between them, scored by the loop itself
    (as verl lets an agent loop that computes its own reward do)."""

    async def run(self, sampling_params, **kwargs):
        ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        mask, logprobs, request_id = [], [], uuid.uuid4().hex
        for turn in range(2):
            out = await self.server_manager.generate(request_id=request_id, prompt_ids=list(ids),
                                                     sampling_params=sampling_params)
            ids, mask, logprobs = ids + out.token_ids, mask + [1] * len(out.token_ids), logprobs + out.log_probs
            if turn == 0:
                tool = self.tokenizer.encode(TOOL_OUTPUT, add_special_tokens=False)
                ids, mask, logprobs = ids + tool, mask + [0] * len(tool), logprobs + [0.0] * len(tool)
        n = len(mask)
        return AgentLoopOutput(prompt_ids=ids[:-n], response_ids=ids[-n:], response_mask=mask,
                               response_logprobs=logprobs, routed_experts=out.routed_experts, reward_score=1.0,
                               num_turns=4, metrics={})


def prompts(agent: str, n: int, rollout_n: int = 2):
    """A generation batch as ``RayPPOTrainer.fit`` hands it to the agent loop: chat messages, a
    ``uid`` per prompt repeated ``rollout_n`` times, ``global_steps`` in ``meta_info``."""
    from verl.protocol import DataProto

    uids = [str(uuid.uuid4()) for _ in range(n)]
    rows = [(f"prompt {i}", uids[i], i) for i in range(n) for _ in range(rollout_n)]
    raw = np.empty(len(rows), dtype=object)
    raw[:] = [[{"role": "user", "content": f"w{10 + i} w{20 + i} w30"}] for _, _, i in rows]
    return DataProto(non_tensor_batch={"raw_prompt": raw, "uid": np.array([u for _, u, _ in rows], dtype=object),
                                       "index": np.array([i for _, _, i in rows]),
                                       "agent_name": np.array([agent] * len(rows), dtype=object)},
                     meta_info={"global_steps": STEP})


def _same_as_verls(theirs, samples, *, routes: str = "equal"):
    """The store's samples, through the trainer-side adapter, give verl's worker output row for
    row; returns both batches in the same row order."""
    by_uid: dict[str, list[int]] = {}
    for i, uid in enumerate(theirs.non_tensor_batch["uid"]):
        by_uid.setdefault(uid, []).append(i)
    assert sorted(len(v) for v in by_uid.values()) == [2] * (len(theirs) // 2)
    ours = data_proto(samples, prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH, pad_token_id=0,
                      missing_reward=None if "rm_scores" in theirs.batch.keys() else 0.0)
    assert len(ours) == len(theirs)
    # a group's two rollouts are one uid in both; within it, match rows by their response
    order = []
    for i, uid in enumerate(ours.non_tensor_batch["uid"]):
        mine = ours.batch["responses"][i]
        candidates = [j for j in by_uid[uid] if j not in order and torch.equal(theirs.batch["responses"][j], mine)]
        assert candidates, f"row {i} (group {uid}) is not one verl returned"
        order.append(candidates[0])
    theirs = theirs[order]
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                "rollout_log_probs", "routed_experts", "rm_scores"):
        if key not in theirs.batch.keys() or (key == "routed_experts" and routes != "equal"):
            continue
        mine, verls = ours.batch[key], theirs.batch[key]
        assert mine.dtype == verls.dtype and mine.shape == verls.shape, key
        assert torch.equal(mine, verls), key
    assert ours.non_tensor_batch["min_global_steps"].tolist() == [STEP] * len(ours)
    assert ours.non_tensor_batch["__num_turns__"].tolist() == theirs.non_tensor_batch["__num_turns__"].tolist()
    return ours, theirs


def _rollout(config, engine_url: str, batch):
    from trajstore.ingest.verl import RecordingAgentLoopWorker

    worker = RecordingAgentLoopWorker(config, OneServerClient(config, EngineServer(engine_url, STEP)))
    try:
        return asyncio.run(worker.generate_sequences(batch))
    finally:
        worker.trajstore.close()


def test_a_verl_agent_loop_batch_is_recorded_folded_and_read_back_as_verl_returned_it(
        engine, model_dir, store_url, tmp_path):
    payload = str(tmp_path / "payload")
    with serve_process("--store", store_url, "--payload", payload, "serve",
                       env={**os.environ, "TRAJSTORE_TOKEN": TOKEN}) as (_, ingest):
        os.environ["TRAJSTORE_TOKEN"] = TOKEN
        try:
            config = verl_config(model_dir, *recipe_overrides(ingest), f"+trajstore.num_experts={NUM_EXPERTS}")
            single = _rollout(config, engine, prompts("single_turn_agent", 2))
            multi = _rollout(config, engine, prompts("two_turn_with_a_tool", 2))
        finally:
            del os.environ["TRAJSTORE_TOKEN"]
    assert "rm_scores" not in single.batch.keys() and "rm_scores" in multi.batch.keys()
    assert multi.non_tensor_batch["__num_turns__"].tolist() == [4] * 4
    with trajstore.connect(store_url, payload=payload) as store:
        assert store.materialize().num_samples_after == 8
        states = [store.trajectory_state(s.trajectory_id) for s in store.samples()]
        assert {st.status for st in states} == {"completed"}
    # the trainer side: the reader's batches in the store's order, one reader per verl batch
    reader = SampleReader(store_url, batch_size=8, payload=payload)
    samples = next(iter(reader))
    by_turns = {1: [s for s in samples if s.loss_mask.all()], 2: [s for s in samples if not s.loss_mask.all()]}
    assert len(by_turns[1]) == len(by_turns[2]) == 4
    _same_as_verls(single, by_turns[1])
    ours, theirs = _same_as_verls(multi, by_turns[2], routes="first recorded")
    # Routes: verl's multi-turn loops keep the last call's rows for every position (ToolAgentLoop's
    # routed_experts), the store keeps each position's first recorded row (docs/vllm.md): the
    # simulated engine, like a real one without prefix caching, recomputes the first turn's positions
    # with other routes in the second call. The two agree on every position only the last call saw.
    first_out = 6  # the engine's output length (MAX_OUTPUT_TOKENS)
    for i in range(len(ours)):
        p = int(ours.batch["attention_mask"][i, :PROMPT_LENGTH].sum())
        seq = ours.batch["input_ids"][i, PROMPT_LENGTH - p:PROMPT_LENGTH + first_out].tolist()
        first = PROMPT_LENGTH - p + len(seq) - 1  # positions the first call's rows cover
        assert torch.equal(ours.batch["routed_experts"][i, PROMPT_LENGTH - p:first],
                           torch.from_numpy(route_rows(seq, p).astype(np.int16)))
        assert torch.equal(ours.batch["routed_experts"][i, first:], theirs.batch["routed_experts"][i, first:])
        assert not torch.equal(ours.batch["routed_experts"][i], theirs.batch["routed_experts"][i])
    for s in by_turns[2]:  # the tool's output is an observation: no loss, no version
        assert (s.token_model_versions[s.loss_mask == 0] == -1).all() and s.reward == 1.0
        assert s.group_id in set(multi.non_tensor_batch["uid"])


def test_the_recipe_without_a_sink_fails_in_the_trainer_naming_it(model_dir):
    from trajstore.ingest.verl import RecordingAgentLoopManager

    config = verl_config(model_dir)
    with pytest.raises(ValidationError, match=r"\+trajstore\.sink=URL"):
        RecordingAgentLoopManager(config, llm_client=None)


@pytest.mark.slow
def test_the_recipe_under_ray_as_verls_trainer_starts_it(engine, model_dir, tmp_path):
    """``RecordingAgentLoopManager.create`` as ``RayPPOTrainer.init_workers`` calls it, on a local Ray
    cluster: the worker actors are ``RecordingAgentLoopWorker``, they record into the service the
    config names with the token of the environment verl started in, and the manager's batch (verl's
    concatenation of its workers') is what the store holds."""
    ray = pytest.importorskip("ray")
    from trajstore.ingest.verl import RecordingAgentLoopManager

    store_url, payload = f"sqlite:///{tmp_path}/store.db", str(tmp_path / "payload")
    here = os.path.dirname(os.path.abspath(__file__))
    with serve_process("--store", store_url, "--payload", payload, "serve",
                       env={**os.environ, "TRAJSTORE_TOKEN": TOKEN}) as (_, ingest):
        config = verl_config(model_dir, *recipe_overrides(ingest), f"+trajstore.num_experts={NUM_EXPERTS}",
                             "actor_rollout_ref.rollout.agent.num_workers=2")
        os.environ["TRAJSTORE_TOKEN"] = TOKEN  # the workers of a local cluster inherit the driver's environment
        path = os.pathsep.join([os.path.dirname(os.path.dirname(here)), os.path.dirname(here), here,
                                os.environ.get("PYTHONPATH", "")])
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path}})
        try:
            client = OneServerClient(config, EngineServer(engine, STEP))
            manager = RecordingAgentLoopManager.create(config=config, llm_client=client)
            out = manager.generate_sequences(prompts("single_turn_agent", 2))
        finally:
            ray.shutdown()
            del os.environ["TRAJSTORE_TOKEN"]
    with trajstore.connect(store_url, payload=payload) as store:
        assert store.materialize().num_samples_after == 4
    samples = next(iter(SampleReader(store_url, batch_size=4, payload=payload)))
    _same_as_verls(out, samples)


def test_an_episode_that_raises_is_recorded_failed_and_the_error_reaches_verl(engine, model_dir, tmp_path):
    """A store URL as the sink (the Writer appends in process); the episode's call is kept, its
    trajectory finished ``failed``, and verl's worker sees the agent loop's own error."""
    store_url = f"sqlite:///{tmp_path}/store.db"
    trajstore.connect(store_url).close()
    config = verl_config(model_dir, *recipe_overrides(store_url))
    with pytest.raises(RuntimeError, match="the tool crashed"):
        _rollout(config, engine, prompts("fails_after_one_call", 1, rollout_n=1))
    with trajstore.connect(store_url) as store:
        info = store.info()
    assert info["trajectories_by_status"] == {"failed": 1}
    assert info["events_by_type"] == {"trajectory_started": 1, "generation": 1, "trajectory_finished": 1}
