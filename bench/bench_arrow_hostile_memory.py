"""Ingest service peak memory per Arrow IPC body, hostile ones included.

    PYTHONPATH=. .venv/bin/python bench/bench_arrow_hostile_memory.py
    PYTHONPATH=<other tree> .venv/bin/python bench/bench_arrow_hostile_memory.py   # the same against it

For each body kind a fresh ``trajstore serve`` (subprocess, fresh SQLite
store in a temp dir) receives the body ``--repeat`` times, one after another;
the table shows the answers, the body's size (the mean for the fuzz run),
and how much the service's peak RSS (``VmHWM``) rose over its RSS after one
small warm-up request. Kinds:

* ``valid-16MiB``: a valid body, arrays of ~16 MiB in all (the yardstick);
* ``zstd-bomb-1GiB``: ~33 KiB of zstd whose array column inflates to 1 GiB;
* ``offset-2e9``: one string offset of the event column set to 2*10**9;
* ``fuzz-2000``: 2,000 mutated small bodies (``tests/fuzz_arrow.py``), growth
  over the whole run.

A service that dies is reported with its exit code.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from _proc import status_kb  # bench/ is on sys.path when run as a script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
TOKEN = "bench-token"
CONTENT_TYPE = "application/vnd.apache.arrow.stream"
WARM_UP = b""  # set in main(): one small valid body


def _stream(batch: pa.RecordBatch, **options) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, batch.schema, options=ipc.IpcWriteOptions(**options)) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def valid_body(total: int) -> bytes:
    from trajstore.ingest.arrow_body import encode_arrow_events

    rng = np.random.default_rng(0)
    events, n, size = [], 0, 0
    while size < total:
        tid = f"v-{n}"
        ids = rng.integers(0, 50_000, 1 << 18, dtype=np.int32)  # 1 MiB of prompt ids
        events += [{"type": "trajectory_started", "trajectory_id": tid},
                   {"type": "generation", "trajectory_id": tid, "seq": 0, "model_version": 0,
                    "prompt_ids": ids, "output_ids": np.array([1, 2], np.int32)}]
        size += ids.nbytes
        n += 1
    return encode_arrow_events(events)


def bomb_body(inflated: int) -> bytes:
    doc = {"type": "generation", "trajectory_id": "b", "seq": 0, "model_version": 0, "output_ids": [1],
           "prompt_ids": {"$arrow": {"dtype": "int32", "shape": [inflated // 4]}}}
    col = pa.array([bytes(inflated)], pa.large_binary())
    return _stream(pa.record_batch([pa.array([json.dumps(doc)]), col], names=["event", "prompt_ids"]),
                   compression="zstd")


def offset_body() -> bytes:
    docs = [json.dumps({"type": "trajectory_started", "trajectory_id": f"o{i}"}) for i in range(3)]
    offsets = np.array([0, len(docs[0]), 2 * 10**9, sum(map(len, docs))], np.int32)
    arr = pa.Array.from_buffers(pa.string(), 3, [None, pa.py_buffer(offsets), pa.py_buffer("".join(docs).encode())])
    return _stream(pa.record_batch([arr], names=["event"]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: bytes) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/events", body=body,
                     headers={"Content-Type": CONTENT_TYPE, "Authorization": f"Bearer {TOKEN}"})
        return str(conn.getresponse().status)
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__
    finally:
        conn.close()


def measure(bodies: list[bytes], tmp: str) -> tuple[dict, float, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trajstore.cli", "--store", f"sqlite:///{tmp}/s.db",
                             "serve", "--port", str(port), "--max-body-mb", "64"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TRAJSTORE_TOKEN": TOKEN})
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(0.5)
        _post(port, WARM_UP)  # first-request costs (imports, pools) are not the body's
        before = status_kb("VmRSS", proc.pid)
        answers: dict = {}
        for body in bodies:
            answer = _post(port, body)
            answers[answer] = answers.get(answer, 0) + 1
            if proc.poll() is not None:
                break
        if proc.poll() is not None:
            return answers, float("nan"), f"died (rc {proc.returncode})"
        grown = (status_kb("VmHWM", proc.pid) - before) / 1024
        return answers, grown, "alive"
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bomb-gib", type=float, default=1.0)
    args = parser.parse_args()
    from fuzz_arrow import make_cases

    import trajstore
    from trajstore.ingest.arrow_body import encode_arrow_events

    global WARM_UP
    WARM_UP = encode_arrow_events([{"type": "trajectory_started", "trajectory_id": "warm-up"}])
    print(f"tree: {Path(trajstore.__file__).parent.parent}")
    kinds = {
        "valid-16MiB": [valid_body(16 << 20)] * args.repeat,
        f"zstd-bomb-{args.bomb_gib:g}GiB": [bomb_body(int(args.bomb_gib * (1 << 30)))] * args.repeat,
        "offset-2e9": [offset_body()] * args.repeat,
        "fuzz-2000": [body for body, _, _ in make_cases(2000, seed=5)],
    }
    print(f"{'body':<18} {'bytes (each)':>14} {'answers':<52} {'peak RSS rise':>14}  service")
    for name, bodies in kinds.items():
        with tempfile.TemporaryDirectory() as tmp:
            answers, grown, state = measure(bodies, tmp)
        size = max(len(b) for b in bodies) if name != "fuzz-2000" else sum(map(len, bodies)) // len(bodies)
        print(f"{name:<18} {size:>14,} {json.dumps(answers, sort_keys=True):<52} {grown:>10.1f} MiB  {state}",
              flush=True)


if __name__ == "__main__":
    main()
