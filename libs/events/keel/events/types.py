"""Every Keel event type, in one module, named in the past tense.

Adding a type: define a frozen payload model here, register it with ``@event_type``, add a golden
fixture under ``tests/golden/<Type>/v<N>.json`` and regenerate the catalogue (``keel events schema
--write``). Changing a payload's shape: bump its version, keep the old shape as a golden fixture and add
an ``@upcaster`` from the old version. Never change a released version in place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from keel.events.envelope import Event, EventPayload, EventTime, event_type, upcaster

Confidence = Literal["low", "medium", "high"]
HealthStatus = Literal["healthy", "degraded", "failed"]


@event_type("JobRegistered", version=1, aggregate="job")
class JobRegistered(EventPayload):
    """A training job became known to Keel with its initial node set."""

    nodes: list[str] = Field(min_length=1)
    world_size: int = Field(ge=1)
    registered_by: str


@event_type("NodeRegistered", version=2, aggregate="node")
class NodeRegistered(EventPayload):
    """A node agent announced itself (an active node of the job, or an idle warm standby). Since v2 it
    says which network addresses the node's host has (``addresses``): a peer that reports one of them as
    unreachable (the inspector's ``peer_unreachable``) names this node."""

    node_id: str
    host: str
    standby: bool = False
    fault_domain: str = ""
    addresses: list[str] = Field(default_factory=list)
    """The IP addresses of the host's interfaces, loopback excluded (empty: unknown, or an agent older
    than v2; such a node is never named by a peer's report)."""


@upcaster("NodeRegistered", from_version=1)
def _node_registered_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 did not say where the node's host is: no address, so no peer's report can name it.
    return {**payload, "addresses": []}


@event_type("NodeHealthChanged", version=2, aggregate="node")
class NodeHealthChanged(EventPayload):
    """The inspector's verdict on one node changed (state changes only, never every sample).

    v1 carried a single ``healthy`` flag; v2 says which component and check, how sure it is, and
    whether the fault is fatal (a high-confidence fatal fault is rung 1 of the ladder).
    """

    node_id: str
    status: HealthStatus
    component: Literal["gpu", "host", "kernel", "nic", "disk", "rank", "unknown"]
    check: str
    confidence: Confidence
    is_fatal: bool
    detail: str = ""
    evidence: dict[str, Any] = Field(default_factory=dict)


@upcaster("NodeHealthChanged", from_version=1)
def _node_health_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 could not say what failed or how sure it was: treat "unhealthy" as a failed, medium-confidence,
    # non-fatal signal so an old event never triggers an immediate eviction on replay.
    healthy = bool(payload.get("healthy"))
    return {
        "node_id": payload["node_id"],
        "status": "healthy" if healthy else "failed",
        "component": "unknown",
        "check": payload.get("check", "legacy"),
        "confidence": "medium",
        "is_fatal": False,
        "detail": payload.get("detail", ""),
        "evidence": {},
    }


@event_type("TimerTicked", version=2, aggregate="clock")
class TimerTicked(EventPayload):
    """Time as an input: the job clock's tick, recorded so a replay sees the time the live run saw. Only
    ticks produced by the one job clock (``CLOCK_PRODUCER``) are time; deciders ignore any other.

    v2 adds ``interval_s``, the clock's interval: the tick is then the controller's recorded clock, on
    which it judges liveness and command expiry by when events arrive (their place between two ticks in
    the stream), not by their producers' timestamps. v1 ticks (older logs) carry None: those logs were
    decided on the producers' timestamps, and a replay of them still is."""

    now: EventTime
    interval_s: float | None = Field(default=None, gt=0, le=86400)
    """How often the job clock ticks (``controller.clock_interval``); None: a v1 tick."""


@upcaster("TimerTicked", from_version=1)
def _timer_ticked_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # Before ticks were the recorded clock: no interval, so deciders judge such a log as it was judged.
    return {**payload, "interval_s": None}


CLOCK_PRODUCER = "clock"
"""The producer of the one ``TimerTicked`` clock per job (``keel.infra.clock.JobClock``)."""
LEGACY_CLOCK_PRODUCERS = frozenset({"controller-clock", "checkpoint-broker-clock"})
"""The two clocks of logs recorded before there was one job clock (the controller's, and the checkpoint
broker's while a restore plan waited): every decider took both as time then, so a replay of such a log
must too."""


def is_foreign_tick(event: Event) -> bool:
    """A ``TimerTicked`` that did not come from the job clock: not time for any decider, so a second
    clock (a service ticking on its own, a test harness) cannot move deadlines. The producer is what the
    publisher wrote: keeping a client that forges it off the bus is the bus's authentication's job."""
    return event.type == TimerTicked.event_name and event.producer != CLOCK_PRODUCER \
        and event.producer not in LEGACY_CLOCK_PRODUCERS


@event_type("NodeEvictionDecided", version=1, aggregate="node")
class NodeEvictionDecided(EventPayload):
    """The controller decided to evict a node. A command: executors ignore it after ``expires_at``."""

    node_id: str
    rung: int = Field(ge=1, le=6)
    reason: str
    evidence: list[str] = Field(default_factory=list)
    """Ids of the events that caused the decision."""
    expires_at: EventTime
    observe_only: bool = False


@event_type("NodeClockSkewed", version=1, aggregate="node")
class NodeClockSkewed(EventPayload):
    """The controller found a node's clock off its recorded clock by more than
    ``controller.clock_skew_allowance`` (``skewed``), or back within it (not ``skewed``): recorded once
    per crossing, for humans. Reported, never acted on: liveness and expiry never read producer clocks.

    ``skew_s`` is the node's newest timestamp minus when its events arrived (the ticks around them), a
    lower bound of the offset: positive, the node's clock is ahead; negative, behind (or its events were
    delivered late)."""

    node_id: str
    skewed: bool
    skew_s: float = Field(ge=-1e9, le=1e9)
    allowance_s: float = Field(ge=0, le=1e9)
    reason: str


@event_type("NodeFenced", version=1, aggregate="node")
class NodeFenced(EventPayload):
    """The controller heard from a node it decided to evict (``NodeEvictionDecided``): the node is fenced
    out of the job. What it reports (heartbeats, rank starts, registrations as a worker, checkpoint
    reports) counts for nothing, and this records that the controller ignored it, once per fence. The
    node's agent consumes it (``node.<its id>.NodeFenced``) and stops: its ranks are of a generation the
    job has left (``fenced_generation`` or older) and never join a newer one.

    ``generation``: the job's newest generation when the input arrived; ``input_type``: what the node
    sent; ``evicted_by``: the id of the eviction decision."""

    node_id: str
    generation: int = Field(ge=0)
    fenced_generation: int = Field(ge=0)
    evicted_by: str
    input_type: str
    reason: str


@event_type("NodeEvicted", version=1, aggregate="node")
class NodeEvicted(EventPayload):
    """An actuator carried out an eviction (or reports why it could not)."""

    node_id: str
    decision_id: str
    actuator: str
    outcome: Literal["evicted", "expired", "failed", "skipped_observe_only"]
    detail: str = ""



# -- node agent, ranks and fault injection (node agent issue) ---------------------------------------

ExitClass = Literal["user_code", "infrastructure", "unknown", "stopped_by_agent", "success"]
FaultKind = Literal["crash", "hang", "hang_stopped", "slow", "nan", "gpu-lost", "xid", "nic-down", "oom", "oom_kernel",
                    "disk-full", "sdc"]


class RankCollective(EventPayload):
    """A rank inside a collective (``Session.waiting``) when the heartbeat was sent."""

    collective: str
    """Its name, e.g. ``dp_all_reduce``."""
    waited_s: float = Field(ge=0)
    """How long the rank had been inside it when the heartbeat was sent."""


@event_type("NodeHeartbeat", version=6, aggregate="node")
class NodeHeartbeat(EventPayload):
    """Periodic liveness of a node agent and a summary of its ranks (not every sample). Since v3 it also
    carries what the node holds in the memory and peer checkpoint tiers (``stored``): shard reports ride
    on the heartbeat instead of being events of their own (``CheckpointShardsStored`` now only reports
    the disk tier), and a heartbeat is sent early when a report round completes (see the agent). Since v4
    it says which generation its ranks run (``generation``) and how many of them ever reported through
    the SDK (``ranks_reporting``): a job whose ranks never do is judged on process liveness alone. Since v5
    it says how long its ranks have been blocked in checkpointing (``checkpoint_blocking_s``), which ETTR
    charges. Since v6 it says which of its ranks are inside a collective and for how long
    (``rank_collectives``): the controller calls a hang when every rank of the job has been inside one at
    once for its floor (``keel.controller.rules``), and the agent sends a heartbeat early when all of its
    ranks have been."""

    node_id: str
    standby: bool = False
    ranks_alive: int = Field(ge=0)
    ranks_expected: int = Field(ge=0)
    last_step: int = -1
    step_time_p50_s: float | None = None
    """Median step time over the last interval, across this node's ranks."""
    health: HealthStatus = "healthy"
    rank_compute_time_p50_s: dict[int, float] = Field(default_factory=dict)
    """Per rank: its median time per step outside collectives over the last interval (absent: the
    loop marks no collective waits). Every rank of a synchronous job steps as slowly as the slowest;
    only a fail-slow rank also computes longer than the peers doing the same work."""
    stored: dict[CheckpointTier, list[ShardRecord]] = Field(default_factory=dict)
    """Per tier ("memory", "peer"): what the node holds now, the newest report-round step of each of its
    ranks in memory and of each backup it holds for another node's rank (one record each). Empty: a
    node without checkpointing, or nothing held yet. The broker folds each tier as a
    ``CheckpointShardsStored`` of that tier."""
    generation: int | None = Field(default=None, ge=0)
    """The generation of the ranks the node runs (or last ran). None: an agent older than v4."""
    ranks_reporting: int | None = Field(default=None, ge=0)
    """How many of that generation's ranks have reported through the SDK (``keel.sdk``) at least once.
    0 with ranks alive: a program without the SDK so far (its progress is invisible, only its processes
    are seen). None: an agent older than v4 (taken as a job that reports through the SDK)."""
    checkpoint_blocking_s: float | None = Field(default=None, ge=0)
    """The most seconds any of that generation's ranks on this node has spent blocked in checkpointing so
    far (a running total per rank, restarting with the generation). ETTR charges its growth as lost time.
    None: no rank checkpoints through the SDK (or an older agent)."""
    rank_collectives: dict[int, RankCollective] = Field(default_factory=dict)
    """The ranks of that generation in the step phase, past their warm-up, that were inside a collective when
    the heartbeat was sent. A rank outside one (computing, loading data, in an eval or a checkpoint) is absent.
    Empty: none, or an agent older than v6."""


@upcaster("NodeHeartbeat", from_version=1)
def _node_heartbeat_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "rank_compute_time_p50_s": {}}  # v1 did not measure it


