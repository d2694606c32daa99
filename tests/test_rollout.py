"""The reference rollout driver (``trajstore.rollout``) in process, on both backends: whole groups
from a dataset, a deterministic order per epoch, resuming from the store's plan (continuing the
running trajectories from their tails, skipping what was dispatched), replacements, dropped and
skipped groups. The kill -9 proof with real processes is tests/test_rollout_kill.py."""

from __future__ import annotations

import threading

import pytest

import trajstore
from helpers import gen
from trajstore.errors import TrajstoreError, ValidationError
from trajstore.rollout import Episode, Outcome, RolloutDriver

PROMPTS = [(f"q{i}", {"text": f"question {i}"}) for i in range(5)]


class Crash(BaseException):
    """The driver process dying: nothing after it runs (the store keeps what was appended)."""


class Agent:
    """Two calls per episode, appended to the store as the proxy would record them; the
    continuation of a tail is the next call with ``seq = next_seq`` whose prompt starts with
    ``tail.tokens``. ``crash_after``: die after that many calls in all. ``fail``: trajectory
    ids that end ``failed``. ``version``: the policy version its calls are generated under."""

    def __init__(self, store, *, crash_after: int | None = None, fail=(), version: int = 0, raise_once=()):
        self.store, self.crash_after, self.fail, self.version = store, crash_after, set(fail), version
        self.raise_once = set(raise_once)
        self.calls, self.episodes = 0, []
        self.lock = threading.Lock()

    def __call__(self, ep: Episode) -> Outcome:
        with self.lock:
            self.episodes.append(ep)
        if ep.trajectory_id in self.raise_once:
            self.raise_once.discard(ep.trajectory_id)
            raise ConnectionError("proxy unreachable")
        seq = ep.tail.next_seq if ep.tail is not None else 0
        tokens = list(ep.tail.tokens) if ep.tail is not None and len(ep.tail.tokens) else [7, int(ep.prompt_id[1:])]
        while seq < 2:
            with self.lock:
                if self.crash_after is not None and self.calls >= self.crash_after:
                    raise Crash()
                self.calls += 1
            prompt = tokens + ([50 + seq] if seq else [])
            output = [100 + ep.index, 200 + seq]
            self.store.append([gen(ep.trajectory_id, seq, prompt, output, version=self.version)])
            tokens, seq = prompt + output, seq + 1
        return Outcome("failed" if ep.trajectory_id in self.fail else "completed", float(ep.index % 2))


def _driver(store, agent, **kw) -> RolloutDriver:
    kw = {"group_size": 3, "concurrency": 3, "seed": 1, **kw}
    return RolloutDriver(store, "r", PROMPTS, episode=agent, **kw)


def test_an_epoch_ends_as_whole_groups_one_per_prompt(store):
    stats = _driver(store, Agent(store), epochs=2).run()
    plan = store.rollout_state("r")
    assert set(plan.dispatched) == {(p, e) for p, _ in PROMPTS for e in (0, 1)}
    assert not plan.open and len(plan.whole) == 10 and stats.dispatched == 10 and stats.episodes == 30
    assert all(len(g.finished) == 3 and g.group_size == 3 for g in plan.whole)
    assert store.materialize().num_samples_after == 30


def test_the_order_is_a_permutation_fixed_by_seed_and_epoch(store):
    d, again = _driver(store, Agent(store)), _driver(store, Agent(store))
    assert d.order(0) == again.order(0) and d.order(1) == again.order(1)
    assert sorted(d.order(0)) == sorted(p for p, _ in PROMPTS) and d.order(0) != d.order(1)
    assert _driver(store, Agent(store), shuffle=False).order(3) == [p for p, _ in PROMPTS]


