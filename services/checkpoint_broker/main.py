"""``keel service checkpoint-broker``: run the checkpoint broker until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from keel.checkpoint_broker.adapter import CheckpointBroker, decider_from_settings
from keel.core.bus import Bus
from keel.core.config import Settings
from keel.core.store import EventStore, create_engine, run_migrations

__all__ = ["serve", "decider_from_settings"]

log = logging.getLogger(__name__)


async def serve(
    settings: Settings,
    nats_url: str,
    database_url: str,
    stop: asyncio.Event,
    on_ready: Callable[[], None] = lambda: None,
) -> None:
    """Run until ``stop`` is set; ``on_ready`` is called once the service consumes live."""
    await asyncio.to_thread(run_migrations, database_url, settings.db_schema)
    bus = await Bus.connect(nats_url, settings.bus, name="keel-checkpoint-broker")
    engine = create_engine(database_url, settings.db_schema)
    broker = CheckpointBroker(bus, EventStore(engine), settings)
    try:
        await broker.start()
        log.info("checkpoint-broker: state rebuilt from the log; persistent tier at %s; consuming live",
                 broker.persist_root)
        on_ready()
        await broker.run(stop)
    finally:
        await bus.close()
        await engine.dispose()
