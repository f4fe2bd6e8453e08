"""A decider that raises never stops its service: the kernel records a ``DecisionRefused`` with the error
instead of a decision, keeps its state as it was, goes on with the next input, and a replay reproduces
the refusal exactly."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from keel.events.envelope import Event
from keel.events.types import DecisionRefused, NodeEvictionDecided, NodeHealthChanged
from keel.kernel.decider import DeciderSession, Decision, Proposal
from keel.kernel.replay import ReplayVerifier
from tests.factories import T0, health_event


@dataclass(frozen=True)
class Seen:
    nodes: tuple[str, ...] = ()


class FragileDecider:
    """Evicts a failed node; its rules have two bugs: a detail of "boom" breaks ``decide``, one of "fold"
    breaks ``evolve``."""

    name = "fragile"

    def initial_state(self) -> Seen:
        return Seen()

    def interested_in(self, event: Event) -> bool:
        return isinstance(event.payload, NodeHealthChanged)

    def evolve(self, state: Seen, event: Event) -> Seen:
        p = event.payload
        if isinstance(p, NodeHealthChanged):
            if p.detail == "fold":
                raise KeyError(p.node_id)
            return Seen(state.nodes + (p.node_id,))
        return state

    def decide(self, state: Seen, event: Event) -> Decision:
        p = event.payload
        assert isinstance(p, NodeHealthChanged)
        if p.detail == "boom":
            raise OverflowError("date value out of range")
        return Decision("evict", (Proposal(NodeEvictionDecided(node_id=p.node_id, rung=1, reason="failed",
                                                               expires_at=event.occurred_at + timedelta(minutes=5)),
                                           subject=f"node/{p.node_id}"),))


def inputs() -> list[Event]:
    return [health_event("n1", detail="boom", at=T0), health_event("n2", detail="fold", at=T0 + timedelta(seconds=1)),
            health_event("n3", detail="ok", at=T0 + timedelta(seconds=2))]


def test_a_raising_decide_or_evolve_is_recorded_as_a_refusal_and_the_next_input_is_decided() -> None:
    session = DeciderSession(FragileDecider())
    events = inputs()
    boom, fold, ok = (session.observe(event) for event in events)
    [refused] = boom.emitted
    assert isinstance(refused.payload, DecisionRefused)
    assert (refused.payload.stage, refused.payload.cause_type) == ("decide", "NodeHealthChanged")
    assert refused.payload.error == "OverflowError: date value out of range"
    assert refused.causation_id == events[0].id and refused.producer == "fragile"
    [refused_fold] = fold.emitted
    assert isinstance(refused_fold.payload, DecisionRefused) and refused_fold.payload.stage == "evolve"
    assert "KeyError" in refused_fold.payload.error
    [eviction] = ok.emitted
    assert isinstance(eviction.payload, NodeEvictionDecided) and eviction.payload.node_id == "n3"
    assert session.state.nodes == ("n1", "n3")  # the input the fold could not take changed nothing


def test_a_replay_reproduces_the_refusals_exactly() -> None:
    live = DeciderSession(FragileDecider())
    log = []
    for event in inputs():
        log.append(event)
        log += live.observe(event).emitted
    verifier = ReplayVerifier(FragileDecider())
    for event in log:
        verifier.observe(event)
    report = verifier.finish()
    assert report.clean and (report.decisions_recorded, report.decisions_replayed) == (3, 3)


class Verbose(FragileDecider):
    """Its eviction reason grows with the detail it was given: a big enough input makes a decision the bus
    could never carry (as a restore plan listing every rank of a very large job would)."""

    name = "verbose"

    def decide(self, state: Seen, event: Event) -> Decision:
        p = event.payload
        assert isinstance(p, NodeHealthChanged)
        return Decision("evict", (Proposal(NodeEvictionDecided(node_id=p.node_id, rung=1, reason=p.detail * 1000,
                                                               expires_at=event.occurred_at + timedelta(minutes=5)),
                                           subject=f"node/{p.node_id}"),))


def test_a_decision_too_large_to_publish_is_refused_with_its_size_and_replays_the_same() -> None:
    limit = 256 * 1024
    big = health_event("n1", detail="x" * 300, at=T0)  # a 300,000-character reason
    small = health_event("n2", detail="disk", at=T0 + timedelta(seconds=1))
    live = DeciderSession(Verbose(), max_event_bytes=limit)
    log: list[Event] = []
    for event in (big, small):
        log.append(event)
        log += live.observe(event).emitted
    refused, evicted = log[1], log[3]
    assert isinstance(refused.payload, DecisionRefused) and "over the 262144-byte event limit" in refused.payload.error
    assert "NodeEvictionDecided would be" in refused.payload.error and len(refused.to_json()) < limit
    assert isinstance(evicted.payload, NodeEvictionDecided) and evicted.payload.node_id == "n2"
    verifier = ReplayVerifier(Verbose(), max_event_bytes=limit)
    for event in log:
        verifier.observe(event)
    assert verifier.finish().clean
    # Without a limit (a replay that forgot it) the big decision comes back: the divergence is shown.
    unlimited = ReplayVerifier(Verbose())
    for event in log:
        unlimited.observe(event)
    assert not unlimited.finish().clean
