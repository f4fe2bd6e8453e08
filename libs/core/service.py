"""The shared start-up of a decider service (``keel service NAME``): migrations, bus, store, cold start.

Every decider service is run the same way: bring the schema up to date, connect to NATS, open the
event store, rebuild the decider's state from the log (``start``), say so, then consume live until
``stop`` (``run``); the bus and the engine are closed whatever happens.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from keel.core.bus import Bus
from keel.core.config import Settings
from keel.core.decider import Decider
from keel.core.runner import DeciderRunner
from keel.core.store import EventStore, create_engine, run_migrations

log = logging.getLogger(__name__)

S = TypeVar("S")


class DeciderService(Protocol):
    async def start(self) -> None: ...

    async def run(self, stop: asyncio.Event) -> None: ...


class RunnerService(Generic[S]):
    """A decider service with no I/O of its own: the shared runner alone (cold start from the store, then
    live events). ``start()``, then ``run(stop)``."""

    def __init__(self, decider: Decider[S], bus: Bus, store: EventStore | None, *, fetch_timeout_s: float = 0.2) -> None:
        self.decider = decider
        self.runner: DeciderRunner[S] = DeciderRunner(decider, bus, store, fetch_timeout_s=fetch_timeout_s)

    @property
    def state(self) -> S:
        return self.runner.session.state

    async def start(self) -> None:
        await self.runner.start()

    async def run(self, stop: asyncio.Event) -> None:
        await self.runner.run(stop)


async def serve_decider(
    name: str,
    build: Callable[[Bus, EventStore], DeciderService],
    settings: Settings,
    nats_url: str,
    database_url: str,
    stop: asyncio.Event,
    on_ready: Callable[[], None] = lambda: None,
    describe: Callable[[Any], str] = lambda _: "",
) -> None:
    """Run the service ``build`` makes until ``stop`` is set; ``on_ready`` once it consumes live.
    ``describe``: an extra clause for the "consuming live" log line."""
    await asyncio.to_thread(run_migrations, database_url, settings.db_schema)
    bus = await Bus.connect(nats_url, settings.bus, name=f"keel-{name}")
    engine = create_engine(database_url, settings.db_schema)
    service = build(bus, EventStore(engine))
    try:
        await service.start()
        extra = describe(service)
        log.info("%s: state rebuilt from the log%s; consuming live", name, f"; {extra}" if extra else "")
        on_ready()
        await service.run(stop)
    finally:
        await bus.close()
        await engine.dispose()
