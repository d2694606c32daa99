"""The PostgreSQL backend running an append's COMMIT is killed with SIGKILL.

Two real cases, in the suite's fault cluster (``fault_cluster`` in
tests/conftest.py, never the main one: a killed backend makes the postmaster
restart every session):

* the commit record was already written (the backend waits for a synchronous
  standby that does not exist): the append landed, so it is acknowledged and
  its payload stays; before the fix the caller got an error, the payload was
  deleted and the retry was deduplicated onto a missing file;
* COMMIT blocks in a deferred trigger before committing: the append did not
  land; the caller gets a retriable ``CommitUnknownError`` and the payload is
  left to the garbage collector, never deleted under a possible commit.

Either way every acknowledged event's payload exists and ``materialize`` works.

The same cases for a trainer's ``train_step``, whose append sends BEGIN, its
writes and COMMIT in one pipeline (``Database.checked``): a connection lost
anywhere in it leaves the outcome unknown, and the events' identities tell.
Found not stored, it is sent once more on a new connection (its keys are
unique): a second loss, with the lock it waited for held across the crash
restart by a prepared transaction, is the retriable ``CommitUnknownError``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psycopg
import pytest

import trajstore
from trajstore.errors import CommitUnknownError, StoreUnavailable
from tests.helpers import finished, gen, started

from pg_cluster import PgCluster

pytestmark = pytest.mark.postgres
APPENDER = "appender"


@pytest.fixture
def cluster(fault_cluster):
    """The shared fault cluster (tests/conftest.py), set up for this module; reset for the next test."""
    with _admin(fault_cluster) as conn:
        # everyone commits locally, the appender role waits for a synchronous standby when one is named
        conn.execute("ALTER SYSTEM SET synchronous_commit = 'local'")
        conn.execute("SELECT pg_reload_conf()")
        conn.execute(f"CREATE ROLE {APPENDER} LOGIN SUPERUSER")
        conn.execute(f"ALTER ROLE {APPENDER} SET synchronous_commit = 'on'")
    return fault_cluster


def _admin(c: PgCluster, dbname: str = "postgres") -> psycopg.Connection:
    deadline = time.monotonic() + 60
    while True:
        try:
            return psycopg.connect(host="127.0.0.1", port=c.port, user="postgres", dbname=dbname,
                                   autocommit=True, connect_timeout=5)
        except psycopg.OperationalError:  # in crash recovery after the kill
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _admin_run(c: PgCluster, *statements: str, dbname: str = "postgres") -> None:
    """Run idempotent ``statements``, again on a new connection when the one used
    is cut: right after a kill -9 a connection can open before the postmaster
    ends every session for crash recovery."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with _admin(c, dbname) as conn:
                for sql in statements:
                    conn.execute(sql)
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _store(c: PgCluster, tmp_path):
    db = c.create_database()
    trajstore.connect(db, payload=str(tmp_path / "payload")).close()  # migrations as the owner
    url = db.replace("postgres@", f"{APPENDER}@")
    return trajstore.connect(url, payload=str(tmp_path / "payload"), migrate=False), db.rsplit("/", 1)[1]


def _trajectory(tid: str) -> list[dict]:
    return [started(tid), gen(tid, 0, [1, 2, 3], [4, 5], logprobs=[-0.1, -0.2]),
            gen(tid, 1, [1, 2, 3, 4, 5, 6], [7], logprobs=[-0.3]), finished(tid)]


def _kill_backend_when(c: PgCluster, condition: str, killed: tuple[int, ...] = ()) -> int:
    """SIGKILL the appender's backend once it shows ``condition`` in pg_stat_activity
    (watching from a new connection when the one watching is cut: in crash recovery).
    ``killed``: backends killed before, never picked again (a killed backend stays in
    pg_stat_activity, still showing ``condition``, until the postmaster has seen it die)."""
    deadline = time.monotonic() + 60
    seen: list = []
    while time.monotonic() < deadline:
        try:
            with _admin(c) as conn:
                while time.monotonic() < deadline:
                    row = conn.execute(f"SELECT pid FROM pg_stat_activity WHERE usename = %s AND {condition} "
                                       "AND NOT pid = ANY(%s)", (APPENDER, list(killed))).fetchone()
                    if row:
                        os.kill(row[0], signal.SIGKILL)
                        return row[0]
                    time.sleep(0.02)
                seen = conn.execute("SELECT pid, state, wait_event_type, wait_event, query FROM pg_stat_activity "
                                    "WHERE usename = %s", (APPENDER,)).fetchall()
        except psycopg.OperationalError:
            time.sleep(0.2)
    raise AssertionError(f"no appender backend with {condition}: {seen}")


