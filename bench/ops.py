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
- ``api_p99_ms``: the HTTP API (``keel-api``, a process of its own, read as the auditor) over a log of
  ``api_log_events`` events (1,000,000 in the full run; 200,000 in ``--quick``, so the figure is labelled with
  its log size) of which ``api_incidents`` are incidents with their decisions, the rest node heartbeats from
  1,200 nodes. A second process (this module's ``--load``, ``api_clients`` threads with a kept-alive connection
  each, the equivalent of ``wrk -c``) asks for the incident list and random incidents' timelines, half each, for
  ``api_seconds``. Half the list requests ask for the first page (``/v1/incidents?job=&limit=100``: the newest
  100, as the web page asks; the API keeps a page while nothing newer it summarizes is logged, and the log does
  not change during the load, so these are answered from what it kept), the other half for an older page at a
  random position (``&before=``): pages never asked for before, read from the store. ``api_p99_ms`` is the worst
  p99 of the three (first page, older page, timeline), from the client's side (request sent to the whole answer
  read). Target ≤ 100 ms. Also ``api_list_p99_ms`` (first page), ``api_list_older_p99_ms``,
  ``api_timeline_p99_ms``, ``api_audit_p99_ms`` (the paged audit view, the first 100) and ``api_requests_per_s``.

``--smoke`` runs it in seconds (the tests run it); ``--quick`` under three minutes (a 20 s outage).
On this 2-core machine the API, PostgreSQL and the load process share two cores: the latencies include that
contention (reported as measured, not corrected). Results carry
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._provenance import provenance  # noqa: E402
from bench._servers import Servers, scratch_dir  # noqa: E402
from bench.bus import KeelSlice  # noqa: E402
from keel.notifier.receiver import WebhookReceiver  # noqa: E402

SECRET = "whsec_" + base64.b64encode(b"bench-ops-webhook-secret-0123456").decode()
SIZES = {  # incidents at a steady rate, then incidents during the outage
    "smoke": {"steady": 10, "rate_per_s": 10.0, "outage_s": 3.0, "outage_rate_per_s": 2.0},
    "quick": {"steady": 200, "rate_per_s": 20.0, "outage_s": 20.0, "outage_rate_per_s": 2.0},
    "full": {"steady": 1000, "rate_per_s": 20.0, "outage_s": 60.0, "outage_rate_per_s": 2.0},
}


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


API_SIZES = {
    "smoke": {"events": 3_000, "incidents": 20, "seconds": 3.0, "clients": 2},
    "quick": {"events": 200_000, "incidents": 1_000, "seconds": 20.0, "clients": 4},
    "full": {"events": 1_000_000, "incidents": 1_000, "seconds": 60.0, "clients": 4},
}
API_JOB = "bench-api"
API_ROUTES = ("list", "list_older", "timeline", "audit")


