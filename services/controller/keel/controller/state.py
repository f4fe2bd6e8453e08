"""The controller's state and its fold: what it knows about each job, rebuilt from the event log alone.

- Views (immutable): ``ControllerState`` maps a job id to its ``JobView``: its nodes (``NodeView``), its
  world size, generation and progress, its guardrail breakers, its code versions and at most one
  ``OpenIncident``, with a ``HeldPlan`` when a recovery waits for an approval or a standby.
- The fold (pure): ``evolve_job(job, event)``. The controller folds its own decision events exactly like
  its inputs, so a cold start rebuilds every incident from the log and a replay reaches the same state.

Incidents: the first signal opens one (``IncidentOpened``); its id - that event's id - is the correlation
id of every decision about it and of the agents' answers. Signals that arrive while it is open join it.
``IncidentResolved`` closes it once a node of the restarted generation steps past the restore point; for
a job whose ranks never report through the SDK (``JobView.sdk_seen`` false), once every rank of the
restarted generation has been running for ``ControllerPolicy.process_settle_interval`` (the fold keeps
since when: ``OpenIncident.processes_up_since``).

Code versions (hot-update): the fold keeps the registered versions (``CodeVersionRegistered``), the newest
one no restart has carried yet (``code_pending``), the ones hot-update found stable and the ones rolled
back (never applied again: versions are content-addressed, a fix is another version).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal, TypeVar

from keel.controller.guardrails import CrashLoopBreaker, EvictionBreaker
from keel.controller.policy import ControllerPolicy
from keel.events.envelope import Event
from keel.events.types import (
    LAUNCH_VERSION,
    ActionHeld,
    ApprovalRequested,
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    CodeRef,
    CodeRolloutRequested,
    CodeVersionRegistered,
    CodeVersionStable,
    DiagnosticsCompleted,
    DiagnosticsRequested,
    IncidentOpened,
    IncidentResolved,
    JobRegistered,
    JobStopDecided,
    MetricAnomalyDetected,
    NodeClockSkewed,
    NodeCordoned,
    NodeEvicted,
    NodeEvictionDecided,
    NodeFenced,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeRegistered,
    RankExited,
    RanksRestartRequested,
    RankStarted,
    RestartDecided,
    SdcReplayRequested,
    StacksRequested,
    StandbyChecked,
    StandbyPoolSized,
    StandbyPromoted,
    StandbyPromotionRequested,
    StandbyRefillRequested,
    TimerTicked,
)
from keel.rules.code import registration_problem

AGENT_PRODUCER = "agent"
"""The producer name of node agents' events (``keel.agent.agent.PRODUCER``): what hearing from a node means."""

Stage = Literal["observing", "capturing", "diagnosing", "replaying", "recovering", "waiting_standby",
                "awaiting_approval"]
"""Where an open incident stands: what the ladder waits for next."""


# -- views ---------------------------------------------------------------------------------------------


_V = TypeVar("_V")


def replace(view: _V, /, **changes: object) -> _V:
    """``dataclasses.replace`` for this module's views, an order of magnitude cheaper: the fold makes
    several per event, and on a fleet of 1,200 machines the generic one (which walks every field through
    ``__init__``) took most of the controller's time. A view here has no ``__post_init__``, no ``InitVar``
    and no ``init=False`` field, so a copy of its ``__dict__`` with the changes is what ``__init__``
    would build. An unknown field is refused, as ``dataclasses.replace`` refuses it."""
    fields = type(view).__dataclass_fields__  # type: ignore[attr-defined]
    for name in changes:
        if name not in fields:
            raise TypeError(f"{type(view).__name__} has no field {name!r}")
    copied = object.__new__(type(view))
    state = copied.__dict__
    state.update(view.__dict__)
    state.update(changes)
    return copied


HEARD_BUCKETS = 64
"""``HeardMap``'s buckets: a node added copies the bucket tuple and one bucket (about machines / 64 entries)."""


