"""the fold step's outcome on events; the sample count on trajectories

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23

Admission applies the fold's step (``trajstore.fold.fold_step``) to each
generation and now stores its outcome:

* ``events.sample_index``: the sample the call folds into;
* ``events.is_merged``: the prompt continued the previous call's sequence;
* ``trajectories.num_samples``: samples started so far (part of the fold's
  tail, ``FoldTail``).

Existing rows are backfilled with the SQL the views used to derive these
from ``prefix_len`` (frozen below: a call merged iff ``seq > 0`` and its
``prefix_len`` equals the previous call's ``prompt_len + output_len``; the
sample index is the running count of calls that start a sample). The views
are dropped first and recreated last as this revision made them (frozen
below: its ``generation_events`` reads the stored columns); downgrading
recreates 0004's frozen views.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

# The derivation generation_events used up to this revision, as an UPDATE.
BACKFILL_EVENTS = """
UPDATE events SET sample_index = d.sample_index, is_merged = d.is_merged
FROM (
    SELECT
        c.position, c.is_merged,
        CAST(SUM(CASE WHEN c.is_merged THEN 0 ELSE 1 END) OVER (
            PARTITION BY c.trajectory_id ORDER BY c.seq ROWS UNBOUNDED PRECEDING) AS BIGINT) - 1 AS sample_index
    FROM (
        SELECT
            e.position, e.trajectory_id, e.seq,
            e.seq > 0 AND e.prefix_len = LAG(e.prompt_len + e.output_len) OVER (
                PARTITION BY e.trajectory_id ORDER BY e.seq) AS is_merged
        FROM events e
        WHERE e.type = 'generation'
    ) c
) d
WHERE events.position = d.position
"""

BACKFILL_TRAJECTORIES = """
UPDATE trajectories SET num_samples = COALESCE((
    SELECT MAX(e.sample_index) + 1 FROM events e
    WHERE e.trajectory_id = trajectories.trajectory_id AND e.type = 'generation'
), 0)
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    drop_views(op.execute)
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('sample_index', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('is_merged', sa.Boolean(), nullable=True))
    with op.batch_alter_table('trajectories', schema=None) as batch_op:
        batch_op.add_column(sa.Column('num_samples', sa.Integer(), nullable=False, server_default='0'))
    op.execute(BACKFILL_EVENTS)
    op.execute(BACKFILL_TRAJECTORIES)
    create_views(op.execute, dialect)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    drop_views(op.execute)
    with op.batch_alter_table('trajectories', schema=None) as batch_op:
        batch_op.drop_column('num_samples')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_column('is_merged')
        batch_op.drop_column('sample_index')
    _revision_0004().create_views(op.execute, dialect)


def _revision_0004():
    """Migration 0004's module, which holds the views as it made them."""
    path = Path(__file__).with_name('0004_versions_metadata_finish_reason.py')
    spec = importlib.util.spec_from_file_location('trajstore_migration_0004', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The views as this revision made them (frozen: the live definitions in
# trajstore.inspect.views read columns that later migrations add, 0009).
VIEWS = {
    ('generation_events', 'sqlite'): """
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
    e.reward, e.has_token_rewards, e.metadata, e.created_at
FROM events e
JOIN trajectories t ON t.trajectory_id = e.trajectory_id
WHERE e.type = 'generation'
""",
    ('trajectory_summary', 'sqlite'): """
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
    SELECT trajectory_id, group_concat(finish_reason, ',') AS finish_reasons
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
""",
    ('sample_summary', 'sqlite'): """
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
    SELECT trajectory_id, sample_index, group_concat(finish_reason, ',') AS finish_reasons
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
""",
    ('model_version_stats', 'sqlite'): """
WITH call_versions AS (
    SELECT trajectory_id, model_version, output_len AS num_tokens, num_loss_tokens, finish_reason
    FROM generation_events
    WHERE version_spans IS NULL
    UNION ALL
    SELECT g.trajectory_id, CAST(json_extract(j.value, '$.model_version') AS INTEGER), CAST(json_extract(j.value, '$.num_tokens') AS INTEGER),
           CAST(json_extract(j.value, '$.num_loss_tokens') AS INTEGER), g.finish_reason
    FROM generation_events g, json_each(g.version_spans) j
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
""",
    ('generation_events', 'postgresql'): """
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
    e.reward, e.has_token_rewards, e.metadata, e.created_at
FROM events e
JOIN trajectories t ON t.trajectory_id = e.trajectory_id
WHERE e.type = 'generation'
""",
    ('trajectory_summary', 'postgresql'): """
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
    SELECT trajectory_id, string_agg(finish_reason, ',' ORDER BY finish_reason) AS finish_reasons
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
""",
    ('sample_summary', 'postgresql'): """
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
    SELECT trajectory_id, sample_index, string_agg(finish_reason, ',' ORDER BY finish_reason) AS finish_reasons
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
""",
    ('model_version_stats', 'postgresql'): """
WITH call_versions AS (
    SELECT trajectory_id, model_version, output_len AS num_tokens, num_loss_tokens, finish_reason
    FROM generation_events
    WHERE version_spans IS NULL
    UNION ALL
    SELECT g.trajectory_id, CAST(j.value ->> 'model_version' AS INTEGER), CAST(j.value ->> 'num_tokens' AS INTEGER),
           CAST(j.value ->> 'num_loss_tokens' AS INTEGER), g.finish_reason
    FROM generation_events g CROSS JOIN LATERAL json_array_elements(g.version_spans) AS j(value)
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
""",
}


VIEW_NAMES = ("generation_events", "trajectory_summary", "sample_summary", "model_version_stats")


def create_views(execute, dialect: str) -> None:
    """Create the views as this revision made them."""
    for name in VIEW_NAMES:
        execute(f"CREATE VIEW {name} AS\n{VIEWS[name, dialect].strip()}")


def drop_views(execute) -> None:
    for name in reversed(VIEW_NAMES):
        execute(f"DROP VIEW IF EXISTS {name}")
