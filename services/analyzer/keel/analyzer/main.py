"""``keel service analyzer``: run the analyzer decider through the shared runner until SIGTERM."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from keel.analyzer.adapter import Analyzer, decider_from_settings
from keel.infra.config import Settings
from keel.infra.service import serve_service, service_main

__all__ = ["serve", "decider_from_settings"]


async def serve(
    settings: Settings, nats_url: str, database_url: str, stop: asyncio.Event, on_ready: Callable[[], None] = lambda: None
) -> None:
    """Run until ``stop`` is set; ``on_ready`` is called once the service consumes live."""
    await serve_service("analyzer", lambda bus, store: Analyzer(bus, store, settings), settings, nats_url,
                        database_url, stop, on_ready)


def main() -> int:
    """``keel-analyzer``: run this service alone (``KEEL_NATS_URL``, ``KEEL_DATABASE_URL``, ``KEEL_*`` settings)."""
    return service_main("analyzer", serve)


if __name__ == "__main__":
    raise SystemExit(main())
