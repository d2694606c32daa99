"""Remote readers (``ReplayReader`` through ``trajstore replay`` on loopback) against the same
readers local (``SampleReader`` on the store), side by side in one run.

    PYTHONPATH=. .venv/bin/python bench/bench_replay.py [--samples 256] [--rounds 3] [--streams 4] [--dir DIR] [--out FILE]
        [--routes 24x4,48x8,60x8,none] [--backends sqlite,postgresql] [--readers 1,2,4] [--before TREE]

The samples are bench_streaming.py's load (``bench_pipeline.arrays_load``):
one sample of 2,400 tokens with 48 x 8 uint8 routes per trajectory, in a
SQLite store. ``--routes`` names other route layouts (layers x top-k, or
``none``: no routes), each a store of its own built from the simulator's
trajectories of the same shape (``trajectory_events``), and ``--backends``
adds a PostgreSQL index (a throwaway cluster, tests/pg_cluster.py). One
replay server process serves each store (``trajstore replay``, read token,
metrics port).

For 1, 2 and 4 readers, each reader a process (one data-parallel rank of
``world_size`` = the number of readers, ``batch_size=8``), reading one epoch
together: local readers open the store, remote readers ask the server. The
children import and connect first, then start on a signal; the wall time is
from the first start to the last end. Two consumers of each batch:
``touched`` reads one byte of every 4 KiB page of every array of every
sample (the least a trainer does with its data: a local reader's
memory-mapped views pay their page faults here, as a remote reader's received
buffers were paid for on arrival); ``collated`` collates the batch into
packed torch tensors (``collate``, what ``SampleDataset`` hands a trainer).
Rounds interleave the paths; medians of ``--rounds``. A remote reader keeps
``--streams`` steps' payload requests in flight.

``--before TREE``: a source tree of trajstore (``git archive main trajstore |
tar -x -C TREE``) whose server and ``ReplayReader`` make a third path,
``before``, in the same rounds (its own server process on the same store).
Without ``--no-extras``, a ``flight`` path is the ceiling of the transfer:
this rank's rows fetched with bare DoGets of 8 rows of one segment,
``--streams`` of them in flight, every page of every buffer touched (no
reader, no ``Sample``). For every path the payload MB/s (the Arrow IPC bytes
an epoch sends) and the reader's CPU ms per MB; for the remote paths the
server's CPU ms per MB too.

Also reported: the server's CPU seconds (from /proc, utime+stime) per
million tokens served, the payload bytes it sent per token and against the
sample segments' bytes of the same samples (nothing is sent or decoded
twice: the ratio is about 1), its peak RSS (VmHWM), and, when ``mosaicml-streaming`` can be
imported, one local ``StreamingDataset`` reader on the same samples (as in
bench_streaming.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

TOKEN = "bench-read-token"
PAGE = 4096
ARRAYS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "logprobs_mask", "token_model_versions",
          "routed_experts", "routed_experts_mask")
CONSUMERS = ("touched", "collated")


def touch(arrays) -> int:
    total = 0
    for a in arrays:
        if a is not None:
            total += int(a.reshape(-1).view(np.uint8)[::PAGE].sum())
    return total


def load(n: int, start: int, routes: str) -> list[list[dict]]:
    """Trajectories ``start .. start+n-1``: bench_streaming.py's (48x8 routes), or the
    simulator's of the same shape with ``routes`` = "LxK" or "none"."""
    from bench_pipeline import CFG, arrays_load

    if routes == "48x8":
        return arrays_load(n, start=start)
    from dataclasses import replace

    from trajstore.demo._simulate import trajectory_events

    if routes == "none":
        return [[{k: v for k, v in e.items() if k != "routed_experts"} for e in trajectory_events(CFG, i)]
                for i in range(start, start + n)]
    layers, topk = (int(x) for x in routes.split("x"))
    cfg = replace(CFG, layers=layers, topk=topk)
    return [trajectory_events(cfg, i) for i in range(start, start + n)]


