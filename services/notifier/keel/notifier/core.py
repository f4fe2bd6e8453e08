"""What the notifier tells whom, in which words, and when it tries again (pure: no I/O, no clock).

``notifications(event)`` turns the events people must hear about into ``Notification``s: an incident opened or
resolved, an action held for approval or by a guardrail, a job stopped at rung 6, a rollback. ``route`` picks the
destinations whose filters take it (severity at least their ``min_severity``; their ``kinds`` and ``jobs``, when
given). Each destination kind has its wire format:

- ``slack``: an incoming-webhook message with Block Kit blocks and a ``text`` fallback (what notifications and
  screen readers show);
- ``pagerduty``: an Events API v2 event; ``trigger`` for what needs a human, ``resolve`` when the incident
  recovered, both under the incident's ``dedup_key``, so PagerDuty keeps one alert per incident;
- ``webhook``: the notification as JSON, signed per the Standard Webhooks spec (``webhook-id``,
  ``webhook-timestamp``, ``webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">``).

``retry_delay`` says whether and when a failed delivery is tried again: on a connection error or a timeout, 408,
429 and 5xx, after ``Retry-After`` when the receiver sends one, else after an exponential back-off; never for
another 4xx (the request is wrong and will stay wrong). ``TokenBucket`` is each destination's rate limit.
Delivery ids are derived from the event and the destination, so a redelivered event keeps its ids: a receiver
deduplicates on ``webhook-id``, PagerDuty on ``dedup_key``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any, Literal

from keel.events.envelope import Event
from keel.events.types import (
    ActionHeld,
    ApprovalRequested,
    IncidentOpened,
    IncidentResolved,
    JobStopDecided,
    RollbackDecided,
)

Severity = Literal["info", "warning", "critical"]
SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}
NotificationKind = Literal["incident_opened", "incident_resolved", "approval_requested", "action_held", "job_stopped",
                           "rollback"]
NOTIFICATION_KINDS: tuple[str, ...] = ("incident_opened", "incident_resolved", "approval_requested", "action_held",
                                       "job_stopped", "rollback")
INPUT_TYPES = ("IncidentOpened", "IncidentResolved", "ApprovalRequested", "ActionHeld", "JobStopDecided",
               "RollbackDecided")
"""The event types the notifier consumes."""
RETRY_STATUSES = frozenset({408, 429})
_NAMESPACE = uuid.UUID("5b0b5a4e-9a56-4d0e-9d35-7a1f2c3e4b61")
APPROVE_ACTION, DENY_ACTION = "keel_approve", "keel_deny"
"""The ``action_id`` of an approval request's two Slack buttons (their ``value`` is the ``ApprovalRequested``
event id; ``keel.notifier.chatops`` reads the presses)."""


@dataclass(frozen=True)
class Notification:
    """One thing to tell people, independent of where it goes."""

    kind: str
    severity: Severity
    job_id: str
    title: str
    text: str
    incident_id: str
    """The incident it belongs to ('' when none): PagerDuty's ``dedup_key``."""
    event_id: str
    event_type: str
    occurred_at: datetime
    action: Literal["trigger", "resolve"] = "trigger"
    fields: dict[str, str] = field(default_factory=dict)
    """Short facts shown beside the text (node, rung, outcome...)."""


@dataclass(frozen=True)
class Destination:
    """Where notifications go, as configured (``notifier.destinations``), with its secret already read."""

    name: str
    kind: Literal["slack", "pagerduty", "webhook"]
    url: str
    secret: str = ""
    """PagerDuty: the integration's routing key; webhook: the signing secret (``whsec_<base64>`` or raw)."""
    min_severity: Severity = "warning"
    kinds: tuple[str, ...] = ()
    jobs: tuple[str, ...] = ()
    rate_per_minute: float = 30.0
    approval_buttons: bool = False
    """Slack: approval requests carry Approve / Deny buttons (chat-ops, answered by the API)."""


