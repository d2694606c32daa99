"""log index, trajectories, samples

Revision ID: 0001
Revises: 
Create Date: 2026-11-22
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('events',
    sa.Column('position', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('trajectory_id', sa.String(length=255), nullable=False),
    sa.Column('type', sa.String(length=24), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=True),
    sa.Column('event_id', sa.String(length=255), nullable=True),
    sa.Column('identity', sa.String(length=600), nullable=True),
    sa.Column('content_hash', sa.LargeBinary(length=16), nullable=False),
    sa.Column('model_version', sa.Integer(), nullable=True),
    sa.Column('prompt_len', sa.Integer(), nullable=True),
    sa.Column('prefix_len', sa.Integer(), nullable=True),
    sa.Column('output_len', sa.Integer(), nullable=True),
    sa.Column('num_loss_tokens', sa.Integer(), nullable=True),
    sa.Column('routes_start', sa.Integer(), nullable=True),
    sa.Column('num_route_rows_sent', sa.Integer(), nullable=True),
    sa.Column('num_route_rows', sa.Integer(), nullable=True),
    sa.Column('routes_dtype', sa.String(length=8), nullable=True),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('has_token_rewards', sa.Boolean(), nullable=True),
    sa.Column('finish_reason', sa.String(length=64), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=True),
    sa.Column('segment', sa.String(length=255), nullable=True),
    sa.Column('segment_row', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('position'),
    sa.UniqueConstraint('identity')
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index('ix_events_trajectory_seq', ['trajectory_id', 'position'], unique=False)

    op.create_table('log_head',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('position', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    # The single counter row appenders take positions from (trajstore.log._dialect).
    op.bulk_insert(sa.table('log_head', sa.column('id', sa.Integer), sa.column('position', sa.BigInteger)),
                   [{'id': 1, 'position': 0}])
    op.create_table('materializer_checkpoints',
    sa.Column('shard', sa.String(length=64), nullable=False),
    sa.Column('position', sa.BigInteger(), nullable=False),
    sa.Column('num_steps_before', sa.BigInteger(), nullable=False),
    sa.Column('num_samples_after', sa.BigInteger(), nullable=False),
    sa.Column('prefix_mismatch_count', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('shard')
    )
    op.create_table('samples',
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
    sa.PrimaryKeyConstraint('trajectory_id', 'sample_index')
    )
    with op.batch_alter_table('samples', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_samples_group_id'), ['group_id'], unique=False)
        batch_op.create_index('ix_samples_order', ['finished_position', 'sample_index'], unique=True)

    op.create_table('segments',
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('kind', sa.String(length=8), nullable=False),
    sa.Column('num_rows', sa.Integer(), nullable=False),
    sa.Column('num_bytes', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('trajectories',
    sa.Column('trajectory_id', sa.String(length=255), nullable=False),
    sa.Column('group_id', sa.String(length=255), nullable=True),
    sa.Column('num_experts', sa.Integer(), nullable=True),
    sa.Column('metadata', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('last_seq', sa.Integer(), nullable=False),
    sa.Column('reward_mode', sa.String(length=8), nullable=True),
    sa.Column('route_layers', sa.Integer(), nullable=True),
    sa.Column('route_topk', sa.Integer(), nullable=True),
    sa.Column('seq_len', sa.BigInteger(), nullable=False),
    sa.Column('seq_hash', sa.LargeBinary(length=16), nullable=False),
    sa.Column('route_len', sa.BigInteger(), nullable=False),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('started_position', sa.BigInteger(), nullable=False),
    sa.Column('finished_position', sa.BigInteger(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('trajectory_id')
    )
    with op.batch_alter_table('trajectories', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_trajectories_finished_position'), ['finished_position'], unique=False)
        batch_op.create_index(batch_op.f('ix_trajectories_group_id'), ['group_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('trajectories', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_trajectories_group_id'))
        batch_op.drop_index(batch_op.f('ix_trajectories_finished_position'))

    op.drop_table('trajectories')
    op.drop_table('segments')
    with op.batch_alter_table('samples', schema=None) as batch_op:
        batch_op.drop_index('ix_samples_order')
        batch_op.drop_index(batch_op.f('ix_samples_group_id'))

    op.drop_table('samples')
    op.drop_table('materializer_checkpoints')
    op.drop_table('log_head')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index('ix_events_trajectory_seq')

    op.drop_table('events')
