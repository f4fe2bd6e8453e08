"""``keel-api``: serve the HTTP API until SIGTERM or SIGINT (uvicorn), read-only, as the ``auditor`` role.

Settings from ``--config``/``KEEL_CONFIG`` and ``KEEL_*`` (``api.*``: address, port, tokens), the database from
``KEEL_DATABASE_URL`` or a running ``keel up``. Exit status 2 on a configuration error or an old schema.
``keel-api --new-token NAME [--scope operator]`` prints a new token and its ``api.tokens`` entry.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from keel.api.app import create_app
from keel.infra.api_auth import READ, SCOPES, TOKEN_BYTES, ApiToken, new_token
from keel.infra.config import ConfigError, Settings, load_settings, resolve_endpoints
from keel.infra.dbroles import AUDITOR
from keel.infra.service import ALIVE_INTERVAL_S, READY_FILE_ENV
from keel.infra.store import SchemaNotCurrent, check_schema_current, create_engine

log = logging.getLogger("keel.api")

URL_FILE = "api.url"
"""Written beside the ready file once listening: the URL the API really serves on."""


def tokens_of(settings: Settings) -> list[ApiToken]:
    return [ApiToken(t.name, t.scope, t.sha256) for t in settings.api.tokens]


async def serve(settings: Settings, database_url: str) -> None:
    """Serve until uvicorn is told to stop (SIGTERM, SIGINT); the engine is closed whatever happens.

    Under a supervisor (``$KEEL_SERVICE_READY_FILE``, as ``keel up`` runs it): once listening, write the bound
    URL beside the ready file (``api.url``; ``api.listen_port: 0`` takes a free port), then the ready file (this
    pid), and touch it every ``ALIVE_INTERVAL_S`` while serving, as every Keel service does."""
    import uvicorn

    engine = create_engine(database_url, settings.db_schema)
    try:
        await check_schema_current(engine, settings.db_schema)
        tokens = tokens_of(settings)
        if not tokens:
            log.warning("api: no tokens configured (api.tokens): every request but /healthz is refused")
        app = create_app(engine, tokens, max_page=settings.api.max_page)
        config = uvicorn.Config(app, host=settings.api.listen_host, port=settings.api.listen_port, log_level="info",
                                access_log=False, server_header=False, proxy_headers=False)
        server = uvicorn.Server(config)
        announce = asyncio.create_task(_announce_when_listening(server, len(tokens)))
        try:
            await server.serve()
        finally:
            announce.cancel()
    finally:
        await engine.dispose()


def bound_url(server: Any) -> str:
    """``http://HOST:PORT`` of a started uvicorn server's first socket (the port it really got)."""
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


async def _announce_when_listening(server: Any, token_count: int) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.02)
    url = bound_url(server)
    log.info("api: serving on %s (%d token(s))", url, token_count)
    ready_file = os.environ.get(READY_FILE_ENV)
    if not ready_file:
        return
    ready = Path(ready_file)
    url_file, partial = ready.with_name(URL_FILE), ready.with_name(f".{URL_FILE}.partial")
    partial.write_text(f"{url}\n")
    os.replace(partial, url_file)  # a reader sees the whole URL or none
    ready.write_text(f"{os.getpid()}\n")
    while True:
        await asyncio.sleep(ALIVE_INTERVAL_S)
        try:
            ready.touch()
        except OSError as exc:  # a probe reads it; serving does not depend on it
            log.warning("cannot touch the ready file %s: %s", ready, exc)


def print_new_token(name: str, scope: str) -> int:
    """``keel-api --new-token NAME``: a fresh token on stdout's first line, its ``api.tokens`` entry (no secret) on
    the second. Give the token to its holder; put the entry in the settings."""
    try:
        token, entry = new_token(name, scope, secrets.token_bytes(TOKEN_BYTES))
    except ValueError as exc:
        print(f"keel-api: {exc}", file=sys.stderr)
        return 2
    print(token)
    print(json.dumps({"name": entry.name, "scope": entry.scope, "sha256": entry.sha256}))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keel-api", description="Serve Keel's HTTP API until SIGTERM.")
    parser.add_argument("--config", help="YAML settings file (also KEEL_CONFIG)")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--new-token", metavar="NAME", help="print a new token for NAME and its api.tokens entry, "
                                                           "then exit (nothing is stored)")
    parser.add_argument("--scope", choices=SCOPES, default=READ, help="the new token's scope (default: read)")
    args = parser.parse_args(argv)
    if args.new_token is not None:
        return print_new_token(args.new_token, args.scope)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = load_settings(Path(args.config) if args.config else None)
        _, database_url = resolve_endpoints(settings, AUDITOR)
    except ConfigError as exc:
        print(f"keel-api: {exc}", file=sys.stderr)
        return 2
    # uvicorn stops gracefully on SIGTERM/SIGINT, then raises the signal again under the handler found at start:
    # with this one the process ends with status 0 after a graceful stop, as every Keel service does.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        asyncio.run(serve(settings, database_url))
    except SchemaNotCurrent as exc:
        print(f"keel-api: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
