"""The reader on SQLite and PostgreSQL: resume in a new process (same and other
world sizes), shard disjointness and coverage, GRPO group integrity,
staleness, the watermark, follow mode against a live writer process.

Resume failures are reported by name: "missing samples", "duplicate
samples", "incorrect order".

Run as a script, this file is the other process of the tests:
    python tests/test_reader.py resume JOB.json     # resume readers from states, print the batches
    python tests/test_reader.py produce URL PAYLOAD N   # append + materialize N trajectories slowly
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

import trajstore
from trajstore.errors import ResumeStateError, ValidationError
from trajstore.log.base import Shard
from trajstore.materializer import Materializer
from trajstore.reader import ReaderConfig, SampleReader, plan_step
from trajstore.demo._simulate import RolloutConfig, trajectory_events

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))

CFG = RolloutConfig(turns=2, prompt_tokens=12, output_tokens=6, observation_tokens=3, layers=2, topk=2,
                    num_experts=8, group_size=4, mismatch_prob=0.3, abort_prob=0.2, fail_prob=0.15, seed=3)
NUM_TRAJECTORIES = 48
GROUP_SIZE = 4


def fill(store, indices, *, materialize_every: int = 7) -> None:
    """Append whole trajectories in the given order; materialize in small batches now and then."""
    m = Materializer(store, max_trajectories=3)
    for n, i in enumerate(indices, 1):
        store.append(trajectory_events(CFG, i, version=i // 8))
        if n % materialize_every == 0:
            m.run()
    m.run()


def shuffled(n: int = NUM_TRAJECTORIES, seed: int = 0) -> list[int]:
    """Arrival order of trajectories as in async GRPO: groups overlap their neighbours, so
    a group can start before and finish after others (the case resume must rebuild)."""
    rng = random.Random(seed)
    return sorted(range(n), key=lambda i: i // GROUP_SIZE + rng.uniform(0, 2.5))


@pytest.fixture(scope="module")
def filled(module_store_url, tmp_path_factory):
    """The shuffled 48 trajectories appended and folded, on each backend: built once per module
    and shared by its tests, which only read it (readers' leases aside). A test that writes
    (``record_step``, appends) takes ``filled_own``."""
    store = trajstore.connect(module_store_url, payload=str(tmp_path_factory.mktemp("filled") / "payload"))
    fill(store, shuffled())
    yield store
    store.close()


@pytest.fixture
def filled_own(store):
    """``filled`` for a test that writes to it: a store of the test's own."""
    fill(store, shuffled())
    return store


def keys(batch) -> list[tuple[str, int]]:
    return [(s.trajectory_id, s.sample_index) for s in batch]


def drive(readers: list[SampleReader], max_steps: int | None = None,
          schedule: dict | None = None) -> list[list[list[tuple[str, int]]]]:
    """Read the ranks in lockstep: one entry per global step, one key list per rank.
    ``schedule`` sets current_model_version = base + steps // every before each step."""
    steps = []
    while max_steps is None or len(steps) < max_steps:
        if schedule:
            for r in readers:
                r.current_model_version = schedule["base"] + r.stats.steps // schedule["every"]
        batches = [next(r, None) for r in readers]
        if all(b is None for b in batches):
            break
        assert all(b is not None for b in batches), "ranks disagree on the number of steps"
        steps.append([keys(b) for b in batches])
    return steps


def make_readers(store_or_url, world_size: int, config: dict, state=None, payload=None,
                 open_reader=SampleReader) -> list[SampleReader]:
    readers = [open_reader(store_or_url, rank=r, world_size=world_size, payload=payload, **config)
               for r in range(world_size)]
    if state is not None:
        for r in readers:
            r.load_state_dict(state)
    return readers


class InProcessReplay:
    """A replay server (``ReplayServer``, real gRPC on loopback) in a thread of this
    process, over its own connection to ``store``: the reader tests run through it."""

    def __init__(self, store) -> None:
        from trajstore.replay._server import ReplayServer

        own = trajstore.connect(store.url, payload=store.payload.location, migrate=False, create=False)
        self.server = ReplayServer(own, "grpc://127.0.0.1:0", tokens=None, close_store=True)
        self.location = f"grpc://127.0.0.1:{self.server.port}"
        self.thread = threading.Thread(target=self.server.serve, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(timeout=30)


@pytest.fixture(params=["local", "replay"])
def open_reader(request):
    """``open_reader(store, **settings)``: a ``SampleReader`` on the store, or a
    ``ReplayReader`` through a replay server in front of it: the reader's seam
    (``trajstore.reader.ReaderStore``) has two implementations, and these tests
    run on both."""
    servers: dict[str, InProcessReplay] = {}
    readers: list[SampleReader] = []

    def open_(store, *args, payload=None, **settings) -> SampleReader:
        if request.param == "local":
            reader = SampleReader(store, *args, payload=payload, **settings)
        else:
            from trajstore.replay import ReplayReader

            if isinstance(store, str):
                store = trajstore.connect(store, payload=payload, migrate=False, create=False)
            if store.url not in servers:
                servers[store.url] = InProcessReplay(store)
            reader = ReplayReader(servers[store.url].location, *args, **settings)
        readers.append(reader)
        return reader

    open_.kind = request.param
    yield open_
    for r in readers:
        r.close()
    for server in servers.values():
        server.stop()


def flat(steps) -> list[tuple[str, int]]:
    return [tuple(k) for step in steps for batch in step for k in batch]


def assert_resumed(before, after, reference: list[tuple[str, int]]) -> None:
    """before + after must read ``reference`` exactly once, each step a contiguous run of it."""
    seen = flat(before) + flat(after)
    missing = sorted(set(reference) - set(seen))
    assert not missing, f"missing samples: {missing[:5]} ({len(missing)} in all)"
    duplicates = sorted(k for k, c in Counter(seen).items() if c > 1)
    assert not duplicates, f"duplicate samples: {duplicates[:5]} ({len(duplicates)} in all)"
    extra = sorted(set(seen) - set(reference))
    assert not extra, f"unexpected samples: {extra[:5]}"
    rank_of = {k: i for i, k in enumerate(reference)}
    by_step = [sorted((tuple(k) for batch in step for k in batch), key=rank_of.__getitem__) for step in before + after]
    assert [k for step in by_step for k in step] == reference, "incorrect order"


# --- resume ------------------------------------------------------------------------------------

RESUME_CONFIGS = {
    "samples": {"batch_size": 3},
    "groups": {"batch_size": 6, "keep_groups": True, "group_size": GROUP_SIZE},
    # group ids naming two groups each (8 trajectories share an id, 4 make a group)
    "groups-reused-ids": {"batch_size": 4, "keep_groups": True, "group_size": GROUP_SIZE // 2},
    "groups-tokens-stale": {"max_tokens_per_batch": 160, "keep_groups": True, "group_size": GROUP_SIZE,
                            "max_staleness": 1, "current_model_version": 3, "status": ["completed"]},
}
# (world size before, batches before the stop, world size after)
RESUMES = [(2, 2, 2), (2, 3, 3), (3, 2, 1), (1, 5, 4)]
# The trainer's version moving on as it trains: which units are stale then
# depends on the step, so only a same-world-size run can be compared.
SCHEDULE = {"base": 2, "every": 3}


@pytest.mark.parametrize("config_name", list(RESUME_CONFIGS))
def test_resume_in_a_new_process_same_and_other_world_size(filled, config_name, tmp_path):
    config = RESUME_CONFIGS[config_name]
    store = filled
    reference = flat(drive(make_readers(store, 1, config)))
    assert len(reference) > 20
    jobs, befores = [], []
    for w_before, k, w_after in RESUMES + [(2, 3, 2)]:
        schedule = SCHEDULE if len(jobs) == len(RESUMES) else None
        readers = make_readers(store, w_before, config)
        befores.append(drive(readers, k, schedule))
        states = [json.loads(json.dumps(r.state_dict())) for r in readers]
        assert all(s == states[0] for s in states), "ranks disagree on the state"
        jobs.append({"world_size": w_after, "state": states[0], "schedule": schedule})
    results = resume_in_new_process(store, config, jobs, tmp_path)
    for (w_before, k, w_after), before, result, job in zip(RESUMES + [(2, 3, 2)], befores, results, jobs):
        after = result["steps"]
        readers = make_readers(store, w_after, config)
        uninterrupted = drive(readers, schedule=job["schedule"])
        # Groups rebuilt on resume must be exactly those still open: no phantom
        # group may hold the rescan point back for the rest of training.
        for name in ("cursor", "scan_from", "snapshot_position"):
            assert result["state"][name] == readers[0].state_dict()[name], f"final {name} differs from an uninterrupted run"
        if w_after == w_before:
            assert len(before + after) == len(uninterrupted), "resumed run has another number of steps"
            for i, (a, b) in enumerate(zip(before + after, uninterrupted)):
                assert a == b, f"step {i} differs from an uninterrupted run"
        if job["schedule"] is None:
            assert_resumed(before, after, reference)


def resume_in_new_process(store, config: dict, jobs: list[dict], directory) -> list[Any]:
    job = {"url": store.url, "payload": store.payload.location, "config": config, "jobs": jobs}
    path = os.path.join(directory, "resume-job.json")
    with open(path, "w") as f:
        json.dump(job, f)
    out = subprocess.run([sys.executable, HERE, "resume", path], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout)
    for r in results:
        r["steps"] = [[[tuple(k) for k in batch] for batch in step] for step in r["steps"]]
    return results


def _resume_main(path: str) -> None:
    with open(path) as f:
        job = json.load(f)
    results = []
    for j in job["jobs"]:
        readers = make_readers(job["url"], j["world_size"], job["config"], j["state"], job["payload"])
        steps = drive(readers, schedule=j["schedule"])
        results.append({"steps": steps, "state": readers[0].state_dict()})
    print(json.dumps(results))


def test_state_is_small_json_and_carries_the_version(filled, open_reader):
    reader = open_reader(filled, batch_size=4, keep_groups=True, group_size=GROUP_SIZE, current_model_version=3)
    next(reader)
    state = reader.state_dict()
    assert len(json.dumps(state)) < 600
    fresh = open_reader(filled, batch_size=4, keep_groups=True, group_size=GROUP_SIZE)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.current_model_version == 3 and fresh.state_dict() == state


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(format="other"), "not a trajstore reader state"),
    (lambda s: s.update(version=2), "version 2 is not the supported 1"),
    (lambda s: s.pop("cursor"), "lacks 'cursor'"),
    (lambda s: s["fingerprint"].update(keep_groups=False), "saved with keep_groups=False, this reader has keep_groups=True"),
    (lambda s: s["fingerprint"].update(group_size=8), "saved with group_size=8"),
    (lambda s: s.update(cursor=[1, "x"]), "cursor must be null or"),
    (lambda s: s.update(current_version="5"), "current_version must be an integer"),
    (lambda s: s["stats"].pop("steps"), "stats must hold integers"),
])
def test_bad_states_are_refused_with_the_reason(filled, change, message, open_reader):
    config = {"batch_size": 4, "keep_groups": True, "group_size": GROUP_SIZE}
    reader = open_reader(filled, **config)
    next(reader)
    state = json.loads(json.dumps(reader.state_dict()))
    change(state)
    with pytest.raises(ResumeStateError, match=message):
        open_reader(filled, **config).load_state_dict(state)
    with pytest.raises(ResumeStateError, match="must be a dict"):
        open_reader(filled, **config).load_state_dict([state])


