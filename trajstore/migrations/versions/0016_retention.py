"""trajectories.archived_at: trajectories whose events the retention command archived

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-27

``trajstore archive`` (docs/deploy.md, "Index growth") writes the events of
folded trajectories to a Parquet archive, then deletes their ``events`` rows.
The ``trajectories`` row stays (counts, status, reward and the samples keep
answering in SQL) and records when its events left the index: ``archived_at``
(unix seconds), NULL while they are in ``events``. The partial index
``ix_trajectories_unarchived`` finds the finished trajectories still to
archive without walking the archived ones (there are ever more of them).
"""
from __future__ import annotations

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE trajectories ADD COLUMN archived_at FLOAT")
    op.execute("CREATE INDEX ix_trajectories_unarchived ON trajectories (finished_position) "
               "WHERE archived_at IS NULL")


def downgrade() -> None:
    bind = op.get_bind()
    n = bind.exec_driver_sql("SELECT count(*) FROM trajectories WHERE archived_at IS NOT NULL").scalar_one()
    if n:
        raise RuntimeError(f"cannot downgrade below 0016: {n} trajectories have their events archived "
                           "(their events are no longer in the index)")
    op.execute("DROP INDEX ix_trajectories_unarchived")
    op.execute("ALTER TABLE trajectories DROP COLUMN archived_at")
