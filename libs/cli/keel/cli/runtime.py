"""The runtime commands: the embedded servers and the services.

    keel up [--no-services]          start the embedded NATS + PostgreSQL (unless external ones are
                                     configured), migrate, start every service in the background
    keel down | status               stop them all; what is running (JSON)
    keel migrate                     bring the event store schema up to date
    keel service NAME                run one service in the foreground (recorder, controller,
                                     checkpoint-broker, actuator, analyzer, hot-update)

``keel up`` starts each service as ``python -m keel.cli.main service NAME`` in its own session, with its
pid in ``<home>/services/NAME.pid`` and its output in ``NAME.log``; it returns once every service has
written its ready file (``KEEL_SERVICE_READY_FILE``: it consumes live) or fails with the log tail of one
that died.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keel.cli.common import CliError, Subparsers, endpoints
from keel.cluster.local import cluster_dir
from keel.infra.config import Settings

if TYPE_CHECKING:
    from keel.infra.embedded import EmbeddedRuntime

SERVICES = ("recorder", "controller", "checkpoint-broker", "actuator", "analyzer", "hot-update")


def register(sub: Subparsers) -> None:
    up = sub.add_parser("up", help="start the embedded NATS and PostgreSQL, migrate, start the services")
    up.add_argument("--no-services", action="store_true", help="start only the servers")
    up.set_defaults(func=cmd_up)
    sub.add_parser("down", help="stop the services and the embedded servers").set_defaults(func=cmd_down)
    sub.add_parser("status", help="what is running").set_defaults(func=cmd_status)
    sub.add_parser("migrate", help="bring the event store schema up to date").set_defaults(func=cmd_migrate)

    service = sub.add_parser("service", help="run one service in the foreground")
    service.add_argument("name", choices=SERVICES)
    service.add_argument("--cluster-dir", default=None, help="actuator: the local cluster it acts on (default <home>/cluster)")
    service.set_defaults(func=cmd_service)


def runtime_for(settings: Settings) -> EmbeddedRuntime:
    from keel.infra.embedded import EmbeddedRuntime

    return EmbeddedRuntime(
        home=settings.home,
        nats_port=settings.nats.port,
        nats_monitor_port=settings.nats.monitor_port,
        postgres_port=settings.postgres.port,
        sync_always=settings.nats.sync_always,
    )


# -- up / down / status ---------------------------------------------------------------------------


def _pid_file(settings: Settings, service: str) -> Path:
    return settings.home / "services" / f"{service}.pid"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    cmdline = Path(f"/proc/{pid}/cmdline")
    return not cmdline.exists() or b"keel" in cmdline.read_bytes()


def _service_pid(settings: Settings, service: str) -> int | None:
    path = _pid_file(settings, service)
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _pid_alive(pid) else None


async def administer_streams(nats_url: str, settings: Settings) -> None:
    """Create the streams, or bring existing ones to these settings (only the administering commands do)."""
    from keel.infra.bus import Bus

    bus = await Bus.connect(nats_url, settings.bus, name="keel-admin", administer=True)
    await bus.close()


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    state: dict[str, Any] = {}
    if not (settings.nats_url and settings.database_url):
        state = runtime_for(settings).up()
    nats_url, database_url = endpoints(settings)
    from keel.infra.store import run_migrations

    run_migrations(database_url, settings.db_schema)
    asyncio.run(administer_streams(nats_url, settings))
    services_dir = settings.home / "services"
    services_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, KEEL_NATS_URL=nats_url, KEEL_DATABASE_URL=database_url, KEEL_HOME=str(settings.home))
    started: dict[str, subprocess.Popen] = {}
    for service in SERVICES if not args.no_services else ():
        if _service_pid(settings, service):
            continue
        log_path = services_dir / f"{service}.log"
        ready_file = services_dir / f"{service}.ready"
        ready_file.unlink(missing_ok=True)
        with open(log_path, "ab") as log_file:
            command = [sys.executable, "-m", "keel.cli.main"]
            if args.config:
                command += ["--config", args.config]
            process = subprocess.Popen(
                [*command, "service", service],
                env={**env, "KEEL_SERVICE_READY_FILE": str(ready_file)},
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        _pid_file(settings, service).write_text(f"{process.pid}\n")
        started[service] = process
    _wait_until_ready(settings, started, timeout_s=60.0)
    print(json.dumps({"nats_url": nats_url, "database_url": database_url, **_status(settings, state)}, indent=2, default=str))
    return 0


def _wait_until_ready(settings: Settings, started: dict[str, subprocess.Popen], timeout_s: float) -> None:
    """Return once every started service consumes live; raise with its log tail if one dies."""
    deadline = time.monotonic() + timeout_s
    waiting = dict(started)
    while waiting:
        for service, process in list(waiting.items()):
            if (settings.home / "services" / f"{service}.ready").exists():
                del waiting[service]
            elif process.poll() is not None:
                log_tail = (settings.home / "services" / f"{service}.log").read_text(errors="replace")[-2000:]
                raise CliError(f"service {service} exited with status {process.returncode} while starting:\n{log_tail}")
        if waiting and time.monotonic() > deadline:
            raise CliError(f"services not ready after {timeout_s:.0f} s: {', '.join(waiting)} (see {settings.home / 'services'})")
        time.sleep(0.05)


def _status(settings: Settings, runtime_state: dict[str, Any] | None = None) -> dict[str, Any]:
    services = {}
    for service in SERVICES:
        pid = _service_pid(settings, service)
        services[service] = {"running": pid is not None, "pid": pid}
    result: dict[str, Any] = {"services": services}
    if not (settings.nats_url and settings.database_url):
        result["runtime"] = runtime_state or runtime_for(settings).status()
    return result


def cmd_down(args: argparse.Namespace, settings: Settings) -> int:
    for service in SERVICES:
        pid = _service_pid(settings, service)
        if pid:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        _pid_file(settings, service).unlink(missing_ok=True)
    if not (settings.nats_url and settings.database_url):
        runtime_for(settings).down()
    print("keel: down")
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    status = _status(settings)
    print(json.dumps(status, indent=2, default=str))
    return 0


# -- services -------------------------------------------------------------------------------------


def cmd_service(args: argparse.Namespace, settings: Settings) -> int:
    from keel.infra.service import run_service

    nats_url, database_url = endpoints(settings)
    if args.name == "recorder":
        from keel.recorder.main import serve
    elif args.name == "controller":
        from keel.controller.main import serve
    elif args.name == "checkpoint-broker":
        from keel.checkpoint_broker.main import serve
    elif args.name == "analyzer":
        from keel.analyzer.main import serve
    elif args.name == "hot-update":
        from keel.hot_update.main import serve
    elif args.name == "actuator":
        from keel.actuator.main import serve as serve_actuator

        directory = cluster_dir(settings, getattr(args, "cluster_dir", None))

        def serve(settings: Settings, nats_url: str, database_url: str, stop: asyncio.Event,
                  on_ready: Callable[[], None] = lambda: None) -> Coroutine[Any, Any, None]:
            return serve_actuator(settings, nats_url, directory, stop, on_ready)
    else:  # argparse's choices make this unreachable
        raise CliError(f"unknown service {args.name}")
    run_service(serve, settings, nats_url, database_url)
    return 0


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from keel.infra.store import run_migrations

    nats_url, database_url = endpoints(settings)
    run_migrations(database_url, settings.db_schema)
    asyncio.run(administer_streams(nats_url, settings))
    print(f"keel: schema {settings.db_schema} is at the latest revision; streams {settings.bus.stream} and "
          f"{settings.bus.dlq_stream} have these settings")
    return 0