def test_status_filter_is_part_of_the_state(filled, open_reader):
    reader = open_reader(filled, batch_size=4, status="completed")
    next(reader)
    with pytest.raises(ResumeStateError, match="status"):
        open_reader(filled, batch_size=4).load_state_dict(reader.state_dict())


# --- sharding, groups, staleness ------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("config", [{"batch_size": 4}, {"max_tokens_per_batch": 200}], ids=["samples", "tokens"])
def test_shards_are_disjoint_and_cover_every_sample(filled, world_size, config, open_reader):
    everything = [(s.trajectory_id, s.sample_index) for s in filled.samples()]
    steps = drive(make_readers(filled, world_size, config, open_reader=open_reader))
    per_rank = [set(k for step in steps for k in step[r]) for r in range(world_size)]
    for a in range(world_size):
        for b in range(a + 1, world_size):
            assert not per_rank[a] & per_rank[b], f"ranks {a} and {b} share samples"
    assert_resumed(steps, [], everything)
    if "max_tokens_per_batch" in config:
        tokens = {(s.trajectory_id, s.sample_index): s.num_tokens for s in filled.samples()}
        for step in steps:
            for batch in step:
                assert len(batch) == 1 or sum(tokens[k] for k in batch) <= 200


def test_drop_last_leaves_the_tail_for_a_later_reader(filled, open_reader):
    everything = [(s.trajectory_id, s.sample_index) for s in filled.samples()]
    readers = make_readers(filled, 3, {"batch_size": 4, "drop_last": True}, open_reader=open_reader)
    steps = drive(readers)
    assert all(len(batch) == 4 for step in steps for batch in step)
    assert len(flat(steps)) == len(everything) - len(everything) % 12
    rest = drive(make_readers(filled, 1, {"batch_size": 4}, readers[0].state_dict(), open_reader=open_reader))
    assert_resumed(steps, rest, everything)


