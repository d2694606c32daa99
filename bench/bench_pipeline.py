"""The whole pipeline on the load RL produces, each path beside its baseline.

    PYTHONPATH=. .venv/bin/python bench/bench_pipeline.py [--rounds 3] [--only append,materialize,...]

Load: 32 trajectories x 4 turns, a 100-token first prompt, then
per turn 500 output tokens and (between turns) 100 observation tokens, so
2,400 unique tokens per trajectory; 48 layers x top-8 routes (uint8 ids <
128); every generation carries ALL route rows for its prompt and output, as
vLLM returns them. Events are wire dicts: token ids and logprobs as
``{b64, dtype, shape}``, routes as a base64 ``.npy`` string (vLLM's form).
Encoding happens before any clock starts.

Paths, each run interleaved with its baseline, ``--rounds`` times, median:

* append: ``store.append`` of the wire events (one call per trajectory, one
  call per event, and the events turn-major in calls of ``BATCH_EVENTS``: event
  k of every trajectory, then event k+1, what a busy Writer or the service
  sends when 32 trajectories generate at once; that store is deleted after each
  round, so page-cache pages are reused as in a steady store; and the same calls
  sending only the route rows not recorded yet, ``NEW_ROWS_APPEND``, the bound of any
  saving on the re-sent rows) vs writing the
  unique arrays (tokens, logprobs, routes) to one uncompressed Parquet file +
  fsync;
* bytes per unique token of the whole store after materialize (log payload +
  sample payload + SQL files), and again after ``collect_garbage(grace_s=0)``
  (the log segments whose events the materializer re-pointed are gone);
* materialize end to end (``store.materialize()``) vs the same sample arrays
  written uncompressed to Parquet + fsync;
* read, warm: ``store.samples()`` and ``SampleReader`` vs
  ``pyarrow.parquet.read_table`` of that uncompressed file; each also with
  "every page touched" (one byte of every 4 KiB page of the arrays read: the
  reader's arrays are views of a memory map, this pays for their page faults);
* HTTP ingest of ~1-MiB events (one service process, 8 client threads on
  the same machine, bodies encoded before the clock), JSON body (routes as
  base64 .npy) and Arrow IPC body interleaved; events/s counts acknowledged
  (200) requests only; service and client CPU per event are reported apart;
* the materializer's poll with nothing to do and 100k unfinished events
  after its checkpoint, SQLite and PostgreSQL (tests/pg_cluster.PgCluster);
* bytes: bytes per unique token of whole stores of ``--bytes-sizes``
  trajectories (appended 32 at a time, one call per trajectory), right after
  ``materialize`` and ``collect_garbage(grace_s=0)`` with the store open, and
  at rest (closed);
* memory: peak RSS of materializing (batches capped at 32k tokens) and of
  reading every sample (``store.samples()``, ``SampleReader``, every page
  touched) of stores of 1x, 4x and 16x ``--memory-base`` trajectories, each
  in a fresh subprocess (the peak reset after imports, ``/proc/self/clear_refs``).

Tokens/s figures count unique tokens (samples' tokens for materialize/read);
``tokens_per_cpu_s`` divides by this process's CPU seconds (all threads),
steadier than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import trajstore  # noqa: E402
from trajstore.events._wire import encode_b64, encode_npy_b64  # noqa: E402
from trajstore.demo._simulate import RolloutConfig, trajectory_events  # noqa: E402
from trajstore.payload._columns import binary_column, list_column  # noqa: E402
from _proc import cpu_s, reset_peak_rss  # noqa: E402  (bench/ is on sys.path when run as a script)

CFG = RolloutConfig(turns=4, prompt_tokens=100, output_tokens=500, observation_tokens=100, layers=48, topk=8,
                    num_experts=128, mismatch_prob=0.0, abort_prob=0.0, fail_prob=0.0, route_drift=0.0)
TRAJECTORIES = 32
POLL_EVENTS = 100_000
TOKEN = "bench-token"
PATHS = ("append", "materialize", "read", "bytes", "http", "poll", "memory")
BATCH_EVENTS = 64  # events per store.append of the turn-major append (what a busy Writer sends)
BATCH_APPEND = f"append, calls of {BATCH_EVENTS} events turn-major"
NEW_ROWS_APPEND = f"append, new route rows only, calls of {BATCH_EVENTS} events turn-major"
"""The same calls, each sending only the route rows its trajectory has not recorded
(``routed_experts_start``): the bound of any saving on the re-sent rows."""
BYTES_SIZES = "1,2,4,8,16,32,64,256"
MEMORY_SCALES = (1, 4, 16)
MEMORY_BATCH_TOKENS = 32_768  # the materializer's batch cap in the memory runs: the 1x store already spans two batches


# -- the load ---------------------------------------------------------------
def arrays_load(n: int, start: int = 0) -> list[list[dict]]:
    """The simulated trajectories ``start .. start+n-1`` with near-random routes
    (top-8 distinct ids of 128 per layer), each call re-sending rows 0..N-2 of one
    per-trajectory table."""
    out = []
    for i in range(start, start + n):
        events = trajectory_events(CFG, i)
        rng = np.random.default_rng([99, i])
        longest = max(len(e["routed_experts"]) for e in events if e["type"] == "generation")
        table = np.argpartition(rng.random((longest, CFG.layers, CFG.num_experts), dtype=np.float32),
                                CFG.topk, axis=-1)[..., :CFG.topk].astype(np.uint8)
        out.append([dict(e, routed_experts=table[:len(e["routed_experts"])]) if e["type"] == "generation" else e
                    for e in events])
    return out


def to_wire(events: list[dict]) -> list[dict]:
    out = []
    for e in events:
        if e["type"] == "generation":
            e = dict(e, prompt_ids=encode_b64(e["prompt_ids"]), output_ids=encode_b64(e["output_ids"]),
                     logprobs=encode_b64(e["logprobs"]), routed_experts=encode_npy_b64(e["routed_experts"]))
        out.append(e)
    return out


def new_rows_only(events: list[dict]) -> list[dict]:
    """The trajectory's events with each generation's routes cut to the rows past the
    previous call's (``routed_experts_start`` set): what an engine asked for only new rows sends."""
    out, seen = [], 0
    for e in events:
        if e["type"] == "generation":
            rows = e["routed_experts"]
            e = dict(e, routed_experts=rows[seen:], routed_experts_start=seen)
            seen = len(rows)
        out.append(e)
    return out


