"""Running the Alembic migrations from the library (first connect, ``trajstore init``).

Concurrent first connects are serialized by the backend
(``serialize_migrations``: PostgreSQL takes a transaction-level advisory lock,
SQLite's write engine begins with ``BEGIN IMMEDIATE``).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from trajstore.log._registry import sql_dialect

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


@functools.cache
def head_revision() -> str | None:
    """The newest migration's revision, read once per process: Alembic compiles every migration
    file from source to find it (tens of milliseconds), and every connect asks."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def upgrade(engine: Engine) -> bool:
    """Bring the schema to head; return True when a migration ran."""
    head = head_revision()
    with engine.connect() as conn:
        if MigrationContext.configure(conn).get_current_revision() == head:
            return False
    with engine.begin() as conn:
        sql_dialect(engine).serialize_migrations(conn)
        current = MigrationContext.configure(conn).get_current_revision()
        if current == head:
            return False
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    where = engine.url.render_as_string(hide_password=True)
    if current is None:  # a mistyped path or database makes a new, empty store: say where
        log.info("trajstore: created a new store at %s (schema %s)", where, head)
    else:
        log.info("trajstore: upgraded the store at %s from schema %s to %s", where, current, head)
    return True
