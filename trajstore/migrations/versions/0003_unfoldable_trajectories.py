"""unfoldable_trajectories: what the materializer could not fold, and why

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

The materializer records each finished trajectory it cannot fold here, in the
transaction that moves its checkpoint past it, and goes on with the others
(docs/materializer.md, "Unfoldable trajectories"). On PostgreSQL the
``trajstore_reader`` role reads it through 0002's default privileges.
"""
from __future__ import annotations

from alembic import op
import sqlalchemy as sa

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('unfoldable_trajectories',
    sa.Column('trajectory_id', sa.String(length=255), nullable=False),
    sa.Column('finished_position', sa.BigInteger(), nullable=False),
    sa.Column('shard', sa.String(length=64), nullable=False),
    sa.Column('error', sa.String(length=64), nullable=False),
    sa.Column('rule', sa.String(length=64), nullable=True),
    sa.Column('message', sa.String(length=1000), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('trajectory_id')
    )
    with op.batch_alter_table('unfoldable_trajectories', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_unfoldable_trajectories_finished_position'), ['finished_position'],
                              unique=False)


def downgrade() -> None:
    with op.batch_alter_table('unfoldable_trajectories', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_unfoldable_trajectories_finished_position'))
    op.drop_table('unfoldable_trajectories')
