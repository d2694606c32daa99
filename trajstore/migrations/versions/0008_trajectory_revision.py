"""trajectories.version -> trajectories.revision: one name per meaning

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23

The trajectory row's optimistic-concurrency counter (bumped by every event;
an append's guarded UPDATE matches it) was called ``version``, beside
``model_version`` (a policy version) everywhere else. It is renamed, nothing
else changes. No inspection view reads the column. ``ALTER TABLE ... RENAME
COLUMN`` is native on PostgreSQL and on SQLite >= 3.25.
"""
from __future__ import annotations

from alembic import op

revision = '0008'
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE trajectories RENAME COLUMN version TO revision")


def downgrade() -> None:
    op.execute("ALTER TABLE trajectories RENAME COLUMN revision TO version")
