"""Load generator: N proxies x M engine calls/s through the real services, per-call costs, and
their projection to a cluster's rate.

    PYTHONPATH=. python bench/bench_load.py [--clients 2] [--rate 50] [--seconds 60] [--turns 4]
        [--backend postgres|sqlite] [--routes new|all] [--body arrow|json] [--linger-ms 20]
        [--max-batch-mb 32] [--no-trace] [--project 3300] [--json OUT]

What runs (each a process of its own, on loopback):

* PostgreSQL: a throwaway cluster (tests/pg_cluster.py); ``--backend sqlite``
  puts the index in a SQLite file instead;
* S3: ``moto_server`` (bench/_moto.py); the store's payload is
  ``s3://bench/run`` on it;
* the ingest service, ``trajstore serve --linger-ms --max-batch-mb`` (one
  worker), started through this script's ``_serve`` mode: the service's own
  ``main`` with every PostgreSQL connection it opens traced by libpq
  (tests/pg_roundtrips.RoundTrips; ``--no-trace`` runs it untraced, for its
  CPU without the trace's writes);
* the materializer as users run it, ``workers/materializer.py`` with its
  defaults: it folds as trajectories finish, and its GC worker
  (``trajstore._upkeep.gc.GcWorker``) deletes the retired log segments;
* N client processes (the "proxies"), each offering M engine calls per
  second: call i is due at start + i/M, taken by the first of
  ``--concurrency`` threads free (a proxy serves many engine calls at once).
  A thread runs one trajectory at a time (a call waits for its ack before
  the trajectory's next call), so ``--concurrency`` trajectories per client
  are in flight; at the run's end each unfinished one gets its
  ``trajectory_finished`` (a request without a call: "cut short"). A call is
  one ``POST /v1/events`` of a generation event (``HttpSink``, Arrow IPC
  body by default), the trajectory's first also carrying
  ``trajectory_started``, its last ``reward`` and ``trajectory_finished``.

The load (multi-turn, sizes drawn per trajectory and per call): a first
prompt of ``--prompt`` tokens (uniform in the range), each turn an output of
``--output`` tokens with its logprobs, the next prompt the whole sequence so
far plus an observation of ``--observation`` tokens; routed experts
48 layers x top-8 (uint8, 128 experts): with ``--routes new`` (the default,
as the recording proxy asks the engine for only new rows) each call carries
the rows of its new positions (``routed_experts_start``), with ``--routes
all`` every row of its sequence (vLLM without the hint). Arrays are views
of random buffers made before the clock starts, so a client's CPU is the
proxy's work: encoding the body and the HTTP call.

Reported per engine call (over the run, from the first call to the end of
the drain that lets the materializer and its GC finish):

* client CPU (the clients' own ``getrusage``) and server CPU per process
  (``/proc/<pid>/stat`` of the service, the materializer, PostgreSQL's
  postmaster and backends, moto), bench/_proc.cpu_s; the materializer's per
  call it folded (generation events of trajectories before its checkpoint),
  the others' per call acknowledged;
* PostgreSQL round trips of the service per committed batch: libpq's
  protocol trace of each of the service's connections (tests/pg_roundtrips),
  divided by the batches its ``/metrics`` counts (``trajstore_ingest_commits_total``);
* S3 requests by operation, counted from moto's request log (every client of
  the server: service, materializer, the bench's own listings, whose
  ``ListObjects`` pages are subtracted); objects made (``PutObject`` +
  ``CompleteMultipartUpload``, by key prefix) and objects deleted (made minus
  the objects left at the end);
* bytes at rest over time: every ``--sample-s`` seconds the bucket is listed
  (bytes of log segments, of sample segments, objects), divided by the unique
  tokens acknowledged so far (a trajectory's sequence once).

Projection, linear: ``projected(X) = X / calls x P`` for ``P = --project``
calls/s (default 3,300): cores = CPU seconds per call x P, requests/s =
requests per call x P. "trajstore cores" adds the clients', the service's
and the materializer's; PostgreSQL's are apart, moto's are the stand-in
S3's (not a cost of a deployment on S3). Calls per object and per batch grow
with the rate (a linger collects more calls), so projected requests and
round trips are upper bounds; CPU per call is taken as constant.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
TESTS = REPO / "tests"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from _proc import cpu_s  # noqa: E402  (bench/ is on sys.path when run as a script)

TOKEN = "bench-token"
LAYERS, TOPK, EXPERTS = 48, 8, 128
BUFFER_TOKENS = 1 << 15  # the random buffers a client's trajectories are views of


# -- the service, traced -----------------------------------------------------------

def serve_traced(counts_path: str, argv: list[str]) -> None:
    """``trajstore serve argv`` with every PostgreSQL engine it makes traced
    (tests/pg_roundtrips.RoundTrips); SIGUSR1 writes the counts so far to
    ``counts_path`` (JSON)."""
    sys.path.insert(0, str(TESTS))
    from pg_roundtrips import RoundTrips

    import trajstore.log.postgres as pg
    from trajstore.cli import main

    tracers: list[RoundTrips] = []
    create_engine = pg.create_engine

    def traced(*a, **kw):
        engine = create_engine(*a, **kw)
        tracers.append(RoundTrips(engine))
        return engine

    pg.create_engine = traced

    def dump(*_: object) -> None:
        total: Counter = Counter()
        for t in tracers:
            total.update(t.counts())
        tmp = counts_path + ".tmp"
        Path(tmp).write_text(json.dumps(dict(total)))
        os.replace(tmp, counts_path)

    signal.signal(signal.SIGUSR1, dump)
    sys.exit(main(["serve", *argv]))


class Service:
    def __init__(self, work: Path, store: str, payload: str, args: argparse.Namespace) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.counts_path = str(work / "roundtrips.json")
        self.traced = args.backend == "postgres" and not args.no_trace
        serve = ["--store", store, "--payload", payload, "--port", str(self.port), "--linger-ms", str(args.linger_ms),
                 "--max-batch-mb", str(args.max_batch_mb)]
        if self.traced:
            cmd = [sys.executable, __file__, "_serve", self.counts_path, *serve]
        else:
            cmd = [sys.executable, "-c", "import sys; from trajstore.cli import main; sys.exit(main())", "serve", *serve]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "TRAJSTORE_TOKEN": TOKEN})
        import urllib.request

        for _ in range(2400):
            if self.proc.poll() is not None:
                raise RuntimeError(f"ingest service exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(f"{self.url}/healthz", timeout=1)
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("ingest service did not start")

    def metrics(self) -> dict[str, int]:
        """The service's counters (its ``/metrics``): store transactions, the requests they
        held, acknowledged requests, events stored."""
        import urllib.request

        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=30).read().decode()
        names = {"trajstore_ingest_commits_total": "commits",
                 "trajstore_ingest_committed_requests_total": "committed_requests",
                 'trajstore_ingest_requests_total{status="200"}': "requests_200",
                 "trajstore_ingest_events_total": "events",
                 "trajstore_ingest_duplicate_events_total": "duplicate_events"}
        out = dict.fromkeys(names.values(), 0)
        for line in text.splitlines():
            key, _, value = line.rpartition(" ")
            if key in names:
                out[names[key]] += int(float(value))
        return out

    def round_trips(self) -> dict | None:
        if not self.traced:
            return None
        Path(self.counts_path).unlink(missing_ok=True)
        self.proc.send_signal(signal.SIGUSR1)
        for _ in range(600):
            if os.path.exists(self.counts_path):
                return json.loads(Path(self.counts_path).read_text())
            time.sleep(0.05)
        raise RuntimeError("the traced service wrote no round-trip counts")

    def close(self) -> None:
        stop(self.proc)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- a client ("proxy") ------------------------------------------------------------

class Plan:
    """The shapes of one client's trajectories: sizes drawn per trajectory and per
    call; arrays are views of the client's random buffers."""

    def __init__(self, args: argparse.Namespace, client: int) -> None:
        rng = np.random.default_rng([7, client])
        self.rng = rng
        self.tokens = rng.integers(0, 150_000, BUFFER_TOKENS, dtype=np.int32)
        self.logprobs = -rng.random(BUFFER_TOKENS, dtype=np.float32)
        base = rng.integers(0, EXPERTS, (BUFFER_TOKENS, LAYERS, 1), dtype=np.uint8)
        self.routes = (base + np.arange(TOPK, dtype=np.uint8)) % EXPERTS  # top-k distinct per layer
        self.args = args
        self.client = client
        self.lock = threading.Lock()
        self.next_trajectory = 0

    def trajectory(self) -> tuple[str, list[tuple[int, int, int]]]:
        """A trajectory id and its calls: (offset in the buffers, prompt length, output length)."""
        a = self.args
        with self.lock:
            i = self.next_trajectory
            self.next_trajectory += 1
            prompt = int(self.rng.integers(a.prompt[0], a.prompt[1] + 1))
            outs = self.rng.integers(a.output[0], a.output[1] + 1, a.turns)
            obs = self.rng.integers(a.observation[0], a.observation[1] + 1, a.turns)
            total = prompt + int(outs.sum() + obs[1:].sum())
            offset = int(self.rng.integers(0, BUFFER_TOKENS - total))
        calls, p = [], prompt
        for k in range(a.turns):
            if k:
                p += int(obs[k])
            calls.append((offset, p, int(outs[k])))
            p += int(outs[k])
        return f"c{self.client}-t{i}", calls

    def events(self, tid: str, calls: list, k: int) -> tuple[list[dict], int]:
        """The body's events of call ``k`` and its new (unique) tokens."""
        off, p, o = calls[k]
        seq_end = off + p + o
        prev_end = off + (calls[k - 1][1] + calls[k - 1][2] if k else 0)
        route_start = 0 if (self.args.routes == "all" or k == 0) else calls[k - 1][1] + calls[k - 1][2]
        gen = {"type": "generation", "trajectory_id": tid, "seq": k, "model_version": 1,
               "prompt_ids": self.tokens[off:off + p], "output_ids": self.tokens[off + p:seq_end],
               "logprobs": self.logprobs[off + p:seq_end],
               "routed_experts": self.routes[off + route_start:seq_end - 1]}
        if route_start:
            gen["routed_experts_start"] = route_start
        events = [gen]
        if k == 0:
            events.insert(0, {"type": "trajectory_started", "trajectory_id": tid, "num_experts": EXPERTS})
        if k == len(calls) - 1:
            events += [{"type": "reward", "trajectory_id": tid, "reward": 1.0},
                       {"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}]
        return events, seq_end - prev_end


def client_main(argv: list[str]) -> None:
    """One "proxy": paced calls from ``--concurrency`` threads; prints a JSON summary."""
    from trajstore.ingest.arrow_body import encode_arrow_events
    from trajstore.ingest.sinks import HttpSink, encode_events

    args = parse_args(argv)
    plan = Plan(args, args.index)
    lock = threading.Lock()
    state = {"ticket": 0, "calls": 0, "tokens": 0, "failed": 0, "bytes": 0, "finishes": 0}
    latencies: list[float] = []
    errors: list[str] = []
    n_calls = int(args.rate * args.seconds)
    progress = Path(args.progress)
    progress.with_suffix(".ready").write_text("")  # buffers made, imports done: the bench says when to start
    go = progress.with_name("go")
    while not go.exists():
        time.sleep(0.02)
    start = float(go.read_text())
    end = start + args.seconds

    def ticket() -> float | None:
        """The due time of the next call; None once every call was taken or the run's
        time is over (calls not yet taken then were offered, never sent: ``missed``)."""
        with lock:
            i = state["ticket"]
            if i >= n_calls or time.time() >= end:
                return None
            state["ticket"] += 1
        return start + i / args.rate

    def worker() -> None:
        sink = HttpSink(args.url, token=TOKEN, body=args.body)
        encode = encode_arrow_events if args.body == "arrow" else encode_events
        try:
            while True:
                tid, calls = plan.trajectory()
                for k in range(len(calls)):
                    due = ticket()
                    if due is None:
                        if k:  # the run ends: the trajectory finishes without its remaining calls
                            body = encode([{"type": "trajectory_finished", "trajectory_id": tid,
                                            "status": "completed"}])
                            status, data = sink.post(body)
                            with lock:
                                state["finishes"] += 1
                                if status != 200:
                                    errors.append(f"finish {status}: {data[:200]!r}")
                        return
                    wait = due - time.time()
                    if wait > 0:
                        time.sleep(wait)
                    events, new_tokens = plan.events(tid, calls, k)
                    t0 = time.perf_counter()
                    body = encode(events)
                    status, data = sink.post(body)
                    took = time.perf_counter() - t0
                    with lock:
                        state["bytes"] += len(body)
                        if status == 200:
                            state["calls"] += 1
                            state["tokens"] += new_tokens
                            latencies.append(took)
                        else:
                            state["failed"] += 1
                            errors.append(f"{status}: {data[:200]!r}")
                    if status != 200:
                        break  # the trajectory is broken: start another
        finally:
            sink.close()

    def report_progress(done: threading.Event) -> None:
        while True:
            stopping = done.wait(0.5)
            with lock:
                line = json.dumps({"calls": state["calls"], "tokens": state["tokens"]})
            progress.with_suffix(".tmp").write_text(line)
            os.replace(progress.with_suffix(".tmp"), progress)
            if stopping:  # the final counts written
                return

    time.sleep(max(0.0, start - time.time()))
    cpu0, t0 = cpu_s(), time.time()
    done = threading.Event()
    reporter = threading.Thread(target=report_progress, args=(done,), daemon=True)
    reporter.start()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.time() - t0, cpu_s() - cpu0
    done.set()
    reporter.join()
    print(json.dumps({**state, "offered": n_calls, "missed": n_calls - state["ticket"], "wall_s": wall, "cpu_s": cpu, "latencies_s": latencies,
                      "errors": errors[:5], "num_errors": len(errors)}))


# -- the run -----------------------------------------------------------------------

def bucket_state(s3, bucket: str, prefix: str) -> tuple[dict, int]:
    """(objects and bytes by kind, ListObjects pages used) of the payload in the bucket."""
    from _moto import key_kind

    out: Counter = Counter()
    pages = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        pages += 1
        for obj in page.get("Contents", []):
            kind = key_kind(obj["Key"])
            out[f"{kind}_objects"] += 1
            out[f"{kind}_bytes"] += obj["Size"]
            out["objects"] += 1
            out["bytes"] += obj["Size"]
    return dict(out), pages


def pending(url: str) -> int:
    """Finished trajectories the materializer has not folded yet (after its checkpoint)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(
                "SELECT count(*) FROM events WHERE type = 'trajectory_finished' AND position > "
                "(SELECT coalesce(min(position), -1) FROM materializer_checkpoints)")).scalar())
    finally:
        engine.dispose()


def index_counts(url: str) -> dict:
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            gen, seg = conn.execute(text("SELECT count(*), count(DISTINCT segment) FROM events "
                                         "WHERE type = 'generation'")).one()
            total = conn.execute(text("SELECT count(*) FROM events")).scalar()
            samples = conn.execute(text("SELECT count(*) FROM samples")).scalar()
            folded = conn.execute(text(
                "SELECT count(*) FROM events WHERE type = 'generation' AND trajectory_id IN "
                "(SELECT trajectory_id FROM events WHERE type = 'trajectory_finished' AND position <= "
                "(SELECT coalesce(min(position), -1) FROM materializer_checkpoints))")).scalar()
    finally:
        engine.dispose()
    return {"generation_events": int(gen), "events": int(total), "samples": int(samples),
            "generation_events_folded": int(folded)}


def postmaster_pid(cluster) -> int:
    return int((cluster.data_dir / "postmaster.pid").read_text().split()[0])


def run(args: argparse.Namespace) -> dict:
    from _moto import MotoS3, s3_requests

    sys.path.insert(0, str(TESTS))
    result: dict = {"args": {k: v for k, v in vars(args).items()}, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "loadavg_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench-load-") as d:
        work = Path(d)
        moto = MotoS3(work)
        cluster = None
        procs: list[subprocess.Popen] = []
        service = None
        try:
            if args.backend == "postgres":
                from pg_cluster import PgCluster

                cluster = PgCluster()
                cluster.start()
                store = cluster.create_database("bench")
            else:
                store = f"sqlite:///{work}/index.db"
            payload = moto.uri("run")
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
            os.environ.update(PYTHONPATH=env["PYTHONPATH"])
            service = Service(work, store, payload, args)
            # one call off the clock: imports, connections, the service's first-request paths
            from trajstore.ingest.sinks import HttpSink

            warm = HttpSink(service.url, token=TOKEN)
            warm.send([{"type": "trajectory_started", "trajectory_id": "warm", "num_experts": EXPERTS},
                       {"type": "generation", "trajectory_id": "warm", "seq": 0, "model_version": 1,
                        "prompt_ids": np.arange(8, dtype=np.int32), "output_ids": np.arange(4, dtype=np.int32),
                        "logprobs": np.zeros(4, np.float32),
                        "routed_experts": np.zeros((11, LAYERS, TOPK), np.uint8)},
                       {"type": "trajectory_finished", "trajectory_id": "warm", "status": "completed"}])
            warm.close()
            materializer = subprocess.Popen([sys.executable, str(REPO / "workers" / "materializer.py"), "--store", store],
                                            stdout=subprocess.DEVNULL)
            procs.append(materializer)
            s3 = moto.client()
            time.sleep(2.0)  # the materializer up, the warm call folded
            client_cmd = [sys.executable, __file__, "_client", "--url", service.url]
            passed = ["--rate", str(args.rate), "--seconds", str(args.seconds), "--turns", str(args.turns),
                      "--concurrency", str(args.concurrency), "--routes", args.routes, "--body", args.body,
                      "--prompt", "%d-%d" % args.prompt, "--output", "%d-%d" % args.output,
                      "--observation", "%d-%d" % args.observation]
            clients = [subprocess.Popen(client_cmd + passed + ["--index", str(k), "--progress", str(work / f"p{k}.json")],
                                        stdout=subprocess.PIPE, env=env, text=True) for k in range(args.clients)]
            procs.extend(clients)
            while not all((work / f"p{k}.ready").exists() for k in range(args.clients)):
                if any(c.poll() is not None for c in clients):
                    raise RuntimeError("a client exited before the start")
                time.sleep(0.05)
            start_at = time.time() + 0.5
            (work / "go.tmp").write_text(repr(start_at))
            os.replace(work / "go.tmp", work / "go")
            time.sleep(max(0.0, start_at - time.time()))
            pids = {"service": service.proc.pid, "materializer": materializer.pid, "moto": moto.proc.pid}
            if cluster is not None:
                pids["postgres"] = postmaster_pid(cluster)
            cpu0 = {k: cpu_s(p) for k, p in pids.items()}
            initial, _ = bucket_state(s3, moto.bucket, "run")  # marker, warm-up objects
            list_pages = 0
            log0 = moto.log_offset()
            metrics0, trips0 = service.metrics(), service.round_trips()
            t0 = time.time()
            samples: list[dict] = []

            def progress() -> tuple[int, int]:
                calls = tokens = 0
                for k in range(args.clients):
                    try:
                        p = json.loads((work / f"p{k}.json").read_text())
                    except (OSError, ValueError):
                        continue
                    calls, tokens = calls + p["calls"], tokens + p["tokens"]
                return calls, tokens

            def sample(phase: str) -> None:
                nonlocal list_pages
                calls, tokens = progress()
                state, pages = bucket_state(s3, moto.bucket, "run")
                list_pages += pages
                samples.append({"t_s": round(time.time() - t0, 1), "phase": phase, "calls": calls, "tokens": tokens,
                                **state})
                if not args.quiet:
                    print_sample(samples[-1], len(samples) == 1)

            next_sample = t0 + args.sample_s
            while any(c.poll() is None for c in clients):
                time.sleep(0.1)
                if time.time() >= next_sample:
                    sample("load")
                    next_sample += args.sample_s
            outs = []
            for c in clients:
                out = c.communicate()[0].strip().splitlines()
                if c.returncode or not out:
                    raise RuntimeError(f"a client failed (exit {c.returncode})")
                outs.append(json.loads(out[-1]))
            load_end = time.time()
            metrics1, trips1 = service.metrics(), service.round_trips()
            # drain: the materializer folds what is left and its GC deletes the retired segments
            drain_end = time.time() + args.drain_s
            last = None
            while time.time() < drain_end:
                time.sleep(min(args.sample_s, 2.0))
                sample("drain")
                now = (samples[-1].get("events_objects", 0), samples[-1].get("samples_objects", 0))
                if now == last and pending(store) == 0:
                    break  # everything folded, nothing deleted since the last look
                last = now
            result["drained"] = pending(store) == 0
            cpu = {k: cpu_s(p) - cpu0[k] for k, p in pids.items()}
            wall = time.time() - t0
            time.sleep(0.5)
            ops, made = s3_requests(moto.log_path, log0)
            ops["ListObjects"] -= list_pages  # the bench's own listings
            final, _ = bucket_state(s3, moto.bucket, "run")
            index = index_counts(store)
        finally:
            for p in procs:
                stop(p)
            if service is not None:
                service.close()
            if cluster is not None:
                cluster.stop()
            moto.close()
    result["loadavg_end"] = os.getloadavg()
    calls = sum(o["calls"] for o in outs)
    lat = np.array([x for o in outs for x in o["latencies_s"]]) * 1e3
    n = max(calls, 1)
    result.update(
        calls_offered=sum(o["offered"] for o in outs), calls_missed=sum(o["missed"] for o in outs),
        calls_acknowledged=calls,
        calls_failed=sum(o["failed"] for o in outs), errors=[e for o in outs for e in o["errors"]][:5],
        trajectories_cut_short=sum(o["finishes"] for o in outs),
        load_s=load_end - t0, wall_s=wall, achieved_calls_per_s=calls / (load_end - t0),
        tokens_acknowledged=sum(o["tokens"] for o in outs), body_bytes=sum(o["bytes"] for o in outs),
        ack_ms={"p50": float(np.percentile(lat, 50)) if len(lat) else None,
                "p99": float(np.percentile(lat, 99)) if len(lat) else None},
        client_cpu_s=sum(o["cpu_s"] for o in outs), server_cpu_s=cpu,
        index=index, warmup_calls=1,
        service_metrics={k: metrics1[k] - metrics0[k] for k in metrics1},
        batches=metrics1["commits"] - metrics0["commits"],
        s3_requests=dict(sorted((k, v) for k, v in ops.items() if v)),
        objects_made=dict(made), objects_left=final.get("objects", 0),
        bytes_at_rest=samples,
    )
    result["objects_made_total"] = sum(made.values())
    result["objects_at_start"] = initial.get("objects", 0)
    result["objects_deleted"] = result["objects_at_start"] + result["objects_made_total"] - final.get("objects", 0)
    result["calls_per_batch"] = calls / max(1, result["batches"])
    result["requests_per_batch"] = result["service_metrics"]["committed_requests"] / max(1, result["batches"])
    result["calls_per_log_object"] = calls / max(1, made.get("events", 0) + made.get("events+multipart", 0))
    if trips0 is not None:
        d = {k: trips1[k] - trips0.get(k, 0) for k in trips1}
        result["pg_service"] = d
        result["round_trips_per_batch"] = d["round_trips"] / max(1, result["batches"])
    # the materializer's CPU per call it folded (it may not have folded every call when the drain ends)
    folded = max(1, index["generation_events_folded"] - result["warmup_calls"])
    per_call = {"client_cpu_ms": result["client_cpu_s"] / n * 1e3,
                **{f"{k}_cpu_ms": v / (folded if k == "materializer" else n) * 1e3 for k, v in cpu.items()},
                **{f"s3_{k}": v / n for k, v in result["s3_requests"].items()},
                "objects_made": result["objects_made_total"] / n, "objects_deleted": result["objects_deleted"] / n,
                "batches": result["batches"] / n}
    if "pg_service" in result:
        per_call["pg_round_trips"] = result["pg_service"]["round_trips"] / n
    result["per_call"] = per_call
    P = args.project
    proj = {"calls_per_s": P,
            "formula": f"projected(X) = X measured / calls (acknowledged; the materializer's: folded) x {P:g} calls/s "
                       "(cores = CPU s per call x rate; requests/s = requests per call x rate)"}
    for k, v in per_call.items():
        if k.endswith("_cpu_ms"):
            proj[k.replace("_cpu_ms", "_cores")] = v / 1e3 * P
        else:
            proj[f"{k}_per_s"] = v * P
    proj["trajstore_cores"] = sum(proj[k] for k in ("client_cores", "service_cores", "materializer_cores"))
    proj["s3_requests_per_s"] = sum(v for k, v in proj.items() if k.startswith("s3_"))
    proj["s3_write_requests_per_s"] = sum(proj.get(f"s3_{k}_per_s", 0) for k in
                                          ("PutObject", "UploadPart", "CreateMultipartUpload",
                                           "CompleteMultipartUpload", "DeleteObjects", "DeleteObject"))
    result["projection"] = proj
    return result


def print_sample(s: dict, header: bool) -> None:
    if header:
        print(f"{'t (s)':>6} {'phase':>5} {'calls':>6} {'tokens':>9} {'objects':>7} {'events MB':>9} "
              f"{'samples MB':>10} {'B/token':>8} {'rest/samples':>12}", flush=True)
    tok = max(s["tokens"], 1)
    copies = s.get("bytes", 0) / s["samples_bytes"] if s.get("samples_bytes") else float("nan")
    print(f"{s['t_s']:6.1f} {s['phase']:>5} {s['calls']:6d} {s['tokens']:9d} {s.get('objects', 0):7d} "
          f"{s.get('events_bytes', 0) / 1e6:9.1f} {s.get('samples_bytes', 0) / 1e6:10.1f} "
          f"{s.get('bytes', 0) / tok:8.1f} {copies:12.2f}", flush=True)


def summary(r: dict) -> str:
    a = r["args"]
    pc, pr = r["per_call"], r["projection"]
    lines = [
        f"bench_load: {a['clients']} clients x {a['rate']:g} calls/s x {a['seconds']:g} s, {a['turns']} turns, "
        f"prompt {a['prompt']} + obs {a['observation']} tokens/turn, output {a['output']}, routes {LAYERS}x{TOPK} "
        f"({a['routes']}), {a['body']} bodies; {a['backend']} + S3 (moto); linger {a['linger_ms']:g} ms; "
        f"{r['date']}, load average {r['loadavg_start'][0]:.2f} -> {r['loadavg_end'][0]:.2f}",
        f"calls: offered {r['calls_offered']}, acknowledged {r['calls_acknowledged']} "
        f"({r['achieved_calls_per_s']:.1f}/s), failed {r['calls_failed']}, not sent in time {r['calls_missed']}; "
        f"drained {r['drained']}; index: {r['index']['generation_events']} "
        f"generation events ({r['warmup_calls']} warm-up), {r['index']['generation_events_folded']} of them folded, "
        f"{r['index']['samples']} samples; "
        f"ack p50 {r['ack_ms']['p50'] or 0:.0f} ms, p99 {r['ack_ms']['p99'] or 0:.0f} ms; "
        f"{r['body_bytes'] / max(1, r['calls_acknowledged']) / 1e3:.0f} KB body/call, "
        f"{r['tokens_acknowledged'] / max(1, r['calls_acknowledged']):.0f} new tokens/call",
        f"batches {r['batches']} ({r['calls_per_batch']:.1f} calls, {r['requests_per_batch']:.1f} requests each; "
        f"{r['trajectories_cut_short']} trajectories cut short); log objects "
        f"{r['objects_made'].get('events', 0) + r['objects_made'].get('events+multipart', 0)} "
        f"({r['calls_per_log_object']:.1f} calls each); objects made {r['objects_made_total']} "
        f"{r['objects_made']}, deleted {r['objects_deleted']}, left {r['objects_left']} "
        f"({r['objects_at_start']} before the load: marker, warm-up)",
    ]
    if "pg_service" in r:
        d = r["pg_service"]
        lines.append(f"PostgreSQL (service, libpq trace): {d['round_trips']} round trips, {d['commits']} COMMITs, "
                     f"{d['pings']} pings over {r['batches']} batches: {r['round_trips_per_batch']:.2f} round trips "
                     f"per committed batch")
    lines.append("S3 requests (moto log, all clients): " + ", ".join(f"{k} {v}" for k, v in r["s3_requests"].items()))
    lines.append("per call: " + ", ".join(f"{k} {v:.3g}" for k, v in pc.items()))
    lines.append(f"projection to {pr['calls_per_s']:g} calls/s: {pr['formula']}")
    lines.append("  cores: " + ", ".join(f"{k[:-6]} {v:.2f}" for k, v in pr.items() if k.endswith("_cores")))
    lines.append("  per s: " + ", ".join(f"{k[:-6]} {v:,.0f}" for k, v in pr.items()
                                          if k.endswith("_per_s") and k != "calls_per_s"))
    return "\n".join(lines)


def summary_rows(r: dict) -> list[dict[str, str]]:
    """docs/benchmarks.md's rows of this run (bench/summary.py reads them from ``--json``)."""
    a, pc, pr = r["args"], r["per_call"], r["projection"]
    section = "[Load generator](benchmarks-history.md#load-generator--benchbench_loadpy)"
    calls = max(1, r["calls_acknowledged"])
    rest = r["bytes_at_rest"][-1] if r["bytes_at_rest"] else None
    at_rest = ""
    if rest and rest.get("tokens"):
        copies = rest["bytes"] / rest["samples_bytes"] if rest.get("samples_bytes") else float("nan")
        at_rest = f"; {rest['bytes'] / rest['tokens']:.1f} B/token ({copies:.2f} copies) after the drain"
    return [
        {"what": f"load generator: {a['clients']} proxies × {a['rate']:g} calls/s × {a['seconds']:g} s through "
                 f"`trajstore serve` + {'PostgreSQL' if a['backend'] == 'postgres' else 'SQLite'} + S3 (moto) + the "
                 f"materializer, {LAYERS}×{TOPK} routes ({a['routes']} rows), "
                 f"≈{r['tokens_acknowledged'] / calls:.0f} new tokens/call",
         "figure": f"achieved {r['achieved_calls_per_s']:.1f} calls/s (load average {r['loadavg_start'][0]:.1f}–"
                   f"{r['loadavg_end'][0]:.1f}); CPU per call: proxy {pc['client_cpu_ms']:.2f} ms, service "
                   f"{pc['service_cpu_ms']:.2f} ms, materializer {pc['materializer_cpu_ms']:.2f} ms"
                   + (f", PostgreSQL {pc['postgres_cpu_ms']:.2f} ms" if "postgres_cpu_ms" in pc else "")
                   + (f"; {r['round_trips_per_batch']:.2f} round trips per batch" if "round_trips_per_batch" in r else "")
                   + f"{at_rest}; projection to {pr['calls_per_s']:,.0f} calls/s: "
                   f"{pr['trajstore_cores']:.1f} trajstore cores (proxies {pr['client_cores']:.1f}, service "
                   f"{pr['service_cores']:.1f}, materializer {pr['materializer_cores']:.1f})"
                   + (f", PostgreSQL {pr['postgres_cores']:.1f}" if "postgres_cores" in pr else "")
                   + f", {pr.get('s3_requests_per_s', 0):,.0f} S3 requests/s",
         "baseline": "— (per-call costs; linear projection, an upper bound for requests)", "section": section},
        {"what": "the fold's S3 reads, same load generator",
         "figure": f"{pc.get('s3_GetObject', 0):.3f} `GetObject` per call; all S3 requests projected to "
                   f"{pr['calls_per_s']:,.0f} calls/s: {pr.get('s3_requests_per_s', 0):,.0f}/s",
         "baseline": "—", "section": section},
    ]


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=2, help="client processes (\"proxies\")")
    p.add_argument("--rate", type=float, default=50.0, help="engine calls per second offered by each client")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--turns", type=int, default=4, help="engine calls per trajectory")
    p.add_argument("--concurrency", type=int, default=16, help="calls in flight at most per client")
    p.add_argument("--prompt", type=span, default=(200, 600), help="first prompt tokens, a range LO-HI")
    p.add_argument("--output", type=span, default=(100, 1000), help="output tokens per call, a range")
    p.add_argument("--observation", type=span, default=(50, 200), help="tokens added to the prompt per turn")
    p.add_argument("--routes", choices=("new", "all"), default="new")
    p.add_argument("--body", choices=("arrow", "json"), default="arrow")
    p.add_argument("--backend", choices=("postgres", "sqlite"), default="postgres")
    p.add_argument("--linger-ms", type=float, default=20.0)
    p.add_argument("--max-batch-mb", type=float, default=32.0)
    p.add_argument("--no-trace", action="store_true", help="run the service untraced (no round-trip counts)")
    p.add_argument("--sample-s", type=float, default=5.0, help="bytes at rest sampled this often")
    p.add_argument("--drain-s", type=float, default=45.0, help="after the load, wait this long at most for the "
                                                                 "materializer and its GC to settle")
    p.add_argument("--project", type=float, default=3300.0, help="calls/s to project the per-call costs to")
    p.add_argument("--json", default=None, help="write the full report here")
    p.add_argument("--quiet", action="store_true")
    # the client mode's own
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--progress", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    if sys.argv[1:2] == ["_serve"]:
        serve_traced(sys.argv[2], sys.argv[3:])
        return
    if sys.argv[1:2] == ["_client"]:
        client_main(sys.argv[2:])
        return
    args = parse_args()
    r = run(args)
    print(summary(r), flush=True)
    if args.json:
        # what bench/summary.py puts in docs/benchmarks.md: the command, its date and load, the rows
        r.update(command=" ".join(["bench/bench_load.py", *sys.argv[1:]]), loadavg=r["loadavg_start"],
                 summary=summary_rows(r))
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(r, indent=2, default=str))


if __name__ == "__main__":
    main()
