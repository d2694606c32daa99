"""log_safe_position: the log's tail bound, readable in SQL by the read-only role

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-27

On PostgreSQL positions come from a sequence and two appends may commit out of
position order (docs/log.md, "Gap-free order"): a tool tailing ``events`` with
``position > last`` in plain SQL would skip an event that commits late. Python
callers bound their tail with ``EventLog.safe_position()``; this gives SQL
users the same bound.

* PostgreSQL: the function ``log_safe_position(wait_s)`` runs the rule of
  ``trajstore.log._dialect`` (``PostgreSQL.settled_head``): read the
  sequence's last value H, then the transaction ids running in this database,
  and return H once none of them is running (waiting up to ``wait_s``
  seconds), else NULL (appends still in flight: read nothing this round). The
  view ``log_safe_position`` (one row, column ``position``) calls it with the
  default wait, 0.25 s. The read-only role ``trajstore_reader`` gets SELECT on
  the sequence (to read its last value; nextval needs USAGE, which it does not
  get).
* SQLite: the view ``log_safe_position`` is the log head (one writer at a
  time: commits are in position order, and the head is committed with the
  events it counts).

Read the bound in its own statement, before the events (docs/sql.md,
"Tailing the log"): a statement's snapshot is taken when it starts, and a bound
computed inside it may cover events committed after that.
"""
from __future__ import annotations

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

READER_ROLE = "trajstore_reader"

# Frozen here; the same rule as ``PostgreSQL.settled_head``. Sent as driver SQL
# without parameters, and written without ``%`` or ``:`` all the same.
_PG_FUNCTION = """
CREATE OR REPLACE FUNCTION {schema}.log_safe_position(wait_s double precision DEFAULT 0.25)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
AS $fn$
DECLARE
    h bigint;
    running text[];
    deadline timestamptz;
    pause_s double precision = 0.0005;
BEGIN
    IF wait_s IS NULL OR wait_s < 0 OR wait_s = CAST('NaN' AS double precision) OR wait_s > 60 THEN
        RAISE EXCEPTION USING ERRCODE = 'invalid_parameter_value',
            MESSAGE = 'log_safe_position: wait_s must be a number of seconds from 0 to 60, got '
                      || coalesce(CAST(wait_s AS text), 'NULL');
    END IF;
    deadline = clock_timestamp() + make_interval(secs => wait_s);
    -- H first: an append holding a position <= H took its transaction id before
    -- H was read, so it has ended or is listed below.
    SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END INTO h FROM {schema}.log_positions;
    SELECT array_agg(CAST(l.transactionid AS text)) INTO running
      FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
     WHERE l.locktype = 'transactionid' AND l.mode = 'ExclusiveLock' AND l.granted
       AND l.transactionid IS NOT NULL AND a.datname = current_database()
       AND l.pid <> pg_backend_pid();
    LOOP
        IF running IS NULL OR NOT EXISTS (
            SELECT 1 FROM pg_locks
             WHERE locktype = 'transactionid' AND mode = 'ExclusiveLock' AND granted
               AND CAST(transactionid AS text) = ANY(running)) THEN
            RETURN h;
        END IF;
        IF clock_timestamp() >= deadline THEN
            RETURN NULL;  -- appends still in flight: no new bound
        END IF;
        PERFORM pg_sleep(pause_s);
        pause_s = least(pause_s * 2, 0.01);
    END LOOP;
END
$fn$
"""


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        op.execute("CREATE VIEW log_safe_position AS SELECT position FROM log_head WHERE id = 1")
        return
    schema = bind.exec_driver_sql("SELECT quote_ident(current_schema())").scalar_one()
    bind.exec_driver_sql(_PG_FUNCTION.format(schema=schema))
    op.execute(f"CREATE VIEW {schema}.log_safe_position AS SELECT {schema}.log_safe_position() AS position")
    op.execute(f"""DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READER_ROLE}') THEN
        BEGIN
            GRANT SELECT ON SEQUENCE {schema}.log_positions TO {READER_ROLE};
            GRANT SELECT ON {schema}.log_safe_position TO {READER_ROLE};
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE USING MESSAGE = 'trajstore: ' || SQLERRM || '; see docs/sql.md (read-only access)';
        END;
    END IF;
END
$$""")


def downgrade() -> None:
    bind = op.get_bind()
    op.execute("DROP VIEW IF EXISTS log_safe_position")
    if bind.dialect.name == "postgresql":
        op.execute(f"""DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READER_ROLE}') THEN
        REVOKE SELECT ON SEQUENCE log_positions FROM {READER_ROLE};
    END IF;
END
$$""")
        op.execute("DROP FUNCTION IF EXISTS log_safe_position(double precision)")
