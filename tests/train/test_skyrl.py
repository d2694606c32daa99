"""Reader batches as SkyRL 0.4.0's GeneratorOutput, checked by SkyRL's own code.

SkyRL 0.4.0 declares Python >= 3.12 and its package ``__init__`` files import
pydantic models that refuse to build on 3.11 (``skyrl/tinker/types.py``:
"Please use typing_extensions.TypedDict"). The modules that define and
consume ``GeneratorOutput`` do import on 3.11, so ``.ci/run`` installs the
wheel (``pip install --no-deps --ignore-requires-python skyrl==0.4.0``) and
this test loads SkyRL's own modules from it, leaving out only those two
package ``__init__`` files. What runs is SkyRL's code, unchanged:
``GeneratorOutput`` (keys and types), its trainer's validation
(``validate_generator_output``, compiled from ``train/utils/trainer_utils.py``:
importing that module whole needs Ray workers and vLLM), and its batch
builder ``convert_prompts_responses_to_batch_tensors`` with
``make_router_padding_mask`` (``train/dataset/preprocess.py``).
"""

from __future__ import annotations

import ast
import importlib
import logging
import os
import sys
import types
import typing

import numpy as np
import pytest

pytest.importorskip("skyrl", reason="pip install --no-deps --ignore-requires-python skyrl==0.4.0 (.ci/run does)")

import torch
from rollout_store import LAYERS, MOE_LAYERS, REWARDS, TOPK, build_store
from skyrl_wheel import skyrl_modules

from trajstore.errors import ValidationError
from trajstore.reader import SampleReader
from trajstore.train.skyrl import generator_output, skyrl_batches


@pytest.fixture(scope="module")
def skyrl():
    """SkyRL's own modules, loaded from the installed wheel."""
    with skyrl_modules() as root:
        base = importlib.import_module("skyrl.train.generators.base")
        preprocess = importlib.import_module("skyrl.train.dataset.preprocess")
        routed = importlib.import_module("skyrl.backends.skyrl_train.utils.routed_experts")
        yield types.SimpleNamespace(base=base, preprocess=preprocess, routed=routed, validate=_trainer_validation(root))


