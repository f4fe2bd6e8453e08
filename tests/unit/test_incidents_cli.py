"""The pure half of ``keel.reports.incidents``: incident summaries, timelines, ETTR tables, approvals and
cordons, against the hand-written incident log of ``tests/incident_factories.py``."""

from __future__ import annotations

import random
import uuid
from datetime import timedelta

import pytest

from keel.cli.main import main
from keel.events.envelope import Event
from keel.events.types import ActionHeld, ApprovalGiven, ApprovalRequested, IncidentOpened, JobStopDecided
from keel.reports.incidents import (
    BadInput,
    LookupFailed,
    approval_answer,
    build_timeline,
    choose_job,
    cordon_event,
    describe,
    ettr_json,
    find_open_request,
    format_duration,
    format_ettr,
    format_incidents,
    format_timeline,
    incidents_json,
    job_ettr,
    match_controller_incidents,
    resolve_id,
    summarize_incidents,
    timeline_json,
)
from keel.rules.ettr import compute_ettr
from tests.incident_factories import JOB, at, incident_log


def positioned(events: list[Event]) -> list[tuple[int, Event]]:
    return [(index + 1, event) for index, event in enumerate(events)]


def controller_event(payload, seconds: float, incident_id: uuid.UUID | None, *, job: str = JOB,
                     event_id: uuid.UUID | None = None) -> Event:
    return Event.create(payload, job_id=job, subject=f"job/{job}", producer="controller", occurred_at=at(seconds),
                        correlation_id=incident_id, event_id=event_id)


# -- durations and ids --------------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0.00 s"), (0.4, "0.40 s"), (12, "12.0 s"), (59.94, "59.9 s"), (245, "4 min 05 s"),
    (7380, "2 h 03 min"), (93600, "1 d 02 h"), (-1.5, "-1.50 s"),
])
def test_durations_always_carry_a_unit(seconds: float, text: str) -> None:
    assert format_duration(timedelta(seconds=seconds)) == text


def test_an_id_is_found_by_itself_or_a_unique_prefix_and_refused_otherwise() -> None:
    a = uuid.UUID("1a2b3c4d-0000-4000-8000-000000000001")
    b = uuid.UUID("1a2b3c4d-0000-4000-8000-000000000002")
    c = uuid.UUID("9f8e7d6c-0000-4000-8000-000000000003")
    ids = [a, b, c]
    assert resolve_id(str(a), ids, "incident") == a
    assert resolve_id("9F8E7D", ids, "incident") == c  # case-insensitive
    assert resolve_id("1a2b3c4d-0000-4000-8000-0000000000", [a, c], "incident") == a
    with pytest.raises(LookupFailed, match=r"incident id '1a2b3c' is ambiguous: 2 match \(1a2b3c4d-0000, 1a2b3c4d-0000\)"):
        resolve_id("1a2b3c", ids, "incident")
    with pytest.raises(LookupFailed, match="no incident 777777"):
        resolve_id("777777", ids, "incident")
    with pytest.raises(LookupFailed, match="no incident"):
        resolve_id(str(uuid.uuid4()), ids, "incident")
    with pytest.raises(BadInput, match="at least 6 hex characters"):
        resolve_id("1a2b", ids, "incident")
    with pytest.raises(BadInput, match="at least 6 hex characters"):
        resolve_id("crash!", ids, "incident")


# -- controller incidents --------------------------------------------------------------------------


def test_an_incident_summary_has_its_kind_node_rung_outcome_and_time_to_resolution() -> None:
    log = incident_log()
    [incident] = summarize_incidents(log.events)
    assert incident.id == log.incident_id and incident.job_id == JOB and incident.opened_at == at(60.5)
    assert (incident.kind, incident.node_id, incident.rung, incident.outcome) == ("crash", "n2", 2, "recovered")
    assert incident.time_to_resolution == timedelta(seconds=12)
    assert incident.evidence == (str(log.exited.id),)
    assert incident.resolution == "stepping again: step 60 passed the fault's step 59"
    assert incidents_json([incident])["incidents"][0]["time_to_resolution_s"] == 12.0


