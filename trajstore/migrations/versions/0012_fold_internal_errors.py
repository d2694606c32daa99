"""fold internal errors: unfoldable_trajectories.kind

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27

A trajectory the materializer could not fold is recorded in
``unfoldable_trajectories`` (and a projection's in ``projection_unfoldable``)
with ``kind``:

* ``'data'``: its data breaks a rule (the fold refused it, its payload is
  missing or unreadable, its index rows contradict each other, a stored
  value does not fit the sample's columns);
* ``'internal_error'``: the fold raised an exception that is no data rule, a
  bug in trajstore; the materializer folds it again on its next run.

Rows recorded before this revision are classified by their exception class:
the data rules' classes are ``'data'``, every other one (a ``TypeError`` a
bug raised, say) ``'internal_error'``, so the trajectories a bug kept from
folding fold once the fixed code runs.

The downgrade drops the column (internal-error rows then read as data ones).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


# frozen here: the exception classes trajstore.materializer records as data
DATA_ERROR_CLASSES = ('ValidationError', 'ConflictError', 'CorruptStoreError', 'PayloadMissingError', 'OverflowError')


def upgrade() -> None:
    classes = ", ".join(f"'{c}'" for c in DATA_ERROR_CLASSES)
    for table in ('unfoldable_trajectories', 'projection_unfoldable'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column('kind', sa.String(length=16), nullable=False, server_default='data'))
        op.execute(f"UPDATE {table} SET kind = 'internal_error' WHERE error NOT IN ({classes})")


def downgrade() -> None:
    for table in ('unfoldable_trajectories', 'projection_unfoldable'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column('kind')
