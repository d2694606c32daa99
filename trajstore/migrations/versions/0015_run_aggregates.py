"""run aggregates: what the run view reads instead of scanning the store

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-27

Four small tables, counted where the data is already decoded and in the
transaction that stores it (docs/report.md, "Aggregates"):

* ``agg_expert_load`` (model_version, layer, expert) -> routed: decode routes
  of the default samples' generated tokens (the materializer's commit);
* ``agg_logprobs`` (model_version, bin) -> tokens, logprob_sum: rollout
  logprobs of those samples' generated loss tokens in fixed bins (same);
* ``agg_output_lengths`` (model_version, output_len) -> calls: engine calls
  (the append's transaction);
* ``agg_route_drift`` (width_s, bucket_start) -> rows_resent, rows_compared,
  rows_drifted: calls that re-sent route rows, by time of append in buckets
  of 1, 60 and 3600 seconds (same).

Backfill: the two tables of the log's columns are counted here from
``events`` (plain SQL). The two of the samples' token columns need the
payload, which a migration does not read: when the store already has samples,
the ``store_settings`` row ``aggregates_pending`` = ``samples`` says so, and
``trajstore report --rebuild-aggregates`` counts them and removes it (the page
says so until then). The read-only role reads the tables through the default
privileges 0002 set. The downgrade drops them and the row.
"""
from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

DRIFT_WIDTHS_S = (1, 60, 3600)


def _bucket(dialect: str, width: int) -> str:
    # unix seconds -> the start of its bucket (created_at is positive: SQLite's CAST truncates = floor)
    if dialect == "postgresql":
        return f"CAST(floor(created_at / {width}) AS BIGINT) * {width}"
    return f"CAST(created_at / {width} AS INTEGER) * {width}"


def upgrade() -> None:
    bind = op.get_bind()
    dialect = bind.dialect.name
    op.create_table(
        "agg_expert_load",
        sa.Column("model_version", sa.Integer(), primary_key=True),
        sa.Column("layer", sa.Integer(), primary_key=True),
        sa.Column("expert", sa.Integer(), primary_key=True),
        sa.Column("routed", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "agg_logprobs",
        sa.Column("model_version", sa.Integer(), primary_key=True),
        sa.Column("bin", sa.Integer(), primary_key=True),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("logprob_sum", sa.Float(), nullable=False),
    )
    op.create_table(
        "agg_output_lengths",
        sa.Column("model_version", sa.Integer(), primary_key=True),
        sa.Column("output_len", sa.Integer(), primary_key=True),
        sa.Column("calls", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "agg_route_drift",
        sa.Column("width_s", sa.Integer(), primary_key=True),
        sa.Column("bucket_start", sa.BigInteger(), primary_key=True),
        sa.Column("rows_resent", sa.BigInteger(), nullable=False),
        sa.Column("rows_compared", sa.BigInteger(), nullable=False),
        sa.Column("rows_drifted", sa.BigInteger(), nullable=False),
    )
    op.execute("INSERT INTO agg_output_lengths (model_version, output_len, calls) "
               "SELECT model_version, output_len, count(*) FROM events "
               "WHERE type = 'generation' AND model_version IS NOT NULL AND output_len IS NOT NULL "
               "GROUP BY model_version, output_len")
    for width in DRIFT_WIDTHS_S:
        b = _bucket(dialect, width)
        op.execute("INSERT INTO agg_route_drift (width_s, bucket_start, rows_resent, rows_compared, rows_drifted) "
                   f"SELECT {width}, {b}, sum(route_rows_resent), "
                   "coalesce(sum(CASE WHEN route_rows_drifted IS NOT NULL THEN route_rows_resent END), 0), "
                   "coalesce(sum(route_rows_drifted), 0) FROM events "
                   f"WHERE type = 'generation' AND route_rows_resent > 0 GROUP BY {b}")
    op.execute("INSERT INTO store_settings (name, value, updated_at) "
               f"SELECT 'aggregates_pending', 'samples', {time.time()!r} "
               "WHERE EXISTS (SELECT 1 FROM samples)")


def downgrade() -> None:
    op.execute("DELETE FROM store_settings WHERE name = 'aggregates_pending'")
    for table in ("agg_route_drift", "agg_output_lengths", "agg_logprobs", "agg_expert_load"):
        op.drop_table(table)
