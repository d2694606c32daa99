"""The guide's recipes walked as written, with real processes: every shell and Python
block of the pages below is read from the markdown (tests/docs_recipes.py) and run
in order in a fresh directory per page, through the real ``trajstore`` CLI of this
checkout (servers in the background, stopped at the end of the page with the
Ctrl-C or SIGTERM their page promises they stop cleanly on).
Each must exit 0 and print what its page's ``<!-- recipe: ... -->`` comment says it
prints. Blocks that need what this machine lacks (a GPU, a package install) are
marked ``skip`` with a reason in the page, and listed here by name: nothing is
skipped silently. The only change to the text is the fixed ports of a page, each
swapped for a free one."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docs_recipes import Recipe, parse_mark, recipes, shell_script
from tests.helpers import free_port

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

# The pages walked (README and every page of docs/README.md's guide), and the blocks each
# leaves out (page:line of the fence -> the reason its comment gives). A block marked skip
# in a page but missing here, or listed here but run, fails
# test_the_skipped_blocks_are_the_listed_ones.
WALKED = {
    "README.md": {
        "README.md:84": "continues the block above (its routes array)",
    },
    "docs/deploy.md": {
        "docs/deploy.md:311": "needs a Ray cluster and PostgreSQL (tests/test_ray_actors.py runs the shards)",
    },
    "docs/first-hour.md": {},
    "docs/ingest.md": {
        "docs/ingest.md:33": "names a cluster's hosts (PostgreSQL at db, an ingest service, S3)",
        "docs/ingest.md:55": "needs a vLLM engine on a GPU (first-hour.md walks the same with the simulated one)",
        "docs/ingest.md:164": "names a cluster's hosts (PostgreSQL at db, an ingest service, S3)",
        "docs/ingest.md:244": "a fragment: names objects of the text around it",
        "docs/ingest.md:465": "a benchmark (docs/benchmarks.md)",
        "docs/ingest.md:484": "needs a vLLM engine on a GPU (first-hour.md walks the same with the simulated one)",
        "docs/ingest.md:493": "a template: continues the block above (a proxy in front of vLLM)",
        "docs/ingest.md:677": "a benchmark (docs/benchmarks.md)",
        "docs/ingest.md:746": "a benchmark (docs/benchmarks.md)",
    },
    "docs/lineage.md": {
        "docs/lineage.md:25": "run as written by tests/test_lineage.py, on SQLite and PostgreSQL",
        "docs/lineage.md:205": "a fragment: names objects of the text around it (store) and an OpenLineage server",
    },
    "docs/materializer.md": {},
    "docs/projections.md": {
        "docs/projections.md:21": "a fragment: names objects of the text around it (store, SampleReader)",
    },
    "docs/reader.md": {
        "docs/reader.md:17": "a template: names the trainer's own objects (model, loss, checkpoint)",
        "docs/reader.md:56": "a template: names the trainer's own objects (model, loss, checkpoint)",
        "docs/reader.md:153": "a template: names the trainer's own objects (model, loss, checkpoint)",
        "docs/reader.md:226": "a template: names the trainer's own objects (model, loss, checkpoint)",
        "docs/reader.md:279": "a template: names the trainer's own objects (model, loss, checkpoint)",
        "docs/reader.md:312": "a fragment: names objects of the text around it",
    },
    "docs/reference.md": {
        "docs/reference.md:484": "a template: names the trainer's own objects (model, loss, checkpoint)",
        "docs/reference.md:567": "a fragment: names objects of the text around it",
    },
    "docs/replay.md": {
        "docs/replay.md:27": "names a cluster's hosts (PostgreSQL at db, an ingest service, S3)",
        "docs/replay.md:54": "a template: names the trainer's own objects (model, loss, checkpoint)",
    },
    "docs/report.md": {
        "docs/report.md:16": "a synopsis (URL, TOKEN); sql.md's cookbook runs the static and the live page",
        "docs/report.md:70": "needs the live page of the block above and jq",
        "docs/report.md:133": "needs two stores of runs",
        "docs/report.md:337": "a synopsis (URL)",
        "docs/report.md:415": "a benchmark (docs/benchmarks.md)",
    },
    "docs/rollout.md": {
        "docs/rollout.md:17":
            "a template for a framework's rollout loop; python -m trajstore.demo._rollout is the runnable one (tests/test_rollout_kill.py)",
    },
    "docs/sglang.md": {
        "docs/sglang.md:28": "needs an SGLang engine on a GPU",
        "docs/sglang.md:120": "needs an SGLang engine on a GPU",
        "docs/sglang.md:146": "needs an SGLang engine on a GPU",
    },
    "docs/skyrl.md": {
        "docs/skyrl.md:15": "needs SkyRL 0.4.0 (tests/train/test_skyrl.py runs it with the framework's wheel)",
        "docs/skyrl.md:68": "needs SkyRL 0.4.0 (tests/train/test_skyrl.py runs it with the framework's wheel)",
    },
    "docs/sql.md": {
        "docs/sql.md:11": "a synopsis (its query is ...); the cookbook below runs these commands on the demo's store",
    },
    "docs/verl.md": {
        "docs/verl.md:22": "needs verl 0.9.1 (tests/train/test_verl.py runs it with the framework's wheel)",
        "docs/verl.md:60": "needs verl 0.9.1 (tests/train/test_verl.py runs it with the framework's wheel)",
        "docs/verl.md:84": "needs verl 0.9.1 and a GPU",
    },
    "docs/vllm.md": {
        "docs/vllm.md:14": "needs a vLLM engine on a GPU (first-hour.md walks the same with the simulated one)",
        "docs/vllm.md:174": "a test run (tests/ingest/test_proxy_fuzz.py)",
        "docs/vllm.md:195": "a benchmark (docs/benchmarks.md)",
    },
}

_PORT = re.compile(r"(?:--port[ =]|--report-port[ =]|localhost:|127\.0\.0\.1:)(\d{4,5})\b")


def _ported(page_recipes: list[Recipe]) -> dict[str, str]:
    """Every fixed port the page's recipes name -> a free one."""
    ports = {p for r in page_recipes for p in _PORT.findall(r.text + (r.run or ""))}
    return {p: str(free_port()) for p in sorted(ports)}