def test_groups_stay_whole_in_one_batch_and_incomplete_groups_wait(store, open_reader):
    order = [i for i in shuffled() if i != 5]  # group 1 lacks one trajectory
    fill(store, order)
    samples = list(store.samples())
    group_of = {(s.trajectory_id, s.sample_index): s.group_id for s in samples}
    status_of = {(s.trajectory_id, s.sample_index): s.status for s in samples}
    config = {"batch_size": 8, "keep_groups": True, "group_size": GROUP_SIZE, "status": ("completed",)}
    readers = make_readers(store, 2, config, open_reader=open_reader)
    steps = drive(readers)
    place = {}
    for i, step in enumerate(steps):
        for r, batch in enumerate(step):
            for k in batch:
                assert place.setdefault(group_of[k], (i, r)) == (i, r), f"group {group_of[k]} split"
    expected = {k for k in group_of if group_of[k] != "group-3-00001" and status_of[k] == "completed"}
    assert set(flat(steps)) == expected
    assert readers[0].stats.open_groups == 1
    assert readers[0].stats.filtered_samples == sum(
        1 for k in group_of if status_of[k] != "completed" and group_of[k] != "group-3-00001")


def test_stale_units_are_skipped_and_counted(filled, open_reader):
    samples = list(filled.samples())
    reader = open_reader(filled, batch_size=5, max_staleness=1, current_model_version=4)
    got = flat([[keys(b)] for b in reader])
    fresh = [(s.trajectory_id, s.sample_index) for s in samples if s.min_model_version >= 3]
    assert got == fresh
    assert reader.stats.stale_samples == reader.stats.stale_units == len(samples) - len(fresh) > 0


