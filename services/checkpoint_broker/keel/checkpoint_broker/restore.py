"""Commits and restore plans: which steps are complete in a tier, and where each rank restores from.

- **Commits** (``decide_commit``): from ``CheckpointShardsStored``, the newest step for which every rank
  has a shard in a tier -> ``CheckpointStepCommitted`` (once per tier and step, monotonically increasing
  within a history: a restore plan to step P winds the memory and peer tiers' commits back to before P,
  because the resumed generation writes those steps anew; the disk tier's persisted steps stay).
- **Restore** (``plan_restore``, pure maths over the inventories): once every node's inventory for a
  generation arrived (or the wait timed out; ``decide_restore``: longer, up to ``restore_plan_max_wait``,
  while a node not known lost is missing and planning without it would restore a step older than the
  newest memory or peer commit), the newest step every rank can restore, each rank from its fastest
  reachable tier (memory, a peer's copy, disk) ->
  ``CheckpointRestorePlanned`` plus one ``CheckpointTierFallback`` per rank that cannot use its memory.
  Each rank's source goes to the node that runs it, on that node's subject (``CheckpointNodeRestorePlanned``,
  ``node_parts``): the job-wide plan is a summary whose size does not grow with the job.
  After an anomaly (a NaN or a spike at step s), only steps below s are candidates.

No I/O, no clock: the wait times out on the job clock's ``TimerTicked`` (``keel.infra.clock``), an event.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from keel.checkpoint_broker.parts import PART_BUDGET_BYTES, split
from keel.checkpoint_broker.placement import ranks_text
from keel.checkpoint_broker.state import BrokerPolicy, JobState, PersistedStep, RestoreWait
from keel.events.types import (
    CheckpointInventoryReported,
    CheckpointNodeRestorePlanned,
    CheckpointRestorePlanned,
    CheckpointShardsStored,
    CheckpointStepCommitted,
    CheckpointTier,
    CheckpointTierFallback,
    RestoreSource,
)
from keel.kernel.decider import Decision, Proposal

TIERS: tuple[CheckpointTier, ...] = ("memory", "peer", "disk")
"""The tiers, fastest to restore from first."""


@dataclass(frozen=True)
class RestorePlan:
    """A restore plan: the step to resume after, each rank's source, the fallbacks taken and why."""

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
    owner_digests: Mapping[int, Mapping[int, Collection[str]]] | None = None,
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

    Only copies the rank's own node vouched for count: a copy of rank ``r`` at step ``s`` is a candidate
    only when its digest is one the node running ``r`` reported for ``s``: in ``owner_digests`` (its
    earlier reports, ``JobState.owner_digests``), or among the memory entries of its inventory here
    (the owner: ``previous_nodes[r]``, else ``targets[r]``). A holder's copy with any other digest (a
    planted or stale backup) is never restored, whatever the holder claims; it is left out as if absent.
    """
    previous_nodes = previous_nodes or {}
    reported: dict[int, dict[int, set[str]]] = {
        rank: {step: set(digests) for step, digests in by_step.items()} for rank, by_step in (owner_digests or {}).items()}
    for node, inventory in inventories.items():
        for entry in inventory.entries:
            if entry.tier == "memory" and node == previous_nodes.get(entry.rank, targets.get(entry.rank)):
                reported.setdefault(entry.rank, {}).setdefault(entry.step, set()).add(entry.digest)
    inventories = {node: inv.model_copy(update={"entries": [
        e for e in inv.entries if e.digest in reported.get(e.rank, {}).get(e.step, ())]})
        for node, inv in inventories.items()}
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


# -- the decisions -----------------------------------------------------------------------------------


def decide_commit(job: JobState, p: CheckpointShardsStored, subject: str) -> Decision:
    """Commit the newest step of ``p.tier`` that every rank now has a shard of (an empty reason: none)."""
    if job.world_size <= 0:
        return Decision("")
    by_step = job.shards.get(p.tier, {})
    committed = job.committed.get(p.tier, -1)
    for step in sorted({r.step for r in p.shards if r.step > committed}, reverse=True):
        records = by_step.get(step, {})
        if all(r in records for r in range(job.world_size)):
            total = sum(records[r].bytes for r in range(job.world_size))
            payload = CheckpointStepCommitted(tier=p.tier, step=step, ranks=job.world_size, bytes=total)
            reason = (f"every one of {job.world_size} ranks has a verified {p.tier} shard of step {step} "
                      f"({total} bytes); previous {p.tier} commit: {committed if committed >= 0 else 'none'}")
            return Decision(reason, (Proposal(payload, subject=subject, key=f"commit/{p.tier}/{step}"),))
    return Decision("")


def decide_restore(job: JobState, now: datetime, policy: BrokerPolicy, subject: str) -> Decision:
    """Plan the newest pending restart's restore once every node it needs reported its inventory or
    ``now`` passed the wait's deadline; until then only a reason (empty: no restore pending)."""
    pending = [g for g in job.restores if g not in job.planned]
    if not pending:
        return Decision("")
    generation = max(pending)  # an older restart still waiting is superseded by the newer one
    wait = job.restores[generation]
    new_world = max((inventory.world_size for inventory in wait.inventories.values()), default=0)
    if new_world and job.world_size and new_world != job.world_size:
        return decide_reshard_restore(job, generation, wait, new_world, now, policy, subject)
    targets = restore_targets(job, wait)
    expected = {targets.get(r) for r in range(job.world_size)}
    missing_nodes = sorted(n for n in expected if n is not None and n not in wait.inventories)
    unknown = [r for r in range(job.world_size) if r not in targets]
    complete = job.world_size > 0 and not missing_nodes and not unknown
    if not complete and now < wait.deadline:
        waiting_for = ", ".join(missing_nodes) or f"the nodes of ranks {ranks_text(unknown)}"
        return Decision(f"generation {generation}: waiting for inventories from {waiting_for}")
    timeout = policy.restore_plan_timeout.total_seconds()
    if complete:
        waited = f"inventories from all {len(wait.inventories)} node(s) arrived"
    else:
        absent = ", ".join(missing_nodes) or "none"
        waited = (f"planned after the {timeout:g}s wait with {len(wait.inventories)} inventory(ies); "
                  f"absent: {absent}" + (f"; no node known for ranks {ranks_text(unknown)}" if unknown else ""))
    plan = plan_restore(generation, job.world_size, targets, wait.inventories, job.addresses, job.persisted,
                        previous_nodes={r: s.node_id for r, s in job.sites.items()}, waited=waited,
                        below=(job.restore_below, job.restore_below_reason) if job.restore_below is not None
                        else None, owner_digests=job.owner_digests)
    if not complete:
        # The wait's deadline counts from the first inventory, often a promoted standby's (it has no ranks
        # to stop) while the survivors are still stopping theirs. Planning without a node that is not known
        # lost, when that would restore an older step than one committed in memory or on the peer tier,
        # throws committed steps away for a late report: wait longer, up to restore_plan_max_wait.
        promised, tier = max((job.committed.get(t, -1), t) for t in ("memory", "peer"))
        if job.restore_below is not None and promised >= job.restore_below:
            promised = -1  # the anomaly rules those steps out anyway
        late = [n for n in missing_nodes if n not in job.left]
        longest = wait.deadline - policy.restore_plan_timeout + policy.restore_plan_max_wait
        if plan.step < promised and late and now < longest:
            return Decision(
                f"generation {generation}: the {timeout:g}s wait for inventories ended without {', '.join(late)} "
                f"(not known lost); planning now would restore step {plan.step}, older than step {promised} "
                f"committed on the {tier} tier: waiting longer, until {longest.isoformat()}")
    parts, unplaced = node_parts(plan, targets, policy.part_budget_bytes)
    payload = CheckpointRestorePlanned(generation=generation, step=plan.step, sources=unplaced, reason=plan.reason,
                                       ranks=len(plan.sources), tiers=dict(sorted(Counter(s.tier for s in plan.sources).items())),
                                       node_parts=len(parts))
    # The parts first: an agent that has the plan has (in stream order) every part addressed to it.
    proposals = [Proposal(part, subject=f"node/{part.node_id}", key=f"plan/{generation}/{part.node_id}/{part.part}")
                 for part in parts]
    proposals.append(Proposal(payload, subject=subject, key=f"plan/{generation}"))
    proposals += [Proposal(f, subject=subject, key=f"fallback/{generation}/{f.rank}") for f in plan.fallbacks]
    return Decision(plan.reason, tuple(proposals))


