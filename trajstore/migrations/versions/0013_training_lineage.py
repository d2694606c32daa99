"""training lineage: train_step and sample_annotation events in SQL

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27

* ``lineage_steps``: one row per ``train_step`` event, (run, step, rank,
  attempt), its policy version, sample and token counts and metrics;
* ``lineage_step_samples``: the samples each step consumed, with the
  sample row's response length and version range when the step was appended;
* ``lineage_annotations``: one row per ``sample_annotation`` event, its
  arrays' locator in the payload, and the train/rollout mismatch aggregated at
  admission (tokens compared, sums of k3 and |r|, max |r|);
* ``lineage_annotation_versions``: the same sums per model version of the
  compared tokens;
* the views ``train_steps``, ``sample_consumption``,
  ``train_rollout_mismatch`` and ``train_rollout_mismatch_by_version``: for
  every (run, step, rank), and every annotated (run, step, sample), the highest
  attempt stands. Granted to the read-only role on PostgreSQL.

Nothing existing is rewritten; the downgrade drops them.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None

# frozen here: later changes to the live views never rewrite this revision
TRAIN_STEPS = """
SELECT
    s.run, s.step, s.rank, s.attempt, s.world_size, s.policy_version,
    s.num_samples, s.num_response_tokens, s.metrics, s.projection,
    s.position, s.created_at
FROM lineage_steps s
WHERE s.attempt = (SELECT MAX(o.attempt) FROM lineage_steps o
                   WHERE o.run = s.run AND o.step = s.step AND o.rank = s.rank)
"""

SAMPLE_CONSUMPTION = """
SELECT
    t.run, t.step, t.rank, t.attempt, t.policy_version,
    x.trajectory_id, x.sample_index, x.min_model_version, x.max_model_version,
    t.policy_version - x.min_model_version AS staleness,
    x.response_len, x.ordinal, t.projection
FROM train_steps t
JOIN lineage_step_samples x
  ON x.run = t.run AND x.step = t.step AND x.rank = t.rank AND x.attempt = t.attempt
"""

TRAIN_ROLLOUT_MISMATCH = """
SELECT
    a.run, a.step, a.attempt, a.trajectory_id, a.sample_index, a.tokens_compared,
    a.k3_sum / NULLIF(CAST(a.tokens_compared AS DOUBLE PRECISION), 0) AS k3_mean,
    a.abs_log_ratio_sum / NULLIF(CAST(a.tokens_compared AS DOUBLE PRECISION), 0) AS abs_log_ratio_mean,
    a.log_ratio_max_abs, a.projection
FROM lineage_annotations a
WHERE a.tokens_compared IS NOT NULL
  AND a.attempt = (SELECT MAX(o.attempt) FROM lineage_annotations o
                   WHERE o.run = a.run AND o.step = a.step
                     AND o.trajectory_id = a.trajectory_id AND o.sample_index = a.sample_index)
"""

TRAIN_ROLLOUT_MISMATCH_BY_VERSION = """
SELECT
    v.run, v.model_version,
    CAST(SUM(v.tokens_compared) AS BIGINT) AS tokens_compared,
    SUM(v.k3_sum) / NULLIF(CAST(SUM(v.tokens_compared) AS DOUBLE PRECISION), 0) AS k3_mean,
    SUM(v.abs_log_ratio_sum) / NULLIF(CAST(SUM(v.tokens_compared) AS DOUBLE PRECISION), 0) AS abs_log_ratio_mean
FROM lineage_annotation_versions v
WHERE v.attempt = (SELECT MAX(o.attempt) FROM lineage_annotations o
                   WHERE o.run = v.run AND o.step = v.step
                     AND o.trajectory_id = v.trajectory_id AND o.sample_index = v.sample_index)
