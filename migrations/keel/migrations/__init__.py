"""keel.migrations: the Alembic migrations of the event store and read models, shipped as package data.
``keel.infra.store.run_migrations`` points Alembic at this folder."""