@upcaster("NodeHeartbeat", from_version=2)
def _node_heartbeat_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "stored": {}}  # v2 agents reported shards as CheckpointShardsStored events


@upcaster("NodeHeartbeat", from_version=3)
def _node_heartbeat_v3_to_v4(payload: dict[str, Any]) -> dict[str, Any]:
    # v3 agents did not say: unknown, which every reader takes as a job reporting through the SDK (as decided then).
    return {**payload, "generation": None, "ranks_reporting": None}


@upcaster("NodeHeartbeat", from_version=4)
def _node_heartbeat_v4_to_v5(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "checkpoint_blocking_s": None}  # v4 agents did not measure it: nothing is charged


@upcaster("NodeHeartbeat", from_version=5)
def _node_heartbeat_v5_to_v6(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "rank_collectives": {}}  # v5 agents did not say: never all blocked


@event_type("RankStarted", version=1, aggregate="rank")
class RankStarted(EventPayload):
    """The agent started one training process. ``generation`` counts in-place restarts of the job."""

    node_id: str
    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    pid: int
    generation: int = Field(ge=0)


@event_type("RankExited", version=1, aggregate="rank")
class RankExited(EventPayload):
    """A training process ended, with its exit status, the tail of its stderr and a classification."""

    node_id: str
    rank: int = Field(ge=0)
    pid: int
    generation: int = Field(ge=0)
    exit_code: int | None
    signal: str | None = None
    classification: ExitClass
    error_type: str = ""
    """The exception class or error marker found in stderr (``TypeError``, ``NCCL error``, ``OOM``...)."""
    stderr_tail: str = ""
    reason: str = ""
    """Why the classifier chose ``classification``."""


class CodeRef(EventPayload):
    """The code a restarted rank runs: a registered version (``CodeVersionRegistered``), or the job's
    launch command (``version_id`` ``LAUNCH_VERSION``, no path: what the agent was started with)."""

    version_id: str
    path: str = ""
    """The version's directory in the version store (shared by the control plane and the agents)."""
    entry: list[str] = Field(default_factory=list)
    """The program: ``["train.py"]`` (relative to ``path``) or ``["-m", "pkg.mod"]``; the launch's own
    arguments follow it. Empty: the launch command's program."""
    digest: str = ""


LAUNCH_VERSION = "launch"
"""The version id of the code a job was launched with (before any deploy)."""


@event_type("RanksRestartRequested", version=4, aggregate="node")
class RanksRestartRequested(EventPayload):
    """A command: restart this node's ranks in place as ``generation``. Ignored after ``expires_at``.

    v2: ``code``, the version the restarted ranks run (None: whatever the node runs now).
    v3: ``master_addr``, the host that serves the ranks' rendezvous (``MASTER_ADDR``) from this generation
    on ("": the one the node launched with): it moves with node rank 0 to another host.
    v4: ``nnodes`` and ``node_rank``: the job goes on with fewer nodes (the controller's shrink, no standby
    ready): this node runs node rank ``node_rank`` of ``nnodes`` from this generation on, and its ranks
    restore the last step resharded from every old rank's shard (0 and -1: the layout stays)."""

    node_id: str
    generation: int = Field(ge=1)
    reason: str
    expires_at: EventTime
    code: CodeRef | None = None
    master_addr: str = Field(default="", max_length=255)
    nnodes: int = Field(default=0, ge=0)
    node_rank: int = Field(default=-1, ge=-1)

    @model_validator(mode="after")
    def _layout_whole(self) -> RanksRestartRequested:
        if (self.nnodes > 0) != (self.node_rank >= 0) or (self.nnodes > 0 and self.node_rank >= self.nnodes):
            raise ValueError(f"node_rank {self.node_rank} and nnodes {self.nnodes}: both set (0 <= node_rank < "
                             f"nnodes) or neither")
        return self


