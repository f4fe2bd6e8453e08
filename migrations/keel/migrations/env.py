"""Alembic environment for Keel's event store.

Run through ``keel.infra.store.run_migrations(dsn, schema)`` (or ``keel migrate``), which passes the
DSN and target schema as config attributes. Every table lives in that schema; the version table too,
so each test schema migrates independently. After the revisions, the non-owner roles get exactly their
privileges in the schema (``keel.infra.store.grant_privileges``), in the same transaction.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import pool, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from keel.infra.store import check_database, engine_options, grant_privileges, metadata

config = context.config
dsn = config.attributes.get("keel_dsn") or config.get_main_option("sqlalchemy.url")
schema = config.attributes.get("keel_schema", "public")


def _run(connection: Connection) -> None:
    check_database(connection)
    # CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema exists: ask first, so a
    # migrating role without it can migrate a schema an administrator made for it.
    exists = connection.execute(text("SELECT 1 FROM pg_namespace WHERE nspname = :s"), {"s": schema}).first()
    if exists is None:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    connection.execute(text(f'SET search_path TO "{schema}"'))
    connection.commit()
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table_schema=schema,
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()
    grant_privileges(connection, schema)


async def _main() -> None:
    if dsn is None:
        raise ValueError("no database URL: pass keel_dsn (keel migrate does) or set sqlalchemy.url")
    url, connect_args = engine_options(dsn)
    engine = create_async_engine(url, poolclass=pool.NullPool, connect_args=connect_args)
    async with engine.connect() as connection:
        await connection.run_sync(_run)
        await connection.commit()
    await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run `keel migrate` against a server")
asyncio.run(_main())
