"""The reader against an unavailable or faulty PostgreSQL store (split from test_reader.py,
whose functions and ``open_reader`` fixture these tests share): a follow reader rides out a
server restart, a reader that gave up resumes, opening waits out a server down, record_step
records once across a restart, killed backends are retried, SampleDataset workers ride out
a restart, and a whole run under backend kills and restarts reads every sample once."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import numpy as np
import pytest

import trajstore
from trajstore.materializer import Materializer
from trajstore.reader import SampleReader
from trajstore.demo._simulate import trajectory_events

from test_reader import FOLLOW_TIMEOUT_S, ONE_SAMPLE_CFG, append_samples, drive, fill, flat, keys, make_readers, shuffled
from test_reader import open_reader  # noqa: F401 - the fixture

# ----------------------------------------------------------------------------
# An unavailable store: the reader waits it out (unavailable_timeout_s), and an
# iteration that raised resumes after the last batch it handed out. PostgreSQL
# only: a SQLite store has no server to restart.

def _pg_store(cluster, tmp_path):
    url = cluster.create_database()
    return trajstore.connect(url, payload=str(tmp_path / "payload"))


def _restart(cluster, down_s: float = 3.0) -> None:
    from pg_cluster import crash_cluster, start_cluster_again

    crash_cluster(cluster)
    time.sleep(down_s)
    start_cluster_again(cluster)


def three_steps_across_a_restart(cluster, store, reader) -> list:
    """Three steps of 4 from a follow ``reader`` over ``store`` that holds 6 samples
    (``append_samples(store, 0, 6)``): one, then the database server crashes and starts
    again (``_restart``) while the reader polls for the next, 6 more samples come, two
    more steps. The reader is closed after."""
    batches = [next(reader)]
    time.sleep(0.3)  # the reader polls for the next step meanwhile
    _restart(cluster)
    append_samples(store, 6, 6)
    batches += [next(reader), next(reader)]
    reader.close()
    return batches


def _reader_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trajstore.reader"]


@pytest.mark.timeout(240)
def test_a_follow_reader_rides_out_a_database_restart(fault_cluster, tmp_path, caplog, open_reader):
    """6 samples, batch 4, follow; one batch; the server crashes (stop -m immediate),
    stays down 3 s and starts again; more samples come: the reader goes on."""
    import logging

    caplog.set_level(logging.INFO, logger="trajstore.reader")
    store = _pg_store(fault_cluster, tmp_path)
    append_samples(store, 0, 6)
    reader = open_reader(store.url, payload=store.payload.location, batch_size=4, follow=True,
                          timeout_s=FOLLOW_TIMEOUT_S, poll_interval_s=0.05)
    batches = three_steps_across_a_restart(fault_cluster, store, reader)
    assert [len(b) for b in batches] == [4, 4, 4]
    assert keys(s for b in batches for s in b) == [(s.trajectory_id, s.sample_index) for s in store.samples()]
    lines = _reader_lines(caplog)
    assert reader.stats.unavailable_waits == 1 and reader.stats.unavailable_s > 2.0, lines
    assert sum("store unavailable while" in m for m in lines) == 1, lines  # one line per wait, not per retry
    assert sum("store available again" in m for m in lines) == 1, lines
    store.close()


@pytest.mark.timeout(240)
def test_a_reader_that_gave_up_raises_again_or_resumes_never_ends(fault_cluster, tmp_path, open_reader, monkeypatch):
    from pg_cluster import crash_cluster, start_cluster_again
    from trajstore.errors import StoreUnavailable
    from trajstore.log import postgres

    # the restart may take less than the idle ping's second or more: the append after it
    # must work either way (no idle ping at all here)
    monkeypatch.setattr(postgres, "PING_IDLE_S", 3600.0)

    store = _pg_store(fault_cluster, tmp_path)
    append_samples(store, 0, 4)
    reader = open_reader(store.url, payload=store.payload.location, batch_size=4, follow=True,
                          timeout_s=FOLLOW_TIMEOUT_S, poll_interval_s=0.05, unavailable_timeout_s=0.5)
    first = next(reader)
    crash_cluster(fault_cluster)
    try:
        for _ in range(2):  # a trainer that catches the error and asks again gets it again
            with pytest.raises(StoreUnavailable, match="unavailable_timeout_s=0.5"):
                next(reader)
    finally:
        start_cluster_again(fault_cluster)
    # the store's pooled connections broke with the server: the next append, made once
    # without a retry, works (a broken pooled connection is replaced at checkout)
    append_samples(store, 4, 4)
    second = next(reader)  # resumes where it was: the next step, nothing lost or repeated
    reader.close()
    assert keys(first + second) == [(s.trajectory_id, s.sample_index) for s in store.samples()]
    store.close()


def _start_again_after(cluster, down_s: float) -> threading.Thread:
    from pg_cluster import start_cluster_again

    def later():
        time.sleep(down_s)
        start_cluster_again(cluster)

    thread = threading.Thread(target=later, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(240)
def test_opening_a_reader_waits_out_a_server_down_and_a_missing_store_fails_at_once(fault_cluster, tmp_path, caplog):
    """``SampleReader(url)`` while the server is down waits like reading (a supervised
    trainer restarting during an outage crash-looped), up to ``unavailable_timeout_s``;
    a store that is not there still fails at once."""
    import logging

    from pg_cluster import crash_cluster
    from trajstore.errors import StoreUnavailable

    caplog.set_level(logging.INFO, logger="trajstore.reader")
    store = _pg_store(fault_cluster, tmp_path)
    append_samples(store, 0, 4)
    url, payload = store.url, store.payload.location
    store.close()
    crash_cluster(fault_cluster)
    began = time.monotonic()
    with pytest.raises(StoreUnavailable, match="opening the store.*unavailable_timeout_s=1"):
        SampleReader(url, payload=payload, batch_size=4, unavailable_timeout_s=1.0)
    assert 0.7 < time.monotonic() - began < 10
    restarted = _start_again_after(fault_cluster, 3.0)
    began = time.monotonic()
    reader = SampleReader(url, payload=payload, batch_size=4)
    waited = time.monotonic() - began
    restarted.join()
    assert waited > 2.0 and reader.stats.unavailable_waits == 1, waited
    assert len(next(reader)) == 4
    reader.close()
    lines = _reader_lines(caplog)
    assert sum("store unavailable while opening the store" in m for m in lines) == 2, lines
    # not there: no wait (the default unavailable_timeout_s is 120 s)
    for missing in (fault_cluster.url("no_such_database"), f"sqlite:///{tmp_path}/none.db",
                    fault_cluster.create_database()):  # a database without trajstore's schema
        began = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            SampleReader(missing, payload=payload)
        assert time.monotonic() - began < 5, (missing, str(info.value))
        assert "unavailable_timeout_s" not in str(info.value)


@pytest.mark.timeout(240)
def test_record_step_waits_out_a_database_restart_and_records_once(fault_cluster, tmp_path, caplog):
    """A restart overlapping a step's end: ``record_step`` waits it out as ``next()``
    does (a trainer written as the README shows died there), and the step is recorded
    once, however many tries it took."""
    import logging

    from pg_cluster import crash_cluster
    from sqlalchemy import text

    caplog.set_level(logging.INFO, logger="trajstore.reader")
    store = _pg_store(fault_cluster, tmp_path)
    append_samples(store, 0, 8)
    reader = SampleReader(store.url, payload=store.payload.location, batch_size=4)
    batches = [next(reader)]
    reader.record_step(0, run="r", policy_version=0)
    batches.append(next(reader))
    notes = ({"trajectory_id": s.trajectory_id, "sample_index": s.sample_index,
              "advantages": np.ones(len(s.response_ids), np.float32)} for s in batches[1])  # an iterator
    crash_cluster(fault_cluster)
    restarted = _start_again_after(fault_cluster, 3.0)
    began = time.monotonic()
    recorded = reader.record_step(1, run="r", policy_version=0, annotations=notes)
    waited = time.monotonic() - began
    restarted.join()
    assert waited > 2.0 and (recorded.step, recorded.attempt, recorded.num_samples) == (1, 0, 4), (waited, recorded)
    assert reader.stats.unavailable_waits == 1
    # one warning for the outage, naming the first read that met it: the step's record, or the
    # prefetch of the next batch when that met the restart first (the record then waits behind it)
    said = [m for m in _reader_lines(caplog) if "store unavailable while" in m]
    assert len(said) == 1 and any(w in said[0] for w in ("while recording step 1 of run 'r'",
                                                         "while reading sample rows")), said
    with store.log.read_engine.connect() as conn:
        steps = conn.execute(text("SELECT step, attempt, num_samples FROM train_steps ORDER BY step")).all()
        consumed = conn.execute(text("SELECT step, trajectory_id, sample_index FROM sample_consumption "
                                     "ORDER BY step, ordinal")).all()
        annotated = conn.execute(text("SELECT count(*) FROM lineage_annotations WHERE step = 1")).scalar_one()
    assert [tuple(r) for r in steps] == [(0, 0, 4), (1, 0, 4)]
    assert [tuple(r) for r in consumed] == [(i, s.trajectory_id, s.sample_index)
                                            for i, b in enumerate(batches) for s in b]
    assert annotated == 4
    reader.close()
    store.close()


@pytest.mark.timeout(240)
def test_backends_killed_mid_read_are_retried(fault_cluster, tmp_path):
    """A row query of the reader (one page per step) is held on a table lock, its
    backend terminated (pg_terminate_backend), and the lock released, three times:
    every sample read once, in order."""
    import psycopg

    store = _pg_store(fault_cluster, tmp_path)
    fill(store, shuffled(24))
    reference = flat(drive(make_readers(store, 1, {"batch_size": 4})))
    dbname = store.url.rsplit("/", 1)[1]
    reader = SampleReader(store.url, payload=store.payload.location, batch_size=4, page_rows=4, prefetch=False)
    admin = f"host=127.0.0.1 port={fault_cluster.port} user=postgres dbname={dbname}"
    killed = 0
    got = []
    with psycopg.connect(admin, autocommit=True) as locker, psycopg.connect(admin, autocommit=True) as killer:
        for _ in range(3):
            locker.execute("BEGIN")
            locker.execute("LOCK TABLE samples IN ACCESS EXCLUSIVE MODE")
            result: dict = {}
            thread = threading.Thread(target=lambda: result.update(batch=next(reader, None)))
            thread.start()
            deadline = time.monotonic() + 20
            pids = []
            while not pids and time.monotonic() < deadline:
                pids = [r[0] for r in killer.execute(
                    "SELECT pid FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
                    (dbname,)).fetchall()]
                time.sleep(0.02)
            assert pids, "the reader's row query never waited on the lock"
            for pid in pids:
                killed += killer.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]
            time.sleep(0.3)
            locker.execute("COMMIT")
            thread.join(timeout=60)
            got.append(keys(result["batch"]))
        got += [keys(b) for b in reader]
    reader.close()
    assert killed >= 3 and reader.stats.unavailable_waits >= 3
    assert [k for b in got for k in b] == [tuple(k) for k in reference]
    store.close()


@pytest.mark.timeout(300)
def test_sample_dataset_workers_ride_out_a_database_restart(fault_cluster, tmp_path):
    torchdata = pytest.importorskip("torchdata.stateful_dataloader")
    from trajstore.train.collate import SampleDataset

    store = _pg_store(fault_cluster, tmp_path)
    append_samples(store, 0, 8)
    dataset = SampleDataset(store.url, payload=store.payload.location, batch_size=4, follow=True,
                            timeout_s=FOLLOW_TIMEOUT_S, poll_interval_s=0.05)
    loader = torchdata.StatefulDataLoader(dataset, batch_size=None, num_workers=2)
    it = iter(loader)
    batches = [next(it), next(it)]
    _restart(fault_cluster)
    append_samples(store, 8, 8)
    batches += [next(it), next(it)]
    state = loader.state_dict()
    del it
    assert [b["step"] for b in batches] == [0, 1, 2, 3]
    got = [(t, i) for b in batches for t, i in zip(b["trajectory_ids"], b["sample_indices"])]
    assert got == [(s.trajectory_id, s.sample_index) for s in store.samples()]
    assert state  # the loader's state after the restart is a normal one
    store.close()


# ----------------------------------------------------------------------------
# A whole run under faults: writer and materializer processes, a follow-mode
# trainer checkpointing its reader state, PostgreSQL backends killed -9 (the
# server restarts every backend) and the server crashed and restarted.

def _soak_writer(url: str, payload: str, out_dir: str, writer: int) -> None:
    """Appends one-sample trajectories until ``out_dir/stop`` exists, retrying each until it
    is stored; notes each acknowledged one (fsynced)."""
    from trajstore.errors import StoreUnavailable

    stop = os.path.join(out_dir, "stop")
    try:
        store = trajstore.connect(url, payload=payload, migrate=False)
        with open(os.path.join(out_dir, f"acked-{writer}.txt"), "a") as ack:
            k = 0
            while not os.path.exists(stop):
                index = writer * 100_000 + k
                while True:
                    try:
                        store.append(trajectory_events(ONE_SAMPLE_CFG, index))
                        break
                    except StoreUnavailable:
                        time.sleep(0.05)
                ack.write(f"{index}\n")
                ack.flush()
                os.fsync(ack.fileno())
                k += 1
                time.sleep(0.02)
        store.close()
    finally:  # no append of this writer is in flight any more: the materializer may stop
        open(os.path.join(out_dir, f"done-{writer}"), "w").close()


def _soak_materializer(url: str, payload: str, out_dir: str) -> None:
    """The materializer worker: folds what is pending, again and again, riding out outages,
    until ``out_dir/stop`` exists, both writers are done (an append they started before the
    stop may still be in flight until then) and nothing is pending."""
    from trajstore.errors import StoreUnavailable

    stop = os.path.join(out_dir, "stop")
    store = trajstore.connect(url, payload=payload, migrate=False)
    m = Materializer(store, max_trajectories=16)
    while True:
        stopping = os.path.exists(stop) and all(os.path.exists(os.path.join(out_dir, f"done-{w}")) for w in range(2))
        try:
            stats = m.run()
        except StoreUnavailable:
            time.sleep(0.1)
            continue
        if stopping and stats.num_trajectories == 0:
            break
        time.sleep(0.05)
    store.close()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_whole_run_under_backend_kills_and_restarts_reads_every_sample_once(fault_cluster, tmp_path):
    import multiprocessing
    import random as _random

    rng = _random.Random(7)
    out_dir, payload = str(tmp_path), str(tmp_path / "payload")
    store = _pg_store(fault_cluster, tmp_path)
    dbname = store.url.rsplit("/", 1)[1]
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=_soak_writer, args=(store.url, payload, out_dir, w), daemon=True) for w in range(2)]
    procs.append(fork.Process(target=_soak_materializer, args=(store.url, payload, out_dir), daemon=True))
    for p in procs:
        p.start()
    faults: list[str] = []
    read: list[tuple[str, int]] = []
    states: list[dict] = []
    reader = SampleReader(store.url, payload=payload, batch_size=4, follow=True, timeout_s=20.0, poll_interval_s=0.05)
    try:
        schedule = ["kill", "kill", "restart", "kill", "kill", "restart"]
        next_fault = time.monotonic() + 2
        while schedule:
            batch = next(reader)
            read += keys(batch)
            states.append(reader.state_dict())  # the trainer's checkpoint
            if time.monotonic() >= next_fault:
                fault = schedule.pop(0)
                if fault == "restart":
                    _restart(fault_cluster, down_s=1.0)
                else:
                    backends = fault_cluster.backends(dbname)
                    assert backends, "no backend of the store to kill"
                    fault_cluster.kill_backend(rng.choice(backends)["pid"])
                faults.append(fault)
                fault_cluster.wait_ready()
                next_fault = time.monotonic() + 2
        # a trainer restored from its last checkpoint reads on where this one stopped
        reader.close()
        reader = SampleReader(store.url, payload=payload, batch_size=4, follow=True, timeout_s=5.0,
                              poll_interval_s=0.05)
        reader.load_state_dict(states[-1])
        open(os.path.join(out_dir, "stop"), "w").close()
        for p in procs:
            p.join(timeout=120)
        read += [k for b in reader for k in keys(b)]
    finally:
        open(os.path.join(out_dir, "stop"), "w").close()
        reader.close()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0], [p.exitcode for p in procs]
    assert faults.count("restart") >= 2 and faults.count("kill") >= 4, faults
    acked = {i for w in range(2) for i in map(int, open(os.path.join(out_dir, f"acked-{w}.txt")).read().split())}
    stored = [(s.trajectory_id, s.sample_index) for s in store.samples()]
    assert len(stored) == len(set(stored)), "a trajectory was folded twice"
    want = {trajectory_events(ONE_SAMPLE_CFG, i)[0]["trajectory_id"] for i in acked}
    assert want <= {t for t, _ in stored}, "an acknowledged trajectory has no sample"
    duplicates = [k for k, c in Counter(read).items() if c > 1]
    assert not duplicates, f"samples read twice: {duplicates[:5]}"
    assert read == stored, "the trainer did not read every stored sample once, in order"
    store.close()
