"""fold internal errors: unfoldable_trajectories.kind

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27

A trajectory the materializer could not fold is recorded in
``unfoldable_trajectories`` (and a projection's in ``projection_unfoldable``)
with ``kind``:

* ``'data'``: its data breaks a rule (the fold refused it, its payload is
  missing or unreadable, its index rows contradict each other); every row
  recorded before this revision is one;
* ``'internal_error'``: the fold raised an exception that is no data rule, a
  bug in trajstore; the materializer folds it again on its next run.

The downgrade drops the column (internal-error rows then read as data ones).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ('unfoldable_trajectories', 'projection_unfoldable'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column('kind', sa.String(length=16), nullable=False, server_default='data'))


def downgrade() -> None:
    for table in ('unfoldable_trajectories', 'projection_unfoldable'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column('kind')
