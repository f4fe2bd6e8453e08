"""The decider kernel's determinism and the controller's rung-1 rule on an idle node, without any I/O
(the whole ladder on a running job: tests/unit/test_controller.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.events.envelope import Event
from keel.events.types import NodeEvicted, NodeEvictionDecided, NodeHealthChanged, NodeRegistered
from keel.kernel.decider import DeciderSession, decision_id

T0 = datetime(2026, 11, 29, 7, 0, tzinfo=UTC)


def health(node: str, *, status="failed", component="gpu", confidence="high", fatal=True, at=T0, check="xid") -> Event:
    return Event.create(
        NodeHealthChanged(node_id=node, status=status, component=component, check=check,
                          confidence=confidence, is_fatal=fatal, detail="XID 79"),
        job_id="job1", subject=f"node/{node}", producer="inspector", occurred_at=at,
    )


def registered(*nodes: str) -> list[Event]:
    return [Event.create(NodeRegistered(node_id=node, host=node), job_id="job1", subject=f"node/{node}",
                         producer="agent", occurred_at=T0 - timedelta(minutes=1)) for node in nodes]


def session_with(decider: ControllerDecider, *nodes: str) -> DeciderSession:
    """A controller that has seen ``nodes`` register (a health event for a node it never saw is ignored)."""
    session = DeciderSession(decider)
    for event in registered(*nodes):
        session.observe(event)
    return session


def test_fatal_high_confidence_hardware_fault_evicts_with_reason_evidence_and_expiry() -> None:
    decider = ControllerDecider(ControllerPolicy(command_ttl=timedelta(minutes=3)))
    cause = health("n7")
    result = session_with(decider, "n7").observe(cause)
    assert result.decision is not None and "rung 1" in result.decision.reason
    [eviction] = result.emitted
    assert isinstance(eviction.payload, NodeEvictionDecided)
    assert eviction.payload.evidence == [str(cause.id)]
    assert eviction.payload.expires_at == T0 + timedelta(minutes=3)
    assert eviction.causation_id == cause.id and eviction.correlation_id == cause.id
    assert eviction.occurred_at == cause.occurred_at  # decisions never read the clock
    assert eviction.id == decision_id(cause.id, "controller", "NodeEvictionDecided", "node/n7")


def test_same_input_gives_the_same_decision_id_every_time() -> None:
    cause = health("n7")
    first = session_with(ControllerDecider(), "n7").observe(cause).emitted
    second = session_with(ControllerDecider(), "n7").observe(cause).emitted
    assert [e.id for e in first] == [e.id for e in second]
    assert first == second


def test_signals_below_rung_one_do_not_evict() -> None:
    session = session_with(ControllerDecider(), "n1", "n2", "n3", "n4", "n5")
    for event in (
        health("n1", confidence="medium"),
        health("n2", fatal=False),
        health("n3", component="rank", check="heartbeat"),
        health("n4", status="healthy"),
        health("n5", status="degraded"),
    ):
        result = session.observe(event)
        assert result.decision is not None and result.emitted == [], result.decision.reason


def test_no_second_eviction_while_one_is_pending_or_done() -> None:
    session = session_with(ControllerDecider(), "n7")
    first = session.observe(health("n7"))
    assert len(first.emitted) == 1
    again = session.observe(health("n7", at=T0 + timedelta(seconds=5), check="ecc"))
    assert again.emitted == [] and "pending" in again.decision.reason
    evicted = Event.create(
        NodeEvicted(node_id="n7", decision_id=str(first.emitted[0].id), actuator="local", outcome="evicted"),
        job_id="job1", subject="node/n7", producer="actuator-local", occurred_at=T0 + timedelta(seconds=6),
    )
    session.observe(evicted)
    later = session.observe(health("n7", at=T0 + timedelta(seconds=10)))
    assert later.emitted == [] and "already evicted" in later.decision.reason


def test_own_decisions_coming_back_are_not_evolved_twice_or_decided_on() -> None:
    decider = ControllerDecider()
    session = session_with(decider, "n7")
    [eviction] = session.observe(health("n7")).emitted
    state_before = session.state
    echo = session.observe(eviction)
    assert echo.decision is None and session.state == state_before


def test_observe_mode_marks_the_command() -> None:
    [eviction] = session_with(ControllerDecider(ControllerPolicy(observe_only=True)), "n7").observe(health("n7")).emitted
    assert eviction.payload.observe_only is True


def test_registration_is_only_evolved() -> None:
    session = DeciderSession(ControllerDecider())
    event = Event.create(NodeRegistered(node_id="s1", host="h", standby=True), job_id="job1",
                         subject="node/s1", producer="agent", occurred_at=T0)
    result = session.observe(event)
    assert result.emitted == [], result.decision
    assert session.state.job("job1").node("s1").standby is True


def test_a_health_event_for_a_node_never_seen_is_recorded_not_acted_on() -> None:
    result = DeciderSession(ControllerDecider()).observe(health("ghost"))
    assert result.emitted == [] and "unknown node ghost" in result.decision.reason
