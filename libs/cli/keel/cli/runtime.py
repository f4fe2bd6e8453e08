"""The runtime commands: the embedded servers and the services.

    keel up [--no-services]          start the embedded NATS + PostgreSQL (unless external ones are
                                     configured), migrate, start every service in the background,
                                     supervised
    keel down | status               stop them all; what is running (JSON), restarts included
    keel migrate                     bring the event store schema up to date
    keel supervise                   run every service in the foreground, supervised
    keel service NAME                run one service in the foreground (recorder, controller,
                                     checkpoint-broker, actuator, analyzer, hot-update, notifier)

Database roles (``keel.infra.dbroles``): ``keel up`` and ``keel migrate`` migrate as the ``migrate`` role (the
embedded server creates every role with a generated password at start); each service resolves its own role's
URL when it starts (``keel service NAME``), so no password travels in an environment variable; ``keel up``
prints the database's address without credentials.

``keel up`` starts one background ``keel supervise`` (pid in ``<home>/services/supervisor.pid``, output
in ``supervisor.log``), which starts each service as ``python -m keel.cli.main service NAME`` in its own
session, with its pid in ``<home>/services/NAME.pid`` and its output in ``NAME.log``, and restarts one
that exits (``keel.infra.supervisor``: back-off, crash-loop give-up, ``ServiceRestarted`` events). ``keel
up`` returns once every service has written its ready file (``KEEL_SERVICE_READY_FILE``: it consumes
live) or fails with the log tail of one that died while starting.

It also supervises the HTTP API (``python -m keel.api.main``, unless ``api.serve_with_up`` is off) on
``api.listen_host:listen_port``, with the configured tokens and a local operator token that the first ``keel up``
makes (``<credentials>/api-operator.token``, 0600); ``keel up`` and ``keel status`` print its URL and that path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keel.cli.common import CliError, Subparsers, endpoints, login_name
from keel.cluster.local import cluster_dir
from keel.infra.api_auth import ApiToken
from keel.infra.config import Settings, credentials_path
from keel.infra.dbroles import MIGRATE, service_role
from keel.infra.dburl import redact

if TYPE_CHECKING:
    from keel.infra.embedded import EmbeddedRuntime

SERVICES = ("recorder", "controller", "checkpoint-broker", "actuator", "analyzer", "hot-update", "notifier")
"""The services ``keel up`` supervises (``keel service NAME``)."""
API = "api"
"""The HTTP API (``keel-api``, ``services/api``), which ``keel up`` supervises beside the services when
``api.serve_with_up`` (run as its own program: ``keel.api`` is the CLI's sibling, not below it)."""
API_TOKEN_FILE = "api-operator.token"
"""The local operator's API token, in the credentials folder (0600): made by the first ``keel up``."""


def supervised_names(settings: Settings) -> tuple[str, ...]:
    """What ``keel up`` runs under its supervisor: every service, and the API unless turned off."""
    return (*SERVICES, API) if settings.api.serve_with_up else SERVICES


def register(sub: Subparsers) -> None:
    up = sub.add_parser("up", help="start the embedded NATS and PostgreSQL, migrate, start the services")
    up.add_argument("--no-services", action="store_true", help="start only the servers")
    up.add_argument("--hosts", choices=("flat", "netns"), default="flat",
                    help="netns: make a host network (a bridge; needs root / CAP_NET_ADMIN) with a NATS cluster "
                         "of three servers on three hosts of their own, for `keel cluster up --hosts netns`; "
                         "`keel down` removes it")
    up.set_defaults(func=cmd_up)
    sub.add_parser("down", help="stop the services and the embedded servers").set_defaults(func=cmd_down)
    sub.add_parser("status", help="what is running").set_defaults(func=cmd_status)
    sub.add_parser("migrate", help="bring the event store schema up to date").set_defaults(func=cmd_migrate)
    sub.add_parser("supervise", help="run every service in the foreground, restarting those that exit "
                   "(what keel up starts in the background)").set_defaults(func=cmd_supervise)

    service = sub.add_parser("service", help="run one service in the foreground")
    service.add_argument("name", choices=SERVICES)
    service.add_argument("--cluster-dir", default=None, help="actuator: the local cluster it acts on (default <home>/cluster)")
    service.add_argument("--job", default=None, help="actuator with actuator.kind slurm: the Keel job whose standbys it "
                         "keeps (default $KEEL_JOB_ID)")
    service.set_defaults(func=cmd_service)


def on_host_network(settings: Settings) -> tuple[Settings, tuple[tuple[str, ...], ...]]:
    """``settings`` for the embedded NATS of ``keel up --hosts netns`` (unchanged without a host network, or
    when ``nats.hosts`` names the addresses): three servers, each on a host of its own (``netns.NATS_HOSTS``),
    with R3 streams, so that losing any one host loses no quorum; and each server's launcher (run in its host's
    namespace). A host network made without those hosts: one server on the control plane's address."""
    from keel.cluster import netns
    from keel.cluster.local import home_network

    network = home_network(settings.home)
    if settings.nats_url or network is None:
        return settings, ()
    if not all(any(h.name == name for h in network.hosts) for name in netns.NATS_HOSTS):
        if settings.nats.hosts:
            return settings, ()
        nats = settings.nats.model_copy(update={"hosts": [network.gateway]})
        return settings.model_copy(update={"nats": nats}), ()
    addresses = list(network.addresses(netns.NATS_HOSTS))
    if settings.nats.hosts and list(settings.nats.hosts) != addresses:
        return settings, ()  # the user's own addresses
    nats = settings.nats.model_copy(update={"hosts": addresses, "embedded_cluster_size": len(netns.NATS_HOSTS)})
    bus = settings.bus if (settings.bus.replicas or 1) > 1 else settings.bus.model_copy(update={"replicas": 3})
    launchers = tuple(tuple(netns.in_host(network, name, [])) for name in netns.NATS_HOSTS)
    return settings.model_copy(update={"nats": nats, "bus": bus}), launchers


def runtime_for(settings: Settings) -> EmbeddedRuntime:
    from keel.infra.embedded import EmbeddedRuntime
    from keel.infra.nats_auth import NatsScope

    settings, launchers = on_host_network(settings)
    return EmbeddedRuntime(
        home=settings.home,
        nats_port=settings.nats.port,
        nats_monitor_port=settings.nats.monitor_port,
        postgres_port=settings.postgres.port,
        sync_always=settings.nats.sync_always,
        credentials_dir=credentials_path(settings),
        nats_tls=settings.nats.tls,
        nats_scope=NatsScope(settings.bus.subject_prefix, settings.bus.stream, settings.bus.dlq_stream),
        nats_cluster_size=settings.nats.embedded_cluster_size,
        nats_cluster_port=settings.nats.cluster_port,
        nats_hosts=tuple(settings.nats.hosts),
        nats_launchers=launchers,
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
    from keel.infra.nats_auth import ADMIN, bus_settings_for

    bus = await Bus.connect(nats_url, bus_settings_for(settings, ADMIN), name="keel-admin", administer=True)
    await bus.close()


def _service_env(settings: Settings, nats_url: str) -> dict[str, str]:
    """The environment of the supervisor and its services: the servers, the home; a database URL only when one
    is configured (each service then resolves its own role's URL from the settings or the embedded runtime)."""
    env = dict(os.environ, KEEL_NATS_URL=nats_url, KEEL_HOME=str(settings.home))
    if settings.database_url:
        env["KEEL_DATABASE_URL"] = settings.database_url
    return env


def migrate(settings: Settings) -> str:
    """Bring the event store's schema up to date as the ``migrate`` role (which also grants every other role
    its privileges); returns the NATS URL."""
    from keel.infra.store import DatabaseNotUsable, run_migrations

    nats_url, database_url = endpoints(settings, MIGRATE)
    try:
        run_migrations(database_url, settings.db_schema)
    except DatabaseNotUsable as exc:
        raise CliError(str(exc)) from None
    return nats_url


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    state: dict[str, Any] = {}
    if args.hosts == "netns":
        _host_network_for_up(settings)
    settings = on_host_network(settings)[0]  # R3 streams on the host network's three NATS servers
    if not (settings.nats_url and settings.database_url):
        state = runtime_for(settings).up()
    nats_url = migrate(settings)
    database_url = endpoints(settings, None)[1]
    asyncio.run(administer_streams(nats_url, settings))
    _ensure_signing_keys(settings)
    services_dir = settings.home / "services"
    services_dir.mkdir(parents=True, exist_ok=True)
    if not args.no_services:
        supervisor = _supervisor_pid(settings)
        if supervisor is None:
            env = _service_env(settings, nats_url)
            with open(services_dir / "supervisor.log", "ab") as log_file:
                process = subprocess.Popen(
                    [*_keel_command(args), "supervise"], env=env, stdout=log_file, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )
            (services_dir / "supervisor.pid").write_text(f"{process.pid}\n")
            supervisor = process.pid
            exited: Callable[[], bool] = lambda: process.poll() is not None  # noqa: E731
        else:
            os.kill(supervisor, signal.SIGHUP)  # start again what it gave up on
            pid = supervisor
            exited = lambda: not _pid_alive(pid)  # noqa: E731
        _wait_until_ready(settings, supervisor, exited, timeout_s=60.0)
    print(json.dumps({"nats_url": nats_url, "database_url": redact(database_url), **_status(settings, state)},
                     indent=2, default=str))
    return 0


def _host_network_for_up(settings: Settings) -> None:
    """``keel up --hosts netns``: the host network (made now if there is none) with the hosts of the embedded NATS
    cluster (``on_host_network``); refused where namespaces cannot be made, or when NATS already runs on
    127.0.0.1."""
    from keel.cluster.local import ClusterError, ensure_home_network
    from keel.cluster.netns import unavailable_reason
    from keel.infra.embedded import LOCALHOST

    reason = unavailable_reason()
    if reason:
        raise CliError(f"--hosts netns: {reason}; `keel up` without it serves the flat local cluster")
    if settings.nats_url:
        raise CliError("--hosts netns starts the embedded NATS on the host network's bridge; an external NATS "
                       "(KEEL_NATS_URL) must itself listen where the node hosts reach it")
    running = runtime_for(settings)
    if running.nats.is_running() and running.nats.host == LOCALHOST:
        raise CliError("the embedded NATS already runs on 127.0.0.1: `keel down` first, then `keel up --hosts netns`")
    try:
        ensure_home_network(settings.home)
    except ClusterError as exc:
        raise CliError(str(exc)) from None


def _ensure_signing_keys(settings: Settings) -> None:
    """The signing keys of the control plane and of the operator running ``keel up`` (docs/security.md)."""
    from keel.events.signing import KeyringError
    from keel.infra.secrets import InsecurePathError
    from keel.infra.signing import ensure_control_plane_keys, operator_name

    try:
        ensure_control_plane_keys(settings, operator_name(settings, login_name()))
    except (KeyringError, InsecurePathError) as exc:
        raise CliError(f"signing keys: {exc}") from None


def _keel_command(args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "keel.cli.main"]
    if getattr(args, "config", None):
        command += ["--config", args.config]
    return command


def _supervisor_pid(settings: Settings) -> int | None:
    try:
        pid = int((settings.home / "services" / "supervisor.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _pid_alive(pid) else None


def _supervisor_state(settings: Settings) -> dict[str, Any]:
    from keel.infra.supervisor import STATE_FILE

    try:
        return dict(json.loads((settings.home / "services" / STATE_FILE).read_text()))
    except (OSError, ValueError):
        return {}


def _wait_until_ready(settings: Settings, supervisor: int, exited: Callable[[], bool], timeout_s: float) -> None:
    """Return once every service consumes live; raise with its log tail if one dies while starting (or the
    supervisor does: ``exited``, which asks its ``Popen`` when this command started it; its pid's command
    line is not yet ``keel``'s while it starts)."""
    services_dir = settings.home / "services"
    deadline = time.monotonic() + timeout_s
    waiting = set(supervised_names(settings))
    while waiting:
        if exited():
            log_tail = (services_dir / "supervisor.log").read_text(errors="replace")[-2000:]
            raise CliError(f"the supervisor (pid {supervisor}) exited while starting the services:\n{log_tail}")
        state = _supervisor_state(settings).get("services", {})
        for service in sorted(waiting):
            entry = state.get(service, {})
            if entry.get("state") == "running" and (services_dir / f"{service}.ready").exists():
                waiting.discard(service)
            elif entry.get("state") in ("backoff", "gave_up") and not entry.get("ever_ready"):
                log_tail = (services_dir / f"{service}.log").read_text(errors="replace")[-2000:]
                raise CliError(f"service {service} {entry.get('reason') or 'exited'} while starting; the supervisor "
                               f"(pid {supervisor}) goes on retrying it, `keel down` stops everything:\n{log_tail}")
        if waiting and time.monotonic() > deadline:
            raise CliError(f"services not ready after {timeout_s:.0f} s: {', '.join(sorted(waiting))} "
                           f"(see {services_dir})")
        time.sleep(0.05)


def _api_url(settings: Settings) -> str | None:
    """The URL the supervised API got (it writes it once listening), or None before then."""
    try:
        return (settings.home / "services" / "api.url").read_text().strip() or None
    except OSError:
        return None


def _status(settings: Settings, runtime_state: dict[str, Any] | None = None) -> dict[str, Any]:
    supervisor = _supervisor_pid(settings)
    supervised = _supervisor_state(settings).get("services", {}) if supervisor else {}
    services = {}
    for service in supervised_names(settings):
        pid = _service_pid(settings, service)
        services[service] = {"running": pid is not None, "pid": pid}
        if service in supervised:
            entry = supervised[service]
            # What the supervisor knows: restarting / gave_up, restarts so far, how the last process ended.
            services[service].update({key: entry[key] for key in ("state", "restarts", "last_exit", "restart_in_s",
                                                                   "reason") if key in entry})
    result: dict[str, Any] = {"supervisor": {"running": supervisor is not None, "pid": supervisor},
                              "services": services}
    if settings.api.serve_with_up:
        result["api"] = {"url": _api_url(settings) if services[API]["running"] else None,
                         "token_file": str(api_token_path(settings))}
    if not (settings.nats_url and settings.database_url):
        result["runtime"] = runtime_state or runtime_for(settings).status()
    return result


def cmd_down(args: argparse.Namespace, settings: Settings) -> int:
    supervisor = _supervisor_pid(settings)
    if supervisor:
        # First the supervisor (it stops its services), so nothing is restarted behind our back.
        os.kill(supervisor, signal.SIGTERM)
        deadline = time.monotonic() + settings.supervisor.stop_timeout.total_seconds() + 5
        while _pid_alive(supervisor) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _pid_alive(supervisor):
            os.kill(supervisor, signal.SIGKILL)
    (settings.home / "services" / "supervisor.pid").unlink(missing_ok=True)
    for service in (*SERVICES, API):
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
    from keel.cluster.local import drop_home_network

    drop_home_network(settings.home)  # `keel up --hosts netns`'s bridge, if any
    print("keel: down")
    return 0


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    status = _status(settings)
    print(json.dumps(status, indent=2, default=str))
    return 0


# -- services -------------------------------------------------------------------------------------


def cmd_supervise(args: argparse.Namespace, settings: Settings) -> int:
    from keel.infra.nats_auth import SUPERVISOR, bus_settings_for
    from keel.infra.supervisor import ServiceSpec, Supervisor, policy_from_settings, run_supervisor

    nats_url, _ = endpoints(settings, None)
    services_dir = settings.home / "services"
    services_dir.mkdir(parents=True, exist_ok=True)
    env = _service_env(settings, nats_url)
    specs = [ServiceSpec(service, [*_keel_command(args), "service", service], env) for service in SERVICES]
    if settings.api.serve_with_up:
        specs.append(ServiceSpec(API, _api_command(args), _api_env(settings, env)))
    supervisor = Supervisor(specs, services_dir, policy_from_settings(settings.supervisor), nats_url=nats_url,
                            bus_settings=bus_settings_for(settings, SUPERVISOR),
                            stop_timeout_s=settings.supervisor.stop_timeout.total_seconds())
    run_supervisor(supervisor, pid_file=services_dir / "supervisor.pid")
    return 0


def _api_command(args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "keel.api.main"]
    if getattr(args, "config", None):
        command += ["--config", args.config]
    return command


def _api_env(settings: Settings, env: dict[str, str]) -> dict[str, str]:
    """The API's environment under ``keel up``: its configured tokens plus the local operator's
    (``ensure_api_token``), as ``KEEL_API__TOKENS``: a digest each, never a token. The local operator's token acts
    as the operator's signing identity (``keel up`` created its key)."""
    token = ensure_api_token(settings)
    entries = [t.model_dump(exclude_none=True, mode="json") for t in settings.api.tokens]
    entries.append(token.entry())
    return {**env, "KEEL_API__TOKENS": json.dumps(entries)}


def api_token_path(settings: Settings) -> Path:
    return credentials_path(settings) / API_TOKEN_FILE


def ensure_api_token(settings: Settings) -> ApiToken:
    """The local operator's API token entry (scope ``operator``, named after the operator, acting as the operator's
    signing identity); the token itself is made once, kept 0600 in the credentials folder, and read by whoever may
    read that folder."""
    import secrets as random_source

    from keel.infra.api_auth import OPERATOR, TOKEN_BYTES, new_token, token_digest
    from keel.infra.secrets import InsecurePathError, read_secret, write_secret
    from keel.infra.signing import operator_name

    path = api_token_path(settings)
    operator = operator_name(settings, login_name())
    # A token's name allows fewer characters than a login name may hold.
    name = re.sub(r"[^A-Za-z0-9_.@-]", "_", operator)[:58] + "-local"
    try:
        try:
            token = read_secret(path).decode().strip()
        except FileNotFoundError:
            token, _ = new_token(name, OPERATOR, random_source.token_bytes(TOKEN_BYTES))
            write_secret(path, f"{token}\n".encode())
    except (InsecurePathError, UnicodeDecodeError) as exc:
        raise CliError(f"the local API token {path}: {exc}") from None
    return ApiToken(name, OPERATOR, token_digest(token), operator)


def cmd_service(args: argparse.Namespace, settings: Settings) -> int:
    from keel.infra.service import run_service
    from keel.infra.store import SchemaNotCurrent

    no_database = args.name in ("actuator", "notifier")
    if no_database and settings.nats_url:  # it reads no log: NATS is all it needs
        nats_url, database_url = settings.nats_url, ""
    else:
        nats_url, database_url = endpoints(settings, None if no_database else service_role(args.name))
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
    elif args.name == "notifier":
        from keel.notifier.main import serve
    elif args.name == "actuator":
        from keel.actuator.main import serve as serve_actuator
        from keel.actuator.main import serve_scheduler

        directory = cluster_dir(settings, getattr(args, "cluster_dir", None))
        job_id = getattr(args, "job", None) or os.environ.get("KEEL_JOB_ID") or None

        def serve(settings: Settings, nats_url: str, database_url: str, stop: asyncio.Event,
                  on_ready: Callable[[], None] = lambda: None) -> Coroutine[Any, Any, None]:
            if settings.actuator.kind in ("slurm", "kubernetes"):
                return serve_scheduler(settings, nats_url, stop, on_ready, job_id=job_id)
            return serve_actuator(settings, nats_url, directory, stop, on_ready)
    else:  # argparse's choices make this unreachable
        raise CliError(f"unknown service {args.name}")
    try:
        run_service(serve, settings, nats_url, database_url)
    except SchemaNotCurrent as exc:
        raise CliError(f"service {args.name}: {exc}") from None
    return 0


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    nats_url = migrate(settings)
    asyncio.run(administer_streams(nats_url, settings))
    print(f"keel: schema {settings.db_schema} is at the latest revision; streams {settings.bus.stream} and "
          f"{settings.bus.dlq_stream} have these settings")
    return 0
