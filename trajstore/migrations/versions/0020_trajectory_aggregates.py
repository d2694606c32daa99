"""run view aggregates of finished trajectories and their samples

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-27

What the materializer's commit counts of each finished trajectory it takes (from its
index rows) and of the default samples it stores, so the run view's per-trajectory,
per-sample and per-version panels read small tables instead of the ``trajectory_summary``,
``sample_summary`` and ``model_version_stats`` views (docs/report.md, "Aggregates"):

* ``agg_trajectory_stats``: one row per counted finished trajectory (its figures as
  ``trajectory_summary`` gives them; ``finished_at``: its newest event's time), with two
  ordered indexes for the "trajectories to look at" panel (highest route drift share, most
  generated tokens: ``ORDER BY ... LIMIT`` through the index);
* ``agg_rewards`` (width_s, bucket_start): rewards of finished trajectories by finish time,
  in buckets of 1, 60 and 3600 s (sum, count, min, max);
* ``agg_trajectory_shapes`` (num_generations, num_samples, num_prefix_mismatches):
  finished trajectories, and their placeholder logprobs;
* ``agg_tasks`` (task): finished trajectories per task of their metadata;
* ``agg_versions`` (model_version, -1: none): finished trajectories per model version they
  generated at, tokens (a call's version spans split), rewards, failed, aborted, multi-version;
* ``agg_groups`` (group_id): finished trajectories' rewards per group and the group's part
  of ``agg_group_variance`` as last counted; ``agg_group_variance`` (width_s, bucket_start):
  finished groups (none running, two or more rewarded), those whose rewards are all equal,
  and their within-group variances, by the finish time of their last trajectory;
* ``agg_samples`` (kind, value): default samples by staleness, versions mixed, calls folded,
  tokens without a route (-1: NULL);
* ``agg_staleness`` (width_s, bucket_start): samples' staleness by their trajectory's finish time;
* ``agg_policy_versions`` (model_version): each version's first generation event (the newest
  version at a position, for a sample's staleness).

One row per key, added to by upsert (no delta rows: the materializer's commits are few).
Backfilled here from the store as it is (the views of 0009, ``samples``, ``events``: plain
SQL); ``trajstore report --rebuild-aggregates`` recounts them. The read-only role reads the
tables through the default privileges 0002 set. The downgrade drops them.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

WIDTHS_S = (1, 60, 3600)
TASK_KEYS = ("task", "env", "environment", "env_class", "data_source", "dataset", "task_name")
BUCKETED = {
    "agg_rewards": (("rewarded", sa.BigInteger(), False), ("reward_sum", sa.Float(), False),
                    ("reward_min", sa.Float(), False), ("reward_max", sa.Float(), False)),
    "agg_group_variance": (("groups", sa.BigInteger(), False), ("zero_variance_groups", sa.BigInteger(), False),
                           ("variance_sum", sa.Float(), False)),
    "agg_staleness": (("samples", sa.BigInteger(), False), ("staled", sa.BigInteger(), False),
                      ("staleness_sum", sa.BigInteger(), False), ("staleness_max", sa.BigInteger(), False),
                      ("policy_version_max", sa.BigInteger(), False)),
}
TABLES = ("agg_trajectory_stats", "agg_rewards", "agg_trajectory_shapes", "agg_tasks", "agg_versions", "agg_groups",
          "agg_group_variance", "agg_samples", "agg_staleness", "agg_policy_versions")


def _bucket(dialect: str, column: str, width: int) -> str:
    # unix seconds -> the start of its bucket (positive: SQLite's CAST truncates = floor)
    if dialect == "postgresql":
        return f"CAST(floor({column} / {width}) AS BIGINT) * {width}"
    return f"CAST({column} / {width} AS INTEGER) * {width}"


def _call_versions(dialect: str) -> str:
    # model_version_stats' call_versions (0009): one row per (call, version it generated at)
    if dialect == "postgresql":
        spans = "generation_events g CROSS JOIN LATERAL json_array_elements(g.version_spans) AS j(value)"
        field = "CAST(j.value ->> '{}' AS INTEGER)"
    else:
        spans = "generation_events g, json_each(g.version_spans) j"
        field = "CAST(json_extract(j.value, '$.{}') AS INTEGER)"
    return (f"SELECT trajectory_id, model_version, output_len AS num_tokens FROM generation_events "
            f"WHERE version_spans IS NULL UNION ALL SELECT g.trajectory_id, {field.format('model_version')}, "
            f"{field.format('num_tokens')} FROM {spans} WHERE g.version_spans IS NOT NULL")


def _create() -> None:
    op.create_table(
        "agg_trajectory_stats",
        sa.Column("trajectory_id", sa.String(255), primary_key=True),
        sa.Column("group_id", sa.String(255), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("task", sa.String(255), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("num_generations", sa.Integer(), nullable=False),
        sa.Column("num_generated_tokens", sa.BigInteger(), nullable=False),
        sa.Column("num_samples", sa.Integer(), nullable=False),
        sa.Column("num_prefix_mismatches", sa.Integer(), nullable=False),
        sa.Column("num_placeholder_logprobs", sa.BigInteger(), nullable=False),
        sa.Column("route_rows_drifted", sa.BigInteger(), nullable=True),
        sa.Column("route_drift_share", sa.Float(), nullable=True),
    )
    op.create_index("ix_agg_trajectory_stats_drift", "agg_trajectory_stats",
                    [sa.text("route_drift_share DESC"), "trajectory_id"])
    op.create_index("ix_agg_trajectory_stats_tokens", "agg_trajectory_stats",
                    [sa.text("num_generated_tokens DESC"), "trajectory_id"])
    for name, values in BUCKETED.items():
        op.create_table(name, sa.Column("width_s", sa.Integer(), primary_key=True),
                        sa.Column("bucket_start", sa.BigInteger(), primary_key=True),
                        *(sa.Column(c, t, nullable=n) for c, t, n in values))
    op.create_table(
        "agg_trajectory_shapes",
        sa.Column("num_generations", sa.Integer(), primary_key=True),
        sa.Column("num_samples", sa.Integer(), primary_key=True),
        sa.Column("num_prefix_mismatches", sa.Integer(), primary_key=True),
        sa.Column("trajectories", sa.BigInteger(), nullable=False),
        sa.Column("placeholder_logprobs", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "agg_tasks",
        sa.Column("task", sa.String(255), primary_key=True),
        sa.Column("trajectories", sa.BigInteger(), nullable=False),
        sa.Column("rewarded", sa.BigInteger(), nullable=False),
        sa.Column("reward_sum", sa.Float(), nullable=False),
        sa.Column("generated_tokens", sa.BigInteger(), nullable=False),
        sa.Column("calls", sa.BigInteger(), nullable=False),
        sa.Column("failed", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "agg_versions",
        sa.Column("model_version", sa.Integer(), primary_key=True),
        sa.Column("trajectories", sa.BigInteger(), nullable=False),
        sa.Column("generated_tokens", sa.BigInteger(), nullable=False),
        sa.Column("rewarded", sa.BigInteger(), nullable=False),
        sa.Column("reward_sum", sa.Float(), nullable=False),
        sa.Column("failed", sa.BigInteger(), nullable=False),
        sa.Column("aborted", sa.BigInteger(), nullable=False),
        sa.Column("multi_version", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "agg_groups",
        sa.Column("group_id", sa.String(255), primary_key=True),
        sa.Column("trajectories", sa.BigInteger(), nullable=False),
        sa.Column("rewarded", sa.BigInteger(), nullable=False),
        sa.Column("reward_sum", sa.Float(), nullable=False),
        sa.Column("reward_sumsq", sa.Float(), nullable=False),
        sa.Column("reward_min", sa.Float(), nullable=True),
        sa.Column("reward_max", sa.Float(), nullable=True),
        sa.Column("finished_at", sa.Float(), nullable=False),
        sa.Column("counted_at", sa.Float(), nullable=True),
        sa.Column("counted_zero", sa.Integer(), nullable=True),
        sa.Column("counted_variance", sa.Float(), nullable=True),
    )
    op.create_table(
        "agg_samples",
        sa.Column("kind", sa.String(16), primary_key=True),
        sa.Column("value", sa.BigInteger(), primary_key=True),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("route_rows", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "agg_policy_versions",
        sa.Column("model_version", sa.Integer(), primary_key=True),
        sa.Column("first_position", sa.BigInteger(), nullable=False),
    )


def _backfill(dialect: str) -> None:
    task = "COALESCE(" + ", ".join(f"t.metadata ->> '{k}'" for k in TASK_KEYS) + ")"
    op.execute(
        "INSERT INTO agg_trajectory_stats (trajectory_id, group_id, status, task, finished_at, reward, "
        "num_generations, num_generated_tokens, num_samples, num_prefix_mismatches, num_placeholder_logprobs, "
        "route_rows_drifted, route_drift_share) "
        f"SELECT ts.trajectory_id, ts.group_id, ts.status, {task}, ts.last_event_at, ts.reward, ts.num_generations, "
        "ts.num_generated_tokens, ts.num_samples, ts.num_prefix_mismatches, ts.num_placeholder_logprobs, "
        "ts.route_rows_drifted, ts.route_drift_share "
        "FROM trajectory_summary ts JOIN trajectories t ON t.trajectory_id = ts.trajectory_id "
        "WHERE ts.status <> 'running' AND ts.last_event_at IS NOT NULL")
    op.execute(
        "INSERT INTO agg_trajectory_shapes (num_generations, num_samples, num_prefix_mismatches, trajectories, "
        "placeholder_logprobs) SELECT num_generations, num_samples, num_prefix_mismatches, count(*), "
        "sum(num_placeholder_logprobs) FROM agg_trajectory_stats "
        "GROUP BY num_generations, num_samples, num_prefix_mismatches")
    op.execute(
        "INSERT INTO agg_tasks (task, trajectories, rewarded, reward_sum, generated_tokens, calls, failed) "
        "SELECT task, count(*), count(reward), COALESCE(sum(reward), 0), sum(num_generated_tokens), "
        "sum(num_generations), count(*) FILTER (WHERE status IN ('failed', 'aborted')) "
        "FROM agg_trajectory_stats WHERE task IS NOT NULL GROUP BY task")
    op.execute(
        "INSERT INTO agg_versions (model_version, trajectories, generated_tokens, rewarded, reward_sum, failed, "
        "aborted, multi_version) "
        "SELECT COALESCE(p.model_version, -1), count(*), COALESCE(sum(p.num_tokens), 0), count(ts.reward), "
        "COALESCE(sum(ts.reward), 0), count(*) FILTER (WHERE ts.status = 'failed'), "
        "count(*) FILTER (WHERE ts.status = 'aborted'), count(*) FILTER (WHERE ts.model_version_span > 0) "
        f"FROM (SELECT model_version, trajectory_id, sum(num_tokens) AS num_tokens FROM ({_call_versions(dialect)}) "
        "cv GROUP BY model_version, trajectory_id) p "
        "JOIN trajectory_summary ts ON ts.trajectory_id = p.trajectory_id WHERE ts.status <> 'running' "
        "GROUP BY COALESCE(p.model_version, -1)")
    op.execute(
        "INSERT INTO agg_groups (group_id, trajectories, rewarded, reward_sum, reward_sumsq, reward_min, reward_max, "
        "finished_at, counted_at, counted_zero, counted_variance) "
        "SELECT group_id, n, rewarded, total, squares, low, high, finished_at, "
        "CASE WHEN running = 0 AND rewarded > 1 THEN finished_at END, "
        "CASE WHEN running = 0 AND rewarded > 1 THEN CASE WHEN low = high THEN 1 ELSE 0 END END, "
        "CASE WHEN running = 0 AND rewarded > 1 THEN squares / rewarded - (total / rewarded) * (total / rewarded) END "
        "FROM (SELECT s.group_id, count(*) AS n, count(s.reward) AS rewarded, COALESCE(sum(s.reward), 0) AS total, "
        "COALESCE(sum(s.reward * s.reward), 0) AS squares, min(s.reward) AS low, max(s.reward) AS high, "
        "max(s.finished_at) AS finished_at, (SELECT count(*) FROM trajectories r WHERE r.group_id = s.group_id "
        "AND r.status = 'running') AS running FROM agg_trajectory_stats s WHERE s.group_id IS NOT NULL "
        "GROUP BY s.group_id) g")
    op.execute(
        "INSERT INTO agg_policy_versions (model_version, first_position) SELECT model_version, min(position) "
        "FROM events WHERE type = 'generation' AND model_version IS NOT NULL GROUP BY model_version")
    # the samples' figures once (sample_summary's staleness reads every event)
    op.execute(
        "CREATE TABLE agg_backfill_samples AS SELECT ss.trajectory_id, ss.staleness, ss.latest_model_version, "
        "ss.model_version_span, ss.num_tokens, ss.num_route_rows, s.num_merged_calls, st.finished_at "
        "FROM sample_summary ss JOIN samples s ON s.trajectory_id = ss.trajectory_id "
        "AND s.sample_index = ss.sample_index "
        "LEFT JOIN agg_trajectory_stats st ON st.trajectory_id = ss.trajectory_id")
    op.execute(
        "INSERT INTO agg_samples (kind, value, samples, tokens, route_rows) "
        "SELECT 'staleness', COALESCE(staleness, -1), count(*), 0, 0 FROM agg_backfill_samples "
        "GROUP BY COALESCE(staleness, -1) "
        "UNION ALL SELECT 'version_span', model_version_span, count(*), 0, 0 FROM agg_backfill_samples "
        "GROUP BY model_version_span "
        "UNION ALL SELECT 'merged_calls', num_merged_calls, count(*), 0, 0 FROM agg_backfill_samples "
        "GROUP BY num_merged_calls "
        "UNION ALL SELECT 'no_route', num_tokens - num_route_rows, count(*), sum(num_tokens), sum(num_route_rows) "
        "FROM agg_backfill_samples WHERE num_route_rows IS NOT NULL GROUP BY num_tokens - num_route_rows")
    for width in WIDTHS_S:
        b = _bucket(dialect, "finished_at", width)
        op.execute(
            "INSERT INTO agg_rewards (width_s, bucket_start, rewarded, reward_sum, reward_min, reward_max) "
            f"SELECT {width}, {b}, count(*), sum(reward), min(reward), max(reward) FROM agg_trajectory_stats "
            f"WHERE reward IS NOT NULL GROUP BY {b}")
        c = _bucket(dialect, "counted_at", width)
        op.execute(
            "INSERT INTO agg_group_variance (width_s, bucket_start, groups, zero_variance_groups, variance_sum) "
            f"SELECT {width}, {c}, count(*), sum(counted_zero), sum(counted_variance) FROM agg_groups "
            f"WHERE counted_at IS NOT NULL GROUP BY {c}")
        op.execute(
            "INSERT INTO agg_staleness (width_s, bucket_start, samples, staled, staleness_sum, staleness_max, "
            f"policy_version_max) SELECT {width}, {b}, count(*), count(staleness), COALESCE(sum(staleness), 0), "
            "COALESCE(max(staleness), -1), COALESCE(max(latest_model_version), -1) FROM agg_backfill_samples "
            f"WHERE finished_at IS NOT NULL GROUP BY {b}")
    op.execute("DROP TABLE agg_backfill_samples")


def upgrade() -> None:
    _create()
    _backfill(op.get_bind().dialect.name)


def downgrade() -> None:
    for name in reversed(TABLES):
        op.drop_table(name)  # their indexes go with them
