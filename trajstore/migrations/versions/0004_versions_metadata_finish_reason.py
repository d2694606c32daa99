"""per-token model versions, generation metadata, sample finish reasons

Revision ID: 0004
Revises: 0002
Create Date: 2026-11-23

docs/reference.md "Versions" and generation ``metadata``:

* ``events.min_model_version``: the first output token's version (the last
  one stays ``model_version``); filled for existing rows;
* ``events.version_spans``: JSON, only for calls whose tokens span several
  versions, so SQL counts tokens per version exactly;
* ``events.metadata``: JSON, a generation's free-form metadata;
* ``samples.finish_reason``: the last merged call's own finish reason.

The views are dropped first and recreated last, as this revision made them:
their SQL is frozen below (the live definitions in ``trajstore.inspect.views``
read columns that later migrations add, 0006). Downgrading recreates 0002's
frozen views.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from typing import Callable

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    drop_views(op.execute)
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('min_model_version', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('version_spans', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('metadata', sa.JSON(), nullable=True))
    with op.batch_alter_table('samples', schema=None) as batch_op:
        batch_op.add_column(sa.Column('finish_reason', sa.String(length=64), nullable=True))
    # Before this revision every call had one version.
    op.execute("UPDATE events SET min_model_version = model_version WHERE type = 'generation'")
    create_views(op.execute, dialect)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    drop_views(op.execute)
    with op.batch_alter_table('samples', schema=None) as batch_op:
        batch_op.drop_column('finish_reason')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_column('metadata')
        batch_op.drop_column('version_spans')
        batch_op.drop_column('min_model_version')
    _revision_0002().create_views(dialect)


def _revision_0002():
    """Migration 0002's module, which holds the views as it made them."""
    path = Path(__file__).with_name('0002_inspection_views_reader_role.py')
    spec = importlib.util.spec_from_file_location('trajstore_migration_0002', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the views as this revision made them (trajstore.inspect.views at 0004, verbatim) --------------

VIEW_NAMES = ("generation_events", "trajectory_summary", "sample_summary", "model_version_stats")


def _join_sorted(column: str, dialect: str) -> str:
    """Aggregate: the distinct values of ``column`` sorted and joined with ','.

    SQLite before 3.44 has no ORDER BY inside an aggregate; group_concat
    follows the order of its input, which the callers sort in a subquery."""
    if dialect == "postgresql":
        return f"string_agg({column}, ',' ORDER BY {column})"
    return f"group_concat({column}, ',')"


def _version_spans(dialect: str) -> str:
    """FROM-clause rows of generation_events ``g`` joined to its version spans ``j``.

    ``j.value`` is one span object; ``_span_int`` reads a field of it."""
    if dialect == "postgresql":
        return "generation_events g CROSS JOIN LATERAL json_array_elements(g.version_spans) AS j(value)"
    return "generation_events g, json_each(g.version_spans) j"


def _span_int(key: str, dialect: str) -> str:
    if dialect == "postgresql":
        return f"CAST(j.value ->> '{key}' AS INTEGER)"
    return f"CAST(json_extract(j.value, '$.{key}') AS INTEGER)"


_GENERATION_EVENTS = """
SELECT
    trajectory_id, group_id, seq, position, sample_index,
    is_merged,
    seq > 0 AND NOT is_merged AS is_prefix_mismatch,
    prompt_len, prefix_len, num_observed_tokens, output_len, num_loss_tokens,
    model_version, min_model_version, version_spans, finish_reason,
    has_routes, routes_start, num_route_rows_sent, num_route_rows_stored,
    reward, has_token_rewards, metadata, created_at
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
            e.output_len, e.num_loss_tokens, e.model_version,
            COALESCE(e.min_model_version, e.model_version) AS min_model_version,
            e.version_spans, e.finish_reason,
            COALESCE(e.num_route_rows_sent, 0) > 0 AS has_routes,
            e.routes_start, e.num_route_rows_sent,
            e.num_route_rows AS num_route_rows_stored,
            e.reward, e.has_token_rewards, e.metadata, e.created_at
        FROM events e
        JOIN trajectories t ON t.trajectory_id = e.trajectory_id
        WHERE e.type = 'generation'
    ) c
) s
"""


def _trajectory_summary(dialect: str) -> str:
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
        MAX(model_version) AS max_model_version
    FROM generation_events
    GROUP BY trajectory_id
),
last_call AS (
    SELECT trajectory_id, finish_reason
    FROM (
        SELECT trajectory_id, finish_reason,
               ROW_NUMBER() OVER (PARTITION BY trajectory_id ORDER BY seq DESC) AS newest
        FROM generation_events
    ) l
    WHERE newest = 1
),
reasons AS (
    SELECT trajectory_id, {_join_sorted("finish_reason", dialect)} AS finish_reasons
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
    lc.finish_reason AS last_finish_reason,
    tm.first_event_at, tm.last_event_at,
    tm.last_event_at - tm.first_event_at AS duration_s
FROM trajectories t
LEFT JOIN calls c ON c.trajectory_id = t.trajectory_id
LEFT JOIN reasons r ON r.trajectory_id = t.trajectory_id
LEFT JOIN last_call lc ON lc.trajectory_id = t.trajectory_id
LEFT JOIN last_call_reward lr ON lr.trajectory_id = t.trajectory_id
LEFT JOIN times tm ON tm.trajectory_id = t.trajectory_id
"""


def _sample_summary(dialect: str) -> str:
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
    SELECT trajectory_id, sample_index, {_join_sorted("finish_reason", dialect)} AS finish_reasons
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


def _model_version_stats(dialect: str) -> str:
    # One row per (call, version it generated at): a call whose tokens span
    # versions (docs/reference.md "Versions") contributes one row per span, exactly.
    return f"""
WITH call_versions AS (
    SELECT trajectory_id, model_version, output_len AS num_tokens, num_loss_tokens, finish_reason
    FROM generation_events
    WHERE version_spans IS NULL
    UNION ALL
    SELECT g.trajectory_id, {_span_int("model_version", dialect)}, {_span_int("num_tokens", dialect)},
           {_span_int("num_loss_tokens", dialect)}, g.finish_reason
    FROM {_version_spans(dialect)}
    WHERE g.version_spans IS NOT NULL
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
    COUNT(*) FILTER (WHERE ts.model_version_span > 0) AS num_multi_version
FROM per_trajectory p
JOIN trajectory_summary ts ON ts.trajectory_id = p.trajectory_id
GROUP BY p.model_version
"""


def view_sql(name: str, dialect: str) -> str:
    """The SELECT behind view ``name`` for ``dialect`` ("sqlite" or "postgresql")."""
    if dialect not in ("sqlite", "postgresql"):
        raise ValueError(f"no inspection views for database {dialect!r} (sqlite or postgresql)")
    builders: dict[str, Callable[[], str]] = {
        "generation_events": lambda: _GENERATION_EVENTS,
        "trajectory_summary": lambda: _trajectory_summary(dialect),
        "sample_summary": lambda: _sample_summary(dialect),
        "model_version_stats": lambda: _model_version_stats(dialect),
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
