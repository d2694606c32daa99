"""the fold step's outcome on events; the sample count on trajectories

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23

Admission applies the fold's step (``trajstore.fold.fold_step``) to each
generation and now stores its outcome (issue 13):

* ``events.sample_index``: the sample the call folds into;
* ``events.is_merged``: the prompt continued the previous call's sequence;
* ``trajectories.num_samples``: samples started so far (part of the fold's
  tail, ``FoldTail``).

Existing rows are backfilled with the SQL the views used to derive these
from ``prefix_len`` (frozen below: a call merged iff ``seq > 0`` and its
``prefix_len`` equals the previous call's ``prompt_len + output_len``; the
sample index is the running count of calls that start a sample). The views
are dropped first and recreated from the live module last (its
``generation_events`` reads the stored columns); downgrading recreates
0004's frozen views.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import op

from trajstore.inspect import views

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

# The derivation generation_events used up to this revision, as an UPDATE.
BACKFILL_EVENTS = """
UPDATE events SET sample_index = d.sample_index, is_merged = d.is_merged
FROM (
    SELECT
        c.position, c.is_merged,
        CAST(SUM(CASE WHEN c.is_merged THEN 0 ELSE 1 END) OVER (
            PARTITION BY c.trajectory_id ORDER BY c.seq ROWS UNBOUNDED PRECEDING) AS BIGINT) - 1 AS sample_index
    FROM (
        SELECT
            e.position, e.trajectory_id, e.seq,
            e.seq > 0 AND e.prefix_len = LAG(e.prompt_len + e.output_len) OVER (
                PARTITION BY e.trajectory_id ORDER BY e.seq) AS is_merged
        FROM events e
        WHERE e.type = 'generation'
    ) c
) d
WHERE events.position = d.position
"""

BACKFILL_TRAJECTORIES = """
UPDATE trajectories SET num_samples = COALESCE((
    SELECT MAX(e.sample_index) + 1 FROM events e
    WHERE e.trajectory_id = trajectories.trajectory_id AND e.type = 'generation'
), 0)
"""


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    views.drop_views(op.execute)
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('sample_index', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('is_merged', sa.Boolean(), nullable=True))
    with op.batch_alter_table('trajectories', schema=None) as batch_op:
        batch_op.add_column(sa.Column('num_samples', sa.Integer(), nullable=False, server_default='0'))
    op.execute(BACKFILL_EVENTS)
    op.execute(BACKFILL_TRAJECTORIES)
    views.create_views(op.execute, dialect)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    views.drop_views(op.execute)
    with op.batch_alter_table('trajectories', schema=None) as batch_op:
        batch_op.drop_column('num_samples')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_column('is_merged')
        batch_op.drop_column('sample_index')
    _revision_0004().create_views(op.execute, dialect)


def _revision_0004():
    """Migration 0004's module, which holds the views as it made them."""
    path = Path(__file__).with_name('0004_versions_metadata_finish_reason.py')
    spec = importlib.util.spec_from_file_location('trajstore_migration_0004', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
