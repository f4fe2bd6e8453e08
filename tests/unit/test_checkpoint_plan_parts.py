"""Restore plans and backup assignments of a 4,096-rank job (512 nodes x 8 ranks) within the bus's event
limit: the broker decider sends each node its part on the node's subject, and the parts add up to the
whole placement and the whole plan. The agent side assembles its node's plan from its parts, in either
order, and still takes a plan in the old one-event shape (version 1)."""

from __future__ import annotations

import itertools
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from keel.agent.checkpointing import NodeCheckpointing, plan_file
from keel.checkpoint_broker.decider import CheckpointBrokerDecider
from keel.checkpoint_broker.parts import PART_BUDGET_BYTES, split
from keel.checkpoint_broker.placement import place_backups
from keel.checkpoint_broker.restore import plan_restore, restore_targets
from keel.checkpoint_broker.state import RankSite
from keel.events.envelope import Event, EventPayload, decode_event
from keel.events.types import (
    BackupAssignment,
    CheckpointBackupAssigned,
    CheckpointInventoryReported,
    CheckpointNodeBackupsAssigned,
    CheckpointNodeRestorePlanned,
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    CheckpointShardsStored,
    DecisionRefused,
    InventoryEntry,
    RankGroups,
    RestoreSource,
    ShardRecord,
)
from keel.infra.config import Settings
from keel.kernel.decider import DeciderSession

T0 = datetime(2026, 11, 29, 7, 0, tzinfo=UTC)
JOB = "big"
DP, PP, TP = 64, 8, 8  # 4,096 ranks, TP within a node: 512 nodes x 8 ranks
LIMIT = int(Settings().bus.max_event_bytes)


def sites() -> list[RankSite]:
    def rank(d: int, p: int, t: int) -> int:
        return d * PP * TP + p * TP + t

    out = []
    for d, p, t in itertools.product(range(DP), range(PP), range(TP)):
        r = rank(d, p, t)
        out.append(RankSite(rank=r, node_id=f"gpu{r // TP:03d}.dc1",
                            dp=tuple(rank(x, p, t) for x in range(DP)), pp=tuple(rank(d, x, t) for x in range(PP)),
                            tp=tuple(rank(d, p, x) for x in range(TP))))
    return out


def ev(payload: EventPayload, node: str, at: datetime = T0) -> Event:
    return Event.create(payload, job_id=JOB, subject=f"node/{node}", producer="agent", occurred_at=at)


def by_node(all_sites: list[RankSite]) -> dict[str, list[RankSite]]:
    nodes: dict[str, list[RankSite]] = {}
    for s in all_sites:
        nodes.setdefault(s.node_id, []).append(s)
    return nodes


def digest(rank: int, step: int) -> str:
    return f"{rank:05d}{step:059d}"


def size(event: Event) -> int:
    return len(event.to_json())


@pytest.fixture(scope="module")
def registered() -> tuple[DeciderSession, list[RankSite], list[Event]]:
    """A broker session that saw the whole job register (with the bus's limit), and the placement's events."""
    all_sites = sites()
    session = DeciderSession(CheckpointBrokerDecider(), max_event_bytes=LIMIT)
    emitted: list[Event] = []
    for node, ranks in sorted(by_node(all_sites).items()):
        emitted += session.observe(ev(CheckpointRanksRegistered(
            node_id=node, generation=0, world_size=len(all_sites), store_address=f"{node}:7301",
            ranks=[RankGroups(rank=s.rank, dp=list(s.dp), pp=list(s.pp), tp=list(s.tp)) for s in ranks]), node)).emitted
    return session, all_sites, emitted


def test_a_4096_rank_placement_is_one_part_per_node_each_within_the_limit(registered) -> None:  # type: ignore[no-untyped-def]
    session, all_sites, emitted = registered
    parts = [e for e in emitted if isinstance(e.payload, CheckpointNodeBackupsAssigned)]
    assert not [e for e in emitted if isinstance(e.payload, DecisionRefused | CheckpointBackupAssigned)]
    nodes = by_node(all_sites)
    assert len(parts) == len(nodes) == 512
    assert max(size(e) for e in emitted) <= LIMIT
    for event in parts:
        # On the node's subject, with exactly the ranks that node runs (it sends their backups).
        assert event.subject == f"node/{event.payload.node_id}"
        assert [a.rank for a in event.payload.assignments] == [s.rank for s in nodes[event.payload.node_id]]
    # The union of the parts is the whole placement, every rank once.
    union = [a for e in parts for a in e.payload.assignments]
    expected = place_backups(all_sites, {n: f"{n}:7301" for n in nodes})
    assert sorted(union, key=lambda a: a.rank) == expected and len(expected) == 4096
    assert session.state.job(JOB).backups == {a.rank: a for a in expected}
    # The job-wide event it replaces would not have fitted.
    whole = CheckpointBackupAssigned(assignments=expected, reason=parts[0].payload.reason)
    assert len(whole.model_dump_json()) > LIMIT


