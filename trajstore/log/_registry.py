"""Which backend a store gets: the one table from a database's name to its backend.

``BACKENDS`` maps the database name of a store URL (SQLAlchemy's backend name:
``sqlite``, ``postgresql``) to the class of the module that holds everything
trajstore does on that database (``trajstore.log._backend`` says what a backend
is). ``backend_of(url)`` picks it for a store URL (``BACKENDS[name]`` for a
database's name), ``sql_dialect(engine)`` is its driver statements for an engine.
A new backend is one module under ``log/`` and one entry here (the driver-error
boundary, ``_errors.py``, asks the backends of this table what their driver's
errors mean).
"""

from __future__ import annotations

import weakref
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from trajstore.errors import IndexInvariantError, ValidationError
from trajstore.log._backend import Backend, safe_url
from trajstore.log._errors import classify_by
from trajstore.log._sqlite import SQLite
from trajstore.log.postgres import PostgreSQL

__all__ = ["BACKENDS", "backend_of", "sql_dialect"]

BACKENDS: dict[str, type[Backend]] = {backend.name: backend for backend in (SQLite, PostgreSQL)}
classify_by(lambda: BACKENDS.values())  # the driver-error boundary asks the backends of this table


def backend_of(url: str) -> type[Backend]:
    """The backend of store URL ``url``; ValidationError (rule ``url``) for a URL
    that is no store URL, names another database, or the backend would misread."""
    try:
        name = make_url(url).get_backend_name()
    except ArgumentError:
        raise ValidationError(f"not a store URL: {url!r} (use sqlite:///path.db or postgresql+psycopg://...)",
                              rule="url") from None
    backend = BACKENDS.get(name)
    if backend is None:
        raise ValidationError(f"unsupported database {name!r} in {safe_url(url)} ({' or '.join(BACKENDS)})",
                              rule="url")
    backend.check_url(url)
    return backend


_OF: "weakref.WeakKeyDictionary[Any, Backend]" = weakref.WeakKeyDictionary()


def sql_dialect(engine: Engine) -> Backend:
    """The driver statements of ``engine``: its backend, built once per SQLAlchemy dialect."""
    found = _OF.get(engine.dialect)
    if found is None:
        kind = BACKENDS.get(engine.dialect.name)
        if kind is None:  # pragma: no cover - backend_of refuses other URLs first
            raise IndexInvariantError(f"no trajstore backend for {engine.dialect.name!r}")
        found = _OF[engine.dialect] = kind(engine.dialect)
    return found