def decide_reshard_restore(job: JobState, generation: int, wait: RestoreWait, new_world: int, now: datetime,
                           policy: BrokerPolicy, subject: str) -> Decision:
    """The restore of a job restarted on another world size (the controller's shrink): the newest step
    every *saved* rank (``job.world_size``, the size its ranks registered with) holds, each saved rank's
    source from its fastest tier, all in the job-wide plan (``reshard_from``): every node stages every
    saved rank's shard and each new rank loads its part resharded. Waits until the inventories name a node
    for every new rank, or the wait's deadline."""
    old_world = job.world_size
    covered = {r for inventory in wait.inventories.values() if inventory.world_size == new_world
               for r in inventory.ranks}
    missing = [r for r in range(new_world) if r not in covered]
    if missing and now < wait.deadline:
        return Decision(f"generation {generation}: the job shrinks from {old_world} to {new_world} ranks; waiting "
                        f"for the inventories of the nodes of new ranks {ranks_text(missing)}")
    waited = (f"inventories from all {len(wait.inventories)} node(s) arrived" if not missing else
              f"planned after the {policy.restore_plan_timeout.total_seconds():g}s wait without the nodes of new "
              f"ranks {ranks_text(missing)}")
    saved_nodes = {r: s.node_id for r, s in job.sites.items() if r < old_world}
    plan = plan_restore(generation, old_world, saved_nodes, wait.inventories, job.addresses, job.persisted,
                        previous_nodes=saved_nodes, waited=waited,
                        below=(job.restore_below, job.restore_below_reason) if job.restore_below is not None
                        else None, owner_digests=job.owner_digests)
    # Every node reads every source: a memory slot on another node is fetched from its shard store too.
    sources = [s if s.tier == "disk" else s.model_copy(update={"address": job.addresses.get(s.node_id, s.address)})
               for s in plan.sources]
    resharded = plan.step >= 0
    reason = (f"generation {generation}: the job shrank from {old_world} to {new_world} ranks"
              + (f": every node stages step {plan.step} of all {old_world} saved ranks and each new rank loads its "
                 f"part resharded; " if resharded else "; ") + plan.reason)
    payload = CheckpointRestorePlanned(generation=generation, step=plan.step, sources=sources, reason=reason,
                                       ranks=len(sources), tiers=dict(sorted(Counter(s.tier for s in sources).items())),
                                       node_parts=0, reshard_from=old_world if resharded else 0)
    proposals = [Proposal(payload, subject=subject, key=f"plan/{generation}")]
    proposals += [Proposal(f, subject=subject, key=f"fallback/{generation}/{f.rank}") for f in plan.fallbacks]
    return Decision(reason, tuple(proposals))