@upcaster("RanksRestartRequested", from_version=1)
def _ranks_restart_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "code": None}  # v1 never changed the code


@upcaster("RanksRestartRequested", from_version=2)
def _ranks_restart_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "master_addr": ""}  # v2 never moved the rendezvous


@upcaster("RanksRestartRequested", from_version=3)
def _ranks_restart_v3_to_v4(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "nnodes": 0, "node_rank": -1}  # v3 never changed the layout


@event_type("RanksRestarted", version=1, aggregate="node")
class RanksRestarted(EventPayload):
    """The agent carried out (or refused) a restart command."""

    node_id: str
    command_id: str
    generation: int = Field(ge=0)
    outcome: Literal["restarted", "expired", "failed", "stale_generation"]
    detail: str = ""


@event_type("FaultInjected", version=1, aggregate="node")
class FaultInjected(EventPayload):
    """``keel inject`` broke something on purpose; detection latency is measured from this event."""

    kind: FaultKind
    node_id: str
    rank: int | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    injected_by: str = "keel inject"


# -- checkpointing (issue 4) -------------------------------------------------------------------------
#
# Tiers, fastest first: "memory" (the rank's own node, shared memory), "peer" (the committed copy a
# backup node holds in its shared memory), "disk" (the persistent tier: a local or shared filesystem).

CheckpointTier = Literal["memory", "peer", "disk"]


class RankGroups(EventPayload):
    """One rank's parallel groups (lists of global ranks, the rank itself included)."""

    rank: int = Field(ge=0)
    dp: list[int] = Field(default_factory=list)
    pp: list[int] = Field(default_factory=list)
    tp: list[int] = Field(default_factory=list)
    shard: list[int] = Field(default_factory=list)
    """The ranks across which this rank's state is sharded (FSDP2 / DTensor parameters: the mesh dimensions
    they are sharded on; ZeRO: the optimizer's process group), the rank included; empty when nothing is
    sharded (DDP: every DP peer holds a replica). Its members hold other parts of the state, not copies."""
    shard_is_dp: bool = False
    """The shard group is the DP group (FSDP2 on a 1-D mesh, ZeRO over DP), and ``shard`` is left empty: a DP
    group is often the whole world, and a node's registration must not carry it twice."""

    @model_validator(mode="after")
    def _one_shard_group(self) -> RankGroups:
        if self.shard_is_dp and self.shard:
            raise ValueError("shard_is_dp names the DP group as the shard group: leave shard empty")
        return self

    @property
    def shard_group(self) -> list[int]:
        """The shard group's members, whichever way it was sent."""
        return self.dp if self.shard_is_dp else self.shard


@event_type("CheckpointRanksRegistered", version=2, aggregate="node")
class CheckpointRanksRegistered(EventPayload):
    """A node's ranks registered their Checkpointer: their parallel groups (v2: with each rank's ``shard``
    group), and where the node's shard store listens (``host:port`` of its gRPC ``ShardStore``) so peers can
    send it backups."""

    node_id: str
    generation: int = Field(ge=0)
    world_size: int = Field(ge=1)
    store_address: str
    ranks: list[RankGroups] = Field(min_length=1)


@upcaster("CheckpointRanksRegistered", from_version=1)
def _ranks_registered_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 knew no shard groups: its ranks were placed as replicas, as they are on replay.
    return {**payload, "ranks": [{**r, "shard": []} for r in payload["ranks"]]}


class BackupAssignment(EventPayload):
    rank: int = Field(ge=0)
    node_id: str
    backup_node_id: str
    backup_address: str
    fallback: str = ""
    """Why this backup is weaker than the rule ("" when no parallel group has ranks on both the rank's
    node and the backup node, so evicting any one group leaves a copy of the shard)."""


@event_type("CheckpointBackupAssigned", version=2, aggregate="job")
class CheckpointBackupAssigned(EventPayload):
    """The broker chose (or re-chose) each rank's backup peer: a node outside the rank's DP, PP and TP
    groups and not its own node; ``fallback`` explains any assignment that could not meet that."""

    assignments: list[BackupAssignment] = Field(min_length=1)
    reason: str
    every_k_steps: int | None = Field(default=None, ge=1)
    backup_every_k_steps: int | None = Field(default=None, ge=1)
    """The schedule in force (``CheckpointScheduleSet``), when one was set: an agent that started after it
    (a replacement node) learns which steps the others back up and persist from its assignments."""



@upcaster("CheckpointBackupAssigned", from_version=1)
def _backup_assigned_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 did not carry the schedule: an old placement says nothing about it.
    return {**payload, "every_k_steps": None, "backup_every_k_steps": None}


@event_type("CheckpointNodeBackupsAssigned", version=1, aggregate="node")
class CheckpointNodeBackupsAssigned(EventPayload):
    """One node's part of a placement: the backup peers of the ranks ``node_id`` runs, on that node's
    subject (its agent reads only its own). What ``CheckpointBackupAssigned`` said in one job-wide event,
    which grows ~250 B per rank; a node with more assignments than one event takes is sent several parts
    (``part`` of ``parts``), each complete in itself."""

    node_id: str
    assignments: list[BackupAssignment] = Field(min_length=1)
    reason: str
    every_k_steps: int | None = Field(default=None, ge=1)
    backup_every_k_steps: int | None = Field(default=None, ge=1)
    """The schedule in force, as in ``CheckpointBackupAssigned``."""
    part: int = Field(default=0, ge=0)
    parts: int = Field(default=1, ge=1)


@event_type("CheckpointNodeBackupsHeld", version=1, aggregate="node")
class CheckpointNodeBackupsHeld(EventPayload):
    """One node's part of a placement as the node that holds backups, on its subject: ``held``, the new or
    moved assignments that name it as the backup peer (its shard store accepts each rank's backups only
    from the node the assignment names), and ``released``, the ranks whose backups this placement moved
    away from it (its store no longer accepts them). Published with the senders' parts
    (``CheckpointNodeBackupsAssigned``) of the same decision; ``part`` of ``parts`` as there."""

    node_id: str
    held: list[BackupAssignment] = Field(default_factory=list)
    released: list[int] = Field(default_factory=list)
    reason: str
    part: int = Field(default=0, ge=0)
    parts: int = Field(default=1, ge=1)


class ShardRecord(EventPayload):
    rank: int = Field(ge=0)
    step: int = Field(ge=0)
    bytes: int = Field(ge=0)
    digest: str  # hex SHA-256 of the shard payload
    owner_node_id: str = ""  # for tier "peer": the node whose rank this is; "" otherwise
    write_s: float = Field(default=0.0, ge=0)  # for tier "disk": seconds this shard took to write
    send_s: float = Field(default=0.0, ge=0)  # for tier "memory": seconds the rank's last backup transfer took


