"""agg_expert_load: one counts array per model version

Revision ID: 0026
Revises: 0025
Create Date: 2026-11-29

``agg_expert_load`` held one row per (model version, layer, expert): 6,144 rows per
version with 48x8 routes of 128 experts, each upserted by the compaction that counts a
commit's decode routes. It now holds ONE row per model version: ``layers``, ``experts``
and ``counts``, the [layers, experts] int64 counts as bytes (little-endian, C order),
the same encoding as ``agg_expert_load_delta``'s. The compaction adds a commit's array to
its version's row (one row read and written per version); the run view sums the rows of
both tables with numpy.

The upgrade turns each version's rows into its array (a missing (layer, expert) counts 0);
the downgrade turns each array back into its rows. On PostgreSQL the reader role
(0002's ``trajstore_reader``), if there is one, is granted SELECT on the new table.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

READER_ROLE = "trajstore_reader"  # 0002's role


def _grant() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"""DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '{READER_ROLE}') THEN
        BEGIN
            EXECUTE 'GRANT SELECT ON agg_expert_load TO {READER_ROLE}';
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE USING MESSAGE = 'trajstore: ' || SQLERRM || '; see docs/sql.md (read-only access)';
        END;
    END IF;
END
$$""")


def upgrade() -> None:
    import numpy as np

    bind = op.get_bind()
    cells: dict[int, list[tuple[int, int, int]]] = {}
    for version, layer, expert, routed in bind.execute(sa.text(
            "SELECT model_version, layer, expert, routed FROM agg_expert_load")).all():
        cells.setdefault(int(version), []).append((int(layer), int(expert), int(routed)))
    op.drop_table("agg_expert_load")
    table = op.create_table(
        "agg_expert_load",
        sa.Column("model_version", sa.Integer(), primary_key=True),
        sa.Column("layers", sa.Integer(), nullable=False),
        sa.Column("experts", sa.Integer(), nullable=False),
        sa.Column("counts", sa.LargeBinary(), nullable=False),
    )
    rows = []
    for version, got in sorted(cells.items()):
        at = np.asarray(got, np.int64)
        counts = np.zeros((int(at[:, 0].max()) + 1, int(at[:, 1].max()) + 1), "<i8")
        np.add.at(counts, (at[:, 0], at[:, 1]), at[:, 2])
        rows.append({"model_version": version, "layers": counts.shape[0], "experts": counts.shape[1],
                     "counts": counts.tobytes()})
    if rows:
        op.bulk_insert(table, rows)
    _grant()


def downgrade() -> None:
    import numpy as np

    bind = op.get_bind()
    arrays = [(int(v), np.frombuffer(bytes(c), "<i8").reshape(int(layers), int(experts)))
              for v, layers, experts, c in bind.execute(sa.text(
                  "SELECT model_version, layers, experts, counts FROM agg_expert_load")).all()]
    op.drop_table("agg_expert_load")
    table = op.create_table(
        "agg_expert_load",
        sa.Column("model_version", sa.Integer(), primary_key=True),
        sa.Column("layer", sa.Integer(), primary_key=True),
        sa.Column("expert", sa.Integer(), primary_key=True),
        sa.Column("routed", sa.BigInteger(), nullable=False),
    )
    rows = [{"model_version": v, "layer": int(l_), "expert": int(e), "routed": int(n)}
            for v, c in arrays for (l_, e), n in np.ndenumerate(c)]
    if rows:
        op.bulk_insert(table, rows)
    _grant()
