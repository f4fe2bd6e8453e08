"""``keel service actuator --cluster-dir DIR``: carry out evictions and standby refills on a local cluster."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from keel.actuator.adapter import ActuatorService
from keel.actuator.local import LocalActuator
from keel.infra.config import Settings
from keel.infra.service import serve_service, service_main

log = logging.getLogger(__name__)


async def serve(settings: Settings, nats_url: str, cluster_dir: Path, stop: asyncio.Event,
                on_ready: Callable[[], None] = lambda: None) -> None:
    """Carry out commands on the local cluster in ``cluster_dir`` until ``stop`` is set."""
    await serve_service("actuator", lambda bus, _store: ActuatorService(bus, LocalActuator(cluster_dir)), settings,
                        nats_url, None, stop, on_ready, describe=lambda _: f"local cluster in {cluster_dir}")


def main() -> int:
    """``keel-actuator``: the local actuator over the cluster in ``$KEEL_CLUSTER_DIR`` (default
    ``<home>/cluster``). It starts standby agents with ``keel run``, so the ``keel`` command (keel-cli)
    must be installed beside it: the local actuator runs on the machine of a full install."""
    import os

    from keel.cluster.local import cluster_dir

    def serve_local(settings: Settings, nats_url: str, _database_url: str, stop: asyncio.Event,
                    on_ready: Callable[[], None]) -> Coroutine[Any, Any, None]:
        return serve(settings, nats_url, cluster_dir(settings, os.environ.get("KEEL_CLUSTER_DIR")), stop, on_ready)

    return service_main("actuator", serve_local, needs_database=False)


if __name__ == "__main__":
    raise SystemExit(main())