@dataclass(frozen=True)
class Request:
    """An HTTP POST, ready to send."""

    url: str
    body: bytes
    headers: dict[str, str]
    delivery_id: str


def notifications(event: Event) -> list[Notification]:
    """The notifications an event calls for (none for most events)."""
    p, job = event.payload, event.job_id

    def note(kind: str, severity: Severity, title: str, text: str, incident_id: str, fields: dict[str, str],
             action: Literal["trigger", "resolve"] = "trigger") -> list[Notification]:
        return [Notification(kind, severity, job, f"[{job}] {title}", text, incident_id, str(event.id), event.type,
                             event.occurred_at, action, fields)]

    if isinstance(p, IncidentOpened):
        where = f" on {p.node_id}" if p.node_id else ""
        return note("incident_opened", "warning", f"{p.kind} incident{where}", p.reason, str(event.id),
                    {"kind": p.kind, "node": p.node_id or "-", "generation": str(p.generation),
                     "last step": str(p.last_step)})
    if isinstance(p, IncidentResolved):
        recovered = p.outcome == "recovered"
        return note("incident_resolved", "info" if recovered else "warning", f"incident {p.outcome} at rung {p.rung}",
                    p.reason, p.incident_id, {"outcome": p.outcome, "rung": str(p.rung)},
                    "resolve" if recovered else "trigger")
    if isinstance(p, ApprovalRequested):
        return note("approval_requested", "warning", f"approval needed: {p.action}",
                    f"{p.reason}\nApprove: keel approve {event.id} / deny: keel deny {event.id} "
                    f"(expires {p.expires_at.isoformat()})", p.incident_id,
                    {"action": p.action, "request": str(event.id), "expires": p.expires_at.isoformat()})
    if isinstance(p, ActionHeld):
        return note("action_held", "warning", f"{p.action} held by {p.guardrail}", p.reason, p.incident_id,
                    {"action": p.action, "guardrail": p.guardrail, "rung": str(p.rung)})
    if isinstance(p, JobStopDecided):
        return note("job_stopped", "critical", f"job stopped at rung {p.rung}: a human is needed", p.reason,
                    p.incident_id, {"rung": str(p.rung)})
    if isinstance(p, RollbackDecided):
        return note("rollback", "warning", f"rolled back to {p.to_version or 'the last stable version'}", p.reason,
                    p.incident_id, {"to version": p.to_version or "-"})
    return []


def route(notification: Notification, destinations: list[Destination]) -> list[Destination]:
    """The destinations that take ``notification``. A resolution goes wherever its incident could have gone (it is
    routed as a warning), and to PagerDuty whatever its filter (a resolve only clears what it holds)."""
    out = []
    for d in destinations:
        if d.jobs and notification.job_id not in d.jobs:
            continue
        if d.kinds and notification.kind not in d.kinds:
            continue
        severity = "warning" if notification.action == "resolve" else notification.severity
        if d.kind == "pagerduty" and notification.action == "resolve":
            severity = "critical"  # a resolve clears what PagerDuty holds: it must reach it whatever its filter
        if SEVERITY_RANK[severity] >= SEVERITY_RANK[d.min_severity]:
            out.append(d)
    return out


def delivery_id(notification: Notification, destination: Destination) -> str:
    """Stable across redeliveries of the same event: the receivers' deduplication key."""
    return "msg_" + uuid.uuid5(_NAMESPACE, f"{notification.event_id}/{destination.name}").hex


def request(notification: Notification, destination: Destination, now: datetime) -> Request:
    """The HTTP request that delivers ``notification`` to ``destination`` (signed at ``now`` for a webhook)."""
    ident = delivery_id(notification, destination)
    if destination.kind == "slack":
        body = slack_message(notification, destination.approval_buttons)
        headers = {"Content-Type": "application/json"}
    elif destination.kind == "pagerduty":
        body = pagerduty_event(notification, destination.secret)
        headers = {"Content-Type": "application/json"}
    else:
        body = webhook_body(notification)
        headers = {"Content-Type": "application/json",
                   **standard_webhook_headers(ident, int(now.timestamp()), body, destination.secret)}
    return Request(destination.url, body, headers, ident)