def _trainer_validation(root: str):
    """SkyRL's ``validate_generator_output`` and the two checks it calls, compiled from its file."""
    path = os.path.join(root, "train", "utils", "trainer_utils.py")
    tree = ast.parse(open(path).read(), path)
    wanted = {"validate_generator_output", "_validate_per_token_side_channels", "_validate_step_wise_fields"}
    module = ast.Module([node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in wanted],
                        type_ignores=[])
    assert len(module.body) == len(wanted)
    from skyrl.backends.skyrl_train.utils.sample_support import SAMPLE_SUPPORT_FIELD
    from skyrl.train.generators.base import GeneratorOutput

    namespace = {"np": np, "GeneratorOutput": GeneratorOutput, "SAMPLE_SUPPORT_FIELD": SAMPLE_SUPPORT_FIELD,
                 "logger": logging.getLogger("skyrl"), **vars(typing)}
    exec(compile(module, path, "exec"), namespace)
    return namespace["validate_generator_output"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = build_store(tmp_path_factory.mktemp("skyrl"))
    yield s
    s.close()


def first_batch(store, **kwargs):
    return next(skyrl_batches(SampleReader(store, batch_size=4), **kwargs))


def matches(value, hint) -> bool:
    """Whether ``value`` is of the typing ``hint`` (the forms GeneratorOutput uses)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin is typing.Union:
        return any(matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin in (list, typing.List):
        return isinstance(value, list) and all(matches(v, args[0]) for v in value)
    if origin in (dict, typing.Dict):
        return isinstance(value, dict) and all(matches(k, args[0]) and matches(v, args[1]) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def test_output_is_exactly_a_generator_output(skyrl, store):
    batch = first_batch(store)
    hints = typing.get_type_hints(skyrl.base.GeneratorOutput)
    assert set(batch.output) == set(hints)
    for key, hint in hints.items():
        if key == "stop_reasons":
            continue  # checked below: a sample without a finish reason keeps None
        assert matches(batch.output[key], hint), (key, batch.output[key])
    assert all(isinstance(t, skyrl.base.TrajectoryID) for t in batch.output["trajectory_ids"])
    assert batch.output["stop_reasons"] == ["stop", "length", "stop", "stop"]


def test_skyrls_trainer_validation_accepts_it_step_wise_with_routes(skyrl, store):
    batch = first_batch(store)
    num_trajectories = sum(batch.output["is_last_step"])
    skyrl.validate(num_trajectories, batch.output, step_wise=True, routes_expected=True)
    rows = [(t.to_string(), last) for t, last in zip(batch.output["trajectory_ids"], batch.output["is_last_step"])]
    assert rows == [("g0_0", True), ("g0_1", True), ("g1_0", False), ("g1_0", True)]
    assert batch.trajectory_ids == ["multi", "short", "mismatch", "mismatch"]


def test_fields_follow_the_stored_samples(store):
    batch = first_batch(store)
    stored = {(s.trajectory_id, s.sample_index): s for s in store.samples()}
    out = batch.output
    for i, key in enumerate(zip(batch.trajectory_ids, batch.sample_indices)):
        s = stored[key]
        assert out["prompt_token_ids"][i] == s.prompt_ids.tolist()
        assert out["response_ids"][i] == s.response_ids.tolist()
        assert out["rollout_logprobs"][i] == s.rollout_logprobs.tolist()
        assert out["is_last_step"][i] == s.is_last_step
        np.testing.assert_array_equal(batch.token_model_versions[i], s.token_model_versions)
        np.testing.assert_array_equal(batch.logprobs_mask[i], s.logprobs_mask)
        np.testing.assert_array_equal(batch.routed_experts_mask[i], s.routed_experts_mask)
    # "short" has token rewards, so every row is per token: its own plus its reward on the last token.
    assert out["rewards"][1] == [0.0, 0.25, 0.0 + REWARDS["short"]]
    assert out["rewards"][0][-1] == REWARDS["multi"] and sum(out["rewards"][0]) == REWARDS["multi"]
    assert out["rewards"][2] == [0.0, 0.0]  # an earlier step: the store gives the reward to the last one
    # multi's last turn came without logprobs: those trained tokens leave the loss ("mask", the default).
    assert out["loss_masks"][0] == [1, 1, 1, 1, 1, 0, 0, 0, 0]
    assert batch.masked_missing_logprobs == 2
    assert out["rollout_metrics"] == {"trajstore/min_model_version": 3, "trajstore/max_model_version": 5,
                                      "trajstore/masked_missing_logprobs": 2}
    assert batch.token_model_versions[0].tolist() == [3, 3, 4, 4, 4, -1, -1, 4, 4]


def test_skyrls_batch_builder_replays_the_recorded_routes_dense_layers_included(skyrl, store):
    batch = first_batch(store)
    out = batch.output
    stored = {(s.trajectory_id, s.sample_index): s for s in store.samples()}
    (sequences, attention_mask, _, _, loss_masks, logprobs, routes, _) = \
        skyrl.preprocess.convert_prompts_responses_to_batch_tensors(
            0, out["prompt_token_ids"], out["response_ids"], out["rewards"], out["loss_masks"],
            out["rollout_logprobs"], out["rollout_expert_indices"])
    captured_lengths = [len(r) for r in out["rollout_expert_indices"]]
    padding_mask = skyrl.preprocess.make_router_padding_mask(attention_mask, captured_lengths)
    assert routes.values.shape[1:] == (LAYERS, TOPK)  # every recorded layer, as SkyRL's replay expects
    for i, key in enumerate(zip(batch.trajectory_ids, batch.sample_indices)):
        s = stored[key]
        n = s.num_tokens
        assert sequences[i, -n:].tolist() == [*s.prompt_ids.tolist(), *s.response_ids.tolist()]
        segment = routes.values[int(routes.cu_seqlens[i]): int(routes.cu_seqlens[i + 1])]
        captured = ~s.routed_experts_mask
        assert captured[:n - 1].all() and not captured[n - 1]  # the engine never forwards the last token
        np.testing.assert_array_equal(segment[:n - 1].numpy(), s.routed_experts[:n - 1])
        assert (segment[:n - 1, 0] == 0).all()  # dense layer 0: zeros, as the engine recorded it
        assert (segment[:n - 1, MOE_LAYERS].sort(dim=-1).values.diff(dim=-1) > 0).all()
        # SkyRL's router mask excludes exactly the rows without a captured route (and padding).
        assert padding_mask[i, -n:].tolist() == (~captured).tolist()
        assert padding_mask[i, :-n].all()
        assert out["rollout_expert_indices"][i].dtype in skyrl.routed.ROUTED_EXPERT_DTYPES
        assert logprobs[i, -len(s.response_ids):].tolist() == pytest.approx(s.rollout_logprobs.tolist())


def test_uint16_routes_become_skyrls_int16(skyrl, store):
    samples = next(SampleReader(store, batch_size=1))
    wide = [s.__class__(**{f: getattr(s, f) for f in s.FIELDS}) for s in samples]
    for s in wide:
        s.routed_experts = s.routed_experts.astype(np.uint16) + 300
    routes = generator_output(wide).output["rollout_expert_indices"]
    assert all(r.dtype == np.int16 for r in routes)
    assert routes[0].dtype in skyrl.routed.ROUTED_EXPERT_DTYPES
    assert int(routes[0].min()) >= 300


def test_resume_state_continues_with_the_next_batch(store):
    reader = SampleReader(store, batch_size=4)
    batches = list(skyrl_batches(reader))
    assert [b.step for b in batches] == [0, 1]
    assert batches[1].trajectory_ids == ["late", "later"]
    resumed = SampleReader(store, batch_size=4)
    resumed.load_state_dict(batches[0].reader_state)
    (again,) = list(skyrl_batches(resumed))
    assert again.trajectory_ids == batches[1].trajectory_ids
    assert again.output["response_ids"] == batches[1].output["response_ids"]
    assert again.reader_state == batches[1].reader_state


def test_missing_logprobs_refused_or_kept_when_asked(store):
    with pytest.raises(ValidationError, match="multi#0: trained response token 7 has no rollout logprob"):
        first_batch(store, missing_logprobs="refuse")
    kept = first_batch(store, missing_logprobs="keep")
    assert kept.output["loss_masks"][0] == [1, 1, 1, 1, 1, 0, 0, 1, 1]
    assert kept.output["rollout_logprobs"][0][7:] == [0.0, 0.0]
    with pytest.raises(ValidationError, match="missing_logprobs must be"):
        first_batch(store, missing_logprobs="drop")


def test_a_last_step_without_reward_is_refused(store):
    samples = next(SampleReader(store, batch_size=1))
    samples[0].reward = None
    with pytest.raises(ValidationError, match="multi#0 has no reward"):
        generator_output(samples)
    assert generator_output(samples, missing_reward=-1.0).output["rewards"] == [-1.0]


def test_routes_must_reach_every_trained_token(store):
    samples = next(SampleReader(store, batch_size=1))
    mask = samples[0].routed_experts_mask.copy()
    mask[6] = True  # a hole before the trained tokens: SkyRL can replay only a captured prefix
    samples[0].routed_experts_mask = mask
    with pytest.raises(ValidationError, match="no captured route at position 6, before trained token 8"):
        generator_output(samples)
    samples = list(next(SampleReader(store, batch_size=2)))
    samples[1].routed_experts = samples[1].routed_experts_mask = None
    with pytest.raises(ValidationError, match="short#0 has no routes but other samples"):
        generator_output(samples)


def test_without_an_importable_skyrl_the_ids_have_trajectory_ids_fields(tmp_path):
    """On Python 3.11 ``skyrl.train.generators.base`` cannot be imported whole (docs/skyrl.md):
    the output then carries a dataclass with TrajectoryID's fields and ``to_string``."""
    import subprocess

    script = (
        "import pathlib, sys\n"
        "from rollout_store import build_store\n"
        "from trajstore.reader import SampleReader\n"
        "from trajstore.train.skyrl import generator_output\n"
        f"store = build_store(pathlib.Path({str(tmp_path)!r}))\n"
        "out = generator_output(next(SampleReader(store, batch_size=4))).output\n"
        "print(sys.version_info >= (3, 12) or 'skyrl.train.generators.base' not in sys.modules)\n"
        "print([t.to_string() for t in out['trajectory_ids']], type(out['trajectory_ids'][0]).__name__)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported, ids = proc.stdout.splitlines()[-2:]
    assert imported == "True"
    assert ids == "['g0_0', 'g0_1', 'g1_0', 'g1_0'] " + ("TrajectoryID" if sys.version_info >= (3, 12) else
                                                        "_TrajectoryID")
