"""A 4,096-rank job (512 nodes x 8 ranks) against real NATS JetStream and PostgreSQL: the checkpoint broker
service places every rank's backup and plans a restore, each node's part on its own subject, every event
within ``bus.max_event_bytes``; node agents' consumers (their real subject filters and durable names)
receive exactly their own node's parts, and each agent's checkpointing writes the plan file of its ranks.

Before per-node parts, both decisions were one event each (about 1 MiB here): the broker refused them
(or, before that, crash-looped on NATS's payload limit) and no plan was ever delivered."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from pathlib import Path

import pytest

from keel.agent.checkpointing import NodeCheckpointing, plan_file
from keel.agent.consumer import command_subjects, durable_name
from keel.checkpoint_broker.adapter import CheckpointBroker
from keel.events.envelope import Event, decode_event
from keel.events.types import (
    CheckpointInventoryReported,
    CheckpointNodeBackupsAssigned,
    CheckpointNodeRestorePlanned,
    CheckpointRanksRegistered,
    CheckpointRestorePlanned,
    CheckpointShardsStored,
    InventoryEntry,
    RankGroups,
    ShardRecord,
)
from keel.infra.bus import fetch_batch
from keel.infra.config import CheckpointSettings
from keel.infra.consumer import EventConsumer
from tests.factories import T0

pytestmark = pytest.mark.integration

JOB = "big"
NODES, PER_NODE = 512, 8
WORLD = NODES * PER_NODE
DP, PP = WORLD // (PP_ := 8) // PER_NODE, PP_  # TP = the 8 ranks of a node, PP over 8 nodes, DP 64
REPLACED = 100  # this node's memory is gone (a replacement): its ranks restore from their peers' copies
SAMPLED = (0, 37, REPLACED, NODES - 1)  # the nodes whose agent-side consumers run here


def node_id(n: int) -> str:
    return f"gpu{n:03d}.dc1"  # a dot: the subject token is encoded, the consumer name too


def groups(rank: int) -> RankGroups:
    d, rest = divmod(rank, PP * PER_NODE)
    p, t = divmod(rest, PER_NODE)

    def r(d_: int, p_: int, t_: int) -> int:
        return d_ * PP * PER_NODE + p_ * PER_NODE + t_

    return RankGroups(rank=rank, dp=[r(x, p, t) for x in range(DP)], pp=[r(d, x, t) for x in range(PP)],
                      tp=[r(d, p, x) for x in range(PER_NODE)])


def ranks_of(n: int) -> list[int]:
    return list(range(n * PER_NODE, (n + 1) * PER_NODE))


def digest(rank: int, step: int) -> str:
    return f"{rank:05d}{step:059d}"


def node_event(payload, n: int, seconds: float) -> Event:  # type: ignore[no-untyped-def]
    return Event.create(payload, job_id=JOB, subject=f"node/{node_id(n)}", producer="agent",
                        occurred_at=T0 + timedelta(seconds=seconds))


class AgentSide:
    """One node agent's consumer (its subjects and durable name) feeding its checkpointing's broker events."""

    def __init__(self, keel_env, n: int, base: Path) -> None:  # type: ignore[no-untyped-def]
        self.node_id = node_id(n)
        self.received: list[Event] = []
        self.ckpt = NodeCheckpointing(job_id=JOB, node_id=self.node_id, local_ranks=ranks_of(n), world_size=WORLD,
                                      node_dir=base / "shm" / self.node_id, agent_dir=base / "agent" / self.node_id,
                                      emit=lambda *a, **k: None, transport=None, persist_root=None)
        subjects = command_subjects(keel_env.settings.bus.subject_prefix, JOB, self.node_id, checkpointing=True)
        self.consumer = EventConsumer(keel_env.bus, durable_name(JOB, self.node_id, checkpointing=True), subjects,
                                      batch_size=64, fetch_timeout_s=0.1)

    async def restart(self, generation: int) -> None:
        """As a restart command does: the inventory is taken (and goes out) before the plan applies."""
        self.ckpt.prepare_restart(generation)
        assert self.ckpt.inventory_future is not None
        await asyncio.to_thread(self.ckpt.inventory_future[1].result, 10)
        self.ckpt.tick(0.0, {}, {})

    async def handle(self, event: Event, _seq: int) -> None:
        self.received.append(event)
        self.ckpt.handle_event(event)


async def test_a_4096_rank_restore_plan_is_delivered_each_node_its_own_part(keel_env, scratch_dir) -> None:
    limit = int(keel_env.settings.bus.max_event_bytes)
    settings = keel_env.settings.model_copy(update={"checkpoint": CheckpointSettings(
        persist_root=scratch_dir / "persist", restore_plan_timeout="10m")})  # type: ignore[arg-type]
    broker = CheckpointBroker(keel_env.bus, keel_env.store, settings, fetch_timeout_s=0.1)
    await broker.start()
    stop = asyncio.Event()
    keel_env.stops.append(stop)
    keel_env.tasks.append(asyncio.create_task(broker.run(stop)))
    agents = {n: AgentSide(keel_env, n, scratch_dir) for n in SAMPLED}
    for agent in agents.values():
        await agent.consumer.start()
        await agent.restart(1)
    prefix = keel_env.settings.bus.subject_prefix
    observer = await keel_env.bus.pull_consumer("test-broker-decisions", filter_subject=f"{prefix}.{JOB}.>")
    seen: list[Event] = []

    async def collect(until, timeout_s: float = 120) -> None:  # type: ignore[no-untyped-def]
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not until():
            assert asyncio.get_running_loop().time() < deadline, [e.type for e in seen][-20:]
            for task in keel_env.tasks:
                if task.done() and task.exception():
                    raise task.exception()  # type: ignore[misc]
            for msg in await fetch_batch(observer, 512, 0.1):
                assert len(msg.data) <= limit, (msg.subject, len(msg.data))
                seen.append(decode_event(msg.data, max_bytes=limit))
                await msg.ack()
            for agent in agents.values():
                await agent.consumer.run_once(agent.handle)

    def of(kind: type) -> list[Event]:
        return [e for e in seen if isinstance(e.payload, kind)]

    await keel_env.bus.publish_many([node_event(CheckpointRanksRegistered(
        node_id=node_id(n), generation=0, world_size=WORLD, store_address=f"10.0.{n // 256}.{n % 256}:7301",
        ranks=[groups(r) for r in ranks_of(n)]), n, 0) for n in range(NODES)])
    await collect(lambda: len(of(CheckpointNodeBackupsAssigned)) == NODES)
    backups = {a.rank: a.backup_node_id for e in of(CheckpointNodeBackupsAssigned) for a in e.payload.assignments}
    assert sorted(backups) == list(range(WORLD))

    # Before it was lost, the replaced node reported its ranks' step 40: the digests its peers' copies must
    # match to be restored (a holder's own claim is never enough).
    await keel_env.bus.publish_many([node_event(CheckpointShardsStored(
        node_id=node_id(REPLACED), tier="memory", shards=[ShardRecord(rank=r, step=40, bytes=1 << 20, digest=digest(r, 40))
                                                         for r in ranks_of(REPLACED)]), REPLACED, 0.5)])
    # Generation 1: every node reports what it holds; the replaced node holds no memory copy.
    inventories = []
    for n in range(NODES):
        entries = [] if n == REPLACED else [
            InventoryEntry(rank=r, tier="memory", step=s, bytes=1 << 20, digest=digest(r, s)) for r in ranks_of(n)
            for s in (40, 41)]
        entries += [InventoryEntry(rank=r, tier="peer", step=40, bytes=1 << 20, digest=digest(r, 40))
                    for r, holder in sorted(backups.items()) if holder == node_id(n)]
        inventories.append(node_event(CheckpointInventoryReported(
            node_id=node_id(n), generation=1, entries=entries, rejected=[], ranks=ranks_of(n)), n, 1))
    await keel_env.bus.publish_many(inventories)
    await collect(lambda: of(CheckpointRestorePlanned) and all(
        plan_file(a.ckpt.agent_dir, 1).exists() for a in agents.values()))

    [plan] = of(CheckpointRestorePlanned)
    parts = of(CheckpointNodeRestorePlanned)
    assert plan.payload.step == 40 and plan.payload.ranks == WORLD and plan.payload.node_parts == NODES == len(parts)
    assert plan.payload.tiers == {"memory": WORLD - PER_NODE, "peer": PER_NODE} and plan.payload.sources == []
    assert all(seen.index(e) < seen.index(plan) for e in parts)  # in stream order, the parts come first
    whole = {s.rank: s for e in parts for s in e.payload.sources}
    assert sorted(whole) == list(range(WORLD))
    for n, agent in agents.items():
        # The node's consumer got its own node's parts and none of another node's.
        own = [e for e in agent.received if isinstance(e.payload, CheckpointNodeRestorePlanned | CheckpointNodeBackupsAssigned)]
        assert own and {e.payload.node_id for e in own} == {agent.node_id}
        assert [e.payload.part for e in own if isinstance(e.payload, CheckpointNodeRestorePlanned)] == [0]
        assert sorted(a.rank for e in own if isinstance(e.payload, CheckpointNodeBackupsAssigned)
                      for a in e.payload.assignments) == ranks_of(n)
        # Its plan file: exactly its ranks, each from the source the broker planned.
        written = json.loads(plan_file(agent.ckpt.agent_dir, 1).read_text())
        assert written["step"] == 40 and sorted(written["shards"], key=int) == [str(r) for r in ranks_of(n)]
        for r in ranks_of(n):
            entry, source = written["shards"][str(r)], whole[r]
            assert (entry["tier"], entry["digest"]) == (source.tier, source.digest == digest(r, 40) and source.digest)
            assert source.tier == ("peer" if n == REPLACED else "memory")
            # This test's agents hold no slot and no shard transport: staging says so, per rank.
            assert "no verified slot" in entry["error"] if source.tier == "memory" else "no shard transport" in entry["error"]
