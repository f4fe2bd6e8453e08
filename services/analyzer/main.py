"""``keel service analyzer``: run the analyzer decider through the shared runner until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from keel.analyzer.adapter import Analyzer, decider_from_settings
from keel.core.bus import Bus
from keel.core.config import Settings
from keel.core.store import EventStore, create_engine, run_migrations

__all__ = ["serve", "decider_from_settings"]

log = logging.getLogger(__name__)


async def serve(
    settings: Settings, nats_url: str, database_url: str, stop: asyncio.Event, on_ready: Callable[[], None] = lambda: None
) -> None:
    """Run until ``stop`` is set; ``on_ready`` is called once the service consumes live."""
    await asyncio.to_thread(run_migrations, database_url, settings.db_schema)
    bus = await Bus.connect(nats_url, settings.bus, name="keel-analyzer")
    engine = create_engine(database_url, settings.db_schema)
    analyzer = Analyzer(bus, EventStore(engine), settings)
    try:
        await analyzer.start()
        log.info("analyzer: state rebuilt from the log; consuming live")
        on_ready()
        await analyzer.run(stop)
    finally:
        await bus.close()
        await engine.dispose()
