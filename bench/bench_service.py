"""Ingest throughput: the HTTP service vs store.append in-process, side by side.

    PYTHONPATH=. .venv/bin/python bench/bench_service.py            # 16 clients, ~2000-token events, 48x8 routes
    PYTHONPATH=. .venv/bin/python bench/bench_service.py --trees before=/tmp/main-tree,after=. --rounds 3

``--trees``: the service of each named source tree (a ``git archive`` of the
baseline, and this one; ``PATH+h11`` runs it with httptools hidden, i.e. on
uvicorn's pure-Python HTTP parser as before httptools joined the extra), interleaved round by round on the same bodies, JSON
and Arrow IPC; the medians of events/s, service CPU ms/event and requests
per commit are printed side by side (CPU per event is the steadier figure on
a shared machine).

Three runs on fresh SQLite stores in a temp dir, same events:

* ``in-process``: N threads calling ``store.append`` directly (the ceiling);
* ``http group-commit``: N threads POSTing to ``workers/ingest_server.py``
  (a separate process) that coalesces concurrent requests;
* ``http per-request``: the same with ``--no-group-commit``;
* ``http group-commit 2 workers``: ``--workers 2`` (two server processes).

Each request holds ``--events-per-request`` generation events, each in its
own trajectory (with its trajectory_started event). Bodies are encoded
before the clock starts, so the HTTP figures measure the service, not the
client's JSON encoding. Ack latency is send-to-200 per request.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import trajstore  # noqa: E402
from trajstore.ingest.client import HttpSink, encode_events  # noqa: E402
from _proc import cpu_s  # noqa: E402  (bench/ is on sys.path when run as a script)

TOKEN = "bench-token"


def make_requests(args: argparse.Namespace, client: int, rng: np.random.Generator) -> list[list[dict]]:
    P, O = args.prompt_tokens, args.output_tokens
    requests = []
    for r in range(args.requests_per_client):
        events = []
        for e in range(args.events_per_request):
            tid = f"c{client}-r{r}-e{e}"
            events.append({"type": "trajectory_started", "trajectory_id": tid, "num_experts": args.num_experts})
            events.append({
                "type": "generation", "trajectory_id": tid, "seq": 0, "model_version": 1,
                "prompt_ids": rng.integers(0, 150_000, P, dtype=np.int32),
                "output_ids": rng.integers(0, 150_000, O, dtype=np.int32),
                "logprobs": -rng.random(O, dtype=np.float32),
                "routed_experts": rng.integers(0, args.num_experts, (P + O - 1, args.layers, args.topk), dtype=np.uint8),
            })
        requests.append(events)
    return requests


def run_clients(args: argparse.Namespace, work: list[list], send, server_pid: int | None = None) -> dict:
    """Run one thread per client over its requests; return throughput, latency and CPU figures."""
    latencies_s: list[float] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        mine = []
        for item in work[k]:
            t0 = time.perf_counter()
            send(k, item)
            mine.append(time.perf_counter() - t0)
        with lock:
            latencies_s.extend(mine)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(len(work))]
    cpu0, server_cpu0 = cpu_s(), cpu_s(server_pid) if server_pid else 0.0
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed_s = time.perf_counter() - start
    client_cpu_s = cpu_s() - cpu0
    server_cpu_s = cpu_s(server_pid) - server_cpu0 if server_pid else client_cpu_s
    num_events = len(work) * args.requests_per_client * args.events_per_request
    lat = np.asarray(latencies_s)
    return {
        "events_per_s": num_events / elapsed_s,
        "tokens_per_s": num_events * (args.prompt_tokens + args.output_tokens) / elapsed_s,
        "ack_p50_ms": float(np.percentile(lat, 50) * 1e3),
        "ack_p99_ms": float(np.percentile(lat, 99) * 1e3),
        # CPU per event of whoever stores (the service process, or this one in-process)
        "store_cpu_ms_per_event": server_cpu_s / num_events * 1e3,
        "client_cpu_ms_per_event": client_cpu_s / num_events * 1e3 if server_pid else 0.0,
        "elapsed_s": elapsed_s,
        "num_events": num_events,
    }


def bench_in_process(args: argparse.Namespace, work: list[list[list[dict]]], tmp: Path) -> dict:
    store = trajstore.connect(f"sqlite:///{tmp}/in-process.db")
    try:
        return run_clients(args, work, lambda k, events: store.append(events))
    finally:
        store.close()


_NO_HTTPTOOLS = """import sys
class _NoHttptools:
    def find_spec(self, name, path=None, target=None):
        if name == "httptools" or name.startswith("httptools."):
            raise ImportError("httptools hidden by bench_service (h11)")
