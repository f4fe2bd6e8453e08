"""`keel up` / `keel status` / `keel down` as a user runs them: real servers and services in the background."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import sqlalchemy as sa

from keel.events.envelope import Event, now_utc
from keel.events.types import NodeRegistered
from keel.infra.bus import Bus
from keel.infra.config import BusSettings, load_settings, resolve_endpoints
from keel.infra.dbroles import AUDITOR
from keel.infra.embedded import free_port
from keel.infra.store import EventStore, create_engine
from tests.factories import health_event

pytestmark = pytest.mark.integration


def cli_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KEEL_NATS_URL", "KEEL_DATABASE_URL")}
    env.update(
        KEEL_HOME=str(home),
        KEEL_NATS__PORT=str(free_port()),
        KEEL_NATS__MONITOR_PORT=str(free_port()),
        KEEL_POSTGRES__PORT=str(free_port()),
        KEEL_API__LISTEN_PORT="0",  # a free port: `keel up` prints the one the API got
    )
    return env


def auditor_url(env: dict[str, str]) -> str:
    """The read-only role's URL on the runtime `keel up` started (what `keel incidents` and the like use)."""
    return resolve_endpoints(load_settings(environ=env), AUDITOR)[1]


def keel(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "keel.cli.main", *args], env=env, capture_output=True, text=True, timeout=120)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_the_api_serves_the_log(up: dict, status: dict) -> None:
    """The API `keel up` supervises: on the URL it printed, behind the local operator token it made (0600),
    serving what the recorder stored; no token, no answer."""
    api = up["api"]
    assert api == status["api"] and api["url"].startswith("http://127.0.0.1:"), api
    token_file = Path(api["token_file"])
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()

    def get(path: str, token: str | None) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(api["url"] + path, headers=headers), timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    assert get("/v1/jobs", None)[0] == 401
    code, jobs = get("/v1/jobs", token)
    assert code == 200 and "job1" in json.dumps(jobs), jobs
    code, events = get("/v1/events?job=job1", token)
    assert code == 200 and {e["type"] for e in events["events"]} >= {"NodeRegistered", "NodeEvicted"}, events
    # The local operator token may act (the operator's key loaded, the API on NATS): an unknown request is 404,
    # not 503 (no actions) nor 403.
    ask = urllib.request.Request(api["url"] + "/v1/approvals/00000000-0000-4000-8000-000000000000", method="POST",
                                 data=b'{"decision": "approve"}', headers={"Authorization": f"Bearer {token}",
                                                                         "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(ask, timeout=30)
        raise AssertionError("an unknown approval request was answered")
    except urllib.error.HTTPError as exc:
        assert exc.code == 404 and "no approval request" in exc.read().decode()


def test_up_records_events_and_down_leaves_nothing_running(scratch_dir: Path) -> None:
    env = cli_env(scratch_dir / "home")
    up = keel(env, "up")
    try:
        assert up.returncode == 0, up.stderr
        state = json.loads(up.stdout)
        assert "@" not in state["database_url"]  # printed without credentials
        pids = [state["services"][s]["pid"] for s in ("recorder", "controller", "checkpoint-broker", "actuator")]
        pids += [state["runtime"]["nats"]["pid"], state["runtime"]["postgres"]["pid"]]
        assert all(pids) and all(pid_alive(pid) for pid in pids)

        again = keel(env, "up")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["services"] == state["services"]  # idempotent: same processes

        async def publish_and_read() -> int:
            # As an operator would: the identity `keel up` issued (an anonymous client is refused).
            bus = await Bus.connect(state["nats_url"],
                                    BusSettings(credentials=scratch_dir / "home" / "credentials" / "nats" / "admin.json"))
            await bus.publish(Event.create(NodeRegistered(node_id="n1", host="h1"), job_id="job1", subject="node/n1",
                                           producer="node-agent", occurred_at=now_utc()))
            await bus.publish(health_event("n1", status="failed", fatal=True, confidence="high", component="gpu",
                                           at=now_utc()))
            await bus.close()
            engine = create_engine(auditor_url(env))
            store = EventStore(engine)
            deadline = time.monotonic() + 30
            # The registration, the fault, the controller's eviction and the actuator's report of it.
            while await store.count() < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            count = await store.count()
            reports = [r.event.payload async for r in store.read(types=["NodeEvicted"])]
            async with engine.connect() as conn:  # who the services connect as
                users = set((await conn.execute(sa.text(
                    "SELECT usename FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid()"))).scalars())
            await engine.dispose()
            return count, reports, users

        count, reports, users = asyncio.run(publish_and_read())
        assert count == 4
        # Each its own role, never the superuser; the API (if its pool holds a connection yet) reads as the auditor.
        assert {"keel_recorder", "keel_decider"} <= users <= {"keel_recorder", "keel_decider", "keel_auditor"}, users
        # No local cluster runs under this home: the actuator says so instead of pretending.
        assert [(r.outcome, "no local cluster" in r.detail) for r in reports] == [("failed", True)], reports
        status = json.loads(keel(env, "status").stdout)
        assert status["services"]["recorder"]["running"] and status["runtime"]["nats"]["running"]
        assert_the_api_serves_the_log(state, status)
        pids.append(status["services"]["api"]["pid"])
    finally:
        down = keel(env, "down")
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 10
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(pid) for pid in pids)
    assert keel(env, "down").returncode == 0  # idempotent
    status = json.loads(keel(env, "status").stdout)
    assert not status["services"]["recorder"]["running"] and not status["runtime"]["postgres"]["running"]


def test_up_with_a_taken_port_says_which_and_starts_nothing(scratch_dir: Path) -> None:
    env = cli_env(scratch_dir / "home")
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", int(env["KEEL_NATS__PORT"])))
        blocker.listen()
        result = keel(env, "up")
    assert result.returncode == 2
    assert env["KEEL_NATS__PORT"] in result.stderr and "Traceback" not in result.stderr
    assert not json.loads(keel(env, "status").stdout)["runtime"]["nats"]["running"]


def test_up_restarts_a_killed_service_and_records_it(scratch_dir: Path) -> None:
    """kill -9 the controller under `keel up`: the supervisor starts it again after its back-off, the
    restart is an event in the log and `keel status` shows it; `keel down` stops the supervisor too."""
    env = cli_env(scratch_dir / "home")
    up = keel(env, "up")
    try:
        assert up.returncode == 0, up.stderr
        state = json.loads(up.stdout)
        supervisor = state["supervisor"]["pid"]
        killed = state["services"]["controller"]["pid"]
        assert supervisor and pid_alive(supervisor) and killed and pid_alive(killed)
        assert state["services"]["controller"]["state"] == "running"
        os.kill(killed, 9)

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = json.loads(keel(env, "status").stdout)
            controller = status["services"]["controller"]
            if controller["running"] and controller["pid"] != killed and controller.get("state") == "running":
                break
            time.sleep(0.5)
        assert controller["pid"] != killed and controller["running"], controller
        assert controller["restarts"] == 1 and controller["last_exit"]["signal"] == "SIGKILL", controller
        assert "SIGKILL" in controller["reason"] and pid_alive(controller["pid"])

        async def restarts() -> list:
            engine = create_engine(auditor_url(env))
            store = EventStore(engine)
            deadline = time.monotonic() + 30
            found: list = []
            while not found and time.monotonic() < deadline:
                found = [r.event async for r in store.read(types=["ServiceRestarted"])]
                await asyncio.sleep(0.2)
            await engine.dispose()
            return found

        recorded = asyncio.run(restarts())
        assert [(e.payload.service, e.payload.signal, e.payload.attempt, e.payload.previous_pid, e.payload.pid)
                for e in recorded] == [("controller", "SIGKILL", 1, killed, controller["pid"])]
        assert "restart" in (scratch_dir / "home" / "services" / "supervisor.log").read_text()
    finally:
        down = keel(env, "down")
    assert down.returncode == 0, down.stderr
    deadline = time.monotonic() + 10
    pids = [supervisor, controller["pid"]]
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(pid) for pid in pids)
    assert not json.loads(keel(env, "status").stdout)["supervisor"]["running"]
