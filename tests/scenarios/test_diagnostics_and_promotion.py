"""The node agent's side of the escalation ladder, with real processes: a local cluster of 2 nodes x 1
rank (the example GPT, DP 2) plus a warm standby, the checkpoint broker, and the controller's commands
published by hand (the controller decides them in production; issue 5).

- A standby self-checks when it starts (``StandbyChecked``): it passes, and fails once its machine has
  lost a GPU.
- ``DiagnosticsRequested`` (rung 2): both nodes stop their ranks, run the round together and report
  ``DiagnosticsCompleted`` under the command's correlation id; an expired request stops nothing; a
  ``RanksRestartRequested`` afterwards resumes training.
- ``StandbyPromotionRequested``: a node is lost; the standby takes its slice, restores its rank from
  the peer copy held by the surviving node, and the job finishes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest

from keel.checkpoint_broker.restore import joined_sources
from keel.cluster.local import FaultSpec, cluster_down, cluster_up, inject, kill_node, start_node
from keel.events.envelope import Event, EventPayload, now_utc
from keel.events.types import DiagnosticsRequested, RankExited, RanksRestartRequested, StandbyPromotionRequested
from tests.integration.test_crashes import service_env, start_service_process
from tests.scenarios.test_cluster_faults import stop_process

pytestmark = pytest.mark.integration

JOB = "ladder"
NODES = ["n00", "n01"]
TRAIN = ["-m", "keel.workload.train", "--size", "tiny"]


class Ladder:
    def __init__(self, keel_env, directory: Path) -> None:  # type: ignore[no-untyped-def]
        self.env = keel_env
        self.settings = keel_env.settings
        self.directory = directory

    def up(self, steps: int, min_step_time: str = "0s") -> None:
        env = {k: v for k, v in service_env(self.settings).items() if k.startswith("KEEL_")}
        env["KEEL_INSPECTOR__STEP_TIMEOUT_FLOOR"] = "60s"
        cluster_up(self.settings, self.directory, nodes=2, standby=1, nproc_per_node=1, job_id=JOB,
                   command=[*TRAIN, "--steps", str(steps), "--min-step-time", min_step_time], nats_url=self.settings.nats_url, extra_env=env,
                   heartbeat_interval="1s", persist_root=self.directory / "checkpoints")

    async def publish(self, payload: EventPayload, subject: str) -> Event:
        command = Event.create(payload, job_id=JOB, subject=subject, producer="controller", occurred_at=now_utc())
        await self.env.bus.publish(command)
        return command

    async def events(self, types: list[str]) -> list[Event]:
        return [r.event async for r in self.env.store.read(job_id=JOB, types=types)]

    async def wait_for(self, types: list[str], predicate: Callable[[Event], bool], timeout_s: float, what: str) -> Event:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in await self.events(types):
                if predicate(event):
                    return event
            await asyncio.sleep(0.2)
        seen = [(e.type, e.subject, e.payload.model_dump()) for e in await self.events(types)][-8:]
        raise AssertionError(f"no {what} within {timeout_s}s; last events of those types: {seen}")

    async def wait_training(self, min_step: int, since: object = None, timeout_s: float = 60) -> None:
        for node in NODES:
            await self.wait_for(["NodeHeartbeat"], lambda e, n=node: e.payload.node_id == n and not e.payload.standby
                                and e.payload.last_step >= min_step and (since is None or e.occurred_at > since),
                                timeout_s, f"a heartbeat of {node} past step {min_step}")


@pytest.fixture
async def ladder(keel_env, scratch_dir):  # type: ignore[no-untyped-def]
    await keel_env.start_recorder()
    # The broker plans every restart's restore (restarted ranks wait for its plan).
    broker = start_service_process("checkpoint-broker", keel_env.settings, scratch_dir / "broker.log",
                                   {"KEEL_CHECKPOINT__PERSIST_ROOT": str(scratch_dir / "cluster" / "checkpoints"),
                                    "KEEL_CHECKPOINT__RESTORE_PLAN_TIMEOUT": "20s"})
    running = Ladder(keel_env, scratch_dir / "cluster")
    try:
        yield running
    finally:
        await asyncio.to_thread(cluster_down, running.directory)
        stop_process(broker)


async def test_diagnostics_stop_the_ranks_report_per_node_and_a_restart_resumes(ladder: Ladder) -> None:
    ladder.up(steps=1_000_000)
    checked = await ladder.wait_for(["StandbyChecked"], lambda e: True, 60, "the standby's self-check")
    assert checked.payload.node_id == "s00" and checked.payload.passed, checked.payload
    assert [r.check for r in checked.payload.results] == ["gpu_matmul", "intra_node_all_to_all"]
    await ladder.wait_training(min_step=3)
    # The standby's machine loses a GPU and its agent restarts: this time the self-check fails, naming it.
    await asyncio.to_thread(kill_node, ladder.directory, "s00")
    await asyncio.to_thread(inject, ladder.settings, ladder.directory,
                            [FaultSpec(kind="gpu-lost", node="s00", params={"gpu": 0})], ladder.settings.nats_url)
    await asyncio.to_thread(start_node, ladder.directory, "s00")

    # An expired request first, then a live one: commands are consumed in order, so once the live
    # round's results are in, the expired one was seen - and must have stopped nothing.
    expired = await ladder.publish(DiagnosticsRequested(
        round=0, nodes=NODES, checks=["gpu_matmul", "intra_node_all_to_all", "inter_node_all_gather"], timeout_s=30,
        expires_at=now_utc() - timedelta(seconds=1), reason="test: a stale command"), f"job/{JOB}")
    command = await ladder.publish(DiagnosticsRequested(
        round=1, nodes=NODES, checks=["gpu_matmul", "intra_node_all_to_all", "inter_node_all_gather"], timeout_s=30,
        expires_at=now_utc() + timedelta(minutes=1), reason="test: crash with no culprit"), f"job/{JOB}")
    completed = {}
    for node in NODES:
        completed[node] = await ladder.wait_for(["DiagnosticsCompleted"], lambda e, n=node: e.payload.node_id == n, 45,
                                                f"the diagnostics results of {node}")
    for event in completed.values():
        assert event.correlation_id == command.id and event.causation_id == command.id, event
        p = event.payload
        assert (p.request_id, p.round, p.passed, p.suspects) == (str(command.id), 1, True, []), p
        by_check = {r.check: r for r in p.results}
        assert by_check["inter_node_all_gather"].passed and by_check["inter_node_all_gather"].bandwidth_gbps
        assert by_check["intra_node_all_to_all"].passed
        assert by_check["gpu_matmul"].skipped  # no CUDA here
    assert all(e.payload.round == 1 for e in await ladder.events(["DiagnosticsCompleted"]))
    # Each rank of generation 0 was stopped once, by the agent, for the live round - not the expired one.
    exits = [e for e in await ladder.events(["RankExited"]) if e.payload.generation == 0]
    assert sorted(e.payload.rank for e in exits) == [0, 1], [e.payload for e in exits]
    # A rank whose peer's agent stopped its peer first may fail in the collective before its own agent's
    # stop reaches it: that exit is a real failure (a gloo error), reported as such, and it came after the
    # live command, never after the expired one alone.
    assert all(e.occurred_at >= command.occurred_at for e in exits), [(e.payload, e.occurred_at) for e in exits]
    assert all(e.payload.classification == "stopped_by_agent" or peer_stopped_first(e.payload) for e in exits), [
        e.payload for e in exits]
    assert any(e.payload.classification == "stopped_by_agent" for e in exits), [e.payload for e in exits]
    assert expired.occurred_at < command.occurred_at
    # The agents kept beating while their ranks were stopped (the round runs in the background).
    await ladder.wait_for(["NodeHeartbeat"], lambda e: e.payload.node_id == "n00" and e.payload.ranks_alive == 0
                          and e.payload.ranks_expected == 1, 10, "a heartbeat of n00 with its ranks stopped")

    failed = await ladder.wait_for(["StandbyChecked"], lambda e: not e.payload.passed, 30, "the failed self-check")
    gpu = next(r for r in failed.payload.results if r.check == "gpu_matmul")
    assert not gpu.passed and not gpu.skipped and "gpu0 is lost" in gpu.detail, failed.payload
    assert "gpu_matmul failed" in failed.payload.detail

    # The controller's next command: every node restarts in place; training resumes from memory.
    for node in NODES:
        await ladder.publish(RanksRestartRequested(node_id=node, generation=1, reason="test: diagnostics passed",
                                                   expires_at=now_utc() + timedelta(minutes=1)), f"node/{node}")
    for node in NODES:
        done = await ladder.wait_for(["RanksRestarted"], lambda e, n=node: e.payload.node_id == n, 30,
                                     f"the restart of {node}")
        assert (done.payload.outcome, done.payload.generation) == ("restarted", 1), done.payload
    plan = await ladder.wait_for(["CheckpointRestorePlanned"], lambda e: e.payload.generation == 1, 30, "the restore plan")
    assert plan.payload.step >= 0 and set(plan.payload.tiers) == {"memory"}, plan.payload
    await ladder.wait_training(min_step=plan.payload.step + 3, since=plan.occurred_at)


async def test_a_standby_takes_a_lost_nodes_slice_and_the_job_finishes_from_the_peer_copy(ladder: Ladder) -> None:
    # Paced at 200 ms a step (unpaced, a step takes ~30 ms here: a node lost within a few steps of the
    # first backups could leave no step that both the survivor and the lost rank's backup still hold; and
    # the broker commits a tier from heartbeats at most every 10 s, so the job must outlive a few rounds).
    steps = 150
    ladder.up(steps=steps, min_step_time="200ms")
    await ladder.wait_for(["StandbyChecked"], lambda e: e.payload.passed, 60, "the standby's self-check")
    # Rank 1's backup lives on n00 (with two training nodes, each backs up the other).
    committed = await ladder.wait_for(["CheckpointStepCommitted"], lambda e: e.payload.tier == "peer"
                                      and e.payload.step >= 5, 60, "a step committed in the peer tier")
    assert committed.payload.step < steps - 40, "training ran too far before the node could be lost"
    await asyncio.to_thread(kill_node, ladder.directory, "n01")

    expires = now_utc() + timedelta(minutes=1)
    promote = await ladder.publish(StandbyPromotionRequested(
        node_id="s00", replaces_node_id="n01", node_rank=1, ranks=[1], generation=1,
        reason="test: n01 lost", expires_at=expires), "node/s00")
    await ladder.publish(RanksRestartRequested(node_id="n00", generation=1, reason="test: n01 lost",
                                               expires_at=expires), "node/n00")
    promoted = await ladder.wait_for(["StandbyPromoted"], lambda e: True, 30, "the promotion")
    assert promoted.correlation_id == promote.id
    p = promoted.payload
    assert (p.node_id, p.outcome, p.generation, p.replaces_node_id) == ("s00", "promoted", 1, "n01"), p
    # A second promotion of the same node is refused: it is no standby any more.
    again = await ladder.publish(StandbyPromotionRequested(
        node_id="s00", replaces_node_id="n01", node_rank=1, ranks=[1], generation=2,
        reason="test: a duplicate", expires_at=expires), "node/s00")
    refused = await ladder.wait_for(["StandbyPromoted"], lambda e: e.causation_id == again.id, 10, "the duplicate refused")
    assert (refused.payload.outcome, refused.payload.generation) == ("not_standby", 1), refused.payload
    started = await ladder.wait_for(["RankStarted"], lambda e: e.payload.generation == 1 and e.payload.rank == 1, 10,
                                    "rank 1 started on the standby")
    assert started.payload.node_id == "s00"

    plan = await ladder.wait_for(["CheckpointRestorePlanned"], lambda e: e.payload.generation == 1, 40, "the restore plan")
    parts = [e.payload for e in await ladder.events(["CheckpointNodeRestorePlanned"])]
    tiers = {s.rank: (s.tier, s.node_id) for s in joined_sources(plan.payload, parts)}
    assert tiers[1] == ("peer", "n00"), plan.payload  # the lost rank comes from the copy n00 held
    assert tiers[0][0] in ("memory", "peer"), plan.payload
    assert committed.payload.step <= plan.payload.step < steps - 1

    for rank in (0, 1):
        done = await ladder.wait_for(["RankExited"], lambda e, r=rank: e.payload.generation == 1 and e.payload.rank == r
                                     and e.payload.classification == "success", 90, f"rank {rank} finishing")
        assert done.payload.node_id == ("n00" if rank == 0 else "s00")
    # The standby's rank 1 restored from the fetched peer copy (its agent's plan file), rank 0 from n00's
    # memory at the same step, and the job ran to its last step.
    plan_file = json.loads((ladder.directory / "nodes" / "s00" / "restore" / "g1.json").read_text())
    assert plan_file["step"] == plan.payload.step and set(plan_file["shards"]) == {"1"}, plan_file
    assert plan_file["shards"]["1"]["tier"] == "peer" and "error" not in plan_file["shards"]["1"], plan_file
    log = (ladder.directory / "nodes" / "n00" / "logs" / "rank0.g1.stdout").read_text()
    assert f"restored step {plan.payload.step}" in log and f"done steps {steps}" in log, log[-2000:]


def peer_stopped_first(exited: RankExited) -> bool:
    """The rank failed in a collective because its peer went away (gloo's words for a closed connection)."""
    text = f"{exited.reason}\n{exited.stderr_tail}".lower()
    return exited.classification == "infrastructure" and any(
        words in text for words in ("connection closed by peer", "connection reset by peer", "broken pipe", "gloo"))