def api_log(total: int, incidents: int) -> tuple[list[Any], list[str]]:
    """``total`` events of one job: ``incidents`` incidents (opened, restart decided, resolved: a timeline of three
    plus its evidence) spread through node heartbeats from 1,200 nodes, a second apart. Returns the events and the
    incident ids."""
    from datetime import timedelta

    from keel.events.envelope import Event, now_utc
    from keel.events.types import IncidentOpened, IncidentResolved, NodeHeartbeat, RestartDecided

    beats = max(total - 3 * incidents, incidents)
    start = now_utc() - timedelta(seconds=beats)
    events: list[Any] = []
    ids: list[str] = []
    every = max(1, beats // max(1, incidents))
    for index in range(beats):
        at = start + timedelta(seconds=index)
        node = f"n{index % 1200:04d}"
        beat = Event.create(NodeHeartbeat(node_id=node, ranks_alive=8, ranks_expected=8, last_step=index),
                            job_id=API_JOB, subject=f"node/{node}", producer="node-agent", occurred_at=at)
        events.append(beat)
        if index % every == every - 1 and len(ids) < incidents:
            opened = Event.create(IncidentOpened(kind="crash", node_id=node, generation=len(ids), reason="bench crash",
                                                 evidence=[str(beat.id)]),
                                  job_id=API_JOB, subject=f"job/{API_JOB}", producer="controller", occurred_at=at)
            incident = str(opened.id)
            decided = Event.create(RestartDecided(incident_id=incident, rung=2, generation=len(ids) + 1,
                                                  reason="bench restart"), job_id=API_JOB, subject=f"job/{API_JOB}",
                                   producer="controller", occurred_at=at, correlation_id=opened.id)
            resolved = Event.create(IncidentResolved(incident_id=incident, outcome="recovered", rung=2,
                                                     generation=len(ids) + 1, reason="bench resumed"),
                                    job_id=API_JOB, subject=f"job/{API_JOB}", producer="controller",
                                    occurred_at=at + timedelta(milliseconds=500), correlation_id=opened.id)
            events += [opened, decided, resolved]
            ids.append(incident)
    return events, ids


async def seed_api_log(database_url: str, schema: str, events: list[Any]) -> float:
    """Append ``events`` to the slice's store in batches, then vacuum and analyze the table; returns the seconds it
    took. A log of a million events grew over weeks, and autovacuum went over it meanwhile: written in one minute,
    it would be vacuumed (and its hint bits written, page by page, by the first reads) while the load runs, which
    no store in use sees."""
    import sqlalchemy as sa

    from keel.infra.store import append_events, create_engine, event_row

    started = time.monotonic()
    engine = create_engine(database_url, schema)
    try:
        for first in range(0, len(events), 5_000):
            async with engine.begin() as conn:
                await append_events(conn, [event_row(e, None) for e in events[first:first + 5_000]])
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(sa.text("VACUUM (ANALYZE) events"))
    finally:
        await engine.dispose()
    return time.monotonic() - started


def load_api(base: str, token: str, incidents: list[str], seconds: float, clients: int,
             log_size: int) -> dict[str, list[float]]:
    """The load (run in a process of its own: ``--load``): ``clients`` threads, each with one kept-alive HTTP
    connection, alternating the incident list and a random incident's timeline (and every 10th request the paged
    audit view) for ``seconds``. Every other list request asks for an older page (``before`` a random position of
    the log): a page the API has not answered before, so it is read from the store, not kept. Returns each route's latencies in seconds; a non-200 answer raises."""
    import http.client
    import random
    import threading
    from urllib.parse import urlsplit

    where = urlsplit(base)
    latencies: dict[str, list[float]] = {route: [] for route in API_ROUTES}
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
        headers = {"Authorization": f"Bearer {token}"}
        count = 0
        while time.monotonic() < deadline and not errors:
            count += 1
            if count % 10 == 0:
                route, path = "audit", f"/v1/audit/incidents?job={API_JOB}&limit=100"
            elif count % 4 == 1:
                route, path = "list", f"/v1/incidents?job={API_JOB}&limit=100"
            elif count % 4 == 3:
                route, path = "list_older", f"/v1/incidents?job={API_JOB}&limit=100&before={rng.randint(2, log_size)}"
            else:
                route, path = "timeline", f"/v1/incidents/{rng.choice(incidents)}/timeline?job={API_JOB}"
            sent = time.monotonic()
            conn.request("GET", path, headers=headers)
            response = conn.getresponse()
            body = response.read()
            took = time.monotonic() - sent
            if response.status != 200:
                with lock:
                    errors.append(f"{path}: HTTP {response.status} {body[:300]!r}")
                return
            with lock:
                latencies[route].append(took)
        conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(errors[0])
    return latencies


async def measure_api(servers: Servers, home: Path, size: dict[str, float]) -> dict[str, Any]:
    """The API under load, twice over the same log: as configured by default, then with no parsed events kept
    (``api.parsed_events_kept: 0``), so every page and timeline parses all its events, as on a log whose
    incidents outnumber what a process keeps."""
    import secrets

    from keel.infra.api_auth import READ, TOKEN_BYTES, new_token
    from keel.infra.embedded import free_port

    events, incidents = api_log(int(size["events"]), int(size["incidents"]))
    runs: dict[str, dict[str, list[float]]] = {}
    async with KeelSlice(servers, servers.nats_url, home) as ks:
        seed_s = await seed_api_log(servers.database_url, ks.piece.schema, events)
        token, entry = new_token("bench", READ, secrets.token_bytes(TOKEN_BYTES))
        for run, extra in (("kept", {}), ("unkept", {"KEEL_API__PARSED_EVENTS_KEPT": "0"})):
            port = free_port()
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}, **servers.service_env,
                   "KEEL_NATS_URL": servers.nats_url, "KEEL_DATABASE_URL": servers.database_url, "KEEL_HOME": str(home),
                   "KEEL_DB_SCHEMA": ks.piece.schema, "KEEL_API__LISTEN_PORT": str(port),
                   "KEEL_API__TOKENS": json.dumps([{"name": entry.name, "scope": entry.scope, "sha256": entry.sha256}]),
                   **extra}
            log_path = home / f"api-{run}.log"
            with open(log_path, "wb") as out:
                api = subprocess.Popen([sys.executable, "-m", "keel.api.main"], env=env, cwd=REPO, stdout=out,
                                       stderr=subprocess.STDOUT)
            base = f"http://127.0.0.1:{port}"
            try:
                await wait_healthy(base, api, log_path)
                spec = {"base": base, "token": token, "incidents": incidents, "seconds": size["seconds"],
                        "clients": int(size["clients"]), "log_size": len(events)}
                loaded = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "bench.ops", "--load"],
                                                 input=json.dumps(spec), capture_output=True, text=True, cwd=REPO,
                                                 timeout=size["seconds"] + 300)
                if loaded.returncode != 0:
                    raise RuntimeError(f"the load process failed: {loaded.stderr[-3000:]}")
                runs[run] = json.loads(loaded.stdout)
            finally:
                api.send_signal(signal.SIGTERM)
                try:
                    api.wait(15)
                except subprocess.TimeoutExpired:
                    api.kill()
                    api.wait()
    latencies, unkept = runs["kept"], runs["unkept"]

    def pct(route: str, value: float, of: dict[str, list[float]]) -> float | None:
        return percentile([t * 1000 for t in of[route]], value)

    worst = [v for v in (pct(r, 99, latencies) for r in ("list", "list_older", "timeline")) if v is not None]
    worst_unkept = [v for v in (pct(r, 99, unkept) for r in ("list", "list_older", "timeline")) if v is not None]
    total = sum(len(v) for v in latencies.values())
    return {"api_p99_ms": max(worst) if worst else None, "api_list_p99_ms": pct("list", 99, latencies),
            "api_list_older_p99_ms": pct("list_older", 99, latencies),
            "api_list_older_p50_ms": pct("list_older", 50, latencies),
            "api_timeline_p99_ms": pct("timeline", 99, latencies), "api_audit_p99_ms": pct("audit", 99, latencies),
            "api_list_p50_ms": pct("list", 50, latencies), "api_timeline_p50_ms": pct("timeline", 50, latencies),
            "api_requests": total, "api_requests_per_s": total / size["seconds"], "api_clients": int(size["clients"]),
            "api_seconds": size["seconds"], "api_log_events": len(events), "api_incidents": len(incidents),
            "api_seed_s": seed_s,
            "api_unkept_p99_ms": max(worst_unkept) if worst_unkept else None,
            "api_unkept_list_older_p50_ms": pct("list_older", 50, unkept),
            "api_unkept_list_older_p99_ms": pct("list_older", 99, unkept),
            "api_unkept_timeline_p99_ms": pct("timeline", 99, unkept),
            "api_unkept_requests_per_s": sum(len(v) for v in unkept.values()) / size["seconds"]}


