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
from keel.events.types import CodeRef, DiagnosticsRequested, RanksRestartRequested, StandbyPromotionRequested
from keel.infra.code_store import ensure_store, publish, staging_dir
from keel.infra.config import BusSettings
from keel.infra.outbox import Outbox
from keel.rules.code import version_id_of

pytestmark = pytest.mark.integration

SLEEPER = ("-c", "import time; time.sleep(120)")
ALL = ["gpu_matmul", "intra_node_all_to_all", "inter_node_all_gather"]


def make_agent(directory: Path, *, node_id: str = "n00", standby: bool = False, nnodes: int = 1,
               node_rank: int = 0, nproc: int = 1, gpus: int = 1) -> NodeAgent:
    """An agent whose version store is ``directory/versions`` (see ``store_version``)."""
    root = directory / node_id / "root"
    seed_overlay_root(root, gpus=gpus)
    spec = LaunchSpec(nnodes=nnodes, nproc_per_node=nproc, node_rank=node_rank, master_addr="127.0.0.1",
                      master_port=rendezvous_base_port(), command=SLEEPER, job_id="job", node_id=node_id,
                      standby=standby, agent_dir=directory / node_id, root=root,
                      heartbeat_interval=timedelta(hours=1), ckpt_dir=None)
    return NodeAgent(spec, outbox=Outbox("nats://127.0.0.1:1", BusSettings(), name="test"), watcher=None,
                     classify=classify(spec), supervised=True, code_store=directory / "versions")


def store_version(directory: Path, files: dict[str, str], entry: list[str] | None = None) -> CodeRef:
    """Publish ``files`` into ``directory/versions`` as ``keel deploy`` does; the command's reference to it."""
    store = ensure_store(directory / "versions")
    staging = staging_dir(store)
    for name, text in files.items():
        (staging / name).parent.mkdir(parents=True, exist_ok=True)
        (staging / name).write_text(text)
    digest, path = publish(staging, store)
    return CodeRef(version_id=version_id_of(digest), path=str(path), entry=entry or ["train.py"], digest=digest)


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
    env = rank_environ(standby, 2)
    assert b"RANK=2" in env and b"GROUP_RANK=1" in env and b"WORLD_SIZE=6" in env and b"KEEL_GENERATION=3" in env
    assert promote(1, [2, 3], generation=4).payload.outcome == "not_standby"


def exec_argv(pid: int, timeout_s: float = 10.0) -> list[bytes]:
    """The argv ``pid`` runs once its exec is done. A rank just spawned may still be between fork and exec
    (``/proc/PID/cmdline`` shows this test's own) or inside exec (the new image's memory is in place but its
    arguments are not yet: ``cmdline`` reads empty, as a CI run once saw); poll until neither holds."""
    own = (Path("/proc") / str(os.getpid()) / "cmdline").read_bytes()
    deadline = time.monotonic() + timeout_s
    while True:
        argv = (Path("/proc") / str(pid) / "cmdline").read_bytes()
        if (argv and argv != own) or time.monotonic() > deadline:
            return argv.split(b"\0")
        time.sleep(0.01)


def rank_environ(agent: NodeAgent, rank: int) -> list[bytes]:
    exec_argv(agent.supervisor.ranks[rank].pid)  # its exec is done: its environ is the rank's
    return (Path("/proc") / str(agent.supervisor.ranks[rank].pid) / "environ").read_bytes().split(b"\0")


def test_the_ranks_rendezvous_follows_node_rank_0_to_another_host(agents, scratch_dir: Path) -> None:
    """A promotion into node rank 0 on another host moves ``MASTER_ADDR`` to it (the command's
    ``master_addr``), and so does a restart in place of any other node; the node keeps the moved address
    for its later generations, whose commands may say nothing of it ("")."""
    standby = make_agent(scratch_dir, node_id="s00", standby=True, nnodes=2, node_rank=1)
    worker = make_agent(scratch_dir, node_id="n01", nnodes=2, node_rank=1)
    agents.extend([standby, worker])
    expires = now_utc() + timedelta(seconds=60)
    standby.handle_command(command(StandbyPromotionRequested(
        node_id="s00", replaces_node_id="n00", node_rank=0, ranks=[0], generation=1, reason="test",
        expires_at=expires, master_addr="127.0.0.2"), "node/s00"))
    assert emitted(standby, "StandbyPromoted")[-1].payload.outcome == "promoted"
    assert standby.spec.master_addr == "127.0.0.2" and b"MASTER_ADDR=127.0.0.2" in rank_environ(standby, 0)

    for generation, master_addr in ((1, "127.0.0.2"), (2, "")):
        worker.handle_command(command(RanksRestartRequested(node_id="n01", generation=generation, reason="test",
                                                            expires_at=expires, master_addr=master_addr), "node/n01"))
        assert emitted(worker, "RanksRestarted")[-1].payload.outcome == "restarted"
        assert b"MASTER_ADDR=127.0.0.2" in rank_environ(worker, 1), generation
        assert f"KEEL_GENERATION={generation}".encode() in rank_environ(worker, 1)


