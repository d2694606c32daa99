"""inspection views; read-only role on PostgreSQL

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

The views as this revision made them, frozen here: a migration imports
nothing from the package, so that what it does never changes when the code
does (the live definitions in ``trajstore.inspect.views`` read columns that
later migrations add, 0004). Later migrations drop and recreate the views.
On PostgreSQL this also makes the ``trajstore_reader`` role that ``trajstore
sql`` switches to (``READER_ROLE_SQL``, frozen here too).
"""
from __future__ import annotations

from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

VIEW_NAMES = ("generation_events", "trajectory_summary", "sample_summary", "model_version_stats")

_GENERATION_EVENTS = """
SELECT
    trajectory_id, group_id, seq, position, sample_index,
    is_merged,
    seq > 0 AND NOT is_merged AS is_prefix_mismatch,
    prompt_len, prefix_len, num_observed_tokens, output_len, num_loss_tokens,
    model_version, finish_reason,
    has_routes, routes_start, num_route_rows_sent, num_route_rows_stored,
    reward, has_token_rewards, created_at
FROM (
    SELECT
        c.*,
        CAST(SUM(CASE WHEN c.is_merged THEN 0 ELSE 1 END) OVER (
            PARTITION BY c.trajectory_id ORDER BY c.seq ROWS UNBOUNDED PRECEDING) AS BIGINT) - 1 AS sample_index
    FROM (
        SELECT
            e.trajectory_id, t.group_id, e.seq, e.position,
            e.seq > 0 AND e.prefix_len = LAG(e.prompt_len + e.output_len) OVER (
                PARTITION BY e.trajectory_id ORDER BY e.seq) AS is_merged,
            e.prompt_len, e.prefix_len,
            e.prompt_len - e.prefix_len AS num_observed_tokens,
            e.output_len, e.num_loss_tokens, e.model_version, e.finish_reason,
            COALESCE(e.num_route_rows_sent, 0) > 0 AS has_routes,
            e.routes_start, e.num_route_rows_sent,
            e.num_route_rows AS num_route_rows_stored,
            e.reward, e.has_token_rewards, e.created_at
        FROM events e
        JOIN trajectories t ON t.trajectory_id = e.trajectory_id
        WHERE e.type = 'generation'
    ) c
) s
"""

_TRAJECTORY_SUMMARY = """
WITH calls AS (
    SELECT
        trajectory_id,
        COUNT(*) AS num_generations,
        CAST(SUM(output_len) AS BIGINT) AS num_generated_tokens,
        CAST(SUM(num_observed_tokens) AS BIGINT) AS num_observed_tokens,
        CAST(SUM(num_loss_tokens) AS BIGINT) AS num_loss_tokens,
        MAX(sample_index) + 1 AS num_samples,
        COUNT(*) FILTER (WHERE is_prefix_mismatch) AS num_prefix_mismatches,
        COUNT(*) FILTER (WHERE has_routes) AS num_generations_with_routes,
        MIN(model_version) AS min_model_version,
        MAX(model_version) AS max_model_version
    FROM generation_events
    GROUP BY trajectory_id
),
reasons AS (
    SELECT trajectory_id, {join_sorted} AS finish_reasons
    FROM (
        SELECT DISTINCT trajectory_id, finish_reason FROM events
        WHERE type = 'generation' AND finish_reason IS NOT NULL
        ORDER BY trajectory_id, finish_reason
    ) d
    GROUP BY trajectory_id
),
last_call_reward AS (
    -- The docs/reference.md gives the final sample the last per-call reward among its calls.
    SELECT r.trajectory_id, r.reward
    FROM (
        SELECT trajectory_id, sample_index, reward,
               ROW_NUMBER() OVER (PARTITION BY trajectory_id ORDER BY seq DESC) AS newest
        FROM generation_events WHERE reward IS NOT NULL
    ) r
    JOIN calls c ON c.trajectory_id = r.trajectory_id AND r.sample_index = c.num_samples - 1
    WHERE r.newest = 1
),
times AS (
    SELECT trajectory_id, MIN(created_at) AS first_event_at, MAX(created_at) AS last_event_at
    FROM events GROUP BY trajectory_id
)
SELECT
    t.trajectory_id, t.group_id, t.status,
    COALESCE(c.num_generations, 0) AS num_generations,
    COALESCE(c.num_generated_tokens, 0) AS num_generated_tokens,
    COALESCE(c.num_observed_tokens, 0) AS num_observed_tokens,
    COALESCE(c.num_loss_tokens, 0) AS num_loss_tokens,
    COALESCE(c.num_samples, 0) AS num_samples,
    COALESCE(c.num_prefix_mismatches, 0) AS num_prefix_mismatches,
    COALESCE(c.num_generations_with_routes, 0) AS num_generations_with_routes,
    COALESCE(t.reward, lr.reward) AS reward,
    c.min_model_version, c.max_model_version,
    c.max_model_version - c.min_model_version AS model_version_span,
    r.finish_reasons,
    tm.first_event_at, tm.last_event_at,
    tm.last_event_at - tm.first_event_at AS duration_s
FROM trajectories t
LEFT JOIN calls c ON c.trajectory_id = t.trajectory_id
LEFT JOIN reasons r ON r.trajectory_id = t.trajectory_id
LEFT JOIN last_call_reward lr ON lr.trajectory_id = t.trajectory_id
LEFT JOIN times tm ON tm.trajectory_id = t.trajectory_id
"""

