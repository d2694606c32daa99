"""named projections: the log re-folded under another fold policy

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-25

* ``projections``: one row per named projection, its fold policy
  (``merge``, ``observation``, ``routes``; trajstore.fold.FoldPolicy) and the
  ``token`` its sample segments are named by;
* ``projection_samples``, ``projection_checkpoints``,
  ``projection_unfoldable``: the columns of ``samples``,
  ``materializer_checkpoints`` and ``unfoldable_trajectories`` plus the
  projection's name, so the default's tables and views are unchanged;
* the view ``projection_sample_summary``: one row per projection sample with
  its policy.

Nothing existing is rewritten; the downgrade drops them (and the samples of
every projection with them: the log is untouched, so they can be
materialized again), and forgets the projections' sample segments, whose
files ``trajstore gc`` then deletes after its grace.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

# frozen here: later changes to the live view never rewrite this revision
PROJECTION_SAMPLE_SUMMARY = """
SELECT
    s.projection, p.merge, p.observation, p.routes,
    s.trajectory_id, s.sample_index, s.group_id, s.status, s.is_last_step,
    s.prompt_len, s.response_len,
    s.prompt_len + s.response_len AS num_tokens,
    s.num_loss_tokens, s.num_merged_calls,
    s.reward, s.finish_reason,
    s.min_model_version, s.max_model_version,
    s.num_route_rows,
    CAST(s.num_route_rows AS DOUBLE PRECISION) / NULLIF(s.prompt_len + s.response_len, 0) AS route_coverage,
    s.finished_position
FROM projection_samples s
JOIN projections p ON p.name = s.projection
"""


def upgrade() -> None:
    op.create_table(
        'projections',
        sa.Column('name', sa.String(length=64), nullable=False),
        sa.Column('merge', sa.String(length=16), nullable=False),
        sa.Column('observation', sa.String(length=16), nullable=False),
        sa.Column('routes', sa.String(length=16), nullable=False),
        sa.Column('token', sa.String(length=32), nullable=False),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('name'),
        sa.UniqueConstraint('token'),
    )
    op.create_table(
        'projection_samples',
        sa.Column('projection', sa.String(length=64), nullable=False),
        sa.Column('trajectory_id', sa.String(length=255), nullable=False),
        sa.Column('sample_index', sa.Integer(), nullable=False),
        sa.Column('finished_position', sa.BigInteger(), nullable=False),
        sa.Column('group_id', sa.String(length=255), nullable=True),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('is_last_step', sa.Boolean(), nullable=False),
        sa.Column('prompt_len', sa.Integer(), nullable=False),
        sa.Column('response_len', sa.Integer(), nullable=False),
        sa.Column('num_loss_tokens', sa.Integer(), nullable=False),
        sa.Column('num_merged_calls', sa.Integer(), nullable=False),
        sa.Column('reward', sa.Float(), nullable=True),
        sa.Column('min_model_version', sa.Integer(), nullable=False),
        sa.Column('max_model_version', sa.Integer(), nullable=False),
        sa.Column('num_route_rows', sa.Integer(), nullable=True),
        sa.Column('segment', sa.String(length=255), nullable=False),
        sa.Column('segment_row', sa.Integer(), nullable=False),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.Column('finish_reason', sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint('projection', 'trajectory_id', 'sample_index'),
    )
    op.create_index('ix_projection_samples_order', 'projection_samples',
                    ['projection', 'finished_position', 'sample_index'], unique=True)
    op.create_table(
        'projection_checkpoints',
        sa.Column('projection', sa.String(length=64), nullable=False),
        sa.Column('shard', sa.String(length=64), nullable=False),
        sa.Column('position', sa.BigInteger(), nullable=False),
        sa.Column('num_steps_before', sa.BigInteger(), nullable=False),
        sa.Column('num_samples_after', sa.BigInteger(), nullable=False),
        sa.Column('prefix_mismatch_count', sa.BigInteger(), nullable=False),
        sa.Column('updated_at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('projection', 'shard'),
    )
    op.create_table(
        'projection_unfoldable',
        sa.Column('projection', sa.String(length=64), nullable=False),
        sa.Column('trajectory_id', sa.String(length=255), nullable=False),
        sa.Column('finished_position', sa.BigInteger(), nullable=False),
        sa.Column('shard', sa.String(length=64), nullable=False),
        sa.Column('error', sa.String(length=64), nullable=False),
        sa.Column('rule', sa.String(length=64), nullable=True),
        sa.Column('message', sa.String(length=1000), nullable=False),
        sa.Column('created_at', sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint('projection', 'trajectory_id'),
    )
    op.execute(f"CREATE VIEW projection_sample_summary AS\n{PROJECTION_SAMPLE_SUMMARY.strip()}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS projection_sample_summary")
    # the projections' sample segments: their files become unreferenced, which
    # `trajstore gc` deletes after its grace (code before 0011 never retires a sample segment)
    op.execute("DELETE FROM segments WHERE kind = 'samples' AND name IN (SELECT segment FROM projection_samples) "
               "AND name NOT IN (SELECT segment FROM samples)")
    op.drop_table('projection_unfoldable')
    op.drop_table('projection_checkpoints')
    op.drop_index('ix_projection_samples_order', table_name='projection_samples')
    op.drop_table('projection_samples')
    op.drop_table('projections')
