"""``keel-api``: serve the HTTP API until SIGTERM or SIGINT (uvicorn), reading the store as the ``auditor`` role.

Settings from ``--config``/``KEEL_CONFIG`` and ``KEEL_*`` (``api.*``: address, port, tokens), the database from
``KEEL_DATABASE_URL`` or a running ``keel up``. With ``api.chatops`` set or an ``operator`` token, each process also
connects to NATS (``KEEL_NATS_URL``) as the ``chatops`` identity (``api.chatops.signing_identity``), to publish
chat-ops approvals (``keel.api.chatops``) and operator tokens' actions (``keel.api.actions``, each signed by its
token's operator key, loaded at start). Exit status 2 on a configuration error (an operator token whose signing key
is missing included) or an old schema.
``keel-api --new-token NAME [--scope operator [--identity ID]]`` prints a new token and its ``api.tokens`` entry
(an operator token's signing key is created when missing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from keel.api.actions import Actions
from keel.api.app import create_app
from keel.api.chatops import Callback, ChatOps, post_to_slack
from keel.events.signing import KeyringError, SigningKey
from keel.infra.api_auth import OPERATOR, READ, SCOPES, TOKEN_BYTES, ApiToken, new_token
from keel.infra.bus import Bus
from keel.infra.config import (
    ConfigError,
    Settings,
    credentials_path,
    database_url_for,
    load_settings,
    resolve_endpoints,
)
from keel.infra.dbroles import AUDITOR
from keel.infra.nats_auth import CHATOPS, bus_settings_for
from keel.infra.secrets import InsecurePathError, read_secret
from keel.infra.service import ALIVE_INTERVAL_S, READY_FILE_ENV
from keel.infra.signing import (
    KeyringFile,
    Signing,
    ensure_signing_identity,
    keyring_path,
    load_signing_key,
    service_signing,
    signing_dir,
)
from keel.infra.store import EventStore, SchemaNotCurrent, check_schema_current, create_engine
from keel.reports.incidents import load_node_jobs

log = logging.getLogger("keel.api")

URL_FILE = "api.url"
"""Written beside the ready file once listening: the URL the API really serves on."""


def tokens_of(settings: Settings) -> list[ApiToken]:
    """``api.tokens`` (``ConfigError`` for an entry ``ApiToken`` refuses: an operator token's identity)."""
    try:
        return [ApiToken(t.name, t.scope, t.sha256, t.identity) for t in settings.api.tokens]
    except ValueError as exc:
        raise ConfigError(f"api.tokens: {exc}") from None


def operator_keys(settings: Settings, tokens: Sequence[ApiToken]) -> dict[str, SigningKey]:
    """Every operator token's signing key (by identity), from ``<credentials>/signing/``: checked at start, so a
    token that cannot act is a ``ConfigError`` naming it and how to fix it, not a failure at its first action."""
    keys: dict[str, SigningKey] = {}
    credentials = credentials_path(settings)
    for token in tokens:
        if token.scope != OPERATOR or token.signer in keys:
            continue
        how = (f"create it with `KEEL_SIGNING__OPERATOR={token.signer} keel credentials init` (or `keel-api --new-token "
               f"NAME --scope operator --identity {token.signer}`, which makes a new token too) with the same "
               "credentials folder, or set the token's identity to an operator that has a key")
        key_file = signing_dir(credentials) / f"{token.signer}.key"
        try:
            if not key_file.exists():
                raise FileNotFoundError(key_file)
            key = load_signing_key(credentials, token.signer)
        except FileNotFoundError:
            raise ConfigError(f"api.tokens: operator token {token.name!r} acts as {token.signer!r}, whose signing key "
                              f"{key_file} is missing: {how}") from None
        except KeyringError as exc:
            raise ConfigError(f"api.tokens: operator token {token.name!r} acts as {token.signer!r}: {exc}; {how}") \
                from None
        if key.role != OPERATOR:
            raise ConfigError(f"api.tokens: operator token {token.name!r} acts as {token.signer!r}, whose key has role "
                              f"{key.role}, not operator: an operator token signs as an operator identity")
        keys[token.signer] = key
    return keys


async def serve(settings: Settings, database_url: str, sock: socket.socket | None = None, *, announce: bool = True,
                workers: Sequence[int] = (), parent: int | None = None,
                keys: dict[str, SigningKey] | None = None) -> None:
    """Serve until uvicorn is told to stop (SIGTERM, SIGINT); the engine is closed whatever happens.

    ``sock``: a listening socket to serve on (shared with the other worker processes), else uvicorn binds the
    configured address. ``announce`` (one process does): under a supervisor (``$KEEL_SERVICE_READY_FILE``, as
    ``keel up`` runs it), once listening, write the bound URL beside the ready file (``api.url``;
    ``api.listen_port: 0`` takes a free port), then the ready file (this pid), and touch it every
    ``ALIVE_INTERVAL_S`` while serving, as every Keel service does. ``workers``: the other processes' pids: when
    one ends, this one stops too (``WorkerLost``), so the supervisor restarts the whole API, not half of it.
    ``parent`` (a worker's): the API's process that forked it; the worker stops when that one is gone.
    ``keys``: the operator tokens' signing keys (``operator_keys``; None: loaded here)."""
    import uvicorn

    engine = create_engine(database_url, settings.db_schema)
    # The listing reads of pages and timelines (``EventStore.fetch_engine``): a pool without a test on checkout,
    # which costs three round trips to PostgreSQL per query; those reads drop a closed connection and take another.
    reads = create_engine(database_url, settings.db_schema, pre_ping=False)
    bus = None
    try:
        await check_schema_current(engine, settings.db_schema)
        tokens = tokens_of(settings)
        if keys is None:
            keys = operator_keys(settings, tokens)
        if not tokens and announce:
            log.warning("api: no tokens configured (api.tokens): every request but /healthz is refused")
        chatops_on = settings.api.chatops.enabled
        bus = await connect_api_bus(settings, chatops=chatops_on) if chatops_on or keys else None
        app = create_app(engine, tokens, max_page=settings.api.max_page, store_engine=reads,
                         parsed_events_kept=settings.api.parsed_events_kept,
                         chatops=chatops_of(settings, bus) if bus is not None and chatops_on else None,
                         actions=actions_of(bus, keys, engine) if bus is not None and keys else None)
        config = uvicorn.Config(app, host=settings.api.listen_host, port=settings.api.listen_port, log_level="info",
                                access_log=False, server_header=False, proxy_headers=False)
        server = uvicorn.Server(config)
        announced: list[Path] = []
        tasks = ([asyncio.create_task(_announce_when_listening(server, len(tokens), len(workers) + 1, announced))]
                 if announce else [])
        lost: list[str] = []
        if workers:
            tasks.append(asyncio.create_task(_watch_workers(server, workers, lost)))
        if parent is not None:
            tasks.append(asyncio.create_task(_watch_parent(server, parent)))
        try:
            await server.serve(sockets=[sock] if sock is not None else None)
        finally:
            for task in tasks:
                task.cancel()
            for written in announced:  # stopped: nothing serves that URL any more (a restart writes its own)
                written.unlink(missing_ok=True)
        if lost:
            raise WorkerLost(lost[0])
    finally:
        if bus is not None:
            await bus.close()
        await reads.dispose()
        await engine.dispose()


async def connect_api_bus(settings: Settings, *, chatops: bool = True) -> Bus:
    """The bus the API publishes its actions on: NATS as identity ``api.chatops.signing_identity`` (role chatops:
    ``ApprovalGiven`` and ``NodeCordoned`` only). ``chatops``: it signs chat-ops answers with that identity's own
    key (created on the first start, entered in the keyring); an operator token's events come signed already."""
    identity = settings.api.chatops.signing_identity
    nats_url = settings.nats_url or resolve_endpoints(settings, None)[0]
    signing = (service_signing(settings, identity, CHATOPS) if chatops
               else Signing(keyring=KeyringFile(keyring_path(settings))))
    return await Bus.connect(nats_url, bus_settings_for(settings, identity), name=f"keel-api-{identity}",
                             signing=signing)


def actions_of(bus: Bus, keys: dict[str, SigningKey], engine: Any) -> Callable[[EventStore], Actions]:
    """The operator actions' handler's factory: publishing on ``bus``, signing with ``keys``."""

    def make(store: EventStore) -> Actions:
        return Actions(store, bus.publish, keys, lambda node: load_node_jobs(engine, node))
    return make


def chatops_of(settings: Settings, bus: Bus) -> Callable[[EventStore], ChatOps]:
    """The chat-ops handler's factory, its secrets read from their private files (``ConfigError`` naming the file
    otherwise)."""
    chat = settings.api.chatops

    def secret(path: Path, what: str) -> str:
        try:
            value = read_secret(path).decode().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"api.chatops {what}: {exc}") from None
        if len(value) < 16:
            raise ConfigError(f"api.chatops {what}: the secret in {path} is under 16 characters")
        return value

    slack = secret(chat.slack_signing_secret_file, "slack_signing_secret_file") \
        if chat.slack_signing_secret_file is not None else ""
    callbacks = {c.name: Callback(c.name, secret(c.secret_file, f"callback {c.name}"), frozenset(c.approvers))
                 for c in chat.callbacks}

    def make(store: EventStore) -> ChatOps:
        return ChatOps(store, bus.publish, slack_secret=slack, slack_approvers=dict(chat.slack_approvers),
                       response_url_prefix=chat.slack_response_url_prefix, callbacks=callbacks,
                       tolerance=chat.timestamp_tolerance, post=post_to_slack)
    return make