def test_a_restarted_driver_continues_the_running_trajectories_from_their_tails(store):
    first = Agent(store, crash_after=7)  # one group whole, the next one's first episode one call in
    with pytest.raises(Crash):
        _driver(store, first, concurrency=1).run()
    plan = store.rollout_state("r")
    running = {t.trajectory_id: t for g in plan.open for t in g.running}
    tails = [t for t in running.values() if len(t.tokens)]
    assert len(plan.whole) == 1 and len(running) == 3 and [t.next_seq for t in tails] == [1]
    second = Agent(store, version=1)
    stats = _driver(store, second).run()
    continued = [ep for ep in second.episodes if ep.tail is not None]
    assert {ep.trajectory_id for ep in continued} == set(running) and stats.continued == len(running)
    # the first driver's groups were not dispatched again
    assert stats.dispatched == len(PROMPTS) - len(plan.dispatched)
    final = store.rollout_state("r")
    assert not final.open and len(final.whole) == len(PROMPTS)
    # each continued trajectory folds into one sample, its tokens from both drivers' versions
    store.materialize()
    samples = {s.trajectory_id: s for s in store.samples()}
    assert len(samples) == 3 * len(PROMPTS)
    for t in tails:
        versions = samples[t.trajectory_id].token_model_versions
        assert set(versions[versions >= 0].tolist()) == {0, 1}


def test_failed_episodes_are_replaced_and_too_many_failures_drop_the_group(store):
    d = _driver(store, None, shuffle=False, max_failures=2, concurrency=1)
    g0, g1 = d.group_id("q0", 0), d.group_id("q1", 0)
    agent = Agent(store, fail={f"{g0}/1", f"{g1}/0", f"{g1}/3"})
    d.episode = agent
    stats = d.run()
    plan = store.rollout_state("r")
    whole = {g.group_id: g for g in plan.whole}
    assert sorted(whole[g0].finished) == [f"{g0}/0", f"{g0}/2", f"{g0}/3"] and list(whole[g0].failed) == [f"{g0}/1"]
    assert g1 not in whole and not plan.open and ("q1", 0) in plan.dispatched  # dropped after 2 failures
    assert stats.replaced == 2 and stats.dropped == 1


def test_stale_groups_are_dropped_at_a_restart_and_their_running_trajectories_aborted(store):
    with pytest.raises(Crash):
        _driver(store, Agent(store, crash_after=4), concurrency=1).run()
    before = store.rollout_state("r")
    (open_group,) = before.open
    stats = _driver(store, Agent(store), stale=lambda g: g.group_id == open_group.group_id).run()
    plan = store.rollout_state("r")
    assert stats.dropped == 1 and not plan.open and len(plan.whole) == len(PROMPTS) - 1
    assert open_group.group_id not in {g.group_id for g in plan.whole}
    for t in open_group.running:
        assert store.trajectory_state(t.trajectory_id).status == "aborted"


def test_a_prompt_skipped_for_good_is_dispatched_but_never_whole(store):
    stats = _driver(store, Agent(store), skip=lambda p, item: "too long" if p == "q3" else None).run()
    plan = store.rollout_state("r")
    assert ("q3", 0) in plan.dispatched and stats.skipped == 1
    assert "q3" not in {g.prompt_id for g in plan.whole} and not plan.open
    again = Agent(store)
    _driver(store, again, skip=lambda p, item: None).run()  # a later driver does not answer it in this epoch
    assert again.episodes == []


def test_resume_replace_aborts_running_trajectories_and_starts_others(store):
    with pytest.raises(Crash):  # the first episode finished, the second one call in, the third not started
        _driver(store, Agent(store, crash_after=3), concurrency=1).run()
    (g,) = store.rollout_state("r").open
    half = [t.trajectory_id for t in g.running if len(t.tokens)]
    assert half
    agent = Agent(store)
    _driver(store, agent, resume="replace").run()
    assert all(ep.tail is None or not len(ep.tail.tokens) for ep in agent.episodes)
    assert all(store.trajectory_state(tid).status == "aborted" for tid in half)
    (whole,) = [w for w in store.rollout_state("r").whole if w.group_id == g.group_id]
    assert len(whole.finished) == 3 and set(half) <= set(whole.failed)


