"""Checkpoint broker core: pure decisions over the event log (no I/O, no clock, no randomness).

Four decisions, each with a reason (docs/checkpointing.md):

- **Placement** (``place_backups``): every rank's backup peer on a node that shares no parallel group
  with the rank's node, load spread evenly; a documented fallback order when no such node exists.
  Re-placement (a backup peer failed, a node left, a rank moved) moves only the affected ranks.
- **Commits**: from ``CheckpointShardsStored``, the newest step for which every rank has a shard in a
  tier -> ``CheckpointStepCommitted`` (once per tier and step, monotonically increasing within a
  history: a restore plan to step P winds the memory and peer tiers' commits back to before P, because
  the resumed generation writes those steps anew; the disk tier's persisted steps stay).
- **Schedule** (``young_interval``): the persistent tier's interval K from Young's formula ->
  ``CheckpointScheduleSet`` when K changes.
- **Restore** (``plan_restore``): once every node's inventory for a generation arrived (or the wait
  timed out), the newest step every rank can restore, each rank from its fastest tier ->
  ``CheckpointRestorePlanned`` plus one ``CheckpointTierFallback`` per rank that cannot use its memory.

The manifest of a disk-committed step is written by the adapter (I/O); it reads
``JobState.pending_manifests`` and reports ``CheckpointPersisted``, which this core folds back in.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    BackupAssignment,
    CheckpointBackupAssigned,
    CheckpointBackupFailed,
    CheckpointInventoryReported,
    CheckpointPersisted,
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    CheckpointScheduleSet,
    CheckpointShardsStored,
    CheckpointStepCommitted,
    CheckpointTier,
    CheckpointTierFallback,
    JobRegistered,
    MetricAnomalyDetected,
    NodeEvicted,
    NodeEvictionDecided,
    NodeHeartbeat,
    RankExited,
    RankGroups,
    RankStarted,
    RestoreSource,
    ShardRecord,
    TimerTicked,
)
from keel.kernel.decider import Decision, Proposal

if TYPE_CHECKING:
    from keel.infra.config import CheckpointSettings

TIERS: tuple[CheckpointTier, ...] = ("memory", "peer", "disk")
FAILURE_CLASSES = frozenset({"user_code", "infrastructure", "unknown"})
"""``RankExited`` classifications that interrupt the job (a restart follows): they count for the MTBF."""
MAX_PENDING_STEPS = 32
"""Uncommitted steps remembered per tier (older ones can no longer become the newest commit)."""

# Placement levels, best first. Only ISOLATED guarantees that evicting any single parallel group (every
# node hosting one of its ranks) leaves a copy of every shard.
ISOLATED, DISJOINT, SHARES_DP, OWN_NODE_ONLY = 0, 1, 2, 3

Signature = tuple[str, frozenset[str], frozenset[str]]
"""A rank's node, the nodes of its DP/PP/TP peers, the nodes of its PP/TP peers."""
_Part = tuple[str, tuple[Proposal, ...]]
"""One sub-decision: its reason ("" when it has nothing to say) and its proposals."""


# -- placement -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankSite:
    """A rank, the node that runs it and its parallel groups (global ranks, the rank included)."""

    rank: int
    node_id: str
    dp: tuple[int, ...] = ()
    pp: tuple[int, ...] = ()
    tp: tuple[int, ...] = ()

    @classmethod
    def from_groups(cls, groups: RankGroups, node_id: str) -> RankSite:
        # Sorted and deduplicated: the members of one group then describe it by one equal tuple.
        return cls(groups.rank, node_id, *(tuple(sorted(set(g))) for g in (groups.dp, groups.pp, groups.tp)))