def _json(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


def slack_message(n: Notification, buttons: bool = False) -> bytes:
    """An incoming-webhook message; ``buttons``: an approval request gets Approve / Deny buttons (the Slack app's
    interactivity must point at the API's ``/v1/chatops/slack``)."""
    icon = {"info": ":white_check_mark:", "warning": ":warning:", "critical": ":rotating_light:"}[n.severity]
    facts = [{"type": "mrkdwn", "text": f"*{k}*\n{v}"} for k, v in list(n.fields.items())[:10]]
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": n.title[:150]}},
        {"type": "section", "text": {"type": "mrkdwn", "text": f"{icon} {n.text[:2900]}"}},
    ]
    if facts:
        blocks.append({"type": "section", "fields": facts})
    if buttons and n.kind == "approval_requested" and n.fields.get("request"):
        blocks.append(approval_buttons(n.fields["request"]))  # answered through the API's chat-ops route
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": (
        f"job `{n.job_id}` · {n.event_type} `{n.event_id}` · {n.occurred_at.isoformat()}"
        + (f" · incident `{n.incident_id}`" if n.incident_id else ""))}]})
    return _json({"text": f"{n.title}: {n.text}"[:3000], "blocks": blocks})


def approval_buttons(request_id: str) -> dict[str, Any]:
    """The Block Kit ``actions`` block of an approval request's message: Approve (with a confirmation) and Deny,
    each carrying the request's id."""
    return {"type": "actions", "block_id": f"keel_approval_{request_id}"[:255], "elements": [
        {"type": "button", "action_id": APPROVE_ACTION, "style": "primary", "value": request_id,
         "text": {"type": "plain_text", "text": "Approve"},
         "confirm": {"title": {"type": "plain_text", "text": "Approve this action?"},
                     "text": {"type": "plain_text", "text": "Keel carries it out as soon as it hears."},
                     "confirm": {"type": "plain_text", "text": "Approve"},
                     "deny": {"type": "plain_text", "text": "Cancel"}}},
        {"type": "button", "action_id": DENY_ACTION, "style": "danger", "value": request_id,
         "text": {"type": "plain_text", "text": "Deny"}}]}


def pagerduty_event(n: Notification, routing_key: str) -> bytes:
    dedup = n.incident_id or n.event_id
    if n.action == "resolve":
        return _json({"routing_key": routing_key, "event_action": "resolve", "dedup_key": dedup})
    return _json({"routing_key": routing_key, "event_action": "trigger", "dedup_key": dedup,
                  "payload": {"summary": n.title[:1024], "source": f"keel/{n.job_id}",
                              "severity": "critical" if n.severity == "critical" else "warning",
                              "timestamp": n.occurred_at.isoformat(), "component": n.kind, "group": n.job_id,
                              "custom_details": {"text": n.text, **n.fields, "event_id": n.event_id}}})


def webhook_body(n: Notification) -> bytes:
    return _json({"type": f"keel.{n.kind}", "timestamp": n.occurred_at.isoformat(),
                  "data": {"job_id": n.job_id, "severity": n.severity, "action": n.action, "title": n.title,
                           "text": n.text, "incident_id": n.incident_id, "event_id": n.event_id,
                           "event_type": n.event_type, "fields": n.fields}})


def webhook_secret_bytes(secret: str) -> bytes:
    """A Standard Webhooks secret: ``whsec_`` and base64, as the spec's libraries issue them; else the raw bytes."""
    if secret.startswith("whsec_"):
        return base64.b64decode(secret.removeprefix("whsec_"))
    return secret.encode()


