"""The one service host: how every service is started, run and stopped (``keel service NAME`` or the
service's own console script ``keel-NAME``).

- ``serve_service``: the start-up every service shares: open the event store (services that read the log)
  as the service's own database role and check that its schema is at the latest revision (services have no
  DDL rights: ``keel migrate`` migrates; a service on an older schema stops and says so), load (on first
  start create) its signing key and the keyring (``keel.infra.signing``: identity and role are the service's
  name), connect to NATS as its own identity, build the service, ``start()`` it (rebuild its
  state from the log, bind its consumer on ``keel.infra.consumer``), say it is ready, ``run(stop)``.
- ``run_service``: signals (graceful once ready, at once while starting) and the ready file ``keel up``
  waits for.
- ``service_main``: the console script: settings, the servers' URLs (the database's for the service's role,
  ``keel.infra.dbroles.SERVICE_ROLES``), exit status 2 on a configuration error or an unmigrated schema.
- ``RunnerService``: a decider service with no I/O of its own (the analyzer, hot-update).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from keel.infra.bus import Bus
from keel.infra.config import ConfigError, Settings, SnapshotSettings, load_settings, resolve_endpoints
from keel.infra.dbroles import MIGRATE, service_role
from keel.infra.dburl import redact
from keel.infra.nats_auth import ADMIN, bus_settings_for
from keel.infra.runner import DeciderRunner
from keel.infra.signing import service_signing
from keel.infra.store import (
    DatabaseNotUsable,
    EventStore,
    SchemaNotCurrent,
    check_schema_current,
    create_engine,
    run_migrations,
)
from keel.kernel.decider import Decider

log = logging.getLogger(__name__)

S = TypeVar("S")


class Service(Protocol):
    """What the host runs: ``start()`` (cold start: rebuild state, bind the consumer), then ``run(stop)``
    until ``stop`` is set (the batch in hand is finished and acknowledged first)."""

    async def start(self) -> None: ...

    async def run(self, stop: asyncio.Event) -> None: ...


class RunnerService(Generic[S]):
    """A decider service with no I/O of its own: the shared runner alone (cold start from the store, then
    live events). ``start()``, then ``run(stop)``."""

    def __init__(self, decider: Decider[S], bus: Bus, store: EventStore | None, *, fetch_timeout_s: float = 0.2,
                 snapshots: SnapshotSettings | None = None) -> None:
        self.decider = decider
        self.runner: DeciderRunner[S] = DeciderRunner(decider, bus, store, fetch_timeout_s=fetch_timeout_s,
                                                      snapshots=snapshots)

    @property
    def state(self) -> S:
        return self.runner.session.state

    async def start(self) -> None:
        await self.runner.start()

    async def run(self, stop: asyncio.Event) -> None:
        await self.runner.run(stop)


async def serve_service(
    name: str,
    build: Callable[[Bus, EventStore | None], Service],
    settings: Settings,
    nats_url: str,
    database_url: str | None,
    stop: asyncio.Event,
    on_ready: Callable[[], None] = lambda: None,
    describe: Callable[[Any], str] = lambda _: "",
) -> None:
    """The one start-up of every service: open the event store (when ``database_url`` is given: every service
    but the actuator, which reads no log) and check its schema is at the latest revision (``SchemaNotCurrent``
    otherwise: run ``keel migrate``), connect to NATS, ``build`` the service, ``start()`` it, call
    ``on_ready`` once it consumes live, ``run(stop)``; the bus and the engine are closed whatever happens.
    ``describe``: an extra clause for the "consuming live" log line."""
    signing = await asyncio.to_thread(service_signing, settings, name, name)
    engine = None
    if database_url is not None:
        engine = create_engine(database_url, settings.db_schema)
    try:
        if engine is not None:
            await check_schema_current(engine, settings.db_schema)
        bus = await Bus.connect(nats_url, bus_settings_for(settings, name), name=f"keel-{name}", signing=signing)
        try:
            service = build(bus, EventStore(engine) if engine is not None else None)
            await service.start()
            extra = describe(service)
            log.info("%s: started%s; consuming live", name, f"; {extra}" if extra else "")
            on_ready()
            await service.run(stop)
        finally:
            await bus.close()
    finally:
        if engine is not None:
            await engine.dispose()


ServeFn = Callable[[Settings, str, str, asyncio.Event, Callable[[], None]], Coroutine[Any, Any, None]]
"""``serve(settings, nats_url, database_url, stop, on_ready)``: what every service's ``main`` module exports."""

READY_FILE_ENV = "KEEL_SERVICE_READY_FILE"
ALIVE_INTERVAL_S = 10.0
"""How often a ready service touches its ready file from its event loop: a file older than a few intervals means
the loop is wedged (Kubernetes' liveness probe, infra/terraform, restarts the pod after 60 s)."""


