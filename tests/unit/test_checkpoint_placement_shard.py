"""Backup placement with shard groups (issue 19, item 1): under FSDP2 / ZeRO a rank's DP peers in its shard group
hold the *other* parts of its state, not replicas, so a node hosting one is no better a backup than a node hosting
a PP or TP peer. Replica peers (DP peers outside the shard group, HSDP's other replicas) stay the DP fallback, and
jobs without a shard group (DDP) are placed exactly as before (tests/unit/test_checkpoint_broker.py)."""

from __future__ import annotations

import itertools
import json
import random
from datetime import UTC, datetime
from pathlib import Path

import pytest

from keel.checkpoint_broker.decider import CheckpointBrokerDecider
from keel.checkpoint_broker.placement import DISJOINT, ISOLATED, OWN_NODE_ONLY, SHARES_DP, _Topology, place_backups
from keel.checkpoint_broker.state import RankSite
from keel.events.envelope import Event, decode_event
from keel.events.types import (
    CheckpointNodeBackupsAssigned,
    CheckpointRanksRegistered,
    RankGroups,
)
from keel.kernel.decider import DeciderSession

T0 = datetime(2026, 11, 29, 7, 0, tzinfo=UTC)
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "CheckpointRanksRegistered"


def hsdp(replicas: int, shards: int, per_node: int, *, sharded: bool = True) -> list[RankSite]:
    """HSDP on a (replicate, shard) mesh: rank = replica * shards + shard index, consecutive ranks share a node.
    Every rank's DP group is every rank; its shard group is its replica's ranks (``sharded=False``: no shard
    group, as a DDP job registers)."""
    world = replicas * shards
    sites = []
    for r in range(world):
        replica = r // shards
        sites.append(RankSite(rank=r, node_id=f"n{r // per_node}", dp=tuple(range(world)), pp=(r,), tp=(r,),
                              shard=tuple(range(replica * shards, (replica + 1) * shards)) if sharded else ()))
    return sites


def addresses(sites: list[RankSite]) -> dict[str, str]:
    return {n: f"{n}:7301" for n in sorted({s.node_id for s in sites})}


def expected_level(site: RankSite, candidate: str, sites: list[RankSite]) -> int | None:
    """The placement rule with shard groups, restated independently of the implementation."""
    if candidate == site.node_id:
        return None
    node_of = {s.rank: s.node_id for s in sites}
    groups = {g for s in sites for g in (s.dp, s.pp, s.tp, s.shard)}
    if not any({site.node_id, candidate} <= {node_of[m] for m in g} for g in groups):
        return ISOLATED
    hosted = {s.rank for s in sites if s.node_id == candidate}
    if not hosted & (set(site.dp) | set(site.pp) | set(site.tp) | set(site.shard)):
        return DISJOINT
    if not hosted & (set(site.pp) | set(site.tp) | set(site.shard)):
        return SHARES_DP
    return OWN_NODE_ONLY


def check(sites: list[RankSite], nodes: dict[str, str]) -> dict[int, str]:
    """Every rank placed on a best node under the restated rule; deterministic whatever the input order."""
    placed = place_backups(sites, nodes)
    assert [a.rank for a in placed] == [s.rank for s in sorted(sites, key=lambda s: s.rank)]
    for site, a in zip(sorted(sites, key=lambda s: s.rank), placed, strict=True):
        best = min(lvl for n in nodes if (lvl := expected_level(site, n, sites)) is not None)
        assert expected_level(site, a.backup_node_id, sites) == best, (site.rank, a.backup_node_id, best)
    shuffled = sites[:]
    random.Random(3).shuffle(shuffled)
    assert place_backups(shuffled, dict(reversed(list(nodes.items())))) == placed
    return {a.rank: a.backup_node_id for a in placed}


def test_fsdp_on_one_mesh_dimension_a_shard_peer_node_is_no_dp_fallback() -> None:
    # FSDP2 over 4 ranks on 2 nodes: the only other node hosts shard peers (the DP group is the shard group).
    fsdp = [RankSite(r, f"n{r // 2}", dp=(0, 1, 2, 3), pp=(r,), tp=(r,), shard=(0, 1, 2, 3)) for r in range(4)]
    ddp = [RankSite(r, f"n{r // 2}", dp=(0, 1, 2, 3), pp=(r,), tp=(r,)) for r in range(4)]
    topo = _Topology(fsdp)
    assert topo.level(topo.signature(fsdp[0]), "n1") == OWN_NODE_ONLY
    ddp_topo = _Topology(ddp)
    assert ddp_topo.level(ddp_topo.signature(ddp[0]), "n1") == SHARES_DP  # replicas: the DP fallback, as before
    [a0, *_] = place_backups(fsdp, addresses(fsdp))
    assert a0.backup_node_id == "n1"  # still backed up: the only other node
    assert a0.fallback == ("every other node holds a PP, TP or shard-group peer of rank 0; n1 is only not its own node "
                           "(shares ranks 2-3 of its shard group; its shard group 0-3 holds the other parts of its "
                           "state, not copies): losing that group loses both copies")
    [d0, *_] = place_backups(ddp, addresses(ddp))
    assert d0.backup_node_id == "n1" and "shares only its DP group" in d0.fallback and "shard" not in d0.fallback


