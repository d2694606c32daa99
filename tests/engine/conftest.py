"""A real vLLM server (the CPU build, in its own virtualenv) for the engine tests.

The engine runs from ``.venv-vllm`` (made by ``.ci/vllm_venv``; another
python with ``$TRAJSTORE_VLLM_PYTHON``), never imported here: it serves a
tiny random Qwen3-MoE built by ``tiny_model.py`` into the module's temp dir,
started once per test module with ``--enable-scale-out`` (the
token-in/token-out endpoint) and ``VLLM_SERVER_DEV_MODE=1`` (pause, resume,
weight-version labels). Without that python the tests are skipped, unless
``$TRAJSTORE_REQUIRE_ENGINE=1`` (CI), where they fail.

``trajstore proxy`` runs as its own process (the CLI a user starts) in front
of the engine, on a store of the module's per backend (``store`` here is module-scoped:
each test uses trajectory ids of its own and reads back only those).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

httpx = pytest.importorskip("httpx", reason="needs the extra: pip install 'trajstore[server]'")

from helpers import free_port, wait_http  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
START_TIMEOUT_S = 300


def _engine_python() -> str:
    python = os.environ.get("TRAJSTORE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        message = f"no vLLM virtualenv at {python}: run `bash .ci/vllm_venv` (or set $TRAJSTORE_VLLM_PYTHON)"
        if os.environ.get("TRAJSTORE_REQUIRE_ENGINE") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python


def _tail(log: Path, n: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group this fixture started (the server and its engine processes), then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)


@dataclass
class Engine:
    url: str
    model_dir: Path
    log: Path

    def label(self, version: str) -> None:
        """Set the engine's weight-version label (what a trainer's finish_weight_update does)."""
        resp = httpx.post(f"{self.url}/update_weight_version", json={"new_version": version}, timeout=30)
        assert resp.status_code == 200, resp.text


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    python = _engine_python()
    work = tmp_path_factory.mktemp("vllm")
    model = work / "tiny-qwen3-moe"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([python, str(HERE / "tiny_model.py"), str(model)], check=True, env=env, capture_output=True)
    port = free_port()
    log = work / "vllm.log"
    env.update(VLLM_SERVER_DEV_MODE="1", VLLM_CONFIGURE_LOGGING="1", VLLM_LOGGING_LEVEL="WARNING",
               VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "tiny",
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--enable-scale-out",
           "--max-model-len", "8192", "--max-num-seqs", "4", "--enforce-eager", "--seed", "0",
           # on CPU this is the share of the machine's memory for the KV cache (1.2 GiB of 15)
           "--gpu-memory-utilization", "0.08"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc, timeout_s=START_TIMEOUT_S, detail=lambda: _tail(log),
                  poll_s=0.5)
        yield Engine(f"http://127.0.0.1:{port}", model, log)
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def store(module_store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator["trajstore.Store"]:
    """One store per backend for the module's tests (each test's trajectory ids are its own): the
    proxy in front of it is started once per backend, not once per test."""
    import trajstore

    s = trajstore.connect(module_store_url, payload=str(tmp_path_factory.mktemp("engine-store") / "payload"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def proxy(engine: Engine, store, module_store_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``trajstore proxy`` (the CLI, its own process) between the tests and the engine, on the module's store."""
    work = tmp_path_factory.mktemp("proxy")
    port = free_port()
    log = work / "proxy.log"
    script = Path(sys.executable).with_name("trajstore")
    cli = [str(script)] if script.exists() else [sys.executable, "-c", "import sys; from trajstore.cli import main; sys.exit(main())"]
    cmd = [*cli, "--store", module_store_url, "--payload", store.payload.location, "proxy",
           "--upstream", engine.url + "/v1", "--port", str(port), "--insecure-no-auth", "--log-level", "warning"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc, timeout_s=60, detail=lambda: _tail(log), poll_s=0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)
