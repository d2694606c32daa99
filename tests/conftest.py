"""Shared fixtures: a real PostgreSQL for the session, and the two-backend `store_url`.

- `postgres_url` (session): URL of a database in a throwaway PostgreSQL cluster
  the suite starts itself (see tests/pg_cluster.py) and removes at the end. No test
  crashes it, so it runs without fsync (a killed server loses no commit without it).
- `fresh_pg_url` (function): a new empty database in that cluster per test,
  dropped afterwards (made ahead and dropped in the background: `PgDatabases`).
- `fault_cluster` (function): a second cluster shared by the tests that kill
  backends, change server settings or crash/restart the server (with fsync on);
  reset between tests (see the fixture).
- `store_url` (function, one case per registered backend, ids "sqlite"/"postgres"):
  the URL a backend test runs against; the PostgreSQL case starts the cluster
  only when selected.
- `store` (function): `trajstore.connect(store_url)` with the payload in the
  test's temp dir.
- `module_store_url` (module, one case per backend): a migrated store's URL for data a
  module's tests share and only read (see test_reader.py's `filled`).
- `five_trajectories` / `five_folded` (function): a SQLite store (a migrated copy) with
  five demo trajectories of the old names, not folded / folded.

Migrated templates: a test whose fixtures include `store` (or a fixture its module names in
`STORE_URL_CONNECTED_BY`; or a test the module names there, whose first step connects
`store_url`) gets a `store_url` that is already migrated to head (the store connects and
migrates it before the test does anything else anyway):
a copy of a SQLite file migrated once per worker, or a PostgreSQL database made with
`CREATE DATABASE ... TEMPLATE` from one migrated once per worker (`migrated_template`).
The copy holds only what the migrations made (no store id, no payload location: the
first connect records those, as on a new store). Every other `store_url` and
`fresh_pg_url` is empty, so the tests of creating and migrating a store run every migration.

Without PostgreSQL binaries every PostgreSQL test errors with how to get them;
TRAJSTORE_SKIP_POSTGRES=1 turns those tests into skips instead.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

import trajstore
from trajstore.log._registry import BACKENDS

from pg_cluster import PgCluster

SKIP_POSTGRES_ENV = "TRAJSTORE_SKIP_POSTGRES"

# Ray (2.60) turns token authentication on for a new local cluster: `ray.init()` sets
# RAY_AUTH_MODE=token in this process and writes a token to ~/.ray/auth_token, and every
# cluster started later on the machine picks that file up. The suite's Ray clusters (local
# ones and `ray start` nodes, which inherit this environment) share one token of the
# process's own instead, so no test depends on what an earlier one left behind.
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    if os.environ.get(SKIP_POSTGRES_ENV) == "1":
        pytest.skip(f"{SKIP_POSTGRES_ENV}=1: PostgreSQL tests skipped")
    with PgCluster(fsync=False) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def _fault_cluster_holder() -> Iterator[dict]:
    holder: dict = {"cluster": None}
    yield holder
    if holder["cluster"] is not None:
        holder["cluster"].stop()


@pytest.fixture
def fault_cluster(_fault_cluster_holder: dict) -> Iterator[PgCluster]:
    """A second PostgreSQL cluster, for tests that kill backends (every session of
    the cluster is then terminated), change server settings (ALTER SYSTEM),
    crash or restart the server: never the suite's main cluster. Started by the
    first such test and handed to the next ones: each gets it running, with only
    the ``postgres`` database and superuser and no ALTER SYSTEM setting of an
    earlier test (``PgCluster.reset``). A test that left it stopped or broken
    costs the next one a new cluster, never a wrong one."""
    if os.environ.get(SKIP_POSTGRES_ENV) == "1":
        pytest.skip(f"{SKIP_POSTGRES_ENV}=1: PostgreSQL tests skipped")
    cluster = _fault_cluster_holder["cluster"]
    if cluster is not None:
        try:
            if not cluster.is_running():
                raise RuntimeError("not running")
            cluster.reset()
        except Exception:  # noqa: BLE001 - whatever the last test left, the next gets a fresh cluster
            cluster.stop()
            cluster = _fault_cluster_holder["cluster"] = None
    if cluster is None:
        cluster = PgCluster()
        cluster.start()
        _fault_cluster_holder["cluster"] = cluster
    yield cluster


@pytest.fixture(scope="session")
def postgres_url(pg_cluster: PgCluster) -> str:
    """postgresql+psycopg://postgres@127.0.0.1:PORT/trajstore_test"""
    return pg_cluster.create_database("trajstore_test")


