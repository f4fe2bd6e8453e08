"""The notifier service: consume what people must hear about, deliver it over HTTP, log each delivery.

For each consumed event (``core.INPUT_TYPES``) the notifier builds its notifications, routes them to the
configured destinations and delivers to all of them at once. A delivery that fails in a way worth retrying
(no answer, 408, 429, 5xx) is tried again after ``Retry-After`` or a back-off, until it succeeds or
``notifier.give_up_after`` has passed; each destination has its own rate limit. Every delivery ends in a
``NotificationSent`` event (``delivered`` or ``failed``), and the consumed event is acknowledged only after
all of its deliveries ended: a crash redelivers it, and the receivers see the same ``webhook-id`` /
``dedup_key`` again (at least once, deduplicable). Nothing secret is logged: destinations go by their name.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from keel.events.envelope import Event, now_utc
from keel.events.types import NotificationSent
from keel.infra.bus import Bus
from keel.infra.config import ConfigError, NotifierSettings
from keel.infra.consumer import EventConsumer
from keel.infra.secrets import read_secret
from keel.infra.subjects import subject_filter
from keel.kernel.decider import decision_id
from keel.notifier.core import (
    INPUT_TYPES,
    Destination,
    Notification,
    Request,
    RetryPolicy,
    TokenBucket,
    notifications,
    request,
    retry_delay,
    route,
)

log = logging.getLogger(__name__)
NAME = "notifier"
PAGERDUTY_EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"


class NotifierConfigError(ConfigError):
    """A destination's secret file cannot be used; the message names the destination and the file."""


def destinations_from_settings(settings: NotifierSettings) -> list[Destination]:
    """The configured destinations with their URLs and secrets read from their files (private files only)."""
    out = []
    for d in settings.destinations:
        try:
            url = read_secret(d.url_file).decode().strip() if d.url_file else d.url
            secret = read_secret(d.secret_file).decode().strip() if d.secret_file else ""
        except (OSError, UnicodeDecodeError) as exc:
            raise NotifierConfigError(f"notifier destination {d.name}: {exc}") from None
        if d.kind == "pagerduty" and not url:
            url = PAGERDUTY_EVENTS_URL
        out.append(Destination(name=d.name, kind=d.kind, url=url, secret=secret,  # type: ignore[arg-type]
                               min_severity=d.min_severity, kinds=tuple(d.kinds),  # type: ignore[arg-type]
                               jobs=tuple(d.jobs), rate_per_minute=d.rate_per_minute,
                               approval_buttons=d.approval_buttons))
    return out


@dataclass(frozen=True)
class Answer:
    status: int | None
    retry_after: str | None
    detail: str


def post(req: Request, timeout_s: float) -> Answer:
    """POST ``req`` (blocking; run it in a thread). ``status`` None: no answer (refused, reset, timed out)."""
    http = urllib.request.Request(req.url, data=req.body, headers=req.headers, method="POST")
    try:
        with urllib.request.urlopen(http, timeout=timeout_s) as response:  # noqa: S310 - configured https/http URLs
            response.read(65536)
            return Answer(response.status, None, f"HTTP {response.status}")
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.headers.get("Retry-After"), f"HTTP {exc.code}")
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return Answer(None, None, f"no answer: {type(reason).__name__}")


class NotifierService:
    def __init__(self, bus: Bus, destinations: list[Destination], settings: NotifierSettings, *,
                 job_id: str | None = None, clock: Callable[[], datetime] = now_utc,
                 send: Callable[[Request, float], Answer] = post, fetch_timeout_s: float = 0.2) -> None:
        self.bus, self.destinations, self.clock, self.send = bus, destinations, clock, send
        self.timeout_s = settings.request_timeout.total_seconds()
        self.policy = RetryPolicy(base=settings.retry_base, max_backoff=settings.retry_max_backoff,
                                  give_up_after=settings.give_up_after)
        self._buckets = {d.name: TokenBucket(d.rate_per_minute) for d in destinations}
        self._locks = {d.name: asyncio.Lock() for d in destinations}
        self.delivered: list[NotificationSent] = []
        subjects = [subject_filter(bus.settings.subject_prefix, job_id, "job", None, kind) for kind in INPUT_TYPES]
        self._events = EventConsumer(bus, NAME, subjects, fetch_timeout_s=fetch_timeout_s)

    async def start(self) -> None:
        await self._events.start()

    async def run(self, stop: asyncio.Event) -> None:
        if not self._events.started:
            await self.start()
        await self._events.run(self._handle, stop)

    async def _handle(self, event: Event, _seq: int) -> None:
        jobs = [(n, d) for n in notifications(event) for d in route(n, self.destinations)]
        if jobs:
            await asyncio.gather(*(self._deliver(event, n, d) for n, d in jobs))

    async def _deliver(self, event: Event, notification: Notification, destination: Destination) -> None:
        first = self.clock()
        attempt, answer, waited = 0, Answer(None, None, "not tried"), []
        while True:
            async with self._locks[destination.name]:  # the rate limit is per destination, in order
                wait = self._buckets[destination.name].take(self.clock())
                if wait > timedelta(0):
                    waited.append(f"rate limit {wait.total_seconds():.1f} s")
                    await asyncio.sleep(wait.total_seconds())
            attempt += 1
            req = request(notification, destination, self.clock())
            started = time.monotonic()
            answer = await asyncio.to_thread(self.send, req, self.timeout_s)
            if answer.status is not None and 200 <= answer.status < 300:
                outcome, detail = "delivered", "; ".join([*waited, f"{answer.detail} in {time.monotonic() - started:.2f} s"])
                break
            delay, why = retry_delay(answer.status, answer.retry_after, attempt, first, self.clock(), self.policy)
            log.warning("%s: %s of %s to %s, attempt %d: %s; %s", NAME, notification.kind, event.id, destination.name,
                        attempt, answer.detail, why if delay is not None else "giving up")
            if delay is None:
                outcome, detail = "failed", why
                break
            waited.append(why)
            await asyncio.sleep(delay.total_seconds())
        now = self.clock()
        report = NotificationSent(
            destination=destination.name, destination_kind=destination.kind, notification=notification.kind,
            notified_event_id=str(event.id), delivery_id=req.delivery_id, outcome=outcome,
            attempts=attempt, status=answer.status, detail=detail[-2000:],
            latency_s=max(0.0, (now - event.occurred_at).total_seconds()))
        self.delivered.append(report)
        log.info("%s: %s of %s to %s: %s after %d attempt(s)", NAME, notification.kind, event.id, destination.name,
                 outcome, attempt)
        await self.bus.publish(Event.create(
            report, event_id=decision_id(event.id, NAME, report.event_name, destination.name),
            job_id=event.job_id, subject=f"job/{event.job_id}", producer=NAME, occurred_at=now,
            causation_id=event.id, correlation_id=event.correlation_id or event.id))


def secret_files(settings: NotifierSettings) -> list[Path]:
    return [p for d in settings.destinations for p in (d.url_file, d.secret_file) if p is not None]
