"""The supervisor ``keel up`` runs its services under, with real processes, real NATS and the recorder: a
service killed with SIGKILL comes back and its restart is recorded; a service that crashes at once every
time is given up after the limit, loudly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from keel.events.envelope import payload_of
from keel.events.types import SYSTEM_JOB, ServiceGaveUp, ServiceRestarted
from keel.infra.supervision import RestartPolicy
from keel.infra.supervisor import STATE_FILE, ServiceSpec, Supervisor
from tests.conftest import KeelEnv

pytestmark = pytest.mark.integration

STEADY = ("import os, pathlib, time; pathlib.Path(os.environ['KEEL_SERVICE_READY_FILE']).write_text(str(os.getpid())); "
          "time.sleep(600)")
BROKEN = "import sys; print('broken: cannot start', flush=True); sys.exit(3)"


async def _until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_killed_service_is_restarted_and_a_crash_loop_given_up(keel_env: KeelEnv, scratch_dir: Path) -> None:
    await keel_env.start_recorder()
    policy = RestartPolicy(backoff_initial=timedelta(milliseconds=100), backoff_max=timedelta(milliseconds=400),
                           healthy_after=timedelta(seconds=30), crash_loop_restarts=3,
                           crash_loop_window=timedelta(minutes=1))
    directory = scratch_dir / "services"
    supervisor = Supervisor(
        [ServiceSpec("steady", [sys.executable, "-c", STEADY]), ServiceSpec("broken", [sys.executable, "-c", BROKEN])],
        directory, policy, nats_url=keel_env.settings.nats_url, bus_settings=keel_env.settings.bus, stop_timeout_s=5)
    stop = asyncio.Event()
    task = asyncio.create_task(supervisor.run(stop))
    steady = supervisor.services["steady"]
    try:
        await _until(lambda: steady.state == "running", 30, "steady service ready")
        first_pid = steady.pid
        assert first_pid is not None and _alive(first_pid)

        os.kill(first_pid, signal.SIGKILL)
        await _until(lambda: steady.state == "running" and steady.pid != first_pid, 30, "steady service restarted")
        assert _alive(steady.pid)  # type: ignore[arg-type]
        assert steady.restarts == 1

        broken = supervisor.services["broken"]
        await _until(lambda: broken.state == "gave_up", 30, "crash loop given up")
        assert broken.restarts == 3 and broken.pid is None
        state = json.loads((directory / STATE_FILE).read_text())["services"]
        assert state["steady"]["state"] == "running" and state["steady"]["restarts"] == 1
        assert state["steady"]["last_exit"]["signal"] == "SIGKILL"
        assert state["broken"]["state"] == "gave_up" and "crash loop" in state["broken"]["reason"]
        assert state["broken"]["last_exit"]["exit_code"] == 3
        assert "keel supervisor:" in (directory / "broken.log").read_text()

        # Every restart and the give-up are recorded: published on the bus, persisted by the recorder.
        await keel_env.wait_for_count(5)
        recorded = [r.event async for r in keel_env.store.read(job_id=SYSTEM_JOB)]
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert not _alive(steady.pid or first_pid)  # stopped with the supervisor

    restarts = [payload_of(e, ServiceRestarted) for e in recorded if e.type == "ServiceRestarted"]
    gave_up = [payload_of(e, ServiceGaveUp) for e in recorded if e.type == "ServiceGaveUp"]
    killed = [r for r in restarts if r.service == "steady"]
    assert [(r.signal, r.exit_code, r.attempt, r.previous_pid) for r in killed] == [("SIGKILL", None, 1, first_pid)]
    assert killed[0].pid != first_pid and "SIGKILL" in killed[0].reason
    looped = [r for r in restarts if r.service == "broken"]
    assert [(r.exit_code, r.attempt, r.backoff_s) for r in looped] == [(3, 1, 0.1), (3, 2, 0.2), (3, 3, 0.4)]
    assert [(g.service, g.exit_code, g.restarts) for g in gave_up] == [("broken", 3, 3)]
    assert "crash loop" in gave_up[0].reason
    assert all(e.subject.startswith("service/") and e.producer == "supervisor" for e in recorded)


async def test_a_restart_is_kept_until_nats_is_reachable(scratch_dir: Path) -> None:
    """No NATS at all: the supervisor still restarts and logs; the events wait in its outbox."""
    policy = RestartPolicy(backoff_initial=timedelta(milliseconds=50), backoff_max=timedelta(milliseconds=50))
    supervisor = Supervisor([ServiceSpec("steady", [sys.executable, "-c", STEADY])], scratch_dir / "s", policy,
                            nats_url="nats://127.0.0.1:1", stop_timeout_s=5)
    stop = asyncio.Event()
    task = asyncio.create_task(supervisor.run(stop))
    steady = supervisor.services["steady"]
    try:
        await _until(lambda: steady.state == "running", 30, "ready")
        pid = steady.pid
        os.kill(pid, signal.SIGTERM)  # type: ignore[arg-type]
        await _until(lambda: steady.state == "running" and steady.pid != pid, 30, "restarted")
        assert [e.type for e in supervisor.events] == ["ServiceRestarted"]
        assert payload_of(supervisor.events[0], ServiceRestarted).signal == "SIGTERM"
        assert supervisor.outbox is not None and len(supervisor.outbox.pending) == 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