def _append_in_thread(store, events) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = store.append(events)
        except BaseException as e:  # reported to the test below
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _append_retrying(store, events):
    """What a well-behaved caller does: retry retriable errors until acknowledged."""
    for _ in range(5):
        try:
            return store.append(events)
        except StoreUnavailable:
            time.sleep(0.5)
    return store.append(events)


def _assert_every_acknowledged_payload_present(store, tids: list[str]) -> None:
    files = {name for name, _ in store.payload.list_names()}
    missing = store.log.referenced_segments() - files
    assert not missing, f"index rows point at deleted payload files: {sorted(missing)}"
    for tid in tids:
        assert len(store.load_generations(tid)) == 2
    stats = store.materialize()
    assert stats.num_trajectories == len(tids)
    assert {s.trajectory_id for s in store.samples()} == set(tids)


def _killed_while_waiting(store, cluster: PgCluster, events, condition: str, holder, kills: int = 1) -> dict:
    """Append ``events`` on a thread and kill its backend once it matches ``condition`` (it
    waits on a lock ``holder`` holds), ``kills`` times; ``holder`` is closed (the kill
    restarted every session). The thread's outcome: ``{"result": ...}`` or ``{"error": ...}``."""
    try:
        t, out = _append_in_thread(store, events)
        killed: tuple[int, ...] = ()
        for _ in range(kills):
            killed += (_kill_backend_when(cluster, condition, killed),)
        t.join(timeout=120)
        assert not t.is_alive()
    finally:
        holder.close()
    return out


def _unknown_outcome(store, cluster: PgCluster, events, condition: str, holder, kills: int = 1) -> None:
    """``_killed_while_waiting``, and the caller got a retriable, one-line ``CommitUnknownError``."""
    out = _killed_while_waiting(store, cluster, events, condition, holder, kills)
    err = out.get("error")
    assert isinstance(err, CommitUnknownError), f"expected a retriable CommitUnknownError, got {out!r}"
    assert "\n" not in str(err)


def test_commit_that_landed_before_the_kill_is_acknowledged_and_keeps_its_payload(cluster, tmp_path):
    store, _ = _store(cluster, tmp_path)
    store.append(_trajectory("before"))
    with _admin(cluster) as conn:
        conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'ghost'")
        conn.execute("SELECT pg_reload_conf()")
    time.sleep(0.5)  # let every backend read the new setting
    t, out = _append_in_thread(store, _trajectory("during"))
    _kill_backend_when(cluster, "wait_event = 'SyncRep'")  # commit record written, waiting for the standby
    # after crash recovery: no more waiting for a standby
    _admin_run(cluster, "ALTER SYSTEM RESET synchronous_standby_names", "SELECT pg_reload_conf()")
    t.join(timeout=120)
    assert not t.is_alive()
    # The commit landed: the append is acknowledged (no error to retry).
    assert "error" not in out, f"append failed although its commit landed: {out['error']!r}"
    assert out["result"].num_appended == 4
    assert _append_retrying(store, _trajectory("during")).num_duplicates == 4  # a retry adds nothing
    _assert_every_acknowledged_payload_present(store, ["before", "during"])
    store.close()


def test_commit_killed_before_it_landed_is_retriable_and_leaves_the_payload_to_gc(cluster, tmp_path):
    store, dbname = _store(cluster, tmp_path)
    store.append(_trajectory("before"))
    with _admin(cluster, dbname) as conn:
        conn.execute("""CREATE FUNCTION hold_commit() RETURNS trigger LANGUAGE plpgsql AS $$
                        BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END $$""")
        conn.execute("""CREATE CONSTRAINT TRIGGER hold_commit AFTER INSERT ON segments
                        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION hold_commit()""")
    files_before = {name for name, _ in store.payload.list_names()}
    holder = _admin(cluster, dbname)  # advisory locks are per database
    holder.execute("SELECT pg_advisory_lock(4242)")
    _unknown_outcome(store, cluster, _trajectory("during"), "query = 'COMMIT' AND wait_event_type = 'Lock'", holder)
    orphans = {name for name, _ in store.payload.list_names()} - files_before
    assert len(orphans) == 1, "the payload of an uncertain commit must be kept"
    _admin_run(cluster, "DROP TRIGGER IF EXISTS hold_commit ON segments", dbname=dbname)
    assert _append_retrying(store, _trajectory("during")).num_appended == 4
    assert store.collect_garbage(grace_s=0) == sorted(orphans)
    _assert_every_acknowledged_payload_present(store, ["before", "during"])
    store.close()