class _Topology:
    """Which nodes host which ranks, and which node pairs some parallel group spans."""

    def __init__(self, sites: Sequence[RankSite]) -> None:
        self.node_of = {s.rank: s.node_id for s in sites}
        self.hosts: dict[str, set[int]] = {}
        for s in sites:
            self.hosts.setdefault(s.node_id, set()).add(s.rank)
        # Every distinct group once (members of one group list it alike), with the nodes it runs on.
        self.group_nodes: dict[tuple[int, ...], frozenset[str]] = {}
        self.group_kind: dict[tuple[int, ...], str] = {}
        self.group_members: dict[tuple[int, ...], frozenset[int]] = {}
        for s in sites:
            for kind in ("dp", "pp", "tp"):
                members = getattr(s, kind)
                if members not in self.group_nodes:
                    self.group_members[members] = frozenset(members)
                    self.group_nodes[members] = frozenset(self.node_of[m] for m in members if m in self.node_of)
                    self.group_kind[members] = kind.upper()
        self.linked: dict[str, set[str]] = {}
        for nodes in self.group_nodes.values():
            for node in nodes:
                self.linked.setdefault(node, set()).update(nodes)
        self._spans: dict[tuple[str, str], str] = {}
        self._signatures: dict[tuple[object, ...], Signature] = {}
        self._interned: dict[Signature, Signature] = {}

    def signature(self, site: RankSite) -> Signature:
        """What a rank's candidate levels depend on: its node, the nodes of its DP/PP/TP peers and
        those of its PP/TP peers. Ranks with one signature rank every candidate alike (one object)."""
        key = (site.node_id, site.dp, site.pp, site.tp)
        if key not in self._signatures:
            dp, pp, tp = (self.group_nodes[g] for g in (site.dp, site.pp, site.tp))
            value = (site.node_id, dp | pp | tp, pp | tp)
            self._signatures[key] = self._interned.setdefault(value, value)
        return self._signatures[key]

    def shared_ranks(self, site: RankSite, backup: str) -> list[int]:
        """The rank's DP/PP/TP peers running on ``backup``."""
        groups = [self.group_members[g] for g in (site.dp, site.pp, site.tp)]
        return sorted(m for m in self.hosts.get(backup, ()) if m != site.rank and any(m in g for g in groups))

    def level(self, signature: Signature, candidate: str) -> int | None:
        """How good ``candidate`` is as a backup for ranks of ``signature`` (``None``: their own node). O(1)."""
        node, any_peer, pp_tp_peer = signature
        if candidate == node:
            return None
        if candidate not in self.linked.get(node, ()):
            return ISOLATED
        if candidate not in any_peer:
            return DISJOINT
        if candidate not in pp_tp_peer:
            return SHARES_DP
        return OWN_NODE_ONLY

    def spanning_group(self, a: str, b: str) -> str:
        if (a, b) not in self._spans:
            found = min((members for members, nodes in self.group_nodes.items()
                         if len(members) > 1 and a in nodes and b in nodes), default=None, key=sorted)
            self._spans[(a, b)] = (f"{self.group_kind[found]} group {ranks_text(found)}" if found is not None
                                   else "a parallel group")
        return self._spans[(a, b)]

    def fallback_text(self, site: RankSite, backup: str, level: int) -> str:
        r, node = site.rank, site.node_id
        if level == ISOLATED:
            return ""
        if level == DISJOINT:
            return (f"every other node shares a parallel group with {node}: {backup} holds none of rank {r}'s "
                    f"DP/PP/TP peers, but the {self.spanning_group(node, backup)} spans both nodes, so evicting "
                    f"that group would lose both copies of rank {r}")
        shared = self.shared_ranks(site, backup)
        if level == SHARES_DP:
            return (f"every other node holds a DP, PP or TP peer of rank {r}; {backup} shares only its DP group "
                    f"(ranks {ranks_text(shared)}), never its PP or TP group")
        return (f"every other node holds a PP or TP peer of rank {r}; {backup} is only not its own node "
                f"(shares ranks {ranks_text(shared)}): losing that group loses both copies")


def place_backups(
    ranks: Sequence[RankSite],
    nodes: Mapping[str, str],
    *,
    current: Mapping[int, BackupAssignment] | None = None,
    avoid: Mapping[int, Collection[str]] | None = None,
) -> list[BackupAssignment]:
    """Every rank's backup node among ``nodes`` (node id -> shard store address), sorted by rank.

    Preference, per rank (``fallback`` says why whenever the first could not be met):

    0. a node sharing no parallel group with the rank's node (no DP, PP or TP group has ranks on both):
       evicting any single group then leaves a copy of every shard;
    1. a node hosting none of the rank's own DP, PP and TP peers;
    2. a node hosting none of its PP and TP peers (sharing only the DP group, whose replicas hold the
       same parameters anyway);
    3. any node but its own.

    Among equally good nodes: the one holding the fewest backups, then the first after the rank's node
    in sorted order (so ranks of one node spread over several peers). Deterministic.

    ``current``: assignments kept when still valid (the backup node is in ``nodes``, not the rank's node,
    not in ``avoid`` and as good as the best available), so re-placement moves only the affected ranks.
    ``avoid``: per rank, nodes not to use unless nothing else is left (a failed backup peer). A rank with
    no other node (a single-node job) gets no assignment.
    """
    current = current or {}
    avoid = avoid or {}
    topo = _Topology(ranks)
    ring = sorted(set(nodes) | {s.node_id for s in ranks})
    load: Counter[str] = Counter()
    result: dict[int, BackupAssignment] = {}
    # Candidate lists depend only on a rank's signature (and its avoided nodes): computed once per
    # signature, as (best level, the nodes of that level in ring order from the rank's node).
    cache: dict[tuple[object, ...], tuple[int, list[str], dict[str, int]]] = {}

    def options(site: RankSite) -> tuple[int, list[str], dict[str, int]] | None:
        avoided = frozenset(avoid.get(site.rank, ()))
        signature = topo.signature(site)
        key = (id(signature), avoided)  # signatures are interned by the topology
        if key not in cache:
            origin = ring.index(site.node_id)
            in_ring_order = [n for n in ring[origin + 1:] + ring[:origin] if n in nodes]
            levels = {n: lvl for n in in_ring_order if (lvl := topo.level(signature, n)) is not None}
            usable = {n: lvl for n, lvl in levels.items() if n not in avoided} or levels
            if not usable:
                return None
            best = min(usable.values())
            cache[key] = (best, [n for n, lvl in usable.items() if lvl == best], usable)
        return cache[key]

    def assignment(site: RankSite, backup: str, level: int) -> BackupAssignment:
        return BackupAssignment(rank=site.rank, node_id=site.node_id, backup_node_id=backup,
                                backup_address=nodes[backup], fallback=topo.fallback_text(site, backup, level))

    to_place: list[tuple[int, int, RankSite, list[str], int]] = []
    for site in sorted(ranks, key=lambda s: s.rank):
        kept = current.get(site.rank)
        if kept is not None and kept.node_id == site.node_id and kept.backup_node_id in nodes:
            level = topo.level(topo.signature(site), kept.backup_node_id)
            if level == ISOLATED and kept.backup_node_id not in avoid.get(site.rank, ()):
                keep = True  # nothing is better: no need to look at the other nodes
            else:
                found = options(site) if level is not None else None
                keep = found is not None and kept.backup_node_id in found[2] and level is not None and level <= found[0]
            if keep and level is not None:
                result[site.rank] = assignment(site, kept.backup_node_id, level)
                load[kept.backup_node_id] += 1
                continue
        found = options(site)
        if found is not None:
            best, pool, _ = found
            to_place.append((len(pool), site.rank, site, pool, best))

    # The most constrained ranks first, so the freer ones fill in around them. ``min`` returns the
    # first of equally loaded nodes: the next one after the rank's node in ring order.
    for _, _, site, pool, best in sorted(to_place, key=lambda item: (item[0], item[1])):
        chosen = min(pool, key=load.__getitem__)
        result[site.rank] = assignment(site, chosen, best)
        load[chosen] += 1
    return [result[r] for r in sorted(result)]