@event_type("CheckpointShardsStored", version=1, aggregate="node")
class CheckpointShardsStored(EventPayload):
    """A node holds verified shards in one tier (its ranks' own snapshots, backups it holds for peers,
    or shards it persisted). Agents now send it for the disk tier only (memory and peer holdings ride
    on ``NodeHeartbeat.stored``); older logs hold it for every tier, and the broker folds both alike."""

    node_id: str
    tier: CheckpointTier
    shards: list[ShardRecord] = Field(min_length=1)


@event_type("CheckpointStepCommitted", version=1, aggregate="job")
class CheckpointStepCommitted(EventPayload):
    """Every rank's shard of ``step`` is present and verified in ``tier``: restorable from there."""

    tier: CheckpointTier
    step: int = Field(ge=0)
    ranks: int = Field(ge=1)
    bytes: int = Field(ge=0)


@event_type("CheckpointScheduleSet", version=1, aggregate="job")
class CheckpointScheduleSet(EventPayload):
    """The persistent tier's interval: every ``every_k_steps`` steps, from Young's formula
    K = sqrt(2 * save_cost * MTBF) / step_time, clamped to the configured floor and ceiling."""

    every_k_steps: int = Field(ge=1)
    backup_every_k_steps: int = Field(default=1, ge=1)
    """Backups go to the peers only for steps that are multiples of this, the same on every node (so the
    peer tier holds one step of every rank): the smallest power of two that keeps each transfer within
    ``backup_max_duty`` of the wall time."""
    save_cost_s: float = Field(ge=0)
    mtbf_s: float = Field(gt=0)
    step_time_s: float = Field(ge=0)
    reason: str


@event_type("CheckpointPersisted", version=1, aggregate="job")
class CheckpointPersisted(EventPayload):
    """Step ``step`` is on the persistent tier: every shard written and its manifest written last,
    atomically. ``save_cost_s``: the slowest node's write time (the C of Young's formula)."""

    step: int = Field(ge=0)
    path: str
    """The manifest file (``<root>/<job>/step-<s:09d>/manifest.json``)."""
    manifest_digest: str
    bytes: int = Field(ge=0)
    save_cost_s: float = Field(ge=0)


class InventoryEntry(EventPayload):
    rank: int = Field(ge=0)
    tier: Literal["memory", "peer"]
    step: int = Field(ge=0)
    bytes: int = Field(ge=0)
    digest: str


class RejectedShard(EventPayload):
    rank: int = Field(ge=0)
    tier: CheckpointTier
    step: int = Field(ge=-1)
    reason: str


@event_type("CheckpointInventoryReported", version=2, aggregate="node")
class CheckpointInventoryReported(EventPayload):
    """Before a restart as ``generation``, a node lists the shards it holds in memory and for peers,
    each verified against its digest; ``rejected`` lists the ones that failed and why."""

    node_id: str
    generation: int = Field(ge=0)
    entries: list[InventoryEntry] = Field(default_factory=list)
    rejected: list[RejectedShard] = Field(default_factory=list)
    ranks: list[int] = Field(default_factory=list)
    """The ranks this node will run as ``generation`` (a replacement node names the ranks it takes
    over); empty: the broker uses ``RankStarted`` of that generation, else the last registration."""
    world_size: int = Field(default=0, ge=0)
    """v2: the job's world size as ``generation`` when a shrink changed it (0: unchanged). A plan for a
    smaller world restores every old rank's shard to every node, to be resharded (``reshard_from``)."""


class RestoreSource(EventPayload):
    rank: int = Field(ge=0)
    tier: CheckpointTier
    node_id: str  # the node holding the shard (for "disk": "" - the shared path is read directly)
    address: str = ""  # that node's shard store, for "peer"
    path: str = ""  # for "disk": the shard file
    digest: str
    bytes: int = Field(ge=0)


@event_type("CheckpointNodeRestorePlanned", version=1, aggregate="node")
class CheckpointNodeRestorePlanned(EventPayload):
    """One node's part of a restore plan: where each rank ``node_id`` runs in ``generation`` restores
    ``step`` from, on that node's subject (its agent reads only its own part). Published before the plan
    itself (``CheckpointRestorePlanned``, job-wide, which counts the parts); a node with more sources
    than one event takes is sent several parts (``part`` of ``parts``)."""

    node_id: str
    generation: int = Field(ge=0)
    step: int = Field(ge=0)
    sources: list[RestoreSource] = Field(min_length=1)
    part: int = Field(default=0, ge=0)
    parts: int = Field(default=1, ge=1)


@event_type("CheckpointRestorePlanned", version=3, aggregate="job")
class CheckpointRestorePlanned(EventPayload):
    """The broker's plan for the ranks of ``generation``: resume after ``step`` (``-1``: start fresh),
    each rank's shard from the fastest tier that holds it verified.

    Version 2 is the job-wide summary: each rank's source is in its node's part
    (``CheckpointNodeRestorePlanned``, ``node_parts`` of them, published before this event), so the plan
    stays within the event size limit at any job size. ``sources`` holds only the ranks no node is known
    to run (every agent reads them); in version 1 it held every rank's source."""

    generation: int = Field(ge=0)
    step: int = Field(ge=-1)
    sources: list[RestoreSource] = Field(default_factory=list)
    reason: str
    ranks: int = Field(default=0, ge=0)
    """Ranks planned (the job's world size; 0 when starting fresh with the size unknown)."""
    tiers: dict[str, int] = Field(default_factory=dict)
    """Ranks restored from each tier ("memory", "peer", "disk")."""
    node_parts: int = Field(default=0, ge=0)
    """``CheckpointNodeRestorePlanned`` events of this plan (every node's parts together)."""
    reshard_from: int = Field(default=0, ge=0)
    """v3: the world size the step was saved with, when the restarted job runs another (a shrink): every
    saved rank's source is in ``sources``, every node stages them all, and each new rank loads its part
    resharded (``Checkpointer.load_resharded``). 0: the same layout, each rank its own shard."""


@upcaster("CheckpointRestorePlanned", from_version=1)
def _restore_planned_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    # v1 listed every rank's source in the plan itself: no node parts, the counts read off the sources.
    sources = payload.get("sources") or []
    tiers: dict[str, int] = {}
    for source in sources:
        tier = source.get("tier") if isinstance(source, dict) else None
        if isinstance(tier, str):
            tiers[tier] = tiers.get(tier, 0) + 1
    return {**payload, "ranks": len(sources), "tiers": tiers, "node_parts": 0}


@event_type("CheckpointTierFallback", version=1, aggregate="job")
class CheckpointTierFallback(EventPayload):
    """A restore (or a backup) could not use the faster tier and took a slower one, and why."""

    generation: int = Field(ge=0)
    rank: int = Field(ge=-1)  # -1: the whole job
    step: int = Field(ge=-1)
    from_tier: CheckpointTier
    to_tier: CheckpointTier | Literal["none"]
    reason: str


@event_type("CheckpointBackupFailed", version=1, aggregate="node")
class CheckpointBackupFailed(EventPayload):
    """A node could not send a rank's shard to its backup peer (peer dead, refused, verification)."""

    node_id: str
    rank: int = Field(ge=0)
    backup_node_id: str
    reason: str