def _step(step: int, samples: list) -> dict:
    return {"type": "train_step", "run": "r", "step": step, "rank": 0, "world_size": 1, "policy_version": 1,
            "samples": samples, "metrics": {"loss": 0.5}}


def _lineage(store) -> list[tuple]:
    with store.log.read_engine.connect() as conn:
        return [tuple(r) for r in conn.exec_driver_sql(
            "SELECT s.step, s.attempt, s.num_samples, count(x.ordinal) FROM lineage_steps s LEFT JOIN "
            "lineage_step_samples x USING (run, step, rank, attempt) GROUP BY s.step, s.attempt, s.num_samples "
            "ORDER BY s.step")]


def test_a_step_whose_pipelined_commit_landed_before_the_kill_is_acknowledged(cluster, tmp_path):
    store, _ = _store(cluster, tmp_path)
    store.append(_trajectory("a") + _trajectory("b"))
    store.materialize()
    store.append([_step(1, [["a", 0]])])
    with _admin(cluster) as conn:
        conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'ghost'")
        conn.execute("SELECT pg_reload_conf()")
    time.sleep(0.5)
    t, out = _append_in_thread(store, [_step(2, [["a", 0], ["b", 0]])])
    _kill_backend_when(cluster, "wait_event = 'SyncRep'")  # its COMMIT written, waiting for the standby
    _admin_run(cluster, "ALTER SYSTEM RESET synchronous_standby_names", "SELECT pg_reload_conf()")
    t.join(timeout=120)
    assert not t.is_alive()
    assert "error" not in out, f"the step's append failed although its commit landed: {out['error']!r}"
    assert out["result"].num_appended == 1 and out["result"].last_position is not None
    assert _append_retrying(store, [_step(2, [["a", 0], ["b", 0]])]).num_duplicates == 1
    assert _lineage(store) == [(1, 0, 1, 1), (2, 0, 2, 2)]
    store.close()


_STEP_INSERT_WAITS = "wait_event_type = 'Lock' AND query LIKE 'INSERT INTO lineage_steps%%'"


def _a_sample_and_its_steps_locked(cluster: PgCluster, tmp_path):
    """A store with one materialized sample ("a", 0), its database and an admin connection
    in a transaction holding a lock a step's ``lineage_steps`` INSERT waits for."""
    store, dbname = _store(cluster, tmp_path)
    store.append(_trajectory("a"))
    store.materialize()
    holder = _admin(cluster, dbname)
    holder.execute("BEGIN")
    holder.execute("LOCK TABLE lineage_steps IN SHARE MODE")
    return store, dbname, holder


def test_a_step_killed_mid_pipeline_is_sent_again_and_stored_once(cluster, tmp_path):
    """The backend is killed while a write of the pipeline waits for a lock, the COMMIT
    queued behind it. The step is not stored, so it is sent once more on a new
    connection (its identity and lineage key are unique: the two sends cannot both
    land): the caller is acknowledged, and the step is stored once."""
    store, _, holder = _a_sample_and_its_steps_locked(cluster, tmp_path)
    # the kill ends every session: the lock too
    out = _killed_while_waiting(store, cluster, [_step(1, [["a", 0]])], _STEP_INSERT_WAITS, holder)
    assert "error" not in out, f"the step was not stored, yet its second send failed: {out['error']!r}"
    assert out["result"].num_appended == 1 and out["result"].last_position is not None
    assert _lineage(store) == [(1, 0, 1, 1)]
    assert _append_retrying(store, [_step(1, [["a", 0]])]).num_duplicates == 1
    store.close()