def test_an_episode_that_loses_contact_makes_the_driver_read_the_plan_again(store):
    d = _driver(store, None)
    lost = d.trajectory_id(d.group_id(d.order(0)[0], 0), 1)
    d.episode = agent = Agent(store, raise_once={lost})
    stats = d.run()
    assert stats.replans >= 1 and [ep.tail is not None for ep in agent.episodes if ep.trajectory_id == lost] == \
        [False, True]
    plan = store.rollout_state("r")
    assert not plan.open and len(plan.whole) == len(PROMPTS)


def test_the_driver_gives_up_in_one_line_when_the_episodes_keep_failing(store):
    def episode(ep):
        raise ConnectionError("connection refused")

    with pytest.raises(TrajstoreError, match="no progress for 0 s.*connection refused"):
        _driver(store, episode, retry_for_s=0).run()


def test_bad_arguments_and_outcomes_are_refused_in_one_line(store):
    with pytest.raises(ValidationError, match="prompt ids must be unique"):
        RolloutDriver(store, "r", [("a", 1), ("a", 2)], episode=Agent(store), group_size=2)
    with pytest.raises(ValidationError, match="resume must be"):
        _driver(store, Agent(store), resume="restart")
    with pytest.raises(ValidationError, match="group_size"):
        _driver(store, Agent(store), group_size=0)
    with pytest.raises(TrajstoreError, match="status must be one of"):
        _driver(store, lambda ep: Outcome("done"), retry_for_s=0).run()


def test_a_writer_is_a_ledger_too(store_url, tmp_path):
    with trajstore.connect(store_url, payload=str(tmp_path / "payload")) as store, \
            trajstore.Writer(store) as writer:
        stats = RolloutDriver(writer, "w", PROMPTS[:2], episode=Agent(store), group_size=2).run()
        assert stats.dispatched == 2 and len(store.rollout_state("w").whole) == 2



def test_running_members_of_a_group_dropped_elsewhere_are_finished_aborted(store):
    with pytest.raises(Crash):
        _driver(store, Agent(store, crash_after=3), concurrency=1).run()
    (g,) = store.rollout_state("r").open
    store.append([{"type": "group_dropped", "run": "r", "group_id": g.group_id, "reason": "by hand"}])
    agent = Agent(store)
    _driver(store, agent).run()
    assert g.group_id not in {ep.group_id for ep in agent.episodes}
    assert all(store.trajectory_state(t.trajectory_id).status == "aborted" for t in g.running)
    (dropped,) = [d for d in store.rollout_state("r").dropped if d.group_id == g.group_id]
    assert not dropped.running and dropped.reason == "by hand"


def test_the_ledger_can_be_an_ingest_service_url(store):
    """The driver on a Writer to ``trajstore serve``'s app over loopback HTTP: its dispatches and
    finishes go through the service, the plan comes back from ``GET /v1/rollout_state``."""
    from trajstore.demo._agent import _serving
    from trajstore.ingest.service import make_app

    with _serving(make_app(store, token="t0ken"), "ingest service") as url, \
            trajstore.Writer(url, token="t0ken") as writer:
        first = Agent(store, crash_after=3)
        with pytest.raises(Crash):
            RolloutDriver(writer, "h", PROMPTS[:2], episode=first, group_size=2, concurrency=1, shuffle=False).run()
        agent = Agent(store)
        stats = RolloutDriver(writer, "h", PROMPTS[:2], episode=agent, group_size=2, concurrency=1,
                              shuffle=False).run()
    assert stats.continued == 1 and [ep.tail.next_seq for ep in agent.episodes if ep.tail is not None] == [1]
    plan = store.rollout_state("h")
    assert len(plan.whole) == 2 and not plan.open
