"""Backup placement: which node holds each rank's backup copy (the "peer" tier), and why.

Every rank's backup goes to a node that shares no parallel group (DP, PP, TP or shard group) with the
rank's node, load spread evenly; ``place_backups`` documents the fallback order when no such node exists, and each
``BackupAssignment.fallback`` says which one was taken. Re-placement (a backup peer failed, a node left,
a rank moved) keeps every assignment that is still as good as the best available, so only the affected
ranks move.

``place_backups`` and ``ranks_text`` are pure maths over plain values; ``decide_placement`` is the
decider's placement decision (``CheckpointNodeBackupsAssigned``, one part per node that runs ranks whose
backup moved: it used to be one job-wide ``CheckpointBackupAssigned``) over a job's state. No I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from keel.checkpoint_broker.parts import PART_BUDGET_BYTES, split
from keel.checkpoint_broker.schedule import announced_schedule
from keel.checkpoint_broker.state import JobState, RankSite
from keel.events.envelope import EventPayload
from keel.events.types import (
    BackupAssignment,
    CheckpointBackupFailed,
    CheckpointNodeBackupsAssigned,
    CheckpointNodeBackupsHeld,
    CheckpointRanksRegistered,
    NodeEvicted,
    NodeEvictionDecided,
)
from keel.kernel.decider import Decision, Proposal

# Placement levels, best first. Only ISOLATED guarantees that evicting any single parallel group (every
# node hosting one of its ranks) leaves a copy of every shard. SHARES_DP is for DP peers that hold
# replicas of the rank's state: a node hosting a peer of its shard group (FSDP2 / ZeRO: the DP peers hold
# the other shards, not copies) is no better than one hosting a PP or TP peer.
ISOLATED, DISJOINT, SHARES_DP, OWN_NODE_ONLY = 0, 1, 2, 3

GROUP_KINDS = ("dp", "pp", "tp", "shard")
"""``RankSite``'s groups, in the order a group's kind is named (a shard group equal to a DP group: "DP/shard")."""

Signature = tuple[str, frozenset[str], frozenset[str]]
"""A rank's node, the nodes of its DP/PP/TP/shard-group peers, the nodes of its PP/TP/shard-group peers."""


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
            for kind in GROUP_KINDS:
                members = getattr(s, kind)
                name = "shard" if kind == "shard" else kind.upper()
                if members not in self.group_nodes:
                    self.group_members[members] = frozenset(members)
                    self.group_nodes[members] = frozenset(self.node_of[m] for m in members if m in self.node_of)
                    self.group_kind[members] = name
                elif kind == "shard" and len(members) > 1 and "shard" not in self.group_kind[members]:
                    self.group_kind[members] += "/shard"  # FSDP2 on one mesh dimension: the DP group is sharded
        self.linked: dict[str, set[str]] = {}
        for nodes in self.group_nodes.values():
            for node in nodes:
                self.linked.setdefault(node, set()).update(nodes)
        self._spans: dict[tuple[str, str], str] = {}
        self._signatures: dict[tuple[object, ...], Signature] = {}
        self._interned: dict[Signature, Signature] = {}

    def signature(self, site: RankSite) -> Signature:
        """What a rank's candidate levels depend on: its node, the nodes of its DP/PP/TP/shard-group peers
        and those of its PP/TP/shard-group peers (a shard peer holds another part of the state, not a copy).
        Ranks with one signature rank every candidate alike (one object)."""
        key = (site.node_id, site.dp, site.pp, site.tp, site.shard)
        if key not in self._signatures:
            dp, pp, tp, shard = (self.group_nodes[g] for g in (site.dp, site.pp, site.tp, site.shard))
            value = (site.node_id, dp | pp | tp | shard, pp | tp | shard)
            self._signatures[key] = self._interned.setdefault(value, value)
        return self._signatures[key]

    def shared_ranks(self, site: RankSite, backup: str, kinds: Sequence[str] = GROUP_KINDS) -> list[int]:
        """The rank's peers in its ``kinds`` groups running on ``backup``."""
        peers = frozenset().union(*(self.group_members[getattr(site, kind)] for kind in kinds))
        return sorted((peers & self.hosts.get(backup, set())) - {site.rank})  # O(group size), not O(node's ranks)

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
        sharded = len(site.shard) > 1  # texts name the shard group only for a rank whose state is sharded
        if level == DISJOINT:
            peers = "DP/PP/TP/shard-group" if sharded else "DP/PP/TP"
            return (f"every other node shares a parallel group with {node}: {backup} holds none of rank {r}'s "
                    f"{peers} peers, but the {self.spanning_group(node, backup)} spans both nodes, so evicting "
                    f"that group would lose both copies of rank {r}")
        shared = self.shared_ranks(site, backup)
        if level == SHARES_DP:
            if sharded:
                return (f"every other node holds a DP, PP, TP or shard-group peer of rank {r}; {backup} shares only "
                        f"its DP group (ranks {ranks_text(shared)}, replicas outside its shard group "
                        f"{ranks_text(site.shard)}), never its PP, TP or shard group")
            return (f"every other node holds a DP, PP or TP peer of rank {r}; {backup} shares only its DP group "
                    f"(ranks {ranks_text(shared)}), never its PP or TP group")
        if sharded:
            why = [name for kind, name in (("pp", "PP group"), ("tp", "TP group"), ("shard", "shard group"))
                   if self.shared_ranks(site, backup, (kind,))]
            of = f" of its {' and '.join(why)}" if why else ""
            shard_note = (f"; its shard group {ranks_text(site.shard)} holds the other parts of its state, not copies"
                          if "shard group" in why else "")
            return (f"every other node holds a PP, TP or shard-group peer of rank {r}; {backup} is only not its own "
                    f"node (shares ranks {ranks_text(shared)}{of}{shard_note}): losing that group loses both copies")
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

    0. a node sharing no parallel group with the rank's node (no DP, PP, TP or shard group has ranks on
       both): evicting any single group then leaves a copy of every shard;
    1. a node hosting none of the rank's own DP, PP, TP and shard-group peers;
    2. a node hosting none of its PP, TP and shard-group peers (sharing only the DP group, whose replicas
       hold the same parameters anyway; under FSDP2 / ZeRO the DP peers in its shard group hold other
       shards, so they count like PP and TP peers);
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


