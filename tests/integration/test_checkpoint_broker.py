"""The checkpoint broker against real NATS JetStream and PostgreSQL: placement, commits, the
persistent tier's manifest on disk, retention, restore plans (complete and timed out) and the repair
of a manifest left unwritten by a crash."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from keel.checkpoint import disk as ckpt_disk
from keel.checkpoint_broker.adapter import PERSISTER, CheckpointBroker
from keel.checkpoint_broker.decider import CheckpointBrokerDecider
from keel.events.envelope import Event, decode_event
from keel.events.types import (
    CLOCK_PRODUCER,
    CheckpointInventoryReported,
    CheckpointRanksRegistered,
    CheckpointShardsStored,
    InventoryEntry,
    RankGroups,
    ShardRecord,
)
from keel.infra.bus import fetch_batch
from keel.infra.clock import JobClock
from keel.infra.config import CheckpointSettings, Settings
from keel.kernel.decider import DeciderSession
from tests.factories import T0

pytestmark = pytest.mark.integration

JOB = "train1"
WORLD = 4  # 2 DP x 2 PP, one rank per node n0..n3


def groups(rank: int) -> RankGroups:
    d, p = divmod(rank, 2)
    return RankGroups(rank=rank, dp=[p, 2 + p], pp=[2 * d, 2 * d + 1], tp=[rank])


def at(seconds: float):  # type: ignore[no-untyped-def]
    return T0 + timedelta(seconds=seconds)


def node_event(payload, node: str, seconds: float = 0) -> Event:  # type: ignore[no-untyped-def]
    return Event.create(payload, job_id=JOB, subject=f"node/{node}", producer="agent", occurred_at=at(seconds))


def registrations(generation: int = 0) -> list[Event]:
    return [node_event(CheckpointRanksRegistered(node_id=f"n{r}", generation=generation, world_size=WORLD,
                                                 store_address=f"127.0.0.1:{7300 + r}", ranks=[groups(r)]), f"n{r}")
            for r in range(WORLD)]


def payload_bytes(rank: int, step: int) -> bytes:
    return f"rank {rank} step {step} ".encode() * (100 + rank)


def persisted_shards(root: Path, step: int, seconds: float) -> list[Event]:
    """Every node writes its rank's shard file, then reports it stored on the disk tier."""
    events = []
    for rank in range(WORLD):
        written = ckpt_disk.write_shard(root, JOB, step, rank, payload_bytes(rank, step))
        record = ShardRecord(rank=rank, step=step, bytes=written.bytes, digest=written.sha256, write_s=0.01 * (rank + 1))
        events.append(node_event(CheckpointShardsStored(node_id=f"n{rank}", tier="disk", shards=[record]), f"n{rank}",
                                 seconds))
    return events


def settings_for(keel_env, root: Path) -> Settings:  # type: ignore[no-untyped-def]
    checkpoint = CheckpointSettings(persist_root=root, retention=2, restore_plan_timeout="1s",  # type: ignore[arg-type]
                                    report_interval="100ms")  # type: ignore[arg-type]
    return keel_env.settings.model_copy(update={"checkpoint": checkpoint})


async def start_broker(keel_env, root: Path) -> CheckpointBroker:  # type: ignore[no-untyped-def]
    broker = CheckpointBroker(keel_env.bus, keel_env.store, settings_for(keel_env, root), fetch_timeout_s=0.1)
    await broker.start()
    stop = asyncio.Event()
    keel_env.stops.append(stop)
    keel_env.tasks.append(asyncio.create_task(broker.run(stop)))
    return broker


class Observer:
    """Reads the job's events off the bus, as an agent would."""

    def __init__(self, keel_env) -> None:  # type: ignore[no-untyped-def]
        self.env = keel_env
        self.seen: list[Event] = []
        self._sub = None

    async def start(self) -> Observer:
        prefix = self.env.settings.bus.subject_prefix
        self._sub = await self.env.bus.pull_consumer("test-observer", filter_subject=f"{prefix}.{JOB}.>")
        return self

    async def wait_for(self, predicate: Callable[[Event], bool], count: int = 1, timeout_s: float = 20) -> list[Event]:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            matching = [e for e in self.seen if predicate(e)]
            if len(matching) >= count:
                return matching
            if asyncio.get_running_loop().time() > deadline:
                types = [e.type for e in self.seen]
                raise AssertionError(f"timed out; saw {types}")
            for task in self.env.tasks:
                if task.done() and task.exception():
                    raise task.exception()  # type: ignore[misc]
            for msg in await fetch_batch(self._sub, 256, 0.1):
                self.seen.append(decode_event(msg.data, max_bytes=self.env.settings.bus.max_event_bytes))
                await msg.ack()