def _swap(text: str, ports: dict[str, str]) -> str:
    for old, new in ports.items():
        text = re.sub(rf"\b{old}\b", new, text)
    return text


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env.update(PYTHONPATH=str(REPO), PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", HOME=str(tmp),
               PYTHONUNBUFFERED="1", NO_COLOR="1")
    return env


def _exported(cwd: Path, env: dict[str, str]) -> dict[str, str]:
    """The environment a shell block left (its ``export``s), for the blocks after it: the
    page's blocks run as in one terminal."""
    dump = cwd / ".recipe-env"
    if not dump.exists():
        return env
    pairs = [item.split("=", 1) for item in dump.read_text().split("\0") if "=" in item]
    dump.unlink()
    return {k: v for k, v in pairs if k not in ("SHLVL", "_", "PWD", "OLDPWD")}


def _check_output(r: Recipe, out: str) -> None:
    for text in r.expect:
        assert text in out, f"{r.where}: the output lacks {text!r}:\n{out}"
    for regex in r.match:
        assert re.search(regex, out, re.M), f"{r.where}: the output does not match {regex!r}:\n{out}"


def _start(cmd: list[str], cwd: Path, env: dict, n: int) -> tuple[subprocess.Popen, Path]:
    log = cwd / f".recipe-{n}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    return proc, log


