"""The controller's I/O: the shared decider loop plus the job clock.

- Decisions: ``DeciderRunner`` over the controller's decider (``decider``; cold start from the store, then live).
- Clock: the one job clock (``keel.infra.clock``) runs in this process: every ``controller.clock_interval``
  a ``TimerTicked(now)`` per live job (``ControllerDecider.needs_clock``), published like any event, so
  every decider - and a replay - sees exactly the time the live run saw. No core reads the clock. A
  quiet job (no incident, nothing but routine reports for ``controller.clock_busy_window``) is ticked
  once per ``controller.clock_quiet_interval`` only (``quiet_clock``): the steady-state event budget.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.controller.state import ControllerState
from keel.events.envelope import Event, now_utc
from keel.events.types import (
    SYSTEM_JOB,
    CheckpointPersisted,
    CheckpointScheduleSet,
    CheckpointShardsStored,
    CheckpointStepCommitted,
    NodeHeartbeat,
    TimerTicked,
)
from keel.infra.bus import Bus
from keel.infra.clock import JobClock
from keel.infra.config import Settings
from keel.infra.runner import DeciderRunner
from keel.infra.store import EventStore

log = logging.getLogger(__name__)

def decider_from_settings(settings: Settings) -> ControllerDecider:
    c = settings.controller
    return ControllerDecider(ControllerPolicy(
        command_ttl=c.command_ttl, observe_only=c.observe_only, diagnostics_timeout=c.diagnostics_timeout,
        diagnostics_ack_timeout=c.diagnostics_ack_timeout, peer_loss_silence=c.peer_loss_silence, stack_analysis=c.stack_analysis,
        stacks_timeout=c.stacks_timeout, stacks_verdict_timeout=c.stacks_verdict_timeout,
        all_blocked_hang_after=c.all_blocked_hang_after,
        sdc_replay=c.sdc_replay, sdc_replay_timeout=c.sdc_replay_timeout,
        node_silence_timeout=c.node_silence_timeout, clock_skew_allowance=c.clock_skew_allowance,
        recovery_timeout=c.recovery_timeout,
        process_settle_interval=c.process_settle_interval, eviction_window=c.eviction_window,
        max_evictions=c.max_evictions, max_eviction_fraction=c.max_eviction_fraction,
        restart_window=c.restart_window, restart_budget=c.restart_budget, max_same_failure=c.max_same_failure,
        approval_required=frozenset(c.approval_required), standby_min=c.standby_min,
        standby_replacement_window=c.standby_replacement_window, shrink_without_standby=c.shrink_without_standby,
        shrink_min_nodes=c.shrink_min_nodes, shrink_node_multiple=c.shrink_node_multiple))


ROUTINE_INPUTS = frozenset({
    TimerTicked.event_name, NodeHeartbeat.event_name, CheckpointShardsStored.event_name,
    CheckpointStepCommitted.event_name, CheckpointScheduleSet.event_name, CheckpointPersisted.event_name,
})
"""The steady state of a healthy job: none of them starts a deadline, so they keep a job quiet."""


def quiet_clock(now: datetime, *, last_tick: datetime | None, last_busy_input: datetime | None, incident: bool,
                interval: timedelta, quiet_interval: timedelta, busy_window: timedelta) -> bool:
    """Whether the job clock skips a job this round: the job is quiet (no incident, no input but routine
    reports for ``busy_window``) and was ticked less than ``quiet_interval`` ago (half a round of slack:
    the rounds come every ``interval``)."""
    if incident or last_tick is None or quiet_interval <= interval:
        return False
    if last_busy_input is not None and now - last_busy_input <= busy_window:
        return False
    return now - last_tick < quiet_interval - interval / 2


class Controller:
    """The running service: ``start()`` (cold start), then ``run(stop)``."""

    def __init__(self, bus: Bus, store: EventStore | None, settings: Settings, *,
                 clock: Callable[[], datetime] = now_utc, fetch_timeout_s: float = 0.2) -> None:
        self.decider = decider_from_settings(settings)
        self.runner = DeciderRunner(self.decider, bus, store, fetch_timeout_s=fetch_timeout_s,
                                    on_input=self._note_input, snapshots=settings.snapshots)
        self.bus = bus
        self.clock = clock
        self.clock_linger = settings.controller.clock_linger
        self.clock_quiet_interval = settings.controller.clock_quiet_interval
        self.clock_busy_window = settings.controller.clock_busy_window
        self._last_input: dict[str, datetime] = {}  # job -> when its latest input other than a tick came
        self._last_busy_input: dict[str, datetime] = {}  # job -> when its latest non-routine input came
        self._last_tick: dict[str, datetime] = {}  # job -> when the clock last ticked it
        # A tick later than the skew allowance would be a wrong reading of the clock (JobClock): dropped instead.
        self.job_clock = JobClock(bus, self.jobs_to_tick, settings.controller.clock_interval, clock=clock,
                                  interval_of=self.tick_interval,
                                  stale_after=settings.controller.clock_skew_allowance)
        self._quiet: set[str] = set()  # jobs ticked once per clock_quiet_interval in this round

    @property
    def ticks(self) -> int:
        return self.job_clock.ticks

    @property
    def state(self) -> ControllerState:
        return self.runner.session.state

    async def start(self) -> None:
        await self.runner.start()

    def _note_input(self, event: Event) -> None:
        if event.type != TimerTicked.event_name and event.job_id != SYSTEM_JOB:  # Keel's own reports need no clock
            self._last_input[event.job_id] = self.clock()
        if event.type not in ROUTINE_INPUTS and event.job_id != SYSTEM_JOB:
            self._last_busy_input[event.job_id] = self.clock()

    def jobs_to_tick(self) -> list[str]:
        """The jobs the controller's rules need time for, and every job with an input in the last
        ``controller.clock_linger`` (another decider may wait on a deadline the controller does not see);
        a quiet job (``quiet_clock``) only once per ``controller.clock_quiet_interval``."""
        now = self.clock()
        lingering = {job for job, at in self._last_input.items() if now - at <= self.clock_linger}
        self._last_input = {job: at for job, at in self._last_input.items() if job in lingering}
        wanted = sorted(set(self.decider.needs_clock(self.state)) | lingering)
        due = [job for job in wanted if not quiet_clock(
            now, last_tick=self._last_tick.get(job), last_busy_input=self._last_busy_input.get(job),
            incident=self._has_incident(job), interval=self.job_clock.interval,
            quiet_interval=self.clock_quiet_interval, busy_window=self.clock_busy_window)]
        self._last_tick = {job: at for job, at in self._last_tick.items() if job in wanted}
        self._last_tick.update({job: now for job in due})
        self._last_busy_input = {job: at for job, at in self._last_busy_input.items() if job in wanted}
        # A job whose ticks are skipped while it is quiet is ticked every quiet interval: its ticks say so.
        self._quiet = {job for job in due if self.clock_quiet_interval > self.job_clock.interval
                       and not self._has_incident(job) and not (
                           (busy := self._last_busy_input.get(job)) is not None and now - busy <= self.clock_busy_window)}
        return due

    def tick_interval(self, job_id: str) -> timedelta:
        """The interval ``job_id``'s tick of this round stands for (``TimerTicked.interval_s``)."""
        return self.clock_quiet_interval if job_id in self._quiet else self.job_clock.interval

    def _has_incident(self, job_id: str) -> bool:
        job = self.state.jobs.get(job_id)
        return job is not None and job.incident is not None

    async def tick_clock(self) -> list[Event]:
        """One round of the job clock (every live job gets a tick)."""
        return await self.job_clock.tick()

    async def run(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while not stop.is_set():
            await self.runner.run_once()
            if loop.time() >= next_tick:
                next_tick = loop.time() + self.job_clock.interval.total_seconds()
                await self.tick_clock()
