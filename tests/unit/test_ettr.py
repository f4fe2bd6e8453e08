"""ETTR and incident phases computed from a hand-written log, checked against hand-computed numbers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from keel.controller.ettr import PHASES, compute_ettr
from keel.core.event_types import (
    CheckpointRestorePlanned,
    FaultInjected,
    NodeHeartbeat,
    RankExited,
    RanksRestartRequested,
    RankStarted,
)
from keel.core.events import Event, EventPayload

T0 = datetime(2026, 11, 29, 8, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ev(payload: EventPayload, seconds: float, subject: str = "node/n0", producer: str = "agent") -> Event:
    return Event.create(payload, job_id="j", subject=subject, producer=producer, occurred_at=at(seconds))


def started(seconds: float, generation: int) -> Event:
    return ev(RankStarted(node_id="n0", rank=0, local_rank=0, world_size=1, pid=10 + generation,
                          generation=generation), seconds, "rank/0")


def beat(seconds: float, step: int) -> Event:
    return ev(NodeHeartbeat(node_id="n0", ranks_alive=1, ranks_expected=1, last_step=step), seconds)


def crash_log() -> list[Event]:
    """Steps 0..49 in 100 s; a crash injected at 100 s at step 49; detected 0.5 s later; the restart
    command at 2 s; new ranks at 3 s; the plan restores step 45; stepping again at 10 s; back at step
    49 at 14 s; then 86 more seconds of training."""
    restart = RanksRestartRequested(node_id="n0", generation=1, reason="test", expires_at=at(400))
    return [
        started(0, 0), beat(50, 24), beat(100, 49),
        ev(FaultInjected(kind="crash", node_id="n0", rank=0), 100, producer="keel inject"),
        ev(RankExited(node_id="n0", rank=0, pid=10, generation=0, exit_code=1, classification="user_code",
                      error_type="RuntimeError"), 100.5, "rank/0"),
        ev(restart, 102, producer="controller"),
        started(103, 1),
        ev(CheckpointRestorePlanned(generation=1, step=45, reason="test"), 104, "job/j", "checkpoint-broker"),
        beat(105, 45),  # the restore point itself: not yet stepping
        beat(110, 46), beat(114, 49), beat(200, 90),
    ]


def test_a_crash_incident_is_split_into_its_phases() -> None:
    report = compute_ettr(crash_log())
    assert report is not None and len(report.incidents) == 1
    [incident] = report.incidents
    assert incident.cause == "injected crash on n0" and incident.step_at_fault == 49
    assert incident.restore_step == 45
    phases = {k: v.total_seconds() for k, v in incident.phases(report.ended_at).items()}
    assert phases == {"detection": 0.5, "localisation": 1.5, "failover": 1.0, "restore": 7.0, "recompute": 4.0}
    assert incident.lost(report.ended_at) == timedelta(seconds=14)
    assert report.wall == timedelta(seconds=200)
    assert report.ettr == pytest.approx(1 - 14 / 200)
    assert set(report.lost_by_phase()) == set(PHASES)


def test_an_incident_still_open_is_charged_to_the_end() -> None:
    log = crash_log()[:7]  # stops right after the new ranks started: no progress yet
    report = compute_ettr(log, until=at(130))
    assert report is not None
    [incident] = report.incidents
    assert incident.recovered_at is None and incident.lost(report.ended_at) == timedelta(seconds=30)
    phases = incident.phases(report.ended_at)
    assert phases["restore"] == timedelta(seconds=27) and phases["recompute"] == timedelta(0)
    assert report.ettr == pytest.approx(1 - 30 / 130)


def test_without_an_injection_the_first_failure_signal_starts_the_incident() -> None:
    log = [e for e in crash_log() if e.type != "FaultInjected"]
    report = compute_ettr(log)
    assert report is not None
    [incident] = report.incidents
    assert incident.started_at == at(100.5) and "rank 0 on n0 exited (user_code: RuntimeError)" == incident.cause
    assert incident.phases(report.ended_at)["detection"] == timedelta(0)


def test_no_rank_no_report_and_a_clean_run_is_fully_productive() -> None:
    assert compute_ettr([beat(1, 0)]) is None
    report = compute_ettr([started(0, 0), beat(10, 5), beat(20, 10)])
    assert report is not None and report.incidents == () and report.ettr == 1.0
