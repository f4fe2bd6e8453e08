"""Rung 3: aggregate every training process's stacks, find the outliers, name the group to evict.

Pure: ``aggregate(processes, topology, missing, settings) -> Verdict``, no I/O, no clock. The method
(ByteRobust's runtime analyzer):

1. **Parse each rank's process tree**: its main process (role ``"rank"``) and its children (dataloader
   workers, checkpoint helpers, others), each a ``ProcessStacks`` from py-spy (``keel.rules.stacks``).
2. **Group stacks by string match**: the main thread of every rank's main process gives a signature
   (normalised frames); equal signatures form a cluster. Children are clustered separately, per role
   (a rank whose dataloader worker is stuck differs there, even if its main process looks like the
   others').
3. **The majority clusters are healthy**: a cluster is healthy when it holds more than
   ``healthy_fraction`` (default 0.5) of the largest cluster's ranks, so clusters of equal size are
   all healthy (no majority: inconclusive), the stage clusters of a pipeline-parallel job (one per
   stage, about equal) are all healthy, while a stuck rank's cluster of one is not. **The rest are
   outliers.**
4. **Evict the smallest parallel group covering all outliers** (``covering_group``): each outlier's
   TP group, PP group, DP group and node are candidates; the one covering every outlier with the
   fewest nodes (then ranks; ties in the order tp, pp, dp, node) wins, unless the union of a greedy
   cover of per-outlier groups needs fewer nodes. A group over ``job_fraction`` of the world is the
   whole job. Deliberate over-eviction: healthy ranks of the group leave too.

Inconclusive (nothing to evict, and the verdict says why): every observed rank shows the same stack
(and no child differs); no cluster is small enough to be an outlier (e.g. two clusters of equal size:
no majority); no rank could be seen; or the missing evidence could change the majority. Missing
evidence (py-spy failed, the process vanished, nothing arrived) is listed in ``Verdict.missing``;
those ranks are never counted healthy and never silently dropped.

Cost: one pass with hashed signatures (``Signer`` memoises normal forms), so O(ranks x frames); the
covering search only touches the outliers' groups.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from keel.rules.stacks import ROLES, MissingEvidence, ProcessStacks, Role, Signer

VerdictKind = Literal["outliers", "inconclusive", "convicted"]
GroupKind = Literal["tp", "pp", "dp", "node", "groups", "job", "none"]
SINGLE_GROUP_KINDS: tuple[GroupKind, ...] = ("tp", "pp", "dp", "node")


# ------------------------------------------------------------------------------------------ topology


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one rank sits: its node and the members of its TP, PP and DP groups (each includes it)."""

    node: str
    tp: tuple[int, ...]
    pp: tuple[int, ...]
    dp: tuple[int, ...]

    def group(self, kind: GroupKind) -> tuple[int, ...]:
        if kind == "tp":
            return self.tp
        if kind == "pp":
            return self.pp
        if kind == "dp":
            return self.dp
        raise ValueError(f"{kind!r} is not a per-rank group kind")


