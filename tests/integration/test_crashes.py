"""Crashes and restarts with real processes: nothing acknowledged is lost, nothing is recorded twice."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from keel.infra.bus import Bus, PublishFailed
from keel.infra.config import Settings
from keel.infra.dbroles import MIGRATE
from keel.infra.embedded import NatsServer, PostgresServer
from keel.infra.store import EventStore, create_engine, run_migrations
from keel.recorder.adapter import Recorder
from tests.conftest import Servers, isolated_settings
from tests.factories import fleet_events

pytestmark = pytest.mark.integration


def service_env(settings: Settings) -> dict[str, str]:
    """A service's environment for ``settings``: each role's database URL too, so it connects as its own role."""
    return {
        **os.environ,
        **{f"KEEL_DATABASE_URLS__{role.upper()}": url
           for role, url in settings.database_urls.model_dump().items() if url},
        "KEEL_NATS_URL": settings.nats_url or "",
        "KEEL_DATABASE_URL": settings.database_url or "",
        "KEEL_DB_SCHEMA": settings.db_schema,
        # The signing keys and keyring of the test's harness (tests/conftest.py): services sign with them
        # and check against them, as under `keel up`.
        **({"KEEL_CREDENTIALS_DIR": str(settings.credentials_dir)} if settings.credentials_dir else {}),
        "KEEL_BUS__SUBJECT_PREFIX": settings.bus.subject_prefix,
        "KEEL_BUS__STREAM": settings.bus.stream,
        "KEEL_BUS__DLQ_STREAM": settings.bus.dlq_stream,
        # Each service finds its own role's NATS identity there (not the test's admin identity).
        "KEEL_CREDENTIALS_DIR": str(settings.credentials_dir or ""),
        "KEEL_RECORDER__BATCH_SIZE": "200",
        "KEEL_BUS__ACK_WAIT": "3s",  # redeliver a killed recorder's batch quickly
    }


def start_recorder_process(settings: Settings, log_path: Path) -> subprocess.Popen:
    return start_service_process("recorder", settings, log_path)


def start_service_process(name: str, settings: Settings, log_path: Path,
                          extra_env: dict[str, str] | None = None, args: list[str] | None = None) -> subprocess.Popen:
    """``keel service NAME [ARGS]`` as a child process bound to the test's servers, prefix and schema."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "keel.cli.main", "service", name, *(args or [])],
            env={**service_env(settings), **(extra_env or {})}, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


async def wait_until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


async def test_recorder_killed_mid_batch_loses_nothing_and_duplicates_nothing(keel_env, scratch_dir: Path) -> None:
    total = 6000
    events = fleet_events(total)
    log = scratch_dir / "recorder.log"
    recorder = start_recorder_process(keel_env.settings, log)
    try:
        publishing = asyncio.create_task(keel_env.bus.publish_many(events, max_in_flight=128))
        store = keel_env.store

        async def some_recorded() -> bool:
            return await store.count() >= 500

        await wait_until(some_recorded, 60, "the recorder to record its first batches")
        recorder.send_signal(signal.SIGKILL)
        recorder.wait(10)
        killed_at = await store.count()
        await publishing
        assert killed_at < total, "the kill came too late to test anything"

        recorder = start_recorder_process(keel_env.settings, log)

        async def all_recorded() -> bool:
            return await store.count() >= total

        await wait_until(all_recorded, 60, "the restarted recorder to catch up")
        await asyncio.sleep(0.5)  # anything recorded twice would show up now
        ids = [r.event.id async for r in store.read()]
        assert len(ids) == total
        assert set(ids) == {e.id for e in events}
    finally:
        recorder.terminate()
        recorder.wait(10)
    assert recorder.returncode == 0, log.read_text()[-2000:]


