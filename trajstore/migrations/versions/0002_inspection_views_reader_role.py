"""inspection views; read-only role on PostgreSQL

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

The view SQL lives in ``trajstore.inspect.views`` (written once for both backends,
documented in docs/sql.md). On PostgreSQL this also makes the
``trajstore_reader`` role that ``trajstore sql`` switches to.
"""
from __future__ import annotations

from alembic import op

from trajstore.inspect import views

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    views.create_views(op.execute, dialect)
    if dialect == "postgresql":
        # After the views: GRANT ... ON ALL TABLES covers views that exist now.
        for statement in views.reader_role_sql():
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for statement in views.drop_reader_grants_sql():
            op.execute(statement)
    views.drop_views(op.execute)
