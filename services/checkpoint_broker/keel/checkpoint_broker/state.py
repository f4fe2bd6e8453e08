"""The checkpoint broker's state and its fold: what the event log says about each job, and nothing else.

Per job (``JobState``): the ranks' registrations (``RankSite``: node and parallel groups) and the nodes'
shard store addresses, the backup assignments and the peers that failed them, the shards stored per
tier and step until that step commits, the committed steps, the disk commits awaiting their manifest
(``DiskCommit``, the adapter's job) and the persisted steps (``PersistedStep``), what the schedule is
derived from (``ScheduleState``: step times, transfer times, save cost, failures), the restores waiting
for inventories (``RestoreWait``) and the step limit an anomaly sets on restore plans.

``fold`` is the decider's ``evolve``: pure (no I/O, no clock, no randomness), so a replay of the log
rebuilds the same state. ``BrokerPolicy`` holds the settings that the fold and the decisions share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from keel.events.envelope import Event
from keel.events.types import (
    BackupAssignment,
    CheckpointBackupAssigned,
    CheckpointBackupFailed,
    CheckpointInventoryReported,
    CheckpointNodeBackupsAssigned,
    CheckpointPersisted,
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    CheckpointScheduleSet,
    CheckpointShardsStored,
    CheckpointStepCommitted,
    JobRegistered,
    MetricAnomalyDetected,
    NodeEvicted,
    NodeEvictionDecided,
    NodeHeartbeat,
    RankExited,
    RankGroups,
    RankStarted,
    ShardRecord,
    TimerTicked,
)

if TYPE_CHECKING:
    # Annotation only: the settings model, read once by ``BrokerPolicy.from_settings``.
    from keel.infra.config import CheckpointSettings

FAILURE_CLASSES = frozenset({"user_code", "infrastructure", "unknown"})
"""``RankExited`` classifications that interrupt the job (a restart follows): they count for the MTBF."""
MAX_PENDING_STEPS = 32
"""Uncommitted steps remembered per tier (older ones can no longer become the newest commit)."""
MAX_OWNER_STEPS = 64
"""Steps per rank whose owner-reported digests are remembered (``JobState.owner_digests``)."""

FOLDED = frozenset({
    # The decider's inputs (keel.checkpoint_broker.decider.INPUTS): every one of them is folded too.
    CheckpointRanksRegistered.event_name, CheckpointBackupFailed.event_name, CheckpointShardsStored.event_name,
    CheckpointInventoryReported.event_name, CheckpointPersisted.event_name, NodeHeartbeat.event_name,
    RankExited.event_name, RankStarted.event_name, NodeEvictionDecided.event_name, NodeEvicted.event_name,
    TimerTicked.event_name,
    # Learnt from, never decided on: the job's size, the broker's own decisions and the analyzer's anomalies.
    # CheckpointBackupAssigned: the job-wide placement of logs written before per-node parts.
    JobRegistered.event_name, CheckpointBackupAssigned.event_name, CheckpointNodeBackupsAssigned.event_name,
    CheckpointStepCommitted.event_name,
    CheckpointScheduleSet.event_name, CheckpointRestorePlanned.event_name, MetricAnomalyDetected.event_name,
})
"""Event types ``fold`` learns from; any other leaves the state unchanged."""


# -- the state ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankSite:
    """A rank, the node that runs it and its parallel groups (global ranks, the rank included).

    ``shard``: the ranks across which its state is sharded (FSDP2 / ZeRO; empty when nothing is): unlike DP
    replicas, they hold other parts of the state, so placement treats them like PP and TP peers."""

    rank: int
    node_id: str
    dp: tuple[int, ...] = ()
    pp: tuple[int, ...] = ()
    tp: tuple[int, ...] = ()
    shard: tuple[int, ...] = ()

    @classmethod
    def from_groups(cls, groups: RankGroups, node_id: str) -> RankSite:
        # Sorted and deduplicated: the members of one group then describe it by one equal tuple.
        return cls(groups.rank, node_id,
                   *(tuple(sorted(set(g))) for g in (groups.dp, groups.pp, groups.tp, groups.shard_group)))


@dataclass(frozen=True)
class PersistedStep:
    """A step on the persistent tier (its manifest written): each rank's shard digest and size."""

    step: int
    manifest_path: str
    shards: Mapping[int, ShardRecord] = field(default_factory=dict)

    def shard_path(self, rank: int) -> str:
        # The layout of keel.checkpoint.disk: the shards sit next to the manifest.
        return str(PurePosixPath(self.manifest_path).parent / f"rank-{rank:05d}.shard")


