"""The node agent's handling of the ladder's commands, one agent at a time: real rank processes, real
diagnostics rounds (single-node, so no peer is needed), no NATS. The agent's outbox is a real ``Outbox``
that never connects: what the agent emitted waits in ``outbox.pending``, in order."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from keel.agent.agent import NodeAgent
from keel.agent.inspector_adapter import classify
from keel.agent.launch_spec import LaunchSpec
from keel.cluster.local import FaultSpec, NodeInfo, apply_fault, rendezvous_base_port, seed_overlay_root
from keel.events.envelope import Event, EventPayload, now_utc
from keel.events.types import DiagnosticsRequested, RanksRestartRequested, StandbyPromotionRequested
from keel.infra.config import BusSettings
from keel.infra.outbox import Outbox

pytestmark = pytest.mark.integration

SLEEPER = ("-c", "import time; time.sleep(120)")
ALL = ["gpu_matmul", "intra_node_all_to_all", "inter_node_all_gather"]


def make_agent(directory: Path, *, node_id: str = "n00", standby: bool = False, nnodes: int = 1,
               node_rank: int = 0, nproc: int = 1, gpus: int = 1) -> NodeAgent:
    root = directory / node_id / "root"
    seed_overlay_root(root, gpus=gpus)
    spec = LaunchSpec(nnodes=nnodes, nproc_per_node=nproc, node_rank=node_rank, master_addr="127.0.0.1",
                      master_port=rendezvous_base_port(), command=SLEEPER, job_id="job", node_id=node_id,
                      standby=standby, agent_dir=directory / node_id, root=root,
                      heartbeat_interval=timedelta(hours=1), ckpt_dir=None)
    return NodeAgent(spec, outbox=Outbox("nats://127.0.0.1:1", BusSettings(), name="test"), watcher=None,
                     classify=classify(spec), supervised=True)


@pytest.fixture
def agents(scratch_dir: Path) -> Iterator[list[NodeAgent]]:
    made: list[NodeAgent] = []
    yield made
    for agent in made:
        agent.rounds.cancel()
        agent.supervisor.stop_all(grace_s=1)
        agent.channel.close()


def command(payload: EventPayload, subject: str) -> Event:
    return Event.create(payload, job_id="job", subject=subject, producer="controller", occurred_at=now_utc())


def emitted(agent: NodeAgent, type_: str) -> list[Event]:
    assert agent.outbox is not None
    return [e for e in agent.outbox.pending if e.type == type_]


def tick_until(agent: NodeAgent, type_: str, timeout_s: float) -> Event:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert agent.tick(probe=False) is None, "the agent wanted to stop"
        if found := emitted(agent, type_):
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no {type_} within {timeout_s}s")


def diagnostics(nodes: list[str], *, round_: int = 0, expires_in_s: float = 60, timeout_s: float = 30) -> Event:
    return command(DiagnosticsRequested(round=round_, nodes=nodes, checks=ALL, timeout_s=timeout_s,
                                        expires_at=now_utc() + timedelta(seconds=expires_in_s), reason="test"),
                   "job/job")


def test_a_round_stops_the_ranks_reports_in_the_background_and_a_restart_follows(agents, scratch_dir: Path) -> None:
    agent = make_agent(scratch_dir, nproc=2, gpus=2)
    agents.append(agent)
    agent.start_ranks(0)
    pids = [p.pid for p in agent.supervisor.alive()]
    assert len(pids) == 2

    for ignored in (diagnostics(["n01", "n02"]), diagnostics(["n00"], round_=1, expires_in_s=-1)):
        agent.handle_command(ignored)  # not this node / expired: nothing stops
        assert agent.rounds.active is None and [p.pid for p in agent.supervisor.alive()] == pids

    request = diagnostics(["n00"], round_=2)
    agent.handle_command(request)
    assert agent.rounds.active is not None and not agent.supervisor.ranks  # stopped at once, round in the background
    stopped = emitted(agent, "RankExited")
    assert sorted(e.payload.rank for e in stopped) == [0, 1]
    assert {e.payload.classification for e in stopped} == {"stopped_by_agent"}
    done = tick_until(agent, "DiagnosticsCompleted", 30)  # the loop keeps ticking (and would beat) meanwhile
    assert (done.causation_id, done.correlation_id) == (request.id, request.id)
    p = done.payload
    assert (p.node_id, p.request_id, p.round, p.passed) == ("n00", str(request.id), 2, True), p
    assert [r.check for r in p.results] == ALL
    # A redelivered command does not run the round again; the agent waits (ranks stopped) for the next one.
    agent.handle_command(request)
    assert agent.rounds.active is None
    for _ in range(5):
        assert agent.tick(probe=False) is None

    agent.handle_command(command(RanksRestartRequested(node_id="n00", generation=1, reason="test",
                                                       expires_at=now_utc() + timedelta(minutes=1)), "node/n00"))
    assert emitted(agent, "RanksRestarted")[-1].payload.outcome == "restarted"
    assert len(agent.supervisor.alive()) == 2 and agent.generation == 1


def test_a_standby_self_checks_ignores_rounds_and_fails_the_check_on_a_lost_gpu(agents, scratch_dir: Path) -> None:
    healthy = make_agent(scratch_dir, node_id="s00", standby=True, nproc=2, gpus=2)
    broken = make_agent(scratch_dir, node_id="s01", standby=True, nproc=2, gpus=2)
    agents += [healthy, broken]
    apply_fault(NodeInfo("s01", True, broken.spec.agent_dir, broken.spec.root, 0),
                FaultSpec(kind="gpu-lost", node="s01", params={"gpu": 1}), "f1")
    healthy.rounds.start_self_check()
    broken.rounds.start_self_check()
    good = tick_until(healthy, "StandbyChecked", 40)
    bad = tick_until(broken, "StandbyChecked", 40)
    assert good.payload.passed and good.causation_id is None, good.payload
    assert [r.check for r in good.payload.results] == ["gpu_matmul", "intra_node_all_to_all"]
    assert not bad.payload.passed and "gpu1 is lost" in bad.payload.detail, bad.payload

    healthy.handle_command(diagnostics(["s00", "n00"]))
    assert healthy.rounds.active is None and not emitted(healthy, "RankExited")


def test_promotion_takes_the_slice_and_refuses_what_it_cannot_do(agents, scratch_dir: Path) -> None:
    standby = make_agent(scratch_dir, node_id="s00", standby=True, nnodes=3, node_rank=2, nproc=2, gpus=2)
    agents.append(standby)

    def promote(node_rank: int, ranks: list[int], expires_in_s: float = 60, generation: int = 3) -> Event:
        cmd = command(StandbyPromotionRequested(node_id="s00", replaces_node_id="n01", node_rank=node_rank,
                                                ranks=ranks, generation=generation, reason="test",
                                                expires_at=now_utc() + timedelta(seconds=expires_in_s)), "node/s00")
        standby.handle_command(cmd)
        result = emitted(standby, "StandbyPromoted")[-1]
        assert result.causation_id == cmd.id and result.payload.command_id == str(cmd.id)
        return result

    assert promote(1, [2, 3], expires_in_s=-1).payload.outcome == "expired"
    failed = promote(1, [2])
    assert failed.payload.outcome == "failed" and "not node rank 1's slice [2, 3]" in failed.payload.detail
    assert standby.spec.standby and not standby.supervisor.ranks

    promoted = promote(1, [2, 3])
    assert (promoted.payload.outcome, promoted.payload.generation, promoted.payload.replaces_node_id) == (
        "promoted", 3, "n01")
    assert not standby.spec.standby and standby.spec.node_rank == 1 and standby.generation == 3
    started = emitted(standby, "RankStarted")
    assert sorted(e.payload.rank for e in started) == [2, 3] and {e.payload.generation for e in started} == {3}
    env = (Path("/proc") / str(standby.supervisor.ranks[2].pid) / "environ").read_bytes().split(b"\0")
    assert b"RANK=2" in env and b"NODE_RANK=1" in env and b"WORLD_SIZE=6" in env and b"KEEL_GENERATION=3" in env
    assert promote(1, [2, 3], generation=4).payload.outcome == "not_standby"


def test_a_restart_or_a_promotion_carrying_a_code_version_runs_it_in_place(agents, scratch_dir: Path) -> None:
    import dataclasses

    from keel.events.types import CodeRef

    launch = scratch_dir / "launch.py"
    launch.write_text("import time; time.sleep(120)\n")
    version = scratch_dir / "versions" / "v1"
    version.mkdir(parents=True)
    (version / "train.py").write_text("import time; time.sleep(120)\n")
    agent = make_agent(scratch_dir, nproc=2, gpus=2)
    agent.spec = agent.supervisor.spec = dataclasses.replace(agent.spec, command=(str(launch), "--lr", "1"))
    agents.append(agent)
    agent.start_ranks(0)
    pids = sorted(p.pid for p in agent.supervisor.alive())
    assert not emitted(agent, "CodeVersionApplied")  # the launch command: no version named

    def restart(generation: int, code: CodeRef) -> Event:
        agent.handle_command(command(RanksRestartRequested(node_id="n00", generation=generation, reason="test", code=code,
                                                           expires_at=now_utc() + timedelta(minutes=1)), "node/n00"))
        return emitted(agent, "RanksRestarted")[-1]

    # A version this node cannot see: refused before anything stops.
    missing = restart(1, CodeRef(version_id="v-gone", path=str(scratch_dir / "versions" / "gone"), entry=["train.py"]))
    assert missing.payload.outcome == "failed" and "is not a directory" in missing.payload.detail
    assert sorted(p.pid for p in agent.supervisor.alive()) == pids and agent.generation == 0
    # A version it sees: the ranks restart on it, in its directory, with the launch's arguments.
    assert restart(1, CodeRef(version_id="v1", path=str(version), entry=["train.py"])).payload.outcome == "restarted"
    [applied] = emitted(agent, "CodeVersionApplied")
    assert (applied.payload.version_id, applied.payload.generation, applied.payload.warm) == ("v1", 1, False)
    for process in agent.supervisor.alive():  # no zygote here: fresh interpreters, argv visible
        proc = Path("/proc") / str(process.pid)
        assert Path(os.readlink(proc / "cwd")) == version
        assert (proc / "cmdline").read_bytes().split(b"\0")[1:4] == [str(version / "train.py").encode(), b"--lr", b"1"]
        env = (proc / "environ").read_bytes().split(b"\0")
        assert b"KEEL_CODE_VERSION=v1" in env and f"KEEL_CODE_DIR={version}".encode() in env
    assert "--lr 1" in applied.payload.detail and str(version / "train.py") in applied.payload.detail
    # Back to the launch command (a rollback to `launch`): no version directory any more.
    assert restart(2, CodeRef(version_id="launch")).payload.outcome == "restarted"
    [back] = [e for e in emitted(agent, "CodeVersionApplied") if e.payload.generation == 2]
    assert back.payload.version_id == "launch" and back.payload.path == ""
    for process in agent.supervisor.alive():
        env = (Path("/proc") / str(process.pid) / "environ").read_bytes().split(b"\0")
        assert b"KEEL_CODE_VERSION=launch" in env and not any(e.startswith(b"KEEL_CODE_DIR=") for e in env)

    # A promoted standby runs the version its command names, like the nodes restarted in place.
    standby = make_agent(scratch_dir, node_id="s00", standby=True, nnodes=2, node_rank=1, nproc=2, gpus=2)
    standby.spec = standby.supervisor.spec = dataclasses.replace(standby.spec, command=(str(launch),))
    agents.append(standby)
    standby.handle_command(command(StandbyPromotionRequested(
        node_id="s00", replaces_node_id="n01", node_rank=1, ranks=[2, 3], generation=3, reason="test",
        code=CodeRef(version_id="v1", path=str(version), entry=["train.py"]),
        expires_at=now_utc() + timedelta(minutes=1)), "node/s00"))
    assert emitted(standby, "StandbyPromoted")[-1].payload.outcome == "promoted"
    [promoted] = emitted(standby, "CodeVersionApplied")
    assert (promoted.payload.node_id, promoted.payload.version_id, promoted.payload.generation) == ("s00", "v1", 3)
    assert {Path(os.readlink(Path("/proc") / str(p.pid) / "cwd")) for p in standby.supervisor.alive()} == {version}