@dataclass(frozen=True)
class Topology:
    """The job's layout: ``placements[rank]`` for every rank ``0 .. world_size - 1``.

    Build it with ``from_mapping`` (``{rank: {"node", "tp", "pp", "dp"}}``), ``from_workload`` (the dict
    ``keel.workload.train.topology`` returns, plus each rank's node) or ``grid``. Raises ``ValueError``
    when a rank is missing or is not a member of its own groups.
    """

    world_size: int
    placements: Mapping[int, Placement]
    node_ranks: Mapping[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if len(self.placements) != self.world_size or any(r not in self.placements for r in range(self.world_size)):
            raise ValueError(f"placements must cover ranks 0..{self.world_size - 1} exactly")
        checked: dict[int, frozenset[int]] = {}  # by id(): the builders share one tuple per group
        by_node: dict[str, list[int]] = {}
        for rank in range(self.world_size):
            p = self.placements[rank]
            for kind in ("tp", "pp", "dp"):
                group = p.group(kind)
                members = checked.get(id(group))
                if members is None:
                    members = checked[id(group)] = frozenset(group)
                    bad = [r for r in members if not 0 <= r < self.world_size]
                    if bad:
                        raise ValueError(f"rank {rank}'s {kind} group {list(group)} names ranks outside the world: {bad}")
                if rank not in members:
                    raise ValueError(f"rank {rank} is not a member of its own {kind} group {list(group)}")
            by_node.setdefault(p.node, []).append(rank)
        object.__setattr__(self, "node_ranks", {n: tuple(rs) for n, rs in by_node.items()})

    @classmethod
    def from_mapping(cls, mapping: Mapping[int, Mapping[str, Any]]) -> Topology:
        """From ``{rank: {"node": str, "tp": [ranks], "pp": [ranks], "dp": [ranks]}}`` (``tp`` optional)."""
        canon: dict[tuple[int, ...], tuple[int, ...]] = {}

        def shared(ranks: Iterable[int]) -> tuple[int, ...]:
            t = tuple(int(r) for r in ranks)
            return canon.setdefault(t, t)

        placements = {}
        for rank, entry in mapping.items():
            r = int(rank)
            placements[r] = Placement(node=str(entry["node"]), tp=shared(entry.get("tp", (r,))),
                                      pp=shared(entry["pp"]), dp=shared(entry["dp"]))
        return cls(len(placements), placements)

    @classmethod
    def from_workload(cls, topo: Mapping[str, Any], nodes: Mapping[int, str] | Sequence[str]) -> Topology:
        """From ``keel.workload.train.topology(world_size, pp)``'s dict and each rank's node.

        The workload has no tensor parallelism: every TP group is the rank alone. ``nodes[rank]`` is
        the rank's node (a list indexed by rank, or a dict).
        """
        placements = {}
        for entry in topo["ranks"]:
            r = int(entry["rank"])
            placements[r] = Placement(node=str(nodes[r]), tp=(r,), pp=tuple(entry["pp_group"]),
                                      dp=tuple(entry["dp_group"]))
        return cls(int(topo["world_size"]), placements)

    @classmethod
    def grid(cls, dp: int, pp: int, tp: int = 1, ranks_per_node: int = 1, node_prefix: str = "node-") -> Topology:
        """DP x PP x TP with ``rank = (dp_rank * pp + pp_rank) * tp + tp_rank`` (TP fastest, then PP:
        with ``tp == 1`` exactly the workload's layout) and ``ranks_per_node`` consecutive ranks per
        node, named ``f"{node_prefix}{i}"``.
        """
        if min(dp, pp, tp, ranks_per_node) < 1:
            raise ValueError("dp, pp, tp and ranks_per_node must be >= 1")
        world = dp * pp * tp
        tp_groups = {(d, s): tuple((d * pp + s) * tp + t for t in range(tp)) for d in range(dp) for s in range(pp)}
        pp_groups = {(d, t): tuple((d * pp + s) * tp + t for s in range(pp)) for d in range(dp) for t in range(tp)}
        dp_groups = {(s, t): tuple((d * pp + s) * tp + t for d in range(dp)) for s in range(pp) for t in range(tp)}
        placements = {}
        for r in range(world):
            t, s, d = r % tp, (r // tp) % pp, r // (tp * pp)
            placements[r] = Placement(node=f"{node_prefix}{r // ranks_per_node}", tp=tp_groups[(d, s)],
                                      pp=pp_groups[(d, t)], dp=dp_groups[(s, t)])
        return cls(world, placements)

    def nodes_of(self, ranks: Iterable[int]) -> tuple[str, ...]:
        """The distinct nodes of ``ranks``, sorted."""
        return tuple(sorted({self.placements[r].node for r in ranks}))

    def groups_of(self, rank: int) -> dict[GroupKind, tuple[int, ...]]:
        """``rank``'s TP, PP, DP group and node's ranks, in that order."""
        p = self.placements[rank]
        return {"tp": p.tp, "pp": p.pp, "dp": p.dp, "node": self.node_ranks[p.node]}


# ------------------------------------------------------------------------------------------- verdict


@dataclass(frozen=True, slots=True)
class Cluster:
    """Ranks whose process of ``role`` shows the same stack (``signature`` outermost first).

    For a child role a rank appears once per child in the cluster (two idle workers: twice).
    """

    role: Role
    hash: str
    signature: tuple[str, ...]
    ranks: tuple[int, ...]
    healthy: bool


@dataclass(frozen=True)
class Verdict:
    """What the analyzer concluded and why (``reasons``: sentences, most important first).

    ``kind``: ``"outliers"`` (stack aggregation found outliers; evict ``group_nodes``),
    ``"convicted"`` (fail-slow rounds convicted a group), or ``"inconclusive"`` (do nothing on this
    evidence; ``group_kind`` is ``"none"``; ``outlier_ranks`` may still name suspects). ``missing``
    lists the evidence that could not be had; ``missing_ranks`` those ranks whose main process could
    not be seen (never in ``healthy_ranks``).
    """

    kind: VerdictKind
    outlier_ranks: tuple[int, ...]
    outlier_nodes: tuple[str, ...]
    group_kind: GroupKind
    group_ranks: tuple[int, ...]
    group_nodes: tuple[str, ...]
    dominant_stack: tuple[str, ...]
    outlier_stacks: Mapping[int, tuple[str, ...]]
    missing: tuple[MissingEvidence, ...]
    reasons: tuple[str, ...]
    outlier_roles: Mapping[int, tuple[Role, ...]] = field(default_factory=dict)
    missing_ranks: tuple[int, ...] = ()
    healthy_ranks: tuple[int, ...] = ()
    clusters: tuple[Cluster, ...] = ()

    @property
    def actionable(self) -> bool:
        """True when the verdict names a group to evict."""
        return self.kind != "inconclusive" and self.group_kind != "none"


@dataclass(frozen=True, slots=True)
class AggregationSettings:
    """``healthy_fraction``: a cluster with more than this share of the largest cluster's ranks is
    healthy (so equal clusters are always all healthy). ``keep_lines``: signatures include line numbers. ``job_fraction``: a covering group with
    more than this share of the world becomes the whole job. ``max_listed``: clusters / ranks named in
    one reason before "and N more".
    """

    healthy_fraction: float = 0.5
    keep_lines: bool = True
    job_fraction: float = 0.5
    max_listed: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.healthy_fraction < 1:
            raise ValueError(f"healthy_fraction must be in (0, 1), got {self.healthy_fraction}")
        if not 0 < self.job_fraction <= 1:
            raise ValueError(f"job_fraction must be in (0, 1], got {self.job_fraction}")


@dataclass(frozen=True, slots=True)
class GroupChoice:
    """The group chosen to cover a set of ranks, with the candidates weighed."""

    kind: GroupKind
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    reasons: tuple[str, ...]


# ------------------------------------------------------------------------------------------- helpers


def format_ranks(ranks: Iterable[int], limit: int = 8) -> str:
    """``[0-3, 7, 9]``: sorted, runs compressed, at most ``limit`` runs then ``... (N ranks)``."""
    rs = sorted(set(ranks))
    runs: list[tuple[int, int]] = []
    for r in rs:
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:limit])
    if len(runs) > limit:
        text += f", ... ({len(rs)} ranks)"
    return f"[{text}]"


