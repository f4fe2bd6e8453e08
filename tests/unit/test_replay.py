"""Replay verification on in-memory logs: clean when the code is unchanged, a readable diff when not."""

from __future__ import annotations

from datetime import timedelta

from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.kernel.decider import DeciderSession
from keel.kernel.replay import verify
from tests.unit.test_decider_and_controller import T0, health, registered


def recorded_log(policy: ControllerPolicy) -> list:
    """What a live run would have written: inputs followed by the decisions they caused."""
    session = DeciderSession(ControllerDecider(policy))
    log = []
    for _index, event in enumerate(
        [*registered(*(f"n{i}" for i in range(20))), health("n1"), health("n2", confidence="low"),
         health("n3", at=T0 + timedelta(seconds=3)), health("n1")]
    ):
        log.append(event)
        log.extend(session.observe(event).emitted)
    return log


def test_replay_of_an_unchanged_policy_is_clean() -> None:
    log = recorded_log(ControllerPolicy())
    report = verify(ControllerDecider(ControllerPolicy()), log)
    assert report.clean, [d.describe() for d in report.divergences]
    assert report.decisions_recorded == report.decisions_replayed == 2
    assert report.events_folded == len(log)


def test_changed_policy_shows_the_changed_field() -> None:
    log = recorded_log(ControllerPolicy(command_ttl=timedelta(minutes=5)))
    report = verify(ControllerDecider(ControllerPolicy(command_ttl=timedelta(minutes=10))), log)
    assert not report.clean
    assert {d.kind for d in report.divergences} == {"changed"}
    text = report.divergences[0].describe()
    assert "payload.expires_at" in text and "07:05:00" in text and "07:10:00" in text


def test_a_decision_the_log_lacks_is_missing_and_one_it_has_extra_is_unexpected() -> None:
    log = recorded_log(ControllerPolicy())
    decisions = [e for e in log if e.producer == "controller"]
    without_first = [e for e in log if e.id != decisions[0].id]
    missing = verify(ControllerDecider(), without_first)
    assert [d.kind for d in missing.divergences] == ["missing"]
    assert "the log does not have it" in missing.divergences[0].describe()

    inputs_only = [e for e in log if e.producer != "controller"]
    forged = inputs_only + [decisions[0].model_copy(update={"id": decisions[0].id.__class__(int=decisions[0].id.int ^ 1)})]
    unexpected = verify(ControllerDecider(), forged)
    assert sorted(d.kind for d in unexpected.divergences) == ["missing", "missing", "unexpected"]
