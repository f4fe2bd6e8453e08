"""How fast and how surely the operations surface tells people: incident to webhook, through an outage.

    python -m bench.ops [--quick | --smoke] [--json PATH]

One run starts its own NATS (JetStream, authenticated) and PostgreSQL (``bench._servers``), the recorder and
the notifier as processes (``keel service recorder`` / ``keel service notifier``, each as its own identity, as
``keel up`` and a deployment run them), and a Standard Webhooks receiver in this process that checks every
signature and notes when each notification arrived. The bench publishes ``IncidentOpened`` events as the
controller would (signed with the controller's key).

- ``notify_p50_s`` / ``notify_p99_s``: from the moment the bus acknowledged an ``IncidentOpened`` (it is in the
  stream: recorded on the bus; the recorder writes it to PostgreSQL beside) to the moment the receiver has the
  signed webhook, at a steady offered load (``notify_rate_per_s``). Both clocks are this process's monotonic clock.
  Target: p99 ≤ 2 s.
- ``notify_from_recorded_p50_s`` / ``_p99_s``: the same arrivals from the moment PostgreSQL committed each event
  (``events.recorded_at``; wall clocks). The notifier and the recorder consume the stream side by side, so this
  can be negative: people may hear of an incident before the log has it, never without the bus having it.
- ``notify_lost``: the receiver answers 503 to everything for ``outage_s`` (60 s in the full run) while
  incidents keep coming; then it accepts again. Lost = incidents published minus incidents received (each counted
  once, by its event id), once the notifier has drained. Target: 0. ``outage_drain_s``: from the receiver's
  return to the last delivery. ``outage_deliveries_retried``: deliveries that took more than one attempt.
- ``api_p99_ms``: the HTTP API is not built yet: null, with the reason.

``--smoke`` runs it in seconds (the tests run it); ``--quick`` under three minutes (a 20 s outage). Results carry
their provenance (``bench._provenance``). Exits 0 even when a target is missed (it is a benchmark); misses are
printed as FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._provenance import provenance  # noqa: E402
from bench._servers import Servers, scratch_dir  # noqa: E402
from bench.bus import KeelSlice  # noqa: E402

SECRET = "whsec_" + base64.b64encode(b"bench-ops-webhook-secret-0123456").decode()
SIZES = {  # incidents at a steady rate, then incidents during the outage
    "smoke": {"steady": 10, "rate_per_s": 10.0, "outage_s": 3.0, "outage_rate_per_s": 2.0},
    "quick": {"steady": 200, "rate_per_s": 20.0, "outage_s": 20.0, "outage_rate_per_s": 2.0},
    "full": {"steady": 1000, "rate_per_s": 20.0, "outage_s": 60.0, "outage_rate_per_s": 2.0},
}


class WebhookReceiver:
    """A Standard Webhooks receiver: verifies each request, notes the first arrival of each event id; while
    ``failing`` it answers 503 (and counts the refusals)."""

    def __init__(self) -> None:
        from keel.events.envelope import now_utc
        from keel.notifier.core import verify_standard_webhook

        self.arrived: dict[str, float] = {}
        self.arrived_wall: dict[str, float] = {}
        self.bad_signatures = 0
        self.refused = 0
        self.failing = False
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                at = time.monotonic()
                if receiver.failing:
                    with receiver.lock:
                        receiver.refused += 1
                    self._answer(503)
                    return
                if verify_standard_webhook(dict(self.headers.items()), body, SECRET, now_utc()) is not None:
                    with receiver.lock:
                        receiver.bad_signatures += 1
                    self._answer(401)
                    return
                event_id = json.loads(body)["data"]["event_id"]
                with receiver.lock:
                    receiver.arrived.setdefault(event_id, at)
                    receiver.arrived_wall.setdefault(event_id, time.time())
                self._answer(200)

            def _answer(self, status: int) -> None:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/keel"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class NotifierProcess:
    """``keel service notifier`` on the slice, delivering to one webhook destination."""

    def __init__(self, ks: KeelSlice, receiver_url: str, home: Path) -> None:
        secret_file = home / "webhook.secret"
        secret_file.write_text(SECRET)
        secret_file.chmod(0o600)
        bus = ks.piece.bus_settings(ks.servers)
        destination = {"name": "bench-hook", "kind": "webhook", "url": receiver_url, "secret_file": str(secret_file),
                       "rate_per_minute": 100000}
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("KEEL_")},
            **ks.servers.service_env,
            "KEEL_NATS_URL": ks.nats_url, "KEEL_HOME": str(home), "KEEL_DB_SCHEMA": ks.piece.schema,
            "KEEL_BUS__SUBJECT_PREFIX": bus.subject_prefix, "KEEL_BUS__STREAM": bus.stream,
            "KEEL_BUS__DLQ_STREAM": bus.dlq_stream,
            "KEEL_NOTIFIER__DESTINATIONS": json.dumps([destination]),
            "KEEL_NOTIFIER__REQUEST_TIMEOUT": "2s", "KEEL_NOTIFIER__RETRY_MAX_BACKOFF": "5s",
            "KEEL_NOTIFIER__GIVE_UP_AFTER": "1h",
        }
        self.log_path = home / "notifier.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "keel.cli.main", "service", "notifier"], env=self.env,
                                         cwd=REPO, stdout=out, stderr=subprocess.STDOUT)

    async def wait_ready(self, bus: Any, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"the notifier exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                await bus.js.consumer_info(bus.settings.stream, "notifier")
                return
            except Exception:  # noqa: BLE001 - not there yet
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the notifier is not ready after {timeout_s} s:\n"
                                       f"{self.log_path.read_text()[-3000:]}") from None
                await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def percentile(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(round(pct / 100 * len(ordered) + 0.5)) - 1))]


async def publish_incidents(bus: Any, count: int, rate_per_s: float, job: str) -> dict[str, float]:
    """``count`` incidents at ``rate_per_s`` on a fixed schedule; event id -> when the bus acknowledged it."""
    from keel.events.envelope import Event, now_utc
    from keel.events.types import IncidentOpened

    acked: dict[str, float] = {}
    start = time.monotonic()
    for index in range(count):
        delay = start + index / rate_per_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        event = Event.create(IncidentOpened(kind="hang", node_id=f"n{index % 1200:04d}", generation=index,
                                            reason=f"bench incident {index}"),
                             job_id=job, subject=f"job/{job}", producer="controller", occurred_at=now_utc())
        await bus.publish(event)
        acked[str(event.id)] = time.monotonic()
    return acked


async def wait_arrived(receiver: WebhookReceiver, ids: set[str], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with receiver.lock:
            if ids <= set(receiver.arrived):
                return True
        await asyncio.sleep(0.1)
    return False


async def since_recorded(ks: KeelSlice, receiver: WebhookReceiver, ids: set[str]) -> list[float]:
    """Per incident: the webhook's arrival minus the moment PostgreSQL committed it (``events.recorded_at``, the
    recorder's transaction; both wall clocks of this machine). Negative when the notifier was faster than the
    recorder: both consume the stream independently."""
    import uuid

    from bench.bus import pg_connect

    deadline = time.monotonic() + 30
    conn = await pg_connect(ks.database_url, ks.piece.schema)
    try:
        while True:
            rows = await conn.fetch("SELECT event_id, recorded_at FROM events WHERE event_id = ANY($1::uuid[])",
                                    [uuid.UUID(i) for i in ids])
            if len(rows) == len(ids) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    finally:
        await conn.close()
    with receiver.lock:
        return [receiver.arrived_wall[str(r["event_id"])] - r["recorded_at"].timestamp() for r in rows
                if str(r["event_id"]) in receiver.arrived_wall]


async def measure_notify(servers: Servers, home: Path, size: dict[str, float]) -> dict[str, Any]:
    receiver = WebhookReceiver()
    try:
        async with KeelSlice(servers, servers.nats_url, home) as ks:
            await ks.start_recorder()
            notifier = NotifierProcess(ks, receiver.url, home)
            notifier.start()
            try:
                await notifier.wait_ready(ks.bus)
                steady = await publish_incidents(ks.bus, int(size["steady"]), size["rate_per_s"], "bench-ops")
                drained = await wait_arrived(receiver, set(steady), 60)
                latencies = [receiver.arrived[i] - at for i, at in steady.items() if i in receiver.arrived]
                from_recorded = await since_recorded(ks, receiver, set(steady))

                receiver.failing = True
                outage_started = time.monotonic()
                count = max(1, int(size["outage_s"] * size["outage_rate_per_s"]))
                during = await publish_incidents(ks.bus, count, size["outage_rate_per_s"], "bench-ops")
                await asyncio.sleep(max(0.0, outage_started + size["outage_s"] - time.monotonic()))
                receiver.failing = False
                back = time.monotonic()
                await wait_arrived(receiver, set(during), 120)
                with receiver.lock:
                    arrived = dict(receiver.arrived)
                got = [arrived[i] for i in during if i in arrived]
                log = (home / "notifier.log").read_text(errors="replace")
            finally:
                await asyncio.to_thread(notifier.stop)
    finally:
        receiver.close()
    return {
        "notify_p50_s": percentile(latencies, 50), "notify_p99_s": percentile(latencies, 99),
        "notify_max_s": max(latencies) if latencies else None, "notify_count": len(steady),
        "notify_from_recorded_p50_s": percentile(from_recorded, 50),
        "notify_from_recorded_p99_s": percentile(from_recorded, 99),
        "notify_received": len(latencies), "notify_drained": drained, "notify_rate_per_s": size["rate_per_s"],
        "notify_lost": len(during) - len(got), "outage_s": size["outage_s"], "outage_incidents": len(during),
        "outage_refusals": receiver.refused, "outage_drain_s": (max(got) - back) if got else None,
        "outage_deliveries_retried": log.count("attempt 1: HTTP 503"),
        "bad_signatures": receiver.bad_signatures,
    }


async def run(mode: str) -> dict[str, Any]:
    servers = Servers()
    servers.start()
    home = scratch_dir("keel-bench-ops-")
    try:
        notify = await measure_notify(servers, home, SIZES[mode])
    finally:
        servers.stop()
    failures = []
    if notify["notify_p99_s"] is None or notify["notify_p99_s"] > 2.0:
        failures.append(f"notify_p99_s {notify['notify_p99_s']} > 2 s")
    if notify["notify_lost"] != 0:
        failures.append(f"notify_lost {notify['notify_lost']} != 0")
    if notify["bad_signatures"]:
        failures.append(f"{notify['bad_signatures']} webhook(s) with a bad signature")
    return {"mode": mode, **notify, "api_p99_ms": None,
            "api_p99_ms_reason": "the HTTP API (issue 20, item 4) is not built yet", "failures": failures}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.ops", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="under three minutes (a 20 s outage)")
    size.add_argument("--smoke", action="store_true", help="seconds: a check that it works")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results there")
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    results = {**provenance(argv, "bench.ops"), **asyncio.run(run(mode))}
    print(f"notify p50 {results['notify_p50_s']} s, p99 {results['notify_p99_s']} s over {results['notify_count']} "
          f"incidents at {results['notify_rate_per_s']}/s; outage {results['outage_s']} s: {results['outage_incidents']} "
          f"incidents, {results['notify_lost']} lost, drained {results['outage_drain_s']} s after the receiver's return")
    for failure in results["failures"]:
        print(f"FAIL {failure}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
