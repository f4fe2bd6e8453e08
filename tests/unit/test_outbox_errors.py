"""The outbox keeps an event whose publish failed with an error the bus does not know (and goes on with the
rest once it is through); only a refusal of the identity's permissions drops one."""

from __future__ import annotations

import asyncio

from keel.infra.bus import NotPermitted
from keel.infra.config import BusSettings
from keel.infra.outbox import Outbox
from tests.factories import health_event


class Publisher:
    """Stands in for the bus's publish: fails the calls listed in ``errors`` (by call number), records the rest."""

    def __init__(self, errors: dict[int, Exception]) -> None:
        self.errors = errors
        self.calls = 0
        self.published: list[str] = []

    async def publish(self, event) -> None:  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls in self.errors:
            raise self.errors[self.calls]
        self.published.append(str(event.id))


async def test_an_unknown_error_keeps_the_event_and_a_refusal_drops_it() -> None:
    outbox = Outbox("nats://127.0.0.1:1", BusSettings(), name="test")
    publisher = Publisher({1: RuntimeError("a client error nobody expected"), 3: NotPermitted("not yours")})
    outbox.bus = publisher  # type: ignore[assignment]
    outbox.unexpected_retry_s = 0.01
    events = [health_event(f"n{i}") for i in range(3)]
    for event in events:
        outbox.put(event)
    await outbox._publish_pending()  # the first call fails: nothing published, nothing dropped
    assert (len(outbox.pending), publisher.published, outbox.refused) == (3, [], 0)
    await asyncio.wait_for(outbox._publish_pending(), 5)
    assert publisher.published == [str(events[0].id), str(events[2].id)]  # the second was refused: dropped
    assert (len(outbox.pending), outbox.refused) == (0, 1)