# -- controller: the escalation ladder, diagnostics, standbys, guardrails (issue 5) -----------------
#
# An incident's id is the id of its ``IncidentOpened`` event; every decision the controller takes
# about it, and every event an agent emits in answer to those commands, carries it as
# ``correlation_id``, so ``keel timeline INCIDENT`` is one query.

IncidentKind = Literal["hardware", "crash", "hang", "user_code", "lost_node", "diagnostics", "fail_slow",
                      "metric_anomaly", "code_update"]
DiagnosticCheck = Literal["gpu_matmul", "intra_node_all_to_all", "inter_node_all_gather"]


@event_type("IncidentOpened", version=2, aggregate="job")
class IncidentOpened(EventPayload):
    """The controller saw a fault that interrupts the job and took it on: every later decision about
    it carries this event's id as ``correlation_id``."""

    kind: IncidentKind
    node_id: str = ""
    """The suspect node when the first signal names one ("" when nothing does yet)."""
    ranks: list[int] = Field(default_factory=list)
    generation: int = Field(ge=0)
    """The generation the fault hit."""
    last_step: int = -1
    """The newest step the job had reached when the fault was seen (recovery means getting back there)."""
    fingerprint: str = ""
    """What makes two failures "the same" (see ``keel.controller.guardrails.failure_fingerprint``)."""
    reason: str
    evidence: list[str] = Field(default_factory=list)


@upcaster("IncidentOpened", from_version=1)
def _incident_opened_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return dict(payload)  # v2 only added the kind "code_update" (a planned restart onto a new code version)


@event_type("IncidentResolved", version=2, aggregate="job")
class IncidentResolved(EventPayload):
    """The job is stepping again after an incident (or the controller gave up on it and paged). Since v2
    it says how recovery was judged (``measure``)."""

    incident_id: str
    outcome: Literal["recovered", "stopped", "superseded"]
    rung: int = Field(ge=0, le=6)
    """The highest rung the incident needed (0: it resolved itself)."""
    generation: int = Field(ge=0)
    reason: str
    measure: Literal["step", "process"] = "step"
    """``step``: a node of the restarted generation reported a step past its restore point (the SDK).
    ``process``: a job without the SDK, recovered once every rank of the restarted generation had been
    running for ``controller.process_settle_interval`` - coarser: no step is seen, so a rank that runs
    but hangs or makes no progress counts as recovered."""


@upcaster("IncidentResolved", from_version=1)
def _incident_resolved_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "measure": "step"}  # before v2 only a reported step resolved an incident


@event_type("DiagnosticsRequested", version=1, aggregate="job")
class DiagnosticsRequested(EventPayload):
    """A command (rung 2): the listed nodes stop their ranks and run stop-time diagnostics together.

    ``round`` numbers the requests of a job: agents rendezvous for the inter-node check on the job's
    master address at ``master_port + 500 + round``, so rounds never share store keys."""

    round: int = Field(ge=0)
    nodes: list[str] = Field(min_length=1)
    checks: list[DiagnosticCheck] = Field(min_length=1)
    timeout_s: float = Field(gt=0)
    """Each node reports within this; a node that does not is named by the controller's timeout."""
    expires_at: EventTime
    reason: str


class CheckResult(EventPayload):
    check: DiagnosticCheck
    passed: bool
    skipped: bool = False
    """The check cannot run here (the GPU self-test on a machine without a GPU): neither pass nor fail."""
    detail: str = ""
    bandwidth_gbps: float | None = None
    duration_s: float = Field(default=0.0, ge=0)


@event_type("DiagnosticsCompleted", version=1, aggregate="node")
class DiagnosticsCompleted(EventPayload):
    """One node's stop-time diagnostic results for a ``DiagnosticsRequested`` round."""

    node_id: str
    request_id: str
    round: int = Field(ge=0)
    passed: bool
    results: list[CheckResult] = Field(default_factory=list)
    suspects: list[str] = Field(default_factory=list)
    """Nodes this node's collective checks point at (a peer that never joined, or sent wrong data)."""
    detail: str = ""


@event_type("StandbyChecked", version=1, aggregate="node")
class StandbyChecked(EventPayload):
    """A warm standby ran its self-check (the same diagnostics, alone): only a passing one counts."""

    node_id: str
    passed: bool
    results: list[CheckResult] = Field(default_factory=list)
    detail: str = ""


@event_type("StandbyPromotionRequested", version=3, aggregate="node")
class StandbyPromotionRequested(EventPayload):
    """A command: the standby ``node_id`` takes over ``replaces_node_id``'s slice of ranks (``node_rank``)
    and starts them as ``generation``, restoring from the peer copies. Ignored after ``expires_at``."""

    node_id: str
    replaces_node_id: str
    node_rank: int = Field(ge=0)
    ranks: list[int] = Field(min_length=1)
    generation: int = Field(ge=1)
    reason: str
    expires_at: EventTime
    code: CodeRef | None = None
    """v2: the code version the promoted ranks run (None: the standby's launch command)."""
    master_addr: str = Field(default="", max_length=255)
    """v3: the host that serves the ranks' rendezvous (``MASTER_ADDR``) from this generation on ("": the one
    the standby launched with). Set when node rank 0 moved to another host, this promotion's or an earlier
    one's."""


@upcaster("StandbyPromotionRequested", from_version=1)
def _promotion_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "code": None}


@upcaster("StandbyPromotionRequested", from_version=2)
def _promotion_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "master_addr": ""}  # v2 never moved the rendezvous


@event_type("StandbyPromoted", version=1, aggregate="node")
class StandbyPromoted(EventPayload):
    """The standby's agent carried out (or refused) a promotion command."""

    node_id: str
    command_id: str
    replaces_node_id: str
    generation: int = Field(ge=0)
    outcome: Literal["promoted", "expired", "failed", "not_standby"]
    detail: str = ""


@event_type("StandbyPoolSized", version=1, aggregate="job")
class StandbyPoolSized(EventPayload):
    """The warm-standby pool's target size changed: the 99th percentile of a binomial model of
    concurrent node failures (``keel.controller.standby``); the actuator refills towards it."""

    target: int = Field(ge=0)
    ready: int = Field(ge=0)
    job_nodes: int = Field(ge=0)
    failure_probability: float = Field(ge=0, le=1)
    reason: str


@event_type("StandbyRefillRequested", version=1, aggregate="job")
class StandbyRefillRequested(EventPayload):
    """A command to the actuator: bring the pool back to ``target`` ready standbys (asynchronously)."""

    count: int = Field(ge=1)
    target: int = Field(ge=0)
    reason: str
    expires_at: EventTime


@event_type("RollbackDecided", version=1, aggregate="job")
class RollbackDecided(EventPayload):
    """Rung 4: the failure points at the code; roll back to the last stable version other than the one
    failing (``to_version``) and restart: the restart commands that follow name it. With no such version
    known, the restart goes ahead on the same code."""

    incident_id: str
    reason: str
    fingerprint: str = ""
    to_version: str = ""
    """The last stable code version ("" when none is known yet)."""
    evidence: list[str] = Field(default_factory=list)
    expires_at: EventTime


@event_type("JobStopDecided", version=1, aggregate="job")
class JobStopDecided(EventPayload):
    """Rung 6 (or a guardrail): stop the job and page a human; nothing is restarted automatically."""

    incident_id: str
    rung: int = Field(ge=1, le=6)
    reason: str
    page: bool = True
    evidence: list[str] = Field(default_factory=list)


