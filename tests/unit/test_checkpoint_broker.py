"""The checkpoint broker's pure core: placement, commits, Young's schedule and restore plans."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from keel.checkpoint_broker.decider import CheckpointBrokerDecider
from keel.checkpoint_broker.placement import place_backups, ranks_text
from keel.checkpoint_broker.restore import joined_sources, plan_restore
from keel.checkpoint_broker.schedule import backup_interval, mtbf_estimate, young_interval
from keel.checkpoint_broker.state import BrokerPolicy, PersistedStep, RankSite
from keel.events.envelope import Event, EventPayload
from keel.events.types import (
    CheckpointBackupAssigned,
    CheckpointBackupFailed,
    CheckpointInventoryReported,
    CheckpointNodeBackupsAssigned,
    CheckpointNodeBackupsHeld,
    CheckpointNodeRestorePlanned,
    CheckpointPersisted,
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    CheckpointScheduleSet,
    CheckpointShardsStored,
    CheckpointStepCommitted,
    CheckpointTierFallback,
    InventoryEntry,
    MetricAnomalyDetected,
    NodeEvicted,
    NodeHeartbeat,
    RankExited,
    RankGroups,
    RejectedShard,
    ShardRecord,
    TimerTicked,
)
from keel.kernel.decider import DeciderSession

T0 = datetime(2026, 11, 29, 7, 0, tzinfo=UTC)
JOB = "job1"


# -- topologies ----------------------------------------------------------------------------------------


def topology(dp: int, pp: int, tp: int, nodes: int) -> list[RankSite]:
    """Megatron order (TP fastest, then PP, then DP); consecutive ranks share a node."""
    world = dp * pp * tp
    assert world % nodes == 0
    per_node = world // nodes

    def rank(d: int, p: int, t: int) -> int:
        return d * pp * tp + p * tp + t

    sites = []
    for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
        r = rank(d, p, t)
        sites.append(RankSite(
            rank=r, node_id=f"n{r // per_node}",
            dp=tuple(rank(x, p, t) for x in range(dp)),
            pp=tuple(rank(d, x, t) for x in range(pp)),
            tp=tuple(rank(d, p, x) for x in range(tp)),
        ))
    return sorted(sites, key=lambda s: s.rank)


def addresses(sites: list[RankSite]) -> dict[str, str]:
    return {n: f"{n}:7301" for n in sorted({s.node_id for s in sites})}


def group_nodes(sites: list[RankSite]) -> list[tuple[tuple[int, ...], set[str]]]:
    node_of = {s.rank: s.node_id for s in sites}
    groups = {tuple(sorted(g)) for s in sites for g in (s.dp, s.pp, s.tp)}
    return [(g, {node_of[m] for m in g}) for g in sorted(groups)]


def expected_level(site: RankSite, candidate: str, sites: list[RankSite]) -> int | None:
    """The placement rule, restated independently of the implementation."""
    if candidate == site.node_id:
        return None
    if not any(site.node_id in nodes and candidate in nodes for _, nodes in group_nodes(sites)):
        return 0
    hosted = {s.rank for s in sites if s.node_id == candidate}
    if not hosted & (set(site.dp) | set(site.pp) | set(site.tp)):
        return 1
    if not hosted & (set(site.pp) | set(site.tp)):
        return 2
    return 3


def check_placement(sites: list[RankSite], nodes: dict[str, str]) -> dict[int, str]:
    assignments = place_backups(sites, nodes)
    by_rank = {a.rank: a for a in assignments}
    assert sorted(by_rank) == [s.rank for s in sites], "every rank gets a backup"
    for site in sites:
        a = by_rank[site.rank]
        assert a.node_id == site.node_id and a.backup_node_id != site.node_id
        assert a.backup_address == nodes[a.backup_node_id]
        best = min(lvl for n in nodes if (lvl := expected_level(site, n, sites)) is not None)
        level = expected_level(site, a.backup_node_id, sites)
        assert level == best, f"rank {site.rank}: level {level}, a level-{best} node exists"
        assert (a.fallback == "") == (level == 0), (site.rank, level, a.fallback)
    backup = {r: a.backup_node_id for r, a in by_rank.items()}
    if all(a.fallback == "" for a in assignments):
        # Evicting any single parallel group (every node hosting one of its ranks) leaves a full copy.
        for group, evicted in group_nodes(sites):
            for site in sites:
                assert site.node_id not in evicted or backup[site.rank] not in evicted, (group, site.rank)
    # Deterministic, whatever the input order.
    shuffled = sites[:]
    random.Random(7).shuffle(shuffled)
    assert place_backups(shuffled, dict(reversed(list(nodes.items())))) == assignments
    return backup


def loads(backup: dict[int, str], nodes: dict[str, str]) -> list[int]:
    return [list(backup.values()).count(n) for n in nodes]


@pytest.mark.parametrize(
    "dp, pp, tp, nodes, all_strict",
    [
        (2, 2, 1, 4, True),
        (2, 2, 1, 2, False),  # every node holds a DP peer: fallback
        (4, 2, 1, 4, False),  # one pipeline per node: DP groups span every node
        (2, 2, 2, 4, True),  # TP inside a node
        (8, 1, 1, 8, False),
        (8, 1, 1, 2, False),
        (1, 4, 1, 4, False),  # one pipeline across every node: only "not its own node" is left
        (2, 4, 1, 8, True),
        (4, 2, 2, 8, True),
        (2, 2, 4, 4, True),
    ],
)
def test_placement_invariants(dp: int, pp: int, tp: int, nodes: int, all_strict: bool) -> None:
    sites = topology(dp, pp, tp, nodes)
    node_map = addresses(sites)
    backup = check_placement(sites, node_map)
    strict = all(a.fallback == "" for a in place_backups(sites, node_map))
    assert strict == all_strict
    counts = loads(backup, node_map)
    assert max(counts) - min(counts) <= 1, counts  # these topologies are symmetric: perfectly balanced


def test_placement_invariants_over_many_topologies() -> None:
    checked = 0
    for dp, pp, tp in itertools.product((1, 2, 3, 4), (1, 2, 4), (1, 2)):
        world = dp * pp * tp
        for nodes in range(2, world + 1):
            if world % nodes == 0:
                check_placement(topology(dp, pp, tp, nodes), addresses(topology(dp, pp, tp, nodes)))
                checked += 1
    assert checked > 40


def test_fallback_reasons_say_what_is_shared() -> None:
    [a0, *_] = place_backups(topology(1, 4, 1, 4), addresses(topology(1, 4, 1, 4)))
    assert "only not its own node" in a0.fallback and "PP or TP peer of rank 0" in a0.fallback
    [b0, *_] = place_backups(topology(4, 2, 1, 4), addresses(topology(4, 2, 1, 4)))
    assert "shares only its DP group" in b0.fallback


def test_single_node_gets_no_backup() -> None:
    sites = topology(2, 1, 1, 1)
    assert place_backups(sites, addresses(sites)) == []


def test_replacement_after_a_failed_peer_or_a_lost_node_moves_only_affected_ranks() -> None:
    sites = topology(2, 2, 2, 4)
    nodes = addresses(sites)
    first = {a.rank: a for a in place_backups(sites, nodes)}
    # Rank 0's backup peer failed: rank 0 moves, nobody else.
    failed = first[0].backup_node_id
    again = {a.rank: a for a in place_backups(sites, nodes, current=first, avoid={0: {failed}})}
    assert again[0].backup_node_id != failed
    assert {r for r in first if first[r] != again[r]} == {0}
    # A node leaves: only the ranks it backed up move.
    gone = "n3"
    fewer = {n: a for n, a in nodes.items() if n != gone}
    after = {a.rank: a for a in place_backups(sites, fewer, current=first)}
    moved = {r for r in first if first[r] != after.get(r)}
    assert moved == {r for r, a in first.items() if a.backup_node_id == gone}
    assert all(a.backup_node_id != gone for a in after.values())


def test_ranks_text() -> None:
    assert ranks_text([8, 0, 1, 2, 5, 7]) == "0-2, 5, 7-8"
    assert ranks_text([]) == "none"


# -- the decider ---------------------------------------------------------------------------------------


def ev(payload: EventPayload, subject: str, at: datetime = T0, producer: str = "agent") -> Event:
    return Event.create(payload, job_id=JOB, subject=subject, producer=producer, occurred_at=at)


def registrations(sites: list[RankSite], generation: int = 0, at: datetime = T0) -> list[Event]:
    by_node: dict[str, list[RankSite]] = {}
    for s in sites:
        by_node.setdefault(s.node_id, []).append(s)
    return [
        ev(CheckpointRanksRegistered(
            node_id=node, generation=generation, world_size=len(sites), store_address=f"{node}:7301",
            ranks=[RankGroups(rank=s.rank, dp=list(s.dp), pp=list(s.pp), tp=list(s.tp)) for s in ranks]),
            f"node/{node}", at)
        for node, ranks in sorted(by_node.items())
    ]


def emitted_of(session: DeciderSession, events: list[Event], kind: type) -> list:
    """The payloads of ``kind`` the decisions on ``events`` emitted. ``CheckpointBackupAssigned``: each
    placement decision's per-node parts (``CheckpointNodeBackupsAssigned``, each checked to be on its
    node's subject) joined into one job-wide view, as before per-node parts."""
    out = []
    for event in events:
        emitted = session.observe(event).emitted
        if kind is CheckpointBackupAssigned:
            parts = [e for e in emitted if isinstance(e.payload, CheckpointNodeBackupsAssigned)]
            assert all(e.subject == f"node/{e.payload.node_id}" for e in parts)
            assert all(a.node_id == e.payload.node_id for e in parts for a in e.payload.assignments)
            if parts:
                first = parts[0].payload
                out.append(CheckpointBackupAssigned(
                    assignments=sorted((a for e in parts for a in e.payload.assignments), key=lambda a: a.rank),
                    reason=first.reason, every_k_steps=first.every_k_steps,
                    backup_every_k_steps=first.backup_every_k_steps))
            continue
        out += [e.payload for e in emitted if isinstance(e.payload, kind)]
    return out


