"""Sampling policies (``ReaderConfig(policy=...)``) on SQLite and PostgreSQL, each
read locally and through a replay server on loopback (``open_reader``):

* every policy resumes exactly from a JSON round trip of ``state_dict()`` taken
  mid-epoch (the same steps as the uninterrupted reader, other ranks' counts too);
* the lineage ``record_step`` stores is what the policy chose, and bounded reuse
  never takes a sample more than ``max_uses`` times (asked of ``sample_consumption``);
* freshness prefers fresh samples, reproducibly; ready_first takes the fresh ones
  first and defers, never drops, the stale ones;
* bad policy settings and states saved under another policy are one-line errors;
* in follow mode a full step is handed over without waiting for the pool's
  window, and every sample is taken its uses while another process writes;
* ``SampleDataset`` takes the policy as the reader does;
* the pooled planner alone (hypothesis): every unit taken its uses, never twice
  in a step, the pool within its window, and a plan resumed from any step's
  state takes the same steps.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import text

from trajstore.errors import ResumeStateError, ValidationError
from trajstore.reader import (FifoPolicy, FreshnessPolicy, ReadyFirstPolicy, ReaderConfig, ReusePolicy,
                              SampleReader)

from test_reader import (FOLLOW_TIMEOUT_S, GROUP_SIZE, NO_TIMEOUT_WAIT_S, append_samples, drive,  # noqa: F401
                         filled, filled_own, follow_while_another_process_writes, keys, make_readers, open_reader,
                         two_full_steps)

POLICIES = {
    "fifo": "fifo",
    "ready_first": {"name": "ready_first", "bound": 1, "window": 24},
    "freshness": {"name": "freshness", "decay": 0.4, "window": 24, "seed": 7},
    "reuse": {"name": "reuse", "max_uses": 3, "window": 12, "seed": 1},
}
# The trainer's version moving on as it trains (drive's schedule): what is stale depends on the step.
SCHEDULE = {"base": 2, "every": 2}


def _versions(store) -> dict[tuple[str, int], int]:
    """Each sample's oldest token version (what staleness is judged on)."""
    return {(s.trajectory_id, s.sample_index): s.min_model_version
            for b in SampleReader(store, batch_size=1000) for s in b}


