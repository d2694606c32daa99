"""weight-version labels, placeholder logprobs, route drift

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25

docs/reference.md "Versions" (the engine's ``weight_versions`` spans and the store's
label map):

* ``events.weight_versions``: JSON, a generation's spans exactly as sent;
* ``version_labels``: the label map (label -> model version), filled by
  ``version_label`` events;
* ``unresolved_labels``: the labels of a generation the map did not hold
  when it was appended (its trajectory is held back until they are mapped).

docs/reference.md "Ordering and validation", the -9999.0 rule:

* ``events.num_placeholder_logprobs``: logprobs at or below -9999.0 a call
  sent (stored as missing); NULL for calls without logprobs and for rows
  appended before this revision (counting them would read every payload).

Route drift (docs/reference.md "Routed experts", R3 health):

* ``events.route_rows_resent``: rows a call sent for positions its sample
  had already recorded. Backfilled for existing rows: admission stored only
  the rows past the watermark, so it is ``num_route_rows_sent -
  num_route_rows`` (NULL without routes).
* ``events.route_rows_drifted``: of those, rows that differ from the
  recorded ones; NULL for existing rows (the dropped rows were never stored,
  so there is nothing to compare).

The views are dropped first and recreated last as this revision made them
(frozen below, like every migration's: a migration imports nothing from the
package, so what it does never changes when ``trajstore.inspect.views``
does); downgrading recreates 0006's frozen views. These are the newest
views: ``trajstore.inspect.views`` builds exactly this SQL until a later
migration freezes other views in its own file.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    drop_views(op.execute)
    # plain ALTER TABLE ADD COLUMN on both dialects: no table rebuild
    op.add_column('events', sa.Column('weight_versions', sa.JSON(), nullable=True))
    op.add_column('events', sa.Column('num_placeholder_logprobs', sa.Integer(), nullable=True))
    op.add_column('events', sa.Column('route_rows_resent', sa.Integer(), nullable=True))
    op.add_column('events', sa.Column('route_rows_drifted', sa.Integer(), nullable=True))
    op.execute("UPDATE events SET route_rows_resent = num_route_rows_sent - num_route_rows "
               "WHERE type = 'generation' AND num_route_rows_sent IS NOT NULL")
    op.create_table(
        'version_labels',
        sa.Column('label', sa.String(length=255), nullable=False),
        sa.Column('model_version', sa.Integer(), nullable=False),
        sa.Column('position', sa.BigInteger(), nullable=False),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('label'),
    )
    op.create_table(
        'unresolved_labels',
        sa.Column('event_position', sa.BigInteger(), nullable=False),
        sa.Column('label', sa.String(length=255), nullable=False),
        sa.Column('trajectory_id', sa.String(length=255), nullable=False),
        sa.PrimaryKeyConstraint('event_position', 'label'),
    )
    op.create_index('ix_unresolved_labels_trajectory_id', 'unresolved_labels', ['trajectory_id'], unique=False)
    op.create_index('ix_unresolved_labels_label', 'unresolved_labels', ['label'], unique=False)
    create_views(op.execute, dialect)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    drop_views(op.execute)
    op.drop_index('ix_unresolved_labels_label', table_name='unresolved_labels')
    op.drop_index('ix_unresolved_labels_trajectory_id', table_name='unresolved_labels')
    op.drop_table('unresolved_labels')
    op.drop_table('version_labels')
    op.execute('ALTER TABLE events DROP COLUMN route_rows_drifted')
    op.execute('ALTER TABLE events DROP COLUMN route_rows_resent')
    op.execute('ALTER TABLE events DROP COLUMN num_placeholder_logprobs')
    op.execute('ALTER TABLE events DROP COLUMN weight_versions')
    _revision_0006().create_views(op.execute, dialect)


def _revision_0006():
    """Migration 0006's module, which holds the views as it made them."""
    path = Path(__file__).with_name('0006_fold_outcome.py')
    spec = importlib.util.spec_from_file_location('trajstore_migration_0006', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The views as this revision makes them (trajstore.inspect.views when they were frozen here, verbatim).
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
    e.route_rows_resent, e.route_rows_drifted,
    e.reward, e.has_token_rewards, e.metadata, e.created_at,
    e.weight_versions, e.num_placeholder_logprobs,
    (SELECT MIN(u.label) FROM unresolved_labels u
     WHERE u.event_position = e.position
       AND NOT EXISTS (SELECT 1 FROM version_labels v WHERE v.label = u.label)) AS unresolved_label
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
    e.route_rows_resent, e.route_rows_drifted,
    e.reward, e.has_token_rewards, e.metadata, e.created_at,
    e.weight_versions, e.num_placeholder_logprobs,
    (SELECT MIN(u.label) FROM unresolved_labels u
     WHERE u.event_position = e.position
       AND NOT EXISTS (SELECT 1 FROM version_labels v WHERE v.label = u.label)) AS unresolved_label
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
