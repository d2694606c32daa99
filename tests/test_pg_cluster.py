"""The test suite's own PostgreSQL is real, writable and hands out distinct databases."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from pg_cluster import crash_cluster, start_cluster_again


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


def test_fsync_is_on_where_servers_crash(fault_cluster, fresh_pg_url: str) -> None:
    # Durability tests are vacuous on a cluster that does not fsync: they crash the fault cluster,
    # which fsyncs. The suite's main cluster is never crashed (a crash there would also end every
    # other test's sessions), so it skips the fsyncs, which only an operating system's crash needs.
    assert _scalar(fault_cluster.url(), "SHOW fsync") == "on"
    assert _scalar(fresh_pg_url, "SHOW fsync") == "off"


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


# --- the fault cluster: shared by tests that kill backends, change settings, restart the server ---

def test_fault_cluster_is_not_the_main_cluster(pg_cluster, fault_cluster) -> None:
    assert fault_cluster.port != pg_cluster.port and fault_cluster.data_dir != pg_cluster.data_dir


def _fault_cluster_state(cluster) -> tuple:
    with cluster._admin() as conn:
        dbs = sorted(r[0] for r in conn.execute("SELECT datname FROM pg_database"))
        roles = sorted(r[0] for r in conn.execute("SELECT rolname FROM pg_roles WHERE rolname NOT LIKE 'pg\\_%'"))
        standby = conn.execute("SHOW synchronous_standby_names").fetchone()[0]
    return dbs, roles, standby


@pytest.mark.parametrize("leaves", ["settings", "crashed", "stopped", "just-objects"])
def test_fault_cluster_is_handed_over_clean(fault_cluster, leaves) -> None:
    """What one test leaves behind (a database, a role owning a table, an ALTER
    SYSTEM setting, a crashed or stopped server), the next gets none of: whichever
    test checks what the one before left (in the order of the parameters)."""
    state = _fault_cluster_state(fault_cluster)
    assert state == (["postgres", "template0", "template1"], ["postgres"], ""), state
    url = fault_cluster.create_database()
    with fault_cluster._admin() as conn:
        conn.execute("CREATE ROLE leftover LOGIN")
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (id int)"))
            conn.execute(sa.text("ALTER TABLE t OWNER TO leftover"))
    finally:
        engine.dispose()
    fault_cluster.alter_system("synchronous_standby_names", "nobody")
    if leaves == "crashed":
        crash_cluster(fault_cluster)
        start_cluster_again(fault_cluster)
    elif leaves == "stopped":
        crash_cluster(fault_cluster)
    if leaves != "stopped":
        fault_cluster.wait_ready()
        with fault_cluster._admin() as conn:  # the port survives a restart, the setting is there
            assert conn.execute("SHOW synchronous_standby_names").fetchone()[0] == "nobody"
