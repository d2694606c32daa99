"""The first hour without a GPU: ``trajstore demo --engine`` and docs/first-hour.md's
step-by-step path, run as written with real processes (engine, proxy) and its agent script."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np

import trajstore
from helpers import free_port, wait_http
from trajstore.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "first-hour.md")


def test_demo_engine_records_episodes_with_routes_and_spans(tmp_path, capsys):
    assert main(["demo", "--engine", "--dir", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "recorded 4 episodes x 3 calls; folded 4 samples" in out
    assert "rollout ledger of run demo: 2 prompts dispatched, 2 groups whole, 0 open" in out
    with trajstore.connect(f"sqlite:///{tmp_path}/d/engine-demo.db") as store:
        samples = {s.trajectory_id: s for s in store.samples()}
        assert sorted(samples) == [f"episode-{i}" for i in range(4)]
        assert {s.group_id for s in samples.values()} == {"task-0", "task-1"}
        s = samples["episode-0"]
        generated = s.token_model_versions[s.token_model_versions >= 0]
        assert set(generated.tolist()) == {0, 1}  # the engine moved to weights "1" inside a call
        assert s.routed_experts.shape == (len(s.prompt_ids) + len(s.response_ids), 2, 2)
        assert int(s.routed_experts_mask.sum()) == 1  # only the last token has no route
        assert s.loss_mask.sum() == 18 and (s.loss_mask[s.token_model_versions < 0] == 0).all()


def _output(proc: subprocess.Popen):
    """What the process wrote, once it has exited (never waits on a running one)."""
    return proc.communicate() if proc.poll() is not None else "(still running)"


def test_first_hour_page_works_as_written(tmp_path):
    """The page's commands with its own ports, and its agent script verbatim."""
    page = open(DOC).read()
    blocks = re.findall(r"```(bash|python)\n(.*?)```", page, re.S)
    commands = [line.strip() for kind, text in blocks if kind == "bash" for line in text.splitlines()]
    engine_cmd = next(c for c in commands if "--engine-only" in c)
    proxy_cmd = next(c for c in commands if " proxy " in c)
    agent = next(text for kind, text in blocks if kind == "python" and "X-Trajstore-Trajectory" in text)
    engine_port, proxy_port = free_port(), free_port()
    store_url = f"sqlite:///{tmp_path}/run/trajstore.db"
    exe = [sys.executable, "-m", "trajstore.cli"]

    def argv(cmd: str) -> list[str]:
        cmd = cmd.replace("sqlite:///run/trajstore.db", store_url).replace("8000", str(engine_port))
        cmd = cmd.replace("8701", str(proxy_port))
        assert cmd.startswith("trajstore ")
        return exe + cmd.split()[1:]

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    engine = subprocess.Popen(argv(engine_cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proxy = None
    try:
        wait_http(f"http://127.0.0.1:{engine_port}/health", engine, timeout_s=90, detail=lambda: _output(engine))
        os.makedirs(tmp_path / "run")
        proxy = subprocess.Popen(argv(proxy_cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        wait_http(f"http://127.0.0.1:{proxy_port}/healthz", proxy, timeout_s=90, detail=lambda: _output(proxy))
        script = tmp_path / "agent.py"
        script.write_text(textwrap.dedent(agent).replace("8701", str(proxy_port)))
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines() == ["recorded as seq 0", "recorded as seq 1"]
    finally:
        for p in (proxy, engine):
            if p is not None:
                p.terminate()
                p.wait(30)
    with trajstore.connect(store_url) as store:
        assert store.materialize().num_samples_after == 1
        (s,) = store.samples()
    assert s.trajectory_id == "my-episode" and s.reward == 1.0
    assert set(s.token_model_versions[s.token_model_versions >= 0].tolist()) == {0, 1}
    assert s.routed_experts is not None and not s.routed_experts_mask[:-1].any()
    assert np.asarray(s.loss_mask).sum() == 12


def test_a_named_label_stays_until_set_again():
    """After `update_weight_version step-42` the clock moved on to "1": a trajectory's versions
    went back from 42 to 1 and it never folded (docs/first-hour.md's label recipe)."""
    from trajstore.demo._engine import WeightClock

    clock = WeightClock(update_every=10)
    assert [s["version"] for s in clock.spans(12)] == ["default", "1"]
    clock.set("step-42")
    assert {s["version"] for s in clock.spans(35)} == {"step-42"}
    clock.set("7")
    assert [s["version"] for s in clock.spans(10)] == ["7", "8"]
