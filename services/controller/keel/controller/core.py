"""Controller core: the escalation ladder as a pure Decider over the event log (no I/O, no clock).

The rungs (ARCHITECTURE.md, "The escalation ladder"), cheapest first:

1. A high-confidence fatal hardware signal (GPU lost, fatal XID, NIC down, disk fault, kernel error),
   or a node whose agent went silent: evict the node now, promote a ready warm standby into its slice
   of ranks, and restart every other node in place as the next generation (restore from memory and
   the peers' copies).
2. A crash or a hang with no culprit: stop the ranks and run stop-time diagnostics on every node; evict
   what fails or does not answer in time, else restart in place. A crash whose traceback the exit
   classifier pins on the user's code needs no diagnostics: it restarts in place at once.
3. (analyzer issue) stack aggregation names the smallest parallel group to evict.
4. The same failure again after a restart, with no progress in between: roll back to the last stable
   code version (``CodeVersionStable``, hot-update's) and restart (``RollbackDecided``; the restart
   commands carry that version). With no stable version known the restart runs the same code, and a
   third failure trips rung 6.
5. A NaN or a loss / gradient-norm spike that stop-time diagnostics do not explain (every node passes):
   silent data corruption is suspected. Dual-phase replay (``SdcReplayRequested``): every node restarts
   its ranks in replay mode from the checkpoint before the anomaly, and the analyzer judges which groups
   of machines compute wrong numbers (``SdcReplayAnalyzed``); the machine it locates is evicted (a
   standby takes its ranks), else the job restarts in place from before the anomaly.
6. A crash loop (the same fingerprint ``max_same_failure`` times in a row) or a spent restart budget:
   stop the job and page a human (``JobStopDecided``).

Guardrails: observe mode (decide and record, execute nothing: ``ActionHeld``), an eviction circuit
breaker (count and fraction of the job's nodes per window: past it, stop and page), never undoing a
human's cordon (a cordoned node is neither diagnosed, restarted onto nor promoted), optional approval
per action kind (``ApprovalRequested`` -> ``ApprovalGiven``), and an expiry on every command, so a cold
start never executes a stale one (the runner never re-decides history; agents and actuators check
``expires_at``).

Code versions (hot-update): the controller stays the only one that restarts ranks. It folds the registered
versions (``CodeVersionRegistered``): every restart it decides carries the newest pending one (a lazy
version rides on the next restart of any cause), and every restart and promotion command names the
version its ranks run. Hot-update's ``CodeRolloutRequested`` (an urgent deploy, a lazy one's deadline)
becomes a planned restart: an incident of kind ``code_update`` at rung 0, which is no failure (the
crash-loop breaker does not count it) but whose lost time ETTR accounts like any other. A rolled-back
version is never applied again (versions are content-addressed: a fix is another version).

Incidents: the first signal opens one (``IncidentOpened``); its id is the correlation id of every
decision about it and of the agents' answers. Signals that arrive while it is open join it.
``IncidentResolved`` closes it once a node of the restarted generation steps past the restore point.
Every piece of incident state is folded from the controller's own decision events, so a cold start
rebuilds it from the log. Time-dependent rules (a silent node, a diagnostic that timed out) fire on
``TimerTicked`` from the controller's clock (recorded, so a replay sees the same time).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Literal

from keel.controller.guardrails import CrashLoopBreaker, EvictionBreaker, failure_fingerprint
from keel.controller.standby import failure_probability, plan_standby_pool
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    LAUNCH_VERSION,
    ActionHeld,
    ApprovalGiven,
    ApprovalRequested,
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    CodeRef,
    CodeRolloutRequested,
    CodeVersionRegistered,
    CodeVersionStable,
    DiagnosticsCompleted,
    DiagnosticsRequested,
    FailSlowConvicted,
    IncidentOpened,
    IncidentResolved,
    JobRegistered,
    JobStopDecided,
    MetricAnomalyDetected,
    NodeCordoned,
    NodeEvicted,
    NodeEvictionDecided,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeRegistered,
    Promotion,
    RankExited,
    RanksRestartRequested,
    RankStarted,
    RestartDecided,
    RollbackDecided,
    SdcReplayAnalyzed,
    SdcReplayRequested,
    StacksAnalyzed,
    StacksRequested,
    StandbyChecked,
    StandbyPoolSized,
    StandbyPromoted,
    StandbyPromotionRequested,
    StandbyRefillRequested,
    TimerTicked,
)
from keel.kernel.decider import Decision, Proposal, materialise
from keel.rules.sdc import plan_phases
from keel.rules.sdc_replay import machine_units, sdc_phase

NAME = "controller"
MIN_SDC_UNITS = 3
"""Fewer replay units (model replicas) than this leave no majority to tell the clean result apart."""
SDC_VERDICT_GRACE = timedelta(seconds=30)
"""How long past a replay round's timeout the controller waits for the analyzer's verdict."""
HARDWARE_COMPONENTS = frozenset({"gpu", "nic", "disk", "kernel", "host"})
FAILURE_CLASSES = frozenset({"user_code", "infrastructure", "unknown"})
HANG_CHECKS = frozenset({"no_progress", "heartbeat_lost"})
ALL_CHECKS: tuple[str, ...] = ("gpu_matmul", "intra_node_all_to_all", "inter_node_all_gather")
ACTIONS = frozenset({"evict", "restart", "diagnose", "promote", "rollback", "stop"})
Action = Literal["evict", "restart", "diagnose", "promote", "rollback", "stop"]
Stage = Literal["observing", "capturing", "diagnosing", "replaying", "recovering", "waiting_standby",
                "awaiting_approval"]


# -- policy ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ControllerPolicy:
    command_ttl: timedelta = timedelta(minutes=5)
    observe_only: bool = False
    diagnostics_timeout: timedelta = timedelta(seconds=60)
    stack_analysis: bool = True
    """Rung 3: a hang first gets its stacks captured and aggregated by the analyzer (while the ranks are
    still hung); only an inconclusive verdict goes on to rung 2's diagnostics."""
    stacks_timeout: timedelta = timedelta(seconds=10)
    """Agents answer a stack capture within this; the analyzer judges without the rest."""
    stacks_verdict_timeout: timedelta = timedelta(seconds=20)
    """No verdict from the analyzer this long after the capture was asked for: go on to rung 2."""
    sdc_replay: bool = True
    """Rung 5: a NaN or spike that diagnostics do not explain is replayed to locate the corrupting machine."""
    sdc_replay_timeout: timedelta = timedelta(seconds=60)
    """Nodes answer a replay round within this; no verdict 30 s after it: restart in place."""
    diagnostics_ack_timeout: timedelta = timedelta(seconds=2)
    """A round's node whose agent sent no heartbeat since the request for this long is lost (its agent
    answers a request with a heartbeat at once): the round concludes without it."""
    diagnostics_checks: tuple[str, ...] = ALL_CHECKS
    node_silence_timeout: timedelta = timedelta(seconds=30)
    """A node of the job whose heartbeats stopped this long ago is lost (rung 1)."""
    eviction_window: timedelta = timedelta(hours=1)
    max_evictions: int = 8
    max_eviction_fraction: float = 0.1
    restart_window: timedelta = timedelta(hours=1)
    restart_budget: int = 10
    max_same_failure: int = 3
    approval_required: frozenset[str] = frozenset()
    """Action kinds (evict, restart, diagnose, rollback) that wait for a human's ``keel approve``."""
    approval_ttl: timedelta = timedelta(minutes=30)
    standby_quantile: float = 0.99
    standby_replacement_window: timedelta = timedelta(hours=1)
    """How long a failed machine takes to come back: the binomial model's window."""
    standby_prior_rate_per_node_hour: float = 0.0012
    """Per-node failure rate assumed while the log is young (the paper's pools: 4 spares for 1,024)."""
    standby_prior_node_hours: float = 1000.0
    standby_min: int = 0
    """At least this many standbys, whatever the model says."""

    def __post_init__(self) -> None:
        unknown = set(self.approval_required) - ACTIONS
        if unknown:
            raise ValueError(f"approval_required: unknown action kind(s) {sorted(unknown)}; known: {sorted(ACTIONS)}")


# -- state -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeView:
    node_id: str
    standby: bool = False
    ranks: frozenset[int] = frozenset()
    """The ranks it runs in ``generation``, its newest."""
    generation: int = -1
    evicted: bool = False
    eviction_pending: str | None = None
    """Id of an eviction decision not yet carried out."""
    cordoned: bool = False
    cordoned_by: str = ""
    checked: bool | None = None
    """A standby's self-check outcome (None: not reported yet; only a passing standby counts)."""
    promoting: bool = False
    last_heartbeat_at: datetime | None = None


