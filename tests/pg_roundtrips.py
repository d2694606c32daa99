"""Counting a PostgreSQL client's round trips exactly, from libpq's own protocol trace.

``RoundTrips(engine)`` traces every connection the engine opens from then on
(``PGconn.trace`` into one file per connection; the pool is emptied so that
every connection is a traced one). ``counts()`` reads the traces: a round
trip is a run of messages the client sent followed by the server's answer
(one F→B turn in the trace), so pipelined statements sent together count
once. It also counts the statements (``Query`` and ``Execute`` messages, one
per executemany row), the rows the server sent (``DataRow``), the COMMITs (the
server's answers: a prepared COMMIT sends no text) and the pings (``SELECT 1``, or the empty query ``;``
SQLAlchemy's ``pool_pre_ping`` sends).

Why not SQLAlchemy's ``before_cursor_execute``: the append runs on pooled
driver cursors (``Database.transaction(raw=True)``), which SQLAlchemy's
execution events never see, nor do they see the pool's pings, a driver's
implicit BEGIN, or which statements share a round trip.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from sqlalchemy import Engine, event


class RoundTrips:
    def __init__(self, engine: Engine) -> None:
        self.dir = tempfile.mkdtemp(prefix="trajstore-pgtrace-")
        self._files: list[Any] = []
        self._engine = engine
        event.listen(engine, "connect", self._on_connect)
        engine.dispose()  # every connection from now on is traced
        self._base = self._raw()

    def _on_connect(self, dbapi_connection: Any, record: Any) -> None:
        from psycopg import pq

        f = open(os.path.join(self.dir, f"{len(self._files)}.trace"), "w")
        self._files.append(f)
        dbapi_connection.pgconn.trace(f.fileno())
        dbapi_connection.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def _raw(self) -> dict[str, int]:
        import ctypes

        ctypes.CDLL(None).fflush(None)  # libpq writes the trace through a buffered stdio stream
        out = {"round_trips": 0, "statements": 0, "rows": 0, "commits": 0, "pings": 0, "connections": len(self._files)}
        for name in sorted(os.listdir(self.dir)):
            side = None
            with open(os.path.join(self.dir, name), errors="replace") as f:
                for line in f:
                    parts = line.split("\t")
                    if len(parts) < 3:
                        continue
                    who, kind = parts[0], parts[2].strip()
                    if who == "B" and side == "F":
                        out["round_trips"] += 1
                    if who in ("F", "B"):
                        side = who
                    if who == "F" and kind in ("Query", "Execute"):
                        out["statements"] += 1
                    if who == "B" and kind == "DataRow":
                        out["rows"] += 1
                    text = parts[3] if len(parts) > 3 else ""
                    if who == "B" and kind == "CommandComplete" and '"COMMIT"' in text:
                        out["commits"] += 1  # (a prepared COMMIT sends no text: count the answers)
                    if who == "F" and kind in ("Query", "Parse") and '"SELECT 1"' in text:
                        out["pings"] += 1  # ours (never prepared)
                    if who == "B" and kind == "EmptyQueryResponse":
                        out["pings"] += 1  # SQLAlchemy's pool_pre_ping sends the empty query ";"
        return out

    def counts(self) -> dict[str, int]:
        """What was counted since this object was made (or since ``reset()``)."""
        raw = self._raw()
        return {k: raw[k] - self._base.get(k, 0) for k in raw}

    def reset(self) -> None:
        self._base = self._raw()

    def close(self) -> None:
        event.remove(self._engine, "connect", self._on_connect)
        self._engine.dispose()
        for f in self._files:
            f.close()
        shutil.rmtree(self.dir, ignore_errors=True)