async def wait_healthy(base: str, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"keel-api exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/healthz", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"keel-api did not answer within {timeout_s} s:\n{log_path.read_text()[-3000:]}")


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
        if ids <= set(receiver.first_arrivals()):
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
    arrived = receiver.first_arrivals()
    return [arrived[str(r["event_id"])].at_wall - r["recorded_at"].timestamp() for r in rows
            if str(r["event_id"]) in arrived]


async def measure_notify(servers: Servers, home: Path, size: dict[str, float]) -> dict[str, Any]:
    receiver = WebhookReceiver(SECRET)
    try:
        async with KeelSlice(servers, servers.nats_url, home) as ks:
            await ks.start_recorder()
            notifier = NotifierProcess(ks, receiver.url, home)
            notifier.start()
            try:
                await notifier.wait_ready(ks.bus)
                steady = await publish_incidents(ks.bus, int(size["steady"]), size["rate_per_s"], "bench-ops")
                drained = await wait_arrived(receiver, set(steady), 60)
                first = receiver.first_arrivals()
                latencies = [first[i].at_monotonic - at for i, at in steady.items() if i in first]
                from_recorded = await since_recorded(ks, receiver, set(steady))

                receiver.failing = True
                outage_started = time.monotonic()
                count = max(1, int(size["outage_s"] * size["outage_rate_per_s"]))
                during = await publish_incidents(ks.bus, count, size["outage_rate_per_s"], "bench-ops")
                await asyncio.sleep(max(0.0, outage_started + size["outage_s"] - time.monotonic()))
                receiver.failing = False
                back = time.monotonic()
                await wait_arrived(receiver, set(during), 120)
                arrived = receiver.first_arrivals()
                got = [arrived[i].at_monotonic for i in during if i in arrived]
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
        api = await measure_api(servers, home, API_SIZES[mode])
    finally:
        servers.stop()
    failures = []
    if notify["notify_p99_s"] is None or notify["notify_p99_s"] > 2.0:
        failures.append(f"notify_p99_s {notify['notify_p99_s']} > 2 s")
    if notify["notify_lost"] != 0:
        failures.append(f"notify_lost {notify['notify_lost']} != 0")
    if notify["bad_signatures"]:
        failures.append(f"{notify['bad_signatures']} webhook(s) with a bad signature")
    if api["api_p99_ms"] is None or api["api_p99_ms"] > 100.0:
        failures.append(f"api_p99_ms {api['api_p99_ms']} > 100 ms (over {api['api_log_events']} events)")
    return {"mode": mode, **notify, **api, "failures": failures}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.ops", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="under three minutes (a 20 s outage)")
    size.add_argument("--smoke", action="store_true", help="seconds: a check that it works")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results there")
    parser.add_argument("--load", action="store_true", help="(internal) be the API's load process: a JSON spec on "
                                                           "stdin, the latencies as JSON on stdout")
    args = parser.parse_args(argv)
    if args.load:
        spec = json.loads(sys.stdin.read())
        print(json.dumps(load_api(spec["base"], spec["token"], spec["incidents"], spec["seconds"], spec["clients"],
                                  spec["log_size"])))
        return 0
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    results = {**provenance(argv, "bench.ops"), **asyncio.run(run(mode))}
    print(f"notify p50 {results['notify_p50_s']} s, p99 {results['notify_p99_s']} s over {results['notify_count']} "
          f"incidents at {results['notify_rate_per_s']}/s; outage {results['outage_s']} s: {results['outage_incidents']} "
          f"incidents, {results['notify_lost']} lost, drained {results['outage_drain_s']} s after the receiver's return")
    print(f"api p99 {results['api_p99_ms']} ms (list {results['api_list_p99_ms']} ms, timeline "
          f"{results['api_timeline_p99_ms']} ms, audit {results['api_audit_p99_ms']} ms) over "
          f"{results['api_log_events']} events, {results['api_requests_per_s']:.1f} requests/s from "
          f"{results['api_clients']} clients; with no parsed events kept: p99 {results['api_unkept_p99_ms']} ms "
          f"(older pages {results['api_unkept_list_older_p99_ms']} ms)")
    for failure in results["failures"]:
        print(f"FAIL {failure}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
