"""Recorder adapter: JetStream in, Postgres out. The only I/O of the recorder.

Per batch: fetch up to ``batch_size`` messages from the durable consumer; decode each (invalid ones, and
events that need a signature and lack a valid one, go to the dead-letter stream and the ``dead_letters``
table, with the reason); in ONE transaction
append the valid events (idempotent on event id), apply the projections to the newly stored ones and
advance the tracking row; commit; only then acknowledge every message of the batch.

A crash anywhere before the ack means redelivery, which the event-id uniqueness turns into a no-op.
Redelivery is not in stream order (a dead consumer's batch comes back after ``ack_wait``, behind newer
messages), so the tracking row (highest sequence and position made durable) is for monitoring only,
never a reason to skip a message: skipping "old" sequences lost a killed recorder's batch. Transient Postgres errors (restart, lost connection) are retried with capped
backoff for as long as it takes: the consumer is unbounded (``max_deliver=-1``) because the recorder
must never give up on an event.

The stream discards new messages at its limit (``keel.infra.bus``): every ``recorder.stream_check_interval``
the recorder checks how full it is and, past ``recorder.stream_trim_at``, purges the oldest messages it has
stored (below its consumer's acknowledgement floor, never beyond: ``core.trim_point``).

Lag: per batch, now minus the arrival in the stream of the batch's oldest message (JetStream metadata in
the reply subject), and the messages still pending for the recorder; kept as metrics
(``keel.infra.metrics``: ``keel_recorder_lag_seconds``, ``keel_recorder_lag_events``) and published as
``RecorderLagReported`` when it crosses ``recorder.lag_threshold`` and periodically while above
(``core.lag_report_due``). While Postgres is away the lag of the batch in hand keeps growing and is
reported too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from keel.events.envelope import Event, InvalidEvent, decode_wire, now_utc
from keel.events.types import SYSTEM_JOB, RecorderLagReported
from keel.infra.bus import Bus, PublishFailed, delivery_info, stream_sequence
from keel.infra.config import RecorderSettings
from keel.infra.consumer import EventConsumer
from keel.infra.metrics import REGISTRY
from keel.infra.store import append_events, event_row, metadata, record_dead_letter, save_tracking
from keel.recorder.core import (
    DEFAULT_PROJECTIONS,
    BatchPlan,
    LagReporting,
    Projection,
    Upsert,
    lag_report_due,
    trim_point,
)

log = logging.getLogger(__name__)

_TRANSIENT_DB = (OSError, ConnectionError, OperationalError, InterfaceError, asyncio.TimeoutError)
_TRANSIENT_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300"})
"""Server states that pass: shutting down, crashed, starting up ("the database system is starting up"),
too many connections. Class 08 (connection exceptions) passes too."""


def transient_db_error(exc: DBAPIError) -> bool:
    """A database error worth retrying: the connection was lost, or the server is not (yet) accepting it."""
    sqlstate = str(getattr(exc.orig, "sqlstate", "") or "")
    return exc.connection_invalidated or sqlstate in _TRANSIENT_SQLSTATES or sqlstate.startswith("08")


RECORDED = REGISTRY.counter("keel_events_recorded_total", "Events persisted to PostgreSQL")
DEAD_LETTERED = REGISTRY.counter("keel_events_dead_lettered_total", "Messages moved to the dead-letter stream")
BATCH_SECONDS = REGISTRY.histogram("keel_recorder_batch_seconds", "One recorder transaction, retries included")
LAG_SECONDS = REGISTRY.gauge("keel_recorder_lag_seconds",
                             "Now minus the arrival in the stream of the oldest message of the batch in hand")
LAG_EVENTS = REGISTRY.gauge("keel_recorder_lag_events", "Messages in the stream not yet delivered to the recorder")
TRIMMED = REGISTRY.counter("keel_stream_trimmed_total", "Recorded messages the recorder purged from the full stream")


@dataclass
class RecorderStats:
    batches: int = 0
    recorded: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    db_retries: int = 0
    last_js_seq: int = 0
    lag_s: float = 0.0
    pending: int = 0
    lag_reports: int = 0
    trimmed: int = 0
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
        # Explicit acks, never AckAll: after a crash, the dead process's unacknowledged deliveries are
        # still outstanding, and an AckAll from the successor would acknowledge them unrecorded.
        self._events = EventConsumer(bus, settings.consumer, batch_size=settings.batch_size,
                                     fetch_timeout_s=settings.fetch_timeout.total_seconds(), max_deliver=-1)
        self._lag = LagReporting()
        self._reporting: asyncio.Task[None] | None = None
        self._next_trim_check_s = 0.0

    async def start(self) -> None:
        await self._events.start()

    async def run(self, stop: asyncio.Event) -> None:
        """Record until ``stop`` is set. Returns after the batch in hand is durable and acknowledged.

        Pipelined: the next batch is fetched while the current one is written, so that the recorder
        waits on NATS and on Postgres at the same time rather than in turn. A batch fetched when
        ``stop`` is set is still recorded (it has been delivered; leaving it unacknowledged would hold
        it back for ``ack_wait`` after a restart).
        """
        if not self._events.started:
            await self.start()
        fetching = asyncio.create_task(self._fetch())
        try:
            while True:
                msgs = await fetching
                if stop.is_set():
                    await self._record(msgs)
                    return
                fetching = asyncio.create_task(self._fetch())
                await self._record(msgs)
                await self._maybe_trim()
        finally:
            if not fetching.done():
                fetching.cancel()
            if self._reporting is not None and not self._reporting.done():
                try:
                    await asyncio.wait_for(self._reporting, 5)
                except TimeoutError:
                    log.warning("recorder: its last lag report was not published before it stopped")

    async def run_once(self) -> int:
        """Fetch and record one batch; returns the number of messages handled."""
        return await self._record(await self._fetch())

    async def _fetch(self) -> list[Msg]:
        assert self._events.started, "call start() first"
        return await self._events.fetch()

    async def _record(self, msgs: list[Msg]) -> int:
        if not msgs:
            await self._observe_lag(None, 0)
            return 0
        started = time.monotonic()
        deliveries = [delivery_info(m) for m in msgs]
        oldest_ns = min(arrival for _, arrival, _ in deliveries)
        pending = max(deliveries)[2]  # after the newest message of the batch
        plan = self.plan(msgs)
        for seq, reason in plan.rejected:
            msg = next(m for m in msgs if stream_sequence(m) == seq)
            await self.bus.dead_letter(msg, reason)
        by_seq = {stream_sequence(m): m for m in msgs}
        fresh, duplicates = await self._commit_with_retry(plan, by_seq, oldest_ns, pending)
        last_seq = max(by_seq)
        for msg in msgs:
            await msg.ack()
        self.stats.batches += 1
        self.stats.recorded += fresh
        self.stats.duplicates += duplicates
        self.stats.dead_lettered += len(plan.rejected)
        self.stats.last_js_seq = max(self.stats.last_js_seq, last_seq)
        RECORDED.inc(fresh)
        DEAD_LETTERED.inc(len(plan.rejected))
        BATCH_SECONDS.observe(time.monotonic() - started)
        await self._observe_lag(oldest_ns, pending)
        return len(msgs)

    async def _observe_lag(self, oldest_ns: int | None, pending: int) -> None:
        """Keep the lag metrics of the batch in hand (``oldest_ns`` None: nothing waits) and publish a
        ``RecorderLagReported`` when ``core.lag_report_due`` says so; a report that cannot be published is
        logged, never a reason to stop recording."""
        lag_s = 0.0 if oldest_ns is None else max(0.0, time.time() - oldest_ns / 1e9)
        self.stats.lag_s, self.stats.pending = lag_s, pending
        LAG_SECONDS.set(lag_s)
        LAG_EVENTS.set(pending)
        threshold_s = self.settings.lag_threshold.total_seconds()
        self._lag, due = lag_report_due(self._lag, lag_s, time.monotonic(), threshold_s=threshold_s,
                                        interval_s=self.settings.lag_report_interval.total_seconds())
        if not due:
            return
        now = now_utc()
        report = Event.create(
            RecorderLagReported(consumer=self.settings.consumer, lag_s=round(lag_s, 3), pending=pending,
                                threshold_s=threshold_s, above=self._lag.above),
            job_id=SYSTEM_JOB, subject=f"recorder/{self.settings.consumer}", producer="recorder", occurred_at=now)
        log.log(logging.WARNING if self._lag.above else logging.INFO, "recorder lag %.1f s (%d pending) is %s the "
                "%.0f s threshold", lag_s, pending, "above" if self._lag.above else "back below", threshold_s)
        # In the background: a report must never hold up recording (a full stream refuses it after retries).
        if self._reporting is not None and not self._reporting.done():
            log.warning("recorder: the previous lag report is still being published; this one is left out")
            return
        self._reporting = asyncio.create_task(self._publish_report(report))

    async def _publish_report(self, report: Event) -> None:
        try:
            await self.bus.publish(report)
            self.stats.lag_reports += 1
        except PublishFailed as exc:
            log.warning("recorder: could not publish its lag report: %s", exc)

    async def _maybe_trim(self) -> None:
        """Every ``stream_check_interval``: purge what the recorder has stored from a stream past
        ``stream_trim_at`` (``core.trim_point``). A failed check is logged and tried again later."""
        now_s = time.monotonic()
        if now_s < self._next_trim_check_s:
            return
        self._next_trim_check_s = now_s + self.settings.stream_check_interval.total_seconds()
        stream = self.bus.settings.stream
        try:
            info = await self.bus.js.stream_info(stream)
            state, config = info.state, info.config
            floor = (await self.bus.js.consumer_info(stream, self.settings.consumer)).ack_floor
            below = trim_point(first_seq=state.first_seq, last_seq=state.last_seq, messages=state.messages,
                               stored_bytes=state.bytes, max_bytes=config.max_bytes or -1,
                               max_msgs=config.max_msgs or -1, recorded_floor=floor.stream_seq if floor else 0,
                               trim_at=self.settings.stream_trim_at, trim_to=self.settings.stream_trim_to)
            if below is None:
                return
            await self.bus.js.purge_stream(stream, seq=below)
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("recorder: could not check or trim stream %s: %r", stream, exc)
            return
        purged = max(0, below - state.first_seq)
        self.stats.trimmed += purged
        TRIMMED.inc(purged)
        log.info("recorder: stream %s was %d messages / %d bytes; purged the recorded ones below sequence %d",
                 stream, state.messages, state.bytes, below)

    def plan(self, msgs: Sequence[Msg]) -> BatchPlan:
        plan = BatchPlan()
        for msg in msgs:
            seq = stream_sequence(msg)
            try:
                as_sent, event = decode_wire(msg.data, max_bytes=self.bus.settings.max_event_bytes)
            except InvalidEvent as exc:
                plan.rejected.append((seq, exc.reason))
                continue
            expected = self.bus.subject_for(event)
            if msg.subject != expected:
                plan.rejected.append((seq, f"published on {msg.subject} but the envelope belongs on {expected}"))
                continue
            verdict = self.bus.signing.check(event, as_sent)
            if not verdict.ok:  # the log keeps only what a consumer may act on (keel.events.signing)
                plan.rejected.append((seq, verdict.reason))
                continue
            plan.accepted.append((seq, as_sent, event))
        return plan

    async def _commit_with_retry(self, plan: BatchPlan, by_seq: dict[int, Msg], oldest_ns: int | None = None,
                                 pending: int = 0) -> tuple[int, int]:
        """Write the batch in one transaction, retrying transient failures; (new, duplicate) counts. While
        it retries, the lag of the batch in hand (arrived at ``oldest_ns``) keeps being observed."""
        delay_s = 0.1
        while True:
            try:
                async with self.engine.begin() as conn:
                    return await self._write(conn, plan, by_seq)
            except _TRANSIENT_DB as exc:
                self._note_retry(exc)
            except DBAPIError as exc:
                if not transient_db_error(exc):
                    raise
                self._note_retry(exc)
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 5.0)
            if oldest_ns is not None:
                await self._observe_lag(oldest_ns, pending)

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



async def _apply_upserts(conn: AsyncConnection, upserts: list[Upsert]) -> None:
    """Apply ``upserts`` in order (later ones win), as one ``INSERT … ON CONFLICT DO UPDATE`` per
    table and column set rather than one statement per event.

    Upserts of the same row are merged first (``{**earlier, **later}``), which leaves the row exactly
    as applying them one by one would, and which a single statement needs (it may not touch a row
    twice). The rows travel as one array per column through ``unnest`` on the raw asyncpg connection:
    one round trip and one cached prepared statement per batch. ``bench/bus.py`` measured the
    statement-per-event version at under 1,000 events/s, far below the bus.
    """
    merged: dict[tuple[str, tuple[tuple[str, Any], ...]], dict[str, Any]] = {}
    guards: dict[str, str | None] = {}
    if all(u.order is not None for u in upserts):
        # With ``only_if_newer``, merge in the order of that column, not of arrival (redelivery).
        upserts = sorted(upserts, key=lambda u: u.order)
    for upsert in upserts:
        values = merged.setdefault((upsert.table, upsert.key), {})
        values.update(upsert.values)
        guards[upsert.table] = upsert.only_if_newer
    groups: dict[tuple[str, tuple[str, ...], tuple[str, ...]], list[tuple[Any, ...]]] = {}
    for (table_name, key), values in merged.items():
        key_columns = tuple(k for k, _ in key)
        value_columns = tuple(values)
        groups.setdefault((table_name, key_columns, value_columns), []).append((*(v for _, v in key), *values.values()))
    if not groups:
        return
    raw = (await conn.get_raw_connection()).driver_connection
    assert raw is not None
    for (table_name, key_columns, value_columns), rows in groups.items():
        table = metadata.tables[table_name]
        columns = (*key_columns, *value_columns)
        types = [table.c[c].type.compile(dialect=postgresql.dialect()) for c in columns]
        arrays = ", ".join(f"${i}::{t}[]" for i, t in enumerate(types, start=1))
        updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in value_columns)
        action = f"DO UPDATE SET {updates}" if updates else "DO NOTHING"
        guard = guards.get(table_name)
        if updates and guard:
            action += f" WHERE {table_name}.{guard} <= EXCLUDED.{guard}"
        await raw.execute(
            f"INSERT INTO {table_name} ({', '.join(columns)}) SELECT * FROM unnest({arrays}) "
            f"ON CONFLICT ({', '.join(key_columns)}) {action}",
            *[list(column) for column in zip(*rows)],
        )
