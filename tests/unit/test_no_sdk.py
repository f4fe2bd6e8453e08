"""A job whose ranks never report through the SDK (pure): the controller resolves its incident on process
liveness after ``process_settle_interval``, and ETTR measures it on process liveness too, labelled
process-level. Jobs that report through the SDK, and logs of agents older than heartbeat v4, keep their
step-based rules."""

from __future__ import annotations

from datetime import timedelta

import pytest

from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.events.envelope import Event, decode_event
from keel.events.types import (
    CLOCK_PRODUCER,
    IncidentResolved,
    NodeHeartbeat,
    RankExited,
    RanksRestartRequested,
    RankStarted,
    TimerTicked,
)
from keel.kernel.replay import verify
from keel.reports.incidents import IncidentSummary, JobEttr, ettr_json, format_ettr, format_incidents, job_ettr
from keel.rules.ettr import PROCESS_LEVEL_NOTE, compute_ettr
from tests.unit.test_controller import Job, of
from tests.unit.test_ettr import at, crash_log, ev

SETTLE = timedelta(seconds=5)


# -- the controller ------------------------------------------------------------------------------------


class NoSdkJob(Job):
    """Two nodes of one rank each, whose agents see processes but no SDK report."""

    def __init__(self, reporting: int | None = 0, settle: timedelta = SETTLE) -> None:
        self.reporting = reporting
        super().__init__(nodes=2, per_node=1, standbys=0, first_step=-1,
                         policy=ControllerPolicy(process_settle_interval=settle, node_silence_timeout=timedelta(hours=1)))

    def heartbeats(self, step: int = -1, nodes: list[str] | None = None, alive: int = 1) -> list[Event]:
        out: list[Event] = []
        for node in nodes or self.nodes:
            out += self.feed(NodeHeartbeat(node_id=node, ranks_alive=alive, ranks_expected=1, last_step=step,
                                           generation=self.generation, ranks_reporting=self.reporting), f"node/{node}")
        return out

    def restarted(self) -> list[Event]:
        """Rank 1 is SIGKILLed; the controller restarts in place; both nodes start generation 1."""
        out = self.crash("n1", 1, classification="user_code", err="Killed")
        [decided] = of(out, "RestartDecided")
        self.generation = decided.payload.generation
        for i, node in enumerate(self.nodes):
            out += self.feed(RankStarted(node_id=node, rank=i, local_rank=0, world_size=2, pid=300 + i,
                                         generation=self.generation), f"rank/{i}", correlation=decided.correlation_id)
        return out

    def v2_tick(self, after_s: float) -> list[Event]:
        self.now += timedelta(seconds=after_s)
        return self.feed(TimerTicked(now=self.now, interval_s=1.0), "clock/j", producer=CLOCK_PRODUCER, dt=0)


def test_a_job_without_the_sdk_is_resolved_once_every_rank_ran_for_the_settle_interval() -> None:
    job = NoSdkJob()
    job.restarted()
    assert not of(job.heartbeats(), "IncidentResolved")  # every rank of generation 1 alive: settling
    assert not of(job.tick(4.0), "IncidentResolved")
    out = job.tick(1.0)
    [resolved] = of(out, "IncidentResolved")
    assert resolved.payload.outcome == "recovered" and resolved.payload.measure == "process"
    assert resolved.payload.generation == 1 and "Process-level" in resolved.payload.reason
    assert "hangs would count as recovered" in resolved.payload.reason
    assert job.session.state.job("job1").incident is None
    report = verify(ControllerDecider(ControllerPolicy(process_settle_interval=SETTLE,
                                                       node_silence_timeout=timedelta(hours=1))), job.log)
    assert report.clean, [d.describe() for d in report.divergences]


def test_the_settle_interval_counts_from_the_tick_after_the_heartbeat_on_the_recorded_clock() -> None:
    job = NoSdkJob()
    job.v2_tick(1.0)
    job.restarted()
    job.heartbeats()
    assert job.session.state.job("job1").incident.processes_up_pending
    job.v2_tick(1.0)  # dates it: up since this tick
    assert not of(job.v2_tick(4.9), "IncidentResolved")
    assert of(job.v2_tick(0.2), "IncidentResolved")[0].payload.measure == "process"


def test_every_node_of_the_new_generation_must_be_heard_with_all_ranks_alive() -> None:
    job = NoSdkJob()
    job.restarted()
    job.heartbeats(nodes=["n0"])
    assert not of(job.tick(30.0), "IncidentResolved"), "n1 was not heard running generation 1"
    job.heartbeats(nodes=["n1"], alive=0)
    assert not of(job.tick(30.0), "IncidentResolved"), "n1's rank is not alive"
    job.heartbeats(nodes=["n1"])
    assert not of(job.tick(1.0), "IncidentResolved")
    assert of(job.tick(5.0), "IncidentResolved")