def test_outcomes_open_stopped_superseded_and_rungs_without_a_rung_field() -> None:
    first, second, third = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()

    def opened(seconds: float, incident: uuid.UUID, kind: str = "hang") -> Event:
        return controller_event(IncidentOpened(kind=kind, node_id="n1", generation=0, reason=f"{kind} on n1"),
                                seconds, incident, event_id=incident)

    events = [
        opened(0, first),
        controller_event(ActionHeld(incident_id=str(first), action="evict", guardrail="approval", rung=3,
                                    reason="needs approval"), 1, first),
        opened(5, second, "user_code"),
        controller_event(JobStopDecided(incident_id=str(second), rung=6, reason="crash loop: page"), 9, second),
        opened(10, third),
    ]
    summaries = summarize_incidents(events)
    assert [(s.outcome, s.rung) for s in summaries] == [("open", 3), ("stopped", 6), ("open", None)]
    assert summaries[1].time_to_resolution == timedelta(seconds=4) and summaries[1].resolution == "crash loop: page"
    text = format_incidents(summaries).splitlines()
    assert text[0].split() == ["ID", "JOB", "OPENED_AT", "KIND", "NODE", "RUNG", "OUTCOME", "RESOLVED_IN", "REASON"]
    assert text[3].split() == [str(third)[:8], "job1", "2026-11-29", "09:00:10.000", "hang", "n1", "-", "open", "-",
                               "hang", "on", "n1"]
    assert text[2].split()[5:10] == ["n1", "6", "stopped", "4.00", "s"]
    assert format_incidents([]) == "keel: no incidents"


def test_the_incidents_table_truncates_the_reason_and_names_the_outcome() -> None:
    log = incident_log()
    [line] = format_incidents(summarize_incidents(log.events), reason_width=30).splitlines()[1:]
    assert line.startswith(str(log.incident_id)[:8] + "  job1")
    assert "2026-11-29 09:01:00.500" in line and " crash " in line and " n2 " in line
    assert " 2  recovered " in line and "12.0 s" in line
    assert line.endswith("  rank 1 on n2 died (SIGSEGV)...")


# -- timelines ------------------------------------------------------------------------------------


def timeline_of(log, shuffle: bool = False):  # type: ignore[no-untyped-def]
    recorded = positioned(log.events)
    opened = next(r for r in recorded if r[1].id == log.incident_id)
    related = [r for r in recorded if r[1].correlation_id == log.incident_id or r[1].id == log.exited.id]
    if shuffle:
        related = related + related[:3]  # duplicates, and in any order
        random.Random(7).shuffle(related)
    return build_timeline(opened, related)


def test_a_timeline_lists_the_evidence_then_the_incidents_events_in_log_order() -> None:
    log = incident_log()
    timeline = timeline_of(log, shuffle=True)
    assert [e.event.type for e in timeline.entries] == [
        "RankExited", "IncidentOpened", "DiagnosticsRequested", "DiagnosticsCompleted", "DiagnosticsCompleted",
        "RestartDecided", "RanksRestartRequested", "RanksRestartRequested", "IncidentResolved"]
    positions = [e.position for e in timeline.entries]
    assert positions == sorted(positions)
    assert [e.evidence for e in timeline.entries] == [True] + [False] * 8
    assert [e.offset.total_seconds() for e in timeline.entries] == pytest.approx(
        [0.0, 0.1, 0.1, 3.6, 3.8, 3.9, 3.9, 3.9, 12.1])
    # The fault itself is no evidence the controller named, and the uncorrelated restarts are not in it.
    assert log.fault.id not in {e.event.id for e in timeline.entries}
    assert timeline.incident.outcome == "recovered" and timeline.missing_evidence == ()


def test_timeline_lines_show_offset_type_producer_subject_and_the_reason() -> None:
    log = incident_log()
    lines = format_timeline(timeline_of(log)).splitlines()
    assert lines[0] == (f"incident {log.incident_id} (crash on n2, job job1): recovered after 12.0 s, "
                        "highest rung 2")
    assert lines[1].startswith("opened 2026-11-29 09:01:00.500: rank 1 on n2 died (SIGSEGV)")
    body = lines[4:]
    assert body[0].split()[:5] == ["+0.000", "s", "*RankExited", "agent", "rank/1"]
    assert body[0].endswith("killed by SIGSEGV with no error in stderr")
    assert body[1].split()[:5] == ["+0.100", "s", "IncidentOpened", "controller", "job/job1"]
    assert body[3].endswith("2 checks passed in 3.3 s")  # n1's detail
    # n2 has neither a reason nor a detail: a compact summary of the payload.
    assert "node_id=n2, request_id=" in body[4] and "passed=True, results=[2 items]" in body[4]
    assert body[-1].split()[:2] == ["+12.100", "s"] and body[-1].endswith("step 60 passed the fault's step 59")


