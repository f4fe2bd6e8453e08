"""The process side of ``keel up``: start the control-plane services, restart those that exit, record it.

``keel up`` runs this as a background ``keel supervise`` (``keel supervise`` alone runs it in the
foreground). Each service is a child process in its own session, with its pid in ``<dir>/NAME.pid``, its
output in ``NAME.log`` and its ready file ``NAME.ready`` (written by ``keel.infra.service`` once it
consumes live). When a service's process ends, ``keel.infra.supervision.on_exit`` says what to do:

- restart it after an exponential back-off (reset once it has run healthy), recording
  ``ServiceRestarted`` (published when NATS is reachable, through an outbox that keeps it until then) and
  a log line;
- or, on a crash loop, give up loudly: ``ServiceGaveUp``, an error line here and in the service's own log,
  and ``gave_up`` with the reason in ``keel status``. ``keel up`` (SIGHUP to the supervisor) tries it again.

The state of every service is written to ``<dir>/supervisor.json`` after each change (``keel status``
reads it). A service already running when the supervisor starts (a supervisor that was killed and
started again) is adopted: watched by its pid, its exit status unknown. SIGTERM stops every service
(SIGTERM, then SIGKILL after ``stop_timeout``) and then the supervisor.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keel.events.envelope import Event, now_utc
from keel.events.types import SYSTEM_JOB, ServiceGaveUp, ServiceRestarted
from keel.infra.config import BusSettings, SupervisorSettings
from keel.infra.outbox import Outbox
from keel.infra.service import READY_FILE_ENV
from keel.infra.supervision import ExitStatus, RestartPolicy, ServiceHistory, on_exit

log = logging.getLogger(__name__)

PRODUCER = "supervisor"
STATE_FILE = "supervisor.json"


def policy_from_settings(settings: SupervisorSettings) -> RestartPolicy:
    return RestartPolicy(
        backoff_initial=settings.restart_backoff_initial,
        backoff_max=settings.restart_backoff_max,
        healthy_after=settings.healthy_after,
        crash_loop_restarts=settings.crash_loop_restarts,
        crash_loop_window=settings.crash_loop_window,
    )


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    argv: Sequence[str]
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))


@dataclass
class _Service:
    spec: ServiceSpec
    state: str = "stopped"
    """``starting`` (no ready file yet), ``running``, ``backoff`` (waiting to restart), ``gave_up``, ``stopped``."""
    process: subprocess.Popen | None = None
    pid: int | None = None
    started_at: float = 0.0
    history: ServiceHistory = field(default_factory=ServiceHistory)
    restarts: int = 0
    next_start_at: float | None = None
    last_exit: dict[str, Any] | None = None
    reason: str = ""
    ever_ready: bool = False
    """It consumed live at least once under this supervisor (``keel up`` tells a failing start from a restart)."""
    pending_restart: dict[str, Any] | None = None
    """The restart decided at the last exit, recorded once the new process runs (its pid is in the event)."""


def _proc_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class Supervisor:
    """Runs ``specs`` under ``directory`` until ``run``'s ``stop`` is set. ``nats_url``: where to publish
    the restart events (None: log lines and the state file only)."""

    def __init__(self, specs: Sequence[ServiceSpec], directory: Path, policy: RestartPolicy, *,
                 nats_url: str | None = None, bus_settings: BusSettings | None = None, stop_timeout_s: float = 10.0,
                 poll_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"supervisor: service names must be unique, got {names}")
        self.directory = directory
        self.policy = policy
        self.services = {spec.name: _Service(spec) for spec in specs}
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        self.clock = clock
        self.outbox = Outbox(nats_url, bus_settings or BusSettings(), name="keel-supervisor") if nats_url else None
        self.retry_requested = False
        self.events: list[Event] = []
        """Every event recorded by this supervisor, in order (also put in the outbox)."""

    # -- files ------------------------------------------------------------------------------------

    def _path(self, name: str, suffix: str) -> Path:
        return self.directory / f"{name}.{suffix}"

    def state_file(self) -> Path:
        return self.directory / STATE_FILE

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        services = {}
        for name, svc in self.services.items():
            entry: dict[str, Any] = {"state": svc.state, "pid": svc.pid, "restarts": svc.restarts,
                                     "attempt": svc.history.attempt, "last_exit": svc.last_exit,
                                     "ever_ready": svc.ever_ready}
            if svc.state == "backoff" and svc.next_start_at is not None:
                entry["restart_in_s"] = round(max(0.0, svc.next_start_at - now), 3)
            if svc.reason:
                entry["reason"] = svc.reason
            services[name] = entry
        return {"pid": os.getpid(), "updated_at": now_utc().isoformat(), "services": services}

    def _write_state(self) -> None:
        path = self.state_file()
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.snapshot(), indent=2) + "\n")
        os.replace(tmp, path)

    # -- processes --------------------------------------------------------------------------------

    def _adopt_or_start(self, svc: _Service) -> None:
        try:
            pid = int(self._path(svc.spec.name, "pid").read_text().strip())
        except (OSError, ValueError):
            pid = 0
        if pid and _proc_alive(pid) and svc.spec.name.encode() in _cmdline(pid) and pid != os.getpid():
            svc.pid, svc.process, svc.started_at = pid, None, self.clock()
            svc.state = "running" if self._path(svc.spec.name, "ready").exists() else "starting"
            svc.ever_ready = svc.state == "running"
            log.info("supervisor: %s already runs as pid %d: watching it", svc.spec.name, pid)
            return
        self._start(svc)

    def _start(self, svc: _Service) -> None:
        name = svc.spec.name
        ready = self._path(name, "ready")
        ready.unlink(missing_ok=True)
        with open(self._path(name, "log"), "ab") as log_file:
            svc.process = subprocess.Popen(
                list(svc.spec.argv), env={**svc.spec.env, READY_FILE_ENV: str(ready)}, stdout=log_file,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        svc.pid, svc.started_at, svc.state, svc.next_start_at = svc.process.pid, self.clock(), "starting", None
        self._path(name, "pid").write_text(f"{svc.pid}\n")
        log.info("supervisor: started %s as pid %d", name, svc.pid)
        if svc.pending_restart is not None:
            self._record(ServiceRestarted(pid=svc.pid, **svc.pending_restart), name)
            svc.pending_restart = None

    def _exit_status(self, svc: _Service) -> ExitStatus | None:
        """The exit status when ``svc``'s process has ended, else None."""
        if svc.process is not None:
            code = svc.process.poll()
            return None if code is None else ExitStatus(code)
        if svc.pid is not None and not _proc_alive(svc.pid):
            return ExitStatus(None)
        return None

    def _on_exit(self, svc: _Service, status: ExitStatus) -> None:
        now = self.clock()
        uptime_s = max(0.0, now - svc.started_at)
        name = svc.spec.name
        decision = on_exit(self.policy, svc.history, name, status, uptime_s=uptime_s, now_s=now)
        svc.history = decision.history
        svc.last_exit = {"exit_code": status.exit_code, "signal": status.signal, "at": now_utc().isoformat(),
                         "uptime_s": round(uptime_s, 3)}
        svc.reason = decision.reason
        previous_pid = svc.pid or 0
        svc.process = None
        self._path(name, "ready").unlink(missing_ok=True)
        if decision.restart:
            log.warning("supervisor: %s", decision.reason)
            svc.state, svc.next_start_at = "backoff", now + decision.backoff_s
            svc.restarts += 1
            svc.pending_restart = {"service": name, "exit_code": status.exit_code, "signal": status.signal,
                                   "attempt": decision.attempt, "backoff_s": decision.backoff_s,
                                   "uptime_s": round(uptime_s, 3), "previous_pid": previous_pid,
                                   "reason": decision.reason}
        else:
            log.error("supervisor: %s", decision.reason)
            svc.state, svc.next_start_at, svc.pid = "gave_up", None, None
            self._path(name, "pid").unlink(missing_ok=True)
            with open(self._path(name, "log"), "a") as service_log:
                service_log.write(f"keel supervisor: {decision.reason}\n")
            self._record(ServiceGaveUp(service=name, exit_code=status.exit_code, signal=status.signal,
                                       restarts=decision.restarts_in_window,
                                       window_s=self.policy.crash_loop_window.total_seconds(),
                                       reason=decision.reason), name)

    def _record(self, payload: ServiceRestarted | ServiceGaveUp, name: str) -> None:
        event = Event.create(payload, job_id=SYSTEM_JOB, subject=f"service/{name}", producer=PRODUCER,
                             occurred_at=now_utc())
        self.events.append(event)
        if self.outbox is not None:
            self.outbox.put(event)

    def step(self) -> bool:
        """One round: notice exits, restarts that are due, readiness. True when anything changed."""
        changed = False
        now = self.clock()
        if self.retry_requested:
            self.retry_requested = False
            for svc in self.services.values():
                if svc.state == "gave_up":
                    log.warning("supervisor: starting %s again, as asked (keel up)", svc.spec.name)
                    svc.history, svc.reason = ServiceHistory(), ""
                    self._start(svc)
                    changed = True
        for svc in self.services.values():
            if svc.state in ("starting", "running"):
                status = self._exit_status(svc)
                if status is not None:
                    self._on_exit(svc, status)
                    changed = True
                elif svc.state == "starting" and self._path(svc.spec.name, "ready").exists():
                    svc.state, svc.ever_ready = "running", True
                    changed = True
            elif svc.state == "backoff" and svc.next_start_at is not None and now >= svc.next_start_at:
                self._start(svc)
                changed = True
        return changed

    async def run(self, stop: asyncio.Event) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        outbox_stop = asyncio.Event()
        outbox_task = asyncio.create_task(self.outbox.run(outbox_stop)) if self.outbox is not None else None
        try:
            for svc in self.services.values():
                self._adopt_or_start(svc)
            self._write_state()
            while not stop.is_set():
                if self.step():
                    self._write_state()
                try:
                    await asyncio.wait_for(stop.wait(), self.poll_s)
                except TimeoutError:
                    pass
        finally:
            await asyncio.to_thread(self.stop_all)
            self._write_state()
            if self.outbox is not None and outbox_task is not None:
                if not outbox_task.done():
                    await self.outbox.flush(timeout_s=3.0)
                outbox_stop.set()
                await outbox_task
                await self.outbox.close()

    def stop_all(self) -> None:
        """SIGTERM every service, wait up to ``stop_timeout_s``, SIGKILL what is left."""
        running = [svc for svc in self.services.values() if svc.pid is not None and svc.state != "gave_up"]
        for svc in running:
            try:
                os.kill(svc.pid, signal.SIGTERM)  # type: ignore[arg-type]
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.stop_timeout_s
        for svc in running:
            while self._exit_status(svc) is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self._exit_status(svc) is None:
                log.warning("supervisor: %s did not stop within %g s: killing it", svc.spec.name, self.stop_timeout_s)
                try:
                    os.kill(svc.pid, signal.SIGKILL)  # type: ignore[arg-type]
                except ProcessLookupError:
                    pass
                if svc.process is not None:
                    svc.process.wait(5)
            svc.state, svc.pid, svc.process = "stopped", None, None
            self._path(svc.spec.name, "pid").unlink(missing_ok=True)
            self._path(svc.spec.name, "ready").unlink(missing_ok=True)
        for svc in self.services.values():
            if svc.state == "backoff":
                svc.state = "stopped"


def run_supervisor(supervisor: Supervisor, *, pid_file: Path | None = None) -> None:
    """Run ``supervisor`` in the foreground: SIGTERM / SIGINT stop it (and every service), SIGHUP starts
    the services it gave up on again. ``pid_file``: where its pid is written (removed at the end)."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)

        def retry() -> None:
            supervisor.retry_requested = True

        loop.add_signal_handler(signal.SIGHUP, retry)
        await supervisor.run(stop)

    if pid_file is not None:
        pid_file.write_text(f"{os.getpid()}\n")
    try:
        asyncio.run(main())
    finally:
        if pid_file is not None:
            try:
                if pid_file.read_text().strip() == str(os.getpid()):
                    pid_file.unlink()
            except OSError:
                pass
