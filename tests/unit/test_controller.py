"""The controller's escalation ladder and guardrails, pure: every rule, with the events a live run sees.

A ``Job`` drives a ``DeciderSession`` with the inputs agents would publish (registrations, rank starts,
heartbeats, exits, health changes, diagnostic results) and keeps every event - inputs and decisions - as
the log, so each test can also check correlation ids, expiries and a cold start from that log.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from keel.controller import decider as controller_decider
from keel.controller.actions import ActionPlan
from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.controller.rules import diagnostics_verdict
from keel.controller.standby import failure_probability, plan_standby_pool
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CLOCK_PRODUCER,
    ApprovalGiven,
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    CheckResult,
    DiagnosticsCompleted,
    FailSlowConvicted,
    MetricAnomalyDetected,
    NodeCordoned,
    NodeEvicted,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeRegistered,
    RankExited,
    RankGroups,
    RanksRestarted,
    RankStarted,
    SdcPhase,
    SdcReplayAnalyzed,
    StacksAnalyzed,
    StandbyChecked,
    TimerTicked,
)
from keel.kernel.decider import DeciderSession
from keel.kernel.replay import verify

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
TRACEBACK = 'Traceback (most recent call last):\n  File "/job/train.py", line 42, in step\n    y = model(x)\n{err}\n'


class Job:
    """A job of ``nodes`` x ``per_node`` ranks (plus standbys) and a controller watching it."""

    def __init__(self, nodes: int = 4, per_node: int = 2, standbys: int = 1, policy: ControllerPolicy | None = None,
                 checked: bool = True, first_step: int = 20) -> None:
        self.decider = ControllerDecider(policy or ControllerPolicy())
        self.session = DeciderSession(self.decider)
        self.log: list[Event] = []
        self.count = 0
        self.now = T0
        self.nodes = [f"n{i}" for i in range(nodes)]
        self.per_node = per_node
        self.generation = 0
        for i, node in enumerate(self.nodes):
            self.feed(NodeRegistered(node_id=node, host=node), f"node/{node}")
            for local in range(per_node):
                self.feed(RankStarted(node_id=node, rank=i * per_node + local, local_rank=local,
                                      world_size=nodes * per_node, pid=100 + i, generation=0), f"rank/{i}")
        for s in range(standbys):
            self.add_standby(f"s{s}", checked=checked)
        self.heartbeats(step=first_step)

    def feed(self, payload: EventPayload, subject: str, *, producer: str = "node-agent", dt: float = 0.1,
             correlation: uuid.UUID | None = None) -> list[Event]:
        self.now += timedelta(seconds=dt)
        self.count += 1  # deterministic input ids: two runs of one test give the same log
        event = Event.create(payload, job_id="job1", subject=subject, producer=producer, occurred_at=self.now,
                             correlation_id=correlation, event_id=uuid.uuid5(uuid.NAMESPACE_OID, f"input-{self.count}"))
        self.log.append(event)
        result = self.session.observe(event)
        self.log.extend(result.emitted)
        self.last_reason = result.decision.reason if result.decision else ""
        return result.emitted

    def add_standby(self, node: str, checked: bool = True) -> list[Event]:
        out = self.feed(NodeRegistered(node_id=node, host=node, standby=True), f"node/{node}")
        return out + self.feed(StandbyChecked(node_id=node, passed=checked), f"node/{node}")

    def heartbeats(self, step: int, nodes: list[str] | None = None) -> list[Event]:
        out: list[Event] = []
        for node in nodes or self.nodes:
            out += self.feed(NodeHeartbeat(node_id=node, ranks_alive=self.per_node, ranks_expected=self.per_node,
                                           last_step=step), f"node/{node}")
        return out

    def crash(self, node: str, rank: int, classification: str = "infrastructure", err: str = "RuntimeError: gloo",
              generation: int | None = None) -> list[Event]:
        return self.feed(RankExited(node_id=node, rank=rank, pid=1, generation=self.generation if generation is None
                                    else generation, exit_code=1, classification=classification,  # type: ignore[arg-type]
                                    error_type=err.split(":")[0], stderr_tail=TRACEBACK.format(err=err)), f"rank/{rank}")

    def health(self, node: str, component: str = "gpu", check: str = "xid", confidence: str = "high",
               fatal: bool = True) -> list[Event]:
        return self.feed(NodeHealthChanged(node_id=node, status="failed", component=component, check=check,  # type: ignore[arg-type]
                                           confidence=confidence, is_fatal=fatal, detail=f"{check} on {node}"),  # type: ignore[arg-type]
                         f"node/{node}", producer="inspector")

    def diagnostics(self, node: str, request: Event, passed: bool = True, detail: str = "") -> list[Event]:
        results = [CheckResult(check="inter_node_all_gather", passed=passed, detail=detail or "ok")]
        return self.feed(DiagnosticsCompleted(node_id=node, request_id=str(request.id), round=request.payload.round,
                                              passed=passed, results=results), f"node/{node}",
                         correlation=request.correlation_id)

    def restart(self, decided: list[Event], restore_step: int = 18, step: int = 19) -> list[Event]:
        """The agents carry out a restart: ranks start, the broker plans, a node steps past the plan."""
        [restart] = of(decided, "RestartDecided")
        self.generation = restart.payload.generation
        incident = restart.correlation_id
        takeover = {p.standby_node_id: p.replaces_node_id for p in restart.payload.promotions}
        running = [n for n in restart.payload.restart_nodes] + list(takeover)
        for node in running:
            slot = self.nodes.index(takeover.get(node, node))
            for local in range(self.per_node):
                self.feed(RankStarted(node_id=node, rank=slot * self.per_node + local, local_rank=local,
                                      world_size=len(self.nodes) * self.per_node, pid=200, generation=self.generation),
                          f"rank/{slot}", correlation=incident)
        self.nodes = [next((s for s, r in takeover.items() if r == n), n) for n in self.nodes]
        self.feed(CheckpointRestorePlanned(generation=self.generation, step=restore_step, reason="plan"), "job/job1",
                  producer="checkpoint-broker")
        return self.heartbeats(step=step, nodes=[running[0]])

    def tick(self, after_s: float, interval_s: float | None = None) -> list[Event]:
        """A tick ``after_s`` later; with ``interval_s``, of the recorded clock (v2), else a v1 tick."""
        self.now += timedelta(seconds=after_s)
        return self.feed(TimerTicked(now=self.now, interval_s=interval_s), "clock/j", producer=CLOCK_PRODUCER, dt=0)


def of(events: list[Event], kind: str) -> list[Event]:
    return [e for e in events if e.type == kind]


def types(events: list[Event]) -> list[str]:
    return [e.type for e in events]


# -- rung 1 ---------------------------------------------------------------------------------------


def test_rung1_evicts_promotes_a_ready_standby_and_restarts_the_rest_in_place() -> None:
    job = Job(policy=ControllerPolicy(command_ttl=timedelta(minutes=3)))
    out = job.health("n2")
    assert types(out) == ["IncidentOpened", "NodeEvictionDecided", "RestartDecided", "StandbyPromotionRequested",
                          "RanksRestartRequested", "RanksRestartRequested", "RanksRestartRequested"]
    [opened] = of(out, "IncidentOpened")
    cause = job.log[-len(out) - 1]
    assert opened.payload.kind == "hardware" and opened.payload.node_id == "n2" and opened.payload.ranks == [4, 5]
    assert opened.payload.evidence == [str(cause.id)] and opened.payload.last_step == 20
    assert all(e.correlation_id == opened.id for e in out), "every decision carries the incident id"
    [eviction] = of(out, "NodeEvictionDecided")
    assert eviction.payload.rung == 1 and "rung 1" in eviction.payload.reason
    assert eviction.payload.expires_at == cause.occurred_at + timedelta(minutes=3)
    [promotion] = of(out, "StandbyPromotionRequested")
    assert (promotion.payload.node_id, promotion.payload.replaces_node_id, promotion.payload.ranks,
            promotion.payload.node_rank, promotion.payload.generation) == ("s0", "n2", [4, 5], 2, 1)
    assert sorted(e.payload.node_id for e in of(out, "RanksRestartRequested")) == ["n0", "n1", "n3"]
    assert {e.payload.generation for e in of(out, "RanksRestartRequested")} == {1}
    # Back at work: the incident closes once the new generation steps past the restore point.
    resolved = job.restart(out, restore_step=18, step=19)
    [done] = of(resolved, "IncidentResolved")
    assert done.payload.outcome == "recovered" and done.payload.rung == 1 and done.correlation_id == opened.id
    assert job.session.state.job("job1").incident is None
    assert job.nodes == ["n0", "n1", "s0", "n3"]


def test_a_heartbeat_before_the_new_generation_starts_does_not_close_the_incident() -> None:
    job = Job()
    job.health("n2")
    assert of(job.heartbeats(step=25, nodes=["n0"]), "IncidentResolved") == []


def test_rung1_without_a_ready_standby_evicts_asks_for_a_refill_and_waits() -> None:
    job = Job(standbys=1, checked=False)  # the only standby failed its self-check
    out = job.health("n1")
    assert types(out)[:2] == ["IncidentOpened", "NodeEvictionDecided"]
    [held] = of(out, "ActionHeld")
    assert held.payload.guardrail == "no_standby" and held.payload.evict == ["n1"] and held.payload.rung == 1
    assert of(out, "StandbyRefillRequested") and not of(out, "RanksRestartRequested")
    # The actuator evicts it; a fresh standby joins and passes its self-check: the held recovery goes on.
    job.feed(NodeEvicted(node_id="n1", decision_id=str(of(out, "NodeEvictionDecided")[0].id), actuator="local",
                         outcome="evicted"), "node/n1", producer="actuator")
    assert of(job.feed(NodeRegistered(node_id="s1", host="s1", standby=True), "node/s1"), "RestartDecided") == []
    out = job.feed(StandbyChecked(node_id="s1", passed=True), "node/s1")
    [restart] = of(out, "RestartDecided")
    assert [(p.standby_node_id, p.replaces_node_id, p.ranks) for p in restart.payload.promotions] == [("s1", "n1", [2, 3])]
    assert restart.payload.evict == [] and "ready standby joined" in restart.payload.reason
    assert sorted(restart.payload.restart_nodes) == ["n0", "n2", "n3"]


def test_an_idle_standby_with_a_fatal_fault_is_evicted_without_a_restart() -> None:
    job = Job()
    out = job.health("s0", component="disk", check="smart")
    assert types(out) == ["NodeEvictionDecided"] and out[0].payload.node_id == "s0"


def test_signals_below_rung1_change_nothing_and_unknown_nodes_are_recorded_only() -> None:
    job = Job()
    for component, check, confidence, fatal in [("gpu", "xid", "medium", True), ("nic", "link_flap", "high", False),
                                                ("host", "psi_memory", "low", False)]:
        assert job.health("n1", component, check, confidence, fatal) == []
        assert "not a rung-1 signal" in job.last_reason
    assert job.health("ghost") == [] and "unknown node ghost" in job.last_reason


def test_a_lost_node_is_evicted_on_the_clock() -> None:
    job = Job(policy=ControllerPolicy(node_silence_timeout=timedelta(seconds=30)))
    assert job.tick(10) == []
    job.heartbeats(step=21, nodes=["n0", "n1", "n3"])  # n2 went silent
    assert job.tick(15) == []
    out = job.tick(10)  # n2's last heartbeat is now 35 s old
    [opened] = of(out, "IncidentOpened")
    assert opened.payload.kind == "lost_node" and "no heartbeat from n2" in opened.payload.reason
    assert [e.payload.node_id for e in of(out, "NodeEvictionDecided")] == ["n2"]
    # The command expires relative to the tick's time (time is an input), not the wall clock.
    assert of(out, "NodeEvictionDecided")[0].payload.expires_at == job.now + timedelta(minutes=5)


# -- rung 2 ---------------------------------------------------------------------------------------


def test_rung2_crash_runs_diagnostics_then_restarts_in_place_when_all_pass() -> None:
    job = Job()
    out = job.crash("n1", 3)
    assert types(out) == ["IncidentOpened", "DiagnosticsRequested"]
    [request] = of(out, "DiagnosticsRequested")
    assert request.payload.nodes == ["n0", "n1", "n2", "n3"] and request.payload.round == 0
    assert set(request.payload.checks) == {"gpu_matmul", "intra_node_all_to_all", "inter_node_all_gather"}
    # More exits of the same failure join the incident.
    assert job.crash("n0", 0) == [] and "part of it" in job.last_reason
    for node in ["n0", "n1", "n2"]:
        assert job.diagnostics(node, request) == []
    assert "waiting for n3" in job.last_reason
    out = job.diagnostics("n3", request)
    [restart] = of(out, "RestartDecided")
    assert restart.payload.rung == 2 and restart.payload.evict == [] and "passed on every node" in restart.payload.reason
    assert sorted(e.payload.node_id for e in of(out, "RanksRestartRequested")) == ["n0", "n1", "n2", "n3"]
    assert of(job.restart(out), "IncidentResolved")


def test_rung2_evicts_the_node_that_fails_diagnostics_and_promotes_a_standby() -> None:
    job = Job()
    [request] = of(job.crash("n1", 3), "DiagnosticsRequested")
    for node in ["n0", "n1", "n3"]:
        job.diagnostics(node, request)
    out = job.diagnostics("n2", request, passed=False, detail="n2 sent corrupted data")
    assert [e.payload.node_id for e in of(out, "NodeEvictionDecided")] == ["n2"]
    [restart] = of(out, "RestartDecided")
    assert "n2 failed (inter_node_all_gather: n2 sent corrupted data)" in restart.payload.reason
    assert [(p.standby_node_id, p.replaces_node_id) for p in restart.payload.promotions] == [("s0", "n2")]


def test_a_diagnostic_that_times_out_names_the_silent_node_and_evicts_it() -> None:
    job = Job(policy=ControllerPolicy(diagnostics_timeout=timedelta(seconds=20)))
    [request] = of(job.crash("n1", 3), "DiagnosticsRequested")
    job.heartbeats(step=20, nodes=["n3"])  # n3's agent acknowledged the round: it is not lost, only late
    for node in ["n0", "n1", "n2"]:
        job.diagnostics(node, request)
    assert job.tick(10) == []
    out = job.tick(15)
    [restart] = of(out, "RestartDecided")
    assert restart.payload.evict == ["n3"] and "n3 did not report within 20 s" in restart.payload.reason
    # A late answer of that round changes nothing.
    assert job.diagnostics("n3", request) == []


def test_diagnostics_conclude_before_the_deadline_once_the_missing_node_is_silent() -> None:
    job = Job(policy=ControllerPolicy(diagnostics_timeout=timedelta(seconds=60), diagnostics_ack_timeout=timedelta(seconds=60),
                                      node_silence_timeout=timedelta(seconds=10)))
    [request] = of(job.crash("n1", 3), "DiagnosticsRequested")
    for node in ["n0", "n1", "n2"]:
        job.diagnostics(node, request)
        job.heartbeats(step=20, nodes=[node])
    assert job.tick(5) == []  # n3's last heartbeat is 5.x s old: it may still answer
    out = job.tick(6)
    [restart] = of(out, "RestartDecided")
    assert restart.payload.evict == ["n3"] and "sent no heartbeat for over 10 s" in job.last_reason


def test_a_node_that_does_not_acknowledge_a_round_is_lost_and_the_round_ends_without_waiting() -> None:
    job = Job(policy=ControllerPolicy(diagnostics_timeout=timedelta(seconds=60)))  # ack timeout: 2 s by default
    job.tick(0, interval_s=1.0)  # the recorded clock runs from before the request
    [request] = of(job.crash("n1", 3), "DiagnosticsRequested")
    job.heartbeats(step=20, nodes=["n0", "n1", "n2"])  # the agents' answers on receipt; n3's agent is gone
    job.diagnostics("n1", request)
    assert job.tick(1, interval_s=1.0) == [] and "waiting for" not in job.last_reason  # within the ack timeout
    out = job.tick(1.5, interval_s=1.0)
    [restart] = of(out, "RestartDecided")
    assert restart.payload.evict == ["n3"]
    assert "n3 did not acknowledge the request within 2 s (its agent sent nothing): lost" in restart.payload.reason
    assert "n3 did not acknowledge the request within 2 s" in job.last_reason
    assert "not waiting for the deadline" in job.last_reason
    # n0 and n2 acknowledged and were still in the all-gather (waiting for n3): not judged, restarted in place.
    assert sorted(e.payload.node_id for e in of(out, "RanksRestartRequested")) == ["n0", "n1", "n2"]
    assert [(p.standby_node_id, p.replaces_node_id) for p in restart.payload.promotions] == [("s0", "n3")]


def test_a_round_half_of_whose_nodes_are_silent_waits_for_its_deadline() -> None:
    """On a loaded machine (or a control plane cut off itself), several agents may answer late at once:
    that is likelier the controller's side than that many hosts gone, so nobody is evicted on it and the
    round runs to its results or its deadline."""
    job = Job(policy=ControllerPolicy(diagnostics_timeout=timedelta(seconds=60)))
    job.tick(0, interval_s=1.0)
    [request] = of(job.crash("n1", 3), "DiagnosticsRequested")
    job.heartbeats(step=20, nodes=["n1", "n2"])  # n0 and n3 are late: 2 of 4
    assert job.tick(1, interval_s=1.0) == []
    assert job.tick(2, interval_s=1.0) == []  # 3 s: past the ack timeout, yet nobody is lost
    job.heartbeats(step=20, nodes=["n0", "n3"])  # their acknowledgements arrive after all
    for node in ["n0", "n1", "n2", "n3"]:
        out = job.diagnostics(node, request)
    [restart] = of(out, "RestartDecided")
    assert restart.payload.evict == []


def test_a_round_is_not_cut_short_over_a_gap_in_the_recorded_clock() -> None:
    """The controller itself stalled or was cut off after the request (no tick for longer than the
    interval and the skew allowance): the acknowledgements may be waiting in the stream, so the node is not
    taken as lost; once the clock runs again from after the request, nobody is judged on it either."""
    job = Job(policy=ControllerPolicy(diagnostics_timeout=timedelta(seconds=60)))
    job.tick(0, interval_s=1.0)
    [request] = of(job.crash("n1", 3), "DiagnosticsRequested")
    job.heartbeats(step=20, nodes=["n0", "n1", "n2"])
    assert job.tick(20, interval_s=1.0) == []  # the first tick after a 20-s gap: n3 is not lost on it
    assert job.tick(1, interval_s=1.0) == []  # the clock runs again, from after the request
    job.heartbeats(step=20, nodes=["n3"])
    for node in ["n0", "n1", "n2", "n3"]:
        out = job.diagnostics(node, request)
    [restart] = of(out, "RestartDecided")
    assert restart.payload.evict == []


def test_a_round_every_node_acknowledged_waits_for_the_results() -> None:
    job = Job(policy=ControllerPolicy(diagnostics_timeout=timedelta(seconds=60)))
    [request] = of(job.crash("n1", 3), "DiagnosticsRequested")
    job.heartbeats(step=20)
    assert job.tick(5) == [] and job.tick(5) == []
    for node in ["n0", "n1", "n2", "n3"]:
        out = job.diagnostics(node, request)
    [restart] = of(out, "RestartDecided")
    assert restart.payload.evict == [] and "passed on every node" in restart.payload.reason


def test_diagnostics_conclude_early_when_every_peer_names_the_silent_node() -> None:
    job = Job()
    [request] = of(job.crash("n1", 3), "DiagnosticsRequested")
    for node in ["n0", "n1"]:
        job.feed(DiagnosticsCompleted(node_id=node, request_id=str(request.id), round=0, passed=False,
                                      suspects=["n3"], detail="n3 never joined"), f"node/{node}")
    assert "waiting for n2, n3" in job.last_reason  # n2 is silent but nobody names it: wait
    out = job.feed(DiagnosticsCompleted(node_id="n2", request_id=str(request.id), round=0, passed=False,
                                        suspects=["n3"]), "node/n2")
    [restart] = of(out, "RestartDecided")
    assert restart.payload.evict == ["n3"] and "n3 named by n0, n1, n2" in restart.payload.reason
    assert "n0, n1, n2 failed only the collective check because of them: kept" in restart.payload.reason
    assert [(p.standby_node_id, p.replaces_node_id) for p in restart.payload.promotions] == [("s0", "n3")]


def test_diagnostics_verdicts() -> None:
    def report(node: str, *, ok: bool = True, local: bool = False, suspects: list[str] | None = None):
        check = "gpu_matmul" if local else "inter_node_all_gather"
        return DiagnosticsCompleted(node_id=node, request_id="r", round=0, passed=ok, suspects=suspects or [],
                                    results=[CheckResult(check=check, passed=ok, detail="bad" if not ok else "")])

    nodes = ["a", "b", "c", "d"]
    t = timedelta(seconds=30)
    ok = diagnostics_verdict({n: report(n) for n in nodes}, nodes, [], t)
    assert ok.evict == frozenset() and not ok.stop and "passed on every node" in ok.reason
    gpu = diagnostics_verdict({**{n: report(n) for n in nodes}, "b": report("b", ok=False, local=True)}, nodes, [], t)
    assert gpu.evict == {"b"} and "b failed its own checks (gpu_matmul: bad)" in gpu.reason
    silent = diagnostics_verdict({n: report(n) for n in "abc"}, nodes, ["d"], t)
    assert silent.evict == {"d"} and "did not report within 30 s" in silent.reason
    fabric = diagnostics_verdict({n: report(n, ok=False) for n in nodes}, nodes, [], t)
    assert fabric.stop and fabric.evict == frozenset() and "fabric-wide" in fabric.reason
    minority = diagnostics_verdict({**{n: report(n) for n in nodes}, "c": report("c", ok=False)}, nodes, [], t)
    assert minority.evict == {"c"} and not minority.stop


def test_the_clock_runs_for_running_jobs_only() -> None:
    job = Job()
    decider = job.decider
    assert decider.needs_clock(job.session.state) == ["job1"]
    job.feed(RankExited(node_id="n0", rank=0, pid=1, generation=0, exit_code=0, classification="success"), "rank/0")
    assert decider.needs_clock(job.session.state) == []
    # A finished job's silent nodes are done, not lost.
    assert job.tick(120) == []


def hang(job: Job, node: str = "n2") -> list[Event]:
    return job.health(node, component="rank", check="no_progress", confidence="medium", fatal=False)


def verdict(job: Job, request: Event, **fields: object) -> list[Event]:
    payload = {"request_id": str(request.id), "round": request.payload.round, "conclusive": True,
               "reason": "rank 5 is stuck elsewhere than the 7 others", **fields}
    return job.feed(StacksAnalyzed(**payload), "job/job1", producer="analyzer")  # type: ignore[arg-type]


def test_a_hang_captures_stacks_and_evicts_the_group_the_analyzer_names() -> None:
    job = Job()
    out = hang(job)
    assert types(out) == ["IncidentOpened", "StacksRequested"] and out[0].payload.kind == "hang"
    [request] = of(out, "StacksRequested")
    assert request.payload.nodes == ["n0", "n1", "n2", "n3"] and "rung 3" in request.payload.reason
    # Every node's ranks hang in the same collective: their reports join the incident.
    assert hang(job, "n0") == []
    out = verdict(job, request, outlier_ranks=[5], outlier_nodes=["n2"], group_kind="pp", group_ranks=[4, 5],
                  group_nodes=["n2"], missing=["rank 7 (pid 9): py-spy failed"])
    [restart] = of(out, "RestartDecided")
    assert restart.payload.rung == 3 and restart.payload.evict == ["n2"]
    assert "the PP group of rank(s) 4, 5 on n2 (over-evicting on purpose)" in restart.payload.reason
    assert "could not see: rank 7 (pid 9): py-spy failed" in restart.payload.reason
    assert [(p.standby_node_id, p.replaces_node_id) for p in restart.payload.promotions] == [("s0", "n2")]
    # The incident id correlates the capture, the verdict and the decision.
    assert request.correlation_id == restart.correlation_id == out[0].correlation_id


def convicted(job: Job, nodes: list[str], ranks: list[int]) -> list[Event]:
    return job.feed(FailSlowConvicted(group_kind="node", group_ranks=ranks, group_nodes=nodes, outlier_ranks=ranks,
                                      rounds=5, flags=4, interval_s=10.0, reason="rank 5 computes 1.3x its peers"),
                    "job/job1", producer="analyzer")


def test_a_fail_slow_conviction_evicts_that_node_at_rung_3_once() -> None:
    job = Job()
    out = convicted(job, ["n2"], [4, 5])
    [opened] = of(out, "IncidentOpened")
    assert opened.payload.kind == "fail_slow" and opened.payload.node_id == "n2" and opened.payload.ranks == [4, 5]
    [restart] = of(out, "RestartDecided")
    assert restart.payload.rung == 3 and restart.payload.evict == ["n2"]
    assert "fail-slow" in restart.payload.reason and "4 of 5 rounds, every 10 s" in restart.payload.reason
    assert [(p.standby_node_id, p.replaces_node_id) for p in restart.payload.promotions] == [("s0", "n2")]
    # A second conviction during that incident is recorded, not acted on twice.
    again = convicted(job, ["n2"], [4, 5])
    assert not of(again, "RestartDecided") and not of(again, "IncidentOpened")


def test_a_fail_slow_conviction_of_an_unknown_node_changes_nothing() -> None:
    job = Job()
    out = convicted(job, ["n9"], [40])
    assert not of(out, "IncidentOpened") and not of(out, "RestartDecided")


def anomaly(job: Job, kind: str, node: str = "n1", step: int = 40) -> list[Event]:
    return job.feed(MetricAnomalyDetected(node_id=node, rank=2, generation=0, kind=kind, metric="loss",  # type: ignore[arg-type]
                                          step=step, value=None, value_text="nan", reason="loss of rank 2 is nan"),
                    f"node/{node}")


def test_a_nan_loss_opens_an_incident_and_diagnoses_before_restarting() -> None:
    job = Job()
    out = anomaly(job, "non_finite")
    [opened] = of(out, "IncidentOpened")
    assert opened.payload.kind == "metric_anomaly" and opened.payload.ranks == [2]
    assert "before step 40" in opened.payload.reason
    assert of(out, "DiagnosticsRequested")
    # The same NaN from the other nodes' ranks joins that incident.
    assert not of(anomaly(job, "non_finite", node="n2"), "IncidentOpened")


def test_a_throughput_decline_alone_is_recorded_not_acted_on() -> None:
    job = Job()
    out = anomaly(job, "decline")
    assert not of(out, "IncidentOpened") and not of(out, "DiagnosticsRequested")


def test_a_group_eviction_beyond_the_ready_standbys_asks_for_the_whole_shortfall_and_waits() -> None:
    job = Job(policy=ControllerPolicy(max_eviction_fraction=1.0))  # one ready standby; the breaker allows two
    [request] = of(hang(job), "StacksRequested")
    out = verdict(job, request, outlier_ranks=[2, 5], outlier_nodes=["n1", "n2"], group_kind="groups",
                  group_ranks=[2, 3, 4, 5], group_nodes=["n1", "n2"])
    assert sorted(e.payload.node_id for e in of(out, "NodeEvictionDecided")) == ["n1", "n2"]
    [refill] = of(out, "StandbyRefillRequested")
    # The actuator brings the pool up to ``target``: the ready standby plus the one missing.
    assert (refill.payload.count, refill.payload.target) == (1, 2)
    assert not of(out, "RestartDecided")
    [held] = of(out, "ActionHeld")
    assert held.payload.guardrail == "no_standby" and held.payload.evict == ["n1", "n2"]
    # The second standby passes its self-check: the held plan goes ahead with both.
    out = job.add_standby("s1")
    [restart] = of(out, "RestartDecided")
    assert restart.payload.rung == 3 and sorted(p.replaces_node_id for p in restart.payload.promotions) == ["n1", "n2"]


def test_an_inconclusive_or_missing_stack_verdict_goes_on_to_diagnostics() -> None:
    job = Job()
    [request] = of(hang(job), "StacksRequested")
    out = verdict(job, request, conclusive=False, reason="all 8 ranks show the same stack")
    [diag] = of(out, "DiagnosticsRequested")
    assert "rung 3 inconclusive: all 8 ranks show the same stack" in diag.payload.reason
    # No verdict at all (the analyzer is not running): rung 2 after stacks_verdict_timeout.
    job = Job(policy=ControllerPolicy(stacks_verdict_timeout=timedelta(seconds=20)))
    hang(job)
    assert job.tick(10) == []
    [diag] = of(job.tick(11), "DiagnosticsRequested")
    assert "no verdict from the analyzer 20 s after" in diag.payload.reason
    # A verdict for another round changes nothing.
    assert verdict(job, request, round=7, group_nodes=["n1"]) == []


def test_a_stall_that_clears_itself_during_the_capture_is_resolved_without_stopping_the_job() -> None:
    # Every node steps past step 20 (where the job stood) before an inconclusive verdict: a long save or
    # eval outside its phase, not a hang. Nothing is stopped, evicted or restarted.
    job = Job()
    [opened] = of(hang(job), "IncidentOpened")
    [request] = of(job.log, "StacksRequested")
    job.heartbeats(step=21)
    out = verdict(job, request, conclusive=False, reason="all 8 ranks show the same stack")
    assert types(out) == ["IncidentResolved"], types(out)
    [resolved] = out
    assert resolved.payload.incident_id == str(opened.id)
    assert (resolved.payload.outcome, resolved.payload.rung) == ("recovered", 0)
    assert "cleared itself" in resolved.payload.reason and "all 8 ranks show the same stack" in resolved.payload.reason
    # The next hang is a new incident, captured again.
    assert types(hang(job)) == ["IncidentOpened", "StacksRequested"]


def test_a_stall_some_nodes_stepped_past_or_a_conclusive_verdict_still_escalates() -> None:
    # Only three of four nodes stepped on: the fourth may still hang; rung 2 as before.
    job = Job()
    [request] = of(hang(job), "StacksRequested")
    job.heartbeats(step=21, nodes=["n0", "n1", "n3"])
    job.heartbeats(step=20, nodes=["n2"])
    assert of(verdict(job, request, conclusive=False, reason="same stacks"), "DiagnosticsRequested")
    # Every node stepped on, but the analyzer names an outlier: it stalled everyone and may again.
    job = Job()
    [request] = of(hang(job), "StacksRequested")
    job.heartbeats(step=21)
    out = verdict(job, request, outlier_ranks=[5], outlier_nodes=["n2"], group_kind="node", group_ranks=[4, 5],
                  group_nodes=["n2"])
    assert [e.payload.node_id for e in of(out, "NodeEvictionDecided")] == ["n2"]
    # No verdict at all, and every node stepped on: resolved when the verdict's wait runs out.
    job = Job(policy=ControllerPolicy(stacks_verdict_timeout=timedelta(seconds=20)))
    hang(job)
    job.heartbeats(step=22)
    out = job.tick(21)
    assert types(out) == ["IncidentResolved"] and "no verdict came from the analyzer within 20 s" in \
        out[0].payload.reason


def test_without_stack_analysis_a_hang_runs_diagnostics() -> None:
    job = Job(policy=ControllerPolicy(stack_analysis=False))
    out = hang(job)
    assert types(out) == ["IncidentOpened", "DiagnosticsRequested"] and out[0].payload.kind == "hang"


def test_a_cordoned_node_is_neither_diagnosed_nor_promoted() -> None:
    job = Job(standbys=2)
    job.feed(NodeCordoned(node_id="s0", by="alice", reason="PSU ticket"), "node/s0", producer="keel-cli")
    [request] = of(job.crash("n1", 3), "DiagnosticsRequested")
    for node in ["n0", "n1", "n2"]:
        job.diagnostics(node, request)
    out = job.diagnostics("n3", request, passed=False)
    [restart] = of(out, "RestartDecided")
    assert [p.standby_node_id for p in restart.payload.promotions] == ["s1"]


# -- rungs 4 and 6, and progress ---------------------------------------------------------------------


def test_user_code_restarts_at_once_then_rolls_back_then_stops_and_pages() -> None:
    job = Job()
    err = "KeyError: 'lm_head'"
    first = job.crash("n0", 1, classification="user_code", err=err)
    assert types(first)[:2] == ["IncidentOpened", "RestartDecided"] and not of(first, "DiagnosticsRequested")
    assert "names the user's code" in of(first, "RestartDecided")[0].payload.reason
    job.restart(first, restore_step=18, step=19)  # resumes, but fails again before passing step 20
    second = job.crash("n0", 1, classification="user_code", err=err)
    [rollback] = of(second, "RollbackDecided")
    [restart] = of(second, "RestartDecided")
    assert restart.payload.rung == 4 and restart.payload.rollback and "2 times in a row" in rollback.payload.reason
    job.restart(second, restore_step=18, step=19)
    third = job.crash("n0", 1, classification="user_code", err=err)
    [stop] = of(third, "JobStopDecided")
    [resolved] = of(third, "IncidentResolved")
    assert stop.payload.rung == 6 and stop.payload.page and "crash loop" in stop.payload.reason
    assert resolved.payload.outcome == "stopped" and not of(third, "RanksRestartRequested")
    # Nothing restarts a stopped job by itself.
    assert job.crash("n1", 2, generation=job.generation) == [] and "stopped" in job.last_reason


def test_a_restarted_generation_failing_at_once_supersedes_its_incident_and_escalates() -> None:
    job = Job()
    err = "KeyError: 'lm_head'"
    first = job.crash("n0", 1, classification="user_code", err=err)
    [restart] = of(first, "RestartDecided")
    job.generation = restart.payload.generation
    # The new generation starts and restores step 18, then fails at step 19 before any heartbeat says it
    # stepped past 18: the first incident never resolved by itself.
    out = job.crash("n0", 1, classification="user_code", err=err)
    [superseded] = of(out, "IncidentResolved")
    assert superseded.payload.outcome == "superseded" and superseded.correlation_id == of(first, "IncidentOpened")[0].id
    [opened] = of(out, "IncidentOpened")
    assert opened.id != superseded.correlation_id and of(out, "RollbackDecided")
    assert all(e.correlation_id == opened.id for e in out if e.type != "IncidentResolved")


def test_progress_past_the_failure_resets_the_crash_loop() -> None:
    job = Job()
    err = "ValueError: bad batch"
    job.restart(job.crash("n0", 1, classification="user_code", err=err), restore_step=18, step=19)
    job.heartbeats(step=40)  # past step 20, where it failed
    again = job.crash("n0", 1, classification="user_code", err=err)
    assert not of(again, "RollbackDecided") and of(again, "RestartDecided")[0].payload.rung == 2


def test_a_failure_before_any_reported_step_is_reset_by_the_first_steps_after_it() -> None:
    # The job crashed before a heartbeat had reported a step (right after its start): stepping at all
    # afterwards is progress, so the same crash later is a new failure (rung 2), not a loop (rung 4).
    job = Job(first_step=-1)
    err = "ValueError: bad batch"
    job.restart(job.crash("n0", 1, classification="user_code", err=err), restore_step=-1, step=0)
    job.heartbeats(step=30)
    again = job.crash("n0", 1, classification="user_code", err=err)
    assert not of(again, "RollbackDecided") and of(again, "RestartDecided")[0].payload.rung == 2
    # A generation that fails again before any step is a loop, as before.
    job = Job(first_step=-1)
    job.restart(job.crash("n0", 1, classification="user_code", err=err), restore_step=-1, step=-1)
    job.heartbeats(step=-1)
    assert of(job.crash("n0", 1, classification="user_code", err=err), "RollbackDecided")


def test_exits_of_an_older_generation_are_not_a_new_incident() -> None:
    job = Job()
    job.restart(job.crash("n0", 1, classification="user_code"), restore_step=18, step=19)
    assert job.crash("n2", 4, generation=0) == [] and "old generation" in job.last_reason


# -- guardrails ------------------------------------------------------------------------------------


def test_observe_mode_decides_and_records_but_executes_nothing() -> None:
    job = Job(policy=ControllerPolicy(observe_only=True))
    out = job.health("n2")
    [eviction] = of(out, "NodeEvictionDecided")
    [held] = of(out, "ActionHeld")
    assert eviction.payload.observe_only and held.payload.guardrail == "observe_only"
    assert not of(out, "RanksRestartRequested") and not of(out, "StandbyPromotionRequested")
    diag = Job(policy=ControllerPolicy(observe_only=True)).crash("n1", 3)
    assert not of(diag, "DiagnosticsRequested") and of(diag, "ActionHeld")[0].payload.action == "diagnose"


def test_eviction_breaker_stops_evicting_and_pages() -> None:
    job = Job(nodes=4, standbys=3, policy=ControllerPolicy(max_evictions=1))
    job.restart(job.health("n1"))
    out = job.health("n2")
    [held] = of(out, "ActionHeld")
    assert held.payload.guardrail == "eviction_breaker" and "circuit breaker open" in held.payload.reason
    assert of(out, "JobStopDecided") and not of(out, "NodeEvictionDecided")


def test_restart_budget_spent_stops_the_job() -> None:
    job = Job(policy=ControllerPolicy(restart_budget=2))
    for err in ["A: one", "B: two"]:
        job.restart(job.crash("n0", 1, classification="user_code", err=err))
        job.heartbeats(step=40)
    out = job.crash("n0", 1, classification="user_code", err="C: three")
    assert of(out, "JobStopDecided") and "restart budget spent" in of(out, "JobStopDecided")[0].payload.reason


def test_approval_required_waits_for_a_human_and_carries_out_on_approve() -> None:
    job = Job(policy=ControllerPolicy(approval_required=frozenset({"evict"})))
    out = job.health("n2")
    [request] = of(out, "ApprovalRequested")
    assert of(out, "ActionHeld")[0].payload.guardrail == "approval" and not of(out, "NodeEvictionDecided")
    assert job.feed(ApprovalGiven(request_id=str(uuid.uuid4()), approved=True, by="bob"), "job/job1") == []
    out = job.feed(ApprovalGiven(request_id=str(request.id), approved=True, by="alice"), "job/job1", producer="keel-cli")
    assert [e.payload.node_id for e in of(out, "NodeEvictionDecided")] == ["n2"]
    assert "approved by alice" in of(out, "RestartDecided")[0].payload.reason


def test_a_denied_approval_stops_the_job_for_a_human() -> None:
    job = Job(policy=ControllerPolicy(approval_required=frozenset({"restart"})))
    out = job.crash("n0", 1, classification="user_code")
    [request] = of(out, "ApprovalRequested")
    out = job.feed(ApprovalGiven(request_id=str(request.id), approved=False, by="alice", comment="investigating"),
                   "job/job1")
    assert of(out, "JobStopDecided") and of(out, "IncidentResolved")[0].payload.outcome == "stopped"


def test_an_approval_nobody_gives_in_time_is_taken_as_denied_not_waited_for_forever() -> None:
    job = Job(policy=ControllerPolicy(approval_required=frozenset({"restart"}), approval_ttl=timedelta(minutes=30)))
    out = job.crash("n0", 1, classification="user_code")
    [request] = of(out, "ApprovalRequested")
    job.heartbeats(step=20)
    assert not of(job.tick(29 * 60), "JobStopDecided")  # still within the approval's time
    out = job.tick(61)
    [stop] = of(out, "JobStopDecided")
    [resolved] = of(out, "IncidentResolved")
    assert resolved.payload.outcome == "stopped" and "nobody answered" in resolved.payload.reason
    assert not of(out, "RestartDecided") and not of(out, "RanksRestartRequested")
    # A late approval changes nothing: the held recovery is gone.
    late = job.feed(ApprovalGiven(request_id=str(request.id), approved=True, by="alice"), "job/job1")
    assert not of(late, "RestartDecided")
    assert "nobody answered" in stop.payload.reason


def test_an_event_stamped_before_the_job_was_first_seen_does_not_break_the_pool_model() -> None:
    job = Job(standbys=0)
    job.now = T0 - timedelta(minutes=10)  # another producer's clock, or a late event
    out = job.add_standby("s9")
    assert job.last_reason and all(e.type in ("StandbyPoolSized", "StandbyRefillRequested") for e in out)


def test_an_unknown_approval_kind_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown action kind"):
        ControllerPolicy(approval_required=frozenset({"reboot"}))


# -- the pool --------------------------------------------------------------------------------------


def test_the_pool_target_is_the_binomial_99th_percentile_of_the_measured_rate() -> None:
    # 0.05 failures per node-hour, a 1 h window: p = 1 - e^-0.05 = 0.04877. For 4 nodes,
    # P(X <= 1) = 0.9512^4 + 4 x 0.04877 x 0.9512^3 = 0.8187 + 0.1679 = 0.9866 < 0.99, P(X <= 2) = 0.9995: 2 standbys.
    policy = ControllerPolicy(standby_prior_rate_per_node_hour=0.05, standby_prior_node_hours=1e9)
    job = Job(nodes=4, standbys=0, policy=policy)
    job.add_standby("s0")
    sized = of(job.log, "StandbyPoolSized")[-1]
    assert sized.payload.failure_probability == pytest.approx(0.04877, abs=1e-5)
    assert sized.payload.target == 2 and sized.payload.job_nodes == 4
    assert sized.payload.failure_probability == pytest.approx(failure_probability(
        0, 4 * (job.now - T0).total_seconds() / 3600, timedelta(hours=1), prior_rate_per_node_hour=0.05,
        prior_node_hours=1e9))
    assert plan_standby_pool(4, sized.payload.failure_probability).size == 2
    # One standby ready or checking of two: the actuator is asked for the other.
    refill = of(job.log, "StandbyRefillRequested")[-1]
    assert (refill.payload.count, refill.payload.target) == (1, 2)
    # Asked once: more pool changes before the new standby registers ask for nothing more...
    asked = len(of(job.log, "StandbyRefillRequested"))
    job.feed(StandbyChecked(node_id="s0", passed=True), "node/s0")
    job.feed(StandbyChecked(node_id="s0", passed=True), "node/s0")
    assert len(of(job.log, "StandbyRefillRequested")) == asked
    # ...until that request expired unanswered.
    job.now += timedelta(minutes=10)
    job.feed(StandbyChecked(node_id="s0", passed=True), "node/s0")
    assert len(of(job.log, "StandbyRefillRequested")) == asked + 1
    # With the default prior a 4-node job needs none ((1 - 0.0012)^4 = 0.9952 >= 0.99); a configured
    # minimum still holds.
    job = Job(nodes=4, standbys=0, policy=ControllerPolicy(standby_min=1))
    assert of(job.log, "StandbyPoolSized")[-1].payload.target == 1


# -- determinism, replay and cold start ----------------------------------------------------------------


def test_no_decision_emits_two_events_with_one_id() -> None:
    """One cause can close an incident and open, then stop, the next: every event keeps its own id."""
    job = Job()
    err = "KeyError: 'lm_head'"
    for _ in range(3):
        out = job.crash("n0", 1, classification="user_code", err=err)
        assert len({e.id for e in out}) == len(out), types(out)
        if of(out, "RestartDecided"):
            job.generation = of(out, "RestartDecided")[0].payload.generation
    assert [e.payload.outcome for e in of(out, "IncidentResolved")] == ["superseded", "stopped"]
    decisions = [e for e in job.log if e.producer == "controller"]
    assert len({e.id for e in decisions}) == len(decisions)


def test_a_decision_is_built_once_with_its_correlation_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The events an ``ActionPlan`` folds while it decides are the events the kernel emits, byte for byte:
    an ``IncidentOpened`` carries its own id as its correlation id from the start (nothing is patched
    afterwards), also when one cause closes one incident and opens the next."""
    plans: list[ActionPlan] = []

    class Recording(ActionPlan):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            plans.append(self)

    monkeypatch.setattr(controller_decider, "ActionPlan", Recording)
    job = Job()
    err = "KeyError: 'lm_head'"
    outs = [job.health("n2")]
    job.restart(outs[0])
    for _ in range(3):
        outs.append(job.crash("n0", 1, classification="user_code", err=err))
        assert [e.to_json() for e in plans[-1].events] == [e.to_json() for e in outs[-1]], types(outs[-1])
        if of(outs[-1], "RestartDecided"):
            job.generation = of(outs[-1], "RestartDecided")[0].payload.generation
    opened = [e for out in outs for e in of(out, "IncidentOpened")]
    assert len(opened) == 4 and all(e.correlation_id == e.id for e in opened)