@dataclass(frozen=True)
class DiskCommit:
    """A step whose every shard is on the persistent tier, awaiting its manifest (the adapter's job)."""

    step: int
    commit_id: str  # id of the CheckpointStepCommitted event (the manifest's cause)
    committed_at: datetime
    first_reported_at: datetime
    shards: Mapping[int, ShardRecord]

    @property
    def save_cost_s(self) -> float:
        """The slowest node's write time; without measurements, the spread of the nodes' reports."""
        measured = max((s.write_s for s in self.shards.values()), default=0.0)
        return measured if measured > 0 else max(0.0, (self.committed_at - self.first_reported_at).total_seconds())


@dataclass(frozen=True)
class ScheduleState:
    """What the schedule is derived from (``keel.checkpoint_broker.schedule``), and what it last announced."""

    every_k: int | None = None  # the K last emitted
    backup_every: int | None = None  # the backup interval last emitted
    send_s: Mapping[int, float] = field(default_factory=dict)  # rank -> latest backup transfer time, s
    save_cost_s: float | None = None  # EWMA of measured save costs
    measurements: int = 0
    failures: frozenset[int] = frozenset()  # generations in which the job was interrupted
    step_times: Mapping[str, float] = field(default_factory=dict)  # node -> latest p50 step time, s
    started_at: datetime | None = None
    announced_at: datetime | None = None  # when the schedule in force was announced (its event's time)


@dataclass(frozen=True)
class RestoreWait:
    """Inventories arriving for a restart as ``generation``; planned when complete or at ``deadline``."""

    generation: int
    deadline: datetime
    inventories: Mapping[str, CheckpointInventoryReported] = field(default_factory=dict)


