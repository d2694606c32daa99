"""store_settings: the payload location recorded in the store; PostgreSQL positions from a sequence

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-25

Every process used to be told where the payload lives (``--payload``,
``payload=``, a default relative to its working directory), and two processes
told different things split one store across two places. The store now records
the location (``store_settings``, row ``payload_location``) and every process
reads it there.

A store created before this migration has no row. The first process that
opens it afterwards records the location it was given (or its default) once it
has checked that the newest segment the index names is there; if it is not,
that process refuses and ``trajstore payload set LOCATION`` records the right
one (docs/deploy.md, "Where the payload lives").

On PostgreSQL, log positions come from the sequence ``log_positions`` instead
of the ``log_head`` row, whose lock serialized every append
(``trajstore.log._dialect``, docs/log.md "Positions"). The sequence starts after
the head. Stop every writer of an older version before upgrading: it would
still take positions from ``log_head``. ``log_head`` stays (SQLite uses it;
the downgrade moves it past every stored position).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "store_settings",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(2000), nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE SEQUENCE log_positions AS bigint MINVALUE 1")
        op.execute("SELECT setval('log_positions', GREATEST(position, 1), position > 0) FROM log_head WHERE id = 1")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("UPDATE log_head SET position = GREATEST(position, "
                   "(SELECT COALESCE(MAX(position), 0) FROM events)) WHERE id = 1")
        op.execute("DROP SEQUENCE log_positions")
    op.drop_table("store_settings")