def registered_session(sites: list[RankSite], policy: BrokerPolicy | None = None) -> DeciderSession:
    session = DeciderSession(CheckpointBrokerDecider(policy))
    [assigned] = emitted_of(session, registrations(sites), CheckpointBackupAssigned)
    assert len(assigned.assignments) == len(sites)
    return session


def test_placement_waits_for_every_rank_then_assigns_all_and_resends_on_reregistration() -> None:
    sites = topology(2, 2, 1, 4)
    session = DeciderSession(CheckpointBrokerDecider())
    events = registrations(sites)
    for event in events[:-1]:
        result = session.observe(event)
        assert result.emitted == [] and "waits for every rank" in result.decision.reason
    emitted = session.observe(events[-1]).emitted
    parts = [e for e in emitted if isinstance(e.payload, CheckpointNodeBackupsAssigned)]
    # Each holder hears, on its own subject, which node sends it which rank's backups (its store refuses others).
    held = [e for e in emitted if isinstance(e.payload, CheckpointNodeBackupsHeld)]
    assert len(parts) + len(held) == len(emitted)
    assert all(e.subject == f"node/{e.payload.node_id}" and e.payload.released == [] for e in held)
    assert sorted((a.rank, a.node_id) for e in held for a in e.payload.held
                  if a.backup_node_id == e.payload.node_id) == sorted(
        (a.rank, a.node_id) for e in parts for a in e.payload.assignments)
    # One part per node, on that node's subject, holding the assignments of the ranks it runs.
    assert [(e.subject, e.payload.node_id) for e in parts] == [(f"node/n{i}", f"n{i}") for i in range(4)]
    assert all(isinstance(e.payload, CheckpointNodeBackupsAssigned) and (e.payload.part, e.payload.parts) == (0, 1)
               for e in parts)
    assert all("all 4 ranks registered" in e.payload.reason for e in parts)
    assert {a.rank: a.backup_node_id for e in parts for a in e.payload.assignments} == {
        a.rank: a.backup_node_id for a in place_backups(sites, addresses(sites))}
    # The same node registers again (its agent restarted): it hears its own assignments again, unchanged.
    [again] = session.observe(registrations(sites, generation=1, at=T0 + timedelta(minutes=1))[1]).emitted
    assert again.subject == "node/n1" and [a.rank for a in again.payload.assignments] == [1]
    assert "n1 registered again, unchanged" in again.payload.reason