def test_the_same_inputs_give_the_same_decisions_and_ids() -> None:
    def run() -> list[Event]:
        job = Job()
        job.restart(job.health("n2"))
        [request] = of(job.crash("n0", 1), "DiagnosticsRequested")
        return [e for e in job.log if e.producer == "controller"]

    first, second = run(), run()
    assert [e.id for e in first] == [e.id for e in second] and first == second


def test_replay_of_the_log_is_clean_and_a_cold_start_rebuilds_the_open_incident() -> None:
    job = Job()
    job.restart(job.health("n2"))
    out = job.crash("n0", 1)
    [request] = of(out, "DiagnosticsRequested")
    job.diagnostics("n0", request)
    report = verify(ControllerDecider(), job.log)
    assert report.clean, [d.describe() for d in report.divergences]
    # A controller restarted now folds the log and decides nothing about history...
    cold = DeciderSession(ControllerDecider())
    cold.rebuild(job.log)
    live = job.session.state.job("job1")
    rebuilt = cold.state.job("job1")
    assert rebuilt.incident == live.incident and rebuilt.incident.stage == "diagnosing"
    assert rebuilt.nodes == live.nodes and rebuilt.generation == live.generation == 1
    # ...and goes on where the live one was: the remaining results conclude the same round.
    remaining = [n for n in ["n1", "s0", "n3"]]
    for node in remaining:
        event = Event.create(DiagnosticsCompleted(node_id=node, request_id=str(request.id), round=0, passed=True),
                             job_id="job1", subject=f"node/{node}", producer="node-agent", occurred_at=job.now)
        result = cold.observe(event)
    assert of(result.emitted, "RestartDecided")[0].payload.generation == 2


