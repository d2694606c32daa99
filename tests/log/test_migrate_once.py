"""A connect to a store already at head reads no migration file: Alembic compiles every one
from source to find the head (tens of milliseconds a connect, and the suite connects
thousands of times), so the head is found once per process."""

from __future__ import annotations

import sys

import trajstore
from trajstore.log._migrate import MIGRATIONS_DIR

_compiled: list[str] | None = None  # the migration files compiled while a test listens


def _listen(event: str, args: tuple) -> None:
    if event == "compile" and _compiled is not None and len(args) > 1:
        if str(args[1]).startswith(str(MIGRATIONS_DIR)):
            _compiled.append(str(args[1]))


sys.addaudithook(_listen)  # a hook stays for the process: it records only while _compiled is a list


def test_a_connect_to_a_store_at_head_compiles_no_migration_file(store):
    global _compiled
    _compiled = []
    try:
        for _ in range(2):
            trajstore.connect(store.url, payload=store.payload.location).close()
        found = list(_compiled)
    finally:
        _compiled = None
    assert found == [], f"{len(found)} migration file(s) compiled to connect to a store at head"


def test_the_audit_hook_sees_alembic_compile_the_migrations(tmp_path):
    """The check above can fail: a new store's migrations are compiled where the hook sees them."""
    global _compiled
    _compiled = []
    try:
        trajstore.connect(f"sqlite:///{tmp_path / 'new.db'}", payload=str(tmp_path / "payload")).close()
        found = list(_compiled)
    finally:
        _compiled = None
    assert len(found) >= len(list(MIGRATIONS_DIR.glob("versions/*.py"))), found
