"""A bounded, in-order outbox for producers at the edge (node agents, the CLI's injector).

``put`` never blocks and never raises, so the process that observes (and the training it watches)
keeps going when NATS is unreachable. A background task connects (retrying with capped backoff,
saying so once in the log), publishes in order and keeps what it could not publish. When the buffer is
full the oldest event is dropped, counted and logged (the first drop, then every 1,000th): a node agent
must not grow without bound while the control plane is away, and its state events are re-sent by the next
heartbeat anyway. A full events stream is such an absence: its refusal (``StreamFull``) is retried like
any failed publish, and the event stays pending until the recorder has made room. An error the bus does not know
keeps the event too (it is retried a second later, logged each time): only a refusal of this identity's
permissions drops one.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from keel.events.envelope import Event
from keel.infra.bus import Bus, NotPermitted, PublishFailed
from keel.infra.config import BusSettings
from keel.infra.signing import NO_SIGNING, Signing

log = logging.getLogger(__name__)


class Outbox:
    unexpected_retry_s = 1.0
    """The wait before retrying an event whose publish failed with an error the bus does not know."""

    def __init__(self, url: str, settings: BusSettings, *, name: str, capacity: int = 10_000,
                 signing: Signing = NO_SIGNING) -> None:
        """``signing``: what the connection signs and what consumers on it (a node agent's commands) check
        against (``keel.infra.signing``); by default nothing is signed and every event that needs a
        signature is refused."""
        self.url = url
        self.settings = settings
        self.signing = signing
        self.name = name
        self.pending: collections.deque[Event] = collections.deque(maxlen=capacity)
        self.dropped = 0
        self.published = 0
        self.refused = 0
        """Events the server refused for this identity's permissions (dropped, each logged)."""
        self.bus: Bus | None = None
        self.connected = asyncio.Event()
        self._wakeup = asyncio.Event()

    def put(self, event: Event) -> None:
        if len(self.pending) == self.pending.maxlen:
            self.dropped += 1
            if self.dropped % 1000 == 1:
                log.error("%s: outbox full (%d events unpublished): dropped its oldest event (%d dropped so far)",
                          self.name, len(self.pending), self.dropped)
        self.pending.append(event)
        self._wakeup.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Connect, then publish until ``stop``; pending events are flushed (best effort) at the end."""
        delay_s = 0.2
        warned = False
        while not stop.is_set() and self.bus is None:
            try:
                self.bus = await asyncio.wait_for(Bus.connect(self.url, self.settings, name=self.name,
                                                                   signing=self.signing), 3)
                self.connected.set()
                if warned:
                    log.warning("%s: reached NATS at %s; publishing %d buffered events", self.name, self.url, len(self.pending))
            except Exception as exc:  # noqa: BLE001 - any failure to connect is retried; the reason is logged
                if not warned:
                    log.error("%s: cannot reach NATS at %s (%s); buffering events and retrying", self.name, self.url,
                              f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
                    warned = True
                await _sleep_or_stop(stop, delay_s)
                delay_s = min(delay_s * 2, 5.0)
        while not stop.is_set():
            await self._publish_pending()
            self._wakeup.clear()
            if not self.pending:
                await _wait_any(stop, self._wakeup, timeout_s=1.0)
        if self.bus is not None:
            await self._publish_pending()
        elif self.pending:
            log.error("%s: NATS at %s was never reachable; %d events were not published", self.name, self.url,
                      len(self.pending))

    async def _publish_pending(self) -> None:
        assert self.bus is not None
        while self.pending:
            event = self.pending[0]
            try:
                await self.bus.publish(event)
            except PublishFailed as exc:
                log.warning("%s: publish failed, will retry: %s", self.name, exc)
                await asyncio.sleep(0.5)
                return
            except NotPermitted as exc:
                # This identity may never publish it (a bug, or a misconfigured identity): retrying would
                # hold up every event behind it for good.
                log.error("%s: dropped %s %s: %s", self.name, event.type, event.id, exc)
                self.refused += 1
            except Exception as exc:  # noqa: BLE001 - an error the bus does not know: keep the event, retry
                # Dropping it, or letting the outbox's task die (every later event with it), would lose what
                # the node saw; a client error nats-py adds one day must not do either.
                log.error("%s: publish of %s %s failed with an unexpected %s: %s; keeping it and retrying",
                          self.name, event.type, event.id, type(exc).__name__, exc)
                await asyncio.sleep(self.unexpected_retry_s)
                return
            if self.pending and self.pending[0] is event:
                self.pending.popleft()
            self.published += 1

    async def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything put so far is published; False on timeout."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.pending and asyncio.get_running_loop().time() < deadline:
            self._wakeup.set()
            await asyncio.sleep(0.02)
        return not self.pending

    async def close(self) -> None:
        if self.bus is not None:
            await self.bus.close()


async def _sleep_or_stop(stop: asyncio.Event, delay_s: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), delay_s)
    except TimeoutError:
        pass


async def _wait_any(stop: asyncio.Event, other: asyncio.Event, timeout_s: float) -> None:
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(other.wait())]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
