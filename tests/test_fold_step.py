"""One rule set: admission applies the fold's step per event and stores its
outcome; ``fold()`` reduces the same step. These tests check that what
admission decides (by hash, one event at a time, across appends) is exactly
what the fold decides (by tokens, over the whole trajectory): the merge, the
sample index, ``prefix_len``, the route rows kept and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, text

from helpers import finished, started
from trajstore._append.admission import admit_batch
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.errors import ValidationError
from trajstore.events import Generation, TrajectoryStarted, parse_event
from trajstore.fold import EMPTY_HASH, FoldTail, fold, fold_step, sequence_hash

TID = "t"
LAYERS, TOPK, EXPERTS = 2, 2, 8
token_lists = st.lists(st.integers(0, 3), min_size=0, max_size=5)


@st.composite
def trajectories(draw) -> list[Generation]:
    """Merges, mismatches of every shape, skipped route rows (valid or not), empty
    route arrays, route-less calls and rewards of either mode (mixing is refused)."""
    generations: list[Generation] = []
    prev: list[int] | None = None
    reward_kind = draw(st.sampled_from(["none", "scalar", "token", "mixed"]))
    for seq in range(draw(st.integers(1, 6))):
        kinds = ["merge", "merge", "fresh", "prefix", "edit", "fork", "fork"]
        kind = "fresh" if prev is None else draw(st.sampled_from(kinds))
        agreed = 0  # leading prompt tokens that agree with the previous sequence (a fork's)
        if kind == "fork" and prev:  # a rewritten history: agrees with prev on a prefix, then differs
            agreed = draw(st.integers(1, max(1, len(prev) - 1)))
            prompt = prev[:agreed] + [9] + draw(token_lists)
        elif kind == "merge":
            prompt = prev + draw(token_lists)
        elif kind == "prefix":
            prompt = prev[: draw(st.integers(0, len(prev)))]
        elif kind == "edit":
            prompt = prev + draw(token_lists)
            if prompt:
                prompt[draw(st.integers(0, len(prompt) - 1))] += 1
        else:
            prompt = draw(st.lists(st.integers(0, 3), min_size=1, max_size=7))
        output = draw(token_lists)
        n = len(prompt) + len(output)
        routes, start = None, 0
        if draw(st.integers(0, 3)) and n > 1:
            if agreed and draw(st.booleans()):
                start = draw(st.integers(1, agreed))  # skips rows the previous sample may hold
            elif draw(st.integers(0, 4)) == 0:
                start = draw(st.integers(0, n - 1))  # any skip (on a merge: a gap, else often refused)
            full = n - 1 - start  # what an engine returns; fewer (even none) exercise the watermark
            num_rows = full if draw(st.booleans()) else draw(st.integers(0, full))
            routes = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(
                0, EXPERTS, (num_rows, LAYERS, TOPK), dtype=np.uint8)
        mode = reward_kind if reward_kind != "mixed" else draw(st.sampled_from(["scalar", "token"]))
        give = draw(st.booleans())
        generations.append(Generation(
            trajectory_id=TID, seq=seq, prompt_ids=np.array(prompt, np.int32), output_ids=np.array(output, np.int32),
            model_version=seq, routed_experts=routes, routed_experts_start=start,
            reward=1.0 if give and mode == "scalar" else None,
            token_rewards=np.ones(len(output), np.float32) if give and mode == "token" else None,
        ))
        prev = prompt + output
    return generations


def _admit(generations: list[Generation]):
    """Admission's outcomes, one append per event (the state threads through the
    stored tail, as across appends); the rare path loads the true sequence."""
    [adm] = admit_batch([TrajectoryStarted(TID, None, EXPERTS)], {}, _never)
    state, outcomes = adm.state, []
    for i, g in enumerate(generations):
        sequence = (lambda j: lambda tid: np.concatenate([generations[j].prompt_ids, generations[j].output_ids]))(i - 1)
        try:
            [adm] = admit_batch([g], {TID: state}, sequence)
        except ValidationError as e:
            return outcomes, (i, e.rule)
        state = adm.state
        outcomes.append(adm.stored)
    return outcomes, state


def _never(tid: str) -> np.ndarray:
    raise AssertionError("admission read payload for a trajectory_started")


def _rows(routes):
    return None if routes is None else routes.tolist()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories())
def test_admission_stores_exactly_the_outcomes_the_fold_reduces(generations):
    admitted, end = _admit(generations)
    try:
        result = fold(generations, trajectory_id=TID, num_experts=EXPERTS)
    except ValidationError as e:
        # the fold refuses what admission refused, for the same rule, and nothing earlier
        assert isinstance(end, tuple), f"the fold refused ({e.rule}) what admission accepted"
        assert e.rule == end[1] and e.trajectory_id == TID
        event(f"refused: {e.rule}")
        return
    assert not isinstance(end, tuple), f"admission refused event {end[0]} ({end[1]}), the fold accepted it"
    assert len(result.steps) == len(admitted) == len(generations)
    for stored, step in zip(admitted, result.steps):
        assert (stored.merged, stored.sample_index, stored.prefix_len) == \
            (step.merged, step.sample_index, step.prefix_len)
        assert _rows(stored.routes) == _rows(step.routes)
        if step.routes is not None:
            assert stored.routes_start == step.routes_start
    event(f"merges: {sum(s.merged for s in result.steps) > 0}")
    event(f"inherited rows: {any(s.inherited_rows for s in result.steps)}")
    assert [s.sample_index for s in result.samples] == sorted({s.sample_index for s in result.steps})
    assert end.num_samples == len(result.samples)
    last = generations[-1]
    assert (end.seq_len, end.seq_hash) == (last.num_tokens,
                                           sequence_hash(np.concatenate([last.prompt_ids, last.output_ids])))


def test_the_step_by_hash_and_by_tokens_agree_and_only_the_hash_tail_hashes():
    a = Generation(TID, 0, np.array([1, 2], np.int32), np.array([3], np.int32), 0)
    b = Generation(TID, 1, np.array([1, 2, 3, 4], np.int32), np.array([5], np.int32), 0)
    c = Generation(TID, 2, np.array([1, 2, 9], np.int32), np.array([5], np.int32), 0)
    hashed, tokens = FoldTail(), FoldTail(seq_hash=None)
    assert hashed.seq_hash == EMPTY_HASH
    outcomes = []
    for prev, g in ((None, a), (a, b), (b, c)):
        pair = (prev.prompt_ids, prev.output_ids) if prev else (np.zeros(0, np.int32),) * 2
        h, hashed = fold_step(hashed, g, lambda: pytest.fail("no skipped rows: nothing to load"))
        t, tokens = fold_step(tokens, g, pair)
        assert (h.merged, h.sample_index, h.prefix_len) == (t.merged, t.sample_index, t.prefix_len)
        outcomes.append((h.merged, h.sample_index, h.prefix_len))
    assert outcomes == [(False, 0, 0), (True, 0, 3), (False, 1, 0)]
    assert tokens.seq_hash is None and hashed.seq_hash == sequence_hash(np.array([1, 2, 9, 5]))
    assert hashed.num_samples == tokens.num_samples == 2
    d = Generation(TID, 3, np.array([1, 2, 9, 5, 6], np.int32), np.array([7], np.int32), 0)
    with pytest.raises(TypeError):  # a tail without a hash cannot decide by hash
        fold_step(tokens, d, lambda: np.zeros(0, np.int32))


CONFIG = RolloutConfig(turns=4, prompt_tokens=8, output_tokens=4, observation_tokens=2, layers=LAYERS, topk=TOPK,
                       num_experts=EXPERTS, vocab=50, mismatch_prob=0.4, abort_prob=0.1, fail_prob=0.0)


def test_stored_outcomes_and_views_equal_the_fold(store, store_url):
    """Through ``store.append`` (events split over appends) on both backends: the
    index rows, the trajectory tail and ``generation_events`` say what the fold says."""
    expected = {}
    for i in range(24):
        events = [dict(e, trajectory_id=f"s{i}") for e in trajectory_events(CONFIG, i)]
        for part in (events[:3], events[3:]):
            store.append(part)
        gens = [parse_event(e) for e in events if e["type"] == "generation"]
        expected[f"s{i}"] = fold(gens, trajectory_id=f"s{i}", num_experts=EXPERTS)
    store.append([started("empty"), finished("empty")])
    assert sum(r.metrics.prefix_mismatch_count for r in expected.values()) > 5  # mismatches were exercised
    engine = create_engine(store_url)
    with engine.connect() as conn:
        rows = conn.execute(text(
            "SELECT trajectory_id, seq, sample_index, is_merged, prefix_len, routes_start, num_route_rows "
            "FROM events WHERE type = 'generation' ORDER BY trajectory_id, seq")).all()
        view = conn.execute(text(
            "SELECT trajectory_id, seq, sample_index, is_merged, is_prefix_mismatch FROM generation_events "
            "ORDER BY trajectory_id, seq")).all()
        num_samples = dict(conn.execute(text("SELECT trajectory_id, num_samples FROM trajectories")).all())
    engine.dispose()
    want = []
    for tid, result in sorted(expected.items()):
        for seq, step in enumerate(result.steps):
            want.append((tid, seq, step.sample_index, step.merged, step.prefix_len,
                         step.routes_start if step.routes is not None else None,
                         None if step.routes is None else len(step.routes)))
    assert [(r[0], r[1], r[2], bool(r[3]), r[4], r[5], r[6]) for r in rows] == want
    assert [(r[0], r[1], r[2], bool(r[3]), bool(r[4])) for r in view] == \
        [(w[0], w[1], w[2], w[3], w[1] > 0 and not w[3]) for w in want]
    assert num_samples == {"empty": 0} | {tid: len(r.samples) for tid, r in expected.items()}