@dataclass(frozen=True)
class HeldPlan:
    """A recovery held back (waiting for an approval or a standby): what it does once it may."""

    rung: int
    evict: frozenset[str]
    reason: str
    rollback: bool = False


@dataclass(frozen=True)
class OpenIncident:
    id: str
    kind: str
    opened_at: datetime
    generation: int
    last_step: int
    fingerprint: str
    stage: Stage = "observing"
    rung: int = 0
    evidence: tuple[str, ...] = ()
    diag_round: int | None = None
    diag_deadline: datetime | None = None
    diag_requested_at: datetime | None = None
    stacks_round: int | None = None
    stacks_requested_at: datetime | None = None
    diag_nodes: frozenset[str] = frozenset()
    diag_results: Mapping[str, DiagnosticsCompleted] = field(default_factory=dict)
    target_generation: int | None = None
    restore_step: int = -1
    started: frozenset[str] = frozenset()
    """Nodes that started ranks of ``target_generation``: only their heartbeats say it is stepping."""
    held: HeldPlan | None = None
    approval_id: str = ""
    sdc_round: int | None = None
    sdc_requested_at: datetime | None = None
    sdc_replays: int = 0
    """Replay phases run for this incident so far."""
    code_change: str = ""
    """What the incident's restart did to the code ("" : nothing), for its resolution's reason."""


@dataclass(frozen=True)
class JobView:
    nodes: Mapping[str, NodeView] = field(default_factory=dict)
    world_size: int = 0
    generation: int = 0
    """The newest generation started or commanded."""
    last_step: int = -1
    """The newest step any node reported outside an incident (what recovery must get back to)."""
    failed_at_step: int = -1
    """``last_step`` when the latest incident opened: stepping past it is progress (crash-loop reset)."""
    incident: OpenIncident | None = None
    diag_rounds: int = 0
    stack_rounds: int = 0
    evictions: EvictionBreaker = EvictionBreaker()
    crash_loop: CrashLoopBreaker = CrashLoopBreaker()
    stopped: bool = False
    finished: bool = False
    """A rank exited successfully: the job is ending, silent nodes are done, not lost."""
    first_seen_at: datetime | None = None
    node_failures: int = 0
    pool_target: int | None = None
    refills_pending: int = 0
    """Standbys asked of the actuator and not yet registered: not asked for again (until the request expires)."""
    refill_asked_at: datetime | None = None
    sdc_rounds: int = 0
    rank_links: Mapping[int, frozenset[int]] = field(default_factory=dict)
    """Each rank's PP and TP peers (from the checkpoint registrations): what a replay must keep together."""
    anomaly_step: int = -1
    """The step of the newest NaN / spike reported (what a rung-5 replay replays)."""
    code_versions: Mapping[str, CodeRef] = field(default_factory=dict)
    """Registered code versions (``keel deploy``), by id."""
    code_pending: str = ""
    """The newest registered version no restart has carried yet: the next restart applies it."""
    code_current: str = ""
    """The version the latest restart commanded ("" : never changed, the launch command)."""
    code_stable: str = ""
    code_stables: tuple[str, ...] = ()
    """Every version hot-update found stable, oldest first: rung 4 rolls back to the newest that is not the
    code failing now."""
    """The newest version hot-update found stable: rung 4's rollback target."""
    code_rolled_back: frozenset[str] = frozenset()
    rollout_due: str = ""
    """Hot-update asked for a rollout that no restart has carried out yet."""

    @property
    def code_running(self) -> str:
        return self.code_current or LAUNCH_VERSION

    def code_ref(self, version_id: str) -> CodeRef | None:
        """What a command names for ``version_id`` ("" : nothing, the node keeps what it runs)."""
        if not version_id:
            return None
        return self.code_versions.get(version_id) or CodeRef(version_id=version_id)

    def node(self, node_id: str) -> NodeView:
        return self.nodes.get(node_id, NodeView(node_id))

    def with_node(self, view: NodeView) -> JobView:
        return replace(self, nodes={**self.nodes, view.node_id: view})

    @property
    def size(self) -> int:
        """The job's node count for the eviction breaker's fraction: every node that ever ran ranks or
        registered as a worker (a 10 % limit is of the job, not of what is left of it)."""
        return max(1, sum(1 for n in self.nodes.values() if not n.standby or n.ranks))

    @property
    def active(self) -> list[NodeView]:
        """Nodes running ranks of the job (not evicted, not standbys), by id."""
        return sorted((n for n in self.nodes.values() if n.ranks and not n.evicted and not n.standby),
                      key=lambda n: n.node_id)

    @property
    def ready_standbys(self) -> list[NodeView]:
        """Standbys that passed their self-check and are free to take over a node's ranks."""
        return sorted((n for n in self.nodes.values() if n.standby and n.checked and not n.evicted
                       and not n.eviction_pending and not n.cordoned and not n.promoting), key=lambda n: n.node_id)


@dataclass(frozen=True)
class ControllerState:
    jobs: Mapping[str, JobView] = field(default_factory=dict)

    def job(self, job_id: str) -> JobView:
        return self.jobs.get(job_id, _EMPTY)

    def with_job(self, job_id: str, job: JobView) -> ControllerState:
        return ControllerState(jobs={**self.jobs, job_id: job})


_EMPTY = JobView()

_DECIDES_ON = frozenset({
    NodeHealthChanged.event_name, NodeHeartbeat.event_name, RankExited.event_name, DiagnosticsCompleted.event_name,
    StandbyChecked.event_name, StandbyPromoted.event_name, NodeRegistered.event_name, NodeCordoned.event_name,
    ApprovalGiven.event_name, TimerTicked.event_name, NodeEvicted.event_name, StacksAnalyzed.event_name,
    FailSlowConvicted.event_name, MetricAnomalyDetected.event_name, SdcReplayAnalyzed.event_name,
    CodeRolloutRequested.event_name,
})


# -- the decider -------------------------------------------------------------------------------------