def test_backup_failure_moves_only_that_rank() -> None:
    sites = topology(2, 2, 2, 4)
    session = registered_session(sites)
    current = dict(session.state.job(JOB).backups)
    failed = current[5].backup_node_id
    event = ev(CheckpointBackupFailed(node_id="n2", rank=5, backup_node_id=failed, reason="UNAVAILABLE"), "node/n2")
    [moved] = emitted_of(session, [event], CheckpointBackupAssigned)
    assert [a.rank for a in moved.assignments] == [5]
    assert moved.assignments[0].backup_node_id != failed and "could not back up rank 5" in moved.reason
    # A failure report about a replaced assignment changes nothing.
    stale = ev(CheckpointBackupFailed(node_id="n2", rank=5, backup_node_id=failed, reason="late"), "node/n2")
    assert emitted_of(session, [stale], CheckpointBackupAssigned) == []


def test_node_eviction_moves_the_backups_it_held() -> None:
    sites = topology(2, 2, 1, 4)
    session = registered_session(sites)
    before = dict(session.state.job(JOB).backups)
    evicted = ev(NodeEvicted(node_id="n3", decision_id="d", actuator="local", outcome="evicted"), "node/n3",
                 producer="actuator")
    [moved] = emitted_of(session, [evicted], CheckpointBackupAssigned)
    assert {a.rank for a in moved.assignments} == {r for r, a in before.items() if a.backup_node_id == "n3"}
    assert all(a.backup_node_id != "n3" for a in moved.assignments)


def shards(node: str, tier: str, records: list[tuple[int, int]], owner: str = "", at: datetime = T0) -> Event:
    return ev(CheckpointShardsStored(node_id=node, tier=tier, shards=[  # type: ignore[arg-type]
        ShardRecord(rank=r, step=s, bytes=100, digest=f"{r:02d}{s:062d}", owner_node_id=owner) for r, s in records]),
        f"node/{node}", at)


def test_commit_per_tier_once_and_monotonic() -> None:
    sites = topology(2, 2, 1, 2)  # n0: ranks 0, 1; n1: ranks 2, 3
    session = registered_session(sites)
    n0 = shards("n0", "memory", [(0, 10), (1, 10), (0, 11), (1, 11)])
    assert emitted_of(session, [n0], CheckpointStepCommitted) == []
    [commit] = emitted_of(session, [shards("n1", "memory", [(2, 10), (3, 10)])], CheckpointStepCommitted)
    assert (commit.tier, commit.step, commit.ranks, commit.bytes) == ("memory", 10, 4, 400)
    # Once per tier and step; never backwards.
    assert emitted_of(session, [shards("n1", "memory", [(2, 10), (3, 10)])], CheckpointStepCommitted) == []
    [newer] = emitted_of(session, [shards("n1", "memory", [(2, 11), (3, 11), (2, 12)])], CheckpointStepCommitted)
    assert newer.step == 11
    assert emitted_of(session, [shards("n0", "memory", [(0, 9), (1, 9)]), shards("n1", "memory", [(2, 9), (3, 9)])],
                      CheckpointStepCommitted) == []
    # Peer tier: a copy counts only when held by a node other than the rank's own.
    own = shards("n0", "peer", [(0, 11), (1, 11)], owner="n0")
    held = shards("n1", "peer", [(0, 11), (1, 11)], owner="n0")
    other = shards("n0", "peer", [(2, 11), (3, 11)], owner="n1")
    assert emitted_of(session, [own, other], CheckpointStepCommitted) == []
    [peer] = emitted_of(session, [held], CheckpointStepCommitted)
    assert (peer.tier, peer.step) == ("peer", 11)
    assert session.state.job(JOB).committed == {"memory": 11, "peer": 11}


def heartbeat(node: str, step_time: float, at: datetime) -> Event:
    return ev(NodeHeartbeat(node_id=node, ranks_alive=1, ranks_expected=1, step_time_p50_s=step_time), f"node/{node}", at)


def test_youngs_formula_numbers() -> None:
    assert mtbf_estimate(0, 0, 14400) == 14400
    assert mtbf_estimate(3600, 1, 14400) == 9000
    k, raw = young_interval(5.0, 14400.0, 2.0, 10, 1000)
    assert raw == pytest.approx(math.sqrt(2 * 5 * 14400) / 2) and k == 190
    assert young_interval(5.0, 14400.0, 0.001, 10, 1000)[0] == 1000  # clamped to the ceiling
    assert young_interval(0.01, 60.0, 10.0, 10, 1000)[0] == 10  # and to the floor


def persisted_event(step: int, save_cost_s: float, at: datetime) -> Event:
    return ev(CheckpointPersisted(step=step, path=f"/p/step-{step:09d}/manifest.json", manifest_digest="d", bytes=1,
                                  save_cost_s=save_cost_s), f"job/{JOB}", at, producer="checkpoint-persister")


def test_schedule_starts_at_the_floor_until_a_step_time_is_measured() -> None:
    """A fast or short job whose heartbeats carry no step time yet still gets a persistent tier."""
    session = registered_session(topology(2, 2, 1, 4), BrokerPolicy(persist_every_floor=7))
    unmeasured = ev(NodeHeartbeat(node_id="n0", ranks_alive=1, ranks_expected=1), "node/n0", T0)
    [initial] = emitted_of(session, [unmeasured], CheckpointScheduleSet)
    assert (initial.every_k_steps, initial.backup_every_k_steps, initial.step_time_s) == (7, 1, 0.0)
    assert "no step time measured yet" in initial.reason
    # Said once; the first measured step time then applies Young's formula.
    assert emitted_of(session, [unmeasured], CheckpointScheduleSet) == []
    [young] = emitted_of(session, [heartbeat("n0", 2.0, T0 + timedelta(seconds=5))], CheckpointScheduleSet)
    assert young.every_k_steps == 190 and "was 7" in young.reason


