"""Concurrent writers on PostgreSQL across a network: do appends queue on each other?

    python bench/bench_writers_pg.py [--writers 1,2,4,8,16] [--seconds 8] [--delay-ms 1]
                                     [--positions sequence,counter-row] [--aggregates on]
                                     [--repeat 1]

Starts a throwaway PostgreSQL (tests/pg_cluster.py) and a small TCP relay in
front of it that delays every chunk by ``--delay-ms`` in each direction (what a
database on another machine costs). For each positions scheme and writer count,
that many forked processes append for ``--seconds``: each append is one
engine call as the recording proxy appends it alone (one ``generation`` event
of 256 prompt + 64 output tokens with 4x2 routes; every trajectory starts and
finishes in its own appends). Reported per run: aggregate events/s, the
speedup over one writer, the share of ~10 ms samples of ``pg_stat_activity``
in which any backend of the database waited on a lock (and, "on agg", one whose
statement writes an aggregate table), and the writers'
client CPU (user + system) per append.

``counter-row`` replays the old position scheme (every append takes its
positions from the ``log_head`` row, its lock held to COMMIT) for the before
figures; ``sequence`` is what the store does now (trajstore.log.postgres,
"Positions").

``--aggregates on,off`` runs each case with the append's run aggregates
(``agg_output_lengths``, ``agg_route_drift``, ``agg_calls``, ``agg_trajectories``:
delta rows) written as the store writes them
and with that write skipped (a switch of this script only: ``off`` is not a
store setting), interleaved, for the cost of counting them in the append's
transaction. Every call here has the same model version and output length: one
key, what a run whose calls stop at ``max_tokens`` looks like. ``--repeat N``
runs every case N times (interleaved) and reports the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import trajstore  # noqa: E402
from trajstore.log.postgres import PostgreSQL  # noqa: E402

COUNTER_ROW = ("WITH k AS (SELECT %s::bigint AS n), "
               "h AS (UPDATE log_head SET position = position + (SELECT n FROM k) WHERE id = 1 RETURNING position) "
               "SELECT generate_series(h.position - k.n + 1, h.position) FROM h, k")


# -- the relay ------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_relay(target_port: int, delay_s: float) -> int:
    """A TCP relay on a free loopback port forwarding to ``target_port``; every chunk
    is delivered ``delay_s`` after it arrived, in order, in each direction."""
    port = _free_port()
    ready = threading.Event()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    writer.close()
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        task = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    break
                queue.put_nowait((time.monotonic() + delay_s, data))
        except ConnectionError:
            pass
        queue.put_nowait((0.0, None))
        await task

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        for w in (client_w, server_w):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w), return_exceptions=True)

    def run() -> None:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", port))
        ready.set()
        loop.run_forever()

    threading.Thread(target=run, daemon=True).start()
    ready.wait(10)
    return port


# -- writers --------------------------------------------------------------------------
def _payloads(rng: np.random.Generator, n: int = 8) -> list[tuple[list[int], list[int], np.ndarray]]:
    """A few engine outputs, reused: building them is not what is measured."""
    return [(rng.integers(0, 150_000, 256).tolist(), rng.integers(0, 150_000, 64).tolist(),
             rng.integers(0, 64, (256 + 64 - 1, 4, 2), dtype=np.uint8)) for _ in range(n)]


def _events(w: int, i: int, payload: tuple[list[int], list[int], np.ndarray]) -> list[list[dict]]:
    tid = f"w{w}-t{i}"
    prompt, output, routes = payload
    return [[{"type": "trajectory_started", "trajectory_id": tid, "num_experts": 64}],
            [{"type": "generation", "trajectory_id": tid, "seq": 0, "prompt_ids": prompt, "output_ids": output,
              "logprobs": [-0.5] * 64, "model_version": 0, "routed_experts": routes}],
            [{"type": "trajectory_finished", "trajectory_id": tid, "status": "completed"}]]


def writer(url: str, w: int, positions: str, aggregates: str, ready: "mp.Barrier", seconds: float,
           out: "mp.Queue") -> None:
    if aggregates == "off":  # the append without its run aggregates (this script's switch only)
        import trajstore.log._events as events_module

        events_module.write_event_aggregates = lambda *a, **k: None
    if positions == "counter-row":
        PostgreSQL.take_positions = COUNTER_ROW  # the old statement, returning one row per position
    store = trajstore.connect(url, migrate=False)
    payloads = _payloads(np.random.default_rng(w))
    store.append(_events(w, -1, payloads[0])[0])  # connections and imports warm
    ready.wait()
    stop_at = time.time() + seconds
    t0 = os.times()
    n = events = 0
    i = 0
    while time.time() < stop_at:
        for b in _events(w, i, payloads[i % len(payloads)]):
            store.append(b)
            n += 1
            events += len(b)
        i += 1
    t1 = os.times()
    out.put({"appends": n, "events": events, "cpu_s": (t1.user - t0.user) + (t1.system - t0.system),
             "elapsed_s": time.time() - stop_at + seconds})
    store.close()


def sample_locks(admin_url: str, db: str, stop: threading.Event, result: dict) -> None:
    import psycopg

    samples = waiting = backends_waiting = on_aggregates = 0
    with psycopg.connect(admin_url, autocommit=True) as conn:
        while not stop.is_set():
            n, agg = conn.execute("SELECT count(*), count(*) FILTER (WHERE position('agg_' in query) > 0) "
                                  "FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
                                  (db,)).fetchone()
            samples += 1
            waiting += n > 0
            backends_waiting += n
            on_aggregates += agg > 0
            time.sleep(0.01)
    result.update(samples=samples, lock_wait_share=waiting / max(1, samples),
                  mean_backends_waiting=backends_waiting / max(1, samples),
                  agg_lock_wait_share=on_aggregates / max(1, samples))


def run_one(cluster, relay_port: int, positions: str, writers: int, seconds: float, aggregates: str = "on") -> dict:
    from sqlalchemy.engine import make_url

    direct = make_url(cluster.create_database())
    db = direct.database
    url = direct.set(port=relay_port).render_as_string(hide_password=False)
    trajstore.connect(url).close()  # migrated, location recorded
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    ready = ctx.Barrier(writers + 1)
    procs = [ctx.Process(target=writer, args=(url, w, positions, aggregates, ready, seconds, out)) for w in range(writers)]
    for p in procs:
        p.start()
    stop, locks = threading.Event(), {}
    ready.wait(timeout=300)
    sampler = threading.Thread(target=sample_locks, args=(direct.set(drivername="postgresql").render_as_string(
        hide_password=False), db, stop, locks))
    sampler.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    stop.set()
    sampler.join()
    for p in procs:
        p.join(60)
    seconds = max(r["elapsed_s"] for r in results)
    events = sum(r["events"] for r in results)
    appends = sum(r["appends"] for r in results)
    return {"positions": positions, "aggregates": aggregates, "writers": writers, "events_per_s": events / seconds,
            "appends_per_s": appends / seconds, "lock_wait_share": locks["lock_wait_share"],
            "mean_backends_waiting": locks["mean_backends_waiting"],
            "agg_lock_wait_share": locks["agg_lock_wait_share"],
            "client_cpu_ms_per_append": 1000 * sum(r["cpu_s"] for r in results) / max(1, appends)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writers", default="1,2,4,8,16")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--delay-ms", type=float, default=1.0)
    p.add_argument("--positions", default="sequence,counter-row")
    p.add_argument("--aggregates", default="on", help="on, off or on,off (side by side)")
    p.add_argument("--repeat", type=int, default=1, help="runs of every case (interleaved); medians reported")
    args = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from pg_cluster import PgCluster

    keys = ("events_per_s", "appends_per_s", "lock_wait_share", "mean_backends_waiting", "agg_lock_wait_share",
            "client_cpu_ms_per_append")
    cases = [(pos, agg, int(n)) for pos in args.positions.split(",") for n in args.writers.split(",")
             for agg in args.aggregates.split(",")]
    runs: dict[tuple, list[dict]] = {c: [] for c in cases}
    with PgCluster() as cluster:
        relay = start_relay(cluster.port, args.delay_ms / 1000)
        for _ in range(args.repeat):
            for pos, agg, n in cases:
                r = run_one(cluster, relay, pos, n, args.seconds, agg)
                runs[(pos, agg, n)].append(r)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    rows = []
    for pos, agg, n in cases:
        got = runs[(pos, agg, n)]
        rows.append(dict(got[0], **{k: float(np.median([g[k] for g in got])) for k in keys}))
    for r in rows:
        base = next(b for b in rows if (b["positions"], b["aggregates"]) == (r["positions"], r["aggregates"]))
        r["speedup"] = r["events_per_s"] / base["events_per_s"]
    print(f"medians of {args.repeat} run(s) of {args.seconds:g} s each")
    print(f"{'positions':<12} {'aggregates':>10} {'writers':>7} {'events/s':>9} {'appends/s':>9} {'speedup':>7} "
          f"{'lock-wait':>9} {'on agg':>6} {'waiting':>7} {'cpu ms/append':>13}")
    for r in rows:
        print(f"{r['positions']:<12} {r['aggregates']:>10} {r['writers']:>7} {r['events_per_s']:>9.0f} "
              f"{r['appends_per_s']:>9.0f} {r['speedup']:>7.2f} {100 * r['lock_wait_share']:>8.0f}% "
              f"{100 * r['agg_lock_wait_share']:>5.0f}% "
              f"{r['mean_backends_waiting']:>7.2f} {r['client_cpu_ms_per_append']:>13.2f}")


if __name__ == "__main__":
    main()
