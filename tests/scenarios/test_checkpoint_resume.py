"""Exact resume, end to end: the example GPT trains on a local cluster (4 nodes x 1 rank, DP 2 x PP 2, so
every pipeline spans two nodes) with every-step in-memory checkpoints, peer backups and the checkpoint
broker. One run is interrupted three times - a rank SIGKILLed, a whole node lost (processes and shared
memory), a whole pipeline group lost - and restored each time; its final parameters and per-step losses
must be bitwise equal to an uninterrupted run's.

The restarts are commanded by hand here (the controller's job) and the job clock ticks from the test (the
controller's process hosts it); everything else is Keel's: inventories, the broker's restore plan and tier
fallbacks, peer fetches over gRPC, the ranks' restore.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from keel.checkpoint_broker.restore import joined_sources
from keel.cluster.local import cluster_down, cluster_status, cluster_up, kill_node, start_node
from keel.events.envelope import Event, now_utc
from keel.events.types import RanksRestartRequested
from keel.sdk.shard import decode_shard
from tests.integration.test_checkpoint_broker import run_job_clock
from tests.integration.test_crashes import service_env, start_service_process
from tests.scenarios.test_cluster_faults import stop_process

pytestmark = pytest.mark.integration

STEPS = 240
"""Room for three losses: each waits for a peer commit of the resumed history, and a backup round may span
32 or 64 steps; with 120 the last loss came within a few steps of the end on a loaded machine, as the
survivors were finishing."""
NODES = ["n00", "n01", "n02", "n03"]
TRAIN = ["-m", "keel.workload.train", "--size", "tiny", "--pp", "2", "--steps", str(STEPS), "--min-step-time", "200ms"]
"""Paced at 200 ms a step: the broker commits a tier from heartbeats' report rounds (at most every 10 s), and
after each loss the resumed job must outlive a round for the next premise (a peer commit after the
restore); unpaced on a loaded machine it ran its last 40 steps in 4 s and ended first."""
_STEP_LINE = re.compile(r"^step (\d+) loss \S+ .*loss_hex (\S+)", re.M)


def losses_of(stdout_files: list[Path]) -> dict[int, str]:
    """Step -> loss (exact, as float.hex) from rank 0's stdout, the last line per step (a restored run
    repeats the steps after its checkpoint)."""
    losses: dict[int, str] = {}
    for path in sorted(stdout_files, key=lambda p: int(p.name.split(".g")[1].split(".")[0])):
        for step, loss in _STEP_LINE.findall(path.read_text()):
            losses[int(step)] = loss
    return losses


def state_of(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved shard, by its path in the state tree."""
    meta, tree = decode_shard(path.read_bytes())
    flat: dict[str, torch.Tensor] = {}

    def walk(node: object, where: str) -> None:
        if isinstance(node, torch.Tensor):
            flat[where] = node
        elif isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, f"{where}/{i}")

    walk(tree, "")
    return flat


def assert_bitwise_equal(a: Path, b: Path) -> None:
    left, right = state_of(a), state_of(b)
    assert left.keys() == right.keys()
    assert left, f"no tensors in {a}"
    for key in left:
        x, y = left[key], right[key]
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), f"{key} differs"


async def assert_equal_to_reference(scratch_dir: Path, rank0_stdout: list[Path]) -> None:
    """Every rank's final state (``<scratch>/final.rank<r>``) and rank 0's every step's loss equal the
    reference run's (``<scratch>/reference``), bit for bit."""
    for rank in range(4):
        final = Path(f"{scratch_dir / 'final'}.rank{rank}")
        deadline = time.monotonic() + 60
        while not final.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert_bitwise_equal(final, Path(f"{scratch_dir / 'reference' / 'final'}.rank{rank}"))
    reference_losses = losses_of(list((scratch_dir / "reference" / "agent" / "logs").glob("rank0.g*.stdout")))
    assert sorted(reference_losses) == list(range(STEPS))
    assert losses_of(rank0_stdout) == reference_losses


