"""An agent SIGKILLed and restarted under a running job rejoins it with its memory tier: real NATS,
PostgreSQL, recorder, controller and checkpoint broker, a local cluster of two node agents training the
example GPT. The restarted agent (same node id, same agent folder, same command line) stops the ranks its
predecessor left behind, keeps the node's shared-memory slots and reports the ranks as ended; the
controller restarts the job and the broker plans its restore from the memory tier, this node's included:
training resumes from a step held in memory (not from disk, not from step 0) and no rank process of the
dead agent is left running."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from keel.agent.rejoin import AgentDirBusy, AgentLock, process_start, processes_of_socket, read_state
from keel.cluster.local import alive, cluster_down, cluster_up, load_cluster, ranks_of, spawn_agent
from keel.events.envelope import Event
from tests.integration.test_crashes import service_env, start_service_process

pytestmark = pytest.mark.integration

JOB = "rejoin"
TRAIN = ["-m", "keel.workload.train", "--size", "tiny", "--steps", "1000000"]


def stop_process(process: subprocess.Popen, timeout_s: float = 15) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


class Job:
    def __init__(self, keel_env, scratch: Path) -> None:  # type: ignore[no-untyped-def]
        self.env, self.scratch = keel_env, scratch
        self.settings = keel_env.settings
        self.directory = scratch / "cluster"
        self.services: list[subprocess.Popen] = []

    def start(self) -> None:
        knobs = {"KEEL_CONTROLLER__DIAGNOSTICS_TIMEOUT": "60s", "KEEL_CONTROLLER__NODE_SILENCE_TIMEOUT": "60s",
                 "KEEL_INSPECTOR__STEP_TIMEOUT_FLOOR": "60s",
                 "KEEL_CHECKPOINT__PERSIST_ROOT": str(self.scratch / "checkpoints"),
                 # The persistent tier far behind: a restore from memory is not a restore from disk.
                 "KEEL_CHECKPOINT__PERSIST_EVERY_FLOOR": "100000", "KEEL_CHECKPOINT__PERSIST_EVERY_CEILING": "100000"}
        ready = []
        for name in ("controller", "checkpoint-broker"):
            ready.append(self.scratch / f"{name}.ready")
            self.services.append(start_service_process(name, self.settings, self.scratch / f"{name}.log",
                                                       {**knobs, "KEEL_SERVICE_READY_FILE": str(ready[-1])}))
        deadline = time.monotonic() + 60
        while not all(path.exists() for path in ready):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.services):
                raise AssertionError(f"services not ready: {[p.name for p in ready if not p.exists()]}")
            time.sleep(0.1)
        env = {k: v for k, v in service_env(self.settings).items() if k.startswith("KEEL_")} | knobs
        cluster_up(self.settings, self.directory, nodes=2, standby=0, nproc_per_node=1, job_id=JOB, command=TRAIN,
                   nats_url=self.settings.nats_url, extra_env=env, heartbeat_interval="1s",
                   persist_root=self.scratch / "checkpoints")

    def stop(self) -> None:
        cluster_down(self.directory)
        for process in self.services:
            if process.poll() is None:
                stop_process(process)

    def node(self, node_id: str) -> dict:  # type: ignore[type-arg]
        return next(n for n in load_cluster(self.directory)["nodes"] if n["node_id"] == node_id)

    def restart_agent(self, node_id: str) -> int:
        """Start the node's agent again exactly as it was started (same id, folder and command line)."""
        state = load_cluster(self.directory)
        node = next(n for n in state["nodes"] if n["node_id"] == node_id)
        process = spawn_agent(list(node["argv"]), dict(os.environ, **state["env"]), Path(node["agent_dir"]))
        node["pid"] = process.pid
        (self.directory / "cluster.json").write_text(json.dumps(state, indent=2))  # cluster_down stops it
        return process.pid

    async def events(self, types: list[str]) -> list[Event]:
        return [r.event async for r in self.env.store.read(job_id=JOB, types=types)]

    async def wait_for(self, types: list[str], predicate, timeout_s: float, what: str) -> Event:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in await self.events(types):
                if predicate(event):
                    return event
            await asyncio.sleep(0.2)
        seen = [(e.type, e.payload.model_dump()) for e in await self.events(types)][-8:]
        recent = [(e.type, getattr(e.payload, "node_id", ""), getattr(e.payload, "reason", "")[:200])
                  for e in [r.event async for r in self.env.store.read(job_id=JOB)]
                  if e.type not in ("NodeHeartbeat", "CheckpointShardsStored", "TimerTicked")][-30:]
        raise AssertionError(f"no {what} within {timeout_s}s; last events of those types: {seen}; "
                             f"the latest events: {recent}")


@pytest.fixture
async def job(keel_env, scratch_dir):  # type: ignore[no-untyped-def]
    await keel_env.start_recorder()
    running = Job(keel_env, scratch_dir)
    try:
        yield running
    finally:
        await asyncio.to_thread(running.stop)


