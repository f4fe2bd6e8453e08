"""ETTR and incident phases computed from a hand-written log, checked against hand-computed numbers."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CheckpointRestorePlanned,
    DiagnosticsRequested,
    FailSlowConvicted,
    FaultInjected,
    IncidentOpened,
    NodeHeartbeat,
    RankExited,
    RanksRestartRequested,
    RankStarted,
    RestartDecided,
)
from keel.rules.ettr import PHASES, compute_ettr

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


# -- the sliding window, partitioned phases, the controller's decisions, generations -------------


def test_a_window_covering_the_whole_job_equals_the_cumulative_figures() -> None:
    report = compute_ettr(crash_log())
    assert report is not None
    window = report.window(timedelta(hours=1))
    assert window.started_at == at(0) and window.ended_at == at(200)  # clipped to the job's start
    assert window.wall == report.wall and window.lost == report.lost == timedelta(seconds=14)
    assert window.ettr == report.ettr
    assert window.lost_by_phase == report.lost_by_phase()
    assert window.lost_by_incident == ((0, timedelta(seconds=14)),)
    assert (window.generation_changes, window.restart_requests) == (1, 1)


def test_a_window_clips_the_incident_and_its_phases() -> None:
    report = compute_ettr(crash_log())
    assert report is not None
    # The last 95 s: [105, 200]. The incident ran 100..114, restore 103..110, recompute 110..114.
    window = report.window(timedelta(seconds=95))
    assert window.started_at == at(105) and window.wall == timedelta(seconds=95)
    assert window.lost == timedelta(seconds=9)
    assert {k: v.total_seconds() for k, v in window.lost_by_phase.items()} == {
        "detection": 0.0, "localisation": 0.0, "failover": 0.0, "restore": 5.0, "recompute": 4.0}
    assert window.ettr == pytest.approx(1 - 9 / 95)
    # The new generation started at 103 and the restart was requested at 102: before the window.
    assert (window.generation_changes, window.restart_requests) == (0, 0)
    # The last 100 s start exactly at the fault: everything counts.
    whole = report.window(timedelta(seconds=100))
    assert whole.lost == timedelta(seconds=14) and whole.ettr == pytest.approx(1 - 14 / 100)
    assert (whole.generation_changes, whole.restart_requests) == (1, 1)


def test_a_window_after_the_recovery_is_fully_productive() -> None:
    report = compute_ettr(crash_log())
    assert report is not None
    window = report.window(timedelta(seconds=80))  # [120, 200]
    assert window.lost_by_incident == () and window.lost == timedelta(0) and window.ettr == 1.0
    assert all(v == timedelta(0) for v in window.lost_by_phase.values())
    with pytest.raises(ValueError, match="longer than 0 s"):
        report.window(timedelta(0))


def test_a_window_over_an_open_incident_charges_it_to_the_end() -> None:
    report = compute_ettr(crash_log()[:7], until=at(130))  # ranks restarted at 103, no progress since
    assert report is not None
    window = report.window(timedelta(seconds=20))  # [110, 130]
    assert window.lost == timedelta(seconds=20) and window.ettr == 0.0
    assert window.lost_by_phase["restore"] == timedelta(seconds=20)


def test_the_controllers_first_decision_ends_localisation() -> None:
    incident_id = uuid.uuid4()
    diagnose = ev(DiagnosticsRequested(round=0, nodes=["n0"], checks=["intra_node_all_to_all"], timeout_s=30,
                                       expires_at=at(400), reason="rung 2"), 101, "job/j", "controller")
    restart = ev(RestartDecided(incident_id=str(incident_id), rung=2, generation=1, restart_nodes=["n0"],
                                reason="passed"), 101.5, "job/j", "controller")
    log = crash_log()
    log[5:5] = [diagnose, restart]  # before the RanksRestartRequested at 102
    report = compute_ettr(log)
    assert report is not None
    phases = {k: v.total_seconds() for k, v in report.incidents[0].phases(report.ended_at).items()}
    assert phases == {"detection": 0.5, "localisation": 0.5, "failover": 2.0, "restore": 7.0, "recompute": 4.0}


def test_phases_stay_contiguous_when_a_mark_is_missing_or_late() -> None:
    # No failure signal at all (the ranks were stopped by the agent), and the restart decided at 101.
    log = [e for e in crash_log() if e.type != "RankExited"]
    log.insert(4, ev(RestartDecided(incident_id=str(uuid.uuid4()), rung=2, generation=1, restart_nodes=["n0"],
                                    reason="hang"), 101, "job/j", "controller"))
    report = compute_ettr(log)
    assert report is not None
    [incident] = report.incidents
    phases = incident.phases(report.ended_at)
    assert {k: v.total_seconds() for k, v in phases.items()} == {
        "detection": 1.0, "localisation": 0.0, "failover": 2.0, "restore": 7.0, "recompute": 4.0}
    assert sum(phases.values(), timedelta(0)) == incident.lost(report.ended_at)
    # A failure signal that arrives after the decision: detection ends at the decision.
    late = crash_log()
    late[4] = ev(late[4].payload, 102.5, "rank/0")  # the RankExited now after the command at 102
    late[4], late[5] = late[5], late[4]
    report = compute_ettr(late)
    assert report is not None
    phases = report.incidents[0].phases(report.ended_at)
    assert phases["detection"] == timedelta(seconds=2) and phases["localisation"] == timedelta(0)
    assert sum(phases.values(), timedelta(0)) == timedelta(seconds=14)


def test_generation_changes_and_restart_requests_are_counted_once_each() -> None:
    second = RanksRestartRequested(node_id="n1", generation=1, reason="test", expires_at=at(400))
    log = crash_log()
    log.insert(6, ev(second, 102.2, "node/n1", "controller"))  # the same restart, another node: one request
    log.append(started(201, 1))  # another rank of generation 1: not a change
    report = compute_ettr(log)
    assert report is not None
    assert report.generations == ((at(103), 1),) and report.generation == 1
    assert report.restart_requests == ((at(102), 1),)
    assert report.to_json()["generation_changes"] == 1 and report.to_json()["restart_requests"] == 1


def test_only_a_node_of_the_new_generation_says_the_job_is_back() -> None:
    """A heartbeat from a node that has not restarted yet still carries its old ranks' step: it must not
    count as recovered (it did in a live run: 0.75 s lost for a 24 s rung-1 incident)."""
    log = crash_log()
    stale = ev(NodeHeartbeat(node_id="n1", ranks_alive=0, ranks_expected=1, last_step=60), 103.5, "node/n1")
    log.insert(log.index(next(e for e in log if e.type == "CheckpointRestorePlanned")), stale)
    [incident] = compute_ettr(log).incidents
    assert incident.marks["resumed"] == at(110) and incident.marks["recovered"] == at(114)


def test_a_planned_restart_onto_a_new_code_version_is_lost_time_too() -> None:
    # The controller opens a code_update incident at 100 s (step 49); the agent stops the ranks (no failure
    # signal: stopped by the agent), the restart command, new ranks, a restore of step 49, stepping at 106 s.
    restart = RanksRestartRequested(node_id="n0", generation=1, reason="rollout", expires_at=at(400))
    log = [started(0, 0), beat(50, 24), beat(100, 49),
           ev(IncidentOpened(kind="code_update", generation=0, last_step=49, fingerprint="code_update/v-1",
                             reason="code rollout: urgent deploy of v-1"), 100, "job/j", "controller"),
           ev(restart, 100, producer="controller"),
           ev(RankExited(node_id="n0", rank=0, pid=10, generation=0, exit_code=None, signal="SIGTERM",
                     classification="stopped_by_agent"), 100.5, "rank/0"),
           started(101, 1),
           ev(CheckpointRestorePlanned(generation=1, step=49, reason="test"), 102, "job/j", "checkpoint-broker"),
           beat(106, 50), beat(200, 95)]
    report = compute_ettr(log)
    assert report is not None
    [incident] = report.incidents
    assert incident.cause.startswith("planned restart: code rollout") and incident.step_at_fault == 49
    assert incident.lost(report.ended_at) == timedelta(seconds=6)
    assert report.ettr == pytest.approx(1 - 6 / 200)


def test_a_real_hang_is_charged_from_when_the_rank_got_stuck_not_from_its_detection() -> None:
    """No FaultInjected: the agent's collective_stuck says rank 0 had waited 5.2 s inside its all-reduce when it
    fired at 105.2 s, so the incident starts at 100 s and its detection phase is those 5.2 s; back at step 49
    at 110 s: 10 s lost."""
    from keel.events.types import NodeHealthChanged

    restart = RanksRestartRequested(node_id="n0", generation=1, reason="test", expires_at=at(400))
    log = [
        started(0, 0), beat(50, 24), beat(100, 49),
        ev(NodeHealthChanged(node_id="n0", component="rank", check="collective_stuck", status="failed",
                             confidence="medium", is_fatal=False, detail="stuck",
                             evidence={"key": "rank0", "waited_s": 5.2, "collective": "dp_all_reduce"}), 105.2),
        ev(restart, 106, producer="controller"),
        started(107, 1), beat(110, 49), beat(115, 50), beat(200, 90),
    ]
    report = compute_ettr(log)
    assert report is not None
    [incident] = report.incidents
    assert incident.started_at == at(100) and "collective_stuck" in incident.cause
    phases = incident.phases(report.ended_at)
    assert phases["detection"] == timedelta(seconds=5.2) and incident.lost(report.ended_at) == timedelta(seconds=10)


def test_a_hang_signal_never_reaches_back_before_the_job_started() -> None:
    from keel.events.types import NodeHealthChanged

    log = [started(10, 0), ev(NodeHealthChanged(node_id="n0", component="rank", check="no_progress", status="failed",
                                                confidence="medium", is_fatal=False, detail="silent",
                                                evidence={"silent_for_s": 300.0}), 40)]
    report = compute_ettr(log)
    assert report is not None and report.incidents[0].started_at == at(10)


def test_an_injected_fault_that_waits_for_its_step_is_charged_from_when_it_fired() -> None:
    """FaultInjected at 90 s with at_step: the crash fires at 100 s (its exit at 100.5 s); the 10 s the
    ranks trained meanwhile are not lost."""
    log = crash_log()
    log.insert(3, ev(FaultInjected(kind="crash", node_id="n0", rank=0, params={"at_step": 49}), 90, producer="keel inject"))
    del log[4]  # the immediate injection at 100 s
    report = compute_ettr(log)
    assert report is not None
    [incident] = report.incidents
    assert incident.started_at == at(100.5) and incident.cause.startswith("rank 0 on n0 exited")


def test_the_job_is_back_when_it_passed_the_step_not_at_the_next_heartbeat() -> None:
    """Heartbeats at 110 s (step 46) and 115 s (step 56): step 49 was passed 1.5 s after the first, at a
    steady 2 steps/s, not 5 s after it."""
    log = [e for e in crash_log() if not (e.type == "NodeHeartbeat" and e.occurred_at > at(105))]
    log += [beat(110, 46), beat(115, 56), beat(200, 90)]
    report = compute_ettr(log)
    assert report is not None
    [incident] = report.incidents
    assert incident.recovered_at == at(111.5) and incident.lost(report.ended_at) == timedelta(seconds=11.5)


def test_a_stall_that_cleared_itself_ends_when_the_job_stepped_past_it() -> None:
    """A save outside its phase stalls rank 0 for 7 s from 100 s; collective_stuck fires at 105.2 s; the job
    steps past step 49 at 108 s (a heartbeat at step 52); the controller resolves the incident at rung 0 at
    110 s. Lost: 100 s -> 108 s, and nothing after it (no restart ever came)."""
    from keel.events.types import IncidentResolved, NodeHealthChanged

    stuck = NodeHealthChanged(node_id="n0", component="rank", check="collective_stuck", status="failed",
                              confidence="medium", is_fatal=False, detail="stuck",
                              evidence={"key": "rank0", "waited_s": 5.2, "collective": "dp_all_reduce"})
    resolved = IncidentResolved(incident_id="i", outcome="recovered", rung=0, generation=0, reason="cleared itself")
    log = [started(0, 0), beat(50, 24), beat(100, 49), ev(stuck, 105.2), beat(106, 49), beat(108, 52),
           ev(resolved, 110, "job/j", "controller"), beat(200, 90)]
    report = compute_ettr(log)
    assert report is not None
    [incident] = report.incidents
    assert incident.recovered_at == at(108) and incident.lost(report.ended_at) == timedelta(seconds=8)
    assert incident.phases(report.ended_at)["detection"] == timedelta(seconds=5.2)
    assert report.ettr == pytest.approx(1 - 8 / 200)
    # Without the controller's rung-0 resolution the job stepping on proves nothing (a crash incident's
    # survivors may report a step completed before the fault): the incident stays open to the end.
    unresolved = compute_ettr([e for e in log if e.type != "IncidentResolved"])
    assert unresolved is not None and unresolved.incidents[0].recovered_at is None


# -- overhead outside incidents: checkpoint blocking, fail-slow steps before a conviction --------------------


def ckpt_beat(seconds: float, step: int, blocked_s: float | None, node: str = "n0", generation: int = 0,
              step_time_s: float | None = None) -> Event:
    return ev(NodeHeartbeat(node_id=node, ranks_alive=1, ranks_expected=1, last_step=step, generation=generation,
                            checkpoint_blocking_s=blocked_s, step_time_p50_s=step_time_s), seconds, f"node/{node}")


def test_checkpoint_blocking_is_charged_as_the_slowest_nodes_growth() -> None:
    # Two nodes block 1 s and 1.5 s per 50 s: a synchronous job waits for the slower one, so 1.5 s per 50 s.
    log = [started(0, 0),
           ckpt_beat(50, 24, 1.0, "n0"), ckpt_beat(50, 24, 1.5, "n1"),
           ckpt_beat(100, 49, 2.0, "n0"), ckpt_beat(100, 49, 3.0, "n1"),
           ckpt_beat(150, 74, 3.0, "n0"), ckpt_beat(150, 74, 4.5, "n1"),
           ckpt_beat(200, 99, 4.0, "n0"), ckpt_beat(200, 99, 6.0, "n1")]
    report = compute_ettr(log)
    assert report is not None and report.incidents == ()
    assert report.lost_by_overhead()["checkpoint"] == pytest.approx(timedelta(seconds=6.0), abs=timedelta(microseconds=2))
    assert report.lost == report.lost_by_overhead()["checkpoint"] and report.incident_lost == timedelta(0)
    assert report.ettr == pytest.approx(1 - 6 / 200)
    # The last 100 s hold the growth of [100, 200]: 3 s (the first heartbeats' is spread over [0, 50]).
    window = report.window(timedelta(seconds=100))
    assert window.lost_by_overhead["checkpoint"].total_seconds() == pytest.approx(3.0)
    assert window.ettr == pytest.approx(1 - 3 / 100)
    data = report.to_json()
    assert data["overhead_s"]["checkpoint"] == pytest.approx(6.0) and data["lost_s"] == pytest.approx(6.0)
    assert data["incident_lost_s"] == 0.0


def test_checkpoint_blocking_during_an_incident_is_the_incidents_and_a_new_generation_counts_afresh() -> None:
    restart = RanksRestartRequested(node_id="n0", generation=1, reason="test", expires_at=at(400))
    log = [started(0, 0), ckpt_beat(50, 24, 1.0), ckpt_beat(100, 49, 2.0),
           ev(FaultInjected(kind="crash", node_id="n0", rank=0), 100, producer="keel inject"),
           ev(RankExited(node_id="n0", rank=0, pid=10, generation=0, exit_code=1, classification="user_code"),
              100.5, "rank/0"),
           ev(restart, 102, producer="controller"), started(103, 1),
           ev(CheckpointRestorePlanned(generation=1, step=45, reason="test"), 104, "job/j", "checkpoint-broker"),
           ckpt_beat(110, 46, 0.3, generation=1),  # stepping again: the incident's (it is open)
           ckpt_beat(114, 49, 0.5, generation=1),  # back at step 49: the incident ends here
           ckpt_beat(164, 74, 1.5, generation=1)]  # 1 s more, after the recovery: charged
    report = compute_ettr(log)
    assert report is not None
    [incident] = report.incidents
    assert incident.lost(report.ended_at) == timedelta(seconds=14)
    assert report.lost_by_overhead()["checkpoint"].total_seconds() == pytest.approx(3.0)  # 1 + 1 + 1
    assert report.lost.total_seconds() == pytest.approx(17.0)


def test_a_total_that_shrinks_without_a_new_generation_is_a_new_count() -> None:
    # A rank restarted in place counts from 0 again: 2.0, then a new count first seen at 0.5 (all of it
    # grown since the last heartbeat), then 1.0 more of it; a heartbeat older than one seen is no news.
    log = [started(0, 0), ckpt_beat(50, 24, 2.0), ckpt_beat(100, 49, 0.5), ckpt_beat(150, 74, 1.5),
           ckpt_beat(120, 60, 0.9)]
    report = compute_ettr(log)
    assert report is not None
    assert report.lost_by_overhead()["checkpoint"].total_seconds() == pytest.approx(3.5)


def fail_slow_log(baseline: bool = True) -> list[Event]:
    """Steps of 0.1 s until 300 s, 0.2 s after (``baseline`` False: 0.2 s from the start, no faster span);
    the analyzer convicts n1 at 600 s (5 rounds of 60 s: the slow span is [300, 600]); the controller opens
    its incident and evicts; the new generation is back at step 6000 at 611 s."""
    restart = RanksRestartRequested(node_id="n0", generation=1, reason="evict n1", expires_at=at(900))
    fast_from = 0 if baseline else 300
    log = [started(0, 0)]
    for t in range(10, 601, 10):
        log.append(ckpt_beat(t, 10 * t, None, step_time_s=0.1 if fast_from <= t < 300 else 0.2))
    log += [ev(FailSlowConvicted(group_kind="node", group_nodes=["n1"], rounds=5, flags=4, interval_s=60.0,
                                 reason="n1 is slow"), 600, "job/j", "analyzer"),
            ev(IncidentOpened(kind="fail_slow", node_id="n1", generation=0, last_step=6000,
                              fingerprint="fail_slow/n1", reason="rung 3: fail-slow: evict n1"), 600, "job/j",
               "controller"),
            ev(restart, 601, producer="controller"), started(603, 1),
            ev(CheckpointRestorePlanned(generation=1, step=5990, reason="test"), 604, "job/j", "checkpoint-broker"),
            ckpt_beat(606, 5995, None, generation=1), ckpt_beat(612, 6001, None, generation=1),
            ckpt_beat(700, 6900, None, generation=1)]
    return log


def test_the_slow_steps_before_a_fail_slow_conviction_are_charged_and_the_eviction_is_an_incident() -> None:
    report = compute_ettr(fail_slow_log())
    assert report is not None
    [charge] = [o for o in report.overheads if o.kind == "fail_slow"]
    # [300, 600] at half speed: 150 s lost; healthy 0.1 s from [0, 300), degraded 0.2 s in [300, 600].
    assert (charge.started_at, charge.ended_at) == (at(300), at(600))
    assert charge.lost == timedelta(seconds=150) and "0.2 s against 0.1 s" in charge.detail
    [incident] = report.incidents
    assert incident.cause.startswith("fail-slow eviction: rung 3") and incident.started_at == at(600)
    # Back at step 6000 at 611 s (interpolated between the heartbeats at 606 s, step 5995, and 612 s, 6001).
    assert incident.lost(report.ended_at) == timedelta(seconds=11)
    assert report.lost == timedelta(seconds=161) and report.ettr == pytest.approx(1 - 161 / 700)
    window = report.window(timedelta(seconds=250))  # [450, 700]: half the slow span
    assert window.lost_by_overhead["fail_slow"] == timedelta(seconds=75)
    assert report.to_json()["fail_slow"][0]["lost_s"] == 150.0


def test_the_series_ends_on_the_report_and_its_window_and_charges_each_instant_what_was_lost_by_then() -> None:
    report = compute_ettr(crash_log())  # [0, 200]; the incident lost 100..114
    assert report is not None
    series = report.series(5, timedelta(seconds=95))  # at 0, 50, 100, 150, 200
    assert [p.at for p in series] == [at(0), at(50), at(100), at(150), at(200)]
    assert series[-1].cumulative == report.ettr and series[-1].window == report.window(timedelta(seconds=95)).ettr
    assert [p.cumulative for p in series[:3]] == [1.0, 1.0, 1.0]  # nothing lost before the fault
    assert series[3].cumulative == pytest.approx(1 - 14 / 150)
    assert series[3].window == pytest.approx(1 - 14 / 95)  # [55, 150] holds the whole incident
    slow = compute_ettr(fail_slow_log())  # 150 s of fail-slow overhead spread over [300, 600], then 11 s
    assert slow is not None
    assert slow.lost_between(slow.started_at, slow.ended_at) == slow.lost
    [point] = [p for p in slow.series(8, timedelta(seconds=100)) if p.at == at(400)]
    assert point.cumulative == pytest.approx(1 - 50 / 400) and point.window == pytest.approx(1 - 50 / 100)
    with pytest.raises(ValueError, match="at least 2 points"):
        report.series(1, timedelta(hours=1))
    with pytest.raises(ValueError, match="longer than 0 s"):
        report.series(10, timedelta(0))


def test_a_fail_slow_conviction_without_a_baseline_is_not_charged_and_says_why() -> None:
    report = compute_ettr(fail_slow_log(baseline=False))
    assert report is not None
    [charge] = [o for o in report.overheads if o.kind == "fail_slow"]
    # Slow from the start: the span before 300 s was no faster (0.2 s), so nothing is charged.
    assert charge.lost == timedelta(0)
    only_slow = [e for e in fail_slow_log() if not (e.type == "NodeHeartbeat" and e.occurred_at < at(300))]
    report = compute_ettr(only_slow)
    assert report is not None
    [charge] = [o for o in report.overheads if o.kind == "fail_slow"]
    assert charge.lost == timedelta(0) and "no baseline" in charge.detail


def test_the_event_types_it_reads_give_the_same_report_as_the_whole_log() -> None:
    from keel.events.types import ApprovalRequested
    from keel.rules.ettr import INPUT_TYPES
    noise = ev(ApprovalRequested(incident_id="x", action="evict", reason="r", expires_at=at(900)), 650, "job/j",
               "controller")
    for log in (fail_slow_log() + [noise], crash_log()):
        whole = compute_ettr(sorted(log, key=lambda e: e.occurred_at))
        assert whole is not None
        read = compute_ettr([e for e in log if e.type in INPUT_TYPES], until=whole.ended_at)
        assert read == whole


def test_an_injected_slow_fault_opens_no_incident_and_starts_the_slow_span() -> None:
    # Injected at 400 s (the steps only got slower from 300 s by the log's own step times: the injection
    # says when it began): [400, 600] at 0.2 s against 0.1 s before is 100 s lost; no incident before 600 s.
    log = fail_slow_log()
    log.insert(next(i for i, e in enumerate(log) if e.occurred_at > at(400)),
               ev(FaultInjected(kind="slow", node_id="n1", params={"fraction": 0.5}), 400, producer="keel inject"))
    report = compute_ettr(log)
    assert report is not None
    [charge] = [o for o in report.overheads if o.kind == "fail_slow"]
    assert (charge.started_at, charge.lost) == (at(400), timedelta(seconds=100))
    [incident] = report.incidents
    assert incident.started_at == at(600) and incident.cause.startswith("fail-slow eviction")


def test_each_generation_is_charged_its_own_slowest_node() -> None:
    # Generation 0: n1 the slowest (4 s). After a restart (n1 replaced by s0) generation 1 counts afresh: its
    # slowest node, n0 at 1 s, is charged, not hidden under n1's old 4 s.
    restart = RanksRestartRequested(node_id="n0", generation=1, reason="test", expires_at=at(400))
    log = [started(0, 0), ckpt_beat(50, 24, 1.0, "n0"), ckpt_beat(50, 24, 4.0, "n1"),
           ev(FaultInjected(kind="crash", node_id="n1", rank=0), 100, producer="keel inject"),
           ev(restart, 101, producer="controller"), started(102, 1),
           ckpt_beat(110, 30, 0.0, "n0", generation=1), ckpt_beat(110, 30, 0.0, "s0", generation=1),
           ckpt_beat(160, 60, 1.0, "n0", generation=1), ckpt_beat(160, 60, 0.5, "s0", generation=1)]
    report = compute_ettr(log)
    assert report is not None
    [incident] = report.incidents
    assert incident.recovered_at == at(110)
    assert report.lost_by_overhead()["checkpoint"].total_seconds() == pytest.approx(5.0)


def test_a_second_conviction_charges_after_the_first_against_its_baseline() -> None:
    # The controller declined the first conviction (no incident): the analyzer convicts again at 700 s. Its
    # span [600, 700] is charged against the healthy 0.1 s measured first, not the slow steps before it.
    log = [e for e in fail_slow_log() if e.occurred_at < at(600) or e.type == "FailSlowConvicted"]
    for t in range(610, 701, 10):
        log.append(ckpt_beat(t, 10 * t, None, step_time_s=0.2))
    log.append(ev(FailSlowConvicted(group_kind="node", group_nodes=["n1"], rounds=5, flags=5, interval_s=60.0,
                                    reason="n1 is slow"), 700, "job/j", "analyzer"))
    report = compute_ettr(log)
    assert report is not None and report.incidents == ()
    first, second = [o for o in report.overheads if o.kind == "fail_slow"]
    assert (first.started_at, first.ended_at, first.lost) == (at(300), at(600), timedelta(seconds=150))
    assert (second.started_at, second.ended_at, second.lost) == (at(600), at(700), timedelta(seconds=50))