class Promotion(EventPayload):
    standby_node_id: str
    replaces_node_id: str
    ranks: list[int] = Field(min_length=1)


@event_type("RestartDecided", version=3, aggregate="job")
class RestartDecided(EventPayload):
    """The ladder's recovery for an incident: evict ``evict``, promote standbys into their ranks, roll
    back the code if ``rollback``, and restart every other node in place as ``generation``. The commands
    (``NodeEvictionDecided``, ``StandbyPromotionRequested``, ``RanksRestartRequested``) follow it.

    v2: ``code_version``, the version the restarted ranks run ("" : unchanged); ``rung`` 0 is a planned
    restart onto a new code version (an urgent deploy or a lazy one's deadline), not a failure."""

    incident_id: str
    rung: int = Field(ge=0, le=6)
    generation: int = Field(ge=1)
    evict: list[str] = Field(default_factory=list)
    promotions: list[Promotion] = Field(default_factory=list)
    restart_nodes: list[str] = Field(default_factory=list)
    rollback: bool = False
    fingerprint: str = ""
    reason: str
    code_version: str = ""
    code_changed: bool = False
    """The restart swaps the code the ranks run (a rollout or a rollback) rather than keeping it."""
    world_size: int = Field(default=0, ge=0)
    """v3: the job's world size from ``generation`` on when the restart shrinks the job (no standby was
    ready and ``controller.shrink_without_standby`` is on); 0: unchanged."""


@upcaster("RestartDecided", from_version=1)
def _restart_decided_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "code_version": "", "code_changed": False}


@upcaster("RestartDecided", from_version=2)
def _restart_decided_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "world_size": 0}  # v2 never shrank the job


@upcaster("CheckpointInventoryReported", from_version=1)
def _inventory_v1_to_v2(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "world_size": 0}


@upcaster("CheckpointRestorePlanned", from_version=2)
def _restore_planned_v2_to_v3(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "reshard_from": 0}


@event_type("DecisionRefused", version=1, aggregate="job")
class DecisionRefused(EventPayload):
    """A decider could not turn an input into a decision (its rules raised: an input about something it
    does not know, arithmetic that overflowed). Recorded instead of a decision, with the error, so the
    service goes on and a replay reproduces it; the input itself stays in the log."""

    decider: str
    cause_type: str
    cause_id: str
    stage: Literal["evolve", "decide"]
    error: str = Field(max_length=2000)


@event_type("ActionHeld", version=1, aggregate="job")
class ActionHeld(EventPayload):
    """A guardrail held back the recovery the ladder chose (observe mode, a tripped breaker, an approval
    not yet given, no ready standby), with the plan it held (rung, nodes to evict, rollback) and why."""

    incident_id: str
    action: Literal["evict", "restart", "diagnose", "promote", "rollback", "stop"]
    guardrail: Literal["observe_only", "eviction_breaker", "restart_budget", "approval", "no_standby"]
    reason: str
    rung: int = Field(default=0, ge=0, le=6)
    evict: list[str] = Field(default_factory=list)
    rollback: bool = False


@event_type("ApprovalRequested", version=1, aggregate="job")
class ApprovalRequested(EventPayload):
    """An action of a kind configured to need a human's approval waits for ``keel approve`` / ``keel deny``."""

    incident_id: str
    action: Literal["evict", "restart", "diagnose", "promote", "rollback", "stop"]
    reason: str
    expires_at: EventTime


@event_type("ApprovalGiven", version=1, aggregate="job")
class ApprovalGiven(EventPayload):
    """A human's answer to an ``ApprovalRequested`` (by its event id)."""

    request_id: str
    approved: bool
    by: str
    comment: str = ""


@event_type("NodeCordoned", version=1, aggregate="node")
class NodeCordoned(EventPayload):
    """A human took a node out of service (or put it back, ``cordoned=False``). The controller never
    undoes a human's cordon: it neither promotes nor restarts onto a cordoned node."""

    node_id: str
    cordoned: bool = True
    by: str
    reason: str = ""


# -- the analyzer: stack aggregation (rung 3) -------------------------------------------------------


@event_type("StacksRequested", version=1, aggregate="job")
class StacksRequested(EventPayload):
    """A command (rung 3): the listed nodes capture the stacks of every training process (each rank and its
    children: dataloader workers, checkpoint helpers) with py-spy, without stopping them, and answer with
    ``StacksCaptured``. ``round`` numbers the job's capture rounds."""

    round: int = Field(ge=0)
    nodes: list[str] = Field(min_length=1)
    native: bool = False
    """Also native frames (py-spy ``--native``: slower, pauses the process)."""
    timeout_s: float = Field(gt=0)
    """Nodes answer within this; the analyzer judges without those that do not (missing evidence)."""
    expires_at: EventTime
    reason: str


class CapturedThread(EventPayload):
    name: str = ""
    os_thread_id: int | None = None
    """The OS thread id (the process id for the main thread)."""
    active: bool = False
    frames: list[str] = Field(default_factory=list)
    """Normalised frames (``function (file:line)``), outermost first."""


class CapturedProcess(EventPayload):
    pid: int
    parent_pid: int | None = None
    rank: int | None = None
    """The rank this process belongs to (itself or its parent rank)."""
    role: Literal["rank", "dataloader", "checkpoint", "other"] = "rank"
    threads: list[CapturedThread] = Field(default_factory=list)


class MissingProcess(EventPayload):
    """A process of a rank that could not be seen, and why (py-spy failed, it vanished, none running)."""

    rank: int = Field(ge=0)
    pid: int | None = None
    role: Literal["rank", "dataloader", "checkpoint", "other"] = "rank"
    """``rank``: the rank's own process (then the rank is not seen at all); else a child of it."""
    reason: str


class RankTopology(EventPayload):
    rank: int = Field(ge=0)
    tp: list[int] = Field(default_factory=list)
    pp: list[int] = Field(default_factory=list)
    dp: list[int] = Field(default_factory=list)


@event_type("StacksCaptured", version=1, aggregate="node")
class StacksCaptured(EventPayload):
    """One node's answer to a ``StacksRequested`` (possibly in ``parts``, to stay within the event size):
    the stacks of its training processes, the parallel groups of its ranks, and what it could not see
    (``missing``: a py-spy failure, a process that vanished, a rank with no process) - never silently
    left out."""

    node_id: str
    request_id: str
    round: int = Field(ge=0)
    processes: list[CapturedProcess] = Field(default_factory=list)
    ranks: list[RankTopology] = Field(default_factory=list)
    missing: list[MissingProcess] = Field(default_factory=list)
    part: int = Field(default=0, ge=0)
    parts: int = Field(default=1, ge=1)
    duration_s: float = Field(default=0.0, ge=0)


