"""The decider loop: fetch -> evolve/decide -> publish -> ack, on the shared consumer (``keel.infra.consumer``).

Cold start: the runner folds the recorded log from Postgres in log order. Everything its durable
consumer has acknowledged (up to the consumer's *ack floor*) was fully decided before the
acknowledgement, so it is only evolved. The rest of the log (the unacknowledged tail: what was in hand
when the service died, and what arrived while it was down) is decided again, in order, exactly as the
live loop would have (``DeciderSession.catch_up``): the decisions are deterministic, so a decision the
log already holds in full is not published again, one published only in part before a crash has its
missing events published now (the same ids), and every echo is awaited so nothing is evolved twice.
A consumer that does not exist yet (a new service, or a stream recreated since) acknowledged nothing:
the part of the log still in the stream is its tail. Then the runner consumes live; a redelivered
message the fold already covered is acknowledged and skipped.

Snapshots (``keel.infra.snapshots``): the cold start begins from the newest snapshot of the decider's
state this code and policy wrote, so it reads only the log after it; it writes a new one when it folded
``snapshots.min_events`` or more, and while running the runner folds what its consumer acknowledged into
a new snapshot every ``snapshots.interval``, in the background, without touching the live state.

Stream resets: a recreated stream numbers its messages from 1 again, so sequences are compared only
within one stream. The fold starts a new *epoch* wherever the log's sequences fall back, checks that the
newest epoch is the stream there is now (``Bus.stream_holds``), and the live loop starts over when its
consumer vanishes with the stream (``EventConsumer.on_reset``).

A message is acknowledged only after the decisions it caused are acknowledged by JetStream. A failure
to publish propagates (crash-only): the service restarts, rebuilds from the log and sees the input again.
Malformed messages are terminated here (never redelivered); the recorder dead-letters them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from keel.events.envelope import Event
from keel.infra.bus import Bus
from keel.infra.config import SnapshotSettings
from keel.infra.consumer import EventConsumer
from keel.infra.snapshots import decider_fingerprint, fold_snapshot, newest_snapshot, take_snapshot
from keel.infra.store import EventStore, RecordedEvent, Snapshot
from keel.infra.subjects import job_subjects
from keel.kernel.decider import (
    Decider,
    DeciderSession,
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
    caught_up: int = 0
    """Events of the log's unacknowledged tail decided again at cold start."""
    folded: int = 0
    """Events the cold start read from the log (after the snapshot it started from, if any)."""
    snapshot_position: int = 0
    """The log position of the snapshot the cold start started from (0: none)."""


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
        snapshots: SnapshotSettings | None = None,
    ) -> None:
        self.session: DeciderSession[S] = DeciderSession(decider)
        self.bus = bus
        self.store = store
        self.consumer = consumer or decider.name
        self.job_id = job_id
        self.stats = RunnerStats()
        self._folded_js_seq = 0  # the newest stream sequence the cold start covered, in the stream there is now
        self.batch_size = batch_size
        self.fetch_timeout_s = fetch_timeout_s
        self.on_input = on_input  # sees every live input before it is decided on (the clock host's hook)
        self._events: EventConsumer | None = None
        self.snapshots = snapshots if snapshots is not None else SnapshotSettings()
        self.scope = job_id or "*"
        self._fingerprint: str | None = None

    async def start(self) -> None:
        # A decision with an event over the bus's limit is refused in the kernel, live and in replay alike.
        self.session.max_event_bytes = self.bus.settings.max_event_bytes
        if self.store is not None:
            await self._cold_start()
        subject = job_subjects(self.bus.settings.subject_prefix, self.job_id)
        self._events = EventConsumer(self.bus, self.consumer, [subject], batch_size=self.batch_size,
                                     fetch_timeout_s=self.fetch_timeout_s, on_reset=self._stream_reset)
        await self._events.start()

    async def _cold_start(self) -> None:
        """Fold the newest snapshot and the log after it; decide the log's unacknowledged tail again and
        publish what a crash left unpublished."""
        assert self.store is not None
        ack_floor = await self.bus.consumer_ack_floor(self.consumer)
        if ack_floor is None:  # no consumer: nothing acknowledged; what the stream still holds is the tail
            first, _ = await self.bus.stream_bounds()
            ack_floor = first - 1
        base = None
        if self.snapshots.enabled:
            self._fingerprint = decider_fingerprint(self.session.decider)
            base = await newest_snapshot(self.store, self.session.decider, self.scope, self._fingerprint)
        previous_seq, last, after, folded = 0, None, 0, 0
        if base is not None:
            self.session.state = base.state
            snap = base.snapshot
            after, folded = snap.position, snap.events_folded
            previous_seq = snap.js_seq or 0
            last = (snap.js_seq, snap.event_id) if snap.js_seq and snap.event_id else None
            self.stats.snapshot_position = snap.position
        tail: list[RecordedEvent] = []  # the newest epoch's events past the ack floor, in log order
        prefix_end: RecordedEvent | None = None  # the last event folded without deciding
        new = 0
        async for recorded in self.store.read(job_id=self.job_id, after_position=after):
            seq = recorded.js_seq
            new += 1
            if seq is not None:
                if seq < previous_seq:  # sequences fell back: a stream recreated; what came before is older
                    prefix_end = self._fold(tail) or prefix_end
                    tail = []
                previous_seq = seq
                last = (seq, recorded.event.id)
            if tail or (seq is not None and seq > ack_floor):
                tail.append(recorded)
            else:
                prefix_end = self._fold([recorded])
        if last is None or not await self.bus.stream_holds(*last):
            # The stream was recreated after the newest recorded event: none of the log is in it.
            prefix_end = self._fold(tail) or prefix_end
            tail, previous_seq = [], 0
        self._folded_js_seq = previous_seq
        self.stats.folded = new
        prefix_new = new - len(tail)
        if (self.snapshots.enabled and prefix_end is not None and self._fingerprint is not None
                and prefix_new >= self.snapshots.min_events):
            snapshot = take_snapshot(self.session, self.scope, self._fingerprint, prefix_end, folded + prefix_new)
            if snapshot is not None:
                await self.store.save_snapshot(snapshot, keep=self.snapshots.keep)
        await self._decide_tail([recorded.event for recorded in tail])

    def _fold(self, events: list[RecordedEvent]) -> RecordedEvent | None:
        """Evolve ``events`` without deciding; the last of them (None if none)."""
        self.session.rebuild(recorded.event for recorded in events)
        return events[-1] if events else None

    async def snapshot_now(self) -> Snapshot | None:
        """Fold what the consumer has acknowledged since the newest snapshot into a new one (at least
        ``snapshots.min_events`` events; the live state is not touched)."""
        if self.store is None or not self.snapshots.enabled:
            return None
        if self._fingerprint is None:
            self._fingerprint = decider_fingerprint(self.session.decider)
        floor = await self.bus.consumer_ack_floor(self.consumer)
        if floor is None:
            return None
        return await fold_snapshot(self.store, self.session.decider, scope=self.scope, job_id=self.job_id,
                                   fingerprint=self._fingerprint, acknowledged_through=floor,
                                   min_events=self.snapshots.min_events, keep=self.snapshots.keep)

    async def _snapshot_periodically(self, stop: asyncio.Event) -> None:
        interval_s = self.snapshots.interval.total_seconds()
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
                return
            except TimeoutError:
                pass
            try:
                await self.snapshot_now()
            except Exception:  # noqa: BLE001 - a snapshot is an optimisation: never stop the decider for it
                log.exception("%s: taking a snapshot failed; trying again in %.0f s", self.consumer, interval_s)

    async def _decide_tail(self, tail: list[Event]) -> None:
        own = self.session.decider.name
        recorded: dict[uuid.UUID, set[uuid.UUID]] = {}
        for event in tail:
            if event.producer == own and event.causation_id is not None:
                recorded.setdefault(event.causation_id, set()).add(event.id)
        missing: list[Event] = []
        for event in tail:
            result = self.session.catch_up(event, frozenset(recorded.get(event.id, ())))
            if result.decision is not None and (result.emitted or event.id not in recorded):
                self.stats.decisions += 1
            missing += result.emitted
        self.stats.caught_up = len(tail)
        if missing:
            log.info("%s: publishing %d decision events the log lacks (decided on the unacknowledged tail of "
                     "%d events)", self.consumer, len(missing), len(tail))
            await self._publish(missing)

    def _stream_reset(self) -> None:
        # The consumer vanished with its stream and was created again on the new one: its sequences start
        # over, so none of them was covered by the fold.
        log.warning("%s: the events stream was recreated; consuming the new one from its start", self.consumer)
        self._folded_js_seq = 0

    async def run(self, stop: asyncio.Event) -> None:
        if self._events is None:
            await self.start()
        snapshotting = None
        if self.store is not None and self.snapshots.enabled:
            snapshotting = asyncio.create_task(self._snapshot_periodically(stop))
        try:
            while not stop.is_set():
                await self.run_once()
        finally:
            if snapshotting is not None:
                snapshotting.cancel()

    async def run_once(self) -> int:
        assert self._events is not None, "call start() first"
        count = await self._events.run_once(self._handle)
        self.stats.malformed = self._events.stats.malformed
        return count

    async def _handle(self, event: Event, seq: int) -> None:
        if self.on_input is not None:
            self.on_input(event)
        if seq <= self._folded_js_seq:
            self.stats.skipped_redelivered += 1  # folded (and, past the ack floor, decided) at cold start
            return
        result = self.session.observe(event)
        if result.decision is not None:
            self.stats.decisions += 1
            log.info("%s decided on %s %s: %s", self.consumer, event.type, event.id, result.decision.reason)
            if result.emitted:
                await self._publish(result.emitted)
        self.stats.handled += 1

    async def _publish(self, events: list[Event]) -> None:
        exit_code = _exit_mid_decision(self.consumer, events)
        if exit_code is not None:
            await self.bus.publish_many(events[:1])
            log.error("%s: fault hook %s: exiting after 1 of %d events of one decision", self.consumer,
                      EXIT_MID_DECISION_ENV, len(events))
            os._exit(exit_code)
        await self.bus.publish_many(events)
        self.stats.emitted += len(events)


EXIT_MID_DECISION_ENV = "KEEL_FAULT_EXIT_MID_DECISION"
"""Fault hook for crash-consistency tests: a decider whose consumer name this variable holds exits the
process (code 70) after publishing the first event of the first decision with more than one, as a
crash between two publishes would."""


def _exit_mid_decision(consumer: str, events: list[Event]) -> int | None:
    return 70 if len(events) > 1 and os.environ.get(EXIT_MID_DECISION_ENV) == consumer else None
