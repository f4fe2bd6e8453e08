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