def test_a_4096_rank_restore_plan_is_sent_in_node_parts_that_add_up_to_the_plan(registered) -> None:  # type: ignore[no-untyped-def]
    session, all_sites, _ = registered
    backups = session.state.job(JOB).backups
    nodes = by_node(all_sites)
    replaced = "gpu100.dc1"  # lost its memory: its ranks come from their peers' copies
    # Before it was lost, it reported its ranks' step 40 (a heartbeat's memory records): the digests the
    # peers' copies must match to be restored.
    session.observe(ev(CheckpointShardsStored(node_id=replaced, tier="memory", shards=[
        ShardRecord(rank=s.rank, step=40, bytes=1 << 20, digest=digest(s.rank, 40)) for s in nodes[replaced]]),
        replaced, T0))
    inventories = []
    for i, (node, ranks) in enumerate(sorted(nodes.items())):
        entries = [] if node == replaced else [
            InventoryEntry(rank=s.rank, tier="memory", step=step, bytes=1 << 20, digest=digest(s.rank, step))
            for s in ranks for step in (40, 41)]
        entries += [InventoryEntry(rank=r, tier="peer", step=40, bytes=1 << 20, digest=digest(r, 40))
                    for r, a in sorted(backups.items()) if a.backup_node_id == node]
        inventories.append(ev(CheckpointInventoryReported(node_id=node, generation=1, entries=entries, rejected=[],
                                                          ranks=[s.rank for s in ranks]),
                              node, T0 + timedelta(seconds=1, milliseconds=i)))
    started = time.perf_counter()
    emitted: list[Event] = []
    for event in inventories[:-1]:
        assert session.observe(event).emitted == []  # waiting for the rest
    job = session.state.job(JOB)
    wait = job.restores[1]
    last = inventories[-1]
    wait = type(wait)(wait.generation, wait.deadline, {**wait.inventories, last.payload.node_id: last.payload})
    expected = plan_restore(1, 4096, restore_targets(job, wait), wait.inventories, job.addresses, job.persisted,
                            owner_digests=job.owner_digests)
    emitted = session.observe(last).emitted
    decide_s = time.perf_counter() - started
    assert not [e for e in emitted if isinstance(e.payload, DecisionRefused)]
    assert max(size(e) for e in emitted) <= LIMIT

    parts = [e for e in emitted if isinstance(e.payload, CheckpointNodeRestorePlanned)]
    [plan] = [e for e in emitted if isinstance(e.payload, CheckpointRestorePlanned)]
    # Every part is published before the plan, on its node's subject, with exactly the ranks it runs.
    assert emitted.index(plan) == len(parts) and emitted[:len(parts)] == parts
    assert len(parts) == 512 == plan.payload.node_parts
    for event in parts:
        assert event.subject == f"node/{event.payload.node_id}"
        assert (event.payload.generation, event.payload.step, event.payload.part, event.payload.parts) == (1, 40, 0, 1)
        assert [s.rank for s in event.payload.sources] == [s.rank for s in nodes[event.payload.node_id]]
    # The union of the parts is the whole plan.
    union = sorted((s for e in parts for s in e.payload.sources), key=lambda s: s.rank)
    assert expected.step == 40 and union == list(expected.sources) and plan.payload.sources == []
    assert {s.tier for s in union if s.rank in {x.rank for x in nodes[replaced]}} == {"peer"}
    assert plan.payload.step == 40 and plan.payload.ranks == 4096
    assert plan.payload.tiers == {"memory": 4096 - 8, "peer": 8}
    # The plan in one event, as before, would not have fitted.
    whole = CheckpointRestorePlanned(generation=1, step=40, sources=list(expected.sources), reason=plan.payload.reason)
    assert len(whole.model_dump_json()) > LIMIT
    assert decide_s < 60, decide_s