def test_stale_groups_are_skipped_whole(filled, open_reader):
    samples = list(filled.samples())
    oldest: dict[str, int] = {}
    for s in samples:
        oldest[s.group_id] = min(oldest.get(s.group_id, 99), s.min_model_version)
    reader = open_reader(filled, batch_size=8, keep_groups=True, group_size=GROUP_SIZE,
                          max_staleness=1, current_model_version=4)
    got = set(flat([[keys(b)] for b in reader]))
    assert got == {(s.trajectory_id, s.sample_index) for s in samples if oldest[s.group_id] >= 3}
    assert reader.stats.stale_units == sum(1 for v in oldest.values() if v < 3)


def test_current_model_version_applies_from_the_next_step(filled, open_reader):
    reader = open_reader(filled, batch_size=2, max_staleness=0)
    first = next(reader)
    reader.current_model_version = 5
    rest = [s for batch in reader for s in batch]
    assert all(s.min_model_version >= 5 for s in rest) and first


def test_plan_step_is_a_balanced_prefix():
    assert plan_step([1] * 10, 3, 2) == (6, [[0, 3], [1, 4], [2, 5]])
    assert plan_step([9, 1, 1], 2, 4) == (1, [[0], []])  # oversized unit alone
    n, bins = plan_step([5, 1, 4, 2, 3, 3, 7], 2, 8)
    assert sorted(i for b in bins for i in b) == list(range(n))
    loads = [sum([5, 1, 4, 2, 3, 3, 7][i] for i in b) for b in bins]
    assert n == 5 and max(loads) <= 8 and max(loads) - min(loads) <= 1
    assert plan_step([], 2, 4) == (0, [[], []])


@given(st.lists(st.integers(1, 20), max_size=40), st.integers(1, 5), st.integers(1, 30))
def test_plan_step_properties(costs, world_size, capacity):
    n, bins = plan_step(costs, world_size, capacity)
    assert len(bins) == world_size
    assert sorted(i for b in bins for i in b) == list(range(n)), "a step is a prefix, every unit placed once"
    assert all(b == sorted(b) for b in bins)
    if costs:
        assert n >= 1
        assert n == 1 or sum(costs[:n]) <= world_size * capacity
        assert all(len(b) == 1 or sum(costs[i] for i in b) <= capacity for b in bins)


def test_config_errors_are_one_line(filled):
    with pytest.raises(ValidationError, match="needs group_size"):
        ReaderConfig(keep_groups=True)
    with pytest.raises(ValidationError, match="not both"):
        ReaderConfig(batch_size=2, max_tokens_per_batch=10)
    with pytest.raises(ValidationError, match="rank 2 not in"):
        SampleReader(filled, rank=2, world_size=2)


# --- watermark and follow ---------------------------------------------------------------------------

def test_only_samples_below_every_shard_checkpoint_are_read(store, open_reader):
    for i in range(12):
        store.append(trajectory_events(CFG, i))
    Materializer(store, shard_index=0, num_shards=2).run()
    Materializer(store, shard_index=1, num_shards=2, max_trajectories=4).run(max_steps=1)
    watermark = store.materialized.load_checkpoint(Shard(1, 2))["position"]
    rows = [r for page in store.materialized.iter_sample_rows(where={}, after=None, page_rows=1000) for r in page]
    got = [s for batch in open_reader(store, batch_size=4, num_shards=2) for s in batch]
    assert keys(got) == [(r["trajectory_id"], r["sample_index"]) for r in rows if r["finished_position"] <= watermark]
    assert 0 < len(got) < len(rows)
    # the shard count comes from the stored checkpoints; a num_shards given by hand must agree
    assert keys(s for batch in open_reader(store, batch_size=4) for s in batch) == keys(got)
    with pytest.raises(ValidationError, match="num_shards"):
        next(open_reader(store, batch_size=4, num_shards=1))


