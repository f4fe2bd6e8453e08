"""``keel service actuator --cluster-dir DIR``: carry out evictions and standby refills on a local cluster."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from keel.actuator.adapter import ActuatorService
from keel.actuator.local import LocalActuator
from keel.core.bus import Bus
from keel.core.config import Settings

log = logging.getLogger(__name__)


async def serve(settings: Settings, nats_url: str, cluster_dir: Path, stop: asyncio.Event,
                on_ready: Callable[[], None] = lambda: None) -> None:
    bus = await Bus.connect(nats_url, settings.bus, name="keel-actuator")
    service = ActuatorService(bus, LocalActuator(cluster_dir))
    try:
        await service.start()
        log.info("actuator (local, %s): consuming commands", cluster_dir)
        on_ready()
        await service.run(stop)
    finally:
        await bus.close()