def turn_major(wire: list[list[dict]], batch: int) -> list[list[dict]]:
    """The trajectories' events interleaved turn by turn (event k of every trajectory,
    then event k+1), in calls of ``batch`` events."""
    flat = [t[k] for k in range(max(map(len, wire))) for t in wire if k < len(t)]
    return [flat[i:i + batch] for i in range(0, len(flat), batch)]


def _remove(*paths: str) -> None:
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def unique_table(trajs: list[list[dict]]) -> pa.Table:
    """One row per trajectory: its final sequence, all logprobs, the routes of every position once."""
    seqs, lps, routes = [], [], []
    for t in trajs:
        gens = [e for e in t if e["type"] == "generation"]
        seqs.append(np.concatenate([gens[-1]["prompt_ids"], gens[-1]["output_ids"]]))
        lps.append(np.concatenate([g["logprobs"] for g in gens]))
        routes.append(gens[-1]["routed_experts"])
    return pa.table({"tokens": list_column(seqs, np.int32), "logprobs": list_column(lps, np.float32),
                     "routes": binary_column(routes)})


def sample_arrays_table(store) -> pa.Table:
    """The materialized samples' arrays as a plain table (the raw baseline for materialize/read)."""
    ss = list(store.samples())
    return pa.table({
        "prompt_ids": list_column([s.prompt_ids for s in ss], np.int32),
        "response_ids": list_column([s.response_ids for s in ss], np.int32),
        "loss_mask": list_column([s.loss_mask for s in ss], np.uint8),
        "rollout_logprobs": list_column([s.rollout_logprobs for s in ss], np.float32),
        "routed_experts": binary_column([s.routed_experts for s in ss]),
    })