def run_service(serve: ServeFn, settings: Settings, nats_url: str, database_url: str) -> None:
    """Run ``serve`` in the foreground until SIGTERM or SIGINT; write ``$KEEL_SERVICE_READY_FILE`` (this
    process's pid) once it consumes live, so a supervisor (``keel up``, a readiness probe) knows it is ready,
    then touch it every ``ALIVE_INTERVAL_S`` from the event loop, so a liveness probe can tell a wedged loop.

    A signal after start-up stops the service gracefully (the batch in hand is finished and acknowledged).
    A signal during start-up (still connecting to a server that does not answer, migrating, rebuilding
    state) cancels it: nothing has been consumed yet, so nothing is lost, and the process exits at once
    instead of waiting for a server that may never come."""
    ready_file = os.environ.get(READY_FILE_ENV)
    if ready_file:
        # A file left by this container's previous process (its /tmp outlives a restart) would read as ready
        # before this one is.
        Path(ready_file).unlink(missing_ok=True)
    ready = asyncio.Event()

    def on_ready() -> None:
        ready.set()
        if ready_file:
            Path(ready_file).write_text(f"{os.getpid()}\n")

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        service = asyncio.create_task(serve(settings, nats_url, database_url, stop, on_ready))
        stopped = asyncio.create_task(stop.wait())
        alive = asyncio.create_task(_touch_while_running(ready, ready_file))
        await asyncio.wait({service, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not service.done() and not ready.is_set():
            log.info("stopped while starting: giving up the start-up")
            service.cancel()
        stopped.cancel()
        alive.cancel()
        try:
            await service
        except asyncio.CancelledError:
            pass

    asyncio.run(runner())


async def _touch_while_running(ready: asyncio.Event, ready_file: str | None) -> None:
    if not ready_file:
        return
    await ready.wait()
    path = Path(ready_file)
    while True:
        await asyncio.sleep(ALIVE_INTERVAL_S)
        try:
            path.touch()
        except OSError as exc:  # a probe reads it; the service itself does not depend on it
            log.warning("cannot touch the ready file %s: %s", path, exc)


def service_main(name: str, serve: ServeFn, argv: Sequence[str] | None = None, *, needs_database: bool = True) -> int:
    """The console script of one service distribution (``keel-controller`` and the like): settings from
    ``--config``/``KEEL_CONFIG`` and ``KEEL_*``, the servers from ``KEEL_NATS_URL``/``KEEL_DATABASE_URL``
    (or a running ``keel up``), then ``run_service``. Exit status 2 on a configuration error.
    ``needs_database=False``: a service that reads no log (the actuator) needs only ``KEEL_NATS_URL``."""
    parser = argparse.ArgumentParser(prog=f"keel-{name}", description=f"Run Keel's {name} service until SIGTERM.")
    parser.add_argument("--config", help="YAML settings file (also KEEL_CONFIG)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = load_settings(Path(args.config) if args.config else None)
        if not needs_database and settings.nats_url:
            nats_url, database_url = settings.nats_url, ""
        elif not needs_database:
            nats_url, database_url = resolve_endpoints(settings, None)[0], ""
        else:
            nats_url, database_url = resolve_endpoints(settings, service_role(name))
    except ConfigError as exc:
        print(f"keel-{name}: {exc}", file=sys.stderr)
        return 2
    try:
        run_service(serve, settings, nats_url, database_url)
    except SchemaNotCurrent as exc:
        print(f"keel-{name}: {exc}", file=sys.stderr)
        return 2
    return 0


def migrate_main(argv: Sequence[str] | None = None) -> int:
    """``keel-migrate``: bring the event store's schema to the latest revision (as the ``migrate`` role, the
    only one with DDL rights; it then grants every other role its privileges) and the streams to these
    settings (the only command besides ``keel migrate`` and ``keel up`` that changes an existing stream),
    then exit (0 done, 1 a database it cannot use, 2 a configuration error). Services do not migrate: they stop on an older schema."""
    parser = argparse.ArgumentParser(prog="keel-migrate", description="Bring Keel's event store schema up to date.")
    parser.add_argument("--config", help="YAML settings file (also KEEL_CONFIG)")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(Path(args.config) if args.config else None)
        nats_url, database_url = resolve_endpoints(settings, MIGRATE)
    except ConfigError as exc:
        print(f"keel-migrate: {exc}", file=sys.stderr)
        return 2
    log.info("migrating schema %s at %s", settings.db_schema, redact(database_url))
    try:
        run_migrations(database_url, settings.db_schema)
    except DatabaseNotUsable as exc:
        print(f"keel-migrate: {exc}", file=sys.stderr)
        return 1

    async def administer() -> None:
        bus = await Bus.connect(nats_url, bus_settings_for(settings, ADMIN), name="keel-migrate", administer=True)
        await bus.close()

    asyncio.run(administer())
    print(f"keel-migrate: schema {settings.db_schema} is at the latest revision; the streams have these settings")
    return 0
