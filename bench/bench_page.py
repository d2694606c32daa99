"""The run view as its user sees it: append -> drawn in a real Chromium, side by side with another tree.

Builds a store (SQLite, or a throwaway PostgreSQL with ``--postgres``) of ``--trajectories``
simulated trajectories (the demo's rollouts, ``--layers`` x ``--topk`` routes) and a trainer's
lineage of ``--steps`` steps of ``--batch-size`` samples, then runs what a user runs beside a
run: a materializer following the log (a process folding every ``--follow-s``) and
``trajstore report --serve --refresh-s 1`` of this tree and, with ``--old DIR``, of another
tree on the same store. Both pages are opened in Debian's chromium (playwright with the
system browser; no browser is downloaded).

Each probe appends one distinctive finished trajectory and one training step of already
folded samples, then watches both pages (a DOM probe every ~10 ms) until the summary's
trajectory count shows it: append -> drawn, per page, p50 and max over ``--probes`` probes; and
until the panels in view are drawn with the same data (a page drawing panels after its summary
says so in ``data-drawn``/``data-shown``; one drawing them in the summary's task, at once).
Probes alternate which page is checked first. Also per page: the renderer's main-thread
time while idle (``--idle-s`` with nothing appended: Chrome's ``TaskDuration`` through the
DevTools protocol, as a share of one core) and the bytes received per update
(``Network.dataReceived``), and per probe the report server's CPU seconds (``/proc/PID/stat``) and
the renderer's main-thread time: what an update costs whatever the machine's load. Before the
browser, the training panels' SQL of each tree is timed on the built store (best of 5). Results
print as one table and as JSON (``--out``).

A big store is built once with ``--build-only --keep DIR`` (``--fill-batch`` trajectories per
append) and probed by later runs with the same ``--keep DIR`` (with ``--postgres``, the server's
data directory is kept there too, in DIR/pg); each run's probe trajectories have ids of their own.

    python bench/bench_page.py --trajectories 10000 --steps 500 --probes 20 --old /tmp/before
    python bench/bench_page.py --trajectories 10000 --steps 500 --probes 20 --old /tmp/before --postgres
    python bench/bench_page.py --trajectories 100000 --steps 500 --build-only --keep /tmp/page100k
    python bench/bench_page.py --trajectories 100000 --steps 500 --probes 20 --old /tmp/before --keep /tmp/page100k

``--old DIR``: a directory holding another trajstore tree (``git archive <commit> trajstore |
tar -x -C DIR``); it needs this store's migrations (copy any newer
``trajstore/migrations/versions/*`` into it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
CHROMIUM = os.environ.get("TRAJSTORE_CHROMIUM", "/usr/bin/chromium")

FOLLOW = r"""
import sys, time, trajstore
url, every = sys.argv[1], float(sys.argv[2])
with trajstore.connect(url, create=False) as store:
    while True:
        store.materialize()
        time.sleep(every)
"""

# The training panels' SQL by one tree (PYTHONPATH), each statement's best of 5 in wall and CPU seconds
# (the database's own CPU, PostgreSQL's server, is in the wall time only)
TRAINING_SQL = r"""
import json, sys, time
from trajstore.inspect._panels import PANELS
from trajstore.inspect.sql import read_only
url = sys.argv[1]
out = {}
with read_only(url) as query:
    for panel in PANELS:
        if panel.name not in ("training_steps", "never_trained"):
            continue
        for i, sql in enumerate(panel.queries(None)):
            best = [float("inf"), float("inf")]
            for _ in range(5):
                t, c = time.perf_counter(), time.process_time()
                query(sql)
                best = [min(best[0], time.perf_counter() - t), min(best[1], time.process_time() - c)]
            out[f"{panel.name}[{i}]"] = best