@event_type("StacksAnalyzed", version=1, aggregate="job")
class StacksAnalyzed(EventPayload):
    """The analyzer's verdict on one capture round: the outlier ranks, the smallest parallel group covering
    them (what rung 3 evicts, deliberately over-evicting), and the evidence: the dominant stack, each
    outlier's stack, and what could not be seen. ``conclusive`` false: no group is named (the reason says
    why: every rank alike, a tie, too much missing evidence); the controller falls back to rung 2."""

    request_id: str
    round: int = Field(ge=0)
    conclusive: bool
    outlier_ranks: list[int] = Field(default_factory=list)
    outlier_nodes: list[str] = Field(default_factory=list)
    group_kind: Literal["tp", "pp", "dp", "node", "groups", "job", "none"] = "none"
    group_ranks: list[int] = Field(default_factory=list)
    group_nodes: list[str] = Field(default_factory=list)
    dominant_stack: list[str] = Field(default_factory=list)
    outlier_stacks: dict[str, list[str]] = Field(default_factory=dict)
    """Rank (as a string) -> the frames that set it apart."""
    missing: list[str] = Field(default_factory=list)
    reason: str


@event_type("FailSlowConvicted", version=1, aggregate="job")
class FailSlowConvicted(EventPayload):
    """The analyzer's fail-slow rounds convicted a group: over the last ``rounds`` rounds (one every
    ``interval_s``) it was flagged most often, at least ``flags`` times. The evidence of each round is in
    ``round_evidence`` (the per-node compute times it saw, the nodes it flagged). The controller evicts
    ``group_nodes`` (rung 3: a slow node costs every rank its time, and no crash will ever say so)."""

    group_kind: Literal["tp", "pp", "dp", "node", "groups", "job"]
    group_ranks: list[int] = Field(default_factory=list)
    group_nodes: list[str] = Field(min_length=1)
    outlier_ranks: list[int] = Field(default_factory=list)
    rounds: int = Field(ge=1)
    flags: int = Field(ge=1)
    interval_s: float = Field(gt=0)
    round_evidence: list[str] = Field(default_factory=list)
    """One line per judged round, oldest first: the compute times it compared and what it flagged."""
    reason: str


@event_type("MetricAnomalyDetected", version=1, aggregate="node")
class MetricAnomalyDetected(EventPayload):
    """A node agent's check of its ranks' per-step metrics (``keel.rules.metrics``) found an anomaly:
    a NaN or infinite loss or gradient norm (``non_finite``), a loss or gradient-norm spike over
    ``spike_factor`` x the moving median (``spike``), or throughput below its own history (``decline``).
    Once per rank, kind and metric per generation. ``value`` is None when not finite (``value_text``
    says which: nan, inf, -inf)."""

    node_id: str
    rank: int = Field(ge=0)
    generation: int = Field(ge=0)
    kind: Literal["non_finite", "spike", "decline"]
    metric: Literal["loss", "grad_norm", "mfu", "tokens_per_s"]
    step: int = Field(ge=0)
    value: float | None = None
    value_text: str
    baseline: float | None = None
    reason: str


# -- rung 5: locating silent data corruption by dual-phase replay ---------------------------------------

SdcPhaseKind = Literal["contiguous", "strided", "split"]


class SdcUnit(EventPayload):
    """A "machine" of the replay: the smallest set of nodes that holds whole model replicas (a node, or
    the nodes one pipeline or TP group spans). Replays shrink DP by whole units; evicting the unit
    evicts its nodes."""

    name: str
    nodes: list[str] = Field(min_length=1)
    ranks: list[int] = Field(min_length=1)


class SdcPhase(EventPayload):
    """One replay round: ``groups`` (lists of unit names) replay side by side, each a scaled-down job.
    ``suspects``: the units under test (a split phase pads its groups with units that passed)."""

    index: int = Field(ge=1)
    kind: SdcPhaseKind
    groups: list[list[str]] = Field(min_length=1)
    suspects: list[str] = Field(default_factory=list)


@event_type("SdcReplayRequested", version=1, aggregate="job")
class SdcReplayRequested(EventPayload):
    """A command (rung 5): every listed node stops its ranks and starts them as ``generation`` in replay
    mode. They restore the checkpoint the broker plans (below the anomaly's step), replay the next step
    once per phase on the same recorded batch (every replica the same one), and compare their gradients
    bitwise inside each group of the phase. ``round`` numbers the job's replay requests."""

    round: int = Field(ge=0)
    generation: int = Field(ge=1)
    nodes: list[str] = Field(min_length=1)
    units: list[SdcUnit] = Field(min_length=1)
    phases: list[SdcPhase] = Field(min_length=1)
    anomaly_step: int = Field(ge=0)
    reference: str = ""
    """The result an earlier round of the same localisation settled on ("": this round's majority)."""
    timeout_s: float = Field(gt=0)
    expires_at: EventTime
    reason: str


class SdcGroupResult(EventPayload):
    """One rank's view of its group in one phase: the digest of the gradients the group agreed on
    (SHA-256 over every member's, when all are bitwise equal) or ``consistent`` false when they differ."""

    phase: int = Field(ge=1)
    group: int = Field(ge=0)
    rank: int = Field(ge=0)
    consistent: bool
    digest: str = ""
    detail: str = ""


@event_type("SdcReplayCompleted", version=1, aggregate="node")
class SdcReplayCompleted(EventPayload):
    """One node's answer to an ``SdcReplayRequested``: its ranks' group results, or ``ran`` false with
    the reason (a rank crashed, the restore failed, the command expired)."""

    node_id: str
    request_id: str
    round: int = Field(ge=0)
    ran: bool
    restored_step: int = -1
    results: list[SdcGroupResult] = Field(default_factory=list)
    detail: str = ""
    duration_s: float = Field(default=0.0, ge=0)


class SdcPhaseOutcome(EventPayload):
    phase: int = Field(ge=1)
    kind: SdcPhaseKind
    failed_groups: list[int] = Field(default_factory=list)
    evidence: list[str] = Field(default_factory=list)
    """Per failing group: why (members disagree, or its result differs from the reference)."""


@event_type("SdcReplayAnalyzed", version=1, aggregate="job")
class SdcReplayAnalyzed(EventPayload):
    """The analyzer's verdict on a replay round (``keel.rules.sdc``): ``found`` names the unit (and its
    nodes, what rung 5 evicts); ``ambiguous`` carries the ``next_phase`` to run; ``several`` names every
    unit that failed alone; ``not_reproduced`` / ``inconsistent`` / ``incomplete`` name nothing."""

    request_id: str
    round: int = Field(ge=0)
    kind: Literal["found", "ambiguous", "several", "not_reproduced", "inconsistent", "incomplete"]
    unit: str = ""
    nodes: list[str] = Field(default_factory=list)
    """The nodes to evict (of the found unit, or of every unit for ``several``)."""
    candidates: list[str] = Field(default_factory=list)
    phases: list[SdcPhaseOutcome] = Field(default_factory=list)
    reference_digest: str = ""
    next_phase: SdcPhase | None = None
    rounds: int = Field(default=0, ge=0)
    """Replay phases used so far in this localisation (all rounds of the incident)."""
    missing: list[str] = Field(default_factory=list)
    reason: str


# -- hot-update: code versions, rollouts, stability -------------------------------------------------

RolloutMode = Literal["urgent", "lazy"]


