"""A realistic event log for the replay benchmark: jobs that live, fail and recover, decided as they go.

Replaying a log of alternating health events (what the bus benchmark did before) measures decoding and
an almost idle fold: nothing there makes a decider decide. Here each job is played through the four
deciders ``keel replay --verify`` checks (controller, checkpoint broker, analyzer, hot-update; built
from default settings as the services build them), and a simulated cluster answers their commands the
way the agents and the actuator do, so the log holds what a real one holds:

- nodes registering (``nodes`` workers and two warm standbys, one self-checked), ranks starting, the
  ranks' checkpoint registration with their DP / PP groups (the broker assigns backups and schedules);
- the job clock (a ``TimerTicked`` every second), a heartbeat per node every 5 s with its step and
  per-rank compute times (the analyzer's fail-slow rounds sample them), a disk checkpoint every 100 steps;
- incidents, each decided by the deciders themselves and answered: a rank crash (rung 2: diagnostics
  round, every node answers, restart in place), a fatal XID (rung 1: eviction carried out by the
  actuator, standby promoted, the rest restarted), each resolved by the heartbeats of the new
  generation past the restore point; then every rank exiting at the end.

Every decision in the log is the decider's own (deterministic ids), so a replay must find each of them
again: the benchmark verifies that while it measures.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CLOCK_PRODUCER,
    CheckpointRanksRegistered,
    CheckResult,
    DiagnosticsCompleted,
    DiagnosticsRequested,
    NodeEvicted,
    NodeEvictionDecided,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeRegistered,
    RankExited,
    RankGroups,
    RanksRestarted,
    RanksRestartRequested,
    RankStarted,
    StandbyChecked,
    StandbyPromoted,
    StandbyPromotionRequested,
    TimerTicked,
)
from keel.kernel.decider import DeciderSession


def deciders() -> dict[str, Any]:
    """The deciders ``keel replay`` runs, built from default settings as the services build them."""
    from keel.cli.replay import deciders_for
    from keel.infra.config import Settings

    return deciders_for(Settings())


class JobSim:
    """One job of ``nodes`` x ``per_node`` ranks (DP x PP 2), its deciders, and the cluster answering them."""

    def __init__(self, job: str, start: datetime, nodes: int = 8, per_node: int = 8) -> None:
        self.job, self.now, self.per_node = job, start, per_node
        self.sessions = [DeciderSession(d) for d in deciders().values()]
        self.slots = [f"{job}-n{i}" for i in range(nodes)]  # slot -> the node running it now
        self.standbys = [f"{job}-s0", f"{job}-s1"]
        self.world = nodes * per_node
        self.generation = 0
        self.step = 0
        self.log: list[Event] = []
        self.count = 0

    # -- the log -----------------------------------------------------------------------------------

    def emit(self, payload: EventPayload, subject: str, producer: str = "agent",
             cause: Event | None = None) -> None:
        """Record an input (deterministic id) and let every decider fold and decide on it."""
        self.count += 1
        event = Event.create(payload, job_id=self.job, subject=subject, producer=producer, occurred_at=self.now,
                             event_id=uuid.uuid5(uuid.NAMESPACE_OID, f"{self.job}/{self.count}"),
                             causation_id=cause.id if cause else None,
                             correlation_id=cause.correlation_id if cause else None)
        self.deliver(event)

    def deliver(self, event: Event) -> None:
        self.log.append(event)
        emitted: list[Event] = []
        for session in self.sessions:
            emitted += session.observe(event).emitted
        for decision in emitted:  # each decider's decisions reach the others (and echo to their own)
            self.deliver(decision)
        for decision in emitted:
            self.answer(decision)

    def answer(self, decision: Event) -> None:
        """What the agents and the actuator do with a command."""
        p = decision.payload
        if isinstance(p, DiagnosticsRequested):
            for node in p.nodes:
                self.emit(DiagnosticsCompleted(node_id=node, request_id=str(decision.id), round=p.round, passed=True,
                                               results=[CheckResult(check="inter_node_all_gather", passed=True,
                                                                    duration_s=0.4)]), f"node/{node}", cause=decision)
        elif isinstance(p, NodeEvictionDecided):
            self.emit(NodeEvicted(node_id=p.node_id, decision_id=str(decision.id), actuator="local", outcome="evicted"),
                      f"node/{p.node_id}", producer="actuator", cause=decision)
        elif isinstance(p, StandbyPromotionRequested):
            self.slots[self.slots.index(p.replaces_node_id)] = p.node_id
            self.standbys.remove(p.node_id)
            self.emit(StandbyPromoted(node_id=p.node_id, command_id=str(decision.id), replaces_node_id=p.replaces_node_id,
                                      generation=p.generation, outcome="promoted"), f"node/{p.node_id}", cause=decision)
            self.start_ranks(p.node_id, p.generation, decision)
        elif isinstance(p, RanksRestartRequested):
            self.emit(RanksRestarted(node_id=p.node_id, command_id=str(decision.id), generation=p.generation,
                                     outcome="restarted"), f"node/{p.node_id}", cause=decision)
            self.start_ranks(p.node_id, p.generation, decision)

    def start_ranks(self, node: str, generation: int, cause: Event | None = None) -> None:
        self.generation = max(self.generation, generation)
        slot = self.slots.index(node)
        for local in range(self.per_node):
            rank = slot * self.per_node + local
            self.emit(RankStarted(node_id=node, rank=rank, local_rank=local, world_size=self.world, pid=1000 + rank,
                                  generation=generation), f"rank/{rank}", cause=cause)
        pp = 2
        dp = self.world // pp
        groups = [RankGroups(rank=r, dp=[s * pp + r % pp for s in range(dp)], pp=[r - r % pp + i for i in range(pp)])
                  for r in range(slot * self.per_node, (slot + 1) * self.per_node)]
        self.emit(CheckpointRanksRegistered(node_id=node, generation=generation, world_size=self.world,
                                            store_address=f"{node}:7070", ranks=groups), f"node/{node}")

    def later(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    # -- a life ------------------------------------------------------------------------------------

    def run(self, seconds: int = 1500) -> list[Event]:
        for node in self.slots:
            self.emit(NodeRegistered(node_id=node, host=node, addresses=[f"10.0.0.{len(self.log) % 250 + 1}"]),
                      f"node/{node}")
        for node in self.standbys:
            self.emit(NodeRegistered(node_id=node, host=node, standby=True), f"node/{node}")
            self.emit(StandbyChecked(node_id=node, passed=True), f"node/{node}")
        self.later(1)
        for node in list(self.slots):
            self.start_ranks(node, 0)
        incidents = {seconds // 3: self.crash, 2 * seconds // 3: self.xid}
        for second in range(2, seconds):
            self.later(1)
            self.emit(TimerTicked(now=self.now, interval_s=1.0), f"clock/{self.job}", producer=CLOCK_PRODUCER)
            self.step += 2
            if second % 5 == 0:
                self.heartbeats()
            if second in incidents:
                incidents[second]()
        for slot, node in enumerate(self.slots):
            for local in range(self.per_node):
                rank = slot * self.per_node + local
                self.emit(RankExited(node_id=node, rank=rank, pid=1000 + rank, generation=self.generation, exit_code=0,
                                     classification="success", reason="exited 0"), f"rank/{rank}")
        return self.log

    def heartbeats(self) -> None:
        for slot, node in enumerate(self.slots):
            compute = {slot * self.per_node + i: 0.31 + 0.002 * ((slot + i + self.step) % 7) for i in range(self.per_node)}
            self.emit(NodeHeartbeat(node_id=node, ranks_alive=self.per_node, ranks_expected=self.per_node,
                                    last_step=self.step, step_time_p50_s=0.5, rank_compute_time_p50_s=compute,
                                    generation=self.generation, ranks_reporting=self.per_node), f"node/{node}")
        for node in self.standbys:
            self.emit(NodeHeartbeat(node_id=node, standby=True, ranks_alive=0, ranks_expected=0), f"node/{node}")

    def crash(self) -> None:
        node = self.slots[1]
        self.emit(RankExited(node_id=node, rank=self.per_node + 1, pid=1000 + self.per_node + 1, generation=self.generation,
                             exit_code=None, signal="SIGSEGV", classification="infrastructure",
                             error_type="SIGSEGV", reason="killed by SIGSEGV"), f"rank/{self.per_node + 1}")

    def xid(self) -> None:
        node = self.slots[2]
        self.emit(NodeHealthChanged(node_id=node, status="failed", component="gpu", check="xid", confidence="high",
                                    is_fatal=True, detail=f"XID 79 on {node}"), f"node/{node}")  # the inspector runs in the agent


def job_logs(count: int, start: datetime) -> Iterator[list[Event]]:
    """Logs of jobs until at least ``count`` events, each job played on its own (ids of its own)."""
    made, index = 0, 0
    while made < count:
        log = JobSim(f"job{index:05d}", start + timedelta(hours=index)).run()
        made += len(log)
        index += 1
        yield log