@dataclass(frozen=True, eq=False)
class HeardMap(Mapping[str, datetime]):
    """``JobView.heard``: the nodes heard since the latest tick, with their newest timestamp. Immutable, and
    cheap to extend: every agent event of a job adds to it, so a copy of the whole map per event (a plain
    dict's) made one heartbeat round of N machines cost N^2 / 2 entry copies (the fleet simulator found it).
    Here a node goes into one of ``HEARD_BUCKETS`` buckets, chosen by a CRC of its id (the same in every
    process, so a snapshot decodes to the same buckets), and only that bucket is copied. Equal to any mapping
    with the same items, a plain dict included (a snapshot of an older state holds one)."""

    buckets: tuple[Mapping[str, datetime], ...] = ()
    size: int = 0

    @staticmethod
    def bucket(node_id: str) -> int:
        return zlib.crc32(node_id.encode()) % HEARD_BUCKETS

    def __getitem__(self, node_id: str) -> datetime:
        if not self.buckets:
            raise KeyError(node_id)
        return self.buckets[self.bucket(node_id)][node_id]

    def get(self, node_id: str, default: datetime | None = None) -> datetime | None:  # type: ignore[override]
        return self.buckets[self.bucket(node_id)].get(node_id, default) if self.buckets else default

    def __iter__(self) -> Iterator[str]:
        for bucket in self.buckets:
            yield from bucket

    def __len__(self) -> int:
        return self.size

    def set(self, node_id: str, at: datetime) -> HeardMap:
        """This map with ``node_id`` heard at ``at`` (this one left as it was)."""
        buckets = self.buckets or tuple({} for _ in range(HEARD_BUCKETS))
        b = self.bucket(node_id)
        bucket = buckets[b]
        grown = node_id not in bucket
        return HeardMap(buckets[:b] + ({**bucket, node_id: at},) + buckets[b + 1:], self.size + grown)

    @staticmethod
    def of(items: Mapping[str, datetime]) -> HeardMap:
        """A ``HeardMap`` of ``items`` (itself when it is one)."""
        if isinstance(items, HeardMap):
            return items
        heard = HeardMap()
        for node_id, at in items.items():
            heard = heard.set(node_id, at)
        return heard


@dataclass(frozen=True)
class BlockedNode:
    """A heartbeat in which every rank of the node was inside a collective: since when all of them were (the
    heartbeat's time less the shortest wait), and each rank's collective and wait."""

    generation: int
    heard_at: datetime
    since: datetime
    ranks: tuple[tuple[int, str, float], ...]
    """(rank, collective, seconds inside it when the heartbeat was sent)."""


def blocked_node(p: NodeHeartbeat, at: datetime) -> BlockedNode | None:
    """The heartbeat's evidence that the node is blocked, or None (a rank outside a collective, or none)."""
    if p.standby or p.generation is None or p.ranks_expected <= 0 or len(p.rank_collectives) < p.ranks_expected:
        return None
    waits = {rank: c.waited_s for rank, c in p.rank_collectives.items()}
    return BlockedNode(generation=p.generation, heard_at=at, since=at - timedelta(seconds=min(waits.values())),
                       ranks=tuple((rank, p.rank_collectives[rank].collective, waits[rank]) for rank in sorted(waits)))


@dataclass(frozen=True)
class NodeView:
    """One node as the job sees it (a worker or a standby): its newest generation only."""

    node_id: str
    standby: bool = False
    ranks: frozenset[int] = frozenset()
    """The ranks it runs in ``generation``, its newest."""
    ranks_before: frozenset[int] = frozenset()
    """The ranks it ran in the generation before ``generation``: a rank it starts again has not moved, so
    no other node can hold it (the fold need not look at every node)."""
    generation: int = -1
    evicted: bool = False
    eviction_pending: str | None = None
    """Id of an eviction decision not yet carried out."""
    cordoned: bool = False
    cordoned_by: str = ""
    checked: bool | None = None
    """A standby's self-check outcome (None: not reported yet; only a passing standby counts)."""
    promoting: bool = False
    heard_at: datetime | None = None
    """When the controller last heard from the node's agent, on its recorded clock: the tick after the
    agent's latest event (any event it produced). In a log of v1 ticks: its latest registration, rank
    start or heartbeat's own timestamp, as such logs were judged."""
    clock_skewed: bool = False
    """The node's clock is off the recorded clock by more than the allowance (``NodeClockSkewed``)."""
    skew_s: float = 0.0
    skew_sightings: int = 0
    """In how many confirmed windows in a row (of those the node was heard in) its newest timestamp lay beyond the
    allowance: + ahead, - behind, 0 within. A skew is reported at ``SKEW_SIGHTINGS`` (``rules.report_skews``):
    a clock that is off is off in every window, while one event that arrived late (an outbox that held it, a
    loop that stalled before sending it) is seen once."""
    fenced_by: str = ""
    """Id of the eviction decision that fenced the node out of the job ("" : not fenced). It holds whatever
    the actuator reports (a partitioned host cannot be drained): until the node offers itself back as a
    standby (a new agent registering with ``standby``), nothing it reports counts (``fenced``)."""
    fenced_generation: int = -1
    """The job's generation when the node was fenced: its ranks are of that generation or older."""
    fenced_incident: str = ""
    """The incident that evicted it (the correlation id of its ``NodeFenced``, so the timeline shows it)."""
    fence_reported: bool = False
    """A ``NodeFenced`` was recorded for this fence (once per fence, however often the node reports)."""
    addresses: tuple[str, ...] = ()
    """The IP addresses its host registered (``NodeRegistered.addresses``): how a peer's report of an
    unreachable address (``PeerReport``) names this node."""
    blocked: BlockedNode | None = None
    """Its newest heartbeat had every one of its ranks inside a collective (None otherwise)."""

    @property
    def fenced(self) -> bool:
        return bool(self.fenced_by)


