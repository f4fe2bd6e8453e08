"""Chat-ops approvals end to end: the real API (``keel-api``, two processes) with ``api.chatops`` configured, over a
real store and a real NATS JetStream with the recorder. A Slack-signed button press leads to an ``ApprovalGiven``
signed by the API's chatops key, which the recorder records and the controller's signature check accepts, and on
which the controller's decider carries the held eviction out. The same press replayed is refused (409) and
publishes nothing; so are a stale timestamp, a stranger's press, an unknown request and a press on an answered
request. A signed generic callback denies another request. Slack's message is updated through ``response_url``."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from keel.controller.policy import ControllerPolicy
from keel.events.envelope import Event, now_utc
from keel.events.types import ApprovalRequested
from keel.infra.signing import consumer_signing
from keel.infra.store import append_events, event_row
from keel.notifier.chatops import APPROVE_ACTION, slack_signature
from keel.notifier.core import standard_webhook_headers
from tests.integration.test_agent_rejoin import stop_process
from tests.integration.test_api import start_api
from tests.unit.test_controller import Job, of

pytestmark = pytest.mark.integration

SLACK_SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
CALLBACK_SECRET = "whsec_c2VjcmV0LW9mLXRoZS1wYWdlci10b29sLTMyYnl0ZXM="
ALICE_SLACK = "U024BE7LH"


class SlackResponses:
    """Stands in for Slack's ``response_url``: keeps what the API posts there."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                outer.received.append({"path": self.path, **json.loads(body)})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def slack_responses() -> Iterator[SlackResponses]:
    responses = SlackResponses()
    yield responses
    responses.close()


def press_body(request_id: str, user: str, response_url: str) -> bytes:
    payload = {"type": "block_actions", "user": {"id": user, "username": "alice"}, "team": {"id": "T0001"},
               "response_url": response_url,
               "actions": [{"action_id": APPROVE_ACTION, "value": request_id, "type": "button"}]}
    return urlencode({"payload": json.dumps(payload)}).encode()


def slack_headers(body: bytes, at: float | None = None) -> dict[str, str]:
    stamp = str(int(time.time() if at is None else at))
    return {"Content-Type": "application/x-www-form-urlencoded", "X-Slack-Request-Timestamp": stamp,
            "X-Slack-Signature": slack_signature(SLACK_SECRET, stamp, body)}


