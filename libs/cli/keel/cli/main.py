"""``keel``: the command line.

    keel up | down | status          the embedded runtime (NATS + PostgreSQL) and the services
    keel migrate                     bring the event store schema up to date
    keel service NAME                run one service in the foreground (recorder, controller, checkpoint-broker, actuator, analyzer, hot-update)
    keel replay [--job J] [--service S] --verify
    keel events tail [--job J] [-n N] [--follow] | show ID | schema [--write | --check]
    keel checkpoints ls [--root PATH] [--job J] [--json]   the persistent checkpoint tier
    keel ettr [--job J] [--window 1h] [--json]   cumulative and sliding-window ETTR, lost time by incident and phase
    keel incidents [--job J] [--json]            the controller's incidents, one line each
    keel timeline INCIDENT [--job J] [--json]    every event of one incident (id or a 6+ character prefix)
    keel approve | deny REQUEST_ID [--comment C] [--by NAME]   answer an ApprovalRequested
    keel cordon NODE --reason R [--by NAME] [--job J] | uncordon NODE   a human takes a node out (or back)
    keel deploy PATH|REV --job J [--urgent|--lazy] [--deadline 24h] [--entry F | -m MOD] [--why W]   a code version
    keel versions --job J [--json]     a job's code versions: history, current, stable, pending
    keel demo                        the end-to-end demonstration behind `make demo`

Global flags (``--config``, ``--home``, ``--nats-url``, ``--database-url``) are the top layer of the
settings (defaults < YAML < KEEL_* environment < flags).

Exit status: 0 done; 1 a check or a lookup failed (``replay --verify`` diverged; an incident or an
approval request that is unknown, ambiguous, already answered or expired); 2 a usage, configuration or
runtime error.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Coroutine
from datetime import timedelta
from pathlib import Path
from typing import Any

from keel.cluster.local import cluster_dir
from keel.infra.config import ConfigError, Settings, load_settings, resolve_endpoints

SERVICES = ("recorder", "controller", "checkpoint-broker", "actuator", "analyzer", "hot-update")


class CliError(RuntimeError):
    """A user-facing failure: printed without a traceback, exit status ``exit_code`` (2 by default)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# -- settings and endpoints ----------------------------------------------------------------------


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        "home": args.home,
        "nats_url": args.nats_url,
        "database_url": args.database_url,
    }
    return load_settings(Path(args.config) if args.config else None, overrides=overrides)


def runtime_for(settings: Settings):  # type: ignore[no-untyped-def]
    from keel.infra.embedded import EmbeddedRuntime

    return EmbeddedRuntime(
        home=settings.home,
        nats_port=settings.nats.port,
        nats_monitor_port=settings.nats.monitor_port,
        postgres_port=settings.postgres.port,
        sync_always=settings.nats.sync_always,
    )


def endpoints(settings: Settings) -> tuple[str, str]:
    """(NATS URL, database URL): external servers when configured, else the running embedded ones."""
    try:
        return resolve_endpoints(settings)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


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


def cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    state: dict[str, Any] = {}
    if not (settings.nats_url and settings.database_url):
        state = runtime_for(settings).up()
    nats_url, database_url = endpoints(settings)
    from keel.infra.store import run_migrations

    run_migrations(database_url, settings.db_schema)
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

        def serve(settings, nats_url, database_url, stop, on_ready):  # type: ignore[no-untyped-def]
            return serve_actuator(settings, nats_url, directory, stop, on_ready)
    else:  # argparse's choices make this unreachable
        raise CliError(f"unknown service {args.name}")
    run_service(serve, settings, nats_url, database_url)
    return 0


def cmd_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from keel.infra.store import run_migrations

    _, database_url = endpoints(settings)
    run_migrations(database_url, settings.db_schema)
    print(f"keel: schema {settings.db_schema} is at the latest revision")
    return 0


# -- replay and events ----------------------------------------------------------------------------


def deciders_for(settings: Settings) -> dict[str, Any]:
    from keel.analyzer.main import decider_from_settings as analyzer_from_settings
    from keel.checkpoint_broker.main import decider_from_settings as broker_from_settings
    from keel.controller.main import decider_from_settings
    from keel.hot_update.main import decider_from_settings as hot_update_from_settings

    return {"controller": decider_from_settings(settings), "checkpoint-broker": broker_from_settings(settings),
            "analyzer": analyzer_from_settings(settings), "hot-update": hot_update_from_settings(settings)}


def cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    from keel.infra.store import EventStore, create_engine
    from keel.kernel.replay import ReplayVerifier

    _, database_url = endpoints(settings)
    deciders = deciders_for(settings)
    if args.service and args.service not in deciders:
        raise CliError(f"no decider named {args.service!r}; known: {', '.join(deciders)}")
    chosen = [deciders[args.service]] if args.service else list(deciders.values())

    async def replay_all() -> list[Any]:
        # One pass over the log feeds every decider, streaming: memory stays flat for any log size.
        engine = create_engine(database_url, settings.db_schema)
        verifiers = [ReplayVerifier(decider) for decider in chosen]
        gc.collect()
        gc.freeze()  # the long-lived heap is not rescanned by every collection during a long replay
        try:
            async for recorded in EventStore(engine).read(job_id=args.job):
                for verifier in verifiers:
                    verifier.observe(recorded.event)
        finally:
            await engine.dispose()
        return [verifier.finish() for verifier in verifiers]

    diverged = False
    for report in asyncio.run(replay_all()):
        print(report.summary())
        for divergence in report.divergences:
            print("  " + divergence.describe().replace("\n", "\n  "))
        diverged |= not report.clean
    if args.verify and diverged:
        return 1
    return 0


def _format_event(position: int, event: Any) -> str:
    payload = event.payload.model_dump(mode="json")
    brief = ", ".join(f"{k}={v}" for k, v in payload.items() if v not in ("", [], {}, None))
    if len(brief) > 140:
        brief = brief[:137] + "..."
    stamp = event.occurred_at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    return f"{position:>8} {stamp} {event.job_id:<10} {event.subject:<16} {event.type:<22} {event.producer:<12} {brief}"


def cmd_events(args: argparse.Namespace, settings: Settings) -> int:
    from keel.infra.store import EventStore, create_engine

    _, database_url = endpoints(settings)

    async def main() -> int:
        engine = create_engine(database_url, settings.db_schema)
        store = EventStore(engine)
        try:
            if args.events_command == "show":
                try:
                    event_id = uuid.UUID(args.id)
                except ValueError:
                    raise CliError(f"not an event id: {args.id!r}") from None
                recorded = await store.get(event_id)
                if recorded is None:
                    raise CliError(f"no event {args.id} in the log")
                print(json.dumps({"position": recorded.position, "js_seq": recorded.js_seq,
                                  "recorded_at": recorded.recorded_at.isoformat(), **recorded.event.to_wire()}, indent=2))
                return 0
            head = await store.head_position()
            after = max(0, head - args.n) if args.job is None else 0
            recent = [r async for r in store.read(job_id=args.job, after_position=after)][-args.n :]
            for recorded in recent:
                print(_format_event(recorded.position, recorded.event))
            position = recent[-1].position if recent else head
            while args.follow:
                await asyncio.sleep(0.5)
                async for recorded in store.read(job_id=args.job, after_position=position):
                    print(_format_event(recorded.position, recorded.event), flush=True)
                    position = recorded.position
            return 0
        finally:
            await engine.dispose()

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 0


def cmd_schema(args: argparse.Namespace, settings: Settings) -> int:
    from keel.events.catalogue import CATALOGUE_PATH, build_catalogue, render

    text = render(build_catalogue())
    if args.write:
        CATALOGUE_PATH.write_text(text)
        print(f"keel: wrote {CATALOGUE_PATH}")
        return 0
    if args.check:
        if not CATALOGUE_PATH.exists() or CATALOGUE_PATH.read_text() != text:
            print(f"keel: {CATALOGUE_PATH} is out of date; run `keel events schema --write`", file=sys.stderr)
            return 1
        print("keel: event catalogue is up to date")
        return 0
    print(text, end="")
    return 0


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cli.agent_cmd import run_agent

    return run_agent(args.launch_args, settings, _nats_url_or_none(settings))


def _nats_url_or_none(settings: Settings) -> str | None:
    if settings.nats_url:
        return settings.nats_url
    try:
        return endpoints(settings)[0]
    except CliError:
        return None


