"""The recording proxy's throughput with and without group commit, side by side in one run.

    python bench/bench_proxy.py [--calls 600] [--clients 16] [--repeats 3] [--postgres URL]

Workload: ``--clients`` harness threads each run their own trajectories of
three-turn token-in/token-out episodes through the proxy in front of a fast
loopback stand-in for vLLM (tests/openai_upstream.py: routes for every
position, logprobs), ``--calls`` calls in all. The proxy runs in this
process on uvicorn, as ``trajstore proxy`` does. Variants, each on a fresh
store, interleaved ``--repeats`` times (best kept): ``alone`` (every record
its own append) and ``group`` (records ready at once share an append, the
default).

Prints one JSON object: calls per second and appends per variant.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx  # noqa: E402

import trajstore  # noqa: E402
from openai_upstream import make_upstream, serve_in_thread  # noqa: E402
from trajstore.ingest.proxy import make_proxy_app  # noqa: E402


def _episode(client: httpx.Client, proxy: str, tid: str) -> int:
    prompt = [3, 20, 21, 2, 5]
    for _ in range(3):
        resp = client.post(f"{proxy}/inference/v1/generate", headers={"X-Trajstore-Trajectory": tid},
                           json={"token_ids": prompt, "sampling_params": {"max_tokens": 6}})
        assert resp.status_code == 200 and "x-trajstore-seq" in resp.headers, resp.headers
        prompt = prompt + resp.json()["choices"][0]["token_ids"] + [4, 30, 2, 5]
    return 3


def run(url: str, upstream: str, *, group: bool, calls: int, clients: int, tag: str) -> dict:
    store = trajstore.connect(url)
    try:
        app = make_proxy_app(store, upstream, group_commit=group)
        with serve_in_thread(app) as proxy, httpx.Client(timeout=60) as client, ThreadPoolExecutor(clients) as pool:
            t0 = time.perf_counter()
            done = sum(pool.map(lambda i: _episode(client, proxy, f"{tag}-{i}"), range(calls // 3)))
            elapsed = time.perf_counter() - t0
        commits = app.state.commit_metrics.commits if group else done
        return {"calls_per_s": round(done / elapsed, 1), "appends": commits, "calls": done}
    finally:
        store.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=600)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--postgres", default=None, help="a PostgreSQL store URL (fresh database) instead of SQLite")
    args = p.parse_args()
    best: dict[str, dict] = {}
    with serve_in_thread(make_upstream()) as upstream, tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for variant in ("alone", "group"):
                url = args.postgres or f"sqlite:///{tmp}/{variant}-{r}.db"
                out = run(url, upstream, group=variant == "group", calls=args.calls, clients=args.clients,
                          tag=f"{variant}-{r}")
                if variant not in best or out["calls_per_s"] > best[variant]["calls_per_s"]:
                    best[variant] = out
    best["ratio"] = round(best["group"]["calls_per_s"] / best["alone"]["calls_per_s"], 2)
    print(json.dumps({"backend": "postgresql" if args.postgres else "sqlite", "clients": args.clients, **best}))


if __name__ == "__main__":
    main()
