"""The kill -9 harness of the rollout driver (``trajstore.rollout``), shared by its test and its bench.

Real processes on loopback: the simulated engine (``trajstore.demo._engine``,
deterministic answers, every answer it starts logged to a file), a real
``trajstore proxy`` in front of it, and the reference driver
(``python -m trajstore.demo._rollout``, the token-level agent that continues
a trajectory from its tail). :func:`run_proof` runs one rollout uninterrupted
(run ``ref``), then the same dataset and seed (run ``killed``) while killing
the driver, the proxy or the engine with SIGKILL at random moments of its
work, restarting each, and returns what the checks need: the calls the engine
generated, the calls recorded, what the driver was told was recorded, the
tokens at stake at each kill, both runs' plans and samples.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers import free_port, reader_url_for, wait_http

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Setup:
    prompts: int = 14
    group_size: int = 4
    concurrency: int = 4
    turns: int = 3
    fail_every: int = 5
    skip: str = "p007"
    latency_s: float = 0.08
    kills: tuple[str, ...] = ("driver", "driver", "proxy", "driver", "engine", "driver", "driver", "driver")
    seed: int = 43


@dataclass
class Kill:
    victim: str
    wasted_calls: int
    """calls the engine generated that are not recorded, new since the previous kill"""
    open_groups: int = 0
    continued: int = 0
    """running trajectories with recorded calls (the next driver continues them)"""
    scratch_tokens: int = 0
    """output tokens recorded in the open groups: what restarting them from scratch generates again"""


@dataclass
class Proof:
    kills: list[Kill] = field(default_factory=list)
    engine_calls: collections.Counter = field(default_factory=collections.Counter)
    recorded: collections.Counter = field(default_factory=collections.Counter)
    ref_engine_calls: collections.Counter = field(default_factory=collections.Counter)
    ref_recorded: collections.Counter = field(default_factory=collections.Counter)
    acked: list[tuple[str, int]] = field(default_factory=list)
    recorded_seqs: set = field(default_factory=set)
    groups: list = field(default_factory=list)
    """the killed run's rows of the SQL view rollout_groups: prompt_id, epoch, whole, dropped, dropped_reason"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


class _Procs:
    """The engine, the proxy and the driver, each restartable on the same port."""

    def __init__(self, store_url: str, workdir: Path, setup: Setup) -> None:
        self.store_url, self.dir, self.setup = store_url, workdir, setup
        self.engine_port, self.proxy_port = free_port(), free_port()
        self.engine = self.proxy = self.driver = None
        self.call_log = self.ack_log = ""

    def start_engine(self) -> None:
        code = ("from trajstore.demo._engine import make_engine; from trajstore.ingest._http import run_server; "
                f"run_server(make_engine(call_log={self.call_log!r}, latency_s={self.setup.latency_s}), "
                f"name='engine', host='127.0.0.1', port={self.engine_port})")
        self.engine = subprocess.Popen([sys.executable, "-c", code], env=_env(), cwd=REPO,
                                       stdout=subprocess.DEVNULL, stderr=open(self.dir / "engine.log", "a"))
        wait_http(f"http://127.0.0.1:{self.engine_port}/health", self.engine, timeout_s=60,
                  detail=lambda: self._log("engine"))

    def start_proxy(self) -> None:
        self.proxy = subprocess.Popen(
            [sys.executable, "-m", "trajstore.cli", "--store", self.store_url, "proxy", "--upstream",
             f"http://127.0.0.1:{self.engine_port}", "--port", str(self.proxy_port), "--insecure-no-auth"],
            env=_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(self.dir / "proxy.log", "a"))
        wait_http(f"http://127.0.0.1:{self.proxy_port}/healthz", self.proxy, timeout_s=60,
                  detail=lambda: self._log("proxy"))

    def start_driver(self, run: str) -> None:
        s = self.setup
        self.driver = subprocess.Popen(
            [sys.executable, "-m", "trajstore.demo._rollout", "--store", self.store_url,
             "--proxy", f"http://127.0.0.1:{self.proxy_port}", "--run", run, "--prompts", str(s.prompts),
             "--group-size", str(s.group_size), "--concurrency", str(s.concurrency), "--turns", str(s.turns),
             "--fail-every", str(s.fail_every), "--skip", s.skip, "--seed", str(s.seed), "--ack-log", self.ack_log],
            env=_env(), cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(self.dir / f"driver-{run}.log", "a"))

    def wait_driver(self, timeout_s: float) -> None:
        try:
            code = self.driver.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.driver.kill()
            self.driver.wait()
            raise AssertionError(f"the driver did not finish in {timeout_s} s: {self._log('driver')}") from None
        assert code == 0, f"the driver exited with {code}: {self._log('driver')}"

    def _log(self, name: str) -> str:
        logs = sorted(self.dir.glob(f"{name}*.log"))
        return "".join(p.read_text()[-3000:] for p in logs)

    def kill(self, name: str) -> None:
        proc = getattr(self, name)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop_all(self) -> None:
        for proc in (self.driver, self.proxy, self.engine):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def engine_calls(path: str) -> collections.Counter:
    """The engine's log as a multiset of ``(seed, prompt_len, output_len)``."""
    out: collections.Counter = collections.Counter()
    if os.path.exists(path):
        for line in open(path):
            c = json.loads(line)
            out[(c["seed"], c["prompt_len"], c["output_len"])] += 1
    return out