@dataclass(frozen=True)
class JobState:
    """One job as the broker knows it from the log."""

    world_size: int = 0
    generation: int = 0  # the newest generation seen
    sites: Mapping[int, RankSite] = field(default_factory=dict)  # rank -> latest registration
    site_generation: Mapping[int, int] = field(default_factory=dict)
    addresses: Mapping[str, str] = field(default_factory=dict)  # node -> shard store address
    left: frozenset[str] = frozenset()  # evicted (or being evicted) nodes
    left_at: Mapping[str, int] = field(default_factory=dict)
    """Each node that left: the job's generation then. Until it registers ranks of a newer generation (a
    standby taken back into the job) it is fenced: its reports count for nothing (``fenced_report``)."""
    backups: Mapping[int, BackupAssignment] = field(default_factory=dict)
    avoid: Mapping[int, frozenset[str]] = field(default_factory=dict)  # rank -> failed backup peers
    shards: Mapping[str, Mapping[int, Mapping[int, ShardRecord]]] = field(default_factory=dict)  # tier, step, rank
    disk_first_seen: Mapping[int, datetime] = field(default_factory=dict)
    committed: Mapping[str, int] = field(default_factory=dict)  # tier -> newest committed step
    committed_at: Mapping[str, datetime] = field(default_factory=dict)  # tier -> log time of that commit
    disk_commits: Mapping[int, DiskCommit] = field(default_factory=dict)
    persisted: Mapping[int, PersistedStep] = field(default_factory=dict)  # the newest ``retention`` steps
    schedule: ScheduleState = ScheduleState()
    started_generation: int = -1
    started: Mapping[int, str] = field(default_factory=dict)  # rank -> node, from RankStarted of started_generation
    restores: Mapping[int, RestoreWait] = field(default_factory=dict)
    planned: frozenset[int] = frozenset()
    restore_below: int | None = None
    """Restore plans take a step below this one: a NaN or a spike appeared at it, so its snapshot and
    every later one may hold corrupted state. It holds for every plan until the resumed history commits a
    step at or past it (a rung-5 replay restores once and the restart after it again)."""
    restore_below_reason: str = ""
    restore_below_planned: bool = False
    """A plan honoured ``restore_below``: from now on a memory or peer commit past it clears it."""
    owner_digests: Mapping[int, Mapping[int, frozenset[str]]] = field(default_factory=dict)
    """rank -> step -> the digests the rank's own node reported for its snapshot of that step (its memory
    records on heartbeats and shard reports, its inventories' memory entries), the newest
    ``MAX_OWNER_STEPS`` steps. Restore plans trust a copy held anywhere only when its digest is one of
    these: a backup's holder says what it holds, never what the rank wrote. A restore plan to step P
    forgets the steps after P (the resumed history writes them anew)."""
    clock_at: datetime | None = None
    """The job clock's latest v2 tick (``TimerTicked.interval_s``): the recorded clock, by which the broker
    dates what arrives (``received_at``). None (no such tick yet, or a log of v1 ticks): producers' timestamps."""

    @property
    def all_registered(self) -> bool:
        return self.world_size > 0 and all(r in self.sites for r in range(self.world_size))

    def pending_manifests(self) -> list[DiskCommit]:
        """Disk-committed steps without a ``CheckpointPersisted`` yet, oldest first."""
        return [c for s, c in sorted(self.disk_commits.items()) if s not in self.persisted]

    def backup_candidates(self) -> dict[str, str]:
        """Live nodes running ranks, with their shard store address: where backups may go."""
        hosting = {site.node_id for site in self.sites.values()}
        return {n: a for n, a in self.addresses.items() if n in hosting and n not in self.left and a}


@dataclass(frozen=True)
class BrokerState:
    """Every job the broker has seen, by job id."""

    jobs: Mapping[str, JobState] = field(default_factory=dict)

    def job(self, job_id: str) -> JobState:
        return self.jobs.get(job_id, _EMPTY_JOB)

    def with_job(self, job_id: str, job: JobState) -> BrokerState:
        return BrokerState(jobs={**self.jobs, job_id: job})


_EMPTY_JOB = JobState()


