"""The SQL inspection views, written once for SQLite and PostgreSQL.

Four views, documented column by column in ``docs/sql.md``:

* ``generation_events``: one row per generation event (engine call), with the
  sample it folds into, as admission stored it;
* ``trajectory_summary``: one row per trajectory;
* ``sample_summary``: one row per materialized sample (the merge result);
* ``model_version_stats``: one row per model version.

These are the CURRENT definitions, for code and docs. No migration imports
this module: each migration that (re)creates the views holds their SQL in its
own file, and the newest one (0009) holds exactly what this module builds
(``tests/test_migrate_versions.py`` compares them on both backends). To
change a view, change it here AND add a migration that drops the views and
creates them from a copy of the new SQL pasted into it, for both dialects
(docs/log.md, "Schema migrations").

Portability rules the SQL keeps, so one text runs on both backends:
* no ``%`` and no ``:`` (Alembic runs the text through ``sqlalchemy.text``
  and psycopg placeholder parsing);
* booleans are expressions (``x > 0``) or BOOLEAN columns (``is_merged``),
  so PostgreSQL gives ``boolean`` and SQLite ``0/1``; both accept
  ``WHERE has_routes``;
* sums of sums are cast to BIGINT (PostgreSQL would give NUMERIC) and
  averages and shares to DOUBLE PRECISION (SQLite would divide integers);
* the true differences are a sorted comma-joined aggregate (``join_sorted``),
  expanding a JSON array into rows (``version_spans``) and reading a field of
  one of them (``span_int``): each backend's class holds its fragments
  (``trajstore.log._backend.Backend``), picked from the backend registry by
  the database's name.

Which generation folds into which sample is not derived here: admission
applies the fold's step (``trajstore.fold.fold_step``) to each call and stores
its outcome, ``events.sample_index`` and ``events.is_merged`` (with
``prefix_len``, the length of the previous sequence on a merge and 0
otherwise); the views read those columns.

The PostgreSQL read-only role used by ``trajstore sql`` is described here
too (``reader_role_sql``: the statements migration 0002 runs, frozen there as
``READER_ROLE_SQL``); see ``trajstore.inspect.sql`` for how it is used.
"""

from __future__ import annotations

from typing import Callable

from trajstore.log._backend import Backend
from trajstore.log._registry import BACKENDS

__all__ = [
    "VIEW_NAMES",
    "READER_ROLE",
    "view_sql",
    "create_views",
    "drop_views",
    "reader_role_sql",
    "drop_reader_grants_sql",
]

# Creation order: later views read the earlier ones.
VIEW_NAMES = ("generation_events", "trajectory_summary", "sample_summary", "model_version_stats")

READER_ROLE = "trajstore_reader"


_GENERATION_EVENTS = """
SELECT
    e.trajectory_id, t.group_id, e.seq, e.position, e.sample_index,
    e.is_merged,
    e.seq > 0 AND NOT e.is_merged AS is_prefix_mismatch,
    e.prompt_len, e.prefix_len,
    e.prompt_len - e.prefix_len AS num_observed_tokens,
    e.output_len, e.num_loss_tokens, e.model_version,
    COALESCE(e.min_model_version, e.model_version) AS min_model_version,
    e.version_spans, e.finish_reason,
    COALESCE(e.num_route_rows_sent, 0) > 0 AS has_routes,
    e.routes_start, e.num_route_rows_sent,
    e.num_route_rows AS num_route_rows_stored,
    e.route_rows_resent, e.route_rows_drifted,
    e.reward, e.has_token_rewards, e.metadata, e.created_at,
    e.weight_versions, e.num_placeholder_logprobs,
    (SELECT MIN(u.label) FROM unresolved_labels u
     WHERE u.event_position = e.position
       AND NOT EXISTS (SELECT 1 FROM version_labels v WHERE v.label = u.label)) AS unresolved_label
FROM events e
JOIN trajectories t ON t.trajectory_id = e.trajectory_id
WHERE e.type = 'generation'
"""