def test_a_node_with_more_entries_than_one_part_takes_gets_several_parts() -> None:
    sources = [RestoreSource(rank=r, tier="disk", node_id="", path=f"/ckpt/j/step-000000040/rank-{r:05d}.shard",
                             digest=digest(r, 40), bytes=1 << 20) for r in range(2048)]
    chunks = split(sources)
    assert len(chunks) > 1 and [s for chunk in chunks for s in chunk] == sources
    assert all(sum(len(s.model_dump_json()) + 1 for s in chunk) <= PART_BUDGET_BYTES for chunk in chunks)
    assert split([]) == []
    # One entry larger than the budget goes alone (the kernel's size check at publish judges it).
    assert [len(c) for c in split(sources[:3], budget_bytes=10)] == [1, 1, 1]


def test_two_fat_nodes_get_their_plan_in_several_parts_each() -> None:
    """2 nodes x 2,048 ranks: each node's part is split (part i of parts), and still under the limit."""
    world = 4096
    session = DeciderSession(CheckpointBrokerDecider(), max_event_bytes=LIMIT)
    emitted = []
    for n in range(2):
        node = f"fat{n}"
        ranks = [RankGroups(rank=r, dp=[r % 2048, 2048 + r % 2048], pp=[r], tp=[r]) for r in range(n * 2048, (n + 1) * 2048)]
        emitted += session.observe(ev(CheckpointRanksRegistered(node_id=node, generation=0, world_size=world,
                                                                store_address=f"{node}:1", ranks=ranks), node)).emitted
    placement = [e for e in emitted if isinstance(e.payload, CheckpointNodeBackupsAssigned)]
    assert len(placement) > 2 and max(size(e) for e in emitted) <= LIMIT
    assert sorted(a.rank for e in placement for a in e.payload.assignments) == list(range(world))
    for n in range(2):
        mine = [e.payload for e in placement if e.payload.node_id == f"fat{n}"]
        assert [p.part for p in mine] == list(range(len(mine))) and {p.parts for p in mine} == {len(mine)}
    emitted = []
    for n in range(2):
        node = f"fat{n}"
        entries = [InventoryEntry(rank=r, tier="memory", step=7, bytes=1, digest=digest(r, 7))
                   for r in range(n * 2048, (n + 1) * 2048)]
        emitted += session.observe(ev(CheckpointInventoryReported(
            node_id=node, generation=1, entries=entries, rejected=[], ranks=[e.rank for e in entries]), node)).emitted
    parts = [e.payload for e in emitted if isinstance(e.payload, CheckpointNodeRestorePlanned)]
    [plan] = [e.payload for e in emitted if isinstance(e.payload, CheckpointRestorePlanned)]
    assert plan.step == 7 and plan.node_parts == len(parts) > 2 and max(size(e) for e in emitted) <= LIMIT
    assert sorted(s.rank for p in parts for s in p.sources) == list(range(world))


# -- the agent side ------------------------------------------------------------------------------------


def node_checkpointing(tmp_path: Path, node: str, ranks: list[int]) -> NodeCheckpointing:
    ckpt = NodeCheckpointing(job_id=JOB, node_id=node, local_ranks=ranks, world_size=16, node_dir=tmp_path / "shm",
                             agent_dir=tmp_path / "agent", emit=lambda *a, **k: None, transport=None,
                             persist_root=None)
    ckpt.prepare_restart(1)
    assert ckpt.inventory_future is not None
    ckpt.inventory_future[1].result(timeout=10)
    ckpt.tick(0.0, {}, {})  # the inventory goes out: the plan is applied as soon as it is whole
    assert ckpt.inventory_future is None
    return ckpt


def disk_source(rank: int) -> RestoreSource:
    return RestoreSource(rank=rank, tier="disk", node_id="", path=f"/ckpt/{JOB}/step-000000040/rank-{rank:05d}.shard",
                         digest=digest(rank, 40), bytes=10)


def broker_event(payload: EventPayload, subject: str) -> Event:
    return Event.create(payload, job_id=JOB, subject=subject, producer="checkpoint-broker", occurred_at=T0)


