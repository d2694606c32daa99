"""Nothing a user has is deleted, split or silently empty.

Through the CLI (in process where the command allows, real subprocesses and
servers on loopback for serve/proxy/demo, a real kill -9 for interruptions)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trajstore
from trajstore.cli import _parser, main
from tests.helpers import free_port
from tests.test_cli import write_jsonl

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "trajstore.cli"]


def run(*argv: str, cwd=None, input=None, timeout=300, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, cwd=cwd, input=input, timeout=timeout,
                          env=env)


def sqlite_url(path) -> str:
    return f"sqlite:///{path}"


@pytest.fixture
def built(tmp_path, capsys):
    """A SQLite store with its payload in a directory of its own, ingested and materialized."""
    url, payload = sqlite_url(tmp_path / "s.db"), str(tmp_path / "pay")
    write_jsonl(tmp_path / "ev.jsonl", n=4)
    assert main(["--store", url, "--payload", payload, "ingest", str(tmp_path / "ev.jsonl")]) == 0
    assert main(["--store", url, "--payload", payload, "materialize"]) == 0
    capsys.readouterr()
    return url, payload


# -- 1. the demo never deletes what it did not make; 9. its next commands work as printed --------

def _demo(directory: str, cwd, *extra: str) -> subprocess.CompletedProcess:
    proc = run("demo", "--trajectories", "8", "--workers", "2", "--dir", directory, "--no-train", *extra, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc


def _next_commands(stdout: str) -> list[list[str]]:
    lines = stdout[stdout.index("next:"):].splitlines()[1:]
    return [shlex.split(line, comments=True) for line in lines if line.strip()]


def test_demo_in_a_non_empty_dir_keeps_the_users_files_and_prints_working_next_commands(tmp_path):
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "notes.txt").write_text("mine")
    (project / "src" / "main.py").write_text("print('mine')")
    proc = _demo(".", cwd=project)
    assert (project / "notes.txt").read_text() == "mine"
    assert (project / "src" / "main.py").read_text() == "print('mine')"
    commands = _next_commands(proc.stdout)
    assert [c[c.index("--store") + 2] for c in commands] == ["sql", "report", "export", "info"]
    for argv in commands:  # exactly as printed, from the same directory
        out = subprocess.run(argv, capture_output=True, text=True, cwd=project, timeout=120)
        assert out.returncode == 0, (argv, out.stderr)
        if "sql" in argv:
            assert "(5 rows)" in out.stdout
    assert (project / "report" / "index.html").exists()
    # A second demo replaces only its own files.
    _demo(".", cwd=project)
    assert (project / "notes.txt").read_text() == "mine" and (project / "src" / "main.py").exists()


def test_demo_dir_survives_and_a_foreign_store_is_not_replaced(tmp_path):
    target = tmp_path / "d"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    _demo(str(target), cwd=tmp_path)
    assert (target / "keep.txt").read_text() == "keep"
    other = tmp_path / "other"
    other.mkdir()
    (other / "trajstore.db").write_bytes(b"someone else's")
    proc = run("demo", "--trajectories", "2", "--dir", str(other), "--no-train", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "not made by trajstore demo" in proc.stderr
    assert (other / "trajstore.db").read_bytes() == b"someone else's"


def test_a_second_demo_on_postgres_is_one_line(fresh_pg_url, tmp_path):
    env = dict(os.environ, TRAJSTORE_PAYLOAD_DIR=str(tmp_path / "pg"))
    first = run("--store", fresh_pg_url, "demo", "--trajectories", "4", "--workers", "2", "--dir",
                str(tmp_path / "d"), "--no-train", env=env)
    assert first.returncode == 0, first.stderr
    second = run("--store", fresh_pg_url, "demo", "--trajectories", "4", "--workers", "2", "--dir",
                 str(tmp_path / "d"), "--no-train", env=env)
    assert second.returncode == 1 and second.stderr.count("\n") == 1, second.stderr
    assert "already holds trajectories" in second.stderr and "Traceback" not in second.stderr


# -- 2. every subcommand honours every global option, before or after its name ------------------

READS = ["materialize", "export", "info", "gc", "sql", "report"]
COMMANDS = ["init", "ingest", *READS, "demo", "serve", "proxy"]
GLOBALS = ["--store", "--payload", "--debug"]


def _argv(command: str, tmp_path: Path) -> list[str]:
    return {
        "init": ["init"], "ingest": ["ingest", str(tmp_path / "ev.jsonl")], "materialize": ["materialize"],
        "export": ["export", str(tmp_path / "exp")], "info": ["info"], "gc": ["gc", "--grace-s", "0"],
        "sql": ["sql", "SELECT count(*) AS n FROM samples"], "report": ["report", str(tmp_path / "rep")],
        "demo": ["demo", "--trajectories", "3", "--workers", "1", "--no-train", "--dir", str(tmp_path / "demo")],
    }[command]


def _wait_http(url: str, proc: subprocess.Popen) -> None:
    import httpx

    for _ in range(300):
        if proc.poll() is not None:
            raise AssertionError(f"server exited: {proc.stderr.read()}")
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError("server did not start")


def _serving(command: str, url: str, payload: str, after: bool, tmp_path: Path, upstream: str | None):
    port = free_port()
    flags = ["--store", url, "--payload", payload]
    tail = ["--port", str(port), "--insecure-no-auth"] + ([] if command == "serve" else ["--upstream", upstream])
    argv = [command, *tail, *flags] if after else [*flags, command, *tail]
    proc = subprocess.Popen([*CLI, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
@pytest.mark.parametrize("option", GLOBALS)
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_honours_every_global_option(command, option, after, tmp_path, capsys):
    if command in ("serve", "proxy"):
        pytest.importorskip("fastapi")
        _check_server_option(command, option, after, tmp_path)
        return
    write_jsonl(tmp_path / "ev.jsonl", n=2)
    url, payload = sqlite_url(tmp_path / "s.db"), str(tmp_path / "pay")

    def call(argv: list[str], opts: list[str]) -> int:
        return main([*argv, *opts] if after else [*opts, *argv])

    if option == "--store":
        # The command acts on the store it names: writers create it, readers say it is missing.
        missing = tmp_path / "missing.db"
        rc = call(_argv(command, tmp_path), ["--store", sqlite_url(missing)])
        err = capsys.readouterr().err
        if command in READS:
            assert rc == 1 and f"no store at {missing}" in err and not missing.exists()
        else:
            assert rc == 0, err
            assert missing.exists()
    elif option == "--payload":
        if command not in ("init", "ingest", "demo"):
            assert main(["--store", url, "--payload", payload, "ingest", str(tmp_path / "ev.jsonl")]) == 0
        if command in ("export", "gc"):
            assert main(["--store", url, "--payload", payload, "materialize"]) == 0
        store = url if command != "demo" else None
        opts = (["--store", store] if store else []) + ["--payload", payload]
        rc = call(_argv(command, tmp_path), opts)
        err = capsys.readouterr().err
        assert rc == 0, err
        if command in ("ingest", "demo", "materialize"):
            names = os.listdir(payload)
            assert any(n.startswith("events") for n in names) or command == "materialize"
            if command != "ingest":
                assert any(n.startswith("samples") for n in names), names
        if command == "export":
            assert len(os.listdir(tmp_path / "exp")) >= 1
        # Nothing went to the default place beside the database.
        assert not (tmp_path / "s.db.payload").exists() and not (tmp_path / "demo" / "trajstore.db.payload").exists()
    else:  # --debug: the traceback instead of the one-line error
        bad = ["--store", "mysql://nowhere/x"]
        argv = _argv(command, tmp_path)
        if command == "demo":
            bad = []
            (tmp_path / "demo").mkdir()
            (tmp_path / "demo" / "trajstore.db").write_text("not the demo's")
        with pytest.raises(Exception):
            call(argv, [*bad, "--debug"])
        assert call(argv, bad) == 1  # and without it, one line
        assert capsys.readouterr().err.count("\n") == 1


def _check_server_option(command: str, option: str, after: bool, tmp_path: Path) -> None:
    import httpx

    from tests.openai_upstream import make_upstream, serve_in_thread

    url, payload = sqlite_url(tmp_path / "s.db"), str(tmp_path / "pay")
    if option == "--debug":
        argv = [command, "--port", str(free_port()), "--store", "mysql://nowhere/x"]
        argv += ["--insecure-no-auth"] + ([] if command == "serve" else ["--upstream", "http://127.0.0.1:9"])
        argv = argv + ["--debug"] if after else ["--debug", *argv]
        proc = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and "Traceback" in proc.stderr
        return
    with serve_in_thread(make_upstream()) as upstream:
        proc, base = _serving(command, url, payload, after, tmp_path, upstream)
        try:
            _wait_http(f"{base}/healthz", proc)
            if command == "serve":
                events = write_jsonl(tmp_path / "ev.jsonl", n=1)
                resp = httpx.post(f"{base}/v1/events", json={"events": events}, timeout=30)
            else:
                resp = httpx.post(f"{base}/v1/chat/completions", timeout=30,
                                  json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                                  headers={"X-Trajstore-Trajectory": "t1", "X-Trajstore-Num-Experts": "16"})
            assert resp.status_code == 200, resp.text
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    assert f"listening on {base}" in proc.stderr.read()  # where to point clients
    # --store: the store named was used; --payload: the segment landed there, not beside the db.
    assert (tmp_path / "s.db").exists()
    assert any(n.startswith("events") for n in os.listdir(payload))
    assert not (tmp_path / "s.db.payload").exists()


# -- 3. an export appears whole or not at all; replacing one is explicit -------------------------

def _count(duckdb, directory) -> int:
    return duckdb.sql(f"SELECT count(*) FROM read_parquet('{directory}/*.parquet')").fetchall()[0][0]


def test_export_over_a_larger_export_is_refused_then_replaced_whole(tmp_path, capsys):
    duckdb = pytest.importorskip("duckdb")
    big, small = sqlite_url(tmp_path / "big.db"), sqlite_url(tmp_path / "small.db")
    for url, n in ((big, 12), (small, 3)):
        write_jsonl(tmp_path / "ev.jsonl", n=n)
        main(["--store", url, "ingest", str(tmp_path / "ev.jsonl")])
        main(["--store", url, "materialize"])
    out = tmp_path / "out"
    assert main(["--store", big, "export", str(out)]) == 0
    n_big = trajstore.connect(big).info()["samples"]
    n_small = trajstore.connect(small).info()["samples"]
    from trajstore.inspect.export import export_samples

    export_samples(trajstore.connect(big).samples(), str(out), rows_per_file=2, replace=True)
    assert len(os.listdir(out)) > 2 and _count(duckdb, out) == n_big
    capsys.readouterr()
    assert main(["--store", small, "export", str(out)]) == 1
    assert "--replace" in capsys.readouterr().err
    assert _count(duckdb, out) == n_big  # untouched
    assert main(["--store", small, "export", "--replace", str(out)]) == 0
    assert _count(duckdb, out) == n_small  # no part file of the larger export mixed in
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_replace_refuses_a_directory_holding_other_files(built, tmp_path, capsys):
    url, payload = built
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(["--store", url, "--payload", payload, "export", "--replace", str(mine)]) == 1
    assert "not an export's" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "mine"


KILL_MID_EXPORT = """
import os, signal, sys
import trajstore
from trajstore.inspect.export import export_samples
store = trajstore.connect(sys.argv[1], payload=sys.argv[2], create=False)
def progress(n):
    os.kill(os.getpid(), signal.SIGKILL)   # kill -9 after the first part file is written
