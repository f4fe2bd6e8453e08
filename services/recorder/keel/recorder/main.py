"""``keel service recorder``: wire the recorder to NATS and Postgres and run it until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from keel.infra.bus import Bus
from keel.infra.config import Settings
from keel.infra.service import serve_service, service_main
from keel.infra.store import EventStore
from keel.recorder.adapter import Recorder

log = logging.getLogger(__name__)


async def serve(
    settings: Settings, nats_url: str, database_url: str, stop: asyncio.Event, on_ready: Callable[[], None] = lambda: None
) -> None:
    """Run until ``stop`` is set; ``on_ready`` is called once the service consumes live."""

    def build(bus: Bus, store: EventStore | None) -> Recorder:
        assert store is not None  # the host opens the store whenever it is given a database
        return Recorder(bus, store.engine, settings.recorder)

    await serve_service("recorder", build, settings, nats_url, database_url, stop, on_ready,
                        describe=lambda recorder: f"recording {recorder.bus.events_subjects} into {settings.db_schema}")


def main() -> int:
    """``keel-recorder``: run this service alone (``KEEL_NATS_URL``, ``KEEL_DATABASE_URL``, ``KEEL_*`` settings)."""
    return service_main("recorder", serve)


if __name__ == "__main__":
    raise SystemExit(main())
