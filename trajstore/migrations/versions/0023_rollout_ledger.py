"""The rollout ledger's group table

Revision ID: 0023
Revises: 0022
Create Date: 2026-11-29

``ledger_groups``: one row per group that ``trajectory_started`` events carrying
``run``, ``prompt_id``, ``epoch`` and ``group_size`` opened (docs/reference.md
"Rollout ledger"), with its started, finished (completed/truncated) and failed
counts and its ``group_dropped``, kept in the transaction of the append that
changes them. ``(run, prompt_id, epoch)`` is unique (a prompt is answered by one
group per epoch); ``(run, started_position)`` lists a run's groups oldest first,
so a driver's resume plan reads its run's rows, never the log.

Existing stores have no ledger group (the fields are new), so the table starts empty.

The view ``rollout_groups`` (docs/sql.md) reads it for the read-only role: one row per
group with its counts, ``whole`` and ``dropped``, and ``last_event_at`` (the latest
change of its trajectories, or its drop).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None


# frozen here: later changes to the live view never rewrite this revision
ROLLOUT_GROUPS = """
SELECT
    g.run, g.group_id, g.prompt_id, g.epoch, g.group_size,
    g.num_started, g.num_finished, g.num_failed,
    g.num_started - g.num_finished - g.num_failed AS num_running,
    (g.dropped_position IS NULL AND g.num_finished >= g.group_size) AS whole,
    (g.dropped_position IS NOT NULL) AS dropped,
    g.dropped_reason, g.started_position, g.started_at,
    CASE WHEN g.dropped_at IS NOT NULL AND (m.last_at IS NULL OR g.dropped_at > m.last_at)
         THEN g.dropped_at ELSE m.last_at END AS last_event_at
FROM ledger_groups g
LEFT JOIN (SELECT t.group_id, MAX(t.updated_at) AS last_at FROM trajectories t
           JOIN ledger_groups l ON l.group_id = t.group_id GROUP BY t.group_id) m ON m.group_id = g.group_id
"""

READER_ROLE = 'trajstore_reader'  # 0002's role; its default privileges cover these too, unless another user migrates


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
    op.execute(f"CREATE VIEW rollout_groups AS\n{ROLLOUT_GROUPS.strip()}")
    if op.get_bind().dialect.name == 'postgresql':
        op.execute(f"""DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READER_ROLE}') THEN
        BEGIN
            EXECUTE 'GRANT SELECT ON rollout_groups, ledger_groups TO {READER_ROLE}';
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE USING MESSAGE = 'trajstore: ' || SQLERRM || '; see docs/sql.md (read-only access)';
        END;
    END IF;
END
$$""")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS rollout_groups")
    op.drop_index("ix_ledger_groups_run_started", table_name="ledger_groups")
    op.drop_index("ux_ledger_groups_prompt", table_name="ledger_groups")
    op.drop_table("ledger_groups")
