"""keel.infra: the adapters every service shares.

``bus`` (NATS JetStream), ``store`` (the PostgreSQL event store, migrations from ``keel.migrations``),
``outbox`` (durable publishing for executors), ``config`` (settings), ``runner`` and ``service`` (the one
service host), ``embedded`` (the embedded NATS and PostgreSQL servers of ``keel up``).
"""