def test_a_restart_or_a_promotion_carrying_a_code_version_runs_it_in_place(agents, scratch_dir: Path) -> None:
    import dataclasses

    launch = scratch_dir / "launch.py"
    launch.write_text("import time; time.sleep(120)\n")
    v1 = store_version(scratch_dir, {"train.py": "import time; time.sleep(120)\n"})
    version = Path(v1.path)
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

    # A version this node's store does not hold: refused before anything stops.
    gone = v1.model_copy(update={"digest": "sha256:" + "0" * 64, "version_id": "v-000000000000",
                                 "path": str(scratch_dir / "versions" / ("0" * 64))})
    missing = restart(1, gone)
    assert missing.payload.outcome == "failed" and "not in this node's store" in missing.payload.detail
    assert sorted(p.pid for p in agent.supervisor.alive()) == pids and agent.generation == 0
    # A version it holds: the ranks restart on it, in its directory, with the launch's arguments.
    assert restart(1, v1).payload.outcome == "restarted"
    [applied] = emitted(agent, "CodeVersionApplied")
    assert (applied.payload.version_id, applied.payload.generation, applied.payload.warm) == (v1.version_id, 1, False)
    for process in agent.supervisor.alive():  # no zygote here: fresh interpreters, argv visible
        proc = Path("/proc") / str(process.pid)
        assert Path(os.readlink(proc / "cwd")) == version
        assert exec_argv(process.pid)[1:5] == [b"-u", str(version / "train.py").encode(), b"--lr", b"1"]
        env = (proc / "environ").read_bytes().split(b"\0")
        assert f"KEEL_CODE_VERSION={v1.version_id}".encode() in env and f"KEEL_CODE_DIR={version}".encode() in env
        assert b"PYTHONDONTWRITEBYTECODE=1" in env  # nothing written into the read-only store
    assert "--lr 1" in applied.payload.detail and str(version / "train.py") in applied.payload.detail
    # Back to the launch command (a rollback to `launch`): no version directory any more.
    assert restart(2, CodeRef(version_id="launch")).payload.outcome == "restarted"
    [back] = [e for e in emitted(agent, "CodeVersionApplied") if e.payload.generation == 2]
    assert back.payload.version_id == "launch" and back.payload.path == ""
    for process in agent.supervisor.alive():
        exec_argv(process.pid)  # its exec is done: its environ is the new one
        env = (Path("/proc") / str(process.pid) / "environ").read_bytes().split(b"\0")
        assert b"KEEL_CODE_VERSION=launch" in env and not any(e.startswith(b"KEEL_CODE_DIR=") for e in env)

    # A promoted standby runs the version its command names, like the nodes restarted in place.
    standby = make_agent(scratch_dir, node_id="s00", standby=True, nnodes=2, node_rank=1, nproc=2, gpus=2)
    standby.spec = standby.supervisor.spec = dataclasses.replace(standby.spec, command=(str(launch),))
    agents.append(standby)
    standby.handle_command(command(StandbyPromotionRequested(
        node_id="s00", replaces_node_id="n01", node_rank=1, ranks=[2, 3], generation=3, reason="test",
        code=v1,
        expires_at=now_utc() + timedelta(minutes=1)), "node/s00"))
    assert emitted(standby, "StandbyPromoted")[-1].payload.outcome == "promoted"
    [promoted] = emitted(standby, "CodeVersionApplied")
    assert (promoted.payload.node_id, promoted.payload.version_id, promoted.payload.generation) == ("s00", v1.version_id, 3)
    assert {Path(os.readlink(Path("/proc") / str(p.pid) / "cwd")) for p in standby.supervisor.alive()} == {version}


