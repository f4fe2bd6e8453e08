"""The Decider shape every service core has, and the pure fold that runs it.

A decider is three pure functions over immutable state::

    initial_state() -> S
    evolve(state, event) -> S                 # learn from any event, including one's own decisions
    decide(state, event) -> Decision          # what to do about this event, and why

``decide`` returns ``Proposal``s (payload + subject + a stable key). ``materialise`` turns them into
events whose ids are uuid5(causation id, decider, type, key): processing a redelivered input yields the
same ids, so JetStream dedup and the Postgres primary key make every decision idempotent. A decision
event's ``occurred_at`` is the decision's ``at`` (the time on its decider's recorded clock), else its
cause's ``occurred_at`` — decision cores never read the clock.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, Protocol, TypeVar

from keel.events.envelope import Event, EventPayload
from keel.events.types import DecisionRefused, is_foreign_tick

S = TypeVar("S")

DECISION_NAMESPACE = uuid.UUID("6f1c2a4e-6a7e-4d1c-9b7a-6b6565c0de00")


@dataclass(frozen=True)
class Proposal:
    """One event a decider wants emitted. ``key`` distinguishes several proposals of one type per cause."""

    payload: EventPayload
    subject: str
    key: str = ""
    correlation_id: uuid.UUID | None = None
    """The incident this decision belongs to; None: the cause's correlation (or the cause itself)."""


@dataclass(frozen=True)
class Decision:
    """What a decider concluded about one input: the events to emit (possibly none) and why."""

    reason: str
    proposals: tuple[Proposal, ...] = ()
    at: datetime | None = None
    """When the decider took it on its recorded clock; its events' ``occurred_at``. None: the cause's
    ``occurred_at`` (a decider that keeps no clock of its own)."""

    @staticmethod
    def nothing(reason: str) -> Decision:
        return Decision(reason=reason)


class Decider(Protocol[S]):
    """A service core. ``name`` is the producer name on every event it emits."""

    name: str

    def initial_state(self) -> S: ...

    def evolve(self, state: S, event: Event) -> S: ...

    def decide(self, state: S, event: Event) -> Decision: ...

    def interested_in(self, event: Event) -> bool:
        """Whether ``decide`` has anything to say about this event type (others are only evolved)."""
        ...


def refusal(decider: str, cause: Event, stage: str, error: BaseException) -> Decision:
    """The decision recorded when ``decider`` raised on ``cause``: a ``DecisionRefused`` with the error."""
    text = f"{type(error).__name__}: {error}"[:2000]
    return Decision(
        reason=f"refused: {decider} could not {stage} {cause.type} {cause.id}: {text}",
        proposals=(Proposal(DecisionRefused(decider=decider, cause_type=cause.type, cause_id=str(cause.id),
                                            stage=stage, error=text),
                            subject=f"job/{cause.job_id}"),),
    )


def evolve_or_keep(decider: Decider[S], state: S, event: Event) -> tuple[S, BaseException | None]:
    """``decider.evolve``; when it raises, the state as it was and the error (an input the fold cannot
    take changes nothing, and never stops the service)."""
    try:
        return decider.evolve(state, event), None
    except Exception as exc:  # noqa: BLE001 - any bug or bad input in a fold is contained here
        return state, exc


def decide_or_refuse(decider: Decider[S], state: S, event: Event) -> Decision:
    """``decider.decide``; when it raises, the refusal to record instead (never an exception)."""
    try:
        return decider.decide(state, event)
    except Exception as exc:  # noqa: BLE001 - a decider that cannot decide records why and goes on
        return refusal(decider.name, event, "decide", exc)


class DecisionTooLarge(ValueError):
    """A decision's event is larger than the bus takes (``max_event_bytes``): it could never be published."""


def publishable(decider_name: str, cause: Event, decision: Decision,
                max_event_bytes: int | None) -> tuple[Decision, list[Event]]:
    """``materialise``, with a size check: a decision with an event over ``max_event_bytes`` is replaced
    by its refusal (saying which event and how large), so a decider never crash-loops on publishing a
    decision the bus refuses, and a replay with the same limit refuses it the same way. Returns the
    decision taken (the refusal, if it came to that) and its events."""
    emitted = materialise(decider_name, cause, decision)
    if max_event_bytes is None:
        return decision, emitted
    for produced in emitted:
        size = len(produced.to_json())
        if size > max_event_bytes:
            error = DecisionTooLarge(f"{produced.type} would be {size} bytes, over the {max_event_bytes}-byte event limit")
            refused = refusal(decider_name, cause, "decide", error)
            return refused, materialise(decider_name, cause, refused)
    return decision, emitted