@event_type("CodeVersionRegistered", version=1, aggregate="code")
class CodeVersionRegistered(EventPayload):
    """``keel deploy`` snapshotted, validated and registered a code version for a job. Content-addressed:
    ``version_id`` is derived from ``digest`` (SHA-256 over the snapshot's paths, modes and bytes).
    ``urgent``: restart onto it now; ``lazy``: at the job's next restart of any cause, forced at
    ``deadline``."""

    version_id: str
    digest: str
    source: str
    """What was deployed: a directory, a git revision (``REPO@REV``) or a wheel file."""
    source_kind: Literal["directory", "git", "wheel"]
    path: str
    """The snapshot in the version store (read-only to the job)."""
    entry: list[str] = Field(min_length=1)
    """The program inside the version: ``["train.py"]`` or ``["-m", "pkg.mod"]``."""
    mode: RolloutMode
    deadline: EventTime | None = None
    """A lazy version is applied by this time even if nothing restarts the job."""
    by: str
    why: str = ""
    checks: list[str] = Field(default_factory=list)
    """What validation checked, in order (exists, imports, entry point resolves...)."""


@event_type("CodeVersionRejected", version=1, aggregate="code")
class CodeVersionRejected(EventPayload):
    """A deploy failed validation: nothing was registered, no rank will ever run it."""

    source: str
    digest: str = ""
    entry: list[str] = Field(default_factory=list)
    mode: RolloutMode
    by: str
    why: str = ""
    reason: str
    """Which check failed and its output."""


@event_type("CodeRolloutRequested", version=1, aggregate="job")
class CodeRolloutRequested(EventPayload):
    """Hot-update asks the controller to restart the job onto ``version_id`` now: the version is urgent, or
    a lazy version's deadline passed with no restart to ride on. At most one rollout is in flight."""

    version_id: str
    trigger: Literal["urgent", "deadline"]
    reason: str


@event_type("CodeVersionApplied", version=1, aggregate="node")
class CodeVersionApplied(EventPayload):
    """A node agent started its ranks of ``generation`` on a code version (in place: same agent, node store
    and in-memory checkpoints)."""

    node_id: str
    version_id: str
    generation: int = Field(ge=0)
    path: str = ""
    warm: bool = True
    """Forked from the node's zygote (False: fresh interpreters, e.g. the zygote had imported a module
    the version ships)."""
    detail: str = ""


@event_type("CodeVersionStable", version=1, aggregate="job")
class CodeVersionStable(EventPayload):
    """A version ran ``steps`` steps (or ``ran_s`` seconds) since it was applied without an incident that
    could be its fault: rung 4 rolls back to the newest such version."""

    version_id: str
    steps: int = Field(ge=0)
    ran_s: float = Field(ge=0)
    reason: str


# -- the control plane's own processes (``keel up``'s supervisor) ----------------------------------



@event_type("ServiceRestarted", version=1, aggregate="service")
class ServiceRestarted(EventPayload):
    """``keel up``'s supervisor restarted a control-plane service that exited (a crash, a kill), after
    ``backoff_s`` of back-off. ``attempt`` counts restarts since the service last ran healthy (its
    back-off doubles with each); ``exit_code`` or ``signal`` say how it ended (both empty: it was not
    the supervisor's child and its status is unknown)."""

    service: str = Field(min_length=1, max_length=64)
    exit_code: int | None = None
    signal: str | None = Field(default=None, max_length=32)
    attempt: int = Field(ge=1)
    backoff_s: float = Field(ge=0)
    uptime_s: float = Field(ge=0)
    """How long the exited process had run."""
    previous_pid: int = Field(ge=0)
    pid: int = Field(ge=0)
    """The restarted process."""
    reason: str = Field(max_length=2000)


@event_type("ServiceGaveUp", version=1, aggregate="service")
class ServiceGaveUp(EventPayload):
    """The supervisor stopped restarting a service that crash-looped: it exited again after ``restarts``
    restarts within ``window_s``. It stays down until ``keel up`` (or ``keel down`` then ``keel up``)."""

    service: str = Field(min_length=1, max_length=64)
    exit_code: int | None = None
    signal: str | None = Field(default=None, max_length=32)
    restarts: int = Field(ge=0)
    window_s: float = Field(ge=0)
    reason: str = Field(max_length=2000)
# -- the control plane itself: dead letters, the recorder ---------------------------------------------

SYSTEM_JOB = "_keel"
"""The job id of events about Keel itself rather than a training job (``RecorderLagReported``)."""


@event_type("DeadLetterRedriven", version=1, aggregate="dead_letter")
class DeadLetterRedriven(EventPayload):
    """``keel dlq redrive`` re-published a dead letter (``dlq_stream`` sequence ``dlq_seq``) on the subject its
    event belongs on, as it was (a code fix made it acceptable) or with a corrected body, and removed it
    from the dead-letter stream. The id is derived from the dead letter, so a redrive is recorded once.
    The event's job is the redriven event's."""

    dlq_stream: str
    dlq_seq: int = Field(ge=1)
    original_subject: str
    original_stream_seq: int = Field(ge=0)
    """The message's sequence in the events stream when it was dead-lettered (0: unknown)."""
    reason: str
    """Why it was dead-lettered."""
    event_id: str
    event_type: str
    subject: str
    """The subject it was re-published on."""
    corrected: bool
    """True: a corrected body was published in place of the dead-lettered bytes."""
    body_sha256: str
    """SHA-256 of the bytes re-published."""
    by: str


@event_type("RecorderLagReported", version=1, aggregate="recorder")
class RecorderLagReported(EventPayload):
    """How far the recorder is behind the stream: published when its lag crosses ``recorder.lag_threshold``
    (either way) and every ``recorder.lag_report_interval`` while it stays above. Job ``_keel``
    (``SYSTEM_JOB``). The same figures are the ``keel_recorder_lag_*`` metrics (``keel.infra.metrics``)."""

    consumer: str
    lag_s: float = Field(ge=0)
    """Now minus the arrival in the stream of the oldest message of the newest batch written."""
    pending: int = Field(ge=0)
    """Messages in the stream the recorder had not yet been delivered (JetStream's pending count)."""
    threshold_s: float = Field(ge=0)
    above: bool
    """The lag is above the threshold (False: the report of a return below it)."""


@event_type("NotificationSent", version=1, aggregate="job")
class NotificationSent(EventPayload):
    """The notifier's delivery log: one per notification and destination, once it is delivered or given up.
    Correlated with the incident; caused by the event it tells about. Secrets (URLs of Slack webhooks, routing
    keys, signing secrets) are never in it: a destination is named by its configured ``destination`` name."""

    destination: str
    destination_kind: Literal["slack", "pagerduty", "webhook"]
    notification: str
    """What it said: ``incident_opened``, ``incident_resolved``, ``approval_requested``, ``action_held``,
    ``job_stopped`` or ``rollback``."""
    notified_event_id: str
    delivery_id: str
    """Stable across redeliveries of the notified event (the ``webhook-id`` a receiver deduplicates on)."""
    outcome: Literal["delivered", "failed"]
    attempts: int = Field(ge=1)
    status: int | None = None
    """The receiver's last HTTP status (None: no answer)."""
    detail: str = ""
    """Why it failed, or what it took (retries, waits)."""
    latency_s: float = Field(ge=0)
    """From the notified event to the delivery's end (delivered, or given up)."""
