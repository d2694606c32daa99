"""PostgreSQL under faults.

* A server that accepts TCP and never answers: every command fails with one
  line (StoreUnavailable) instead of hanging (9.11). The server is a real
  listening socket on loopback that accepts and holds connections silently.
* A peer that vanishes without closing the socket (a network fault, a host
  reset: a loopback proxy severs its connections silently and resets each one
  the client writes to): a trainer's step record, whose pooled connection is
  not pinged for having sat idle, finds the connection dead by sending, sends
  again on a new one, is acknowledged and stored once.
* The required fault test: appender processes that retry while
  backends are killed during COMMIT, killed at random, and the cluster is
  restarted; afterwards every acknowledged event is stored exactly once, every
  index row's payload file exists, the materializer equals a clean run, and
  the appenders saw trajstore errors only.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import trajstore
from trajstore.demo._simulate import RolloutConfig, trajectory_events
from trajstore.errors import StoreUnavailable, ValidationError
from trajstore.log.postgres import DEFAULT_CONNECT_TIMEOUT_S, engine_options
from trajstore.schema import events, segments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- 9.11: a silent database --------------------------------------------------
@pytest.fixture
def silent_server() -> Iterator[int]:
    """Port of a loopback TCP server that accepts connections and never says a word."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            held.append(conn)  # keep it open, read nothing, answer nothing

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()
    assert held, "nobody connected to the silent server"


@pytest.mark.timeout(60)
def test_connect_to_a_silent_server_raises_store_unavailable(silent_server, tmp_path):
    url = f"postgresql+psycopg://u@127.0.0.1:{silent_server}/x?connect_timeout=2"
    with pytest.raises(StoreUnavailable) as info:
        trajstore.connect(url)
    msg = str(info.value)
    assert "\n" not in msg and "timeout" in msg and f"127.0.0.1:{silent_server}" in msg
    # without the migration check, the first statement (reading the recorded payload
    # location) fails the same way
    with pytest.raises(StoreUnavailable, match="timeout") as info:
        trajstore.connect(url, migrate=False, payload=str(tmp_path / "payload"))
    assert "\n" not in str(info.value) and "payload location" in str(info.value)


@pytest.mark.timeout(120)
def test_cli_info_against_a_silent_server_exits_with_one_line(silent_server):
    """The reported reproduction, with the default timeouts: it printed nothing for 90 s."""
    url = f"postgresql+psycopg://u@127.0.0.1:{silent_server}/x"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "trajstore.cli", "--store", url, "info"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: cannot open store") and "timeout" in line and str(silent_server) in line


def test_timeouts_have_defaults_and_url_parameters():
    url, args = engine_options("postgresql+psycopg://u@db:5432/x")
    assert url == "postgresql+psycopg://u@db:5432/x"
    assert args == {"connect_timeout": DEFAULT_CONNECT_TIMEOUT_S, "options": "-c statement_timeout=120s"}
    url, args = engine_options("postgresql+psycopg://u:pw@db/x?connect_timeout=3&statement_timeout=5min"
                               "&options=-c%20work_mem%3D64MB&sslmode=disable")
    assert "statement_timeout" not in url and "connect_timeout=3" in url and "sslmode=disable" in url
    assert ":pw@" in url and "options" not in url
    assert args == {"options": "-c work_mem=64MB -c statement_timeout=5min"}
    # given the libpq way, in options: kept, no default added after it (the last -c would win)
    _, args = engine_options("postgresql+psycopg://u@db/x?options=-c%20statement_timeout%3D7s")
    assert args["options"] == "-c statement_timeout=7s"
    for bad in ("connect_timeout=soon", "statement_timeout=1s%20-c%20role%3Dpostgres", "statement_timeout=-1"):
        with pytest.raises(ValidationError) as info:
            engine_options(f"postgresql+psycopg://u@db/x?{bad}")
        assert info.value.rule == "url"


def test_statement_timeout_is_in_effect(fresh_pg_url, tmp_path):
    store = trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p"))
    with store.log.read_engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW statement_timeout").scalar_one() == "2min"
    store.close()
    store = trajstore.connect(fresh_pg_url + "?statement_timeout=200ms", payload=str(tmp_path / "p"))
    with store.log.read_engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW statement_timeout").scalar_one() == "200ms"
        with pytest.raises(sa.exc.OperationalError, match="statement timeout"):
            conn.exec_driver_sql("SELECT pg_sleep(30)")
    assert store.info()["head_position"] == 0  # the store itself works under the setting
    store.close()