# -- rung 5: dual-phase replay -------------------------------------------------------------------


def registered(job: Job) -> None:
    """The ranks' checkpoint registrations: PP 1 (each rank its own pipeline), so each node is a unit."""
    for i, node in enumerate(job.nodes):
        ranks = [i * job.per_node + local for local in range(job.per_node)]
        job.feed(CheckpointRanksRegistered(node_id=node, generation=0, world_size=len(job.nodes) * job.per_node,
                                           store_address="127.0.0.1:1", ranks=[RankGroups(rank=r, pp=[r], tp=[r])
                                                                               for r in ranks]), f"node/{node}")


def diagnosed_clean(job: Job, out: list[Event]) -> list[Event]:
    [request] = of(out, "DiagnosticsRequested")
    result: list[Event] = []
    for node in request.payload.nodes:
        result += job.diagnostics(node, request)
    return result


def replay_verdict(job: Job, request: Event, **fields) -> list[Event]:  # type: ignore[no-untyped-def]
    return job.feed(SdcReplayAnalyzed(request_id=str(request.id), round=request.payload.round, **fields), "job/job1",
                    producer="analyzer", correlation=request.correlation_id)


def test_rung5_a_nan_that_diagnostics_do_not_explain_is_replayed_and_the_located_node_evicted() -> None:
    job = Job()
    registered(job)
    out = diagnosed_clean(job, anomaly(job, "non_finite", step=40))
    [replay] = of(out, "SdcReplayRequested")
    p = replay.payload
    assert not of(out, "RestartDecided")
    assert p.anomaly_step == 40 and p.generation == 1 and p.nodes == ["n0", "n1", "n2", "n3"]
    assert [u.name for u in p.units] == ["n0", "n1", "n2", "n3"] and [u.ranks for u in p.units][1] == [2, 3]
    assert [ph.kind for ph in p.phases] == ["contiguous", "strided"]
    assert [ph.groups for ph in p.phases] == [[["n0", "n1"], ["n2", "n3"]], [["n0", "n2"], ["n1", "n3"]]]
    assert "rung 5" in p.reason and replay.correlation_id is not None
    out = replay_verdict(job, replay, kind="found", unit="n2", nodes=["n2"], candidates=["n2"], rounds=2,
                         reason="machine n2 is the only one in a failing group of every phase")
    [restart] = of(out, "RestartDecided")
    assert restart.payload.rung == 5 and restart.payload.evict == ["n2"] and restart.payload.generation == 2
    assert [pr.replaces_node_id for pr in restart.payload.promotions] == ["n2"]
    assert of(out, "NodeEvictionDecided")[0].payload.node_id == "n2"
    # The job steps again: the incident closes at rung 5.
    resolved = of(job.restart(out, restore_step=39, step=40), "IncidentResolved")
    assert resolved and resolved[0].payload.rung == 5


