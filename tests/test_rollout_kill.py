"""The rollout driver killed with SIGKILL at random points, eight times (the driver, the proxy and
the engine), against an uninterrupted run of the same seed: every prompt of the epoch dispatched
once, the same trajectories, no call generated again but the ones in flight at a kill, the same
samples, nothing the proxy acknowledged lost. Real processes on loopback, both backends
(tests/rollout_kill.py is the harness; bench/bench_rollout_resume.py reports its figures)."""

from __future__ import annotations

import numpy as np
import pytest

import trajstore
from rollout_kill import Setup, run_proof

pytestmark = pytest.mark.slow


def _samples(store, run: str) -> dict[str, object]:
    return {s.trajectory_id.split("/", 1)[1] + f"#{s.sample_index}": s for s in store.samples()
            if s.trajectory_id.startswith(run + "/")}


def test_a_killed_driver_resumes_with_nothing_lost_and_nothing_repeated(store_url, tmp_path):
    setup = Setup()
    proof = run_proof(store_url, tmp_path / "work", setup)
    assert len(proof.kills) == len(setup.kills), "the rollout ended before every kill landed"

    # nothing generated again but the calls in flight at each kill (at most `concurrency` each)
    wasted = proof.engine_calls - proof.recorded
    assert not proof.recorded - proof.engine_calls  # every recorded call is one the engine generated
    assert sum(wasted.values()) == sum(k.wasted_calls for k in proof.kills)  # none after the last kill
    assert all(0 <= k.wasted_calls <= setup.concurrency for k in proof.kills), proof.kills
    # and each was a call the run went on to record (the one in flight, done again), never an extra one
    assert set(wasted) <= set(proof.recorded)
    # the uninterrupted run generated each call once, and the killed run recorded exactly its calls
    assert proof.ref_engine_calls == proof.ref_recorded
    assert proof.recorded == proof.ref_recorded
    # the kills hit work in progress: some trajectories were continued from their tails
    assert sum(k.continued for k in proof.kills) > 0
    # nothing acknowledged lost
    assert proof.acked and set(proof.acked) <= proof.recorded_seqs

    prompts = {f"p{i:03d}" for i in range(setup.prompts)}
    # every prompt of the epoch dispatched once: one group each in the SQL view, the skipped one dropped
    assert [(p, e) for p, e, *_ in proof.groups] == [(p, 0) for p in sorted(prompts)]
    assert {p: (bool(w), bool(d), r) for p, _, w, d, r in proof.groups} == {
        p: (False, True, "skipped: listed in --skip") if p == setup.skip else (True, False, None) for p in prompts}
    with trajstore.connect(store_url) as store:
        ref, killed = store.rollout_state("ref"), store.rollout_state("killed")
        # every prompt of the epoch dispatched, once (a second group for one is refused by the store)
        assert set(killed.dispatched) == set(ref.dispatched) == {(p, 0) for p in prompts}
        assert not killed.open and not ref.open
        assert sorted(g.prompt_id for g in killed.whole) == sorted(prompts - {setup.skip})
        assert [(g.prompt_id, sorted(t.split("/", 1)[1] for t in g.finished)) for g in
                sorted(killed.whole, key=lambda g: g.prompt_id)] == \
            [(g.prompt_id, sorted(t.split("/", 1)[1] for t in g.finished)) for g in
             sorted(ref.whole, key=lambda g: g.prompt_id)]
        store.materialize()
        a, b = _samples(store, "ref"), _samples(store, "killed")
    assert sorted(a) == sorted(b) and len(a) >= setup.prompts * setup.group_size
    for key, s in a.items():
        t = b[key]
        assert (s.status, s.reward) == (t.status, t.reward), key
        for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "logprobs_mask", "token_model_versions",
                     "routed_experts"):
            assert np.array_equal(getattr(s, name), getattr(t, name)), (key, name)
    scratch = sum(k.scratch_tokens for k in proof.kills)
    again = sum(n * out for (seed, plen, out), n in wasted.items())
    print(f"\nrollout resume: {len(proof.kills)} kills, {sum(wasted.values())} calls / {again} tokens generated "
          f"again; restarting the open groups from scratch: {scratch} tokens")
    assert again < scratch