class ControllerDecider:
    """The escalation ladder, per job. Every decision's reason names the rung and the evidence."""

    name = NAME

    def __init__(self, policy: ControllerPolicy | None = None) -> None:
        self.policy = policy or ControllerPolicy()

    def initial_state(self) -> ControllerState:
        return ControllerState()

    def interested_in(self, event: Event) -> bool:
        return event.type in _DECIDES_ON

    def evolve(self, state: ControllerState, event: Event) -> ControllerState:
        job = state.jobs.get(event.job_id) or self.new_job()
        updated = self.evolve_job(job, event)
        return state if updated is job else state.with_job(event.job_id, updated)

    def needs_clock(self, state: ControllerState) -> list[str]:
        """Jobs whose rules depend on time now (a running job's silent nodes, a diagnostics deadline):
        the adapter records a ``TimerTicked`` for each, once per clock interval."""
        return sorted(job_id for job_id, job in state.jobs.items()
                      if (job.active and not job.stopped and not job.finished)
                      or (job.incident is not None and job.incident.stage in ("diagnosing", "capturing", "replaying")))

    def new_job(self) -> JobView:
        """A job seen for the first time, with the policy's guardrail limits."""
        policy = self.policy
        return JobView(evictions=EvictionBreaker(policy.eviction_window, policy.max_evictions, policy.max_eviction_fraction),
                       crash_loop=CrashLoopBreaker(policy.restart_window, policy.restart_budget, policy.max_same_failure))

    def decide(self, state: ControllerState, event: Event) -> Decision:
        plan = _Plan(self, state.jobs.get(event.job_id) or self.new_job(), event)
        p = event.payload
        if isinstance(p, NodeHealthChanged):
            self._on_health(plan, p)
        elif isinstance(p, RankExited):
            self._on_exit(plan, p)
        elif isinstance(p, DiagnosticsCompleted):
            self._on_diagnostics(plan, p)
        elif isinstance(p, StacksAnalyzed):
            self._on_stacks(plan, p)
        elif isinstance(p, FailSlowConvicted):
            self._on_fail_slow(plan, p)
        elif isinstance(p, MetricAnomalyDetected):
            self._on_metric_anomaly(plan, p)
        elif isinstance(p, SdcReplayAnalyzed):
            self._on_sdc_verdict(plan, p)
        elif isinstance(p, CodeRolloutRequested):
            self._on_rollout(plan, p)
        elif isinstance(p, TimerTicked):
            self._on_tick(plan, p.now)
        elif isinstance(p, NodeHeartbeat):
            self._on_heartbeat(plan, p)
        elif isinstance(p, ApprovalGiven):
            self._on_approval(plan, p)
        elif isinstance(p, NodeCordoned):
            plan.note(f"{p.node_id} {'cordoned' if p.cordoned else 'uncordoned'} by {p.by}"
                      + (f" ({p.reason})" if p.reason else "")
                      + (": never diagnosed, restarted onto or promoted until a human lifts it" if p.cordoned else ""))
        else:  # a change of the standby pool: registrations, self-checks, promotions, evictions done
            self._on_pool_change(plan)
        return plan.decision(f"{event.type}: nothing to decide")

    # -- evolve ----------------------------------------------------------------------------------

    def evolve_job(self, job: JobView, event: Event) -> JobView:  # noqa: C901 - one branch per event type
        p, at = event.payload, event.occurred_at
        if job.first_seen_at is None and isinstance(p, (RankStarted, NodeRegistered, JobRegistered)):
            job = replace(job, first_seen_at=at)
        if isinstance(p, JobRegistered):
            return replace(job, world_size=job.world_size or p.world_size)
        if isinstance(p, NodeRegistered):
            view = job.node(p.node_id)
            # A node registering (again) is a new agent: a repaired or replacement machine, or a restarted
            # one. It holds no ranks until it starts some; a human's cordon stays until a human lifts it.
            if p.standby and job.refills_pending:
                job = replace(job, refills_pending=job.refills_pending - 1)  # one of those asked for
            return job.with_node(replace(view, standby=p.standby, evicted=False, eviction_pending=None,
                                         promoting=False, checked=None if p.standby else view.checked,
                                         ranks=frozenset() if p.standby else view.ranks, last_heartbeat_at=at))
        if isinstance(p, RankStarted):
            view = job.node(p.node_id)
            if p.generation < view.generation:
                return job
            ranks = view.ranks | {p.rank} if p.generation == view.generation else frozenset({p.rank})
            job = job.with_node(replace(view, ranks=frozenset(ranks), generation=p.generation, standby=False,
                                        promoting=False, last_heartbeat_at=at))
            for other in list(job.nodes.values()):  # a rank moved here (a promotion) left its old node
                if other.node_id != p.node_id and p.rank in other.ranks and other.generation < p.generation:
                    job = job.with_node(replace(other, ranks=other.ranks - {p.rank}))
            job = replace(job, generation=max(job.generation, p.generation), world_size=max(job.world_size, p.world_size))
            incident = job.incident
            if incident is not None and incident.stage == "observing" and incident.target_generation is None \
                    and p.generation > incident.generation:
                # Restarted by someone else (observe mode, a human): watch that generation recover.
                incident = replace(incident, target_generation=p.generation)
            if incident is not None and incident.target_generation == p.generation:
                job = replace(job, incident=replace(incident, started=incident.started | {p.node_id}))
            return job
        if isinstance(p, NodeHeartbeat):
            job = job.with_node(replace(job.node(p.node_id), last_heartbeat_at=at))
            if p.standby or job.incident is not None:
                return job
            # Past where it failed: no loop. A failure before any reported step (failed_at_step -1) is
            # passed by the first step reported after it.
            if p.last_step > job.failed_at_step and job.crash_loop.fingerprints:
                job = replace(job, crash_loop=job.crash_loop.progressed())
            return replace(job, last_step=max(job.last_step, p.last_step))
        if isinstance(p, StandbyChecked):
            return job.with_node(replace(job.node(p.node_id), checked=p.passed))
        if isinstance(p, NodeCordoned):
            return job.with_node(replace(job.node(p.node_id), cordoned=p.cordoned, cordoned_by=p.by if p.cordoned else ""))
        if isinstance(p, NodeEvictionDecided):
            if p.observe_only:
                return job
            return replace(job.with_node(replace(job.node(p.node_id), eviction_pending=str(event.id))),
                           evictions=job.evictions.record(at), node_failures=job.node_failures + 1)
        if isinstance(p, NodeEvicted):
            view = job.node(p.node_id)
            # ``ranks`` stays: what the node ran is what a standby must take over (``active`` skips it).
            return job.with_node(replace(view, eviction_pending=None, evicted=view.evicted or p.outcome == "evicted"))
        if isinstance(p, StandbyPromotionRequested):
            return job.with_node(replace(job.node(p.node_id), promoting=True))
        if isinstance(p, StandbyPromoted):
            if p.outcome == "promoted":
                return job
            return job.with_node(replace(job.node(p.node_id), promoting=False, checked=False))
        if isinstance(p, RanksRestartRequested):
            return replace(job, generation=max(job.generation, p.generation))
        if isinstance(p, RankExited):
            if p.classification == "success" and p.generation >= job.generation:
                return replace(job, finished=True)
            return job
        if isinstance(p, CheckpointRanksRegistered):
            links = dict(job.rank_links)
            for groups in p.ranks:
                links[groups.rank] = frozenset(groups.pp) | frozenset(groups.tp) | {groups.rank}
            return replace(job, rank_links=links)
        if isinstance(p, MetricAnomalyDetected):
            if p.kind != "decline" and p.generation >= job.generation:
                fresh = job.incident is None or job.anomaly_step < 0
                return replace(job, anomaly_step=p.step if fresh else min(job.anomaly_step, p.step))
            return job
        if isinstance(p, CheckpointRestorePlanned):
            incident = job.incident
            if incident is not None and incident.target_generation == p.generation:
                return replace(job, incident=replace(incident, restore_step=p.step))
            return job
        if isinstance(p, CodeVersionRegistered):
            ref = CodeRef(version_id=p.version_id, path=p.path, entry=list(p.entry), digest=p.digest)
            return replace(job, code_versions={**job.code_versions, p.version_id: ref}, code_pending=p.version_id)
        if isinstance(p, CodeVersionStable):
            stables = tuple(v for v in job.code_stables if v != p.version_id) + (p.version_id,)
            return replace(job, code_stable=p.version_id, code_stables=stables)
        if isinstance(p, CodeRolloutRequested):
            return replace(job, rollout_due=p.version_id)
        return self._evolve_incident(job, event)

    def _evolve_incident(self, job: JobView, event: Event) -> JobView:
        """The controller's own decisions about an incident (folded live and on a cold start alike)."""
        p, at = event.payload, event.occurred_at
        incident = job.incident
        if isinstance(p, IncidentOpened):
            return replace(job, failed_at_step=p.last_step, incident=OpenIncident(
                id=str(event.id), kind=p.kind, opened_at=at, generation=p.generation, last_step=p.last_step,
                fingerprint=p.fingerprint, evidence=tuple(p.evidence)))
        if isinstance(p, IncidentResolved):
            return replace(job, incident=None if incident is None or incident.id == p.incident_id else incident,
                           anomaly_step=-1,
                           stopped=job.stopped or p.outcome == "stopped")
        if isinstance(p, JobStopDecided):
            return replace(job, stopped=True)
        if isinstance(p, StandbyPoolSized):
            return replace(job, pool_target=p.target)
        if isinstance(p, StandbyRefillRequested):
            return replace(job, refills_pending=job.refills_pending + p.count, refill_asked_at=p.expires_at)
        if isinstance(p, StacksRequested):
            job = replace(job, stack_rounds=max(job.stack_rounds, p.round + 1))
            if incident is None:
                return job
            return replace(job, incident=replace(incident, stage="capturing", rung=max(incident.rung, 3),
                                                 stacks_round=p.round, stacks_requested_at=at))
        if isinstance(p, SdcReplayRequested):
            job = replace(job, sdc_rounds=max(job.sdc_rounds, p.round + 1), generation=max(job.generation, p.generation))
            if incident is None:
                return job
            return replace(job, incident=replace(incident, stage="replaying", rung=max(incident.rung, 5),
                                                 sdc_round=p.round, sdc_requested_at=at,
                                                 sdc_replays=incident.sdc_replays + len(p.phases)))
        if isinstance(p, DiagnosticsRequested):
            job = replace(job, diag_rounds=max(job.diag_rounds, p.round + 1))
            if incident is None:
                return job
            return replace(job, incident=replace(
                incident, stage="diagnosing", rung=max(incident.rung, 2), diag_round=p.round,
                diag_deadline=at + timedelta(seconds=p.timeout_s), diag_requested_at=at, diag_nodes=frozenset(p.nodes),
                diag_results={}))
        if incident is None:
            return job
        if isinstance(p, DiagnosticsCompleted):
            if incident.stage != "diagnosing" or p.round != incident.diag_round:
                return job
            return replace(job, incident=replace(incident, diag_results={**incident.diag_results, p.node_id: p}))
        if isinstance(p, RestartDecided):
            fingerprint = p.fingerprint or f"{incident.kind}@{','.join(p.evict) or 'none'}"
            # A planned restart (rung 0: a code rollout) is no failure: the crash-loop breaker skips it.
            crash_loop = job.crash_loop if p.rung == 0 else job.crash_loop.record(at, fingerprint)
            code_change = incident.code_change
            if p.code_changed:
                code_change = (f"{'rolled back' if p.rollback else 'moved'} from {job.code_running} to "
                               f"{p.code_version}")
                job = replace(job, code_current=p.code_version, rollout_due="",
                              code_pending="" if job.code_pending == p.code_version else job.code_pending,
                              code_rolled_back=job.code_rolled_back | {job.code_running} if p.rollback
                              else job.code_rolled_back)
            return replace(job, generation=max(job.generation, p.generation), crash_loop=crash_loop,
                           incident=replace(incident, stage="recovering", rung=max(incident.rung, p.rung),
                                            target_generation=p.generation, started=frozenset(), restore_step=-1,
                                            held=None, code_change=code_change))
        if isinstance(p, ActionHeld):
            held = HeldPlan(p.rung, frozenset(p.evict), p.reason, p.rollback)
            stage: Stage = {"approval": "awaiting_approval", "no_standby": "waiting_standby"}.get(  # type: ignore[assignment]
                p.guardrail, "observing")
            return replace(job, incident=replace(incident, stage=stage, held=held, rung=max(incident.rung, p.rung)))
        if isinstance(p, ApprovalRequested):
            return replace(job, incident=replace(incident, approval_id=str(event.id)))
        return job

    # -- rung 1 and hangs ------------------------------------------------------------------------

    def _on_health(self, plan: _Plan, p: NodeHealthChanged) -> None:
        job = plan.job
        if p.status != "failed":
            plan.note(f"{p.node_id} is {p.status} ({p.component}/{p.check}): nothing to do")
            return
        if p.node_id not in job.nodes:
            plan.note(f"health event for unknown node {p.node_id} ({p.component}/{p.check}): it never registered "
                      f"with job {plan.event.job_id}; recorded, nothing done")
            return
        node = job.node(p.node_id)
        if node.evicted:
            plan.note(f"{p.node_id} is already evicted")
            return
        if node.eviction_pending:
            plan.note(f"{p.node_id} already has eviction {node.eviction_pending} pending")
            return
        rung1 = p.is_fatal and p.confidence == "high" and p.component in HARDWARE_COMPONENTS
        if rung1:
            why = (f"rung 1: high-confidence fatal {p.component} fault on {p.node_id} ({p.check}: "
                   f"{p.detail or 'no detail'}); evict now rather than diagnose")
            if not node.ranks or node.standby or job.stopped:
                plan.evict_idle(p.node_id, why + (" (an idle standby: nothing to restart)" if node.standby else ""))
                return
            plan.open_incident("hardware", p.node_id, "", why)
            plan.recover(1, frozenset({p.node_id}), why)
            return
        if p.component == "rank" and p.check in HANG_CHECKS and node.ranks and not job.stopped:
            if job.incident is not None:
                plan.note(f"{p.node_id}: rank {p.check} during incident {job.incident.id[:8]} ({job.incident.stage}): "
                          f"part of it")
                return
            if self.policy.stack_analysis:
                why = (f"rung 3: {p.node_id} reports {p.check} ({p.detail or 'no detail'}): capture the stacks of every "
                       f"training process while they hang and let the analyzer find the outliers")
                plan.open_incident("hang", p.node_id, f"hang/{p.check}", why)
                plan.capture_stacks(why)
                return
            why = (f"rung 2: {p.node_id} reports {p.check} ({p.detail or 'no detail'}) and nothing names a culprit: "
                   f"stop the ranks and run stop-time diagnostics on every node")
            plan.open_incident("hang", p.node_id, f"hang/{p.check}", why)
            plan.diagnose(why)
            return
        plan.note(f"{p.node_id}: {p.component}/{p.check} failed with {p.confidence} confidence, fatal={p.is_fatal}; "
                  f"not a rung-1 signal, left to the higher rungs")

    # -- crashes: rungs 2, 4 and 6 ---------------------------------------------------------------

    def _on_exit(self, plan: _Plan, p: RankExited) -> None:
        job = plan.job
        if p.classification not in FAILURE_CLASSES:
            plan.note(f"rank {p.rank} on {p.node_id} exited ({p.classification}): not a failure")
            return
        if job.stopped:
            plan.note(f"the job is stopped: the exit of rank {p.rank} is recorded, nothing restarted")
            return
        if p.generation < job.generation:
            plan.note(f"rank {p.rank} of generation {p.generation} exited; the job is at generation {job.generation}: "
                      f"an old generation ending")
            return
        incident = job.incident
        if incident is not None:
            restarted = incident.target_generation
            if not (incident.stage == "recovering" and restarted is not None and p.generation >= restarted):
                plan.note(f"rank {p.rank} on {p.node_id} exited ({p.classification}) during incident "
                          f"{incident.id[:8]} ({incident.stage}): part of it")
                return
            # The restarted generation itself failed before stepping past its restore point: the
            # recovery did not work. Close that incident and take this failure on as a new one (a
            # repeated fingerprint then climbs to rung 4, and on to rung 6).
            plan.resolve("superseded", f"generation {p.generation} failed again before stepping past its restore "
                                       f"point (step {incident.restore_step}): rank {p.rank} on {p.node_id} exited "
                                       f"({p.classification})")
        fingerprint = failure_fingerprint(p.classification, p.error_type, p.stderr_tail)
        streak = _streak(job.crash_loop.fingerprints, fingerprint)
        what = (f"rank {p.rank} on {p.node_id} exited ({p.classification}{': ' + p.error_type if p.error_type else ''}"
                f"{'; ' + p.reason if p.reason else ''})")
        kind = "user_code" if p.classification == "user_code" else "crash"
        if 2 <= streak < self.policy.max_same_failure:
            why = (f"rung 4: {what}; the same failure ({fingerprint}) {streak} times in a row with no progress "
                   f"in between: roll back to the last stable code version and restart")
            plan.open_incident(kind, p.node_id, fingerprint, why, ranks=[p.rank])
            plan.recover(4, frozenset(), why, rollback=True)
        elif p.classification == "user_code":
            why = f"rung 2: {what}; the traceback names the user's code, not a machine: restart in place, no diagnostics"
            plan.open_incident(kind, p.node_id, fingerprint, why, ranks=[p.rank])
            plan.recover(2, frozenset(), why)
        else:
            why = f"rung 2: {what}; nothing names a culprit: stop the ranks and run stop-time diagnostics on every node"
            plan.open_incident(kind, p.node_id, fingerprint, why, ranks=[p.rank])
            if streak >= self.policy.max_same_failure:
                plan.recover(2, frozenset(), why)  # the crash-loop breaker stops it, with its reason
            else:
                plan.diagnose(why)

    def _on_diagnostics(self, plan: _Plan, p: DiagnosticsCompleted) -> None:
        incident = plan.job.incident
        if incident is None or incident.stage != "diagnosing" or p.round != incident.diag_round:
            plan.note(f"diagnostics of {p.node_id} (round {p.round}) outside a diagnosing incident: recorded")
            return
        missing = sorted(incident.diag_nodes - set(incident.diag_results))
        named = {s for r in incident.diag_results.values() for s in r.suspects}
        if missing and not set(missing) <= named:
            plan.note(f"diagnostics round {p.round}: {p.node_id} {'passed' if p.passed else 'failed'}; waiting for "
                      f"{', '.join(missing)}")
            return
        # Everyone who can answer did, and they name every silent node as the peer that never joined:
        # no need to sit out the timeout.
        plan.conclude_diagnostics(timed_out=tuple(missing))

    def _on_stacks(self, plan: _Plan, p: StacksAnalyzed) -> None:
        incident = plan.job.incident
        if incident is None or incident.stage != "capturing" or p.round != incident.stacks_round:
            plan.note(f"stack verdict of round {p.round} outside a capturing incident: recorded")
            return
        seen = f" (could not see: {'; '.join(p.missing)})" if p.missing else ""
        if not p.conclusive or not p.group_nodes:
            plan.diagnose(f"rung 3 inconclusive: {p.reason}{seen}; rung 2: stop the ranks and run stop-time "
                          f"diagnostics on every node")
            return
        group = f"{p.group_kind.upper()} group" if p.group_kind in ("tp", "pp", "dp") else p.group_kind
        plan.recover(3, frozenset(p.group_nodes),
                     f"rung 3: the analyzer names rank(s) {_ranks_text(p.outlier_ranks)} as outliers ({p.reason}); "
                     f"evict the smallest group covering them, the {group} of rank(s) {_ranks_text(p.group_ranks)} on "
                     f"{', '.join(p.group_nodes)} (over-evicting on purpose){seen}")

    def _on_fail_slow(self, plan: _Plan, p: FailSlowConvicted) -> None:
        job = plan.job
        nodes = [n for n in p.group_nodes if n in job.nodes and not job.node(n).evicted]
        if job.stopped:
            plan.note(f"fail-slow conviction of {', '.join(p.group_nodes)}: the job is stopped; recorded")
            return
        if job.incident is not None:
            plan.note(f"fail-slow conviction of {', '.join(p.group_nodes)} during incident {job.incident.id[:8]} "
                      f"({job.incident.stage}): recorded; the analyzer convicts again if it persists")
            return
        if not nodes:
            plan.note(f"fail-slow conviction of {', '.join(p.group_nodes)}: no such live node of this job; recorded")
            return
        group = f"{p.group_kind.upper()} group" if p.group_kind in ("tp", "pp", "dp") else p.group_kind
        why = (f"rung 3: fail-slow: the analyzer convicts the {group} of rank(s) {_ranks_text(p.group_ranks)} on "
               f"{', '.join(nodes)} ({p.flags} of {p.rounds} rounds, every {p.interval_s:g} s: {p.reason}); "
               f"every rank waits for it each step: evict it")
        plan.open_incident("fail_slow", nodes[0], f"fail_slow/{','.join(nodes)}", why,
                           ranks=sorted({r for n in nodes for r in job.node(n).ranks}))
        plan.recover(3, frozenset(nodes), why)

    def _on_metric_anomaly(self, plan: _Plan, p: MetricAnomalyDetected) -> None:
        job = plan.job
        what = f"{p.kind.replace('_', '-')} {p.metric} on rank {p.rank} ({p.node_id}) at step {p.step}: {p.reason}"
        if p.kind == "decline":
            plan.note(f"throughput: {what}; recorded (a slow node is fail-slow's to convict; nothing is evicted "
                      f"for a decline alone)")
            return
        if job.stopped or p.generation < job.generation:
            plan.note(f"{what}: {'the job is stopped' if job.stopped else 'an old generation'}; recorded")
            return
        if job.incident is not None:
            plan.note(f"{what}: during incident {job.incident.id[:8]} ({job.incident.stage}): part of it")
            return
        if p.node_id not in job.nodes:
            plan.note(f"{what}: from a node this job does not know; recorded")
            return
        why = (f"rung 2: {what}. Nothing crashed, so a machine may be computing wrong numbers: stop the ranks and run "
               f"stop-time diagnostics on every node, then restart from a checkpoint before step {p.step} (the "
               f"checkpoint broker plans below it); if every node passes, rung 5 replays the step to locate a machine "
               f"that corrupts silently")
        plan.open_incident("metric_anomaly", p.node_id, f"metric/{p.kind}/{p.metric}", why, ranks=[p.rank])
        plan.diagnose(why)

    def _on_sdc_verdict(self, plan: _Plan, p: SdcReplayAnalyzed) -> None:
        incident = plan.job.incident
        if incident is None or incident.stage != "replaying" or p.round != incident.sdc_round:
            plan.note(f"replay verdict of round {p.round} outside a replaying incident: recorded")
            return
        rounds = f"{p.rounds} replay phase(s)"
        if p.kind in ("found", "several") and p.nodes:
            what = (f"machine {p.unit}" if p.kind == "found" else f"machines {', '.join(p.candidates)} (each fails alone)")
            plan.recover(5, frozenset(p.nodes), f"rung 5: dual-phase replay located {what} in {rounds}: {p.reason}; "
                                                f"evict {', '.join(p.nodes)} and restart from before the anomaly")
        elif p.kind == "ambiguous" and p.next_phase is not None:
            plan.replay_sdc(f"rung 5: replay round {p.round} was ambiguous ({p.reason})", phases=[p.next_phase],
                            reference=p.reference_digest)
        else:
            plan.recover(5, frozenset(), f"rung 5: dual-phase replay {p.kind.replace('_', ' ')} after {rounds} "
                                         f"({p.reason}): no machine to evict; restart in place from before the anomaly")

    def _on_tick(self, plan: _Plan, now: datetime) -> None:
        job, policy = plan.job, self.policy
        incident = job.incident
        if (incident is not None and incident.stage == "capturing" and incident.stacks_requested_at is not None
                and now - incident.stacks_requested_at >= policy.stacks_verdict_timeout):
            plan.diagnose(f"rung 3: no verdict from the analyzer {policy.stacks_verdict_timeout.total_seconds():g} s "
                          f"after the capture of round {incident.stacks_round} was asked for (is it running?); rung 2: "
                          f"stop the ranks and run stop-time diagnostics on every node")
            return
        if (incident is not None and incident.stage == "replaying" and incident.sdc_requested_at is not None
                and now - incident.sdc_requested_at >= policy.sdc_replay_timeout + SDC_VERDICT_GRACE):
            plan.recover(5, frozenset(), f"rung 5: no verdict on replay round {incident.sdc_round} "
                                         f"{(policy.sdc_replay_timeout + SDC_VERDICT_GRACE).total_seconds():g} s after it "
                                         f"was asked for (is the analyzer running?): restart in place from before the anomaly")
            return
        if incident is not None and incident.stage == "diagnosing":
            missing = sorted(incident.diag_nodes - set(incident.diag_results))
            if incident.diag_deadline is not None and now >= incident.diag_deadline:
                plan.conclude_diagnostics(timed_out=tuple(missing))
                return
            # Every node still owing a result has gone silent too (no heartbeat for the silence
            # timeout): its agent is gone, and waiting for the deadline only loses time.
            silent = [n for n in missing if (seen := job.node(n).last_heartbeat_at) is not None
                      and now - seen > policy.node_silence_timeout]
            if missing and len(silent) == len(missing) and len(missing) < len(incident.diag_nodes):
                plan.note(f"diagnostics round {incident.diag_round}: {', '.join(silent)} sent no heartbeat for "
                          f"over {policy.node_silence_timeout.total_seconds():g} s: not waiting for the deadline")
                plan.conclude_diagnostics(timed_out=tuple(missing))
                return
            # A node whose agent has not answered the request at all (agents send a heartbeat on receipt)
            # is gone: its peers would only wait for it in the all-gather until the deadline.
            requested_at = incident.diag_requested_at
            if requested_at is not None and now - requested_at >= policy.diagnostics_ack_timeout:
                unacked = [n for n in missing if (seen := job.node(n).last_heartbeat_at) is None or seen < requested_at]
                if unacked and len(unacked) < len(incident.diag_nodes):
                    plan.note(f"diagnostics round {incident.diag_round}: {', '.join(unacked)} sent nothing in the "
                              f"{policy.diagnostics_ack_timeout.total_seconds():g} s since the request: not waiting "
                              f"for the deadline")
                    plan.conclude_diagnostics(timed_out=(), unacknowledged=tuple(unacked))
            return
        if job.stopped or job.finished or (incident is not None and incident.stage not in ("recovering", "observing")):
            return
        lost = [n for n in job.active if not n.eviction_pending and n.last_heartbeat_at is not None
                and now - n.last_heartbeat_at > policy.node_silence_timeout]
        if not lost:
            return
        silence = max((now - n.last_heartbeat_at).total_seconds() for n in lost if n.last_heartbeat_at)
        names = ", ".join(n.node_id for n in lost)
        why = (f"rung 1: no heartbeat from {names} for {silence:.0f} s (timeout "
               f"{policy.node_silence_timeout.total_seconds():g} s): the node's agent is gone; evict it")
        plan.open_incident("lost_node", lost[0].node_id, "", why)
        plan.recover(1, frozenset(n.node_id for n in lost), why)

    def _on_rollout(self, plan: _Plan, p: CodeRolloutRequested) -> None:
        job = plan.job
        pending = job.code_pending
        if not pending:
            plan.note(f"rollout of {p.version_id} asked for: no version is pending (a restart already carried it)")
        elif job.stopped or job.finished:
            plan.note(f"rollout of {pending} asked for: the job is {'stopped' if job.stopped else 'finishing'}; "
                      f"nothing restarted")
        elif not job.active:
            plan.note(f"rollout of {pending} asked for: no ranks run yet; they start on it with the next restart")
        elif job.incident is not None:
            plan.note(f"rollout of {pending} asked for during incident {job.incident.id[:8]} ({job.incident.stage}): "
                      f"its restart carries the version, or one follows once it is resolved")
        else:
            plan.roll_out(f"{p.reason}{'' if pending == p.version_id else f' (the newest pending version is {pending})'}")

    def _on_heartbeat(self, plan: _Plan, p: NodeHeartbeat) -> None:
        incident = plan.job.incident
        if incident is None or incident.stage not in ("recovering", "observing") or p.node_id not in incident.started:
            return
        if p.last_step > incident.restore_step:
            by = "" if incident.stage == "recovering" else " without the controller acting"
            code = ""
            if incident.code_change.startswith("rolled back"):
                code = (f"; the code was {incident.code_change} and that resolved it: the cause was the user's code, "
                        f"not a machine")
            elif incident.code_change:
                code = f"; the code {incident.code_change}"
            plan.resolve("recovered", f"generation {incident.target_generation} is stepping again{by} ({p.node_id} at "
                                      f"step {p.last_step}, restored after step {incident.restore_step}){code}")
            job = plan.job
            if job.rollout_due and job.code_pending and not job.stopped and not job.finished:
                plan.roll_out(f"rollout of {job.code_pending} asked for during incident {incident.id[:8]}, which is "
                              f"over: restart onto it now")

    def _on_pool_change(self, plan: _Plan) -> None:
        incident = plan.job.incident
        if incident is not None and incident.stage == "waiting_standby" and incident.held is not None:
            held = incident.held
            if len(plan.job.ready_standbys) >= sum(1 for n in held.evict if plan.job.node(n).ranks):
                plan.recover(held.rung, held.evict, f"{held.reason}; a ready standby joined the pool",
                             rollback=held.rollback, approved=True)
                return
        plan.size_pool()

    def _on_approval(self, plan: _Plan, p: ApprovalGiven) -> None:
        incident = plan.job.incident
        if incident is None or incident.stage != "awaiting_approval" or incident.approval_id != p.request_id:
            plan.note(f"answer to {p.request_id[:8]} by {p.by} matches no waiting action: recorded, nothing done")
            return
        held = incident.held
        assert held is not None
        if not p.approved:
            plan.resolve("stopped", f"{p.by} denied the recovery ({p.comment or 'no comment'}): the job is stopped and "
                                    f"left to a human", stop=True)
            return
        plan.recover(held.rung, held.evict, f"{held.reason}; approved by {p.by}", rollback=held.rollback, approved=True)


