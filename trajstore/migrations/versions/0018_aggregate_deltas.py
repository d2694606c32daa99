"""aggregate deltas: the append inserts its own aggregate rows, no shared row updated

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-27

``agg_output_lengths`` and ``agg_route_drift`` (0015) were one row per key,
added to by every append (``INSERT ... ON CONFLICT DO UPDATE``): on PostgreSQL
an append waited for the row lock of any concurrent append counting the same
key (every call of one output length, every call of one time bucket) until
that one committed. Now each append inserts DELTA rows of its own and readers
sum a key's rows (docs/log.md, "Run aggregates"):

* ``id``: a surrogate primary key (the key columns are no longer unique);
* ``delta``: true for an append's rows, false for the one total row of a key
  (``ux_<table>_total``: unique on the key columns where NOT delta, what the
  fold of deltas upserts into); ``ix_<table>_delta``: the deltas, for that
  fold (the materializer's commit, ``report --rebuild-aggregates``).

Existing rows become the totals. The downgrade folds the deltas into them and
restores the key as the primary key.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

TABLES = {
    "agg_output_lengths": (("model_version", "output_len"), ("calls",)),
    "agg_route_drift": (("width_s", "bucket_start"), ("rows_resent", "rows_compared", "rows_drifted")),
}
TYPES = {"model_version": sa.Integer(), "output_len": sa.Integer(), "width_s": sa.Integer(),
         "bucket_start": sa.BigInteger()}


def _indexes(name: str, keys: tuple[str, ...]) -> None:
    op.create_index(f"ux_{name}_total", name, list(keys), unique=True,
                    sqlite_where=sa.text("NOT delta"), postgresql_where=sa.text("NOT delta"))
    op.create_index(f"ix_{name}_delta", name, ["id"], sqlite_where=sa.text("delta"),
                    postgresql_where=sa.text("delta"))


def _sqlite_recreate(name: str, columns: list[sa.Column], select: str) -> None:
    # SQLite changes no primary key in place: a new table, filled, renamed over the old
    op.create_table(f"{name}_new", *columns)
    cols = ", ".join(c.name for c in columns if c.name != "id")  # the surrogate key numbers itself
    op.execute(f"INSERT INTO {name}_new ({cols}) {select}")
    op.drop_table(name)
    op.rename_table(f"{name}_new", name)


def upgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for name, (keys, values) in TABLES.items():
        if sqlite:
            _sqlite_recreate(name, [sa.Column("id", sa.Integer(), primary_key=True),
                                    *[sa.Column(k, TYPES[k], nullable=False) for k in keys],
                                    *[sa.Column(v, sa.BigInteger(), nullable=False) for v in values],
                                    sa.Column("delta", sa.Boolean(), nullable=False)],
                             f"SELECT {', '.join((*keys, *values))}, FALSE FROM {name}")
        else:
            op.execute(f"ALTER TABLE {name} DROP CONSTRAINT {name}_pkey")
            op.execute(f"ALTER TABLE {name} ADD COLUMN id BIGSERIAL PRIMARY KEY")
            op.execute(f"ALTER TABLE {name} ADD COLUMN delta BOOLEAN NOT NULL DEFAULT FALSE")
            op.execute(f"ALTER TABLE {name} ALTER COLUMN delta DROP DEFAULT")
        _indexes(name, keys)


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for name, (keys, values) in TABLES.items():
        summed = (f"SELECT {', '.join(keys)}, {', '.join(f'sum({v}) AS {v}' for v in values)} FROM {name} "
                  f"GROUP BY {', '.join(keys)}")
        op.drop_index(f"ix_{name}_delta", table_name=name)
        op.drop_index(f"ux_{name}_total", table_name=name)
        if sqlite:
            _sqlite_recreate(name, [*[sa.Column(k, TYPES[k], primary_key=True) for k in keys],
                                    *[sa.Column(v, sa.BigInteger(), nullable=False) for v in values]], summed)
        else:
            op.execute(f"CREATE TEMPORARY TABLE {name}_summed AS {summed}")
            op.execute(f"DELETE FROM {name}")
            op.execute(f"ALTER TABLE {name} DROP COLUMN delta")
            op.execute(f"ALTER TABLE {name} DROP COLUMN id")  # its primary key and sequence go with it
            op.execute(f"ALTER TABLE {name} ADD PRIMARY KEY ({', '.join(keys)})")
            op.execute(f"INSERT INTO {name} ({', '.join((*keys, *values))}) SELECT * FROM {name}_summed")
            op.execute(f"DROP TABLE {name}_summed")