_SAMPLE_SUMMARY = """
WITH calls AS (
    SELECT
        trajectory_id, sample_index,
        COUNT(*) AS num_merged_calls,
        CAST(SUM(output_len) AS BIGINT) AS num_generated_tokens,
        CAST(SUM(CASE WHEN is_merged THEN num_observed_tokens ELSE 0 END) AS BIGINT) AS num_observed_tokens,
        COUNT(*) FILTER (WHERE has_routes) AS num_calls_with_routes
    FROM generation_events
    GROUP BY trajectory_id, sample_index
),
policy AS (
    -- The newest model version that had generated anywhere in the log at
    -- each position: what the trainer was at when a trajectory finished.
    SELECT position,
           MAX(model_version) OVER (ORDER BY position ROWS UNBOUNDED PRECEDING) AS latest_model_version
    FROM events
)
SELECT
    s.trajectory_id, s.sample_index, s.group_id, s.status, s.is_last_step,
    s.prompt_len, s.response_len,
    s.prompt_len + s.response_len AS num_tokens,
    s.num_loss_tokens,
    c.num_merged_calls, c.num_generated_tokens, c.num_observed_tokens,
    s.reward,
    s.min_model_version, s.max_model_version,
    s.max_model_version - s.min_model_version AS model_version_span,
    p.latest_model_version,
    p.latest_model_version - s.min_model_version AS staleness,
    c.num_calls_with_routes,
    s.num_route_rows,
    CAST(s.num_route_rows AS DOUBLE PRECISION) / NULLIF(s.prompt_len + s.response_len, 0) AS route_coverage,
    s.finished_position
FROM samples s
LEFT JOIN calls c ON c.trajectory_id = s.trajectory_id AND c.sample_index = s.sample_index
LEFT JOIN policy p ON p.position = s.finished_position
"""

_MODEL_VERSION_STATS = """
WITH per_trajectory AS (
    SELECT
        model_version, trajectory_id,
        COUNT(*) AS num_generations,
        CAST(SUM(output_len) AS BIGINT) AS num_generated_tokens,
        CAST(SUM(num_loss_tokens) AS BIGINT) AS num_loss_tokens,
        COUNT(*) FILTER (WHERE finish_reason = 'abort') AS num_aborted_calls
    FROM generation_events
    GROUP BY model_version, trajectory_id
)
SELECT
    p.model_version,
    COUNT(*) AS num_trajectories,
    CAST(SUM(p.num_generations) AS BIGINT) AS num_generations,
    CAST(SUM(p.num_generated_tokens) AS BIGINT) AS num_generated_tokens,
    CAST(SUM(p.num_loss_tokens) AS BIGINT) AS num_loss_tokens,
    CAST(SUM(p.num_aborted_calls) AS BIGINT) AS num_aborted_calls,
    COUNT(ts.reward) AS num_rewarded,
    AVG(CAST(ts.reward AS DOUBLE PRECISION)) AS mean_reward,
    COUNT(*) FILTER (WHERE ts.status = 'completed') AS num_completed,
    COUNT(*) FILTER (WHERE ts.status = 'aborted') AS num_aborted,
    COUNT(*) FILTER (WHERE ts.status = 'failed') AS num_failed,
    COUNT(*) FILTER (WHERE ts.model_version_span > 0) AS num_multi_version
FROM per_trajectory p
JOIN trajectory_summary ts ON ts.trajectory_id = p.trajectory_id
GROUP BY p.model_version
"""


