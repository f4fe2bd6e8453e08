"""A publisher and a consumer across a NATS restart (real nats-server, stopped and started on the same port
and store): a publish waits for the connection instead of spending its attempts, up to
``bus.outage_tolerance``; a consumer sends no pull requests while disconnected and goes on afterwards."""

from __future__ import annotations

import asyncio
import time

import pytest

from keel.events.envelope import Event, now_utc
from keel.events.types import NodeRegistered
from keel.infra.bus import Bus, PublishFailed
from keel.infra.config import BusSettings
from keel.infra.consumer import EventConsumer
from keel.infra.embedded import NatsServer

pytestmark = pytest.mark.integration

# Without waiting for the connection, two attempts of one second each fail a publish in about 2 s.
SETTINGS = BusSettings(subject_prefix="ko", stream="KO", dlq_stream="KO_DLQ", max_bytes="64MiB", publish_attempts=2,
                       publish_timeout="1s", retry_backoff_initial="50ms", outage_tolerance="60s")


def registered(node: str) -> Event:
    return Event.create(NodeRegistered(node_id=node, host=node), job_id="j", subject=f"node/{node}",
                        producer="test", occurred_at=now_utc())


async def test_publish_and_consume_ride_out_a_nats_restart(own_nats: NatsServer) -> None:
    settings = SETTINGS.model_copy(update={"credentials": own_nats.identity_file("admin")})
    bus = await Bus.connect(own_nats.url, settings, name="outage-publisher")
    consumer_bus = await Bus.connect(own_nats.url, settings, name="outage-consumer")
    try:
        consumer = EventConsumer(consumer_bus, "outage-test", fetch_timeout_s=0.2)
        await consumer.start()
        seen: list[Event] = []

        async def handle(event: Event, _seq: int) -> None:
            seen.append(event)

        stop = asyncio.Event()
        consuming = asyncio.create_task(consumer.run(handle, stop))
        await bus.publish(registered("before"))
        await asyncio.to_thread(own_nats.stop)
        started = time.monotonic()
        one = asyncio.create_task(bus.publish(registered("during-1")))
        many = asyncio.create_task(bus.publish_many([registered("during-2"), registered("during-3")]))
        await asyncio.sleep(6)  # three times what the attempts alone would last
        assert not one.done() and not many.done()
        assert not consuming.done()
        await asyncio.to_thread(own_nats.start)
        await asyncio.wait_for(asyncio.gather(one, many), 30)
        assert time.monotonic() - started >= 6
        deadline = time.monotonic() + 20
        while len(seen) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(consuming, 10)
        assert [e.payload.node_id for e in seen] == ["before", "during-1", "during-2", "during-3"]
        info = await bus.js.stream_info(SETTINGS.stream)
        assert info.state.messages == 4  # each once
    finally:
        await bus.close()
        await consumer_bus.close()


async def test_publish_gives_up_after_the_outage_tolerance(own_nats: NatsServer) -> None:
    settings = SETTINGS.model_copy(update={"outage_tolerance": BusSettings(outage_tolerance="2s").outage_tolerance,
                                           "credentials": own_nats.identity_file("admin")})
    bus = await Bus.connect(own_nats.url, settings, name="outage-publisher")
    try:
        await asyncio.to_thread(own_nats.stop)
        started = time.monotonic()
        with pytest.raises(PublishFailed, match="NATS unreachable for .*outage_tolerance 2 s"):
            await bus.publish(registered("lost"))
        assert 2 <= time.monotonic() - started < 15
    finally:
        await asyncio.to_thread(own_nats.start)
        await bus.close()



async def test_the_job_clock_sends_no_tick_late_across_a_nats_outage(own_nats: NatsServer) -> None:
    """A tick is a reading of the clock: while NATS is unreachable the job clock drops its rounds instead of
    leaving them to be sent, stale, when the connection is back; afterwards it ticks afresh. Every tick in the
    stream is then no older than when it was acknowledged (within the allowance)."""
    from datetime import timedelta

    from keel.events.envelope import decode_event
    from keel.infra.clock import JobClock

    settings = SETTINGS.model_copy(update={"credentials": own_nats.identity_file("admin")})
    bus = await Bus.connect(own_nats.url, settings, name="clock-host")
    try:
        clock = JobClock(bus, lambda: ["j"], timedelta(seconds=1), stale_after=timedelta(seconds=2))
        assert len(await clock.tick()) == 1
        await asyncio.to_thread(own_nats.stop)
        deadline = time.monotonic() + 10
        while bus.nc.is_connected:
            assert time.monotonic() < deadline, "the client did not notice the server stopped"
            await asyncio.sleep(0.05)
        during = [await clock.tick() for _ in range(3)]
        assert during == [[], [], []] and clock.dropped == 3
        await asyncio.to_thread(own_nats.start)
        deadline = time.monotonic() + 30
        while not bus.nc.is_connected:
            assert time.monotonic() < deadline, "the client did not reconnect"
            await asyncio.sleep(0.05)
        after = await clock.tick()
        assert len(after) == 1
        await asyncio.sleep(1.0)  # anything the client had buffered is flushed on reconnecting
        puller = await bus.pull_consumer("clock-check", ack_all=True)
        messages = await puller.fetch(10, 2)
        ticks = [decode_event(m.data, max_bytes=settings.max_event_bytes) for m in messages]
        assert len(ticks) == 2 and ticks[-1].id == after[0].id, [t.payload.now for t in ticks]
        assert (await bus.js.stream_info(SETTINGS.stream)).state.messages == 2
    finally:
        await bus.close()
