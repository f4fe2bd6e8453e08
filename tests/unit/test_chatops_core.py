"""Chat-ops approvals' pure core (``keel.notifier.chatops``): Slack's request signature and timestamp window, the
button payload, the approvers' allow-list, the signed generic callback, the replay key, and the Slack message's
buttons (``keel.notifier.core.slack_message``)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from urllib.parse import urlencode

import pytest

from keel.events.envelope import Event
from keel.events.types import ApprovalRequested
from keel.notifier.chatops import (
    APPROVE_ACTION,
    DENY_ACTION,
    Refused,
    answer_id,
    callback_action,
    slack_action,
    slack_signature,
    slack_update,
)
from keel.notifier.core import Destination, notifications, request, standard_webhook_headers

T0 = datetime(2026, 12, 7, 8, 0, tzinfo=UTC)
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"  # the shape of a Slack signing secret (Slack's docs' example)
REQUEST_ID = "7d1c2a4e-6a7e-4d1c-9b7a-6b6565c0de01"
APPROVERS = {"U024BE7LH": "alice"}


def slack_body(action_id: str = APPROVE_ACTION, user: str = "U024BE7LH", value: str = REQUEST_ID,
               kind: str = "block_actions", response_url: str = "https://hooks.slack.com/actions/T1/1/abc") -> bytes:
    payload = {"type": kind, "user": {"id": user, "username": "alice.s", "team_id": "T0001"}, "team": {"id": "T0001"},
               "response_url": response_url,
               "actions": [{"action_id": action_id, "value": value, "type": "button", "action_ts": "1.2"}]}
    return urlencode({"payload": json.dumps(payload)}).encode()


def signed(body: bytes, at: datetime = T0, secret: str = SECRET) -> dict[str, str]:
    stamp = str(int(at.timestamp()))
    return {"X-Slack-Request-Timestamp": stamp, "X-Slack-Signature": slack_signature(secret, stamp, body)}


def press(body: bytes, headers: dict[str, str], now: datetime = T0):
    return slack_action(headers, body, secret=SECRET, approvers=APPROVERS, now=now)


def test_slack_signature_is_slacks_v0_scheme() -> None:
    # Slack's documented example: secret, timestamp and body as in "Verifying requests from Slack".
    body = (b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&"
            b"channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&"
            b"response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&"
            b"trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c")
    assert slack_signature(SECRET, "1531420618", body) == \
        "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"


def test_a_signed_press_by_an_approver_is_an_answer() -> None:
    body = slack_body()
    action = press(body, signed(body), now=T0 + timedelta(seconds=299))
    assert (action.request_id, action.approved, action.approver, action.channel) == (REQUEST_ID, True, "alice", "slack")
    assert action.comment == "via Slack, Slack user U024BE7LH (@alice.s), team T0001"
    assert action.response_url == "https://hooks.slack.com/actions/T1/1/abc"
    denied = slack_body(DENY_ACTION)
    assert press(denied, signed(denied)).approved is False
    # The replay key is the request's signature: the same request gives the same answer id, another a new one.
    again = press(body, signed(body))
    assert again.replay_key == action.replay_key and answer_id(again.replay_key) == answer_id(action.replay_key)
    later = signed(body, T0 + timedelta(seconds=1))
    assert answer_id(press(body, later).replay_key) != answer_id(action.replay_key)


@pytest.mark.parametrize("tamper, status, reason", [
    (lambda b, h: (b + b"x", h), 401, "does not match"),
    (lambda b, h: (b, {**h, "X-Slack-Signature": "v0=" + "0" * 64}), 401, "does not match"),
    (lambda b, h: (b, signed(b, secret="another-secret-of-some-length")), 401, "does not match"),
    (lambda b, h: (b, {"X-Slack-Signature": h["X-Slack-Signature"]}), 401, "missing"),
    (lambda b, h: (b, {**h, "X-Slack-Request-Timestamp": "soon"}), 401, "not Unix seconds"),
    (lambda b, h: (b, signed(b, T0 - timedelta(seconds=301))), 401, "outside the 300 s window"),
    (lambda b, h: (b, signed(b, T0 + timedelta(minutes=10))), 401, "outside the 300 s window"),
])
def test_a_request_not_signed_now_with_the_secret_is_refused(tamper, status, reason) -> None:
    body = slack_body()
    body, headers = tamper(body, signed(body))
    with pytest.raises(Refused) as refused:
        press(body, headers)
    assert refused.value.status == status and reason in refused.value.reason


def test_without_a_signing_secret_everything_is_refused() -> None:
    body = slack_body()
    with pytest.raises(Refused) as refused:
        slack_action(signed(body), body, secret="", approvers=APPROVERS, now=T0)
    assert refused.value.status == 503


@pytest.mark.parametrize("body, status, reason", [
    (slack_body(user="U0NOTALLOW"), 403, "Slack user U0NOTALLOW (@alice.s) is not an approver"),
    (slack_body(action_id="something_else"), 422, "unknown action"),
    (slack_body(value="not-a-uuid"), 422, "not an approval request id"),
    (slack_body(kind="view_submission"), 422, "only block_actions"),
    (slack_body(user="alice"), 422, "no Slack user id"),
    (b"payload=%7Bnot-json", 422, "not a Slack interaction"),
    (b"text=hello", 422, "not a Slack interaction"),
])
def test_a_signed_press_that_cannot_be_an_approvers_answer_is_refused(body: bytes, status: int, reason: str) -> None:
    with pytest.raises(Refused) as refused:
        press(body, signed(body))
    assert refused.value.status == status and reason in refused.value.reason


def test_an_update_goes_only_to_slacks_response_url() -> None:
    body = slack_body(response_url="http://169.254.169.254/latest/meta-data")
    assert press(body, signed(body)).response_url == ""
    assert json.loads(slack_update("done", replace=True))["replace_original"] is True
    note = json.loads(slack_update("no", replace=False))
    assert note["response_type"] == "ephemeral" and note["replace_original"] is False


CALLBACK_SECRET = "whsec_" + "c2VjcmV0LW9mLXRoZS1wYWdlci10b29sLTMyYnl0ZXM="


def callback(body: dict[str, object], ident: str = "msg_1", at: datetime = T0, secret: str = CALLBACK_SECRET,
             now: datetime = T0):
    raw = json.dumps(body).encode()
    headers = standard_webhook_headers(ident, int(at.timestamp()), raw, secret)
    return callback_action(headers, raw, name="pager", secret=CALLBACK_SECRET, approvers=frozenset({"bob"}), now=now)


def test_a_signed_callback_answers_as_one_of_its_approvers() -> None:
    action = callback({"request_id": REQUEST_ID, "decision": "deny", "approver": "bob", "comment": "not now"})
    assert (action.request_id, action.approved, action.approver, action.channel) == (REQUEST_ID, False, "bob",
                                                                                      "webhook:pager")
    assert action.comment == "via callback pager: not now" and action.replay_key == "webhook:pager:msg_1"
    assert callback({"request_id": REQUEST_ID, "decision": "approve", "approver": "bob"}).approved is True


@pytest.mark.parametrize("kwargs, status, reason", [
    ({"body": {"request_id": REQUEST_ID, "decision": "approve", "approver": "mallory"}}, 403, "may not answer as"),
    ({"body": {"request_id": REQUEST_ID, "decision": "maybe", "approver": "bob"}}, 422, "decision"),
    ({"body": {"request_id": "x", "decision": "approve", "approver": "bob"}}, 422, "request_id"),
    ({"body": {"request_id": REQUEST_ID, "decision": "approve", "approver": "bob"}, "secret": "whsec_d3Jvbmc="},
     401, "no signature matches"),
    ({"body": {"request_id": REQUEST_ID, "decision": "approve", "approver": "bob"},
      "at": T0 - timedelta(minutes=6)}, 401, "outside"),
])
def test_a_callback_not_signed_or_not_allowed_is_refused(kwargs: dict, status: int, reason: str) -> None:
    with pytest.raises(Refused) as refused:
        callback(**kwargs)
    assert refused.value.status == status and reason in refused.value.reason


def test_the_approval_message_carries_buttons_only_where_configured() -> None:
    asked = Event.create(ApprovalRequested(incident_id=str(uuid.uuid4()), action="evict", reason="evict n2",
                                           expires_at=T0 + timedelta(minutes=15)),
                         job_id="job1", subject="job/job1", producer="controller", occurred_at=T0)
    [note] = notifications(asked)
    plain = Destination(name="s", kind="slack", url="http://127.0.0.1:9/s")
    interactive = Destination(name="s", kind="slack", url="http://127.0.0.1:9/s", approval_buttons=True)
    assert not [b for b in json.loads(request(note, plain, T0).body)["blocks"] if b["type"] == "actions"]
    [actions] = [b for b in json.loads(request(note, interactive, T0).body)["blocks"] if b["type"] == "actions"]
    assert [(e["action_id"], e["value"]) for e in actions["elements"]] == [(APPROVE_ACTION, str(asked.id)),
                                                                          (DENY_ACTION, str(asked.id))]


def test_a_strangers_refusal_keeps_slacks_url_to_tell_them_why() -> None:
    body = slack_body(user="U0NOTALLOW")
    with pytest.raises(Refused) as refused:
        press(body, signed(body))
    assert refused.value.response_url == "https://hooks.slack.com/actions/T1/1/abc"
    forged = slack_body(user="U0NOTALLOW")
    with pytest.raises(Refused) as unsigned:
        press(forged, {**signed(forged), "X-Slack-Signature": "v0=" + "1" * 64})
    assert unsigned.value.response_url == ""  # nothing from an unverified body is used
