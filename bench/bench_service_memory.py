"""Ingest service memory: peak RSS against request bytes in flight.

    PYTHONPATH=. .venv/bin/python bench/bench_service_memory.py            # 60 MB bodies, 1/3/8 at once

For each concurrency (1, 3, 8) a fresh service (``trajstore serve`` in a
subprocess, fresh SQLite store in a temp dir) receives that many large bodies
at once, each from its own thread and connection. A body is the worst case
the issue names: small ints (``"prompt_ids": [3,1,4,...]``, two bytes a
token) in a few big generation events, ``--body-mb`` MB in all. The service's
peak RSS is its ``VmHWM`` from ``/proc/<pid>/status`` after the load, its
baseline ``VmRSS`` before it. "in flight" is what the clients sent at once
(concurrency x body); the service admits at most ``--max-in-flight-mb`` of
it at a time (its byte budget) and the rest wait in their sockets;
"admitted" is the most it held at once (its ``/metrics`` gauge).

``--max-in-flight-mb 0`` leaves the service's default; run against an older
tree (``PYTHONPATH=<old tree>``) to compare (it must then be 0).
"""

from __future__ import annotations

import argparse
import http.client
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from _proc import status_kb  # bench/ is on sys.path when run as a script

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-token"


def make_body(body_bytes: int, tokens_per_event: int, tag: str) -> bytes:
    """A POST body of about ``body_bytes``: trajectories with one big generation of single-digit ids."""
    rng = np.random.default_rng(0)
    digits = rng.integers(0, 10, tokens_per_event).astype(np.uint8) + ord("0")
    ids = bytearray(2 * tokens_per_event - 1)
    ids[0::2] = digits.tobytes()
    ids[1::2] = b"," * (tokens_per_event - 1)
    ids = bytes(ids)
    parts, size, i = [], 0, 0
    while size < body_bytes:
        tid = f"{tag}-{i}".encode()
        parts.append(b'{"type":"trajectory_started","trajectory_id":"%s"}' % tid)
        parts.append(b'{"type":"generation","trajectory_id":"%s","seq":0,"model_version":0,"output_ids":[1,2],'
                     b'"prompt_ids":[%s]}' % (tid, ids))
        size += len(parts[-1]) + len(parts[-2])
        i += 1
    return b'{"events":[' + b",".join(parts) + b"]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(store_url: str, port: int, max_in_flight_mb: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trajstore.cli", "--store", store_url, "serve", "--port", str(port),
           "--token", TOKEN, "--max-body-mb", "64"]
    if max_in_flight_mb:
        cmd += ["--max-in-flight-mb", str(max_in_flight_mb)]
    proc = subprocess.Popen(cmd, env=os.environ.copy(), cwd=REPO)
    for _ in range(600):
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.05)
        if proc.poll() is not None:
            raise RuntimeError(f"service exited with {proc.returncode}")
    proc.kill()
    raise RuntimeError("service did not come up")


def post(port: int, body: bytes, out: list, i: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/events", body=body,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    resp = conn.getresponse()
    resp.read()
    out[i] = (resp.status, time.perf_counter() - start)


def _admitted_peak(port: int) -> float | None:
    """The service's peak of body bytes admitted at once (its byte budget), MB; None if it has no budget."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    for line in conn.getresponse().read().decode().splitlines():
        if line.startswith("trajstore_ingest_body_bytes_in_flight_peak "):
            return float(line.split()[1]) / 1e6
    return None


def run(concurrency: int, body_bytes: int, tokens_per_event: int, max_in_flight_mb: float, tmp: Path) -> dict:
    bodies = [make_body(body_bytes, tokens_per_event, f"c{concurrency}r{i}") for i in range(concurrency)]
    port = _free_port()
    proc = start_service(f"sqlite:///{tmp / f'store{concurrency}.db'}", port, max_in_flight_mb)
    try:
        time.sleep(0.5)
        baseline_kb = status_kb("VmRSS", proc.pid)
        out: list = [None] * concurrency
        threads = [threading.Thread(target=post, args=(port, b, out, i)) for i, b in enumerate(bodies)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        peak_kb = status_kb("VmHWM", proc.pid)
        admitted = _admitted_peak(port)
    finally:
        proc.terminate()
        proc.wait(60)
    return {"concurrency": concurrency, "body_mb": len(bodies[0]) / 1e6, "in_flight_mb": sum(map(len, bodies)) / 1e6,
            "baseline_mb": baseline_kb / 1024, "peak_mb": peak_kb / 1024, "statuses": sorted(s for s, _ in out),
            "wall_s": wall, "admitted_mb": admitted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--body-mb", type=float, default=60.0)
    parser.add_argument("--tokens-per-event", type=int, default=1_000_000)
    parser.add_argument("--concurrency", default="1,3,8")
    parser.add_argument("--max-in-flight-mb", type=float, default=0.0, help="0: the service's default")
    args = parser.parse_args()
    print(f"{'clients':>7} {'body MB':>8} {'sent at once MB':>16} {'admitted MB':>12} {'baseline MB':>12} "
          f"{'peak RSS MB':>12} {'peak-baseline':>14} {'x body':>7} {'wall s':>7}  statuses")
    with tempfile.TemporaryDirectory(prefix="trajstore-bench-mem-") as tmp:
        for c in (int(x) for x in args.concurrency.split(",")):
            r = run(c, int(args.body_mb * 1e6), args.tokens_per_event, args.max_in_flight_mb, Path(tmp))
            grown = r["peak_mb"] - r["baseline_mb"]
            admitted = "n/a" if r["admitted_mb"] is None else f"{r['admitted_mb']:.1f}"
            print(f"{c:>7} {r['body_mb']:>8.1f} {r['in_flight_mb']:>16.1f} {admitted:>12} {r['baseline_mb']:>12.0f} "
                  f"{r['peak_mb']:>12.0f} {grown:>14.0f} {grown / r['body_mb']:>7.1f} {r['wall_s']:>7.1f}  "
                  f"{r['statuses']}", flush=True)


if __name__ == "__main__":
    main()