# Roles belong to the cluster, not the database, so creating it tolerates
# another database (or a concurrent migration) having made it first. A
# migrating user without CREATEROLE cannot make it; then the migration goes on
# with a NOTICE and an administrator runs the statements in docs/sql.md. The
# migrating user becomes a member so that ``trajstore sql`` can ``SET ROLE``
# to it; default privileges cover the tables and views later migrations add.
# Each grant the user may lack the right for (USAGE on a schema it does not
# own, membership without CREATEROLE) degrades to a NOTICE.
READER_ROLE_SQL = """DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'trajstore_reader') THEN
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = current_user AND (rolsuper OR rolcreaterole)) THEN
            RAISE NOTICE 'trajstore: cannot create role trajstore_reader (no CREATEROLE); see docs/sql.md (read-only access)';
            RETURN;
        END IF;
        BEGIN
            CREATE ROLE trajstore_reader NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;  -- made concurrently by a migration of another database
        END;
    END IF;
    BEGIN
        EXECUTE 'GRANT USAGE ON SCHEMA ' || quote_ident(current_schema()) || ' TO trajstore_reader';
    EXCEPTION WHEN insufficient_privilege THEN
        RAISE NOTICE USING MESSAGE = 'trajstore: ' || SQLERRM || '; see docs/sql.md (read-only access)';
    END;
    EXECUTE 'GRANT SELECT ON ALL TABLES IN SCHEMA ' || quote_ident(current_schema()) || ' TO trajstore_reader';
    EXECUTE 'ALTER DEFAULT PRIVILEGES IN SCHEMA ' || quote_ident(current_schema()) || ' GRANT SELECT ON TABLES TO trajstore_reader';
    IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) THEN
    BEGIN
        EXECUTE 'GRANT trajstore_reader TO ' || quote_ident(current_user);
    EXCEPTION WHEN insufficient_privilege THEN
        RAISE NOTICE USING MESSAGE = 'trajstore: ' || SQLERRM || '; see docs/sql.md (read-only access)';
    END;
    END IF;
END
$$"""

DROP_READER_GRANTS_SQL = """DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'trajstore_reader') THEN
        EXECUTE 'ALTER DEFAULT PRIVILEGES IN SCHEMA ' || quote_ident(current_schema())
            || ' REVOKE SELECT ON TABLES FROM trajstore_reader';
        EXECUTE 'REVOKE SELECT ON ALL TABLES IN SCHEMA ' || quote_ident(current_schema()) || ' FROM trajstore_reader';
        EXECUTE 'REVOKE USAGE ON SCHEMA ' || quote_ident(current_schema()) || ' FROM trajstore_reader';
    END IF;
END
$$"""


def view_sql(name: str, dialect: str) -> str:
    """The SELECT behind view ``name`` as of this revision."""
    join_sorted = ("string_agg(finish_reason, ',' ORDER BY finish_reason)" if dialect == "postgresql"
                   else "group_concat(finish_reason, ',')")
    return {
        "generation_events": _GENERATION_EVENTS,
        "trajectory_summary": _TRAJECTORY_SUMMARY.replace("{join_sorted}", join_sorted),
        "sample_summary": _SAMPLE_SUMMARY,
        "model_version_stats": _MODEL_VERSION_STATS,
    }[name].strip()


def create_views(dialect: str) -> None:
    for name in VIEW_NAMES:
        op.execute(f"CREATE VIEW {name} AS\n{view_sql(name, dialect)}")


def drop_views() -> None:
    for name in reversed(VIEW_NAMES):
        op.execute(f"DROP VIEW IF EXISTS {name}")


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    create_views(dialect)
    if dialect == "postgresql":
        # After the views: GRANT ... ON ALL TABLES covers views that exist now.
        op.execute(READER_ROLE_SQL)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(DROP_READER_GRANTS_SQL)
    drop_views()