@dataclass(frozen=True)
class BrokerPolicy:
    """The broker's settings (``keel.infra.config.CheckpointSettings``), shared by the fold and the decisions."""

    persist_every_floor: int = 10  # steps
    persist_every_ceiling: int = 1000  # steps
    initial_save_cost: timedelta = timedelta(seconds=5)
    mtbf_prior: timedelta = timedelta(hours=4)
    restore_plan_timeout: timedelta = timedelta(seconds=10)
    restore_plan_max_wait: timedelta = timedelta(seconds=60)
    """The longest wait for inventories when planning after ``restore_plan_timeout`` would lose committed
    steps (``keel.checkpoint_broker.restore.decide_restore``)."""
    retention: int = 3  # persisted steps kept
    save_cost_weight: float = 0.3
    """EWMA weight of the newest save-cost measurement."""
    backup_max_duty: float = 0.1
    """The share of wall time one rank's backup transfer may take (sets the backup interval)."""
    backup_min_period: timedelta = timedelta(seconds=0.5)
    """The shortest time between two backup rounds (sets the backup interval's floor)."""
    schedule_hysteresis: float = 0.2
    """A new K is announced only when it differs from the current one by this fraction (at least 1 step):
    the step time jitters every heartbeat, and agents need not hear every rounding flip (Young's optimum
    is flat: a K 20 % off wastes about 2 % more than the optimum)."""
    commit_min_period: timedelta = timedelta(seconds=10)
    """Heartbeat-carried reports (``NodeHeartbeat.stored``) commit a memory or peer step at most once per
    this period per tier (by the log's time): report rounds come every 5-10 s, and a commit every other
    round is enough to pin a recent step (restores plan from inventories, not from commits). The first
    commit after a restore plan is never held back. Shard-report events (older logs) commit as before."""
    schedule_min_period: timedelta = timedelta(seconds=60)
    """A schedule is announced at most once per this period (by the log's time), unless the backup
    interval in force must go coarser (its transfers exceed the duty past the margin): a job whose step
    time swings keeps one schedule a minute, not one per heartbeat."""

    part_budget_bytes: int = 64 * 1024
    """The most entry bytes in one per-node part of a plan or a placement (``keel.checkpoint_broker.parts``)."""

    @classmethod
    def from_settings(cls, settings: CheckpointSettings, *, max_event_bytes: int | None = None) -> BrokerPolicy:
        """``max_event_bytes``: the bus's event limit; parts then hold at most a quarter of it in entries
        (and never more than 64 KiB), leaving room for the envelope and the reason."""
        budget = 64 * 1024 if max_event_bytes is None else max(1024, min(64 * 1024, int(max_event_bytes) // 4))
        return cls(
            part_budget_bytes=budget,
            persist_every_floor=settings.persist_every_floor,
            persist_every_ceiling=settings.persist_every_ceiling,
            initial_save_cost=settings.initial_save_cost,
            mtbf_prior=settings.mtbf_prior,
            restore_plan_timeout=settings.restore_plan_timeout,
            restore_plan_max_wait=settings.restore_plan_max_wait,
            retention=settings.retention,
            backup_max_duty=settings.backup_max_duty,
            backup_min_period=settings.backup_min_period,
        )


# -- the fold ---------------------------------------------------------------------------------------


def received_at(job: JobState, event: Event) -> datetime:
    """When ``event`` counts as having happened for the broker: a tick's ``now``; else the job's recorded
    clock (the latest v2 tick: the event arrived after it), never a producer's own timestamp - a node
    whose clock is 10 minutes off neither ends a restore plan's wait at once nor stretches it. Before any
    v2 tick (and in logs of v1 ticks) the event's ``occurred_at``, as such logs were decided."""
    p = event.payload
    if isinstance(p, TimerTicked):
        return p.now
    return job.clock_at if job.clock_at is not None else event.occurred_at


def fold(state: BrokerState, event: Event, policy: BrokerPolicy) -> BrokerState:
    """``state`` after ``event``: the decider's ``evolve``. Pure; events of other types leave it as is."""
    if event.type not in FOLDED:
        return state  # health reports and the like: the bulk of the log, nothing to learn here
    job = state.job(event.job_id)
    if job.schedule.started_at is None:
        job = replace(job, schedule=replace(job.schedule, started_at=received_at(job, event)))
    updated = _evolve_job(job, event, policy)
    return state.with_job(event.job_id, updated)


def fenced_report(job: JobState, p: object) -> str:
    """Why the broker ignores node report ``p`` ("" : it does not). A node evicted (``left``) may come back
    with its old agent (a host back after a partition): what it holds is of a history the job left, so its
    shard reports (heartbeats, disk reports) and inventories commit and plan nothing, and its ranks'
    registrations of the generation it left (or older) do not make it a backup candidate again. Its
    registrations and inventories of a newer generation count: it was taken back into the job."""
    node_id = getattr(p, "node_id", "")
    if node_id not in job.left:
        return ""
    left_at = job.left_at.get(node_id, job.generation)
    if isinstance(p, (CheckpointRanksRegistered, CheckpointInventoryReported)) and p.generation > left_at:
        # A node taken back into the job (a standby, or a replacement under the same id) restarting as a
        # newer generation: what it holds now is of the history the job goes on with.
        return ""
    if isinstance(p, (NodeHeartbeat, CheckpointShardsStored, CheckpointInventoryReported, CheckpointRanksRegistered)):
        return (f"{node_id} left the job at generation {left_at} (evicted): its {type(p).__name__} is ignored "
                f"(a fenced node's shards commit and restore nothing)")
    return ""


def _evolve_job(job: JobState, event: Event, policy: BrokerPolicy) -> JobState:
    p = event.payload
    if fenced_report(job, p):
        return job
    if isinstance(p, TimerTicked):
        clock_at = p.now if p.interval_s is not None else None
        return job if clock_at == job.clock_at else replace(job, clock_at=clock_at)
    if isinstance(p, JobRegistered):
        return replace(job, world_size=job.world_size or p.world_size)
    if isinstance(p, CheckpointRanksRegistered):
        sites, gens = dict(job.sites), dict(job.site_generation)
        for groups in p.ranks:
            if gens.get(groups.rank, -1) <= p.generation:
                sites[groups.rank] = RankSite.from_groups(groups, p.node_id)
                gens[groups.rank] = p.generation
        # A registration is proof of life: the node is a candidate again, for every rank.
        avoid = {r: nodes - {p.node_id} for r, nodes in job.avoid.items() if nodes - {p.node_id}}
        if p.generation >= job.generation and 0 < p.world_size < job.world_size:
            # The job shrank (a restart onto fewer nodes): the ranks past its new size exist no more.
            sites = {r: s for r, s in sites.items() if r < p.world_size}
            gens = {r: g for r, g in gens.items() if r < p.world_size}
        return replace(job, world_size=p.world_size if p.generation >= job.generation else job.world_size,
                       generation=max(job.generation, p.generation), sites=sites, site_generation=gens,
                       addresses={**job.addresses, p.node_id: p.store_address}, left=job.left - {p.node_id},
                       left_at={n: g for n, g in job.left_at.items() if n != p.node_id}, avoid=avoid)
    if isinstance(p, (CheckpointBackupAssigned, CheckpointNodeBackupsAssigned)):
        return replace(job, backups={**job.backups, **{a.rank: a for a in p.assignments}})
    if isinstance(p, CheckpointBackupFailed):
        current = job.backups.get(p.rank)
        if current is None or current.backup_node_id != p.backup_node_id:
            return job  # about an assignment already replaced
        failed = job.avoid.get(p.rank, frozenset()) | {p.backup_node_id}
        return replace(job, avoid={**job.avoid, p.rank: failed})
    if isinstance(p, NodeEvictionDecided):
        if p.observe_only:
            return job
        failures = job.schedule.failures | {job.generation}
        return _without_node(replace(job, schedule=replace(job.schedule, failures=failures)), p.node_id)
    if isinstance(p, NodeEvicted):
        return _without_node(job, p.node_id) if p.outcome == "evicted" else job
    if isinstance(p, RankExited):
        if p.classification not in FAILURE_CLASSES:
            return job
        return replace(job, schedule=replace(job.schedule, failures=job.schedule.failures | {p.generation}))
    if isinstance(p, RankStarted):
        if p.generation < job.started_generation:
            return job
        started = dict(job.started) if p.generation == job.started_generation else {}
        started[p.rank] = p.node_id
        return replace(job, generation=max(job.generation, p.generation), started_generation=p.generation,
                       started=started, world_size=job.world_size or p.world_size)
    if isinstance(p, NodeHeartbeat):
        # Since v3 the heartbeat carries the node's memory and peer holdings: folded as the
        # ``CheckpointShardsStored`` events older agents sent for them (older logs fold those).
        for report in heartbeat_reports(p):
            job = _evolve_stored(job, report, event.occurred_at)
        if p.standby or not p.step_time_p50_s or p.step_time_p50_s <= 0:
            return job
        times = {**job.schedule.step_times, p.node_id: p.step_time_p50_s}
        return replace(job, schedule=replace(job.schedule, step_times=times))
    if isinstance(p, CheckpointShardsStored):
        return _evolve_stored(job, p, event.occurred_at)
    if isinstance(p, CheckpointStepCommitted):
        return _evolve_commit(job, p, event)
    if isinstance(p, CheckpointScheduleSet):
        return replace(job, schedule=replace(job.schedule, every_k=p.every_k_steps,
                                             backup_every=p.backup_every_k_steps,
                                             # The placeholder before any step time (0) is replaced at once.
                                             announced_at=event.occurred_at if p.step_time_s > 0 else None))
    if isinstance(p, CheckpointPersisted):
        return _evolve_persisted(job, p, policy)
    if isinstance(p, CheckpointInventoryReported):
        job = _note_owner_digests(job, p.node_id, [(e.rank, e.step, e.digest) for e in p.entries if e.tier == "memory"])
        if job.planned and p.generation <= max(job.planned):
            return job  # that restart (or a newer one) is planned already: a late report
        wait = job.restores.get(p.generation) or RestoreWait(
            p.generation, received_at(job, event) + policy.restore_plan_timeout)
        wait = replace(wait, inventories={**wait.inventories, p.node_id: p})
        return replace(job, restores={**job.restores, p.generation: wait},
                       generation=max(job.generation, p.generation))
    if isinstance(p, MetricAnomalyDetected):
        if p.kind == "decline" or p.generation < job.generation:
            return job
        if job.restore_below is not None and job.restore_below <= p.step:
            # The resumed history went bad again at or past the limit: it is not past it, so a commit
            # of it must not lift the limit (the next plan still goes below the first anomaly).
            return replace(job, restore_below_planned=False) if job.restore_below_planned else job
        return replace(job, restore_below=p.step, restore_below_planned=False,
                       restore_below_reason=f"{p.kind.replace('_', '-')} {p.metric} at step {p.step} "
                                            f"(rank {p.rank} on {p.node_id})")
    if isinstance(p, CheckpointRestorePlanned):
        # The resumed generation re-runs the steps after p.step: their memory and peer copies are new,
        # so those tiers commit again from there (agents wait for a commit before their next backup
        # round). p.step itself too: the first round after the restore is often the restored step
        # (a multiple of the backup interval). Shards still pending belong to the history left.
        rewound = {tier: step for tier, step in job.committed.items()}
        for tier in ("memory", "peer"):
            if tier in rewound:
                rewound[tier] = min(rewound[tier], p.step - 1)
        shards = {tier: by_step for tier, by_step in job.shards.items() if tier not in ("memory", "peer")}
        owners = {rank: {s: d for s, d in by_step.items() if s <= p.step} for rank, by_step in job.owner_digests.items()}
        return replace(job, planned=job.planned | {p.generation}, committed=rewound, shards=shards,
                       owner_digests={rank: by_step for rank, by_step in owners.items() if by_step},
                       committed_at={t: at for t, at in job.committed_at.items() if t not in ("memory", "peer")},
                       restores={g: w for g, w in job.restores.items() if g > p.generation},
                       restore_below_planned=job.restore_below is not None)
    return job


def heartbeat_reports(p: NodeHeartbeat) -> list[CheckpointShardsStored]:
    """The shard reports a heartbeat carries (``NodeHeartbeat.stored``), one per tier with shards, in a
    fixed order: the fold and the commit decision treat each as a ``CheckpointShardsStored``."""
    return [CheckpointShardsStored(node_id=p.node_id, tier=tier, shards=p.stored[tier])
            for tier in ("memory", "peer", "disk") if p.stored.get(tier)]


def _note_owner_digests(job: JobState, node_id: str, records: list[tuple[int, int, str]]) -> JobState:
    """Remember the digests ``node_id`` reported for the snapshots of the ranks registered to it (a node's
    report about another node's rank is not the owner's word, and is ignored)."""
    owned = [(rank, step, digest) for rank, step, digest in records
             if (site := job.sites.get(rank)) is not None and site.node_id == node_id]
    if not owned:
        return job
    digests = dict(job.owner_digests)
    for rank, step, digest in owned:
        by_step = dict(digests.get(rank, {}))
        known = by_step.get(step, frozenset())
        if digest in known:
            continue
        by_step[step] = known | {digest}
        digests[rank] = {s: by_step[s] for s in sorted(by_step)[-MAX_OWNER_STEPS:]}
    return replace(job, owner_digests=digests)


def _evolve_stored(job: JobState, p: CheckpointShardsStored, at: datetime) -> JobState:
    if p.tier == "memory":
        job = _note_owner_digests(job, p.node_id, [(r.rank, r.step, r.digest) for r in p.shards])
    sends = {r.rank: r.send_s for r in p.shards if p.tier == "memory" and r.send_s > 0}
    if sends:
        job = replace(job, schedule=replace(job.schedule, send_s={**job.schedule.send_s, **sends}))
    return _evolve_shards(job, p, at)


def _evolve_shards(job: JobState, p: CheckpointShardsStored, at: datetime) -> JobState:
    committed = job.committed.get(p.tier, -1)
    by_step = dict(job.shards.get(p.tier, {}))
    first_seen = dict(job.disk_first_seen)
    for record in p.shards:
        if record.step <= committed:
            continue
        if p.tier == "peer":
            # A backup counts only when held away from the rank: by a node other than its owner's.
            owner = record.owner_node_id or (job.sites[record.rank].node_id if record.rank in job.sites else "")
            if not owner or owner == p.node_id:
                continue
        by_step[record.step] = {**by_step.get(record.step, {}), record.rank: record}
        if p.tier == "disk":
            first_seen.setdefault(record.step, at)
    for step in sorted(by_step)[:-MAX_PENDING_STEPS]:
        del by_step[step]
    return replace(job, shards={**job.shards, p.tier: by_step},
                   disk_first_seen={s: t for s, t in first_seen.items() if s in by_step})


def _evolve_commit(job: JobState, p: CheckpointStepCommitted, event: Event) -> JobState:
    by_step = job.shards.get(p.tier, {})
    job = replace(job, committed={**job.committed, p.tier: max(p.step, job.committed.get(p.tier, -1))},
                  committed_at={**job.committed_at, p.tier: event.occurred_at},
                  shards={**job.shards, p.tier: {s: r for s, r in by_step.items() if s > p.step}})
    if (job.restore_below is not None and job.restore_below_planned and p.tier != "disk"
            and p.step >= job.restore_below):
        # The resumed history stepped past the anomaly: its steps there are new, not the corrupted ones.
        job = replace(job, restore_below=None, restore_below_reason="", restore_below_planned=False)
    if p.tier != "disk":
        return job
    commit = DiskCommit(step=p.step, commit_id=str(event.id), committed_at=event.occurred_at,
                        first_reported_at=job.disk_first_seen.get(p.step, event.occurred_at),
                        shards=dict(by_step.get(p.step, {})))
    return replace(job, disk_commits={**job.disk_commits, p.step: commit},
                   disk_first_seen={s: t for s, t in job.disk_first_seen.items() if s > p.step})


def _evolve_persisted(job: JobState, p: CheckpointPersisted, policy: BrokerPolicy) -> JobState:
    commit = job.disk_commits.get(p.step)
    records = commit.shards if commit is not None else job.shards.get("disk", {}).get(p.step, {})
    persisted = {**job.persisted, p.step: PersistedStep(p.step, p.path, dict(records))}
    kept = sorted(persisted)[-policy.retention:]
    schedule = job.schedule
    weight = policy.save_cost_weight
    cost = p.save_cost_s if schedule.save_cost_s is None else schedule.save_cost_s + weight * (
        p.save_cost_s - schedule.save_cost_s)
    return replace(job, persisted={s: persisted[s] for s in kept},
                   disk_commits={s: c for s, c in job.disk_commits.items() if s > p.step},
                   schedule=replace(schedule, save_cost_s=cost, measurements=schedule.measurements + 1))


def _without_node(job: JobState, node_id: str) -> JobState:
    """A node leaves: no more backups on it, and its step time no longer sets the job's pace."""
    times = {n: t for n, t in job.schedule.step_times.items() if n != node_id}
    left_at = job.left_at if node_id in job.left else {**job.left_at, node_id: job.generation}
    return replace(job, left=job.left | {node_id}, left_at=left_at, schedule=replace(job.schedule, step_times=times))