@contextlib.contextmanager
def _ends_once_drained(reader: SampleReader, producer: subprocess.Popen, idle_s: float = 0.5):
    """Test-side only: while the producer runs, the follow reader keeps its long idle
    timeout (the producer's gaps on a shared CPU); once the producer has exited (all
    it wrote is committed) and the reader has finished a poll begun after that which
    found nothing, nothing more can arrive: the timeout becomes ``idle_s`` so the
    reader ends now rather than idling out the long one. A reader that missed a
    sample still ends with it missing (or, stuck, after the long timeout)."""
    done = threading.Event()

    def shorten() -> None:
        while producer.poll() is None:
            if done.wait(0.05):
                return
        polls = reader.stats.polls
        # the first poll counted after this may have begun before the exit; the second began after it
        while reader.stats.polls < polls + 2:
            if done.wait(0.01):
                return
        reader.config = dataclasses.replace(reader.config, timeout_s=idle_s)

    watcher = threading.Thread(target=shorten, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def follow_while_another_process_writes(store, open_follow_reader: Callable[[], Any],
                                        **popen: Any) -> tuple[Any, list[list[tuple[str, int]]]]:
    """Another process writes 32 trajectories into ``store`` (``produce``) while a follow
    reader, ``open_follow_reader()``, reads until it is drained (``_ends_once_drained``).
    Asserts the producer succeeded; returns the reader and the keys of each step it read.
    ``popen``: more ``subprocess.Popen`` arguments for the producer (its ``env``)."""
    producer = subprocess.Popen([sys.executable, HERE, "produce", store.url, store.payload.location, "32"],
                                cwd=ROOT, stderr=subprocess.PIPE, text=True, **popen)
    try:
        # Start following once the producer is up (its start-up alone can exceed the
        # follow timeout on a loaded machine); it still writes for seconds after, and
        # its slowest gap under a shared CPU must stay below the idle timeout.
        while producer.poll() is None and not any(True for _ in store.samples(page_rows=1)):
            time.sleep(0.05)
        reader = open_follow_reader()
        with _ends_once_drained(reader, producer):
            steps = [keys(batch) for batch in reader]
    finally:
        _, err = producer.communicate(timeout=120)
    assert producer.returncode == 0, err[-2000:]
    return reader, steps


@pytest.mark.parametrize("config", [{"batch_size": 3}, {"batch_size": 8, "keep_groups": True, "group_size": GROUP_SIZE}],
                         ids=["samples", "groups"])
def test_follow_sees_every_sample_once_while_another_process_writes(store, config, open_reader):
    reader, steps = follow_while_another_process_writes(
        store, lambda: open_reader(store, follow=True, timeout_s=20.0, poll_interval_s=0.05, **config))
    steps = [[step] for step in steps]
    assert reader.stats.polls > 0, "the reader never had to wait: the test did not exercise following"
    reference = flat(drive(make_readers(store, 1, config)))
    assert len(reference) >= 32
    assert_resumed(steps, [], reference)


# The producer's pause after each fold: twice the follow readers' poll interval (0.05 s), so a
# reader that has caught up polls and finds nothing at least once per pause (the tests assert
# that it waited); ten pauses of a 32-trajectory run.
PRODUCER_PAUSE_S = 0.1


def _produce_main(url: str, payload: str, n: int) -> None:
    store = trajstore.connect(url, payload=payload)
    m = Materializer(store, max_trajectories=2)
    for k, i in enumerate(shuffled(n, seed=1)):
        store.append(trajectory_events(CFG, i, version=i // 8))
        if k % 3 == 2:
            m.run()
            time.sleep(PRODUCER_PAUSE_S)
    m.run()
    store.close()


def test_core_reader_does_not_import_torch():
    code = "import sys, trajstore, trajstore.reader; assert 'torch' not in sys.modules, 'torch imported'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


if __name__ == "__main__":
    if sys.argv[1] == "resume":
        _resume_main(sys.argv[2])
    elif sys.argv[1] == "produce":
        _produce_main(sys.argv[2], sys.argv[3], int(sys.argv[4]))


# --- saying why nothing comes out ------------------------------------------

def _empty_read(caplog, reader: SampleReader) -> list[str]:
    import logging

    caplog.set_level(logging.WARNING, logger="trajstore.reader")
    caplog.clear()
    with reader:
        assert list(reader) == []
        assert next(reader, None) is None  # asked again: still said once
    return [r.getMessage() for r in caplog.records if r.name == "trajstore.reader"]


def test_group_size_larger_than_the_groups_is_explained_once(filled, caplog, open_reader):
    said = _empty_read(caplog, open_reader(filled, keep_groups=True, group_size=2 * GROUP_SIZE))
    assert len(said) == 1, said
    groups = NUM_TRAJECTORIES // GROUP_SIZE
    assert "yields no batch" in said[0] and f"{groups} groups are still open" in said[0]
    assert f"group_size={2 * GROUP_SIZE}" in said[0] and f"the fullest has {GROUP_SIZE}" in said[0]


def test_unmaterialized_trajectories_are_explained(store, caplog, open_reader):
    for i in range(6):
        store.append(trajectory_events(CFG, i))
    said = _empty_read(caplog, open_reader(store, batch_size=4))
    assert len(said) == 1 and "6 finished trajectories are not materialized yet" in said[0], said


def test_everything_stale_is_explained(filled, caplog, open_reader):
    said = _empty_read(caplog, open_reader(filled, batch_size=4, max_staleness=0, current_model_version=100))
    assert len(said) == 1 and "staler than max_staleness=0 at current_model_version=100" in said[0], said


def test_an_empty_store_is_explained(store, caplog, open_reader):
    said = _empty_read(caplog, open_reader(store, batch_size=4))
    assert said == ["trajstore reader (rank 0 of 1) yields no batch: "
                    "the store has no materialized samples and no finished trajectory"]


def test_a_reader_with_batches_says_nothing(filled, caplog, open_reader):
    import logging

    caplog.set_level(logging.WARNING, logger="trajstore.reader")
    with open_reader(filled, batch_size=4) as reader:
        assert len(list(reader)) > 0
    assert [r for r in caplog.records if r.name == "trajstore.reader"] == []


# --- finish reasons ------------------------------------------------------------

def _with_finish_reason(sample, reason):
    from dataclasses import replace

    return replace(sample, finish_reason=reason)


def test_finish_reason_drop_and_mask_on_loaded_samples(filled):
    import numpy as np

    samples = list(filled.samples())[:6]
    reasons = ["stop", "length", None, "abort", "length", "stop"]
    batch = [_with_finish_reason(s, r) for s, r in zip(samples, reasons)]
    reader = SampleReader(filled, drop_finish_reasons="length", mask_finish_reasons=["abort"])
    out = reader._by_finish_reason(batch)
    assert [s.finish_reason for s in out] == ["stop", None, "abort", "stop"]
    assert not out[2].loss_mask.any() and np.array_equal(out[0].loss_mask, samples[0].loss_mask)
    assert samples[3].loss_mask.any()  # the stored sample itself is untouched
    assert (reader.stats.dropped_samples, reader.stats.masked_samples) == (2, 1)
    reader.close()


def test_finish_reason_options_are_checked():
    with pytest.raises(ValidationError, match=r"finish reasons \['length'\] are both dropped and masked"):
        ReaderConfig(drop_finish_reasons=("length",), mask_finish_reasons="length")
    assert ReaderConfig(drop_finish_reasons="length").drop_finish_reasons == ("length",)


def test_reader_drops_samples_by_recorded_finish_reason(store, open_reader):
    """End to end: generations recorded with finish_reason "length" never reach the trainer."""
    overlong = set()
    for i in range(12):
        events = trajectory_events(CFG, i)
        if i % 3 == 0:
            for ev in events:
                if ev["type"] == "generation":
                    ev["finish_reason"] = "length"
            overlong.add(events[0]["trajectory_id"])
        store.append(events)
    store.materialize()
    assert {s.finish_reason for s in store.samples() if s.trajectory_id in overlong} == {"length"}
    with open_reader(store, batch_size=4, drop_finish_reasons=("length",)) as reader:
        read = [s for batch in reader for s in batch]
        dropped = reader.stats.dropped_samples
    assert read and not {s.trajectory_id for s in read} & overlong
    everything = list(store.samples())
    assert len(read) + dropped == len(everything)


# ----------------------------------------------------------------------------
# Old names (one name per meaning): SampleReader(current_version=) and its attribute
# still work with a DeprecationWarning; states saved with "version" / "current_version" still load.

def test_reader_current_version_is_current_model_version(five_folded):
    from trajstore.reader import SampleReader

    with pytest.warns(DeprecationWarning, match="current_version= is deprecated; use current_model_version="):
        reader = SampleReader(five_folded, batch_size=2, current_version=3)
    assert reader.current_model_version == 3
    with pytest.warns(DeprecationWarning, match="use current_model_version"):
        reader.current_version = 4
    assert reader.current_model_version == 4
    with pytest.warns(DeprecationWarning, match="use current_model_version"):
        assert reader.current_version == 4
    state = reader.state_dict()
    assert state["format_version"] == 1 and state["current_model_version"] == 4
    assert "version" not in state and "current_version" not in state


def test_a_state_saved_before_the_renames_still_loads(five_folded):
    from trajstore.reader import SampleReader

    state = _state_after_one_batch(five_folded)
    new = SampleReader(five_folded, batch_size=2)
    new.load_state_dict(state)
    rest = [s.trajectory_id for batch in new for s in batch]
    # what the reader of the previous release saved: "version" and "current_version"
    old = json.loads(json.dumps(state))
    old["version"] = old.pop("format_version")
    old["current_version"] = old.pop("current_model_version")
    resumed = SampleReader(five_folded, batch_size=2)
    resumed.load_state_dict(old)
    assert resumed.current_model_version == 7 and resumed.state_dict() == state
    assert [s.trajectory_id for batch in resumed for s in batch] == rest and rest


def _state_after_one_batch(store):
    from trajstore.reader import SampleReader

    reader = SampleReader(store, batch_size=2, current_model_version=7)
    next(reader)
    return reader.state_dict()


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(format_version=2), "format version 2 is not the supported 1"),
    (lambda s: s.pop("format_version"), "lacks 'format_version'"),
    (lambda s: s.update(current_model_version="5"), "current_model_version must be an integer"),
    (lambda s: s.pop("current_model_version"), "lacks 'current_model_version'"),
])
def test_bad_renamed_state_keys_are_refused(five_folded, change, message):
    from trajstore.errors import ResumeStateError
    from trajstore.reader import SampleReader

    state = _state_after_one_batch(five_folded)
    change(state)
    with pytest.raises(ResumeStateError, match=message):
        SampleReader(five_folded, batch_size=2).load_state_dict(state)


