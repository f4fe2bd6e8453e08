"""``keel service recorder``: wire the recorder to NATS and Postgres and run it until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from keel.infra.bus import Bus
from keel.infra.config import Settings
from keel.infra.service import service_main
from keel.infra.store import create_engine, run_migrations
from keel.recorder.adapter import Recorder

log = logging.getLogger(__name__)


async def serve(
    settings: Settings, nats_url: str, database_url: str, stop: asyncio.Event, on_ready: Callable[[], None] = lambda: None
) -> None:
    """Run until ``stop`` is set; ``on_ready`` is called once the service consumes live."""
    await asyncio.to_thread(run_migrations, database_url, settings.db_schema)
    bus = await Bus.connect(nats_url, settings.bus, name="keel-recorder")
    engine = create_engine(database_url, settings.db_schema)
    recorder = Recorder(bus, engine, settings.recorder)
    try:
        await recorder.start()
        log.info("recorder: consuming %s into %s", bus.events_subjects, settings.db_schema)
        on_ready()
        await recorder.run(stop)
    finally:
        await bus.close()
        await engine.dispose()


def main() -> int:
    """``keel-recorder``: run this service alone (``KEEL_NATS_URL``, ``KEEL_DATABASE_URL``, ``KEEL_*`` settings)."""
    return service_main("recorder", serve)


if __name__ == "__main__":
    raise SystemExit(main())
