"""The demo's train stage: stream batches from the store into a tiny
megatron-core MoE model with router replay, and show what happened.

The training itself runs in ``workers/trainer.py``, in a child process, for
two reasons. On a CPU-only machine megatron-core 0.16.1 needs a few shims
(CUDA device, TransformerEngine GEMM, CUDA RNG); those belong to runnable
scripts and tests, never to the ``trajstore`` package, and patching them
into the demo's own process would leak into everything after it. And the
worker is the same program a user runs as a trainer reader process, so the
demo shows the real path: store -> reader -> collate -> replay -> backward.

When megatron-core is not installed, or the package runs without its source
checkout (no ``workers/``), the stage is skipped with a message saying why.
"""

from __future__ import annotations

from rich.markup import escape

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["demo_train", "worker_path"]

STEPS = 5
MAX_TOKENS_PER_BATCH = 8192


def worker_path() -> Path | None:
    """workers/trainer.py of the source checkout this package runs from, if any."""
    path = Path(__file__).resolve().parents[2] / "workers" / "trainer.py"
    return path if path.is_file() else None


def demo_train(console: Any, url: str, args: Any) -> None:
    """Train a few steps on the demo store at ``url`` and print a table of them."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        console.print("train stage skipped: megatron-core is not installed (pip install -e '.[megatron]')", markup=False)
        return
    worker = worker_path()
    if worker is None:
        console.print("train stage skipped: workers/trainer.py not found (run the demo from a source checkout)")
        return
    reports, error = _run_worker(worker, _worker_args(url, args))
    if error:
        console.print(f"[red]train stage failed[/red]: {escape(error)}")
        return
    _show(console, reports)


def _worker_args(url: str, args: Any) -> list[str]:
    from trajstore.demo._simulate import DEMO_CONFIG

    argv = ["--store", url, "--steps", str(STEPS), "--max-tokens", str(MAX_TOKENS_PER_BATCH),
            "--group-size", str(DEMO_CONFIG.group_size), "--num-experts", str(DEMO_CONFIG.num_experts),
            # The rollouts span policy versions 0..4; the trainer starts at 3 and
            # moves on every 2 steps, skipping what is more than 2 versions old.
            "--start-version", "3", "--version-every", "2", "--max-staleness", "2", "--json"]
    if getattr(args, "payload", None):
        argv += ["--payload", args.payload]
    return argv


def _run_worker(worker: Path, argv: list[str]) -> tuple[list[dict[str, Any]], str | None]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")  # megatron warns about absent TransformerEngine/Apex
    out = subprocess.run([sys.executable, str(worker), *argv], capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return [], lines[-1] if lines else f"exit code {out.returncode}"
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")], None


def _show(console: Any, reports: list[dict[str, Any]]) -> None:
    from rich.table import Table

    steps = [r for r in reports if not r.get("summary")]
    summary = next((r for r in reports if r.get("summary")), {})
    table = Table(title="train: tiny megatron-core MoE on CPU, routes replayed from the store")
    for column in ("step", "samples", "tokens", "routes [1,T,L,K]", "replayed tokens", "router = recorded",
                   "free routing = recorded", "loss", "stale skipped"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in steps:
        table.add_row(str(r["step"]), str(r["samples"]), str(r["tokens"]), "x".join(map(str, r["routes"])),
                      str(r["replayed_tokens"]), f"{r['replay_agreement']:.1%}", f"{r['free_routing_agreement']:.1%}",
                      f"{r['loss']:.4f}", str(r["stale_skipped"]))
    console.print(table)
    if steps:
        console.print(f"MoE layers replay recorded layers {steps[0]['moe_layer_ids']}; packed THD batches of "
                      f"<= {MAX_TOKENS_PER_BATCH} tokens, GRPO groups kept whole; reader state to resume from: "
                      f"{summary.get('state_bytes', '?')} bytes of JSON")
    else:
        console.print("train stage: the reader found no batch to train on")
