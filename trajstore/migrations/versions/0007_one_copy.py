"""one copy of every token: events re-pointed into sample segments; retired segments

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23

* ``events.segment_kind``: NULL while an event's payload is a row of a log
  segment (``.arrow``, one row per event); ``'samples'`` once the
  materializer re-pointed it to the sample it folded into (``segment`` /
  ``segment_row`` then name the sample row, and the event's slices of it
  follow from ``prefix_len``, ``prompt_len``, ``output_len``,
  ``routes_start``, ``num_route_rows``).
* ``segments.retired_at``: when the last event left a log segment (re-pointed
  or compacted); ``trajstore gc`` deletes the file once that is older than
  its grace.
* ``ix_events_segment``: which events a segment still holds (retiring,
  compaction).
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ALTER TABLE ADD/DROP COLUMN on both dialects (SQLite >= 3.35): no table
    # rebuild, so the inspection views over events stay as they are
    op.add_column('events', sa.Column('segment_kind', sa.String(length=8), nullable=True))
    op.add_column('segments', sa.Column('retired_at', sa.Float(), nullable=True))
    op.create_index('ix_events_segment', 'events', ['segment'], unique=False)


def downgrade() -> None:
    # Events re-pointed into sample segments cannot be read by the code before this
    # revision: a downgrade is for a store whose events are all still in the log,
    # and is refused otherwise (dropping segment_kind would make them unreadable).
    moved = op.get_bind().execute(sa.text("SELECT COUNT(*) FROM events WHERE segment_kind IS NOT NULL")).scalar()
    if moved:
        raise RuntimeError(f"cannot downgrade below 0007: {moved} events read their tokens from sample segments "
                           "(materialized); revisions before 0007 cannot read them")
    op.drop_index('ix_events_segment', table_name='events')
    op.execute('ALTER TABLE segments DROP COLUMN retired_at')
    op.execute('ALTER TABLE events DROP COLUMN segment_kind')