async def test_an_agent_killed_and_restarted_under_a_running_job_resumes_it_from_its_memory_tier(job: Job) -> None:
    await asyncio.to_thread(job.start)
    victim = job.node("n01")
    agent_dir = Path(victim["agent_dir"])
    # Both nodes train and n01's memory tier holds a few steps.
    for node in ("n00", "n01"):
        await job.wait_for(["NodeHeartbeat"], lambda e, n=node: e.payload.node_id == n and e.payload.last_step >= 5,
                           180, f"{node} stepping")
    # What a node holds in memory and on behalf of peers rides on its heartbeats (``NodeHeartbeat.stored``).
    held = await job.wait_for(["NodeHeartbeat"], lambda e: e.payload.node_id == "n01"
                              and max((s.step for s in e.payload.stored.get("memory", [])), default=-1) >= 5, 60,
                              "n01's memory tier past step 5")
    in_memory_before = max(s.step for s in held.payload.stored["memory"])
    # n01 holds rank 0's backup for n00 (the peer tier): the restart must not lose that either.
    await job.wait_for(["NodeHeartbeat"], lambda e: e.payload.node_id == "n01"
                       and any(s.rank == 0 for s in e.payload.stored.get("peer", [])), 60,
                       "n01 holding rank 0's backup")
    recorded = read_state(agent_dir)
    assert recorded is not None and recorded.generation == 0 and list(recorded.ranks) == [1], recorded
    old_ranks = ranks_of(agent_dir)
    old_all = processes_of_socket(agent_dir / "agent.sock")  # ranks and zygote
    assert [r.pid for r in recorded.ranks.values()] == old_ranks and old_ranks, (recorded, old_ranks)
    slots = sorted(p.name for p in Path(victim["ckpt_dir"]).glob("rank1.slot*"))
    assert slots, "no memory-tier slot on n01"

    # The agent alone is SIGKILLed: its rank and zygote run on, orphaned; its state file stays.
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while alive(victim["pid"]) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not alive(victim["pid"])
    assert all(process_start(pid) is not None for pid in old_ranks), "the ranks died with their agent"
    killed_at = time.monotonic()

    new_pid = await asyncio.to_thread(job.restart_agent, "n01")
    ended = await job.wait_for(["RankExited"], lambda e: e.payload.node_id == "n01"
                               and e.payload.error_type == "AgentRestarted", 60, "the rejoin's report of the old rank")
    assert (ended.payload.rank, ended.payload.pid, ended.payload.generation) == (1, old_ranks[0], 0)
    assert ended.payload.classification == "infrastructure"
    # Nothing of the dead agent runs any more: its rank and its zygote were stopped by the new agent.
    assert all(process_start(pid) is None for pid in old_all), [p for p in old_all if process_start(p) is not None]
    # Its memory tier was kept (a new launch would have removed every slot).
    assert sorted(p.name for p in Path(victim["ckpt_dir"]).glob("rank1.slot*")) == slots

    # The controller restarts the job (after its diagnostics round); the broker plans the restore from
    # memory, n01's rank from n01's own slots, at a step at least as new as the one held before the kill.
    plan = await job.wait_for(["CheckpointRestorePlanned"], lambda e: e.payload.generation >= 1, 180,
                              "the restore plan of the restarted job")
    generation = plan.payload.generation
    # The plan's sources travel per node (CheckpointNodeRestorePlanned parts) beside the job-wide summary.
    from keel.checkpoint_broker.restore import joined_sources

    parts = [e.payload for e in await job.events(["CheckpointNodeRestorePlanned"])]
    sources = {s.rank: s for s in joined_sources(plan.payload, parts)}
    assert (sources[1].tier, sources[1].node_id) == ("memory", "n01"), plan.payload
    assert {s.tier for s in sources.values()} == {"memory"}, plan.payload
    assert plan.payload.step >= in_memory_before > 0, (plan.payload.step, in_memory_before)
    inventory = await job.wait_for(["CheckpointInventoryReported"], lambda e: e.payload.node_id == "n01"
                                   and e.payload.generation == generation, 10, "n01's inventory")
    assert any(x.tier == "memory" and x.rank == 1 and x.step == plan.payload.step for x in inventory.payload.entries)
    assert any(x.tier == "peer" and x.rank == 0 for x in inventory.payload.entries), inventory.payload.entries
    restarted = await job.wait_for(["RanksRestarted"], lambda e: e.payload.node_id == "n01"
                                   and e.payload.generation == generation, 30, "n01's restart")
    assert restarted.payload.outcome == "restarted", restarted.payload
    started = await job.wait_for(["RankStarted"], lambda e: e.payload.node_id == "n01"
                                 and e.payload.generation == generation, 30, "n01's new rank")

    # Training resumes past the restored step on both nodes, and the incident is resolved.
    for node in ("n00", "n01"):
        await job.wait_for(["NodeHeartbeat"], lambda e, n=node: e.payload.node_id == n
                           and e.occurred_at > started.occurred_at and e.payload.last_step > plan.payload.step,
                           120, f"{node} stepping past the restored step {plan.payload.step}")
    resumed_s = time.monotonic() - killed_at
    resolved = await job.wait_for(["IncidentResolved"], lambda e: True, 60, "the incident resolved")
    assert resolved.payload.outcome == "recovered", resolved.payload
    # No orphan: the node's processes are the new agent's rank (and zygote), nothing else.
    assert ranks_of(agent_dir) == [started.payload.pid], (ranks_of(agent_dir), started.payload.pid)
    assert alive(new_pid)
    print(f"rejoin: killed at step >= {in_memory_before}, restored step {plan.payload.step} from memory, "
          f"generation {generation}, training past it {resumed_s:.1f} s after the kill")


