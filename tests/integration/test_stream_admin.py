"""Only an administering client changes a stream's settings (real NATS)."""

from __future__ import annotations

import pytest

from keel.infra.bus import Bus

pytestmark = pytest.mark.integration


async def test_a_client_with_other_settings_leaves_the_stream_as_it_is_and_says_so(keel_env, caplog) -> None:
    settings = keel_env.settings.bus
    url = keel_env.settings.nats_url
    info = await keel_env.bus.js.stream_info(settings.stream)
    assert info.config.max_bytes == settings.max_bytes  # created with the fixture's settings

    # A laptop with default-ish settings: another size and age. It connects, publishes, reads - and
    # changes nothing on the server.
    laptop_settings = settings.model_copy(update={"max_bytes": settings.max_bytes // 2, "max_age": settings.max_age * 2})
    laptop = await Bus.connect(url, laptop_settings, name="laptop")
    try:
        differences = await laptop.ensure_streams()
    finally:
        await laptop.close()
    assert any(d.startswith("max_bytes") for d in differences) and any(d.startswith("max_age") for d in differences)
    assert len([d for d in differences if d.startswith("max_bytes")]) == 2  # the events and dead-letter streams
    assert "only `keel migrate` changes stream settings" in caplog.text
    assert (await keel_env.bus.js.stream_info(settings.stream)).config.max_bytes == settings.max_bytes

    # The administering command (keel migrate / keel-migrate / keel up) does change them.
    admin = await Bus.connect(url, laptop_settings, name="admin", administer=True)
    try:
        assert (await admin.js.stream_info(settings.stream)).config.max_bytes == laptop_settings.max_bytes
        assert await admin.ensure_streams() == []
    finally:
        await admin.close()


async def test_the_same_settings_report_no_difference(keel_env) -> None:
    assert await keel_env.bus.ensure_streams() == []


async def test_a_node_consumer_is_removed_by_the_server_after_its_inactivity_threshold(keel_env) -> None:
    from datetime import timedelta

    from keel.infra.consumer import EventConsumer

    prefix = keel_env.settings.bus.subject_prefix
    consumer = EventConsumer(keel_env.bus, "agent-j-gpu01%2Edc1-node-2", [f"{prefix}.j.node.gpu01%2Edc1.>"],
                             inactive_threshold=timedelta(seconds=1))
    await consumer.start()
    info = await keel_env.bus.js.consumer_info(keel_env.settings.bus.stream, consumer.durable)
    assert info.config.inactive_threshold == 1.0
    assert keel_env.settings.bus.node_consumer_inactive == timedelta(days=1)  # what agents use by default
    # Nobody pulls any more (the node is gone): the server removes the consumer by itself.
    import asyncio

    import nats.js.errors

    for _ in range(100):
        try:
            await keel_env.bus.js.consumer_info(keel_env.settings.bus.stream, consumer.durable)
        except nats.js.errors.NotFoundError:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the inactive consumer is still there after 10 s")


@pytest.mark.parametrize("name", ["agent-j-gpu01.dc1", "a*b", "a>b", "with space", ""])
async def test_a_durable_name_nats_cannot_take_is_refused_loudly(keel_env, name: str) -> None:
    with pytest.raises(ValueError, match="invalid durable consumer name"):
        await keel_env.bus.pull_consumer(name)