def test_rung5_an_ambiguous_round_runs_the_split_phase_with_the_reference_then_evicts_both() -> None:
    job = Job(policy=ControllerPolicy(max_eviction_fraction=1.0), standbys=2)
    registered(job)
    [replay] = of(diagnosed_clean(job, anomaly(job, "spike")), "SdcReplayRequested")
    split = SdcPhase(index=3, kind="split", groups=[["n0", "n1"], ["n3", "n2"]], suspects=["n0", "n3"])
    out = replay_verdict(job, replay, kind="ambiguous", candidates=["n0", "n3"], next_phase=split,
                         reference_digest="abc", rounds=2, reason="2 suspects remain")
    [again] = of(out, "SdcReplayRequested")
    assert again.payload.round == 1 and again.payload.phases == [split] and again.payload.reference == "abc"
    out = replay_verdict(job, again, kind="several", nodes=["n0", "n3"], candidates=["n0", "n3"], rounds=3,
                         reason="2 machines fail on their own")
    [restart] = of(out, "RestartDecided")
    assert restart.payload.evict == ["n0", "n3"] and restart.payload.rung == 5


def test_rung5_not_reproduced_restarts_in_place_and_a_missing_verdict_times_out() -> None:
    job = Job()
    registered(job)
    [replay] = of(diagnosed_clean(job, anomaly(job, "non_finite")), "SdcReplayRequested")
    out = replay_verdict(job, replay, kind="not_reproduced", rounds=1, reason="no group failed in phase 1")
    [restart] = of(out, "RestartDecided")
    assert restart.payload.evict == [] and restart.payload.rung == 5 and "not reproduced" in restart.payload.reason

    other = Job()
    registered(other)
    [replay] = of(diagnosed_clean(other, anomaly(other, "non_finite")), "SdcReplayRequested")
    assert not of(other.tick(60), "RestartDecided")
    [restart] = of(other.tick(31), "RestartDecided")
    assert restart.payload.evict == [] and "no verdict" in restart.payload.reason


