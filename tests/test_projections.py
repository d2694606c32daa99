"""Named projections on SQLite and PostgreSQL: the log re-folded under another
fold policy, beside the default samples (docs/projections.md).

The step-wise cases follow SkyRL 0.4.0's step-wise generator without merging
(``skyrl/train/generators/skyrl_gym_generator.py``, the ``is_step_wise``
branch of the agent loop): each turn is a sample whose prompt is the whole
input so far and whose response is the turn's ``output_ids + obs_ids``, loss
mask 1 on the output and 0 on the observation, rollout logprobs 0.0 on the
observation (``TurnOutput.get_turn_loss_mask`` / ``get_turn_rollout_logprobs``).
The expected samples here are built by hand from the commands, never by the fold.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from sqlalchemy import select

import trajstore
from trajstore import SampleReader
from trajstore.events import parse_event
from trajstore.fold import FoldPolicy, fold
from trajstore.log.base import Shard
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.schema import events as events_table, materializer_checkpoints, samples as samples_table, segments
from tests.helpers import finished, gen, started
from tests.test_materializer import _random_trajectory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
L, K = 2, 2


# The tests whose first step connects store_url (a store's first connect migrates it): theirs is a
# copy of the migrated template (tests/conftest.py).
STORE_URL_CONNECTED_BY = (
    "test_cli_projection_commands",
    "test_kill_9_during_a_projection_materialization_then_resume_equals_a_clean_run",
    "test_a_projection_and_the_default_materialized_at_once_equal_clean_runs",
)


def _turns(rng: np.random.Generator, prompt_len: int, turns: list[tuple[int, int]], *, drift: bool = True):
    """A SkyRL-style multi-turn episode as engine calls: turn i's prompt is the whole
    input so far (prompt + previous outputs and observations); every call returns
    routes for its whole sequence (vLLM), which differ on re-sent rows when ``drift``.
    ``turns``: (output tokens, observation tokens after it) per turn; the last
    observation is never sent to the engine."""
    seq = list(rng.integers(0, 1000, prompt_len))
    calls = []
    for i, (n_out, n_obs) in enumerate(turns):
        out = list(rng.integers(0, 1000, n_out))
        n = len(seq) + n_out
        rows = rng.integers(0, 64, (n - 1, L, K)).astype(np.uint8)
        if not drift and calls:
            prev = calls[-1]["routes"]
            rows[: len(prev)] = prev  # the engine recomputed the same routes
        calls.append({"prompt": list(seq), "output": out, "obs": list(rng.integers(0, 1000, n_obs)),
                      "logprobs": list(-rng.random(n_out).astype(np.float32)), "routes": rows})
        seq = seq + out + calls[-1]["obs"]
    return calls


def _append(store, tid: str, calls) -> None:
    evs = [started(tid, num_experts=64)]
    for i, c in enumerate(calls):
        evs.append(gen(tid, i, c["prompt"], c["output"], logprobs=c["logprobs"], routed_experts=c["routes"],
                       reward=float(i), finish_reason="stop"))
    store.append(evs + [finished(tid)])


def _first_routes(calls, upto: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """R3 by hand: each position takes the row of the first call (of ``calls[:upto]``)
    that sent one; positions no call sent are masked and hold 0..topk-1."""
    routes = np.tile(np.arange(K, dtype=np.uint8), (length, L, 1))
    mask = np.ones(length, bool)
    for c in calls[:upto]:
        for p, row in enumerate(c["routes"]):
            if p < length and mask[p]:
                routes[p], mask[p] = row, False
    return routes, mask


def _last_routes(calls, upto: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """routes='last' by hand: each position takes the row of the last call that sent one."""
    routes = np.tile(np.arange(K, dtype=np.uint8), (length, L, 1))
    mask = np.ones(length, bool)
    for c in calls[:upto]:
        for p, row in enumerate(c["routes"]):
            if p < length:
                routes[p], mask[p] = row, False
    return routes, mask


def _skyrl_step(calls, i: int, observation: str):
    """Turn i as SkyRL's step-wise generator lays it out (observation='response'),
    or the call alone (observation='prompt')."""
    c = calls[i]
    obs = calls[i]["obs"] if observation == "response" and i + 1 < len(calls) else []
    response = c["output"] + obs
    return {"prompt_ids": c["prompt"], "response_ids": response,
            "loss_mask": [1] * len(c["output"]) + [0] * len(obs),
            "rollout_logprobs": np.array(c["logprobs"] + [0.0] * len(obs), np.float32),
            "token_model_versions": [0] * len(c["output"]) + [-1] * len(obs),
            "reward": float(i), "is_last_step": i == len(calls) - 1}


def _check(sample, want, routes_mask):
    assert sample.prompt_ids.tolist() == [int(x) for x in want["prompt_ids"]]
    assert sample.response_ids.tolist() == [int(x) for x in want["response_ids"]]
    assert sample.loss_mask.tolist() == want["loss_mask"]
    np.testing.assert_array_equal(sample.rollout_logprobs, want["rollout_logprobs"])
    assert sample.token_model_versions.tolist() == want["token_model_versions"]
    assert sample.reward == want["reward"] and sample.is_last_step == want["is_last_step"]
    routes, mask = routes_mask
    np.testing.assert_array_equal(sample.routed_experts_mask, mask)
    np.testing.assert_array_equal(sample.routed_experts, routes)


SKYRL_CASES = {
    # three turns, observations between them (the usual multi-turn tool episode)
    "three_turns": (8, [(4, 3), (5, 2), (3, 0)]),
    # an empty observation: the next prompt is exactly the previous sequence
    "empty_observation": (5, [(3, 0), (4, 2), (2, 0)]),
    # a single turn: one step, nothing to merge
    "single_turn": (6, [(4, 0)]),
}


@pytest.mark.parametrize("case", sorted(SKYRL_CASES))
@pytest.mark.parametrize("observation", ["response", "prompt"])
def test_step_wise_projection_equals_skyrl_step_wise_by_hand(store, case, observation):
    prompt_len, turns = SKYRL_CASES[case]
    calls = _turns(np.random.default_rng(len(case)), prompt_len, turns)
    _append(store, "t", calls)
    store.create_projection("steps", merge="none", observation=observation)
    stats = store.materialize(projection="steps")
    got = list(store.samples(projection="steps"))
    assert stats.num_samples_after == len(got) == len(calls)
    assert stats.prefix_mismatch_count == 0 and stats.num_steps_before == len(calls)
    for i, s in enumerate(got):
        want = _skyrl_step(calls, i, observation)
        length = len(want["prompt_ids"]) + len(want["response_ids"])
        # R3: every sample replays the first recording of each position
        _check(s, want, _first_routes(calls, i + (2 if observation == "response" else 1), length))
    # the default fold merged the same calls into one sample
    store.materialize()
    assert [s.sample_index for s in store.samples()] == [0]


def test_routes_last_without_drift_equals_the_last_calls_rows_by_hand(store):
    calls = _turns(np.random.default_rng(7), 6, [(3, 2), (4, 1), (2, 0)], drift=False)
    _append(store, "t", calls)
    store.create_projection("last", routes="last")
    store.create_projection("steps-last", merge="none", routes="last")
    assert store.materialize(projection="last").num_unfoldable == 0
    assert store.materialize(projection="steps-last").num_unfoldable == 0
    (merged,) = store.samples(projection="last")
    n = len(calls[-1]["prompt"]) + len(calls[-1]["output"])
    routes, mask = _last_routes(calls, len(calls), n)
    np.testing.assert_array_equal(merged.routed_experts, routes)
    np.testing.assert_array_equal(merged.routed_experts_mask, mask)
    for i, s in enumerate(store.samples(projection="steps-last")):
        _check(s, _skyrl_step(calls, i, "prompt"), _last_routes(calls, i + 1, len(s.prompt_ids) + len(s.response_ids)))


def test_routes_last_with_drift_is_refused_not_invented(store):
    """The re-sent rows that drifted were never stored: no sample is made from them."""
    calls = _turns(np.random.default_rng(8), 6, [(3, 2), (4, 1)], drift=True)
    _append(store, "t", calls)
    store.create_projection("last", routes="last")
    stats = store.materialize(projection="last")
    assert stats.num_unfoldable == 1 and stats.num_samples_after == 0
    assert list(store.samples(projection="last")) == []
    bad = store.materialized.projection("last").unfoldable_trajectories()
    assert bad["count"] == 1 and bad["recent"][0]["rule"] == "routes_not_stored"
    assert store.materialized.unfoldable_trajectories()["count"] == 0  # the default is unaffected
    assert store.materialize().num_samples_after == 1


@pytest.mark.parametrize("policy", [FoldPolicy("none"), FoldPolicy("none", "response")], ids=["none", "response"])
def test_projection_of_the_stored_facts_equals_the_policy_on_the_commands(store, policy):
    """Admission drops re-sent rows; a projection that keeps the first recording needs
    none of them: its samples equal the policy applied to the commands as sent
    (merges, mismatches, observation deltas, skipped prompt rows, route-less calls)."""
    rng = random.Random(11)
    expected = {}
    for i in range(60):
        evs = _random_trajectory(rng, f"t{i}")
        try:
            store.append(evs)
        except trajstore.ValidationError as e:
            assert e.rule == "missing_route_rows", str(e)
            continue
        gens = [parse_event(e) for e in evs if e["type"] == "generation"]
        expected[f"t{i}"] = fold(gens, trajectory_id=f"t{i}", num_experts=evs[0]["num_experts"],
                                 policy=policy).samples
    if len(expected) % 2:
        store.materialize()  # half of the store's events already re-pointed into default samples
    store.create_projection("p", **policy.to_dict())
    store.materialize(projection="p")
    got: dict[str, list] = {}
    for s in store.samples(projection="p"):
        got.setdefault(s.trajectory_id, []).append(s)
    assert got.keys() == expected.keys() and len(expected) > 40
    for tid, want in expected.items():
        assert len(got[tid]) == len(want)
        for a, b in zip(got[tid], want):
            assert a.equals(b), f"{tid} sample {a.sample_index} differs"


def _folded(store, cfg: RolloutConfig, n: int) -> None:
    """``n`` demo trajectories of ``cfg`` appended and folded into the default samples."""
    for i in range(n):
        store.append(trajectory_events(cfg, i))
    store.materialize()


def _default_state(store) -> dict:
    with store.log.read_engine.connect() as conn:
        return {
            "samples": sorted(tuple(r) for r in conn.execute(select(samples_table))),
            "checkpoints": sorted((r.shard, r.position, r.num_samples_after)
                                  for r in conn.execute(select(materializer_checkpoints))),
            "locators": sorted(tuple(r) for r in conn.execute(select(
                events_table.c.position, events_table.c.segment, events_table.c.segment_row,
                events_table.c.segment_kind))),
        }


def test_default_samples_unchanged_by_create_materialize_drop_and_drop_frees_only_its_files(store):
    cfg = RolloutConfig(turns=3, prompt_tokens=16, output_tokens=8, observation_tokens=4, layers=L, topk=K, seed=4)
    _folded(store, cfg, 12)
    before = _default_state(store)
    default = list(store.samples())
    store.create_projection("steps", merge="none")
    store.create_projection("sky", merge="none", observation="response")
    for i in range(12, 20):  # more trajectories after the projections exist
        store.append(trajectory_events(cfg, i))
    assert store.materialize(projection="steps").num_trajectories == 20
    store.materialize(projection="sky")
    assert store.materialize(projection="steps").num_trajectories == 0  # exactly once
    store.materialize()
    after_default = list(store.samples())
    assert all(a.equals(b) for a, b in zip(after_default, default))
    sky = list(store.samples(projection="sky"))
    with store.log.read_engine.connect() as conn:
        seg_names = set(conn.execute(select(segments.c.name)).scalars())
    steps_files = {n for n in seg_names if n.startswith(f"samples-{store.materialized.projection('steps').row['token']}")}
    assert steps_files
    store.collect_garbage(grace_s=0)  # the default's retired log segments go first
    state = _default_state(store)
    done = store.drop_projection("steps")
    assert done["samples"] == len(sky) and done["segments"] == len(steps_files)
    assert _default_state(store) == state
    removed = set(store.collect_garbage(grace_s=0))
    assert removed == steps_files  # its segments, and nothing else
    files = {n for n, _ in store.payload.list_names()}
    assert not files & steps_files
    assert all(a.equals(b) for a, b in zip(store.samples(), after_default))
    assert all(a.equals(b) for a, b in zip(store.samples(projection="sky"), sky))
    assert [p["name"] for p in store.projections()] == ["sky"]
    with pytest.raises(trajstore.ValidationError, match="no projection 'steps'"):
        list(store.samples(projection="steps"))
    # created again under the same name: new files, folded from the log again
    store.create_projection("steps", merge="none")
    assert store.materialize(projection="steps").num_trajectories == 20
    assert _default_state(store)["samples"] == state["samples"]
    assert set(before["samples"]) <= set(state["samples"])


def test_a_dropped_projections_files_keep_the_grace_when_the_dropping_clock_runs_behind(store, monkeypatch):
    """Retirement is stamped with the database's clock, as the GC reads it: a
    process whose clock runs an hour behind drops a projection, and a GC with a
    10-minute grace right after still keeps the projection's files (a reader
    that resolved them just before the drop may be reading them)."""
    cfg = RolloutConfig(turns=2, prompt_tokens=8, output_tokens=4, observation_tokens=2, layers=L, topk=K, seed=7)
    _folded(store, cfg, 4)
    store.create_projection("steps", merge="none")
    store.materialize(projection="steps")
    token = store.materialized.projection("steps").row["token"]
    files = {n for n, _ in store.payload.list_names() if n.startswith(f"samples-{token}")}
    assert files
    db_now = store.log.database_time()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3600.0)  # this process's clock: an hour behind
    store.drop_projection("steps")
    monkeypatch.setattr(time, "time", real)
    with store.log.read_engine.connect() as conn:
        stamped = dict(conn.execute(select(segments.c.name, segments.c.retired_at)
                                    .where(segments.c.name.in_(files))).all())
    assert set(stamped) == files
    assert not set(store.collect_garbage(grace_s=600)) & files, "deleted within the grace"
    assert all(db_now - 5 <= t <= store.log.database_time() + 5 for t in stamped.values()), stamped
    assert files <= {n for n, _ in store.payload.list_names()}
    assert files <= set(store.collect_garbage(grace_s=0))


def test_sample_reader_reads_a_projection_and_resumes(store):
    cfg = RolloutConfig(turns=3, prompt_tokens=16, output_tokens=8, observation_tokens=4, layers=L, topk=K, seed=5)
    _folded(store, cfg, 8)
    store.create_projection("steps", merge="none")
    # before its materialization, the projection has nothing to read
    assert list(SampleReader(store, projection="steps", batch_size=4)) == []
    store.materialize(projection="steps")
    want = [(s.trajectory_id, s.sample_index) for s in store.samples(projection="steps")]
    assert len(want) > len(list(store.samples()))
    reader = SampleReader(store, projection="steps", batch_size=4)
    first = next(reader)
    state = reader.state_dict()
    assert state["fingerprint"]["projection"] == "steps"
    rest = SampleReader(store, projection="steps", batch_size=4)
    rest.load_state_dict(state)
    got = [(s.trajectory_id, s.sample_index) for s in first] + [(s.trajectory_id, s.sample_index)
                                                               for b in rest for s in b]
    assert got == want
    with pytest.raises(trajstore.ResumeStateError):
        SampleReader(store, batch_size=4).load_state_dict(state)  # the default's samples are another sequence
    with pytest.raises(trajstore.ValidationError, match="no projection 'nope'"):
        SampleReader(store, projection="nope")


def test_bad_projection_definitions_are_refused_with_one_line(store):
    for kw, rule in [({"merge": "all"}, "fold_policy"), ({"routes": "middle"}, "fold_policy"),
                     ({"observation": "response"}, "fold_policy")]:
        with pytest.raises(trajstore.ValidationError) as e:
            store.create_projection("x", **kw)
        assert e.value.rule == rule and "\n" not in str(e.value)
    for name in ("", "a b", "x" * 65, "../x"):
        with pytest.raises(trajstore.ValidationError, match="projection name"):
            store.create_projection(name)
    store.create_projection("x")
    with pytest.raises(trajstore.ValidationError, match="exists"):
        store.create_projection("x", merge="none")
    with pytest.raises(trajstore.ValidationError, match="no projection"):
        store.drop_projection("y")
    assert [p["name"] for p in store.projections()] == ["x"]


def test_cli_projection_commands(store_url, tmp_path):
    payload = str(tmp_path / "payload")
    with trajstore.connect(store_url, payload=payload) as s:
        calls = _turns(np.random.default_rng(3), 5, [(3, 2), (2, 0)])
        _append(s, "t", calls)
    env = dict(os.environ, PYTHONPATH=ROOT)
    base = [sys.executable, "-m", "trajstore.cli", "--store", store_url, "--payload", payload]

    def cli(*args):
        return subprocess.run(base + list(args), capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)

    r = cli("projection", "create", "steps", "--merge", "none", "--observation", "response")
    assert r.returncode == 0 and "created projection steps" in r.stdout, r.stderr
    r = cli("materialize", "--projection", "steps")
    assert r.returncode == 0 and '"num_samples_after": 2' in r.stdout, r.stderr
    r = cli("projection", "list")
    assert r.returncode == 0 and '"num_samples": 2' in r.stdout
    r = cli("projection", "create", "bad", "--observation", "response")
    assert r.returncode == 1 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1
    r = cli("materialize", "--projection", "nope")
    assert r.returncode == 1 and "no projection 'nope'" in r.stderr
    r = cli("export", str(tmp_path / "export"), "--projection", "steps")
    assert r.returncode == 0 and "exported 2 samples" in r.stdout, r.stderr
    import pyarrow.parquet as pq

    t = pq.read_table(tmp_path / "export" / "part-00000.parquet")
    assert t.column("sample_index").to_pylist() == [0, 1]
    assert t.column("response_ids")[0].as_py() == [int(x) for x in calls[0]["output"] + calls[0]["obs"]]
    r = cli("projection", "drop", "steps")
    assert r.returncode == 0 and "dropped projection steps: 2 sample(s)" in r.stdout


CRASH_CFG = RolloutConfig(turns=3, prompt_tokens=48, output_tokens=24, observation_tokens=8, layers=4, topk=2, seed=6)

# Self-contained (a subprocess must not depend on how `tests` resolves)
_MAIN = """
import sys, trajstore
from trajstore.materializer import Materializer
store = trajstore.connect(sys.argv[1], payload=sys.argv[2])
Materializer(store, max_trajectories=2, projection="steps").run()
"""


def test_kill_9_during_a_projection_materialization_then_resume_equals_a_clean_run(store_url, tmp_path):
    n = 120
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    for i in range(n):
        store.append(trajectory_events(CRASH_CFG, i))
    store.materialize(max_trajectories=16)
    default = list(store.samples())
    store.create_projection("steps", merge="none", observation="response")
    index = store.materialized.projection("steps")
    env = dict(os.environ, PYTHONPATH=ROOT)
    rng = random.Random(9)
    at_kill = []
    for _ in range(3):
        before = index.load_checkpoint(Shard(0, 1))
        proc = subprocess.Popen([sys.executable, "-c", _MAIN, store_url, payload], cwd=ROOT, env=env)
        deadline = time.time() + 120
        while index.load_checkpoint(Shard(0, 1)) == before and time.time() < deadline and proc.poll() is None:
            time.sleep(0.01)  # kill only once this run has committed something: mid-run
        time.sleep(rng.uniform(0.0, 0.1))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        cp = index.load_checkpoint(Shard(0, 1))
        at_kill.append(cp["num_samples_after"] if cp else 0)
    store.materialize(projection="steps")  # the restart finishes the job
    got = list(store.samples(projection="steps"))
    cp = index.load_checkpoint(Shard(0, 1))

    clean_dir = tmp_path / "clean"
    clean = trajstore.connect(f"sqlite:///{clean_dir}/clean.db", payload=str(clean_dir / "payload"))
    for i in range(n):
        clean.append(trajectory_events(CRASH_CFG, i))
    clean.create_projection("steps", merge="none", observation="response")
    clean_stats = clean.materialize(projection="steps")
    want = list(clean.samples(projection="steps"))
    assert any(0 < k < clean_stats.num_samples_after for k in at_kill), f"no kill landed mid-run: {at_kill}"
    assert len(got) == len(want) == clean_stats.num_samples_after
    assert [(s.trajectory_id, s.sample_index) for s in got] == [(s.trajectory_id, s.sample_index) for s in want]
    assert all(a.equals(b) for a, b in zip(got, want)), "projection samples differ from a clean run"
    assert cp["num_samples_after"] == clean_stats.num_samples_after
    assert cp["num_steps_before"] == clean_stats.num_steps_before
    # the default samples were not touched by any of it
    assert all(a.equals(b) for a, b in zip(store.samples(), default)) and len(list(store.samples())) == len(default)
    # crashed runs' files are unreferenced garbage; after GC every projection sample still reads
    store.collect_garbage(grace_s=0)
    assert all(a.equals(b) for a, b in zip(store.samples(projection="steps"), want))
    store.close()
    clean.close()


def test_migration_0011_down_and_up_keeps_the_default_and_frees_the_projection_files(store_url, tmp_path):
    from alembic import command
    from sqlalchemy import create_engine, inspect

    from trajstore.log._migrate import alembic_config

    def migrate(engine, target, down=False):
        with engine.begin() as conn:
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            (command.downgrade if down else command.upgrade)(cfg, target)

    payload = str(tmp_path / "payload")
    with trajstore.connect(store_url, payload=payload) as store:
        _append(store, "t", _turns(np.random.default_rng(1), 5, [(3, 2), (2, 0)]))
        store.materialize()
        store.create_projection("steps", merge="none")
        store.materialize(projection="steps")
        default = list(store.samples())
        proj_files = {r["segment"] for page in store.materialized.projection("steps").iter_sample_rows(
            where={}, after=None, page_rows=100) for r in page}
    engine = create_engine(store_url)
    try:
        migrate(engine, "0010", down=True)
        assert not {"projections", "projection_samples"} & set(inspect(engine).get_table_names())
        migrate(engine, "head")
    finally:
        engine.dispose()
    with trajstore.connect(store_url, payload=payload) as store:
        assert all(a.equals(b) for a, b in zip(store.samples(), default)) and len(list(store.samples())) == 1
        assert store.projections() == []
        assert set(store.collect_garbage(grace_s=0)) >= proj_files
        assert all(a.equals(b) for a, b in zip(store.samples(), default))
        store.create_projection("steps", merge="none")
        assert store.materialize(projection="steps").num_samples_after == 2


def test_the_trainer_dataset_reads_a_projection(store):
    """SampleDataset (the torch adapter over SampleReader) takes the projection as a reader field."""
    pytest.importorskip("torch")
    from trajstore.train.collate import SampleDataset

    calls = _turns(np.random.default_rng(2), 5, [(3, 2), (4, 1), (2, 0)])
    _append(store, "t", calls)
    store.materialize()
    store.create_projection("steps", merge="none", observation="response")
    store.materialize(projection="steps")
    batches = list(SampleDataset(store, batch_size=8, projection="steps"))
    assert len(batches) == 1 and batches[0]["sample_indices"] == [0, 1, 2]
    want = [_skyrl_step(calls, i, "response") for i in range(3)]
    lengths = [len(w["prompt_ids"]) + len(w["response_ids"]) for w in want]
    assert batches[0]["input_ids"].shape[1] == max(lengths)
    for row, w in enumerate(want):
        assert batches[0]["input_ids"][row, : lengths[row]].tolist() == [int(x) for x in w["prompt_ids"] + w["response_ids"]]
    (default,) = list(SampleDataset(store, batch_size=8))
    assert default["sample_indices"] == [0]


_BOTH = """
import sys, trajstore
from trajstore.materializer import Materializer
store = trajstore.connect(sys.argv[1], payload=sys.argv[2])
Materializer(store, max_trajectories=2, projection=sys.argv[3] or None).run()
"""


def test_a_projection_and_the_default_materialized_at_once_equal_clean_runs(store_url, tmp_path):
    """The default re-points events into its samples (and retires their log segments)
    while a projection reads the same events: both end equal to a clean run."""
    n = 60
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    for i in range(n):
        store.append(trajectory_events(CRASH_CFG, i))
    store.create_projection("steps", merge="none", observation="response")
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", _BOTH, store_url, payload, name], cwd=ROOT, env=env,
                              stderr=subprocess.PIPE, text=True) for name in ("", "steps")]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    # GC only now: a zero grace while another process is between writing a sample file
    # and committing it would delete that file (the grace is what protects it)
    store.collect_garbage(grace_s=0)
    clean_dir = tmp_path / "clean"
    clean = trajstore.connect(f"sqlite:///{clean_dir}/clean.db", payload=str(clean_dir / "payload"))
    for i in range(n):
        clean.append(trajectory_events(CRASH_CFG, i))
    clean.create_projection("steps", merge="none", observation="response")
    clean.materialize()
    clean.materialize(projection="steps")
    for projection in (None, "steps"):
        got, want = list(store.samples(projection=projection)), list(clean.samples(projection=projection))
        assert len(got) == len(want) > 0
        assert all(a.equals(b) for a, b in zip(got, want)), f"{projection or 'default'} differs from a clean run"
    assert store.materialized.projection("steps").unfoldable_trajectories()["count"] == 0
    store.close()
    clean.close()


@pytest.mark.parametrize("recreate", [None, {"merge": "none"}, {"merge": "prefix"}], ids=["dropped", "same", "other"])
def test_a_projection_dropped_under_a_reader_is_an_error_not_an_end(store, recreate):
    """A reader mid-epoch never ends "normally" on a dropped projection, nor reads on into
    the samples of one created again under the same name (another fold: another sequence)."""
    from trajstore.errors import ProjectionChangedError

    cfg = RolloutConfig(turns=3, prompt_tokens=16, output_tokens=8, observation_tokens=4, layers=L, topk=K, seed=5)
    _folded(store, cfg, 12)
    store.create_projection("steps", merge="none")
    store.materialize(projection="steps")
    # prefetch=False: a prefetching reader may have read this small epoch's rows whole before the drop
    # (then it yields the old projection's epoch, whole); without it, the next page read sees the drop
    reader = SampleReader(store, projection="steps", batch_size=2, page_rows=2, prefetch=False)
    first = next(reader)
    state = reader.state_dict()
    assert len(first) == 2 and state["projection_token"]
    store.drop_projection("steps")
    if recreate is not None:
        store.create_projection("steps", **recreate)
        store.materialize(projection="steps")
    with pytest.raises(ProjectionChangedError, match="projection 'steps' was dropped"):
        for _ in reader:
            pass
    if recreate is not None:
        fresh = SampleReader(store, projection="steps", batch_size=2)
        with pytest.raises(ProjectionChangedError, match="dropped and created again"):
            fresh.load_state_dict(state)
        assert len(next(iter(fresh))) == 2  # a new reader on the new projection reads from its start
