"""PostgreSQL: the event index partitioned by position (docs/deploy.md, "Partitioning").

``partition_events`` converts a store's ``events`` table to a table
partitioned by ``RANGE (position)``, once, in one transaction, then keeps
partitions created ahead of the head. PostgreSQL requires a partitioned
table's unique keys to include the partition key, and ``events.identity``
(idempotency) does not: identities move to their own unpartitioned table,
``event_identities`` (primary key named ``events_identity_key``, the old
unique key's name, so a duplicate is still the lost race the append
re-admits), filled by a row trigger on every insert into ``events`` and
emptied by it on every delete (retention). ``events`` keeps a plain index on
``identity`` for the append's lookups.

The conversion does not copy the events: the old table becomes the first
partition (``events_legacy``, every position below the sequence's next
value; a CHECK constraint validated first lets the attach skip its scan).
What it rebuilds is the identities table and an identity index on the old
rows (one scan each). The views are bound to the old table, so every view of
the schema is dropped and re-created from its own definition, in the order
it was made. New partitions hold ``rows`` positions each; a DEFAULT
partition catches positions past the last one (run the command again, e.g.
daily, to keep ``ahead`` partitions ahead of the head).
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import Connection, text

__all__ = ["partition_events", "partitions"]

_BOUND = re.compile(r"FROM \((MINVALUE|'?-?\d+'?)\) TO \('?(-?\d+)'?\)")

IDENTITY_TRIGGER_SQL = """
CREATE OR REPLACE FUNCTION trajstore_event_identity() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    IF NEW.identity IS NOT NULL THEN
      INSERT INTO event_identities (identity, position) VALUES (NEW.identity, NEW.position);
    END IF;
  ELSIF OLD.identity IS NOT NULL THEN
    DELETE FROM event_identities WHERE identity = OLD.identity AND position = OLD.position;
  END IF;
  RETURN NULL;
END $$
"""


def _is_partitioned(conn: Connection) -> bool:
    return conn.exec_driver_sql("SELECT relkind FROM pg_class WHERE oid = 'events'::regclass").scalar_one() == "p"


def partitions(conn: Connection) -> list[tuple[str, int | None, int | None]]:
    """``(name, from, to)`` of each partition of ``events`` (None: MINVALUE, or the DEFAULT partition's both)."""
    rows = conn.exec_driver_sql(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'events'::regclass ORDER BY c.relname").all()
    out = []
    for name, bound in rows:
        m = _BOUND.search(bound or "")
        if m is None:
            out.append((name, None, None))
        else:
            lo = None if m.group(1) == "MINVALUE" else int(m.group(1).strip("'"))
            out.append((name, lo, int(m.group(2))))
    return out


def _convert(conn: Connection) -> int:
    run = conn.exec_driver_sql
    run("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
    views = run("SELECT c.relname, pg_get_viewdef(c.oid) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE c.relkind = 'v' AND n.nspname = current_schema() ORDER BY c.oid").all()
    for name, _ in reversed(views):
        run(f'DROP VIEW IF EXISTS "{name}" CASCADE')
    bound = int(run("SELECT GREATEST((SELECT COALESCE(MAX(position), 0) FROM events), "
                    "(SELECT last_value FROM log_positions)) + 1").scalar_one())
    for statement in (
        "ALTER TABLE events RENAME TO events_legacy",
        "ALTER TABLE events_legacy RENAME CONSTRAINT events_pkey TO events_legacy_pkey",
        "ALTER INDEX ix_events_trajectory_seq RENAME TO ix_events_legacy_trajectory_seq",
        "ALTER INDEX ix_events_type_position RENAME TO ix_events_legacy_type_position",
        "ALTER INDEX ix_events_segment RENAME TO ix_events_legacy_segment",
        "ALTER TABLE events_legacy DROP CONSTRAINT events_identity_key",
        "CREATE TABLE event_identities (identity VARCHAR(600) NOT NULL, position BIGINT NOT NULL, "
        "CONSTRAINT events_identity_key PRIMARY KEY (identity))",
        "INSERT INTO event_identities (identity, position) SELECT identity, position FROM events_legacy "
        "WHERE identity IS NOT NULL",
        "CREATE TABLE events (LIKE events_legacy INCLUDING DEFAULTS INCLUDING CONSTRAINTS) PARTITION BY RANGE (position)",
        "ALTER TABLE events ADD CONSTRAINT events_pkey PRIMARY KEY (position)",
        "CREATE INDEX ix_events_trajectory_seq ON events (trajectory_id, position)",
        "CREATE INDEX ix_events_type_position ON events (type, position)",
        "CREATE INDEX ix_events_segment ON events (segment)",
        "CREATE INDEX ix_events_identity ON events (identity)",
        f"ALTER TABLE events_legacy ADD CONSTRAINT events_legacy_range CHECK (position < {bound})",
        f"ALTER TABLE events ATTACH PARTITION events_legacy FOR VALUES FROM (MINVALUE) TO ({bound})",
        "ALTER TABLE events_legacy DROP CONSTRAINT events_legacy_range",
        IDENTITY_TRIGGER_SQL,
        "CREATE TRIGGER events_identity AFTER INSERT OR DELETE ON events FOR EACH ROW "
        "EXECUTE FUNCTION trajstore_event_identity()",
        "CREATE TABLE events_default PARTITION OF events DEFAULT",
    ):
        run(statement)
    for name, definition in views:
        run(f'CREATE VIEW "{name}" AS {definition}')
    return bound


def partition_events(engine: Any, *, rows: int, ahead: int, drop_empty: bool = False) -> dict[str, Any]:
    """Partition ``events`` by position (once), then create partitions of ``rows``
    positions until ``ahead`` of them lie past the log's head. With ``drop_empty``,
    first detach and drop the partitions wholly below the head that hold no row
    (retention emptied them; a late insert into a dropped range lands in the DEFAULT
    partition). Returns ``{"converted", "created", "dropped": [names], "partitions": [(name, from, to)]}``."""
    with engine.begin() as conn:
        conn.exec_driver_sql("SET LOCAL statement_timeout = 0")
        converted = not _is_partitioned(conn)
        if converted:
            _convert(conn)
        dropped = []
        if drop_empty:
            conn.exec_driver_sql("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
            head = int(conn.exec_driver_sql("SELECT last_value FROM log_positions").scalar_one())
            for name, _, hi in partitions(conn):
                if hi is not None and hi <= head + 1 and conn.exec_driver_sql(
                        f'SELECT NOT EXISTS (SELECT 1 FROM "{name}")').scalar_one():
                    conn.exec_driver_sql(f'ALTER TABLE events DETACH PARTITION "{name}"')
                    conn.exec_driver_sql(f'DROP TABLE "{name}"')
                    dropped.append(name)
        parts = partitions(conn)
        upper = max((hi for _, _, hi in parts if hi is not None), default=0)
        # rows already in the DEFAULT partition stay there: new ranges start past them
        upper = max(upper, int(conn.exec_driver_sql(
            "SELECT COALESCE(MAX(position), -1) + 1 FROM events_default").scalar_one()))
        head = int(conn.exec_driver_sql("SELECT last_value FROM log_positions").scalar_one())
        created = []
        while upper < head + ahead * rows:
            name = f"events_p{upper:019d}"
            conn.exec_driver_sql(f"CREATE TABLE {name} PARTITION OF events FOR VALUES FROM ({upper}) TO ({upper + rows})")
            created.append(name)
            upper += rows
        return {"converted": converted, "created": created, "dropped": dropped, "partitions": partitions(conn)}