PEER_UNREACHABLE_CHECK = "peer_unreachable"
"""The inspector's check for a peer address a rank's connections keep retransmitting to (``NodeHealthChanged``)."""


@dataclass(frozen=True)
class PeerReport:
    """A node's standing report that its ranks cannot reach ``address`` (a ``peer_unreachable`` health
    event, failed and not withdrawn by a healthy one since)."""

    reporter: str
    address: str
    at: datetime
    """When it was recorded, on the recorded clock (the latest tick before it arrived)."""
    detail: str = ""
    reporter_heard_at: datetime | None = None
    """When the reporter had last been heard before its report arrived (None: never): a report that arrives
    after a silence of its own comes from a node that was cut off itself (its queued events flushed once
    its link came back), and names peers that were never the problem."""


@dataclass(frozen=True)
class HeldPlan:
    """A recovery held back (waiting for an approval or a standby): what it does once it may."""

    rung: int
    evict: frozenset[str]
    reason: str
    rollback: bool = False


@dataclass(frozen=True)
class OpenIncident:
    """The job's incident in progress: what opened it, how far up the ladder it got, what it waits for."""

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
    stacks_nodes: frozenset[str] = frozenset()
    """The nodes the stack capture round asked (``StacksRequested.nodes``)."""
    stacks_acknowledged: frozenset[str] = frozenset()
    """Round nodes whose agent sent anything after the capture request, in log order (as
    ``diag_acknowledged``): agents answer the request with a heartbeat on receipt."""
    stepped_on: frozenset[str] = frozenset()
    """Nodes of the hung generation whose heartbeat, during the capture round, reported a step past
    ``last_step``: their collectives completed again (a stall that cleared itself)."""
    diag_nodes: frozenset[str] = frozenset()
    diag_results: Mapping[str, DiagnosticsCompleted] = field(default_factory=dict)
    diag_acknowledged: frozenset[str] = frozenset()
    """Round nodes whose agent sent anything after the request, in log order: an event that arrived before
    the request but is credited at the tick after it (the recorded clock) is no acknowledgement."""
    target_generation: int | None = None
    restore_step: int = -1
    started: frozenset[str] = frozenset()
    """Nodes that started ranks of ``target_generation``: only their heartbeats say it is stepping."""
    held: HeldPlan | None = None
    recovering_since: datetime | None = None
    """When the incident's latest restart was decided (its recovery deadline counts from here)."""
    approval_id: str = ""
    approval_expires_at: datetime | None = None
    """When the approval asked for runs out unanswered (then the held recovery is taken as denied)."""
    sdc_round: int | None = None
    sdc_requested_at: datetime | None = None
    sdc_replays: int = 0
    """Replay phases run for this incident so far."""
    code_change: str = ""
    """What the incident's restart did to the code ("" : nothing), for its resolution's reason."""
    processes_up: frozenset[str] = frozenset()
    """Nodes of ``target_generation`` whose latest heartbeat showed every rank alive and none reporting
    through the SDK (what resolves a job without the SDK)."""
    processes_up_since: datetime | None = None
    """Since when every rank of ``target_generation`` is known to run (``processes_up_at``): on the recorded
    clock the tick after the heartbeat that completed the set, else that heartbeat's timestamp."""
    processes_up_pending: bool = False
    """The set is complete and the next tick dates it (the recorded clock)."""


