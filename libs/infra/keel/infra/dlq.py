"""The dead-letter stream: read it, and redrive what a fix made acceptable (``keel dlq``).

A dead letter is a message some consumer could not take (the recorder first of all), copied by
``Bus.dead_letter`` to the dead-letter stream (``bus.dlq_stream``, subjects ``<prefix>_dlq.>``) as the raw
bytes with the reason, the original subject and the original stream sequence in headers. Its id is its
sequence in the dead-letter stream.

Redriving one (``redrive``) takes its bytes as they are (a code fix, say an upcaster, made them
acceptable) or a corrected body, and:

1. checks it with what every consumer applies (``decode_wire`` and the subject rule): what would be
   dead-lettered again is refused with the reason, as is a cut copy (``Keel-Dlq-Truncated-From``) without
   a corrected body, a message whose envelope belongs on another subject than the one it came on (unless
   a corrected body is given), and an event id the log already holds with another body (one id, one body);
2. publishes it on the subject its envelope belongs on (message id ``redrive-<dlq stream>-<seq>``: a
   repeated redrive inside the dedup window is dropped by JetStream; after it, the store's event-id key
   drops it);
3. publishes ``DeadLetterRedriven`` (who, when, why it was dead-lettered, what was published), whose id is
   derived from the dead letter, so it is recorded once however often a redrive is retried;
4. deletes it from the dead-letter stream. The ``dead_letters`` table keeps the original for good.

A redrive interrupted between 2 and 4 is finished by running it again: the log then holds the same event
(same id, same body), which counts as redriven already.

``plan_redrive`` is the pure decision; ``DeadLetters`` does the I/O.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import nats.js.errors

from keel.events.envelope import Event, InvalidEvent, decode_wire
from keel.events.types import DeadLetterRedriven
from keel.infra.bus import (
    HEADER_DLQ_REASON,
    HEADER_DLQ_STREAM_SEQ,
    HEADER_DLQ_SUBJECT,
    HEADER_DLQ_TRUNCATED,
    Bus,
)
from keel.infra.subjects import event_subject

REDRIVE_PRODUCER = "keel-dlq"
_REDRIVE_NAMESPACE = uuid.UUID("1b8f5a52-7c0e-4f0e-9d53-2b8c1f0d6a11")


@dataclass(frozen=True)
class DeadLetter:
    """One message of the dead-letter stream."""

    id: int
    """Its sequence in the dead-letter stream."""
    dlq_subject: str
    subject: str
    """The subject it was published on."""
    reason: str
    stream_seq: int
    """Its sequence in the events stream (0: unknown)."""
    at: datetime
    """When it was dead-lettered."""
    data: bytes
    size: int
    """The original message's size (larger than ``len(data)`` when the copy was cut)."""
    truncated: bool
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def job(self) -> str:
        """The job token of its subject (``?`` when the subject has none)."""
        tokens = self.subject.split(".")
        return tokens[1] if len(tokens) >= 2 else "?"

    @property
    def type(self) -> str:
        """The event type its subject names (the last of five tokens), ``?`` for a subject off the rule."""
        tokens = self.subject.split(".")
        return tokens[-1] if len(tokens) == 5 else "?"

    def summary(self) -> dict[str, object]:
        """The JSON-ready fields of ``keel dlq ls --json`` (no body)."""
        return {"id": self.id, "at": self.at.isoformat(), "job": self.job, "type": self.type, "subject": self.subject,
                "reason": self.reason, "size": self.size, "truncated": self.truncated, "stream_seq": self.stream_seq}


@dataclass(frozen=True)
class Redrive:
    """What redriving one dead letter publishes (``plan_redrive`` said yes)."""

    dead_letter: DeadLetter
    event: Event
    body: bytes
    subject: str
    corrected: bool


class RedriveRefused(ValueError):
    """This dead letter cannot be redriven (as it is, or with this body); the message says why."""


def redrive_record_id(dlq_stream: str, dlq_seq: int) -> uuid.UUID:
    """The id of the ``DeadLetterRedriven`` of dead letter ``dlq_seq`` (one per dead letter)."""
    return uuid.uuid5(_REDRIVE_NAMESPACE, f"{dlq_stream}:{dlq_seq}")


def plan_redrive(dead_letter: DeadLetter, body: bytes | None, *, prefix: str, max_event_bytes: int) -> Redrive:
    """Decide whether ``dead_letter`` can be redriven, as it is (``body`` None) or as ``body`` (pure).
    Raises ``RedriveRefused`` with the reason."""
    corrected = body is not None
    if body is None:
        if dead_letter.truncated:
            raise RedriveRefused(
                f"dead letter {dead_letter.id} is a cut copy ({len(dead_letter.data)} of {dead_letter.size} bytes; the "
                f"dead_letters table keeps it whole, js_seq {dead_letter.stream_seq}): redrive a corrected body (--body FILE)")
        body = dead_letter.data
    try:
        _, event = decode_wire(body, max_bytes=max_event_bytes)
    except InvalidEvent as exc:
        what = "the corrected body" if corrected else f"dead letter {dead_letter.id}"
        raise RedriveRefused(f"{what} is still not a valid event: {exc.reason}") from None
    subject = event_subject(prefix, event)
    if not corrected and subject != dead_letter.subject:
        raise RedriveRefused(
            f"dead letter {dead_letter.id} was published on {dead_letter.subject} but its envelope belongs on {subject}: "
            "redriving it would act on what its publisher did not say; redrive a corrected body (--body FILE) if "
            "you mean it")
    return Redrive(dead_letter, event, body, subject, corrected)