def test_schedule_is_set_when_k_changes_with_the_numbers() -> None:
    session = DeciderSession(CheckpointBrokerDecider())
    [first] = emitted_of(session, [heartbeat("n0", 2.0, T0)], CheckpointScheduleSet)
    assert (first.every_k_steps, first.save_cost_s, first.mtbf_s, first.step_time_s) == (190, 5.0, 14400.0, 2.0)
    assert "initial estimate" in first.reason and "= 189.7 -> 190" in first.reason
    # The first measured persist (20 s) replaces the estimate; MTBF = (100 s + 4 h) / 1.
    [second] = emitted_of(session, [persisted_event(100, 20.0, T0 + timedelta(seconds=100))], CheckpointScheduleSet)
    assert second.save_cost_s == 20.0 and second.mtbf_s == pytest.approx(14500)
    assert second.every_k_steps == round(math.sqrt(2 * 20 * 14500) / 2.0) == 381
    assert "EWMA of 1 measured persist(s)" in second.reason
    # Jitter in the step time within the hysteresis: no new schedule.
    assert emitted_of(session, [heartbeat("n1", 2.05, T0 + timedelta(seconds=110))], CheckpointScheduleSet) == []
    # A failure an hour in: MTBF = (3600 + 14400) / 2 = 9000 s; the slowest node (2.05 s) sets the pace.
    exited = ev(RankExited(node_id="n0", rank=0, pid=1, generation=0, exit_code=None, signal="SIGKILL",
                           classification="infrastructure"), "rank/0", T0 + timedelta(hours=1))
    [third] = emitted_of(session, [exited], CheckpointScheduleSet)
    assert third.mtbf_s == pytest.approx(9000) and third.step_time_s == 2.05
    assert third.every_k_steps == round(math.sqrt(2 * 20 * 9000) / 2.05) == 293
    assert "1 failure(s)" in third.reason and "was 381" in third.reason
    # Later measurements are smoothed: C = 20 + 0.3 x (5 - 20) = 15.5, K 258: within 20 % of 293, kept.
    assert emitted_of(session, [persisted_event(200, 5.0, T0 + timedelta(hours=1, seconds=1))],
                      CheckpointScheduleSet) == []
    # C = 15.5 + 0.3 x (80 - 15.5) = 34.85: K 386, past the hysteresis; but a minute has not passed since
    # the schedule in force was announced: it waits for the next input after the minute.
    assert emitted_of(session, [persisted_event(300, 80.0, T0 + timedelta(hours=1, seconds=2))],
                      CheckpointScheduleSet) == []
    [fourth] = emitted_of(session, [heartbeat("n1", 2.05, T0 + timedelta(hours=1, minutes=1))], CheckpointScheduleSet)
    assert fourth.save_cost_s == pytest.approx(34.85)
    assert fourth.every_k_steps == round(math.sqrt(2 * 34.85 * (3660 + 14400) / 2) / 2.05) == 387
    # A stopped rank is not a failure.
    stopped = ev(RankExited(node_id="n0", rank=1, pid=2, generation=0, exit_code=0, classification="stopped_by_agent"),
                 "rank/1", T0 + timedelta(hours=1, seconds=1))
    assert emitted_of(session, [stopped], CheckpointScheduleSet) == []


def test_backup_interval_keeps_transfers_within_the_duty_in_powers_of_two() -> None:
    assert backup_interval(0.0, 0.35, 0.1, 1000) == 1  # nothing measured yet: every step
    assert backup_interval(0.02, 0.35, 0.1, 1000) == 1  # 0.02 / 0.035 = 0.6
    assert backup_interval(0.37, 0.35, 0.1, 1000) == 16  # 10.6 -> 16
    assert backup_interval(0.37, 0.35, 1.0, 1000) == 2  # back to back: 1.06 -> 2
    assert backup_interval(100.0, 0.1, 0.1, 1000) == 1000  # the ceiling
    # Rounds at least 0.5 s apart: 0.5 / 0.066 = 7.6 -> 8 steps, however fast the transfer.
    assert backup_interval(0.001, 0.066, 0.1, 1000, min_period_s=0.5) == 8
    assert backup_interval(0.37, 0.35, 0.1, 1000, min_period_s=0.5) == 16  # the transfer dominates
    assert backup_interval(0.0, 0.0, 0.1, 1000, min_period_s=0.5) == 1  # no step time yet


def test_schedule_announces_the_backup_interval_from_the_slowest_transfer() -> None:
    session = DeciderSession(CheckpointBrokerDecider())
    [first] = emitted_of(session, [heartbeat("n0", 0.5, T0)], CheckpointScheduleSet)
    assert first.backup_every_k_steps == 1
    slow = ev(CheckpointShardsStored(node_id="n0", tier="memory", shards=[
        ShardRecord(rank=0, step=5, bytes=10, digest="d", send_s=0.3),
        ShardRecord(rank=1, step=5, bytes=10, digest="d", send_s=0.1)]), "node/n0", T0 + timedelta(seconds=1))
    [second] = emitted_of(session, [slow], CheckpointScheduleSet)
    # The slowest rank's 0.3 s within 10 % of a 0.5 s step: 6 steps -> 8.
    assert second.backup_every_k_steps == 8 and second.every_k_steps == first.every_k_steps
    assert "backups every 8 step(s): slowest transfer 0.300s" in second.reason
    assert emitted_of(session, [heartbeat("n0", 0.5, T0 + timedelta(seconds=2))], CheckpointScheduleSet) == []



def test_assignments_carry_the_schedule_in_force_for_a_replacement_agent() -> None:
    """A replacement node's agent starts after the schedule was announced (its consumer resumes where the
    old agent's stopped): its assignments tell it which steps the others back up and persist."""
    sites = topology(2, 2, 1, 4)
    session = registered_session(sites)
    [before] = emitted_of(session, registrations(sites, generation=1)[1:2], CheckpointBackupAssigned)
    assert before.every_k_steps is None  # nothing announced yet
    slow = ev(CheckpointShardsStored(node_id="n0", tier="memory", shards=[
        ShardRecord(rank=0, step=5, bytes=10, digest="d", send_s=0.3)]), "node/n0", T0 + timedelta(seconds=1))
    emitted_of(session, [heartbeat("n0", 0.5, T0)], CheckpointScheduleSet)
    [announced] = emitted_of(session, [slow], CheckpointScheduleSet)
    assert announced.backup_every_k_steps == 8
    [again] = emitted_of(session, registrations(sites, generation=1, at=T0 + timedelta(minutes=1))[1:2],
                         CheckpointBackupAssigned)
    assert (again.every_k_steps, again.backup_every_k_steps) == (announced.every_k_steps, 8)

