"""The notifier against real local HTTP receivers, over a real NATS JetStream and the recorder: Slack, PagerDuty and a
Standard Webhooks receiver that checks every signature. One receiver fails for a while (503 with Retry-After, then
resets connections), one answers too slowly at first, one refuses for good (401); nothing is lost but what was
refused, each delivery ends in a ``NotificationSent`` in the log, and no secret reaches the log or the events."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from keel.events.envelope import Event, now_utc
from keel.events.types import ApprovalRequested, IncidentOpened, IncidentResolved, JobStopDecided
from keel.infra.config import NotifierDestinationSettings, NotifierSettings
from keel.notifier.adapter import NotifierConfigError, NotifierService, destinations_from_settings
from keel.notifier.core import verify_standard_webhook
from tests.integration.test_actuator import wait_events

pytestmark = pytest.mark.integration

WEBHOOK_SECRET = "whsec_" + base64.b64encode(b"notifier-test-secret-0123456789!").decode()
ROUTING_KEY = "R0UTING-KEY-0123456789abcdef"
SLACK_TOKEN_PATH = "/services/T000/B000/slack-secret-path"


class Receiver:
    """A local HTTP server that records what it is sent, answering as its ``script`` says: a list of
    (status, headers, delay_s) consumed one per request, then 200. Status 0 resets the connection."""

    def __init__(self, name: str, script: list[tuple[int, dict[str, str], float]] | None = None,
                 verify_secret: str | None = None) -> None:
        self.name, self.script, self.verify_secret = name, list(script or []), verify_secret
        self.received: list[dict] = []  # type: ignore[type-arg]
        self.refused_signatures: list[str] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver.lock:
                    status, headers, delay_s = receiver.script.pop(0) if receiver.script else (200, {}, 0.0)
                if delay_s:
                    time.sleep(delay_s)
                if status == 0:
                    self.connection.shutdown(2)  # a reset: no answer at all
                    return
                if status == 200:
                    problem = None
                    if receiver.verify_secret is not None:
                        problem = verify_standard_webhook(dict(self.headers.items()), body, receiver.verify_secret,
                                                          now_utc())
                    if problem:
                        receiver.refused_signatures.append(problem)
                        status = 401
                    else:
                        with receiver.lock:
                            receiver.received.append({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()},
                                                      "body": json.loads(body), "at": time.monotonic()})
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[dict[str, Receiver]]:
    made = {
        "slack": Receiver("slack", [(0, {}, 2.5)]),  # the first answer comes after the 1 s timeout
        "pagerduty": Receiver("pagerduty"),
        # Fails for a while: 503 with Retry-After 1 twice, a reset, a 500 without Retry-After; then accepts.
        "webhook": Receiver("webhook", [(503, {"Retry-After": "1"}, 0.0), (503, {"Retry-After": "1"}, 0.0),
                                        (0, {}, 0.0), (500, {}, 0.0)], verify_secret=WEBHOOK_SECRET),
        "refusing": Receiver("refusing", verify_secret=WEBHOOK_SECRET),  # the destination signs with another key
    }
    yield made
    for receiver in made.values():
        receiver.close()


def secret_file(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    path.chmod(0o600)
    return path


def settings_for(receivers: dict[str, Receiver], folder: Path) -> NotifierSettings:
    return NotifierSettings(
        request_timeout=timedelta(seconds=1), retry_base=timedelta(milliseconds=200),
        retry_max_backoff=timedelta(seconds=2), give_up_after=timedelta(seconds=60),
        destinations=[
            NotifierDestinationSettings(name="team-slack", kind="slack", url_file=secret_file(
                folder, "slack.url", receivers["slack"].url + SLACK_TOKEN_PATH)),
            NotifierDestinationSettings(name="oncall-pd", kind="pagerduty", url=receivers["pagerduty"].url + "/v2/enqueue",
                                        secret_file=secret_file(folder, "pd.key", ROUTING_KEY)),
            NotifierDestinationSettings(name="audit-hook", kind="webhook", url=receivers["webhook"].url + "/keel",
                                        secret_file=secret_file(folder, "hook.secret", WEBHOOK_SECRET),
                                        min_severity="info"),
            NotifierDestinationSettings(name="wrong-key", kind="webhook", url=receivers["refusing"].url,
                                        secret_file=secret_file(folder, "wrong.secret", "whsec_" + base64.b64encode(
                                            b"not the receiver's secret").decode()), kinds=["job_stopped"]),
        ])


async def test_notifications_reach_every_receiver_through_failures_signed_and_logged(
        keel_env, scratch_dir: Path, receivers: dict[str, Receiver], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    await keel_env.start_recorder()
    settings = settings_for(receivers, scratch_dir)
    service = NotifierService(keel_env.bus, destinations_from_settings(settings), settings)
    await service.start()
    stop = asyncio.Event()
    keel_env.stops.append(stop)
    keel_env.tasks.append(asyncio.create_task(service.run(stop)))

    now = now_utc()
    incident = Event.create(IncidentOpened(kind="hang", node_id="n3", generation=1, last_step=40, reason="rank 5 stuck"),
                            job_id="job1", subject="job/job1", producer="controller", occurred_at=now)
    approval = Event.create(ApprovalRequested(incident_id=str(incident.id), action="evict", reason="evict n3",
                                              expires_at=now + timedelta(minutes=10)),
                            job_id="job1", subject="job/job1", producer="controller", occurred_at=now,
                            correlation_id=incident.id)
    resolved = Event.create(IncidentResolved(incident_id=str(incident.id), outcome="recovered", rung=3, generation=2,
                                             reason="stepping again"), job_id="job1", subject="job/job1",
                            producer="controller", occurred_at=now, correlation_id=incident.id)
    stopped = Event.create(JobStopDecided(incident_id=str(incident.id), rung=6, reason="crash loop"), job_id="job1",
                           subject="job/job1", producer="controller", occurred_at=now, correlation_id=incident.id)
    for event in (incident, approval, resolved, stopped):
        await keel_env.bus.publish(event)

    # Incident, approval, stop and the incident's resolution (it goes wherever the incident went) to Slack,
    # PagerDuty and the webhook; the stop alone to the receiver with the wrong key.
    expected = {"team-slack": 4, "oncall-pd": 4, "audit-hook": 4, "wrong-key": 1}
    log = await wait_events(keel_env, "job1", ["NotificationSent"], sum(expected.values()), 90)
    by_destination: dict[str, list] = {}  # type: ignore[type-arg]
    for event in log:
        by_destination.setdefault(event.payload.destination, []).append(event.payload)
    assert {k: len(v) for k, v in by_destination.items()} == expected
    assert all(p.outcome == "delivered" for name in ("team-slack", "oncall-pd", "audit-hook")
               for p in by_destination[name]), [p for p in log]
    [refused] = by_destination["wrong-key"]
    assert refused.outcome == "failed" and refused.status == 401 and refused.attempts == 1  # a refusal is not retried
    assert receivers["refusing"].refused_signatures == ["no signature matches"]

    # Through 503s with Retry-After, a reset and a 500, the webhook got all four, each signature checked.
    hook = receivers["webhook"]
    assert sorted(r["body"]["type"] for r in hook.received) == ["keel.approval_requested", "keel.incident_opened",
                                                                 "keel.incident_resolved", "keel.job_stopped"]
    assert hook.refused_signatures == []
    assert max(p.attempts for p in by_destination["audit-hook"]) >= 2
    assert {r["headers"]["webhook-id"] for r in hook.received} == {p.delivery_id for p in by_destination["audit-hook"]}
    # Slack's first answer came too late: tried again, delivered once per notification (no loss).
    slack = receivers["slack"]
    assert sorted(r["body"]["blocks"][0]["text"]["text"] for r in slack.received) == [
        "[job1] approval needed: evict", "[job1] hang incident on n3", "[job1] incident recovered at rung 3",
        "[job1] job stopped at rung 6: a human is needed"]
    assert all(r["path"] == SLACK_TOKEN_PATH for r in slack.received)
    # PagerDuty: one alert for the incident, triggered, resolved, triggered again by the stop.
    pd = receivers["pagerduty"]
    actions = [r["body"]["event_action"] for r in pd.received]
    assert sorted(actions) == ["resolve", "trigger", "trigger", "trigger"]
    assert {r["body"]["dedup_key"] for r in pd.received} == {str(incident.id)}
    assert all(r["body"]["routing_key"] == ROUTING_KEY for r in pd.received)
    # The delivery log is correlated with the incident and caused by what it told about.
    assert all(e.correlation_id == incident.id for e in log)
    assert {e.causation_id for e in log} == {incident.id, approval.id, resolved.id, stopped.id}
    # No secret in the service's log or in the events.
    logged = caplog.text + json.dumps([e.payload.model_dump(mode="json") for e in log])
    for secret in (SLACK_TOKEN_PATH, ROUTING_KEY, WEBHOOK_SECRET.removeprefix("whsec_")):
        assert secret not in logged


def test_a_destination_whose_secret_file_is_unusable_stops_the_start_naming_it(scratch_dir: Path) -> None:
    loose = scratch_dir / "loose.secret"
    loose.write_text(WEBHOOK_SECRET)
    loose.chmod(0o644)
    for path, why in ((scratch_dir / "missing.secret", "does not exist"), (loose, "has mode 0644")):
        settings = NotifierSettings(destinations=[NotifierDestinationSettings(
            name="hook", kind="webhook", url="http://127.0.0.1:9", secret_file=path)])
        with pytest.raises(NotifierConfigError, match="notifier destination hook: ") as caught:
            destinations_from_settings(settings)
        assert why in str(caught.value)