async def _watch_parent(server: Any, parent: int) -> None:
    """A worker's: stop when the API's process that forked it is gone. Its parent-death signal alone can be lost:
    one that comes before uvicorn installs its handlers meets the no-op SIGTERM handler inherited from the parent
    (seen in CI: the worker outlived a killed API and went on serving the port alone)."""
    while not server.should_exit:
        if os.getppid() != parent:
            log.error("api worker %d: the API's process %d is gone; stopping", os.getpid(), parent)
            server.should_exit = True
            return
        await asyncio.sleep(0.2)


class WorkerLost(RuntimeError):
    """A worker process of the API ended while the API was serving."""


async def _watch_workers(server: Any, workers: Sequence[int], lost: list[str]) -> None:
    while not server.should_exit:
        for pid in workers:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                lost.append(f"api worker {pid} ended (status {status}); stopping the API so it restarts whole")
                log.error("%s", lost[0])
                server.should_exit = True
                return
        await asyncio.sleep(0.5)


def bound_url(server: Any) -> str:
    """``http://HOST:PORT`` of a started uvicorn server's first socket (the port it really got)."""
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


async def _announce_when_listening(server: Any, token_count: int, processes: int, announced: list[Path]) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.02)
    url = bound_url(server)
    log.info("api: serving on %s (%d token(s), %d process(es))", url, token_count, processes)
    ready_file = os.environ.get(READY_FILE_ENV)
    if not ready_file:
        return
    ready = Path(ready_file)
    url_file, partial = ready.with_name(URL_FILE), ready.with_name(f".{URL_FILE}.partial")
    partial.write_text(f"{url}\n")
    os.replace(partial, url_file)  # a reader sees the whole URL or none
    announced.append(url_file)
    ready.write_text(f"{os.getpid()}\n")
    while True:
        await asyncio.sleep(ALIVE_INTERVAL_S)
        try:
            ready.touch()
        except OSError as exc:  # a probe reads it; serving does not depend on it
            log.warning("cannot touch the ready file %s: %s", ready, exc)


