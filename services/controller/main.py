"""``keel service controller``: run the controller decider through the shared runner until SIGTERM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from keel.controller.core import ControllerDecider, ControllerPolicy
from keel.core.bus import Bus
from keel.core.config import Settings
from keel.core.runner import DeciderRunner
from keel.core.store import EventStore, create_engine, run_migrations

log = logging.getLogger(__name__)


def decider_from_settings(settings: Settings) -> ControllerDecider:
    policy = ControllerPolicy(
        command_ttl=settings.controller.command_ttl, observe_only=settings.controller.observe_only
    )
    return ControllerDecider(policy)


async def serve(
    settings: Settings, nats_url: str, database_url: str, stop: asyncio.Event, on_ready: Callable[[], None] = lambda: None
) -> None:
    """Run until ``stop`` is set; ``on_ready`` is called once the service consumes live."""
    await asyncio.to_thread(run_migrations, database_url, settings.db_schema)
    bus = await Bus.connect(nats_url, settings.bus, name="keel-controller")
    engine = create_engine(database_url, settings.db_schema)
    runner = DeciderRunner(decider_from_settings(settings), bus, EventStore(engine))
    try:
        await runner.start()
        log.info("controller: state rebuilt from the log; consuming live")
        on_ready()
        await runner.run(stop)
    finally:
        await bus.close()
        await engine.dispose()
