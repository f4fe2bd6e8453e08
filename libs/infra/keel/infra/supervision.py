"""When to restart a control-plane service that exited, and when to give up: a pure function with reasons.

``keel.infra.supervisor`` (the process side of ``keel up``) calls ``on_exit`` each time a service's
process ends and does what it says. The rules:

- **Back-off.** The n-th restart since the service last ran healthy waits ``backoff_initial * 2**(n-1)``,
  at most ``backoff_max``.
- **Reset after health.** A process that ran ``healthy_after`` or longer before it exited was healthy:
  its restart is attempt 1 again (the back-off starts over).
- **Crash loop.** An exit that finds ``crash_loop_restarts`` restarts already made within the last
  ``crash_loop_window`` is not restarted: the supervisor gives up, loudly, and the service stays down
  until ``keel up`` asks again.
"""

from __future__ import annotations

import signal as signals
from dataclasses import dataclass, field, replace
from datetime import timedelta


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial: timedelta = timedelta(seconds=1)
    backoff_max: timedelta = timedelta(seconds=30)
    healthy_after: timedelta = timedelta(seconds=60)
    crash_loop_restarts: int = 5
    crash_loop_window: timedelta = timedelta(minutes=5)

    def __post_init__(self) -> None:
        if self.backoff_initial <= timedelta(0) or self.backoff_max < self.backoff_initial:
            raise ValueError("restart back-off: need 0 < backoff_initial <= backoff_max")
        if self.crash_loop_restarts < 1 or self.crash_loop_window <= timedelta(0):
            raise ValueError("crash loop: need crash_loop_restarts >= 1 and a positive crash_loop_window")


@dataclass(frozen=True)
class ServiceHistory:
    """What the policy remembers of one service: restarts since it last ran healthy, and when (seconds on
    the supervisor's monotonic clock) each restart within the window was decided."""

    attempt: int = 0
    restarts_at: tuple[float, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended: ``returncode`` as ``subprocess`` gives it (negative: killed by that signal),
    None when unknown (a process the supervisor adopted, not its child)."""

    returncode: int | None

    @property
    def exit_code(self) -> int | None:
        return self.returncode if self.returncode is not None and self.returncode >= 0 else None

    @property
    def signal(self) -> str | None:
        if self.returncode is None or self.returncode >= 0:
            return None
        try:
            return signals.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"

    def describe(self) -> str:
        if self.returncode is None:
            return "exited (status unknown: not the supervisor's child)"
        if self.signal is not None:
            return f"was killed by {self.signal}"
        return f"exited with status {self.exit_code}"


@dataclass(frozen=True)
class RestartDecision:
    restart: bool
    """False: give up (a crash loop)."""
    attempt: int
    backoff_s: float
    reason: str
    history: ServiceHistory
    restarts_in_window: int


def on_exit(policy: RestartPolicy, history: ServiceHistory, service: str, status: ExitStatus, *, uptime_s: float,
            now_s: float) -> RestartDecision:
    """What to do about ``service``'s process that ended with ``status`` after ``uptime_s``, at ``now_s``
    (monotonic seconds): restart it after a back-off, or give up. Pure."""
    window_s = policy.crash_loop_window.total_seconds()
    recent = tuple(at for at in history.restarts_at if now_s - at <= window_s)
    healthy = uptime_s >= policy.healthy_after.total_seconds()
    how = f"{service} {status.describe()} after {uptime_s:.1f} s"
    if len(recent) >= policy.crash_loop_restarts:
        reason = (f"{how}; it was restarted {len(recent)} times within {window_s:g} s "
                  f"(supervisor.crash_loop_restarts {policy.crash_loop_restarts} in supervisor.crash_loop_window): "
                  f"a crash loop, giving up - it stays down until `keel up` (see its log)")
        return RestartDecision(False, history.attempt, 0.0, reason, replace(history, restarts_at=recent), len(recent))
    attempt = 1 if healthy else history.attempt + 1
    backoff_s = min(policy.backoff_initial.total_seconds() * 2 ** (attempt - 1), policy.backoff_max.total_seconds())
    ran = "it had run healthy, back-off reset" if healthy and history.attempt else f"restart {attempt} since it last ran healthy"
    reason = f"{how}; {ran}; restarting in {backoff_s:g} s ({len(recent) + 1} restarts within {window_s:g} s)"
    return RestartDecision(True, attempt, backoff_s, reason, ServiceHistory(attempt, (*recent, now_s)), len(recent) + 1)