# ----------------------------------------------------------------------------
# Settings are keywords (the README's form); a ReaderConfig as the second
# argument still works, with a DeprecationWarning, and means the same reader.


def test_a_reader_config_argument_is_deprecated_and_means_the_same_keywords(filled):
    config = ReaderConfig(batch_size=3, keep_groups=True, group_size=GROUP_SIZE, status=["completed", "truncated"])
    with pytest.warns(DeprecationWarning, match=r"SampleReader\(\.\.\., config\) is deprecated; pass the settings "
                                                r"as keywords") as caught:
        old = SampleReader(filled, config, page_rows=7)
    assert caught[0].filename == HERE  # the warning names the caller's line
    new = SampleReader(filled, **{**dataclasses.asdict(config), "page_rows": 7})
    assert old.config == new.config == dataclasses.replace(config, page_rows=7)
    assert [keys(b) for b in old] == [keys(b) for b in new]
    # the saved state is the same, and each reader's state resumes the other
    assert old.state_dict() == new.state_dict()
    first = SampleReader(filled, batch_size=3, keep_groups=True, group_size=GROUP_SIZE,
                         status=("completed", "truncated"))
    next(first)
    with pytest.warns(DeprecationWarning):
        resumed = SampleReader(filled, config)
    resumed.load_state_dict(first.state_dict())
    assert [keys(b) for b in resumed] == [keys(b) for b in first]


