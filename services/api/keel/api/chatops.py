"""Chat-ops approvals served by the API (adapter): Slack's buttons and signed callbacks answer held actions.

``POST /v1/chatops/slack`` takes Slack's interaction requests, ``POST /v1/chatops/callback/<name>`` a configured
tool's Standard Webhooks-signed JSON. Neither takes a bearer token: the request's signature is its
authentication, checked first (``keel.notifier.chatops``: the signature, the timestamp window, the approver's
allow-list). Then, against the event store and the bus:

1. **Replay.** The answer's event id is derived from the request (``answer_id``): a request this process has
   seen, whose answer the log already holds, or that JetStream reports as a duplicate on publishing, is refused
   (409). The log is the memory that outlives a restart and is shared by every API process.
2. **The request.** An id the log holds no ``ApprovalRequested`` for is 404, one already answered 409, one
   expired 410 (``keel.reports.incidents.find_open_request``, as ``keel approve``).
3. **The answer.** ``approval_answer`` builds the ``ApprovalGiven``: ``by`` the approver the allow-list maps
   to, ``comment`` who pressed what where, ``producer`` the channel (``chatops-slack``, ``chatops-webhook``),
   signed by the API's ``chatops`` key (a role that may sign approvals and nothing else).

Slack is also told the outcome through the message's ``response_url`` (when it is under
``api.chatops.slack_response_url_prefix``): the buttons are replaced by who answered, or the presser alone sees
why nothing happened. Every refusal publishes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.error
import urllib.request
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from keel.events.envelope import Event, now_utc, payload_of
from keel.events.types import ApprovalGiven, ApprovalRequested
from keel.notifier.chatops import ApprovalAction, Refused, answer_id, callback_action, slack_action, slack_update
from keel.reports.incidents import LookupFailed, approval_answer, find_open_request, short_id

log = logging.getLogger("keel.api.chatops")

SEEN_KEPT = 10_000
"""Replay keys each process remembers (the log remembers them all; this covers the recorder's lag)."""
RESPONSE_TIMEOUT_S = 5.0


class Published(Protocol):
    """What publishing answers (``keel.infra.bus.PublishResult``): whether JetStream already held the message id."""

    @property
    def duplicate(self) -> bool: ...


class Store(Protocol):
    async def get(self, event_id: uuid.UUID) -> Any: ...

    def read(self, *, job_id: str | None = None, types: list[str] | None = None) -> Any: ...


@dataclass(frozen=True)
class Callback:
    name: str
    secret: str
    approvers: frozenset[str]


@dataclass
class ChatOps:
    """The chat-ops routes' work: verify, look up, publish. ``publish`` signs and publishes one event (a bus
    connected as the chatops identity); ``post`` sends Slack's message update (blocking; run in a thread)."""

    store: Store
    publish: Callable[[Event], Awaitable[Published]]
    slack_secret: str = ""
    slack_approvers: Mapping[str, str] = field(default_factory=dict)
    response_url_prefix: str = "https://hooks.slack.com/"
    callbacks: Mapping[str, Callback] = field(default_factory=dict)
    tolerance: timedelta = timedelta(minutes=5)
    clock: Callable[[], datetime] = now_utc
    post: Callable[[str, bytes], None] | None = None
    _seen: OrderedDict[str, None] = field(default_factory=OrderedDict, init=False, repr=False)
    _updates: set[asyncio.Task[None]] = field(default_factory=set, init=False, repr=False)

    async def slack(self, headers: Mapping[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        try:
            action = slack_action(headers, body, secret=self.slack_secret, approvers=self.slack_approvers,
                                  now=self.clock(), tolerance=self.tolerance,
                                  response_url_prefix=self.response_url_prefix)
        except Refused as refused:
            log.warning("chat-ops slack: refused (%d): %s", refused.status, refused.reason)
            if refused.response_url:  # signed by Slack, but not someone who may answer: tell them why
                self._post_update(refused.response_url, f":no_entry: {refused.reason}", replace=False)
            return refused.status, {"ok": False, "detail": refused.reason}
        return await self._answer(action)

    async def callback(self, name: str, headers: Mapping[str, str], body: bytes) -> tuple[int, dict[str, Any]]:
        known = self.callbacks.get(name)
        try:
            if known is None:
                raise Refused(404, f"no chat-ops callback named {name[:64]!r} (api.chatops.callbacks)")
            action = callback_action(headers, body, name=name, secret=known.secret, approvers=known.approvers,
                                     now=self.clock(), tolerance=self.tolerance)
        except Refused as refused:
            log.warning("chat-ops callback %s: refused (%d): %s", name[:64], refused.status, refused.reason)
            return refused.status, {"ok": False, "detail": refused.reason}
        return await self._answer(action)

    async def _answer(self, action: ApprovalAction) -> tuple[int, dict[str, Any]]:
        try:
            answer = await self._publish_answer(action)
        except Refused as refused:
            log.warning("chat-ops %s: %s's answer refused (%d): %s", action.channel, action.approver, refused.status,
                        refused.reason)
            self._tell_slack(action, f":no_entry: {refused.reason}", replace=False)
            return refused.status, {"ok": False, "detail": refused.reason}
        verdict = "approved" if action.approved else "denied"
        given = payload_of(answer, ApprovalGiven)
        text = (f"{':white_check_mark:' if action.approved else ':x:'} *{verdict}* by {given.by} "
                f"({action.comment}): request `{short_id(uuid.UUID(given.request_id))}`")
        log.info("chat-ops %s: request %s %s by %s; event %s", action.channel, given.request_id, verdict, given.by,
                 answer.id)
        self._tell_slack(action, text, replace=True)
        return 200, {"ok": True, "outcome": verdict, "request_id": given.request_id, "by": given.by,
                     "channel": action.channel, "event_id": str(answer.id), "detail": text}

    async def _publish_answer(self, action: ApprovalAction) -> Event:
        if action.replay_key in self._seen:
            raise Refused(409, "replayed: this request was already received; nothing was published")
        self._seen[action.replay_key] = None  # before any wait: a copy arriving meanwhile is refused
        if len(self._seen) > SEEN_KEPT:
            self._seen.popitem(last=False)
        try:
            return await self._checked_publish(action)
        except Refused as refused:
            if refused.status >= 500:
                self._seen.pop(action.replay_key, None)  # not handled: the same request may come again
            raise
        except Exception:
            self._seen.pop(action.replay_key, None)
            raise

    async def _checked_publish(self, action: ApprovalAction) -> Event:
        event_id = answer_id(action.replay_key)
        if await self.store.get(event_id) is not None:
            raise Refused(409, "replayed: the log already holds this request's answer; nothing was published")
        try:
            request_uuid = uuid.UUID(action.request_id)
        except ValueError:
            raise Refused(422, "not an approval request id") from None
        recorded = await self.store.get(request_uuid)
        if recorded is None or recorded.event.type != "ApprovalRequested":
            raise Refused(404, f"no approval request {action.request_id} in the log; nothing was published")
        request: Event = recorded.event
        answers = [r.event async for r in self.store.read(job_id=request.job_id, types=["ApprovalGiven"])]
        if any(a.id == event_id for a in answers):  # recorded since the first look
            raise Refused(409, "replayed: the log already holds this request's answer; nothing was published")
        now = self.clock()
        try:
            find_open_request(str(request.id), [request], answers, now)
        except LookupFailed as exc:
            answered = any(payload_of(a, ApprovalGiven).request_id == str(request.id) for a in answers)
            expired = payload_of(request, ApprovalRequested).expires_at <= now
            raise Refused(409 if answered or not expired else 410, f"{exc}; nothing was published") from None
        answer = approval_answer(request, approved=action.approved, by=action.approver, comment=action.comment,
                                 now=now, event_id=event_id, producer=f"chatops-{action.channel.split(':')[0]}")
        try:
            published = await self.publish(answer)
        except Exception as exc:  # noqa: BLE001 - the bus's errors vary; the caller may try again
            log.error("chat-ops: publishing the answer to %s failed: %r", action.request_id, exc)
            raise Refused(503, "the answer could not be published (the bus did not acknowledge it); try again") from None
        if published.duplicate:
            raise Refused(409, "replayed: the bus already holds this request's answer; nothing new was published")
        return answer

    def _tell_slack(self, action: ApprovalAction, text: str, *, replace: bool) -> None:
        if action.response_url:
            self._post_update(action.response_url, text, replace=replace)

    def _post_update(self, url: str, text: str, *, replace: bool) -> None:
        if self.post is None:
            return
        post, body = self.post, slack_update(text, replace=replace)
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(post, url, body))
        self._updates.add(task)
        task.add_done_callback(self._updates.discard)


def post_to_slack(url: str, body: bytes) -> None:
    """POST ``body`` (JSON) to a Slack ``response_url``; a failure is logged (the answer is already published)."""
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=RESPONSE_TIMEOUT_S) as response:  # noqa: S310 - prefix-checked
            response.read(4096)
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        log.warning("chat-ops: Slack's response_url did not take the update (%s after %.1f s)",
                    type(getattr(exc, "reason", exc)).__name__, time.monotonic() - started)


__all__ = ["Callback", "ChatOps", "post_to_slack"]