def written_plan(ckpt: NodeCheckpointing) -> dict | None:
    path = plan_file(ckpt.agent_dir, 1)
    return json.loads(path.read_text()) if path.exists() else None


def summary(node_parts: int, step: int = 40, sources: list[RestoreSource] | None = None) -> Event:
    return broker_event(CheckpointRestorePlanned(generation=1, step=step, reason="planned", sources=sources or [],
                                                 ranks=16, tiers={"disk": 16}, node_parts=node_parts), f"job/{JOB}")


def part(node: str, ranks: list[int], index: int = 0, count: int = 1) -> Event:
    return broker_event(CheckpointNodeRestorePlanned(node_id=node, generation=1, step=40, part=index, parts=count,
                                                     sources=[disk_source(r) for r in ranks]), f"node/{node}")


def test_the_agent_applies_its_parts_then_the_plan(tmp_path: Path) -> None:
    ckpt = node_checkpointing(tmp_path, "n1", [8, 9, 10, 11])
    ckpt.handle_event(part("n1", [8, 9], 0, 2))
    ckpt.handle_event(part("n1", [10, 11], 1, 2))
    assert written_plan(ckpt) is None  # parts alone are not a plan
    ckpt.handle_event(summary(node_parts=4))
    plan = written_plan(ckpt)
    assert plan is not None and plan["step"] == 40 and sorted(plan["shards"], key=int) == ["8", "9", "10", "11"]
    assert plan["shards"]["10"] == {"digest": digest(10, 40), "tier": "disk", "path": disk_source(10).path,
                                    "format": "shard"}


def test_the_agent_waits_for_a_part_that_comes_after_the_plan(tmp_path: Path) -> None:
    ckpt = node_checkpointing(tmp_path, "n1", [8, 9, 10, 11])
    ckpt.handle_event(part("n1", [8, 9], 0, 2))
    ckpt.handle_event(summary(node_parts=4))
    assert written_plan(ckpt) is None  # ranks 10 and 11 are in a part still on its way
    ckpt.handle_event(part("n1", [10, 11], 1, 2))
    plan = written_plan(ckpt)
    assert plan is not None and sorted(plan["shards"], key=int) == ["8", "9", "10", "11"]
    assert not any("error" in entry for entry in plan["shards"].values())


def test_a_rank_the_parts_do_not_name_gets_an_explicit_error(tmp_path: Path) -> None:
    ckpt = node_checkpointing(tmp_path, "n1", [8, 9])
    ckpt.handle_event(part("n1", [8]))
    ckpt.handle_event(summary(node_parts=2))
    plan = written_plan(ckpt)
    assert plan is not None and "names no source for rank 9" in plan["shards"]["9"]["error"]
    assert "error" not in plan["shards"]["8"]


def test_a_fresh_start_needs_no_part_and_other_nodes_parts_are_ignored(tmp_path: Path) -> None:
    ckpt = node_checkpointing(tmp_path, "n1", [8, 9])
    ckpt.handle_event(part("n2", [8, 9]))  # another node's (a consumer filter would not even deliver it)
    ckpt.handle_event(summary(node_parts=0, step=-1))
    plan = written_plan(ckpt)
    assert plan is not None and plan["step"] == -1 and plan["shards"] == {}


def test_an_old_one_event_plan_still_applies(tmp_path: Path) -> None:
    """A version-1 plan (every rank's source in the one event) from an older broker's log or stream."""
    ckpt = node_checkpointing(tmp_path, "n1", [8, 9])
    envelope = json.loads(summary(node_parts=0).to_json())
    envelope["schema_version"] = 1
    envelope["payload"] = {"generation": 1, "step": 40, "reason": "planned",
                           "sources": [disk_source(r).model_dump(mode="json") for r in range(16)]}
    old = decode_event(json.dumps(envelope).encode(), max_bytes=LIMIT)
    assert isinstance(old.payload, CheckpointRestorePlanned) and old.payload.node_parts == 0
    assert old.payload.ranks == 16 and old.payload.tiers == {"disk": 16}
    ckpt.handle_event(old)
    plan = written_plan(ckpt)
    assert plan is not None and sorted(plan["shards"], key=int) == ["8", "9"]


