"""One database's SQL index: the log index and the sample index over its engines.

The names ``trajstore.log.sql`` (the module this index was before it was split
by job) exported are all here, for its deprecated path (``trajstore._util.moved``).
"""

from __future__ import annotations

from sqlalchemy import Engine

from trajstore.errors import first_line
from trajstore.log._errors import translate
from trajstore.log._events import SqlEventLog
from trajstore.log._samples import SqlProjectionIndex, SqlSampleIndex
from trajstore.log._transaction import Database
from trajstore.log.base import RELEASED

__all__ = ["RELEASED", "SqlEventLog", "SqlProjectionIndex", "SqlSampleIndex", "first_line", "open_sql", "translate"]


def open_sql(write_engine: Engine, read_engine: Engine) -> tuple[SqlEventLog, SqlSampleIndex]:
    """The log index and the sample index of one database, sharing its engines."""
    db = Database(write_engine, read_engine)
    return SqlEventLog(write_engine, read_engine, db), SqlSampleIndex(write_engine, read_engine, db)
