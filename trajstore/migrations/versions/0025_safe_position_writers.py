"""log_safe_position: only the transactions of logins that may append hold the tail

Revision ID: 0025
Revises: 0024
Create Date: 2026-11-29

0014's ``log_safe_position`` waited on every transaction id running in the
database, whatever its login: a reader login (``trajstore init --reader-login``)
holding one (``BEGIN; SELECT txid_current();``, an idle BI session) made it NULL,
and the materializer, which bounds its tail the same way, folded nothing, for as
long as the session stayed. An append takes its positions as a login that may
INSERT into ``events`` or take values of ``log_positions``; a transaction of a
login that can do neither (itself or through a role it is a member of) holds no
position, and is no longer waited on. The rule is ``PostgreSQL.settled_head``'s
(``trajstore.log.postgres``, ``_MAY_APPEND_SQL``).

SQLite: nothing (its view is the log head). The downgrade restores 0014's function.
"""
from __future__ import annotations

from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None

# Frozen here. Sent as driver SQL without parameters, written without ``%`` or ``:``.
_FUNCTION = """
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
       AND l.pid <> pg_backend_pid(){writers};
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

# only a login that may append (insert events, or take positions) holds positions
_WRITERS = """
       AND EXISTS (SELECT 1 FROM pg_roles r
                    WHERE pg_has_role(a.usesysid, r.oid, 'MEMBER')
                      AND (has_table_privilege(r.oid, to_regclass('{schema}.events'), 'INSERT')
                           OR has_sequence_privilege(r.oid, to_regclass('{schema}.log_positions'), 'USAGE, UPDATE')))"""


def _create(writers: bool) -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    schema = bind.exec_driver_sql("SELECT quote_ident(current_schema())").scalar_one()
    bind.exec_driver_sql(_FUNCTION.format(schema=schema, writers=_WRITERS.format(schema=schema) if writers else ""))


def upgrade() -> None:
    _create(writers=True)


def downgrade() -> None:
    _create(writers=False)