# -- schedule ----------------------------------------------------------------------------------------


def mtbf_estimate(elapsed_s: float, failures: int, prior_s: float) -> float:
    """Mean time between failures, in seconds: ``(elapsed + prior) / (failures + 1)``.

    The prior counts as one failure-free stretch of ``prior_s`` (a conjugate prior): with no failures
    yet the estimate is the prior plus the time observed, and the observed rate dominates as failures
    accumulate.
    """
    return (max(0.0, elapsed_s) + prior_s) / (failures + 1)


def backup_interval(send_s: float, step_time_s: float, max_duty: float, ceiling: int, min_period_s: float = 0.0) -> int:
    """Steps between backups so that one transfer of ``send_s`` seconds takes at most ``max_duty`` of the
    wall time and rounds are at least ``min_period_s`` apart: the smallest power of two >=
    max(send_s / (max_duty * step_time), min_period_s / step_time), at most ``ceiling``.

    Powers of two, so that a change (the step time jitters) moves every node to steps the old and the
    new interval share. The period floor lets a round commit (every copy landed and reported) before
    any rank reaches the next one, so a fast rank's store is rarely two rounds past a slow rank's copy
    (the store keeps two). 1 (every step) when no step time was measured yet."""
    if step_time_s <= 0:
        return 1
    raw = max(max(0.0, send_s) / (max_duty * step_time_s), max(0.0, min_period_s) / step_time_s)
    interval = 1
    while interval < raw and interval < ceiling:
        interval *= 2
    return min(interval, max(1, ceiling))


def young_interval(
    save_cost_s: float, mtbf_s: float, step_time_s: float, floor: int, ceiling: int
) -> tuple[int, float]:
    """Young's optimal checkpoint interval in steps: ``(clamp(round(K)), K)`` with
    ``K = sqrt(2 * save_cost * MTBF) / step_time`` (seconds in, steps out)."""
    if step_time_s <= 0:
        raise ValueError(f"step time must be > 0 s, got {step_time_s}")
    raw = math.sqrt(2.0 * max(0.0, save_cost_s) * mtbf_s) / step_time_s
    return min(ceiling, max(floor, round(raw))), raw


# -- restore planning --------------------------------------------------------------------------------


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
class RestorePlan:
    generation: int
    step: int  # -1: start fresh
    sources: tuple[RestoreSource, ...]
    fallbacks: tuple[CheckpointTierFallback, ...]
    reason: str


