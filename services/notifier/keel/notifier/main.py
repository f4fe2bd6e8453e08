"""``keel service notifier``: deliver notifications to the configured destinations until SIGTERM."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from keel.infra.config import Settings
from keel.infra.service import serve_service, service_main
from keel.notifier.adapter import NotifierService, destinations_from_settings


async def serve(settings: Settings, nats_url: str, database_url: str, stop: asyncio.Event,
                on_ready: Callable[[], None] = lambda: None) -> None:
    """Run until ``stop`` is set; ``on_ready`` is called once the service consumes live. Needs no database."""
    destinations = destinations_from_settings(settings.notifier)  # a bad secret file stops the start, named
    names = ", ".join(f"{d.name} ({d.kind})" for d in destinations) or "none: nothing is delivered"
    await serve_service("notifier", lambda bus, _store: NotifierService(bus, destinations, settings.notifier), settings,
                        nats_url, None, stop, on_ready, describe=lambda _: f"destinations {names}")


def main() -> int:
    """``keel-notifier``: run this service alone (``KEEL_NATS_URL``, ``KEEL_NOTIFIER__*`` or a YAML file)."""
    return service_main("notifier", serve, needs_database=False)


if __name__ == "__main__":
    raise SystemExit(main())