def test_hsdp_2x2_backups_go_to_the_other_replica_never_a_shard_peer_while_a_replica_node_exists() -> None:
    sites = hsdp(replicas=2, shards=2, per_node=1)  # n0, n1: replica 0 (ranks 0, 1); n2, n3: replica 1
    nodes = addresses(sites)
    backup = check(sites, nodes)
    replica_nodes = {0: {"n0", "n1"}, 1: {"n2", "n3"}}
    for r, node in backup.items():
        assert node not in replica_nodes[r // 2], (r, node)  # not a shard peer's node
    assert sorted(backup.values()) == ["n0", "n1", "n2", "n3"]  # one each: spread
    [a0] = [a for a in place_backups(sites, nodes) if a.rank == 0]
    assert a0.fallback == ("every other node holds a DP, PP, TP or shard-group peer of rank 0; n2 shares only its DP "
                           "group (ranks 2, replicas outside its shard group 0-1), never its PP, TP or shard group")
    # Without shard groups (as v1 registrations are read) the same layout puts rank 0 next door, on n1.
    assert check(hsdp(2, 2, 1, sharded=False), nodes)[0] == "n1"
    # The other replica's nodes gone: only then the shard peer's node, and the fallback says why.
    left = {n: a for n, a in nodes.items() if n in replica_nodes[0]}
    [a0, a1] = place_backups([s for s in sites if s.node_id in left], left)
    assert (a0.backup_node_id, a1.backup_node_id) == ("n1", "n0")
    assert "shard-group peer of rank 0" in a0.fallback and "of its shard group" in a0.fallback


def test_hsdp_with_two_ranks_per_node_keeps_every_backup_in_the_other_replica() -> None:
    sites = hsdp(replicas=2, shards=4, per_node=2)  # replica 0 on n0, n1; replica 1 on n2, n3
    backup = check(sites, addresses(sites))
    assert all((node in {"n2", "n3"}) == (r < 4) for r, node in backup.items()), backup


@pytest.mark.parametrize("dp, pp, tp, per_node", [(4, 2, 1, 2), (2, 2, 2, 2), (4, 1, 2, 2), (2, 2, 1, 1), (4, 2, 1, 4)])
def test_fsdp_in_megatron_layouts_is_placed_on_the_best_node_of_the_rule(dp: int, pp: int, tp: int, per_node: int) -> None:
    # FSDP2 over the DP dimension of a DP x PP x TP job (TP fastest, then PP, then DP), every group's ranks sorted.
    def rank(d: int, p: int, t: int) -> int:
        return d * pp * tp + p * tp + t

    sites = []
    for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
        group = tuple(rank(x, p, t) for x in range(dp))
        sites.append(RankSite(rank(d, p, t), f"n{rank(d, p, t) // per_node}", dp=group,
                              pp=tuple(rank(d, x, t) for x in range(pp)), tp=tuple(rank(d, p, x) for x in range(tp)),
                              shard=group))
    placed = place_backups(sites, addresses(sites))
    check(sites, addresses(sites))
    assert not any("shares only its DP group" in a.fallback for a in placed)  # DP peers are shard peers here


def _registration(node: str, ranks: list[RankSite]) -> Event:
    return Event.create(CheckpointRanksRegistered(
        node_id=node, generation=0, world_size=4, store_address=f"{node}:7301",
        ranks=[RankGroups(rank=s.rank, dp=list(s.dp), pp=list(s.pp), tp=list(s.tp), shard=list(s.shard))
               for s in ranks]), job_id="job1", subject=f"node/{node}", producer="agent", occurred_at=T0)


def test_the_broker_folds_shard_groups_from_registrations_and_places_by_them() -> None:
    sites = hsdp(replicas=2, shards=2, per_node=1)
    session = DeciderSession(CheckpointBrokerDecider())
    emitted = [e for s in sites for e in session.observe(_registration(s.node_id, [s])).emitted]
    assert session.state.jobs["job1"].sites[0].shard == (0, 1)
    assigned = {a.rank: a.backup_node_id for e in emitted if isinstance(e.payload, CheckpointNodeBackupsAssigned)
                for a in e.payload.assignments}
    assert assigned == check(sites, addresses(sites))
    assert assigned[0] in {"n2", "n3"} and assigned[2] in {"n0", "n1"}


def test_a_version_1_registration_is_upcast_without_shard_groups() -> None:
    doc = json.loads((GOLDEN / "v1.json").read_text())
    event = decode_event(json.dumps(doc["envelope"]).encode(), max_bytes=256 * 1024)
    assert isinstance(event.payload, CheckpointRanksRegistered) and event.schema_version == 2
    assert [g.shard for g in event.payload.ranks] == [[], []]
    assert [g.dp for g in event.payload.ranks] == [[0, 2], [1, 3]]  # everything else as sent
    assert RankSite.from_groups(event.payload.ranks[0], "n01") == RankSite(0, "n01", (0, 2), (0, 1), (0,), ())
    v2 = json.loads((GOLDEN / "v2.json").read_text())
    current = decode_event(json.dumps(v2["envelope"]).encode(), max_bytes=256 * 1024)
    assert [g.shard for g in current.payload.ranks] == [[0, 1], [0, 1]]
