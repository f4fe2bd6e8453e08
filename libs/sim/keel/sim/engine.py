"""Keel on a simulated fleet: the real controller's decider, fed the events real agents emit (pure, no I/O).

A discrete-event loop over a heap of timed actions on a simulated clock (no NATS, no PostgreSQL, no
processes, no sleeping). The simulator plays the agents (health events, rank exits and starts, heartbeats,
diagnostics results), the job clock (``TimerTicked``), the actuator (evictions, standbys), the checkpoint
broker's restore plan and the analyzer's verdicts (stack aggregation, fail-slow, SDC replay), each after a
duration drawn from the calibration. Every decision is the controller's own (``ControllerDecider`` in a
``DeciderSession``, as live and in ``keel replay``): the simulator only carries out the commands it emits.

Simplifications (docs/fleet-sim.md): one rank per machine in the controller's view (a machine's 8 GPUs move
together); the job clock ticks only while something is in flight (a gap in between, which the controller's
recorded clock skips, as it does a clock host that was down); a host that dies is reported by a stand-in
health event after the silence timeout rather than by 30 s of other machines' heartbeats.
"""

from __future__ import annotations

import heapq
import random
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from keel.controller.decider import ControllerDecider
from keel.controller.policy import ControllerPolicy
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    CheckResult,
    DiagnosticsCompleted,
    DiagnosticsRequested,
    FailSlowConvicted,
    IncidentResolved,
    JobRegistered,
    JobStopDecided,
    MetricAnomalyDetected,
    NodeEvicted,
    NodeEvictionDecided,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeRegistered,
    RankExited,
    RankGroups,
    RanksRestartRequested,
    RankStarted,
    RestartDecided,
    SdcReplayAnalyzed,
    SdcReplayRequested,
    StacksAnalyzed,
    StacksRequested,
    StandbyChecked,
    StandbyPromoted,
    StandbyPromotionRequested,
    StandbyRefillRequested,
    TimerTicked,
)
from keel.kernel.decider import DeciderSession
from keel.sim.config import Calibration
from keel.sim.metrics import Loss
from keel.sim.trace import Failure, Trace

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TICK_S = 5.0
"""The job clock's interval while something is in flight (``controller.clock_quiet_interval``)."""
HEARTBEAT_EVERY_S = 25.0
"""A machine's heartbeat is fed once it has been this long unheard on the controller's recorded clock (within the
controller's 30 s silence timeout; docs/fleet-sim.md, "Heartbeats")."""
TIMED_STAGES = frozenset({"capturing", "diagnosing", "replaying", "recovering"})
"""An incident's stages with a deadline on the job clock: the simulator ticks the job through them."""
HARDWARE = frozenset({"gpu_lost", "xid", "host_lost", "sdc", "fail_slow"})
"""Faults that stay with the machine until it is evicted (or repaired)."""


@dataclass(frozen=True)
class Variant:
    """Keel or one of its ablations: which mechanism the simulated fleet has."""

    name: str = "keel"
    standby: bool = True
    analyzer: bool = True
    memory_checkpoint: bool = True
    hot_update: bool = True


VARIANTS = {
    "keel": Variant(),
    "keel_no_standby": Variant("keel_no_standby", standby=False),
    "keel_no_analyzer": Variant("keel_no_analyzer", analyzer=False),
    "keel_no_memory_ckpt": Variant("keel_no_memory_ckpt", memory_checkpoint=False),
    "keel_no_hot_update": Variant("keel_no_hot_update", hot_update=False),
}


@dataclass
class _Down:
    """The job is not making progress: since when, why, and the phase marks of the recovery."""

    since_s: float
    mechanism: str
    signal_s: float | None = None
    decided_s: float | None = None
    standby_wait_s: float = 0.0
    human_s: float = 0.0


@dataclass
class SimResult:
    system: str
    losses: list[Loss]
    incidents_by_rung: dict[str, int]
    evicted_nodes: int
    over_evicted_nodes: int
    standbys_promoted: int
    standbys_provisioned: int
    job_stops: int
    events: int
    decisions: int
    log: list[Event] = field(default_factory=list)


