"""kill -9 while the materializer re-points events into sample segments and
while compaction moves them: after a restart the samples equal a
clean run sample by sample, every event still reads back, and a GC right
after the crash (grace 0) never removes a file an index row still names."""

from __future__ import annotations

import pytest
from sqlalchemy import select

import trajstore
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.log.base import Shard
from trajstore.schema import events as events_table, samples as samples_table
from tests.helpers import kill_at_pause
from tests.log.test_gc_compaction import _same

CFG = RolloutConfig(turns=3, prompt_tokens=60, output_tokens=40, observation_tokens=12, layers=4, topk=2,
                    num_experts=64, mismatch_prob=0.25, abort_prob=0.1, fail_prob=0.05, seed=21)
N = 16


# The tests whose first step connects store_url (a store's first connect migrates it): theirs is a
# copy of the migrated template (tests/conftest.py).
STORE_URL_CONNECTED_BY = (
    "test_kill_9_during_materialize_then_resume_equals_a_clean_run",
    "test_kill_9_during_compaction_then_resume_equals_a_clean_run",
)


def _append(store, ids, *, finish: bool) -> None:
    for i in ids:
        evs = trajectory_events(CFG, i)
        if not finish:
            evs = evs[:-1]
        for k in range(0, len(evs), 2):  # many small log segments
            store.append(evs[k : k + 2])


def _finishes(ids) -> list[dict]:
    return [trajectory_events(CFG, i)[-1] for i in ids]


def _kill_at(url: str, payload: str, job: str, where: str, nth: int, marker: str) -> None:
    kill_at_pause("tests.log.repoint_procs", url, payload, job, where, str(nth), marker, marker=marker, what=job,
                  point=f"{where} #{nth}")


def _named_files_exist(store) -> None:
    with store.log.read_engine.connect() as conn:
        named = set(conn.execute(select(events_table.c.segment).where(events_table.c.segment.is_not(None))).scalars())
        named |= set(conn.execute(select(samples_table.c.segment)).scalars())
    on_disk = {n for n, _ in store.payload.list_names()}
    assert named <= on_disk, f"GC removed files an index row names: {sorted(named - on_disk)}"


def _clean_samples(tmp_path) -> list:
    clean = trajstore.connect(f"sqlite:///{tmp_path}/clean.db", payload=str(tmp_path / "clean-payload"))
    _append(clean, range(N), finish=True)
    clean.materialize()
    out = list(clean.samples())
    clean.close()
    return out


def _check_against_clean(store, tmp_path) -> None:
    got, want = list(store.samples()), _clean_samples(tmp_path)
    assert [(s.trajectory_id, s.sample_index) for s in got] == [(s.trajectory_id, s.sample_index) for s in want]
    assert all(a.equals(b) for a, b in zip(got, want)), "samples differ from a clean run"
    # every event reads back (from the sample rows it was folded into)
    for s in got:
        if s.sample_index == 0:
            assert store.load_generations(s.trajectory_id)


@pytest.mark.parametrize("where", ["after_file", "in_transaction"])
def test_kill_9_during_materialize_then_resume_equals_a_clean_run(store_url, tmp_path, where):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    _append(store, range(N), finish=True)
    _kill_at(store_url, payload, "materialize", where, 2, str(tmp_path / "paused"))
    cp = store.materialized.load_checkpoint(Shard(0, 1))
    assert cp is not None and 0 < cp["position"] < store.log.head_position(), "the kill landed mid-run"
    with store.log.read_engine.connect() as conn:
        kinds = [k for k in conn.execute(select(events_table.c.segment_kind)
                                         .where(events_table.c.type == "generation")).scalars()]
    assert "samples" in kinds and None in kinds  # the first batch re-pointed, the killed one not
    store.collect_garbage(grace_s=0)
    _named_files_exist(store)
    store.materialize()
    store.collect_garbage(grace_s=0)
    _named_files_exist(store)
    assert {n for n, _ in store.payload.list_names()} == store.log.referenced_segments()
    _check_against_clean(store, tmp_path)
    store.close()


@pytest.mark.parametrize("where", ["after_file", "in_transaction"])
def test_kill_9_during_compaction_then_resume_equals_a_clean_run(store_url, tmp_path, where):
    payload = str(tmp_path / "payload")
    store = trajstore.connect(store_url, payload=payload)
    _append(store, range(N), finish=False)
    tids = [trajectory_events(CFG, i)[0]["trajectory_id"] for i in range(N)]
    before = {t: store.load_generations(t) for t in tids}
    _kill_at(store_url, payload, "compact", where, 2, str(tmp_path / "paused"))
    store.collect_garbage(grace_s=0)
    _named_files_exist(store)
    after = {t: store.load_generations(t) for t in tids}
    assert all(_same(before[t], after[t]) for t in tids)
    assert store.compact(target_bytes=64 << 10)["events_moved"] > 0  # resume
    assert all(_same(before[t], store.load_generations(t)) for t in tids)
    store.collect_garbage(grace_s=0)
    _named_files_exist(store)
    store.append(_finishes(range(N)))
    store.materialize()
    store.collect_garbage(grace_s=0)
    _named_files_exist(store)
    _check_against_clean(store, tmp_path)
    store.close()
