"""What recording training lineage costs the trainer, beside the step's read.

    python bench/bench_lineage.py [--samples 512] [--tokens 2000] [--rounds 7] [--postgres | --url URL]
                                  [--tree DIR] [--pause S] [--out bench/results/bench_lineage.json]

A store of ``--samples`` one-call trajectories of ``--tokens`` response tokens
(with logprobs) is materialized; each round a fresh ``SampleReader`` reads one
step of all of them and records it: ``record_step`` with metrics only (one
``train_step`` naming every sample), then with per-token ``trainer_logprobs``
for every sample (one ``sample_annotation`` each, the mismatch aggregated at
admission). Reported per backend: the read and both records, median of
``--rounds`` (wall milliseconds, median and best; CPU milliseconds of the
process, which counts the reader prefetching on its own thread meanwhile,
and of the calling thread: what the trainer's thread spent. The machine is
shared, so CPU time is the steadier figure); the connections each record checked out; on PostgreSQL
the round trips of each record, counted with libpq's protocol trace
(``PQtrace`` on every connection the recording thread checks out while the record runs:
one round trip per ``ReadyForQuery`` the server sends, that is per request the
client waited for: a simple query, or an extended-protocol batch ending in
``Sync``, an ``executemany`` pipeline included, and the ping of a pooled
connection idle a second or more (``log.postgres._check_out``: the trace is
switched on before it); plus one per SQLAlchemy pre-ping where an engine has
one, counted by wrapping the dialect's ``do_ping``). ``--pause S`` waits S
seconds between the read and the record, as a trainer's step does, and then as long again before a
control workload (``_control``: 512 keys through ``json.dumps`` and ``repr`` and into an
indexed in-memory SQLite table, ~the record's Python and SQL with no store), timed the same
way and also warm (run again at once): what the same pause does to any work on this machine,
beside what it does to the record; and the bytes at rest of the
annotations' payload against the raw float32 logprobs (docs/benchmarks.md,
"Training lineage").

``--consumed N`` first writes N consumption rows of earlier steps (a long run's
lineage; trajectory ids random then, as uuid4 ids are): a record's cost as the
lineage tables grow.

``--postgres`` also runs it on a throwaway PostgreSQL (tests/pg_cluster.py);
``--url`` on a given one. ``--tree DIR`` imports trajstore from DIR instead of
this checkout (an older commit, ``git worktree``/``git archive``d, measured
by the same script in the same window: the "before" of a change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tree() -> str:
    for i, arg in enumerate(sys.argv):
        if arg == "--tree" and i + 1 < len(sys.argv):
            return os.path.abspath(sys.argv[i + 1])
        if arg.startswith("--tree="):
            return os.path.abspath(arg.split("=", 1)[1])
    return ROOT


sys.path.insert(0, _tree())

import numpy as np  # noqa: E402
from sqlalchemy import event  # noqa: E402

import trajstore  # noqa: E402


class Wire:
    """Connections checked out and (PostgreSQL) round trips, while ``counting``."""

    def __init__(self, store: trajstore.Store, trace_path: str) -> None:
        self.counting = False
        self._thread = 0
        self.checkouts = 0
        self.postgres = store.log.write_engine.dialect.name == "postgresql"
        self._trace = open(trace_path, "w+")
        self.pings = 0
        for engine in {store.log.write_engine, store.log.read_engine}:
            # first among the checkout listeners (insert=True): PostgreSQL's own ping of a
            # connection idle >= 1 s (log.postgres._check_out, a checkout listener) is traced
            event.listen(engine, "checkout", self._checkout, insert=True)
            event.listen(engine, "checkin", self._checkin)
            # SQLAlchemy's pre-ping, where an engine has one, runs before any checkout listener: counted here
            ping = engine.dialect.do_ping

            def counted(dbapi_conn, ping=ping):
                if self.counting and threading.get_ident() == self._thread:
                    self.pings += 1
                return ping(dbapi_conn)

            engine.dialect.do_ping = counted

    def _checkout(self, dbapi_conn, record, proxy) -> None:
        if not self.counting or threading.get_ident() != self._thread:
            return  # not the measured call's (e.g. the reader prefetching its next batch)
        self.checkouts += 1
        if self.postgres:
            from psycopg import pq

            dbapi_conn.pgconn.trace(self._trace.fileno())
            dbapi_conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def _checkin(self, dbapi_conn, record) -> None:
        if self.postgres and dbapi_conn is not None and threading.get_ident() == self._thread:
            try:
                dbapi_conn.pgconn.untrace()  # flushes what libpq buffered
            except Exception:  # noqa: BLE001 - a connection closed meanwhile traced nothing more
                pass

    def measure(self, fn) -> tuple[float, float, int, int | None, float]:
        """(wall ms, process CPU ms, connections checked out, round trips or None,
        the calling thread's CPU ms) of ``fn()``."""
        self._trace.seek(0)
        self._trace.truncate()
        self.checkouts = 0
        self.pings = 0
        self._thread = threading.get_ident()
        self.counting = True
        try:
            w, c, t = time.perf_counter(), time.process_time(), time.thread_time()
            fn()
            wall, cpu, thread = time.perf_counter() - w, time.process_time() - c, time.thread_time() - t
        finally:
            self.counting = False
        trips = None
        if self.postgres:
            with open(self._trace.name) as f:
                trips = self.pings + sum(1 for line in f if line.startswith("B\t") and "\tReadyForQuery" in line)
        return wall * 1e3, cpu * 1e3, self.checkouts, trips, thread * 1e3


_CONTROL_DB = None


def _control(n: int) -> None:
    """The control workload (module doc): no store, no file, no other thread."""
    global _CONTROL_DB
    import sqlite3

    if _CONTROL_DB is None:
        _CONTROL_DB = sqlite3.connect(":memory:", isolation_level=None)
        _CONTROL_DB.execute("CREATE TABLE x (step INTEGER, tid TEXT, idx INTEGER, PRIMARY KEY (step, tid, idx))")
        _CONTROL_DB.execute("CREATE INDEX ix_x ON x (tid, idx)")
    keys = [(f"t{i}", 0) for i in range(n)]
    json.dumps(keys)
    repr(keys)
    step = _CONTROL_DB.execute("SELECT coalesce(max(step), 0) + 1 FROM x").fetchone()[0]
    _CONTROL_DB.execute("BEGIN")
    _CONTROL_DB.executemany("INSERT INTO x VALUES (?, ?, ?)", [(step, t, i) for t, i in keys])
    _CONTROL_DB.execute("COMMIT")


def _timed(fn) -> tuple[float, float]:
    w, t = time.perf_counter(), time.thread_time()
    fn()
    return (time.perf_counter() - w) * 1e3, (time.thread_time() - t) * 1e3


def _fill_consumption(store: trajstore.Store, rows: int, n: int) -> None:
    """``rows`` consumption rows of earlier steps (run "filler", ``n`` a step, random 32-hex
    trajectory ids as uuid4 ids are), written straight into ``lineage_step_samples``."""
    cols = ("run, step, rank, attempt, trajectory_id, sample_index, ordinal, response_len, "
            "min_model_version, max_model_version")
    with store.log.write_engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.exec_driver_sql(f"INSERT INTO lineage_step_samples ({cols}) SELECT 'filler', i / {n}, 0, 0, "
                                 f"md5(i::text), 0, mod(i, {n}), 1, 1, 1 FROM generate_series(0, {rows - 1}) i")
        else:
            rng = np.random.default_rng(1)
            for k in range(0, rows, 100_000):
                conn.exec_driver_sql(f"INSERT INTO lineage_step_samples ({cols}) VALUES (?, ?, 0, 0, ?, 0, ?, 1, 1, 1)",
                                     [("filler", i // n, rng.bytes(16).hex(), i % n)
                                      for i in range(k, min(rows, k + 100_000))])


def run(url: str, payload: str, n: int, r: int, rounds: int, pause: float = 0.0, consumed: int = 0) -> dict:
    store = trajstore.connect(url, payload=payload)
    rng = np.random.default_rng(0)
    # with --consumed the ids are random, as uuid4 ids are (where each sample's index rows land)
    ids = [rng.bytes(16).hex() if consumed else f"t{i}" for i in range(n)]
    events = []
    for tid in ids:
        events += [{"type": "trajectory_started", "trajectory_id": tid},
                   {"type": "generation", "trajectory_id": tid, "seq": 0, "prompt_ids": np.arange(64),
                    "output_ids": np.arange(r) % 1000, "logprobs": -rng.random(r).astype(np.float32),
                    "model_version": 1},
                   {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}]
    for k in range(0, len(events), 300):
        store.append(events[k:k + 300])
    store.materialize()
    if consumed:
        _fill_consumption(store, consumed, n)
    wire = Wire(store, os.path.join(payload + ".trace"))

    read, plain, notes, control, control_warm = [], [], [], [], []
    for round_ in range(rounds):
        reader = trajstore.SampleReader(store, batch_size=n)
        got: list = []
        read.append(wire.measure(lambda: got.append(next(reader))))
        batch = got[0]
        if pause:
            time.sleep(pause)  # a trainer's step: the record's connection sat idle meanwhile
        plain.append(wire.measure(lambda: reader.record_step(2 * round_, run="bench", policy_version=1,
                                                             metrics={"loss": 1.0})))
        annotations = {(s.trajectory_id, s.sample_index): {"trainer_logprobs": s.rollout_logprobs - 0.01}
                       for s in batch}
        reader._lineage_recorder().handed_out(batch)  # the same samples again, annotated
        notes.append(wire.measure(lambda: reader.record_step(2 * round_ + 1, run="bench", policy_version=1,
                                                             annotations=annotations)))
        reader.close()
        time.sleep(pause)
        control.append(_timed(lambda: _control(n)))
        control_warm.append(_timed(lambda: _control(n)))
    names = [name for name, _ in store.payload.list_names() if name.startswith("lineage-")]
    at_rest = sum(os.path.getsize(store.payload.path(name)) for name in names) / len(names)

    def summary(xs: list, wire_counts: bool = True) -> dict:
        out = {"wall_ms": statistics.median(x[0] for x in xs), "wall_ms_best": min(x[0] for x in xs),
               "cpu_ms": statistics.median(x[1] for x in xs),
               "thread_cpu_ms": statistics.median(x[4] for x in xs)}
        if wire_counts:  # the reader reads on its prefetch thread: only the records' are counted
            out["checkouts"] = [x[2] for x in xs]
            if xs[0][3] is not None:
                out["round_trips"] = [x[3] for x in xs]
        return out

    result = {"backend": store.log.write_engine.dialect.name, "samples": n, "tokens_per_sample": r,
              "consumption_rows_before": consumed,
              "rounds": rounds, "pause_s": pause, "read": summary(read, wire_counts=False), "record": summary(plain),
              "record_with_logprobs": summary(notes),
              "annotation_bytes_per_float_byte": at_rest / (n * r * 4),
              "control_after_pause": {"wall_ms": statistics.median(x[0] for x in control),
                                      "thread_cpu_ms": statistics.median(x[1] for x in control)},
              "control_warm": {"wall_ms": statistics.median(x[0] for x in control_warm),
                               "thread_cpu_ms": statistics.median(x[1] for x in control_warm)}}
    store.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--url", default=None, help="a PostgreSQL store (instead of --postgres's throwaway one)")
    parser.add_argument("--postgres", action="store_true", help="also run on a throwaway PostgreSQL cluster")
    parser.add_argument("--tree", default=None, help="import trajstore from this directory (see the module doc)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "bench_lineage.json"))
    parser.add_argument("--pause", type=float, default=0.0,
                        help="seconds between the step's read and its record (a trainer's step: on PostgreSQL a "
                             "connection idle >= 1 s is pinged at checkout, counted as a round trip)")
    parser.add_argument("--consumed", type=int, default=0,
                        help="consumption rows of earlier steps in the store before the rounds (a run's "
                             "history: 1,000,000 is ~2,000 steps of 512), with random trajectory ids")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    results = {"tree": _tree(), "load_average": os.getloadavg()[0], "backends": []}
    results["backends"].append(run(f"sqlite:///{tmp}/store.db", os.path.join(tmp, "payload"), args.samples,
                                   args.tokens, args.rounds, args.pause, args.consumed))
    cluster = None
    pg_url = args.url
    if args.postgres and pg_url is None:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from pg_cluster import PgCluster

        cluster = PgCluster()
        cluster.start()
        pg_url = cluster.create_database("bench_lineage")
    try:
        if pg_url is not None:
            results["backends"].append(run(pg_url, os.path.join(tmp, "pg-payload"), args.samples, args.tokens,
                                           args.rounds, args.pause, args.consumed))
    finally:
        if cluster is not None:
            cluster.stop()
    results["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(results, indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