class KeelSim:
    """One run of Keel (or an ablation) over a trace."""

    def __init__(self, trace: Trace, cal: Calibration, *, variant: Variant = Variant(), seed: int = 0,
                 record: bool = False, policy: ControllerPolicy | None = None) -> None:
        self.trace, self.cal, self.variant = trace, cal, variant
        self.rng = random.Random(seed * 7919 + 17)
        self.id_rng = random.Random(seed * 7919 + 18)
        """Event ids come from a stream of their own: how many events the simulated agents send changes no
        duration drawn."""
        base = policy or ControllerPolicy()
        self.policy = replace(base, stack_analysis=base.stack_analysis and variant.analyzer,
                              sdc_replay=base.sdc_replay and variant.analyzer,
                              command_ttl=timedelta(hours=2))
        self.session: DeciderSession[Any] = DeciderSession(ControllerDecider(self.policy))
        self.record = record
        self.log: list[Event] = []
        self.job_id = "fleet"
        self.epoch = 0
        self.heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self.seq = 0
        self.now_s = 0.0
        self.step_s = cal.job["step_time_s"]
        self.pp = int(cal.job["nodes_per_pp_group"])
        # ground truth
        self.names = [f"n{i:05d}" for i in range(trace.nodes)]
        self.rank_of: dict[str, int] = {n: i for i, n in enumerate(self.names)}
        self.node_of_rank: dict[int, str] = dict(enumerate(self.names))
        self.generation_of: dict[str, int] = {n: 0 for n in self.names}
        self.standbys: list[str] = []
        self.next_standby = 0
        self.faulty: dict[str, Failure] = {}
        self.dead: set[str] = set()
        self.slow: dict[str, Failure] = {}
        self.bad_code = False
        self.down: _Down | None = None
        self.stepping_since_s = 0.0
        self.base_step = 0
        self.generation = 0
        self.pending_restart: RestartDecided | None = None
        self.restart_nodes: list[str] = []
        self.promotions: list[tuple[str, str, int]] = []
        self.ticking = False
        self.clock_run = 0
        """Which run of ticks is the current one: a tick scheduled by an earlier run is dropped."""
        self.heard_s: dict[str, float] = {}
        """Each machine's newest event produced by its agent (simulated seconds): what the controller hears."""
        self.stopped = False
        self._waiting_since: float | None = None
        self._provision_now = False
        # outcomes
        self.losses: list[Loss] = []
        self.rungs: Counter[str] = Counter()
        self.evicted = 0
        self.over_evicted = 0
        self.promoted = 0
        self.provisioned = 0
        self.stops = 0
        self.events = 0
        self.decisions = 0

    # -- the loop -------------------------------------------------------------------------------------

    def at(self, t_s: float, action: Callable[..., None], *args: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t_s, self.seq, action, args))

    def run(self) -> SimResult:
        self._start_job(first=True)
        for failure in self.trace.failures:
            self.at(failure.at_s, self._fail, failure)
        if not self.variant.hot_update:
            for t in self.trace.code_changes_s:
                self.at(t, self._code_change_requeue)
        while self.heap:
            t, _, action, args = heapq.heappop(self.heap)
            if t > self.trace.horizon_s:
                break
            self.now_s = t
            action(*args)
        if self.down is not None:
            self._close_down(self.trace.horizon_s, recompute_s=0.0)
        if self.slow:
            for failure in self.slow.values():
                self._slow_loss(failure, self.trace.horizon_s)
        return SimResult(self.variant.name, self.losses, dict(sorted(self.rungs.items())), self.evicted,
                         self.over_evicted, self.promoted, self.provisioned, self.stops, self.events,
                         self.decisions, self.log)

    def time(self, t_s: float | None = None) -> datetime:
        return T0 + timedelta(seconds=self.now_s if t_s is None else t_s)

    def feed(self, payload: EventPayload, subject: str, producer: str = "agent") -> None:
        """One input to the controller, as the bus would deliver it; then carry out its decisions."""
        event = Event.create(payload, job_id=self.job_id, subject=subject, producer=producer,
                             occurred_at=self.time(), event_id=uuid.UUID(int=self.id_rng.getrandbits(128)))
        self.events += 1
        if producer == "agent":
            node = getattr(payload, "node_id", None)
            if isinstance(node, str) and node:
                self.heard_s[node] = self.now_s
        if self.record:
            self.log.append(event)
        result = self.session.observe(event)
        for produced in result.emitted:
            self.decisions += 1
            if self.record:
                self.log.append(produced)
            self.session.expect_echo(produced.id)
            self._act(produced)

    def _tick(self, run: int, first: bool = False) -> None:
        """A tick of the job clock; the next one follows while an incident waits on time. The first tick of a
        run comes just before the input that started the clock (so that input is decided at the current time)
        and always has a successor: what the input opens (a diagnostics round, a stack capture) is known only
        after it."""
        if not self.ticking or run != self.clock_run:
            return  # a tick of a run that ended (the clock stopped since, and may have started again)
        self.feed(TimerTicked(now=self.time(), interval_s=TICK_S), f"clock/{self.job_id}", "clock")
        job = self.session.state.job(self.job_id)
        self._heartbeat_round(job)
        stage = job.incident.stage if job.incident is not None else None
        if not first and stage not in TIMED_STAGES and self.pending_restart is None:
            self.ticking = False  # nothing waits on time: a gap, which the recorded clock skips
            return
        self.at(self.now_s + TICK_S, self._tick, run)

    def _heartbeat_round(self, job: Any) -> None:
        """After a tick: the heartbeats that keep every live machine heard (``_heartbeats``)."""
        if job.clock_since is not None and self.now_s - self.seconds(job.clock_since) >= HEARTBEAT_EVERY_S:
            self._heartbeats(unheard_since_s=self.now_s - HEARTBEAT_EVERY_S)

    def _start_clock(self) -> None:
        if self.ticking or self.stopped:
            return
        self.ticking = True
        self.clock_run += 1
        self._tick(self.clock_run, first=True)
        self._progress()

    def _progress(self) -> None:
        """The step the job reached, as every agent's heartbeat reports it while the job steps: fed from one
        live machine when the clock starts (the controller keeps the job's newest step, and a failure after
        progress is no crash loop). The other machines' heartbeats would say the same."""
        name = next((n for n in self.active_nodes() if n not in self.dead), None)
        if name is not None:
            self.feed(NodeHeartbeat(node_id=name, ranks_alive=1, ranks_expected=1, last_step=self.step_now(),
                                    generation=self.generation_of.get(name, 0)), f"node/{name}")

    def seconds(self, at: datetime) -> float:
        return (at - T0).total_seconds()

    def _heartbeats(self, unheard_since_s: float | None = None) -> None:
        """Every live machine of the job heartbeats (``unheard_since_s`` None), or only those the controller has
        heard nothing from since ``unheard_since_s``.

        On the recorded clock the controller judges a machine silent by the time since it was last heard
        (any event of its agent, credited at the tick after it) or since the current unbroken run of ticks
        began (``JobView.clock_since``), whichever is later; past ``node_silence_timeout`` (30 s) it is lost.
        Called after each tick of a run at least 25 s old with ``unheard_since_s`` = now - 25 s, it feeds
        the heartbeats that keep every live machine heard within the timeout, and only those: a machine that
        just acknowledged a request, reported a result or started its ranks is heard already, and none is
        due before the run is 25 s old. The controller's view of who is silent is the same as if every
        machine heartbeat every few seconds, as real agents do; only heartbeats it could not tell apart
        from the ones fed are left out."""
        step = self.step_now()
        heard = self.heard_s
        for name in self.active_nodes():
            if name not in self.dead and (unheard_since_s is None or heard.get(name, -1.0) <= unheard_since_s):
                self.feed(NodeHeartbeat(node_id=name, ranks_alive=1, ranks_expected=1, last_step=step,
                                        generation=self.generation_of.get(name, 0)), f"node/{name}")

    def active_nodes(self) -> list[str]:
        return [self.node_of_rank[r] for r in range(len(self.names))]

    def step_now(self) -> int:
        if self.down is not None:
            return self.base_step
        return self.base_step + int(max(0.0, self.now_s - self.stepping_since_s) // self.step_s)

    # -- the job --------------------------------------------------------------------------------------

    def _start_job(self, first: bool) -> None:
        """Register the job and its machines, start generation 0's ranks, fill the standby pool (at once
        for the first start: the pool is provisioned before the job begins)."""
        nodes = self.active_nodes()
        self.feed(JobRegistered(nodes=nodes, world_size=len(nodes), registered_by="sim"), f"job/{self.job_id}", "sim")
        self._start_clock()
        self._provision_now = first
        for rank, name in enumerate(nodes):
            self.feed(NodeRegistered(node_id=name, host=name, fault_domain=f"d{rank // 16}"), f"node/{name}")
        for rank, name in enumerate(nodes):
            self.feed(RankStarted(node_id=name, rank=rank, local_rank=0, world_size=len(nodes), pid=1000 + rank,
                                  generation=self.generation), f"rank/{rank}")
        for name in nodes:
            self._register_checkpointer(name, self.generation)
        if first and self.variant.standby and not self.standbys:
            # The cluster brings one warm standby up with the job; its registration is a pool change, on which
            # the controller sizes the pool (the binomial model) and asks for the rest (provisioned at once).
            self._standby_ready()
        self._provision_now = False
        self._heartbeats()
        self.ticking = False

    def _register_checkpointer(self, name: str, generation: int) -> None:
        """The machine's ranks registered Keel's Checkpointer, with their parallel groups: the rank's pipeline
        group of ``nodes_per_pp_group`` machines (its tensor-parallel peers are on the machine itself). What
        rung 5 replays by: without it the controller has no replay units and restarts in place."""
        rank = self.rank_of[name]
        first = rank - rank % self.pp
        pp = list(range(first, min(len(self.names), first + self.pp)))
        self.feed(CheckpointRanksRegistered(node_id=name, generation=generation, world_size=len(self.names),
                                            store_address=f"{name}:7070", ranks=[RankGroups(rank=rank, pp=pp)]),
                  f"node/{name}")

    def _fail(self, failure: Failure) -> None:
        if self.stopped and failure.signal not in HARDWARE:
            return
        victims = [self.names[i] for i in failure.nodes]
        victims = [n for n in victims if n in self.rank_of and n not in self.dead]
        if not victims and failure.signal not in ("user_code", "bad_deploy"):
            return  # it hit machines that already left the job
        if failure.signal == "fail_slow":
            node = victims[0]
            self.slow[node] = replace(failure, at_s=self.now_s)
            if self.variant.analyzer:
                self.at(self.now_s + self._draw("agent", "failslow_conviction"), self._convict_slow, node)
            else:
                self.at(self.now_s + min(failure.duration_s, self.cal.baselines["human_detection_s"]),
                        self._slow_ends, node)
            return
        if failure.signal in HARDWARE or failure.signal == "hang":
            for node in victims:
                self.faulty[node] = failure
            if failure.repair_s > 0:
                self.at(self.now_s + failure.repair_s, self._repaired, victims)
        if failure.signal == "host_lost":
            self.dead.update(victims)
        if failure.signal == "bad_deploy":
            self.bad_code = True
        if self.stopped:
            return
        if self.down is None:
            self.down = _Down(self.now_s, failure.kind)
            self.base_step = self.step_now_before_down()
        self._signal_later(failure, victims)

    def step_now_before_down(self) -> int:
        return self.base_step + int(max(0.0, self.now_s - self.stepping_since_s) // self.step_s)

    def _signal_later(self, failure: Failure, victims: list[str]) -> None:
        detection = {"gpu_lost": "gpu_lost", "xid": "xid", "host_lost": "host_lost", "nic_flap": "crash",
                     "hang": "hang", "user_code": "crash", "bad_deploy": "crash", "sdc": "metric_anomaly"}
        delay = self._draw("detection", detection[failure.signal])
        self.at(self.now_s + delay, self._signal, failure.signal, victims[0] if victims else self.active_nodes()[0],
                failure.kind)

    def _signal(self, signal: str, node: str, kind: str) -> None:
        """The agent's report of a failure on ``node``, as the real inspector and supervisor emit it."""
        if node not in self.rank_of or self.stopped:
            return
        if self.down is not None and self.down.signal_s is None:
            self.down.signal_s = self.now_s
        self._start_clock()
        rank, gen = self.rank_of[node], self.generation_of.get(node, 0)
        subject = f"node/{node}"
        if signal in ("gpu_lost", "xid", "host_lost"):
            component = "host" if signal == "host_lost" else "gpu"
            check = {"gpu_lost": "gpu_lost", "xid": "xid_fatal", "host_lost": "agent_silent"}[signal]
            self.feed(NodeHealthChanged(node_id=node, status="failed", component=component, check=check,
                                        confidence="high", is_fatal=True, detail=f"sim: {kind}"), subject)
        elif signal == "hang":
            self.feed(NodeHealthChanged(node_id=node, status="failed", component="rank", check="collective_stuck",
                                        confidence="high", is_fatal=False, detail=f"sim: {kind}"), subject)
        elif signal == "nic_flap":
            self.feed(RankExited(node_id=node, rank=rank, pid=1000 + rank, generation=gen, exit_code=1,
                                 classification="infrastructure", error_type="DistBackendError",
                                 stderr_tail="NCCL error: remote process exited or there was a network error",
                                 reason=f"sim: {kind}"), f"rank/{rank}")
        elif signal in ("user_code", "bad_deploy"):
            self.feed(RankExited(node_id=node, rank=rank, pid=1000 + rank, generation=gen, exit_code=1,
                                 classification="user_code", error_type="RuntimeError",
                                 stderr_tail=f'File "train.py", line 42, in step\nRuntimeError: sim {kind}',
                                 reason=f"sim: {kind}"), f"rank/{rank}")
        elif signal == "sdc":
            self.feed(MetricAnomalyDetected(node_id=node, rank=rank, generation=gen, kind="non_finite",
                                            metric="loss", step=max(0, self.base_step), value_text="nan",
                                            reason=f"sim: {kind}"), subject)

    # -- carrying out the controller's decisions --------------------------------------------------------

    def _act(self, event: Event) -> None:  # noqa: C901 - one branch per command
        p = event.payload
        if isinstance(p, NodeEvictionDecided) and not p.observe_only:
            self.at(self.now_s + self._draw("actuator", "evict"), self._evicted, p.node_id, str(event.id))
        elif isinstance(p, StandbyRefillRequested):
            self._refill(p)
        elif isinstance(p, RestartDecided):
            self._restart_decided(p)
        elif isinstance(p, StandbyPromotionRequested):
            self.promotions.append((p.node_id, p.replaces_node_id, p.ranks[0]))
        elif isinstance(p, RanksRestartRequested):
            self.restart_nodes.append(p.node_id)
        elif isinstance(p, DiagnosticsRequested):
            self._diagnose(p, str(event.id))
        elif isinstance(p, StacksRequested):
            self._stacks(p, str(event.id))
        elif isinstance(p, SdcReplayRequested):
            self.at(self.now_s + self._draw("agent", "sdc_replay"), self._sdc_verdict, p, str(event.id))
        elif isinstance(p, IncidentResolved):
            self.rungs[f"rung{p.rung}"] += 1
        elif isinstance(p, JobStopDecided):
            self._stopped()
        elif p.event_name == "ActionHeld" and getattr(p, "guardrail", "") == "no_standby" and self.down is not None:
            self._waiting_since = self.now_s

    def _evicted(self, node: str, decision_id: str) -> None:
        self.feed(NodeEvicted(node_id=node, decision_id=decision_id, actuator="sim", outcome="evicted"),
                  f"node/{node}", "actuator")
        if node in self.standbys:
            self.standbys.remove(node)
            return
        self.evicted += 1
        if node not in self.faulty and node not in self.dead and node not in self.slow:
            self.over_evicted += 1
        self.faulty.pop(node, None)
        self.dead.discard(node)
        if node in self.slow:
            self._slow_loss(self.slow.pop(node), self.now_s)

    def _refill(self, p: StandbyRefillRequested) -> None:
        if self._provision_now:
            delay = 0.0
        elif self.variant.standby:
            delay = self._draw("actuator", "standby_provision")
        elif p.reason.startswith("incident"):
            delay = self._draw("actuator", "cold_replacement")
        else:
            return  # no warm pool: only a replacement an incident waits for is brought in (cold)
        for _ in range(p.count):
            self.at(self.now_s + delay, self._standby_ready)

    def _standby_ready(self) -> None:
        name = f"s{self.next_standby:05d}"
        self.next_standby += 1
        self.provisioned += 1
        self.standbys.append(name)
        self.feed(NodeRegistered(node_id=name, host=name, standby=True), f"node/{name}")
        self.feed(StandbyChecked(node_id=name, passed=True,
                                 results=[CheckResult(check="gpu_matmul", passed=True)]), f"node/{name}")

    def _restart_decided(self, p: RestartDecided) -> None:
        if self.down is not None and self.down.decided_s is None:
            self.down.decided_s = self.now_s
        if self.down is not None and self._waiting_since is not None:
            self.down.standby_wait_s += self.now_s - self._waiting_since
            self._waiting_since = None
        self.pending_restart = p
        self.restart_nodes, self.promotions = [], []
        self._start_clock()
        self.generation = p.generation
        if p.rollback:
            self.bad_code = False
        restore = "setup_restore_memory" if self.variant.memory_checkpoint else "setup_restore_persistent"
        done = self.now_s + self._draw("agent", "restart") + self._draw("agent", restore)
        restore_step = self.base_step
        self.feed(CheckpointRestorePlanned(generation=p.generation, step=restore_step,
                                           reason="sim: the newest complete checkpoint"),
                  f"job/{self.job_id}", "checkpoint-broker")
        self.at(done, self._restarted, p.generation)

    def _restarted(self, generation: int) -> None:
        """The commanded generation's ranks are up (agents report their starts); a fault still on a machine
        of it recurs; else the job steps again and one heartbeat past the restore point says so."""
        if self.pending_restart is None or generation != self.generation or self.stopped:
            return
        self.pending_restart = None
        for standby, replaced, rank in self.promotions:
            self.feed(StandbyPromoted(node_id=standby, command_id="sim", replaces_node_id=replaced,
                                      generation=generation, outcome="promoted"), f"node/{standby}")
            if standby in self.standbys:
                self.standbys.remove(standby)
            self.promoted += 1
            self.rank_of.pop(replaced, None)
            self.rank_of[standby] = rank
            self.node_of_rank[rank] = standby
        for name in [s for s, _, _ in self.promotions] + self.restart_nodes:
            if name in self.rank_of:
                self.generation_of[name] = generation
                self.feed(RankStarted(node_id=name, rank=self.rank_of[name], local_rank=0,
                                      world_size=len(self.names), pid=2000 + generation,
                                      generation=generation), f"rank/{self.rank_of[name]}")
        for standby, _, _ in self.promotions:
            if standby in self.rank_of:
                self._register_checkpointer(standby, generation)
        self.promotions, self.restart_nodes = [], []
        culprit = self._recurring()
        if culprit is not None:
            failure, node = culprit
            self._signal_later(failure, [node])
            return
        if self.down is not None:
            recompute = self._recompute_s()
            self._close_down(self.now_s, recompute)
        node = self.active_nodes()[0]
        self.at(self.now_s + self.step_s, self._stepped, node, generation)

    def _stepped(self, node: str, generation: int) -> None:
        if generation != self.generation or self.down is not None:
            return
        self.feed(NodeHeartbeat(node_id=node, ranks_alive=1, ranks_expected=1, last_step=self.step_now() + 1,
                                generation=generation), f"node/{node}")

    def _recurring(self) -> tuple[Failure, str] | None:
        """A fault that restarting in place does not cure: a broken machine still in the job, bad code."""
        for node in self.active_nodes():
            failure = self.faulty.get(node)
            if failure is not None:
                return failure, node
        if self.bad_code:
            return Failure(self.now_s, "bad_deploy", "bad_deploy", ()), self.active_nodes()[0]
        return None

    def _recompute_s(self) -> float:
        if self.variant.memory_checkpoint:
            return self.rng.uniform(0.0, self.step_s)
        # the persistent tier's newest checkpoint: every interval of stepping since the job last resumed
        since = self.down.since_s if self.down is not None else self.now_s
        return max(0.0, since - self.stepping_since_s) % self.cal.job["keel_persist_interval_s"]

    def _close_down(self, end_s: float, recompute_s: float) -> None:
        down = self.down
        assert down is not None
        mech = down.mechanism
        human = min(down.human_s, max(0.0, end_s - down.since_s))
        cut = end_s - human  # a stopped job's page and requeue come last
        sig = min(down.signal_s if down.signal_s is not None else cut, cut)
        dec = min(down.decided_s if down.decided_s is not None else cut, cut)
        wait = min(down.standby_wait_s, max(0.0, dec - sig))
        marks = [("detection", down.since_s, sig), ("diagnosis", sig, dec - wait), ("standby_wait", dec - wait, dec),
                 ("restart", dec, cut), ("human", cut, end_s)]
        for phase, lo, hi in marks:
            if hi > lo:
                self.losses.append(Loss(lo, hi, 1.0, mech, phase))
        if recompute_s > 0:
            self.losses.append(Loss(end_s, end_s + recompute_s, 1.0, mech, "recompute"))
        self.down = None
        self.stepping_since_s = end_s + recompute_s

    # -- the analyzer and the agents' rounds (played) ---------------------------------------------------

    def _diagnose(self, p: DiagnosticsRequested, request_id: str) -> None:
        ack = self.now_s + self._draw("agent", "ack")
        done = self.now_s + self._draw("agent", "diagnostics")
        self.at(ack, self._acks, list(p.nodes))
        self.at(done, self._diag_results, list(p.nodes), request_id, p.round)

    def _acks(self, nodes: list[str]) -> None:
        step = self.step_now()
        for name in nodes:
            if name not in self.dead and name in self.rank_of:
                self.feed(NodeHeartbeat(node_id=name, ranks_alive=0, ranks_expected=1, last_step=step,
                                        generation=self.generation_of.get(name, 0)), f"node/{name}")

    def _diag_results(self, nodes: list[str], request_id: str, round_: int) -> None:
        for name in nodes:
            if name in self.dead or name not in self.rank_of:
                continue
            failure = self.faulty.get(name)
            bad = failure is not None and failure.signal in ("gpu_lost", "xid")
            self.feed(DiagnosticsCompleted(
                node_id=name, request_id=request_id, round=round_, passed=not bad,
                results=[CheckResult(check="gpu_matmul", passed=not bad, detail="sim")]), f"node/{name}")

    def _stacks(self, p: StacksRequested, request_id: str) -> None:
        self.at(self.now_s + self._draw("agent", "ack"), self._acks, list(p.nodes))
        self.at(self.now_s + self._draw("agent", "stacks_verdict"), self._stacks_verdict, p, request_id)

    def _pp_group(self, node: str) -> list[str]:
        rank = self.rank_of[node]
        first = rank - rank % self.pp
        return [self.node_of_rank[r] for r in range(first, min(len(self.names), first + self.pp))]

    def _stacks_verdict(self, p: StacksRequested, request_id: str) -> None:
        culprit = next((n for n in p.nodes if n in self.faulty and self.faulty[n].signal == "hang"), None)
        if culprit is None or culprit not in self.rank_of:
            self.feed(StacksAnalyzed(request_id=request_id, round=p.round, conclusive=False,
                                     reason="sim: every rank's stack alike"), f"job/{self.job_id}", "analyzer")
            return
        group = self._pp_group(culprit)
        self.feed(StacksAnalyzed(request_id=request_id, round=p.round, conclusive=True,
                                 outlier_ranks=[self.rank_of[culprit]], outlier_nodes=[culprit], group_kind="pp",
                                 group_ranks=[self.rank_of[n] for n in group], group_nodes=group,
                                 reason=f"sim: {culprit}'s ranks are outside the collective everyone waits in"),
                  f"job/{self.job_id}", "analyzer")

    def _sdc_verdict(self, p: SdcReplayRequested, request_id: str) -> None:
        bad = [n for n in p.nodes if self.faulty.get(n) is not None and self.faulty[n].signal == "sdc"]
        kind = "found" if bad else "not_reproduced"
        self.feed(SdcReplayAnalyzed(request_id=request_id, round=p.round, kind=kind, unit=bad[0] if bad else "",
                                    nodes=bad[:1], rounds=2, reason=f"sim: {kind}"), f"job/{self.job_id}", "analyzer")

    def _convict_slow(self, node: str) -> None:
        if node not in self.slow or node not in self.rank_of:
            return
        if self.stopped:  # the analyzer watches the requeued job too: it convicts the machine there
            self.at(self.now_s + self._draw("agent", "failslow_conviction"), self._convict_slow, node)
            return
        self._start_clock()
        self.feed(FailSlowConvicted(group_kind="node", group_ranks=[self.rank_of[node]], group_nodes=[node],
                                    outlier_ranks=[self.rank_of[node]], rounds=5, flags=5, interval_s=10.0,
                                    reason="sim: its compute time is the outlier"), f"job/{self.job_id}", "analyzer")
        if node in self.slow:  # an incident was open: the analyzer convicts again later
            self.at(self.now_s + self._draw("agent", "failslow_conviction"), self._convict_slow, node)

    def _slow_ends(self, node: str) -> None:
        failure = self.slow.pop(node, None)
        if failure is not None:
            self._slow_loss(failure, self.now_s)

    def _slow_loss(self, failure: Failure, end_s: float) -> None:
        end_s = min(end_s, failure.at_s + failure.duration_s) if failure.duration_s > 0 else end_s
        if end_s > failure.at_s:
            self.losses.append(Loss(failure.at_s, end_s, 1.0 - 1.0 / failure.slowdown, failure.kind, "slow"))

    def _repaired(self, nodes: list[str]) -> None:
        for node in nodes:
            self.faulty.pop(node, None)

    def _stopped(self) -> None:
        """Rung 6 (or a breaker): the job stops and a human is paged; they requeue it as a new job."""
        self.stops += 1
        self.stopped = True
        self.pending_restart = None
        self.ticking = False
        if self.down is None:
            self.down = _Down(self.now_s, "job_stop")
            self.base_step = self.step_now_before_down()
        delay = self._draw("actuator", "human_response")
        self.down.human_s += delay
        self.at(self.now_s + delay, self._human_requeue)

    def _human_requeue(self) -> None:
        self.epoch += 1
        self.job_id = f"fleet-{self.epoch}"
        self.stopped = False
        self.bad_code = False
        # the human replaces what is broken or gone, as the scheduler would
        for rank in range(len(self.names)):
            name = self.node_of_rank[rank]
            if name in self.faulty or name in self.dead:
                fresh = f"r{self.epoch:03d}{rank:05d}"
                self.rank_of.pop(name, None)
                self.faulty.pop(name, None)
                self.dead.discard(name)
                self.rank_of[fresh] = rank
                self.node_of_rank[rank] = fresh
        self.generation = 0
        self.generation_of = {n: 0 for n in self.rank_of}
        self._start_job(first=True)
        restore = "setup_restore_memory" if self.variant.memory_checkpoint else "setup_restore_persistent"
        self.at(self.now_s + self._draw("agent", "restart") + self._draw("agent", restore), self._requeued)

    def _requeued(self) -> None:
        if self.down is not None:
            self._close_down(self.now_s, self._recompute_s())

    def _code_change_requeue(self) -> None:
        """Without hot update a code change is a stop, a requeue and a restore from the persistent tier."""
        if self.down is not None:
            return
        cost = (self.cal.baselines["requeue_s"] + self._draw("agent", "restart")
                + self._draw("agent", "setup_restore_persistent"))
        self.losses.append(Loss(self.now_s, self.now_s + cost, 1.0, "code_change", "restart"))

    def _draw(self, section: str, key: str) -> float:
        table: dict[str, Any] = getattr(self.cal, section)
        return float(table[key].draw(self.rng))
