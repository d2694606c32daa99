"""A connect to a store already at head reads no migration file: Alembic loads every one
(compiled from source, or from its cached bytecode) to find the head (tens of milliseconds
a connect, and the suite connects thousands of times), so the head is found once per process."""

from __future__ import annotations

import sys
from pathlib import Path

import trajstore
from trajstore.log._migrate import MIGRATIONS_DIR

_compiled: list[str] | None = None  # the migration modules loaded while a test listens
_VERSIONS = str(MIGRATIONS_DIR / "versions")


def _listen(event: str, args: tuple) -> None:
    # A module is loaded from source ("compile" of the .py) or from its bytecode in
    # __pycache__ ("open" of the .pyc, as a process after the first one does): either counts.
    if _compiled is None:
        return
    path = str(args[1]) if event == "compile" and len(args) > 1 else str(args[0]) if event == "open" and args else ""
    if path.startswith(_VERSIONS) and path.endswith((".py", ".pyc")):
        _compiled.append(Path(path).name.split(".")[0])


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
    assert found == [], f"{len(set(found))} migration module(s) loaded to connect to a store at head"


def test_the_audit_hook_sees_alembic_compile_the_migrations(tmp_path):
    """The check above can fail: a new store's migrations are loaded where the hook sees them,
    from source or from bytecode."""
    global _compiled
    _compiled = []
    try:
        trajstore.connect(f"sqlite:///{tmp_path / 'new.db'}", payload=str(tmp_path / "payload")).close()
        found = list(_compiled)
    finally:
        _compiled = None
    assert set(found) >= {p.stem for p in MIGRATIONS_DIR.glob("versions/*.py")}, found
