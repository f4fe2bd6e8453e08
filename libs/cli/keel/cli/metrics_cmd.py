"""``keel metrics``: the operations metrics in Prometheus' text format, derived from the event log.

    keel metrics                                   print them once
    keel metrics --textfile /var/lib/node_exporter/textfile/keel.prom    write them for node_exporter's
                                                   textfile collector (atomically: a temporary file renamed)
    keel metrics --serve 127.0.0.1:9464 --token-file F     serve GET /metrics to Prometheus, bearer token F

The metrics are ``keel.infra.ops_metrics``'s: ETTR, incidents by kind and rung, detection and recovery
latencies, restarts, evictions, decisions, the standby pool, checkpoint tiers, the store's totals. With
``--serve`` the log is folded once, then only the events recorded since are read, every
``--interval``; a scrape gets the metrics as of the last read. ``--serve`` refuses to run without a token
(a file holding it, or ``$KEEL_METRICS_TOKEN``), and a request without ``Authorization: Bearer <token>`` gets
401. Listens on loopback unless told otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from keel.cli.common import CliError, Subparsers, endpoints
from keel.events.units import parse_duration

if TYPE_CHECKING:
    from keel.infra.config import Settings
    from keel.infra.ops_metrics import OpsMetrics, StoreTotals
    from keel.infra.store import EventStore

log = logging.getLogger(__name__)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_REQUEST_BYTES = 8192


def register(sub: Subparsers) -> None:
    metrics = sub.add_parser("metrics", help="the operations metrics in Prometheus' text format, from the log")
    metrics.add_argument("--job", default=None, help="only this job's events (default: every job's)")
    metrics.add_argument("--textfile", default=None, metavar="PATH",
                         help="write them to PATH (atomically) instead of printing: node_exporter's textfile collector")
    metrics.add_argument("--serve", default=None, metavar="HOST:PORT",
                         help="serve GET /metrics on HOST:PORT (bearer token required: --token-file or "
                              "$KEEL_METRICS_TOKEN)")
    metrics.add_argument("--token-file", default=None, metavar="PATH", help="the bearer token for --serve")
    metrics.add_argument("--interval", default="5s", help="with --serve: how often new events are read (default 5s)")
    metrics.set_defaults(func=cmd_metrics)


async def fold(store: EventStore, metrics: OpsMetrics, job: str | None) -> StoreTotals:
    """Fold every event recorded after ``metrics.position``; the store's totals now."""
    from keel.infra.ops_metrics import StoreTotals

    async for recorded in store.read(job_id=job, after_position=metrics.position):
        metrics.apply(recorded.event, recorded.position)
    return StoreTotals(events_recorded=await store.count(job), dead_lettered=len(await store.dead_letters()))


def write_textfile(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader never sees half of it (a temporary file in the same folder,
    renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_token(token_file: str | None) -> str:
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise CliError(f"--token-file {token_file}: {exc.strerror or exc}") from None
    else:
        token = os.environ.get("KEEL_METRICS_TOKEN", "").strip()
    if len(token) < 16:
        raise CliError("keel metrics --serve needs a bearer token of at least 16 characters: --token-file PATH or "
                       "$KEEL_METRICS_TOKEN (a metrics endpoint is not served unauthenticated)")
    return token


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CliError(f"--serve: expected HOST:PORT (e.g. 127.0.0.1:9464), got {value!r}")
    return host.strip("[]"), int(port)


def respond(request: bytes, token: str, body: str) -> bytes:
    """The HTTP/1.1 response to one request (pure): the metrics for ``GET /metrics`` with the right bearer token,
    401 without it, 404 for another path, 405 for another method, 400 for what is not a request."""
    head, _, _ = request.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _response(400, "Bad Request", "not an HTTP request\n")
    method, target, _ = parts
    if target.split("?", 1)[0] != "/metrics":
        return _response(404, "Not Found", "only /metrics is served here\n")
    if method not in ("GET", "HEAD"):
        return _response(405, "Method Not Allowed", "GET /metrics\n", {"Allow": "GET, HEAD"})
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    scheme, _, given = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        return _response(401, "Unauthorized", "a bearer token is required\n", {"WWW-Authenticate": 'Bearer realm="keel"'})
    response = _response(200, "OK", body, {"Content-Type": CONTENT_TYPE})
    return response.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n" if method == "HEAD" else response


def _response(code: int, reason: str, body: str, headers: dict[str, str] | None = None) -> bytes:
    payload = body.encode()
    fields = {"Content-Type": "text/plain; charset=utf-8", **(headers or {}), "Content-Length": str(len(payload)),
              "Connection": "close"}
    head = f"HTTP/1.1 {code} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    return head.encode() + payload


async def serve(store: EventStore, job: str | None, host: str, port: int, token: str, interval_s: float,
                ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Fold the log, then serve ``/metrics`` and read new events every ``interval_s`` until ``stop``."""
    from keel.infra.ops_metrics import OpsMetrics

    metrics = OpsMetrics()
    totals = await fold(store, metrics, job)
    state = {"body": metrics.render(totals)}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            writer.write(respond(request, token, state["body"]))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port, limit=MAX_REQUEST_BYTES)
    bound = ", ".join(f"{s.getsockname()[0]}:{s.getsockname()[1]}" for s in server.sockets)
    print(f"keel metrics: serving /metrics on {bound} (bearer token required)", flush=True)
    if ready is not None:
        ready.set()
    stop = stop or asyncio.Event()
    async with server:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                pass
            try:
                before, seen = metrics.position, totals
                totals = await fold(store, metrics, job)
                if metrics.position != before or totals != seen:  # ETTR is recomputed only when something changed
                    state["body"] = metrics.render(totals)
            except Exception:  # noqa: BLE001 - the store may be away for a while: keep serving the last figures
                log.exception("keel metrics: reading new events failed; serving the last metrics")


def cmd_metrics(args: argparse.Namespace, settings: Settings) -> int:
    from keel.infra.ops_metrics import OpsMetrics
    from keel.infra.store import EventStore, create_engine

    try:
        interval = parse_duration(args.interval)
    except ValueError as exc:
        raise CliError(f"--interval: {exc}") from None
    if interval.total_seconds() <= 0:
        raise CliError(f"--interval must be longer than 0 s, got {args.interval!r}")
    if args.serve and args.textfile:
        raise CliError("--serve and --textfile are two ways to publish the metrics: pick one")
    listen = parse_listen(args.serve) if args.serve else None
    token = read_token(args.token_file) if listen else ""
    _, database_url = endpoints(settings)

    async def main() -> str:
        engine = create_engine(database_url, settings.db_schema)
        try:
            store = EventStore(engine)
            if listen is not None:
                await serve(store, args.job, listen[0], listen[1], token, interval.total_seconds())
                return ""
            metrics = OpsMetrics()
            return metrics.render(await fold(store, metrics, args.job))
        finally:
            await engine.dispose()

    try:
        text = asyncio.run(main())
    except KeyboardInterrupt:
        return 0
    if args.textfile:
        write_textfile(Path(args.textfile), text)
        print(f"keel metrics: wrote {args.textfile}", file=sys.stderr)
    elif text:
        sys.stdout.write(text)
    return 0
