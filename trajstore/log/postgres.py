"""PostgreSQL engines: the production backend (psycopg 3).

Transactions run at READ COMMITTED; appends take positions from the sequence
``log_positions`` and never wait for each other (see ``trajstore.log._dialect``).

Timeouts (docs/log.md, "Timeouts"): a server that accepts TCP and never
answers must not hang a command. Two URL query parameters, both named as
PostgreSQL names them, have defaults here:

* ``connect_timeout`` — seconds to wait for a connection (libpq's own
  parameter); default ``DEFAULT_CONNECT_TIMEOUT_S``; ``0`` waits forever;
* ``statement_timeout`` — the server setting, sent as
  ``options=-c statement_timeout=...``: milliseconds, or a number with a
  unit (``ms``, ``s``, ``min``, ``h``, ``d``); default
  ``DEFAULT_STATEMENT_TIMEOUT``; ``0`` disables it. It also bounds lock waits.

A connect that times out surfaces as ``StoreUnavailable`` (one line); so does
a statement cancelled by the timeout.

A pooled connection is pinged (``SELECT 1``) at checkout only when it sat
in the pool for ``PING_IDLE_S`` or more (``_ping_if_idle``), not on every
checkout: under load an append reuses a connection within milliseconds, and
a ping there would be a round trip of its three. A connection that broke
while busy (a server restart under load) fails its next use once; that
error is a lost connection (``StoreUnavailable``, nothing stored, retried by
every writer) and the connection is dropped from the pool.

Returning a connection to the pool rolls it back (``_reset``); when that fails
because the connection broke meanwhile (a server restart, a terminated
backend), the connection is invalidated quietly (the pool opens a new one when
it needs one), not logged as SQLAlchemy's "Exception during reset or similar"
traceback: nothing failed that the caller had not already been told about.
"""

from __future__ import annotations

import logging
import os
import re
import time

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.engine import make_url
from sqlalchemy.pool import PoolResetState

from trajstore.errors import ValidationError

__all__ = ["DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_STATEMENT_TIMEOUT", "default_payload_dir", "engine_options",
           "make_engines"]

DEFAULT_CONNECT_TIMEOUT_S = 10
DEFAULT_STATEMENT_TIMEOUT = "120s"

_DURATION = re.compile(r"^[0-9]+(ms|s|min|h|d)?$")


class _DropSecondReport(logging.Filter):
    """psycopg logs ``error ignored terminating <psycopg.Pipeline [BAD]>: ...`` when a pipeline
    (or COPY) it closes after an error fails again, as it does when the server goes away
    mid-append. The first error is already raised and reported as a trajstore error; this
    second line only repeats it in psycopg's words."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("error ignored terminating"))


def make_engines(url: str) -> tuple[Engine, Engine]:
    psycopg_log = logging.getLogger("psycopg")
    if not any(isinstance(f, _DropSecondReport) for f in psycopg_log.filters):
        psycopg_log.addFilter(_DropSecondReport())
    url, connect_args = engine_options(url)
    # reset_on_return=None: the "reset" listener below is the pool's reset (a rollback);
    # no pool_pre_ping: _ping_if_idle pings only connections that sat idle
    engine = create_engine(url, pool_size=4, max_overflow=8, connect_args=connect_args,
                           pool_reset_on_return=None)
    event.listen(engine, "reset", _reset)
    event.listen(engine, "checkin", _checked_in)
    event.listen(engine, "checkout", _ping_if_idle)
    return engine, engine


PING_IDLE_S = 1.0
"""A pooled connection idle this long is pinged at checkout (module doc)."""
_IDLE_SINCE = "trajstore_idle_since"


def _checked_in(dbapi_connection: Any, record: Any) -> None:
    if record is not None:
        record.info[_IDLE_SINCE] = time.monotonic()


def _ping_if_idle(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """At checkout: a connection idle ``PING_IDLE_S`` or more answers ``SELECT 1`` or is replaced
    (``DisconnectionError`` makes the pool open a new one)."""
    since = record.info.get(_IDLE_SINCE)
    if since is None or time.monotonic() - since < PING_IDLE_S:
        return
    try:
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        try:
            dbapi_connection.execute("SELECT 1", prepare=False)
        finally:
            dbapi_connection.autocommit = autocommit
    except Exception as e:  # noqa: BLE001 - any failure: the connection is unusable
        raise DisconnectionError(f"pooled connection failed its ping: {e}") from None


_log = logging.getLogger("trajstore.log")


def _reset(dbapi_connection: Any, record: Any, state: PoolResetState) -> None:
    """A connection returned to the pool: roll back what it left open; a connection
    that broke meanwhile is invalidated (closed and dropped from the pool) quietly."""
    if state.transaction_was_reset or not state.asyncio_safe:
        return  # already rolled back by its SQLAlchemy Connection, or not ours to touch
    try:
        dbapi_connection.rollback()
    except Exception as e:  # noqa: BLE001 - any failure here means the connection is unusable
        _log.debug("a pooled connection failed its rollback on return (%s); dropping it",
                   str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        if record is not None:
            record.invalidate(e)


def engine_options(url: str) -> tuple[str, dict[str, str | int]]:
    """The URL psycopg gets and the connect arguments carrying the timeouts.

    ``statement_timeout`` is not a libpq parameter, so it leaves the URL and
    joins ``options``; ``connect_timeout`` stays in the URL when given."""
    u = make_url(url)
    query = dict(u.query)
    connect_args: dict[str, str | int] = {}
    given = query.get("connect_timeout")
    if given is None:
        connect_args["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT_S
    elif not (isinstance(given, str) and given.isdigit()):
        raise ValidationError(f"connect_timeout={given!r} in the store URL is not a whole number of seconds",
                              rule="url")
    statement = query.pop("statement_timeout", None)
    if statement is not None and not (isinstance(statement, str) and _DURATION.match(statement)):
        raise ValidationError(f"statement_timeout={statement!r} in the store URL is not a duration "
                              "(milliseconds, or a number with ms, s, min, h or d)", rule="url")
    options = query.pop("options", "")
    if isinstance(options, tuple):
        options = " ".join(options)
    if statement is None and "statement_timeout" in options:
        statement = ""  # given the libpq way (options=-c statement_timeout=...): keep it
    elif statement is None:
        statement = DEFAULT_STATEMENT_TIMEOUT
    if statement:
        options = f"{options} -c statement_timeout={statement}"
    connect_args["options"] = options.strip()
    return u.set(query=query).render_as_string(hide_password=False), connect_args


def default_payload_dir(url: str) -> str:
    """``$TRAJSTORE_PAYLOAD_DIR``, else ``./trajstore-payload/<database>``."""
    env = os.environ.get("TRAJSTORE_PAYLOAD_DIR")
    if env:
        return env
    return os.path.abspath(os.path.join("trajstore-payload", make_url(url).database or "trajstore"))