_STEP_LINE = re.compile(r"^step (\d+) loss ", re.M)


def steps_in(path: Path) -> list[int]:
    try:
        return [int(step) for step in _STEP_LINE.findall(path.read_text())]
    except OSError:
        return []


def test_an_unsupervised_agent_killed_and_run_again_resumes_from_its_memory_tier(scratch_dir: Path) -> None:
    """Plain ``keel run`` (no NATS, no controller): run again after its agent was SIGKILLed, it stops the
    orphaned rank and restarts it from the node's memory tier (a local plan), not from step 0."""
    agent_dir = scratch_dir / "agent"
    ckpt_dir = Path("/dev/shm") / f"keel-test-{uuid.uuid4().hex[:10]}"
    argv = [sys.executable, "-m", "keel.cli.main", "run", "--standalone", "--nproc-per-node", "1",
            "--keel-job-id", "solo", "--keel-agent-dir", str(agent_dir),
            "--keel-ckpt-dir", str(ckpt_dir), *TRAIN]
    env = {k: v for k, v in os.environ.items() if k != "KEEL_NATS_URL"} | {"KEEL_HOME": str(scratch_dir / "home")}
    agent_dir.mkdir(parents=True)
    first = spawn_agent(argv, env, agent_dir)
    second = None
    try:
        stdout0 = agent_dir / "logs" / "rank0.g0.stdout"
        deadline = time.monotonic() + 180
        while max(steps_in(stdout0), default=-1) < 10:
            assert time.monotonic() < deadline and first.poll() is None, (first.poll(), steps_in(stdout0)[-3:])
            time.sleep(0.1)
        old = processes_of_socket(agent_dir / "agent.sock")
        assert old, "no rank or zygote found"
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert all(process_start(pid) is not None for pid in old), "the rank died with its agent"
        killed_at_step = max(steps_in(stdout0))

        second = spawn_agent(argv, env, agent_dir)
        stdout1 = agent_dir / "logs" / "rank0.g1.stdout"
        deadline = time.monotonic() + 180
        while len(steps_in(stdout1)) < 3:
            assert time.monotonic() < deadline and second.poll() is None, (second.poll(), (agent_dir / "agent.log")
                                                                           .read_text()[-3000:])
            time.sleep(0.1)
        assert all(process_start(pid) is None for pid in old), "a process of the dead agent is still running"
        plan = json.loads((agent_dir / "restore" / "g1.json").read_text())
        assert plan["step"] >= 10 and plan["shards"]["0"]["tier"] == "memory", plan
        # The rank resumed after the restored step (not at step 0), a step at most one slot behind the last
        # one the old rank printed before its agent was killed, or newer.
        assert steps_in(stdout1)[0] == plan["step"] + 1 and plan["step"] >= killed_at_step - 2, (
            steps_in(stdout1)[:3], plan["step"], killed_at_step)
        new = processes_of_socket(agent_dir / "agent.sock")
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 143
        # Stopped on purpose: its ranks stopped with it, and no state left (the next run is a new launch).
        assert all(process_start(pid) is None for pid in new) and processes_of_socket(agent_dir / "agent.sock") == []
        assert read_state(agent_dir) is None
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)
        for pid in processes_of_socket(agent_dir / "agent.sock"):
            os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(ckpt_dir, ignore_errors=True)


def test_one_agent_per_folder_a_second_is_refused_and_the_lock_goes_with_its_holder(scratch_dir: Path) -> None:
    agent_dir = scratch_dir / "agent"
    first = AgentLock(agent_dir)
    with pytest.raises(AgentDirBusy, match=f"another agent \\(pid {os.getpid()}\\) is running in {agent_dir}"):
        AgentLock(agent_dir)
    first.release()
    AgentLock(agent_dir).release()
    # A holder that dies however it dies (here SIGKILL) leaves the folder free.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from keel.agent.rejoin import AgentLock; AgentLock(Path(sys.argv[1])); "
                               "print('locked', flush=True); time.sleep(60)", str(agent_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(AgentDirBusy, match=f"pid {holder.pid}"):
            AgentLock(agent_dir)
    finally:
        holder.kill()
        holder.wait(10)
    AgentLock(agent_dir).release()