@pytest.mark.parametrize("groups", [False, True], ids=["samples", "groups"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_resumes_exactly_from_a_mid_epoch_state(filled, open_reader, policy, groups):
    config = {"batch_size": 3, "policy": POLICIES[policy]}
    if groups:
        config = {"batch_size": 8, "keep_groups": True, "group_size": GROUP_SIZE, "policy": POLICIES[policy]}
    uninterrupted = drive(make_readers(filled, 2, config, open_reader=open_reader), schedule=SCHEDULE)
    assert len(uninterrupted) > 4
    for stop in (1, len(uninterrupted) // 2):
        readers = make_readers(filled, 2, config, open_reader=open_reader)
        before = drive(readers, stop, SCHEDULE)
        states = [json.loads(json.dumps(r.state_dict())) for r in readers]
        assert states[0] == states[1], "ranks disagree on the state"
        if policy != "fifo":
            assert states[0]["pool"], "a pooled policy's state holds its pool mid-epoch"
        after = drive(make_readers(filled, 2, config, states[0], open_reader=open_reader), schedule=SCHEDULE)
        assert before + after == uninterrupted, f"{policy}: a reader restored after step {stop} took other steps"
    taken = Counter(k for step in uninterrupted for batch in step for k in batch)
    uses = POLICIES[policy]["max_uses"] if policy == "reuse" else 1
    assert set(taken.values()) == {uses}, f"{policy}: every sample taken {uses} times in an epoch"
    for step in uninterrupted:
        flat_step = [k for batch in step for k in batch]
        assert len(flat_step) == len(set(flat_step)), "a sample twice in one step"


def test_a_policy_changes_the_order_but_not_the_epoch(filled, open_reader):
    fifo = [keys(b) for b in open_reader(filled, batch_size=4)]
    fresh = [keys(b) for b in open_reader(filled, batch_size=4, policy=POLICIES["freshness"],
                                          current_model_version=5)]
    assert sorted(k for b in fifo for k in b) == sorted(k for b in fresh for k in b)
    assert fifo != fresh


def test_bounded_reuse_never_exceeds_k_in_sample_consumption(filled_own, open_reader):
    """What ``record_step`` records is what the policy handed out, and no sample is
    consumed more than ``max_uses`` times (the ``sample_consumption`` view)."""
    filled = filled_own  # it records steps: a store of its own
    k = 2
    reader = open_reader(filled, batch_size=4, policy={"name": "reuse", "max_uses": k, "window": 10, "seed": 3})
    handed = []
    for step, batch in enumerate(reader):
        reader.record_step(step, run="replay-k", policy_version=step // 3)
        handed.append(keys(batch))
    with filled.log.read_engine.connect() as conn:
        rows = conn.execute(text("SELECT step, trajectory_id, sample_index FROM sample_consumption "
                                 "WHERE run = 'replay-k' ORDER BY step, ordinal")).all()
        most = conn.execute(text("SELECT max(n) FROM (SELECT count(*) AS n FROM sample_consumption "
                                 "WHERE run = 'replay-k' GROUP BY trajectory_id, sample_index) AS c")).scalar()
        reused = conn.execute(text("SELECT count(*) FROM (SELECT 1 FROM sample_consumption WHERE run = 'replay-k' "
                                   "GROUP BY trajectory_id, sample_index HAVING count(*) = :k) AS c"),
                              {"k": k}).scalar()
    recorded: dict[int, list] = {}
    for step, tid, index in rows:
        recorded.setdefault(step, []).append((tid, index))
    assert [recorded[i] for i in range(len(handed))] == handed, "record_step stored another choice than the policy's"
    assert most == k, f"a sample consumed {most} times with max_uses={k}"
    assert reused == filled.materialized.count_samples(), "an epoch of bounded reuse takes every sample k times"


def test_freshness_prefers_fresh_samples_and_is_seeded(filled, open_reader):
    versions = _versions(filled)
    current = max(versions.values())

    def first_half_staleness(decay: float, seed: int) -> float:
        reader = open_reader(filled, batch_size=4, current_model_version=current,
                             policy={"name": "freshness", "decay": decay, "window": 1000, "seed": seed})
        order = [k for b in reader for k in keys(b)]
        half = order[: len(order) // 2]
        return float(np.mean([current - versions[k] for k in half]))

    everyone = float(np.mean([current - v for v in versions.values()]))
    fresh = [first_half_staleness(0.2, seed) for seed in range(3)]
    uniform = [first_half_staleness(1.0, seed) for seed in range(3)]
    # decay 0.2: a sample one version staler is 5x less likely to be drawn first
    assert max(fresh) < min(uniform) and max(fresh) < everyone - 0.8, (fresh, uniform, everyone)
    assert first_half_staleness(0.2, 0) == fresh[0], "the same seed draws the same order"
    a = [keys(b) for b in open_reader(filled, batch_size=4, policy={"name": "freshness", "seed": 0})]
    b = [keys(b) for b in open_reader(filled, batch_size=4, policy={"name": "freshness", "seed": 1})]
    assert a != b, "another seed draws another order"
    # the weights' ratios do not depend on the trainer's version: neither does the draw (so it plans ahead)
    later = [keys(b) for b in open_reader(filled, batch_size=4, policy={"name": "freshness", "seed": 0},
                                          current_model_version=current + 40)]
    assert later == a


def test_ready_first_takes_fresh_units_first_and_defers_the_stale_ones(filled, open_reader):
    versions = _versions(filled)
    current, bound = max(versions.values()), 1
    reader = open_reader(filled, batch_size=4, current_model_version=current,
                         policy={"name": "ready_first", "bound": bound, "window": 1000})
    steps = [keys(b) for b in reader]
    order = [k for step in steps for k in step]
    fresh = [[current - versions[k] <= bound for k in step] for step in steps]
    assert 0 < sum(map(sum, fresh)) < len(order)
    first_stale = next(i for i, step in enumerate(fresh) if not all(step))
    assert not any(f for step in fresh[first_stale + 1:] for f in step), "a stale sample was taken before a fresh one"
    assert sorted(order) == sorted(versions), "deferred, not dropped: the epoch holds every sample once"
    assert reader.stats.stale_samples == 0


def test_max_staleness_still_drops_under_a_policy(filled, open_reader):
    versions = _versions(filled)
    current = max(versions.values())
    reader = open_reader(filled, batch_size=4, current_model_version=current, max_staleness=2,
                         policy=POLICIES["freshness"])
    got = [k for b in reader for k in keys(b)]
    assert got and all(current - versions[k] <= 2 for k in got)
    assert reader.stats.stale_samples == len(versions) - len(got) > 0


def test_policy_settings_are_checked_in_one_line():
    cases = [
        ("lifo", "policy must be one of 'fifo', 'ready_first', 'freshness', 'reuse', got 'lifo'"),
        ({"name": "reuse", "k": 2}, "policy 'reuse' takes ['max_uses', 'window', 'seed'], got ['k']"),
        ({"name": "reuse", "max_uses": 0}, "policy 'reuse': max_uses must be an integer >= 1, got 0"),
        ({"name": "freshness", "decay": 1.5}, "policy 'freshness': decay must be a number in (0, 1], got 1.5"),
        ({"name": "ready_first", "bound": -1}, "policy 'ready_first': bound must be an integer >= 0, got -1"),
        ({"name": "ready_first", "window": 0}, "policy 'ready_first': window must be an integer >= 1, got 0"),
        (3, "policy must be a name"),
    ]
    for value, message in cases:
        with pytest.raises(ValidationError, match=re.escape(message)) as e:
            ReaderConfig(policy=value)
        assert "\n" not in str(e.value)
    assert ReaderConfig(policy="reuse").policy == ReusePolicy()
    assert ReaderConfig(policy={"name": "freshness", "decay": 0.3}).policy == FreshnessPolicy(decay=0.3)
    assert ReaderConfig(policy=ReadyFirstPolicy(bound=2)).policy.to_dict() == {"name": "ready_first", "bound": 2,
                                                                              "window": 64}
    assert ReaderConfig().policy == FifoPolicy() and "policy" not in ReaderConfig().fingerprint()


def test_a_state_saved_under_another_policy_is_refused(filled, open_reader):
    reuse = open_reader(filled, batch_size=4, policy="reuse")
    next(reuse)
    fifo = open_reader(filled, batch_size=4)
    next(fifo)
    with pytest.raises(ResumeStateError, match=r"state was saved with policy=\{'name': 'reuse'.*this reader has "
                                               r"policy='fifo'"):
        open_reader(filled, batch_size=4).load_state_dict(reuse.state_dict())
    with pytest.raises(ResumeStateError, match="state was saved with policy='fifo'"):
        open_reader(filled, batch_size=4, policy="reuse").load_state_dict(fifo.state_dict())
    with pytest.raises(ResumeStateError, match="policy=.*'seed': 1"):
        open_reader(filled, batch_size=4, policy={"name": "reuse", "seed": 1}).load_state_dict(reuse.state_dict())
    bad = reuse.state_dict()
    bad["pool"][0][2] = 2
    with pytest.raises(ResumeStateError, match=r"has 2 uses; policy 'reuse' allows 2"):
        open_reader(filled, batch_size=4, policy="reuse").load_state_dict(bad)
    bad = reuse.state_dict()
    bad["pool"] = [bad["pool"][1], bad["pool"][0]]
    with pytest.raises(ResumeStateError, match="out of order"):
        open_reader(filled, batch_size=4, policy="reuse").load_state_dict(bad)


def test_sample_dataset_takes_the_policy(filled):
    pytest.importorskip("torch")
    from trajstore.train.collate import SampleDataset

    config = {"batch_size": 4, "policy": POLICIES["reuse"]}
    expected = [keys(b) for b in SampleReader(filled, **config)]
    dataset = SampleDataset(filled, **config)
    got = [list(zip(b["trajectory_ids"], (int(i) for i in b["sample_indices"]))) for b in dataset]
    assert got == expected
    # resumed from a batch's reader_state: the rest of the same steps
    third = None
    for n, b in enumerate(SampleDataset(filled, **config)):
        if n == 2:
            third = b["reader_state"]
            break
    rest = SampleDataset(filled, **config)
    rest.load_state_dict(third)
    assert [list(zip(b["trajectory_ids"], (int(i) for i in b["sample_indices"]))) for b in rest] == expected[3:]


@pytest.mark.parametrize("policy", ["ready_first", "freshness", "reuse"])
def test_a_follow_reader_hands_over_a_full_step_without_filling_its_window(store, open_reader, policy):
    """The pool's window (24 units) is not waited for: once a poll finds nothing
    new and the pool holds a step, the step is handed over."""
    append_samples(store, 0, 4)  # exactly one step
    with open_reader(store, follow=True, timeout_s=FOLLOW_TIMEOUT_S, poll_interval_s=0.05, batch_size=4,
                     policy=POLICIES[policy]) as reader:
        _, second, waited, took = two_full_steps(store, reader)
        assert took < NO_TIMEOUT_WAIT_S + waited, "the second step waited for the follow timeout"
    assert len(second) == 4


@pytest.mark.parametrize("policy", ["ready_first", "reuse"])
def test_a_follow_reader_takes_every_sample_its_uses_while_another_process_writes(store, open_reader, policy):
    reader, steps = follow_while_another_process_writes(
        store, lambda: open_reader(store, follow=True, timeout_s=20.0, poll_interval_s=0.05, batch_size=3,
                                   policy=POLICIES[policy], current_model_version=3))
    assert reader.stats.polls > 0, "the reader never had to wait: the test did not exercise following"
    uses = POLICIES[policy]["max_uses"] if policy == "reuse" else 1
    taken = Counter(k for step in steps for k in step)
    everything = {(s.trajectory_id, s.sample_index) for s in store.samples()}
    assert set(taken) == everything, f"missing samples: {sorted(everything - set(taken))[:5]}"
    assert set(taken.values()) == {uses}, f"samples taken other than {uses} times: {taken.most_common(3)}"


# -- the pooled planner alone (pure: no store) ----------------------------------------------------

def _units(versions: list[int], sizes: list[int]):
    from trajstore.reader._plan import Unit

    out = []
    for i, (v, n) in enumerate(zip(versions, sizes)):
        rows = [{"finished_position": i + 1, "sample_index": j} for j in range(n)]
        out.append(Unit(rows, rows, 10 * n, v))
    return out


def _plan(policy, units, *, world_size, capacity, state=None, current=None):
    from trajstore.reader._policies import pooled_steps

    counts = {"steps": 0, "stale_units": 0, "stale_samples": 0, "filtered_samples": 0}
    cursor, restored = None, {}
    if state is not None:
        counts = dict(state["stats"])
        cursor = tuple(state["cursor"]) if state["cursor"] else None
        restored = {(p, i): n for p, i, n in state["pool"]}
    stream = iter([u for u in units if cursor is None or u.key > cursor or u.key in restored])

    def state_after(c, pool, uses):
        return {"cursor": c, "pool": [[*u.key, n] for u, n in zip(pool, uses)], "stats": dict(counts)}

    return list(pooled_steps(policy, stream, cursor=cursor, restored=restored, world_size=world_size,
                             capacity=capacity, cost=lambda u: len(u.kept), stale=lambda u: False,
                             current=lambda: current, counts=counts, drop_last=False, state_after=state_after))


@given(versions=st.lists(st.integers(0, 6), min_size=1, max_size=40), data=st.data(),
       world_size=st.integers(1, 3), capacity=st.integers(1, 6),
       policy=st.sampled_from([ReadyFirstPolicy(bound=1, window=5), FreshnessPolicy(decay=0.3, window=7, seed=2),
                               ReusePolicy(max_uses=3, window=4, seed=9)]))
def test_pooled_steps_use_every_unit_its_uses_and_resume_from_any_step(versions, data, world_size, capacity, policy):
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=len(versions), max_size=len(versions)))
    units = _units(versions, sizes)
    steps = _plan(policy, units, world_size=world_size, capacity=capacity, current=6)
    taken = Counter(u.key for s in steps for b in s.bins for u in b)
    assert taken == {u.key: policy.max_uses for u in units}
    for s in steps:
        in_step = [u.key for b in s.bins for u in b]
        assert len(in_step) == len(set(in_step)), "a unit twice in one step"
        assert all(sum(len(u.kept) for u in b) <= capacity or len(b) == 1 for b in s.bins)
        assert len(s.state["pool"]) <= policy.window
    cut = data.draw(st.integers(0, len(steps) - 1))
    state = json.loads(json.dumps(steps[cut].state))
    resumed = _plan(policy, units, world_size=world_size, capacity=capacity, state=state, current=6)
    assert [[[u.key for u in b] for b in s.bins] for s in steps[cut + 1:]] == \
           [[[u.key for u in b] for b in s.bins] for s in resumed], "a plan resumed from a state took other steps"


# -- a trainer killed -9 mid-step and restored, with a policy (tests/lineage_trainer.py) -----------

@pytest.mark.timeout(600)
def test_a_trainer_with_bounded_reuse_killed_mid_step_records_what_an_uncrashed_run_does(store, store_url,
                                                                                        tmp_path):
    import signal

    from test_lineage import _consumption, _trainer, _wait_for, rollouts, sql

    rollouts(store, [f"t{i:02d}" for i in range(10)])  # 10 samples, each taken twice: 10 steps of 2
    policy = json.dumps({"name": "reuse", "max_uses": 2, "window": 6, "seed": 4})
    ref = _trainer(store_url, "ref", tmp_path / "ref.json", "--policy", policy)
    out, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err
    expected = _consumption(store, "ref")
    assert len(expected) == 20
    # killed -9 after recording step 5; its last checkpoint was taken after step 3
    marker = tmp_path / "paused"
    crash = _trainer(store_url, "crash", tmp_path / "crash.json", "--pause-after", 5, marker, "--policy", policy)
    _wait_for(marker, crash)
    crash.send_signal(signal.SIGKILL)
    crash.wait(60)
    assert json.loads((tmp_path / "crash.json").read_text())["step"] == 4
    restored = _trainer(store_url, "crash", tmp_path / "crash.json", "--policy", policy)
    out, err = restored.communicate(timeout=300)
    assert restored.returncode == 0, err
    assert out.splitlines()[:2] == ["step 4 attempt 0 replayed True", "step 5 attempt 0 replayed True"]
    assert _consumption(store, "crash") == expected, "the restored trainer's policy took other samples"
    uses = sql(store, "SELECT trajectory_id, sample_index, count(*) FROM sample_consumption WHERE run = 'crash' "
                      "GROUP BY trajectory_id, sample_index")
    assert len(uses) == 10 and {n for _, _, n in uses} == {2}, uses
