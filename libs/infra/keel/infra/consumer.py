"""The one consumer loop: fetch a batch from a durable JetStream consumer -> decode -> handle -> ack.

Every process that consumes events uses it: the decider runner (controller, broker, analyzer, hot-update),
the actuator and the node agent hand it a handler per event; the recorder, which writes whole batches in
one transaction, takes the raw batches from ``fetch``.

The contract, the same for every consumer:
- A message that is not a valid event (``decode_event`` refuses it), or that was published on another
  subject than the one its envelope belongs on, is logged and terminated: never redelivered, never
  handed to the handler. The recorder dead-letters it with the same reason, so what a consumer acts on
  is exactly what the log keeps (an event from a component still on an older subject scheme included).
- An event that needs a signature and has no valid one (``Bus.signing.check``: unsigned, signed by a key
  the keyring lacks or of the wrong role, or whose signature does not match) is never handed to the
  handler: it is dead-lettered with the reason (``Bus.dead_letter``; the recorder dead-letters the same
  message under the same id, so it is kept once) and acknowledged.
- A message is acknowledged only after its handler returns. A handler that raises leaves the message
  unacknowledged and the exception propagates (crash-only: the process restarts and sees it again).
- One id, one body: an event id handled once is not handled again (a duplicate the stream took after
  its dedup window, or the same id with another body, which the log does not keep either: the recorder
  keeps the first). The memory of ids is bounded (``RECENT_IDS``); older duplicates are the stream's
  dedup window's and the log's primary key's to catch.
- The consumer outlives its stream: when the durable consumer is gone (the stream was deleted and
  created again, which numbers messages from 1 again), it is created anew on the new stream and
  ``on_reset`` is called, so the owner can forget the sequences it remembers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from keel.events.envelope import Event, InvalidEvent, decode_wire
from keel.infra.bus import BatchPuller, Bus, fetch_batch, stream_sequence

log = logging.getLogger(__name__)

Handler = Callable[[Event, int], Awaitable[None]]
"""``handle(event, stream_sequence)``: called once per valid message, in stream order; ack follows."""


RECENT_IDS = 65_536
"""How many handled event ids a consumer remembers to drop duplicates (about 4 MiB)."""

RESET_CHECK_INTERVAL_S = 5.0
"""While fetches come back empty, how often the consumer checks that its durable still exists."""


@dataclass
class ConsumerStats:
    handled: int = 0
    malformed: int = 0
    refused: int = 0
    """Events refused for their signature (dead-lettered, never handled)."""
    duplicates: int = 0
    resets: int = 0


class EventConsumer:
    """A durable pull consumer on the events stream (``durable``), filtered to ``filter_subjects`` (all of
    the stream when empty). ``start()`` creates or binds it; ``run_once(handle)`` handles one batch;
    ``run(handle, stop)`` loops until ``stop``; ``fetch()`` returns a raw batch for batch consumers."""

    def __init__(self, bus: Bus, durable: str, filter_subjects: list[str] | None = None, *, batch_size: int = 16,
                 fetch_timeout_s: float = 0.5, max_deliver: int | None = None,
                 inactive_threshold: timedelta | None = None,
                 on_reset: Callable[[], None] | None = None) -> None:
        self.bus = bus
        self.durable = durable
        self.filter_subjects = list(filter_subjects or [])
        self.batch_size = batch_size
        self.fetch_timeout_s = fetch_timeout_s
        self.max_deliver = max_deliver
        self.inactive_threshold = inactive_threshold
        self.stats = ConsumerStats()
        self.on_reset = on_reset
        self._sub: BatchPuller | None = None
        self._recent: OrderedDict[uuid.UUID, None] = OrderedDict()
        self._next_reset_check = 0.0

    @property
    def started(self) -> bool:
        return self._sub is not None

    async def start(self) -> None:
        if len(self.filter_subjects) == 1:
            self._sub = await self.bus.pull_consumer(self.durable, filter_subject=self.filter_subjects[0],
                                                     max_deliver=self.max_deliver,
                                                     inactive_threshold=self.inactive_threshold)
        else:
            self._sub = await self.bus.pull_consumer(self.durable, filter_subjects=self.filter_subjects or None,
                                                     max_deliver=self.max_deliver,
                                                     inactive_threshold=self.inactive_threshold)

    async def fetch(self, batch_size: int | None = None, timeout_s: float | None = None) -> list[Msg]:
        """Up to ``batch_size`` raw messages; an empty list when none came within the fetch timeout."""
        if self._sub is None:
            await self.start()
        assert self._sub is not None
        msgs = await fetch_batch(self._sub, batch_size or self.batch_size,
                                 self.fetch_timeout_s if timeout_s is None else timeout_s)
        if not msgs and time.monotonic() >= self._next_reset_check:
            self._next_reset_check = time.monotonic() + RESET_CHECK_INTERVAL_S
            try:
                await self._recreate_if_gone()
            except (nats.errors.Error, TimeoutError, OSError) as exc:  # NATS unreachable: ask again later
                log.debug("%s: could not check its durable consumer: %r", self.durable, exc)
        return msgs

    async def _recreate_if_gone(self) -> None:
        """Create the durable consumer again when it is gone (deleted with its stream)."""
        if await self.bus.consumer_ack_floor(self.durable) is not None:
            return
        try:
            await self.bus.stream_bounds()
        except nats.js.errors.NotFoundError:
            log.warning("%s: the events stream is gone; waiting for it to be created again", self.durable)
            return
        log.warning("%s: its durable consumer is gone (the stream was recreated); creating it again", self.durable)
        previous = self._sub
        await self.start()  # raises (and is asked again later) if the stream went away meanwhile
        if previous is not None:
            await previous.unsubscribe()
        self._recent.clear()
        self.stats.resets += 1
        if self.on_reset is not None:
            self.on_reset()

    async def run_once(self, handle: Handler) -> int:
        """Handle one batch; returns how many messages it held (malformed ones included)."""
        msgs = await self.fetch()
        for msg in msgs:
            try:
                as_sent, event = decode_wire(msg.data, max_bytes=self.bus.settings.max_event_bytes)
            except InvalidEvent as exc:
                log.warning("%s: ignoring malformed message on %s: %s", self.durable, msg.subject, exc.reason)
                self.stats.malformed += 1
                await msg.term()
                continue
            expected = self.bus.subject_for(event)
            if msg.subject != expected:
                log.warning("%s: ignoring %s %s published on %s: its envelope belongs on %s", self.durable,
                            event.type, event.id, msg.subject, expected)
                self.stats.malformed += 1
                await msg.term()
                continue
            verdict = self.bus.signing.check(event, as_sent)
            if not verdict.ok:
                log.error("%s: refusing %s %s from %s: %s", self.durable, event.type, event.id, msg.subject,
                          verdict.reason)
                self.stats.refused += 1
                await self.bus.dead_letter(msg, verdict.reason)
                await msg.ack()
                continue
            if event.id in self._recent:
                log.info("%s: %s %s handled already; dropping the duplicate", self.durable, event.type, event.id)
                self.stats.duplicates += 1
                await msg.ack()
                continue
            await handle(event, stream_sequence(msg))
            await msg.ack()
            self._remember(event.id)
            self.stats.handled += 1
        return len(msgs)

    def _remember(self, event_id: uuid.UUID) -> None:
        self._recent[event_id] = None
        if len(self._recent) > RECENT_IDS:
            self._recent.popitem(last=False)

    async def run(self, handle: Handler, stop: asyncio.Event) -> None:
        """Handle batches until ``stop`` is set (the batch in hand is finished first)."""
        while not stop.is_set():
            await self.run_once(handle)