export_samples(store.samples(), sys.argv[3], rows_per_file=2, progress=progress, replace=True)
"""


@pytest.mark.parametrize("earlier", [False, True], ids=["fresh", "replacing"])
def test_a_killed_export_leaves_no_dataset_or_the_earlier_one_whole(built, tmp_path, capsys, earlier):
    duckdb = pytest.importorskip("duckdb")
    url, payload = built
    out = tmp_path / "out"
    if earlier:
        assert main(["--store", url, "--payload", payload, "export", str(out)]) == 0
    before = sorted(os.listdir(out)) if earlier else None
    proc = subprocess.run([sys.executable, "-c", KILL_MID_EXPORT, url, payload, str(out)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    if earlier:
        assert sorted(os.listdir(out)) == before
        assert _count(duckdb, out) == trajstore.connect(url, payload=payload).info()["samples"]
    else:
        assert not out.exists()
    # The next export succeeds (the killed one's hidden temporary directory is not in its way).
    assert main(["--store", url, "--payload", payload, "export", "--replace", str(out)]) == 0


# -- 4. reading a store that does not exist creates nothing ------------------------------------

@pytest.mark.parametrize("command", READS)
def test_read_commands_on_a_missing_store_say_so_and_create_nothing(command, tmp_path):
    missing = tmp_path / "typo" / "s.db"
    proc = run("--store", sqlite_url(missing), *_argv(command, tmp_path))
    assert proc.returncode == 1 and f"no store at {missing}" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("command", READS)
def test_read_commands_on_an_empty_postgres_database_create_no_schema(command, fresh_pg_url, tmp_path):
    proc = run("--store", fresh_pg_url, *_argv(command, tmp_path),
               env=dict(os.environ, TRAJSTORE_PAYLOAD_DIR=str(tmp_path / "p")))
    assert proc.returncode == 1 and "no store at" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    import sqlalchemy

    engine = sqlalchemy.create_engine(fresh_pg_url)
    with engine.connect() as conn:
        assert sqlalchemy.inspect(conn).get_table_names() == []
    engine.dispose()


def test_library_readers_on_a_missing_store(tmp_path):
    from trajstore import SampleReader
    from trajstore.errors import StoreUnavailable

    missing = tmp_path / "typo.db"
    with pytest.raises(StoreUnavailable, match="no store at"):
        list(trajstore.connect(sqlite_url(missing), create=False).samples())
    with pytest.raises(StoreUnavailable, match="no store at"):
        SampleReader(sqlite_url(missing), batch_size=1)
    assert not missing.exists() and os.listdir(tmp_path) == []


# -- 7. one-line errors --------------------------------------------------------------------------

def test_info_on_a_file_that_is_not_a_database(tmp_path):
    (tmp_path / "notes.db").write_text("hello\n" * 100)
    for cmd in (["info"], ["sql", "SELECT 1"], ["ingest", "-"]):
        proc = run("--store", sqlite_url(tmp_path / "notes.db"), *cmd, input="")
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert "Traceback" not in proc.stderr and "database" in proc.stderr
    assert (tmp_path / "notes.db").read_text() == "hello\n" * 100


def test_sql_into_a_closed_pipe_is_quiet(built):
    url, _ = built
    query = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 200000) SELECT x FROM c"
    cmd = " ".join(shlex.quote(a) for a in [*CLI, "--store", url, "sql", "--format", "csv", query])
    proc = subprocess.run(f"{cmd} | head -1", shell=True, capture_output=True, text=True,
                          executable="/bin/bash", timeout=120)
    assert proc.stdout == "x\n"
    assert proc.stderr == "", proc.stderr


def test_ingest_names_the_file_line_of_json_and_validation_errors(tmp_path, capsys):
    url = sqlite_url(tmp_path / "s.db")
    events = write_jsonl(tmp_path / "ev.jsonl", n=1)
    lines = ["", json.dumps(events[0]), "", "", "{oops"]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["--store", url, "ingest", str(tmp_path / "a.jsonl")]) == 1
    assert "line 5 of" in capsys.readouterr().err
    bad = dict(events[1], seq=7)
    (tmp_path / "b.jsonl").write_text("\n\n" + json.dumps(events[0]) + "\n\n" + json.dumps(bad) + "\n")
    assert main(["--store", url, "ingest", str(tmp_path / "b.jsonl")]) == 1
    err = capsys.readouterr().err
    assert "line 5 of" in err and "seq_gap" in err and err.count("\n") == 1
    assert trajstore.connect(url).info()["head_position"] == 0


# -- 8. ingest streams, stores nothing on a bad event anywhere, and a re-run completes a crash ----

def test_a_bad_event_after_many_batches_stores_nothing(tmp_path, capsys):
    from trajstore.ingest.jsonl import ingest_file

    url = sqlite_url(tmp_path / "s.db")
    events = write_jsonl(tmp_path / "ev.jsonl", n=20)
    bad = dict(events[-1], trajectory_id="never-started")
    with open(tmp_path / "ev.jsonl", "a") as f:
        f.write(json.dumps(bad) + "\n")
    store = trajstore.connect(url)
    with pytest.raises(trajstore.ValidationError, match=f"line {len(events) + 1} of .*unknown_trajectory"):
        ingest_file(store, str(tmp_path / "ev.jsonl"), batch_events=4)
    assert store.info()["head_position"] == 0


KILL_MID_INGEST = """
import os, signal, sys
import trajstore
from trajstore.ingest.jsonl import ingest_file
store = trajstore.connect(sys.argv[1])
size = os.path.getsize(sys.argv[2])
seen = 0
def progress(n):
    global seen
    seen += n
    if seen > size * 1.3:   # past validation and some appended batches
        os.kill(os.getpid(), signal.SIGKILL)