def post(base: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(base + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def recorded_answers(keel_env, count: int, timeout_s: float = 20.0) -> list[Event]:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        answers = [r.event async for r in keel_env.store.read(types=["ApprovalGiven"])]
        if len(answers) >= count or time.monotonic() > deadline:
            return answers
        await asyncio.sleep(0.1)


async def test_a_slack_press_approves_the_held_eviction_once_and_a_replay_is_refused(
        keel_env, scratch_dir: Path, slack_responses: SlackResponses) -> None:
    # The controller's decider holds an eviction for approval (the request expires in a day: the API's clock is real).
    job = Job(policy=ControllerPolicy(approval_required=frozenset({"evict"}), approval_ttl=timedelta(days=3650)))
    [request] = of(job.health("n2"), "ApprovalRequested")
    assert not of(job.log, "NodeEvictionDecided")
    # Another request, for the callback to deny (the decider waits on one action at a time).
    second = Event.create(ApprovalRequested(incident_id=str(request.payload.incident_id), action="restart",
                                            reason="restart after n3", expires_at=now_utc() + timedelta(hours=1)),
                          job_id=request.job_id, subject=request.subject, producer="controller", occurred_at=now_utc(),
                          correlation_id=request.correlation_id)
    async with keel_env.engine.begin() as conn:
        await append_events(conn, [event_row(event, None) for event in [*job.log, second]])
    await keel_env.start_recorder()

    secrets = scratch_dir / "secrets"
    secrets.mkdir(mode=0o700)
    (secrets / "slack").write_text(SLACK_SECRET + "\n")
    (secrets / "pager").write_text(CALLBACK_SECRET)
    for name in ("slack", "pager"):
        (secrets / name).chmod(0o600)
    process, base = await asyncio.to_thread(start_api, keel_env, scratch_dir, extra_env={
        "KEEL_API__WORKERS": "2",
        "KEEL_API__CHATOPS__SLACK_SIGNING_SECRET_FILE": str(secrets / "slack"),
        "KEEL_API__CHATOPS__SLACK_APPROVERS": json.dumps({ALICE_SLACK: "alice"}),
        "KEEL_API__CHATOPS__SLACK_RESPONSE_URL_PREFIX": slack_responses.url,
        "KEEL_API__CHATOPS__CALLBACKS": json.dumps([{"name": "pager", "secret_file": str(secrets / "pager"),
                                                     "approvers": ["bob"]}]),
    })
    try:
        body = press_body(str(request.id), ALICE_SLACK, slack_responses.url + "actions/1")
        headers = slack_headers(body)
        status, answer = await asyncio.to_thread(post, base, "/v1/chatops/slack", body, headers)
        assert status == 200, answer
        assert (answer["outcome"], answer["by"], answer["channel"]) == ("approved", "alice", "slack")

        [given] = await recorded_answers(keel_env, 1)  # recorded: the recorder checked its signature first
        assert str(given.id) == answer["event_id"]
        assert given.payload.model_dump() == {"request_id": str(request.id), "approved": True, "by": "alice",
                                              "comment": "via Slack, Slack user U024BE7LH (@alice), team T0001"}
        assert (given.producer, given.signed_by, given.causation_id) == ("chatops-slack", "chatops", request.id)
        verdict = consumer_signing(keel_env.settings).check(given)  # what the controller's consumer loop runs
        assert verdict.ok and "chatops" in verdict.reason, verdict.reason
        # The controller's decider takes it as it would from `keel approve`: the held eviction is carried out.
        out = job.session.observe(given).emitted
        assert [e.payload.node_id for e in of(out, "NodeEvictionDecided")] == ["n2"]

        # The same request again, to either API process (each answers on its own): refused, nothing published.
        for _ in range(2):
            status, replay = await asyncio.to_thread(post, base, "/v1/chatops/slack", body, headers)
            assert status == 409 and "replayed" in replay["detail"], replay
        # A fresh press on the answered request: refused as answered.
        fresh = slack_headers(body, time.time() + 1)
        status, again = await asyncio.to_thread(post, base, "/v1/chatops/slack", body, fresh)
        assert status == 409 and "already approved by alice" in again["detail"], again
        # Stale, forged, a stranger's, an unknown request: refused, each with its reason.
        stale = slack_headers(body, time.time() - 400)
        assert (await asyncio.to_thread(post, base, "/v1/chatops/slack", body, stale))[0] == 401
        forged = {**headers, "X-Slack-Signature": "v0=" + "0" * 64}
        assert (await asyncio.to_thread(post, base, "/v1/chatops/slack", body, forged))[0] == 401
        stranger = press_body(str(second.id), "U0STRANGER", slack_responses.url + "actions/2")
        status, refused = await asyncio.to_thread(post, base, "/v1/chatops/slack", stranger, slack_headers(stranger))
        assert status == 403 and "not an approver" in refused["detail"]
        unknown = press_body("00000000-0000-4000-8000-000000000000", ALICE_SLACK, slack_responses.url)
        assert (await asyncio.to_thread(post, base, "/v1/chatops/slack", unknown, slack_headers(unknown)))[0] == 404

        # A signed generic callback denies the second request, as bob.
        doc = json.dumps({"request_id": str(second.id), "decision": "deny", "approver": "bob",
                          "comment": "n3 is being repaired"}).encode()
        signed = {"Content-Type": "application/json",
                  **standard_webhook_headers("msg_42", int(time.time()), doc, CALLBACK_SECRET)}
        status, denied = await asyncio.to_thread(post, base, "/v1/chatops/callback/pager", doc, signed)
        assert status == 200 and (denied["outcome"], denied["by"]) == ("denied", "bob"), denied
        status, replay = await asyncio.to_thread(post, base, "/v1/chatops/callback/pager", doc, signed)
        assert status == 409 and "replayed" in replay["detail"]
        badly = {**signed, "webhook-signature": "v1,AAAA"}
        assert (await asyncio.to_thread(post, base, "/v1/chatops/callback/pager", doc, badly))[0] == 401

        answers = await recorded_answers(keel_env, 3, timeout_s=2.0)
        assert [(a.payload.by, a.payload.approved, a.producer) for a in answers] == [
            ("alice", True, "chatops-slack"), ("bob", False, "chatops-webhook")]

        # Slack heard the outcome: the buttons replaced by who approved, then each refused press told to the
        # presser alone (the replays, the press on the answered request, the stranger's).
        deadline = time.monotonic() + 10
        while len(slack_responses.received) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        first = [r for r in slack_responses.received if r["path"] == "/actions/1"]
        assert [r["replace_original"] for r in first] == [True, False, False, False]
        assert "approved* by alice" in first[0]["text"] and all(r["response_type"] == "ephemeral" for r in first[1:])
        [stranger_told] = [r for r in slack_responses.received if r["path"] == "/actions/2"]
        assert stranger_told["response_type"] == "ephemeral" and "not an approver" in stranger_told["text"]
    finally:
        await asyncio.to_thread(stop_process, process)
