"""per-token model versions, generation metadata, sample finish reasons

Revision ID: 0004
Revises: 0002
Create Date: 2026-11-23

SPEC "Versions" and generation ``metadata`` (issue 11):

* ``events.min_model_version``: the first output token's version (the last
  one stays ``model_version``); filled for existing rows;
* ``events.version_spans``: JSON, only for calls whose tokens span several
  versions, so SQL counts tokens per version exactly;
* ``events.metadata``: JSON, a generation's free-form metadata;
* ``samples.finish_reason``: the last merged call's own finish reason.

The views are dropped first and recreated from the live module
(``trajstore.inspect.views``) last; downgrading recreates 0002's frozen views.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import op

from trajstore.inspect import views

revision = '0004'
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    views.drop_views(op.execute)
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.add_column(sa.Column('min_model_version', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('version_spans', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('metadata', sa.JSON(), nullable=True))
    with op.batch_alter_table('samples', schema=None) as batch_op:
        batch_op.add_column(sa.Column('finish_reason', sa.String(length=64), nullable=True))
    # Before this revision every call had one version.
    op.execute("UPDATE events SET min_model_version = model_version WHERE type = 'generation'")
    views.create_views(op.execute, dialect)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    views.drop_views(op.execute)
    with op.batch_alter_table('samples', schema=None) as batch_op:
        batch_op.drop_column('finish_reason')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_column('metadata')
        batch_op.drop_column('version_spans')
        batch_op.drop_column('min_model_version')
    _revision_0002().create_views(dialect)


def _revision_0002():
    """Migration 0002's module, which holds the views as it made them."""
    path = Path(__file__).with_name('0002_inspection_views_reader_role.py')
    spec = importlib.util.spec_from_file_location('trajstore_migration_0002', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
