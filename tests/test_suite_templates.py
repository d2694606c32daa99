"""The suite's migrated templates (tests/conftest.py): a store made from one is the store a
first connect makes (same schema, grants, version and settings), with an id of its own;
a test that does not open ``store`` gets an empty ``store_url``."""

from __future__ import annotations

import pytest
from sqlalchemy import text

import trajstore
from trajstore.errors import StoreUnavailable

SQLITE_SCHEMA = "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name"
PG_SCHEMA = {
    "columns": "SELECT table_name, column_name, ordinal_position, data_type, is_nullable, column_default "
               "FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1, 3",
    "indexes": "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1, 2",
    "views": "SELECT viewname, definition FROM pg_views WHERE schemaname = 'public' ORDER BY 1",
    "constraints": "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint "
                   "WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2",
    "grants": "SELECT grantee, table_name, privilege_type FROM information_schema.role_table_grants "
              "WHERE table_schema = 'public' ORDER BY 1, 2, 3",
    "routines": "SELECT proname, pg_get_functiondef(oid) FROM pg_proc WHERE pronamespace = 'public'::regnamespace "
                "ORDER BY 1",
    "sequences": "SELECT sequencename, start_value, last_value FROM pg_sequences WHERE schemaname = 'public' "
                 "ORDER BY 1",
    "default_acl": "SELECT defaclrole::regrole::text, defaclobjtype, defaclacl::text FROM pg_default_acl ORDER BY 1, 2",
    "schema_acl": "SELECT nspname, nspacl::text FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%' ORDER BY 1",
    # what CREATE DATABASE ... TEMPLATE does not copy: the database's own grants and settings
    "database_acl": "SELECT datacl::text FROM pg_database WHERE datname = current_database()",
    "database_settings": "SELECT setrole, setconfig::text FROM pg_db_role_setting s JOIN pg_database d "
                         "ON d.oid = s.setdatabase WHERE d.datname = current_database() ORDER BY 1",
}


def fingerprint(store: trajstore.Store) -> dict:
    with store.log.write_engine.connect() as conn:
        if conn.dialect.name == "sqlite":
            found = {"schema": conn.execute(text(SQLITE_SCHEMA)).all(),
                     "journal_mode": conn.execute(text("PRAGMA journal_mode")).scalar_one()}
        else:
            found = {name: conn.execute(text(sql)).all() for name, sql in PG_SCHEMA.items()}
        found["version"] = conn.execute(text("SELECT version_num FROM alembic_version")).all()
        found["settings"] = conn.execute(text("SELECT name FROM store_settings ORDER BY name")).all()
        found["store_id"] = conn.execute(text("SELECT value FROM store_settings WHERE name = 'store_id'")).scalar_one()
    return found


@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_a_store_from_the_migrated_template_is_the_store_a_first_connect_makes(backend, migrated_template,
                                                                                 tmp_path, request):
    if backend == "sqlite":
        urls = [f"sqlite:///{tmp_path / 'fresh.db'}", migrated_template.sqlite_copy(tmp_path / "copy.db"),
                migrated_template.sqlite_copy(tmp_path / "copy2.db")]
    else:
        cluster = request.getfixturevalue("pg_cluster")
        urls = [request.getfixturevalue("fresh_pg_url"), request.getfixturevalue("migrated_pg_url"),
                cluster.create_database(template=migrated_template.pg_database())]
        request.addfinalizer(lambda: cluster.drop_database(urls[2].rsplit("/", 1)[1]))
    prints = []
    for i, url in enumerate(urls):
        with trajstore.connect(url, payload=str(tmp_path / f"payload{i}")) as store:
            prints.append(fingerprint(store))
    ids = [p.pop("store_id") for p in prints]
    assert len(set(ids)) == 3, ids  # each copy makes its own id at its first connect
    assert prints[0]["version"] and prints[0]["schema" if backend == "sqlite" else "columns"]
    assert prints[1] == prints[0]
    assert prints[2] == prints[0]


def test_a_store_url_without_the_store_fixture_is_empty(store_url):
    with pytest.raises(StoreUnavailable, match="no store at"):
        trajstore.connect(store_url, create=False)


def test_with_the_store_fixture_the_url_holds_the_stores_schema_from_the_start(store_url, store, tmp_path):
    # the URL's database was migrated before `store` connected: a second opener needs no migration
    with trajstore.connect(store_url, migrate=False, create=False) as again:
        assert fingerprint(again) == fingerprint(store)