class Clock:
    """Wall and CPU (this process, all threads) seconds per path, over rounds."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0, c0 = time.perf_counter(), time.process_time()
        yield
        self.wall.setdefault(name, []).append(time.perf_counter() - t0)
        self.cpu.setdefault(name, []).append(time.process_time() - c0)

    def medians(self) -> tuple[dict[str, float], dict[str, float]]:
        return {k: _med(v) for k, v in self.wall.items()}, {k: _med(v) for k, v in self.cpu.items()}


def raw_write(table: pa.Table, path: str) -> None:
    with open(path, "wb") as f:
        pq.write_table(table, f, compression="none")
        f.flush()
        os.fsync(f.fileno())


def raw_read(path: str, touched: bool = False) -> int:
    table = pq.read_table(path)
    if touched:  # one byte of every page of every buffer, as _count does for a sample's arrays
        for col in table.columns:
            for ch in col.chunks:
                for b in ch.buffers():
                    if b is not None and b.size:
                        _touch(np.frombuffer(b, np.uint8))
    return int(sum(len(ch.values) for c in ("prompt_ids", "response_ids") for ch in table.column(c).chunks))


def _count(x, touched: bool) -> int:
    """A sample's tokens; ``touched``: also read one byte of every page of its arrays
    (the reader's arrays are views of a memory map: this pays for their page faults)."""
    if touched:
        for a in (x.prompt_ids, x.response_ids, x.loss_mask, x.rollout_logprobs, x.routed_experts):
            _touch(a)
    return len(x.prompt_ids) + len(x.response_ids)


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _dir_bytes(path: str, prefix: str = "") -> int:
    if not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith(prefix))


def _store_bytes(d: str, r: int, payload: str, tokens: int) -> dict[str, float]:
    """Bytes per unique token of log payload, sample payload and SQL files."""
    return {"log": _dir_bytes(payload, "events-") / tokens, "samples": _dir_bytes(payload, "samples-") / tokens,
            "sql": sum(os.path.getsize(p) for p in (f"{d}/a{r}.db", f"{d}/a{r}.db-wal") if os.path.exists(p)) / tokens}


def _rates(tokens: int, names: list[str], base: str, wall: dict, cpu: dict) -> dict:
    out = {}
    for k in names:
        out[k] = {"tokens_per_s": round(tokens / wall[k]), "tokens_per_cpu_s": round(tokens / cpu[k])}
        if k != base:
            out[k].update(vs_raw=round(wall[base] / wall[k], 3), cpu_vs_raw=round(cpu[base] / cpu[k], 3))
    return out