def _trajectory_summary(backend: type[Backend]) -> str:
    return f"""
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
        MIN(min_model_version) AS min_model_version,
        MAX(model_version) AS max_model_version,
        MIN(unresolved_label) AS unresolved_label,
        CAST(SUM(num_placeholder_logprobs) AS BIGINT) AS num_placeholder_logprobs,
        CAST(SUM(route_rows_resent) AS BIGINT) AS route_rows_resent,
        CAST(SUM(route_rows_drifted) AS BIGINT) AS route_rows_drifted,
        CAST(SUM(CASE WHEN route_rows_drifted IS NOT NULL THEN route_rows_resent END) AS BIGINT)
            AS route_rows_compared
    FROM generation_events
    GROUP BY trajectory_id
),
last_call AS (
    -- joined on the newest seq, not ranked with ROW_NUMBER(): SQLite cannot index a
    -- ranked subquery for the LEFT JOIN below and scanned it once per trajectory
    SELECT g.trajectory_id, g.finish_reason
    FROM generation_events g
    JOIN (SELECT trajectory_id, MAX(seq) AS seq FROM generation_events GROUP BY trajectory_id) m
      ON m.trajectory_id = g.trajectory_id AND m.seq = g.seq
),
reasons AS (
    SELECT trajectory_id, {backend.join_sorted("finish_reason")} AS finish_reasons
    FROM (
        SELECT DISTINCT trajectory_id, finish_reason FROM events
        WHERE type = 'generation' AND finish_reason IS NOT NULL
        ORDER BY trajectory_id, finish_reason
    ) d
    GROUP BY trajectory_id
),
last_call_reward AS (
    -- The docs/reference.md gives the final sample the last per-call reward among its calls.
    SELECT g.trajectory_id, g.reward
    FROM generation_events g
    JOIN (SELECT trajectory_id, MAX(seq) AS seq FROM generation_events
          WHERE reward IS NOT NULL GROUP BY trajectory_id) m
      ON m.trajectory_id = g.trajectory_id AND m.seq = g.seq
    JOIN calls c ON c.trajectory_id = g.trajectory_id AND g.sample_index = c.num_samples - 1
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
    lc.finish_reason AS last_finish_reason,
    tm.first_event_at, tm.last_event_at,
    tm.last_event_at - tm.first_event_at AS duration_s,
    c.unresolved_label,
    t.status <> 'running' AND c.unresolved_label IS NOT NULL AS is_held_back,
    COALESCE(c.num_placeholder_logprobs, 0) AS num_placeholder_logprobs,
    c.route_rows_resent, c.route_rows_drifted,
    CAST(c.route_rows_drifted AS DOUBLE PRECISION) / NULLIF(c.route_rows_compared, 0) AS route_drift_share
FROM trajectories t
LEFT JOIN calls c ON c.trajectory_id = t.trajectory_id
LEFT JOIN reasons r ON r.trajectory_id = t.trajectory_id
LEFT JOIN last_call lc ON lc.trajectory_id = t.trajectory_id
LEFT JOIN last_call_reward lr ON lr.trajectory_id = t.trajectory_id
LEFT JOIN times tm ON tm.trajectory_id = t.trajectory_id
"""


def _sample_summary(backend: type[Backend]) -> str:
    return f"""
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
reasons AS (
    SELECT trajectory_id, sample_index, {backend.join_sorted("finish_reason")} AS finish_reasons
    FROM (
        SELECT DISTINCT trajectory_id, sample_index, finish_reason FROM generation_events
        WHERE finish_reason IS NOT NULL
        ORDER BY trajectory_id, sample_index, finish_reason
    ) d
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
    s.reward, s.finish_reason, r.finish_reasons,
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
LEFT JOIN reasons r ON r.trajectory_id = s.trajectory_id AND r.sample_index = s.sample_index
LEFT JOIN policy p ON p.position = s.finished_position
"""


def _model_version_stats(backend: type[Backend]) -> str:
    # One row per (call, version it generated at): a call whose tokens span
    # versions (docs/reference.md "Versions") contributes one row per span, exactly.
    return f"""
WITH call_versions AS (
    SELECT trajectory_id, model_version, output_len AS num_tokens, num_loss_tokens, finish_reason
    FROM generation_events
    WHERE version_spans IS NULL
    UNION ALL
    SELECT g.trajectory_id, {backend.span_int("model_version")}, {backend.span_int("num_tokens")},
           {backend.span_int("num_loss_tokens")}, g.finish_reason
    FROM {backend.version_spans()}
    WHERE g.version_spans IS NOT NULL
),
drift AS (
    -- a call's routes belong to the version of its last token (model_version)
    SELECT model_version,
           CAST(SUM(route_rows_resent) AS BIGINT) AS route_rows_resent,
           CAST(SUM(route_rows_drifted) AS BIGINT) AS route_rows_drifted,
           CAST(SUM(CASE WHEN route_rows_drifted IS NOT NULL THEN route_rows_resent END) AS BIGINT)
               AS route_rows_compared
    FROM generation_events
    GROUP BY model_version
),
per_trajectory AS (
    SELECT
        model_version, trajectory_id,
        COUNT(*) AS num_generations,
        CAST(SUM(num_tokens) AS BIGINT) AS num_generated_tokens,
        CAST(SUM(num_loss_tokens) AS BIGINT) AS num_loss_tokens,
        COUNT(*) FILTER (WHERE finish_reason = 'abort') AS num_aborted_calls
    FROM call_versions
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
    COUNT(*) FILTER (WHERE ts.model_version_span > 0) AS num_multi_version,
    MAX(d.route_rows_resent) AS route_rows_resent,
    MAX(d.route_rows_drifted) AS route_rows_drifted,
    CAST(MAX(d.route_rows_drifted) AS DOUBLE PRECISION) / NULLIF(MAX(d.route_rows_compared), 0) AS route_drift_share
FROM per_trajectory p
JOIN trajectory_summary ts ON ts.trajectory_id = p.trajectory_id
LEFT JOIN drift d ON d.model_version = p.model_version
GROUP BY p.model_version
"""