@dataclass(frozen=True)
class JobView:
    """Everything the controller knows about one job."""

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
    restarted_at: datetime | None = None
    """When the latest restart (``RestartDecided``) was decided: evidence gathered across it compares two
    generations (a fail-slow conviction's window must not span it)."""
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
    """The newest version hot-update found stable: rung 4's rollback target."""
    code_stables: tuple[str, ...] = ()
    """Every version hot-update found stable, oldest first: rung 4 rolls back to the newest that is not the
    code failing now."""
    code_rolled_back: frozenset[str] = frozenset()
    rollout_due: str = ""
    """Hot-update asked for a rollout that no restart has carried out yet."""
    sdk_seen: bool = False
    """A rank of the job reported through the SDK (a heartbeat with ``ranks_reporting`` above 0 or a step),
    or an agent older than heartbeat v4 said nothing about it: recovery is judged on steps. False: every
    heartbeat so far showed no rank reporting, and recovery is judged on process liveness (coarser)."""
    master_addr: str = ""
    """Where the ranks' rendezvous (``MASTER_ADDR``) moved to with node rank 0 (``master.moved_rendezvous``):
    every restart command carries it from then on. "": never moved (each node uses the one it launched with)."""
    clock_at: datetime | None = None
    """The job clock's latest tick (v2, ``TimerTicked.interval_s``): the controller's recorded time. None:
    no such tick yet, or a log of v1 ticks (then producers' timestamps are the time, as they were)."""
    clock_interval: timedelta = timedelta(seconds=1)
    clock_since: datetime | None = None
    """The first tick of the current unbroken run of ticks: the clock host was listening since then, so
    no node is judged silent over a gap (the host down, catching up, or not ticking the job)."""
    clock_allowance: timedelta = timedelta(seconds=5)
    """``ControllerPolicy.clock_skew_allowance``: also how much later than its interval a tick may come
    before the run of ticks counts as broken."""
    heard: Mapping[str, datetime] = field(default_factory=dict)
    """Nodes heard since the latest tick, with their newest timestamp: credited at the next tick."""
    skews: Mapping[str, float] = field(default_factory=dict)
    """The window before the one the latest tick closed, confirmed by it: each node heard in it and how far its
    newest timestamp lies outside the window (seconds; + ahead, - behind, 0 inside): what ``NodeClockSkewed``
    reports. Confirmed: the latest tick came in an unbroken run after the window's own, so that tick was not
    late (a tick sent late, e.g. from a partitioned clock host's socket once the link is back, lands behind
    events that arrived after its ``now`` and would make every node look that far ahead); else empty."""
    window_skews: Mapping[str, float] = field(default_factory=dict)
    """The same for the window the latest tick closed, not yet confirmed (``skews`` at the next tick)."""
    peer_reports: tuple[PeerReport, ...] = ()
    """Standing reports of peers the nodes' ranks cannot reach (``rules.peer_reported_lost_nodes``)."""

    @property
    def recorded_clock(self) -> bool:
        """Whether the job runs on the recorded clock (v2 ticks) rather than producers' timestamps."""
        return self.clock_at is not None

    @property
    def needs_clock(self) -> bool:
        """Whether the controller's rules depend on time for this job now (a running job's silent nodes,
        a round's deadline): the clock host then ticks it every interval."""
        if self.incident is not None and self.incident.stage in ("diagnosing", "capturing", "replaying"):
            return True
        # Asked on every decision (``ActionPlan.recorded_now``): the first running node answers, no sort.
        return not self.stopped and not self.finished and any(
            n.ranks and not n.evicted and not n.standby for n in self.nodes.values())

    def silence(self, node: NodeView, now: datetime) -> timedelta | None:
        """How long ``node`` has been silent at ``now`` (None: never heard). On the recorded clock only
        the time the clock host was listening counts (from ``clock_since``, the end of the latest gap)."""
        if node.heard_at is None:
            return None
        since = node.heard_at
        if self.clock_since is not None and self.clock_since > since:
            since = self.clock_since
        return now - since

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
        return sorted((n for n in self.nodes.values() if n.ranks and not n.evicted and not n.standby
                       and not n.fenced), key=lambda n: n.node_id)

    @property
    def ready_standbys(self) -> list[NodeView]:
        """Standbys that passed their self-check and are free to take over a node's ranks."""
        return sorted((n for n in self.nodes.values() if n.standby and n.checked and not n.evicted and not n.fenced
                       and not n.eviction_pending and not n.cordoned and not n.promoting), key=lambda n: n.node_id)


@dataclass(frozen=True)
class ControllerState:
    """The controller's whole state: one ``JobView`` per job id."""

    jobs: Mapping[str, JobView] = field(default_factory=dict)

    def job(self, job_id: str) -> JobView:
        return self.jobs.get(job_id, _EMPTY)

    def with_job(self, job_id: str, job: JobView) -> ControllerState:
        return ControllerState(jobs={**self.jobs, job_id: job})


_EMPTY = JobView()


def new_job(policy: ControllerPolicy) -> JobView:
    """A job seen for the first time, with the policy's guardrail limits."""
    return JobView(evictions=EvictionBreaker(policy.eviction_window, policy.max_evictions, policy.max_eviction_fraction),
                   crash_loop=CrashLoopBreaker(policy.restart_window, policy.restart_budget, policy.max_same_failure),
                   clock_allowance=policy.clock_skew_allowance)


# -- the fold ------------------------------------------------------------------------------------------