# -- append, bytes, materialize, read ---------------------------------------
def append_materialize_read(args, out: dict) -> None:
    trajs = arrays_load(TRAJECTORIES)
    wire = [to_wire(t) for t in trajs]
    unique = unique_table(trajs)
    batched = turn_major(wire, BATCH_EVENTS)
    batched_new = turn_major([to_wire(new_rows_only(t)) for t in trajs], BATCH_EVENTS)
    tokens = int(np.diff(np.asarray(unique.column("tokens").chunk(0).offsets)).sum())
    wire_mb = sum(len(json.dumps(t)) for t in wire) / 2**20
    clock = Clock()
    sizes: dict[str, float] = {}
    sizes_gc: dict[str, float] = {}
    sizes_rest: dict[str, float] = {}
    sample_tokens = 0
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        for r in range(args.rounds):
            with clock("raw write unique arrays"):
                raw_write(unique, f"{d}/unique{r}.parquet")
            if "append" in args.only:
                s = trajstore.connect(f"sqlite:///{d}/e{r}.db")
                with clock("append, one call per event"):
                    for t in wire:
                        for e in t:
                            s.append([e])
                s.close()
                for name, calls in ((BATCH_APPEND, batched), (NEW_ROWS_APPEND, batched_new))[::1 - 2 * (r % 2)]:
                    base = f"{d}/b{r}"  # the two forms alternate which goes first
                    s = trajstore.connect(f"sqlite:///{base}.db", payload=f"{base}.payload")
                    with clock(name):
                        for call in calls:
                            s.append(call)
                    s.close()
                    _remove(f"{base}.db", f"{base}.db-wal", f"{base}.db-shm", f"{base}.payload")
            url, payload = f"sqlite:///{d}/a{r}.db", f"{d}/a{r}.payload"
            s = trajstore.connect(url, payload=payload)
            with clock("append, one call per trajectory"):
                for t in wire:
                    s.append(t)
            if not ({"materialize", "read"} & set(args.only)):
                s.close()
                continue
            with clock("materialize"):
                s.materialize()
            samples_tbl = sample_arrays_table(s)
            sample_tokens = int(np.diff(np.asarray(samples_tbl.column("prompt_ids").chunk(0).offsets)).sum()
                                + np.diff(np.asarray(samples_tbl.column("response_ids").chunk(0).offsets)).sum())
            raw_path = f"{d}/samples{r}.parquet"
            with clock("raw write sample arrays"):
                raw_write(samples_tbl, raw_path)
            sizes = _store_bytes(d, r, payload, tokens)
            s.collect_garbage(grace_s=0)  # the log segments the materializer emptied
            sizes_gc = _store_bytes(d, r, payload, tokens)
            # at rest: closing the last connection checkpoints SQLite's WAL into the
            # database file and removes it (open, the WAL holds second copies of pages)
            s.close()
            sizes_rest = _store_bytes(d, r, payload, tokens)
            s = trajstore.connect(url, payload=payload)
            if "read" in args.only:
                from trajstore.reader import SampleReader

                raw_read(raw_path)  # warm
                list(s.samples())
                for _ in range(2):  # two warm reads each, interleaved
                    for touched in (False, True):
                        suffix = ", every page touched" if touched else ""
                        with clock("raw read sample arrays" + suffix):
                            n = raw_read(raw_path, touched)
                        assert n == sample_tokens
                        with clock("store.samples()" + suffix):
                            n = sum(_count(x, touched) for x in s.samples())
                        assert n == sample_tokens
                        with clock("SampleReader" + suffix):
                            with SampleReader(s, batch_size=8) as reader:
                                n = sum(_count(x, touched) for b in reader for x in b)
                        assert n == sample_tokens
            s.close()
    wall, cpu = clock.medians()
    res: dict = {"unique_tokens": tokens, "sample_tokens": sample_tokens, "wire_mib": round(wire_mb, 1),
                 "wall_s_median": {k: round(v, 4) for k, v in wall.items()},
                 "cpu_s_median": {k: round(v, 4) for k, v in cpu.items()}}
    res["append"] = _rates(tokens, [k for k in wall if k.startswith(("append", "raw write unique"))],
                           "raw write unique arrays", wall, cpu)
    if BATCH_APPEND in clock.wall:  # also each round's ratio (its raw write beside it), median
        raw_w, raw_c = clock.wall["raw write unique arrays"], clock.cpu["raw write unique arrays"]
        for name in (BATCH_APPEND, NEW_ROWS_APPEND):
            res["append"][name].update(
                vs_raw_per_round=round(_med([r / a for r, a in zip(raw_w, clock.wall[name])]), 3),
                cpu_vs_raw_per_round=round(_med([r / a for r, a in zip(raw_c, clock.cpu[name])]), 3))
    if "materialize" in wall:
        res["materialize"] = _rates(sample_tokens, ["materialize", "raw write sample arrays"],
                                    "raw write sample arrays", wall, cpu)
        res["bytes_per_unique_token"] = {k: round(v, 1) for k, v in sizes.items()}
        res["bytes_per_unique_token"]["total"] = round(sum(sizes.values()), 1)
        res["bytes_per_unique_token_after_gc"] = {k: round(v, 1) for k, v in sizes_gc.items()}
        res["bytes_per_unique_token_after_gc"]["total"] = round(sum(sizes_gc.values()), 1)
        res["bytes_per_unique_token_after_gc_at_rest"] = {k: round(v, 1) for k, v in sizes_rest.items()}
        res["bytes_per_unique_token_after_gc_at_rest"]["total"] = round(sum(sizes_rest.values()), 1)
    if "SampleReader" in wall:
        res["read"] = _rates(sample_tokens, ["store.samples()", "SampleReader", "raw read sample arrays"],
                             "raw read sample arrays", wall, cpu)
        t = ", every page touched"
        res["read_touched"] = _rates(sample_tokens, ["store.samples()" + t, "SampleReader" + t,
                                                     "raw read sample arrays" + t], "raw read sample arrays" + t,
                                     wall, cpu)
    out["pipeline"] = res