def build(d: str, n: int, url: str | None = None, routes: str = "48x8") -> tuple[str, str]:
    import trajstore

    url, payload = url or f"sqlite:///{d}/store.db", f"{d}/payload"
    store = trajstore.connect(url, payload=payload)
    for start in range(0, n, 16):
        store.append([e for t in load(min(n, start + 16) - start, start, routes) for e in t])
    store.materialize()
    store.close()
    return url, payload


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _hwm_mb(pid: int) -> float:
    m = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024 if m else float("nan")


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _rss_anon_mb(pid: int) -> float:
    m = re.search(r"RssAnon:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) / 1024 if m else float("nan")


def _stalled_clients(url: str, payload: str, location: str, pid: int, n: int) -> dict:
    """The server's anonymous RSS with ``n`` clients that each opened a stream of every
    sample of the store and read none of it (back-pressure: not buffered)."""
    import pyarrow.flight as fl

    import trajstore
    from trajstore.replay import _protocol as proto

    store = trajstore.connect(url, payload=payload, migrate=False, create=False)
    rows = [r for page in store.materialized.iter_sample_rows(where={}, after=None, page_rows=100_000) for r in page]
    store.close()
    by_segment: dict[str, list[int]] = {}
    for r in rows:
        by_segment.setdefault(r["segment"], []).append(r["segment_row"])
    opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])
    before = _rss_anon_mb(pid)
    held = []
    for _ in range(n):
        client = fl.connect(location)
        for name, seg_rows in by_segment.items():
            held.append((client, client.do_get(fl.Ticket(proto.encode(proto.SAMPLES, segment=name, rows=seg_rows)),
                                               opts)))
    time.sleep(2.0)
    during = _rss_anon_mb(pid)
    threads = int(re.search(r"Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))
    # meanwhile, one reader reads the whole store
    from trajstore.replay import ReplayReader

    t = time.perf_counter()
    read = sum(len(b) for b in ReplayReader(location, token=TOKEN, batch_size=8))
    reader_s = time.perf_counter() - t
    assert read == len(rows), (read, len(rows))
    for client, stream in held[:1]:
        stream.read_all()  # still whole once read
    for client, _ in held:
        client.close()
    return {"clients": n, "streams": len(held), "bytes_asked_gib": round(len(held) / len(by_segment) * sum(
                os.path.getsize(os.path.join(payload, name)) for name in by_segment) / 2**30, 1),
            "server_rss_anon_mb_before": round(before, 1), "server_rss_anon_mb_stalled": round(during, 1),
            "server_threads_stalled": threads, "one_reader_meanwhile_s": round(reader_s, 2)}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_readers(kind: str, k: int, url: str, payload: str, location: str, go_dir: str, consumer: str,
                streams: int, tree: Path = REPO) -> dict:
    """k reader processes of ``kind`` ("local", "remote", "streaming"); aggregate figures."""
    go = os.path.join(go_dir, f"go-{time.monotonic_ns()}")
    procs = [subprocess.Popen([sys.executable, __file__, "--child", kind, str(r), str(k), url, payload, location, go,
                               consumer, str(streams)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(tree)}) for r in range(k)]
    ready = [p.stdout.readline() for p in procs]  # each says "ready" once imported and connected
    assert all(line.strip() == "ready" for line in ready), [p.stderr.read() for p in procs]
    Path(go).touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out))
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {"wall_s": wall, "tokens": sum(r["tokens"] for r in results), "batches": sum(r["batches"] for r in results),
            "samples": sum(r["samples"] for r in results), "reader_cpu_s": sum(r["cpu_s"] for r in results)}


def _child(kind: str, rank: int, world: int, url: str, payload: str, location: str, go: str, consumer: str,
           streams: str) -> None:
    if consumer == "collated":
        from trajstore.train.collate import collate
    if kind == "local":
        from trajstore.reader import SampleReader

        reader = SampleReader(url, payload=payload, rank=rank, world_size=world, batch_size=8)
        batches = iter(reader)
    elif kind in ("remote", "before"):
        from trajstore.replay import ReplayReader

        reader = ReplayReader(location, token=TOKEN, rank=rank, world_size=world, batch_size=8, streams=int(streams))
        reader.store.hello()
        batches = iter(reader)
    elif kind == "flight":
        batches = _raw_flight(url, payload, location, rank, world, int(streams))
    else:
        from bench_streaming import import_streaming

        streaming = import_streaming()
        ds = streaming.StreamingDataset(local=os.path.join(os.path.dirname(payload), "mds"), remote=None,
                                        shuffle=False, batch_size=8)
        batches = ([row] for row in ds)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    start, cpu = time.time(), time.process_time()
    tokens = samples = n = 0
    for batch in batches:
        n += 1
        if consumer == "collated" and kind != "streaming":
            tensors = collate(batch, layout="packed")
            tokens += int(tensors["seq_lens"].sum())
            samples += len(batch)
            continue
        for s in batch:
            samples += 1
            if kind == "streaming":
                tokens += len(s["prompt_ids"]) + len(s["response_ids"])
                touch([s[k] for k in ARRAYS])
            elif kind == "flight":
                tokens += s
                continue
            else:
                tokens += s.num_tokens
                touch([getattr(s, k) for k in ARRAYS])
    print(json.dumps({"start": start, "end": time.time(), "cpu_s": time.process_time() - cpu, "tokens": tokens,
                      "samples": samples, "batches": n}))


