"""The job clock: one ``TimerTicked`` per job and interval, the only source of time for every decider.

Decision cores never read the clock; what depends on time (a node gone silent, a diagnostics deadline, a
restore plan waiting for inventories, a hot-update deadline, a fail-slow round) is decided on a recorded
tick, so a replay sees exactly the time the live run saw. There is one clock per job, not one per service:
ticks from any other producer are ignored by every decider (``keel.events.types.is_foreign_tick``). The
controller's process hosts it, because the controller knows which jobs are live.

The ticks are also the controller's recorded clock (docs/architecture.md, "Time"): an event's receive time
is its place between two ticks of its job in the stream, which a replay of the log sees too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

from keel.events.envelope import Event, now_utc
from keel.events.types import CLOCK_PRODUCER, TimerTicked
from keel.infra.bus import Bus

log = logging.getLogger(__name__)


def tick_event(job_id: str, now: datetime, interval: timedelta | None = None) -> Event:
    """The job clock's tick for ``job_id`` at ``now``. With ``interval`` (the live clock always gives it)
    the tick is the controller's recorded clock (liveness and expiry by arrival); without, a v1-style
    tick (judged on producers' timestamps, as logs recorded before were)."""
    payload = TimerTicked(now=now, interval_s=interval.total_seconds() if interval is not None else None)
    return Event.create(payload, job_id=job_id, subject=f"clock/{job_id}", producer=CLOCK_PRODUCER,
                        occurred_at=now)


class JobClock:
    """Publishes a tick for each job ``jobs()`` names; the host calls ``tick()`` once per ``interval``.

    A tick is a reading of the clock: one that lands late in the stream says a time long past, after events
    that arrived since (a tick caught in a partition of the clock host, published when its link is back,
    would date the backlog it lands behind to before the partition, and make every node's clock look that far
    ahead). So a round whose ticks are not acknowledged within ``stale_after`` is dropped (None: never), and
    so is a round while the bus has no connection (the client would buffer the ticks and send them, stale, on
    reconnecting): the next round ticks afresh, and the deciders take the missing ticks for the gap that it
    was."""

    def __init__(self, bus: Bus, jobs: Callable[[], Iterable[str]], interval: timedelta, *,
                 clock: Callable[[], datetime] = now_utc,
                 interval_of: Callable[[str], timedelta] | None = None,
                 stale_after: timedelta | None = None) -> None:
        self.bus = bus
        self.jobs = jobs
        self.interval = interval
        self.interval_of = interval_of
        """The interval a job's ticks come at, when it is not ``interval`` for every job (a quiet job is
        ticked less often): each tick says its own, so a slower clock is not taken for a gap."""
        self.clock = clock
        self.stale_after = stale_after
        self.ticks = 0
        self.dropped = 0
        """Rounds of ticks dropped as stale (not acknowledged within ``stale_after``)."""

    async def tick(self) -> list[Event]:
        now = self.clock()
        ticks = [tick_event(job_id, now, self.interval_of(job_id) if self.interval_of else self.interval)
                 for job_id in self.jobs()]
        if ticks:
            if self.stale_after is not None and not self.bus.nc.is_connected:
                self.dropped += 1
                log.warning("job clock: no NATS connection: %d tick(s) at %s dropped (sent on reconnecting, they "
                            "would be late); the next round ticks afresh", len(ticks), now.isoformat())
                return []
            publishing = self.bus.publish_many(ticks)
            if self.stale_after is None:
                await publishing
            else:
                try:
                    await asyncio.wait_for(publishing, self.stale_after.total_seconds())
                except TimeoutError:
                    self.dropped += 1
                    log.warning("job clock: %d tick(s) at %s not acknowledged within %g s (NATS unreachable?): "
                                "dropped, a late tick would date what arrived since to before it; the next "
                                "round ticks afresh", len(ticks), now.isoformat(), self.stale_after.total_seconds())
                    return []
            self.ticks += len(ticks)
        return ticks
