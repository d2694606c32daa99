"""Alembic environment: target metadata is trajstore.schema.metadata.

The connection is passed in by ``trajstore.log._migrate`` (config attribute
``connection``); from the command line, give ``-x url=...``.
"""

from __future__ import annotations

from alembic import context

from trajstore.schema import metadata

config = context.config


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("give the database: alembic -x url=sqlite:///store.db upgrade head")
    from trajstore.log._registry import backend_of

    engine, _ = backend_of(url).make_engines(url)  # the store's engine: PostgreSQL timeouts, SQLite locking
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()
