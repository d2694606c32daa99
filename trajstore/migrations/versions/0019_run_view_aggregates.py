"""run view aggregates: engine calls and trajectories over time, running trajectories by status

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-27

* ``agg_calls`` (width_s, bucket_start, model_version, finish_reason) ->
  calls, output_tokens, observed_tokens, prefix_mismatches, calls_with_routes,
  max_output_len, route_rows_resent, route_rows_compared, route_rows_drifted:
  generation events by time of append in buckets of 1, 60 and 3600 seconds,
  model version (-1: none) and finish reason ('': none), with the route drift
  of the calls that re-sent rows (per version), counted in the append's
  transaction (docs/report.md, "Aggregates"). The run view's over-time call
  panels and the run's totals read it instead of the ``generation_events`` and
  ``trajectory_summary`` views.
* ``agg_trajectories`` (width_s, bucket_start, status) -> started, finished:
  ``trajectory_started`` events (under status ``running``) and
  ``trajectory_finished`` events (under their status) by time of append, same
  buckets: the running and problem panels' counts over time (a trajectory's
  first event is its start, its last its finish).

Both hold delta rows as ``agg_output_lengths`` and ``agg_route_drift`` do since
0018 (docs/log.md, "Run aggregates"): a surrogate ``id``; ``delta`` true for an
append's own rows, false for the one total row of a key (``ux_<table>_total``:
unique on the key where NOT delta); ``ix_<table>_delta``: the deltas, for the
materializer's fold. A key's count is the sum of its rows (``max_output_len``:
their max). Backfilled here from ``events`` (plain SQL) as total rows;
``trajstore report --rebuild-aggregates`` recounts them.

* ``ix_trajectories_status``: the running trajectories (the stuck panel) are
  read through an index instead of the whole table.

The read-only role reads the tables through the default privileges 0002 set.
The downgrade drops them.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

WIDTHS_S = (1, 60, 3600)
KEYS = {"agg_calls": ("width_s", "bucket_start", "model_version", "finish_reason"),
        "agg_trajectories": ("width_s", "bucket_start", "status")}


def _bucket(dialect: str, width: int) -> str:
    # unix seconds -> the start of its bucket (created_at is positive: SQLite's CAST truncates = floor)
    if dialect == "postgresql":
        return f"CAST(floor(created_at / {width}) AS BIGINT) * {width}"
    return f"CAST(created_at / {width} AS INTEGER) * {width}"


def _id() -> sa.Column:
    # a surrogate key numbering itself (BIGSERIAL on PostgreSQL, the rowid on SQLite)
    return sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True)


def _indexes(name: str) -> None:
    op.create_index(f"ux_{name}_total", name, list(KEYS[name]), unique=True,
                    sqlite_where=sa.text("NOT delta"), postgresql_where=sa.text("NOT delta"))
    op.create_index(f"ix_{name}_delta", name, ["id"], sqlite_where=sa.text("delta"),
                    postgresql_where=sa.text("delta"))


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.create_table(
        "agg_calls",
        _id(),
        sa.Column("width_s", sa.Integer(), nullable=False),
        sa.Column("bucket_start", sa.BigInteger(), nullable=False),
        sa.Column("model_version", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(64), nullable=False),
        sa.Column("calls", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("observed_tokens", sa.BigInteger(), nullable=False),
        sa.Column("prefix_mismatches", sa.BigInteger(), nullable=False),
        sa.Column("calls_with_routes", sa.BigInteger(), nullable=False),
        sa.Column("max_output_len", sa.Integer(), nullable=False),
        sa.Column("route_rows_resent", sa.BigInteger(), nullable=False),
        sa.Column("route_rows_compared", sa.BigInteger(), nullable=False),
        sa.Column("route_rows_drifted", sa.BigInteger(), nullable=False),
        sa.Column("delta", sa.Boolean(), nullable=False),
    )
    op.create_table(
        "agg_trajectories",
        _id(),
        sa.Column("width_s", sa.Integer(), nullable=False),
        sa.Column("bucket_start", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("started", sa.BigInteger(), nullable=False),
        sa.Column("finished", sa.BigInteger(), nullable=False),
        sa.Column("delta", sa.Boolean(), nullable=False),
    )
    for name in KEYS:
        _indexes(name)
    op.create_index("ix_trajectories_status", "trajectories", ["status"])
    for width in WIDTHS_S:  # the log's counts, as total rows (one per key)
        b = _bucket(dialect, width)
        op.execute(
            "INSERT INTO agg_calls (width_s, bucket_start, model_version, finish_reason, calls, output_tokens, "
            "observed_tokens, prefix_mismatches, calls_with_routes, max_output_len, route_rows_resent, "
            "route_rows_compared, route_rows_drifted, delta) "
            f"SELECT {width}, {b}, COALESCE(model_version, -1), COALESCE(finish_reason, ''), count(*), "
            "COALESCE(sum(output_len), 0), COALESCE(sum(prompt_len - prefix_len), 0), "
            "count(*) FILTER (WHERE seq > 0 AND NOT is_merged), "
            "count(*) FILTER (WHERE COALESCE(num_route_rows_sent, 0) > 0), COALESCE(max(output_len), 0), "
            "COALESCE(sum(route_rows_resent), 0), "
            "COALESCE(sum(CASE WHEN route_rows_drifted IS NOT NULL THEN route_rows_resent END), 0), "
            "COALESCE(sum(route_rows_drifted), 0), FALSE "
            f"FROM events WHERE type = 'generation' "
            f"GROUP BY {b}, COALESCE(model_version, -1), COALESCE(finish_reason, '')")
        op.execute(
            "INSERT INTO agg_trajectories (width_s, bucket_start, status, started, finished, delta) "
            f"SELECT {width}, {b}, CASE WHEN type = 'trajectory_started' THEN 'running' ELSE status END, "
            "count(*) FILTER (WHERE type = 'trajectory_started'), count(*) FILTER (WHERE type = 'trajectory_finished'), "
            "FALSE FROM events WHERE type IN ('trajectory_started', 'trajectory_finished') "
            f"GROUP BY {b}, CASE WHEN type = 'trajectory_started' THEN 'running' ELSE status END")


def downgrade() -> None:
    op.drop_table("agg_trajectories")  # its indexes go with it
    op.drop_index("ix_trajectories_status", table_name="trajectories")
    op.drop_table("agg_calls")