def test_missing_evidence_is_named_and_json_keeps_the_envelopes() -> None:
    log = incident_log()
    recorded = positioned(log.events)
    opened = next(r for r in recorded if r[1].id == log.incident_id)
    ghost = str(uuid.uuid4())
    head = opened[1]
    with_ghost = head.model_copy(update={"payload": head.payload.model_copy(
        update={"evidence": [str(log.exited.id), ghost]})})
    related = [r for r in recorded if r[1].id == log.exited.id or r[1].correlation_id == log.incident_id]
    timeline = build_timeline((opened[0], with_ghost), related)
    assert timeline.missing_evidence == (ghost,)
    assert format_timeline(timeline).splitlines()[-1] == f"  (evidence {ghost} is not in the log)"
    data = timeline_json(timeline)
    assert data["incident"]["id"] == str(log.incident_id) and data["missing_evidence"] == [ghost]
    assert data["events"][0]["type"] == "RankExited" and data["events"][0]["evidence"] is True
    assert data["events"][1]["type"] == "IncidentOpened" and data["events"][1]["offset_s"] == pytest.approx(0.1)
    assert data["events"][1]["correlation_id"] == str(log.incident_id)
    with pytest.raises(ValueError, match="not an IncidentOpened"):
        build_timeline(recorded[0], [])


def test_describe_prefers_reason_then_detail_then_a_summary() -> None:
    log = incident_log()
    by_type: dict[str, Event] = {}
    for event in log.events:
        by_type.setdefault(event.type, event)
    assert describe(by_type["RestartDecided"]).startswith("rung 2: every node passed diagnostics")
    assert describe(by_type["FaultInjected"]) == "kind=crash, node_id=n2, rank=1, injected_by=keel inject"
    assert describe(by_type["RankStarted"], width=30) == "node_id=n1, rank=0, local_r..."


# -- ETTR with the controller's incidents ----------------------------------------------------------


def test_ettr_of_the_incident_log_by_hand() -> None:
    log = incident_log()
    job = job_ettr(JOB, log.events, timedelta(hours=1), summarize_incidents(log.events))
    assert job is not None
    report = job.report
    assert report.wall == timedelta(seconds=120) and report.lost == timedelta(seconds=12)
    assert report.ettr == pytest.approx(0.9)
    phases = {k: v.total_seconds() for k, v in report.incidents[0].phases(report.ended_at).items()}
    assert phases == pytest.approx({"detection": 0.4, "localisation": 0.1, "failover": 5.0, "restore": 2.5,
                                    "recompute": 4.0})
    assert job.controller[0] is not None and job.controller[0].id == log.incident_id
    assert (len(report.generations), len(report.restart_requests)) == (1, 1)


def test_the_ettr_window_of_the_incident_log_by_hand() -> None:
    log = incident_log()
    job = job_ettr(JOB, log.events, timedelta(seconds=55))  # [65, 120]
    assert job is not None
    window = job.window
    assert window.lost == timedelta(seconds=7) and window.ettr == pytest.approx(1 - 7 / 55)
    assert {k: v.total_seconds() for k, v in window.lost_by_phase.items()} == pytest.approx(
        {"detection": 0.0, "localisation": 0.0, "failover": 0.5, "restore": 2.5, "recompute": 4.0})
    assert (window.generation_changes, window.restart_requests) == (1, 0)  # started 65.5, requested 64.3


def test_the_ettr_table_puts_the_window_next_to_the_cumulative_figures() -> None:
    log = incident_log()
    job = job_ettr(JOB, log.events, timedelta(seconds=55), summarize_incidents(log.events))
    assert job is not None
    lines = format_ettr(job).splitlines()
    assert lines[0] == "job job1: 2026-11-29 09:00:00.000 .. 2026-11-29 09:02:00.000, generation 1"
    rows = {line[:20].strip(): line[20:].split("  ") for line in lines[3:18]}
    assert lines[2].split() == ["cumulative", "last", "55s"]
    assert [c.strip() for c in rows["ETTR"] if c.strip()] == ["90.00 %", "87.27 %"]
    assert [c.strip() for c in rows["unproductive"] if c.strip()] == ["12.0 s", "7.00 s"]
    assert [c.strip() for c in rows["failover"] if c.strip()] == ["5.00 s", "0.50 s"]
    assert [c.strip() for c in rows["checkpointing"] if c.strip()] == ["0.00 s", "0.00 s"]  # no total reported
    assert [c.strip() for c in rows["generation changes"] if c.strip()] == ["1", "1"]
    assert [c.strip() for c in rows["restart requests"] if c.strip()] == ["1", "0"]
    [incident_line] = [line for line in lines if line.lstrip().startswith("1  ")]
    assert "12.0 s" in incident_line and "7.00 s" in incident_line
    assert f"{str(log.incident_id)[:8]} crash" in incident_line and incident_line.endswith("injected crash on n2")
    data = ettr_json(job)
    assert data["cumulative"]["ettr"] == pytest.approx(0.9) and data["window"]["lost_s"] == pytest.approx(7.0)
    assert data["cumulative"]["incidents"][0]["controller_incident"] == {"id": str(log.incident_id), "kind": "crash"}