def _raw_flight(url: str, payload: str, location: str, rank: int, world: int, streams: int):
    """The ceiling: this rank's share of the sample rows fetched with bare DoGets of 8 rows
    of one segment, ``streams`` in flight, every page of every buffer touched; yields
    [tokens of the 8 rows]."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.compute as pc
    import pyarrow.flight as fl

    import trajstore
    from trajstore.replay import _protocol as proto

    store = trajstore.connect(url, payload=payload, migrate=False, create=False)
    rows = [r for page in store.materialized.iter_sample_rows(where={}, after=None, page_rows=100_000) for r in page]
    store.close()
    by_segment: dict[str, list[int]] = {}
    for r in rows[rank::world]:
        by_segment.setdefault(r["segment"], []).append(r["segment_row"])
    requests = [(name, numbers[i:i + 8]) for name, numbers in by_segment.items() for i in range(0, len(numbers), 8)]
    client = fl.connect(location)
    opts = fl.FlightCallOptions(headers=[(b"authorization", f"Bearer {TOKEN}".encode())])

    def get(request: tuple[str, list[int]]):
        return client.do_get(fl.Ticket(proto.encode(proto.SAMPLES, segment=request[0], rows=request[1])),
                             opts).read_all()

    def gen():
        pool = ThreadPoolExecutor(streams)
        for table in pool.map(get, requests):
            for column in table.columns:
                for chunk in column.chunks:
                    for buf in chunk.buffers():
                        if buf is not None and buf.size:
                            np.frombuffer(buf, np.uint8)[::PAGE].sum()
            yield [int(pc.sum(pc.list_value_length(table["prompt_ids"])).as_py()
                       + pc.sum(pc.list_value_length(table["response_ids"])).as_py())]
    return gen()


def build_mds(url: str, payload: str, mds: str) -> bool:
    """The store's samples as an MDS dataset when Streaming imports (bench_streaming.py's layout)."""
    try:
        from bench_streaming import ARRAYS as S_ARRAYS, import_streaming
        streaming = import_streaming()
    except Exception as e:  # noqa: BLE001 - not installed (or not importable): the comparison is left out
        print(f"MosaicML Streaming not importable ({type(e).__name__}: {e}); its column is left out", file=sys.stderr)
        return False
    import trajstore

    store = trajstore.connect(url, payload=payload, migrate=False)
    columns = {k: f"ndarray:{v}" for k, v in S_ARRAYS.items()} | {"trajectory_id": "str", "sample_index": "int"}
    with streaming.MDSWriter(out=mds, columns=columns, compression=None) as w:
        for s in store.samples():
            row = {k: np.ascontiguousarray(getattr(s, k)).view(v) if getattr(s, k).dtype == np.bool_
                   else getattr(s, k) for k, v in S_ARRAYS.items()}
            row.update(trajectory_id=s.trajectory_id, sample_index=s.sample_index)
            w.write(row)
    store.close()
    return True


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tmp", default=None)
    p.add_argument("--dir", default=None, help="keep the store here and reuse it when it is there (default: a temporary one)")
    p.add_argument("--stalled", type=int, default=16, help="clients that open streams of the whole store and stall (0: none)")
    p.add_argument("--stalled-only", action="store_true", help="only the stalled-clients measurement")
    p.add_argument("--streams", type=int, default=4, help="parallel payload requests per remote reader (default 4)")
    p.add_argument("--routes", default="48x8", help="route layouts, comma-separated: LAYERSxTOPK or none (default 48x8)")
    p.add_argument("--backends", default="sqlite", help="sqlite, postgresql or both, comma-separated (default sqlite)")
    p.add_argument("--readers", default="1,2,4", help="reader counts, comma-separated (default 1,2,4)")
    p.add_argument("--no-extras", action="store_true", help="leave out the bare Flight and Streaming paths")
    p.add_argument("--before", default=None, help="a trajstore source tree whose server and reader make a 'before' "
                                                   "path in the same rounds")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    readers = tuple(int(k) for k in args.readers.split(","))
    layouts = [r.strip() for r in args.routes.split(",") if r.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    cluster = None
    if "postgresql" in backends:
        sys.path.insert(0, str(REPO / "tests"))
        from pg_cluster import PgCluster

        cluster = PgCluster()
        cluster.start()
    out: dict = {"samples": args.samples, "rounds": args.rounds, "cpus": os.cpu_count(), "streams": args.streams,
                 "readers": list(readers), "stores": {}}
    try:
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            for backend in backends:
                for routes in layouts:
                    label = f"{backend} {routes}"
                    d = os.path.join(args.dir or tmp, f"{backend}-{routes}") if len(backends) + len(layouts) > 2 \
                        else (args.dir or tmp)
                    url = None
                    if backend == "postgresql":
                        assert cluster is not None
                        url = cluster.url(f"replay_{routes}".replace("x", "_"))
                        cluster.create_database(f"replay_{routes}".replace("x", "_"))
                    out["stores"][label] = one_store(args, d, url, routes, readers)
                    if args.out:  # each store's figures as soon as they are there
                        Path(args.out).write_text(json.dumps(out, indent=2))
                    if args.stalled_only:
                        continue
                    print(label, json.dumps({k: v for k, v in out["stores"][label].items()
                                             if "_vs_local" in k or "server_" in k}),
                          file=sys.stderr, flush=True)
    finally:
        if cluster is not None:
            cluster.stop()
    if len(out["stores"]) == 1:  # one store: its figures at the top, as before
        out.update(out.pop("stores").popitem()[1])
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return out


def one_store(args: argparse.Namespace, d: str, url: str | None, routes: str, readers: tuple[int, ...]) -> dict:
    """Every path on one store (built in ``d`` unless there already), one server serving it."""
    t0 = time.perf_counter()
    if os.path.exists(os.path.join(d, "payload")) and (url is None and os.path.exists(os.path.join(d, "store.db"))):
        url, payload = f"sqlite:///{d}/store.db", f"{d}/payload"
        with_streaming = os.path.isdir(os.path.join(d, "mds"))
    else:
        if os.path.exists(os.path.join(d, "payload")):  # a store of an earlier run whose index is gone
            shutil.rmtree(os.path.join(d, "payload"))
        os.makedirs(d, exist_ok=True)
        url, payload = build(d, args.samples, url, routes)
        with_streaming = not args.no_extras and routes != "none" and build_mds(url, payload, os.path.join(d, "mds"))
    build_s = time.perf_counter() - t0
    segment_bytes = sum(os.path.getsize(os.path.join(payload, f)) for f in os.listdir(payload)
                        if f.startswith("samples-"))
    servers = {"remote": _serve(url, payload, REPO)}
    if args.before:
        servers["before"] = _serve(url, payload, Path(args.before))
    server, location, metrics_port = servers["remote"]
    stalled = None
    try:
        if args.stalled_only:
            return {"samples": args.samples, "stalled_clients": _stalled_clients(url, payload, location, server.pid,
                                                                               args.stalled)}
        remote_kinds = tuple(servers)
        paths = [(consumer, kind, k) for consumer in CONSUMERS for k in readers for kind in ("local",) + remote_kinds]
        if not args.no_extras:
            paths.append(("touched", "flight", 1))
        if with_streaming:
            paths.append(("touched", "streaming", 1))

        def run(kind: str, k: int, consumer: str) -> dict:
            proc, loc, _ = servers.get(kind, servers["remote"])
            return run_readers(kind, k, url, payload, loc, d, consumer, args.streams,
                               Path(args.before) if kind == "before" else REPO)

        for consumer, kind, k in paths:  # warm: page cache, the server's first connections
            run(kind, k, consumer)
        figures: dict[tuple[str, str, int], list[dict]] = {}
        served = {kind: {"cpu": 0.0, "tokens": 0.0, "bytes": 0.0, "epochs": 0} for kind in servers}
        for _ in range(args.rounds):
            for consumer, kind, k in paths:
                proc, _, port = servers.get(kind, servers["remote"])
                t_0, b_0 = (_metric(port, "trajstore_replay_tokens_served_total"),
                            _metric(port, "trajstore_replay_payload_bytes_served_total"))
                c0 = _cpu_s(proc.pid)  # after the scrapes: answering them is not serving the epoch
                fig = run(kind, k, consumer)
                fig["server_cpu_s"] = _cpu_s(proc.pid) - c0
                fig["served_bytes"] = _metric(port, "trajstore_replay_payload_bytes_served_total") - b_0
                if kind in servers:
                    tally = served[kind]
                    tally["cpu"] += fig["server_cpu_s"]
                    tally["tokens"] += _metric(port, "trajstore_replay_tokens_served_total") - t_0
                    tally["bytes"] += fig["served_bytes"]
                    tally["epochs"] += 1
                figures.setdefault((consumer, kind, k), []).append(fig)
        hwm = _hwm_mb(server.pid)
        if args.stalled:
            stalled = _stalled_clients(url, payload, location, server.pid, args.stalled)
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    out: dict = {"routes": routes, "store": url.split(":", 1)[0], "build_s": round(build_s, 1),
                 "sample_segment_mib": round(segment_bytes / 2**20, 1), "paths": {}}
    mine = served["remote"]
    epoch_mb = mine["bytes"] / mine["epochs"] / 1e6  # the Arrow IPC bytes of one epoch's payload
    tokens = None
    for (consumer, kind, k), figs in figures.items():
        wall = statistics.median(f["wall_s"] for f in figs)
        t = figs[0]["tokens"]
        assert all(f["tokens"] == t for f in figs), (kind, k)
        tokens = t if tokens is None else tokens
        assert t == tokens, f"{kind} x{k} read {t} tokens, others {tokens}"
        cpu = statistics.median(f["reader_cpu_s"] for f in figs)
        row = {"wall_s": round(wall, 4), "batches_per_s": round(figs[0]["batches"] / wall, 1),
               "tokens_per_s": round(t / wall), "payload_mb_per_s": round(epoch_mb / wall),
               "reader_cpu_s": round(cpu, 3), "reader_cpu_ms_per_mb": round(cpu * 1e3 / epoch_mb, 3)}
        if kind != "local" and kind != "streaming":
            server_cpu = statistics.median(f["server_cpu_s"] for f in figs)
            row["server_cpu_s"] = round(server_cpu, 3)
            row["server_cpu_ms_per_mb"] = round(server_cpu * 1e3 / epoch_mb, 3)
        out["paths"][f"{kind} x{k}, {consumer}"] = row
    for consumer in CONSUMERS:
        for k in readers:
            for kind in servers:
                name = "remote_vs_local" if kind == "remote" else f"{kind}_vs_local"
                out[f"{name}_x{k}_{consumer}"] = round(out["paths"][f"{kind} x{k}, {consumer}"]["tokens_per_s"]
                                                       / out["paths"][f"local x{k}, {consumer}"]["tokens_per_s"], 3)
    if "flight x1, touched" in out["paths"]:
        out["flight_vs_local_x1_touched"] = round(out["paths"]["flight x1, touched"]["tokens_per_s"]
                                                  / out["paths"]["local x1, touched"]["tokens_per_s"], 3)
    out["tokens_per_epoch"] = tokens
    out["payload_mb_per_epoch"] = round(epoch_mb, 2)
    for kind, tally in served.items():
        prefix = "server" if kind == "remote" else f"{kind}_server"
        out[f"{prefix}_cpu_s_per_million_tokens"] = round(tally["cpu"] / tally["tokens"] * 1e6, 4)
        out[f"{prefix}_payload_bytes_per_token"] = round(tally["bytes"] / tally["tokens"], 1)
        out[f"{prefix}_bytes_sent_per_segment_byte"] = round(tally["bytes"] / (segment_bytes * tally["epochs"]), 3)
    out["server_peak_rss_mb"] = round(hwm, 1)
    if stalled is not None:
        out["stalled_clients"] = stalled
    return out


def _serve(url: str, payload: str, tree: Path) -> tuple[subprocess.Popen, str, int]:
    """A ``trajstore replay`` process of source tree ``tree`` on the store: (process, location, metrics port)."""
    port, metrics_port = _free_port(), _free_port()
    server = subprocess.Popen([sys.executable, "-m", "trajstore.cli", "replay", "--store", url, "--payload", payload,
                               "--port", str(port), "--token", TOKEN, "--metrics-port", str(metrics_port)],
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    line = server.stderr.readline()
    assert "listening on" in line, line + server.stderr.read()
    return server, f"grpc://127.0.0.1:{port}", metrics_port


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:11])
    else:
        main()