GROUP BY v.run, v.model_version
"""

VIEWS = (("train_steps", TRAIN_STEPS), ("sample_consumption", SAMPLE_CONSUMPTION),
         ("train_rollout_mismatch", TRAIN_ROLLOUT_MISMATCH),
         ("train_rollout_mismatch_by_version", TRAIN_ROLLOUT_MISMATCH_BY_VERSION))

READER_ROLE = 'trajstore_reader'  # 0002's role; its default privileges cover these too, unless another user migrates


def upgrade() -> None:
    op.create_table(
        'lineage_steps',
        sa.Column('run', sa.String(length=255), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('world_size', sa.Integer(), nullable=False),
        sa.Column('policy_version', sa.Integer(), nullable=False),
        sa.Column('projection', sa.String(length=64), nullable=True),
        sa.Column('num_samples', sa.Integer(), nullable=False),
        sa.Column('num_response_tokens', sa.BigInteger(), nullable=False),
        sa.Column('metrics', sa.Text(), nullable=False),
        sa.Column('identity', sa.String(length=600), nullable=False),
        sa.Column('position', sa.BigInteger(), nullable=False),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('run', 'step', 'rank', 'attempt'),
    )
    op.create_table(
        'lineage_step_samples',
        sa.Column('run', sa.String(length=255), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('trajectory_id', sa.String(length=255), nullable=False),
        sa.Column('sample_index', sa.Integer(), nullable=False),
        sa.Column('ordinal', sa.Integer(), nullable=False),
        sa.Column('response_len', sa.Integer(), nullable=False),
        sa.Column('min_model_version', sa.Integer(), nullable=False),
        sa.Column('max_model_version', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('run', 'step', 'rank', 'attempt', 'trajectory_id', 'sample_index'),
    )
    op.create_index('ix_lineage_step_samples_sample', 'lineage_step_samples', ['trajectory_id', 'sample_index'])
    op.create_table(
        'lineage_annotations',
        sa.Column('run', sa.String(length=255), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('trajectory_id', sa.String(length=255), nullable=False),
        sa.Column('sample_index', sa.Integer(), nullable=False),
        sa.Column('projection', sa.String(length=64), nullable=True),
        sa.Column('num_tokens', sa.Integer(), nullable=True),
        sa.Column('has_trainer_logprobs', sa.Boolean(), nullable=False),
        sa.Column('has_advantages', sa.Boolean(), nullable=False),
        sa.Column('advantage', sa.Float(), nullable=True),
        sa.Column('has_entropy', sa.Boolean(), nullable=False),
        sa.Column('metrics', sa.Text(), nullable=False),
        sa.Column('tokens_compared', sa.Integer(), nullable=True),
        sa.Column('k3_sum', sa.Float(), nullable=True),
        sa.Column('abs_log_ratio_sum', sa.Float(), nullable=True),
        sa.Column('log_ratio_max_abs', sa.Float(), nullable=True),
        sa.Column('identity', sa.String(length=600), nullable=False),
        sa.Column('position', sa.BigInteger(), nullable=False),
        sa.Column('segment', sa.String(length=255), nullable=True),
        sa.Column('segment_row', sa.Integer(), nullable=True),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('run', 'step', 'attempt', 'trajectory_id', 'sample_index'),
    )
    op.create_index('ix_lineage_annotations_sample', 'lineage_annotations', ['trajectory_id', 'sample_index'])
    op.create_table(
        'lineage_annotation_versions',
        sa.Column('run', sa.String(length=255), nullable=False),
        sa.Column('step', sa.Integer(), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.Column('trajectory_id', sa.String(length=255), nullable=False),
        sa.Column('sample_index', sa.Integer(), nullable=False),
        sa.Column('model_version', sa.Integer(), nullable=False),
        sa.Column('tokens_compared', sa.Integer(), nullable=False),
        sa.Column('k3_sum', sa.Float(), nullable=False),
        sa.Column('abs_log_ratio_sum', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('run', 'step', 'attempt', 'trajectory_id', 'sample_index', 'model_version'),
    )
    for name, sql in VIEWS:
        op.execute(f"CREATE VIEW {name} AS\n{sql.strip()}")
    if op.get_bind().dialect.name == 'postgresql':
        names = ', '.join(name for name, _ in VIEWS)
        op.execute(f"""DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READER_ROLE}') THEN
        BEGIN
            EXECUTE 'GRANT SELECT ON {names}, lineage_steps, lineage_step_samples, lineage_annotations, '
                || 'lineage_annotation_versions TO {READER_ROLE}';
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE USING MESSAGE = 'trajstore: ' || SQLERRM || '; see docs/sql.md (read-only access)';
        END;
    END IF;
END
$$""")


def downgrade() -> None:
    for name, _ in reversed(VIEWS):
        op.execute(f"DROP VIEW IF EXISTS {name}")
    op.drop_table('lineage_annotation_versions')
    op.drop_index('ix_lineage_annotations_sample', table_name='lineage_annotations')
    op.drop_table('lineage_annotations')
    op.drop_index('ix_lineage_step_samples_sample', table_name='lineage_step_samples')
    op.drop_table('lineage_step_samples')
    op.drop_table('lineage_steps')
