"""A throwaway PostgreSQL cluster for the test suite.

`PgCluster` runs initdb in a fresh temporary directory, starts the server on a
free loopback TCP port (its unix socket goes into the same directory, never
/var/run/postgresql), hands out SQLAlchemy URLs, creates and drops databases,
and at `stop()` shuts the server down and deletes every file it made.

initdb refuses to run as root. When the tests run as root (CI, the dev
machines), every server binary runs as the `postgres` system user through
`runuser -u postgres --`, and the temporary directory is chowned to it;
otherwise the binaries run as the current user. Either way the cluster's
superuser is named `postgres` and loopback connections use trust auth, so URLs
carry no password.

fsync stays on by default: the durability tests crash a cluster (kill -9 of
backends, `pg_ctl stop -m immediate`), and one that does not fsync would make
them vacuous. `PgCluster(fsync=False)` turns it off for a cluster no test
crashes: the suite's main one (tests/conftest.py; the crash tests take
`fault_cluster`). A server killed still loses no commit without fsync (its
WAL is written to the kernel before COMMIT returns); only an operating
system's crash would, and skipping the flushes makes the per-test
`CREATE DATABASE` and every commit several times cheaper on a busy disk.
initdb's own final sync is skipped (`--no-sync`), since the freshly made
template files hold nothing a test relies on surviving an OS crash.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg

SUPERUSER = "postgres"
# Some tests run 8+ concurrent writer processes, each holding connections.
SERVER_SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "max_connections": "200",
    "shared_buffers": "64MB",
    "logging_collector": "off",
    # a few, for fault tests that hold a lock across a crash restart (PREPARE TRANSACTION)
    "max_prepared_transactions": "4",
}
# PostgreSQL 14+ on Linux: crash recovery (every start after `pg_ctl -m immediate`) first syncs the
# data directory; one syncfs() of its file system instead of an fsync of every file (2-4 s
# a restart on a busy machine, 0.3 s so). The same durability, only the method differs.
SERVER_SETTINGS_14 = {"recovery_init_sync_method": "syncfs"}
START_TIMEOUT_S = 60

# Runs in a detached process: once the test process is gone without having
# called stop() (killed by `timeout`, SIGKILL, a crash), stop the server and
# delete its directory, so no postmaster outlives its test run.
_WATCHDOG = """
import os, shutil, subprocess, sys, time
owner_pid, pg_ctl, data_dir, base_dir, as_postgres = sys.argv[1:6]
while True:
    try:
        os.kill(int(owner_pid), 0)
    except (ProcessLookupError, PermissionError):  # gone, or its pid reused
        break
    time.sleep(1)