# -- restore planning ------------------------------------------------------------------------------------


def digest(rank: int, step: int) -> str:
    return f"{rank:02d}{step:062d}"


def inventory(node: str, generation: int, memory: dict[int, list[int]] | None = None,
              peer: dict[int, list[int]] | None = None, rejected: list[RejectedShard] | None = None,
              ranks: list[int] | None = None, at: datetime = T0) -> Event:
    entries = [InventoryEntry(rank=r, tier=tier, step=s, bytes=100, digest=digest(r, s))  # type: ignore[arg-type]
               for tier, held in (("memory", memory or {}), ("peer", peer or {}))
               for r, steps in held.items() for s in steps]
    return ev(CheckpointInventoryReported(node_id=node, generation=generation, entries=entries,
                                          rejected=rejected or [], ranks=ranks or []), f"node/{node}", at)


def plan_events(session: DeciderSession, events: list[Event]) -> tuple[CheckpointRestorePlanned | None, list]:
    """The plan decided on ``events`` (its node parts joined back into ``sources``) and its fallbacks.
    Checks the parts: each on its node's subject, published before the plan, counted by it, holding
    the ranks that node runs."""
    plans, fallbacks, parts = [], [], []
    for event in events:
        for produced in session.observe(event).emitted:
            if isinstance(produced.payload, CheckpointNodeRestorePlanned):
                assert not plans and produced.subject == f"node/{produced.payload.node_id}"
                parts.append(produced.payload)
            elif isinstance(produced.payload, CheckpointRestorePlanned):
                plans.append(produced.payload)
            elif isinstance(produced.payload, CheckpointTierFallback):
                fallbacks.append(produced.payload)
    assert len(plans) <= 1
    if not plans:
        assert parts == []
        return None, fallbacks
    plan = plans[0]
    assert plan.node_parts == len(parts) and all(p.generation == plan.generation and p.step == plan.step for p in parts)
    sources = joined_sources(plan, parts)
    assert plan.ranks == len(sources) and plan.tiers == dict(sorted(Counter(s.tier for s in sources).items()))
    return plan.model_copy(update={"sources": sources}), fallbacks


def four_nodes() -> tuple[DeciderSession, dict[int, str]]:
    """2x2x1 on n0..n3, one rank per node; returns the session and each rank's backup node."""
    session = registered_session(topology(2, 2, 1, 4))
    return session, {r: a.backup_node_id for r, a in session.state.job(JOB).backups.items()}


def test_all_local_restores_from_memory_without_fallbacks() -> None:
    session, backup = four_nodes()
    events = [inventory(f"n{r}", 1, memory={r: [40, 41]},
                        peer={o: [40] for o, b in backup.items() if b == f"n{r}"}) for r in range(4)]
    plan, fallbacks = plan_events(session, events[:3])
    assert plan is None  # n3's inventory is still missing
    plan, fallbacks = plan_events(session, events[3:])
    assert plan is not None and plan.step == 41 and fallbacks == []
    assert [(s.rank, s.tier, s.node_id, s.digest) for s in plan.sources] == [
        (r, "memory", f"n{r}", digest(r, 41)) for r in range(4)]
    assert "4 from memory" in plan.reason and "all 4 node(s) arrived" in plan.reason
    # Planned once: a late inventory for the same generation changes nothing.
    assert plan_events(session, [inventory("n0", 1, memory={0: [41]})]) == (None, [])


def test_replaced_node_restores_its_rank_from_the_peer_with_a_fallback_event() -> None:
    session, backup = four_nodes()
    session.observe(shards("n1", "memory", [(1, 40)]))  # n1 reported its rank's step 40 before it died
    # n1 died; n9 takes over rank 1 with empty shared memory. Rank 1's backup peer holds step 40.
    events = [inventory(f"n{r}", 1, memory={r: [40, 41]}, peer={1: [40]} if backup[1] == f"n{r}" else None)
              for r in (0, 2, 3)]
    events.append(inventory("n9", 1, ranks=[1]))
    plan, fallbacks = plan_events(session, events)
    assert plan is not None and plan.step == 40
    tiers = {s.rank: (s.tier, s.node_id) for s in plan.sources}
    assert tiers == {0: ("memory", "n0"), 1: ("peer", backup[1]), 2: ("memory", "n2"), 3: ("memory", "n3")}
    assert plan.sources[1].address == f"{backup[1]}:7301"
    [rank1, job_level] = fallbacks
    assert (rank1.rank, rank1.step, rank1.from_tier, rank1.to_tier) == (1, 40, "memory", "peer")
    assert "n9 reported no verified shard of step 40 for rank 1 (node replaced" in rank1.reason
    assert "shared memory empty" in rank1.reason
    assert (job_level.rank, job_level.to_tier) == (-1, "peer")
    assert "newest step in memory, 41, is held for 3 of 4 ranks" in job_level.reason


def test_a_restore_plan_rewinds_the_memory_and_peer_commits_to_its_step() -> None:
    """The resumed generation writes the steps after the plan's anew: they commit again (agents wait for
    a commit before their next backup round, so without the rewind backups would stall)."""
    session, backup = four_nodes()
    def peer_round(step: int) -> list[Event]:
        return [shards(b, "peer", [(r, step)], owner=f"n{r}") for r, b in sorted(backup.items())]
    committed = [e for events in [peer_round(44)] for e in emitted_of(session, events, CheckpointStepCommitted)]
    assert [(c.tier, c.step) for c in committed] == [("peer", 44)]
    events = [inventory(f"n{r}", 1, memory={r: [40, 44]},
                        peer={o: [40, 44] for o, b in backup.items() if b == f"n{r}"}) for r in range(4)]
    plan, _ = plan_events(session, events)
    assert plan is not None and plan.step == 44
    assert session.state.job(JOB).committed["peer"] == 43  # 44 may commit again in the resumed history
    # A second failure, restored to an older step (say the disk's 40): generation 2 re-runs 41..44.
    later = [inventory(f"n{r}", 2, memory={r: [40]}, peer={o: [40] for o, b in backup.items() if b == f"n{r}"})
             for r in range(4)]
    plan, _ = plan_events(session, later)
    assert plan is not None and plan.step == 40
    assert session.state.job(JOB).committed["peer"] == 39
    # The first round after the restore is often the restored step itself: it commits again.
    [again] = emitted_of(session, peer_round(40), CheckpointStepCommitted)
    assert (again.tier, again.step) == ("peer", 40)
    [later] = emitted_of(session, peer_round(42), CheckpointStepCommitted)
    assert (later.tier, later.step) == ("peer", 42)