async def test_nats_killed_mid_stream_every_acknowledged_event_reaches_postgres(
    own_nats: NatsServer, servers: Servers
) -> None:
    settings = isolated_settings(Servers(own_nats.url, servers.database_url, nats=own_nats, role_urls=servers.role_urls))
    await asyncio.to_thread(run_migrations, servers.url(MIGRATE), settings.db_schema)
    engine = create_engine(servers.database_url, settings.db_schema)
    store = EventStore(engine)
    publisher = await Bus.connect(own_nats.url, settings.bus, name="publisher")
    consumer_bus = await Bus.connect(own_nats.url, settings.bus, name="recorder")
    recorder = Recorder(consumer_bus, engine, settings.recorder)
    await recorder.start()
    stop = asyncio.Event()
    recording = asyncio.create_task(recorder.run(stop))
    acknowledged: set[uuid.UUID] = set()
    refused = 0
    try:
        for index, event in enumerate(fleet_events(1500)):
            if index == 500:
                own_nats.kill()  # SIGKILL: no chance to flush anything not already on disk
                restarting = asyncio.create_task(asyncio.to_thread(_restart_later, own_nats, 0.5))
            try:
                await publisher.publish(event)
                acknowledged.add(event.id)
            except PublishFailed:
                refused += 1
        await restarting

        async def all_acknowledged_recorded() -> bool:
            if recording.done():
                recording.result()
            return await store.count() >= len(acknowledged)

        await wait_until(all_acknowledged_recorded, 60, "acknowledged events to reach Postgres")
        recorded = {r.event.id async for r in store.read()}
        assert acknowledged <= recorded
        assert len(acknowledged) >= 1000, f"only {len(acknowledged)} acknowledged, {refused} refused"
    finally:
        stop.set()
        await asyncio.wait_for(recording, 30)
        await publisher.close()
        await consumer_bus.close()
        await engine.dispose()


def _restart_later(server: NatsServer, delay_s: float) -> None:
    import time

    time.sleep(delay_s)
    server.start()


async def test_postgres_restarted_recorder_retries_and_catches_up(own_postgres: PostgresServer, servers: Servers) -> None:
    settings = isolated_settings(Servers(servers.nats_url, own_postgres.dsn, nats=servers.nats))
    await asyncio.to_thread(run_migrations, own_postgres.dsn, settings.db_schema)
    engine = create_engine(own_postgres.dsn, settings.db_schema)
    store = EventStore(engine)
    bus = await Bus.connect(servers.nats_url, settings.bus)
    recorder = Recorder(bus, engine, settings.recorder)
    await recorder.start()
    stop = asyncio.Event()
    recording = asyncio.create_task(recorder.run(stop))
    events = fleet_events(3000)
    try:
        await bus.publish_many(events[:1000])

        async def first_part() -> bool:
            return await store.count() >= 1000

        await wait_until(first_part, 30, "the first 1000 events")
        await asyncio.to_thread(own_postgres.stop)
        await bus.publish_many(events[1000:])  # JetStream keeps accepting while Postgres is down
        await asyncio.sleep(1.0)
        assert not recording.done()
        await asyncio.to_thread(own_postgres.start)

        async def everything() -> bool:
            return await store.count() >= 3000

        await wait_until(everything, 60, "the recorder to catch up after the restart")
        ids = [r.event.id async for r in store.read()]
        assert len(ids) == len(set(ids)) == 3000
        assert recorder.stats.db_retries > 0
    finally:
        stop.set()
        await asyncio.wait_for(recording, 30)
        for stream in (settings.bus.stream, settings.bus.dlq_stream):
            await bus.js.delete_stream(stream)
        await bus.close()
        await engine.dispose()