def print_new_token(name: str, scope: str, identity: str | None = None, settings: Settings | None = None) -> int:
    """``keel-api --new-token NAME``: a fresh token on stdout's first line, its ``api.tokens`` entry (no secret) on
    the second. Give the token to its holder; put the entry in the settings. An operator token's entry names its
    signing identity (``identity``, default ``NAME``), whose key is created in ``settings``' credentials folder
    when missing (said on stderr)."""
    try:
        token, entry = new_token(name, scope, secrets.token_bytes(TOKEN_BYTES), identity)
        if entry.scope == OPERATOR:
            if settings is None:
                raise ValueError("an operator token needs the settings (its signing key's credentials folder)")
            credentials = credentials_path(settings)
            key_file = signing_dir(credentials) / f"{entry.signer}.key"
            existed = key_file.exists()
            ensure_signing_identity(credentials, entry.signer, OPERATOR)
            print(f"keel-api: operator {entry.signer!r} signs this token's actions with {key_file} "
                  f"({'existing' if existed else 'created'}; the keyring {keyring_path(settings)} holds its public "
                  "key: copy it to hosts that keep their own)", file=sys.stderr)
    except (ValueError, KeyringError, InsecurePathError, OSError) as exc:
        print(f"keel-api: {exc}", file=sys.stderr)
        return 2
    print(token)
    print(json.dumps(entry.entry()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keel-api", description="Serve Keel's HTTP API until SIGTERM.")
    parser.add_argument("--config", help="YAML settings file (also KEEL_CONFIG)")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--new-token", metavar="NAME", help="print a new token for NAME and its api.tokens entry, "
                                                           "then exit (nothing is stored)")
    parser.add_argument("--scope", choices=SCOPES, default=READ, help="the new token's scope (default: read)")
    parser.add_argument("--identity", help="an operator token's signing identity (default: NAME); its key is "
                                           "created when missing")
    args = parser.parse_args(argv)
    if args.new_token is not None:
        if args.identity is not None and args.scope != OPERATOR:
            parser.error("--identity is for --scope operator (a read token cannot act)")
        new_settings = None
        if args.scope == OPERATOR:
            try:
                new_settings = load_settings(Path(args.config) if args.config else None)
            except ConfigError as exc:
                print(f"keel-api: {exc}", file=sys.stderr)
                return 2
        return print_new_token(args.new_token, args.scope, args.identity, new_settings)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = load_settings(Path(args.config) if args.config else None)
        keys = operator_keys(settings, tokens_of(settings))  # before anything starts: a token that cannot act
        database_url = database_url_for(settings, AUDITOR)  # the store; NATS only for actions (serve)
    except (ConfigError, InsecurePathError) as exc:
        print(f"keel-api: {exc}", file=sys.stderr)
        return 2
    # uvicorn stops gracefully on SIGTERM/SIGINT, then raises the signal again under the handler found at start:
    # with this one the process ends with status 0 after a graceful stop, as every Keel service does.
    signal.signal(signal.SIGTERM, lambda *_: None)
    processes = settings.api.workers or min(2, os.cpu_count() or 1)
    if processes == 1:
        return _serve_here(settings, database_url, keys=keys)
    try:
        sock = listening_socket(settings.api.listen_host, settings.api.listen_port)
    except OSError as exc:
        print(f"keel-api: cannot listen on {settings.api.listen_host}:{settings.api.listen_port}: {exc}",
              file=sys.stderr)
        return 1
    workers = []
    api_pid = os.getpid()
    for _ in range(processes - 1):
        pid = os.fork()  # no thread and no event loop exists yet: the child starts clean
        if pid == 0:
            _die_with_parent(api_pid)
            os._exit(_serve_here(settings, database_url, sock, announce=False, parent=api_pid, keys=keys))
        workers.append(pid)
    try:
        return _serve_here(settings, database_url, sock, workers=workers, keys=keys)
    finally:
        for pid in workers:
            _stop_worker(pid)


def _serve_here(settings: Settings, database_url: str, sock: socket.socket | None = None, *, announce: bool = True,
                workers: Sequence[int] = (), parent: int | None = None,
                keys: dict[str, SigningKey] | None = None) -> int:
    try:
        asyncio.run(serve(settings, database_url, sock, announce=announce, workers=workers, parent=parent, keys=keys))
    except (SchemaNotCurrent, ConfigError, KeyringError, InsecurePathError) as exc:
        print(f"keel-api: {exc}", file=sys.stderr)
        return 2
    except WorkerLost as exc:
        print(f"keel-api: {exc}", file=sys.stderr)
        return 1
    return 0


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port) and listening, for every worker process to accept on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY on accepted connections only then (without it every answer
    # waited for the client's delayed ACK, 40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _die_with_parent(parent: int) -> None:
    """Linux: this worker gets SIGTERM when ``parent``, the process that forked it, dies (even by SIGKILL), so no
    worker is left serving the port alone. ``parent`` is taken before the fork: in a container the API is PID 1,
    so a parent of PID 1 is no sign of an orphan; a parent other than ``parent`` is."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the parent's stop still ends it
        pass
    if os.getppid() != parent:  # the parent died before the call above: reparented
        os._exit(1)


def _stop_worker(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM a worker and reap it: SIGKILL if it has not stopped within ``grace_s``."""
    import time

    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.05)


if __name__ == "__main__":
    raise SystemExit(main())