def _innermost(sig: Sequence[str]) -> str:
    return sig[-1] if sig else "(no Python thread)"


def _clusters(role: Role, items: Iterable[tuple[int, tuple[str, ...], str]], fraction: float) -> list[Cluster]:
    """Clusters of (rank, signature, hash) items, largest first (then by hash), healthy flag set."""
    by_hash: dict[str, tuple[tuple[str, ...], list[int]]] = {}
    for rank, sig, h in items:
        entry = by_hash.get(h)
        if entry is None:
            entry = by_hash[h] = (sig, [])
        entry[1].append(rank)
    ordered = sorted(by_hash.items(), key=lambda kv: (-len(kv[1][1]), kv[0]))
    if not ordered:
        return []
    largest = len(ordered[0][1][1])
    return [Cluster(role, h, sig, tuple(sorted(ranks)), len(ranks) > fraction * largest)
            for h, (sig, ranks) in ordered]


def _describe(clusters: Sequence[Cluster], limit: int) -> str:
    parts = [f"{c.hash} x{len(c.ranks)} at {_innermost(c.signature)!r} ({'healthy' if c.healthy else 'outlier'})"
             for c in clusters[:limit]]
    if len(clusters) > limit:
        parts.append(f"and {len(clusters) - limit} more")
    return "; ".join(parts)


