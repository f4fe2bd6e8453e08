"""The decider loop: fetch -> evolve/decide -> publish -> ack, on the shared consumer (``keel.infra.consumer``).

Cold start: the runner folds the recorded log from Postgres (evolve only, no decisions), remembering
the last JetStream sequence it folded and which inputs already have recorded decisions. Then it
consumes its durable pull consumer live. A redelivered message at or below the folded sequence is not
evolved twice; if its decision is already recorded it is only acknowledged.

A message is acknowledged only after the decisions it caused are acknowledged by JetStream. A failure
to publish propagates (crash-only): the service restarts, rebuilds from the log and sees the input again.
Malformed messages are terminated here (never redelivered); the recorder dead-letters them.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from keel.events.envelope import Event
from keel.events.types import is_foreign_tick
from keel.infra.bus import Bus
from keel.infra.consumer import EventConsumer
from keel.infra.store import EventStore
from keel.infra.subjects import job_subjects
from keel.kernel.decider import (
    Decider,
    DeciderSession,
    StepResult,
    decide_or_refuse,
    evolve_or_keep,
    publishable,
)

log = logging.getLogger(__name__)

S = TypeVar("S")


@dataclass
class RunnerStats:
    handled: int = 0
    decisions: int = 0
    emitted: int = 0
    malformed: int = 0
    skipped_redelivered: int = 0


class DeciderRunner(Generic[S]):
    """One decider on the shared consumer loop (``keel.infra.consumer``): cold start from the store, then
    live. ``start()``, then ``run(stop)`` (or ``run_once()`` per batch)."""

    def __init__(
        self,
        decider: Decider[S],
        bus: Bus,
        store: EventStore | None,
        *,
        consumer: str | None = None,
        job_id: str | None = None,
        batch_size: int = 256,
        fetch_timeout_s: float = 0.5,
        on_input: Callable[[Event], None] | None = None,
    ) -> None:
        self.session: DeciderSession[S] = DeciderSession(decider)
        self.bus = bus
        self.store = store
        self.consumer = consumer or decider.name
        self.job_id = job_id
        self.stats = RunnerStats()
        self._folded_js_seq = 0
        self._decided_causes: set[uuid.UUID] = set()
        self.batch_size = batch_size
        self.fetch_timeout_s = fetch_timeout_s
        self.on_input = on_input  # sees every live input before it is decided on (the clock host's hook)
        self._events: EventConsumer | None = None

    async def start(self) -> None:
        # A decision with an event over the bus's limit is refused in the kernel, live and in replay alike.
        self.session.max_event_bytes = self.bus.settings.max_event_bytes
        if self.store is not None:
            async for recorded in self.store.read(job_id=self.job_id):
                self.session.rebuild([recorded.event])
                if recorded.js_seq:
                    self._folded_js_seq = max(self._folded_js_seq, recorded.js_seq)
                event = recorded.event
                if event.producer == self.session.decider.name and event.causation_id:
                    self._decided_causes.add(event.causation_id)
        subject = job_subjects(self.bus.settings.subject_prefix, self.job_id)
        self._events = EventConsumer(self.bus, self.consumer, [subject], batch_size=self.batch_size,
                                     fetch_timeout_s=self.fetch_timeout_s)
        await self._events.start()

    async def run(self, stop: asyncio.Event) -> None:
        if self._events is None:
            await self.start()
        while not stop.is_set():
            await self.run_once()

    async def run_once(self) -> int:
        assert self._events is not None, "call start() first"
        count = await self._events.run_once(self._handle)
        self.stats.malformed = self._events.stats.malformed
        return count

    async def _handle(self, event: Event, seq: int) -> None:
        if self.on_input is not None:
            self.on_input(event)
        if seq <= self._folded_js_seq and (
            event.producer == self.session.decider.name or event.id in self._decided_causes
        ):
            self.stats.skipped_redelivered += 1
            return
        result = self.session.observe(event) if seq > self._folded_js_seq else self._decide_only(event)
        if result is not None and result.decision is not None:
            self.stats.decisions += 1
            log.info("%s decided on %s %s: %s", self.consumer, event.type, event.id, result.decision.reason)
            if result.emitted:
                await self.bus.publish_many(result.emitted)
                self.stats.emitted += len(result.emitted)
        self.stats.handled += 1

    def _decide_only(self, event: Event) -> StepResult[S] | None:
        # Folded during the cold start but never decided on (the service died in between): decide on
        # the current state without evolving the event a second time.
        decider = self.session.decider
        if event.producer == decider.name or not decider.interested_in(event) or is_foreign_tick(event):
            return None
        decision = decide_or_refuse(decider, self.session.state, event)
        decision, emitted = publishable(decider.name, event, decision, self.session.max_event_bytes)
        for produced in emitted:
            self.session.state, _ = evolve_or_keep(decider, self.session.state, produced)
            # Evolved now: when its echo comes through the stream it must not be evolved again (a breaker
            # would count the eviction twice).
            self.session.expect_echo(produced.id)
        return StepResult(decision, emitted)