def test_rung5_is_skipped_without_checkpointed_ranks_or_with_a_single_unit() -> None:
    job = Job()  # no checkpoint registrations: nothing to replay from
    out = diagnosed_clean(job, anomaly(job, "non_finite"))
    assert not of(out, "SdcReplayRequested")
    [restart] = of(out, "RestartDecided")
    assert "no checkpointed ranks" in restart.payload.reason
    # One pipeline over every node: one unit, nothing to tell apart.
    whole = Job(nodes=2, per_node=1)
    whole.feed(CheckpointRanksRegistered(node_id="n0", generation=0, world_size=2, store_address="a:1",
                                         ranks=[RankGroups(rank=0, pp=[0, 1])]), "node/n0")
    out = diagnosed_clean(whole, anomaly(whole, "non_finite", node="n0"))
    assert not of(out, "SdcReplayRequested") and "1 replay unit(s)" in of(out, "RestartDecided")[0].payload.reason
    # Two replicas: one result against the other, no majority.
    pair = Job(nodes=2, per_node=1)
    registered(pair)
    out = diagnosed_clean(pair, anomaly(pair, "non_finite", node="n0"))
    assert not of(out, "SdcReplayRequested") and "at least 3 units" in of(out, "RestartDecided")[0].payload.reason


def test_rung5_decisions_replay_identically_from_the_log() -> None:
    job = Job()
    registered(job)
    [replay] = of(diagnosed_clean(job, anomaly(job, "non_finite")), "SdcReplayRequested")
    replay_verdict(job, replay, kind="found", unit="n1", nodes=["n1"], candidates=["n1"], rounds=2, reason="n1")
    report = verify(ControllerDecider(), job.log)
    assert report.clean, [d.describe() for d in report.divergences]
    assert report.decisions_replayed >= 3  # the replay request, the restart, the eviction among them


