"""Recorder adapter: JetStream in, Postgres out. The only I/O of the recorder.

Per batch: fetch up to ``batch_size`` messages from the durable consumer; decode each (invalid ones
go to the dead-letter stream and the ``dead_letters`` table, with the reason); in ONE transaction
append the valid events (idempotent on event id), apply the projections to the newly stored ones and
advance the tracking row; commit; only then acknowledge every message of the batch.

A crash anywhere before the ack means redelivery, which the event-id uniqueness and the tracking row
turn into a no-op. Transient Postgres errors (restart, lost connection) are retried with capped
backoff for as long as it takes: the consumer is unbounded (``max_deliver=-1``) because the recorder
must never give up on an event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa
from nats.aio.msg import Msg
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from keel.core.bus import Bus, fetch_batch
from keel.core.config import RecorderSettings
from keel.core.events import InvalidEvent, decode_wire
from keel.core.store import append_events, event_row, metadata, record_dead_letter, save_tracking
from keel.recorder.core import DEFAULT_PROJECTIONS, BatchPlan, Projection, Upsert

log = logging.getLogger(__name__)

_TRANSIENT_DB = (OSError, ConnectionError, OperationalError, InterfaceError, asyncio.TimeoutError)


@dataclass
class RecorderStats:
    batches: int = 0
    recorded: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    db_retries: int = 0
    last_js_seq: int = 0
    started_at: float = field(default_factory=time.monotonic)


class Recorder:
    def __init__(
        self,
        bus: Bus,
        engine: AsyncEngine,
        settings: RecorderSettings,
        projections: Sequence[Projection] = DEFAULT_PROJECTIONS,
    ) -> None:
        self.bus = bus
        self.engine = engine
        self.settings = settings
        self.projections = list(projections)
        self.stats = RecorderStats()
        self._tracked_seq = 0
        self._sub = None

    async def start(self) -> None:
        # Explicit acks, never AckAll: after a crash, the dead process's unacknowledged deliveries are
        # still outstanding, and an AckAll from the successor would acknowledge them unrecorded.
        self._sub = await self.bus.pull_consumer(self.settings.consumer, max_deliver=-1)
        self._tracked_seq = await self._load_tracking()

    async def run(self, stop: asyncio.Event) -> None:
        """Record until ``stop`` is set. Returns after the batch in hand is durable and acknowledged."""
        if self._sub is None:
            await self.start()
        while not stop.is_set():
            await self.run_once()

    async def run_once(self) -> int:
        """Fetch and record one batch; returns the number of messages handled."""
        assert self._sub is not None, "call start() first"
        msgs = await fetch_batch(self._sub, self.settings.batch_size, self.settings.fetch_timeout.total_seconds())
        if not msgs:
            return 0
        plan = self.plan(msgs)
        for seq, reason in plan.rejected:
            msg = next(m for m in msgs if m.metadata.sequence.stream == seq)
            await self.bus.dead_letter(msg, reason)
        by_seq = {m.metadata.sequence.stream: m for m in msgs}
        fresh, duplicates = await self._commit_with_retry(plan, by_seq)
        last_seq = max(by_seq)
        for msg in msgs:
            await msg.ack()
        self._tracked_seq = max(self._tracked_seq, last_seq)
        self.stats.batches += 1
        self.stats.recorded += fresh
        self.stats.duplicates += duplicates
        self.stats.dead_lettered += len(plan.rejected)
        self.stats.last_js_seq = max(self.stats.last_js_seq, last_seq)
        return len(msgs)

    def plan(self, msgs: Sequence[Msg]) -> BatchPlan:
        plan = BatchPlan()
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            if seq <= self._tracked_seq:
                plan.already_recorded.append(seq)
                continue
            try:
                as_sent, event = decode_wire(msg.data, max_bytes=self.bus.settings.max_event_bytes)
            except InvalidEvent as exc:
                plan.rejected.append((seq, exc.reason))
                continue
            expected = self.bus.subject_for(event)
            if msg.subject != expected:
                plan.rejected.append((seq, f"published on {msg.subject} but the envelope belongs on {expected}"))
                continue
            plan.accepted.append((seq, as_sent, event))
        return plan

    async def _commit_with_retry(self, plan: BatchPlan, by_seq: dict[int, Msg]) -> tuple[int, int]:
        """Write the batch in one transaction, retrying transient failures; (new, duplicate) counts."""
        delay_s = 0.1
        while True:
            try:
                async with self.engine.begin() as conn:
                    return await self._write(conn, plan, by_seq)
            except _TRANSIENT_DB as exc:
                self._note_retry(exc)
            except DBAPIError as exc:
                if not exc.connection_invalidated:
                    raise
                self._note_retry(exc)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 5.0)

    def _note_retry(self, exc: BaseException) -> None:
        self.stats.db_retries += 1
        log.warning("recorder: Postgres unavailable (%s); retrying", type(exc).__name__)

    async def _write(self, conn: AsyncConnection, plan: BatchPlan, by_seq: dict[int, Msg]) -> tuple[int, int]:
        rows = [event_row(event, seq, as_sent) for seq, as_sent, event in plan.accepted]
        new_positions = await append_events(conn, rows)
        fresh, seen = [], set()
        for _, _, event in plan.accepted:
            # A duplicate inside one batch (same event id under two message ids) counts once.
            if event.id in new_positions and event.id not in seen:
                fresh.append(event)
            seen.add(event.id)
        for projection in self.projections:
            await _apply_upserts(conn, projection.project(fresh))
        for seq, reason in plan.rejected:
            msg = by_seq[seq]
            await record_dead_letter(conn, seq, msg.subject, reason, msg.data)
        last_seq = max(by_seq)
        last_position = max(new_positions.values(), default=0)
        await save_tracking(conn, self.settings.consumer, last_seq, last_position)
        return len(fresh), len(plan.accepted) - len(fresh)

    async def _load_tracking(self) -> int:
        table = metadata.tables["tracking"]
        async with self.engine.connect() as conn:
            value = (
                await conn.execute(sa.select(table.c.last_js_seq).where(table.c.consumer == self.settings.consumer))
            ).scalar_one_or_none()
        return int(value or 0)


async def _apply_upserts(conn: AsyncConnection, upserts: list[Upsert]) -> None:
    for upsert in upserts:
        table = metadata.tables[upsert.table]
        values = dict(upsert.key) | dict(upsert.values)
        stmt = insert(table).values(**values)
        stmt = stmt.on_conflict_do_update(index_elements=[k for k, _ in upsert.key], set_=dict(upsert.values))
        await conn.execute(stmt)