# -- a peer gone without a word ---------------------------------------------------
class _SeveringProxy:
    """A loopback TCP proxy to ``port``; ``sever()`` makes every connection open now a
    dead peer: the server's side is closed, the client's is held open in silence and
    reset (RST) when the client writes to it. Connections opened later work."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.pairs: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self.resets = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            severed = threading.Event()
            self.pairs.append((client, server, severed))
            threading.Thread(target=self._pump, args=(client, server, severed, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, severed, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, severed: threading.Event, from_client: bool) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if severed.is_set() or not data:
                if from_client and data:  # the client wrote to a dead peer: reset
                    src.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.resets += 1
                    src.close()
                elif not severed.is_set():
                    dst.close()
                return
            try:
                dst.sendall(data)
            except OSError:
                return

    def sever(self) -> None:
        for _, server, severed in self.pairs:
            severed.set()
            server.shutdown(socket.SHUT_RDWR)  # the server's side ends; the client hears nothing

    def close(self) -> None:
        self.listener.close()
        for client, server, _ in self.pairs:
            client.close()
            server.close()


@pytest.mark.postgres
@pytest.mark.timeout(120)
def test_a_step_record_on_an_idle_connection_whose_peer_vanished_is_sent_again(fresh_pg_url, tmp_path, monkeypatch,
                                                                                caplog):
    from trajstore.lineage import store_recorder
    from trajstore.log import postgres as pg_backend

    port = int(sa.engine.make_url(fresh_pg_url).port)
    proxy = _SeveringProxy(port)
    url = fresh_pg_url.replace(f":{port}/", f":{proxy.port}/")
    store = trajstore.connect(url, payload=str(tmp_path / "p"))
    try:
        tids = [f"t{i}" for i in range(3)]
        for tid in tids:
            store.append([{"type": "trajectory_started", "trajectory_id": tid},
                          {"type": "generation", "trajectory_id": tid, "seq": 0, "prompt_ids": [1, 2],
                           "output_ids": [3, 4], "logprobs": [-0.1, -0.2], "model_version": 1},
                          {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}])
        store.materialize()
        recorder = store_recorder(store)
        assert recorder.record(0, run="r", policy_version=1, samples=[(tids[0], 0)]).attempt == 0
        monkeypatch.setattr(pg_backend, "PING_IDLE_S", 0.0)  # every pooled connection counts as idle
        proxy.sever()
        with caplog.at_level("WARNING", logger="trajstore.log"):
            done = recorder.record(1, run="r", policy_version=1, samples=[(t, 0) for t in tids])
        assert (done.attempt, done.num_samples, done.replayed) == (0, 3, False)
        assert proxy.resets >= 1, "the record never wrote to a severed connection: it was pinged first"
        assert any("sending it again on a new connection" in r.getMessage() for r in caplog.records)
        with store.log.read_engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT step, num_samples FROM train_steps ORDER BY step").fetchall() \
                == [(0, 1), (1, 3)]
            assert conn.exec_driver_sql("SELECT count(*) FROM events WHERE type = 'train_step'").scalar_one() == 2
    finally:
        store.close()
        proxy.close()


# -- the required fault test ------------------------------------------------------
NUM_WRITERS = 3
FAULT_CFG = RolloutConfig(turns=2, prompt_tokens=96, output_tokens=48, observation_tokens=16, layers=4, topk=2,
                          num_experts=64, mismatch_prob=0.2, abort_prob=0.2, seed=11)
# Faults in order; between two faults the writers must acknowledge some appends.
# "held_commit": COMMITs are held after their WAL flush (see _kill_held_commit)
# and one such backend gets kill -9: the commit landed, the client sees an error.
# "commit": kill -9 of whatever backend pg_stat_activity shows running COMMIT.
# "random": kill -9 of a random client backend of the store's database.
# "restart": pg_ctl stop -m immediate + start (a crash of the whole server).
SCHEDULE = ["held_commit", "commit", "random", "restart", "held_commit", "commit", "restart"]


def _appender(url: str, payload: str, out_dir: str, writer: int) -> None:
    """One writer process: appends trajectories (two append calls each), retrying
    each call until it succeeds; records every error's class and every
    acknowledged trajectory (fsynced), until ``out_dir/stop`` exists."""
    import time as _time

    from trajstore.errors import StoreUnavailable, TrajstoreError

    stop = os.path.join(out_dir, "stop")
    with open(os.path.join(out_dir, f"acked-{writer}.txt"), "a") as ack, \
            open(os.path.join(out_dir, f"errors-{writer}.txt"), "a") as errors:
        store = None
        k = 0
        while not os.path.exists(stop):
            index = writer * 100_000 + k
            evs = trajectory_events(FAULT_CFG, index)
            mid = len(evs) // 2
            for part in (evs[:mid], evs[mid:]):
                deadline = _time.monotonic() + 90
                while True:
                    try:
                        if store is None:
                            store = trajstore.connect(url, payload=payload, migrate=False)  # the test migrated
                        store.append(part)
                        break
                    except Exception as e:  # noqa: BLE001 - every error is recorded, then judged by the test
                        kind = f"{type(e).__module__}.{type(e).__qualname__}"
                        line = (str(e).strip().splitlines() or [""])[0][:300]
                        trajstore_error = isinstance(e, TrajstoreError)
                        retriable = isinstance(e, StoreUnavailable)  # ContentionError, CommitUnknownError, ...
                        errors.write(f"{kind}\t{int(trajstore_error)}\t{int(retriable)}\t{line}\n")
                        errors.flush()
                        if isinstance(e, TrajstoreError) and not isinstance(e, StoreUnavailable):
                            raise SystemExit(3)  # refused: never retried (the test fails on it)
                        if _time.monotonic() > deadline:
                            raise SystemExit(4)
                        _time.sleep(0.05)
            ack.write(f"{index}\n")
            ack.flush()
            os.fsync(ack.fileno())
            k += 1
    if store is not None:
        store.close()


def _lines(paths) -> list[str]:
    out = []
    for p in paths:
        if os.path.exists(p):
            with open(p) as f:
                out += [line.rstrip("\n") for line in f if line.strip()]
    return out


def _wait_for_acks(out_dir: str, at_least: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    ack_files = [os.path.join(out_dir, f"acked-{w}.txt") for w in range(NUM_WRITERS)]
    while len(_lines(ack_files)) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)


def _commits(cluster, db: str, wait_event: str | None = None) -> list[dict]:
    return [b for b in cluster.backends(db) if b["state"] == "active" and (b["query"] or "").strip().upper() == "COMMIT"
            and (wait_event is None or b["wait_event"] == wait_event)]


def _kill_held_commit(cluster, db: str) -> int:
    """Hold COMMITs where they are durable but not yet answered, then kill -9 one.

    With ``synchronous_standby_names`` naming a standby that never connects,
    a COMMIT flushes its WAL locally and then waits for the standby
    (wait_event SyncRep): that transaction survives crash recovery, yet its
    client gets only a dropped connection. This is the reported "the server
    drops the connection while COMMIT runs, but the commit had landed",
    made reliable instead of hoping a kill falls in a microsecond window."""
    cluster.alter_system("synchronous_standby_names", "trajstore_no_such_standby")
    deadline = time.monotonic() + 15
    held: list[dict] = []
    while not held and time.monotonic() < deadline:
        held = _commits(cluster, db, "SyncRep")
        time.sleep(0.02)
    cluster.alter_system("synchronous_standby_names", None, reload=False)  # the file only: keep them held
    if held:
        cluster.kill_backend(held[0]["pid"])
    cluster.reload()
    return len(held)


def _kill_a_commit(cluster, db: str, rng: random.Random) -> int:
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        found = _commits(cluster, db)
        if found:
            cluster.kill_backend(rng.choice(found)["pid"])
            return 1
    _kill_random(cluster, db, rng)  # no COMMIT caught in time: any backend will do
    return 0


def _kill_random(cluster, db: str, rng: random.Random) -> None:
    backends = cluster.backends(db)
    if backends:
        cluster.kill_backend(rng.choice(backends)["pid"])


def _store_contents(url: str, payload: str):
    store = trajstore.connect(url, payload=payload)
    with store.log.read_engine.connect() as conn:
        rows = conn.execute(sa.select(events.c.trajectory_id, events.c.identity, events.c.segment)).all()
        segment_rows = set(conn.execute(sa.select(segments.c.name)).scalars())
    return store, rows, segment_rows


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_acknowledged_events_survive_backend_kills_during_commit_and_restarts(tmp_path, fault_cluster):
    t0 = time.monotonic()
    rng = random.Random(9)
    out_dir, payload = str(tmp_path), str(tmp_path / "payload")
    cluster = fault_cluster  # not the suite's main cluster: the test kills backends and restarts the server
    url = cluster.create_database("faults")
    trajstore.connect(url, payload=payload).close()  # migrated before the first fault
    # Forked, so the writers start at once with trajstore already imported;
    # each is a real process with its own connections, like a rollout worker.
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=_appender, args=(url, payload, out_dir, w), daemon=True)
             for w in range(NUM_WRITERS)]
    for p in procs:
        p.start()
    ack_files = [os.path.join(out_dir, f"acked-{w}.txt") for w in range(NUM_WRITERS)]
    injected = {"held_commits": 0, "commit_kills": 0, "random_kills": 0, "restarts": 0}
    try:
        print(f"cluster up, writers started [{time.monotonic() - t0:.1f} s]")
        _wait_for_acks(out_dir, 2 * NUM_WRITERS, timeout_s=60)
        print(f"writers appending [{time.monotonic() - t0:.1f} s]")
        for fault in SCHEDULE:
            before = len(_lines(ack_files))
            if fault == "held_commit":
                injected["held_commits"] += _kill_held_commit(cluster, "faults")
            elif fault == "commit":
                injected["commit_kills"] += _kill_a_commit(cluster, "faults", rng)
            elif fault == "random":
                _kill_random(cluster, "faults", rng)
                injected["random_kills"] += 1
            else:
                cluster.restart("immediate")
                injected["restarts"] += 1
            cluster.wait_ready()
            _wait_for_acks(out_dir, before + NUM_WRITERS)  # the writers recover before the next fault
            print(f"{fault} done, writers recovered [{time.monotonic() - t0:.1f} s]")
    finally:
        open(os.path.join(out_dir, "stop"), "w").close()
        for p in procs:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
                p.join()
    codes = [p.exitcode for p in procs]

    acked = sorted(int(x) for x in _lines(ack_files))
    errors = [line.split("\t", 3) for line in _lines(os.path.join(out_dir, f"errors-{w}.txt")
                                                   for w in range(NUM_WRITERS))]
    store, rows, segment_rows = _store_contents(url, payload)
    summary = (f"faults {injected}; {len(acked)} trajectories acknowledged; writer errors "
               f"{dict(Counter(kind for kind, _, _, _ in errors))}")
    print(summary, f"[{time.monotonic() - t0:.1f} s after start]")
    try:
        # the faults happened and the writers came through them
        assert injected["held_commits"] >= 1 and injected["restarts"] == 2, summary
        assert codes == [0] * NUM_WRITERS, f"writers exited {codes}; {summary}"
        assert len(acked) >= 4 * NUM_WRITERS and errors, summary

        # every acknowledged event stored exactly once (and nothing unacknowledged half-stored)
        expected = {trajectory_events(FAULT_CFG, i)[0]["trajectory_id"]: trajectory_events(FAULT_CFG, i)
                    for i in acked}
        per_traj: dict[str, int] = {}
        for tid, _, _ in rows:
            per_traj[tid] = per_traj.get(tid, 0) + 1
        for tid, evs in expected.items():
            assert per_traj.get(tid, 0) == len(evs), f"{tid}: {per_traj.get(tid, 0)} of {len(evs)} events"
        identities = [ident for _, ident, _ in rows if ident is not None]
        assert len(identities) == len(set(identities))

        # every index row's payload file is there
        referenced = {seg for _, _, seg in rows if seg is not None}
        assert referenced <= segment_rows
        missing = sorted(s for s in segment_rows if not os.path.exists(store.payload.path(s)))
        assert not missing, (f"{len(missing)} of {len(segment_rows)} segments the index points at are gone "
                             f"(an uncertain COMMIT deleted its payload): {missing[:3]}; {summary}")

        # the materializer folds everything, and equals a clean run of the same trajectories
        stats = store.materialize()
        assert stats.num_unfoldable == 0
        got = {(s.trajectory_id, s.sample_index): s for s in store.samples()}
        clean = trajstore.connect(f"sqlite:///{tmp_path}/clean.db", payload=str(tmp_path / "clean-payload"))
        stored = sorted(i for i in acked)
        for i in stored:
            clean.append(trajectory_events(FAULT_CFG, i))
        clean_stats = clean.materialize()
        want = {(s.trajectory_id, s.sample_index): s for s in clean.samples()}
        clean.close()
        assert stats.num_trajectories == clean_stats.num_trajectories == len(per_traj)
        assert got.keys() == want.keys()
        assert all(got[k].equals(want[k]) for k in want), "samples differ from a clean run"

        # the writers saw trajstore errors only, and only retriable ones
        foreign = sorted({kind for kind, is_ours, _, _ in errors if is_ours != "1"})
        assert not foreign, f"driver errors escaped to the writers: {foreign}; {summary}"
        refused = sorted({kind for kind, _, retriable, _ in errors if retriable != "1"})
        assert not refused, f"retries were refused: {refused}; {summary}"
    finally:
        store.close()