def test_rung5_observe_mode_runs_no_diagnostics_nor_replay_and_each_incident_replays_its_own_anomaly_step() -> None:
    job = Job(policy=ControllerPolicy(observe_only=True))
    registered(job)
    out = anomaly(job, "non_finite", step=40)
    assert not of(out, "DiagnosticsRequested") and of(out, "ActionHeld")  # observe mode: not even diagnostics
    live = Job()
    registered(live)
    [first] = of(diagnosed_clean(live, anomaly(live, "non_finite", step=40)), "SdcReplayRequested")
    out = replay_verdict(live, first, kind="not_reproduced", rounds=1, reason="no group failed")
    live.restart(out, restore_step=39, step=41)
    later = live.feed(MetricAnomalyDetected(node_id="n1", rank=2, generation=live.generation, kind="spike",
                                            metric="grad_norm", step=90, value=50.0, value_text="50",
                                            reason="grad_norm spike"), "node/n1")
    [second] = of(diagnosed_clean(live, later), "SdcReplayRequested")
    assert (first.payload.anomaly_step, second.payload.anomaly_step) == (40, 90)
    assert second.payload.round == 1 and second.payload.generation > first.payload.generation


def test_only_the_job_clock_moves_time_a_tick_from_anyone_else_is_ignored() -> None:
    # The diagnostics deadline (20 s) passes only on the job clock's ticks. A tick another producer
    # publishes (a second clock, a hostile client) must neither conclude the round nor change the state.
    job = Job(policy=ControllerPolicy(diagnostics_timeout=timedelta(seconds=20)))
    [request] = of(job.crash("n1", 3), "DiagnosticsRequested")
    for node in ["n0", "n1", "n2"]:
        job.diagnostics(node, request)
    job.now += timedelta(seconds=25)
    state_before = job.session.state
    for producer in ("analyzer-clock", "intruder", "controller"):
        assert job.feed(TimerTicked(now=job.now), "clock/j", producer=producer, dt=0) == []
    assert job.session.state is state_before
    # Logs recorded before there was one clock ticked as "controller-clock" (or "checkpoint-broker-clock"): still time.
    out = job.feed(TimerTicked(now=job.now), "clock/j", producer="controller-clock", dt=0)
    [restart] = of(out, "RestartDecided")
    assert restart.payload.evict == ["n3"]