def plan_restore(
    generation: int,
    world_size: int,
    targets: Mapping[int, str],
    inventories: Mapping[str, CheckpointInventoryReported],
    addresses: Mapping[str, str],
    persisted: Mapping[int, PersistedStep],
    *,
    previous_nodes: Mapping[int, str] | None = None,
    waited: str = "",
    below: tuple[int, str] | None = None,
) -> RestorePlan:
    """The newest step ``s`` such that every rank ``0..world_size-1`` has a verified shard of ``s`` in
    some tier, and where each rank gets it from, fastest first:

    1. ``memory``: the rank's own slot on the node that will run it (``targets``);
    2. ``peer`` on that same node: a backup it holds (no transfer);
    3. ``peer`` on another node that reported an inventory and has a shard store address;
    4. ``disk``: a persisted step (manifest written) in ``persisted``.

    One ``CheckpointTierFallback`` per rank not restored from memory, saying why; one for the whole job
    (rank -1) when the chosen step is older than the newest step in memory (``to_tier`` "none" when
    nothing is complete anywhere: step -1, start fresh). ``previous_nodes``: where each rank ran before
    (to tell a replaced node's empty memory); ``waited``: how the wait for inventories ended.
    ``below``: ``(step, why)``: only steps below ``step`` are candidates (a NaN or spike appeared at it,
    so its snapshot and every later one may hold corrupted state).
    """
    previous_nodes = previous_nodes or {}
    if below is not None:
        limit = below[0]
        inventories = {node: inv.model_copy(update={"entries": [e for e in inv.entries if e.step < limit]})
                       for node, inv in inventories.items()}
        persisted = {step: p for step, p in persisted.items() if step < limit}
        waited = (f"{waited}; " if waited else "") + f"steps from {limit} on excluded: {below[1]}"
    holdings: dict[int, dict[int, list[tuple[str, str, int, str]]]] = {}  # rank -> step -> (node, tier, bytes, digest)
    for node, inventory in sorted(inventories.items()):
        for entry in inventory.entries:
            holdings.setdefault(entry.rank, {}).setdefault(entry.step, []).append(
                (node, entry.tier, entry.bytes, entry.digest))
    steps = sorted({s for by_step in holdings.values() for s in by_step} | set(persisted), reverse=True)

    def best_source(rank: int, step: int) -> RestoreSource | None:
        target = targets.get(rank)
        held = holdings.get(rank, {}).get(step, [])
        local = [h for h in held if h[0] == target]
        for tier in ("memory", "peer"):
            for node, held_tier, size, digest in local:
                if held_tier == tier:
                    return RestoreSource(rank=rank, tier=tier, node_id=node, address=addresses.get(node, ""),
                                         digest=digest, bytes=size)
        remote = sorted((h for h in held if h[0] != target and addresses.get(h[0])),
                        key=lambda h: (h[1] != "peer", h[0]))
        if remote:
            node, _, size, digest = remote[0]
            return RestoreSource(rank=rank, tier="peer", node_id=node, address=addresses[node], digest=digest,
                                 bytes=size)
        disk = persisted.get(step)
        record = disk.shards.get(rank) if disk is not None else None
        if disk is not None and record is not None:
            return RestoreSource(rank=rank, tier="disk", node_id="", path=disk.shard_path(rank), digest=record.digest,
                                 bytes=record.bytes)
        return None

    chosen_step, sources = -1, []
    if world_size > 0:
        for step in steps:
            candidate = []
            for rank in range(world_size):
                source = best_source(rank, step)
                if source is None:
                    break
                candidate.append(source)
            else:
                chosen_step, sources = step, candidate
                break

    fallbacks = [
        CheckpointTierFallback(generation=generation, rank=s.rank, step=chosen_step, from_tier="memory",
                               to_tier=s.tier, reason=_why_not_memory(s, chosen_step, generation, targets,
                                                                     inventories, previous_nodes, waited))
        for s in sources if s.tier != "memory"
    ]
    memory_steps = {s for by_step in holdings.values() for s, held in by_step.items()
                    if any(tier == "memory" for _, tier, _, _ in held)}
    newest_memory = max(memory_steps, default=-1)
    slowest = max((TIERS.index(s.tier) for s in sources), default=-1)
    if newest_memory > chosen_step:
        missing = [r for r in range(world_size) if not holdings.get(r, {}).get(newest_memory)]
        if chosen_step >= 0:
            outcome = f"restoring step {chosen_step} instead ({newest_memory - chosen_step} steps lost)"
        else:
            outcome = "no tier holds every rank's shard of any step: starting fresh"
        fallbacks.append(CheckpointTierFallback(
            generation=generation, rank=-1, step=chosen_step, from_tier="memory",
            to_tier=TIERS[slowest] if chosen_step >= 0 else "none",
            reason=(f"the newest step in memory, {newest_memory}, is held for {world_size - len(missing)} of "
                    f"{world_size} ranks (none anywhere for ranks {ranks_text(missing)}); {outcome}" if missing else
                    f"every rank has a copy of step {newest_memory} in memory, but not every copy is on its rank's "
                    f"node or on a node with a known shard store; {outcome}")))

    counts = Counter(s.tier for s in sources)
    tail = f"; {waited}" if waited else ""
    if chosen_step >= 0:
        reason = (f"generation {generation}: resume after step {chosen_step}, the newest step every one of "
                  f"{world_size} ranks has verified: {counts['memory']} from memory, {counts['peer']} from peers, "
                  f"{counts['disk']} from disk{tail}")
    elif world_size <= 0:
        reason = f"generation {generation}: the job's world size is unknown (no rank registered): start fresh{tail}"
    else:
        newest_disk = max(persisted, default=None)
        reason = (f"generation {generation}: no step has a verified shard of every one of {world_size} ranks in "
                  f"any tier (newest in memory: {newest_memory if newest_memory >= 0 else 'none'}, newest "
                  f"persisted: {newest_disk if newest_disk is not None else 'none'}): start fresh{tail}")
    return RestorePlan(generation, chosen_step, tuple(sources), tuple(fallbacks), reason)


def _why_not_memory(
    source: RestoreSource,
    step: int,
    generation: int,
    targets: Mapping[int, str],
    inventories: Mapping[str, CheckpointInventoryReported],
    previous_nodes: Mapping[int, str],
    waited: str,
) -> str:
    rank = source.rank
    target = targets.get(rank)
    if source.tier == "peer" and source.node_id == target:
        where = f"the backup copy {target} holds for it"
    elif source.tier == "peer":
        where = f"the copy on {source.node_id} (fetched over its shard store)"
    else:
        where = f"the persistent tier ({source.path})"
    if target is None:
        why = f"no node is known to run rank {rank} in generation {generation}"
    elif (inventory := inventories.get(target)) is None:
        why = f"{target} sent no inventory for generation {generation}" + (f" ({waited})" if waited else "")
    else:
        reasons = [f"{target} rejected its memory copy of rank {rank} step {r.step}: {r.reason}"
                   for r in inventory.rejected if r.rank == rank and r.tier == "memory"]
        held = sorted({e.step for e in inventory.entries if e.rank == rank and e.tier == "memory"})
        if held:
            reasons.append(f"{target} holds rank {rank} in memory only at step(s) {', '.join(map(str, held))}, "
                           f"not step {step}")
        elif not reasons:
            previous = previous_nodes.get(rank)
            replaced = (f" (node replaced: rank {rank} ran on {previous} before, shared memory empty)"
                        if previous and previous != target else "")
            reasons.append(f"{target} reported no verified shard of step {step} for rank {rank}{replaced}")
        why = "; ".join(reasons)
    if source.tier == "disk":
        peer_rejects = [f"{node} rejected its copy: {r.reason}" for node, inv in sorted(inventories.items())
                        for r in inv.rejected if r.rank == rank and r.tier == "peer"]
        why += "; no live peer reported a verified copy" + (f" ({'; '.join(peer_rejects)})" if peer_rejects else "")
    return f"{why}; restoring from {where}"


