"""The test suite's own PostgreSQL is real, writable and hands out distinct databases."""

from __future__ import annotations

import sqlalchemy as sa


def _scalar(url: str, sql: str) -> object:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql)).scalar_one()
    finally:
        engine.dispose()


def test_postgres_url_is_a_real_postgresql(postgres_url: str) -> None:
    assert postgres_url.startswith("postgresql+psycopg://")
    version = _scalar(postgres_url, "SELECT version()")
    assert "PostgreSQL" in version


def test_can_create_table_and_round_trip_rows(fresh_pg_url: str) -> None:
    engine = sa.create_engine(fresh_pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (id int PRIMARY KEY, payload bytea)"))
            conn.execute(sa.text("INSERT INTO t VALUES (1, :p)"), {"p": b"\x00\xff"})
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT payload FROM t WHERE id = 1")).scalar_one() == b"\x00\xff"
    finally:
        engine.dispose()


def test_fsync_is_on(fresh_pg_url: str) -> None:
    # Durability tests are vacuous on a cluster that does not fsync.
    assert _scalar(fresh_pg_url, "SHOW fsync") == "on"


def test_each_fresh_database_is_distinct_and_empty(pg_cluster, fresh_pg_url: str) -> None:
    other_url = pg_cluster.create_database()
    try:
        assert other_url != fresh_pg_url
        engine = sa.create_engine(fresh_pg_url)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text("CREATE TABLE only_here (x int)"))
        finally:
            engine.dispose()
        count_sql = "SELECT count(*) FROM pg_tables WHERE tablename = 'only_here'"
        assert _scalar(fresh_pg_url, count_sql) == 1
        assert _scalar(other_url, count_sql) == 0
        assert _scalar(other_url, "SELECT current_database()") == other_url.rsplit("/", 1)[1]
    finally:
        pg_cluster.drop_database(other_url.rsplit("/", 1)[1])


def test_dropping_a_database_ends_connections_left_open(pg_cluster) -> None:
    url = pg_cluster.create_database()
    engine = sa.create_engine(url)
    conn = engine.connect()  # deliberately left open, as a failing test might
    conn.execute(sa.text("SELECT 1"))
    pg_cluster.drop_database(url.rsplit("/", 1)[1])
    conn.invalidate()  # its server backend is gone; don't try to return it to the pool
    engine.dispose()
    exists_sql = f"SELECT count(*) FROM pg_database WHERE datname = '{url.rsplit('/', 1)[1]}'"
    assert _scalar(pg_cluster.url(), exists_sql) == 0


def test_store_url_yields_both_backends(store_url: str) -> None:
    dialect = sa.engine.make_url(store_url).get_backend_name()
    assert dialect in {"sqlite", "postgresql"}
    assert _scalar(store_url, "SELECT 1") == 1