def standard_webhook_headers(message_id: str, timestamp_s: int, body: bytes, secret: str) -> dict[str, str]:
    signed = f"{message_id}.{timestamp_s}.".encode() + body
    digest = hmac.new(webhook_secret_bytes(secret), signed, hashlib.sha256).digest()
    return {"webhook-id": message_id, "webhook-timestamp": str(timestamp_s),
            "webhook-signature": "v1," + base64.b64encode(digest).decode()}


def verify_standard_webhook(headers: dict[str, str], body: bytes, secret: str, now: datetime,
                            tolerance: timedelta = timedelta(minutes=5)) -> str | None:
    """None when the request is signed with ``secret`` within ``tolerance`` of ``now``; else why not. (What a
    receiver runs; here for the tests and for users writing one.)"""
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        ident, stamp, signatures = lower["webhook-id"], int(lower["webhook-timestamp"]), lower["webhook-signature"]
    except (KeyError, ValueError):
        return "missing or malformed webhook-id, webhook-timestamp or webhook-signature"
    if abs(now.timestamp() - stamp) > tolerance.total_seconds():
        return f"timestamp {stamp} is outside the {tolerance.total_seconds():g} s window"
    expected = standard_webhook_headers(ident, stamp, body, secret)["webhook-signature"]
    if any(hmac.compare_digest(s, expected) for s in signatures.split(" ")):
        return None
    return "no signature matches"


@dataclass(frozen=True)
class RetryPolicy:
    base: timedelta = timedelta(seconds=1)
    max_backoff: timedelta = timedelta(seconds=60)
    give_up_after: timedelta = timedelta(hours=1)


def retry_delay(status: int | None, retry_after: str | None, attempt: int, first_tried: datetime, now: datetime,
                policy: RetryPolicy) -> tuple[timedelta | None, str]:
    """After attempt ``attempt`` (1 for the first) failed with ``status`` (None: no answer: a connection error or
    a timeout): how long to wait before the next one, or None to give up; and why."""
    if status is not None and status not in RETRY_STATUSES and not 500 <= status <= 599:
        return None, f"HTTP {status}: the receiver refused the request; it would refuse it again"
    wait = min(policy.max_backoff, policy.base * (2 ** min(attempt - 1, 30)))
    why = f"{'no answer' if status is None else f'HTTP {status}'}: back-off {wait.total_seconds():g} s"
    asked = parse_retry_after(retry_after, now)
    if asked is not None:
        wait = max(asked, timedelta(0))
        why = f"HTTP {status}: Retry-After {wait.total_seconds():g} s"
    if now + wait - first_tried > policy.give_up_after:
        return None, (f"{'no answer' if status is None else f'HTTP {status}'} for "
                      f"{(now - first_tried).total_seconds():.0f} s: gave up after {attempt} attempt(s) "
                      f"(give_up_after {policy.give_up_after.total_seconds():g} s)")
    return wait, why


def parse_retry_after(value: str | None, now: datetime) -> timedelta | None:
    """``Retry-After`` as seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return timedelta(seconds=int(value))
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        return None
    return when - now


class TokenBucket:
    """``rate_per_minute`` deliveries a minute, in bursts of up to ``burst``. ``take(now)``: how long to wait
    before the next delivery (and that delivery's token is taken)."""

    def __init__(self, rate_per_minute: float, burst: int = 5) -> None:
        if rate_per_minute <= 0:
            raise ValueError(f"rate_per_minute must be positive, got {rate_per_minute}")
        self.rate_per_s = rate_per_minute / 60.0
        self.burst = float(max(1, burst))
        self.tokens = self.burst
        self.at: datetime | None = None

    def take(self, now: datetime) -> timedelta:
        if self.at is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.at).total_seconds() * self.rate_per_s)
        self.at = now
        self.tokens -= 1.0
        if self.tokens >= 0:
            return timedelta(0)
        return timedelta(seconds=-self.tokens / self.rate_per_s)