def of_type(name: str, **fields: object) -> Callable[[Event], bool]:
    def match(event: Event) -> bool:
        return event.type == name and all(getattr(event.payload, k) == v for k, v in fields.items())

    return match


async def test_placement_commits_and_the_manifest_written_atomically_with_retention(keel_env, scratch_dir) -> None:
    root = scratch_dir / "persist"
    observer = await Observer(keel_env).start()
    broker = await start_broker(keel_env, root)
    await keel_env.bus.publish_many(registrations())
    # One part per node, on that node's subject, with the assignments of the rank it runs.
    parts = await observer.wait_for(of_type("CheckpointNodeBackupsAssigned"), count=WORLD)
    assignments = [a for e in parts for a in e.payload.assignments]
    backups = {a.rank: a.backup_node_id for a in assignments}
    assert sorted(backups) == list(range(WORLD))
    assert all(a.fallback == "" and a.backup_node_id != a.node_id for a in assignments)
    assert all(e.producer == "checkpoint-broker" and e.subject == f"node/{e.payload.node_id}"
               and [a.node_id for a in e.payload.assignments] == [e.payload.node_id] for e in parts)

    # Memory tier: each node's rank at steps 5 and 6; step 6 commits once the last node reports it.
    await keel_env.bus.publish_many([
        node_event(CheckpointShardsStored(node_id=f"n{r}", tier="memory", shards=[
            ShardRecord(rank=r, step=s, bytes=10, digest=f"{r}{s}".ljust(64, "0")) for s in (5, 6)]), f"n{r}", 1)
        for r in range(WORLD)])
    [memory] = await observer.wait_for(of_type("CheckpointStepCommitted", tier="memory"))
    assert (memory.payload.step, memory.payload.ranks, memory.payload.bytes) == (6, WORLD, 40)

    # Disk tier: three persisted steps; the manifest lands after the last shard, retention keeps two.
    for index, step in enumerate((100, 200, 300)):
        await keel_env.bus.publish_many(persisted_shards(root, step, 2 + index))
        await observer.wait_for(of_type("CheckpointPersisted", step=step))
    commits = [e.payload.step for e in observer.seen if of_type("CheckpointStepCommitted", tier="disk")(e)]
    assert commits == [100, 200, 300]
    [persisted] = [e for e in observer.seen if of_type("CheckpointPersisted", step=300)(e)]
    assert persisted.producer == PERSISTER
    assert persisted.payload.save_cost_s == pytest.approx(0.04)  # the slowest node's write time
    manifest = ckpt_disk.read_manifest(root, JOB, 300)
    assert persisted.payload.path == str(manifest.path) and persisted.payload.manifest_digest == manifest.digest
    assert [(e.rank, e.bytes) for e in manifest.shards] == [(r, len(payload_bytes(r, 300))) for r in range(WORLD)]
    for rank in range(WORLD):
        assert ckpt_disk.load_shard(root, JOB, 300, rank) == payload_bytes(rank, 300)
    document = json.loads(manifest.path.read_text())
    assert document["job"] == JOB and document["world_size"] == WORLD
    step_dir = ckpt_disk.step_dir(root, JOB, 300)
    assert not [p.name for p in step_dir.iterdir() if ".tmp" in p.name]  # written via a temp file and a rename
    assert [c.step for c in ckpt_disk.list_checkpoints(root, JOB)] == [200, 300]  # retention: newest 2
    assert broker.stats.manifests_written == 3 and broker.stats.removed_dirs == 1

    # The decider folds its adapter's report back in (through the stream) and mirrors retention.
    for _ in range(100):
        if 300 in broker.state.job(JOB).persisted:
            break
        await asyncio.sleep(0.05)
    job = broker.state.job(JOB)
    assert sorted(job.persisted) == [200, 300] and job.pending_manifests() == []


def inventory(node: str, generation: int, entries: list[InventoryEntry], seconds: float) -> Event:
    return node_event(CheckpointInventoryReported(node_id=node, generation=generation, entries=entries), node, seconds)


def memory_entry(rank: int, step: int) -> InventoryEntry:
    return InventoryEntry(rank=rank, tier="memory", step=step, bytes=10, digest=f"{rank}{step}".ljust(64, "0"))


