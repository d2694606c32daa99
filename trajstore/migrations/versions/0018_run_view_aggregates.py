"""run view aggregates: engine calls and trajectories over time, running trajectories by status

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-27

* ``agg_calls`` (width_s, bucket_start, model_version, finish_reason) ->
  calls, output_tokens, observed_tokens, prefix_mismatches, calls_with_routes,
  max_output_len: generation events by time of append in buckets of 1, 60 and
  3600 seconds, model version (-1: none) and finish reason ('': none), with
  the route drift of the calls that re-sent rows (per version), counted
  in the append's transaction (docs/report.md, "Aggregates"). The run view's
  over-time call panels and the run's totals read it instead of the
  ``generation_events`` and ``trajectory_summary`` views. Backfilled here from
  ``events`` (plain SQL); ``trajstore report --rebuild-aggregates`` recounts it.
* ``agg_trajectories`` (width_s, bucket_start, status) -> started, finished:
  ``trajectory_started`` events (under status ``running``) and
  ``trajectory_finished`` events (under their status) by time of append, same
  buckets: the running and problem panels' counts over time (a trajectory's
  first event is its start, its last its finish).
* ``writer`` (both tables): the PostgreSQL backend that added the row (0 on
  SQLite and in the backfill): concurrent appends of one bucket never wait on
  each other's row lock; readers sum over it.
* ``ix_trajectories_status``: the running trajectories (the stuck panel) are
  read through an index instead of the whole table.

The read-only role reads the table through the default privileges 0002 set.
The downgrade drops both.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

WIDTHS_S = (1, 60, 3600)


def _bucket(dialect: str, width: int) -> str:
    # unix seconds -> the start of its bucket (created_at is positive: SQLite's CAST truncates = floor)
    if dialect == "postgresql":
        return f"CAST(floor(created_at / {width}) AS BIGINT) * {width}"
    return f"CAST(created_at / {width} AS INTEGER) * {width}"


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.create_table(
        "agg_calls",
        sa.Column("width_s", sa.Integer(), primary_key=True),
        sa.Column("bucket_start", sa.BigInteger(), primary_key=True),
        sa.Column("model_version", sa.Integer(), primary_key=True),
        sa.Column("finish_reason", sa.String(64), primary_key=True),
        sa.Column("writer", sa.Integer(), primary_key=True),
        sa.Column("calls", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("observed_tokens", sa.BigInteger(), nullable=False),
        sa.Column("prefix_mismatches", sa.BigInteger(), nullable=False),
        sa.Column("calls_with_routes", sa.BigInteger(), nullable=False),
        sa.Column("max_output_len", sa.Integer(), nullable=False),
        sa.Column("route_rows_resent", sa.BigInteger(), nullable=False),
        sa.Column("route_rows_compared", sa.BigInteger(), nullable=False),
        sa.Column("route_rows_drifted", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "agg_trajectories",
        sa.Column("width_s", sa.Integer(), primary_key=True),
        sa.Column("bucket_start", sa.BigInteger(), primary_key=True),
        sa.Column("status", sa.String(16), primary_key=True),
        sa.Column("writer", sa.Integer(), primary_key=True),
        sa.Column("started", sa.BigInteger(), nullable=False),
        sa.Column("finished", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_trajectories_status", "trajectories", ["status"])
    for width in WIDTHS_S:
        b = _bucket(dialect, width)
        op.execute(
            "INSERT INTO agg_calls (width_s, bucket_start, model_version, finish_reason, writer, calls, output_tokens, "
            "observed_tokens, prefix_mismatches, calls_with_routes, max_output_len, route_rows_resent, "
            "route_rows_compared, route_rows_drifted) "
            f"SELECT {width}, {b}, COALESCE(model_version, -1), COALESCE(finish_reason, ''), 0, count(*), "
            "COALESCE(sum(output_len), 0), COALESCE(sum(prompt_len - prefix_len), 0), "
            "count(*) FILTER (WHERE seq > 0 AND NOT is_merged), "
            "count(*) FILTER (WHERE COALESCE(num_route_rows_sent, 0) > 0), COALESCE(max(output_len), 0), "
            "COALESCE(sum(route_rows_resent), 0), "
            "COALESCE(sum(CASE WHEN route_rows_drifted IS NOT NULL THEN route_rows_resent END), 0), "
            "COALESCE(sum(route_rows_drifted), 0) "
            f"FROM events WHERE type = 'generation' "
            f"GROUP BY {b}, COALESCE(model_version, -1), COALESCE(finish_reason, '')")
        op.execute(
            "INSERT INTO agg_trajectories (width_s, bucket_start, status, writer, started, finished) "
            f"SELECT {width}, {b}, CASE WHEN type = 'trajectory_started' THEN 'running' ELSE status END, 0, "
            "count(*) FILTER (WHERE type = 'trajectory_started'), count(*) FILTER (WHERE type = 'trajectory_finished') "
            "FROM events WHERE type IN ('trajectory_started', 'trajectory_finished') "
            f"GROUP BY {b}, CASE WHEN type = 'trajectory_started' THEN 'running' ELSE status END")


def downgrade() -> None:
    op.drop_table("agg_trajectories")
    op.drop_index("ix_trajectories_status", table_name="trajectories")
    op.drop_table("agg_calls")
