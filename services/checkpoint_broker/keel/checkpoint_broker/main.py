"""``keel service checkpoint-broker``: run the checkpoint broker until SIGTERM."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from keel.checkpoint_broker.adapter import CheckpointBroker, decider_from_settings
from keel.infra.config import Settings
from keel.infra.service import serve_service, service_main

__all__ = ["serve", "decider_from_settings"]


async def serve(
    settings: Settings,
    nats_url: str,
    database_url: str,
    stop: asyncio.Event,
    on_ready: Callable[[], None] = lambda: None,
) -> None:
    """Run until ``stop`` is set; ``on_ready`` is called once the service consumes live."""
    await serve_service("checkpoint-broker", lambda bus, store: CheckpointBroker(bus, store, settings), settings,
                        nats_url, database_url, stop, on_ready,
                        describe=lambda broker: f"persistent tier at {broker.persist_root}")


def main() -> int:
    """``keel-checkpoint-broker``: run this service alone (``KEEL_NATS_URL``, ``KEEL_DATABASE_URL``, ``KEEL_*`` settings)."""
    return service_main("checkpoint-broker", serve)


if __name__ == "__main__":
    raise SystemExit(main())