def _why_no_outliers(role: Role, clusters: Sequence[Cluster], n: int) -> str:
    what = "main processes" if role == "rank" else f"{role} processes"
    if len(clusters) == 1:
        return f"all {n} observed {what} show the same stack ({clusters[0].hash} at {_innermost(clusters[0].signature)!r})"
    sizes = sorted({len(c.ranks) for c in clusters})
    if len(sizes) == 1:
        return f"the {what} form {len(clusters)} clusters of equal size {sizes[0]}: no majority, so no outlier"
    return (f"the {what} form {len(clusters)} clusters, each holding enough of the largest's "
            f"{len(clusters[0].ranks)} to count as healthy (sizes {sorted((len(c.ranks) for c in clusters), reverse=True)})")


def _fragile(clusters: Sequence[Cluster], n_missing: int, fraction: float) -> list[str]:
    """How the missing evidence could change which clusters are healthy (empty: it cannot)."""
    if n_missing == 0 or not clusters:
        return []
    largest = len(clusters[0].ranks)
    out = []
    for c in clusters:
        if not c.healthy and len(c.ranks) + n_missing > fraction * largest:
            out.append(f"outlier cluster {c.hash} ({len(c.ranks)}) would count as healthy if the {n_missing} "
                       f"unseen were like it")
        if c.healthy and c is not clusters[0] and len(c.ranks) <= fraction * (largest + n_missing):
            out.append(f"healthy cluster {c.hash} ({len(c.ranks)}) would be an outlier if the {n_missing} "
                       f"unseen joined the largest")
    return out


def _group_cost(ranks: Collection[int], topology: Topology, cache: dict[int, int]) -> int:
    key = id(ranks)
    n = cache.get(key)
    if n is None:
        n = cache[key] = len(topology.nodes_of(ranks))
    return n