def cmd_cluster(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cluster.local import ClusterError, cluster_dir, cluster_down, cluster_status, cluster_up

    directory = cluster_dir(settings, args.dir)
    try:
        if args.cluster_command == "up":
            command = args.command[1:] if args.command[:1] == ["--"] else args.command
            state = cluster_up(settings, directory, nodes=args.nodes, standby=args.standby,
                               nproc_per_node=args.nproc_per_node, job_id=args.job_id, command=command,
                               nats_url=_nats_url_or_none(settings), probe_interval=args.probe_interval,
                               heartbeat_interval=args.heartbeat_interval)
            print(json.dumps(state, indent=2))
        elif args.cluster_command == "down":
            stopped = cluster_down(directory)
            print(f"keel: cluster down ({len(stopped)} agents stopped)")
        else:
            print(json.dumps(cluster_status(directory), indent=2))
    except ClusterError as exc:
        raise CliError(str(exc)) from None
    return 0


def cmd_inject(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cluster.local import ClusterError, FaultSpec, cluster_dir, inject, load_scenario

    directory = cluster_dir(settings, args.dir)
    try:
        if args.scenario:
            faults = load_scenario(Path(args.scenario)).faults
        else:
            if not args.kind or not args.node:
                raise CliError("keel inject KIND --node NODE [--rank R] [--param k=v], or --scenario FILE")
            params = {}
            for item in args.param:
                key, sep, value = item.partition("=")
                if not sep:
                    raise CliError(f"--param takes key=value, got {item!r}")
                try:
                    params[key] = json.loads(value)
                except ValueError:
                    params[key] = value
            try:
                faults = [FaultSpec(kind=args.kind, node=args.node, rank=args.rank, params=params)]
            except ValueError as exc:
                raise CliError(f"invalid fault: {exc}") from None
        for line in inject(settings, directory, faults, _nats_url_or_none(settings)):
            print(f"keel: injected {line}")
    except ClusterError as exc:
        raise CliError(str(exc)) from None
    return 0


def cmd_checkpoints(args: argparse.Namespace, settings: Settings) -> int:
    from keel.checkpoint.disk import list_checkpoints

    root = Path(args.root).expanduser() if args.root else settings.checkpoint.resolved_persist_root(settings.home)
    try:
        infos = list_checkpoints(root, args.job)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        print(json.dumps({"root": str(root), "checkpoints": [info.to_json() for info in infos]}, indent=2))
        return 0
    if not infos:
        print(f"keel: no checkpoints under {root}" + (f" for job {args.job}" if args.job else ""))
        return 0
    print(f"{'JOB':<16} {'STEP':>9} {'RANKS':>5} {'BYTES':>14} {'CREATED_AT':<29} STATUS")
    for info in infos:
        status = info.status if not info.detail or info.detail == "no manifest" else f"{info.status} ({info.detail})"
        print(f"{info.job:<16} {info.step:>9} {info.ranks:>5} {info.bytes:>14} {info.created_at:<29} {status}")
    return 0


# -- reporting and human input (keel.cli.incidents) ----------------------------------------------


def _on_store(settings: Settings, use: Callable[[Any], Coroutine[Any, Any, Any]]) -> Any:
    """Run ``use(store)`` against the event store; lookup and usage errors become ``CliError``."""
    from keel.cli.incidents import BadInput, LookupFailed
    from keel.infra.store import EventStore, create_engine

    _, database_url = endpoints(settings)

    async def main() -> Any:
        engine = create_engine(database_url, settings.db_schema)
        try:
            return await use(EventStore(engine))
        finally:
            await engine.dispose()

    try:
        return asyncio.run(main())
    except LookupFailed as exc:
        raise CliError(str(exc), exit_code=1) from None
    except BadInput as exc:
        raise CliError(str(exc)) from None


def _publish(settings: Settings, event: Any) -> None:
    from keel.infra.bus import Bus

    nats_url, _ = endpoints(settings)

    async def main() -> None:
        bus = await asyncio.wait_for(Bus.connect(nats_url, settings.bus, name="keel-cli"), timeout=10)
        try:
            await bus.publish(event)
        finally:
            await bus.close()

    try:
        asyncio.run(main())
    except TimeoutError:
        raise CliError(f"NATS at {nats_url} did not answer within 10 s; nothing was published") from None


def _login_name() -> str:
    import getpass

    try:
        return os.environ.get("USER") or getpass.getuser()
    except (OSError, KeyError):
        raise CliError("cannot tell who you are: pass --by NAME") from None


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def cmd_ettr(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cli.incidents import ettr_json, format_ettr, load_ettr
    from keel.events.units import parse_duration

    try:
        window = parse_duration(args.window)
    except ValueError as exc:
        raise CliError(f"--window: {exc}") from None
    if window <= timedelta(0):
        raise CliError(f"--window must be longer than 0 s, got {args.window!r}")
    jobs = _on_store(settings, lambda store: load_ettr(store, args.job, window))
    if args.json:
        _print_json({"jobs": [ettr_json(job) if job else {"job_id": name, "cumulative": None, "window": None}
                              for name, job in jobs]})
        return 0
    if not jobs:
        print("keel: no events in the log")
        return 0
    blocks = [format_ettr(job) if job else f"job {name}: no rank has started yet: no ETTR" for name, job in jobs]
    print("\n\n".join(blocks))
    return 0


def cmd_incidents(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cli.incidents import format_incidents, incidents_json, load_incidents

    incidents = _on_store(settings, lambda store: load_incidents(store, args.job))
    if args.json:
        _print_json(incidents_json(incidents))
    else:
        print(format_incidents(incidents))
    return 0


def cmd_timeline(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cli.incidents import format_timeline, load_timeline, timeline_json

    timeline = _on_store(settings, lambda store: load_timeline(store, args.incident, args.job))
    if args.json:
        _print_json(timeline_json(timeline))
    else:
        print(format_timeline(timeline))
    return 0


def cmd_answer(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cli.incidents import BadInput, approval_answer, load_open_request, short_id
    from keel.events.envelope import now_utc

    approved = args.command == "approve"
    by = args.by or _login_name()
    request = _on_store(settings, lambda store: load_open_request(store, args.request_id, now_utc(), args.job))
    try:
        answer = approval_answer(request, approved=approved, by=by, comment=args.comment, now=now_utc())
    except BadInput as exc:
        raise CliError(str(exc)) from None
    _publish(settings, answer)
    incident = short_id(request.correlation_id) if request.correlation_id else request.payload.incident_id[:8]
    print(f"keel: {'approved' if approved else 'denied'} request {short_id(request.id)} "
          f"({request.payload.action} for incident {incident}, job {request.job_id}) as {by}; event {answer.id}")
    return 0


def cmd_cordon(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cli.incidents import BadInput, choose_job, cordon_event, load_node_jobs
    from keel.events.envelope import now_utc

    cordoned = args.command == "cordon"
    by = args.by or _login_name()

    async def job_of(store: Any) -> str:
        jobs = await load_node_jobs(store.engine, args.node)
        if args.job is None:
            return choose_job(args.node, jobs)
        if args.job not in jobs:
            print(f"keel: warning: node {args.node} has no events in job {args.job} yet", file=sys.stderr)
        return str(args.job)

    job = _on_store(settings, job_of)
    try:
        event = cordon_event(job, args.node, cordoned=cordoned, by=by, reason=args.reason or "", now=now_utc())
    except BadInput as exc:
        raise CliError(str(exc)) from None
    _publish(settings, event)
    print(f"keel: {'cordoned' if cordoned else 'uncordoned'} {args.node} of job {job} as {by}; event {event.id}")
    return 0


def cmd_deploy(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cli.versions import deploy_event
    from keel.events.envelope import now_utc
    from keel.events.units import parse_duration

    entry = ["-m", args.module] if args.module else ([args.entry] if args.entry else None)
    try:
        deadline = parse_duration(args.deadline) if args.deadline else None
    except ValueError as exc:
        raise CliError(f"--deadline: {exc}") from None
    event = deploy_event(settings, args.job, args.source, entry=entry, mode="urgent" if args.urgent else "lazy",
                         deadline=deadline, by=args.by or _login_name(), why=args.why, now=now_utc())
    _publish(settings, event)
    p = event.payload
    if event.type == "CodeVersionRejected":
        print(f"keel: rejected {args.source}: {p.reason}; event {event.id}", file=sys.stderr)
        return 1
    when = "restart onto it now" if p.mode == "urgent" else f"at the next restart, at the latest {p.deadline.isoformat()}"
    print(f"keel: registered {p.version_id} ({p.source_kind} {p.source}, entry {' '.join(p.entry)}) for job {args.job}: "
          f"{when}; event {event.id}")
    return 0


def cmd_versions(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cli.versions import HISTORY_TYPES, format_versions, summarise

    async def load(store: Any) -> list[Any]:
        return [r.event async for r in store.read(job_id=args.job, types=HISTORY_TYPES)]

    summary = summarise(_on_store(settings, load))
    if args.json:
        _print_json({"job": args.job, **summary})
    else:
        print(format_versions(args.job, summary))
    return 0


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from keel.cli.demo import run_demo

    return run_demo(settings, config=args.config, keep=args.keep)


# -- argument parsing -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="keel", description="Keel: keep large training jobs productive.")
    parser.add_argument("--config", help="YAML settings file (also KEEL_CONFIG)")
    parser.add_argument("--home", help="runtime directory for the embedded servers (default ~/.keel, KEEL_HOME)")
    parser.add_argument("--nats-url", help="use this NATS server instead of the embedded one (KEEL_NATS_URL)")
    parser.add_argument("--database-url", help="use this PostgreSQL instead of the embedded one (KEEL_DATABASE_URL)")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

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

    replay = sub.add_parser("replay", help="fold the log through the current deciders and diff the decisions")
    replay.add_argument("--job")
    replay.add_argument("--service")
    replay.add_argument("--verify", action="store_true", help="exit 1 when any decision diverges")
    replay.set_defaults(func=cmd_replay)

    events = sub.add_parser("events", help="read the event log")
    events_sub = events.add_subparsers(dest="events_command", required=True)
    tail = events_sub.add_parser("tail", help="the latest events")
    tail.add_argument("--job")
    tail.add_argument("-n", type=int, default=20)
    tail.add_argument("-f", "--follow", action="store_true")
    tail.set_defaults(func=cmd_events)
    show = events_sub.add_parser("show", help="one event in full")
    show.add_argument("id")
    show.set_defaults(func=cmd_events)
    schema = events_sub.add_parser("schema", help="the JSON Schema catalogue of every event type")
    group = schema.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true")
    group.add_argument("--check", action="store_true")
    schema.set_defaults(func=cmd_schema)

    run = sub.add_parser("run", help="launch and supervise one node's ranks (torchrun-compatible)", add_help=False)
    run.add_argument("launch_args", nargs=argparse.REMAINDER)
    run.set_defaults(func=cmd_run)

    cluster = sub.add_parser("cluster", help="a local multi-node cluster of node agents")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    cluster_up = cluster_sub.add_parser("up", help="start N agents running the training command")
    cluster_up.add_argument("--nodes", type=int, required=True)
    cluster_up.add_argument("--standby", type=int, default=0)
    cluster_up.add_argument("--nproc-per-node", type=int, default=1)
    cluster_up.add_argument("--job-id", default="job")
    cluster_up.add_argument("--dir", help="cluster state directory (default <home>/cluster)")
    cluster_up.add_argument("--probe-interval", default="1s")
    cluster_up.add_argument("--heartbeat-interval", default="5s")
    cluster_up.add_argument("command", nargs=argparse.REMAINDER, help="-- [-m module | script.py] [args]")
    cluster_up.set_defaults(func=cmd_cluster)
    for name, text in (("down", "stop every agent and rank"), ("status", "agents and their ranks")):
        parser_ = cluster_sub.add_parser(name, help=text)
        parser_.add_argument("--dir")
        parser_.set_defaults(func=cmd_cluster)

    inject = sub.add_parser("inject", help="inject a fault into the local cluster")
    inject.add_argument("kind", nargs="?", help="crash hang slow nan oom gpu-lost xid nic-down disk-full sdc")
    inject.add_argument("--node")
    inject.add_argument("--rank", type=int)
    inject.add_argument("--param", action="append", default=[], help="key=value (JSON values allowed)")
    inject.add_argument("--scenario", help="YAML file: faults: [{at: 10s, kind: hang, node: n01, rank: 2}]")
    inject.add_argument("--dir")
    inject.set_defaults(func=cmd_inject)

    checkpoints = sub.add_parser("checkpoints", help="the persistent checkpoint tier")
    checkpoints_sub = checkpoints.add_subparsers(dest="checkpoints_command", required=True)
    checkpoints_ls = checkpoints_sub.add_parser("ls", help="committed and incomplete checkpoints")
    checkpoints_ls.add_argument("--root", help="persistent tier root (default: checkpoint.persist_root, <home>/checkpoints)")
    checkpoints_ls.add_argument("--job")
    checkpoints_ls.add_argument("--json", action="store_true")
    checkpoints_ls.set_defaults(func=cmd_checkpoints)

    ettr = sub.add_parser("ettr", help="ETTR, cumulative and over a sliding window, lost time by incident and phase")
    ettr.add_argument("--job", help="one job (default: every job in the log)")
    ettr.add_argument("--window", default="1h", help="the sliding window: the last DURATION of the log (default 1h)")
    ettr.add_argument("--json", action="store_true")
    ettr.set_defaults(func=cmd_ettr)

    incidents = sub.add_parser("incidents", help="the controller's incidents, one line each")
    incidents.add_argument("--job")
    incidents.add_argument("--json", action="store_true")
    incidents.set_defaults(func=cmd_incidents)

    timeline = sub.add_parser("timeline", help="every event of one incident, in log order")
    timeline.add_argument("incident", help="the incident id (the IncidentOpened event's) or a prefix of 6+ characters")
    timeline.add_argument("--job")
    timeline.add_argument("--json", action="store_true")
    timeline.set_defaults(func=cmd_timeline)

    for name, text in (("approve", "approve a held action (an ApprovalRequested)"),
                       ("deny", "deny a held action (an ApprovalRequested)")):
        answer = sub.add_parser(name, help=text)
        answer.add_argument("request_id", help="the ApprovalRequested event id or a prefix of 6+ characters")
        answer.add_argument("--comment", default="")
        answer.add_argument("--by", help="who answers (default: your login name)")
        answer.add_argument("--job", help="look the request up in this job only")
        answer.set_defaults(func=cmd_answer)

    for name, text in (("cordon", "take a node out of service: the controller never undoes it"),
                       ("uncordon", "put a cordoned node back into service")):
        cordon = sub.add_parser(name, help=text)
        cordon.add_argument("node")
        cordon.add_argument("--reason", required=name == "cordon", default="")
        cordon.add_argument("--by", help="who cordons (default: your login name)")
        cordon.add_argument("--job", help="the node's job (default: the one job the log has the node in)")
        cordon.set_defaults(func=cmd_cordon)

    deploy = sub.add_parser("deploy", help="register a code version for a running job (validated before rollout)")
    deploy.add_argument("source", help="a directory, a wheel (*.whl), or a git revision (REPO@REV, or REV of the "
                                       "repository here)")
    deploy.add_argument("--job", required=True)
    entry = deploy.add_mutually_exclusive_group()
    entry.add_argument("--entry", help="the script to run, relative to the version (default train.py)")
    entry.add_argument("--module", "-m", help="run this module of the version instead (python -m MODULE)")
    mode = deploy.add_mutually_exclusive_group()
    mode.add_argument("--urgent", action="store_true", help="restart the job onto it now")
    mode.add_argument("--lazy", action="store_true", help="apply it at the next restart of any cause (default)")
    deploy.add_argument("--deadline", help="a lazy version is forced this long after the deploy (default "
                                           "hot_update.default_deadline, 24h)")
    deploy.add_argument("--why", default="", help="what changed and why (shown by keel versions)")
    deploy.add_argument("--by", help="who deploys (default: your login name)")
    deploy.set_defaults(func=cmd_deploy)

    versions = sub.add_parser("versions", help="a job's code versions: history, current, stable, pending")
    versions.add_argument("--job", required=True)
    versions.add_argument("--json", action="store_true")
    versions.set_defaults(func=cmd_versions)

    demo = sub.add_parser("demo", help="run the end-to-end demonstration")
    demo.add_argument("--keep", action="store_true", help="leave the stack running afterwards")
    demo.set_defaults(func=cmd_demo)
    return parser


_GLOBAL_FLAGS_WITH_VALUE = {"--config", "--home", "--nats-url", "--database-url"}


def _command_index(argv: list[str]) -> int | None:
    """Position of the subcommand: the first word that is not a global flag or its value."""
    index = 0
    while index < len(argv):
        word = argv[index]
        if word in _GLOBAL_FLAGS_WITH_VALUE:
            index += 2
        elif word.startswith("-"):
            index += 1
        else:
            return index
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    launch_args: list[str] | None = None
    index = _command_index(argv)
    if index is not None and argv[index] == "run":
        # Everything after `run` belongs to the launcher (torchrun flags start with dashes, which
        # argparse would otherwise try to read as keel's own).
        argv, launch_args = argv[: index + 1], argv[index + 1 :]
    args = parser.parse_args(argv)
    if launch_args is not None:
        args.launch_args = launch_args
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("nats").setLevel(logging.WARNING)
    try:
        settings = settings_from_args(args)
        return int(args.func(args, settings))
    except CliError as exc:
        print(f"keel: {exc}", file=sys.stderr)
        return exc.exit_code
    except ConfigError as exc:
        print(f"keel: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        # The embedded runtime's errors (port in use, data dir locked) are meant for people.
        if type(exc).__module__ == "keel.infra.embedded":
            print(f"keel: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
