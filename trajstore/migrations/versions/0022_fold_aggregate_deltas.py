"""The materializer's aggregates as rows of each commit's own

Revision ID: 0022
Revises: 0021
Create Date: 2026-11-29

A materializer commit upserted the run view's aggregate rows (``agg_expert_load``: one row
per (model version, layer, expert), 6,144 per version with 48x8 routes; and the
per-trajectory tables of 0020): shards counting the same keys queued on the same row
locks. Each of those tables gets a DELTA table beside it (``<table>_delta``: a surrogate
key, then the same key and counted columns, no unique key), which the commit inserts
into; ``agg_expert_load_delta`` holds one row per (commit, model version) with the
counts as int64 bytes. A background compaction moves the deltas into the totals.
``agg_expert_pending``: one row per commit naming its sample segment, whose decode
routes the compaction counts into ``agg_expert_load`` (off the fold's critical path).

The downgrade moves every delta into its totals (sums; minima and maxima kept as such;
the expert load's bytes decoded) and drops the delta tables. A group's part of
``agg_group_variance`` is settled by the compaction: one not compacted before the
downgrade is settled by ``trajstore report --rebuild-aggregates``.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

TABLES = ("agg_logprobs", "agg_rewards", "agg_trajectory_shapes", "agg_tasks", "agg_versions", "agg_groups",
          "agg_samples", "agg_staleness", "agg_policy_versions")
KEYS = {"agg_logprobs": ("model_version", "bin"), "agg_rewards": ("width_s", "bucket_start"),
        "agg_trajectory_shapes": ("num_generations", "num_samples", "num_prefix_mismatches"),
        "agg_tasks": ("task",), "agg_versions": ("model_version",), "agg_groups": ("group_id",),
        "agg_samples": ("kind", "value"), "agg_staleness": ("width_s", "bucket_start"),
        "agg_policy_versions": ("model_version",)}
MAXIMA = {"reward_max", "finished_at", "staleness_max", "policy_version_max"}
MINIMA = {"reward_min", "first_position"}
COUNTED = ("counted_at", "counted_zero", "counted_variance")  # agg_groups' settled part: the compaction's


def _columns(name: str) -> list[dict]:
    return [c for c in sa.inspect(op.get_bind()).get_columns(name) if c["name"] not in COUNTED]


def upgrade() -> None:
    for name in TABLES:
        op.create_table(f"{name}_delta", sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                                                   primary_key=True),
                        *[sa.Column(c["name"], c["type"], nullable=c["nullable"]) for c in _columns(name)])
    op.create_index("ix_agg_groups_delta_group", "agg_groups_delta", ["group_id"])
    op.create_table("agg_expert_load_delta",
                    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
                    sa.Column("model_version", sa.Integer(), nullable=False),
                    sa.Column("layers", sa.Integer(), nullable=False),
                    sa.Column("experts", sa.Integer(), nullable=False),
                    sa.Column("counts", sa.LargeBinary(), nullable=False))
    op.create_table("agg_expert_pending",
                    sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
                    sa.Column("segment", sa.String(255), nullable=False))


def downgrade() -> None:
    import numpy as np

    bind = op.get_bind()
    for name in TABLES:
        keys = KEYS[name]
        values = [c["name"] for c in _columns(name) if c["name"] not in keys]

        def agg(v: str) -> str:
            return f"{'max' if v in MAXIMA else 'min' if v in MINIMA else 'sum'}({v})"

        def update(v: str) -> str:
            if v in MAXIMA or v in MINIMA:
                op_ = ">" if v in MAXIMA else "<"
                return (f"{v} = CASE WHEN {name}.{v} IS NULL OR excluded.{v} {op_} {name}.{v} THEN "
                        f"COALESCE(excluded.{v}, {name}.{v}) ELSE {name}.{v} END")
            return f"{v} = {name}.{v} + excluded.{v}"

        op.execute(f"INSERT INTO {name} ({', '.join((*keys, *values))}) SELECT {', '.join(keys)}, "
                   f"{', '.join(agg(v) for v in values)} FROM {name}_delta GROUP BY {', '.join(keys)} "
                   f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {', '.join(update(v) for v in values)}")
        op.drop_table(f"{name}_delta")
    summed: dict[int, np.ndarray] = {}
    for version, layers, experts, counts in bind.execute(sa.text(
            "SELECT model_version, layers, experts, counts FROM agg_expert_load_delta")).all():
        c = np.frombuffer(bytes(counts), "<i8").reshape(int(layers), int(experts))
        have = summed.setdefault(int(version), np.zeros((0, 0), np.int64))
        grown = np.zeros(np.maximum(have.shape, c.shape), np.int64)
        grown[:have.shape[0], :have.shape[1]] += have
        grown[:c.shape[0], :c.shape[1]] += c
        summed[int(version)] = grown
    rows = [{"v": v, "l": int(l_), "e": int(e), "n": int(c[l_, e])}
            for v, c in summed.items() for l_ in range(c.shape[0]) for e in range(c.shape[1])]
    if rows:
        bind.execute(sa.text("INSERT INTO agg_expert_load (model_version, layer, expert, routed) "
                             "VALUES (:v, :l, :e, :n) ON CONFLICT (model_version, layer, expert) "
                             "DO UPDATE SET routed = agg_expert_load.routed + excluded.routed"), rows)
    op.drop_table("agg_expert_load_delta")
    op.drop_table("agg_expert_pending")  # commits whose expert load was not counted: --rebuild-aggregates