def evolve_job(job: JobView, event: Event) -> JobView:  # noqa: C901 - one branch per event type
    """``job`` after ``event`` (pure). Every event the controller sees goes through here: the inputs
    (registrations, heartbeats, rank starts...) and its own decisions, live and on a cold start alike."""
    p, at = event.payload, event.occurred_at
    if isinstance(p, TimerTicked):
        return _evolve_tick(job, p)
    legacy = job.clock_at is None
    if not legacy and event.producer == AGENT_PRODUCER:
        job = _heard(job, event)
    if event.producer == AGENT_PRODUCER or isinstance(p, (NodeHeartbeat, DiagnosticsCompleted)):
        job = _acknowledged(job, event)
    if job.first_seen_at is None and isinstance(p, (RankStarted, NodeRegistered, JobRegistered)):
        job = replace(job, first_seen_at=at)
    fenced = fenced_report(job, event)
    if fenced is not None and not (isinstance(p, NodeRegistered) and p.standby):
        # A fenced node's progress, rank starts and registration as a worker count for nothing (its
        # heartbeat's step would reset the crash-loop breaker; its registration would un-evict it).
        # ``rules.on_fenced`` records that it was ignored. A new agent registering there must be told.
        return job.with_node(replace(fenced, fence_reported=False)) if isinstance(p, NodeRegistered) else job
    if isinstance(p, JobRegistered):
        return replace(job, world_size=job.world_size or p.world_size)
    if isinstance(p, NodeRegistered):
        view = job.node(p.node_id)
        # A new agent: its predecessor's reports about peers are not its own, nor is the window its predecessor's
        # clock was last measured in.
        job = replace(job, peer_reports=tuple(r for r in job.peer_reports if r.reporter != p.node_id))
        if p.node_id in job.window_skews:
            job = replace(job, window_skews={k: v for k, v in job.window_skews.items() if k != p.node_id})
        # A node registering (again) is a new agent: a repaired or replacement machine, or a restarted
        # one. It holds no ranks until it starts some; a human's cordon stays until a human lifts it. Its
        # clock is judged afresh (the new agent learns its skew from a new ``NodeClockSkewed``).
        if p.standby and job.refills_pending:
            job = replace(job, refills_pending=job.refills_pending - 1)  # one of those asked for
        # A fenced node comes back only this way, as a standby (reaching here): its fence is lifted and it
        # counts for the pool once its self-check passes; its old ranks are gone.
        return job.with_node(replace(view, standby=p.standby, evicted=False, eviction_pending=None,
                                     promoting=False, checked=None if p.standby else view.checked,
                                     ranks=frozenset() if p.standby else view.ranks,
                                     ranks_before=frozenset() if p.standby else view.ranks_before,
                                     heard_at=at if legacy else view.heard_at, clock_skewed=False,
                                     skew_sightings=0,
                                     fenced_by="", fenced_generation=-1, fenced_incident="",
                                     fence_reported=False, addresses=tuple(p.addresses)))
    if isinstance(p, RankStarted):
        view = job.node(p.node_id)
        if p.generation < view.generation:
            return job
        if p.generation == view.generation:
            ranks, ranks_before = view.ranks | {p.rank}, view.ranks_before
        else:
            ranks, ranks_before = frozenset({p.rank}), view.ranks
        job = job.with_node(replace(view, ranks=frozenset(ranks), ranks_before=ranks_before, generation=p.generation,
                                    standby=False, promoting=False, heard_at=at if legacy else view.heard_at))
        # A rank moved here (a promotion) left its old node. A rank is held by at most one node of an older
        # generation (this branch keeps it so): when this node ran it already, nobody else does, and the
        # scan of every node (O(machines) per rank started) is only made for a rank that moved. In generation
        # 0 none has: an older generation's node would hold no ranks.
        if p.generation > 0 and p.rank not in view.ranks and p.rank not in ranks_before:
            for other in list(job.nodes.values()):
                if other.node_id != p.node_id and p.rank in other.ranks and other.generation < p.generation:
                    job = job.with_node(replace(other, ranks=other.ranks - {p.rank}))
        # A rank of the newest generation says the world size (smaller after a shrink); older ones say nothing.
        world_size = p.world_size if p.generation >= job.generation and p.world_size else job.world_size
        job = replace(job, generation=max(job.generation, p.generation), world_size=world_size)
        incident = job.incident
        if incident is not None and incident.stage == "observing" and incident.target_generation is None \
                and p.generation > incident.generation:
            # Restarted by someone else (observe mode, a human): watch that generation recover.
            incident = replace(incident, target_generation=p.generation)
        if incident is not None and incident.target_generation == p.generation:
            job = replace(job, incident=replace(incident, started=incident.started | {p.node_id}))
        return job
    if isinstance(p, NodeHeartbeat):
        if legacy:
            job = job.with_node(replace(job.node(p.node_id), heard_at=at))
        if p.node_id in job.nodes and (p.rank_collectives or job.node(p.node_id).blocked is not None):
            job = job.with_node(replace(job.node(p.node_id), blocked=blocked_node(p, at)))
        if not p.standby and not job.sdk_seen and (p.ranks_reporting is None or p.ranks_reporting > 0
                                                   or p.last_step >= 0):
            job = replace(job, sdk_seen=True)
        if not p.standby and job.incident is not None:
            job = _processes_heard(job, job.incident, p, at, legacy)
        if not p.standby and job.incident is not None:
            job = _stepped_on(job, job.incident, p)
        if p.standby or job.incident is not None:
            return job
        if p.generation is not None and p.generation < job.generation:
            return job  # ranks of a generation the job left (a node left behind): their steps are no progress
        # Past where it failed: no loop. A failure before any reported step (failed_at_step -1) is
        # passed by the first step reported after it.
        if p.last_step > job.failed_at_step and job.crash_loop.fingerprints:
            job = replace(job, crash_loop=job.crash_loop.progressed())
        return replace(job, last_step=max(job.last_step, p.last_step))
    if isinstance(p, NodeHealthChanged) and p.check == PEER_UNREACHABLE_CHECK:
        return _peer_report(job, p, at)
    if isinstance(p, StandbyChecked):
        return job.with_node(replace(job.node(p.node_id), checked=p.passed))
    if isinstance(p, NodeClockSkewed):
        if p.node_id not in job.nodes:
            return job
        return job.with_node(replace(job.node(p.node_id), clock_skewed=p.skewed, skew_s=p.skew_s))
    if isinstance(p, NodeCordoned):
        return job.with_node(replace(job.node(p.node_id), cordoned=p.cordoned, cordoned_by=p.by if p.cordoned else ""))
    if isinstance(p, NodeEvictionDecided):
        if p.observe_only:
            return job
        view = job.node(p.node_id)
        fence = {} if view.fenced else {"fenced_by": str(event.id), "fenced_generation": max(0, job.generation),
                                        "fenced_incident": str(event.correlation_id or ""), "fence_reported": False}
        return replace(job.with_node(replace(view, eviction_pending=str(event.id), **fence)),
                       evictions=job.evictions.record(at), node_failures=job.node_failures + 1)
    if isinstance(p, NodeFenced):
        return job.with_node(replace(job.node(p.node_id), fence_reported=True))
    if isinstance(p, NodeEvicted):
        view = job.node(p.node_id)
        # ``ranks`` stays: what the node ran is what a standby must take over (``active`` skips it).
        return job.with_node(replace(view, eviction_pending=None, evicted=view.evicted or p.outcome == "evicted"))
    if isinstance(p, StandbyPromotionRequested):
        return replace(job.with_node(replace(job.node(p.node_id), promoting=True)),
                       master_addr=p.master_addr or job.master_addr)
    if isinstance(p, StandbyPromoted):
        if p.outcome == "promoted":
            return job
        return job.with_node(replace(job.node(p.node_id), promoting=False, checked=False))
    if isinstance(p, RanksRestartRequested):
        return replace(job, generation=max(job.generation, p.generation), master_addr=p.master_addr or job.master_addr)
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
        if registration_problem(p.version_id, p.digest, p.path, p.entry):
            return job  # hot-update answers it with CodeVersionRejected; no restart may carry it
        ref = CodeRef(version_id=p.version_id, path=p.path, entry=list(p.entry), digest=p.digest)
        return replace(job, code_versions={**job.code_versions, p.version_id: ref}, code_pending=p.version_id)
    if isinstance(p, CodeVersionStable):
        stables = tuple(v for v in job.code_stables if v != p.version_id) + (p.version_id,)
        return replace(job, code_stable=p.version_id, code_stables=stables)
    if isinstance(p, CodeRolloutRequested):
        return replace(job, rollout_due=p.version_id)
    return _evolve_incident(job, event)

