"""reader leases: what the payload GC may not delete yet

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27

* ``reader_leases``: one row per live reader (a ``SampleReader``, a replay
  server, ...): ``held_since`` is the database time before the oldest index
  read whose locators the reader may still open, ``expires_at`` when the lease
  lapses unless renewed (a dead reader blocks nothing after that). The GC
  deletes a retired segment only once it was retired before every live
  lease's ``held_since`` (docs/log.md, "One copy").
* ``ix_segments_retired``: the GC's steady path reads the retired segments
  from the index (no listing of the payload): a partial index on
  ``segments.retired_at`` holds only them.
* PostgreSQL: the read-only role ``trajstore_reader`` (migration 0002) may
  write its own leases (INSERT, UPDATE, DELETE on ``reader_leases`` only).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

READER_ROLE = "trajstore_reader"


def upgrade() -> None:
    op.create_table(
        "reader_leases",
        sa.Column("name", sa.String(length=64), primary_key=True),
        sa.Column("holder", sa.String(length=255), nullable=False),
        sa.Column("held_since", sa.Float(), nullable=False),
        sa.Column("renewed_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
    )
    op.execute("CREATE INDEX ix_segments_retired ON segments (retired_at) WHERE retired_at IS NOT NULL")
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"""DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READER_ROLE}') THEN
        EXECUTE 'GRANT SELECT, INSERT, UPDATE, DELETE ON ' || quote_ident(current_schema())
                || '.reader_leases TO {READER_ROLE}';
    END IF;
END $$""")


def downgrade() -> None:
    op.execute("DROP INDEX ix_segments_retired")
    op.drop_table("reader_leases")