def node_parts(plan: RestorePlan, targets: Mapping[int, str], budget_bytes: int = PART_BUDGET_BYTES,
               ) -> tuple[list[CheckpointNodeRestorePlanned], list[RestoreSource]]:
    """``plan``'s sources by the node that runs each rank (``targets``): every node's parts (nodes in
    sorted order, each split under ``budget_bytes``), and the sources of ranks no node is known to
    run (they stay in the job-wide plan, where every agent reads them)."""
    by_node: dict[str, list[RestoreSource]] = {}
    unplaced: list[RestoreSource] = []
    for source in plan.sources:
        node = targets.get(source.rank)
        if node:
            by_node.setdefault(node, []).append(source)
        else:
            unplaced.append(source)
    parts = []
    for node in sorted(by_node):
        chunks = split(by_node[node], budget_bytes)
        parts += [CheckpointNodeRestorePlanned(node_id=node, generation=plan.generation, step=plan.step,
                                               sources=chunk, part=i, parts=len(chunks))
                  for i, chunk in enumerate(chunks)]
    return parts, unplaced


def joined_sources(plan: CheckpointRestorePlanned, parts: Iterable[CheckpointNodeRestorePlanned]) -> list[RestoreSource]:
    """Every rank's source of ``plan``, from the plan itself (version 1: all of them) and its nodes'
    ``parts`` (those of other plans are ignored), by rank."""
    sources = {s.rank: s for s in plan.sources}
    for part in parts:
        if part.generation == plan.generation and part.step == plan.step:
            sources.update({s.rank: s for s in part.sources})
    return [sources[r] for r in sorted(sources)]


def restore_targets(job: JobState, wait: RestoreWait) -> dict[int, str]:
    """Which node runs each rank in ``wait.generation``: what the inventories claim, else
    ``RankStarted`` of that generation, else the last registration."""
    targets = {r: s.node_id for r, s in job.sites.items()}
    if job.started_generation == wait.generation:
        targets.update(job.started)
    for node, inventory in sorted(wait.inventories.items()):
        targets.update({r: node for r in inventory.ranks})
    return targets