def processes_up(job: JobView, incident: OpenIncident) -> bool:
    """Whether every rank of the incident's restarted generation runs, as the heartbeats of a job without
    the SDK tell it: every active node started that generation and its latest heartbeat showed all its
    ranks alive, and the active nodes' ranks cover the job's world size (a promoted standby's too)."""
    target = incident.target_generation
    active = job.active
    if target is None or not active:
        return False
    ranks = frozenset().union(*(n.ranks for n in active))
    return (all(n.generation == target and n.node_id in incident.processes_up for n in active)
            and len(ranks) >= max(1, job.world_size))


def _processes_heard(job: JobView, incident: OpenIncident, p: NodeHeartbeat, at: datetime, legacy: bool) -> JobView:
    """A heartbeat during an incident, for a job without the SDK: whether the node's ranks of the
    restarted generation all run, and since when the whole generation does (``processes_up_since``)."""
    if incident.target_generation is None or p.generation != incident.target_generation \
            or p.node_id not in incident.started:
        return job
    alive = 0 < p.ranks_expected <= p.ranks_alive and p.ranks_reporting == 0
    nodes = incident.processes_up | {p.node_id} if alive else incident.processes_up - {p.node_id}
    incident = replace(incident, processes_up=nodes)
    if not alive:
        incident = replace(incident, processes_up_since=None, processes_up_pending=False)
    elif incident.processes_up_since is None and not incident.processes_up_pending \
            and processes_up(replace(job, incident=incident), incident):
        # On the recorded clock the heartbeat is credited at the next tick, as every arrival is.
        incident = replace(incident, processes_up_since=at) if legacy else replace(incident, processes_up_pending=True)
    return replace(job, incident=incident)


