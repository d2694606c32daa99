"""weight-version labels, placeholder logprobs, route drift

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-25

SPEC "Versions" (the engine's ``weight_versions`` spans and the store's
label map):

* ``events.weight_versions``: JSON, a generation's spans exactly as sent;
* ``version_labels``: the label map (label -> model version), filled by
  ``version_label`` events;
* ``unresolved_labels``: the labels of a generation the map did not hold
  when it was appended (its trajectory is held back until they are mapped).

SPEC "Ordering and validation", the -9999.0 rule:

* ``events.num_placeholder_logprobs``: logprobs at or below -9999.0 a call
  sent (stored as missing); NULL for calls without logprobs and for rows
  appended before this revision (counting them would read every payload).

Route drift (SPEC "Routed experts", R3 health):

* ``events.route_rows_resent``: rows a call sent for positions its sample
  had already recorded. Backfilled for existing rows: admission stored only
  the rows past the watermark, so it is ``num_route_rows_sent -
  num_route_rows`` (NULL without routes).
* ``events.route_rows_drifted``: of those, rows that differ from the
  recorded ones; NULL for existing rows (the dropped rows were never stored,
  so there is nothing to compare).

The views are dropped first and recreated last from the live module;
downgrading recreates 0006's frozen views.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import op

from trajstore.inspect import views

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    views.drop_views(op.execute)
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
    views.create_views(op.execute, dialect)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    views.drop_views(op.execute)
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
