"""Collation: every field at the right positions in padded (left/right) and packed
layouts, routes kept in their stored dtype, and the torch SampleDataset."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import trajstore
from trajstore.train.collate import SampleDataset, collate, collate_arrays
from trajstore.errors import ValidationError
from trajstore.sample import Sample
from trajstore.demo._simulate import RolloutConfig, trajectory_events


def make_sample(prompt_len: int, response_len: int, *, seed: int = 0, routes_dtype=np.uint8, layers: int = 2,
                topk: int = 2, with_routes: bool = True, token_rewards: bool = False, reward=1.0) -> Sample:
    rng = np.random.default_rng(seed)
    n = prompt_len + response_len
    routes = rng.integers(0, 200, (n, layers, topk)).astype(routes_dtype) if with_routes else None
    mask = rng.random(n) < 0.2 if with_routes else None
    return Sample(
        trajectory_id=f"t{seed}", group_id="g", sample_index=seed, is_last_step=True, status="completed",
        prompt_ids=rng.integers(1, 1000, prompt_len).astype(np.int32),
        response_ids=rng.integers(1, 1000, response_len).astype(np.int32),
        loss_mask=(rng.random(response_len) < 0.7).astype(np.uint8),
        rollout_logprobs=-rng.random(response_len).astype(np.float32),
        logprobs_mask=np.ones(response_len, np.bool_),
        token_model_versions=rng.integers(-1, 5, response_len).astype(np.int32),
        finish_reason="stop",
        reward=reward, token_rewards=rng.random(response_len).astype(np.float32) if token_rewards else None,
        routed_experts=routes, routed_experts_mask=mask, min_model_version=0, max_model_version=4)


SAMPLES = [make_sample(3, 4, seed=1), make_sample(5, 2, seed=2, token_rewards=True, reward=None),
           make_sample(1, 1, seed=3)]


def where(layout: str, side: str, out: dict) -> list[tuple[int, int]]:
    """(row, first position) of each sample, derived independently of the collator."""
    if layout == "packed":
        return [(0, int(c)) for c in out["cu_seqlens"][:-1]]
    width = out["input_ids"].shape[1]
    return [(b, 0 if side == "right" else width - s.num_tokens) for b, s in enumerate(SAMPLES)]


@pytest.mark.parametrize("layout, side", [("padded", "right"), ("padded", "left"), ("packed", "right")])
def test_every_field_lands_at_its_positions(layout, side):
    out = collate_arrays(SAMPLES, layout=layout, padding_side=side, pad_to_multiple_of=4, pad_token_id=7)
    rows = 1 if layout == "packed" else len(SAMPLES)
    width = 16 if layout == "packed" else 8  # 7+7+2 packed; longest 7 rounded up to 8
    assert out["input_ids"].shape == (rows, width)
    real = np.zeros((rows, width), dtype=bool)
    for s, (row, start) in zip(SAMPLES, where(layout, side, out)):
        p, n = len(s.prompt_ids), s.num_tokens
        seq, resp = slice(start, start + n), slice(start + p, start + n)
        real[row, seq] = True
        np.testing.assert_array_equal(out["input_ids"][row, seq], np.concatenate([s.prompt_ids, s.response_ids]))
        np.testing.assert_array_equal(out["position_ids"][row, seq], np.arange(n))
        np.testing.assert_array_equal(out["loss_mask"][row, start:start + p], 0)
        np.testing.assert_array_equal(out["loss_mask"][row, resp], s.loss_mask)
        np.testing.assert_array_equal(out["rollout_logprobs"][row, resp], s.rollout_logprobs)
        np.testing.assert_array_equal(out["token_model_versions"][row, start:start + p], -1)
        np.testing.assert_array_equal(out["token_model_versions"][row, resp], s.token_model_versions)
        expected_rewards = s.token_rewards if s.token_rewards is not None else 0
        np.testing.assert_array_equal(out["token_rewards"][row, resp], expected_rewards)
        np.testing.assert_array_equal(out["routed_experts"][row, seq], s.routed_experts)
        np.testing.assert_array_equal(out["routed_experts_mask"][row, seq], s.routed_experts_mask)
    np.testing.assert_array_equal(out["attention_mask"], real)
    assert (out["input_ids"][~real] == 7).all() and (out["loss_mask"][~real] == 0).all()
    assert out["routed_experts_mask"][~real].all() and (out["token_model_versions"][~real] == -1).all()
    assert out["routed_experts"].dtype == np.uint8 and out["loss_mask"].dtype == np.float32
    np.testing.assert_array_equal(out["seq_lens"], [7, 7, 2])
    np.testing.assert_array_equal(out["prompt_lens"], [3, 5, 1])
    assert np.isnan(out["rewards"][1]) and out["rewards"][0] == 1.0
    assert out["trajectory_ids"] == ["t1", "t2", "t3"] and out["sample_indices"] == [1, 2, 3]


def test_packed_offsets():
    out = collate_arrays(SAMPLES, layout="packed")
    assert out["cu_seqlens"].tolist() == [0, 7, 14, 16] and out["cu_seqlens"].dtype == np.int32
    assert out["position_ids"][0].tolist() == list(range(7)) * 2 + [0, 1]


def test_routes_keep_their_dtype_to_the_tensor():
    mixed = [make_sample(2, 2, seed=1, routes_dtype=np.uint16), make_sample(2, 3, seed=2)]
    out = collate(mixed)
    assert out["routed_experts"].dtype == torch.uint16
    np.testing.assert_array_equal(out["routed_experts"][1, :5].numpy(), mixed[1].routed_experts)
    assert collate(SAMPLES)["routed_experts"].dtype == torch.uint8


def test_samples_without_routes_are_masked_and_no_routes_means_no_keys():
    batch = [make_sample(2, 2, seed=1), make_sample(2, 2, seed=2, with_routes=False)]
    out = collate_arrays(batch)
    assert out["routed_experts_mask"][1].all()
    assert "routed_experts" not in collate_arrays([batch[1]])


def test_tensor_dtypes():
    out = collate(SAMPLES)
    assert out["input_ids"].dtype == torch.int64 and out["attention_mask"].dtype == torch.bool
    assert out["rollout_logprobs"].dtype == torch.float32 and out["token_model_versions"].dtype == torch.int32


@pytest.mark.parametrize("kwargs, batch, message", [
    ({"layout": "thd"}, SAMPLES, "layout must be"),
    ({"padding_side": "middle"}, SAMPLES, "padding_side must be"),
    ({}, [], "empty batch"),
    ({}, [make_sample(2, 2, layers=2), make_sample(2, 2, layers=3)], "disagree on routes"),
])
def test_bad_input_is_refused(kwargs, batch, message):
    with pytest.raises(ValidationError, match=message):
        collate_arrays(batch, **kwargs)


# --- the torch dataset -------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path):
    s = trajstore.connect(f"sqlite:///{tmp_path / 'store.db'}", payload=str(tmp_path / "payload"))
    cfg = RolloutConfig(turns=2, prompt_tokens=10, output_tokens=5, observation_tokens=2, layers=2, topk=2,
                        num_experts=8)
    for i in range(24):
        s.append(trajectory_events(cfg, i))
    s.materialize()
    yield s
    s.close()


def batches(dataset, num_workers: int = 0) -> list[dict]:
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=num_workers)
    return list(loader)


def test_dataloader_workers_keep_the_order_and_states_resume(store):
    plain = batches(SampleDataset(store, batch_size=4, layout="packed"))
    with_workers = batches(SampleDataset(store, batch_size=4, layout="packed"), num_workers=2)
    assert [b["step"] for b in with_workers] == list(range(len(plain)))
    for a, b in zip(plain, with_workers):
        assert a["trajectory_ids"] == b["trajectory_ids"] and torch.equal(a["input_ids"], b["input_ids"])
        assert a["reader_state"] == b["reader_state"]
    resumed = SampleDataset(store, batch_size=4, layout="packed")
    resumed.load_state_dict(json.loads(json.dumps(plain[2]["reader_state"])))
    assert [b["trajectory_ids"] for b in batches(resumed)] == [b["trajectory_ids"] for b in plain[3:]]


def _same_steps(got: list[int], expected: list[int]) -> None:
    """Assert ``got`` is ``expected`` exactly, naming what is missing, duplicated or out of order."""
    missing = sorted(set(expected) - set(got))
    duplicate = sorted({s for s in got if got.count(s) > 1})
    assert not missing, f"missing steps {missing} (got {got})"
    assert not duplicate, f"duplicate steps {duplicate} (got {got})"
    assert got == expected, f"incorrect order: {got} != {expected}"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(store, num_workers, caplog):
    import logging
    import pickle

    caplog.set_level(logging.WARNING, logger="torchdata")

    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    StatefulDataLoader = stateful_dataloader.StatefulDataLoader

    def dataset():
        return SampleDataset(store, batch_size=3, layout="padded")

    whole = [(b["step"], b["trajectory_ids"]) for b in StatefulDataLoader(dataset(), batch_size=None)]
    assert len(whole) >= 6
    for cut in (1, 4, len(whole) - 1):
        loader = StatefulDataLoader(dataset(), batch_size=None, num_workers=num_workers)
        it = iter(loader)
        first = [(b["step"], b["trajectory_ids"]) for b in (next(it) for _ in range(cut))]
        saved = pickle.loads(pickle.dumps(loader.state_dict()))  # as a checkpoint would hold it
        del it, loader
        resumed = StatefulDataLoader(dataset(), batch_size=None, num_workers=num_workers)
        resumed.load_state_dict(saved)
        caplog.clear()
        rest = [(b["step"], b["trajectory_ids"]) for b in resumed]
        # the dataset resumes from its own state, not by re-reading what was consumed
        assert not [r.getMessage() for r in caplog.records if "fast-forward" in r.getMessage()]
        got = first + rest
        _same_steps([s for s, _ in got], [s for s, _ in whole])
        assert got == whole  # the same samples in every step


def test_dataset_state_dict_before_and_after_iteration(store):
    ds = SampleDataset(store, batch_size=4)
    assert ds.state_dict() == {"format": "trajstore.sample_dataset", "reader_state": None}
    first = next(iter(ds))
    assert ds.state_dict()["reader_state"] == first["reader_state"]
    again = SampleDataset(store, batch_size=4)
    again.load_state_dict(ds.state_dict())
    assert next(iter(again))["step"] == 1


def test_logprobs_mask_is_false_on_prompt_and_padding():
    samples = [make_sample(3, 4, seed=1), make_sample(2, 3, seed=2)]
    out = collate_arrays(samples)
    assert out["logprobs_mask"].dtype == np.bool_ and out["logprobs_mask"].shape == (2, 7)
    for row, s in enumerate(samples):
        p, n = len(s.prompt_ids), s.num_tokens
        np.testing.assert_array_equal(out["logprobs_mask"][row], [False] * p + s.logprobs_mask.tolist()
                                      + [False] * (7 - n))
    assert out["finish_reasons"] == [s.finish_reason for s in samples]


def test_logprobs_mask_and_finish_reasons_are_collated():
    from dataclasses import replace

    recorded = replace(make_sample(3, 4, seed=1), logprobs_mask=np.array([True, False, True, True]),
                       finish_reason="length")
    # the engine reported no logprob for this one: its mask is all false
    unrecorded = replace(make_sample(2, 3, seed=2), logprobs_mask=np.zeros(3, np.bool_), finish_reason=None)
    out = collate_arrays([recorded, unrecorded], padding_side="left")
    assert out["logprobs_mask"].dtype == np.bool_ and out["logprobs_mask"].shape == (2, 7)
    np.testing.assert_array_equal(out["logprobs_mask"][0], [False] * 3 + [True, False, True, True])
    np.testing.assert_array_equal(out["logprobs_mask"][1], [False] * 7)
    assert out["finish_reasons"] == ["length", None]
    packed = collate([recorded, unrecorded], layout="packed")
    assert packed["logprobs_mask"].dtype == torch.bool and int(packed["logprobs_mask"].sum()) == 3


# ----------------------------------------------------------------------------
# The old keyword SampleDataset(current_version=) still works, with a DeprecationWarning.

def test_sample_dataset_current_version_is_current_model_version(five_folded):
    pytest.importorskip("torch")
    from trajstore.train.collate import SampleDataset

    with pytest.warns(DeprecationWarning, match="current_version= is deprecated; use current_model_version="):
        old = SampleDataset(five_folded, batch_size=2, max_staleness=0, current_version=0)
    new = SampleDataset(five_folded, batch_size=2, max_staleness=0, current_model_version=0)
    assert old.current_model_version == new.current_model_version == 0
    # the policy is passed on the same way under either name (every sample is stale against 100)
    with pytest.warns(DeprecationWarning):
        stale_old = SampleDataset(five_folded, batch_size=2, max_staleness=0, current_version=100)
    stale_new = SampleDataset(five_folded, batch_size=2, max_staleness=0, current_model_version=100)
    assert len(list(stale_old)) == len(list(stale_new)) == 0
    assert len(list(SampleDataset(five_folded, batch_size=2))) > 0


def test_sample_dataset_takes_a_reader_config_only_as_the_deprecated_form(five_folded):
    pytest.importorskip("torch")
    from trajstore.reader import ReaderConfig
    from trajstore.train.collate import SampleDataset

    new = SampleDataset(five_folded, batch_size=2, keep_groups=False)
    with pytest.warns(DeprecationWarning, match=r"SampleDataset\(\.\.\., config\) is deprecated"):
        old = SampleDataset(five_folded, ReaderConfig(batch_size=2, keep_groups=False))
    assert old.config == new.config
    got, want = batches(old), batches(new)
    assert [b["trajectory_ids"] for b in got] == [b["trajectory_ids"] for b in want] and len(want) >= 2