sys.meta_path.insert(0, _NoHttptools())
"""


def start_service(tmp: Path, name: str, port: int, extra: list[str], tree: Path = REPO,
                  h11: bool = False) -> subprocess.Popen:
    """The service of ``tree``; ``h11``: with httptools hidden, so uvicorn parses HTTP in pure Python
    (as every tree did before httptools joined the server extra)."""
    cmd = [sys.executable, str(tree / "workers" / "ingest_server.py"), "--store", f"sqlite:///{tmp}/{name}.db",
           "--port", str(port), "--max-body-mb", "256", *extra]
    path = str(tree)
    if h11:
        (tmp / "h11").mkdir(exist_ok=True)
        (tmp / "h11" / "sitecustomize.py").write_text(_NO_HTTPTOOLS)
        path = f"{tmp / 'h11'}{os.pathsep}{path}"
    env = {**os.environ, "TRAJSTORE_TOKEN": TOKEN, "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, env=env)
    import urllib.request

    for _ in range(2400):  # up to 2 minutes: a saturated machine starts two workers slowly
        if proc.poll() is not None:
            raise RuntimeError(f"ingest service exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("ingest service did not start")


def bench_http(args: argparse.Namespace, bodies: list[list[bytes]], tmp: Path, name: str, extra: list[str],
               *, tree: Path = REPO, port: int | None = None, body: str = "json",
               warmup: list[bytes] | None = None, h11: bool = False) -> dict:
    port = port or args.port
    proc = start_service(tmp, name, port, extra, tree, h11)
    sinks = [HttpSink(f"http://127.0.0.1:{port}", token=TOKEN, body=body) for _ in bodies]

    def send(k: int, payload: bytes) -> None:
        status, data = sinks[k].post(payload)
        if status != 200:
            raise RuntimeError(f"ingest answered {status}: {data[:200]!r}")

    try:
        for k, payload in enumerate(warmup or []):  # imports, connections, first-request paths: off the clock
            send(k % len(sinks), payload)
        commits0 = _commits(port)
        result = run_clients(args, bodies, send, server_pid=proc.pid)
        commits = _commits(port) - commits0
        result["requests_per_commit"] = len(bodies) * args.requests_per_client / commits if commits > 0 else None
        return result
    finally:
        for s in sinks:
            s.close()
        proc.terminate()
        proc.wait(30)


def _commits(port: int) -> int:
    """The service's store transactions so far (its /metrics)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("trajstore_ingest_commits_total "))


