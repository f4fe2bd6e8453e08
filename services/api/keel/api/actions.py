"""Operator actions served by the API (adapter): an ``operator`` token answers held actions and cordons nodes.

``POST /v1/approvals/{request_id}`` answers an ``ApprovalRequested``, ``POST /v1/nodes/{node_id}/cordon`` and
``/uncordon`` take a node out of service or put it back, as ``keel approve`` / ``deny`` / ``cordon`` /
``uncordon`` do, from the same builders (``keel.reports.incidents``). Who acted is the token's operator signing
identity (``ApiToken.signer``): the event's ``by`` names it and its key signs the event (``sign_event``), so the
controller's check (an operator event's ``by`` is its signer) holds as for the CLI. The keys are loaded when the
API starts (``keel.api.main.operator_keys``: a missing one stops the start, exit status 2); the bus the events go
out on is the API's own NATS identity (role ``chatops``: ``ApprovalGiven`` and ``NodeCordoned`` only).

Approvals, against the event store and the bus (as chat-ops, ``keel.api.chatops``):

1. An id the log holds no ``ApprovalRequested`` for is 404; one already answered 409 (naming by whom, as
   ``keel approve`` says), one expired 410 (``keel.reports.incidents.find_open_request``).
2. The answer's event id is derived from the request (``answer_event_id``): two answers to one request through
   the API are one message id, so JetStream keeps the first and reports the second as a duplicate (409) even
   before the recorder has recorded the first. A request answered once stays answered.

Every refusal publishes nothing. Nothing here logs a token.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from keel.api.chatops import Published, Store  # what publishing answers and the store reads: as chat-ops
from keel.events.envelope import Event, now_utc, payload_of
from keel.events.signing import SigningKey, sign_event, verify_event
from keel.events.types import ApprovalGiven, ApprovalRequested
from keel.infra.api_auth import ApiToken
from keel.reports.incidents import BadInput, LookupFailed, approval_answer, cordon_event, find_open_request, short_id

log = logging.getLogger("keel.api.actions")

PRODUCER = "api"
"""The ``producer`` of the events an operator token's actions publish."""
_NAMESPACE = uuid.UUID("6c1f9a52-7d3e-4f0b-9a41-2b8e5d0c7f13")


class Refused(Exception):
    """An action not taken: the HTTP status and the reason (nothing was published)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def answer_event_id(request_id: uuid.UUID) -> uuid.UUID:
    """The event id of the API's answer to approval request ``request_id``: one per request, whoever answers."""
    return uuid.uuid5(_NAMESPACE, f"api-answer:{request_id}")


def signed_as(event: Event, key: SigningKey) -> Event:
    """``event`` signed by operator ``key``, checked as a consumer checks it (its ``by`` must name the signer)."""
    signed = sign_event(event, key)
    verdict = verify_event(signed, {key.name: key.public})
    if not verdict.ok:  # a bug here, not the caller's: never publish what every consumer refuses
        raise RuntimeError(f"the API's own {event.type} would be refused: {verdict.reason}")
    return signed


def refusal_of(request: Event, answers: list[Event], now: datetime) -> Refused | None:
    """Why ``request`` cannot be answered now (409 answered, 410 expired), or None (pure)."""
    try:
        find_open_request(str(request.id), [request], answers, now)
    except LookupFailed as exc:
        answered = any(payload_of(a, ApprovalGiven).request_id == str(request.id) for a in answers)
        expired = payload_of(request, ApprovalRequested).expires_at <= now
        return Refused(409 if answered or not expired else 410, f"{exc}; nothing was published")
    return None


def jobs_refusal(node_id: str, jobs: list[str], job: str | None) -> tuple[str, Refused | None]:
    """The job a cordon of ``node_id`` applies to (``job``, else the one job the log has it in), or why not (pure)."""
    if job is not None:
        if job not in jobs:
            return job, Refused(404, f"node {node_id} has no events in job {job}; nothing was published")
        return job, None
    if not jobs:
        return "", Refused(404, f"node {node_id} has no events in the log; nothing was published")
    if len(jobs) > 1:
        return "", Refused(422, f"node {node_id} belongs to jobs {', '.join(sorted(jobs))}: pass job")
    return jobs[0], None