def test_a_rank_found_dead_while_settling_starts_the_settle_interval_again() -> None:
    job = NoSdkJob()
    job.restarted()
    job.heartbeats()
    job.tick(3.0)
    job.heartbeats(nodes=["n0"], alive=0)
    assert not of(job.tick(3.0), "IncidentResolved")
    job.heartbeats(nodes=["n0"])
    assert not of(job.tick(4.0), "IncidentResolved")
    assert of(job.tick(1.0), "IncidentResolved")


def test_a_heartbeat_of_the_old_generation_does_not_count() -> None:
    job = NoSdkJob()
    job.restarted()
    job.generation = 0  # a late heartbeat of the generation that failed
    job.heartbeats()
    assert not of(job.tick(60.0), "IncidentResolved")


@pytest.mark.parametrize("reporting", [1, None], ids=["sdk", "agent-before-v4"])
def test_a_job_that_reports_through_the_sdk_or_an_old_agent_waits_for_a_step_as_before(reporting: int | None) -> None:
    job = NoSdkJob(reporting=reporting)
    job.restarted()
    job.heartbeats()
    assert not of(job.tick(60.0), "IncidentResolved")
    [resolved] = of(job.heartbeats(step=3), "IncidentResolved")
    assert resolved.payload.measure == "step" and "stepping again" in resolved.payload.reason


def test_a_process_settle_interval_is_read_from_the_settings() -> None:
    from keel.controller.adapter import decider_from_settings
    from keel.infra.config import Settings

    settings = Settings.model_validate({"controller": {"process_settle_interval": "12s"}})
    assert decider_from_settings(settings).policy.process_settle_interval == timedelta(seconds=12)
    with pytest.raises(ValueError, match="process_settle_interval"):
        Settings.model_validate({"controller": {"process_settle_interval": "twelve"}})


# -- ETTR ----------------------------------------------------------------------------------------------


def start(seconds: float, rank: int, generation: int) -> Event:
    return ev(RankStarted(node_id=f"n{rank}", rank=rank, local_rank=0, world_size=2, pid=10 * generation + rank,
                          generation=generation), seconds, f"rank/{rank}")


def hb(seconds: float, node: int, generation: int, alive: int = 1, reporting: int | None = 0, step: int = -1) -> Event:
    return ev(NodeHeartbeat(node_id=f"n{node}", ranks_alive=alive, ranks_expected=1, last_step=step,
                            generation=generation, ranks_reporting=reporting), seconds, f"node/n{node}")


def exited(seconds: float, rank: int, generation: int, classification: str = "infrastructure") -> Event:
    return ev(RankExited(node_id=f"n{rank}", rank=rank, pid=1, generation=generation, exit_code=None,
                         signal="SIGKILL", classification=classification), seconds, f"rank/{rank}")  # type: ignore[arg-type]


def no_sdk_log(reporting: int | None = 0) -> list[Event]:
    """Two ranks from 0 s; rank 1 killed at 100 s; the restart command at 102 s; generation 1 starts at
    103 and 103.5 s; both nodes heard with their rank alive at 105 s; the log ends at 200 s."""
    restart = RanksRestartRequested(node_id="n0", generation=1, reason="test", expires_at=at(400))
    return [start(0, 0, 0), start(0.2, 1, 0), hb(50, 0, 0, reporting=reporting), hb(50, 1, 0, reporting=reporting),
            exited(100, 1, 0), ev(restart, 102, "node/n0", "controller"),
            start(103, 0, 1), start(103.5, 1, 1), hb(105, 0, 1, reporting=reporting),
            hb(105.2, 1, 1, reporting=reporting), hb(200, 0, 1, reporting=reporting)]


def test_ettr_of_a_job_without_the_sdk_counts_from_process_liveness_and_says_so() -> None:
    report = compute_ettr(no_sdk_log())
    assert report is not None and report.measure == "process" and report.note == PROCESS_LEVEL_NOTE
    [incident] = report.incidents
    assert incident.measure == "process" and incident.recovered_at == at(103.5)
    phases = {k: v.total_seconds() for k, v in incident.phases(report.ended_at).items()}
    assert phases == {"detection": 0.0, "localisation": 2.0, "failover": 1.0, "restore": 0.5, "recompute": 0.0}
    assert report.lost == timedelta(seconds=3.5) and report.ettr == pytest.approx(1 - 3.5 / 200)
    body = report.to_json()
    assert body["measure"] == "process" and "coarser" in body["note"] and body["incidents"][0]["measure"] == "process"


def test_the_recovery_is_the_latest_start_whatever_the_log_order() -> None:
    log = no_sdk_log()
    log[6], log[7] = log[7], log[6]  # rank 1's start (103.5 s) recorded before rank 0's (103 s)
    report = compute_ettr(log)
    assert report is not None and report.incidents[0].recovered_at == at(103.5)


