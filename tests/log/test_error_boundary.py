"""``trajstore.log._errors.driver_errors``: the one context manager that maps what
a database driver raised to a trajstore error, in its three modes, on real
SQLite and PostgreSQL databases (SQLAlchemy's wrapped errors and the raw
DB-API ones of sqlite3 and psycopg)."""

from __future__ import annotations

import sqlite3
import time

import pytest
from sqlalchemy import text

from trajstore.errors import IndexInvariantError, StoreUnavailable, TrajstoreError
from trajstore.log._backend import Backend
from trajstore.log._errors import driver_errors
from trajstore.log.base import StaleState
from trajstore.schema import store_settings


def _insert_setting(engine, name: str) -> None:
    with engine.begin() as conn:
        conn.execute(store_settings.insert().values(name=name, value="x", updated_at=time.time()))


def test_opening_mode_names_what_failed_in_one_line(store):
    engine = store.log.db.write_engine
    with pytest.raises(StoreUnavailable) as caught:
        with driver_errors("reading the store's widgets", mode="opening"), engine.connect() as conn:
            conn.execute(text("SELECT * FROM no_such_table"))
    assert str(caught.value).startswith("reading the store's widgets: ")
    assert "no_such_table" in str(caught.value) and "\n" not in str(caught.value)


def test_opening_mode_reports_a_taken_key_as_a_lost_race_only_when_asked(store):
    engine = store.log.db.write_engine
    _insert_setting(engine, "boundary_test")
    with pytest.raises(StaleState):
        with driver_errors("recording a setting", mode="opening", races=True):
            _insert_setting(engine, "boundary_test")
    with pytest.raises(StoreUnavailable, match="^recording a setting: "):
        with driver_errors("recording a setting", mode="opening"):
            _insert_setting(engine, "boundary_test")


def test_index_mode_is_translate(store):
    engine = store.log.db.write_engine
    _insert_setting(engine, "boundary_test")
    # store_settings is no key writers race for: a second insert is a trajstore bug
    with pytest.raises(IndexInvariantError, match="^recording a setting: the index refused the write"):
        with driver_errors("recording a setting"):
            _insert_setting(engine, "boundary_test")


def test_user_query_mode_gives_the_database_reason(store):
    engine = store.log.db.write_engine
    with pytest.raises(TrajstoreError) as caught:
        with driver_errors("SQL error", mode="user_query"), engine.connect() as conn:
            conn.exec_driver_sql("SELEC 1")
    assert str(caught.value).startswith("SQL error: ") and "syntax error" in str(caught.value)
    assert "\n" not in str(caught.value) and "[SQL:" not in str(caught.value)


def test_raw_driver_errors_are_mapped_and_the_rest_passes_through(tmp_path):
    conn = sqlite3.connect(tmp_path / "raw.db")
    try:
        with pytest.raises(TrajstoreError, match=r"^cannot switch \(no such table: t\); see there$"):
            with driver_errors("cannot switch ({reason}); see there", mode="user_query"):
                conn.execute("SELECT * FROM t")
        with pytest.raises(StoreUnavailable, match="^opening raw: no such table: t$"):
            with driver_errors("opening raw", mode="opening"):
                conn.execute("SELECT * FROM t")
        for mode in ("index", "opening", "user_query"):
            with pytest.raises(KeyError):
                with driver_errors("anything", mode=mode):  # type: ignore[arg-type]
                    raise KeyError("not the driver's")
    finally:
        conn.close()


def test_a_server_starting_up_is_one_to_wait_out():
    psycopg_errors = pytest.importorskip("psycopg.errors")
    from trajstore.log._errors import ServerRecovering

    # what psycopg raises while PostgreSQL starts up (SQLSTATE 57P03), as the driver builds it
    with pytest.raises(ServerRecovering, match="^reading: the database system is starting up$") as caught:
        with driver_errors("reading", mode="opening"):
            raise psycopg_errors.CannotConnectNow("the database system is starting up")
    assert isinstance(caught.value, StoreUnavailable)
    with pytest.raises(StoreUnavailable) as caught:
        with driver_errors("reading", mode="opening"):
            raise psycopg_errors.UndefinedTable("relation \"x\" does not exist")
    assert not isinstance(caught.value, ServerRecovering)


# -- a third backend: its module and its registry entry, nothing in _errors.py ----------

class ToyDriverError(Exception):
    """The DB-API base error of a third database's driver."""


class Toy(Backend):
    """A throwaway third backend: what its driver's errors mean is its own to say."""

    name = "toydb"

    @classmethod
    def driver_errors(cls) -> tuple[type[BaseException], ...]:
        return (ToyDriverError,)

    @classmethod
    def lost_race(cls, e: BaseException) -> bool:
        return str(e).startswith("busy:")

    @classmethod
    def recovering(cls, e: BaseException) -> bool:
        return "warming up" in str(e)

    @classmethod
    def query_reason(cls, e: BaseException, timeout_s: float | None) -> str:
        return f"toydb says {e}"


def test_a_third_backend_is_one_module_and_one_registry_entry(monkeypatch):
    from sqlalchemy.exc import DBAPIError

    from trajstore.log import _registry
    from trajstore.log._errors import ServerRecovering

    monkeypatch.setattr(_registry, "BACKENDS", {**_registry.BACKENDS, Toy.name: Toy})  # a copy plus one entry
    with pytest.raises(ServerRecovering, match="^opening: toydb warming up$"):
        with driver_errors("opening", mode="opening"):
            raise ToyDriverError("toydb warming up")
    with pytest.raises(TrajstoreError, match="^SQL error: toydb says no such column x$"):
        with driver_errors("SQL error", mode="user_query"):
            raise ToyDriverError("no such column x")
    # as SQLAlchemy wraps its driver's error in an index transaction: the backend says "lost a race"
    with pytest.raises(StaleState, match="^appending: "):
        with driver_errors("appending"):
            raise DBAPIError.instance("COMMIT", None, ToyDriverError("busy: another writer"), ToyDriverError)
    with pytest.raises(IndexInvariantError, match="^appending: unexpected database error"):
        with driver_errors("appending"):
            raise DBAPIError.instance("COMMIT", None, ToyDriverError("no such column x"), ToyDriverError)
    monkeypatch.undo()  # not registered: its driver's errors are no driver's the boundary knows
    with pytest.raises(ToyDriverError):
        with driver_errors("opening", mode="opening"):
            raise ToyDriverError("toydb warming up")


@pytest.mark.parametrize("name", ["sqlite", "postgresql"])
def test_each_backend_classifies_its_own_driver_errors(name):
    from trajstore.log._errors import DriverErrorRules, backend_of_error
    from trajstore.log._registry import BACKENDS

    backend = BACKENDS[name]
    classes = backend.driver_errors()
    if not classes:
        pytest.skip(f"{backend.driver} is not installed")
    assert backend.driver and backend.__module__.startswith("trajstore.log.")
    assert backend_of_error(classes[0]("x")) is backend
    assert backend_of_error(KeyError("x")) is DriverErrorRules  # nobody's: the rules that say nothing