def recorded_calls(reader_url: str, run: str) -> tuple[collections.Counter, set, dict[str, int]]:
    """The run's recorded calls (SQL view ``generation_events``, read as the reader login) as the
    same multiset, their ``(trajectory_id, seq)`` and each trajectory's output tokens."""
    from trajstore.demo._rollout import member_seed
    from trajstore.inspect.sql import read_only

    with read_only(reader_url) as query:
        rows = query("SELECT trajectory_id, seq, prompt_len, output_len FROM generation_events").rows
    calls: collections.Counter = collections.Counter()
    seqs, tokens = set(), collections.Counter()
    for tid, seq, prompt_len, output_len in rows:
        parts = tid.split("/")  # run/e<epoch>/<prompt_id>/<index>
        if parts[0] != run:
            continue
        calls[(member_seed(parts[2], int(parts[1][1:]), int(parts[3])), prompt_len, output_len)] += 1
        seqs.add((tid, int(seq)))
        tokens[tid] += output_len
    return calls, seqs, dict(tokens)


def _settle(reader_url: str, run: str, call_log: str) -> tuple[collections.Counter, dict[str, int]]:
    """Wait until the engine and the store stop moving (the proxy may still record an answer
    that was in flight); the unrecorded calls and each trajectory's tokens then."""
    last = None
    while True:
        time.sleep(0.3)
        calls, _, tokens = recorded_calls(reader_url, run)
        now = (sum(calls.values()), _lines(call_log))
        if now == last:
            return engine_calls(call_log) - calls, tokens
        last = now


def run_proof(store_url: str, workdir: Path, setup: Setup = Setup(), *, timeout_s: float = 120.0) -> Proof:
    import trajstore

    workdir.mkdir(parents=True, exist_ok=True)
    # created and migrated once, before the processes, which find the payload location in the store
    trajstore.connect(store_url, payload=str(workdir / "payload")).close()
    reader_url = reader_url_for(store_url)
    procs = _Procs(store_url, workdir, setup)
    proof = Proof()
    rng = random.Random(setup.seed)
    try:
        # the uninterrupted run
        procs.call_log, procs.ack_log = str(workdir / "calls-ref.jsonl"), str(workdir / "acks-ref.txt")
        procs.start_engine()
        procs.start_proxy()
        procs.start_driver("ref")
        procs.wait_driver(timeout_s)
        procs.kill("engine")
        # the same rollout, killed
        procs.call_log, procs.ack_log = str(workdir / "calls.jsonl"), str(workdir / "acks.txt")
        procs.start_engine()
        procs.start_driver("killed")
        wasted_before = 0
        with trajstore.connect(store_url) as store:
            for victim in setup.kills:
                n0 = _lines(procs.call_log)
                deadline = time.monotonic() + timeout_s
                while _lines(procs.call_log) <= n0 and procs.driver.poll() is None:  # the driver is at work
                    assert time.monotonic() < deadline, "no engine call after a restart"
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 0.25))
                if procs.driver.poll() is not None:
                    break
                procs.kill(victim)
                unrecorded, tokens = _settle(reader_url, "killed", procs.call_log)
                wasted = sum(unrecorded.values())
                kill = Kill(victim, wasted - wasted_before)
                wasted_before = wasted
                if victim == "driver":
                    plan = store.rollout_state("killed")
                    kill.open_groups = len(plan.open)
                    kill.continued = sum(1 for g in plan.open for t in g.running if len(t.tokens))
                    kill.scratch_tokens = sum(n for tid, n in tokens.items()
                                              if any(tid.startswith(g.group_id + "/") for g in plan.open))
                proof.kills.append(kill)
                getattr(procs, f"start_{victim}")(*(("killed",) if victim == "driver" else ()))
            procs.wait_driver(timeout_s)
            proof.engine_calls = engine_calls(procs.call_log)
            proof.recorded, proof.recorded_seqs, _ = recorded_calls(reader_url, "killed")
            proof.ref_engine_calls = engine_calls(str(workdir / "calls-ref.jsonl"))
            proof.ref_recorded, _, _ = recorded_calls(reader_url, "ref")
            from trajstore.inspect.sql import read_only

            with read_only(reader_url) as query:
                proof.groups = [tuple(r) for r in query(
                    "SELECT prompt_id, epoch, whole, dropped, dropped_reason FROM rollout_groups "
                    "WHERE run = 'killed' ORDER BY prompt_id").rows]
        proof.acked = [(tid, int(seq)) for tid, seq in (line.split() for line in open(procs.ack_log))]
    finally:
        procs.stop_all()
    return proof
