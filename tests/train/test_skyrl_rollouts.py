"""SkyRL 0.4.0's own generator recording its rollouts through trajstore (docs/skyrl.md,
"Record the rollouts"), the recipe run as written.

What runs is SkyRL's code from the installed wheels, unchanged: the docs' ``RecordedExp`` over
``BasePPOExp.get_generator`` (compiled from ``train/entrypoints/main_base.py``, whose module
imports Ray workers), ``SkyRLGymGenerator``, ``RemoteInferenceClient`` (HTTP, detokenizing with
a Hugging Face tokenizer), ``prepare_generator_input`` and ``get_sampling_params_for_backend``
as SkyRL's trainer calls them, ``SkyRLTrainConfig``, and skyrl-gym's ``gsm8k_multi_turn``
environment. The engine is the simulated one (``trajstore.demo._engine``) on loopback; the calls
go to a real ``trajstore serve`` over each backend. SkyRL 0.4.0 needs Python 3.12 for its package
``__init__`` files: they are left out as in tests/train/test_skyrl.py.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import os
import re
import types
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("skyrl", reason="pip install --no-deps --ignore-requires-python skyrl==0.4.0 (.ci/run does)")
pytest.importorskip("skyrl_gym", reason="pip install --no-deps skyrl-gym==0.4.0 (.ci/run does)")

from helpers import serve_process
from skyrl_wheel import skyrl_modules

import trajstore
from trajstore.demo._agent import _serving
from trajstore.demo._engine import make_engine
from trajstore.reader import SampleReader
from trajstore.train.skyrl import generator_output

TOKEN = "skyrl-rollouts-token"
DOC = Path(__file__).resolve().parents[2] / "docs" / "skyrl.md"
WEIGHT_SYNCS, N_SAMPLES = 2, 2


@pytest.fixture(scope="module")
def skyrl():
    """SkyRL's modules, loaded from the installed wheel without the 3.12-only package ``__init__`` files."""
    with skyrl_modules() as root:
        ns = types.SimpleNamespace(
            root=root,
            config=importlib.import_module("skyrl.train.config"),
            utils=importlib.import_module("skyrl.train.generators.utils"),
            engine_utils=importlib.import_module("skyrl.backends.skyrl_train.inference_servers.engine_utils"),
            remote=importlib.import_module("skyrl.backends.skyrl_train.inference_servers.remote_inference_client"),
            servers_utils=importlib.import_module("skyrl.backends.skyrl_train.inference_servers.utils"),
        )
        yield ns


