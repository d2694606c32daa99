"""A new user's first hour, through the CLI: servers say "listening" only
when they answer and one ``error:`` line otherwise; the demo deletes only
what it made; long ingests log progress without a terminal; errors name
what and where. Real subprocesses and servers on loopback."""

from __future__ import annotations

import os
import re
import selectors
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import free_port, stop_process

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "trajstore.cli"]


def run(*argv: str, cwd=None, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRAJSTORE_TOKEN"}
    return {**env, **extra}


def _server_argv(command: str, tmp_path: Path, port: int) -> list[str]:
    argv = ["--store", f"sqlite:///{tmp_path}/s.db", command, "--port", str(port)]
    return argv + (["--upstream", "http://127.0.0.1:9"] if command == "proxy" else [])


def _stderr_lines_until(proc: subprocess.Popen, needle: str, timeout_s: float = 60) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    # a selector, not select.select: select() refuses descriptors past 1023, which a test
    # process that opened many files and sockets before this one reaches
    watch = selectors.DefaultSelector()
    watch.register(proc.stderr, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if watch.select(0.2):
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if needle in line:
                return lines
        elif proc.poll() is not None:
            break
    raise AssertionError(f"no {needle!r} on stderr: {lines}")


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_a_server_says_listening_only_once_it_answers(command, tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    port = free_port()
    proc = subprocess.Popen([*CLI, *_server_argv(command, tmp_path, port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(TRAJSTORE_TOKEN="t0ken"))
    try:
        lines = _stderr_lines_until(proc, "listening on")
        # the line comes after the server answers: one try, no retry
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        assert lines[-1].startswith(f"trajstore {command}: listening on http://127.0.0.1:{port} (store sqlite:///")
    finally:
        stop_process(proc)


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_a_server_without_a_token_prints_one_error_line_and_never_listening(command, tmp_path):
    pytest.importorskip("fastapi")
    proc = run(*_server_argv(command, tmp_path, free_port()), env=_env(), timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        "error: no token: pass --token or set $TRAJSTORE_TOKEN (or --insecure-no-auth to run open)"]


@pytest.mark.parametrize("command", ["serve", "proxy"])
def test_a_server_on_a_taken_port_prints_one_error_line(command, tmp_path):
    pytest.importorskip("fastapi")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run(*_server_argv(command, tmp_path, port), env=_env(TRAJSTORE_TOKEN="t0ken"), timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(another process has it: stop that one or pick another --port)"], proc.stderr


@pytest.mark.parametrize("host, warned", [("0.0.0.0", True), ("127.0.0.1", False)])
def test_serve_insecure_no_auth_warns_unless_on_loopback(tmp_path, host, warned):
    """Running open is worth a warning where other machines reach the port, not on 127.0.0.1."""
    pytest.importorskip("fastapi")
    port = free_port()
    proc = subprocess.Popen([*CLI, *_server_argv("serve", tmp_path, port), "--insecure-no-auth", "--host", host],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        lines = _stderr_lines_until(proc, "listening on")
        assert any(f"running open (--insecure-no-auth) on {host}" in line for line in lines) == warned, lines
    finally:
        stop_process(proc)


def test_a_second_demo_keeps_the_report_the_user_made(tmp_path):
    """The demo prints ``report DIR/report`` as a next step; a second demo
    removed that report with its own store and export."""
    for _ in range(2):
        proc = run("demo", "--trajectories", "4", "--workers", "1", "--dir", "d", "--no-train", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        report = tmp_path / "d" / "report"
        if not report.exists():
            report.mkdir()
            (report / "index.html").write_text("the user's report")
            (tmp_path / "d" / "export" / "old-part").write_text("the demo's export is the demo's")
    assert (report / "index.html").read_text() == "the user's report"
    assert not (tmp_path / "d" / "export" / "old-part").exists()


def test_a_long_ingest_without_a_terminal_prints_progress_lines(tmp_path):
    """Off a terminal the bar was silent: a 253-MB ingest printed nothing for 45 s."""
    from tests.test_cli import write_jsonl

    write_jsonl(tmp_path / "ev.jsonl", n=200)
    proc = run("--store", f"sqlite:///{tmp_path}/s.db", "ingest", str(tmp_path / "ev.jsonl"),
               env=_env(TRAJSTORE_PROGRESS_INTERVAL_S="0"))
    assert proc.returncode == 0, proc.stderr
    size = (tmp_path / "ev.jsonl").stat().st_size
    shown = f"of {size} bytes" if size < 1000 else "of "
    for name in ("validate", "append"):  # one pass after the other, each counting the file's bytes once
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"ingest: {name} {tmp_path / 'ev.jsonl'}: ")]
        assert len(lines) >= 2 and lines[-1].endswith("(done)"), proc.stderr
        assert shown in lines[0] and "%" in lines[0]
        assert "(100%)" in lines[-1], lines[-1]  # not 50%: the bytes are not counted twice


def test_export_and_report_print_progress_off_a_terminal(tmp_path):
    """Both took 8-11 s on a run's store with nothing on stderr until the end."""
    import trajstore
    from trajstore.demo._run import DEMO_CONFIG
    from trajstore.demo._simulate import trajectory_events
    from trajstore.inspect._panels import PANELS

    url = f"sqlite:///{tmp_path}/s.db"
    with trajstore.connect(url, payload=str(tmp_path / "payload")) as store:
        for i in range(40):
            store.append(trajectory_events(DEMO_CONFIG, i))
        store.materialize()
        num_samples = store.info()["samples"]
    env = _env(TRAJSTORE_PROGRESS_INTERVAL_S="0")
    proc = run("--store", url, "export", str(tmp_path / "exp"), env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("exporting samples: ")]
    assert len(lines) >= 2 and lines[-1].startswith(f"exporting samples: {num_samples} of {num_samples} (100%)")
    assert lines[-1].endswith("(done)")
    proc = run("--store", url, "report", str(tmp_path / "r"), env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("drawing the report's panels: ")]
    assert len(lines) >= 3 and lines[-1].startswith(f"drawing the report's panels: {len(PANELS)} of {len(PANELS)}")
    assert lines[-1].endswith("(done)")


@pytest.fixture
def scram_cluster():
    """A cluster of the test's own where login ``pw_analyst`` must give a password (scram-sha-256)."""
    from pg_cluster import PgCluster, PostgresNotFound

    try:
        cluster = PgCluster()
        cluster.start()
    except PostgresNotFound as e:
        pytest.skip(str(e))
    try:
        hba = cluster.data_dir / "pg_hba.conf"
        # the local socket under peer authentication (the OS user's own name only), as distributions set it up
        hba.write_text("local all pw_analyst peer\nhost all pw_analyst 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
        cluster.reload()
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.postgres
def test_init_reader_login_prints_a_command_that_logs_in_as_pasted(scram_cluster, tmp_path):
    """It printed ``analyst:%2A%2A%2A@...``: pasted, that logs in with the password ``***``."""
    url = scram_cluster.create_database()
    env = _env(TRAJSTORE_READER_PASSWORD="s3cret pass", TRAJSTORE_PAYLOAD_DIR=str(tmp_path / "pay"),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = run("--store", url, "init", "--reader-login", "pw_analyst", env=env)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.splitlines()[-1]
    assert "s3cret" not in proc.stdout and "***" not in line and "%2A" not in line
    command = line[line.index("): ") + 3:]
    assert command.startswith('PGPASSWORD="$TRAJSTORE_READER_PASSWORD" trajstore --store ')
    pasted = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=120)
    assert pasted.returncode == 0, pasted.stderr
    assert "(1 row)" in pasted.stdout and " 0 " in pasted.stdout, pasted.stdout
    wrong = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120,
                           env={**env, "TRAJSTORE_READER_PASSWORD": "nope"})
    assert wrong.returncode == 1 and "password authentication failed" in wrong.stderr, wrong.stderr


def _one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: "), proc.stderr
    return proc.stderr.strip()


def test_errors_name_what_is_wrong(tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "notdb.db").write_text("not a database, just text that is long enough")
    (tmp_path / "e.jsonl").write_text('{"type": "trajectory_started", "trajectory_id": "t"}\n')
    store = f"sqlite:///{tmp_path}/s.db"
    assert _one_error(run("--store", store, "ingest", str(tmp_path / "adir"))) == (
        f"error: {tmp_path / 'adir'} is a directory: ingest takes one JSONL file (or - for stdin)")
    assert _one_error(run("--store", store, "report", str(tmp_path / "afile"))) == (
        f"error: report: {tmp_path / 'afile'} is a file; the report writes a directory (index.html and plotly.min.js)")
    for argv in (["ingest", str(tmp_path / "e.jsonl")], ["init"], ["info"]):
        line = _one_error(run("--store", f"sqlite:///{tmp_path}/notdb.db", *argv))
        assert line == f"error: not a trajstore store: {tmp_path}/notdb.db is not a SQLite database", (argv, line)
    assert _one_error(run("--store", "x.db", "info")) == (
        "error: not a store URL: 'x.db' (use sqlite:///path.db or postgresql+psycopg://...)")
    assert (tmp_path / "notdb.db").read_text().startswith("not a database")


def test_sql_prints_iso_times_or_unix_seconds_as_docs_say(tmp_path):
    from tests.test_cli import write_jsonl

    write_jsonl(tmp_path / "ev.jsonl", n=2)
    store = f"sqlite:///{tmp_path}/s.db"
    assert run("--store", store, "ingest", str(tmp_path / "ev.jsonl")).returncode == 0
    query = "SELECT first_event_at FROM trajectory_summary LIMIT 1"
    iso = run("--store", store, "sql", "--format", "csv", query).stdout.splitlines()[1]
    unix = run("--store", store, "sql", "--format", "json", "--unix-times", query).stdout
    import datetime as dt
    import json

    seconds = json.loads(unix)[0]["first_event_at"]
    assert abs(dt.datetime.fromisoformat(iso).timestamp() - seconds) < 0.001
    docs = (REPO / "docs" / "sql.md").read_text()
    assert "as ISO 8601 UTC in every format" in docs and "--unix-times" in docs


def test_a_writer_on_a_new_directory_says_it_made_it(tmp_path):
    """``Writer("sqlite:///nonexist-dir/x.db")`` made the directory and a store without a word."""
    code = ("from trajstore.ingest.client import Writer\n"
            "with Writer('sqlite:///nonexist-dir/x.db') as w:\n"
            "    w.extend([{'type': 'trajectory_started', 'trajectory_id': 't'}])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"created directory {tmp_path / 'nonexist-dir'} for a new SQLite store" in proc.stderr


def test_the_docs_examples_use_only_what_trajstore_installs():
    """docs/ingest.md's proxy example called ``requests``, which no extra installs."""
    for page in ("docs/ingest.md", "README.md"):
        text = (REPO / page).read_text()
        assert "requests.post(" not in text and "requests.get(" not in text and "import requests" not in text, page
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"httpx>=' in pyproject and "httpx.post(" in (REPO / "docs/ingest.md").read_text()


def test_report_serve_prints_a_link_with_the_token_and_answers_a_browser_without_it_with_a_page(tmp_path):
    """Without the token the page answered raw JSON; the link to open was left to guess."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("plotly")
    import trajstore

    url = f"sqlite:///{tmp_path}/s.db"
    trajstore.connect(url, payload=str(tmp_path / "payload")).close()
    port = free_port()
    proc = subprocess.Popen([*CLI, "--store", url, "report", "--serve", "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(TRAJSTORE_TOKEN="a b/c"))
    try:
        lines = _stderr_lines_until(proc, "open the page: ")
        link = lines[-1].split("open the page: ", 1)[1].strip()
        assert link == f"http://127.0.0.1:{port}/?token=a%20b%2Fc"  # clickable: the token quoted
        locked = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
        assert locked.status_code == 401 and locked.headers["content-type"].startswith("text/html")
        assert "needs its token" in locked.text and "?token=TOKEN" in locked.text
        assert httpx.get(f"http://127.0.0.1:{port}/api/data", timeout=10).json()["error"]["rule"] == "unauthorized"
        opened = httpx.get(link, timeout=30, follow_redirects=True)
        assert opened.status_code == 200 and "trajstore report" in opened.text
    finally:
        stop_process(proc)


def test_trajstore_lineage_needs_no_import_of_its_own():
    """``trajstore.lineage.step_samples`` (docs/lineage.md) raised AttributeError after ``import trajstore``."""
    proc = subprocess.run([sys.executable, "-c", "import trajstore; print(trajstore.lineage.step_samples.__name__)"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and proc.stdout.strip() == "step_samples", proc.stderr


@pytest.mark.postgres
def test_init_reader_login_through_a_local_socket_prints_a_command_that_logs_in(scram_cluster, tmp_path):
    """A store URL through the local socket gave a command that peer authentication refuses
    (the OS user is not the reader login): the printed one goes over TCP, where the password works."""
    url = scram_cluster.create_database()
    dbname = url.rsplit("/", 1)[1]
    socket_url = f"postgresql+psycopg://postgres@/{dbname}?host={scram_cluster.base_dir}&port={scram_cluster.port}"
    env = _env(TRAJSTORE_READER_PASSWORD="s3cret", TRAJSTORE_PAYLOAD_DIR=str(tmp_path / "pay"),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = run("--store", socket_url, "init", "--reader-login", "pw_analyst", env=env)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.splitlines()[-1]
    command = line[line.index("): ") + 3:]
    assert f"pw_analyst@127.0.0.1:{scram_cluster.port}/{dbname}" in command, command
    pasted = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=120)
    assert pasted.returncode == 0, pasted.stderr
    assert "(1 row)" in pasted.stdout
    # the socket itself refuses the reader login, as the command printed before would have used it
    through_socket = subprocess.run(
        [*CLI, "--store", f"postgresql+psycopg://pw_analyst@/{dbname}?host={scram_cluster.base_dir}"
                          f"&port={scram_cluster.port}", "sql", "SELECT 1"],
        capture_output=True, text=True, env=env, timeout=120)
    assert through_socket.returncode == 1 and "peer authentication failed" in through_socket.stderr.lower(), \
        through_socket.stderr


def test_demo_engine_keeps_the_first_demos_store(tmp_path):
    """README's second line (`demo --engine`) deleted the first line's demo store, and the
    commands the first demo printed failed: each demo has its own directory."""
    pytest.importorskip("fastapi")
    first = run("demo", "--trajectories", "4", "--workers", "1", "--no-train", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    engine = run("demo", "--engine", cwd=tmp_path)
    assert engine.returncode == 0, engine.stderr
    assert (tmp_path / "trajstore-demo" / "trajstore.db").exists()
    assert (tmp_path / "trajstore-engine-demo" / "engine-demo.db").exists()
    info = run("--store", "sqlite:///trajstore-demo/trajstore.db", "info", cwd=tmp_path)  # as the demo prints it
    assert info.returncode == 0 and '"samples": 0' not in info.stdout, info.stderr


def test_readme_lists_every_extra_with_what_it_enables():
    import tomllib

    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Extras"):]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z0-9-]+)` \| [^|]+ \| ([^|]+) \|$", section, re.M)}
    assert set(rows) == extras, (sorted(extras - set(rows)), sorted(set(rows) - extras))
    assert all(len(what.strip()) > 5 for what in rows.values())