class PgDatabases:
    """The session cluster's per-test databases, made and dropped off the tests' path: while a
    test runs, the database the next test of its kind takes is made (``CREATE DATABASE``, of the
    same template), and a test's database is dropped after it in the background. Both wait on
    the server's disk (a copy is WAL-logged and flushed) more than they use a core, so they
    overlap the tests' own work instead of adding to it. One thread, in order; a database made
    ahead that failed is made again when taken; the drops are done before the cluster stops."""

    def __init__(self, cluster: PgCluster) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._cluster = cluster
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pg-databases")
        self._ahead: dict[str | None, "Future[str]"] = {}

    def take(self, template: str | None = None) -> str:
        """A new database (t_<random>): empty, or a copy of ``template``; its URL."""
        made = self._ahead.pop(template, None)
        url = None
        if made is not None:
            try:
                url = made.result()
            except Exception:  # noqa: BLE001 - made again below, where a failure is the test's error
                url = None
        if url is None:
            url = self._cluster.create_database(template=template)
        self._ahead[template] = self._thread.submit(self._cluster.create_database, template=template)
        return url

    def drop(self, url: str) -> None:
        self._thread.submit(self._cluster.drop_database, url.rsplit("/", 1)[1])

    def close(self) -> None:
        self._thread.shutdown(wait=True)


@pytest.fixture(scope="session")
def pg_databases(pg_cluster: PgCluster) -> Iterator[PgDatabases]:
    databases = PgDatabases(pg_cluster)
    yield databases
    databases.close()


@pytest.fixture
def fresh_pg_url(pg_databases: PgDatabases) -> Iterator[str]:
    """A new empty database (t_<random>) in the session cluster."""
    url = pg_databases.take()
    yield url
    pg_databases.drop(url)


@pytest.fixture
def migrated_pg_url(pg_databases: PgDatabases, migrated_template: "MigratedTemplate") -> Iterator[str]:
    """A new database (t_<random>) in the session cluster, migrated to head: a copy of the
    worker's migrated template (``CREATE DATABASE ... TEMPLATE``)."""
    url = pg_databases.take(migrated_template.pg_database())
    yield url
    pg_databases.drop(url)


def migrate_new_store(url: str) -> None:
    """Run every migration on ``url`` as a store's first connect does (``trajstore.log._migrate.upgrade``
    on the backend's own engines), and nothing else: no store id, no payload location."""
    from trajstore.log._migrate import upgrade
    from trajstore.log._registry import backend_of

    backend = backend_of(url)
    backend.require_database(url, missing_ok=True)
    write_engine, read_engine = backend.make_engines(url)
    try:
        assert upgrade(write_engine), f"{url} was already migrated"
    finally:
        write_engine.dispose()
        read_engine.dispose()


class MigratedTemplate:
    """The worker's migrated stores, made the first time a test asks (one per backend)."""

    PG_NAME = "trajstore_migrated_template"

    def __init__(self, request: pytest.FixtureRequest, directory: Path) -> None:
        self._request = request
        self._directory = directory
        self._sqlite: Path | None = None
        self._pg: str | None = None

    def sqlite_copy(self, path: Path) -> str:
        """A copy of the migrated SQLite file at ``path`` (which must not exist); its URL."""
        if self._sqlite is None:
            template = self._directory / "template.db"
            migrate_new_store(f"sqlite:///{template}")
            # every connection closed: the WAL was checkpointed into the file and removed
            assert not Path(f"{template}-wal").exists() and not Path(f"{template}-shm").exists()
            self._sqlite = template
        assert not path.exists(), path
        shutil.copyfile(self._sqlite, path)
        return f"sqlite:///{path}"

    def pg_database(self) -> str:
        """The name of the migrated PostgreSQL template database (no connection left open to it)."""
        if self._pg is None:
            cluster: PgCluster = self._request.getfixturevalue("pg_cluster")
            migrate_new_store(cluster.create_database(self.PG_NAME))
            self._pg = self.PG_NAME
        return self._pg