def view_sql(name: str, dialect: str) -> str:
    """The SELECT behind view ``name`` for database ``dialect`` (a backend's name:
    ``trajstore.log._registry.BACKENDS``)."""
    backend = BACKENDS.get(dialect)
    if backend is None:
        raise ValueError(f"no inspection views for database {dialect!r} ({' or '.join(BACKENDS)})")
    builders: dict[str, Callable[[], str]] = {
        "generation_events": lambda: _GENERATION_EVENTS,
        "trajectory_summary": lambda: _trajectory_summary(backend),
        "sample_summary": lambda: _sample_summary(backend),
        "model_version_stats": lambda: _model_version_stats(backend),
    }
    if name not in builders:
        raise ValueError(f"unknown view {name!r}; views: {', '.join(VIEW_NAMES)}")
    return builders[name]().strip()


def create_views(execute: Callable[[str], object], dialect: str) -> None:
    """Create the four views (``execute`` runs one statement, e.g. ``op.execute``)."""
    for name in VIEW_NAMES:
        execute(f"CREATE VIEW {name} AS\n{view_sql(name, dialect)}")


def drop_views(execute: Callable[[str], object]) -> None:
    for name in reversed(VIEW_NAMES):
        execute(f"DROP VIEW IF EXISTS {name}")


def reader_role_sql() -> list[str]:
    """PostgreSQL statements that let ``trajstore_reader`` read this database.

    Roles belong to the cluster, not the database, so creating it tolerates
    another database (or a concurrent migration) having made it first. A
    migrating user without CREATEROLE cannot make it; then the migration
    goes on with a NOTICE and an administrator runs the statements in
    docs/sql.md. The migrating user becomes a member so that ``trajstore
    sql`` can ``SET ROLE`` to it; default privileges cover the tables and
    views later migrations add. Each grant the user may lack the right for
    (USAGE on a schema it does not own, membership without CREATEROLE)
    degrades to a NOTICE: the store must still be creatable.
    """
    role = READER_ROLE
    schema = "quote_ident(current_schema())"

    def tolerant(statement: str) -> str:
        return f"""
    BEGIN
        EXECUTE {statement};
    EXCEPTION WHEN insufficient_privilege THEN
        RAISE NOTICE USING MESSAGE = 'trajstore: ' || SQLERRM || '; see docs/sql.md (read-only access)';
    END;"""

    return [
        f"""DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = current_user AND (rolsuper OR rolcreaterole)) THEN
            RAISE NOTICE 'trajstore: cannot create role {role} (no CREATEROLE); see docs/sql.md (read-only access)';
            RETURN;
        END IF;
        BEGIN
            CREATE ROLE {role} NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;  -- made concurrently by a migration of another database
        END;
    END IF;{tolerant(f"'GRANT USAGE ON SCHEMA ' || {schema} || ' TO {role}'")}
    EXECUTE 'GRANT SELECT ON ALL TABLES IN SCHEMA ' || {schema} || ' TO {role}';
    EXECUTE 'ALTER DEFAULT PRIVILEGES IN SCHEMA ' || {schema} || ' GRANT SELECT ON TABLES TO {role}';
    IF NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) THEN{tolerant(f"'GRANT {role} TO ' || quote_ident(current_user)")}
    END IF;
END
$$"""
    ]


def drop_reader_grants_sql() -> list[str]:
    """Undo ``reader_role_sql`` in this database; the role itself may serve others."""
    role = READER_ROLE
    return [
        f"""DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{role}') THEN
        EXECUTE 'ALTER DEFAULT PRIVILEGES IN SCHEMA ' || quote_ident(current_schema())
            || ' REVOKE SELECT ON TABLES FROM {role}';
        EXECUTE 'REVOKE SELECT ON ALL TABLES IN SCHEMA ' || quote_ident(current_schema()) || ' FROM {role}';
        EXECUTE 'REVOKE USAGE ON SCHEMA ' || quote_ident(current_schema()) || ' FROM {role}';
    END IF;
END
$$"""
    ]
