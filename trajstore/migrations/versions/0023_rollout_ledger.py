"""The rollout ledger's group table

Revision ID: 0023
Revises: 0021
Create Date: 2026-11-29

``ledger_groups``: one row per group that ``trajectory_started`` events carrying
``run``, ``prompt_id``, ``epoch`` and ``group_size`` opened (docs/reference.md
"Rollout ledger"), with its started, finished (completed/truncated) and failed
counts and its ``group_dropped``, kept in the transaction of the append that
changes them. ``(run, prompt_id, epoch)`` is unique (a prompt is answered by one
group per epoch); ``(run, started_position)`` lists a run's groups oldest first,
so a driver's resume plan reads its run's rows, never the log.

Existing stores have no ledger group (the fields are new), so the table starts empty.
The read-only role's ``rollout_groups`` view over it is made where the other views are
(``trajstore.inspect.views``).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0021"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ledger_groups",
        sa.Column("group_id", sa.String(255), primary_key=True),
        sa.Column("run", sa.String(255), nullable=False),
        sa.Column("prompt_id", sa.String(255), nullable=False),
        sa.Column("epoch", sa.Integer, nullable=False),
        sa.Column("group_size", sa.Integer, nullable=False),
        sa.Column("num_started", sa.Integer, nullable=False),
        sa.Column("num_finished", sa.Integer, nullable=False),
        sa.Column("num_failed", sa.Integer, nullable=False),
        sa.Column("started_position", sa.BigInteger, nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("dropped_position", sa.BigInteger, nullable=True),
        sa.Column("dropped_reason", sa.String(255), nullable=True),
        sa.Column("dropped_at", sa.Float, nullable=True),
    )
    op.create_index("ux_ledger_groups_prompt", "ledger_groups", ["run", "prompt_id", "epoch"], unique=True)
    op.create_index("ix_ledger_groups_run_started", "ledger_groups", ["run", "started_position"])


def downgrade() -> None:
    op.drop_index("ix_ledger_groups_run_started", table_name="ledger_groups")
    op.drop_index("ux_ledger_groups_prompt", table_name="ledger_groups")
    op.drop_table("ledger_groups")