def test_the_agent_takes_its_backup_assignments_from_its_part_or_an_old_job_wide_event(tmp_path: Path) -> None:
    ckpt = node_checkpointing(tmp_path, "n1", [8, 9])

    def assignment(rank: int, node: str, backup: str) -> BackupAssignment:
        return BackupAssignment(rank=rank, node_id=node, backup_node_id=backup, backup_address=f"{backup}:1")

    ckpt.handle_event(broker_event(CheckpointNodeBackupsAssigned(
        node_id="n1", assignments=[assignment(8, "n1", "n2")], reason="r", every_k_steps=20, backup_every_k_steps=4),
        "node/n1"))
    assert ckpt.assignments[8].backup_node_id == "n2" and (ckpt.every_k_steps, ckpt.backup_every) == (20, 4)
    ckpt.handle_event(broker_event(CheckpointBackupAssigned(
        assignments=[assignment(9, "n1", "n3"), assignment(0, "n0", "n1")], reason="r"), f"job/{JOB}"))
    assert {r: a.backup_node_id for r, a in ckpt.assignments.items()} == {8: "n2", 9: "n3"}


def fat_registrations(world: int = 4096) -> list[Event]:
    events = []
    for n in range(2):
        node = f"fat{n}"
        ranks = [RankGroups(rank=r, dp=[r % 2048, 2048 + r % 2048], pp=[r], tp=[r]) for r in range(n * 2048, (n + 1) * 2048)]
        events.append(ev(CheckpointRanksRegistered(node_id=node, generation=0, world_size=world,
                                                   store_address=f"{node}:1", ranks=ranks), node))
    return events


def test_parts_shrink_with_a_smaller_configured_event_limit() -> None:
    """The broker as its service builds it (``decider_from_settings``): parts hold at most a quarter of
    ``bus.max_event_bytes`` in entries, so a 32 KiB limit still takes every part."""
    from keel.checkpoint_broker.adapter import decider_from_settings
    from keel.infra.config import BusSettings

    limit = 32 * 1024
    settings = Settings(bus=BusSettings(max_event_bytes="32KiB"))  # type: ignore[arg-type]
    assert decider_from_settings(settings).policy.part_budget_bytes == limit // 4
    session = DeciderSession(decider_from_settings(settings), max_event_bytes=limit)
    emitted = [e for event in fat_registrations() for e in session.observe(event).emitted]
    assert not [e for e in emitted if isinstance(e.payload, DecisionRefused)]
    parts = [e for e in emitted if isinstance(e.payload, CheckpointNodeBackupsAssigned)]
    assert len(parts) > 8 and max(size(e) for e in emitted) <= limit
    assert sorted(a.rank for e in parts for a in e.payload.assignments) == list(range(4096))


def test_a_part_over_the_limit_is_refused_with_its_reason_not_published() -> None:
    """A broker whose parts are larger than the bus takes (a limit below the parts' budget) records a
    refusal naming the event and its size: the size check at publish, never a crash loop."""
    session = DeciderSession(CheckpointBrokerDecider(), max_event_bytes=16 * 1024)  # parts of up to 64 KiB
    emitted = [e for event in fat_registrations() for e in session.observe(event).emitted]
    [refused] = [e.payload for e in emitted]
    assert isinstance(refused, DecisionRefused)
    assert "CheckpointNodeBackupsAssigned would be" in refused.error and "16384-byte event limit" in refused.error


def test_a_restart_judges_the_backup_peers_afresh(tmp_path: Path) -> None:
    """Right after an in-place restart, peers already at the new generation refuse this node's backups of
    the old one (stale) until it restarts too: three quick failures. Carried into the new generation they
    held its backups for the retry interval (10 s), so no report round completed and a lost node's ranks
    restored a step from before the restart (bench/recovery.py --hosts netns)."""
    import time

    ckpt = NodeCheckpointing(job_id=JOB, node_id="n1", local_ranks=[2, 3], world_size=16, node_dir=tmp_path / "shm",
                             agent_dir=tmp_path / "agent", emit=lambda *a, **k: None, transport=None,
                             persist_root=None)
    for progress in ckpt.progress.values():
        progress.send_failures = 3
        progress.retry_at_s = time.monotonic() + 10.0
    ckpt.prepare_restart(1)
    assert ckpt.inventory_future is not None
    ckpt.inventory_future[1].result(timeout=10)
    assert [(p.send_failures, p.retry_at_s) for p in ckpt.progress.values()] == [(0, 0.0), (0, 0.0)]