@dataclass
class Actions:
    """The operator routes' work. ``publish``: publishes one (already signed) event and waits for JetStream's
    acknowledgement; ``keys``: each operator identity's signing key; ``node_jobs``: the jobs the log has a node in."""

    store: Store
    publish: Callable[[Event], Awaitable[Published]]
    keys: Mapping[str, SigningKey]
    node_jobs: Callable[[str], Awaitable[list[str]]]
    clock: Callable[[], datetime] = now_utc

    def _key(self, token: ApiToken) -> SigningKey:
        key = self.keys.get(token.signer)
        if key is None:  # the start loads every operator token's key: only a token added without a restart
            raise Refused(503, f"no signing key loaded for operator {token.signer!r}; restart the API after adding "
                               "the token")
        return key

    async def answer(self, token: ApiToken, request_id: uuid.UUID, *, approved: bool, comment: str) -> dict[str, Any]:
        key = self._key(token)
        recorded = await self.store.get(request_id)
        if recorded is None or recorded.event.type != "ApprovalRequested":
            raise Refused(404, f"no approval request {request_id} in the log; nothing was published")
        request: Event = recorded.event
        answers = [r.event async for r in self.store.read(job_id=request.job_id, types=["ApprovalGiven"])]
        now = self.clock()
        refused = refusal_of(request, answers, now)
        if refused is not None:
            raise refused
        event_id = answer_event_id(request.id)
        try:
            answer = approval_answer(request, approved=approved, by=key.name, comment=comment, now=now,
                                     event_id=event_id, producer=PRODUCER)
        except BadInput as exc:
            raise Refused(422, str(exc)) from None
        await self._publish(signed_as(answer, key), f"the answer to {request_id}",
                            "this request was already answered through the API (an answer raced this one)")
        verdict = "approved" if approved else "denied"
        asked = payload_of(request, ApprovalRequested)
        log.info("api: request %s (%s, job %s) %s by %s (token %s); event %s", request.id, asked.action,
                 request.job_id, verdict, key.name, token.name, answer.id)
        return {"ok": True, "outcome": verdict, "request_id": str(request.id), "action": asked.action,
                "job_id": request.job_id, "by": key.name, "event_id": str(answer.id),
                "detail": f"{verdict} request {short_id(request.id)} ({asked.action}, job {request.job_id}) as "
                          f"{key.name}"}

    async def cordon(self, token: ApiToken, node_id: str, *, cordoned: bool, reason: str,
                     job: str | None) -> dict[str, Any]:
        key = self._key(token)
        if cordoned and not reason.strip():
            raise Refused(422, "a cordon needs a reason; nothing was published")
        job_id, refused = jobs_refusal(node_id, await self.node_jobs(node_id), job)
        if refused is not None:
            raise refused
        try:
            event = cordon_event(job_id, node_id, cordoned=cordoned, by=key.name, reason=reason, now=self.clock(),
                                 producer=PRODUCER)
        except BadInput as exc:
            raise Refused(422, str(exc)) from None
        await self._publish(signed_as(event, key), f"the {'cordon' if cordoned else 'uncordon'} of {node_id}",
                            "the bus already holds this event")
        what = "cordoned" if cordoned else "uncordoned"
        log.info("api: %s %s of job %s by %s (token %s); event %s", what, node_id, job_id, key.name, token.name,
                 event.id)
        return {"ok": True, "outcome": what, "node_id": node_id, "job_id": job_id, "by": key.name,
                "event_id": str(event.id), "detail": f"{what} {node_id} of job {job_id} as {key.name}"}

    async def _publish(self, event: Event, what: str, duplicate: str) -> None:
        try:
            published = await self.publish(event)
        except Exception as exc:  # noqa: BLE001 - the bus's errors vary; the caller may try again
            log.error("api: publishing %s failed: %r", what, exc)
            raise Refused(503, f"{what} could not be published (the bus did not acknowledge it); try again") from None
        if published.duplicate:
            raise Refused(409, f"{duplicate}; nothing new was published")


__all__ = ["PRODUCER", "Actions", "Refused", "answer_event_id", "jobs_refusal", "refusal_of", "signed_as"]
