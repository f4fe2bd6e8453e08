"""Alembic environment for Keel's event store.

Run through ``keel.infra.store.run_migrations(dsn, schema)`` (or ``keel migrate``), which passes the
DSN and target schema as config attributes. Every table lives in that schema; the version table too,
so each test schema migrates independently.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import pool, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from keel.infra.store import async_dsn, metadata

config = context.config
dsn = config.attributes.get("keel_dsn") or config.get_main_option("sqlalchemy.url")
schema = config.attributes.get("keel_schema", "public")


def _run(connection: Connection) -> None:
    connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
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


async def _main() -> None:
    if dsn is None:
        raise ValueError("no database URL: pass keel_dsn (keel migrate does) or set sqlalchemy.url")
    engine = create_async_engine(async_dsn(dsn), poolclass=pool.NullPool)
    async with engine.connect() as connection:
        await connection.run_sync(_run)
        await connection.commit()
    await engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run `keel migrate` against a server")
asyncio.run(_main())