async def run_job_clock(keel_env, interval: timedelta, job_id: str = JOB) -> JobClock:  # type: ignore[no-untyped-def]
    """The one job clock, as the controller's process runs it, ticking the job ``job_id``."""
    clock = JobClock(keel_env.bus, lambda: [job_id], interval)
    stop = asyncio.Event()
    keel_env.stops.append(stop)

    async def tick() -> None:
        while not stop.is_set():
            await clock.tick()
            await asyncio.sleep(interval.total_seconds())

    keel_env.tasks.append(asyncio.create_task(tick()))
    return clock


async def test_restore_plans_when_every_inventory_arrived_or_after_the_timeout(keel_env, scratch_dir) -> None:
    observer = await Observer(keel_env).start()
    await start_broker(keel_env, scratch_dir / "persist")
    await run_job_clock(keel_env, timedelta(seconds=1))
    await keel_env.bus.publish_many(registrations())
    await observer.wait_for(of_type("CheckpointNodeBackupsAssigned"), count=WORLD)

    # Generation 1: every node answers; everything restores from memory.
    await keel_env.bus.publish_many([inventory(f"n{r}", 1, [memory_entry(r, 40), memory_entry(r, 41)], 10)
                                     for r in range(WORLD)])
    [plan] = await observer.wait_for(of_type("CheckpointRestorePlanned", generation=1))
    assert plan.payload.step == 41 and plan.payload.tiers == {"memory": WORLD} and plan.payload.node_parts == WORLD
    # Each node's part, on its subject, before the plan: its rank from its own memory.
    parts = [e for e in observer.seen if e.type == "CheckpointNodeRestorePlanned"]
    assert sorted((e.subject, [(s.rank, s.tier, s.node_id) for s in e.payload.sources]) for e in parts) == [
        (f"node/n{r}", [(r, "memory", f"n{r}")]) for r in range(WORLD)]
    assert all(observer.seen.index(e) < observer.seen.index(plan) for e in parts)
    assert not [e for e in observer.seen if e.type == "CheckpointTierFallback"]

    # Generation 2: n3 never answers. After the 1 s wait the job clock ticks and the broker plans with
    # what arrived; n3's rank has no copy anywhere, so the job starts fresh and says why.
    await keel_env.bus.publish_many([inventory(f"n{r}", 2, [memory_entry(r, 50)], 20) for r in range(3)])
    [fresh] = await observer.wait_for(of_type("CheckpointRestorePlanned", generation=2), timeout_s=30)
    assert fresh.payload.step == -1 and "absent: n3" in fresh.payload.reason
    ticks = [e for e in observer.seen if e.type == "TimerTicked"]
    assert ticks and all(t.producer == CLOCK_PRODUCER for t in ticks)
    assert fresh.causation_id in {t.id for t in ticks}
    [job_level] = await observer.wait_for(of_type("CheckpointTierFallback", generation=2))
    assert (job_level.payload.rank, job_level.payload.to_tier) == (-1, "none")
    assert "held for 3 of 4 ranks" in job_level.payload.reason


async def test_cold_start_writes_a_manifest_a_crash_left_unwritten(keel_env, scratch_dir) -> None:
    root = scratch_dir / "persist"
    # A previous broker decided the disk commit, then died before writing the manifest.
    inputs = registrations() + persisted_shards(root, 700, 1)
    previous = DeciderSession(CheckpointBrokerDecider())
    decisions = [e for event in inputs for e in previous.observe(event).emitted]
    # Each node's assignments, each holder's part of them (who sends it which rank's backups), the commit.
    assert [e.type for e in decisions] == (["CheckpointNodeBackupsAssigned"] * WORLD + ["CheckpointNodeBackupsHeld"] * WORLD
                                           + ["CheckpointStepCommitted"])
    await keel_env.bus.publish_many(inputs + decisions)
    await keel_env.start_recorder()
    assert await keel_env.wait_for_count(len(inputs) + len(decisions)) == len(inputs) + len(decisions)
    assert not ckpt_disk.manifest_path(root, JOB, 700).exists()

    observer = await Observer(keel_env).start()
    broker = await start_broker(keel_env, root)  # folds the log, then repairs
    [persisted] = await observer.wait_for(of_type("CheckpointPersisted", step=700))
    assert persisted.causation_id == decisions[-1].id
    assert ckpt_disk.read_manifest(root, JOB, 700).digest == persisted.payload.manifest_digest
    # The old decisions are not made again.
    await asyncio.sleep(0.5)
    assert [e.type for e in observer.seen if e.producer == "checkpoint-broker"] == [e.type for e in decisions]
    assert broker.stats.manifests_written == 1
