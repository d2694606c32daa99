"""PostgreSQL dialect hooks: the production backend (psycopg 3).

Transactions run at READ COMMITTED; appends are ordered by the ``log_head``
row lock (see ``trajstore.log.sql``). Many processes may append at once.
"""

from __future__ import annotations

import os

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import make_url

__all__ = ["default_payload_dir", "make_engines"]


def make_engines(url: str) -> tuple[Engine, Engine]:
    engine = create_engine(url, pool_pre_ping=True, pool_size=4, max_overflow=8)
    return engine, engine


def default_payload_dir(url: str) -> str:
    """``$TRAJSTORE_PAYLOAD_DIR``, else ``./trajstore-payload/<database>``."""
    env = os.environ.get("TRAJSTORE_PAYLOAD_DIR")
    if env:
        return env
    return os.path.abspath(os.path.join("trajstore-payload", make_url(url).database or "trajstore"))
