"""Builders and probes shared by the tests."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import numpy as np
from sqlalchemy import func, select

from trajstore.demo._simulate import RolloutConfig
from trajstore.schema import events, materializer_checkpoints, samples, segments, trajectories


REPO = Path(__file__).resolve().parents[1]


def started(tid: str = "t1", **kw: Any) -> dict:
    return {"type": "trajectory_started", "trajectory_id": tid, **kw}


def gen(tid: str, seq: int, prompt, output, *, version: int = 0, **kw: Any) -> dict:
    return {"type": "generation", "trajectory_id": tid, "seq": seq, "prompt_ids": list(prompt),
            "output_ids": list(output), "model_version": version, **kw}


def finished(tid: str = "t1", status: str = "completed", **kw: Any) -> dict:
    return {"type": "trajectory_finished", "trajectory_id": tid, "status": status, **kw}


def reward(tid: str, value: float, **kw: Any) -> dict:
    return {"type": "reward", "trajectory_id": tid, "reward": value, **kw}


def routes(rows: int, layers: int = 1, topk: int = 1, value=None, dtype=np.uint8) -> np.ndarray:
    if value is None:
        return np.arange(rows * layers * topk, dtype=np.int64).reshape(rows, layers, topk).astype(dtype) % 7
    return np.full((rows, layers, topk), value, dtype=dtype)


def snapshot(store) -> dict[str, Any]:
    """Everything an append could change: row counts, the head, the payload files."""
    with store.log.read_engine.connect() as conn:
        counts = {t.name: conn.execute(select(func.count()).select_from(t)).scalar_one()
                  for t in (events, trajectories, segments, samples, materializer_checkpoints)}
        revisions = dict(conn.execute(select(trajectories.c.trajectory_id, trajectories.c.revision)).all())
    return {"counts": counts, "head": store.log.head_position(), "revisions": revisions,
            "files": sorted(n for n, _ in store.payload.list_names())}


# the demo trajectories of the tests of old (deprecated) names: the `five_trajectories` fixture's
OLD_NAMES_CFG = RolloutConfig(turns=2, prompt_tokens=8, output_tokens=4, observation_tokens=2, layers=2, topk=2, seed=1)


TEST_READER_LOGIN = "trajstore_test_analyst"


def reader_url_for(store_url: str) -> str:
    """Inspection runs under a login that holds only the reader's rights:
    ``store_url`` itself for SQLite; on PostgreSQL the same database through a
    reader login, made the way docs/sql.md says (``trajstore init --reader-login``)."""
    if not store_url.startswith("postgresql"):
        return store_url
    import trajstore
    from sqlalchemy.engine import make_url
    from trajstore.inspect.sql import create_reader_login

    with trajstore.connect(store_url) as store:
        create_reader_login(store, TEST_READER_LOGIN, password="")
    return make_url(store_url).set(username=TEST_READER_LOGIN, password=None).render_as_string(False)


def wait_http(url: str, proc: subprocess.Popen, *, timeout_s: float, detail: Callable[[], Any] = lambda: "",
              ready: Callable[[int], bool] = lambda status: status == 200, poll_s: float = 0.2) -> None:
    """Return once ``url`` answers with a ``ready`` status. Fails (AssertionError) when ``proc``,
    the server, exits first or ``timeout_s`` passes, with ``detail()`` (its output, its log's
    tail) in the message."""
    import httpx  # the server extra: only the tests that start a server need it

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url}: the server exited with {proc.returncode} before answering:\n{detail()}")
        try:
            if ready(httpx.get(url, timeout=2).status_code):
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise AssertionError(f"{url} did not answer in {timeout_s:.0f} s:\n{detail()}")


def free_port() -> int:
    """A loopback TCP port free at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_s3(bucket: str, log_path: str | os.PathLike = os.devnull) -> Iterator[str]:
    """A real S3-compatible server (``moto_server``) on a loopback port with ``bucket``
    made; yields its endpoint (``host:port``). Its request log goes to ``log_path``; the
    AWS credential variables hold test values while it runs and are restored after."""
    import pyarrow.fs as pafs
    import pytest

    # this interpreter's (a moto_server elsewhere on PATH may be another Python's, another moto)
    exe = str(Path(sys.executable).parent / "moto_server")
    if not os.path.exists(exe):
        pytest.fail("moto_server not found: install the dev extra (moto[server])")
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail("moto_server did not start")
                time.sleep(0.1)
        endpoint = f"127.0.0.1:{port}"
        pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True).create_dir(bucket)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def kill_at_pause(module: str, *args: str, marker: str, what: str, point: str) -> None:
    """Runs ``python -m module *args`` from the checkout until it reaches its pause point,
    that is until it writes the file ``marker`` (it writes ``marker + ".done"`` instead
    when it ends without passing the point), then kills it -9. Fails if it exits before
    or never gets there in 120 s; ``what`` and ``point`` name the process and the point
    in those messages."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        deadline = time.time() + 120
        while not os.path.exists(marker) and not os.path.exists(marker + ".done") and time.time() < deadline:
            assert proc.poll() is None, f"the {what} process died before its pause (exit {proc.returncode})"
            time.sleep(0.02)
        assert os.path.exists(marker), f"the {what} never reached its pause point {point}"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Stop a server process as Ctrl-C does (SIGINT); killed if it is still there after ``timeout_s``."""
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serve_process(*argv: str, env: dict[str, str], start_timeout_s: float = 120.0,
                  stop_timeout_s: float = 30.0) -> Iterator[tuple[subprocess.Popen, str]]:
    """``trajstore serve`` as a real process: ``python -m trajstore.cli *argv --port P`` on a
    free loopback port, its output piped. Yields ``(proc, url)`` once ``/healthz`` answers 200
    (fails with its stderr if it exits first); stopped with SIGINT (``stop_process``) after."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trajstore.cli", *argv, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "serve did not start"
                time.sleep(0.1)
        yield proc, url
    finally:
        stop_process(proc, stop_timeout_s)


@contextlib.contextmanager
def proxy_process(*argv: str, env: dict[str, str] | None = None, tries: int = 300) -> Iterator[str]:
    """``trajstore proxy`` as deployed, a real process: ``python -m trajstore.cli *argv --port P``
    on a free loopback port, run from the checkout (on its ``PYTHONPATH``) with ``env`` added to
    this environment. Yields its URL once ``/healthz`` answers 200 (up to ``tries`` polls; fails
    if it exits first); terminated after."""
    import httpx

    port = free_port()
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "trajstore.cli", *argv, "--port", str(port)], env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(tries):
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
            assert proc.poll() is None, f"proxy exited with {proc.returncode}"
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def brute_force_expert_load(samples, every: int = 1) -> dict[tuple, int]:
    """Decode-route expert load by (version, layer, expert), one generated token at a time:
    the route row of the position before it, left out when masked; ``every`` > 1 counts the
    tokens at response positions ``p`` with ``(p + phase) % every == 0`` only (``phase``:
    crc32 of ``"<trajectory_id>/<sample_index>"`` mod ``every``), each ``every`` times
    (docs/report.md "Aggregates": the expert load's sampling)."""
    import zlib

    import numpy as np

    expected: dict[tuple, int] = {}
    for s in samples:
        if s.routed_experts is None:
            continue
        phase = zlib.crc32(f"{s.trajectory_id}/{s.sample_index}".encode()) % every
        for j in np.nonzero(s.token_model_versions >= 0)[0]:
            if (int(j) + phase) % every:
                continue
            row = len(s.prompt_ids) + j - 1
            if row < 0 or (s.routed_experts_mask is not None and s.routed_experts_mask[row]):
                continue
            for layer, experts in enumerate(s.routed_experts[row]):
                for e in experts:
                    key = (int(s.token_model_versions[j]), layer, int(e))
                    expected[key] = expected.get(key, 0) + every
    return expected


def count_expert_load_every(store, every: int) -> None:
    """Set the store's expert-load sampling stride (its ``store_settings`` row; 1: exact)."""
    import time

    from trajstore.log._dialect import execute

    def put(conn, d) -> None:
        execute(conn, f"DELETE FROM store_settings WHERE name = {d.p}", ("expert_load_sample_every",))
        execute(conn, f"INSERT INTO store_settings (name, value, updated_at) VALUES ({d.marks(3)})",
                ("expert_load_sample_every", str(every), time.time()))

    store.log.db.transaction("setting the expert-load sampling", put)