# -- bytes: bytes per unique token of whole stores by size -------------------
def bytes_by_size(args, out: dict) -> None:
    """Bytes per unique token of a store of N trajectories for each N of ``--bytes-sizes``:
    after ``materialize``, right after ``collect_garbage(grace_s=0)`` (store open), at rest."""
    res = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        for n in (int(x) for x in args.bytes_sizes.split(",") if x):
            url, payload = f"sqlite:///{d}/a{n}.db", f"{d}/a{n}.payload"
            s = trajstore.connect(url, payload=payload)
            tokens = 0
            for start in range(0, n, TRAJECTORIES):  # 32 at a time: the load's arrays stay small
                trajs = arrays_load(min(TRAJECTORIES, n - start), start)
                tokens += int(np.diff(np.asarray(unique_table(trajs).column("tokens").chunk(0).offsets)).sum())
                for t in trajs:
                    s.append(to_wire(t))
            s.materialize()
            before = _store_bytes(d, n, payload, tokens)
            s.collect_garbage(grace_s=0)
            after_gc = _store_bytes(d, n, payload, tokens)
            s.close()
            rest = _store_bytes(d, n, payload, tokens)
            res[str(n)] = {"unique_tokens": tokens, **{
                k: {**{part: round(v, 1) for part, v in sizes.items()}, "total": round(sum(sizes.values()), 1)}
                for k, sizes in (("before_gc", before), ("after_gc", after_gc), ("at_rest", rest))}}
            _remove(f"{d}/a{n}.db", f"{d}/a{n}.db-wal", f"{d}/a{n}.db-shm", payload)
    out["bytes_by_store_size"] = res


# -- memory: materialize and read peak RSS at 1x, 4x, 16x the load ------------
def memory(args, out: dict) -> None:
    """Peak RSS of materializing and of reading (``store.samples()``, ``SampleReader``)
    stores of 1x, 4x and 16x the load, each step in a fresh subprocess. The
    stores are built (appended) in children too, so no parent memory is inherited."""
    res = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        for scale in MEMORY_SCALES:
            n = args.memory_base * scale
            url, payload = f"sqlite:///{d}/m{scale}.db", f"{d}/m{scale}.payload"
            _child("build", url, payload, str(n))
            row: dict = {"trajectories": n}
            for step in ("materialize", "samples", "reader"):
                row[step] = _child(step, url, payload, str(n))
            res[f"{scale}x"] = row
    base = res["1x"]
    for scale in MEMORY_SCALES:
        r = res[f"{scale}x"]
        r["growth_vs_1x"] = {k: round(r[k]["peak_growth_mb"] / max(base[k]["peak_growth_mb"], 1e-9), 2)
                             for k in ("materialize", "samples", "reader")}
    out["memory"] = res


