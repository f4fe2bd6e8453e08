"""Chat-ops approvals: a held action approved or denied from Slack's buttons or a signed callback (pure: no I/O,
no clock; the caller passes the time).

Two ways in, each authenticated by a shared secret before anything in the body is read:

- **Slack interactivity** (``slack_*``): Slack POSTs ``application/x-www-form-urlencoded`` with ``payload=<JSON>``
  when someone presses a button of the ``approval_requested`` message (``approval_buttons``), signed with the
  Slack app's signing secret: ``X-Slack-Signature: v0=<hex HMAC-SHA256 of "v0:<timestamp>:<raw body>">`` and
  ``X-Slack-Request-Timestamp`` (Unix seconds). ``verify_slack`` checks both, the timestamp within a window.
  The presser's Slack user id must be in the allow-list (``approvers``: Slack user id -> operator name).
- **A generic callback** (``callback_*``): a JSON body ``{"request_id", "decision": "approve"|"deny",
  "approver", "comment"?}`` signed per Standard Webhooks (``webhook-id``, ``webhook-timestamp``,
  ``webhook-signature``; ``keel.notifier.core.verify_standard_webhook``) with the callback's secret; its
  ``approver`` must be one the callback may name.

``replay_key`` is what identifies one request (Slack: its signature; a callback: its ``webhook-id``): the
``ApprovalGiven`` it leads to has an id derived from it (``answer_id``), so the same request seen again, by this
process or another, after a restart or not, names an event the log (or JetStream's deduplication) already holds
and is refused as a replay. Whether the request is known, still open and not yet answered is the event store's
(``keel.reports.incidents.find_open_request``); the adapter asks it.

Every refusal is a ``Refused`` with an HTTP status and the reason, and nothing is published.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import parse_qs

from keel.notifier.core import APPROVE_ACTION, DENY_ACTION, approval_buttons, verify_standard_webhook

SLACK_SIGNATURE_HEADER = "x-slack-signature"
SLACK_TIMESTAMP_HEADER = "x-slack-request-timestamp"
DEFAULT_TOLERANCE = timedelta(minutes=5)
MAX_BODY_BYTES = 64 * 1024
"""The largest request body read (Slack's block_actions payloads are a few KB)."""
SLACK_USER_ID = re.compile(r"^[UW][A-Z0-9]{2,20}$")
"""A Slack user id (``U...``, or ``W...`` on Enterprise Grid)."""
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_NAMESPACE = uuid.UUID("0f6f3d0a-6c55-4b8e-9d0b-2a3f1c7e5d21")


class Refused(Exception):
    """A chat-ops request that publishes nothing: ``status`` is the HTTP answer, the message the reason."""

    def __init__(self, status: int, reason: str, response_url: str = "") -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.response_url = response_url
        """A verified Slack request's ``response_url`` (allowed by the prefix), to tell the presser why; else ''."""


@dataclass(frozen=True)
class ApprovalAction:
    """One verified, parsed answer to an approval request, before the store says whether it is still open."""

    request_id: str
    approved: bool
    approver: str
    """The operator name the answer is recorded under (``ApprovalGiven.by``)."""
    channel: str
    """``slack`` or ``webhook:<callback name>``."""
    comment: str
    """What the log keeps of who pressed what where (``ApprovalGiven.comment``)."""
    replay_key: str
    response_url: str = ""
    """Slack's URL for updating the message (empty for a callback, or one not allowed)."""


def _header(headers: Mapping[str, str], name: str) -> str | None:
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None


def slack_signature(secret: str, timestamp: str, body: bytes) -> str:
    """``v0=`` and the hex HMAC-SHA256 of ``v0:<timestamp>:<body>`` keyed with the Slack app's signing secret."""
    base = b"v0:" + timestamp.encode() + b":" + body
    return "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


def verify_slack(headers: Mapping[str, str], body: bytes, secret: str, now: datetime,
                 tolerance: timedelta = DEFAULT_TOLERANCE) -> str:
    """The request's replay key (its signature) when ``body`` is signed with ``secret`` at a timestamp within
    ``tolerance`` of ``now``; else ``Refused`` (401) with the reason."""
    if not secret:
        raise Refused(503, "chat-ops has no Slack signing secret configured: every Slack request is refused")
    signature, stamp = _header(headers, SLACK_SIGNATURE_HEADER), _header(headers, SLACK_TIMESTAMP_HEADER)
    if not signature or not stamp:
        raise Refused(401, "missing X-Slack-Signature or X-Slack-Request-Timestamp")
    if not stamp.isdigit() or len(stamp) > 12:
        raise Refused(401, f"X-Slack-Request-Timestamp {stamp[:20]!r} is not Unix seconds")
    skew = abs(now.timestamp() - int(stamp))
    if skew > tolerance.total_seconds():
        raise Refused(401, f"X-Slack-Request-Timestamp is {skew:.0f} s from now, outside the "
                           f"{tolerance.total_seconds():g} s window (expired, or replayed)")
    if not hmac.compare_digest(signature.encode(), slack_signature(secret, stamp, body).encode()):
        raise Refused(401, "X-Slack-Signature does not match the body signed with the signing secret")
    return "slack:" + signature


def parse_slack(body: bytes, approvers: Mapping[str, str], response_url_prefix: str) -> tuple[str, bool, str, str, str]:
    """(request id, approved, approver, comment, response URL) of a verified Slack ``block_actions`` body.

    ``approvers`` maps Slack user ids to operator names: a presser not in it is refused (403). The response URL
    is kept only when it starts with ``response_url_prefix`` (an update is never sent anywhere else)."""
    try:
        form = parse_qs(body.decode("utf-8"), strict_parsing=True, max_num_fields=4)
        [raw] = form["payload"]
        payload = json.loads(raw)
    except (UnicodeDecodeError, ValueError, KeyError, json.JSONDecodeError):
        raise Refused(422, "the body is not a Slack interaction (payload=<JSON>, form-encoded)") from None
    if not isinstance(payload, dict) or payload.get("type") != "block_actions":
        kind = payload.get("type") if isinstance(payload, dict) else None
        raise Refused(422, f"a Slack interaction of type {kind!r}: only block_actions (the buttons) are answered")
    actions = payload.get("actions")
    user = payload.get("user")
    if not isinstance(actions, list) or len(actions) != 1 or not isinstance(actions[0], dict) \
            or not isinstance(user, dict):
        raise Refused(422, "a block_actions payload needs one action and the user who pressed it")
    action = actions[0]
    action_id, value = action.get("action_id"), action.get("value")
    if action_id not in (APPROVE_ACTION, DENY_ACTION):
        raise Refused(422, f"unknown action {str(action_id)[:40]!r} ({APPROVE_ACTION} or {DENY_ACTION})")
    if not isinstance(value, str) or not _UUID.match(value):
        raise Refused(422, "the button's value is not an approval request id")
    user_id = user.get("id")
    if not isinstance(user_id, str) or not SLACK_USER_ID.match(user_id):
        raise Refused(422, "the payload names no Slack user id")
    approver = approvers.get(user_id)
    team = payload.get("team") if isinstance(payload.get("team"), dict) else {}
    handle = user.get("username") or user.get("name") or ""
    who = f"Slack user {user_id}" + (f" (@{str(handle)[:64]})" if handle else "")
    url = payload.get("response_url")
    response_url = url if isinstance(url, str) and response_url_prefix and url.startswith(response_url_prefix) else ""
    if approver is None:
        raise Refused(403, f"{who} is not an approver (chat-ops approvers list no such Slack user): nothing was "
                           "published", response_url)
    team_id = team.get("id") if isinstance(team, dict) else None
    comment = f"via Slack, {who}" + (f", team {str(team_id)[:20]}" if team_id else "")
    return value.lower(), action_id == APPROVE_ACTION, approver, comment, response_url


def slack_action(headers: Mapping[str, str], body: bytes, *, secret: str, approvers: Mapping[str, str], now: datetime,
                 tolerance: timedelta = DEFAULT_TOLERANCE,
                 response_url_prefix: str = "https://hooks.slack.com/") -> ApprovalAction:
    """A Slack button press, verified (signature, timestamp window) and parsed; else ``Refused``."""
    if len(body) > MAX_BODY_BYTES:
        raise Refused(413, f"the body is over {MAX_BODY_BYTES} bytes")
    key = verify_slack(headers, body, secret, now, tolerance)
    request_id, approved, approver, comment, url = parse_slack(body, approvers, response_url_prefix)
    return ApprovalAction(request_id, approved, approver, "slack", comment, key, url)


def callback_action(headers: Mapping[str, str], body: bytes, *, name: str, secret: str, approvers: frozenset[str],
                    now: datetime, tolerance: timedelta = DEFAULT_TOLERANCE) -> ApprovalAction:
    """A signed generic callback (Standard Webhooks) from callback ``name``, verified and parsed; else ``Refused``.
    ``approvers``: the operator names this callback may answer as."""
    if len(body) > MAX_BODY_BYTES:
        raise Refused(413, f"the body is over {MAX_BODY_BYTES} bytes")
    if not secret:
        raise Refused(503, f"callback {name!r} has no secret: every request is refused")
    why = verify_standard_webhook(dict(headers), body, secret, now, tolerance)
    if why is not None:
        raise Refused(401, f"callback {name!r}: {why}")
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Refused(422, "the body is not JSON") from None
    if not isinstance(doc, dict):
        raise Refused(422, "the body is not a JSON object")
    request_id, decision, approver = doc.get("request_id"), doc.get("decision"), doc.get("approver")
    comment = doc.get("comment", "")
    if not isinstance(request_id, str) or not _UUID.match(request_id):
        raise Refused(422, "request_id must be an approval request's id (a UUID)")
    if decision not in ("approve", "deny"):
        raise Refused(422, "decision must be 'approve' or 'deny'")
    if not isinstance(approver, str) or not approver:
        raise Refused(422, "approver must name who answers")
    if not isinstance(comment, str) or len(comment) > 500:
        raise Refused(422, "comment must be a string of at most 500 characters")
    if approver not in approvers:
        raise Refused(403, f"callback {name!r} may not answer as {approver[:64]!r}: not one of its approvers")
    ident = _header(headers, "webhook-id") or ""
    note = f"via callback {name}" + (f": {comment}" if comment else "")
    return ApprovalAction(request_id.lower(), decision == "approve", approver, f"webhook:{name}", note,
                          f"webhook:{name}:{ident}")


def answer_id(replay_key: str) -> uuid.UUID:
    """The ``ApprovalGiven`` event id of the request ``replay_key`` names: the same request, the same event."""
    return uuid.uuid5(_NAMESPACE, replay_key)


def slack_update(text: str, *, replace: bool) -> bytes:
    """What is POSTed to Slack's ``response_url``: the outcome replacing the buttons' message (``replace``: the
    request is answered, so the buttons go), or an ephemeral note to the presser only (a refusal)."""
    body: dict[str, Any] = {"text": text[:3000], "replace_original": replace}
    if replace:
        body["blocks"] = [{"type": "section", "text": {"type": "mrkdwn", "text": text[:2900]}}]
    else:
        body["response_type"] = "ephemeral"
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


__all__ = ["APPROVE_ACTION", "DENY_ACTION", "ApprovalAction", "Refused", "answer_id", "approval_buttons",
           "callback_action", "slack_action", "slack_signature", "slack_update", "verify_slack"]
