"""The actuator service: consume the controller's commands for machines, carry them out, report.

Acknowledged only after the outcome event (``NodeEvicted``; ``StandbyProvisioned`` is not an event of
its own - new standbys announce themselves with ``NodeRegistered`` and ``StandbyChecked``) is on the
bus. Outcome ids are derived from the command's id, so a command redelivered after a crash reports
once. A command seen after its ``expires_at`` is reported ``expired`` and not carried out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime

from keel.actuator.core import Actuator, ActuatorError, eviction_outcome, refill_count
from keel.events.envelope import Event, now_utc
from keel.events.types import NodeEvicted, NodeEvictionDecided, StandbyPromotionRequested, StandbyRefillRequested
from keel.infra.bus import Bus
from keel.infra.consumer import EventConsumer
from keel.infra.subjects import subject_filter
from keel.kernel.decider import decision_id

log = logging.getLogger(__name__)


class ActuatorService:
    def __init__(self, bus: Bus, actuator: Actuator, *, job_id: str | None = None,
                 clock: Callable[[], datetime] = now_utc, fetch_timeout_s: float = 0.2) -> None:
        self.bus, self.actuator, self.job_id, self.clock = bus, actuator, job_id, clock
        self.producer = f"actuator-{actuator.name}"
        self.fetch_timeout_s = fetch_timeout_s
        self.carried_out: list[str] = []
        # Every node's commands (any aggregate id): the actuator acts on machines for the whole job.
        subjects = [subject_filter(bus.settings.subject_prefix, job_id, command.aggregate, None, command.event_name)
                    for command in (NodeEvictionDecided, StandbyPromotionRequested, StandbyRefillRequested)]
        self._commands = EventConsumer(bus, self.producer, subjects, fetch_timeout_s=fetch_timeout_s)

    async def start(self) -> None:
        await self._commands.start()

    async def run(self, stop: asyncio.Event) -> None:
        if not self._commands.started:
            await self.start()
        await self._commands.run(self._handle, stop)

    async def run_once(self) -> int:
        assert self._commands.started, "call start() first"
        return await self._commands.run_once(self._handle)

    async def _handle(self, command: Event, _seq: int) -> None:
        if isinstance(command.payload, NodeEvictionDecided):
            await self._evict(command, command.payload)
        elif isinstance(command.payload, StandbyRefillRequested):
            await self._refill(command, command.payload)
        elif isinstance(command.payload, StandbyPromotionRequested):
            # Bookkeeping, not an action (the standby's agent carries the promotion out): the node no
            # longer counts as a standby, so the refill in the same decision starts a new one.
            try:
                await asyncio.to_thread(self.actuator.mark_promoted, command.payload.node_id)
            except (ActuatorError, OSError) as exc:
                log.warning("%s: could not record the promotion of %s: %s", self.producer,
                            command.payload.node_id, exc)

    async def _evict(self, command: Event, payload: NodeEvictionDecided) -> None:
        now = self.clock()
        skip = eviction_outcome(payload, now)
        if skip is None:
            try:
                incident = str(command.correlation_id) if command.correlation_id else ""
                detail = await asyncio.to_thread(self.actuator.evict, payload.node_id, payload.reason, incident)
                outcome = "evicted"
            except (ActuatorError, OSError) as exc:
                outcome, detail = "failed", f"{type(exc).__name__}: {exc}"
        else:
            outcome, detail = skip.outcome, skip.detail
        log.info("%s: evict %s: %s (%s)", self.producer, payload.node_id, outcome, detail)
        self.carried_out.append(f"evict {payload.node_id}: {outcome}")
        report = NodeEvicted(node_id=payload.node_id, decision_id=str(command.id), actuator=self.actuator.name,
                             outcome=outcome, detail=detail)
        await self.bus.publish(Event.create(
            report, event_id=decision_id(command.id, self.producer, report.event_name, payload.node_id),
            job_id=command.job_id, subject=command.subject, producer=self.producer, occurred_at=now,
            causation_id=command.id, correlation_id=command.correlation_id))

    async def _refill(self, command: Event, payload: StandbyRefillRequested) -> None:
        now = self.clock()
        try:
            standbys = await asyncio.to_thread(self.actuator.standbys)
            count, why = refill_count(payload, now, len(standbys))
            started = await asyncio.to_thread(self.actuator.provision_standbys, count) if count else []
        except (ActuatorError, OSError) as exc:
            log.error("%s: refill failed: %s: %s", self.producer, type(exc).__name__, exc)
            self.carried_out.append(f"refill: failed ({exc})")
            return
        log.info("%s: refill: %s%s", self.producer, why, f" -> {', '.join(started)}" if started else "")
        self.carried_out.append(f"refill: {', '.join(started) or 'none'}")