FENCED_INPUTS = frozenset({"NodeHeartbeat", "NodeRegistered", "RankStarted", "RankExited", "NodeHealthChanged",
                           "MetricAnomalyDetected", "DiagnosticsCompleted", "RanksRestarted", "StandbyChecked",
                           "StandbyPromoted", "StacksCaptured", "SdcReplayCompleted", "CheckpointRanksRegistered",
                           "CheckpointShardsStored", "CheckpointInventoryReported", "CodeVersionApplied"})
"""What a node's agent reports about its node or ranks: from a fenced node, each counts for nothing."""


def fenced_report(job: JobView, event: Event) -> NodeView | None:
    """The fenced node ``event`` is a report of, if it is one (pure): an agent's report (``FENCED_INPUTS``)
    about a node the controller decided to evict. None: not such a report."""
    if event.producer != AGENT_PRODUCER or event.type not in FENCED_INPUTS:
        return None
    node_id = _agent_node(event)
    view = job.nodes.get(node_id) if node_id else None
    return view if view is not None and view.fenced else None


def _agent_node(event: Event) -> str:
    """The node whose agent produced ``event`` ("" when it names none)."""
    node_id = getattr(event.payload, "node_id", None)
    if not isinstance(node_id, str) or not node_id:
        node_id = event.aggregate_id if event.aggregate_kind == "node" else ""
    return node_id


def _stepped_on(job: JobView, incident: OpenIncident, p: NodeHeartbeat) -> JobView:
    """A heartbeat during a hang's stack capture showing its node's ranks past the step the job had
    reached when the incident opened (same generation): that node stepped on."""
    if (incident.stage != "capturing" or p.node_id in incident.stepped_on or p.last_step <= incident.last_step
            or (p.generation is not None and p.generation != incident.generation)):
        return job
    return replace(job, incident=replace(incident, stepped_on=incident.stepped_on | {p.node_id}))


def _acknowledged(job: JobView, event: Event) -> JobView:
    """An agent's event during a diagnostics or stack capture round: its node has answered the request
    (log order)."""
    incident = job.incident
    if incident is None:
        return job
    node_id = _agent_node(event)
    if incident.stage == "diagnosing" and incident.diag_requested_at is not None:
        if node_id not in incident.diag_nodes or node_id in incident.diag_acknowledged:
            return job
        return replace(job, incident=replace(incident, diag_acknowledged=incident.diag_acknowledged | {node_id}))
    if incident.stage == "capturing" and incident.stacks_requested_at is not None:
        if node_id not in incident.stacks_nodes or node_id in incident.stacks_acknowledged:
            return job
        return replace(job, incident=replace(incident, stacks_acknowledged=incident.stacks_acknowledged | {node_id}))
    return job


def _peer_report(job: JobView, p: NodeHealthChanged, at: datetime) -> JobView:
    """A node reports a peer address unreachable (failed) or reachable again (anything else): its standing
    report about that address is replaced or withdrawn."""
    address = str(p.evidence.get("peer_address") or p.evidence.get("key") or "")
    if not address:
        return job
    kept = tuple(r for r in job.peer_reports if not (r.reporter == p.node_id and r.address == address))
    if p.status == "failed":
        kept += (PeerReport(p.node_id, address, job.clock_at or at, p.detail,
                            reporter_heard_at=job.node(p.node_id).heard_at),)
    return replace(job, peer_reports=kept)


def _heard(job: JobView, event: Event) -> JobView:
    """An event its node's agent produced: the node is heard now (credited at the next tick)."""
    node_id = _agent_node(event)
    if not node_id:
        return job
    seen = job.heard.get(node_id)
    if seen is not None and seen >= event.occurred_at:
        return job
    return replace(job, heard=HeardMap.of(job.heard).set(node_id, event.occurred_at))