def _child(step: str, url: str, payload: str, n: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", step, url, payload, n], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))})
    if proc.returncode != 0:
        raise RuntimeError(f"child {step} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _rss_mb() -> tuple[float, float]:
    """(VmRSS, VmHWM) of this process in MB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _touch(a) -> int:
    """Read one byte of every 4 KiB page (a trainer copies every byte; this makes the pages resident)."""
    return int(a.reshape(-1).view(np.uint8)[::4096].sum())


def child_main(step: str, url: str, payload: str, n: int) -> None:
    from trajstore.materializer import Materializer
    from trajstore.reader import SampleReader

    s = trajstore.connect(url, payload=payload)
    if step == "build":
        for lo in range(0, n, 16):
            for t in arrays_load(min(16, n - lo), start=lo):
                s.append(t)
        s.close()
        print(json.dumps({}))
        return
    reset_peak_rss()  # the peak (VmHWM) from here on
    before, _ = _rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    if step == "materialize":
        Materializer(s, max_batch_tokens=MEMORY_BATCH_TOKENS).run()
    elif step == "samples":
        for x in s.samples():
            tokens += x.num_tokens
            _touch(x.routed_experts)
    else:
        with SampleReader(s, batch_size=8) as reader:
            for batch in reader:
                for x in batch:
                    tokens += x.num_tokens
                    _touch(x.routed_experts)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    _, peak = _rss_mb()
    if step == "materialize":
        tokens = sum(x.num_tokens for x in s.samples())
    s.close()
    print(json.dumps({"rss_before_mb": round(before, 1), "peak_rss_mb": round(peak, 1),
                      "peak_growth_mb": round(peak - before, 1), "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                      "tokens": tokens}))


# -- HTTP ingest --------------------------------------------------------------
def http_ingest(args, out: dict) -> None:
    """events/s and service CPU per event of ~1-MiB events, JSON body (routes as
    base64 .npy) and, when the service has it, the Arrow IPC body; one service
    process per round, both bodies interleaved in it."""
    import http.client

    from trajstore.ingest.sinks import encode_events

    try:
        from trajstore.ingest.arrow_body import ARROW_CONTENT_TYPE, encode_arrow_events
    except ImportError:  # the code before the Arrow body
        ARROW_CONTENT_TYPE, encode_arrow_events = None, None
    rng = np.random.default_rng(7)
    P, O, clients, per = 1500, 500, 8, args.http_requests_per_client

    def event_pair(tid: str, npy_routes: bool) -> list[dict]:
        routes = rng.integers(0, 128, (P + O - 1, 48, 8), dtype=np.uint8)
        return [{"type": "trajectory_started", "trajectory_id": tid, "num_experts": 128},
                {"type": "generation", "trajectory_id": tid, "seq": 0, "model_version": 1,
                 "prompt_ids": rng.integers(0, 150_000, P, dtype=np.int32),
                 "output_ids": rng.integers(0, 150_000, O, dtype=np.int32),
                 "logprobs": -rng.random(O, dtype=np.float32),
                 "routed_experts": encode_npy_b64(routes) if npy_routes else routes}]

    kinds = {"json": ("application/json", lambda evs: encode_events(evs), True)}
    if encode_arrow_events is not None:
        kinds["arrow"] = (ARROW_CONTENT_TYPE, encode_arrow_events, False)
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    cpu_ms: dict[str, list[float]] = {k: [] for k in kinds}
    client_cpu_ms: dict[str, list[float]] = {k: [] for k in kinds}
    body_mib: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        for r in range(args.rounds):
            port = args.port + r
            cmd = [sys.executable, str(REPO / "workers" / "ingest_server.py"), "--store", f"sqlite:///{d}/h{r}.db",
                   "--port", str(port), "--max-body-mb", "64", *args.serve_args]
            proc = subprocess.Popen(cmd, env={**os.environ, "TRAJSTORE_TOKEN": TOKEN, "PYTHONPATH": str(REPO)})
            try:
                _wait_healthy(port, proc)
                for kind, (ctype, encode, npy) in kinds.items():
                    bodies = [[encode(event_pair(f"r{r}-{kind}-c{c}-{k}", npy)) for k in range(per)]
                              for c in range(clients)]
                    body_mib[kind] = round(float(np.mean([len(b) for c in bodies for b in c])) / 2**20, 2)
                    headers = {"Content-Type": ctype, "Authorization": f"Bearer {TOKEN}"}
                    errors: list[str] = []
                    acked = [0] * clients  # requests answered 200 (stored): the only ones counted

                    def client(k: int) -> None:
                        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                        for b in bodies[k]:
                            conn.request("POST", "/v1/events", body=b, headers=headers)
                            resp = conn.getresponse()
                            data = resp.read()
                            if resp.status != 200:
                                errors.append(f"{resp.status} {data[:200]!r}")
                            else:
                                acked[k] += 1
                        conn.close()

                    # one warm-up request off the clock: imports and first-request paths of the service
                    warm = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                    warm.request("POST", "/v1/events", body=encode(event_pair(f"r{r}-{kind}-warm", npy)), headers=headers)
                    warm.getresponse().read()
                    warm.close()
                    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
                    t0, c0, m0 = time.perf_counter(), cpu_s(proc.pid), cpu_s()
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    wall, n = time.perf_counter() - t0, sum(acked)
                    rates[kind].append(n / wall)
                    cpu_ms[kind].append((cpu_s(proc.pid) - c0) / n * 1e3)
                    # the client threads (this process; on the same cores as the service)
                    client_cpu_ms[kind].append((cpu_s() - m0) / n * 1e3)
                    if errors:
                        raise RuntimeError(errors[0])
            finally:
                proc.terminate()
                proc.wait(30)
    out["http"] = {kind: {"events_per_s": round(_med(rates[kind]), 1),
                          "service_cpu_ms_per_event": round(_med(cpu_ms[kind]), 2),
                          "client_cpu_ms_per_event": round(_med(client_cpu_ms[kind]), 2), "body_mib": body_mib[kind]}
                   for kind in kinds}
    out["http"].update(clients=clients, requests_per_client=per, serve_args=args.serve_args)


def _wait_healthy(port: int, proc: subprocess.Popen) -> None:
    import urllib.request

    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError("ingest service exited")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("ingest service did not start")


# -- the materializer's idle poll --------------------------------------------
def seed_checkpoint(store) -> None:
    """One folded trajectory, so the materializer has a checkpoint."""
    store.append(trajectory_events(RolloutConfig(turns=1, prompt_tokens=8, output_tokens=8, layers=2, topk=2), 0))
    store.materialize()


def poll_time(store, polls: int) -> float:
    from trajstore.materializer import Materializer

    m = Materializer(store)
    assert m.step() is None
    ts = []
    for _ in range(polls):
        t0 = time.perf_counter()
        assert m.step() is None
        ts.append(time.perf_counter() - t0)
    return _med(ts)


def explain(store) -> list[str]:
    from sqlalchemy import select

    from trajstore.schema import events

    q = (select(events).where(events.c.position > 1).where(events.c.type.in_(["trajectory_finished"]))
         .order_by(events.c.position).limit(256))
    sql = str(q.compile(store.log.read_engine, compile_kwargs={"literal_binds": True}))
    with store.log.read_engine.connect() as conn:
        if store.log.read_engine.dialect.name == "sqlite":
            return [str(r[-1]) for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql)]
        return [r[0] for r in conn.exec_driver_sql("EXPLAIN ANALYZE " + sql)]


def poll(args, out: dict) -> None:
    res = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        stores = {"sqlite": trajstore.connect(f"sqlite:///{d}/p.db")}
        cluster = None
        if not args.no_postgres:
            sys.path.insert(0, str(REPO / "tests"))
            from pg_cluster import PgCluster

            cluster = PgCluster()
            cluster.start()
            cluster.create_database("poll")
            stores["postgresql"] = trajstore.connect(cluster.url("poll"), payload=f"{d}/pg.payload")
        try:
            for name, s in stores.items():
                seed_checkpoint(s)
            idle = {name: [] for name in stores}
            for _ in range(args.rounds):
                for name, s in stores.items():
                    idle[name].append(poll_time(s, 20))
            for name, s in stores.items():
                insert_unfinished(s, POLL_EVENTS)
            busy = {name: [] for name in stores}
            for _ in range(args.rounds):
                for name, s in stores.items():
                    busy[name].append(poll_time(s, 20))
            for name, s in stores.items():
                res[name] = {"empty_log_ms": round(_med(idle[name]) * 1e3, 3),
                             f"{POLL_EVENTS}_unfinished_ms": round(_med(busy[name]) * 1e3, 3),
                             "plan": explain(s)}
                s.close()
        finally:
            if cluster:
                cluster.stop()
    out["poll"] = res


def insert_unfinished(store, n: int) -> None:
    """``n`` generation events of 1,000 running trajectories after the checkpoint,
    inserted straight into the index (a poll must not look at their payload)."""
    from sqlalchemy import insert, update

    from trajstore.schema import events, log_head, trajectories

    head = store.log.head_position()
    now = time.time()
    n_traj = 1000
    with store.log.write_engine.begin() as conn:
        conn.execute(insert(trajectories), [{
            "trajectory_id": f"run-{i}", "metadata": {}, "status": "running", "revision": 1, "last_seq": 99,
            "seq_len": 0, "seq_hash": b"\0" * 16, "route_len": 0, "started_position": head + 1,
            "created_at": now, "updated_at": now} for i in range(n_traj)])
        for lo in range(0, n, 20_000):
            conn.execute(insert(events), [{
                "position": head + 1 + p, "trajectory_id": f"run-{p % n_traj}", "type": "generation",
                "seq": p // n_traj, "identity": f"generation:run-{p % n_traj}:{p // n_traj}",
                "content_hash": b"\0" * 16, "model_version": 1, "prompt_len": 10, "prefix_len": 0,
                "output_len": 10, "segment": None, "segment_row": None, "created_at": now}
                for p in range(lo, min(n, lo + 20_000))])
        conn.execute(update(log_head).where(log_head.c.id == 1).values(position=head + n))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    p.add_argument("--no-postgres", action="store_true")
    p.add_argument("--port", type=int, default=18790)
    p.add_argument("--serve-arg", dest="serve_args", action="append", default=[],
                   help="extra argument for `trajstore serve` (repeatable), e.g. --serve-arg=--workers --serve-arg=2")
    p.add_argument("--http-requests-per-client", type=int, default=64,
                   help="requests (one ~1-MiB event each) per client per body kind and round (http; default 64: 512 events per kind and round, so the CPU clock's 10-ms ticks are small beside it)")
    p.add_argument("--bytes-sizes", default=BYTES_SIZES,
                   help=f"bytes: store sizes in trajectories, comma-separated (default {BYTES_SIZES})")
    p.add_argument("--memory-base", type=int, default=TRAJECTORIES, help="trajectories of the 1x store (memory)")
    p.add_argument("--tmp", default=None, help="scratch directory (default: system temp)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    args.only = [x for x in args.only.split(",") if x]
    out: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "rounds": args.rounds,
                 "only": args.only,
                 # what bench/summary.py puts beside the figures in docs/benchmarks.md
                 "command": " ".join(["bench/bench_pipeline.py", *(argv if argv is not None else sys.argv[1:])]),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loadavg": os.getloadavg()}
    if {"append", "materialize", "read"} & set(args.only):
        append_materialize_read(args, out)
    if "bytes" in args.only:
        bytes_by_size(args, out)
    if "http" in args.only:
        http_ingest(args, out)
    if "poll" in args.only:
        poll(args, out)
    if "memory" in args.only:
        memory(args, out)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        main()
