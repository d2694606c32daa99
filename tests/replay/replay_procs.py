"""Replay servers as real processes on loopback: `trajstore replay` started with the CLI.

``ReplayProcess`` starts one on a fixed port (so a restart after kill -9 comes
back at the same address), waits for its "listening" line and keeps its
stderr in a file the tests read (log lines of its waits)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
READ_TOKEN = "read-token-0123456789"
WRITE_TOKEN = "write-token-9876543210"


class ReplayProcess:
    def __init__(self, store_url: str, payload: str, log_dir: Path, *extra: str, port: int | None = None,
                 metrics_port: int | None = None) -> None:
        self.store_url, self.payload, self.extra = store_url, payload, extra
        self.port = port or free_port()
        self.metrics_port = metrics_port
        tls = "--tls-cert" in extra
        self.location = f"grpc+tls://localhost:{self.port}" if tls else f"grpc://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"replay-{self.port}-{self.starts}.log"

    def start(self) -> "ReplayProcess":
        self.starts += 1
        cmd = [sys.executable, "-m", "trajstore.cli", "replay", "--store", self.store_url, "--payload", self.payload,
               "--port", str(self.port), "--token", READ_TOKEN, "--write-token", WRITE_TOKEN, *self.extra]
        if self.metrics_port is not None:
            cmd += ["--metrics-port", str(self.metrics_port)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=ROOT, env=env)
        log.close()
        deadline = time.monotonic() + 60
        while "listening on" not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"replay server exited {self.proc.returncode}: {self.log()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"replay server did not start: {self.log()[-2000:]}")
            time.sleep(0.05)
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()