@pytest.fixture(scope="session")
def migrated_template(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MigratedTemplate:
    return MigratedTemplate(request, tmp_path_factory.mktemp("migrated-template"))


def _wants_migrated(request: pytest.FixtureRequest) -> bool:
    """The test's fixtures connect the store (and so migrate it) before it runs: ``store``, or
    a fixture its module names in ``STORE_URL_CONNECTED_BY`` (one that connects ``store_url``
    first thing, as ``store`` does); or the module names the test itself there (its first
    step is that connect)."""
    first_connects = {"store", *getattr(request.module, "STORE_URL_CONNECTED_BY", ())}
    return bool(first_connects & {*request.fixturenames, request.node.originalname})


def _sqlite_case(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    path = tmp_path / "store.db"
    if _wants_migrated(request):
        return request.getfixturevalue("migrated_template").sqlite_copy(path)
    return f"sqlite:///{path}"


def _postgres_case(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return request.getfixturevalue("migrated_pg_url" if _wants_migrated(request) else "fresh_pg_url")


# How the suite makes a database for each registered backend (trajstore.log._registry.BACKENDS),
# the test id and the marks of its cases: a backend added to the registry fails collection here
# until the suite knows how to run the backend tests (the log conformance suite first) on it.
BACKEND_CASES = {
    "sqlite": ("sqlite", (), _sqlite_case),
    "postgresql": ("postgres", (pytest.mark.postgres,), _postgres_case),
}


BACKEND_PARAMS = [pytest.param(name, id=BACKEND_CASES[name][0], marks=BACKEND_CASES[name][1]) for name in BACKENDS]


@pytest.fixture(params=BACKEND_PARAMS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Empty, unless the test's fixtures include ``store`` (then migrated: see the module docstring)."""
    # a test may pick one case indirectly, by the backend's name or by its test id ("postgres")
    name = next((n for n, case in BACKEND_CASES.items() if request.param in (n, case[0])), request.param)
    return BACKEND_CASES[name][2](request, tmp_path)


@pytest.fixture(scope="module", params=BACKEND_PARAMS)
def module_store_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                     migrated_template: MigratedTemplate) -> Iterator[str]:
    """A migrated store's URL on each backend, one per test module: for a module's fixture of
    data its tests only read (built once, not once per test). A test that writes takes a
    store of its own (``store``)."""
    if request.param == "sqlite":
        yield migrated_template.sqlite_copy(tmp_path_factory.mktemp("module-store") / "store.db")
        return
    assert request.param == "postgresql", f"module_store_url does not know backend {request.param!r}"
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    url = cluster.create_database(template=migrated_template.pg_database())
    yield url
    cluster.drop_database(url.rsplit("/", 1)[1])


@pytest.fixture
def store(store_url: str, tmp_path: Path) -> Iterator["trajstore.Store"]:
    """A store on each backend, payload in the test's temp dir (modules may override)."""
    s = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    yield s
    s.close()


@pytest.fixture
def five_trajectories(tmp_path: Path, migrated_template: MigratedTemplate) -> Iterator["trajstore.Store"]:
    """A SQLite store holding five demo trajectories (``OLD_NAMES_CFG``), not folded yet:
    the store of the tests that old (deprecated) names still work."""
    from trajstore.demo._simulate import trajectory_events

    from helpers import OLD_NAMES_CFG

    store = trajstore.connect(migrated_template.sqlite_copy(tmp_path / "s.db"))
    for i in range(5):
        store.append(trajectory_events(OLD_NAMES_CFG, i))
    yield store
    store.close()


@pytest.fixture
def five_folded(five_trajectories: "trajstore.Store") -> "trajstore.Store":
    """``five_trajectories`` folded."""
    five_trajectories.materialize()
    return five_trajectories


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # So `-m "not postgres"` also deselects tests that ask for the cluster directly.
    for item in items:
        if {"pg_cluster", "postgres_url", "fresh_pg_url", "migrated_pg_url", "fault_cluster"} & set(item.fixturenames):
            item.add_marker(pytest.mark.postgres)


# The slowest files, at the end of a run of many: under `--dist loadfile` a file runs on one
# worker, so the slowest file bounds the run (split one that approaches the run's time / workers).
_FILE_SECONDS: dict[str, list[float]] = {}
SLOWEST_FILES_SHOWN = 10


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    phases = _FILE_SECONDS.setdefault(report.nodeid.split("::", 1)[0], [0.0, 0.0, 0.0])
    phases[("setup", "call", "teardown").index(report.when)] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or len(_FILE_SECONDS) < 2 * SLOWEST_FILES_SHOWN:
        return  # a worker (the controller reports), or a run of a few files
    terminalreporter.write_sep("=", f"slowest {SLOWEST_FILES_SHOWN} files (wall s: setup + call + teardown)")
    ranked = sorted(_FILE_SECONDS.items(), key=lambda kv: -sum(kv[1]))
    for path, (setup, call, teardown) in ranked[:SLOWEST_FILES_SHOWN]:
        terminalreporter.write_line(f"{setup + call + teardown:8.1f} s  {path}  "
                                    f"(setup {setup:.1f}, call {call:.1f}, teardown {teardown:.1f})")
    total = sum(sum(v) for v in _FILE_SECONDS.values())
    terminalreporter.write_line(f"{total:8.1f} s  in all {len(_FILE_SECONDS)} files")