print(json.dumps(out))
"""


def training_sql(url: str, tree: str) -> dict[str, list[float]]:
    got = subprocess.run([sys.executable, "-c", TRAINING_SQL, url], env=dict(os.environ, PYTHONPATH=tree),
                         cwd=tree, capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f"timing the training panels' SQL of {tree} failed:\n{got.stderr}")
    return json.loads(got.stdout)


def build(url: str, args: argparse.Namespace) -> None:
    import numpy as np

    import trajstore
    from bench_report import config, fill

    cfg = config(args)
    t = time.perf_counter()
    with trajstore.connect(url) as store:
        fill(store, cfg, 0, args.trajectories, args.fill_batch, args.versions, args.trajectories)
        store.materialize()
        reader = trajstore.SampleReader(store, batch_size=args.batch_size)
        rng = np.random.default_rng(0)
        steps = 0
        while steps < args.steps:
            for batch in reader:
                notes = {(s.trajectory_id, s.sample_index): {"trainer_logprobs": np.asarray(
                    s.rollout_logprobs, np.float32) - np.float32(0.01 * rng.random())} for s in batch[:2]}
                reader.record_step(steps, run="bench", policy_version=max(s.max_model_version for s in batch),
                                   metrics={"loss": 1.0 / (steps + 1), "kl": 1e-3 * rng.random()},
                                   annotations=notes)
                steps += 1
                if steps >= args.steps:
                    break
    print(f"built {args.trajectories} trajectories and {args.steps} training steps in "
          f"{time.perf_counter() - t:.0f} s", flush=True)


def kept_cluster(home: str):
    """A PostgreSQL server whose data directory is ``home``/pg, kept between runs (``--keep``): the
    first run creates and fills it, later runs start it again and probe the same store."""
    import pwd
    from pathlib import Path

    from pg_cluster import PgCluster

    class Kept(PgCluster):
        def _make_base_dir(self) -> None:
            self.base_dir = Path(home) / "pg"
            self.base_dir.mkdir(parents=True, exist_ok=True)
            if self.run_as_postgres:
                pw = pwd.getpwnam("postgres")
                os.chown(self.base_dir, pw.pw_uid, pw.pw_gid)

        def _spawn_watchdog(self) -> None:  # the tests' watchdog deletes the directory: this one is kept
            pass

        def start(self) -> None:
            if not (Path(home) / "pg" / "data" / "PG_VERSION").exists():
                return super().start()
            self._make_base_dir()
            self.port = free_port()
            self._write_settings()
            self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_path), "-w", "start")

        def stop(self) -> None:
            if self.base_dir is not None and (self.data_dir / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop", check=False)

    from pg_cluster import free_loopback_port as free_port

    return Kept()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (and its reaped children) from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def serve(url: str, tree: str) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.Popen([sys.executable, "-m", "trajstore.cli", "--store", url, "report", "--serve", "--port",
                             "0", "--insecure-no-auth", "--refresh-s", "1"], stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True, env=env, cwd=tree)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+/)", line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise SystemExit(f"report server of {tree} did not start")


class Watched:
    """One page in the browser, with its DevTools session (main-thread time, bytes received)."""

    def __init__(self, browser, name: str, base: str) -> None:
        self.name = name
        self.page = browser.new_page(viewport={"width": 1300, "height": 900})
        self.cdp = self.page.context.new_cdp_session(self.page)
        self.cdp.send("Performance.enable")
        self.cdp.send("Network.enable")
        self.received = 0
        self.cdp.on("Network.dataReceived", lambda e: setattr(self, "received", self.received + e["dataLength"]))
        self.page.goto(base)
        self.page.wait_for_function("Number(document.body.dataset.refreshes) >= 1", timeout=600_000)
        self.latencies: list[float] = []
        self.panel_latencies: list[float] = []

    def task_s(self) -> float:
        return {m["name"]: m["value"] for m in self.cdp.send("Performance.getMetrics")["metrics"]}["TaskDuration"]

    def refreshes(self) -> int:
        return int(self.page.evaluate("Number(document.body.dataset.refreshes || 0)"))

    def in_view_drawn(self) -> bool:
        """Whether the panels in view show the data the summary shows (a page that draws every panel in
        the task that draws the summary has no ``data-shown``: drawn with it)."""
        return bool(self.page.evaluate("document.body.dataset.shown === undefined || "
                                       "document.body.dataset.drawn === document.body.dataset.shown"))

    def shows(self, count: int) -> bool:
        return bool(self.page.evaluate(
            "(n) => Array.from(document.querySelectorAll('#summary tr')).some(r => r.cells[0].textContent === "
            "'trajectories' && r.cells[1].textContent.startsWith(n + ' ('))", count))


RUN_SEED = 900_000 + int(time.time()) % 1_000_000 * 100
"""Probe trajectories of this run have ids of their own: a store kept (``--keep``) and probed again
gets new trajectories, never an append of one it already has (which adds nothing to show)."""


def probe_events(cfg, i: int, version: int) -> list[dict]:
    from trajstore.demo._simulate import trajectory_events

    return trajectory_events(replace(cfg, seed=RUN_SEED + i), 0, version=version)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=10_000)
    p.add_argument("--steps", type=int, default=500, help="training steps recorded before the probes")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--versions", type=int, default=50)
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--idle-s", type=float, default=20.0)
    p.add_argument("--follow-s", type=float, default=0.25, help="the following materializer's pause between folds")
    p.add_argument("--old", default=None, help="another trajstore tree, served beside this one")
    p.add_argument("--postgres", action="store_true", help="a throwaway PostgreSQL store (tests/pg_cluster.py)")
    p.add_argument("--keep", default=None, help="build the store in this directory and keep it (reused if there)")
    p.add_argument("--fill-batch", type=int, default=1000, help="trajectories per append while building the store")
    p.add_argument("--build-only", action="store_true", help="build the store (with --keep) and stop")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "page.json"))
    args = p.parse_args()
    sys.path.insert(0, HERE)
    import trajstore
    from bench_report import config

    workdir = args.keep or tempfile.mkdtemp(prefix="bench-page-")
    os.makedirs(workdir, exist_ok=True)
    cluster = None
    if args.postgres:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from pg_cluster import PgCluster

        cluster = kept_cluster(workdir) if args.keep else PgCluster()
        cluster.start()
        built = os.path.join(workdir, "pg-built")
        os.environ["TRAJSTORE_PAYLOAD_DIR"] = os.path.join(workdir, "pg-payload")
        if os.path.exists(built):
            url = cluster.url("bench_page")
        else:
            url = cluster.create_database("bench_page")
            build(url, args)
            with open(built, "w") as f:
                f.write(f"{args.trajectories} trajectories, {args.steps} steps\n")
        # the page reads through a login holding only the reader role (trajstore sql and the report
        # refuse a superuser), made as docs/sql.md says
        from sqlalchemy.engine import make_url

        from trajstore.inspect.sql import create_reader_login

        with trajstore.connect(url) as store:
            if not os.path.exists(built + "-reader"):
                create_reader_login(store, "bench_page_reader", password="")
                open(built + "-reader", "w").close()
        view_url = make_url(url).set(username="bench_page_reader", password=None).render_as_string(False)
    else:
        url = view_url = f"sqlite:///{workdir}/run.db"
        if not os.path.exists(f"{workdir}/run.db"):
            build(url, args)
    if args.build_only:
        if cluster is not None:
            cluster.stop()
        return
    procs = []
    load = [os.getloadavg()[0]]
    results: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "backend":
                     "postgresql" if args.postgres else "sqlite", "trajectories": args.trajectories,
                     "steps": args.steps, "pages": {}}
    try:
        trees = {"this tree": ROOT} | ({"old tree": os.path.abspath(args.old)} if args.old else {})
        results["training_sql"] = {name: training_sql(view_url, tree) for name, tree in trees.items()}
        for name, got in results["training_sql"].items():
            print(f"{name}: training panels' SQL, best of 5 (ms wall): "
                  + ", ".join(f"{k} {1e3 * v[0]:.1f}" for k, v in got.items()), flush=True)
        follower = subprocess.Popen([sys.executable, "-c", FOLLOW, url, str(args.follow_s)],
                                    env=dict(os.environ, PYTHONPATH=ROOT))
        procs.append(follower)
        bases, servers = {}, {}
        for name, tree in trees.items():
            proc, bases[name] = serve(view_url, tree)
            procs.append(proc)
            servers[name] = proc.pid
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            pages = [Watched(browser, name, base) for name, base in bases.items()]
            # idle: nothing appended; what does an open page cost?
            time.sleep(2)
            before = {w.name: (w.task_s(), w.received, w.refreshes()) for w in pages}
            time.sleep(args.idle_s)
            for w in pages:
                task, got, refreshes = before[w.name]
                results["pages"][w.name] = {
                    "idle_core_share": (w.task_s() - task) / args.idle_s,
                    "idle_bytes_per_s": (w.received - got) / args.idle_s,
                    "idle_updates": w.refreshes() - refreshes}
            cfg = config(args)
            with trajstore.connect(url, create=False) as store:
                reader = trajstore.SampleReader(store, batch_size=args.batch_size)
                batches = iter(reader)
                start = {w.name: (w.received, w.refreshes(), w.task_s(), cpu_s(servers[w.name])) for w in pages}
                for i in range(args.probes):
                    summary = pages[0].page.evaluate(
                        "Array.from(document.querySelectorAll('#summary tr')).find(r => r.cells[0].textContent === "
                        "'trajectories').cells[1].textContent")
                    expected = int(summary.split(" ")[0]) + 1
                    batch = next(batches)
                    t0 = time.perf_counter()
                    store.append(probe_events(cfg, i, version=args.versions + 1))
                    reader.record_step(args.steps + i, run="bench", policy_version=args.versions + 1)
                    t_ack = time.perf_counter()
                    order = pages if i % 2 == 0 else pages[::-1]
                    waiting, drawing = list(order), []
                    deadline = t0 + 60
                    while (waiting or drawing) and time.perf_counter() < deadline:
                        for w in list(waiting):
                            if w.shows(expected):
                                w.latencies.append(time.perf_counter() - t0)
                                waiting.remove(w)
                                drawing.append(w)
                        for w in list(drawing):  # then the panels in view, drawn with that data
                            if w.in_view_drawn():
                                w.panel_latencies.append(time.perf_counter() - t0)
                                drawing.remove(w)
                        time.sleep(0.01)
                    for w in waiting:
                        w.latencies.append(float("inf"))
                    for w in waiting + drawing:
                        w.panel_latencies.append(float("inf"))
                    load.append(os.getloadavg()[0])
                    print(f"probe {i}: ack {1e3 * (t_ack - t0):.0f} ms; "
                          + ", ".join(f"{w.name} {w.latencies[-1]:.2f} s (panels in view {w.panel_latencies[-1]:.2f} s)"
                                      for w in pages), flush=True)
                    del batch
                for w in pages:
                    got, refreshes, task, server = start[w.name]
                    updates = max(w.refreshes() - refreshes, 1)
                    # what an update costs, whatever the machine's load: the server's CPU (change checks,
                    # the panels' SQL, drawing, JSON) and the renderer's main-thread time, per probe
                    results["pages"][w.name].update({
                        "server_cpu_s_per_probe": (cpu_s(servers[w.name]) - server) / args.probes,
                        "render_s_per_probe": (w.task_s() - task) / args.probes})
                    lat = sorted(w.latencies)
                    panel_lat = sorted(w.panel_latencies)
                    results["pages"][w.name].update({
                        "p50_s": statistics.median(lat), "max_s": lat[-1],
                        "panels_in_view_p50_s": statistics.median(panel_lat), "panels_in_view_max_s": panel_lat[-1],
                        "panels_in_view_latencies_s": panel_lat,
                        "bytes_per_update": (w.received - got) / updates, "updates": updates,
                        "latencies_s": lat})
            browser.close()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if cluster is not None:
            cluster.stop()
    results["load_average"] = [min(load), max(load)]
    # the "Current figures" row (bench/summary.py)
    mine, old = results["pages"].get("this tree"), results["pages"].get("old tree")
    if mine:
        results["summary"] = [{
            "what": f"run view in Chromium, append → drawn, {results['backend']}, {args.trajectories:,} trajectories, "
                    f"{args.steps} training steps",
            "figure": f"p50 {mine['p50_s']:.2f} s, max {mine['max_s']:.2f} s (panels in view p50 "
                      f"{mine['panels_in_view_p50_s']:.2f} s, max {mine['panels_in_view_max_s']:.2f} s; {args.probes} "
                      f"probes); idle page {mine['idle_core_share']:.1%} of a core; server CPU "
                      f"{mine['server_cpu_s_per_probe']:.2f} s per probe",
            "baseline": "-" if not old else f"--old tree, same run: p50 {old['p50_s']:.2f} s, max {old['max_s']:.2f} s, "
                                            f"server CPU {old['server_cpu_s_per_probe']:.2f} s per probe",
            "section": "[Run view in a browser](#the-run-view-in-a-browser--benchbench_pagepy)"}]
    print(f"\n{results['backend']}, {args.trajectories} trajectories, {args.steps} steps, {args.probes} probes "
          f"(load average {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} cores)")
    print(f"{'page':<10} {'p50 s':>6} {'max s':>6} {'in view p50/max s':>17} {'idle core':>9} {'idle B/s':>9} {'KB/update':>9} "
          f"{'server CPU s/probe':>18} {'render s/probe':>14}")
    for name, r in results["pages"].items():
        print(f"{name:<10} {r['p50_s']:6.2f} {r['max_s']:6.2f} "
              f"{r['panels_in_view_p50_s']:8.2f}/{r['panels_in_view_max_s']:<8.2f} {r['idle_core_share']:9.1%} "
              f"{r['idle_bytes_per_s']:9.0f} {r['bytes_per_update'] / 1e3:9.1f} {r['server_cpu_s_per_probe']:18.2f} "
              f"{r['render_s_per_probe']:14.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
