"""The event envelope, the registry of event types and the wire codec.

One envelope for every event (see docs/events.md, and docs/architecture.md for the rules around it)::

    id, type, schema_version, job_id, subject, occurred_at, producer, causation_id, correlation_id, payload
    [, signed_by, signature]

``signed_by`` and ``signature`` are present on signed events only (``keel.events.signing`` says which types
must be signed and by whom, and what the signature covers); an unsigned event's JSON does not hold them.

Payloads are frozen pydantic models registered with ``@event_type(name, version, aggregate)``. When a
payload's shape changes, its version goes up and a pure ``@upcaster(name, from_version)`` turns the
old payload into the next version, so old events in the log are read as the current version. The
wire format is JSON; nothing is ever pickled.

``decode_event`` is the one way in from bytes: it raises ``InvalidEvent`` with a reason a human can
act on (malformed JSON, unknown type, a missing or mistyped field, a version from the future, an
oversized message) and the caller dead-letters the raw bytes with that reason.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    create_model,
)

JOB_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
SUBJECT_RE = re.compile(r"^[a-z][a-z_]*/[A-Za-z0-9_.:-]{1,128}$")


class InvalidEvent(ValueError):
    """Bytes that are not a valid Keel event. ``reason`` is short and says what is wrong."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EventPayload(BaseModel):
    """Base of every payload: frozen, no unknown fields. Subclasses are registered with ``event_type``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_name: ClassVar[str] = ""
    schema_version: ClassVar[int] = 0
    aggregate: ClassVar[str] = ""
    envelope_class: ClassVar[type[Event] | None] = None


EARLIEST_TIME = datetime(2000, 1, 1, tzinfo=UTC)
LATEST_TIME = datetime(2200, 1, 1, tzinfo=UTC)
"""Every timestamp in an event lies in [EARLIEST_TIME, LATEST_TIME): a decider adds durations to them
(a command's expiry, a deadline), which must never overflow ``datetime``."""


def _sane_time(value: datetime) -> datetime:
    if not EARLIEST_TIME <= value < LATEST_TIME:
        raise ValueError(f"timestamp {value.isoformat()} is outside {EARLIEST_TIME.year}-{LATEST_TIME.year - 1}")
    return value


def _to_utc(value: datetime) -> datetime:
    # Most timestamps already are UTC; converting those anyway costs more than validating the rest.
    return _sane_time(value if value.utcoffset() == _ZERO else value.astimezone(UTC))


_ZERO = timedelta(0)


JobId = Annotated[str, StringConstraints(pattern=JOB_ID_RE.pattern)]
Subject = Annotated[str, StringConstraints(pattern=SUBJECT_RE.pattern)]
UtcDatetime = Annotated[AwareDatetime, AfterValidator(_to_utc)]
EventTime = Annotated[AwareDatetime, AfterValidator(_sane_time)]
"""A timestamp in a payload: timezone-aware and within the sane range."""


class Event(BaseModel):
    """The envelope. ``payload`` is the typed payload at its *current* schema version.

    Build new events with ``Event.create``; turn bytes into events with ``decode_event``. Every
    registered type has its own subclass (``NodeHealthChangedEvent``...) whose ``payload`` field is
    that type's model, so validating or serialising an envelope is one pass in pydantic's core.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: uuid.UUID
    type: str
    schema_version: int = Field(ge=1)
    job_id: JobId
    subject: Subject
    occurred_at: UtcDatetime
    producer: str = Field(min_length=1, max_length=64)
    causation_id: uuid.UUID | None = None
    correlation_id: uuid.UUID | None = None
    payload: SerializeAsAny[EventPayload]
    signed_by: str | None = Field(default=None, min_length=1, max_length=64)
    """The keyring identity whose key signed this event (``keel.events.signing``); None: unsigned."""
    signature: str | None = Field(default=None, min_length=1, max_length=128)
    """Base64 ed25519 signature over the canonical envelope (``keel.events.signing.signing_bytes``)."""

    @property
    def aggregate_kind(self) -> str:
        return self.subject.split("/", 1)[0]

    @property
    def aggregate_id(self) -> str:
        return self.subject.split("/", 1)[1]

    @classmethod
    def create(
        cls,
        payload: EventPayload,
        *,
        job_id: str,
        subject: str,
        producer: str,
        occurred_at: datetime,
        event_id: uuid.UUID | None = None,
        causation_id: uuid.UUID | None = None,
        correlation_id: uuid.UUID | None = None,
    ) -> Event:
        """A new event around ``payload``; type and version come from the payload's class."""
        envelope_class = type(payload).envelope_class
        if envelope_class is None:
            raise TypeError(f"{type(payload).__name__} is not a registered event payload")
        expected_kind = payload.aggregate
        if expected_kind and not subject.startswith(expected_kind + "/"):
            raise ValueError(f"{payload.event_name} events belong to '{expected_kind}/...' subjects, got {subject!r}")
        return envelope_class(
            id=event_id or uuid.uuid4(),
            type=payload.event_name,
            schema_version=payload.schema_version,
            job_id=job_id,
            subject=subject,
            occurred_at=occurred_at,
            producer=producer,
            causation_id=causation_id,
            correlation_id=correlation_id,
            payload=payload,
        )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-ready envelope (payload at its class's version); an unsigned one without the signature fields."""
        if self.signature is None and self.signed_by is None:
            return self.model_dump(mode="json", exclude=_SIGNATURE_FIELDS)
        return self.model_dump(mode="json")

    def to_json(self) -> bytes:
        if self.signature is None and self.signed_by is None:
            return self.model_dump_json(exclude=_SIGNATURE_FIELDS).encode()
        return self.model_dump_json().encode()


_SIGNATURE_FIELDS = {"signed_by", "signature"}  # never mutated: what an unsigned event leaves out


P = TypeVar("P", bound=type[EventPayload])
PayloadT = TypeVar("PayloadT", bound=EventPayload)
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass
class _TypeEntry:
    name: str
    aggregate: str
    current_version: int
    model: type[EventPayload]
    upcasters: dict[int, Upcaster] = field(default_factory=dict)
    """from_version -> function producing from_version + 1."""


class EventRegistry:
    """Known event types, their current payload model and the upcaster chain from every old version."""

    def __init__(self) -> None:
        self._types: dict[str, _TypeEntry] = {}
        self._current: TypeAdapter[Event] | None = None

    def current_version_adapter(self) -> TypeAdapter[Event]:
        """Validates JSON of *any* type at its current version in one pass (discriminated on ``type``);
        anything else (an old version, an error) fails and takes the slow path."""
        if self._current is None:
            classes = tuple(entry.model.envelope_class for entry in self._types.values())
            union = Annotated[Union[classes], Field(discriminator="type")]  # type: ignore[valid-type]  # noqa: UP007
            self._current = TypeAdapter(union)
        return self._current

    def register(self, name: str, version: int, aggregate: str) -> Callable[[P], P]:
        def decorate(model: P) -> P:
            if name in self._types:
                raise ValueError(f"event type {name} registered twice")
            model.event_name = name
            model.schema_version = version
            model.aggregate = aggregate
            # ``Literal[name]`` of a value known only at run time is a valid type for pydantic, but not a
            # type form a static checker can verify (it sees a bare special form): the ignores say so.
            model.envelope_class = create_model(
                f"{model.__name__}Event",
                __base__=Event,
                __module__=model.__module__,
                type=(Literal[name], ...),  # type: ignore[arg-type]
                schema_version=(Literal[version], ...),  # type: ignore[arg-type]
                payload=(model, ...),
            )
            self._types[name] = _TypeEntry(name, aggregate, version, model)
            self._current = None
            return model

        return decorate

    def upcaster(self, name: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
        def decorate(function: Upcaster) -> Upcaster:
            entry = self._types[name]
            if not 1 <= from_version < entry.current_version:
                raise ValueError(f"{name}: no upcaster from v{from_version} when current is v{entry.current_version}")
            entry.upcasters[from_version] = function
            return function

        return decorate

    def check_complete(self) -> None:
        """Raise if some type lacks an upcaster for one of its old versions."""
        for entry in self._types.values():
            missing = [v for v in range(1, entry.current_version) if v not in entry.upcasters]
            if missing:
                raise ValueError(f"{entry.name}: missing upcasters from versions {missing}")

    def names(self) -> list[str]:
        return sorted(self._types)

    def model(self, name: str) -> type[EventPayload]:
        return self._types[name].model

    def current_version(self, name: str) -> int:
        return self._types[name].current_version

    def aggregate(self, name: str) -> str:
        return self._types[name].aggregate

    def upcast(self, name: str, version: int, payload: dict[str, Any]) -> dict[str, Any]:
        """Bring a raw payload from ``version`` to the current version (pure)."""
        entry = self._entry(name)
        if version > entry.current_version:
            raise InvalidEvent(
                f"{name} schema_version {version} is newer than this build knows (v{entry.current_version}); "
                "upgrade this consumer"
            )
        if version < 1:
            raise InvalidEvent(f"{name} schema_version must be >= 1, got {version}")
        for step in range(version, entry.current_version):
            try:
                payload = entry.upcasters[step](payload)
            except InvalidEvent:
                raise
            except Exception as exc:  # noqa: BLE001 - a payload an upcaster cannot take is invalid input
                raise InvalidEvent(f"{name} v{step} cannot be upcast to v{step + 1}: {type(exc).__name__}: {exc}") from None
        return payload

    def _entry(self, name: str) -> _TypeEntry:
        try:
            return self._types[name]
        except KeyError:
            raise InvalidEvent(f"unknown event type {name!r}") from None

    def parse_envelope(self, envelope: dict[str, Any]) -> Event:
        """Validate a decoded JSON envelope (any known version) into an ``Event`` at the current version."""
        if not isinstance(envelope, dict):
            raise InvalidEvent(f"envelope must be a JSON object, got {type(envelope).__name__}")
        name = envelope.get("type")
        if not isinstance(name, str):
            raise InvalidEvent("envelope field 'type' is missing or not a string")
        entry = self._entry(name)
        version = envelope.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise InvalidEvent("envelope field 'schema_version' is missing or not an integer")
        raw_payload = envelope.get("payload")
        if not isinstance(raw_payload, dict):
            raise InvalidEvent("envelope field 'payload' is missing or not an object")
        if version != entry.current_version:
            envelope = {**envelope, "schema_version": entry.current_version,
                        "payload": self.upcast(name, version, raw_payload)}
        envelope_class = entry.model.envelope_class
        assert envelope_class is not None
        try:
            return envelope_class.model_validate(envelope)
        except ValidationError as exc:
            raise InvalidEvent(_validation_reason(name, exc)) from None


    def parse_envelope_json(self, name: str, version: int, text: str | bytes) -> Event:
        """Like ``parse_envelope`` for JSON text whose type and version the caller already knows
        (store rows): the current version is parsed and validated in one pass in pydantic's core."""
        entry = self._entry(name)
        if version != entry.current_version:
            return self.parse_envelope(json.loads(text))
        envelope_class = entry.model.envelope_class
        assert envelope_class is not None
        try:
            return envelope_class.model_validate_json(text)
        except ValidationError as exc:
            raise InvalidEvent(_validation_reason(name, exc)) from None


def _validation_reason(name: str, exc: ValidationError) -> str:
    parts = []
    for item in exc.errors()[:5]:
        loc = ".".join(str(p) for p in item["loc"]) or "(envelope)"
        msg = "unknown field" if item["type"] == "extra_forbidden" else item["msg"]
        parts.append(f"{loc}: {msg}")
    return f"{name}: " + "; ".join(parts)


REGISTRY = EventRegistry()
"""The registry every Keel component shares; ``keel.events.types`` fills it."""

event_type = REGISTRY.register
upcaster = REGISTRY.upcaster


def decode_wire(
    raw: bytes, *, max_bytes: int, registry: EventRegistry = REGISTRY
) -> tuple[dict[str, Any] | None, Event]:
    """Bytes from the wire to (the envelope as sent if it was an older version, else ``None``; the
    ``Event`` at its current version).

    The store keeps an old envelope as sent (its original ``schema_version`` and payload) and upcasts
    on read. Raises ``InvalidEvent``.
    """
    if len(raw) > max_bytes:
        raise InvalidEvent(f"message of {len(raw)} bytes exceeds the {max_bytes}-byte event limit")
    if _suspect(raw):
        _strict_json(raw)  # a NUL, a non-finite number or deep nesting: refused here with its reason
    try:
        # Fast path, nearly every message: a known type at its current version, parsed and validated
        # in one pass in pydantic's core. The event then *is* what was sent.
        return None, registry.current_version_adapter().validate_json(raw)
    except ValidationError:
        pass  # an old version to upcast, or invalid: the slow path says which, with a reason
    envelope = _strict_json(raw)
    return envelope, registry.parse_envelope(envelope)


MAX_JSON_DEPTH = 64
"""Nesting deeper than this is refused (the deepest event type nests about 6 levels; free-form fields such
as ``evidence`` or ``params`` could otherwise nest as deep as a parser goes)."""

def _suspect(raw: bytes) -> bool:
    """Cheap byte tests that let nearly every message skip the strict parse on the fast path: JSON escapes
    a NUL as \\u0000, and a non-finite number is a bare NaN / Infinity token (the word inside a string
    only costs the strict parse); a message whose brackets may nest deeper than ``MAX_JSON_DEPTH``
    (``_shallow``) is parsed strictly too."""
    return b"\\u0000" in raw or b"NaN" in raw or b"Infinity" in raw or not _shallow(raw)


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _shallow(raw: bytes) -> bool:
    """True when ``raw``'s brackets certainly nest no deeper than ``MAX_JSON_DEPTH``, found at C speed.

    Counting openers alone (at most ``MAX_JSON_DEPTH`` of them) sent every wide message, a node's stacks
    with thousands of objects, through the strict parse's byte-by-byte loop (about 0.3 s per MB: most of
    the analyzer's time for a large job). Here the brackets alone (those inside strings too, which only
    makes the answer more cautious) are reduced by removing every adjacent ``[]`` and ``{}``: a pass
    removes at least one level of nesting and at most two (``{[]}`` goes in one), so brackets gone
    within ``MAX_JSON_DEPTH // 2`` passes nest at most ``MAX_JSON_DEPTH`` deep. Brackets that do not
    pair up (a lone bracket inside a string) stop the reduction: not shallow, the strict parse judges."""
    if raw.count(b"{") + raw.count(b"[") <= MAX_JSON_DEPTH:
        return True
    brackets = raw.translate(None, _NOT_BRACKETS)
    for _ in range(MAX_JSON_DEPTH // 2):
        shorter = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if not shorter:
            return True
        if len(shorter) == len(brackets):
            return False
        brackets = shorter
    return False


def _refuse_constant(token: str) -> Any:
    raise InvalidEvent(f"non-finite number {token} (JSON has none, PostgreSQL jsonb refuses it)")


def _strict_json(raw: bytes) -> Any:
    """Parse ``raw`` as strict JSON: no NaN/Infinity, no NUL in any string or key, nesting at most
    ``MAX_JSON_DEPTH``. Raises ``InvalidEvent`` only (never ``RecursionError`` or a decode error)."""
    depth = 0
    for byte in raw:  # before json.loads, which would recurse as deep as the input goes
        if byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise InvalidEvent(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    try:
        value = json.loads(raw, parse_constant=_refuse_constant)
    except InvalidEvent:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise InvalidEvent(f"not valid JSON: {exc}") from None
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                raise InvalidEvent("a string holds a NUL character (PostgreSQL jsonb refuses it)")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


def decode_event(raw: bytes, *, max_bytes: int, registry: EventRegistry = REGISTRY) -> Event:
    """Bytes from the wire to an ``Event`` at its current version. Raises ``InvalidEvent``."""
    return decode_wire(raw, max_bytes=max_bytes, registry=registry)[1]


def payload_of(event: Event, kind: type[PayloadT]) -> PayloadT:
    """``event.payload`` as a ``kind`` (typed, for a caller that read events of one type).

    Every registered type's payload is its own class, so this holds whenever ``event.type`` is ``kind``'s
    name; an event of another type is the caller's bug and raises ``TypeError``."""
    payload = event.payload
    if not isinstance(payload, kind):
        raise TypeError(f"expected a {kind.__name__} event, got {event.type} ({event.id})")
    return payload


def now_utc() -> datetime:
    """Wall-clock time for *adapters*. Decision cores never call this: time reaches them as events."""
    return datetime.now(UTC)