# ----------------------------------------------------------------------------
# Hand-over: a step is handed over as soon as it is full, not when one more
# unit arrives (or the follow timeout passes).

ONE_SAMPLE_CFG = RolloutConfig(turns=1, prompt_tokens=8, output_tokens=4, observation_tokens=2, layers=2, topk=2,
                               num_experts=8, group_size=2, mismatch_prob=0.0, abort_prob=0.0, fail_prob=0.0, seed=1)
# Generous: a hand-over is milliseconds; the bug it catches waited the whole follow timeout.
NO_TIMEOUT_WAIT_S = 10.0
FOLLOW_TIMEOUT_S = 40.0


def append_samples(store, start: int, n: int) -> None:
    """Trajectories ``start .. start+n-1`` of one sample each, appended and materialized."""
    for i in range(start, start + n):
        store.append(trajectory_events(ONE_SAMPLE_CFG, i))
    Materializer(store).run()


def two_full_steps(store, reader) -> tuple[list, list, float, float]:
    """Two steps of 4 from a follow ``reader`` over ``store`` that holds exactly one
    (``append_samples(store, 0, 4)``): the first, asserted handed over without waiting
    for more, then the next, whose last samples another thread appends while the
    reader waits. Returns both steps, the first one's wait and the time from asking
    for the first to the second's hand-over."""
    t0 = time.monotonic()
    first = next(reader)
    waited = time.monotonic() - t0
    assert len(first) == 4 and waited < NO_TIMEOUT_WAIT_S, f"a full step waited {waited:.1f} s for more"
    # the next step: its last group completes while the reader waits
    writer = threading.Thread(target=append_samples, args=(store, 4, 4))
    writer.start()
    second = next(reader)
    handed_over = time.monotonic()
    writer.join()
    return first, second, waited, handed_over - t0


@pytest.mark.parametrize("config", [{"batch_size": 4}, {"batch_size": 4, "keep_groups": True, "group_size": 2},
                                    {"batch_size": 4, "prefetch": False}], ids=["samples", "groups", "no-prefetch"])
