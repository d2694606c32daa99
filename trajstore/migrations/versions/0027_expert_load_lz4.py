"""agg_expert_load arrays stored with lz4 (PostgreSQL)

Revision ID: 0027
Revises: 0026
Create Date: 2026-11-29

A commit's expert-load array (``agg_expert_load_delta.counts``: [layers, experts] int64,
49 KB at 48 layers of 128 experts) and a version's compacted total (``agg_expert_load``)
are larger than PostgreSQL's TOAST threshold, so the server compressed each with its
default, pglz: 0.9 ms of server CPU per array inserted here, every commit and every
version in it, and again when the compaction rewrites the total. With lz4 (PostgreSQL 14+
built with it) an insert costs 0.18 ms and the array takes 20 KB instead of 14 (pglz) or
50 (none). Without lz4 the column is stored uncompressed (``STORAGE EXTERNAL``: 0.24 ms,
50 KB). Only the storage changes; the values read are the same. SQLite: nothing to do.

Only values written after the upgrade are stored the new way (a row compressed before
is read as it is). The downgrade puts the columns back to the server's default.
"""
from __future__ import annotations

from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

TABLES = ("agg_expert_load", "agg_expert_load_delta")


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(f"""DO $$
BEGIN
    IF current_setting('server_version_num')::int >= 140000 AND EXISTS (
            SELECT 1 FROM pg_settings WHERE name = 'default_toast_compression' AND 'lz4' = ANY(enumvals)) THEN
        EXECUTE 'ALTER TABLE {table} ALTER COLUMN counts SET COMPRESSION lz4';
    ELSE
        EXECUTE 'ALTER TABLE {table} ALTER COLUMN counts SET STORAGE EXTERNAL';
    END IF;
END
$$""")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(f"""DO $$
BEGIN
    IF current_setting('server_version_num')::int >= 140000 THEN
        EXECUTE 'ALTER TABLE {table} ALTER COLUMN counts SET COMPRESSION default';
    END IF;
    EXECUTE 'ALTER TABLE {table} ALTER COLUMN counts SET STORAGE EXTENDED';
END
$$""")
