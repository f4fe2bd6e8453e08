"""``DeciderSession.catch_up``: deciding again, at cold start, an input whose decision the log may hold in
full, in part, or not at all (pure: no servers)."""

from __future__ import annotations

from keel.kernel.decider import DeciderSession, materialise
from tests.factories import health_event
from tests.integration.test_runner_cold_start import EvictOnFailure


def fault():  # type: ignore[no-untyped-def]
    return health_event("n1", status="failed", fatal=True, confidence="high", component="gpu")


def test_nothing_recorded_decides_and_emits_everything() -> None:
    session = DeciderSession(EvictOnFailure(spread=3))
    result = session.catch_up(fault())
    assert len(result.emitted) == 3
    assert session.state.evictions_folded == 3


def test_a_partly_recorded_decision_emits_only_what_the_log_lacks_and_folds_each_event_once() -> None:
    decider = EvictOnFailure(spread=3)
    cause = fault()
    decision = materialise(decider.name, cause, decider.decide(decider.initial_state(), cause))
    session = DeciderSession(decider)
    result = session.catch_up(cause, frozenset({decision[0].id}))
    assert [e.id for e in result.emitted] == [decision[1].id, decision[2].id]
    assert session.observe(decision[0]).decision is None  # the recorded one, folded next, is an echo
    assert session.state.evictions_folded == 3


def test_a_fully_recorded_decision_emits_nothing() -> None:
    decider = EvictOnFailure(spread=2)
    cause = fault()
    decision = materialise(decider.name, cause, decider.decide(decider.initial_state(), cause))
    session = DeciderSession(decider)
    assert session.catch_up(cause, frozenset(e.id for e in decision)).emitted == []
    for event in decision:
        session.observe(event)
    assert session.state.evictions_folded == 2


def test_a_recorded_decision_this_decider_would_not_take_stands() -> None:
    cause = fault()
    old = EvictOnFailure(spread=1)
    recorded = materialise(old.name, cause, old.decide(old.initial_state(), cause.model_copy(
        update={"payload": cause.payload.model_copy(update={"node_id": "n9"})})))
    session = DeciderSession(EvictOnFailure(spread=2))
    result = session.catch_up(cause, frozenset({recorded[0].id}))
    assert result.emitted == [] and "recorded one stands" in (result.decision.reason if result.decision else "")
    assert session.state.evictions_folded == 0
    session.observe(recorded[0])  # folded as it comes
    assert session.state.evictions_folded == 1