def decision_id(causation_id: uuid.UUID, decider: str, event_type: str, key: str) -> uuid.UUID:
    """Deterministic id of a decision event: the same cause and decision always give the same id."""
    return uuid.uuid5(DECISION_NAMESPACE, f"{causation_id}|{decider}|{event_type}|{key}")


def materialise(decider_name: str, cause: Event, decision: Decision) -> list[Event]:
    """The events a decision emits, with deterministic ids, causation and correlation filled in."""
    events = []
    for proposal in decision.proposals:
        name = proposal.payload.event_name
        events.append(
            Event.create(
                proposal.payload,
                event_id=decision_id(cause.id, decider_name, name, proposal.key or proposal.subject),
                job_id=cause.job_id,
                subject=proposal.subject,
                producer=decider_name,
                occurred_at=decision.at or cause.occurred_at,
                causation_id=cause.id,
                correlation_id=proposal.correlation_id or cause.correlation_id or cause.id,
            )
        )
    return events


@dataclass
class StepResult(Generic[S]):
    decision: Decision | None
    emitted: list[Event] = field(default_factory=list)


class DeciderSession(Generic[S]):
    """A decider's state while it runs, live or in replay. The one loop body every service uses.

    ``observe(event)``: evolve, decide if interested, evolve the emitted decisions at once, and
    remember their ids so that when they come back through the stream (or the log) they are not
    evolved twice. The decider's own past decisions are evolved, never decided on again.
    """

    def __init__(self, decider: Decider[S], state: S | None = None, *, max_event_bytes: int | None = None) -> None:
        self.decider = decider
        self.state: S = decider.initial_state() if state is None else state
        self.max_event_bytes = max_event_bytes
        """The bus's event limit: a decision with a larger event is refused (``publishable``)."""
        self._awaiting_echo: set[uuid.UUID] = set()

    def rebuild(self, events: Iterable[Event]) -> None:
        """Cold start: evolve over history without deciding anything."""
        for event in events:
            if not is_foreign_tick(event):
                self.state, _ = evolve_or_keep(self.decider, self.state, event)

    def observe(self, event: Event) -> StepResult[S]:
        """Evolve ``event``, decide if interested, evolve the decision's events at once and await their echoes."""
        return self.catch_up(event)

    def catch_up(self, event: Event, recorded: frozenset[uuid.UUID] = frozenset()) -> StepResult[S]:
        """``observe`` for an input the log holds but this decider may not have finished deciding on (a
        cold start's unacknowledged tail); ``recorded``: the ids of the decisions about ``event`` that the
        log already holds (they follow it in the log).

        The decision is taken again (the same state and input give the same decision and ids); the
        returned ``emitted`` are only its events the log lacks, the rest of a decision published in part
        before a crash. Every event of the decision is evolved now and awaited as an echo, so the recorded
        ones, folded next, are not evolved twice. Should the log hold a decision about ``event`` that
        this one does not contain (the decider changed since, or the live run saw another order), the
        log wins: nothing is evolved or published here and the recorded decisions are folded as they come.
        """
        if is_foreign_tick(event):
            return StepResult(None)  # time comes from the one job clock only
        if event.id in self._awaiting_echo:
            self._awaiting_echo.discard(event.id)
            return StepResult(None)
        self.state, error = evolve_or_keep(self.decider, self.state, event)
        if event.producer == self.decider.name:
            return StepResult(None)
        if error is not None:
            decision = refusal(self.decider.name, event, "evolve", error)
        elif not self.decider.interested_in(event):
            return StepResult(None)
        else:
            decision = decide_or_refuse(self.decider, self.state, event)
        decision, emitted = publishable(self.decider.name, event, decision, self.max_event_bytes)
        if not recorded <= {produced.id for produced in emitted}:
            return StepResult(Decision.nothing(
                f"the log holds another decision about {event.type} {event.id} than the one taken now: "
                "the recorded one stands"))
        for produced in emitted:
            self.state, _ = evolve_or_keep(self.decider, self.state, produced)
            self._awaiting_echo.add(produced.id)
        return StepResult(decision, [produced for produced in emitted if produced.id not in recorded])

    def expect_echo(self, event_id: uuid.UUID) -> None:
        """``event_id`` (a decision already evolved into the state) will come back through the stream:
        take it then without evolving it again."""
        self._awaiting_echo.add(event_id)

    def forget_echoes(self) -> None:
        """Drop remembered decision ids (call when their echoes cannot arrive any more)."""
        self._awaiting_echo.clear()