def _wait_ready(r: Recipe, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 90
    while r.ready and r.ready not in log.read_text():
        assert proc.poll() is None, f"{r.where}: exited {proc.returncode} before {r.ready!r}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"{r.where}: no {r.ready!r} in 90 s:\n{log.read_text()}"
        time.sleep(0.1)


def _command(r: Recipe, ports: dict[str, str], cwd: Path, n: int) -> list[str]:
    if r.save:
        (cwd / r.save).write_text(_swap(r.text, ports))
    if r.run:
        return ["bash", "-c", shell_script(_swap(r.run, ports))]
    if r.save:
        return []
    if r.lang == "python":
        script = cwd / f".recipe-{n}.py"
        script.write_text(_swap(r.text, ports))
        return [sys.executable, script.name]
    if r.background:  # one command, exec'd so that the signal reaches it
        lines = [line for line in r.text.replace("\\\n", " ").splitlines()
                 if line.strip() and not line.lstrip().startswith("#")]
        assert len(lines) == 1, f"{r.where}: a background block holds one command, not {lines}"
        line = _swap(lines[0].strip(), ports)
        return ["bash", "-c", ("exec env " if re.match(r"^[A-Z_]+=", line) else "exec ") + line]
    return ["bash", "-c", shell_script(_swap(r.text, ports)) + "env -0 > .recipe-env\n"]


def walk(page: str, cwd: Path) -> list[str]:
    """Run the page's recipes in ``cwd``; returns the ``page:line`` of each one run."""
    page_recipes = recipes(REPO / page, REPO)
    ports = _ported(page_recipes)
    env = _env(cwd)
    # `.venv/bin/trajstore` as the README writes it: this checkout's venv
    (cwd / ".venv").symlink_to(VENV_BIN.parent)
    ran, servers = [], []
    try:
        for n, r in enumerate(page_recipes):
            if r.skip:
                continue
            if r.before:  # the state the prose assumes, as the comment shows it
                setup = subprocess.run(["bash", "-c", shell_script(_swap(r.before, ports)) + "env -0 > .recipe-env\n"],
                                       cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
                assert setup.returncode == 0, f"{r.where}: its 'before' exited {setup.returncode}:\n{setup.stderr}"
                env = _exported(cwd, env)
            cmd = _command(r, ports, cwd, n)
            if not cmd:
                ran.append(r.where)
                continue
            if r.background:
                proc, log = _start(cmd, cwd, env, n)
                servers.append((r, proc, log))
                _wait_ready(r, proc, log)
            else:
                proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
                out = proc.stdout + proc.stderr
                assert proc.returncode == 0, f"{r.where}: exit {proc.returncode}:\n{r.text}\n{out}"
                _check_output(r, out)
                env = _exported(cwd, env)
            ran.append(r.where)
    finally:
        stopped = []
        for r, proc, log in reversed(servers):
            if proc.poll() is None:
                proc.send_signal(getattr(signal, "SIG" + r.stop))
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            stopped.append((r, proc.returncode, log))
    for r, rc, log in stopped:
        out = log.read_text()
        # Ctrl-C: 0, or 130 (128 + SIGINT) with the CLI's one-line "interrupted"; SIGTERM: 0
        clean = {0, 130} if r.stop == "INT" else {0}
        assert rc in clean, f"{r.where}: a background recipe stopped by SIG{r.stop} exited {rc}:\n{out}"
        _check_output(r, out)
    return ran


def test_the_walk_covers_the_guide():
    """Every page docs/README.md puts in the guide is walked (with README.md)."""
    text = (REPO / "docs" / "README.md").read_text()
    guide = text.split("\n## Guide\n")[1].split("\n## Internals\n")[0]
    pages = {"README.md"} | {"docs/" + m for m in re.findall(r"\]\(([a-z0-9-]+\.md)\)", guide)}
    assert set(WALKED) == pages


def test_the_skipped_blocks_are_the_listed_ones():
    """Every block a walked page marks ``skip`` is listed above with its reason, and the reverse:
    per page, the same reasons as many times (the lines listed are where the blocks were when
    the list was written; a page edited above them moves them, not what is skipped)."""
    marked = {r.where: r.skip for page in WALKED for r in recipes(REPO / page, REPO) if r.skip}
    listed = {where: reason for skipped in WALKED.values() for where, reason in skipped.items()}

    def per_page(skips: dict[str, str]) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for where, reason in skips.items():
            out.setdefault(where.rsplit(":", 1)[0], []).append(reason)
        return {page: sorted(reasons) for page, reasons in out.items()}

    assert per_page(marked) == per_page(listed)
    print("\nskipped recipes:\n" + "\n".join(f"  {w}: {why}" for w, why in sorted(marked.items())))


def test_a_recipe_comment_is_checked():
    assert parse_mark("""save a.py run 'python a.py' expect '"n": 1' background""", "x") == {
        "save": "a.py", "run": "python a.py", "expect": ['"n": 1'], "match": [], "background": True}
    with pytest.raises(ValueError, match="unknown recipe keyword 'expcet'"):
        parse_mark("expcet x", "page.md:3")
    with pytest.raises(ValueError, match="needs an argument"):
        parse_mark("skip", "page.md:3")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", sorted(WALKED))
def test_the_page_walks_as_written(page, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    ran = walk(page, tmp_path)
    # every block the page does not mark skip ran (the marks are held to WALKED's list, by
    # reason, in test_the_skipped_blocks_are_the_listed_ones)
    every = recipes(REPO / page, REPO)
    assert ran == [r.where for r in every if not r.skip], (ran, [r.where for r in every])