def _streak(history: Iterable[str], fingerprint: str) -> int:
    """How many times in a row ``fingerprint`` will have been seen, counting this time."""
    streak = 1
    for previous in reversed(tuple(history)):
        if previous != fingerprint:
            break
        streak += 1
    return streak


def _ranks_text(ranks: Iterable[int]) -> str:
    return ", ".join(map(str, sorted(ranks)))


@dataclass(frozen=True)
class DiagnosticsVerdict:
    evict: frozenset[str]
    reason: str
    stop: bool = False


_LOCAL_CHECKS = frozenset({"gpu_matmul", "intra_node_all_to_all"})


def diagnostics_verdict(results: Mapping[str, DiagnosticsCompleted], nodes: Iterable[str], timed_out: Iterable[str],
                        timeout: timedelta, *, unacknowledged: Iterable[str] = (),
                        ack_timeout: timedelta | None = None) -> DiagnosticsVerdict:
    """Which nodes one round of stop-time diagnostics convicts, and why (pure).

    - A node failing a check of its own (the GPU self-test, the intra-node all-to-all) is bad.
    - The inter-node all-gather fails on *every* node when one is bad; the reports' ``suspects`` (a peer
      that never joined or sent wrong data) say which. A node named by another is bad; a node whose
      only failure is the collective and whom nobody names is a bystander.
    - A node that did not report (``timed_out``) is bad: its agent or its network is gone. So is one
      whose agent did not even acknowledge the request (``unacknowledged``, within ``ack_timeout``); a
      node that acknowledged and has not reported yet when the round ends that early is not judged.
    - The collective failing on at least half the nodes with nobody named is no bad machine (a switch,
      the fabric, a bad driver push): evicting would empty the job, so the verdict is to stop and page.
    """
    nodes, timed_out = sorted(set(nodes)), sorted(set(timed_out))
    unacknowledged = sorted(set(unacknowledged) - set(timed_out))
    named: dict[str, set[str]] = {}
    for reporter, result in results.items():
        for suspect in result.suspects:
            if suspect != reporter:
                named.setdefault(suspect, set()).add(reporter)
    local_bad = {n for n, r in results.items() if any(not c.passed and not c.skipped and c.check in _LOCAL_CHECKS
                                                      for c in r.results)}
    collective_only = {n for n, r in results.items() if not r.passed and n not in local_bad}
    bad = local_bad | set(timed_out) | set(unacknowledged) | {s for s in named if s in set(nodes)}
    unexplained = collective_only - bad
    parts = []
    for node_id in sorted(local_bad):
        checks = [f"{c.check}: {c.detail}" for c in results[node_id].results
                  if not c.passed and not c.skipped and c.check in _LOCAL_CHECKS]
        parts.append(f"{node_id} failed its own checks ({'; '.join(checks)})")
    for suspect in sorted(set(named) & bad - local_bad):
        parts.append(f"{suspect} named by {', '.join(sorted(named[suspect]))} "
                     f"({'never joined or sent wrong data' if suspect in timed_out or suspect not in results else 'sent wrong data'})")
    silent = [n for n in timed_out if n not in named]
    if silent:
        parts.append(f"{', '.join(silent)} did not report within {timeout.total_seconds():g} s (the diagnostic timed "
                     f"out): treated as failed")
    gone = [n for n in unacknowledged if n not in named]
    if gone:
        within = f" within {ack_timeout.total_seconds():g} s" if ack_timeout is not None else ""
        parts.append(f"{', '.join(gone)} did not acknowledge the request{within} (its agent sent nothing): lost")
    if not bad and unexplained:
        if len(unexplained) * 2 >= max(1, len(nodes)):
            return DiagnosticsVerdict(frozenset(), f"the inter-node check failed on {', '.join(sorted(unexplained))} "
                                                   f"and no report names a culprit: a fabric-wide fault, not a machine; "
                                                   f"stopping instead of evicting half the job", stop=True)
        bad = set(unexplained)
        for node_id in sorted(unexplained):
            checks = [f"{c.check}: {c.detail}" for c in results[node_id].results if not c.passed and not c.skipped]
            parts.append(f"{node_id} failed ({'; '.join(checks) or results[node_id].detail or 'no detail'})")
        parts.append("nobody else is named: evicting the minority that failed")
    if not bad:
        return DiagnosticsVerdict(frozenset(), f"passed on every node ({', '.join(sorted(results))})")
    bystanders = sorted(collective_only - bad)
    if bystanders:
        parts.append(f"{', '.join(bystanders)} failed only the collective check because of them: kept")
    return DiagnosticsVerdict(frozenset(bad), "; ".join(parts))