def covering_group(outliers: Collection[int], topology: Topology, job_fraction: float = 0.5) -> GroupChoice:
    """The smallest parallel group covering every rank of ``outliers``, and why.

    Candidates: each single group of the first outlier (its TP group, PP group, DP group, node) that
    contains all outliers, and the union of a greedy cover (for the lowest uncovered outlier, the group
    of its four covering the most uncovered outliers per node). The winner has the fewest nodes, then
    the fewest ranks; a single group beats the union on a tie, and single groups tie-break in the
    order tp, pp, dp, node. A winner with more than ``job_fraction`` of the world's ranks becomes
    ``"job"`` (every rank). No outliers: kind ``"none"``.
    """
    outs = sorted(set(outliers))
    if not outs:
        return GroupChoice("none", (), (), ("no outlier: no group to evict",))
    for r in outs:
        if r not in topology.placements:
            raise ValueError(f"outlier rank {r} is not in the topology (world size {topology.world_size})")
    cost_cache: dict[int, int] = {}
    out_set = set(outs)
    candidates: list[tuple[int, int, int, GroupKind, tuple[int, ...]]] = []
    considered = []
    for order, (kind, group) in enumerate(topology.groups_of(outs[0]).items()):
        members = set(group)
        covers = out_set <= members
        nodes = _group_cost(group, topology, cost_cache)
        considered.append(f"{kind} {format_ranks(group, 4)} ({len(group)} ranks, {nodes} nodes)"
                          f"{'' if covers else ' does not cover all'}")
        if covers:
            candidates.append((nodes, len(group), order, kind, tuple(sorted(group))))
    # greedy cover by per-outlier groups
    uncovered = set(outs)
    picks: list[tuple[GroupKind, tuple[int, ...]]] = []
    while uncovered:
        o = min(uncovered)
        best = None
        for order, (kind, group) in enumerate(topology.groups_of(o).items()):
            covered = len(uncovered.intersection(group))
            nodes = _group_cost(group, topology, cost_cache)
            key = (-covered / nodes, -covered, nodes, len(group), order)
            if best is None or key < best[0]:
                best = (key, kind, group)
        assert best is not None
        picks.append((best[1], tuple(best[2])))
        uncovered.difference_update(best[2])
    union = tuple(sorted({r for _, g in picks for r in g}))
    union_nodes = len(topology.nodes_of(union))
    reasons = []
    if candidates:
        nodes, size, _, kind, group = min(candidates)
        choice_kind: GroupKind = kind
        choice = group
        if len(picks) > 1 and (union_nodes, len(union)) < (nodes, size):
            choice_kind, choice = "groups", union
            reasons.append(
                f"the {len(picks)} groups {', '.join(f'{k} {format_ranks(g, 4)}' for k, g in picks)} cover the outliers "
                f"with {union_nodes} nodes, fewer than the smallest single covering group ({kind}, {nodes} nodes)")
        else:
            reasons.append(f"{kind} group {format_ranks(group)} is the smallest single group covering outliers "
                           f"{format_ranks(outs)}: {size} ranks on {nodes} node(s)")
    else:
        choice_kind = "groups" if len(picks) > 1 else picks[0][0]
        choice = union
        reasons.append(
            f"no single TP, PP, DP group or node covers outliers {format_ranks(outs)}; the union of "
            f"{', '.join(f'{k} {format_ranks(g, 4)}' for k, g in picks)} does ({len(union)} ranks on {union_nodes} nodes)")
    reasons.append("groups of the lowest outlier weighed: " + "; ".join(considered))
    if len(choice) > job_fraction * topology.world_size:
        reasons.append(f"that group holds {len(choice)} of {topology.world_size} ranks, more than "
                       f"{job_fraction:.0%}: the whole job")
        choice_kind, choice = "job", tuple(range(topology.world_size))
    nodes_t = topology.nodes_of(choice)
    healthy_inside = len(choice) - len(out_set)
    if healthy_inside > 0:
        reasons.append(f"deliberate over-eviction: {healthy_inside} rank(s) of the group showed no fault "
                       f"and leave with it, for a restart within minutes instead of a diagnosis")
    return GroupChoice(choice_kind, choice, nodes_t, tuple(reasons))


# ----------------------------------------------------------------------------------------- aggregate


class _VerdictContext(TypedDict):
    """What every verdict of one ``aggregate`` call shares (``_inconclusive``'s keyword arguments)."""

    topology: Topology
    dominant: tuple[str, ...]
    missing: tuple[MissingEvidence, ...]
    missing_ranks: tuple[int, ...]
    healthy: tuple[int, ...]
    clusters: tuple[Cluster, ...]


def _inconclusive(reasons: list[str], *, outliers: Sequence[int] = (), topology: Topology, dominant: tuple[str, ...],
                  outlier_stacks: Mapping[int, tuple[str, ...]] | None = None,
                  outlier_roles: Mapping[int, tuple[Role, ...]] | None = None, missing: tuple[MissingEvidence, ...],
                  missing_ranks: tuple[int, ...], healthy: tuple[int, ...], clusters: tuple[Cluster, ...]) -> Verdict:
    return Verdict(
        kind="inconclusive", outlier_ranks=tuple(outliers), outlier_nodes=topology.nodes_of(outliers),
        group_kind="none", group_ranks=(), group_nodes=(), dominant_stack=dominant,
        outlier_stacks=dict(outlier_stacks or {}), missing=missing, reasons=tuple(reasons),
        outlier_roles=dict(outlier_roles or {}), missing_ranks=missing_ranks, healthy_ranks=healthy,
        clusters=clusters,
    )