def test_a_controller_incident_matches_only_inside_the_ettr_incident() -> None:
    log = incident_log()
    report = compute_ettr(log.events)
    assert report is not None
    [summary] = summarize_incidents(log.events)
    early = summary.__class__(**{**summary.__dict__, "opened_at": at(59)})  # before the fault
    late = summary.__class__(**{**summary.__dict__, "opened_at": at(72)})  # at the recovery
    assert match_controller_incidents(report, [early]) == (None,)
    assert match_controller_incidents(report, [late]) == (None,)
    assert match_controller_incidents(report, [late, summary]) == (summary,)
    still_open = compute_ettr(log.events[:16])  # ends with the new ranks started at 65.5
    assert still_open is not None and still_open.incidents[0].recovered_at is None
    at_end = summary.__class__(**{**summary.__dict__, "opened_at": still_open.ended_at})
    assert match_controller_incidents(still_open, [at_end]) == (at_end,)


# -- human input ------------------------------------------------------------------------------------


def approval_request(incident: uuid.UUID, seconds: float = 10) -> Event:
    return controller_event(ApprovalRequested(incident_id=str(incident), action="evict", reason="rung 1: evict n2",
                                              expires_at=at(seconds + 300)), seconds, incident)


def test_an_open_request_is_found_and_answered_with_the_incidents_correlation() -> None:
    incident = uuid.uuid4()
    request = approval_request(incident)
    other = approval_request(uuid.uuid4(), 20)
    assert find_open_request(str(request.id)[:8], [request, other], [], at(30)) is request
    answer = approval_answer(request, approved=True, by="alice", comment="go", now=at(31))
    assert isinstance(answer.payload, ApprovalGiven)
    assert answer.payload.model_dump() == {"request_id": str(request.id), "approved": True, "by": "alice",
                                           "comment": "go"}
    assert (answer.job_id, answer.subject, answer.producer) == (JOB, "job/job1", "cli")
    assert answer.correlation_id == incident and answer.causation_id == request.id and answer.occurred_at == at(31)
    with pytest.raises(BadInput, match="--by"):
        approval_answer(request, approved=False, by=" ", comment="", now=at(31))


def test_a_request_answered_expired_or_unknown_is_refused() -> None:
    request = approval_request(uuid.uuid4())
    denied = Event.create(ApprovalGiven(request_id=str(request.id), approved=False, by="bob"), job_id=JOB,
                          subject="job/job1", producer="cli", occurred_at=at(12))
    with pytest.raises(LookupFailed, match=r"\(evict\) was already denied by bob at 2026-11-29 09:00:12.000"):
        find_open_request(str(request.id), [request], [denied], at(13))
    with pytest.raises(LookupFailed, match="expired at 2026-11-29 09:05:10.000"):
        find_open_request(str(request.id), [request], [], at(311))
    with pytest.raises(LookupFailed, match="no approval request"):
        find_open_request(str(uuid.uuid4()), [request], [], at(13))


def test_cordon_events_and_the_nodes_job() -> None:
    event = cordon_event(JOB, "n2", cordoned=True, by="alice", reason="flaky NIC", now=at(5))
    assert event.type == "NodeCordoned" and event.subject == "node/n2" and event.job_id == JOB
    assert event.payload.model_dump() == {"node_id": "n2", "cordoned": True, "by": "alice", "reason": "flaky NIC"}
    back = cordon_event(JOB, "n2", cordoned=False, by="alice", reason="", now=at(6))
    assert back.payload.cordoned is False
    with pytest.raises(BadInput, match="--reason"):
        cordon_event(JOB, "n2", cordoned=True, by="alice", reason="", now=at(5))
    with pytest.raises(BadInput, match="not a node id"):
        cordon_event(JOB, "n 2", cordoned=True, by="alice", reason="x", now=at(5))
    assert choose_job("n2", ["job1"]) == "job1"
    with pytest.raises(LookupFailed, match="node n2 has no events in the log: pass --job"):
        choose_job("n2", [])
    with pytest.raises(LookupFailed, match="node n2 belongs to jobs a, b: pass --job"):
        choose_job("n2", ["b", "a"])


def test_the_cli_refuses_a_window_without_a_unit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ettr", "--window", "60"]) == 2
    assert "--window: invalid duration '60'" in capsys.readouterr().err
    assert main(["ettr", "--window", "0s"]) == 2
    assert "--window must be longer than 0 s" in capsys.readouterr().err