def test_after_a_nan_every_plan_takes_a_step_before_it_until_the_resumed_history_passes_it() -> None:
    session, backup = four_nodes()
    nan = ev(MetricAnomalyDetected(node_id="n2", rank=2, generation=0, kind="non_finite", metric="loss", step=44,
                                   value_text="nan", reason="loss of rank 2 is nan at step 44"), "node/n2")
    session.observe(nan)
    events = [inventory(f"n{r}", 1, memory={r: [43, 44, 45]},
                        peer={o: [40] for o, b in backup.items() if b == f"n{r}"}) for r in range(4)]
    plan, _ = plan_events(session, events)
    assert plan is not None and plan.step == 43, plan
    assert "steps from 44 on excluded: non-finite loss at step 44 (rank 2 on n2)" in plan.reason
    # A rung-5 replay restored once and did not step; the restart after it must again avoid 44 and 45.
    again = [inventory(f"n{r}", 2, memory={r: [43, 44, 45]}) for r in range(4)]
    plan, _ = plan_events(session, again)
    assert plan is not None and plan.step == 43, plan
    # A commit before the resumed history reaches 44 keeps the limit...
    for r, b in sorted(backup.items()):
        session.observe(shards(b, "peer", [(r, 43)], owner=f"n{r}"))
    assert session.state.job(JOB).restore_below == 44
    # The resumed history going bad again at 44 (the corruption persists): a commit of it must not lift the limit.
    session.observe(ev(MetricAnomalyDetected(node_id="n1", rank=1, generation=2, kind="non_finite", metric="grad_norm",
                                             step=44, value_text="inf", reason="grad_norm is inf"), "node/n1"))
    for r, b in sorted(backup.items()):
        session.observe(shards(b, "peer", [(r, 44)], owner=f"n{r}"))
    assert session.state.job(JOB).restore_below == 44
    plan, _ = plan_events(session, [inventory(f"n{r}", 3, memory={r: [43, 44, 45]}) for r in range(4)])
    assert plan is not None and plan.step == 43, plan
    # ...the resumed history committing 44 (new, clean) lifts it: the next restart takes the newest again.
    for r, b in sorted(backup.items()):
        session.observe(shards(b, "peer", [(r, 44)], owner=f"n{r}"))
    assert session.state.job(JOB).restore_below is None
    later = [inventory(f"n{r}", 4, memory={r: [50, 51]}) for r in range(4)]
    plan, _ = plan_events(session, later)
    assert plan is not None and plan.step == 51


def persist_step(session: DeciderSession, step: int, at: datetime) -> None:
    events = [shards(f"n{r}", "disk", [(r, step)], at=at) for r in range(4)]
    [commit] = emitted_of(session, events, CheckpointStepCommitted)
    assert commit.tier == "disk"
    [pending] = session.state.job(JOB).pending_manifests()
    assert pending.step == step
    emitted_of(session, [ev(CheckpointPersisted(
        step=step, path=f"/ckpt/{JOB}/step-{step:09d}/manifest.json", manifest_digest="m", bytes=400, save_cost_s=1.0),
        f"job/{JOB}", at, producer="checkpoint-persister")], CheckpointScheduleSet)
    assert session.state.job(JOB).pending_manifests() == []


def test_rejected_digest_falls_to_the_next_tier_with_its_reason() -> None:
    session, backup = four_nodes()
    persist_step(session, 30, T0)
    mismatch = RejectedShard(rank=2, tier="memory", step=41, reason="digest mismatch for step 41 (stored ab, actual cd)")
    events = [inventory(f"n{r}", 1, memory={r: [40, 41]}) for r in (0, 1, 3)]
    events.append(inventory("n2", 1, memory={}, rejected=[mismatch]))
    plan, fallbacks = plan_events(session, events)
    # No peer copy anywhere: rank 2 exists only on disk (step 30), so everyone restores step 30 from disk.
    assert plan is not None and plan.step == 30
    assert {s.tier for s in plan.sources} == {"disk"}
    assert plan.sources[2].path == f"/ckpt/{JOB}/step-000000030/rank-00002.shard"
    assert plan.sources[2].digest == digest(2, 30)
    by_rank = {f.rank: f for f in fallbacks}
    assert set(by_rank) == {-1, 0, 1, 2, 3}
    assert "digest mismatch for step 41" in by_rank[2].reason and by_rank[2].to_tier == "disk"
    assert "holds rank 0 in memory only at step(s) 40, 41, not step 30" in by_rank[0].reason
    assert by_rank[-1].to_tier == "disk" and "11 steps lost" in by_rank[-1].reason


def test_rejected_digest_with_a_peer_copy_restores_that_rank_from_the_peer() -> None:
    session, backup = four_nodes()
    session.observe(shards("n2", "memory", [(2, 41)]))  # what rank 2 wrote, as its node reported it then
    mismatch = RejectedShard(rank=2, tier="memory", step=41, reason="digest mismatch")
    events = [inventory(f"n{r}", 1, memory={r: [41]}, peer={2: [41]} if backup[2] == f"n{r}" else None)
              for r in (0, 1, 3)]
    events.append(inventory("n2", 1, rejected=[mismatch]))
    plan, [fallback] = plan_events(session, events)
    assert plan is not None and plan.step == 41 and plan.sources[2].tier == "peer"
    assert "rejected its memory copy of rank 2 step 41: digest mismatch" in fallback.reason