def _evolve_tick(job: JobView, p: TimerTicked) -> JobView:
    """A tick of the job clock. A v2 tick is the recorded clock: every node heard since the previous tick
    is credited at this tick's ``now`` (its events arrived between the two), and how far their newest
    timestamps lie outside that window is kept for the skew report (made at the next tick, if that one comes in
    an unbroken run: ``JobView.skews``). A tick later than its interval plus
    the allowance after the previous one (or the first) starts a new unbroken run: silence is judged
    from there. A v1 tick (an old log) leaves the job on producers' timestamps."""
    if p.interval_s is None:
        if job.clock_at is None:
            return job
        return replace(job, clock_at=None, clock_since=None, heard={}, skews={}, window_skews={})
    now, interval = p.now, timedelta(seconds=p.interval_s)
    previous = job.clock_at
    unbroken = previous is not None and timedelta(0) <= now - previous <= interval + job.clock_allowance
    skews: dict[str, float] = {}
    nodes = dict(job.nodes)
    for node_id, newest in job.heard.items():
        if newest > now:
            skews[node_id] = (newest - now).total_seconds()
        elif previous is not None and newest < previous:
            skews[node_id] = (newest - previous).total_seconds()
        else:
            skews[node_id] = 0.0
        if node_id in nodes:
            nodes[node_id] = replace(nodes[node_id], heard_at=now)
    if unbroken:  # the window before this tick's is confirmed: count its sightings beyond the allowance
        allowance = job.clock_allowance.total_seconds()
        for node_id, skew in job.window_skews.items():
            view = nodes.get(node_id)
            if view is not None:
                sightings = next_skew_sightings(view.skew_sightings, skew, allowance)
                if sightings != view.skew_sightings:
                    nodes[node_id] = replace(view, skew_sightings=sightings)
    else:  # a gap: windows on either side of it are not "in a row" (late events cluster around partitions)
        for node_id, view in job.nodes.items():
            if view.skew_sightings:
                nodes[node_id] = replace(nodes[node_id], skew_sightings=0)
    incident = job.incident
    if incident is not None and previous is not None and not unbroken and now - previous > interval:
        incident = past_gap(incident, now - previous - interval)
    if incident is not None and incident.processes_up_pending:
        incident = replace(incident, processes_up_since=now, processes_up_pending=False)
    return replace(job, nodes=nodes, clock_at=now, clock_interval=interval, incident=incident,
                   clock_since=job.clock_since if unbroken else now, heard={},
                   skews=job.window_skews if unbroken else {}, window_skews=skews)


def next_skew_sightings(sightings: int, skew_s: float, allowance_s: float) -> int:
    """``NodeView.skew_sightings`` after a confirmed window in which the node's newest timestamp lay ``skew_s``
    outside it (pure): one more in the same direction beyond ``allowance_s``, a new count on a change of
    direction, 0 within."""
    if skew_s > allowance_s:
        return max(sightings, 0) + 1
    if skew_s < -allowance_s:
        return min(sightings, 0) - 1
    return 0


def past_gap(incident: OpenIncident, gap: timedelta) -> OpenIncident:
    """``incident`` with its deadlines moved ``gap`` later: the time the clock host was not listening (cut off
    from NATS, down, catching up) counts against no deadline, as it counts toward no node's silence. Without
    this, what the controller decides while it works off a backlog is stamped with its last tick before the
    gap, and the first tick after it would find every round it just asked for long overdue (the agents'
    answers not yet in) and conclude it on nodes that never had the time to answer. Commands keep their
    expiry (``command_ttl`` is minutes; an agent checks it on its own clock)."""

    def later(at: datetime | None) -> datetime | None:
        return None if at is None else at + gap

    return replace(incident, diag_deadline=later(incident.diag_deadline),
                   diag_requested_at=later(incident.diag_requested_at),
                   stacks_requested_at=later(incident.stacks_requested_at),
                   sdc_requested_at=later(incident.sdc_requested_at),
                   recovering_since=later(incident.recovering_since),
                   processes_up_since=later(incident.processes_up_since))


def _evolve_incident(job: JobView, event: Event) -> JobView:
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
                                             stacks_round=p.round, stacks_requested_at=at,
                                             stacks_nodes=frozenset(p.nodes), stacks_acknowledged=frozenset()))
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
            diag_results={}, diag_acknowledged=frozenset()))
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
        return replace(job, generation=max(job.generation, p.generation), crash_loop=crash_loop, restarted_at=at,
                       world_size=p.world_size or job.world_size,
                       incident=replace(incident, stage="recovering", rung=max(incident.rung, p.rung),
                                        target_generation=p.generation, started=frozenset(), restore_step=-1,
                                        held=None, code_change=code_change, recovering_since=at,
                                        processes_up=frozenset(), processes_up_since=None,
                                        processes_up_pending=False))
    if isinstance(p, ActionHeld):
        held = HeldPlan(p.rung, frozenset(p.evict), p.reason, p.rollback)
        stage: Stage = {"approval": "awaiting_approval", "no_standby": "waiting_standby"}.get(  # type: ignore[assignment]
            p.guardrail, "observing")
        return replace(job, incident=replace(incident, stage=stage, held=held, rung=max(incident.rung, p.rung)))
    if isinstance(p, ApprovalRequested):
        return replace(job, incident=replace(incident, approval_id=str(event.id), approval_expires_at=p.expires_at))
    return job