def base_ppo_exp(skyrl):
    """``BasePPOExp`` with SkyRL's own ``get_generator``, compiled from ``main_base.py``."""
    path = os.path.join(skyrl.root, "train", "entrypoints", "main_base.py")
    tree = ast.parse(open(path).read(), path)
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BasePPOExp"]
    (method,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_generator"]
    namespace = {"GeneratorInterface": object,
                 "resolve_policy_model_name": skyrl.servers_utils.resolve_policy_model_name}
    exec(compile(ast.Module([method], type_ignores=[]), path, "exec"), namespace)
    return type("BasePPOExp", (), {"get_generator": namespace["get_generator"]})


def tokenizer():
    """A Hugging Face fast tokenizer (word level, built locally) with a chat template."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 299)}, "<unk>": 299}
    words = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}w3 {{ m['content'] }} w2 {% endfor %}"
                         "{% if add_generation_prompt %}w5{% endif %}")
    return tok


def recipe(skyrl, ingest: str) -> type:
    """docs/skyrl.md's ``RecordedExp``, as written, over SkyRL's ``BasePPOExp``."""
    page = DOC.read_text()
    section = page[page.index("## Record the rollouts"):]
    code = next(b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "RecordingGenerator" in b)
    import_line = "from skyrl.train.entrypoints.main_base import BasePPOExp\n"
    assert code.startswith(import_line)
    code = code[len(import_line):]
    assert re.search(r'^INGEST = "http://ingest-host:8700"', code, re.M)
    code = re.sub(r'^INGEST = "http://ingest-host:8700"', f'INGEST = "{ingest}"', code, flags=re.M)
    namespace = {"BasePPOExp": base_ppo_exp(skyrl), "__name__": "recipe"}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace["RecordedExp"]


def generate(skyrl, engine: str, exp_cls: type):
    """One training step's generation as SkyRL's trainer runs it; returns the generator's output, the
    recording client and the ``TrajectoryID`` of each row (the input's: the output has none unless step-wise)."""
    cfg = skyrl.config.SkyRLTrainConfig()
    cfg.generator.max_input_length, cfg.generator.sampling_params.max_generate_length = 256, 16
    cfg.generator.sampling_params.logprobs, cfg.generator.max_turns = 0, 2
    engine_client = skyrl.remote.RemoteInferenceClient(proxy_url=engine, server_urls=[engine], data_parallel_size=1,
                                                       tokenizer=tokenizer())
    for _ in range(WEIGHT_SYNCS):  # the trainer's weight syncs so far
        engine_client.increment_weight_version()
    exp = object.__new__(exp_cls)
    generator = exp.get_generator(cfg, tokenizer(), engine_client)
    prompts = [{"prompt": [{"role": "user", "content": f"w{10 + i} w{20 + i} w30"}], "env_class": None,
                "env_extras": {"reward_spec": {"ground_truth": "42"}, "max_turns": 2, "extra_info": {}},
                "uid": f"prompt-{i}"} for i in range(2)]
    sampling = skyrl.engine_utils.get_sampling_params_for_backend("vllm", cfg.generator.sampling_params)
    batch, _ = skyrl.utils.prepare_generator_input(prompts, N_SAMPLES, sampling, "gsm8k_multi_turn", "train", 7)

    async def run():
        try:
            return await generator.generate(batch)
        finally:
            await engine_client._get_generate_client().aclose()

    try:
        return asyncio.run(run()), generator.client, batch["trajectory_ids"]
    finally:
        generator.client.recorder.close()


def test_a_skyrl_generator_batch_is_recorded_folded_and_read_back_as_skyrl_returned_it(
        skyrl, store_url, tmp_path):
    payload = str(tmp_path / "payload")
    with _serving(make_engine(weight_clock=False), "engine") as engine, \
            serve_process("--store", store_url, "--payload", payload, "serve",
                          env={**os.environ, "TRAJSTORE_TOKEN": TOKEN}) as (_, ingest):
        os.environ["TRAJSTORE_TOKEN"] = TOKEN
        try:
            out, client, trajectory_ids = generate(skyrl, engine, recipe(skyrl, ingest))
        finally:
            del os.environ["TRAJSTORE_TOKEN"]
    rows = len(out["response_ids"])
    assert rows == 2 * N_SAMPLES == len(trajectory_ids) and out["is_last_step"] is None  # a row per trajectory
    assert all(0 in mask and mask[-1] == 1 for mask in out["loss_masks"])  # two turns, an observation between
    with trajstore.connect(store_url, payload=payload) as store:
        assert store.materialize().num_samples_after == rows
    samples = next(iter(SampleReader(store_url, batch_size=rows, payload=payload)))
    by_id = {s.trajectory_id.split("-", 2)[2]: s for s in samples}
    assert sorted(by_id) == sorted(t.to_string() for t in trajectory_ids)
    for i, trajectory in enumerate(trajectory_ids):
        s = by_id[trajectory.to_string()]
        assert s.prompt_ids.tolist() == out["prompt_token_ids"][i]
        assert s.response_ids.tolist() == out["response_ids"][i]
        assert s.loss_mask.astype(int).tolist() == out["loss_masks"][i]
        generated = s.loss_mask.astype(bool)
        assert np.allclose(s.rollout_logprobs[generated], np.asarray(out["rollout_logprobs"][i])[generated])
        assert s.finish_reason == out["stop_reasons"][i]
        assert s.reward == sum(out["rewards"][i])
        assert (s.token_model_versions[generated] == WEIGHT_SYNCS).all()
        assert s.group_id == client.group_id(trajectory.to_string(), s.trajectory_id.split("-")[1])
    # the trainer side: the samples as SkyRL's GeneratorOutput again, row for row
    theirs = {t.to_string(): i for i, t in enumerate(trajectory_ids)}
    ours = generator_output(samples).output
    for j, s in enumerate(samples):
        i = theirs[s.trajectory_id.split("-", 2)[2]]
        for key in ("prompt_token_ids", "response_ids", "loss_masks", "stop_reasons"):
            assert ours[key][j] == out[key][i], key
        assert np.allclose(np.asarray(ours["rollout_logprobs"][j])[np.asarray(ours["loss_masks"][j]) == 1],
                           np.asarray(out["rollout_logprobs"][i])[np.asarray(out["loss_masks"][i]) == 1])
        assert ours["trajectory_ids"][j].instance_id == s.group_id


def test_without_a_sink_the_recipe_fails_naming_it():
    from trajstore.errors import ValidationError
    from trajstore.ingest.skyrl import RecordingInferenceClient

    with pytest.raises(ValidationError, match=r"needs a sink: the ingest service's http://host:port, or a store URL"):
        RecordingInferenceClient(object(), None)