def test_a_new_generation_that_dies_before_it_is_seen_running_has_not_recovered() -> None:
    log = no_sdk_log()[:8] + [exited(104, 0, 1)]  # generation 1 dies before any heartbeat saw it running
    restart = RanksRestartRequested(node_id="n0", generation=2, reason="test", expires_at=at(400))
    log += [hb(105, 0, 1, alive=0), ev(restart, 106, "node/n0", "controller"), start(110, 0, 2), start(110.5, 1, 2),
            hb(112, 0, 2), hb(112, 1, 2), hb(200, 0, 2)]
    report = compute_ettr(log)
    assert report is not None
    [incident] = report.incidents  # the second failure joined the first incident
    assert incident.recovered_at == at(110.5) and report.lost == timedelta(seconds=10.5)


def test_without_the_heartbeat_confirming_it_the_incident_stays_open() -> None:
    report = compute_ettr(no_sdk_log()[:8], until=at(150))
    assert report is not None and report.incidents[0].recovered_at is None
    assert report.lost == timedelta(seconds=50) and report.measure == "process"


@pytest.mark.parametrize("reporting", [1, None], ids=["sdk", "agent-before-v4"])
def test_a_job_reporting_through_the_sdk_keeps_its_step_accounting(reporting: int | None) -> None:
    log = no_sdk_log(reporting=reporting)
    report = compute_ettr(log)
    assert report is not None and report.measure == "step" and report.note == ""
    assert report.incidents[0].recovered_at is None, "no step past the fault: not recovered on processes"
    # The step-based log of tests/unit/test_ettr.py, its heartbeats from a v4 agent: the same figures.
    stepped = [e if not isinstance(e.payload, NodeHeartbeat) else
               ev(e.payload.model_copy(update={"generation": 0, "ranks_reporting": 1}),
                  (e.occurred_at - at(0)).total_seconds()) for e in crash_log()]
    before, after = compute_ettr(crash_log()), compute_ettr(stepped)
    assert before is not None and after is not None and after.measure == before.measure == "step"
    assert after.lost == before.lost == timedelta(seconds=14)
    assert after.incidents[0].phases(after.ended_at) == before.incidents[0].phases(before.ended_at)


def test_keel_ettr_and_keel_incidents_label_a_process_level_measure() -> None:
    job = job_ettr("j", no_sdk_log(), timedelta(hours=1))
    assert isinstance(job, JobEttr)
    assert "measured process-level (coarser)" in format_ettr(job)
    body = ettr_json(job)
    assert body["measure"] == "process" and body["note"] == PROCESS_LEVEL_NOTE
    resolved = ev(IncidentResolved(incident_id="7d1c2a4e-6a7e-4d1c-9b7a-6b6565c0de01", outcome="recovered", rung=2,
                                   generation=1, reason="running again", measure="process"), 110, "job/j", "controller")
    summary = IncidentSummary(id=__import__("uuid").UUID(resolved.payload.incident_id), job_id="j", opened_at=at(100),
                              kind="crash", node_id="n1", reason="rank 1 exited", generation=0,
                              outcome="recovered", resolved_at=at(110), measure="process")
    assert "process-level (no SDK, coarser" in format_incidents([summary])
    assert summary.to_json()["measure"] == "process"


def test_older_events_upcast_to_a_step_measure_and_an_unknown_sdk() -> None:
    heartbeat = decode_event(
        b'{"id": "0b6f3c1e-52a4-5d8e-9c71-4e2a6b8d9f13", "type": "NodeHeartbeat", "schema_version": 3, '
        b'"job_id": "j", "subject": "node/n0", "occurred_at": "2026-11-29T07:00:00+00:00", "producer": "agent", '
        b'"causation_id": null, "correlation_id": null, "payload": {"node_id": "n0", "ranks_alive": 1, '
        b'"ranks_expected": 1, "stored": {}}}', max_bytes=1 << 16)
    assert isinstance(heartbeat.payload, NodeHeartbeat)
    assert heartbeat.payload.generation is None and heartbeat.payload.ranks_reporting is None
    resolved = decode_event(
        b'{"id": "eff9d5e3-8e57-57a7-882e-bf573e0f8f6f", "type": "IncidentResolved", "schema_version": 1, '
        b'"job_id": "j", "subject": "job/j", "occurred_at": "2026-12-01T07:00:00Z", "producer": "controller", '
        b'"causation_id": null, "correlation_id": null, "payload": {"incident_id": "x", "outcome": "recovered", '
        b'"rung": 2, "generation": 1, "reason": "stepping"}}', max_bytes=1 << 16)
    assert isinstance(resolved.payload, IncidentResolved) and resolved.payload.measure == "step"
    with pytest.raises(ValueError):
        NodeHeartbeat(node_id="n0", ranks_alive=1, ranks_expected=1, ranks_reporting=-1)