def aggregate(
    processes: Iterable[ProcessStacks],
    topology: Topology,
    missing: Iterable[MissingEvidence] = (),
    settings: AggregationSettings = AggregationSettings(),
) -> Verdict:
    """Stack aggregation over every rank's process tree (module docstring: the method).

    ``processes``: every captured process, each with its ``rank`` and ``role`` (exactly one ``"rank"``
    process per seen rank). ``missing``: what could not be captured. A rank of the topology with
    neither is reported missing too ("no evidence received"). Raises ``ValueError`` for inconsistent
    input (a process without a rank or outside the topology, two main processes for one rank, a rank
    both seen and reported missing).
    """
    signer = Signer(settings.keep_lines)
    frac = settings.healthy_fraction
    limit = settings.max_listed
    main_items: list[tuple[int, tuple[str, ...], str]] = []
    child_items: dict[Role, list[tuple[int, tuple[str, ...], str]]] = {}
    seen: set[int] = set()
    world = topology.world_size
    for proc in processes:
        r = proc.rank
        if r is None or not 0 <= r < world:
            raise ValueError(f"process {proc.pid} ({proc.role}) has rank {r!r}, not a rank of this {world}-rank job")
        sig, h = signer.process(proc)
        if proc.role == "rank":
            if r in seen:
                raise ValueError(f"rank {r} has two main processes (pid {proc.pid} and another)")
            seen.add(r)
            main_items.append((r, sig, h))
        else:
            child_items.setdefault(proc.role, []).append((r, sig, h))

    missing_list = list(missing)
    missing_main: dict[int, MissingEvidence] = {}
    for m in missing_list:
        if not 0 <= m.rank < world:
            raise ValueError(f"missing evidence for rank {m.rank}, not a rank of this {world}-rank job")
        if m.role == "rank":
            if m.rank in seen:
                raise ValueError(f"rank {m.rank}'s main process is both captured and reported missing")
            missing_main.setdefault(m.rank, m)
    if len(seen) + len(missing_main) < world:
        for r in range(world):
            if r not in seen and r not in missing_main:
                m = MissingEvidence(r, "rank", None, "no stack evidence received")
                missing_main[r] = m
                missing_list.append(m)
    missing_t = tuple(sorted(missing_list, key=lambda m: (m.rank, ROLES.index(m.role), m.pid or 0)))
    missing_ranks = tuple(sorted(missing_main))

    reasons: list[str] = []
    if missing_ranks:
        why = sorted({m.reason for m in missing_main.values()})
        reasons.append(f"{len(missing_ranks)} rank(s) {format_ranks(missing_ranks, limit)} could not be seen "
                       f"({'; '.join(why[:3])}{'; ...' if len(why) > 3 else ''}): counted neither healthy nor outlier")
    missing_children = [m for m in missing_list if m.role != "rank"]
    if missing_children:
        reasons.append(f"{len(missing_children)} child process(es) of rank(s) "
                       f"{format_ranks({m.rank for m in missing_children}, limit)} could not be seen")

    main_clusters = _clusters("rank", main_items, frac)
    if not main_clusters:
        return _inconclusive(["no rank's main process could be seen: nothing to compare", *reasons],
                             topology=topology, dominant=(), missing=missing_t, missing_ranks=missing_ranks,
                             healthy=(), clusters=())
    dominant = main_clusters[0].signature
    all_clusters: list[Cluster] = list(main_clusters)
    reasons.append(f"main-process stacks of {len(main_items)} rank(s) form {len(main_clusters)} cluster(s): "
                   f"{_describe(main_clusters, limit)}; a cluster is healthy with more than {frac:.0%} of the "
                   f"largest's {len(main_clusters[0].ranks)} ranks")

    outlier_roles: dict[int, list[Role]] = {}
    outlier_stacks: dict[int, tuple[str, ...]] = {}
    fragile: list[str] = []
    no_outlier_reasons: list[str] = []

    main_out = [c for c in main_clusters if not c.healthy]
    if main_out:
        for c in main_out:
            for r in c.ranks:
                outlier_roles.setdefault(r, []).append("rank")
                outlier_stacks[r] = c.signature
        fragile += _fragile(main_clusters, len(missing_ranks), frac)
    else:
        no_outlier_reasons.append(_why_no_outliers("rank", main_clusters, len(main_items)))

    for role in ROLES[1:]:
        items = child_items.get(role)
        if not items:
            continue
        clusters = _clusters(role, items, frac)
        all_clusters += clusters
        outs = [c for c in clusters if not c.healthy]
        if not outs:
            if len(clusters) > 1:
                no_outlier_reasons.append(_why_no_outliers(role, clusters, len(items)))
            continue
        reasons.append(f"{role} process stacks ({len(items)}) form {len(clusters)} cluster(s): {_describe(clusters, limit)}")
        for c in outs:
            for r in sorted(set(c.ranks)):
                roles = outlier_roles.setdefault(r, [])
                if role not in roles:
                    roles.append(role)
                outlier_stacks.setdefault(r, c.signature)
        fragile += _fragile(clusters, sum(1 for m in missing_children if m.role == role), frac)

    outliers = tuple(sorted(outlier_roles))
    roles_t = {r: tuple(v) for r, v in outlier_roles.items()}
    out_set = set(outliers)
    healthy = tuple(r for c in main_clusters if c.healthy for r in c.ranks if r not in out_set)
    healthy = tuple(sorted(healthy))
    common = _VerdictContext(topology=topology, dominant=dominant, missing=missing_t, missing_ranks=missing_ranks,
                             healthy=healthy, clusters=tuple(all_clusters))

    if not outliers:
        head = "inconclusive: " + "; ".join(no_outlier_reasons)
        if missing_ranks:
            head += f"; the unseen rank(s) {format_ranks(missing_ranks, limit)} may hold the fault"
        return _inconclusive([head, *reasons], **common)

    for r in outliers:
        bits = []
        for role in roles_t[r]:
            if role == "rank":
                bits.append(f"its main process is at {_innermost(outlier_stacks[r])!r}")
            else:
                bits.append(f"a {role} process differs from the other ranks'")
        if len(outliers) <= limit or r == outliers[0]:
            reasons.append(f"rank {r} is an outlier: {'; '.join(bits)} (the majority is at {_innermost(dominant)!r})")
    if len(outliers) > limit:
        reasons.append(f"{len(outliers)} outlier ranks in all: {format_ranks(outliers, limit)}")

    if fragile:
        return _inconclusive(
            [f"inconclusive: the missing evidence could change the majority ({'; '.join(fragile[:3])})", *reasons],
            outliers=outliers, outlier_stacks=outlier_stacks, outlier_roles=roles_t, **common)

    choice = covering_group(outliers, topology, settings.job_fraction)
    head = (f"{len(outliers)} outlier rank(s) {format_ranks(outliers, limit)} on node(s) "
            f"{', '.join(topology.nodes_of(outliers)[:limit])}: evict {choice.kind} group of {len(choice.ranks)} "
            f"rank(s) on node(s) {', '.join(choice.nodes[:limit])}{' ...' if len(choice.nodes) > limit else ''}")
    return Verdict(
        kind="outliers", outlier_ranks=outliers, outlier_nodes=topology.nodes_of(outliers),
        group_kind=choice.kind, group_ranks=choice.ranks, group_nodes=choice.nodes, dominant_stack=dominant,
        outlier_stacks=outlier_stacks, missing=missing_t, reasons=(head, *reasons, *choice.reasons),
        outlier_roles=roles_t, missing_ranks=missing_ranks, healthy_ranks=healthy, clusters=tuple(all_clusters),
    )