def test_a_restart_naming_code_outside_the_store_or_a_tampered_version_is_refused_before_any_rank_stops(
        agents, scratch_dir: Path) -> None:
    """The agent runs only a version of its store, in the folder named by the digest, re-hashed; every other
    command is refused with the reason (``RanksRestarted`` failed) and the running ranks keep running."""
    from keel.infra.code_store import tree_digest

    train = "import time; time.sleep(120)\n"
    good = store_version(scratch_dir, {"train.py": train, "pkg/__init__.py": "", "pkg/run.py": train})
    store = Path(good.path).parent
    agent = make_agent(scratch_dir)
    agents.append(agent)
    agent.start_ranks(0)
    pids = sorted(p.pid for p in agent.supervisor.alive())
    generation = 0

    def restart(code: CodeRef) -> str:
        nonlocal generation
        generation += 1
        agent.handle_command(command(RanksRestartRequested(node_id="n00", generation=generation, reason="test",
                                                           code=code, expires_at=now_utc() + timedelta(minutes=1)),
                                     "node/n00"))
        answer = emitted(agent, "RanksRestarted")[-1].payload
        return answer.detail if answer.outcome == "failed" else answer.outcome

    def refused(code: CodeRef, reason: str) -> None:
        detail = restart(code)
        assert reason in detail and detail.endswith("the ranks keep running"), detail
        assert sorted(p.pid for p in agent.supervisor.alive()) == pids and agent.generation == 0  # nothing stopped

    # A folder outside the store, even one whose digest and id are right.
    evil = scratch_dir / "evil"
    evil.mkdir()
    (evil / "train.py").write_text("import os; os.system('touch /tmp/pwned')\n")
    evil_digest = tree_digest(evil)
    forged = CodeRef(version_id=version_id_of(evil_digest), path=str(evil), entry=["train.py"], digest=evil_digest)
    refused(forged, "is not a version store directory named by the digest")
    named = scratch_dir / "elsewhere" / evil_digest[7:]
    named.parent.mkdir()
    evil.rename(named)
    evil = named
    refused(forged.model_copy(update={"path": str(named)}),
            f"is not {store / evil_digest[7:]}: a node runs only a version of its store")
    # The same folder linked into the store under its digest: a link is no stored version.
    (store / evil_digest[7:]).symlink_to(evil)
    refused(forged.model_copy(update={"path": str(store / evil_digest[7:])}), "not a version folder")
    # Entry points that leave the version, an id that is not the digest's, a malformed digest.
    for entry, reason in ((["/tmp/x.py"], "one relative path to a *.py file"), (["../evil/train.py"], "no '..'"),
                          (["-m", "os"], "-m os is not a module of the version"),
                          (["-m", "pkg.run;rm"], "one dotted module name"), (["run.sh"], "*.py"),
                          (["missing.py"], "missing.py is not a file in the version")):
        refused(good.model_copy(update={"entry": entry}), reason)
    refused(good.model_copy(update={"version_id": "v-stable"}), "is not " + good.version_id)
    refused(good.model_copy(update={"digest": "sha256:../../etc"}), "64 lowercase hex digits")

    # The good version runs, hashed once; restarting onto it again costs no second hash.
    # (It was verified by the refusals of its entry points above: the tree was fine, the entry was not.)
    assert restart(good) == "restarted" and agent.code_versions is not None
    checked = agent.code_versions.hashed
    pids, generation_ran = sorted(p.pid for p in agent.supervisor.alive()), agent.generation
    assert restart(good) == "restarted" and agent.code_versions.hashed == checked
    pids, generation_ran = sorted(p.pid for p in agent.supervisor.alive()), agent.generation

    def refused_now(code: CodeRef, reason: str) -> None:
        detail = restart(code)
        assert reason in detail, detail
        assert sorted(p.pid for p in agent.supervisor.alive()) == pids and agent.generation == generation_ran

    # Tampered after it was verified (the owner made it writable, changed it, made it read-only again):
    # the changed mtime makes the agent hash it again, and the digest no longer matches.
    script = Path(good.path) / "train.py"
    script.chmod(0o644)
    refused_now(good, "has mode 0644: stored versions are read-only")
    script.write_text("import os; os.system('touch /tmp/pwned')\n")
    script.chmod(0o444)
    refused_now(good, "not to its digest")
    script.chmod(0o644)
    script.write_text(train)
    script.chmod(0o444)
    assert restart(good) == "restarted"
    pids, generation_ran = sorted(p.pid for p in agent.supervisor.alive()), agent.generation
    # Bytecode the digest leaves out, which Python would load instead of the source; a link inside.
    folder = Path(good.path)
    folder.chmod(0o755)
    (folder / "__pycache__").mkdir(mode=0o555)
    folder.chmod(0o555)
    refused_now(good, "__pycache__ is not part of the version")
    folder.chmod(0o755)
    (folder / "__pycache__").rmdir()
    (folder / "data").symlink_to("/etc/passwd")
    folder.chmod(0o555)
    refused_now(good, "data is a symbolic link")
    assert agent.code_versions.hashed == checked + 5  # every change above was noticed: checked again
