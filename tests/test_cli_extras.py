"""A command whose extra is not installed says which extra and how to install it,
in one line, instead of a bare "No module named ...". Each case runs the CLI in its
own process with the package made unimportable (``sys.modules[name] = None``, what
Python does for a package that is not there)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import trajstore

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    ("serve", "uvicorn", "server", ["serve", "--insecure-no-auth", "--port", "0"]),
    ("serve", "fastapi", "server", ["serve", "--insecure-no-auth", "--port", "0"]),
    ("proxy", "httpx", "server", ["proxy", "--upstream", "http://127.0.0.1:9", "--insecure-no-auth", "--port", "0"]),
    ("report", "plotly", "report", ["report", "{tmp}/r"]),
    ("report", "starlette", "report", ["report", "--serve", "--insecure-no-auth", "--port", "0"]),
    ("replay", "prometheus_client", "replay", ["replay", "--insecure-no-auth", "--port", "0"]),
    ("demo", "httpx", "server", ["demo", "--engine", "--dir", "{tmp}/d"]),
    ("demo", "fastapi", "server", ["demo", "--engine-only", "--port", "0"]),
]


@pytest.mark.parametrize("command, package, extra, argv", CASES, ids=[f"{c}-{p}" for c, p, _, _ in CASES])
def test_a_missing_extra_is_named_with_its_install_command(command, package, extra, argv, tmp_path):
    url = f"sqlite:///{tmp_path}/s.db"
    trajstore.connect(url, payload=str(tmp_path / "p")).close()
    code = (f"import sys; sys.modules[{package!r}] = None\n"
            "from trajstore.cli import main\nsys.exit(main(sys.argv[1:]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code, "--store", url, *[a.format(tmp=tmp_path) for a in argv]],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 1, (done.stdout, done.stderr)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"'{extra}' extra" in errors[0] or f"[{extra}]" in errors[0], errors[0]
    assert f"pip install -e '.[{extra}]'" in errors[0], errors[0]
