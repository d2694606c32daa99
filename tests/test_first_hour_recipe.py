"""docs/first-hour.md walked as written: its code blocks are extracted from the
markdown and run in order (the engine and the proxy in the background, the
harness saved as agent.py, every shell line through bash, the Python snippets
through python), with only the two fixed ports swapped for free ones. A command
the page names that does not exist, or a recipe that leaves the trajectory
unfoldable, fails here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import free_port, stop_process
from tests.test_cli_first_hour import _stderr_lines_until

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "first-hour.md"


def _blocks(section_from: str, section_to: str) -> list[tuple[str, str]]:
    text = PAGE.read_text()
    text = text[text.index(section_from):text.index(section_to)]
    return [(m.group(1), textwrap.dedent(m.group(2)))
            for m in re.finditer(r"```(bash|python)\n(.*?)\n[ \t]*```", text, re.S)]


def _lines(script: str) -> list[str]:
    """Shell lines of a block: continuations joined, comments and blanks left out."""
    return [line.strip() for line in script.replace("\\\n", " ").splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_the_pages_commands_exist():
    """Every `trajstore COMMAND` the page names is a command the CLI has (it named `compact`)."""
    from trajstore.cli import _parser

    commands = set(_parser()._subparsers._group_actions[0].choices)
    named = set(re.findall(r"`(?:\.venv/bin/)?trajstore (?:--store \S+ )?([a-z][a-z-]*)", PAGE.read_text()))
    named |= {c.strip("` ") for row in re.findall(r"^\| (`[^|]+) \|", PAGE.read_text(), re.M)
              for c in re.findall(r"`([a-z][a-z-]*)", row)}
    named -= {"workers"}  # the table's `workers/trainer.py`, a script of the checkout
    assert named and named <= commands, sorted(named - commands)


@pytest.mark.timeout(300)
def test_step_by_step_and_the_named_label_as_written(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    engine_port, proxy_port = free_port(), free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "TRAJSTORE_TOKEN"}, "PYTHONPATH": str(REPO),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}

    def ported(text: str) -> str:
        return text.replace("8000", str(engine_port)).replace("8701", str(proxy_port))

    blocks = [(kind, ported(body)) for kind, body in _blocks("## Step by step", "## Beside a run")]
    kinds = [k for k, _ in blocks]
    assert kinds == ["bash", "bash", "python", "bash", "python", "bash", "bash"], kinds
    (engine_line,), (proxy_line,) = _lines(blocks[0][1]), _lines(blocks[1][1])
    servers = []
    try:
        for line, ready in ((engine_line, "listening on"), (proxy_line, "listening on")):
            proc = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=tmp_path, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            servers.append(proc)
            _stderr_lines_until(proc, ready)
        (tmp_path / "agent.py").write_text(blocks[2][1])
        outputs = [_run(["python", "agent.py"], tmp_path, env)]
        assert outputs[0].count("recorded as seq") == 2
        outputs += [_run(["bash", "-c", line], tmp_path, env) for line in _lines(blocks[3][1])]
        assert "my-episode" in outputs[-1]  # the folded sample
        outputs.append(_run(["python", "-c", blocks[4][1]], tmp_path, env))
        # the named label: held back until the label is mapped, then folded at version 42
        held = [_run(["bash", "-c", line], tmp_path, env) for line in _lines(blocks[5][1])]
        assert '"num_held_back": 1' in held[-1] and '"num_trajectories": 0' in held[-1], held[-1]
        folded = [_run(["bash", "-c", line], tmp_path, env) for line in _lines(blocks[6][1])]
        assert '"num_trajectories": 1' in folded[1], folded[1]
        (row,) = [line for line in folded[2].splitlines() if "label-try" in line]
        assert row.split() == ["label-try", "42", "42"] or re.findall(r"\b42\b", row) == ["42", "42"], folded[2]
    finally:
        for proc in servers:
            stop_process(proc)


def _run(argv: list[str], cwd: Path, env: dict) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (argv, proc.stdout, proc.stderr)
    return proc.stdout