def test_a_step_lost_on_both_sends_is_a_retriable_unknown_outcome_never_a_success(cluster, tmp_path):
    """A prepared transaction holds the lock the step's INSERT waits for, across the
    crash restart the kill causes: the first send is killed waiting for it, the second
    send waits for it again and is killed too. Not stored, and the caller is told the
    outcome is unknown (retry), never that it succeeded, nor a certain failure."""
    store, dbname, holder = _a_sample_and_its_steps_locked(cluster, tmp_path)
    holder.execute("PREPARE TRANSACTION 'hold_steps'")  # outlives the session and the crash restart
    try:
        _unknown_outcome(store, cluster, [_step(1, [["a", 0]])], _STEP_INSERT_WAITS, holder, kills=2)
    finally:
        _admin_run(cluster, "ROLLBACK PREPARED 'hold_steps'", dbname=dbname)
    assert _lineage(store) == []
    assert _append_retrying(store, [_step(1, [["a", 0]])]).num_appended == 1
    assert _lineage(store) == [(1, 0, 1, 1)]
    store.close()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_backends_killed_at_random_under_retrying_appenders(cluster, tmp_path):
    """Three appenders that retry retriable errors; their backends are SIGKILLed
    again and again, preferably during COMMIT. Afterwards every acknowledged
    event is stored once, every index row's payload exists, the only errors the
    appenders saw were trajstore's, and materialize folds everything."""
    from tests.log.procs import small_trajectory

    store, _ = _store(cluster, tmp_path)
    url = store.url
    acked: list[tuple[int, int]] = []
    seen_errors: list[BaseException] = []
    # Appenders write at least 12 trajectories each and go on until the killer is done:
    # on a loaded machine a fixed amount of work could end before three kills.
    enough = threading.Event()

    def retried(call) -> tuple[bool, object]:
        """``call()`` again while it raises ``StoreUnavailable``; (False, None) after any other
        error (which fails the test below). Every error is noted."""
        while True:
            try:
                return True, call()
            except StoreUnavailable as e:
                seen_errors.append(e)
                time.sleep(0.05)
            except BaseException as e:
                seen_errors.append(e)
                return False, None

    def appender(w: int) -> None:
        # opening the store reads it too: its backend may be the one killed
        ok, s = retried(lambda: trajstore.connect(url, payload=store.payload.location, migrate=False))
        if not ok:
            return
        try:
            k = 0
            while k < 12 or (not enough.is_set() and k < 1000):
                evs = small_trajectory(w, k)
                for i in range(0, len(evs), 2):
                    if not retried(lambda: s.append(evs[i:i + 2]))[0]:
                        return
                acked.append((w, k))
                k += 1
        finally:
            s.close()

    threads = [threading.Thread(target=appender, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    kills = 0
    with_commit = 0
    deadline = time.monotonic() + 150
    while any(t.is_alive() for t in threads) and kills < 8 and time.monotonic() < deadline:
        try:
            with _admin(cluster) as conn:
                row = None
                for _ in range(50):  # prefer a backend running COMMIT
                    row = conn.execute("SELECT pid, query FROM pg_stat_activity WHERE usename = %s AND state = 'active'"
                                       " ORDER BY query = 'COMMIT' DESC LIMIT 1", (APPENDER,)).fetchone()
                    if row and row[1] == "COMMIT":
                        break
                    time.sleep(0.005)
        except psycopg.OperationalError:
            continue
        if row:
            try:
                os.kill(row[0], signal.SIGKILL)
            except ProcessLookupError:
                continue
            kills += 1
            with_commit += row[1] == "COMMIT"
            time.sleep(0.5)
    enough.set()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    assert kills >= 3
    foreign = [e for e in seen_errors if not isinstance(e, StoreUnavailable)]
    assert not foreign, f"appenders saw non-retriable or foreign errors: {foreign[:3]}"
    written = {w: sum(1 for a, _ in acked if a == w) for w in range(3)}
    assert min(written.values()) >= 12
    assert sorted(acked) == [(w, k) for w in range(3) for k in range(written[w])]
    tids = [f"w{w}-t{k}" for w, k in acked]
    stored = store.log.trajectory_events(tids)
    assert all(len(stored[t]) == 10 for t in tids), "an acknowledged event is missing or stored twice"
    files = {name for name, _ in store.payload.list_names()}
    assert not store.log.referenced_segments() - files, "index rows point at deleted payload files"
    assert store.materialize().num_trajectories == len(tids)
    store.close()
