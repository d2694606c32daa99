"""A pooled PostgreSQL connection that broke while checked out (the server
restarted, its backend was terminated) is dropped quietly when it is returned:
no SQLAlchemy "Exception during reset or similar" traceback in the log, and the
next use of the pool gets a working connection."""

from __future__ import annotations

import logging

import pytest

from trajstore.log.postgres import make_engines

from pg_cluster import crash_cluster, start_cluster_again


def _reset_tracebacks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("sqlalchemy.pool") and r.levelno >= logging.WARNING]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["restart", "terminate"])
def test_a_connection_broken_while_checked_out_is_dropped_quietly(fault_cluster, caplog, fault):
    caplog.set_level(logging.DEBUG, logger="sqlalchemy.pool")
    url = fault_cluster.create_database()
    engine, _ = make_engines(url)
    raw = engine.raw_connection()  # the append's hot path holds pooled driver connections
    cur = raw.cursor()
    cur.execute("SELECT pg_backend_pid()")  # a transaction is open: returning it rolls back
    pid = cur.fetchone()[0]
    if fault == "restart":
        crash_cluster(fault_cluster)
        start_cluster_again(fault_cluster)
    else:
        fault_cluster.wait_ready()
        with fault_cluster._admin() as admin:
            assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]
    raw.close()  # back to the pool: the rollback fails on the dead connection
    assert _reset_tracebacks(caplog) == [], "the pool logged the failed reset as an error"
    with engine.connect() as conn:  # the pool hands out a working connection again
        assert conn.exec_driver_sql("SELECT 1").scalar_one() == 1
    assert engine.pool.checkedout() == 0
    engine.dispose()
