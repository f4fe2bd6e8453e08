"""A small, realistic controller incident log (rung 2: a crash with no culprit, diagnostics on both
nodes, a restart in place), shared by the unit and integration tests of the reporting commands.

Timeline (seconds from ``T0``), job ``job1``, nodes n1 (rank 0) and n2 (rank 1):

    0      RankStarted n1, n2 (generation 0)
    30, 60 NodeHeartbeat n1, n2 (steps 29, 59)
    60.0   FaultInjected crash on n2
    60.4   RankExited n2 rank 1 (unknown, SIGSEGV)                 <- IncidentOpened.evidence
    60.5   IncidentOpened (crash, n2) + DiagnosticsRequested round 0 on n1, n2
    64.0   DiagnosticsCompleted n1 (passed, detail), 64.2 n2 (passed, no detail)
    64.3   RestartDecided rung 2 generation 1 + RanksRestartRequested n1, n2
    65.5   RankStarted n1, n2 (generation 1; the agent does not correlate them)
    68     NodeHeartbeat step 57 (stepping again), 72 step 59 (back at the fault's step 59)
    72.5   IncidentResolved recovered, rung 2
    120    NodeHeartbeat step 108

By hand: the ETTR incident runs 60 .. 72 (12 s lost of 120 s: ETTR 90 %): detection 0.4 s,
localisation 0.1 s (ended by the DiagnosticsRequested), failover 5 s, restore 2.5 s, recompute 4 s.
The controller incident resolves 12 s after it opened (60.5 .. 72.5).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CheckResult,
    DiagnosticsCompleted,
    DiagnosticsRequested,
    FaultInjected,
    IncidentOpened,
    IncidentResolved,
    NodeHeartbeat,
    RankExited,
    RanksRestartRequested,
    RankStarted,
    RestartDecided,
)

T0 = datetime(2026, 11, 29, 9, 0, tzinfo=UTC)
JOB = "job1"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@dataclass(frozen=True)
class IncidentLog:
    events: list[Event]
    incident_id: uuid.UUID
    fault: Event
    exited: Event


def incident_log(job: str = JOB, start_s: float = 0.0, incident_id: uuid.UUID | None = None) -> IncidentLog:
    """The log above (all times shifted by ``start_s``), in log order; the incident's id is
    ``incident_id`` when given."""
    incident_id = incident_id or uuid.uuid4()

    def ev(payload: EventPayload, seconds: float, subject: str, producer: str, *, correlated: bool = False,
           cause: Event | None = None, event_id: uuid.UUID | None = None) -> Event:
        return Event.create(payload, job_id=job, subject=subject, producer=producer, occurred_at=at(start_s + seconds),
                            event_id=event_id, causation_id=cause.id if cause else None,
                            correlation_id=incident_id if correlated else None)

    def started(seconds: float, node: str, rank: int, generation: int) -> Event:
        return ev(RankStarted(node_id=node, rank=rank, local_rank=0, world_size=2, pid=100 + 10 * generation + rank,
                              generation=generation), seconds, f"rank/{rank}", "agent")

    def beats(seconds: float, step: int) -> list[Event]:
        return [ev(NodeHeartbeat(node_id=node, ranks_alive=1, ranks_expected=1, last_step=step), seconds,
                   f"node/{node}", "agent") for node in ("n1", "n2")]

    expires = at(start_s + 360)
    fault = ev(FaultInjected(kind="crash", node_id="n2", rank=1), 60.0, "node/n2", "cli")
    exited = ev(RankExited(node_id="n2", rank=1, pid=101, generation=0, exit_code=None, signal="SIGSEGV",
                           classification="unknown", reason="killed by SIGSEGV with no error in stderr"),
                60.4, "rank/1", "agent")
    opened = ev(IncidentOpened(kind="crash", node_id="n2", ranks=[1], generation=0, last_step=59,
                               fingerprint="crash@n2",
                               reason="rank 1 on n2 died (SIGSEGV) with no culprit: rung 2, stop-time diagnostics",
                               evidence=[str(exited.id)]),
                60.5, f"job/{job}", "controller", correlated=True, cause=exited, event_id=incident_id)
    diagnose = ev(DiagnosticsRequested(round=0, nodes=["n1", "n2"], checks=["intra_node_all_to_all",
                                                                         "inter_node_all_gather"],
                                       timeout_s=60, expires_at=expires,
                                       reason="rung 2: a crash with no culprit; diagnose n1, n2 before restarting"),
                  60.5, f"job/{job}", "controller", correlated=True, cause=exited)
    checks = [CheckResult(check="intra_node_all_to_all", passed=True, duration_s=1.2),
              CheckResult(check="inter_node_all_gather", passed=True, bandwidth_gbps=9.5, duration_s=2.1)]
    done_n1 = ev(DiagnosticsCompleted(node_id="n1", request_id=str(diagnose.id), round=0, passed=True, results=checks,
                                      detail="2 checks passed in 3.3 s"), 64.0, "node/n1", "agent", correlated=True,
                 cause=diagnose)
    done_n2 = ev(DiagnosticsCompleted(node_id="n2", request_id=str(diagnose.id), round=0, passed=True, results=checks),
                 64.2, "node/n2", "agent", correlated=True, cause=diagnose)
    restart = ev(RestartDecided(incident_id=str(incident_id), rung=2, generation=1, restart_nodes=["n1", "n2"],
                                fingerprint="crash@n2",
                                reason="rung 2: every node passed diagnostics; restart in place as generation 1"),
                 64.3, f"job/{job}", "controller", correlated=True, cause=done_n2)
    restarts = [ev(RanksRestartRequested(node_id=node, generation=1, reason="restart in place as generation 1",
                                         expires_at=expires), 64.3, f"node/{node}", "controller", correlated=True,
                   cause=done_n2) for node in ("n1", "n2")]
    resolved = ev(IncidentResolved(incident_id=str(incident_id), outcome="recovered", rung=2, generation=1,
                                   reason="stepping again: step 60 passed the fault's step 59"),
                  72.5, f"job/{job}", "controller", correlated=True)
    events = [
        started(0, "n1", 0, 0), started(0, "n2", 1, 0), *beats(30, 29), *beats(60, 59),
        fault, exited, opened, diagnose, done_n1, done_n2, restart, *restarts,
        started(65.5, "n1", 0, 1), started(65.5, "n2", 1, 1), *beats(68, 57), *beats(72, 59), resolved,
        *beats(120, 108),
    ]
    return IncidentLog(events, incident_id, fault, exited)
