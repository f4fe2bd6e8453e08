"""The recorder under faults of what it stands on, with real servers: PostgreSQL killed in the middle of a
batch's COPY, and a stream filled to its limit while the recorder is stopped."""

from __future__ import annotations

import asyncio
import threading

import pytest
from sqlalchemy.ext.asyncio import AsyncConnection

from keel.infra.bus import Bus
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
        if self.crashed < self.crashes and plan.accepted:
            self.crashed += 1
            self.postgres.kill()  # the transaction holding this batch's COPY dies with the server

            def restart() -> None:
                self.postgres.start()
                self.restarted.set()

            threading.Thread(target=restart, daemon=True).start()
        return result


async def test_postgres_killed_mid_copy_loses_nothing_doubles_nothing(own_postgres: PostgresServer,
                                                                        servers: Servers) -> None:
    settings = isolated_settings(Servers(servers.nats_url, own_postgres.dsn), batch_size=500)
    await asyncio.to_thread(run_migrations, own_postgres.dsn, settings.db_schema)
    engine = create_engine(own_postgres.dsn, settings.db_schema)
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