def compare_trees(args: argparse.Namespace, work: list[list[list[dict]]]) -> None:
    """``--trees``: each tree's service, interleaved, JSON and Arrow bodies; medians side by side."""
    import statistics

    from trajstore.ingest.arrow_body import encode_arrow_events

    trees = dict(item.split("=", 1) for item in args.trees.split(","))  # PATH+h11: with httptools hidden
    bodies = {"json": [[encode_events(evs) for evs in client] for client in work],
              "arrow": [[encode_arrow_events(evs) for evs in client] for client in work]}
    rng = np.random.default_rng(1)
    warm_args = argparse.Namespace(**{**vars(args), "requests_per_client": 1})
    warm = {kind: [enc(evs) for c in range(len(work)) for evs in make_requests(warm_args, 1000 + c, rng)]
            for kind, enc in (("json", encode_events), ("arrow", encode_arrow_events))}
    extra = [a for a in args.serve_args]
    runs: dict[tuple[str, str], list[dict]] = {}
    port = args.port
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        for r in range(args.rounds):
            for kind in args.bodies.split(","):
                for name, tree in trees.items():
                    port += 1
                    path, h11 = (tree[:-4], True) if tree.endswith("+h11") else (tree, False)
                    res = bench_http(args, bodies[kind], Path(d), f"{name}-{kind}-{r}", extra,
                                     tree=Path(path).resolve(), port=port, body=kind, warmup=warm[kind], h11=h11)
                    runs.setdefault((name, kind), []).append(res)
                    print(f"round {r + 1} {name:8s} {kind:5s} {res['events_per_s']:7.1f} events/s "
                          f"{res['store_cpu_ms_per_event']:6.2f} ms CPU/event, "
                          f"{res['requests_per_commit'] or 0:4.1f} requests/commit", file=sys.stderr, flush=True)
    med = {key: {m: statistics.median(x[m] for x in v if x[m] is not None) if any(x[m] is not None for x in v) else None
                 for m in ("events_per_s", "store_cpu_ms_per_event", "ack_p50_ms", "ack_p99_ms", "requests_per_commit",
                           "client_cpu_ms_per_event")}
           for key, v in runs.items()}
    print(f"{args.clients} clients x {args.requests_per_client} requests x {args.events_per_request} events; "
          f"{args.rounds} interleaved rounds, medians; serve args {extra}")
    print("| tree | body | events/s | service CPU ms/event | requests/commit | ack p50 ms | ack p99 ms | client CPU ms/event |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (name, kind), m in med.items():
        print(f"| {name} | {kind} | {m['events_per_s']:.1f} | {m['store_cpu_ms_per_event']:.2f} | "
              f"{m['requests_per_commit'] or 0:.1f} | {m['ack_p50_ms']:.0f} | {m['ack_p99_ms']:.0f} | "
              f"{m['client_cpu_ms_per_event']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": {f"{n}/{k}": v for (n, k), v in runs.items()},
                                          "medians": {f"{n}/{k}": v for (n, k), v in med.items()}}, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests-per-client", type=int, default=20)
    p.add_argument("--events-per-request", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--output-tokens", type=int, default=500)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=128)
    p.add_argument("--port", type=int, default=18700)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "bench_service.json"))
    p.add_argument("--trees", default=None, help="name=PATH,name=PATH: compare these source trees' services")
    p.add_argument("--rounds", type=int, default=3, help="with --trees: interleaved rounds")
    p.add_argument("--bodies", default="json,arrow", help="with --trees: body formats to run")
    p.add_argument("--serve-arg", dest="serve_args", action="append", default=[],
                   help="with --trees: extra argument for the service (repeatable), e.g. --serve-arg=--workers --serve-arg=2")
    p.add_argument("--tmp", default=None, help="scratch directory (default: system temp)")
    args = p.parse_args()

    rng = np.random.default_rng(0)
    work = [make_requests(args, k, rng) for k in range(args.clients)]
    if args.trees:
        compare_trees(args, work)
        return
    bodies = [[encode_events(events) for events in client] for client in work]
    body_mb = np.mean([len(b) for c in bodies for b in c]) / 2**20
    results = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        results["in-process store.append"] = bench_in_process(args, work, tmp)
        results["http group-commit"] = bench_http(args, bodies, tmp, "http-group", [])
        results["http per-request"] = bench_http(args, bodies, tmp, "http-single", ["--no-group-commit"])
        results["http group-commit 2 workers"] = bench_http(args, bodies, tmp, "http-group-2", ["--workers", "2"])
    print(f"{args.clients} clients x {args.requests_per_client} requests x {args.events_per_request} events; "
          f"{args.prompt_tokens}+{args.output_tokens} tokens, routes {args.layers}x{args.topk}; body {body_mb:.2f} MiB")
    print(f"| {'mode':<26} | events/s | tokens/s | ack p50 ms | ack p99 ms | store CPU ms/event | client CPU ms/event |")
    print(f"|{'-' * 28}|---------:|---------:|-----------:|-----------:|-------------------:|--------------------:|")
    for mode, r in results.items():
        print(f"| {mode:<26} | {r['events_per_s']:8.1f} | {r['tokens_per_s']:8.0f} | {r['ack_p50_ms']:10.1f} "
              f"| {r['ack_p99_ms']:10.1f} | {r['store_cpu_ms_per_event']:18.1f} | {r['client_cpu_ms_per_event']:19.1f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "body_mib": body_mb, "results": results}, indent=2))


if __name__ == "__main__":
    main()
