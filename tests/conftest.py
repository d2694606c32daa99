"""Shared fixtures: a real PostgreSQL for the session, and the two-backend `store_url`.

- `postgres_url` (session): URL of a database in a throwaway PostgreSQL cluster
  the suite starts itself (see tests/pg_cluster.py) and removes at the end.
- `fresh_pg_url` (function): a new empty database in that cluster per test,
  dropped afterwards.
- `store_url` (function, params "sqlite"/"postgres"): the URL a backend test
  runs against; the PostgreSQL case starts the cluster only when selected.
- `store` (function): `trajstore.connect(store_url)` with the payload in the
  test's temp dir.

Without PostgreSQL binaries every PostgreSQL test errors with how to get them;
TRAJSTORE_SKIP_POSTGRES=1 turns those tests into skips instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import trajstore

from pg_cluster import PgCluster

SKIP_POSTGRES_ENV = "TRAJSTORE_SKIP_POSTGRES"


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    if os.environ.get(SKIP_POSTGRES_ENV) == "1":
        pytest.skip(f"{SKIP_POSTGRES_ENV}=1: PostgreSQL tests skipped")
    with PgCluster() as cluster:
        yield cluster


@pytest.fixture(scope="session")
def postgres_url(pg_cluster: PgCluster) -> str:
    """postgresql+psycopg://postgres@127.0.0.1:PORT/trajstore_test"""
    return pg_cluster.create_database("trajstore_test")


@pytest.fixture
def fresh_pg_url(pg_cluster: PgCluster) -> Iterator[str]:
    """A new empty database (t_<random>) in the session cluster."""
    url = pg_cluster.create_database()
    yield url
    pg_cluster.drop_database(url.rsplit("/", 1)[1])


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
    ]
)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    return request.getfixturevalue("fresh_pg_url")


@pytest.fixture
def store(store_url: str, tmp_path: Path) -> Iterator["trajstore.Store"]:
    """A store on each backend, payload in the test's temp dir (modules may override)."""
    s = trajstore.connect(store_url, payload=str(tmp_path / "payload"))
    yield s
    s.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # So `-m "not postgres"` also deselects tests that ask for the cluster directly.
    for item in items:
        if {"pg_cluster", "postgres_url", "fresh_pg_url"} & set(item.fixturenames):
            item.add_marker(pytest.mark.postgres)