def test_nothing_anywhere_starts_fresh() -> None:
    session, _ = four_nodes()
    plan, fallbacks = plan_events(session, [inventory(f"n{r}", 1) for r in range(4)])
    assert plan is not None and plan.step == -1 and plan.sources == [] and fallbacks == []
    assert "start fresh" in plan.reason


def test_memory_with_too_little_says_so_at_job_level() -> None:
    session, _ = four_nodes()
    plan, fallbacks = plan_events(session, [inventory(f"n{r}", 1, memory={r: [7]} if r < 2 else None)
                                            for r in range(4)])
    assert plan is not None and plan.step == -1
    [job_level] = fallbacks
    assert (job_level.rank, job_level.from_tier, job_level.to_tier) == (-1, "memory", "none")
    assert "held for 2 of 4 ranks" in job_level.reason and "ranks 2-3" in job_level.reason


def test_plan_after_the_timeout_with_what_arrived() -> None:
    session, _ = four_nodes()
    events = [inventory(f"n{r}", 1, memory={r: [41]}, at=T0 + timedelta(seconds=1)) for r in range(3)]
    assert plan_events(session, events) == (None, [])
    early = ev(TimerTicked(now=T0 + timedelta(seconds=5)), "clock/checkpoint-broker", producer="clock")
    assert plan_events(session, [early]) == (None, [])
    late = ev(TimerTicked(now=T0 + timedelta(seconds=12)), "clock/checkpoint-broker", producer="clock")
    plan, fallbacks = plan_events(session, [late])
    assert plan is not None and plan.step == -1  # rank 3's node never answered and nothing else holds it
    assert "after the 10s wait with 3 inventory(ies); absent: n3" in plan.reason


def test_plan_restore_prefers_a_local_backup_over_a_remote_copy() -> None:
    inventories = {
        "a": CheckpointInventoryReported(node_id="a", generation=1, entries=[
            InventoryEntry(rank=1, tier="peer", step=5, bytes=1, digest="x")]),
        "b": CheckpointInventoryReported(node_id="b", generation=1, entries=[
            InventoryEntry(rank=1, tier="memory", step=5, bytes=1, digest="x"),
            InventoryEntry(rank=0, tier="memory", step=5, bytes=1, digest="y")]),
    }
    # Rank 1 ran on b (its memory copy is its owner's word), and moves to a, which holds its backup.
    plan = plan_restore(1, 2, {0: "b", 1: "a"}, inventories, {"a": "a:1", "b": "b:1"},
                        {5: PersistedStep(5, "/r/j/step-000000005/manifest.json")}, previous_nodes={0: "b", 1: "b"})
    assert [(s.rank, s.tier, s.node_id) for s in plan.sources] == [(0, "memory", "b"), (1, "peer", "a")]
    [fallback] = plan.fallbacks
    assert "the backup copy a holds for it" in fallback.reason


def test_replay_of_own_decisions_is_stable() -> None:
    """Deciding twice over the same inputs gives the same decisions (ids included)."""
    sites = topology(2, 2, 1, 4)
    inputs = registrations(sites) + [shards(f"n{r}", "memory", [(r, 3)]) for r in range(4)] + [
        heartbeat("n0", 0.5, T0)]
    runs = []
    for _ in range(2):
        session = DeciderSession(CheckpointBrokerDecider())
        runs.append([e for event in inputs for e in session.observe(event).emitted])
    # 4 nodes' placements, the 4 holders' parts of them, the initial schedule, the new one
    assert runs[0] == runs[1] and len(runs[0]) == 10


def test_replaced_node_registering_moves_only_its_ranks_and_the_backups_it_held() -> None:
    session, backup = four_nodes()
    before = dict(session.state.job(JOB).backups)
    sites = topology(2, 2, 1, 4)
    replacement = RankSite(1, "n9", sites[1].dp, sites[1].pp, sites[1].tp)
    [event] = registrations([replacement], generation=1)
    event = ev(event.payload.model_copy(update={"world_size": 4}), "node/n9")
    [moved] = emitted_of(session, [event], CheckpointBackupAssigned)
    assert {a.rank for a in moved.assignments} == {1} | {r for r, b in backup.items() if b == "n1"}
    after = session.state.job(JOB).backups
    assert after[1].node_id == "n9" and all(a.backup_node_id != "n1" for a in after.values())
    assert {r for r in before if before[r] != after[r]} == {a.rank for a in moved.assignments}


# -- the adapter's persistent-tier step, with a fake bus ----------------------------------------------------


class FakeBus:
    def __init__(self) -> None:
        from keel.infra.config import BusSettings

        self.settings = BusSettings()  # the broker's runner builds its consumer's subject filter from it
        self.published: list[Event] = []

    async def publish(self, event: Event) -> None:
        self.published.append(event)

    async def publish_many(self, events: list[Event]) -> None:
        self.published += events


async def test_manifest_waits_for_every_shard_file_then_reports_the_persisted_step(tmp_path) -> None:
    from keel.checkpoint import disk as ckpt_disk
    from keel.checkpoint_broker.adapter import CheckpointBroker
    from keel.infra.config import CheckpointSettings, Settings

    now = [T0]
    settings = Settings(home=tmp_path, checkpoint=CheckpointSettings(persist_root=tmp_path / "p", retention=1))
    bus = FakeBus()
    broker = CheckpointBroker(bus, None, settings, clock=lambda: now[0])  # type: ignore[arg-type]
    session = broker.runner.session
    for event in registrations(topology(2, 1, 1, 2)):
        session.observe(event)
    records = []
    for rank in range(2):
        written = ckpt_disk.write_shard(tmp_path / "p", JOB, 10, rank, b"x" * (10 + rank))
        records.append(ShardRecord(rank=rank, step=10, bytes=written.bytes, digest=written.sha256, write_s=0.5))
    ckpt_disk.shard_file(tmp_path / "p", JOB, 10, 1).unlink()  # reported stored, not visible here (yet)
    for rank in range(2):
        session.observe(ev(CheckpointShardsStored(node_id=f"n{rank}", tier="disk", shards=[records[rank]]),
                           f"node/n{rank}"))
    assert await broker.write_manifests() == []
    assert broker.stats.manifest_failures == 1 and not ckpt_disk.manifest_path(tmp_path / "p", JOB, 10).exists()
    ckpt_disk.write_shard(tmp_path / "p", JOB, 10, 1, b"x" * 11)
    assert await broker.write_manifests() == []  # not again before report_interval
    now[0] = T0 + timedelta(seconds=2)
    [persisted] = await broker.write_manifests()
    assert isinstance(persisted.payload, CheckpointPersisted) and persisted.producer == "checkpoint-persister"
    assert persisted.payload.save_cost_s == 0.5 and persisted.payload.bytes == 21
    assert persisted.payload.manifest_digest == ckpt_disk.read_manifest(tmp_path / "p", JOB, 10).digest
    assert await broker.write_manifests() == []  # once