def reference_run(directory: Path) -> None:
    """The uninterrupted run: the same 4 ranks under `keel run` on one node, no checkpointing at all."""
    env = {**os.environ, "KEEL_HOME": str(directory)}
    env.pop("KEEL_NATS_URL", None)
    result = subprocess.run(
        [sys.executable, "-m", "keel.cli.main", "run", "--standalone", "--nproc-per-node", "4",
         "--keel-agent-dir", str(directory / "agent"), "--keel-no-checkpoint",
         *TRAIN, "--save-final", str(directory / "final")],
        env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


class Run:
    def __init__(self, keel_env, directory: Path, nodes: list[str] = NODES) -> None:  # type: ignore[no-untyped-def]
        self.env = keel_env
        self.settings = keel_env.settings
        self.directory = directory
        self.nodes = nodes
        self.generation = 0

    async def events(self, types: list[str]) -> list[Event]:
        return [r.event async for r in self.env.store.read(job_id="ckpt", types=types)]

    async def wait_for(self, types: list[str], predicate, timeout_s: float, what: str) -> Event:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in await self.events(types):
                if predicate(event):
                    return event
            await asyncio.sleep(0.2)
        seen = [(e.type, e.payload.model_dump()) for e in await self.events(types)][-6:]
        raise AssertionError(f"no {what} within {timeout_s}s; last events of those types: {seen}")

    def rank0_stdout(self) -> list[Path]:
        return list((self.directory / "cluster" / "nodes" / "n00" / "logs").glob("rank0.g*.stdout"))

    def current_step(self) -> int:
        steps = [int(s) for path in self.rank0_stdout() for s, _ in _STEP_LINE.findall(path.read_text())]
        return max(steps, default=-1)

    async def wait_step(self, step: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.current_step() < step:
            if time.monotonic() > deadline:
                raise AssertionError(f"training did not reach step {step} in {timeout_s}s (at {self.current_step()})")
            await asyncio.sleep(0.1)

    async def restart_all(self, reason: str) -> Event:
        """The controller's command, by hand: every node restarts its ranks as the next generation.
        Returns the broker's restore plan for it."""
        self.generation += 1
        generation = self.generation
        for node in self.nodes:
            command = Event.create(RanksRestartRequested(node_id=node, generation=generation, reason=reason,
                                                         expires_at=now_utc() + timedelta(minutes=2)),
                                   job_id="ckpt", subject=f"node/{node}", producer="controller", occurred_at=now_utc())
            await self.env.bus.publish(command)
        # Generous: a node started just before (a lost node, a lost pipeline) imports torch into its zygote
        # and reports its inventory first, on 2 cores shared with the reference run; this checks what the
        # plan holds, not how fast it comes (bench/recovery.py times that).
        try:
            plan = await self.wait_for(["CheckpointRestorePlanned"], lambda e: e.payload.generation == generation, 150,
                                       f"the restore plan of generation {generation}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; inventories of generation {generation}: {await self.inventories()}") from None
        # Each rank's source is in its node's part of the plan (recorded before the plan itself).
        parts = [e.payload for e in await self.events(["CheckpointNodeRestorePlanned"])]
        return plan.model_copy(update={"payload": plan.payload.model_copy(
            update={"sources": joined_sources(plan.payload, parts)})})

    async def wait_peer_commit_after(self, plan: Event, timeout_s: float = 90) -> int:
        """Wait until the peer tier commits a step newer than ``plan``'s, decided after it: a full round
        of backups of the resumed history (the premise of losing a node or a group next). The interval
        between backups follows the measured transfer time, so how many steps that takes varies."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            after_plan = False
            async for recorded in self.env.store.read(job_id="ckpt", types=["CheckpointRestorePlanned",
                                                                             "CheckpointStepCommitted"]):
                event = recorded.event
                if event.id == plan.id:
                    after_plan = True
                elif (after_plan and event.type == "CheckpointStepCommitted" and event.payload.tier == "peer"
                      and event.payload.step > plan.payload.step):
                    return event.payload.step
            await asyncio.sleep(0.2)
        reports = [(e.payload.node_id, [(r.rank, r.step) for r in e.payload.stored.get("peer", [])])
                   for e in await self.events(["NodeHeartbeat"]) if e.payload.stored.get("peer")][-12:]
        commits = [(e.payload.tier, e.payload.step) for e in await self.events(["CheckpointStepCommitted"])][-8:]
        schedule = [e.payload.model_dump() for e in await self.events(["CheckpointScheduleSet"])][-2:]
        raise AssertionError(f"no peer-tier commit after step {plan.payload.step} within {timeout_s}s "
                             f"(at step {self.current_step()}); last peer reports {reports}; last commits "
                             f"{commits}; schedule {schedule}")

    async def newest_peer_commit(self) -> int:
        """The newest step committed on the peer tier since the last restore plan (-1: none)."""
        newest = -1
        async for recorded in self.env.store.read(job_id="ckpt", types=["CheckpointRestorePlanned",
                                                                         "CheckpointStepCommitted"]):
            event = recorded.event
            if event.type == "CheckpointRestorePlanned":
                newest = -1
            elif event.payload.tier == "peer":
                newest = max(newest, event.payload.step)
        return newest

    async def inventories(self) -> list[tuple[str, list[tuple[str, int, int]]]]:
        """What every node reported holding before this generation's restore (for failure messages)."""
        return [(e.payload.node_id, sorted((x.tier, x.rank, x.step) for x in e.payload.entries))
                for e in await self.events(["CheckpointInventoryReported"]) if e.payload.generation == self.generation]


@asynccontextmanager
async def broker_run(keel_env, scratch_dir: Path, nodes: list[str] = NODES) -> AsyncIterator[Run]:  # type: ignore[no-untyped-def]
    """The recorder, the real checkpoint broker (persisting every 10 steps) and the job clock for job ``ckpt``; the
    local cluster in ``scratch_dir / "cluster"`` is taken down after."""
    await keel_env.start_recorder()
    env = {"KEEL_CHECKPOINT__PERSIST_ROOT": str(scratch_dir / "cluster" / "checkpoints"),
                "KEEL_CHECKPOINT__PERSIST_EVERY_FLOOR": "10", "KEEL_CHECKPOINT__PERSIST_EVERY_CEILING": "10",
                "KEEL_CHECKPOINT__RESTORE_PLAN_TIMEOUT": "20s"}
    broker = start_service_process("checkpoint-broker", keel_env.settings, scratch_dir / "broker.log", env)
    # The broker's restore plan stops waiting for a late node's inventory on the job clock: without the
    # ticks the controller would send, a replacement node still importing torch past the wait left the
    # plan waiting for an event that never came.
    await run_job_clock(keel_env, timedelta(seconds=1), job_id="ckpt")
    running = Run(keel_env, scratch_dir, nodes)
    try:
        yield running
    finally:
        await asyncio.to_thread(cluster_down, scratch_dir / "cluster")
        stop_process(broker)


@pytest.fixture
async def run(keel_env, scratch_dir):  # type: ignore[no-untyped-def]
    async with broker_run(keel_env, scratch_dir) as running:
        yield running


async def lose_and_replace_node(run: Run, scratch_dir: Path, lost: str) -> Event:
    """Kill ``lost``'s whole node (processes and shared memory), start a fresh one in its place, restart every node
    as the next generation: the restore plan."""
    await asyncio.to_thread(kill_node, scratch_dir / "cluster", lost)
    await asyncio.to_thread(start_node, scratch_dir / "cluster", lost)
    return await run.restart_all(f"test: node {lost} lost")


async def kill_a_rank_and_restart(run: Run, scratch_dir: Path, victim: str) -> Event:
    """SIGKILL the rank on ``victim`` and restart every node as the next generation: the plan, which must restore
    every rank from its node's memory."""
    state = cluster_status(scratch_dir / "cluster")
    pid = next(n["ranks"][0] for n in state["nodes"] if n["node_id"] == victim)
    os.kill(pid, signal.SIGKILL)
    plan = await run.restart_all(f"test: rank on {victim} killed")
    assert plan.payload.step >= 5
    assert {s.tier for s in plan.payload.sources} == {"memory"}, plan.payload
    return plan


async def test_exact_resume_after_a_rank_a_node_and_a_pipeline_group_are_lost(run: Run, scratch_dir: Path) -> None:
    rng = random.Random(int(os.environ.get("KEEL_TEST_SEED", "4")))
    reference = asyncio.create_task(asyncio.to_thread(reference_run, scratch_dir / "reference"))

    env = {k: v for k, v in service_env(run.settings).items() if k.startswith("KEEL_")}
    env["KEEL_INSPECTOR__STEP_TIMEOUT_FLOOR"] = "60s"
    await asyncio.to_thread(
        cluster_up, run.settings, scratch_dir / "cluster", nodes=4, standby=0, nproc_per_node=1, job_id="ckpt",
        command=[*TRAIN, "--save-final", str(scratch_dir / "final")], nats_url=run.settings.nats_url,
        extra_env=env, heartbeat_interval="2s", persist_root=scratch_dir / "cluster" / "checkpoints")

    # Backups are placed outside every group of their rank: rank r's DP peer and PP peer live on two
    # other nodes, so exactly one node is left for its backup.
    # One part per node (on its subject), all from the placement decided once every rank registered.
    deadline = time.monotonic() + 60
    while True:
        parts = await run.events(["CheckpointNodeBackupsAssigned"])
        assigned = [a for e in parts if e.causation_id == parts[0].causation_id for a in e.payload.assignments]
        if len(assigned) == 4 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.3)
    backup_of = {a.rank: a.backup_node_id for a in assigned}
    assert backup_of == {0: "n03", 1: "n02", 2: "n01", 3: "n00"}, backup_of
    assert all(not a.fallback for a in assigned)

    # 1. One rank SIGKILLed at a random step: restored from local memory.
    await run.wait_step(rng.randint(6, 14))
    victim = rng.choice(NODES)
    plan = await kill_a_rank_and_restart(run, scratch_dir, victim)
    first_restore = plan.payload.step
    await run.wait_step(first_restore + 8)
    await run.wait_peer_commit_after(plan)

    # 2. A whole node lost (its processes and its shared memory), replaced by a fresh machine: its
    #    rank comes back from the backup peer, and the broker says why it fell back.
    lost = rng.choice(NODES)
    plan = await lose_and_replace_node(run, scratch_dir, lost)
    lost_rank = NODES.index(lost)
    tiers = {s.rank: s.tier for s in plan.payload.sources}
    inventories = await run.inventories()
    peer_step = max((step for node, entries in inventories if node != lost for tier, r, step in entries
                     if tier == "peer" and r == lost_rank), default=-1)
    # The lost rank's shard survived on its backup peer, a full round of the resumed history at least.
    assert peer_step > first_restore, (peer_step, inventories)
    assert plan.payload.step > first_restore, (plan.payload, inventories)
    # It comes back from that copy, or from the persistent tier when a backup round was still in flight
    # at the loss and the disk holds a newer step for every rank (the planner takes the newest step).
    if tiers[lost_rank] == "peer":
        # The others resume at the same step: from memory when their ring still holds it, else from
        # their own backups (peers back up every k-th step, the same steps on every node).
        assert all(tier in ("memory", "peer") for rank, tier in tiers.items() if rank != lost_rank), tiers
    else:
        assert tiers[lost_rank] == "disk" and plan.payload.step > peer_step, (tiers, plan.payload.step, peer_step)
    fallback = await run.wait_for(["CheckpointTierFallback"], lambda e: e.payload.generation == run.generation
                                  and e.payload.rank == lost_rank, 10, "the tier fallback event")
    assert fallback.payload.from_tier == "memory" and fallback.payload.to_tier == tiers[lost_rank]
    second_restore = plan.payload.step
    await run.wait_step(second_restore + 8)
    await run.wait_peer_commit_after(plan)

    # 3. A whole pipeline group lost: both nodes of one pipeline, processes and memory.
    pipeline = rng.choice([[0, 1], [2, 3]])
    committed = await run.newest_peer_commit()
    assert run.current_step() < STEPS - 40, f"the premise needs a job still training (at step {run.current_step()})"
    for rank in pipeline:
        await asyncio.to_thread(kill_node, scratch_dir / "cluster", NODES[rank])
    for rank in pipeline:
        await asyncio.to_thread(start_node, scratch_dir / "cluster", NODES[rank])
    plan = await run.restart_all(f"test: pipeline {pipeline} lost")
    tiers = {s.rank: s.tier for s in plan.payload.sources}
    inventories = await run.inventories()
    context = (plan.payload.step, tiers, committed, plan.payload.reason, inventories)
    # The newest peer-committed step survives on the other pipeline's nodes: in their memory (the sent
    # ring pins it) and in the backups they hold for the lost ranks (newest and previous; rounds are at
    # least backup_min_period apart). The plan resumes there, or at a newer step the persistent tier
    # holds for every rank.
    assert committed > second_restore, context
    assert plan.payload.step >= committed, context
    if plan.payload.step == committed:
        assert all(tiers[r] == "peer" for r in pipeline), context
        assert all(tiers[r] in ("memory", "peer") for r in range(4) if r not in pipeline), context
    else:
        assert all(tiers[r] in ("peer", "disk") for r in pipeline), context
    fallbacks = await run.events(["CheckpointTierFallback"])
    assert {e.payload.rank for e in fallbacks if e.payload.generation == run.generation} >= set(pipeline)

    # The job finishes; final state and every step's loss equal the uninterrupted run, bit for bit.
    await run.wait_for(["RankExited"], lambda e: e.payload.generation == run.generation and e.payload.rank == 0
                       and e.payload.classification == "success", 240, "the end of training")
    await reference
    await assert_equal_to_reference(scratch_dir, run.rank0_stdout())

    # The persistent tier was written on the broker's schedule (every 10 steps here) with manifests.
    persisted = await run.events(["CheckpointPersisted"])
    assert persisted and all(e.payload.step % 10 == 0 for e in persisted)
    committed = await run.events(["CheckpointStepCommitted"])
    assert {e.payload.tier for e in committed} >= {"memory", "peer", "disk"}