def ranks_text(ranks: Collection[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    ordered = sorted(set(ranks))
    if not ordered:
        return "none"
    parts, start, prev = [], ordered[0], ordered[0]
    for r in ordered[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if r is not None:
            start = prev = r
    return ", ".join(parts)


# -- the decision ------------------------------------------------------------------------------------


def decide_placement(job: JobState, p: EventPayload, subject: str, part_budget_bytes: int = PART_BUDGET_BYTES) -> Decision:
    """Place or move backups after a registration, a failed backup or a node leaving the job.

    Waits until every rank of the job registered. An empty reason: nothing to say about ``p``."""
    if not job.all_registered:
        if not isinstance(p, CheckpointRanksRegistered):
            return Decision("")
        known = sum(1 for r in range(job.world_size) if r in job.sites)
        return Decision(f"placement waits for every rank to register ({known} of {job.world_size})")
    candidates = job.backup_candidates()
    if isinstance(p, CheckpointRanksRegistered) and _same_as_before(job, p, candidates):
        # The common re-registration (ranks restarted in place): nothing moved, so skip the
        # placement (costly on large jobs) and remind the node of its assignments.
        resent = sorted((job.backups[g.rank] for g in p.ranks), key=lambda a: a.rank)
        reason = f"{p.node_id} registered again, unchanged: its {len(resent)} assignment(s) re-sent"
        return Decision(reason, assignment_proposals(resent, reason, job, part_budget_bytes))
    placed = place_backups(list(job.sites.values()), candidates, current=job.backups, avoid=job.avoid)
    changed = [a for a in placed if job.backups.get(a.rank) != a]
    registering = p.node_id if isinstance(p, CheckpointRanksRegistered) else None
    # A registering node's agent may have restarted: tell it its assignments again.
    moved_ranks = {a.rank for a in changed}
    resent = [a for a in placed if a.node_id == registering and a.rank not in moved_ranks]
    unplaced = sorted(set(job.sites) - {a.rank for a in placed})
    note = f"; no other live node for ranks {ranks_text(unplaced)}" if unplaced else ""
    if not changed and not resent:
        asked = isinstance(p, CheckpointBackupFailed | CheckpointRanksRegistered)
        return Decision(f"placement unchanged{note}" if asked else "")
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
    return Decision(reason, assignment_proposals(assignments, reason, job, part_budget_bytes))


def assignment_proposals(assignments: Sequence[BackupAssignment], reason: str, job: JobState,
                         part_budget_bytes: int = PART_BUDGET_BYTES) -> tuple[Proposal, ...]:
    """``assignments`` as per-node parts (``CheckpointNodeBackupsAssigned``), each on the subject of the
    node that runs the ranks (the one that sends their backups): nodes in sorted order, each node's
    assignments by rank, split under ``PART_BUDGET_BYTES``."""
    by_node: dict[str, list[BackupAssignment]] = {}
    for assignment in sorted(assignments, key=lambda a: a.rank):
        by_node.setdefault(assignment.node_id, []).append(assignment)
    proposals = []
    for node in sorted(by_node):
        chunks = split(by_node[node], part_budget_bytes)
        proposals += [Proposal(CheckpointNodeBackupsAssigned(node_id=node, assignments=chunk, reason=reason, part=i,
                                                             parts=len(chunks), **announced_schedule(job.schedule)),
                               subject=f"node/{node}", key=f"placement/{node}/{i}")
                      for i, chunk in enumerate(chunks)]
    return tuple(proposals) + holder_proposals(assignments, reason, job, part_budget_bytes)


def holder_proposals(assignments: Sequence[BackupAssignment], reason: str, job: JobState,
                     part_budget_bytes: int = PART_BUDGET_BYTES) -> tuple[Proposal, ...]:
    """The holders' side of ``assignments`` (``CheckpointNodeBackupsHeld``), for the new or moved ones
    only: each node that is to hold a rank's backups hears who sends them (its shard store accepts them
    from that node only), each node that held them before hears they moved away. ``job``: the state
    before the placement. An unchanged assignment re-sent to its sender says nothing new to its holder
    (who keeps what it heard across an agent restart)."""
    held: dict[str, list[BackupAssignment]] = {}
    released: dict[str, list[int]] = {}
    for assignment in sorted(assignments, key=lambda a: a.rank):
        previous = job.backups.get(assignment.rank)
        if previous == assignment:
            continue
        held.setdefault(assignment.backup_node_id, []).append(assignment)
        if previous is not None and previous.backup_node_id != assignment.backup_node_id:
            released.setdefault(previous.backup_node_id, []).append(assignment.rank)
    proposals: list[Proposal] = []
    for node in sorted(set(held) | set(released)):
        # Released ranks are a few integers: they ride on the first part.
        chunks = split(held.get(node, []), part_budget_bytes) or [[]]
        proposals += [Proposal(CheckpointNodeBackupsHeld(node_id=node, held=chunk, released=released.get(node, [])
                                                         if i == 0 else [], reason=reason, part=i, parts=len(chunks)),
                               subject=f"node/{node}", key=f"held/{node}/{i}")
                      for i, chunk in enumerate(chunks)]
    return tuple(proposals)


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