def redrive_record(redrive: Redrive, *, dlq_stream: str, by: str, now: datetime) -> Event:
    """The ``DeadLetterRedriven`` event of ``redrive`` (deterministic id)."""
    dl = redrive.dead_letter
    payload = DeadLetterRedriven(
        dlq_stream=dlq_stream, dlq_seq=dl.id, original_subject=dl.subject[:1000],
        original_stream_seq=dl.stream_seq, reason=dl.reason, event_id=str(redrive.event.id),
        event_type=redrive.event.type, subject=redrive.subject, corrected=redrive.corrected,
        body_sha256=hashlib.sha256(redrive.body).hexdigest(), by=by)
    return Event.create(payload, job_id=redrive.event.job_id, subject=f"dead_letter/{dlq_stream}:{dl.id}",
                        producer=REDRIVE_PRODUCER, occurred_at=now, event_id=redrive_record_id(dlq_stream, dl.id),
                        causation_id=redrive.event.id, correlation_id=redrive.event.correlation_id)


def _from_raw(raw: object, dlq_prefix: str) -> DeadLetter:
    headers = {str(k): str(v) for k, v in (getattr(raw, "headers", None) or {}).items()}
    data = getattr(raw, "data", None) or b""
    dlq_subject = str(getattr(raw, "subject", "") or "")
    original = headers.get(HEADER_DLQ_SUBJECT) or dlq_subject.replace(dlq_prefix, "", 1).lstrip(".")
    truncated_from = headers.get(HEADER_DLQ_TRUNCATED, "")
    seq_text = headers.get(HEADER_DLQ_STREAM_SEQ, "0")
    at = getattr(raw, "time", None) or datetime.fromtimestamp(0, UTC)
    return DeadLetter(
        id=int(getattr(raw, "seq", 0) or 0), dlq_subject=dlq_subject, subject=original,
        reason=headers.get(HEADER_DLQ_REASON, "(no reason header)"),
        stream_seq=int(seq_text) if seq_text.isdigit() else 0, at=at, data=data,
        size=int(truncated_from) if truncated_from.isdigit() else len(data), truncated=bool(truncated_from),
        headers=headers)


class DeadLetters:
    """The dead-letter stream of ``bus``: ``list``, ``get``, ``redrive``."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.stream = bus.settings.dlq_stream

    async def list(self, *, job: str | None = None, since: datetime | None = None, limit: int | None = None
                   ) -> list[DeadLetter]:
        """The dead letters (oldest first), of ``job`` only, dead-lettered at or after ``since``; the newest
        ``limit`` of them. Reads every message of the stream that matches (one request each)."""
        info = await self.bus.js.stream_info(self.stream)
        if not info.state.messages:
            return []
        subject = f"{self.bus.dlq_prefix}.{job}.>" if job else f"{self.bus.dlq_prefix}.>"
        kept: deque[DeadLetter] = deque(maxlen=limit)
        seq = info.state.first_seq
        while seq <= info.state.last_seq:
            try:
                raw = await self.bus.js.get_msg(self.stream, seq=seq, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                break
            dead_letter = _from_raw(raw, self.bus.dlq_prefix)
            seq = dead_letter.id + 1
            if since is None or dead_letter.at >= since:
                kept.append(dead_letter)
        return list(kept)

    async def get(self, dlq_seq: int) -> DeadLetter | None:
        """Dead letter ``dlq_seq``, or None when there is none (never was, redriven or removed)."""
        try:
            raw = await self.bus.js.get_msg(self.stream, seq=dlq_seq)
        except nats.js.errors.NotFoundError:
            return None
        return _from_raw(raw, self.bus.dlq_prefix)

    async def redrive(self, redrive: Redrive, *, by: str, now: datetime,
                      logged: Callable[[uuid.UUID], Awaitable[Event | None]]) -> str:
        """Carry out ``redrive`` (steps 2-4 of the module docstring); ``logged(event_id)`` reads an event from
        the log (None when it is not there). Returns what happened, one line. Raises ``RedriveRefused``
        when the log holds the event id with another body."""
        event = redrive.event
        held = await logged(event.id)
        if held is not None and held != event:
            raise RedriveRefused(
                f"the log already holds event {event.id} ({held.type}) with another body: a second body for one id "
                "is refused (one id, one body)")
        if held is None:
            await self.bus.publish_raw(redrive.subject, redrive.body,
                                       msg_id=f"redrive-{self.stream}-{redrive.dead_letter.id}")
        record = redrive_record(redrive, dlq_stream=self.stream, by=by, now=now)
        await self.bus.publish(record)
        await self.remove(redrive.dead_letter.id)
        if held is not None:
            return f"event {event.id} was already in the log (an earlier redrive); recorded and removed"
        return f"published {event.type} {event.id} on {redrive.subject}"

    async def remove(self, dlq_seq: int) -> bool:
        """Delete dead letter ``dlq_seq`` from the stream; False when it was not there."""
        try:
            return bool(await self.bus.js.delete_msg(self.stream, dlq_seq))
        except nats.js.errors.APIError:  # not there (any more): 404, or 400 "no message found"
            return False
