"""SPEC "Training lineage" on both backends: the train_step and sample_annotation
events (validation, unknown_sample, identity and attempts, atomicity), their
arrays in the payload, the four views, and recording through SampleReader."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
from sqlalchemy import text

import trajstore
from trajstore.errors import ConflictError, ValidationError
from trajstore.events import identity_of, parse_event
from trajstore.lineage import read_annotations
from tests.helpers import finished, gen, reader_url_for, snapshot, started


def sql(store, query, **params):
    with store.log.read_engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(query), params).all()]


def step(run="r", step=1, samples=(("a", 0),), rank=0, world_size=1, policy_version=5, **kw):
    return {"type": "train_step", "run": run, "step": step, "rank": rank, "world_size": world_size,
            "policy_version": policy_version, "samples": [list(s) for s in samples], **kw}


def note(tid="a", index=0, run="r", step=1, **kw):
    return {"type": "sample_annotation", "run": run, "step": step, "trajectory_id": tid, "sample_index": index,
            **kw}


def rollouts(store, ids=("a", "b", "c")):
    """One finished trajectory per id, materialized: one sample of 5 response tokens, versions 2..3."""
    events = []
    for tid in ids:
        events += [started(tid),
                   gen(tid, 0, [1, 2], [3, 4, 5], version=2, logprobs=[-0.5, -1.0, -0.75]),
                   gen(tid, 1, [1, 2, 3, 4, 5, 6], [7], version=3), finished(tid)]
    store.append(events)
    store.materialize()


def fixed_rollouts(store, ids=("a", "b", "c")):
    """Samples with response [10, 11, 12, 13, 14]: loss_mask [1, 1, 0, 1, 1],
    token_model_versions [2, 2, -1, 3, 3], rollout logprobs [-.5, -1, 0, -.25, 0]
    with logprobs_mask [1, 1, 0, 1, 0]."""
    events = []
    for tid in ids:
        events += [started(tid),
                   gen(tid, 0, [1, 2], [10, 11], version=2, logprobs=[-0.5, -1.0]),
                   gen(tid, 1, [1, 2, 10, 11, 12], [13], version=3, logprobs=[-0.25]),
                   gen(tid, 2, [1, 2, 10, 11, 12, 13], [14], version=3),
                   finished(tid)]
    store.append(events)
    store.materialize()
    s = next(iter(store.samples(trajectory_ids=[ids[0]])))
    assert s.response_ids.tolist() == [10, 11, 12, 13, 14]
    assert s.loss_mask.tolist() == [1, 1, 0, 1, 1]
    assert s.logprobs_mask.tolist() == [True, True, False, True, False]
    assert s.token_model_versions.tolist() == [2, 2, -1, 3, 3]


# -- the wire format -----------------------------------------------------------------

@pytest.mark.parametrize("event, rule", [
    (step(bogus=1), "unknown_field"),
    (note(logprob=[0.0]), "unknown_field"),
    (step(step=2 ** 31), "int32_range"),
    (step(attempt=-1), "attempt"),
    (step(rank=2, world_size=2), "rank"),
    (step(world_size=2 ** 31), "int32_range"),
    (step(world_size=0), "world_size"),
    (step(run=""), "run"),
    (step(run="x" * 256), "run"),
    (step(run="a\x00b"), "run"),
    (step(samples=[["a", 0], ["a", 0]]), "samples"),
    (step(samples=[["a"]]), "samples"),
    (step(samples=[["", 0]]), "samples[0] trajectory_id"),
    (step(samples=[["a", -1]]), "sample_index"),
    (step(metrics={"loss": float("nan")}), "non_finite"),
    (step(metrics={"loss": "low"}), "metrics"),
    (step(metrics=[1.0]), "metrics"),
    ({k: v for k, v in step().items() if k != "policy_version"}, "missing_field"),
    ({k: v for k, v in step().items() if k != "samples"}, "missing_field"),
    (note(trainer_logprobs=[0.0, float("inf")]), "non_finite"),
    (note(entropy=[1e300]), "non_finite"),
    (note(advantages=float("nan")), "non_finite"),
    (note(trainer_logprobs=[0.0], entropy=[0.0, 1.0]), "length_mismatch"),
    (note(trainer_logprobs=["x"]), "array_dtype"),
    (note(sample_index=2 ** 31), "int32_range"),
    ({k: v for k, v in note().items() if k != "trajectory_id"}, "missing_field"),
])
def test_lineage_events_are_validated_like_every_event(event, rule):
    with pytest.raises(ValidationError) as e:
        parse_event(event)
    assert e.value.rule == rule


def test_identity_is_the_key_unless_an_event_id_is_given():
    a = parse_event(step(run="x:1", step=2))
    b = parse_event(step(run="x", step=1, rank=0))
    assert identity_of(a) != identity_of(b)  # ids holding ":" never collide
    assert identity_of(parse_event(step(event_id="e1"))) == "id:e1"
    assert identity_of(parse_event(note("t:1", 0, run="r"))) != identity_of(parse_event(note("1", 0, run="r:t")))
    long = parse_event(note("t" * 255, 0, run="\x01" * 255))  # escapes past the column: hashed
    assert len(identity_of(long)) <= 600


# -- admission ------------------------------------------------------------------------

def test_a_sample_not_in_the_store_is_refused_and_nothing_is_stored(store):
    rollouts(store, ["a"])
    store.append([started("z"), gen("z", 0, [1], [2]), finished("z")])  # not materialized yet
    before = snapshot(store)
    for bad in ([step(samples=[("a", 0), ("a", 1)])], [step(samples=[("z", 0)])], [note("nope", 0)],
                [started("new"), step(samples=[("a", 0)]), note("a", 7)]):
        with pytest.raises(ValidationError) as e:
            store.append(bad)
        assert e.value.rule == "unknown_sample"
        assert e.value.index == len(bad) - 1 and "materialize it first" in str(e.value)
    assert snapshot(store) == before
    assert sql(store, "SELECT count(*) FROM lineage_steps") == [(0,)]


def test_annotation_arrays_need_one_entry_per_response_token(store):
    rollouts(store, ["a"])  # 5 response tokens
    for name in ("trainer_logprobs", "advantages", "entropy"):
        with pytest.raises(ValidationError) as e:
            store.append([step(), note(**{name: [0.0] * 4})])
        assert e.value.rule == "length_mismatch" and e.value.index == 1
        assert "4 entries" in str(e.value) and "5 response tokens" in str(e.value)
    assert sql(store, "SELECT count(*) FROM events WHERE type IN ('train_step', 'sample_annotation')") == [(0,)]
    store.append([step(), note(advantages=0.5, trainer_logprobs=[0.0] * 5)])  # a number for the whole sample


def test_same_content_is_a_noop_and_different_content_a_conflict(store):
    rollouts(store, ["a", "b"])
    batch = [step(samples=[("a", 0), ("b", 0)], metrics={"loss": 0.5}),
             note("a", 0, trainer_logprobs=np.full(5, -0.5, np.float32), metrics={"kl": 0.01})]
    first = store.append(batch)
    assert first.num_appended == 2
    again = store.append(batch)
    assert (again.num_appended, again.num_duplicates) == (0, 2)
    head = store.log.head_position()
    for changed in (dict(batch[0], metrics={"loss": 0.6}), dict(batch[0], samples=[["a", 0]]),
                    dict(batch[1], trainer_logprobs=[-0.4] * 5), dict(batch[0], policy_version=6)):
        with pytest.raises(ConflictError):
            store.append([changed])
    # another event (another event_id) for a recorded key: one event per key
    with pytest.raises(ConflictError) as e:
        store.append([dict(batch[0], event_id="other")])
    assert "already recorded by another event" in str(e.value)
    with pytest.raises(ConflictError):
        store.append([dict(batch[1], event_id="other")])
    # in one batch too
    with pytest.raises(ConflictError):
        store.append([step(step=9, event_id="x"), step(step=9, event_id="y")])
    assert store.log.head_position() == head
    # an event_id-identified step is idempotent by its id
    assert store.append([step(step=2, event_id="s2")]).num_appended == 1
    assert store.append([step(step=2, event_id="s2")]).num_duplicates == 1


def test_the_highest_attempt_stands_and_earlier_ones_stay(store):
    rollouts(store, ["a", "b", "c"])
    store.append([step(step=1, samples=[("a", 0)], metrics={"loss": 1.0}),
                  step(step=1, rank=1, world_size=2, samples=[("c", 0)]),
                  step(step=2, samples=[("b", 0)])])
    store.append([step(step=1, samples=[("b", 0)], attempt=1, policy_version=6, metrics={"loss": 2.0})])
    rows = sql(store, "SELECT run, step, rank, attempt, world_size, policy_version, num_samples, "
                      "num_response_tokens, metrics FROM train_steps ORDER BY step, rank")
    assert [r[:8] for r in rows] == [("r", 1, 0, 1, 1, 6, 1, 5), ("r", 1, 1, 0, 2, 5, 1, 5),
                                     ("r", 2, 0, 0, 1, 5, 1, 5)]
    assert json.loads(rows[0][8]) == {"loss": 2.0} and json.loads(rows[1][8]) == {}
    assert sql(store, "SELECT trajectory_id, step, attempt FROM sample_consumption ORDER BY step, trajectory_id") \
        == [("b", 1, 1), ("c", 1, 0), ("b", 2, 0)]
    # the earlier attempt stays in the log and in SQL
    assert sql(store, "SELECT attempt FROM lineage_steps WHERE step = 1 AND rank = 0 ORDER BY attempt") \
        == [(0,), (1,)]
    assert sql(store, "SELECT count(*) FROM events WHERE type = 'train_step'") == [(4,)]


def test_sample_consumption_carries_staleness_at_training_time(store):
    rollouts(store, ["a", "b"])  # versions 2..3
    store.append([step(step=7, policy_version=9, samples=[("b", 0), ("a", 0)])])
    assert sql(store, "SELECT run, step, rank, attempt, policy_version, trajectory_id, sample_index, "
                      "min_model_version, max_model_version, staleness FROM sample_consumption "
                      "ORDER BY trajectory_id") == [("r", 7, 0, 0, 9, "a", 0, 2, 3, 7), ("r", 7, 0, 0, 9, "b", 0, 2, 3, 7)]
    # never trained on: finished samples with no consumption row
    store.append([started("d"), gen("d", 0, [1], [2]), finished("d")])
    store.materialize()
    assert sql(store, "SELECT s.trajectory_id FROM samples s WHERE NOT EXISTS (SELECT 1 FROM sample_consumption c "
                      "WHERE c.trajectory_id = s.trajectory_id AND c.sample_index = s.sample_index)") == [("d",)]


def test_train_rollout_mismatch_is_k3_over_the_compared_tokens(store):
    fixed_rollouts(store, ["a", "b"])
    trainer = np.array([-0.4, -1.2, 5.0, -0.25, 9.0], np.float32)  # tokens 2 and 4 are not compared
    store.append([step(samples=[("a", 0), ("b", 0)]),
                  note("a", 0, trainer_logprobs=trainer),
                  note("b", 0, trainer_logprobs=np.array([-0.5, -1.0, 0, -0.5, 0], np.float32)),
                  note("a", 0, step=2, entropy=np.ones(5, np.float32))])  # no trainer logprobs: no row
    r = trainer[[0, 1, 3]].astype(np.float64) - np.array([-0.5, -1.0, -0.25], np.float32)
    k3 = np.exp(r) - 1 - r
    [(run, st, attempt, tid, idx, n, k3_mean, abs_mean, max_abs), b_row] = sql(
        store, "SELECT run, step, attempt, trajectory_id, sample_index, tokens_compared, k3_mean, "
               "abs_log_ratio_mean, log_ratio_max_abs FROM train_rollout_mismatch ORDER BY trajectory_id")
    assert (run, st, attempt, tid, idx, n) == ("r", 1, 0, "a", 0, 3)
    assert math.isclose(k3_mean, k3.mean(), rel_tol=1e-9)
    assert math.isclose(abs_mean, np.abs(r).mean(), rel_tol=1e-9)
    assert math.isclose(max_abs, np.abs(r).max(), rel_tol=1e-9)
    r_b = np.array([0.0, 0.0, -0.25])
    k3_b = np.exp(r_b) - 1 - r_b
    assert b_row[5] == 3 and math.isclose(b_row[6], k3_b.mean(), rel_tol=1e-9)
    # by version: tokens 0, 1 are version 2, token 3 version 3 (of both samples)
    rows = sql(store, "SELECT run, model_version, tokens_compared, k3_mean, abs_log_ratio_mean "
                      "FROM train_rollout_mismatch_by_version ORDER BY model_version")
    assert [r_[:3] for r_ in rows] == [("r", 2, 4), ("r", 3, 2)]
    assert math.isclose(rows[0][3], (k3[:2].sum() + k3_b[:2].sum()) / 4, rel_tol=1e-9)
    assert math.isclose(rows[1][3], (k3[2] + k3_b[2]) / 2, rel_tol=1e-9)
    assert math.isclose(rows[1][4], (abs(r[2]) + abs(r_b[2])) / 2, rel_tol=1e-9)
    # a redone step's annotation stands alone
    store.append([note("a", 0, attempt=1, trainer_logprobs=np.array([-0.5, -1.0, 0, -0.25, 0], np.float32))])
    got = dict((tid, (n, k)) for tid, n, k in sql(
        store, "SELECT trajectory_id, tokens_compared, k3_mean FROM train_rollout_mismatch"))
    assert got["a"] == (3, 0.0)
    rows = sql(store, "SELECT model_version, tokens_compared FROM train_rollout_mismatch_by_version "
                      "ORDER BY model_version")
    assert rows == [(2, 4), (3, 2)]


def test_annotation_arrays_live_in_the_payload_once(store):
    fixed_rollouts(store, ["a", "b"])
    lp = np.linspace(-1, 0, 5, dtype=np.float32)
    adv = np.arange(5, dtype=np.float32)
    store.append([step(samples=[("a", 0), ("b", 0)]),
                  note("a", 0, trainer_logprobs=lp, advantages=adv, entropy=lp * 2, metrics={"m": 1.5}),
                  note("b", 0, advantages=0.25)])
    got = {a.trajectory_id: a for a in read_annotations(store, run="r", step=1)}
    assert np.array_equal(got["a"].trainer_logprobs, lp) and np.array_equal(got["a"].advantages, adv)
    assert np.array_equal(got["a"].entropy, lp * 2) and got["a"].metrics == {"m": 1.5}
    assert got["b"].advantages == 0.25 and got["b"].trainer_logprobs is None and got["b"].entropy is None
    # one lineage segment, named by the annotation's event; the scalar one has no payload
    segs = sql(store, "SELECT name, kind, num_rows FROM segments WHERE kind = 'lineage'")
    assert len(segs) == 1 and segs[0][2] == 1
    assert sql(store, "SELECT segment FROM events WHERE type = 'sample_annotation' ORDER BY position") \
        == [(segs[0][0],), (None,)]
    # garbage collection and compaction leave it alone
    store.collect_garbage(grace_s=0)
    store.compact(target_bytes=1 << 30)
    assert np.array_equal(read_annotations(store, run="r", step=1)[0].trainer_logprobs, lp)
    # SQL holds no array
    with store.log.read_engine.connect() as conn:
        columns = set(conn.execute(text("SELECT * FROM lineage_annotations")).keys())
    assert not columns & {"trainer_logprobs", "advantages", "entropy"}


def test_lineage_events_do_not_disturb_the_fold(store):
    rollouts(store, ["a"])
    store.append([step(samples=[("a", 0)])])
    store.append([started("b"), gen("b", 0, [1], [2]), step(step=2, samples=[("a", 0)]), finished("b")])
    stats = store.materialize()
    assert stats.num_trajectories == 1
    assert sorted(s.trajectory_id for s in store.samples()) == ["a", "b"]
    info = store.info()
    assert info["events_by_type"]["train_step"] == 2


def test_a_projection_step_names_that_projections_samples(store):
    store.append([started("a"), gen("a", 0, [1], [2, 3]), gen("a", 1, [9], [4]), finished("a")])
    store.materialize()  # two samples (a prefix mismatch)
    store.create_projection("flat", merge="none")
    store.materialize(projection="flat")
    with pytest.raises(ValidationError) as e:
        store.append([step(samples=[("a", 5)], projection="flat")])
    assert e.value.rule == "unknown_sample" and "projection 'flat'" in str(e.value)
    with pytest.raises(ValidationError) as e:
        store.append([step(samples=[("a", 0)], projection="nope")])
    assert e.value.rule == "projection"
    store.append([step(samples=[("a", 0), ("a", 1)], projection="flat")])
    assert sql(store, "SELECT projection, num_samples FROM train_steps") == [("flat", 2)]


def test_the_views_are_readable_with_the_read_only_role(store, store_url):
    rollouts(store, ["a"])
    store.append([step(), note(trainer_logprobs=[-0.5] * 5)])
    from trajstore.inspect.sql import run_query

    for view in ("train_steps", "sample_consumption", "train_rollout_mismatch",
                 "train_rollout_mismatch_by_version"):
        result = run_query(reader_url_for(store_url), f"SELECT count(*) FROM {view}")
        assert result.rows == [(1,)] or result.rows == [[1]], view


# -- recording from the reader ---------------------------------------------------------

def test_the_reader_records_what_it_handed_out_and_a_replay_is_a_noop(store):
    rollouts(store, [f"t{i}" for i in range(6)])
    reader = trajstore.SampleReader(store, batch_size=2)
    batches = []
    for k, batch in enumerate(reader):
        batches.append([(s.trajectory_id, s.sample_index) for s in batch])
        done = reader.record_step(k, run="grpo", policy_version=10 + k, metrics={"loss": float(k)},
                                  annotations={(s.trajectory_id, s.sample_index):
                                               {"trainer_logprobs": np.zeros(len(s.response_ids), np.float32)}
                                               for s in batch[:1]})
        assert (done.attempt, done.num_samples, done.num_annotations, done.replayed) == (0, 2, 1, False)
        if k == 0:
            saved = reader.state_dict()
    assert len(batches) == 3
    consumed = sql(store, "SELECT step, trajectory_id FROM sample_consumption ORDER BY step, ordinal")
    assert consumed == [(k, tid) for k, b in enumerate(batches) for tid, _ in b]
    # restored after step 0: steps 1 and 2 replayed exactly are no-ops
    again = trajstore.SampleReader(store, batch_size=2)
    again.load_state_dict(saved)
    for k, batch in enumerate(again, start=1):
        done = again.record_step(k, run="grpo", policy_version=10 + k, metrics={"loss": float(k)},
                                 annotations={(s.trajectory_id, s.sample_index):
                                              {"trainer_logprobs": np.zeros(len(s.response_ids), np.float32)}
                                              for s in batch[:1]})
        assert done.replayed and done.attempt == 0
    # step 2 redone differently (another loss) takes attempt 1, which stands
    again.load_state_dict(saved)
    next(again)
    done = again.record_step(1, run="grpo", policy_version=11, metrics={"loss": 99.0})
    assert (done.attempt, done.replayed) == (1, False)
    assert sql(store, "SELECT step, attempt, metrics FROM train_steps ORDER BY step") == [
        (0, 0, '{"loss":0.0}'), (1, 1, '{"loss":99.0}'), (2, 0, '{"loss":2.0}')]
    # the same redo once more is a no-op at the standing attempt
    again.load_state_dict(saved)
    next(again)
    assert again.record_step(1, run="grpo", policy_version=11, metrics={"loss": 99.0}).replayed
    # policy_version defaults to current_model_version
    reader.current_model_version = 42
    with pytest.raises(ValidationError):
        trajstore.SampleReader(store, batch_size=2).record_step(0, run="x")
    assert reader.record_step(3, run="grpo").num_samples == 0
    assert sql(store, "SELECT policy_version FROM train_steps WHERE step = 3") == [(42,)]


def test_recording_a_step_is_one_write_transaction_and_no_read_whatever_its_size(store, tmp_path, monkeypatch):
    """A new step's record (the recorder's attempt rule, the store's admission) checks
    out one connection and runs one write transaction, with no read before it: the
    samples and keys are checked by the statements that write them, for 2 samples as
    for 40. On PostgreSQL that transaction is one round trip (libpq's protocol trace):
    BEGIN, every statement and COMMIT in one pipeline ending in one Sync. On SQLite
    the statements (sqlite3's trace) are as many for 40 samples as for 2, BEGIN
    IMMEDIATE first and COMMIT last. The pool's ping of a connection idle a second or
    more (``log.postgres._check_out``, traced here) is not made for it (a record whose
    connection turns out lost is sent again on a new one): with every checkout idle
    "long enough" for the last record, it is still one round trip."""
    from sqlalchemy import event

    from trajstore.log import postgres as pg_backend

    from trajstore.lineage import store_recorder

    rollouts(store, [f"t{i:02d}" for i in range(40)])
    keys = [(f"t{i:02d}", 0) for i in range(40)]
    checkouts = []
    statements: list[str] = []

    postgres = store.log.write_engine.dialect.name == "postgresql"
    trace = open(tmp_path / "libpq.trace", "w+")

    def count(dbapi_conn, *_):
        checkouts.append(1)
        if postgres:  # libpq's protocol trace: one ReadyForQuery per request the client waited for
            from psycopg import pq

            dbapi_conn.pgconn.trace(trace.fileno())
            dbapi_conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        else:
            dbapi_conn.set_trace_callback(statements.append)

    def untrace(dbapi_conn, *_):
        if postgres:
            dbapi_conn.pgconn.untrace()
        else:
            dbapi_conn.set_trace_callback(None)

    pings = []

    def protocol():
        trace.flush()
        with open(trace.name) as f:
            lines = f.read().splitlines()
        ready = sum(1 for line in lines if line.startswith("B\t") and "\tReadyForQuery" in line)
        syncs = sum(1 for line in lines if line.startswith("F\t") and line.endswith("\tSync"))
        parsed = [line.split('"')[3] for line in lines if line.startswith("F\t") and "\tParse\t" in line]
        return ready, syncs, parsed

    engines = {store.log.write_engine, store.log.read_engine}
    for engine in engines:
        event.listen(engine, "checkout", count, insert=True)  # before the idle ping's listener: it is traced
        event.listen(engine, "checkin", untrace)
    monkeypatch.setattr(pg_backend, "PING_IDLE_S", 3600.0)  # however slow the machine, no idle ping in the counts
    ping = store.log.write_engine.dialect.do_ping

    def counted_ping(dbapi_conn):  # the pool's pre-ping runs before the checkout event
        pings.append(1)
        return ping(dbapi_conn)

    if postgres:
        store.log.write_engine.dialect.do_ping = counted_ping
    seen = []
    try:
        recorder = store_recorder(store)
        for k, n in enumerate((2, 40, 40)):
            if k == 2:
                monkeypatch.setattr(pg_backend, "PING_IDLE_S", 0.0)  # every other checkout pings
            checkouts.clear()
            pings.clear()
            statements.clear()
            trace.seek(0)
            trace.truncate()
            done = recorder.record(k, run="cost", policy_version=3, metrics={"loss": 1.0}, samples=keys[:n])
            assert (done.attempt, done.num_samples, done.replayed) == (0, n, False)
            assert len(checkouts) == 1, (n, len(checkouts))  # 2 before: a read, then the write
            if postgres:
                ready, syncs, parsed = protocol()
                # one request: 3 before (the read, BEGIN and the writes, COMMIT alone); no ping of
                # an idle connection (a simple query of its own: 2 before)
                assert (ready, syncs) == (1, 1), (n, ready, syncs)
                assert parsed[0] == "BEGIN" and parsed[-1] == "COMMIT", parsed
                assert not pings  # no SQLAlchemy pre-ping either
                seen.append(len(parsed))
            else:
                assert statements[0] == "BEGIN IMMEDIATE" and statements[-1] == "COMMIT", statements
                assert not any(s.lstrip().upper().startswith("SELECT") for s in statements), statements
                seen.append(len(statements))
    finally:
        for engine in engines:
            event.remove(engine, "checkout", count)
            event.remove(engine, "checkin", untrace)
        if postgres:
            store.log.write_engine.dialect.do_ping = ping
    assert seen[0] == seen[1] == seen[2], seen  # nothing per sample
    assert sql(store, "SELECT step, num_samples, num_response_tokens FROM train_steps WHERE run = 'cost' "
                      "ORDER BY step") == [(0, 2, 10), (1, 40, 200), (2, 40, 200)]
    assert sql(store, "SELECT trajectory_id, ordinal, response_len, min_model_version, max_model_version "
                      "FROM lineage_step_samples WHERE step = 1 AND ordinal IN (0, 39) ORDER BY ordinal") \
        == [("t00", 0, 5, 2, 3), ("t39", 39, 5, 2, 3)]


def _tried_unread(store, monkeypatch):
    """What each append's unread try (``EventLog.commit_unread_steps``) came to: "stored"
    or the class of what it raised (``ChecksFailed``: rolled back, the batch then read
    and admitted as any other)."""
    tries: list[str] = []
    commit = store.log.commit_unread_steps

    def counted(rows):
        try:
            positions = commit(rows)
        except BaseException as e:
            tries.append(type(e).__name__)
            raise
        tries.append("stored")
        return positions

    monkeypatch.setattr(store.log, "commit_unread_steps", counted)
    return tries


def _lineage_rows(store):
    return (sql(store, "SELECT run, step, rank, attempt, num_samples, num_response_tokens, identity, position "
                       "FROM lineage_steps ORDER BY step, rank, attempt"),
            sql(store, "SELECT step, attempt, trajectory_id, sample_index, ordinal FROM lineage_step_samples "
                       "ORDER BY step, attempt, ordinal"))


def test_a_step_whose_checks_fail_in_sql_gets_the_read_paths_error_and_leaves_nothing(store, monkeypatch):
    """The unread append of a step refused by its own statements (a missing sample, a
    projection that does not exist) is rolled back whole, and the read path gives the
    error it always gave: the first missing sample named, at its event's index."""
    rollouts(store, ["a", "b", "c"])
    tries = _tried_unread(store, monkeypatch)
    store.append([step(step=1, samples=[("a", 0), ("b", 0)])])
    assert tries == ["stored"]
    before, rows = snapshot(store), _lineage_rows(store)
    for bad, index, missing in (([step(step=2, samples=[("a", 0), ("zz", 0), ("b", 0), ("yy", 1)])], 0, "'zz', 0"),
                                ([step(step=2, samples=[("c", 0)]), step(step=3, samples=[("a", 0), ("c", 1)])],
                                 1, "'c', 1")):
        tries.clear()
        with pytest.raises(ValidationError) as e:
            store.append(bad)
        assert tries == ["ChecksFailed"]
        assert (e.value.rule, e.value.index) == ("unknown_sample", index)
        assert f"[{missing}] is not in the default samples" in str(e.value)
    tries.clear()
    with pytest.raises(ValidationError) as e:
        store.append([step(step=2, samples=[("a", 0)], projection="nope")])
    assert tries == ["ChecksFailed"] and e.value.rule == "projection"
    assert snapshot(store) == before and _lineage_rows(store) == rows  # nothing half-written
    store.append([step(step=2, samples=[("c", 0), ("a", 0)])])  # the store still takes the next one
    assert sql(store, "SELECT step, trajectory_id, ordinal FROM lineage_step_samples WHERE step = 2 "
                      "ORDER BY ordinal") == [(2, "c", 0), (2, "a", 1)]


def test_a_replayed_or_redone_step_checked_in_sql_is_a_noop_or_a_conflict_as_before(store, monkeypatch):
    """A step whose identity or key is recorded fails the unread append's keys; the
    read path then finds what it always found: the same content a no-op, other
    content a conflict (the recorder then takes the next attempt), another event for
    the key a conflict. Nothing of the failed try stays."""
    from trajstore.lineage import store_recorder

    rollouts(store, ["a", "b", "c"])
    tries = _tried_unread(store, monkeypatch)
    first = step(step=1, samples=[("a", 0), ("b", 0)], metrics={"loss": 0.5})
    assert store.append([first]).num_appended == 1
    before, rows = snapshot(store), _lineage_rows(store)
    tries.clear()
    again = store.append([first])
    assert (again.num_appended, again.num_duplicates, tries) == (0, 1, ["ChecksFailed"])
    for changed in (dict(first, metrics={"loss": 0.6}), dict(first, samples=[["c", 0]])):
        tries.clear()
        with pytest.raises(ConflictError) as e:
            store.append([changed])
        assert tries == ["ChecksFailed"] and "already stored with different content" in str(e.value)
    tries.clear()
    with pytest.raises(ConflictError) as e:
        store.append([dict(first, event_id="other")])
    assert tries == ["ChecksFailed"] and "already recorded by another event" in str(e.value)
    assert snapshot(store) == before and _lineage_rows(store) == rows
    # through the recorder: a replay is a no-op, a redone step the next attempt
    recorder = store_recorder(store)
    tries.clear()
    replay = recorder.record(1, run="r", policy_version=5, metrics={"loss": 0.5}, samples=[("a", 0), ("b", 0)])
    assert (replay.attempt, replay.replayed) == (0, True)
    redo = recorder.record(1, run="r", policy_version=5, metrics={"loss": 0.7}, samples=[("c", 0)])
    assert (redo.attempt, redo.replayed) == (1, False)
    assert tries == ["ChecksFailed", "ChecksFailed", "stored"]
    assert sql(store, "SELECT step, attempt, num_samples, metrics FROM train_steps") == [(1, 1, 1, '{"loss":0.7}')]
    assert sql(store, "SELECT attempt, trajectory_id FROM lineage_step_samples ORDER BY attempt, ordinal") \
        == [(0, "a"), (0, "b"), (1, "c")]


# -- a trainer killed -9 mid-step and restored (real processes) -------------------------

def _trainer(store_url, run, checkpoint, *extra):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, str(repo / "tests" / "lineage_trainer.py"), store_url, run,
                             str(checkpoint), *map(str, extra)], env=env, cwd=repo, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _consumption(store, run):
    return sql(store, "SELECT step, rank, attempt, policy_version, trajectory_id, sample_index, min_model_version "
                      "FROM sample_consumption WHERE run = :run ORDER BY step, ordinal", run=run)


def _wait_for(path, proc, timeout_s=120.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the trainer never reached the pause"
        time.sleep(0.05)


@pytest.mark.timeout(600)
def test_a_trainer_killed_mid_step_and_restored_records_what_a_run_that_never_crashed_does(store, store_url,
                                                                                            tmp_path):
    import signal

    rollouts(store, [f"t{i:02d}" for i in range(12)])  # 12 samples: 6 steps of 2
    ref = _trainer(store_url, "ref", tmp_path / "ref.json")
    out, err = ref.communicate(timeout=300)
    assert ref.returncode == 0, err
    expected = _consumption(store, "ref")
    assert [r[0] for r in expected] == [k for k in range(6) for _ in range(2)]

    # killed -9 after recording step 3; its last checkpoint was taken after step 1
    marker = tmp_path / "paused"
    crash = _trainer(store_url, "crash", tmp_path / "crash.json", "--pause-after", 3, marker)
    _wait_for(marker, crash)
    crash.send_signal(signal.SIGKILL)
    crash.wait(60)
    assert json.loads((tmp_path / "crash.json").read_text())["step"] == 2
    restored = _trainer(store_url, "crash", tmp_path / "crash.json")
    out, err = restored.communicate(timeout=300)
    assert restored.returncode == 0, err
    # steps 2 and 3 were replayed with the same content: no-ops
    assert out.splitlines()[:2] == ["step 2 attempt 0 replayed True", "step 3 attempt 0 replayed True"]
    assert _consumption(store, "crash") == expected
    ref_notes = [(a.step, a.trajectory_id, a.attempt, a.trainer_logprobs.tolist()) for a in read_annotations(store, run="ref")]
    assert [(a.step, a.trajectory_id, a.attempt, a.trainer_logprobs.tolist())
            for a in read_annotations(store, run="crash")] == ref_notes

    # the same crash, but the restored trainer computes another loss: the replayed steps are redone
    marker = tmp_path / "paused2"
    crash = _trainer(store_url, "redo", tmp_path / "redo.json", "--pause-after", 3, marker)
    _wait_for(marker, crash)
    crash.send_signal(signal.SIGKILL)
    crash.wait(60)
    restored = _trainer(store_url, "redo", tmp_path / "redo.json", "--salt", 1.0)
    out, err = restored.communicate(timeout=300)
    assert restored.returncode == 0, err
    got = _consumption(store, "redo")
    assert [(r[0], r[4]) for r in got] == [(r[0], r[4]) for r in expected]  # the same samples per step
    assert {r[0]: r[2] for r in got} == {0: 0, 1: 0, 2: 1, 3: 1, 4: 0, 5: 0}  # the redone steps' attempts stand
    assert sql(store, "SELECT step, attempt FROM lineage_steps WHERE run = 'redo' AND step IN (2, 3) "
                      "ORDER BY step, attempt") == [(2, 0), (2, 1), (3, 0), (3, 1)]


# -- docs/lineage.md's full loop, run as written -----------------------------------------------

@pytest.mark.timeout(600)
def test_the_full_loop_in_docs_lineage_md_runs_as_written(store_url, tmp_path):
    """rollouts -> materialize -> SampleDataset with DataLoader workers -> a torch step
    recording lineage and trainer logprobs -> kill -9 and restore -> SQL: the page's
    block, saved as the page says and run in an empty directory; its output as the page shows it."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("torch")
    pytest.importorskip("torchdata.stateful_dataloader")
    repo = Path(__file__).resolve().parents[1]
    doc = (repo / "docs" / "lineage.md").read_text()
    start = doc.index("\n## A full loop on CPU\n")
    section = doc[start:doc.index("\n## ", start + 5)]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    shown = re.findall(r"\n```\n(.*?)```", section[section.index(code) + len(code) + 3:], re.S)[0]
    (tmp_path / "lineage_loop.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    if store_url.startswith("postgresql"):
        env["TRAJSTORE_URL"] = store_url
        env["TRAJSTORE_READER_URL"] = reader_url_for(store_url)
    done = subprocess.run([sys.executable, "lineage_loop.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=540)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:6] == ["step 0: attempt 0, replayed False", "step 1: attempt 0, replayed False",
                         "step 2: attempt 0, replayed False", "trainer exit code -9",
                         "step 2: attempt 0, replayed True", "step 3: attempt 0, replayed False"]
    assert lines[6:] == shown.strip().splitlines()
    with trajstore.connect(store_url if store_url.startswith("postgresql")
                           else f"sqlite:///{tmp_path / 'lineage-loop' / 'store.db'}", create=False) as store:
        assert [len(read_annotations(store, run="demo", step=k)) for k in range(4)] == [4, 4, 4, 4]


# -- docs/sql.md's recipes ------------------------------------------------------------------

def _recipes() -> list[str]:
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "sql.md").read_text()
    start = doc.index("\n## Training lineage\n")
    section = doc[start:doc.index("\n## ", start + 5)]
    return re.findall(r"```sql\n(.*?)```", section, re.S)


def test_the_sql_md_recipes_answer_on_both_backends(store, store_url):
    from trajstore.inspect.sql import run_query

    fixed_rollouts(store, ["t1", "t2", "t3", "t4"])
    store.append([step(run="grpo-a", step=3, samples=[("t2", 0), ("t1", 0)], policy_version=7,
                       metrics={"loss": 0.25}),
                  step(run="grpo-a", step=3, rank=1, world_size=2, samples=[("t3", 0)], policy_version=7),
                  note("t1", 0, run="grpo-a", step=3, trainer_logprobs=np.full(5, -0.5, np.float32))])
    recipes = _recipes()
    assert len(recipes) == 7
    postgres = store_url.startswith("postgresql")
    answers = []
    for sql_text in recipes:
        if postgres and "json_extract" in sql_text:
            sql_text = sql_text.replace("json_extract(metrics, '$.loss')", "CAST(metrics AS json) ->> 'loss'")
        answers.append(run_query(reader_url_for(store_url), sql_text).rows)
    never, used_t1, staleness, by_version, worst, step3, loss = answers
    assert [tuple(r[:2]) for r in never] == [("t4", 0)]
    assert [tuple(r[:5]) for r in used_t1] == [("grpo-a", 3, 0, 0, 0)]
    assert [tuple(r[:5]) for r in staleness] == [("grpo-a", 3, 3, 5, 5)]
    assert [tuple(r[:3]) for r in by_version] == [("grpo-a", 2, 2), ("grpo-a", 3, 1)]
    assert [tuple(r[:5]) for r in worst] == [("grpo-a", 3, "t1", 0, 3)]
    assert [tuple(r[:4]) for r in step3] == [(0, 0, "t2", 0), (0, 1, "t1", 0), (1, 0, "t3", 0)]
    assert [(r[0], r[1], float(r[2]) if r[2] is not None else None) for r in loss] == [(3, 0, 0.25), (3, 1, None)]


# -- SampleDataset with StatefulDataLoader workers and a torch training step ----------------

def _torch_step(model, opt, batch):
    """One real optimizer step on CPU; the trainer's logprobs of each sample's response tokens."""
    import torch

    ids = batch["input_ids"]
    logits = model(ids)  # [B, S, V]
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, S-1]
    mask = batch["loss_mask"][:, 1:]
    loss = -(logp * mask).sum() / mask.sum().clamp(min=1)
    opt.zero_grad()
    loss.backward()
    opt.step()
    per_sample = {}
    for b, (tid, idx) in enumerate(zip(batch["trajectory_ids"], batch["sample_indices"])):
        p, s = int(batch["prompt_lens"][b]), int(batch["seq_lens"][b])
        per_sample[(tid, int(idx))] = {"trainer_logprobs": logp[b, p - 1:s - 1].detach()}
    return float(loss.detach()), per_sample


def test_sample_dataset_with_stateful_dataloader_workers_records_lineage(store, store_url, tmp_path):
    import pickle

    torch = pytest.importorskip("torch")
    StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
    from trajstore.train.collate import SampleDataset

    fixed_rollouts(store, [f"t{i}" for i in range(8)])

    def run(name, crash_after=None, saved=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dataset = SampleDataset(store_url, batch_size=2, current_model_version=7)
        loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
        if saved is not None:
            saved = pickle.loads(saved)
            loader.load_state_dict(saved["loader"])
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
        checkpoint = None
        for batch in loader:
            k = batch["step"]
            loss, notes = _torch_step(model, opt, batch)
            dataset.record_step(k, batch, run=name, metrics={"loss": loss}, annotations=notes)
            if k == 1:  # the trainer's checkpoint: loader, model and optimizer together
                checkpoint = pickle.dumps({"loader": loader.state_dict(), "model": model.state_dict(),
                                           "opt": opt.state_dict()})  # a copy, as a file would hold it
            if crash_after is not None and k == crash_after:
                return checkpoint
        return checkpoint

    run("ref")
    saved = run("crash", crash_after=2)
    run("crash", saved=saved)  # restored: step 2 is replayed
    expected = _consumption(store, "ref")
    assert len(expected) == 8 and {r[3] for r in expected} == {7}
    assert _consumption(store, "crash") == expected
    mismatch = sql(store, "SELECT run, step, trajectory_id, tokens_compared FROM train_rollout_mismatch "
                          "ORDER BY run, step, trajectory_id")
    assert [r[1:] for r in mismatch if r[0] == "crash"] == [r[1:] for r in mismatch if r[0] == "ref"]
    assert {r[3] for r in mismatch} == {3}
    ref = read_annotations(store, run="ref", step=2)
    crash = read_annotations(store, run="crash", step=2)
    assert [a.trajectory_id for a in crash] == [a.trajectory_id for a in ref]
    for a, b in zip(ref, crash):
        np.testing.assert_allclose(a.trainer_logprobs, b.trainer_logprobs, rtol=1e-6)


@pytest.mark.parametrize("adapter", ["skyrl", "verl"])
def test_the_adapters_record_through_the_reader_they_read(store, adapter):
    """verl's and SkyRL's batches come from ``reader.iter_steps()``: the trainer's
    one call after each step is ``reader.record_step`` (rank and samples are the reader's)."""
    pytest.importorskip("torch")
    fixed_rollouts(store, [f"t{i}" for i in range(6)])
    reader = trajstore.SampleReader(store, rank=1, world_size=2, batch_size=1)
    if adapter == "skyrl":
        from trajstore.train.skyrl import skyrl_batches

        steps = [(b.step, b.output["trajectory_ids"]) for b in skyrl_batches(reader, missing_reward=0.0)
                 if reader.record_step(b.step, run=adapter, policy_version=b.step) is not None]
    else:
        pytest.importorskip("verl", reason="pip install --no-deps verl==0.9.1")
        from trajstore.train.verl import verl_batches

        steps = [(b.meta_info["trajstore"]["step"], list(b.non_tensor_batch["uid"])) for b in verl_batches(reader, missing_reward=0.0)
                 if reader.record_step(b.meta_info["trajstore"]["step"], run=adapter,
                                       policy_version=b.meta_info["trajstore"]["step"]) is not None]
    assert len(steps) == 3
    rows = sql(store, "SELECT step, rank, trajectory_id FROM sample_consumption WHERE run = :run ORDER BY step",
               run=adapter)
    assert [(r[0], r[1]) for r in rows] == [(s, 1) for s, _ in steps]


@pytest.mark.parametrize("with_unsorted", [True, False])
def test_the_batched_mismatch_equals_the_per_token_definition(with_unsorted):
    """``rollout_mismatches`` (all samples in one pass) against k3 written out token
    by token, with versions that go back within a sample (the sort path) or not (the
    runs path, per-sample figures from the groups), and samples with nothing to compare."""
    from types import SimpleNamespace

    from trajstore.lineage._admission import rollout_mismatches

    rng = np.random.default_rng(3)
    samples, trainer = [], []
    for n, sorted_versions in ((7, True), (0, True), (9, not with_unsorted), (5, True), (4, True)):
        versions = np.sort(rng.integers(0, 4, n)) if sorted_versions else rng.integers(0, 4, n)
        mask = rng.integers(0, 2, n).astype(np.uint8) if n != 4 else np.zeros(n, np.uint8)
        samples.append(SimpleNamespace(response_ids=np.zeros(n, np.int32), loss_mask=mask,
                                       logprobs_mask=rng.random(n) < 0.8,
                                       rollout_logprobs=-rng.random(n).astype(np.float32),
                                       token_model_versions=versions.astype(np.int32)))
        trainer.append(-rng.random(n).astype(np.float32) * 2)
    got = rollout_mismatches(trainer, samples)
    for s, t, (n, k3_sum, abs_sum, max_abs, per_version) in zip(samples, trainer, got):
        by_version: dict[int, list[float]] = {}
        k3s, rs = [], []
        for i in range(len(s.response_ids)):
            if s.loss_mask[i] and s.logprobs_mask[i]:
                r = float(t[i]) - float(s.rollout_logprobs[i])
                rs.append(r)
                k3s.append(math.exp(r) - 1 - r)
                by_version.setdefault(int(s.token_model_versions[i]), []).append(r)
        assert n == len(rs)
        assert math.isclose(k3_sum, sum(k3s), rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(abs_sum, sum(map(abs, rs)), rel_tol=1e-9, abs_tol=1e-12)
        assert max_abs == (max(map(abs, rs)) if rs else None) or math.isclose(max_abs, max(map(abs, rs)))
        assert [(v, c) for v, c, _, _ in per_version] == [(v, len(by_version[v])) for v in sorted(by_version)]
        for v, c, k, a in per_version:
            assert math.isclose(k, sum(math.exp(r) - 1 - r for r in by_version[v]), rel_tol=1e-9, abs_tol=1e-12)


def test_export_step_writes_the_samples_of_one_training_step(store, store_url, tmp_path, capsys, monkeypatch):
    import pyarrow.parquet as pq

    from trajstore.cli import main
    from trajstore.lineage import step_samples

    monkeypatch.setenv("TRAJSTORE_PAYLOAD_DIR", str(tmp_path / "payload"))
    fixed_rollouts(store, ["t1", "t2", "t3", "t4"])
    store.append([step(run="g", step=3, samples=[("t3", 0), ("t1", 0)]),
                  step(run="g", step=3, rank=1, world_size=2, samples=[("t2", 0)]),
                  step(run="g", step=3, samples=[("t4", 0)], attempt=1),  # rank 0 redone: this attempt stands
                  step(run="g", step=4, samples=[("t1", 0)])])
    assert [s.trajectory_id for s in step_samples(store, run="g", step=3)] == ["t4", "t2"]
    out = tmp_path / "step3"
    assert main(["--store", store_url, "export", str(out), "--run", "g", "--step", "3"]) == 0
    assert "exported 2 samples of step 3 of run 'g'" in capsys.readouterr().out
    table = pq.read_table(out)
    assert table.column("trajectory_id").to_pylist() == ["t4", "t2"]
    assert table.column("response_ids").to_pylist()[0] == [10, 11, 12, 13, 14]
    assert main(["--store", store_url, "export", str(tmp_path / "x"), "--run", "g"]) != 0
    assert "--run and --step go together" in capsys.readouterr().err
    # a run or step that does not exist: exit 1 naming what does, nothing written (it exited 0 with 0 samples)
    assert main(["--store", store_url, "export", str(tmp_path / "nope"), "--run", "nope", "--step", "0"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: export: run 'nope' has no samples recorded for step 0; recorded: 'g' (steps 3..4, 2 recorded) "
        "(SampleReader.record_step records them)"]
    assert not (tmp_path / "nope").exists()


def test_mlflow_logs_the_consumed_samples_as_a_dataset_input(store, tmp_path):
    mlflow = pytest.importorskip("mlflow", reason="pip install 'trajstore[mlflow]'")
    from trajstore.inspect.lineage_mlflow import log_consumed_samples

    fixed_rollouts(store, ["t1", "t2", "t3"])
    store.append([step(run="m", step=0, samples=[("t1", 0), ("t2", 0)]), step(run="m", step=1, samples=[("t1", 0)]),
                  step(run="m", step=2, samples=[("t3", 0)])])
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    with mlflow.start_run() as active:
        info = log_consumed_samples(store, run="m", first_step=0, last_step=1)
    assert (info["num_samples"], info["num_distinct_samples"], info["num_steps"]) == (3, 2, 2)
    [logged] = mlflow.get_run(active.info.run_id).inputs.dataset_inputs
    assert logged.dataset.digest == info["digest"] and logged.dataset.source_type == "trajstore"
    assert json.loads(logged.dataset.source)["run"] == "m"
    assert {t.key: t.value for t in logged.tags}["num_samples"] == "3"
    # the same consumption, the same digest; a redone step another
    assert log_consumed_samples(store, run="m", first_step=0, last_step=1)["digest"] == info["digest"]
    mlflow.end_run()
    store.append([step(run="m", step=1, samples=[("t2", 0)], attempt=1)])
    assert log_consumed_samples(store, run="m", first_step=0, last_step=1)["digest"] != info["digest"]
    mlflow.end_run()


def test_openlineage_run_events_carry_the_consumed_samples_through_the_file_transport(store, tmp_path):
    pytest.importorskip("openlineage.client", reason="pip install 'trajstore[openlineage]'")
    from openlineage.client import OpenLineageClient
    from openlineage.client.transport.file import FileConfig, FileTransport

    from trajstore.inspect.lineage_mlflow import consumed_rows
    from trajstore.inspect.lineage_openlineage import emit_consumed_samples

    fixed_rollouts(store, ["t1", "t2", "t3"])
    store.append([step(run="o", step=0, samples=[("t1", 0), ("t2", 0)]), step(run="o", step=1, samples=[("t1", 0)]),
                  step(run="o", step=2, samples=[("t3", 0)]), step(run="other", step=0, samples=[("t2", 0)])])
    path = tmp_path / "openlineage.jsonl"
    client = OpenLineageClient(transport=FileTransport(FileConfig(log_file_path=str(path), append=True)))
    every_two = emit_consumed_samples(store, run="o", first_step=0, last_step=1, event_type="RUNNING", client=client)
    whole = emit_consumed_samples(store, run="o", client=client)
    emit_consumed_samples(store, run="other", client=client)
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["eventType"] for e in events] == ["RUNNING", "COMPLETE", "COMPLETE"]
    first, second, third = events
    # one training run, one OpenLineage run: both events share the run id; another run has its own
    assert first["run"]["runId"] == second["run"]["runId"] == every_two["run_id"] == whole["run_id"]
    assert third["run"]["runId"] != first["run"]["runId"]
    assert first["job"] == {"namespace": "trajstore", "name": "o", "facets": {}}
    [dataset] = first["inputs"]
    assert dataset["name"] == "samples" and dataset["namespace"] == store.url
    assert dataset["inputFacets"]["inputStatistics"]["rowCount"] == 3
    facet = first["run"]["facets"]["trajstore_training"]
    assert {k: facet[k] for k in ("run", "firstStep", "lastStep", "numSteps", "numSamples", "numDistinctSamples")} \
        == {"run": "o", "firstStep": 0, "lastStep": 1, "numSteps": 2, "numSamples": 3, "numDistinctSamples": 2}
    assert facet["_schemaURL"] and facet["_producer"]
    facet = second["run"]["facets"]["trajstore_training"]
    assert (facet["firstStep"], facet["lastStep"], facet["numSteps"], facet["numSamples"]) == (0, 2, 3, 4)
    assert second["inputs"][0]["inputFacets"]["inputStatistics"]["rowCount"] == 4
    # the digest is the one MLflow's dataset input carries for the same steps
    rows = consumed_rows(store, run="o", first_step=0, last_step=1)
    digest = hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:36]
    assert first["run"]["facets"]["trajstore_training"]["digest"] == every_two["digest"] == digest
    with pytest.raises(ValueError, match="event_type must be one of"):
        emit_consumed_samples(store, run="o", event_type="DONE", client=client)


def test_two_writers_racing_for_one_step_key_one_wins_the_other_conflicts(store, store_url, tmp_path):
    """Two processes' stores append different events (event_ids) for the same
    (run, step, rank, attempt) at once: each step is recorded once, the loser gets
    a ConflictError (never a driver error), whatever the interleaving."""
    import threading

    rollouts(store, ["a"])
    other = trajstore.connect(store_url)
    barrier = threading.Barrier(2)
    outcomes: dict[str, list] = {"x": [], "y": []}

    def writer(s, tag):
        for k in range(20):
            barrier.wait()
            try:
                s.append([step(step=k, samples=[("a", 0)], event_id=f"{tag}-{k}", metrics={tag: 1.0})])
                outcomes[tag].append("stored")
            except ConflictError:
                outcomes[tag].append("conflict")
            except Exception as e:  # noqa: BLE001 - recorded: the assertion names it
                outcomes[tag].append(repr(e))

    threads = [threading.Thread(target=writer, args=(s, tag)) for s, tag in ((store, "x"), (other, "y"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    other.close()
    for k in range(20):
        assert sorted((outcomes["x"][k], outcomes["y"][k])) == ["conflict", "stored"], (k, outcomes)
    assert sql(store, "SELECT count(*), count(DISTINCT step) FROM lineage_steps") == [(20, 20)]


def test_huge_trainer_logprobs_leave_the_views_the_tracker_and_the_report_readable(store, store_url):
    """A finite but huge trainer logprob (1e30) makes each token's k3 about exp(700),
    1e304: two annotations of 10,000 such tokens summed overflowed float64, and
    PostgreSQL's ``SUM`` in ``train_rollout_mismatch_by_version``, the tracker's and the
    report's queries failed (``value out of range: overflow``). k3 and its stored sums
    are clamped to ``SUMMED_K3_BOUND``; |r| keeps its value."""
    from trajstore.lineage._admission import MAX_LOG_RATIO, SUMMED_K3_BOUND
    from trajstore.inspect._panels import collect
    from trajstore.inspect.sql import read_only
    from trajstore.inspect.trackers import store_metrics

    n = 10_000
    events = []
    for tid in ("a", "b"):
        events += [started(tid), gen(tid, 0, [1], list(range(2, n + 2)), version=2, logprobs=[-1.0] * n),
                   finished(tid)]
    store.append(events)
    store.materialize()
    huge = np.full(n, 1e30, np.float32)
    store.append([step(samples=[("a", 0), ("b", 0)]), note("a", 0, trainer_logprobs=huge),
                  note("b", 0, trainer_logprobs=huge)])
    [(tokens, k3_mean, abs_mean)] = sql(store, "SELECT tokens_compared, k3_mean, abs_log_ratio_mean "
                                               "FROM train_rollout_mismatch_by_version")
    assert tokens == 2 * n and math.isclose(k3_mean, SUMMED_K3_BOUND / n, rel_tol=1e-9)
    assert abs_mean == MAX_LOG_RATIO
    assert sql(store, "SELECT max(log_ratio_max_abs) FROM train_rollout_mismatch") == [(MAX_LOG_RATIO,)]
    with read_only(reader_url_for(store_url)) as query:
        values = store_metrics(query).values
        panels = {p["name"]: p for p in collect(query)["panels"]}
    assert math.isclose(values["mismatch/k3_mean"], SUMMED_K3_BOUND / n, rel_tol=1e-9)
    assert all(math.isfinite(v) for v in values.values())
    drawn = [p for name, p in panels.items() if "mismatch" in name or "k3" in (p["title"] or "")]
    assert drawn and all(p["figure"] for p in drawn), [(p["name"], p["note"]) for p in drawn]