ingest_file(store, sys.argv[2], progress=progress, batch_events=5)
"""


def test_a_rerun_after_kill_9_mid_ingest_completes_the_rest(tmp_path, capsys):
    url = sqlite_url(tmp_path / "s.db")
    events = write_jsonl(tmp_path / "ev.jsonl", n=12)
    proc = subprocess.run([sys.executable, "-c", KILL_MID_INGEST, url, str(tmp_path / "ev.jsonl")],
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    stored = trajstore.connect(url).info()["head_position"]
    assert 0 < stored < len(events) and stored % 5 == 0  # whole batches only
    assert main(["--store", url, "ingest", str(tmp_path / "ev.jsonl")]) == 0
    out = capsys.readouterr().out
    assert f"appended {len(events) - stored} events ({stored} already stored)" in out
    assert trajstore.connect(url).info()["head_position"] == len(events)


# -- 10. smaller things --------------------------------------------------------------------------

def test_version_and_help_for_every_option_and_positional(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and re.fullmatch(r"trajstore \S+\n", capsys.readouterr().out)

    def walk(parser: argparse.ArgumentParser, where: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{where} {name}")
            yield where, action

    missing = [f"{where}: {a.option_strings or a.dest}" for where, a in walk(_parser(), "trajstore")
               if not a.help and not isinstance(a, argparse._HelpAction)]
    assert missing == []


def test_sql_prints_times_as_iso(built, capsys):
    url, _ = built
    assert main(["--store", url, "sql", "--format", "csv",
                 "SELECT first_event_at, duration_s FROM trajectory_summary LIMIT 1"]) == 0
    first, duration = capsys.readouterr().out.splitlines()[1].split(",")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", first), first
    float(duration)  # a duration stays a number


def test_materialize_with_nothing_pending_and_gc_with_young_orphans(built, capsys):
    url, payload = built
    assert main(["--store", url, "--payload", payload, "materialize"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["num_steps_before"] == 0 and metrics["merge_ratio"] == "n/a"
    store = trajstore.connect(url, payload=payload)
    open(store.payload.path("events-young-orphan.arrow"), "wb").write(b"x")
    assert main(["--store", url, "--payload", payload, "gc"]) == 0
    out = capsys.readouterr().out
    assert "removed 0" in out and "kept 1 younger than --grace-s 3600" in out


def test_readme_python_snippet_runs(tmp_path):
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Use it\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 2  # Writer + SampleReader first, then the wire dicts
    snippet = "\n".join(blocks)
    proc = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k != "TRAJSTORE_URL"})
    assert proc.returncode == 0, proc.stderr
    assert "merge_ratio" in proc.stdout


def test_gitignore_has_the_demo_dir():
    assert "trajstore-demo/" in (REPO / ".gitignore").read_text().splitlines()