def test_a_restore_wait_runs_on_the_recorded_clock_not_the_nodes_clocks() -> None:
    """Issue 14 (producer clocks): with the job clock's v2 ticks, a restore plan's wait counts from the tick
    before the first inventory arrived. An inventory stamped 10 minutes early (a node whose clock lags)
    does not end the wait at the next tick, and one stamped 10 minutes late does not stretch it."""
    session, _ = four_nodes()

    def tick(seconds: float) -> Event:
        return ev(TimerTicked(now=T0 + timedelta(seconds=seconds), interval_s=1.0), "clock/job1", producer="clock")

    lagging = inventory("n0", 1, memory={0: [41]}, at=T0 - timedelta(minutes=10))
    ahead = inventory("n1", 1, memory={1: [41]}, at=T0 + timedelta(minutes=10))
    assert plan_events(session, [tick(0), lagging, ahead, tick(1)]) == (None, [])
    assert plan_events(session, [tick(9)]) == (None, [])  # within the 10 s wait from the tick at 0 s
    plan, _ = plan_events(session, [tick(11)])
    assert plan is not None and "after the 10s wait with 2 inventory(ies)" in plan.reason, plan


# -- planted backups: plans trust the owner's digests, never a holder's -------------------------------


def test_a_planted_backup_is_never_restored() -> None:
    """n1 is lost. The node holding rank 1's backup claims a copy of step 44 whose digest n1 never reported
    (a planted, self-consistent backup): the plan takes step 40, whose copy matches what n1 reported."""
    session, backup = four_nodes()
    persist_step(session, 30, T0)
    for step in (40, 44):
        session.observe(shards("n1", "memory", [(1, step)]))  # what rank 1 wrote, as its node reported it
    holder = backup[1]
    planted = ev(CheckpointInventoryReported(node_id=holder, generation=1, ranks=[int(holder[1:])], rejected=[], entries=[
        InventoryEntry(rank=int(holder[1:]), tier="memory", step=s, bytes=100, digest=digest(int(holder[1:]), s))
        for s in (40, 44)] + [
        InventoryEntry(rank=1, tier="peer", step=44, bytes=100, digest="66" * 32),  # not what rank 1 wrote
        InventoryEntry(rank=1, tier="peer", step=40, bytes=100, digest=digest(1, 40))]), f"node/{holder}")
    others = [inventory(f"n{r}", 1, memory={r: [40, 44]}) for r in (0, 2, 3) if f"n{r}" != holder]
    others.append(inventory("n9", 1, ranks=[1]))  # n1's replacement, empty memory
    plan, _ = plan_events(session, [planted, *others])
    assert plan is not None and plan.step == 40
    assert (plan.sources[1].tier, plan.sources[1].node_id, plan.sources[1].digest) == ("peer", holder, digest(1, 40))
    # A holder that claims only the planted copy leaves rank 1 to the persistent tier.
    session, backup = four_nodes()
    persist_step(session, 30, T0)
    session.observe(shards("n1", "memory", [(1, 44)]))
    holder = backup[1]
    only_planted = ev(CheckpointInventoryReported(node_id=holder, generation=1, ranks=[], rejected=[], entries=[
        InventoryEntry(rank=1, tier="peer", step=44, bytes=100, digest="66" * 32)]), f"node/{holder}")
    memory = [inventory(f"n{r}", 1, memory={r: [44]}) for r in (0, 2, 3)]
    plan, _ = plan_events(session, [only_planted, *memory, inventory("n9", 1, ranks=[1])])
    assert plan is not None and plan.step == 30 and {s.tier for s in plan.sources} == {"disk"}
    assert all(s.digest != "66" * 32 for s in plan.sources)


def test_only_a_ranks_own_node_vouches_for_its_digests() -> None:
    session, _ = four_nodes()
    # n2 reports a "memory" record for rank 1, which runs on n1: not n1's word, not remembered.
    session.observe(ev(CheckpointShardsStored(node_id="n2", tier="memory", shards=[
        ShardRecord(rank=1, step=8, bytes=100, digest="77" * 32)]), "node/n2"))
    session.observe(shards("n1", "memory", [(1, 8)]))
    assert session.state.job(JOB).owner_digests[1] == {8: frozenset({digest(1, 8)})}
    # A restore plan to step 4 forgets the steps after it: the resumed history writes them anew.
    plan, _ = plan_events(session, [inventory(f"n{r}", 1, memory={r: [4]}) for r in range(4)])
    assert plan is not None and plan.step == 4
    assert 8 not in session.state.job(JOB).owner_digests.get(1, {})


def test_holders_hear_who_sends_them_each_rank_and_which_ranks_moved_away() -> None:
    sites = topology(2, 2, 2, 4)
    session = registered_session(sites)
    current = dict(session.state.job(JOB).backups)
    failed = current[5].backup_node_id
    event = ev(CheckpointBackupFailed(node_id="n2", rank=5, backup_node_id=failed, reason="UNAVAILABLE"), "node/n2")
    emitted = session.observe(event).emitted
    held = {e.payload.node_id: e.payload for e in emitted if isinstance(e.payload, CheckpointNodeBackupsHeld)}
    moved = session.state.job(JOB).backups[5]
    assert all(e.subject == f"node/{e.payload.node_id}" for e in emitted if isinstance(e.payload, CheckpointNodeBackupsHeld))
    assert held[failed].released == [5] and held[failed].held == []
    assert [(a.rank, a.node_id) for a in held[moved.backup_node_id].held] == [(5, moved.node_id)]
    assert set(held) == {failed, moved.backup_node_id}