# -- one decision in the making ----------------------------------------------------------------------


class _Plan:
    """Builds one decision. Every proposal is folded into ``job`` at once (with the same evolve as the log
    gets), so later steps of the same decision see what earlier ones changed."""

    def __init__(self, decider: ControllerDecider, job: JobView, event: Event) -> None:
        self.decider, self.policy, self.job, self.event = decider, decider.policy, job, event
        self.proposals: list[Proposal] = []
        self.reasons: list[str] = []
        self.subject = f"job/{event.job_id}"

    def note(self, reason: str) -> None:
        if reason and reason not in self.reasons:
            self.reasons.append(reason)

    def emit(self, payload: EventPayload, subject: str | None = None, key: str = "") -> Event:
        incident = self.job.incident
        proposal = Proposal(payload, subject=subject or self.subject, key=key,
                            correlation_id=uuid.UUID(incident.id) if incident is not None else None)
        [event] = materialise(NAME, self.event, Decision("", (proposal,)))
        self.proposals.append(proposal)
        self.job = self.decider.evolve_job(self.job, event)
        return event

    def decision(self, default: str) -> Decision:
        return Decision(reason="; ".join(self.reasons) or default, proposals=tuple(self.proposals))

    @property
    def now(self) -> datetime:
        p = self.event.payload
        return p.now if isinstance(p, TimerTicked) else self.event.occurred_at

    @property
    def expires_at(self) -> datetime:
        return self.now + self.policy.command_ttl

    # incidents

    def open_incident(self, kind: str, node_id: str, fingerprint: str, reason: str, *,
                      ranks: list[int] | None = None) -> None:
        if self.job.incident is not None:
            return
        self.emit(IncidentOpened(kind=kind, node_id=node_id, ranks=ranks or sorted(self.job.node(node_id).ranks),  # type: ignore[arg-type]
                                 generation=self.job.generation, last_step=self.job.last_step,
                                 fingerprint=fingerprint, reason=reason, evidence=[str(self.event.id)]),
                  key="incident")
        # The incident's own id is its correlation: emit() read it before the incident existed.
        opened = self.proposals[-1]
        self.proposals[-1] = replace(opened, correlation_id=uuid.UUID(self.job.incident.id))  # type: ignore[union-attr]

    def resolve(self, outcome: str, reason: str, *, stop: bool = False, rung: int | None = None) -> None:
        incident = self.job.incident
        assert incident is not None
        self.note(reason)
        final_rung = rung if rung is not None else incident.rung
        # Keys name the incident: one decision may close one incident and open (and close) the next, and
        # two events of one type and key from one cause would share an id (the second deduplicated away).
        if stop:
            self.emit(JobStopDecided(incident_id=incident.id, rung=max(1, final_rung), reason=reason, page=True,
                                     evidence=list(incident.evidence)), key=f"stop/{incident.id}")
        self.emit(IncidentResolved(incident_id=incident.id, outcome=outcome, rung=final_rung,  # type: ignore[arg-type]
                                   generation=self.job.generation, reason=reason), key=f"resolved/{incident.id}")

    # guardrails

    def hold(self, action: Action, guardrail: str, reason: str, plan: HeldPlan) -> None:
        incident = self.job.incident
        assert incident is not None
        self.note(reason)
        self.emit(ActionHeld(incident_id=incident.id, action=action, guardrail=guardrail, reason=reason,  # type: ignore[arg-type]
                             rung=plan.rung, evict=sorted(plan.evict), rollback=plan.rollback),
                  key=f"held/{guardrail}/{incident.id}")

    def approval_needed(self, action: Action, plan: HeldPlan) -> bool:
        if action not in self.policy.approval_required:
            return False
        incident = self.job.incident
        assert incident is not None
        self.hold(action, "approval", f"{action} needs a human's approval: `keel approve` or `keel deny`", plan)
        self.emit(ApprovalRequested(incident_id=incident.id, action=action, reason=plan.reason,
                                    expires_at=self.now + self.policy.approval_ttl), key=f"approval/{action}")
        return True

    # rungs

    def evict_idle(self, node_id: str, reason: str) -> None:
        """Evict a node that runs none of the job's ranks (an idle standby): nothing to restart."""
        verdict = self.job.evictions.check(self.now, self.job.size)
        if not verdict.allowed:
            self.note(f"{reason}; held: {verdict.reason}")
            return
        self.note(reason)
        self.emit(NodeEvictionDecided(node_id=node_id, rung=1, reason=reason, evidence=[str(self.event.id)],
                                      expires_at=self.expires_at, observe_only=self.policy.observe_only),
                  subject=f"node/{node_id}")

    def capture_stacks(self, reason: str) -> None:
        """Rung 3: every active node captures its training processes' stacks; the analyzer judges."""
        nodes = [n.node_id for n in sorted(self.job.active, key=lambda n: min(n.ranks)) if not n.cordoned]
        round_ = self.job.stack_rounds
        self.note(reason)
        self.emit(StacksRequested(round=round_, nodes=nodes, timeout_s=self.policy.stacks_timeout.total_seconds(),
                                  expires_at=self.expires_at, reason=reason), key=f"stacks/{round_}")

    def diagnose(self, reason: str) -> None:
        # By rank, rank 0's node first: it hosts the round's rendezvous, at the job's master address.
        nodes = [n.node_id for n in sorted(self.job.active, key=lambda n: min(n.ranks)) if not n.cordoned]
        plan = HeldPlan(2, frozenset(), reason)
        if self.policy.observe_only:
            self.hold("diagnose", "observe_only", "observe mode: diagnostics decided, not run", plan)
            return
        if self.approval_needed("diagnose", plan):
            return
        round_ = self.job.diag_rounds
        self.note(reason)
        self.emit(DiagnosticsRequested(round=round_, nodes=nodes, checks=list(self.policy.diagnostics_checks),  # type: ignore[arg-type]
                                       timeout_s=self.policy.diagnostics_timeout.total_seconds(),
                                       expires_at=self.expires_at, reason=reason), key=f"diagnostics/{round_}")

    def conclude_diagnostics(self, timed_out: tuple[str, ...], unacknowledged: tuple[str, ...] = ()) -> None:
        incident = self.job.incident
        assert incident is not None
        verdict = diagnostics_verdict(incident.diag_results, incident.diag_nodes, timed_out,
                                      self.policy.diagnostics_timeout, unacknowledged=unacknowledged,
                                      ack_timeout=self.policy.diagnostics_ack_timeout)
        round_ = incident.diag_round
        if verdict.stop:
            self.resolve("stopped", f"rung 2: stop-time diagnostics round {round_}: {verdict.reason}", stop=True, rung=2)
        elif verdict.evict:
            self.recover(2, verdict.evict, f"rung 2: stop-time diagnostics round {round_}: {verdict.reason}: evict")
        elif incident.kind == "metric_anomaly" and self.policy.sdc_replay and self.job.anomaly_step >= 0:
            self.replay_sdc(f"rung 5: stop-time diagnostics round {round_}: {verdict.reason}, yet a machine computed "
                            f"a non-finite or spiking value at step {self.job.anomaly_step}: silent data corruption "
                            f"suspected")
        else:
            self.recover(2, frozenset(), f"rung 2: stop-time diagnostics round {round_}: {verdict.reason}: "
                                         f"restart in place")

    def replay_sdc(self, reason: str, phases: list | None = None, reference: str = "") -> None:  # type: ignore[type-arg]
        """Rung 5: restart every node's ranks in replay mode (the dual-phase plan, or ``phases``); the
        analyzer's verdict comes back as ``SdcReplayAnalyzed``. With fewer than ``MIN_SDC_UNITS`` replay
        units there is no majority to judge by: restart in place."""
        job = self.job
        active = [n for n in sorted(job.active, key=lambda n: min(n.ranks)) if not n.cordoned]
        rank_nodes = {r: n.node_id for n in active for r in n.ranks}
        units = machine_units(rank_nodes, {r: job.rank_links.get(r, frozenset({r})) for r in rank_nodes})
        if len(units) < MIN_SDC_UNITS or not job.rank_links:
            why = ("no checkpointed ranks to replay from" if not job.rank_links
                   else f"{len(units)} replay unit(s) ({', '.join(u.name for u in units) or 'none'}): the clean result "
                        f"is the one most groups agree on, which needs at least {MIN_SDC_UNITS} units")
            self.recover(5, frozenset(), f"{reason}; {why}: restart in place from before the anomaly")
            return
        if self.policy.observe_only:
            self.hold("diagnose", "observe_only", f"{reason}; observe mode: the replay is decided, not run",
                      HeldPlan(5, frozenset(), reason))
            return
        if phases is None:
            phases = [sdc_phase(p) for p in plan_phases([u.name for u in units])]
        round_ = job.sdc_rounds
        self.note(reason)
        self.emit(SdcReplayRequested(round=round_, generation=job.generation + 1, nodes=[n.node_id for n in active],
                                     units=units, phases=phases, anomaly_step=max(0, job.anomaly_step),
                                     reference=reference, timeout_s=self.policy.sdc_replay_timeout.total_seconds(),
                                     expires_at=self.expires_at,
                                     reason=f"{reason}: replay the step after the checkpoint below the anomaly "
                                            f"(step {job.anomaly_step}) on {len(units)} units in {len(phases)} "
                                            f"phase(s) ({', '.join(p.kind for p in phases)})"),
                  key=f"sdc/{round_}")

    def recover(self, rung: int, evict: frozenset[str], reason: str, *, rollback: bool = False,
                approved: bool = False) -> None:
        """Evict ``evict`` (ready standbys take over their ranks), roll back if asked, and restart every
        other node of the job in place as the next generation - within the guardrails."""
        job, policy = self.job, self.policy
        incident = job.incident
        assert incident is not None
        plan = HeldPlan(rung, evict, reason, rollback)
        to_evict = sorted(n for n in evict if not job.node(n).evicted and not job.node(n).eviction_pending)
        # The eviction circuit breaker: a flood of "bad node" verdicts is likelier a broken probe or switch.
        breaker = job.evictions
        for _node_id in to_evict:
            verdict = breaker.check(self.now, job.size)
            if not verdict.allowed:
                self.hold("evict", "eviction_breaker", verdict.reason, plan)
                self.resolve("stopped", verdict.reason, stop=True, rung=rung)
                return
            breaker = breaker.record(self.now)
        # The crash-loop breaker and the job-wide restart budget (rung 6); a planned restart is no failure.
        fingerprint = incident.fingerprint or f"{incident.kind}@{','.join(sorted(evict)) or 'none'}"
        verdict = job.crash_loop.check(self.now, fingerprint)
        if rung > 0 and not verdict.allowed:
            self.hold("restart", "restart_budget", verdict.reason, plan)
            self.resolve("stopped", f"rung 6: {verdict.reason}", stop=True, rung=6)
            return
        if policy.observe_only:
            for node_id in to_evict:
                self.emit(NodeEvictionDecided(node_id=node_id, rung=rung, reason=reason, evidence=list(incident.evidence),
                                              expires_at=self.expires_at, observe_only=True), subject=f"node/{node_id}")
            self.hold("rollback" if rollback else "restart", "observe_only", f"{reason}; observe mode: decided, "
                      f"not executed", plan)
            return
        action: Action = "rollback" if rollback else ("evict" if to_evict else "restart")
        if not approved and self.approval_needed(action, plan):
            return
        # Standbys for the ranks of the nodes that leave.
        leaving = [job.node(n) for n in sorted(evict) if job.node(n).ranks]
        standbys = job.ready_standbys
        for node_id in to_evict:
            self.emit(NodeEvictionDecided(node_id=node_id, rung=rung, reason=reason, evidence=list(incident.evidence),
                                          expires_at=self.expires_at), subject=f"node/{node_id}")
        if len(standbys) < len(leaving):
            need = len(leaving) - len(standbys)
            self.hold("promote", "no_standby", f"{reason}; no ready standby for {need} evicted node(s): the job "
                      f"waits for the pool to refill", plan)
            # ``target`` is the pool the actuator must bring up: the standbys ready now plus the shortfall
            # (a group eviction can need more than the pool's usual size).
            self.emit(StandbyRefillRequested(count=need, target=max(len(standbys) + need, job.pool_target or 0),
                                             reason=f"incident {incident.id[:8]} needs {need} ready standby(s) now",
                                             expires_at=self.expires_at), key="refill")
            return
        generation = self.job.generation + 1
        code_version, code_text = self.code_for(rollback)
        code = self.job.code_ref(code_version or self.job.code_current)
        promotions = [Promotion(standby_node_id=s.node_id, replaces_node_id=n.node_id, ranks=sorted(n.ranks))
                      for n, s in zip(leaving, standbys, strict=False)]
        staying = [n.node_id for n in self.job.active if n.node_id not in evict]
        self.note(reason)
        text = (f"restart as generation {generation} on {len(staying) + len(promotions)} node(s)"
                + "".join(f"; {p.standby_node_id} takes over ranks {_ranks_text(p.ranks)} of {p.replaces_node_id}"
                          for p in promotions)
                + (f"; {code_text}" if code_text else "") + "; restore from memory and peers")
        self.note(text)
        self.emit(RestartDecided(incident_id=incident.id, rung=rung, generation=generation, evict=to_evict,
                                 promotions=promotions, restart_nodes=staying, rollback=rollback,
                                 fingerprint=fingerprint, reason=f"{reason}; {text}", code_version=code_version,
                                 code_changed=bool(code_version)), key=f"restart/{generation}")
        if rollback:
            self.emit(RollbackDecided(incident_id=incident.id, reason=f"{reason}; {code_text}",
                                      fingerprint=incident.fingerprint, to_version=code_version,
                                      evidence=list(incident.evidence), expires_at=self.expires_at), key="rollback")
        for promotion in promotions:
            node_rank = promotion.ranks[0] // max(1, len(promotion.ranks))
            self.emit(StandbyPromotionRequested(
                node_id=promotion.standby_node_id, replaces_node_id=promotion.replaces_node_id, node_rank=node_rank,
                ranks=promotion.ranks, generation=generation, expires_at=self.expires_at, code=code,
                reason=f"incident {incident.id[:8]}: take over ranks {_ranks_text(promotion.ranks)} of "
                       f"{promotion.replaces_node_id}"), subject=f"node/{promotion.standby_node_id}")
        for node_id in staying:
            self.emit(RanksRestartRequested(node_id=node_id, generation=generation, expires_at=self.expires_at, code=code,
                                            reason=f"incident {incident.id[:8]}, rung {rung}: restart in place as "
                                                   f"generation {generation}"), subject=f"node/{node_id}")
        if promotions:
            self.size_pool()

    def code_for(self, rollback: bool) -> tuple[str, str]:
        """The code version a restart switches to ("" : it keeps the code) and what to say about it."""
        job = self.job
        running = job.code_running
        if rollback:
            # The same failure twice in a row points at the code running now, even if it ran long enough to
            # be called stable (a bug at a step it had not reached yet): back to the stable version before it.
            earlier = [v for v in reversed(job.code_stables) if v != running and v not in job.code_rolled_back]
            if earlier:
                was = " (stable until now)" if running in job.code_stables else ""
                return earlier[0], f"roll the code back from {running}{was} to {earlier[0]}, the last stable version before it"
            if job.code_stables:
                return "", f"no stable version other than {running}: nothing to roll back to; the same code restarts"
            return "", "no code version is known to be stable yet: nothing to roll back to; the same code restarts"
        pending = job.code_pending
        if pending and pending not in job.code_rolled_back:
            return pending, f"the ranks start on code version {pending} (was {running})"
        return "", ""

    def roll_out(self, reason: str) -> None:
        """A planned restart onto the pending code version (an urgent deploy, a lazy one's deadline)."""
        version = self.job.code_pending
        why = f"code rollout: {reason}"
        self.open_incident("code_update", "", f"code_update/{version}", why)
        self.recover(0, frozenset(), why)

    def size_pool(self) -> None:
        """The standby pool's target from the binomial model; a refill when fewer are ready."""
        job, policy = self.job, self.policy
        nodes = len(job.active)
        if nodes == 0:
            return
        # Producers stamp their own events: one arriving out of order can predate the first one seen.
        hours = max(0.0, (self.now - job.first_seen_at).total_seconds() / 3600.0) if job.first_seen_at else 0.0
        p = failure_probability(job.node_failures, nodes * hours, policy.standby_replacement_window,
                                prior_rate_per_node_hour=policy.standby_prior_rate_per_node_hour,
                                prior_node_hours=policy.standby_prior_node_hours)
        model = plan_standby_pool(nodes, p, quantile=policy.standby_quantile)
        target = max(policy.standby_min, model.size)
        ready = len(job.ready_standbys) + sum(1 for n in job.nodes.values() if n.standby and n.checked is None
                                             and not n.evicted)
        if target != job.pool_target:
            reason = model.reason + (f"; raised to the configured minimum {policy.standby_min}"
                                     if policy.standby_min > model.size else "")
            self.note(f"standby pool: {reason}")
            self.emit(StandbyPoolSized(target=target, ready=ready, job_nodes=nodes, failure_probability=p,
                                       reason=reason), key="pool")
        expired = self.job.refill_asked_at is not None and self.now > self.job.refill_asked_at
        pending = 0 if expired else self.job.refills_pending  # an actuator that never delivered is asked again
        missing = target - ready - pending
        if missing > 0:
            self.emit(StandbyRefillRequested(count=missing, target=target,
                                             reason=f"{ready} standby(s) ready or checking and {pending} on their "
                                                    f"way, target {target}",
                                             expires_at=self.expires_at), key="refill/pool")