def _restarted_in_place(job: Job) -> list[Event]:
    """A crash that diagnostics clear: the incident's restart (rung 2) is decided and awaits the ranks."""
    [request] = of(job.crash("n1", 3), "DiagnosticsRequested")
    out: list[Event] = []
    for node in ["n0", "n1", "n2", "n3"]:
        out = job.diagnostics(node, request)
    assert of(out, "RestartDecided")
    return out


def test_a_node_that_cannot_carry_out_the_restart_is_evicted_and_a_standby_takes_its_ranks() -> None:
    job = Job()
    [restart] = of(_restarted_in_place(job), "RestartDecided")
    generation = restart.payload.generation
    assert job.feed(RanksRestarted(node_id="n0", command_id="c0", generation=generation, outcome="restarted"),
                    "node/n0") == []
    out = job.feed(RanksRestarted(node_id="n2", command_id="c2", generation=generation, outcome="failed",
                                  detail="zygote died"), "node/n2")
    assert [e.payload.node_id for e in of(out, "NodeEvictionDecided")] == ["n2"]
    [again] = of(out, "RestartDecided")
    assert again.payload.generation > generation and "could not restart" in again.payload.reason
    assert [(p.standby_node_id, p.replaces_node_id) for p in again.payload.promotions] == [("s0", "n2")]


def test_a_restart_that_never_brings_the_job_back_stops_it_at_the_recovery_deadline() -> None:
    # Silence is another rule: the heartbeats here cover the job's nodes, not its idle standby.
    job = Job(policy=ControllerPolicy(recovery_timeout=timedelta(minutes=10), node_silence_timeout=timedelta(hours=1)))
    _restarted_in_place(job)
    for _ in range(9):  # nodes heartbeat, but no rank of the new generation ever starts stepping
        job.heartbeats(step=18)
        assert not of(job.tick(60), "JobStopDecided")
    job.heartbeats(step=18)
    out = job.tick(61)
    [stop] = of(out, "JobStopDecided")
    assert "did not bring the job back" in stop.payload.reason
    assert of(out, "IncidentResolved")[0].payload.outcome == "stopped"
