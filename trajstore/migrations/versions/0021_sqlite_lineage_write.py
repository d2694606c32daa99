"""SQLite: no per-sample index on a step's consumption rows

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-27

On SQLite, ``ix_lineage_step_samples_sample`` (trajectory_id, sample_index) is dropped;
PostgreSQL keeps it. A trainer's record inserts one consumption row per sample, and
that index's key is the trajectory id: a step's fresh samples land on as many leaf
pages of it as they are samples, and SQLite's WAL takes every page a transaction
touched whole at COMMIT. So the record grew with the run: 3.9 ms on a fresh store,
23 ms after 200,000 consumption rows, 32-34 ms after 1,000,000 (uuid trajectory ids,
512 samples a step), and 3.0 ms at 1,000,000 without the index (docs/benchmarks.md,
"Training lineage"). PostgreSQL logs one tuple per index entry instead (7.3 ms fresh,
9.6 ms at 1,000,000) and keeps the index.

What SQLite gives up: a query for one sample's or one trajectory's consumption
(``sample_consumption WHERE trajectory_id = ...``) scans the consumption rows instead
of looking them up (docs/sql.md says so). Every query trajstore itself runs on them is
keyed by the step, or reads them all.

The downgrade creates the index again on SQLite.
"""
from __future__ import annotations

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

INDEX, TABLE, COLUMNS = "ix_lineage_step_samples_sample", "lineage_step_samples", ["trajectory_id", "sample_index"]


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.drop_index(INDEX, table_name=TABLE)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.create_index(INDEX, TABLE, COLUMNS)
