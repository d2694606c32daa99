"""Which replay read token records each run's lineage (``run_owners``, migration 0024).

The first read token to record a run owns it; another read token's lineage for
that run is refused, and so is a read token's for a run whose lineage was
recorded without one (by a trainer with a database login, or the write token).
``owner`` is a digest of the token (``owner_of``), never the token itself.
"""

from __future__ import annotations

import hashlib
import time
from typing import Collection

from sqlalchemy import Connection, insert, select

from trajstore.log._dialect import SqlDialect, chunks
from trajstore.log._transaction import Database
from trajstore.log.base import StaleState
from trajstore.schema import lineage_annotations, lineage_steps, run_owners

__all__ = ["owner_of", "claim_runs"]


def owner_of(token: str) -> str:
    """The digest a token owns runs under."""
    return hashlib.sha256(token.encode()).hexdigest()


def claim_runs(db: Database, runs: Collection[str], owner: str) -> dict[str, str]:
    """Claim ``runs`` for ``owner`` (those nobody owns and nobody recorded yet), in one
    transaction; return the runs it may not record, each with why (nothing is claimed
    then)."""
    wanted = sorted(set(runs))

    def body(conn: Connection, d: SqlDialect) -> dict[str, str]:
        owned: dict[str, str] = {}
        for part in chunks(wanted):
            owned.update(conn.execute(select(run_owners.c.run, run_owners.c.owner)
                                      .where(run_owners.c.run.in_(part))).all())
        refused = {r: "is recorded by another read token" for r, o in owned.items() if o != owner}
        new = [r for r in wanted if r not in owned]
        for part in chunks(new):
            for t in (lineage_steps, lineage_annotations):
                for r in conn.execute(select(t.c.run).where(t.c.run.in_(part)).distinct()).scalars():
                    refused[r] = "was recorded without a read token (with the store's login or the write token)"
        if not refused and new:
            now = time.time()
            conn.execute(insert(run_owners), [{"run": r, "owner": owner, "created_at": now} for r in new])
        return refused

    for _ in range(3):
        try:
            return db.transaction("claiming runs for a read token", body)
        except StaleState:  # another token claimed one of them meanwhile: read again
            continue
    return db.transaction("claiming runs for a read token", body)
