"""index events (type, position): the materializer's poll

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23

The materializer polls ``type = 'trajectory_finished' AND position >
checkpoint ORDER BY position``. With only the primary key it visited every
event after the checkpoint (100k unfinished events: a 20-60 ms scan per idle
poll); with this index it is one index range seek, whatever the log holds.
"""
from __future__ import annotations

from alembic import op


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_events_type_position', 'events', ['type', 'position'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_events_type_position', table_name='events')