def test_a_full_step_is_handed_over_without_waiting_for_more(store, config, open_reader):
    append_samples(store, 0, 4)  # exactly one step
    with open_reader(store, follow=True, timeout_s=FOLLOW_TIMEOUT_S, poll_interval_s=0.05, **config) as reader:
        first, second, waited, took = two_full_steps(store, reader)
        assert took < NO_TIMEOUT_WAIT_S + waited, "the second full step waited for the follow timeout"
    assert sorted(keys(first + second)) == sorted((s.trajectory_id, s.sample_index) for s in store.samples())


# ----------------------------------------------------------------------------
# Every setting works through the replay service too: a projection's samples.

def test_a_projection_is_read_with_its_own_samples_and_state(store, open_reader):
    for i in range(12):
        store.append(trajectory_events(CFG, i))
    store.materialize()
    store.create_projection("steps", merge="none")
    store.materialize(projection="steps")
    want = [(s.trajectory_id, s.sample_index) for s in store.samples(projection="steps")]
    assert len(want) > len(list(store.samples()))  # step-wise: another sequence than the default's
    reader = open_reader(store, batch_size=4, projection="steps")
    first = next(reader)
    state = reader.state_dict()
    assert state["fingerprint"]["projection"] == "steps"
    rest = open_reader(store, batch_size=4, projection="steps")
    rest.load_state_dict(state)
    assert keys(first) + [k for b in rest for k in keys(b)] == want
    with pytest.raises(ResumeStateError, match="projection"):
        open_reader(store, batch_size=4).load_state_dict(state)
    with pytest.raises(ValidationError, match="no projection 'nope'"):
        open_reader(store, batch_size=4, projection="nope")


@pytest.mark.parametrize("recreate", [False, True], ids=["dropped", "created-again"])
def test_a_projection_changed_mid_epoch_is_an_error_in_both_readers(store, open_reader, recreate):
    """Either reader, mid-epoch on a projection dropped (and created again under the same
    name: another fold, another sequence), raises ``ProjectionChangedError`` at its next
    page: it never reads on into the other projection's samples (a mix of two folds)."""
    from trajstore.errors import ProjectionChangedError

    for i in range(12):
        store.append(trajectory_events(CFG, i))
    store.materialize()
    store.create_projection("steps", merge="none")
    store.materialize(projection="steps")
    reader = open_reader(store, batch_size=2, page_rows=2, prefetch=False, projection="steps")
    first = next(reader)
    assert len(first) == 2 and reader.state_dict()["projection_token"]
    store.drop_projection("steps")
    if recreate:
        store.create_projection("steps", merge="prefix")
        store.materialize(projection="steps")
    seen = []
    with pytest.raises(ProjectionChangedError, match="projection 'steps' was dropped"
                                                     + (" and created again" if recreate else "")):
        for batch in reader:
            seen.extend(keys(batch))
    assert len(seen) < 2  # at most what the one page read before the change held
    if recreate:  # a new reader of either kind reads the new projection from its start
        fresh = open_reader(store, batch_size=2, projection="steps")
        assert fresh.state_dict()["projection_token"] != reader.state_dict()["projection_token"]
        assert len(next(iter(fresh))) == 2


def test_the_store_and_the_replay_store_implement_the_declared_reader_seam(store):
    """The five reads (docs/reference.md) as ``trajstore.reader``'s Protocols: each
    implementation has them, with the declared parameters (names, kinds, defaults)."""
    import inspect

    from trajstore.reader import ReaderEventLog, ReaderPayload, ReaderSampleIndex, ReaderStore
    from trajstore.replay import ReplayStore

    store.create_projection("steps", merge="none")
    remote = ReplayStore("grpc://127.0.0.1:1")  # connects at the first call: none is made here
    seams = {ReaderSampleIndex: ("iter_sample_rows", "watermark", "projection"), ReaderEventLog: ("count_events",),
             ReaderPayload: ("read_rows",)}
    try:
        for impl in (store, remote):
            assert isinstance(impl, ReaderStore)
            parts = {ReaderSampleIndex: [impl.materialized], ReaderEventLog: [impl.log], ReaderPayload: [impl.payload]}
            if impl is store:
                parts[ReaderSampleIndex].append(store.materialized.projection("steps"))
            for protocol, objects in parts.items():
                for obj in objects:
                    assert isinstance(obj, protocol), (type(obj), protocol)
                    for name in seams[protocol]:
                        declared = inspect.signature(getattr(protocol, name)).parameters.values()
                        actual = inspect.signature(getattr(type(obj), name)).parameters.values()
                        assert [(p.name, p.kind, p.default) for p in actual] == \
                               [(p.name, p.kind, p.default) for p in declared], f"{type(obj).__name__}.{name}"
    finally:
        remote.close()
