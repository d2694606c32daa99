"""lineage_steps.projection_token; run_owners

Revision ID: 0024
Revises: 0023
Create Date: 2026-11-29

* ``lineage_steps.projection_token``: the identity (``projections.token``) of the
  projection a step's samples were read from, written with the step (NULL: the
  default samples, or a step recorded before this revision). A projection dropped
  and created again under the same name has another token, so a step's export
  can tell its samples from the new projection's.
* ``run_owners``: which replay read token records each run's lineage (the first
  one to record it owns the run; ``owner`` is a digest of the token, never the
  token). A read token cannot record a run another one owns.

The downgrade drops both.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("lineage_steps", sa.Column("projection_token", sa.String(32), nullable=True))
    op.create_table(
        "run_owners",
        sa.Column("run", sa.String(255), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("run_owners")
    # a plain ALTER on both backends (SQLite >= 3.35): a batch copy of the table would
    # break the views that read it
    op.execute("ALTER TABLE lineage_steps DROP COLUMN projection_token")
