"""The notifier's pure core: which events become notifications, where they go, their wire formats (Slack Block Kit,
PagerDuty Events API v2, Standard Webhooks signatures), when a failed delivery is tried again, the rate limit."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from keel.events.envelope import Event
from keel.events.types import ApprovalRequested, IncidentOpened, IncidentResolved, JobStopDecided, NodeHeartbeat
from keel.notifier.core import (
    Destination,
    RetryPolicy,
    TokenBucket,
    delivery_id,
    notifications,
    parse_retry_after,
    request,
    retry_delay,
    route,
    verify_standard_webhook,
)

T0 = datetime(2026, 12, 6, 7, 0, tzinfo=UTC)
SECRET = "whsec_" + base64.b64encode(b"a-signing-secret-of-32-bytes!!!!").decode()


def opened(kind: str = "hang") -> Event:
    return Event.create(IncidentOpened(kind=kind, node_id="n3", generation=2, last_step=41, reason="rank 5 stuck"),  # type: ignore[arg-type]
                        job_id="job1", subject="job/job1", producer="controller", occurred_at=T0)


def resolved(incident: Event, outcome: str = "recovered") -> Event:
    return Event.create(IncidentResolved(incident_id=str(incident.id), outcome=outcome, rung=3, generation=3,  # type: ignore[arg-type]
                                         reason="stepping again"), job_id="job1", subject="job/job1",
                        producer="controller", occurred_at=T0 + timedelta(seconds=30), correlation_id=incident.id)


def dest(kind: str, **kwargs: object) -> Destination:
    secret = {"pagerduty": "R0UTINGKEY", "webhook": SECRET}.get(kind, "")
    return Destination(name=f"{kind}-1", kind=kind, url=f"http://127.0.0.1:9/{kind}", secret=secret, **kwargs)  # type: ignore[arg-type]


def test_only_what_people_must_hear_about_becomes_a_notification() -> None:
    incident = opened()
    [n] = notifications(incident)
    assert (n.kind, n.severity, n.action, n.incident_id) == ("incident_opened", "warning", "trigger", str(incident.id))
    assert n.title == "[job1] hang incident on n3" and n.text == "rank 5 stuck" and n.fields["last step"] == "41"
    [done] = notifications(resolved(incident))
    assert (done.kind, done.severity, done.action, done.incident_id) == ("incident_resolved", "info", "resolve",
                                                                       str(incident.id))
    [stopped] = notifications(resolved(incident, "stopped"))
    assert stopped.action == "trigger" and stopped.severity == "warning"  # a stop clears nothing
    stop = Event.create(JobStopDecided(incident_id=str(incident.id), rung=6, reason="crash loop"), job_id="job1",
                        subject="job/job1", producer="controller", occurred_at=T0)
    assert notifications(stop)[0].severity == "critical"
    approval = Event.create(ApprovalRequested(incident_id="i", action="evict", reason="evict n3",
                                              expires_at=T0 + timedelta(minutes=10)),
                            job_id="job1", subject="job/job1", producer="controller", occurred_at=T0)
    [ask] = notifications(approval)
    assert f"keel approve {approval.id}" in ask.text and ask.fields["expires"] == "2026-12-06T07:10:00+00:00"
    beat = Event.create(NodeHeartbeat(node_id="n1", ranks_alive=1, ranks_expected=1, last_step=3), job_id="job1",
                        subject="node/n1", producer="agent", occurred_at=T0)
    assert notifications(beat) == []


def test_routing_by_severity_kind_and_job_and_pagerduty_always_gets_its_resolve() -> None:
    incident = opened()
    [n] = notifications(incident)
    [done] = notifications(resolved(incident))
    critical_only = dest("pagerduty", min_severity="critical")
    slack = dest("slack")
    info = dest("webhook", min_severity="info", kinds=("incident_resolved",))
    other_job = Destination("elsewhere", "slack", "http://x", jobs=("job2",))
    assert route(n, [critical_only, slack, info, other_job]) == [slack]
    assert route(done, [critical_only, slack, info, other_job]) == [critical_only, slack, info]


def test_slack_message_has_blocks_and_a_text_fallback() -> None:
    [n] = notifications(opened())
    body = json.loads(request(n, dest("slack"), T0).body)
    assert body["text"].startswith("[job1] hang incident on n3: rank 5 stuck")
    assert body["blocks"][0] == {"type": "header", "text": {"type": "plain_text", "text": "[job1] hang incident on n3"}}
    assert any(f["text"] == "*node*\nn3" for f in body["blocks"][2]["fields"])


def test_pagerduty_trigger_and_resolve_share_the_incidents_dedup_key() -> None:
    incident = opened()
    [n] = notifications(incident)
    [done] = notifications(resolved(incident))
    trigger = json.loads(request(n, dest("pagerduty"), T0).body)
    resolve = json.loads(request(done, dest("pagerduty"), T0).body)
    assert trigger["event_action"] == "trigger" and resolve["event_action"] == "resolve"
    assert trigger["dedup_key"] == resolve["dedup_key"] == str(incident.id)
    assert trigger["routing_key"] == "R0UTINGKEY" and trigger["payload"]["severity"] == "warning"
    assert trigger["payload"]["source"] == "keel/job1" and set(resolve) == {"routing_key", "event_action", "dedup_key"}


def test_webhooks_are_signed_per_standard_webhooks_and_the_verifier_refuses_tampering() -> None:
    [n] = notifications(opened())
    d = dest("webhook")
    req = request(n, d, T0)
    assert req.headers["webhook-id"] == delivery_id(n, d) == request(n, d, T0 + timedelta(hours=1)).delivery_id
    # The spec's construction, by hand: base64(HMAC-SHA256(key, "id.timestamp.body")) with the key base64-decoded.
    key = base64.b64decode(SECRET.removeprefix("whsec_"))
    expected = base64.b64encode(hmac.new(key, f"{req.delivery_id}.{int(T0.timestamp())}.".encode() + req.body,
                                         hashlib.sha256).digest()).decode()
    assert req.headers["webhook-signature"] == f"v1,{expected}"
    assert verify_standard_webhook(req.headers, req.body, SECRET, T0 + timedelta(seconds=30)) is None
    assert verify_standard_webhook(req.headers, req.body + b" ", SECRET, T0) == "no signature matches"
    assert "outside" in (verify_standard_webhook(req.headers, req.body, SECRET, T0 + timedelta(minutes=6)) or "")
    assert verify_standard_webhook(req.headers, req.body, "whsec_" + base64.b64encode(b"other").decode(), T0)
    assert json.loads(req.body)["type"] == "keel.incident_opened"


@pytest.mark.parametrize(("status", "retry_after", "attempt", "expected_s"), [
    (None, None, 1, 1.0),  # no answer: back-off 1, 2, 4 ... s
    (503, None, 3, 4.0),
    (500, None, 12, 60.0),  # capped
    (429, "7", 1, 7.0),  # Retry-After in seconds
    (503, "Sun, 06 Dec 2026 07:00:20 GMT", 1, 20.0),  # or as an HTTP date
    (408, "soon", 2, 2.0),  # unreadable: the back-off
])
def test_what_is_retried_and_when(status: int | None, retry_after: str | None, attempt: int, expected_s: float) -> None:
    wait, _ = retry_delay(status, retry_after, attempt, T0, T0, RetryPolicy())
    assert wait == timedelta(seconds=expected_s)


def test_a_refusal_is_not_retried_and_a_delivery_gives_up_after_its_window() -> None:
    for status in (400, 401, 403, 404, 410):
        wait, why = retry_delay(status, None, 1, T0, T0, RetryPolicy())
        assert wait is None and f"HTTP {status}" in why
    wait, why = retry_delay(503, None, 40, T0, T0 + timedelta(minutes=59, seconds=30), RetryPolicy())
    assert wait is None and "gave up after 40 attempt(s)" in why
    assert parse_retry_after(None, T0) is None


def test_the_rate_limit_spaces_deliveries_after_a_burst() -> None:
    bucket = TokenBucket(rate_per_minute=60, burst=2)
    assert [bucket.take(T0) for _ in range(2)] == [timedelta(0), timedelta(0)]
    assert bucket.take(T0) == timedelta(seconds=1)
    assert bucket.take(T0 + timedelta(seconds=1)) == timedelta(seconds=1)  # the one waiting took that second's token
    assert TokenBucket(60, burst=2).take(T0 + timedelta(hours=1)) == timedelta(0)
    with pytest.raises(ValueError):
        TokenBucket(0)
    assert uuid.UUID(delivery_id(notifications(opened())[0], dest("slack")).removeprefix("msg_"))