if os.path.isdir(data_dir):
    cmd = [pg_ctl, "-D", data_dir, "-m", "immediate", "-w", "stop"]
    if as_postgres == "1":
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    subprocess.run(cmd, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shutil.rmtree(base_dir, ignore_errors=True)
"""


class PostgresNotFound(RuntimeError):
    """No PostgreSQL server binaries (initdb, pg_ctl, postgres) were found."""


def find_bindir() -> Path:
    """Locate a directory holding initdb and pg_ctl.

    Order: $TRAJSTORE_PG_BIN, then `pg_config --bindir`, then the newest
    /usr/lib/postgresql/*/bin (Debian's layout). Raises PostgresNotFound.
    """
    candidates: list[Path] = []
    if os.environ.get("TRAJSTORE_PG_BIN"):
        candidates.append(Path(os.environ["TRAJSTORE_PG_BIN"]))
    pg_config = shutil.which("pg_config")
    if pg_config:
        # Debian's pg_config (libpq-dev) may name a bindir with no server in it.
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            candidates.append(Path(out.stdout.strip()))
    debian = glob.glob("/usr/lib/postgresql/*/bin")
    debian.sort(key=lambda p: [int(n) for n in re.findall(r"\d+", p)], reverse=True)
    candidates += [Path(p) for p in debian]
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "pg_ctl").is_file():
            return bindir
    raise PostgresNotFound(
        "no PostgreSQL server binaries found (looked in $TRAJSTORE_PG_BIN, "
        f"`pg_config --bindir`, /usr/lib/postgresql/*/bin: {[str(c) for c in candidates]}); "
        "install them (`apt-get install -y postgresql`, or run `bash .ci/run`), "
        "point TRAJSTORE_PG_BIN at them, or set TRAJSTORE_SKIP_POSTGRES=1 to skip "
        "the PostgreSQL tests"
    )


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgCluster:
    """One PostgreSQL server in its own temporary directory."""

    def __init__(self, bindir: Path | None = None, *, fsync: bool = True) -> None:
        self.bindir = bindir or find_bindir()
        self.fsync = fsync
        self.run_as_postgres = os.geteuid() == 0
        self.base_dir: Path | None = None
        self.port: int | None = None

    @property
    def data_dir(self) -> Path:
        assert self.base_dir is not None
        return self.base_dir / "data"

    @property
    def log_path(self) -> Path:
        assert self.base_dir is not None
        return self.base_dir / "server.log"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{dbname}"

    def start(self) -> None:
        """initdb + pg_ctl start; raises RuntimeError with the server log on failure."""
        try:
            self._init_and_start()
        except BaseException:
            self.stop()
            raise

    def _init_and_start(self) -> None:
        self._make_base_dir()
        self._run(
            "initdb", "-D", str(self.data_dir), "-U", SUPERUSER, "--auth=trust",
            "--encoding=UTF8", "--locale=C", "--no-sync",
        )
        # A free port can be taken between our probe and the server's bind;
        # retry with another one rather than fail the whole session.
        for _ in range(3):
            self.port = free_loopback_port()
            self._write_settings()
            started = self._run(
                "pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_path),
                "-w", "-t", str(START_TIMEOUT_S), "start", check=False,
            )
            if started.returncode == 0:
                self._spawn_watchdog()
                return
        raise RuntimeError(
            f"PostgreSQL did not start (pg_ctl exit {started.returncode}): "
            f"{started.stderr.strip()}\n--- {self.log_path} ---\n{self._log_tail()}"
        )

    def stop(self) -> None:
        """Stop the server (if running) and delete its directory."""
        try:
            # postmaster.pid also exists after a start that timed out half-way.
            if self.base_dir is not None and (self.data_dir / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop",
                          check=False)
        finally:
            if self.base_dir is not None:
                shutil.rmtree(self.base_dir, ignore_errors=True)
                self.base_dir = None

    def create_database(self, name: str | None = None, *, template: str | None = None) -> str:
        """CREATE DATABASE (default name t_<random>), a copy of database ``template`` when
        given (nobody may be connected to it), and return its SQLAlchemy URL."""
        name = name or f"t_{uuid.uuid4().hex[:16]}"
        with self._admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        """DROP DATABASE, terminating any connection a test left open."""
        with self._admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    # -- faults (tests/log/test_faults_pg.py) ------------------------------
    def backends(self, dbname: str | None = None) -> list[dict]:
        """Client backends (pid, datname, state, query, wait_event), optionally of one database.

        Asked right after a kill -9, the server may be in crash recovery (a
        readiness check can pass just before the postmaster notices the kill):
        then it waits until the server accepts connections and asks again."""
        try:
            rows = self._backend_rows(dbname)
        except psycopg.OperationalError:
            self.wait_ready()
            rows = self._backend_rows(dbname)
        return [dict(zip(("pid", "datname", "state", "query", "wait_event"), r)) for r in rows]

    def _backend_rows(self, dbname: str | None) -> list[tuple]:
        with self._admin() as conn:
            return conn.execute(
                "SELECT pid, datname, state, query, wait_event FROM pg_stat_activity "
                "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid() "
                "AND (%s::text IS NULL OR datname = %s::text)", (dbname, dbname),
            ).fetchall()

    def kill_backend(self, pid: int) -> None:
        """kill -9 of one server process. The postmaster then terminates every
        other backend and runs crash recovery before it accepts connections again."""
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it ended on its own

    def alter_system(self, name: str, value: str | None, *, reload: bool = True) -> None:
        """ALTER SYSTEM SET name = value (RESET when value is None), then reload the configuration."""
        with self._admin() as conn:
            if value is None:
                conn.execute(f"ALTER SYSTEM RESET {name}")
            else:
                conn.execute(f"ALTER SYSTEM SET {name} = '{value}'")
        if reload:
            self.reload()

    def reload(self) -> None:
        """pg_ctl reload: SIGHUP to the postmaster (works during crash recovery too)."""
        self._run("pg_ctl", "-D", str(self.data_dir), "reload", check=False)

    def restart(self, mode: str = "immediate") -> None:
        """Stop the server (``immediate`` = like a crash: no checkpoint) and start it on the same port."""
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop", check=False)
        started = self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_path),
                            "-w", "-t", str(START_TIMEOUT_S), "start", check=False)
        if started.returncode != 0:
            raise RuntimeError(f"PostgreSQL did not restart: {started.stderr.strip()}\n{self._log_tail()}")

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until the server accepts connections again (after a crash or a restart)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self._admin() as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def is_running(self) -> bool:
        """The server answers (a cluster a test left in crash recovery gets up to 60 s)."""
        if self.base_dir is None or not (self.data_dir / "postmaster.pid").exists():
            return False
        try:
            self.wait_ready(60)
        except psycopg.OperationalError:
            return False
        return True

    def reset(self) -> None:
        """Back to how ``start()`` left it, for the next test sharing this cluster:
        every database but ``postgres`` dropped (connections terminated), every
        role but the superuser dropped, every ALTER SYSTEM setting a test made
        reset and the configuration reloaded. The server is not restarted."""
        ours = set(SERVER_SETTINGS) | set(SERVER_SETTINGS_14) | {"port", "unix_socket_directories"}
        with self._admin() as conn:
            # settings first: a synchronous standby that never comes would hold every commit below
            conn.execute("SET synchronous_commit TO local")
            conn.execute("SET statement_timeout TO '60s'")  # a hang becomes an error: the caller starts a new cluster
            for (name,) in conn.execute(
                    "SELECT DISTINCT name FROM pg_file_settings WHERE sourcefile LIKE '%%postgresql.auto.conf'"
            ).fetchall():
                if name not in ours:
                    conn.execute(f"ALTER SYSTEM RESET {name}")
            conn.execute("SELECT pg_reload_conf()")
            for (name,) in conn.execute(
                    "SELECT datname FROM pg_database WHERE datname NOT IN ('postgres', 'template0', 'template1')"
            ).fetchall():
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            for (name,) in conn.execute(
                    "SELECT rolname FROM pg_roles WHERE rolname <> %s AND rolname NOT LIKE 'pg\\_%%'",
                    (SUPERUSER,)).fetchall():
                conn.execute(f'DROP OWNED BY "{name}"')
                conn.execute(f'DROP ROLE "{name}"')

    def __enter__(self) -> PgCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _admin(self) -> psycopg.Connection:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user=SUPERUSER, dbname="postgres",
            autocommit=True, connect_timeout=10,
        )

    def _make_base_dir(self) -> None:
        # As root, the directory must be reachable by `postgres`: /tmp is, while
        # $TMPDIR or pytest's per-user dirs (mode 0700) may not be.
        parent = "/tmp" if self.run_as_postgres else None
        self.base_dir = Path(tempfile.mkdtemp(prefix="trajstore-pg-", dir=parent))
        if self.run_as_postgres:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError(
                    "running as root, but there is no `postgres` system user to run "
                    "initdb as (Debian's postgresql package creates it)"
                ) from None
            os.chown(self.base_dir, pw.pw_uid, pw.pw_gid)

    def _spawn_watchdog(self) -> None:
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self.bindir / "pg_ctl"),
             str(self.data_dir), str(self.base_dir), "1" if self.run_as_postgres else "0"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, cwd="/",
        )

    def _write_settings(self) -> None:
        settings = dict(SERVER_SETTINGS, port=str(self.port),
                        unix_socket_directories=f"'{self.base_dir}'")
        if not self.fsync:
            settings["fsync"] = "off"
        if sys.platform == "linux" and int((self.data_dir / "PG_VERSION").read_text().split(".")[0]) >= 14:
            settings.update(SERVER_SETTINGS_14)
        # postgresql.auto.conf is read last, so rewriting it on a port retry wins.
        text = "".join(f"{k} = {v}\n" for k, v in settings.items())
        auto_conf = self.data_dir / "postgresql.auto.conf"
        auto_conf.write_text(text)
        if self.run_as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(auto_conf, pw.pw_uid, pw.pw_gid)

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / tool), *args]
        if self.run_as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        # cwd: the server user may not be able to enter the caller's directory.
        result = subprocess.run(cmd, cwd=self.base_dir, capture_output=True, text=True,
                                stdin=subprocess.DEVNULL)
        if check and result.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed (exit {result.returncode}): "
                f"{result.stderr.strip() or result.stdout.strip()}"
            )
        return result

    def _log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-num_lines:])
        except OSError:
            return "(no server log)"


def crash_cluster(cluster: PgCluster) -> None:
    """Stop the server the way a crash does (``pg_ctl stop -m immediate``): no
    checkpoint, every backend killed; the data directory stays for restart."""
    cluster._run("pg_ctl", "-D", str(cluster.data_dir), "-m", "immediate", "-w", "stop")


def start_cluster_again(cluster: PgCluster) -> None:
    """Start a stopped (or crashed) cluster again on the same port; crash recovery runs."""
    cluster._run("pg_ctl", "-D", str(cluster.data_dir), "-l", str(cluster.log_path),
                 "-w", "-t", str(START_TIMEOUT_S), "start")
