"""The recorder under faults of what it stands on, with real servers: PostgreSQL killed in the middle of a
batch's COPY, and a stream filled to its limit while the recorder is stopped."""

from __future__ import annotations

import asyncio
import threading

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection

from keel.infra.bus import Bus
from keel.infra.dbroles import MIGRATE, RECORDER
from keel.infra.embedded import PostgresServer
from keel.infra.store import EventStore, create_engine, run_migrations
from keel.recorder.adapter import Recorder
from keel.recorder.core import BatchPlan
from tests.conftest import Servers, isolated_settings
from tests.factories import fleet_events
from tests.integration.test_crashes import wait_until

pytestmark = pytest.mark.integration


class CrashingPostgresRecorder(Recorder):
    """A fault hook: after a batch's rows are copied into PostgreSQL (the COPY and the INSERT done, the
    transaction not yet committed), the first ``crashes`` batches SIGKILL the server and start it again."""

    def __init__(self, *args, postgres: PostgresServer, crashes: int, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.postgres = postgres
        self.crashes = crashes
        self.crashed = 0
        self.restarted = threading.Event()

    async def _write(self, conn: AsyncConnection, plan: BatchPlan, by_seq):  # type: ignore[no-untyped-def]
        result = await super()._write(conn, plan, by_seq)
        # Not while the previous restart is still under way (start() also sets up the roles once the server is up).
        if self.crashed < self.crashes and plan.accepted and (self.crashed == 0 or self.restarted.is_set()):
            self.restarted.clear()
            self.crashed += 1
            self.postgres.kill()  # the transaction holding this batch's COPY dies with the server

            def restart() -> None:
                self.postgres.start()
                self.restarted.set()

            threading.Thread(target=restart, daemon=True).start()
        return result


async def test_postgres_killed_mid_copy_loses_nothing_doubles_nothing(own_postgres: PostgresServer,
                                                                        servers: Servers) -> None:
    settings = isolated_settings(Servers(servers.nats_url, own_postgres.dsn, nats=servers.nats), batch_size=500)
    await asyncio.to_thread(run_migrations, own_postgres.role_dsn(MIGRATE), settings.db_schema)
    engine = create_engine(own_postgres.role_dsn(RECORDER), settings.db_schema)  # as the recorder service connects
    store = EventStore(engine)
    bus = await Bus.connect(servers.nats_url, settings.bus)
    recorder = CrashingPostgresRecorder(bus, engine, settings.recorder, postgres=own_postgres, crashes=2)
    await recorder.start()
    stop = asyncio.Event()
    recording = asyncio.create_task(recorder.run(stop))
    events = fleet_events(4000)
    try:
        await bus.publish_many(events)

        async def everything() -> bool:
            try:
                return await store.count() >= len(events)
            except Exception:  # noqa: BLE001 - the server is down or recovering: not yet
                return False

        await wait_until(everything, 120, "the recorder to record everything after two PostgreSQL crashes")
        assert recorder.crashed == 2 and recorder.stats.db_retries >= 2
        assert not recording.done()  # it recovered by itself
        ids = [r.event.id async for r in store.read()]
        assert len(ids) == len(set(ids)) == len(events)
        assert set(ids) == {e.id for e in events}
        positions = [r.position async for r in store.read()]
        assert positions == sorted(positions)
        assert recorder.stats.recorded == len(events)
    finally:
        stop.set()
        await asyncio.wait_for(recording, 60)
        for stream in (settings.bus.stream, settings.bus.dlq_stream):
            await bus.js.delete_stream(stream)
        await bus.close()
        await engine.dispose()


async def test_a_full_stream_pushes_back_and_loses_nothing_the_recorder_has_not_stored(keel_env, servers: Servers,
                                                                                     caplog) -> None:
    """A tiny stream (64 KiB) filled while the recorder is stopped: publishers are refused with a clear error
    (StreamFull, logged once), the outbox keeps what it could not publish, the stream drops nothing; once
    the recorder runs it stores everything and purges what it stored, and the outbox drains into it."""
    from keel.infra.bus import StreamFull
    from keel.infra.config import BusSettings, RecorderSettings
    from keel.infra.metrics import REGISTRY
    from keel.infra.outbox import Outbox

    tag = keel_env.settings.bus.subject_prefix
    bus_settings = BusSettings(subject_prefix=f"{tag}f", stream=f"{tag.upper()}F", dlq_stream=f"{tag.upper()}F_DLQ",
                               max_bytes="64KiB", publish_attempts=2, retry_backoff_initial="20ms",
                               credentials=keel_env.settings.bus.credentials)
    bus = await Bus.connect(servers.nats_url, bus_settings, administer=True)
    outbox = Outbox(servers.nats_url, bus_settings, name="test-outbox")
    outbox_stop = asyncio.Event()
    publishing = asyncio.create_task(outbox.run(outbox_stop))
    refusals = REGISTRY.counter("keel_stream_full_refusals_total", "").value()
    events = fleet_events(600)
    try:
        info = await bus.js.stream_info(bus_settings.stream)
        assert info.config.discard == "new" or getattr(info.config.discard, "value", None) == "new"
        for event in events[:500]:
            outbox.put(event)

        async def refused() -> bool:
            return REGISTRY.counter("keel_stream_full_refusals_total", "").value() > refusals

        await wait_until(refused, 60, "the stream to fill and refuse the outbox")
        with pytest.raises(StreamFull, match="is full .* is the recorder running"):
            await bus.publish(events[500])
        with pytest.raises(StreamFull):
            await bus.publish_many(events[500:])
        state = (await bus.js.stream_info(bus_settings.stream)).state
        assert state.first_seq == 1 and state.bytes <= 64 * 1024  # full, and nothing was discarded
        assert 0 < state.messages < 500 and outbox.pending and outbox.dropped == 0
        assert any("is full" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
        for event in events[500:]:
            outbox.put(event)  # what the refused publishers keep, as an agent would

        recorder = Recorder(bus, keel_env.engine, RecorderSettings(
            consumer="recorder", batch_size=50, stream_check_interval="50ms", lag_threshold="1h"))
        await recorder.start()
        stop = asyncio.Event()
        recording = asyncio.create_task(recorder.run(stop))
        try:
            async def all_recorded() -> bool:
                return await keel_env.store.count() >= len(events)

            await wait_until(all_recorded, 120, "every event to reach PostgreSQL")
            assert await outbox.flush(10) and outbox.dropped == 0
            ids = [r.event.id async for r in keel_env.store.read()]
            assert len(ids) == len(set(ids)) == len(events) and set(ids) == {e.id for e in events}
            assert recorder.stats.trimmed > 0
            state = (await bus.js.stream_info(bus_settings.stream)).state
            assert state.first_seq > 1 and state.bytes <= 64 * 1024
        finally:
            stop.set()
            await asyncio.wait_for(recording, 30)
    finally:
        outbox_stop.set()
        await asyncio.wait_for(publishing, 30)
        await outbox.close()
        for stream in (bus_settings.stream, bus_settings.dlq_stream):
            await bus.js.delete_stream(stream)
        await bus.close()


async def test_recorder_lag_is_an_event_and_a_metric(keel_env) -> None:
    """Events wait 2 s in the stream before the recorder starts: its first batches are over the 1 s threshold
    (a RecorderLagReported, above, with the pending count), and once it has caught up it reports the return
    below; the metrics say the same."""
    from keel.events.types import SYSTEM_JOB, RecorderLagReported
    from keel.infra.config import RecorderSettings
    from keel.infra.metrics import REGISTRY

    recorded_before = REGISTRY.counter("keel_events_recorded_total", "").value()
    events = fleet_events(400)
    await keel_env.bus.publish_many(events)
    await asyncio.sleep(2.0)
    recorder = await keel_env.start_recorder(RecorderSettings(batch_size=50, lag_threshold="1s",
                                                              lag_report_interval="1h"))

    async def reported_back() -> bool:
        return recorder.stats.lag_reports >= 2

    await wait_until(reported_back, 30, "the lag reports")
    await keel_env.wait_for_count(len(events) + 2)
    reports = [r.event async for r in keel_env.store.read() if r.event.type == RecorderLagReported.event_name]
    assert [r.payload.above for r in reports] == [True, False]
    above, below = (r.payload for r in reports)
    assert isinstance(above, RecorderLagReported) and isinstance(below, RecorderLagReported)
    assert above.lag_s >= 2.0 and above.pending == len(events) - 50 and above.threshold_s == 1.0
    assert below.lag_s < 1.0 and reports[0].job_id == SYSTEM_JOB and reports[0].subject == "recorder/recorder"
    assert REGISTRY.counter("keel_events_recorded_total", "").value() - recorded_before >= len(events)
    assert REGISTRY.gauge("keel_recorder_lag_seconds", "").value() < 1.0
    text = REGISTRY.render()
    assert "# TYPE keel_recorder_lag_seconds gauge" in text and "keel_recorder_batch_seconds_count" in text
    from keel.reports.incidents import load_job_spans

    assert SYSTEM_JOB not in [job for job, _, _ in await load_job_spans(keel_env.engine)]  # no training job
    assert [job for job, _, _ in await load_job_spans(keel_env.engine, SYSTEM_JOB)] == [SYSTEM_JOB]