def ranks_text(ranks: Collection[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    ordered = sorted(set(ranks))
    if not ordered:
        return "none"
    parts, start, prev = [], ordered[0], ordered[0]
    for r in ordered[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if r is not None:
            start = prev = r
    return ", ".join(parts)


# -- state -------------------------------------------------------------------------------------------


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
    every_k: int | None = None  # the K last emitted
    backup_every: int | None = None  # the backup interval last emitted
    send_s: Mapping[int, float] = field(default_factory=dict)  # rank -> latest backup transfer time, s
    save_cost_s: float | None = None  # EWMA of measured save costs
    measurements: int = 0
    failures: frozenset[int] = frozenset()  # generations in which the job was interrupted
    step_times: Mapping[str, float] = field(default_factory=dict)  # node -> latest p50 step time, s
    started_at: datetime | None = None


@dataclass(frozen=True)
class RestoreWait:
    """Inventories arriving for a restart as ``generation``; planned when complete or at ``deadline``."""

    generation: int
    deadline: datetime
    inventories: Mapping[str, CheckpointInventoryReported] = field(default_factory=dict)


@dataclass(frozen=True)
class JobState:
    world_size: int = 0
    generation: int = 0  # the newest generation seen
    sites: Mapping[int, RankSite] = field(default_factory=dict)  # rank -> latest registration
    site_generation: Mapping[int, int] = field(default_factory=dict)
    addresses: Mapping[str, str] = field(default_factory=dict)  # node -> shard store address
    left: frozenset[str] = frozenset()  # evicted (or being evicted) nodes
    backups: Mapping[int, BackupAssignment] = field(default_factory=dict)
    avoid: Mapping[int, frozenset[str]] = field(default_factory=dict)  # rank -> failed backup peers
    shards: Mapping[str, Mapping[int, Mapping[int, ShardRecord]]] = field(default_factory=dict)  # tier, step, rank
    disk_first_seen: Mapping[int, datetime] = field(default_factory=dict)
    committed: Mapping[str, int] = field(default_factory=dict)  # tier -> newest committed step
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
    jobs: Mapping[str, JobState] = field(default_factory=dict)

    def job(self, job_id: str) -> JobState:
        return self.jobs.get(job_id, _EMPTY_JOB)

    def with_job(self, job_id: str, job: JobState) -> BrokerState:
        return BrokerState(jobs={**self.jobs, job_id: job})


_EMPTY_JOB = JobState()


@dataclass(frozen=True)
class BrokerPolicy:
    persist_every_floor: int = 10  # steps
    persist_every_ceiling: int = 1000  # steps
    initial_save_cost: timedelta = timedelta(seconds=5)
    mtbf_prior: timedelta = timedelta(hours=4)
    restore_plan_timeout: timedelta = timedelta(seconds=10)
    retention: int = 3  # persisted steps kept
    save_cost_weight: float = 0.3
    """EWMA weight of the newest save-cost measurement."""
    backup_max_duty: float = 0.1
    """The share of wall time one rank's backup transfer may take (sets the backup interval)."""
    backup_min_period: timedelta = timedelta(seconds=0.5)
    """The shortest time between two backup rounds (sets the backup interval's floor)."""
    schedule_hysteresis: float = 0.1
    """A new K is announced only when it differs from the current one by this fraction (at least 1 step):
    the step time jitters every heartbeat, and agents need not hear every rounding flip."""

    @classmethod
    def from_settings(cls, settings: CheckpointSettings) -> BrokerPolicy:
        return cls(
            persist_every_floor=settings.persist_every_floor,
            persist_every_ceiling=settings.persist_every_ceiling,
            initial_save_cost=settings.initial_save_cost,
            mtbf_prior=settings.mtbf_prior,
            restore_plan_timeout=settings.restore_plan_timeout,
            retention=settings.retention,
            backup_max_duty=settings.backup_max_duty,
            backup_min_period=settings.backup_min_period,
        )


# -- the decider ------------------------------------------------------------------------------------

_INPUTS = frozenset({
    CheckpointRanksRegistered.event_name, CheckpointBackupFailed.event_name, CheckpointShardsStored.event_name,
    CheckpointInventoryReported.event_name, CheckpointPersisted.event_name, NodeHeartbeat.event_name,
    RankExited.event_name, RankStarted.event_name, NodeEvictionDecided.event_name, NodeEvicted.event_name,
    TimerTicked.event_name,
})
_FOLDED = _INPUTS | {
    JobRegistered.event_name, CheckpointBackupAssigned.event_name, CheckpointStepCommitted.event_name,
    CheckpointScheduleSet.event_name, CheckpointRestorePlanned.event_name, MetricAnomalyDetected.event_name,
}


class CheckpointBrokerDecider:
    """The checkpoint broker: placement, commits, schedule and restore plans, per job."""

    name = "checkpoint-broker"

    def __init__(self, policy: BrokerPolicy | None = None) -> None:
        self.policy = policy or BrokerPolicy()

    def initial_state(self) -> BrokerState:
        return BrokerState()

    def interested_in(self, event: Event) -> bool:
        return event.type in _INPUTS

    # evolve ------------------------------------------------------------------------------------------

    def evolve(self, state: BrokerState, event: Event) -> BrokerState:
        if event.type not in _FOLDED:
            return state  # health reports and the like: the bulk of the log, nothing to learn here
        job = state.job(event.job_id)
        if job.schedule.started_at is None:
            job = replace(job, schedule=replace(job.schedule, started_at=event.occurred_at))
        updated = self._evolve_job(job, event)
        return state.with_job(event.job_id, updated)

    def _evolve_job(self, job: JobState, event: Event) -> JobState:
        p = event.payload
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
            return replace(job, world_size=p.world_size if p.generation >= job.generation else job.world_size,
                           generation=max(job.generation, p.generation), sites=sites, site_generation=gens,
                           addresses={**job.addresses, p.node_id: p.store_address}, left=job.left - {p.node_id},
                           avoid=avoid)
        if isinstance(p, CheckpointBackupAssigned):
            return replace(job, backups={**job.backups, **{a.rank: a for a in p.assignments}})
        if isinstance(p, CheckpointBackupFailed):
            current = job.backups.get(p.rank)
            if current is None or current.backup_node_id != p.backup_node_id:
                return job  # about an assignment already replaced
            avoid = job.avoid.get(p.rank, frozenset()) | {p.backup_node_id}
            return replace(job, avoid={**job.avoid, p.rank: avoid})
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
            if p.standby or not p.step_time_p50_s or p.step_time_p50_s <= 0:
                return job
            times = {**job.schedule.step_times, p.node_id: p.step_time_p50_s}
            return replace(job, schedule=replace(job.schedule, step_times=times))
        if isinstance(p, CheckpointShardsStored):
            sends = {r.rank: r.send_s for r in p.shards if p.tier == "memory" and r.send_s > 0}
            if sends:
                job = replace(job, schedule=replace(job.schedule, send_s={**job.schedule.send_s, **sends}))
            return self._evolve_shards(job, p, event.occurred_at)
        if isinstance(p, CheckpointStepCommitted):
            return self._evolve_commit(job, p, event)
        if isinstance(p, CheckpointScheduleSet):
            return replace(job, schedule=replace(job.schedule, every_k=p.every_k_steps,
                                                 backup_every=p.backup_every_k_steps))
        if isinstance(p, CheckpointPersisted):
            return self._evolve_persisted(job, p)
        if isinstance(p, CheckpointInventoryReported):
            if job.planned and p.generation <= max(job.planned):
                return job  # that restart (or a newer one) is planned already: a late report
            wait = job.restores.get(p.generation) or RestoreWait(
                p.generation, event.occurred_at + self.policy.restore_plan_timeout)
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
            return replace(job, planned=job.planned | {p.generation}, committed=rewound, shards=shards,
                           restores={g: w for g, w in job.restores.items() if g > p.generation},
                           restore_below_planned=job.restore_below is not None)
        return job

    def _evolve_shards(self, job: JobState, p: CheckpointShardsStored, at: datetime) -> JobState:
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

    def _evolve_commit(self, job: JobState, p: CheckpointStepCommitted, event: Event) -> JobState:
        by_step = job.shards.get(p.tier, {})
        job = replace(job, committed={**job.committed, p.tier: max(p.step, job.committed.get(p.tier, -1))},
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

    def _evolve_persisted(self, job: JobState, p: CheckpointPersisted) -> JobState:
        commit = job.disk_commits.get(p.step)
        records = commit.shards if commit is not None else job.shards.get("disk", {}).get(p.step, {})
        persisted = {**job.persisted, p.step: PersistedStep(p.step, p.path, dict(records))}
        kept = sorted(persisted)[-self.policy.retention:]
        schedule = job.schedule
        weight = self.policy.save_cost_weight
        cost = p.save_cost_s if schedule.save_cost_s is None else schedule.save_cost_s + weight * (
            p.save_cost_s - schedule.save_cost_s)
        return replace(job, persisted={s: persisted[s] for s in kept},
                       disk_commits={s: c for s, c in job.disk_commits.items() if s > p.step},
                       schedule=replace(schedule, save_cost_s=cost, measurements=schedule.measurements + 1))

    # decide ------------------------------------------------------------------------------------------

    def decide(self, state: BrokerState, event: Event) -> Decision:
        job = state.job(event.job_id)
        p = event.payload
        parts: list[_Part] = []
        subject = f"job/{event.job_id}"
        if isinstance(p, (CheckpointRanksRegistered, CheckpointBackupFailed, NodeEvictionDecided, NodeEvicted)):
            parts.append(self._decide_placement(job, p, subject))
        if isinstance(p, CheckpointShardsStored):
            parts.append(self._decide_commit(job, p, subject))
        if isinstance(p, (NodeHeartbeat, CheckpointPersisted, RankExited, NodeEvictionDecided)) or (
                isinstance(p, CheckpointShardsStored) and any(r.send_s > 0 for r in p.shards)):
            parts.append(self._decide_schedule(job, event, subject))
        if isinstance(p, (CheckpointInventoryReported, RankStarted, TimerTicked)):
            now = p.now if isinstance(p, TimerTicked) else event.occurred_at
            parts.append(self._decide_restore(job, now, subject))
        reasons = [reason for reason, _ in parts if reason]
        proposals = tuple(proposal for _, props in parts for proposal in props)
        return Decision(reason="; ".join(reasons) or f"{event.type}: nothing to decide", proposals=proposals)

    def _decide_placement(self, job: JobState, p: EventPayload, subject: str) -> _Part:
        if not job.all_registered:
            if not isinstance(p, CheckpointRanksRegistered):
                return "", ()
            known = sum(1 for r in range(job.world_size) if r in job.sites)
            return f"placement waits for every rank to register ({known} of {job.world_size})", ()
        candidates = job.backup_candidates()
        if isinstance(p, CheckpointRanksRegistered) and _same_as_before(job, p, candidates):
            # The common re-registration (ranks restarted in place): nothing moved, so skip the
            # placement (costly on large jobs) and remind the node of its assignments.
            resent = sorted((job.backups[g.rank] for g in p.ranks), key=lambda a: a.rank)
            reason = f"{p.node_id} registered again, unchanged: its {len(resent)} assignment(s) re-sent"
            return reason, (Proposal(CheckpointBackupAssigned(assignments=resent, reason=reason, **_schedule_of(job)),
                                     subject=subject, key="placement"),)
        placed = place_backups(list(job.sites.values()), candidates, current=job.backups, avoid=job.avoid)
        changed = [a for a in placed if job.backups.get(a.rank) != a]
        registering = p.node_id if isinstance(p, CheckpointRanksRegistered) else None
        # A registering node's agent may have restarted: tell it its assignments again.
        resent = [a for a in placed if a.node_id == registering and a not in changed]
        unplaced = sorted(set(job.sites) - {a.rank for a in placed})
        note = f"; no other live node for ranks {ranks_text(unplaced)}" if unplaced else ""
        if not changed and not resent:
            return (f"placement unchanged{note}" if isinstance(p, CheckpointBackupFailed | CheckpointRanksRegistered)
                    else ""), ()
        if isinstance(p, CheckpointBackupFailed):
            why = f"{p.node_id} could not back up rank {p.rank} on {p.backup_node_id} ({p.reason})"
        elif isinstance(p, (NodeEvictionDecided, NodeEvicted)):
            why = f"{p.node_id} leaves the job"
        elif job.backups:
            why = f"{p.node_id} registered its ranks"  # type: ignore[attr-defined]
        else:
            why = f"all {job.world_size} ranks registered"
        moved = ranks_text([a.rank for a in changed])
        weaker = sum(1 for a in changed if a.fallback)
        reason = (f"{why}: {len(changed)} backup(s) placed or moved (ranks {moved})"
                  + (f", {weaker} with a fallback" if weaker else "")
                  + (f", {len(resent)} re-sent to {registering}" if resent else "") + note)
        assignments = sorted(changed + resent, key=lambda a: a.rank)
        payload = CheckpointBackupAssigned(assignments=assignments, reason=reason, **_schedule_of(job))
        return reason, (Proposal(payload, subject=subject, key="placement"),)

    def _decide_commit(self, job: JobState, p: CheckpointShardsStored, subject: str) -> _Part:
        if job.world_size <= 0:
            return "", ()
        by_step = job.shards.get(p.tier, {})
        committed = job.committed.get(p.tier, -1)
        for step in sorted({r.step for r in p.shards if r.step > committed}, reverse=True):
            records = by_step.get(step, {})
            if all(r in records for r in range(job.world_size)):
                total = sum(records[r].bytes for r in range(job.world_size))
                payload = CheckpointStepCommitted(tier=p.tier, step=step, ranks=job.world_size, bytes=total)
                reason = (f"every one of {job.world_size} ranks has a verified {p.tier} shard of step {step} "
                          f"({total} bytes); previous {p.tier} commit: {committed if committed >= 0 else 'none'}")
                return reason, (Proposal(payload, subject=subject, key=f"commit/{p.tier}/{step}"),)
        return "", ()

    def _decide_schedule(self, job: JobState, event: Event, subject: str) -> _Part:
        schedule, policy = job.schedule, self.policy
        if not schedule.step_times:
            if schedule.every_k is not None or not job.all_registered:
                return "", ()
            # Young's K is in steps and needs the step time; until a heartbeat measured one, persist at
            # the floor (the most frequent setting: a short or fast job still gets a disk copy).
            k = policy.persist_every_floor
            reason = (f"no step time measured yet: persist every {k} steps (the floor) until Young's formula "
                      f"can be applied; backups every step until a transfer is measured")
            cost = (schedule.save_cost_s if schedule.save_cost_s is not None
                    else policy.initial_save_cost.total_seconds())
            payload = CheckpointScheduleSet(every_k_steps=k, backup_every_k_steps=1, save_cost_s=cost,
                                            mtbf_s=policy.mtbf_prior.total_seconds(), step_time_s=0.0, reason=reason)
            return reason, (Proposal(payload, subject=subject, key="schedule/initial"),)
        # Synchronous training runs at its slowest node's pace.
        step_time = max(schedule.step_times.values())
        cost = schedule.save_cost_s if schedule.save_cost_s is not None else policy.initial_save_cost.total_seconds()
        started = schedule.started_at or event.occurred_at
        elapsed = (event.occurred_at - started).total_seconds()
        failures = len(schedule.failures)
        prior = policy.mtbf_prior.total_seconds()
        mtbf = mtbf_estimate(elapsed, failures, prior)
        k, raw = young_interval(cost, mtbf, step_time, policy.persist_every_floor, policy.persist_every_ceiling)
        current = schedule.every_k
        slowest_send = max(schedule.send_s.values(), default=0.0)
        backup_every = backup_interval(slowest_send, step_time, policy.backup_max_duty, policy.persist_every_ceiling,
                                       policy.backup_min_period.total_seconds())
        if (current is not None and abs(k - current) < max(1.0, policy.schedule_hysteresis * current)
                and backup_every == (schedule.backup_every or 1)):
            return "", ()
        cost_from = (f"EWMA of {schedule.measurements} measured persist(s)" if schedule.save_cost_s is not None
                     else "initial estimate, nothing persisted yet")
        reason = (f"Young: K = sqrt(2 x C {cost:.2f}s x MTBF {mtbf:.0f}s) / step time {step_time:.4f}s = {raw:.1f} "
                  f"-> {k} steps (clamped to [{policy.persist_every_floor}, {policy.persist_every_ceiling}]); "
                  f"C: {cost_from}; MTBF = (observed {elapsed:.0f}s + prior {prior:.0f}s) / ({failures} failure(s) + 1)"
                  + (f"; was {current}" if current is not None else "")
                  + f"; backups every {backup_every} step(s): slowest transfer {slowest_send:.3f}s within "
                    f"{policy.backup_max_duty:.0%} of the step time, rounds at least "
                    f"{policy.backup_min_period.total_seconds():g}s apart")
        payload = CheckpointScheduleSet(every_k_steps=k, backup_every_k_steps=backup_every, save_cost_s=cost,
                                        mtbf_s=mtbf, step_time_s=step_time, reason=reason)
        return reason, (Proposal(payload, subject=subject, key="schedule"),)

    def _decide_restore(self, job: JobState, now: datetime, subject: str) -> _Part:
        pending = [g for g in job.restores if g not in job.planned]
        if not pending:
            return "", ()
        generation = max(pending)  # an older restart still waiting is superseded by the newer one
        wait = job.restores[generation]
        targets = self.targets(job, wait)
        expected = {targets.get(r) for r in range(job.world_size)}
        missing_nodes = sorted(n for n in expected if n is not None and n not in wait.inventories)
        unknown = [r for r in range(job.world_size) if r not in targets]
        complete = job.world_size > 0 and not missing_nodes and not unknown
        if not complete and now < wait.deadline:
            waiting_for = ", ".join(missing_nodes) or f"the nodes of ranks {ranks_text(unknown)}"
            return f"generation {generation}: waiting for inventories from {waiting_for}", ()
        if complete:
            waited = f"inventories from all {len(wait.inventories)} node(s) arrived"
        else:
            timeout = self.policy.restore_plan_timeout.total_seconds()
            absent = ", ".join(missing_nodes) or "none"
            waited = (f"planned after the {timeout:g}s wait with {len(wait.inventories)} inventory(ies); "
                      f"absent: {absent}" + (f"; no node known for ranks {ranks_text(unknown)}" if unknown else ""))
        plan = plan_restore(generation, job.world_size, targets, wait.inventories, job.addresses, job.persisted,
                            previous_nodes={r: s.node_id for r, s in job.sites.items()}, waited=waited,
                            below=(job.restore_below, job.restore_below_reason) if job.restore_below is not None
                            else None)
        payload = CheckpointRestorePlanned(generation=generation, step=plan.step, sources=list(plan.sources),
                                           reason=plan.reason)
        proposals = [Proposal(payload, subject=subject, key=f"plan/{generation}")]
        proposals += [Proposal(f, subject=subject, key=f"fallback/{generation}/{f.rank}") for f in plan.fallbacks]
        return plan.reason, tuple(proposals)

    @staticmethod
    def targets(job: JobState, wait: RestoreWait) -> dict[int, str]:
        """Which node runs each rank in ``wait.generation``: what the inventories claim, else
        ``RankStarted`` of that generation, else the last registration."""
        targets = {r: s.node_id for r, s in job.sites.items()}
        if job.started_generation == wait.generation:
            targets.update(job.started)
        for node, inventory in sorted(wait.inventories.items()):
            targets.update({r: node for r in inventory.ranks})
        return targets

    def pending_restores(self, state: BrokerState) -> list[str]:
        """Jobs with a restore plan waiting for inventories (the adapter ticks the clock for them)."""
        return sorted(j for j, job in state.jobs.items() if any(g not in job.planned for g in job.restores))


def _schedule_of(job: JobState) -> dict[str, int]:
    """The schedule last announced, as ``CheckpointBackupAssigned`` carries it (nothing before one)."""
    schedule = job.schedule
    if schedule.every_k is None:
        return {}
    return {"every_k_steps": schedule.every_k, "backup_every_k_steps": schedule.backup_every or 1}


def _same_as_before(job: JobState, p: CheckpointRanksRegistered, candidates: Mapping[str, str]) -> bool:
    """Whether a registration changes nothing placement depends on: each of its ranks already has a
    backup from this node on a live candidate, and peers already know this node's address."""
    for groups in p.ranks:
        current = job.backups.get(groups.rank)
        if current is None or current.node_id != p.node_id or current.backup_node_id not in candidates:
            return False
        if current.backup_address != candidates[current.backup_node_id]:
            return False
    return all(a.backup_address == p.store_address for a in job.backups.values() if a.backup_node_id == p.node_id)


def _without_node(job: JobState, node_id: str) -> JobState:
    """A node leaves: no more backups on it, and its step time no longer sets the job's pace."""
    times = {n: t for n, t in job.schedule.step_times.items() if n != node_id}
    return replace(job, left=job.left | {node_id}, schedule=replace(job.schedule, step_times=times))