async def test_controller_killed_between_two_events_of_a_decision_publishes_the_rest_after_restart(
    keel_env, scratch_dir: Path
) -> None:
    """The fault hook makes the controller process exit after the first event of a decision; restarted,
    it publishes the missing ones with the same ids, nothing is recorded twice, and the log replays clean."""
    from keel.controller.adapter import decider_from_settings
    from keel.events.envelope import now_utc
    from keel.events.types import IncidentOpened
    from keel.infra.runner import EXIT_MID_DECISION_ENV
    from keel.kernel.decider import DeciderSession
    from keel.kernel.replay import verify
    from tests.incident_factories import T0, incident_log

    # A rank dies with no culprit (rung 2): the decision opens an incident and requests diagnostics.
    story = incident_log(start_s=(now_utc() - T0).total_seconds() - 60)
    inputs = [e for e in story.events[:story.events.index(story.exited) + 1] if e.producer != "controller"]
    expected = DeciderSession(decider_from_settings(keel_env.settings))
    decision = [e for event in inputs for e in expected.observe(event).emitted if event.id == story.exited.id]
    assert len(decision) >= 2 and any(isinstance(e.payload, IncidentOpened) for e in decision)

    await keel_env.start_recorder()
    log = scratch_dir / "controller.log"
    env = {"KEEL_HOME": str(scratch_dir / "home")}
    controller = start_service_process("controller", keel_env.settings, log, {**env, EXIT_MID_DECISION_ENV: "controller"})
    try:
        await keel_env.bus.publish_many(inputs)
        exit_code = await asyncio.to_thread(controller.wait, 120)
        assert exit_code == 70, log.read_text()[-3000:]

        async def controller_events() -> list:
            return [r.event async for r in keel_env.store.read()
                    if r.event.producer == "controller" and r.event.causation_id == story.exited.id]

        await asyncio.sleep(1.0)
        partial = await controller_events()
        assert len(partial) == 1, partial  # the crash: one event of the decision out, the rest never sent

        controller = start_service_process("controller", keel_env.settings, log, env)

        async def completed() -> bool:
            return len(await controller_events()) >= len(decision)

        await wait_until(completed, 120, "the restarted controller to publish the rest of the decision")
        await asyncio.sleep(1.0)  # anything doubled would show up now
        recorded = await controller_events()
        assert sorted(str(e.id) for e in recorded) == sorted(str(e.id) for e in decision)  # the same ids, once each
        log_events = [r.event async for r in keel_env.store.read()]
        report = verify(decider_from_settings(keel_env.settings), log_events)
        assert report.clean, report.details()
    finally:
        if controller.poll() is None:
            controller.terminate()
            controller.wait(30)



async def test_services_go_on_when_the_stream_is_deleted_and_created_again(keel_env, scratch_dir: Path, ) -> None:
    """The recorder and controller processes, with their durable consumers gone with the stream, create
    them again on the new one: a fault after the reset is recorded and decided, a controller restarted
    after it decides nothing twice, and the log replays clean."""
    from keel.controller.adapter import decider_from_settings
    from keel.kernel.replay import verify
    from tests.factories import health_event
    from tests.integration.test_replay_cli import registrations

    # The job clock stands still (one tick an hour): deleting a stream loses whatever the recorder had not
    # yet stored, and a tick the controller folded but the recorder never saw would move the n4
    # decision's recorded time (its ``expires_at``) away from what replay computes. That loss is what
    # deleting a stream means; this test is about the services going on after it.
    env = {"KEEL_HOME": str(scratch_dir / "home"), "KEEL_CONTROLLER__NODE_SILENCE_TIMEOUT": "1h",
           "KEEL_CONTROLLER__CLOCK_INTERVAL": "1h", "KEEL_CONTROLLER__CLOCK_QUIET_INTERVAL": "1h"}
    recorder = start_service_process("recorder", keel_env.settings, scratch_dir / "recorder.log", env)
    controller = start_service_process("controller", keel_env.settings, scratch_dir / "controller.log", env)
    store = keel_env.store

    async def evictions() -> list:
        return [r.event async for r in store.read(types=["NodeEvictionDecided"])]

    try:
        await keel_env.bus.publish_many([*registrations(), health_event("n2", status="failed", fatal=True,
                                                                        confidence="high", component="gpu")])

        async def first_eviction() -> bool:
            return len(await evictions()) == 1

        await wait_until(first_eviction, 120, "the eviction of n2 before the reset")

        await keel_env.bus.js.delete_stream(keel_env.settings.bus.stream)
        await keel_env.bus.ensure_streams()  # what `keel migrate` does on a missing stream
        await keel_env.bus.publish(health_event("n4", status="failed", fatal=True, confidence="high", component="disk"))

        async def second_eviction() -> bool:
            return len(await evictions()) == 2

        await wait_until(second_eviction, 120, "the eviction of n4 after the reset")
        controller.terminate()
        controller.wait(30)
        controller = start_service_process("controller", keel_env.settings, scratch_dir / "controller.log", env)
        await asyncio.sleep(8)  # a restarted controller that decided anything twice would show it now
        assert [e.payload.node_id for e in await evictions()] == ["n2", "n4"]
        log_events = [r.event async for r in store.read()]
        assert len({e.id for e in log_events}) == len(log_events)
        report = verify(decider_from_settings(keel_env.settings), log_events)
        assert report.clean, report.details()
    finally:
        for process in (controller, recorder):
            if process.poll() is None:
                process.terminate()
                process.wait(30)
    assert recorder.returncode == 0, (scratch_dir / "recorder.log").read_text()[-3000:]
